/* join.c: the merge join of indexed batches, galloping over runs of key hashes that cannot match. */
#include <stdlib.h>
#include <string.h>
#include "join.h"
#include "status.h"

void dbsp_pairs_free(DbspPairs *p) {
    free(p->li); free(p->ri); free(p->w);
    memset(p, 0, sizeof *p);
}

static int pairs_push(DbspPairs *p, int64_t l, int64_t r, int64_t w) {
    if (p->n == p->cap) {
        int64_t cap = p->cap ? p->cap * 2 : 256;
        int64_t *a = realloc(p->li, (size_t)cap * 8); if (!a) return DBSP_ENOMEM; p->li = a;
        int64_t *b = realloc(p->ri, (size_t)cap * 8); if (!b) return DBSP_ENOMEM; p->ri = b;
        int64_t *c = realloc(p->w, (size_t)cap * 8); if (!c) return DBSP_ENOMEM; p->w = c;
        p->cap = cap;
    }
    p->li[p->n] = l; p->ri[p->n] = r; p->w[p->n] = w; p->n++;
    return DBSP_OK;
}

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

static inline int key_has_null(const DbspBatch *b, int64_t i, const int32_t *keys, int32_t nkeys) {
    for (int32_t k = 0; k < nkeys; k++)
        if (!dbsp_col_valid(&b->cols[keys[k]], i)) return 1;
    return 0;
}

int dbsp_join(const DbspBatch *a, const uint64_t *akh, const int32_t *akeys,
              const DbspBatch *b, const uint64_t *bkh, const int32_t *bkeys, int32_t nkeys,
              int left_outer, DbspPairs *out) {
    memset(out, 0, sizeof *out);
    for (int32_t k = 0; k < nkeys; k++) {
        int ca = dbsp_type_class(a->cols[akeys[k]].type), cb = dbsp_type_class(b->cols[bkeys[k]].type);
        int ia = ca == DBSP_CLASS_SIGNED || ca == DBSP_CLASS_UNSIGNED, ib = cb == DBSP_CLASS_SIGNED || cb == DBSP_CLASS_UNSIGNED;
        if (!(ca == cb || (ia && ib))) return DBSP_ETYPE;
    }
    int st = DBSP_OK;
    int64_t na = a->nrows, nb = b->nrows, i = 0, j = 0;
    while (i < na) {
        uint64_t h = akh[i];
        int64_t ie = i + 1;
        while (ie < na && akh[ie] == h) ie++;
        j = dbsp_gallop(bkh, j, nb, h);
        int64_t je = j;
        while (je < nb && bkh[je] == h) je++;
        if (je == j && !left_outer) {
            /* no right row has this hash: skip straight to the next left hash that can match */
            i = j < nb ? dbsp_gallop(akh, ie, na, bkh[j]) : na;
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
    return DBSP_OK;
fail:
    dbsp_pairs_free(out);
    return st;
}
