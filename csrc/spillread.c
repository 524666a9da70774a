/* spillread.c: batched Bloom tests and page accounting of spilled batches' reads (spillread.h). */
#include "spillread.h"

size_t dbsp_bloom_probe(const uint64_t *words, size_t nwords, int k, const uint64_t *hashes, size_t m,
                        uint8_t *out) {
    int bits = 0;
    while (((size_t)1 << bits) < nwords) bits++;
    size_t c = 0;
    /* each probe reads a random word of a filter of up to some MiB: a cache (and TLB) miss a hash, one after the
     * other when not fetched ahead; the words of the hashes AHEAD on are asked for first, so that the misses overlap */
    enum { AHEAD = 16 };
    for (size_t i = 0; i < m && i < AHEAD; i++)
        __builtin_prefetch(&words[bits ? (size_t)(hashes[i] >> (64 - bits)) : 0]);
    for (size_t i = 0; i < m; i++) {
        if (i + AHEAD < m)
            __builtin_prefetch(&words[bits ? (size_t)(hashes[i + AHEAD] >> (64 - bits)) : 0]);
        uint64_t h = hashes[i], mask = 0;
        for (int j = 0; j < k; j++) mask |= (uint64_t)1 << ((h >> (6 * j)) & 63);
        uint64_t w = words[bits ? (size_t)(h >> (64 - bits)) : 0];
        uint8_t hit = (w & mask) == mask;
        out[i] = hit;
        c += hit;
    }
    return c;
}

/* first index j in [0, n) with f[j] >= h (right: > h); n if none */
static inline int64_t lower(const uint64_t *f, int64_t n, uint64_t h, int right) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (right ? f[mid] <= h : f[mid] < h) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static inline int64_t floordiv(int64_t a, int64_t b) { /* b > 0 */
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* mark the pages of bytes [s, e) (nothing when e <= s); -1 when one is outside [0, npages) */
static inline int mark(uint64_t *bits, int64_t npages, int pageshift, int64_t s, int64_t e) {
    if (e <= s) return 0;
    int64_t p = floordiv(s, (int64_t)1 << pageshift), last = floordiv(e - 1, (int64_t)1 << pageshift);
    if (p < 0 || last >= npages) return -1;
    for (; p <= last; p++) bits[p >> 6] |= (uint64_t)1 << (p & 63);
    return 0;
}

static int mark_rows(const DbspSpan *sp, int64_t nspans, const uint8_t *base, int values, int64_t r, int64_t e,
                     uint64_t *bits, int64_t npages, int pageshift) {
    for (int64_t s = 0; s < nspans; s++) {
        const DbspSpan *x = &sp[s];
        int64_t pos = r + x->aoff, end = e + x->aoff;
        int st = 0;
        if (x->kind == DBSP_SPAN_FIXED) {
            st = mark(bits, npages, pageshift, x->off + pos * x->width, x->off + end * x->width);
        } else if (x->kind == DBSP_SPAN_BITS) {
            st = mark(bits, npages, pageshift, x->off + floordiv(pos, 8), x->off + floordiv(end + 7, 8));
        } else {
            st = mark(bits, npages, pageshift, x->off + pos * x->width, x->off + (end + 1) * x->width);
            if (!st && values) {
                const uint8_t *o = base + x->off;
                int64_t vs, ve;
                if (x->width == 8) {
                    vs = ((const int64_t *)o)[pos];
                    ve = ((const int64_t *)o)[end];
                } else {
                    vs = ((const int32_t *)o)[pos];
                    ve = ((const int32_t *)o)[end];
                }
                st = mark(bits, npages, pageshift, x->data + vs, x->data + ve);
            }
        }
        if (st) return st;
    }
    return 0;
}

int dbsp_pages_read(const uint64_t *fence, int64_t nfence, int fence_shift, int64_t n, int64_t kh_off,
                    const uint64_t *hashes, int64_t m, const int64_t *rows, int64_t nrows,
                    const DbspSpan *spans, int64_t nspans, const uint8_t *base, int values,
                    uint64_t *bits, int64_t npages, int pageshift) {
    int64_t step = (int64_t)1 << fence_shift;
    for (int64_t i = 0; i < m; i++) {
        uint64_t h = hashes[i];
        int64_t left = lower(fence, nfence, h, 0) - 1, right = lower(fence, nfence, h, 1) * step;
        int64_t lo = (left > 0 ? left : 0) * step, hi = right + step + 2;
        if (hi > n) hi = n;
        if (mark(bits, npages, pageshift, kh_off + lo * 8, kh_off + hi * 8)) return -1;
        if (rows == NULL) { /* the rows between the fence entries around it */
            int64_t upto = right < n ? right : n;
            if (mark_rows(spans, nspans, base, values, lo, upto, bits, npages, pageshift)) return -1;
        }
    }
    if (rows != NULL)
        for (int64_t i = 0; i < nrows; i++)
            if (mark_rows(spans, nspans, base, values, rows[i], rows[i] + 1, bits, npages, pageshift)) return -1;
    return 0;
}

int64_t dbsp_bits_list(const uint64_t *bits, int64_t npages, int64_t *out) {
    int64_t c = 0, nw = (npages + 63) >> 6;
    for (int64_t w = 0; w < nw; w++) {
        uint64_t x = bits[w];
        if (out == NULL) {
            c += __builtin_popcountll(x);
            continue;
        }
        while (x) {
            out[c++] = (w << 6) + __builtin_ctzll(x);
            x &= x - 1;
        }
    }
    return c;
}

int64_t dbsp_pages_stamp(int32_t *clock, const int64_t *pages, int64_t m, int32_t now) {
    int64_t fresh = 0;
    for (int64_t i = 0; i < m; i++) {
        int32_t *c = &clock[pages[i]];
        fresh += *c == 0;
        *c = now;
    }
    return fresh;
}
