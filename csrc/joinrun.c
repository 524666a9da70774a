/* joinrun.c: an inner equi-join's step over one side's change in one call (see joinrun.h). */
#include <stdlib.h>
#include <string.h>
#include "joinrun.h"
#include "join.h"
#include "rows.h"
#include "status.h"
#include "zset.h"

void dbsp_join_run_free(DbspJoinRunOut *o, int32_t nb) {
    if (o->change.release) o->change.release(&o->change);
    free(o->w); free(o->kh); free(o->rh); free(o->cols);
    o->cols = NULL;
    o->w = NULL; o->kh = NULL; o->rh = NULL; o->n = 0;
    for (int32_t k = 0; k < nb; k++) {
        if (o->parts[k].release) o->parts[k].release(&o->parts[k]);
        free(o->pw[k]);
        o->pw[k] = NULL;
        o->pn[k] = 0;
    }
}

int dbsp_join_run(const DbspBatch *c, const struct ArrowSchema *cs, const int32_t *ckeys, int32_t nkeys, int change_left,
                  int32_t nb, const DbspBatch *const *bs, const uint64_t *const *bkh, const uint64_t *const *bfence,
                  const DbspDir *const *bdir, const int32_t *bkeys, const int32_t *lcols, int32_t nl, const int32_t *rcols,
                  int32_t nr, const DbspBatch *pad, DbspJoinRunOut *o) {
    static const uint8_t empty[16] = {0};
    DbspRows r;
    DbspColumn *cols = NULL;
    DbspPairs p;
    int64_t *cnt = NULL, *pidx = NULL, *pzero = NULL;
    uint8_t *met = NULL;
    int st;
    const int32_t np = nb + (pad != NULL);  /* the parts: one per batch, then the padded rows' (invariant 4) */
    memset(&r, 0, sizeof r);
    memset(&p, 0, sizeof p);
    o->change.release = NULL;
    o->cols = NULL;
    o->w = NULL; o->kh = NULL; o->rh = NULL; o->n = 0; o->pad_met = 0;
    for (int32_t k = 0; k < np; k++) { o->parts[k].release = NULL; o->pw[k] = NULL; o->pn[k] = 0; }
    if (pad && (!change_left || pad->nrows < 1)) return DBSP_EINVAL;
    /* invariant 1: the change indexed as ZSet.index_by indexes it */
    if ((st = dbsp_zset_consolidate_rh(c, ckeys, nkeys, &r, &o->rh)) != DBSP_OK) goto fail;
    if (r.n == 0) goto done;
    if ((st = dbsp_cdata_gather(c, r.idx, r.n, &o->change)) != DBSP_OK) goto fail;
    /* the indexed change viewed in its key-hash order, for the join kernel and the gathers */
    if (!(cols = malloc((size_t)(c->ncols ? c->ncols : 1) * sizeof *cols))) { st = DBSP_ENOMEM; goto fail; }
    int64_t nrows = 0;
    int32_t bad = -1;
    if ((st = dbsp_cdata_view(cs, &o->change, c->ncols, cols, &nrows, empty, &bad)) != DBSP_OK) goto fail;
    DbspBatch a = {.nrows = r.n, .ncols = c->ncols, .cols = cols, .weights = r.weights};
    if (pad && (!(cnt = calloc((size_t)r.n, sizeof *cnt)) || !(met = calloc((size_t)r.n, 1)))) {
        st = DBSP_ENOMEM;
        goto fail;
    }
    /* invariant 2: each batch's pairs, then its part's columns */
    for (int32_t k = 0; k < nb; k++) {
        if (bs[k]->nrows == 0) continue;
        if ((st = dbsp_join_dir(&a, r.khash, NULL, ckeys, bs[k], bkh[k], bfence[k], bdir ? bdir[k] : NULL, bkeys,
                                 nkeys, 0, &p)) != DBSP_OK)
            goto fail;
        if (p.n == 0) { dbsp_pairs_free(&p); continue; }
        if (cnt) {  /* invariant 4: each change row's right weights, summed over its pairs */
            const int64_t *bw = bs[k]->weights;
            for (int64_t x = 0; x < p.n; x++) {
                met[p.li[x]] = 1;
                if (__builtin_add_overflow(cnt[p.li[x]], bw ? bw[p.ri[x]] : 1, &cnt[p.li[x]])) {
                    st = DBSP_EOVERFLOW;
                    goto fail;
                }
            }
        }
        const DbspBatch *lb = change_left ? &a : bs[k], *rb = change_left ? bs[k] : &a;
        int32_t ln = lcols ? nl : lb->ncols, rn = rcols ? nr : rb->ncols;  /* NULL: every column */
        if (change_left)
            st = dbsp_cdata_gather2(&a, lcols, ln, p.li, bs[k], rcols, rn, p.ri, p.n, &o->parts[k]);
        else
            st = dbsp_cdata_gather2(bs[k], lcols, ln, p.ri, &a, rcols, rn, p.li, p.n, &o->parts[k]);
        if (st != DBSP_OK) goto fail;
        o->pw[k] = p.w;
        o->pn[k] = p.n;
        p.w = NULL;
        dbsp_pairs_free(&p);
    }
    if (cnt) {  /* invariant 4: the rows without a right row, padded with pad's row 0 */
        int64_t m = 0;
        for (int64_t i = 0; i < r.n; i++) m += cnt[i] <= 0;
        if (m) {
            pidx = malloc((size_t)m * sizeof *pidx);
            pzero = calloc((size_t)m, sizeof *pzero);
            o->pw[nb] = malloc((size_t)m * sizeof **o->pw);
            if (!pidx || !pzero || !o->pw[nb]) { st = DBSP_ENOMEM; goto fail; }
            for (int64_t i = 0, j = 0; i < r.n; i++)
                if (cnt[i] <= 0) pidx[j] = i, o->pw[nb][j] = r.weights[i], o->pad_met |= met[i], j++;
            if ((st = dbsp_cdata_gather2(&a, lcols, lcols ? nl : a.ncols, pidx, pad, rcols, rcols ? nr : pad->ncols,
                                         pzero, m, &o->parts[nb])) != DBSP_OK) goto fail;
            o->pn[nb] = m;
        }
    }
done:
    o->n = r.n;
    if (r.n) o->cols = cols, cols = NULL;  /* invariant 5 */
    o->w = r.weights;
    o->kh = r.khash;
    r.weights = NULL;
    r.khash = NULL;
    if (r.n == 0) { free(o->rh); o->rh = NULL; free(o->w); free(o->kh); o->w = NULL; o->kh = NULL; }
    dbsp_rows_free(&r);
    free(cols); free(cnt); free(met); free(pidx); free(pzero);
    return DBSP_OK;
fail:
    dbsp_pairs_free(&p);
    dbsp_rows_free(&r);
    free(cols); free(cnt); free(met); free(pidx); free(pzero);
    dbsp_join_run_free(o, np);
    return st;
}
