/* join.c: the merge join of indexed batches (galloping over key-hash runs that cannot match) and the hash join. */
#include <stdlib.h>
#include <string.h>
#include "join.h"
#include "lookup.h"
#include "status.h"
#include "hash.h"
#include "scratch.h"

#define PF_ROWS 8  /* the fast loop of dbsp_join_dir prefetches the batch row that the key this many on meets */

void dbsp_pairs_free(DbspPairs *p) {
    free(p->li); free(p->ri); free(p->w);
    memset(p, 0, sizeof *p);
}

static int pairs_reserve(DbspPairs *p, int64_t cap) {
    if (cap <= p->cap) return DBSP_OK;
    int64_t *a = realloc(p->li, (size_t)cap * 8); if (!a) return DBSP_ENOMEM; p->li = a;
    int64_t *b = realloc(p->ri, (size_t)cap * 8); if (!b) return DBSP_ENOMEM; p->ri = b;
    int64_t *c = realloc(p->w, (size_t)cap * 8); if (!c) return DBSP_ENOMEM; p->w = c;
    p->cap = cap;
    return DBSP_OK;
}

static int pairs_push(DbspPairs *p, int64_t l, int64_t r, int64_t w) {
    if (p->n == p->cap) {
        int st = pairs_reserve(p, p->cap ? p->cap * 2 : 256);
        if (st) return st;
    }
    p->li[p->n] = l; p->ri[p->n] = r; p->w[p->n] = w; p->n++;
    return DBSP_OK;
}

static inline int key_has_null(const DbspBatch *b, int64_t i, const int32_t *keys, int32_t nkeys) {
    for (int32_t k = 0; k < nkeys; k++)
        if (!dbsp_col_valid(&b->cols[keys[k]], i)) return 1;
    return 0;
}

int dbsp_join(const DbspBatch *a, const uint64_t *akh, const int32_t *akeys,
              const DbspBatch *b, const uint64_t *bkh, const int32_t *bkeys, int32_t nkeys,
              int left_outer, DbspPairs *out) {
    return dbsp_join_fenced(a, akh, NULL, akeys, b, bkh, NULL, bkeys, nkeys, left_outer, out);
}

int dbsp_join_fenced(const DbspBatch *a, const uint64_t *akh, const uint64_t *afence, const int32_t *akeys,
                     const DbspBatch *b, const uint64_t *bkh, const uint64_t *bfence, const int32_t *bkeys,
                     int32_t nkeys, int left_outer, DbspPairs *out) {
    return dbsp_join_dir(a, akh, afence, akeys, b, bkh, bfence, NULL, bkeys, nkeys, left_outer, out);
}

int dbsp_join_dir(const DbspBatch *a, const uint64_t *akh, const uint64_t *afence, const int32_t *akeys,
                  const DbspBatch *b, const uint64_t *bkh, const uint64_t *bfence, const DbspDir *bdir,
                  const int32_t *bkeys, int32_t nkeys, int left_outer, DbspPairs *out) {
    memset(out, 0, sizeof *out);
    for (int32_t k = 0; k < nkeys; k++) {
        int ca = dbsp_type_class(a->cols[akeys[k]].type), cb = dbsp_type_class(b->cols[bkeys[k]].type);
        int ia = ca == DBSP_CLASS_SIGNED || ca == DBSP_CLASS_UNSIGNED, ib = cb == DBSP_CLASS_SIGNED || cb == DBSP_CLASS_UNSIGNED;
        if (!(ca == cb || (ia && ib))) return DBSP_ETYPE;
    }
    int st = DBSP_OK;
    int64_t na = a->nrows, nb = b->nrows, i = 0, j = 0;
    int64_t *pos = NULL;
    if (na > 0 && na * 4 <= nb) {  /* a small a against a large b: seek all of a's hashes in b at once (lookup.h) */
        pos = malloc((size_t)na * 8);
        if (!pos) return DBSP_ENOMEM;
        dbsp_seek_all_dir(bkh, nb, bfence, bdir, akh, na, pos);
    }
    /* one int64 key column without nulls on both sides: its values compared inline */
    const int64_t *fa = NULL, *fb = NULL;
    if (nkeys == 1 && !left_outer) {
        const DbspColumn *ca = &a->cols[akeys[0]], *cb = &b->cols[bkeys[0]];
        if (ca->type == DBSP_INT64 && cb->type == DBSP_INT64 && !ca->validity && !cb->validity) {
            fa = (const int64_t *)ca->values + ca->offset;
            fb = (const int64_t *)cb->values + cb->offset;
        }
    }
    if (pos && fa) {  /* both at once (a small change against a large batch, one int64 key): the loop below, inline */
        const int64_t *aw = a->weights, *bw = b->weights;
        if ((st = pairs_reserve(out, na < 256 ? 256 : na))) goto fail;
        /* the pairs' arrays and count in locals (stores through out would reload them), written back at the end */
        int64_t *li = out->li, *ri = out->ri, *pw = out->w, pn = 0;
        while (i < na) {
            uint64_t h = akh[i];
            int64_t ie = i + 1;
            while (ie < na && akh[ie] == h) ie++;
            if (i + PF_ROWS < na && pos[i + PF_ROWS] < nb) {  /* the key and weight the key PF_ROWS on will read */
                __builtin_prefetch(&fb[pos[i + PF_ROWS]]);
                if (bw) __builtin_prefetch(&bw[pos[i + PF_ROWS]]);
            }
            int64_t j = pos[i], je = j;
            while (je < nb && bkh[je] == h) je++;
            for (int64_t x = i; x < ie && j < je; x++) {
                int64_t wa = aw ? aw[x] : 1, v = fa[x];
                for (int64_t y = j; y < je; y++) {
                    if (fb[y] != v) continue;
                    int64_t w;
                    if (__builtin_mul_overflow(wa, bw ? bw[y] : 1, &w)) { st = DBSP_EOVERFLOW; goto fail; }
                    if (pn == out->cap) {
                        out->n = pn;
                        if ((st = pairs_reserve(out, out->cap * 2))) goto fail;
                        li = out->li; ri = out->ri; pw = out->w;
                    }
                    li[pn] = x; ri[pn] = y; pw[pn] = w; pn++;
                }
            }
            i = ie;
        }
        out->n = pn;
        free(pos);
        return DBSP_OK;
    }
    while (i < na) {
        uint64_t h = akh[i];
        int64_t ie = i + 1;
        while (ie < na && akh[ie] == h) ie++;
        if (pos) {
            j = pos[i];
            if (ie + 8 < na && pos[ie + 8] < nb) dbsp_prefetch_row(b, pos[ie + 8], bkeys, nkeys);
        } else {
            j = dbsp_seek(bkh, nb, bfence, j, h);
        }
        int64_t je = j;
        while (je < nb && bkh[je] == h) je++;
        if (je == j && !left_outer) {
            /* no right row has this hash: skip straight to the next left hash that can match */
            i = pos ? ie : j < nb ? dbsp_seek(akh, na, afence, ie, bkh[j]) : na;
            continue;
        }
        if (fa) {
            for (int64_t x = i; x < ie; x++) {
                int64_t wa = a->weights ? a->weights[x] : 1, v = fa[x];
                for (int64_t y = j; y < je; y++) {
                    if (fb[y] != v) continue;
                    int64_t w;
                    if (__builtin_mul_overflow(wa, b->weights ? b->weights[y] : 1, &w)) { st = DBSP_EOVERFLOW; goto fail; }
                    if ((st = pairs_push(out, x, y, w))) goto fail;
                }
            }
            i = ie;
            j = je;
            continue;
        }
        for (int64_t x = i; x < ie; x++) {
            int64_t wa = a->weights ? a->weights[x] : 1;
            int matched = 0;
            if (!key_has_null(a, x, akeys, nkeys)) {
                for (int64_t y = j; y < je; y++) {
                    if (dbsp_row_cmp(a, x, akeys, b, y, bkeys, nkeys) != 0 || key_has_null(b, y, bkeys, nkeys)) continue;
                    int64_t w;
                    if (__builtin_mul_overflow(wa, b->weights ? b->weights[y] : 1, &w)) { st = DBSP_EOVERFLOW; goto fail; }
                    if ((st = pairs_push(out, x, y, w))) goto fail;
                    matched = 1;
                }
            }
            if (left_outer && !matched && (st = pairs_push(out, x, -1, wa))) goto fail;
        }
        i = ie;
        j = je;
    }
    free(pos);
    return DBSP_OK;
fail:
    free(pos);
    dbsp_pairs_free(out);
    return st;
}

/* ---- hash join ---- */

/* a partitioned row: its key hash, row, weight, and (fast path: one numeric key) canonical key value, so the
 * build and the probe read only partition-local memory */
typedef struct { uint64_t h; int64_t row; uint64_t kv; int64_t w; } HRow;

/* the key value compared on the fast path: integers as 64 bits, floats as canonical bits (-0.0 == 0.0) */
static inline uint64_t fast_key(const DbspColumn *c, int64_t i) {
    return dbsp_type_class(c->type) == DBSP_CLASS_FLOAT ? dbsp_canon_f64_bits(dbsp_col_f64(c, i)) : dbsp_col_u64(c, i);
}

/* stable counting sort of rows by the top `bits` bits of their hash: out rows, bounds[0..2^bits];
 * kcol (may be NULL) is the single numeric key column whose values ride along */
static int radix_split(const uint64_t *h, int64_t n, int bits, const DbspColumn *kcol, const int64_t *w, HRow *out,
                       int64_t *bounds) {
    int64_t np = (int64_t)1 << bits;
    memset(bounds, 0, (size_t)(np + 1) * 8);
    for (int64_t i = 0; i < n; i++) bounds[(bits ? h[i] >> (64 - bits) : 0) + 1]++;
    for (int64_t p = 0; p < np; p++) bounds[p + 1] += bounds[p];
    int64_t *cur = malloc((size_t)np * 8);
    if (!cur) return DBSP_ENOMEM;
    memcpy(cur, bounds, (size_t)np * 8);
    for (int64_t i = 0; i < n; i++) {
        HRow *r = &out[cur[bits ? h[i] >> (64 - bits) : 0]++];
        r->h = h[i];
        r->row = i;
        r->kv = kcol && dbsp_col_valid(kcol, i) ? fast_key(kcol, i) : 0;
        r->w = w ? w[i] : 1;
    }
    free(cur);
    return DBSP_OK;
}

int dbsp_hash_join(const DbspBatch *a, const int32_t *akeys, const DbspBatch *b, const int32_t *bkeys,
                   int32_t nkeys, int left_outer, DbspPairs *out) {
    memset(out, 0, sizeof *out);
    for (int32_t k = 0; k < nkeys; k++) {
        int ca = dbsp_type_class(a->cols[akeys[k]].type), cb = dbsp_type_class(b->cols[bkeys[k]].type);
        int ia = ca == DBSP_CLASS_SIGNED || ca == DBSP_CLASS_UNSIGNED, ib = cb == DBSP_CLASS_SIGNED || cb == DBSP_CLASS_UNSIGNED;
        if (!(ca == cb || (ia && ib)) || ca == 0) return DBSP_ETYPE;
    }
    int64_t na = a->nrows, nb = b->nrows;
    int st = DBSP_OK;
    int bits = 0;
    while (bits < 16 && ((int64_t)4096 << bits) < nb) bits++;
    int64_t np = (int64_t)1 << bits;
    size_t sha = (size_t)(na ? na : 1) * 8, shb = (size_t)(nb ? nb : 1) * 8;
    size_t sra = (size_t)(na ? na : 1) * sizeof(HRow), srb = (size_t)(nb ? nb : 1) * sizeof(HRow);
    uint64_t *ha = dbsp_scratch_alloc(sha), *hb = dbsp_scratch_alloc(shb);
    HRow *ra = dbsp_scratch_alloc(sra), *rb = dbsp_scratch_alloc(srb);
    int64_t *ba = malloc((size_t)(np + 1) * 8), *bb = malloc((size_t)(np + 1) * 8);
    int64_t *slots = NULL, *next = NULL, cap = 0, maxb = 0;
    if (!ha || !hb || !ra || !rb || !ba || !bb) { st = DBSP_ENOMEM; goto done; }
    if ((st = dbsp_hash_columns(a, akeys, nkeys, ha)) || (st = dbsp_hash_columns(b, bkeys, nkeys, hb))) goto done;
    if ((st = pairs_reserve(out, na))) goto done;
    /* fast path: one key column of the same numeric class on both sides compares canonical values inline */
    const DbspColumn *fa = NULL, *fb = NULL;
    if (nkeys == 1) {
        int ca = dbsp_type_class(a->cols[akeys[0]].type), cb = dbsp_type_class(b->cols[bkeys[0]].type);
        if (ca == cb && ca != DBSP_CLASS_BYTES) { fa = &a->cols[akeys[0]]; fb = &b->cols[bkeys[0]]; }
    }
    if ((st = radix_split(ha, na, bits, fa, a->weights, ra, ba)) || (st = radix_split(hb, nb, bits, fb, b->weights, rb, bb)))
        goto done;
    for (int64_t p = 0; p < np; p++) if (bb[p + 1] - bb[p] > maxb) maxb = bb[p + 1] - bb[p];
    cap = 16;
    while (cap < 2 * maxb) cap *= 2;
    slots = malloc((size_t)cap * 8);       /* head of each slot's chain: an index into rb, or -1 */
    next = malloc((size_t)(maxb ? maxb : 1) * 8);  /* the next entry of the same slot, partition-local */
    if (!slots || !next) { st = DBSP_ENOMEM; goto done; }
    for (int64_t p = 0; p < np; p++) {
        int64_t bs = bb[p], be = bb[p + 1];
        int64_t c = 16;
        while (c < 2 * (be - bs)) c *= 2;
        uint64_t mask = (uint64_t)c - 1;
        memset(slots, 0xff, (size_t)c * 8);
        /* build: chain b's rows by hash slot, newest first; rows with a null key never match */
        for (int64_t y = be - 1; y >= bs; y--) {
            if (key_has_null(b, rb[y].row, bkeys, nkeys)) continue;
            uint64_t s = rb[y].h & mask;
            next[y - bs] = slots[s];
            slots[s] = y;
        }
        /* probe with a's rows of this partition */
        for (int64_t x = ba[p]; x < ba[p + 1]; x++) {
            int64_t ar = ra[x].row, wa = ra[x].w;
            int matched = 0;
            if (!key_has_null(a, ar, akeys, nkeys)) {
                for (int64_t y = slots[ra[x].h & mask]; y >= 0; y = next[y - bs]) {
                    int64_t br = rb[y].row;
                    if (rb[y].h != ra[x].h) continue;
                    if (fa ? rb[y].kv != ra[x].kv : dbsp_row_cmp(a, ar, akeys, b, br, bkeys, nkeys) != 0) continue;
                    int64_t w;
                    if (__builtin_mul_overflow(wa, rb[y].w, &w)) { st = DBSP_EOVERFLOW; goto done; }
                    if ((st = pairs_push(out, ar, br, w))) goto done;
                    matched = 1;
                }
            }
            if (left_outer && !matched && (st = pairs_push(out, ar, -1, wa))) goto done;
        }
    }
done:
    dbsp_scratch_free(ha, sha); dbsp_scratch_free(hb, shb); dbsp_scratch_free(ra, sra); dbsp_scratch_free(rb, srb);
    free(ba); free(bb); free(slots); free(next);
    if (st) dbsp_pairs_free(out);
    return st;
}
