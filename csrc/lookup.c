/* lookup.c: galloping lookups of a change's key hashes in a sorted batch (row numbers, or matching weights). */
#include <stdlib.h>
#include "lookup.h"
#include "rows.h"
#include "status.h"

int64_t dbsp_gallop(const uint64_t *h, int64_t lo, int64_t hi, uint64_t target) {
    if (lo >= hi || h[lo] >= target) return lo;
    int64_t step = 1, prev = lo;  /* invariant: h[prev] < target */
    while (prev + step < hi && h[prev + step] < target) { prev += step; step *= 2; }
    int64_t l = prev + 1, r = prev + step < hi ? prev + step : hi;  /* answer in [l, r] */
    while (l < r) {
        int64_t m = l + (r - l) / 2;
        if (h[m] < target) l = m + 1; else r = m;
    }
    return l;
}

int64_t dbsp_seek(const uint64_t *kh, int64_t n, const uint64_t *fence, int64_t lo, uint64_t target) {
    if (!fence) return dbsp_gallop(kh, lo, n, target);
    if (lo >= n || kh[lo] >= target) return lo;
    int64_t near = lo + (1 << DBSP_FENCE_SHIFT);
    if (near >= n || kh[near] >= target) return dbsp_gallop(kh, lo, near < n ? near : n, target);  /* dense walk */
    /* kh[lo] < target: the first fence entry >= target bounds the answer from above */
    int64_t nf = dbsp_fence_len(n);
    int64_t k = dbsp_gallop(fence, (lo >> DBSP_FENCE_SHIFT) + 1, nf, target);
    int64_t s = (k - 1) << DBSP_FENCE_SHIFT, e = k < nf ? k << DBSP_FENCE_SHIFT : n;
    if (s < lo) s = lo;
    while (s < e) {  /* first index in [s, e) with kh >= target; e itself qualifies when e < n */
        int64_t m = s + (e - s) / 2;
        if (kh[m] < target) s = m + 1; else e = m;
    }
    return s;
}

int dbsp_lookup(const uint64_t *kh, int64_t n, const uint64_t *want, int64_t nwant, int64_t **idx, int64_t *nidx) {
    return dbsp_lookup_fenced(kh, n, NULL, want, nwant, idx, nidx);
}

int dbsp_lookup_fenced(const uint64_t *kh, int64_t n, const uint64_t *fence, const uint64_t *want, int64_t nwant,
                       int64_t **idx, int64_t *nidx) {
    *idx = NULL;
    *nidx = 0;
    for (int64_t q = 1; q < nwant; q++)
        if (want[q] < want[q - 1]) return DBSP_EINVAL;
    int64_t cap = 0, m = 0, j = 0;
    int64_t *out = NULL;
    for (int64_t q = 0; q < nwant && j < n; q++) {
        uint64_t h = want[q];
        if (q > 0 && h == want[q - 1]) continue;
        j = dbsp_seek(kh, n, fence, j, h);
        while (j < n && kh[j] == h) {
            if (m == cap) {
                int64_t c = cap ? cap * 2 : (nwant < 64 ? 64 : nwant);
                int64_t *o2 = realloc(out, (size_t)c * 8);
                if (!o2) { free(out); return DBSP_ENOMEM; }
                out = o2; cap = c;
            }
            out[m++] = j++;
        }
    }
    *idx = out;
    *nidx = m;
    return DBSP_OK;
}

/* ---- batched seeks with software prefetching: a small change against a large, cache-cold batch is bound by
 * memory latency, so the blocks and rows that the next few wanted hashes need are requested early ---- */

#define PF_AHEAD 8

void dbsp_seek_all(const uint64_t *kh, int64_t n, const uint64_t *fence, const uint64_t *want, int64_t m,
                     int64_t *pos) {
    if (!fence) {
        int64_t j = 0;
        for (int64_t i = 0; i < m; i++) pos[i] = j = dbsp_gallop(kh, j, n, want[i]);
        return;
    }
    int64_t nf = dbsp_fence_len(n), k = 0;
    for (int64_t i = 0; i < m; i++) pos[i] = k = dbsp_gallop(fence, k, nf, want[i]);  /* first fence entry >= */
    for (int64_t i = 0; i < m; i++) {
        if (i + PF_AHEAD < m) dbsp_prefetch_fence_block(kh, n, pos[i + PF_AHEAD]);
        pos[i] = dbsp_fence_block_seek(kh, n, pos[i], want[i]);
    }
}

int dbsp_dir_build(const uint64_t *kh, int64_t n, int32_t bits, uint32_t *dir) {
    if (n < 0 || n >= ((int64_t)1 << 32) || bits < 1 || bits > 32) return DBSP_EINVAL;
    const int sh = 64 - bits;
    const uint64_t nb = (uint64_t)1 << bits;
    uint64_t x = 0;  /* the next bucket whose start is not written yet */
    for (int64_t i = 0; i < n; i++) {
        if (i && kh[i] < kh[i - 1]) return DBSP_EINVAL;
        uint64_t b = kh[i] >> sh;
        while (x <= b) dir[x++] = (uint32_t)i;
    }
    while (x <= nb) dir[x++] = (uint32_t)n;
    return DBSP_OK;
}

/* the first index in [s, e) with kh >= h (e if none): a short scan, then a gallop past a long run */
static inline int64_t dir_scan(const uint64_t *kh, int64_t s, int64_t e, uint64_t h) {
    for (int t = 0; t < 8; t++, s++)
        if (s >= e || kh[s] >= h) return s;
    return dbsp_gallop(kh, s, e, h);
}

int64_t dbsp_dir_seek(const uint64_t *kh, const DbspDir *d, uint64_t h) {
    uint64_t x = h >> (64 - d->bits);
    return dir_scan(kh, d->dir[x], d->dir[x + 1], h);
}

void dbsp_seek_all_dir(const uint64_t *kh, int64_t n, const uint64_t *fence, const DbspDir *d, const uint64_t *want,
                       int64_t m, int64_t *pos) {
    if (!d) {
        dbsp_seek_all(kh, n, fence, want, m, pos);
        return;
    }
    const int sh = 64 - d->bits;
    const uint32_t *dir = d->dir;
    for (int64_t i = 0; i < m; i++) {
        /* the directory entry the hash 2 * PF_AHEAD on needs, then the key hashes of the one PF_AHEAD on */
        if (i + 2 * PF_AHEAD < m) __builtin_prefetch(&dir[want[i + 2 * PF_AHEAD] >> sh]);
        if (i + PF_AHEAD < m) __builtin_prefetch(&kh[dir[want[i + PF_AHEAD] >> sh]]);
        uint64_t x = want[i] >> sh;
        pos[i] = dir_scan(kh, dir[x], dir[x + 1], want[i]);
    }
}

/* noipa: a function that only prefetches has no effect GCC can see, so its interprocedural analysis finds it const and
 * deletes every call to it in this file (GCC 12: dbsp_match_weights_rh and dbsp_match_sums prefetched nothing) */
__attribute__((noipa)) void dbsp_prefetch_row(const DbspBatch *b, int64_t y, const int32_t *cols, int32_t ncols) {
    if (b->weights) __builtin_prefetch(&b->weights[y]);
    for (int32_t k = 0; k < ncols; k++) {
        const DbspColumn *c = &b->cols[cols ? cols[k] : k];
        int w = dbsp_type_width(c->type);
        int64_t at = c->offset + y;
        if (c->type == DBSP_BOOL) __builtin_prefetch((const uint8_t *)c->values + (at >> 3));
        else if (w) __builtin_prefetch((const uint8_t *)c->values + at * w);
        else if (c->type == DBSP_LARGE_UTF8 || c->type == DBSP_LARGE_BINARY) __builtin_prefetch((const int64_t *)c->values + at);
        else __builtin_prefetch((const int32_t *)c->values + at);
    }
}

int dbsp_match_weights(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                       int64_t *acc) {
    return dbsp_match_weights_fenced(a, akh, b, bkh, NULL, acc);
}

int dbsp_match_weights_fenced(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                              const uint64_t *bfence, int64_t *acc) {
    return dbsp_match_weights_rh(a, akh, NULL, b, bkh, bfence, NULL, acc);
}

int dbsp_match_weights_rh(const DbspBatch *a, const uint64_t *akh, const uint64_t *arh, const DbspBatch *b,
                          const uint64_t *bkh, const uint64_t *bfence, const uint64_t *brh, int64_t *acc) {
    if (a->ncols != b->ncols) return DBSP_ETYPE;
    for (int32_t c = 0; c < a->ncols; c++)
        if (dbsp_type_class(a->cols[c].type) != dbsp_type_class(b->cols[c].type)) return DBSP_ETYPE;
    int64_t na = a->nrows, nb = b->nrows;
    if (na == 0 || nb == 0) return DBSP_OK;
    int64_t *pos = malloc((size_t)na * 8);
    if (!pos) return DBSP_ENOMEM;
    dbsp_seek_all(bkh, nb, bfence, akh, na, pos);
    int by_row_hash = arh && brh;
    int st = DBSP_OK;
    for (int64_t i = 0; i < na;) {
        uint64_t h = akh[i];
        int64_t ie = i + 1;
        while (ie < na && akh[ie] == h) ie++;
        if (ie + PF_AHEAD < na && pos[ie + PF_AHEAD] < nb) dbsp_prefetch_row(b, pos[ie + PF_AHEAD], NULL, b->ncols);
        int64_t j = pos[i], je = j;
        /* the end of b's run: gallop, not walk (a run can hold a big group's every row) */
        if (j < nb && bkh[j] == h) je = h == UINT64_MAX ? nb : dbsp_gallop(bkh, j, nb, h + 1);
        int64_t y = j;
        for (int64_t x = i; x < ie && y < je; x++) {
            /* with row hashes: both runs are in row-hash order (key hash, row hash, value), so gallop to the
             * rows of x's row hash; without: compare x with every row of the run */
            int64_t z = by_row_hash ? (y = dbsp_gallop(brh, y, je, arh[x])) : j;
            for (; z < je && (!by_row_hash || brh[z] == arh[x]); z++)
                if (dbsp_row_cmp_eqfast(a, x, NULL, b, z, NULL, a->ncols) == 0) {
                    if (dbsp_add_weight(&acc[x], b->weights ? b->weights[z] : 1)) { st = DBSP_EOVERFLOW; goto done; }
                    break;  /* b is consolidated: at most one equal row */
                }
        }
        i = ie;
    }
done:
    free(pos);
    return st;
}

int dbsp_match_sums(const DbspBatch *a, const uint64_t *akh, const int64_t *sel, int64_t n, const int32_t *akeys,
                    const DbspBatch *b, const uint64_t *bkh, const uint64_t *bfence, const int32_t *bkeys,
                    int32_t nkeys, const int32_t *cols, int32_t ncols, int64_t *acc) {
    for (int32_t k = 0; k < nkeys; k++) {
        if (akeys[k] < 0 || akeys[k] >= a->ncols || bkeys[k] < 0 || bkeys[k] >= b->ncols) return DBSP_EINVAL;
        if (dbsp_type_class(a->cols[akeys[k]].type) != dbsp_type_class(b->cols[bkeys[k]].type)) return DBSP_ETYPE;
    }
    for (int32_t c = 0; c < ncols; c++) {
        if (cols[c] < 0 || cols[c] >= b->ncols) return DBSP_EINVAL;
        if (b->cols[cols[c]].type != DBSP_INT64) return DBSP_ETYPE;
    }
    int64_t nb = b->nrows;
    if (n == 0 || nb == 0) return DBSP_OK;
    int64_t *pos = malloc((size_t)n * 8);
    if (!pos) return DBSP_ENOMEM;
    dbsp_seek_all(bkh, nb, bfence, akh, n, pos);
    int st = DBSP_OK;
    for (int64_t i = 0; i < n;) {
        uint64_t h = akh[i];
        int64_t ie = i + 1;
        while (ie < n && akh[ie] == h) ie++;
        if (ie + PF_AHEAD < n && pos[ie + PF_AHEAD] < nb) {
            dbsp_prefetch_row(b, pos[ie + PF_AHEAD], bkeys, nkeys);
            dbsp_prefetch_row(b, pos[ie + PF_AHEAD], cols, ncols);
        }
        int64_t j = pos[i], je = j;
        while (je < nb && bkh[je] == h) je++;
        for (int64_t y = j; y < je; y++) {
            for (int64_t x = i; x < ie; x++) {
                int64_t r = sel ? sel[x] : x;
                if (dbsp_row_cmp_eqfast(a, r, akeys, b, y, bkeys, nkeys) != 0) continue;
                int64_t wy = b->weights ? b->weights[y] : 1;
                for (int32_t c = 0; c < ncols; c++) {
                    const DbspColumn *col = &b->cols[cols[c]];
                    int64_t v = dbsp_col_valid(col, y) ? ((const int64_t *)col->values)[col->offset + y] : 0, p;
                    if (__builtin_mul_overflow(v, wy, &p) || dbsp_add_weight(&acc[x * ncols + c], p)) {
                        st = DBSP_EOVERFLOW;
                        goto done;
                    }
                }
                break;  /* the selected rows have distinct keys: at most one matches */
            }
        }
        i = ie;
    }
done:
    free(pos);
    return st;
}
