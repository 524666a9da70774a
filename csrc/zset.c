/* zset.c: consolidate (via the grouping engine of group.c), merge and negate for Z-set batches. */
#include <stdlib.h>
#include <string.h>
#include <assert.h>
#include "zset.h"
#include "group.h"
#include "hash.h"
#include "scratch.h"

void dbsp_rows_free(DbspRows *r) {
    free(r->idx);
    free(r->weights);
    free(r->khash);
    memset(r, 0, sizeof *r);
}

int dbsp_rows_reserve(DbspRows *r, int64_t extra) {
    if (r->n + extra <= r->cap) return DBSP_OK;
    int64_t cap = r->cap ? r->cap : 64;
    while (cap < r->n + extra) cap *= 2;
    if ((size_t)cap * 8 >= ((size_t)2 << 20)) {  /* large: fresh huge-page buffers (scratch.h), copied over */
        void *a[3] = { r->idx, r->weights, r->khash }, *fresh[3];
        for (int k = 0; k < 3; k++) {
            if (!(fresh[k] = dbsp_alloc_result((size_t)cap * 8))) {
                for (int j = 0; j < k; j++) free(fresh[j]);
                return DBSP_ENOMEM;
            }
            if (r->n) memcpy(fresh[k], a[k], (size_t)r->n * 8);
        }
        for (int k = 0; k < 3; k++) free(a[k]);
        r->idx = fresh[0]; r->weights = fresh[1]; r->khash = fresh[2];
        r->cap = cap;
        return DBSP_OK;
    }
    int64_t *i2 = realloc(r->idx, (size_t)cap * 8);
    if (!i2) return DBSP_ENOMEM;
    r->idx = i2;
    int64_t *w2 = realloc(r->weights, (size_t)cap * 8);
    if (!w2) return DBSP_ENOMEM;
    r->weights = w2;
    uint64_t *k2 = realloc(r->khash, (size_t)cap * 8);
    if (!k2) return DBSP_ENOMEM;
    r->khash = k2;
    r->cap = cap;
    return DBSP_OK;
}

/* ---- consolidate: the grouping engine with the whole row as identity ---- */

int dbsp_zset_consolidate(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out) {
    int st = dbsp_group(b, NULL, 0, keys, nkeys, NULL, 0, 1, out, NULL);
#ifdef DBSP_CHECK_INVARIANTS
    if (st == DBSP_OK) assert(dbsp_rows_check_order(b, out->idx, out->weights, out->khash, out->n, keys, nkeys) == 0);
#endif
    return st;
}

/* ---- merge ---- */

int dbsp_zset_merge(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                    const int32_t *keys, int32_t nkeys, DbspRows *out) {
    int st = DBSP_OK;
    memset(out, 0, sizeof *out);
    if (a->ncols != b->ncols) return DBSP_EINVAL;
    for (int32_t c = 0; c < a->ncols; c++)
        if (dbsp_type_class(a->cols[c].type) != dbsp_type_class(b->cols[c].type)) return DBSP_ETYPE;
#ifdef DBSP_CHECK_INVARIANTS
    assert(dbsp_rows_check_order(a, NULL, a->weights, akh, a->nrows, keys, nkeys) == 0);
    assert(dbsp_rows_check_order(b, NULL, b->weights, bkh, b->nrows, keys, nkeys) == 0);
#endif
    if ((st = dbsp_rows_reserve(out, a->nrows + b->nrows))) goto done;
    int64_t i = 0, j = 0, na = a->nrows, nb = b->nrows;
    const int64_t *aw = a->weights, *bw = b->weights;
    /* With a key, rows of equal key hash are ordered by row hash: it is computed only for rows whose key hash
     * occurs on both sides (one row hash per row, remembered while the walk stays on it), not for every row. */
    int64_t arh_at = -1, brh_at = -1;
    uint64_t arh = 0, brh = 0;
    while (i < na || j < nb) {
        int c;
        if (i == na) c = 1;
        else if (j == nb) c = -1;
        else if (akh[i] != bkh[j]) c = akh[i] < bkh[j] ? -1 : 1;
        else {
            if (nkeys > 0) {
                if (arh_at != i) { arh = dbsp_hash_row(a, i, NULL, 0); arh_at = i; }
                if (brh_at != j) { brh = dbsp_hash_row(b, j, NULL, 0); brh_at = j; }
            } else {
                arh = akh[i]; brh = bkh[j];
            }
            c = arh != brh ? (arh < brh ? -1 : 1) : dbsp_row_cmp(a, i, NULL, b, j, NULL, a->ncols);
        }
        int64_t k = out->n;
        if (c < 0) {
            out->idx[k] = i; out->weights[k] = aw ? aw[i] : 1; out->khash[k] = akh[i]; out->n++; i++;
        } else if (c > 0) {
            out->idx[k] = na + j; out->weights[k] = bw ? bw[j] : 1; out->khash[k] = bkh[j]; out->n++; j++;
        } else {
            int64_t w = aw ? aw[i] : 1;
            if ((st = dbsp_add_weight(&w, bw ? bw[j] : 1))) goto done;
            if (w != 0) { out->idx[k] = i; out->weights[k] = w; out->khash[k] = akh[i]; out->n++; }
            i++; j++;
        }
    }
done:
    if (st) dbsp_rows_free(out);
    return st;
}

int dbsp_weights_negate(const int64_t *w, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (w[i] == INT64_MIN) return DBSP_EOVERFLOW;
        out[i] = -w[i];
    }
    return DBSP_OK;
}

int dbsp_rows_check_order(const DbspBatch *b, const int64_t *sel, const int64_t *weights, const uint64_t *khash,
                          int64_t n, const int32_t *keys, int32_t nkeys) {
    if (n == 0) return 0;
    int64_t nb = b->nrows;
    uint64_t *rh = malloc((size_t)(nb ? nb : 1) * 8), *kh = malloc((size_t)(nb ? nb : 1) * 8);
    int bad = 0;
    if (!rh || !kh) { free(rh); free(kh); return 0; }
    dbsp_hash_columns(b, NULL, 0, rh);
    if (nkeys) dbsp_hash_columns(b, keys, nkeys, kh); else memcpy(kh, rh, (size_t)nb * 8);
    for (int64_t t = 0; t < n && !bad; t++) {
        int64_t i = sel ? sel[t] : t;
        if (weights && weights[t] == 0) bad = 1;
        if (khash && khash[t] != kh[i]) bad = 1;
        if (t > 0) {
            int64_t p = sel ? sel[t - 1] : t - 1;
            int c = kh[p] != kh[i] ? (kh[p] < kh[i] ? -1 : 1)
                  : rh[p] != rh[i] ? (rh[p] < rh[i] ? -1 : 1)
                  : dbsp_row_cmp(b, p, NULL, b, i, NULL, b->ncols);
            if (c >= 0) bad = 1;
        }
    }
    free(rh); free(kh);
    return bad ? -1 : 0;
}
