/* group_int.c: the grouping engine's path for one non-null 64-bit integer identity column with COUNT and int64 SUM.
 *
 * Design notes:
 *  1. It returns what dbsp_group (group.c) returns for the same call, bit for bit: the same groups, first rows,
 *     weight sums, key hashes and canonical order, and the same sums. Sums are exact there (an overflow only
 *     when a group's sum does not fit); here a partial sum that leaves int64 returns DBSP_GROUP_INT_NO, and
 *     the caller runs the general engine, which decides.
 *  2. The row hash of one integer column is a bijection of its value (hash.h), so the canonical order (key hash,
 *     row hash, value) is the order of the hashes alone, and a group's hash is computed from its value: no
 *     hash array is stored, and the histogram and scatter passes each recompute the row's hash.
 *  3. Rows are radix-partitioned by the top hash bits (as in group.c) into entries of 16 + 8 * nsums bytes:
 *     value, row number (u32), weight (i32), then value * weight per SUM. A weight outside int32 makes the call
 *     return DBSP_GROUP_INT_NO, and the caller runs the general engine. Partitions start on 64-byte
 *     boundaries, so full write-combining buffers leave with non-temporal stores (no read for ownership) when
 *     the entry array is larger than STREAM_MIN_BYTES; a smaller one is written through the cache, where the
 *     next pass reads it (streamed, a 1k-row call's entries went to memory and came back from there).
 *  4. Each partition is folded into a flat open-addressing table of (value, weight sum, first row, sums) that
 *     stays in cache: sized from the previous partition's group count (the first one's for at most 4,096
 *     groups), and grown when half full to twice the groups its rows so far project for the whole partition
 *     (new groups per row seen), so a partition of mostly distinct values grows once, not once per doubling;
 *     cleared while its groups are extracted. Groups are then sorted by hash (a counting pass on the next hash
 *     bits). The projection only sizes the table: a wrong one costs another growth or a larger table to clear.
 *  5. A call of at most INT_ROWS_PER_PART rows has one partition: pass 1 computes no hash and keeps no partition
 *     array, and pass 2 writes the entries straight into the entry array in row order (what the write-combining
 *     buffers of one partition would flush there), so a 1k-row step pays neither pass's copies.
 */
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "group.h"
#include "hash.h"
#include "scratch.h"

#ifndef INT_ROWS_PER_PART
#define INT_ROWS_PER_PART 32768
#endif
#define INT_WC 16  /* entries per write-combining buffer */
#define MAX_SUMS 4
#ifndef PREFETCH
#define PREFETCH 8     /* entries ahead whose table slot is prefetched */
#endif
#define LINE 64
#ifndef STREAM_MIN_BYTES
#define STREAM_MIN_BYTES ((size_t)1 << 20) /* entry arrays up to this size are written through the cache */
#endif

static int is_int64_col(const DbspColumn *c) {
    return c->validity == NULL && (c->type == DBSP_INT64 || c->type == DBSP_UINT64 || c->type == DBSP_TIMESTAMP);
}

int dbsp_group_int_applies(const DbspBatch *b, const int32_t *icols, int32_t nicols, const int32_t *kcols,
                           int32_t nkcols, const DbspAggSpec *aggs, int32_t naggs) {
    int32_t ncols = icols ? nicols : b->ncols;
    if (ncols != 1 || b->nrows >= (int64_t)INT32_MAX) return 0;
    int32_t col = icols ? icols[0] : 0;
    if (col < 0 || col >= b->ncols || !is_int64_col(&b->cols[col])) return 0;
    if (nkcols > 1 || (nkcols == 1 && kcols[0] != col)) return 0;
    int32_t nsums = 0;
    for (int32_t a = 0; a < naggs; a++) {
        if (aggs[a].kind == DBSP_AGG_COUNT) continue;
        if (aggs[a].kind != DBSP_AGG_SUM || aggs[a].col < 0 || aggs[a].col >= b->ncols) return 0;
        const DbspColumn *c = &b->cols[aggs[a].col];
        if (c->validity || (c->type != DBSP_INT64 && c->type != DBSP_TIMESTAMP) || ++nsums > MAX_SUMS) return 0;
    }
    return 1;
}

static inline void flush_stream(uint8_t *dst, const uint8_t *src, size_t bytes, int stream) {
#if defined(__SSE2__)
    if (stream) {
        for (size_t o = 0; o < bytes; o += 16)
            _mm_stream_si128((__m128i *)(void *)(dst + o), _mm_load_si128((const __m128i *)(const void *)(src + o)));
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, bytes);
}

static inline uint64_t ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline void st64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void st32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
/* Copy one table slot (SL bytes, a multiple of 8, constant per instantiation): word by word, since GCC emits a
 * `rep movs` for some constant sizes (40 bytes), whose start-up cost was a fifth of a 1k-row call. */
static inline void copy_slot(uint8_t *dst, const uint8_t *src, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 8) st64(dst + o, ld64(src + o));
}

/* in-partition table slot: value (0), weight sum (8), first row + 1 (16; 0 = empty), sums (24 + 8k) */
#define SLOT_BYTES(ns) (24 + 8 * (ns))
#define TAB_POS(v, lg) ((uint64_t)((v) * DBSP_HASH_K_GOLD) >> (64 - (lg)))

typedef struct { uint64_t h; uint64_t g; } HashRef;

/* sort refs by h (all distinct, sharing their top `used` bits) through tmp */
static void sort_refs(HashRef *r, HashRef *tmp, int64_t n, int used, int64_t *cnt) {
    if (n > 32) {
        int bb = 0;
        while (bb < 16 && ((int64_t)1 << bb) < n) bb++;
        if (used + bb > 64) bb = 64 - used;
        int64_t nb = (int64_t)1 << bb;
        memset(cnt, 0, (size_t)(nb + 1) * 8);
#define BUCKET(h) ((int64_t)(((h) << used) >> (64 - bb)))
        for (int64_t i = 0; i < n; i++) cnt[BUCKET(r[i].h) + 1]++;
        for (int64_t k = 0; k < nb; k++) cnt[k + 1] += cnt[k];
        for (int64_t i = 0; i < n; i++) tmp[cnt[BUCKET(r[i].h)]++] = r[i];
#undef BUCKET
        memcpy(r, tmp, (size_t)n * sizeof *r);
    }
    for (int64_t i = 1; i < n; i++) {  /* buckets hold a few refs each: insertion sort finishes the order */
        HashRef x = r[i];
        int64_t j = i - 1;
        while (j >= 0 && r[j].h > x.h) { r[j + 1] = r[j]; j--; }
        r[j + 1] = x;
    }
}

/* grow out (rows + ivals) to hold `need` groups */
static int reserve_out(DbspRows *out, int64_t **ivals, int32_t naggs, int64_t need) {
    if (need <= out->cap) return DBSP_OK;
    int64_t old = out->cap;
    int st = dbsp_rows_reserve(out, need - out->n);
    if (st || !naggs || out->cap == old) return st;
    int64_t *iv = realloc(*ivals, (size_t)(out->cap * naggs) * 8);
    if (!iv) return DBSP_ENOMEM;
    *ivals = iv;
    return DBSP_OK;
}

static inline __attribute__((always_inline)) int group_int(const DbspBatch *b, int32_t col, const DbspAggSpec *aggs,
                                                           int32_t naggs, const int32_t ns, int drop_zero,
                                                           DbspRows *out, int64_t **ivals_out) {
    const int64_t n = b->nrows;
    const DbspColumn *kc = &b->cols[col];
    const uint64_t *key = (const uint64_t *)kc->values + kc->offset;
    const int64_t *w = b->weights;
    const int64_t *val[MAX_SUMS];
    int32_t sum_of[64];  /* aggregate -> its sum slot, -1 for COUNT */
    for (int32_t a = 0, k = 0; a < naggs; a++) {
        if (aggs[a].kind == DBSP_AGG_COUNT) { sum_of[a] = -1; continue; }
        const DbspColumn *c = &b->cols[aggs[a].col];
        val[k] = (const int64_t *)c->values + c->offset;
        sum_of[a] = k++;
    }
    const int64_t ES = 16 + 8 * ns, SL = SLOT_BYTES(ns);
    const int64_t align = ES % LINE == 0 ? 1 : (ES % 32 == 0 ? 2 : (ES % 16 == 0 ? 4 : 8));  /* entries per line multiple */
    int bits = 0;
    while (bits < 16 && ((int64_t)INT_ROWS_PER_PART << bits) < n) bits++;
    const int64_t np = (int64_t)1 << bits;
    const int shift = 64 - bits;
#define PART(h) (bits ? (int64_t)((h) >> shift) : 0)
    int st = DBSP_OK;
    int64_t *cnt = calloc((size_t)np + 1, 8), *start = malloc(((size_t)np + 1) * 8), *cur = malloc((size_t)np * 8);
    uint32_t *fill = calloc((size_t)np, 4);
    uint8_t *Ebase = NULL, *wcbase = NULL, *T = NULL, *G = NULL;
    HashRef *R = NULL, *R2 = NULL;
    int64_t *bucket_cnt = NULL, *ivals = NULL;
    uint16_t *part = NULL;
    size_t part_bytes = 0, e_bytes = 0, wc_bytes = (size_t)(np * INT_WC * ES + LINE), t_bytes = 0, g_bytes = 0, r_bytes = 0;
    if (!cnt || !start || !cur || !fill) { st = DBSP_ENOMEM; goto done; }

    /* pass 1: each row's partition (kept: 2 bytes a row is cheaper to reread than the hash to recompute) */
    if (bits) {
        part_bytes = (size_t)n * 2;
        part = dbsp_scratch_alloc(part_bytes);
        if (!part) { st = DBSP_ENOMEM; goto done; }
        for (int64_t i = 0; i < n; i++) {
            uint16_t p = (uint16_t)PART(dbsp_hash_int_row(key[i]));
            part[i] = p;
            cnt[p]++;
        }
    } else {  /* one partition (design note 5): no hash, no partition array */
        cnt[0] = n;
    }
    start[0] = 0;
    int64_t maxp = 0;
    for (int64_t p = 0; p < np; p++) {
        start[p + 1] = (start[p] + cnt[p] + align - 1) / align * align;
        cur[p] = start[p];
        if (cnt[p] > maxp) maxp = cnt[p];
    }
    e_bytes = (size_t)(start[np] * ES + LINE);
    Ebase = dbsp_scratch_alloc(e_bytes);
    if (!bits) wc_bytes = 0;
    wcbase = bits ? dbsp_scratch_alloc(wc_bytes) : NULL;
    if (!Ebase || (bits && !wcbase)) { st = DBSP_ENOMEM; goto done; }
    uint8_t *E = (uint8_t *)(((uintptr_t)Ebase + LINE - 1) & ~(uintptr_t)(LINE - 1));
    const int stream = e_bytes > STREAM_MIN_BYTES;  /* design note 3: small entry arrays stay in cache */
    uint8_t *wc = (uint8_t *)(((uintptr_t)wcbase + LINE - 1) & ~(uintptr_t)(LINE - 1));

    /* pass 2: scatter entries through write-combining buffers (design note 3) */
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = key[i];
        int64_t p = bits ? part[i] : 0;
        int64_t wi = w ? w[i] : 1;
        if (wi < INT32_MIN || wi > INT32_MAX) { st = DBSP_GROUP_INT_NO; goto done; }
        uint8_t *e = bits ? wc + (p * INT_WC + fill[p]) * ES : E + i * ES;  /* one partition: in place (note 5) */
        st64(e, v);
        st32(e + 8, (uint32_t)i);
        st32(e + 12, (uint32_t)(int32_t)wi);
        for (int32_t k = 0; k < ns; k++) {
            int64_t prod;
            if (__builtin_mul_overflow(val[k][i], wi, &prod)) { st = DBSP_EOVERFLOW; goto done; }
            st64(e + 16 + 8 * k, (uint64_t)prod);
        }
        if (bits && ++fill[p] == INT_WC) {
            flush_stream(E + cur[p] * ES, wc + p * INT_WC * ES, (size_t)(INT_WC * ES), stream);
            cur[p] += INT_WC;
            fill[p] = 0;
        }
    }
    for (int64_t p = 0; bits && p < np; p++)
        if (fill[p]) memcpy(E + cur[p] * ES, wc + p * INT_WC * ES, (size_t)(fill[p] * ES));
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
#undef PART

    /* per partition: fold into the table, extract and clear it, sort by hash, append (design note 4) */
    int maxlg = 6;
    while (((int64_t)1 << maxlg) < 2 * maxp) maxlg++;
    t_bytes = (size_t)(((int64_t)1 << maxlg) * SL);
    g_bytes = (size_t)((maxp ? maxp : 1) * SL);
    r_bytes = (size_t)((maxp ? maxp : 1) * (int64_t)sizeof(HashRef));
    T = dbsp_scratch_alloc(t_bytes);
    G = dbsp_scratch_alloc(g_bytes);
    R = dbsp_scratch_alloc(r_bytes);
    R2 = dbsp_scratch_alloc(r_bytes);
    bucket_cnt = malloc(((size_t)1 << 16) * 8 + 8);
    if (!T || !G || !R || !R2 || !bucket_cnt) { st = DBSP_ENOMEM; goto done; }
    memset(T, 0, t_bytes);
    memset(out, 0, sizeof *out);
    int64_t prev_ng = -1;
    for (int64_t p = 0; p < np; p++) {
        int64_t es = start[p], ee = start[p] + cnt[p];
        if (ee == es) continue;
        int lg = 6;
        int64_t want = prev_ng >= 0 ? prev_ng + prev_ng / 4 : (cnt[p] < 4096 ? cnt[p] : 4096);
        while (lg < maxlg && ((int64_t)1 << lg) < 2 * want) lg++;
        uint64_t mask = ((uint64_t)1 << lg) - 1;
        int64_t ng = 0;
        for (int64_t j = es; j < ee; j++) {
            const uint8_t *e = E + j * ES;
            uint64_t v = ld64(e);
            if (j + PREFETCH < ee) __builtin_prefetch(T + TAB_POS(ld64(e + PREFETCH * ES), lg) * SL);
            uint64_t s = TAB_POS(v, lg);
            for (;;) {
                uint8_t *sl = T + s * SL;
                if (ld32(sl + 16) == 0) {  /* a new group: its first row */
                    st64(sl, v);
                    st64(sl + 8, (uint64_t)(int64_t)(int32_t)ld32(e + 12));
                    st32(sl + 16, ld32(e + 8) + 1);
                    for (int32_t k = 0; k < ns; k++) st64(sl + 24 + 8 * k, ld64(e + 16 + 8 * k));
                    if (2 * ++ng > (int64_t)mask + 1) {  /* half full: grow (lg < maxlg, as ng <= maxp) */
                        int64_t proj = dbsp_group_projection(ng, j - es + 1, ee - j - 1); /* group.h */
                        int nlg = lg + 1;
                        while (nlg < maxlg && ((int64_t)1 << nlg) < 2 * proj) nlg++;
                        int64_t m = 0;
                        for (uint64_t t = 0; t <= mask; t++) {
                            uint8_t *q = T + t * SL;
                            if (ld32(q + 16)) { copy_slot(G + m * SL, q, SL); st32(q + 16, 0); m++; }
                        }
                        lg = nlg;
                        mask = ((uint64_t)1 << lg) - 1;
                        for (int64_t g = 0; g < m; g++) {
                            uint64_t s2 = TAB_POS(ld64(G + g * SL), lg);
                            while (ld32(T + s2 * SL + 16)) s2 = (s2 + 1) & mask;
                            copy_slot(T + s2 * SL, G + g * SL, SL);
                        }
                    }
                    break;
                }
                if (ld64(sl) == v) {
                    int64_t ws = (int64_t)ld64(sl + 8);
                    if (__builtin_add_overflow(ws, (int64_t)(int32_t)ld32(e + 12), &ws)) { st = DBSP_GROUP_INT_NO; goto done; }
                    st64(sl + 8, (uint64_t)ws);
                    for (int32_t k = 0; k < ns; k++) {
                        int64_t a = (int64_t)ld64(sl + 24 + 8 * k);
                        if (__builtin_add_overflow(a, (int64_t)ld64(e + 16 + 8 * k), &a)) { st = DBSP_GROUP_INT_NO; goto done; }
                        st64(sl + 24 + 8 * k, (uint64_t)a);
                    }
                    break;
                }
                s = (s + 1) & mask;
            }
        }
        prev_ng = ng;
        /* extract the groups (clearing the table), hash them, sort by hash */
        int64_t m = 0;
        for (uint64_t t = 0; t <= mask; t++) {
            uint8_t *q = T + t * SL;
            if (!ld32(q + 16)) continue;
            if (!drop_zero || ld64(q + 8) != 0) copy_slot(G + m * SL, q, SL);
            st32(q + 16, 0);
            if (drop_zero && ld64(q + 8) == 0) continue;
            R[m].h = dbsp_hash_int_row(ld64(q));
            R[m].g = (uint64_t)m;
            m++;
        }
        sort_refs(R, R2, m, bits, bucket_cnt);
        if (out->n + m > out->cap) {  /* first partition: reserve for the groups its share predicts */
            int64_t guess = out->cap ? 2 * out->cap : (int64_t)((double)m * (double)n / (double)cnt[p] * 1.05) + 1024;
            if (guess < out->n + m) guess = out->n + m;
            if ((st = reserve_out(out, &ivals, naggs, guess))) goto done;
        }
        for (int64_t r = 0; r < m; r++) {
            const uint8_t *q = G + R[r].g * SL;
            int64_t o = out->n++;
            out->idx[o] = (int64_t)ld32(q + 16) - 1;
            out->weights[o] = (int64_t)ld64(q + 8);
            out->khash[o] = R[r].h;
            for (int32_t a = 0; a < naggs; a++)
                ivals[o * naggs + a] = sum_of[a] < 0 ? out->weights[o] : (int64_t)ld64(q + 24 + 8 * sum_of[a]);
        }
    }
done:
    free(cnt); free(start); free(cur); free(fill); free(bucket_cnt); dbsp_scratch_free(part, part_bytes);
    dbsp_scratch_free(Ebase, e_bytes); dbsp_scratch_free(wcbase, wc_bytes); dbsp_scratch_free(T, t_bytes);
    dbsp_scratch_free(G, g_bytes); dbsp_scratch_free(R, r_bytes); dbsp_scratch_free(R2, r_bytes);
    if (st) { dbsp_rows_free(out); free(ivals); ivals = NULL; }
    if (ivals_out) *ivals_out = ivals; else free(ivals);
    return st;
}

int dbsp_group_int(const DbspBatch *b, const int32_t *icols, const DbspAggSpec *aggs, int32_t naggs, int drop_zero,
                   DbspRows *out, int64_t **ivals) {
    memset(out, 0, sizeof *out);
    if (ivals) *ivals = NULL;
    if (naggs > 64 || (naggs && !ivals)) return DBSP_EINVAL;
    int32_t col = icols ? icols[0] : 0, ns = 0;
    for (int32_t a = 0; a < naggs; a++) ns += aggs[a].kind == DBSP_AGG_SUM;
    if (b->nrows == 0) return DBSP_OK;
    switch (ns) {  /* one specialized copy per number of sums */
    case 0: return group_int(b, col, aggs, naggs, 0, drop_zero, out, ivals);
    case 1: return group_int(b, col, aggs, naggs, 1, drop_zero, out, ivals);
    case 2: return group_int(b, col, aggs, naggs, 2, drop_zero, out, ivals);
    case 3: return group_int(b, col, aggs, naggs, 3, drop_zero, out, ivals);
    default: return group_int(b, col, aggs, naggs, 4, drop_zero, out, ivals);
    }
}
