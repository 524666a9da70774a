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
    free(o->w); free(o->kh); free(o->rh);
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
                  const int32_t *bkeys, const int32_t *lcols, int32_t nl, const int32_t *rcols, int32_t nr,
                  DbspJoinRunOut *o) {
    static const uint8_t empty[16] = {0};
    DbspRows r;
    DbspColumn *cols = NULL;
    DbspPairs p;
    int st;
    memset(&r, 0, sizeof r);
    memset(&p, 0, sizeof p);
    o->change.release = NULL;
    o->w = NULL; o->kh = NULL; o->rh = NULL; o->n = 0;
    for (int32_t k = 0; k < nb; k++) { o->parts[k].release = NULL; o->pw[k] = NULL; o->pn[k] = 0; }
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
    /* invariant 2: each batch's pairs, then its part's columns */
    for (int32_t k = 0; k < nb; k++) {
        if (bs[k]->nrows == 0) continue;
        if ((st = dbsp_join_fenced(&a, r.khash, NULL, ckeys, bs[k], bkh[k], bfence[k], bkeys, nkeys, 0, &p)) != DBSP_OK)
            goto fail;
        if (p.n == 0) { dbsp_pairs_free(&p); continue; }
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
done:
    o->n = r.n;
    o->w = r.weights;
    o->kh = r.khash;
    r.weights = NULL;
    r.khash = NULL;
    if (r.n == 0) { free(o->rh); o->rh = NULL; free(o->w); free(o->kh); o->w = NULL; o->kh = NULL; }
    dbsp_rows_free(&r);
    free(cols);
    return DBSP_OK;
fail:
    dbsp_pairs_free(&p);
    dbsp_rows_free(&r);
    free(cols);
    dbsp_join_run_free(o, nb);
    return st;
}
