/* joinlin.c: an inner join folded straight into its linear group-by's totals in one call (see joinlin.h). */
#include <stdlib.h>
#include <string.h>
#include "joinlin.h"
#include "join.h"
#include "status.h"

typedef struct Seg {  /* the pairs of one change with one batch */
    const DbspBatch *lb, *rb;  /* the left and the right rows' batches */
    int lchange;               /* the change is the left side: p.li rows of lb, p.ri of rb (else the reverse) */
    DbspPairs p;
} Seg;

/* the change of side sd indexed (invariant 1) and viewed as a batch a (its key hashes sd->out.kh) */
static int index_side(DbspJoinLinSide *sd, const int32_t *ckeys, int32_t nkeys, DbspColumn **cols, DbspBatch *a) {
    DbspJoinRunOut *o = &sd->out;
    int st = dbsp_join_run(sd->c, sd->cs, ckeys, nkeys, 1, 0, NULL, NULL, NULL, NULL, ckeys, NULL, 0, NULL, 0, NULL,
                           o);
    if (st != DBSP_OK || o->n == 0) return st;
    *cols = o->cols;  /* the view the call read the change through (joinrun.h invariant 5): the caller frees it */
    o->cols = NULL;
    a->nrows = o->n;
    a->ncols = sd->c->ncols;
    a->cols = *cols;
    a->weights = o->w;
    return DBSP_OK;
}

/* the pairs of change a (key hashes akh, keys akeys) with batch b, appended to segs as a segment (none if empty) */
static int pair_up(const DbspBatch *a, const uint64_t *akh, const int32_t *akeys, const DbspBatch *b,
                   const uint64_t *bkh, const uint64_t *bfence, const DbspDir *bdir, const int32_t *bkeys,
                   int32_t nkeys, int lchange, Seg *segs, int32_t *nseg) {
    if (b->nrows == 0 || a->nrows == 0) return DBSP_OK;
    Seg *g = &segs[*nseg];
    memset(g, 0, sizeof *g);
    int st = dbsp_join_dir(a, akh, NULL, akeys, b, bkh, bfence, bdir, bkeys, nkeys, 0, &g->p);
    if (st != DBSP_OK) { dbsp_pairs_free(&g->p); return st; }
    if (g->p.n == 0) { dbsp_pairs_free(&g->p); return DBSP_OK; }
    g->lb = lchange ? a : b;
    g->rb = lchange ? b : a;
    g->lchange = lchange;
    (*nseg)++;
    return DBSP_OK;
}

/* invariant 3: column g of the joined batch over every segment's pairs, into *vals (and *valid when a value is
 * null: malloc'ed, all set first) */
static int gather_col(const DbspJoinLin *j, int32_t g, const Seg *segs, int32_t nseg, int64_t total, uint8_t **vals,
                      uint8_t **valid) {
    int32_t t = j->gtype[g], side = j->gside[g], c = j->gcol[g];
    int wd = dbsp_type_width(t);
    if (wd == 0 || t == DBSP_BOOL) return DBSP_ETYPE;
    if (!(*vals = malloc((size_t)(total ? total : 1) * (size_t)wd))) return DBSP_ENOMEM;
    int64_t at = 0;
    for (int32_t k = 0; k < nseg; k++) {
        const Seg *s = &segs[k];
        const DbspBatch *b = side ? s->rb : s->lb;
        const int64_t *rows = (side == 0) == (s->lchange != 0) ? s->p.li : s->p.ri;
        if (c < 0 || c >= b->ncols) return DBSP_EINVAL;
        const DbspColumn *col = &b->cols[c];
        if (col->type != t) return DBSP_ETYPE;
        const uint8_t *src = (const uint8_t *)col->values + col->offset * wd;
        uint8_t *dst = *vals + at * wd;
        int64_t n = s->p.n;
        switch (wd) {
        case 8: for (int64_t i = 0; i < n; i++) memcpy(dst + i * 8, src + rows[i] * 8, 8); break;
        case 4: for (int64_t i = 0; i < n; i++) memcpy(dst + i * 4, src + rows[i] * 4, 4); break;
        case 2: for (int64_t i = 0; i < n; i++) memcpy(dst + i * 2, src + rows[i] * 2, 2); break;
        default: for (int64_t i = 0; i < n; i++) dst[i] = src[rows[i]]; break;
        }
        if (col->validity) {
            for (int64_t i = 0; i < n; i++) {
                if (dbsp_bit(col->validity, col->offset + rows[i])) continue;
                if (!*valid) {
                    if (!(*valid = malloc((size_t)(total + 7) / 8 + 1))) return DBSP_ENOMEM;
                    memset(*valid, 0xFF, (size_t)(total + 7) / 8 + 1);
                }
                (*valid)[(at + i) >> 3] &= (uint8_t)~(1u << ((at + i) & 7));
            }
        }
        at += n;
    }
    return DBSP_OK;
}

int dbsp_join_linear_run(const DbspJoinLin *j, DbspJoinLinSide *sides, DbspLinRun *s, const int32_t *keys,
                         int32_t nkeys, const DbspAggSpec *specs, int32_t ns, DbspKeyIndex *ix, const int32_t *shown,
                         const int32_t *nonnull, const int32_t *avg, const int32_t *avg_lo, int32_t nout,
                         int out_keys, struct ArrowArray *batch, struct ArrowArray *out, int64_t **w, uint64_t **kh,
                         int64_t *n, int *ordered, int *distinct, const DbspKeyIndex *dirty, uint8_t **fresh,
                         int *served) {
    DbspColumn *ccols[2] = {NULL, NULL};
    DbspBatch a[2];
    Seg *segs = NULL;
    int32_t nseg = 0;
    int64_t total = 0;
    uint8_t *vals[64], *valid[64];
    DbspColumn jcols[64];
    int64_t *jw = NULL;
    int st = DBSP_OK, joining = 1;
    memset(a, 0, sizeof a);
    memset(vals, 0, sizeof vals);
    memset(valid, 0, sizeof valid);
    batch->release = NULL;
    out->release = NULL;
    *w = NULL; *kh = NULL; *n = 0; *ordered = 1; *distinct = 1; *served = 1;
    if (fresh) *fresh = NULL;
    for (int k = 0; k < 2; k++) {
        memset(&sides[k].out, 0, sizeof sides[k].out);
    }
    if (j->ng < 1 || j->ng > 64) return DBSP_EINVAL;
    int32_t room = sides[0].nb + sides[1].nb + 1;
    if (!(segs = calloc((size_t)room, sizeof *segs))) return DBSP_ENOMEM;
    /* invariant 2: db against L's batches, then da against R's batches and db */
    for (int k = 1; k >= 0; k--) {
        DbspJoinLinSide *sd = &sides[k];
        if (!sd->c) continue;
        const int32_t *ck = k ? j->rkeys : j->lkeys, *bk = k ? j->lkeys : j->rkeys;
        if ((st = index_side(sd, ck, j->nkeys, &ccols[k], &a[k])) != DBSP_OK) goto fail;
        if (sd->out.n == 0) continue;
        for (int32_t b = 0; b < sd->nb; b++)
            if ((st = pair_up(&a[k], sd->out.kh, ck, sd->bs[b], sd->bkh[b], sd->bfence[b],
                              sd->bdir ? sd->bdir[b] : NULL, bk, j->nkeys, k == 0, segs, &nseg)) != DBSP_OK)
                goto fail;
        if (k == 0 && sides[1].c && sides[1].out.n)
            if ((st = pair_up(&a[0], sd->out.kh, ck, &a[1], sides[1].out.kh, NULL, NULL, bk, j->nkeys, 1, segs, &nseg))
                != DBSP_OK)
                goto fail;
    }
    joining = 0;
    for (int32_t k = 0; k < nseg; k++) total += segs[k].p.n;
    if (total == 0) goto done;
    /* invariant 3: the joined batch */
    for (int32_t g = 0; g < j->ng; g++) {
        if ((st = gather_col(j, g, segs, nseg, total, &vals[g], &valid[g])) != DBSP_OK) goto fail;
        memset(&jcols[g], 0, sizeof jcols[g]);
        jcols[g].type = j->gtype[g];
        jcols[g].values = vals[g];
        jcols[g].validity = valid[g];
    }
    for (int32_t k = 0; k < j->nnn; k++) {  /* invariant 4: a null where the group-by sums or counts values */
        int32_t g = j->nonulls[k];
        if (g < 0 || g >= j->ng) { st = DBSP_EINVAL; goto fail; }
        if (valid[g]) { *served = 0; goto fail; }
    }
    if (!(jw = malloc((size_t)total * 8))) { st = DBSP_ENOMEM; goto fail; }
    int64_t at = 0;
    for (int32_t k = 0; k < nseg; k++) {
        memcpy(jw + at, segs[k].p.w, (size_t)segs[k].p.n * 8);
        at += segs[k].p.n;
    }
    DbspBatch jb = {.nrows = total, .ncols = j->ng, .cols = jcols, .weights = jw};
    st = dbsp_linear_run3(s, &jb, keys, nkeys, specs, ns, ix, shown, nonnull, avg, avg_lo, nout, out_keys, batch, out,
                          w, kh, n, ordered, distinct, dirty, fresh);
    if (st != DBSP_OK) goto fail;
done:
    for (int32_t k = 0; k < nseg; k++) dbsp_pairs_free(&segs[k].p);
    for (int32_t g = 0; g < 64; g++) { free(vals[g]); free(valid[g]); }
    free(segs); free(jw); free(ccols[0]); free(ccols[1]);
    return DBSP_OK;
fail:
    if (st == DBSP_EOVERFLOW && joining) {  /* a weight the join's own step raises, naming it (invariant 4) */
        *served = 0;
        st = DBSP_OK;
    }
    for (int32_t k = 0; k < nseg; k++) dbsp_pairs_free(&segs[k].p);
    for (int32_t g = 0; g < 64; g++) { free(vals[g]); free(valid[g]); }
    free(segs); free(jw); free(ccols[0]); free(ccols[1]);
    for (int k = 0; k < 2; k++) dbsp_join_run_free(&sides[k].out, 0);
    return st;
}
