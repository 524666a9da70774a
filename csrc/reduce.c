/* reduce.c: grouped aggregation, over an index (runs of equal key hash, split by key value on collisions) or by
 * the hash grouping engine; both fold rows with the accumulators of agg.h. */
#include <stdlib.h>
#include <string.h>
#include "reduce.h"
#include "group.h"
#include "status.h"

void dbsp_reduce_free(DbspReduceOut *r) {
    free(r->group_row); free(r->khash); free(r->ivals); free(r->fvals); free(r->valid);
    memset(r, 0, sizeof *r);
}

static int alloc_out(DbspReduceOut *o, int64_t ngroups, int32_t naggs) {
    size_t g = (size_t)(ngroups ? ngroups : 1), k = (size_t)(naggs ? naggs : 1);
    o->naggs = naggs;
    o->group_row = malloc(g * 8);
    o->khash = malloc(g * 8);
    o->ivals = malloc(g * k * 8);
    o->fvals = malloc(g * k * 8);
    o->valid = malloc(g * k);
    if (!o->group_row || !o->khash || !o->ivals || !o->fvals || !o->valid) { dbsp_reduce_free(o); return DBSP_ENOMEM; }
    o->cap = ngroups;
    return DBSP_OK;
}

/* write the accumulators of `ngroups` groups into the result arrays; DBSP_EOVERFLOW if a sum does not fit */
static int export_accs(const DbspAcc *acc, int64_t ngroups, const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *o) {
    for (int64_t g = 0; g < ngroups; g++)
        for (int32_t k = 0; k < naggs; k++) {
            const DbspAcc *a = &acc[g * naggs + k];
            int64_t at = g * naggs + k;
            if (dbsp_acc_check(a)) return DBSP_EOVERFLOW;
            int minmax = aggs[k].kind == DBSP_AGG_MIN || aggs[k].kind == DBSP_AGG_MAX;
            o->ivals[at] = minmax ? a->row : a->i;
            o->fvals[at] = a->f;
            o->valid[at] = a->valid;
        }
    return DBSP_OK;
}

int dbsp_reduce(const DbspBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys,
                const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out) {
    memset(out, 0, sizeof *out);
    int st = dbsp_aggs_check(b, aggs, naggs);
    if (st) return st;
    int64_t n = b->nrows, ng = 0, acap = 0;
    const int64_t *wts = b->weights;
    int64_t *lead = malloc((size_t)(n ? n : 1) * 8);  /* first row of each group, in output order */
    DbspAcc *acc = NULL;
    if (!lead) return DBSP_ENOMEM;
    for (int64_t s = 0; s < n;) {
        int64_t e = s + 1;
        while (e < n && kh[e] == kh[s]) e++;
        int64_t g0 = ng;
        for (int64_t r = s; r < e; r++) {
            /* a run of one key hash is almost always one key; compare with each group opened in this run */
            int64_t g = g0;
            while (g < ng && dbsp_row_cmp(b, r, keys, b, lead[g], keys, nkeys) != 0) g++;
            if (g == ng) {
                if ((ng + 1) * naggs > acap) {
                    int64_t c = acap ? acap * 2 : 1024;
                    while (c < (ng + 1) * naggs) c *= 2;
                    DbspAcc *a2 = realloc(acc, (size_t)c * sizeof(DbspAcc));
                    if (!a2) { st = DBSP_ENOMEM; goto done; }
                    acc = a2; acap = c;
                }
                lead[ng] = r;
                for (int32_t k = 0; k < naggs; k++) dbsp_acc_init(&acc[ng * naggs + k], aggs[k].kind);
                ng++;
            }
            for (int32_t k = 0; k < naggs; k++) {
                const DbspColumn *c = aggs[k].kind == DBSP_AGG_COUNT ? NULL : &b->cols[aggs[k].col];
                DbspAggValue v = c ? dbsp_agg_value(c, r) : (DbspAggValue){ 0, 0 };
                if ((st = dbsp_acc_fold(&acc[g * naggs + k], aggs[k].kind, c, r, v, wts ? wts[r] : 1))) goto done;
            }
        }
        s = e;
    }
    if ((st = alloc_out(out, ng, naggs))) goto done;
    out->ngroups = ng;
    for (int64_t g = 0; g < ng; g++) { out->group_row[g] = lead[g]; out->khash[g] = (int64_t)kh[lead[g]]; }
    st = export_accs(acc, ng, aggs, naggs, out);
done:
    free(lead); free(acc);
    if (st) dbsp_reduce_free(out);
    return st;
}

static int group_reduce(const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                        const DbspAggSpec *aggs, int32_t naggs, int drop_zero, DbspReduceOut *out) {
    memset(out, 0, sizeof *out);
    DbspRows rows;
    DbspAcc *acc = NULL;
    int st;
    if (naggs > 0 && dbsp_aggs_check(b, aggs, naggs) == DBSP_OK && dbsp_group_int_applies(b, keys, nkeys, NULL, 0, aggs, naggs)) {
        /* one integer key, COUNT and int64 SUM: group_int.c writes the results in place */
        int64_t *ivals = NULL;
        st = dbsp_group_int(b, keys, aggs, naggs, drop_zero, &rows, &ivals);
        if (st == DBSP_OK && rows.n == 0) {
            dbsp_rows_free(&rows);
            free(ivals);
            return alloc_out(out, 0, naggs);
        }
        if (st == DBSP_OK) {
            out->naggs = naggs;
            out->ngroups = out->cap = rows.n;
            out->group_row = rows.idx;
            out->khash = (int64_t *)rows.khash;
            out->ivals = ivals;
            free(rows.weights);
            size_t g = (size_t)(rows.n ? rows.n : 1), k = (size_t)naggs;
            out->fvals = calloc(g * k, 8);
            out->valid = malloc(g * k);
            if (!out->group_row || !out->khash || !out->ivals || !out->fvals || !out->valid) {
                dbsp_reduce_free(out);
                return DBSP_ENOMEM;
            }
            memset(out->valid, 1, g * k);
            return DBSP_OK;
        }
        if (st != DBSP_GROUP_INT_NO) return st;
    }
    st = dbsp_group(b, keys, nkeys, NULL, 0, aggs, naggs, drop_zero, &rows, naggs ? &acc : NULL);
    if (st) return st;
    if ((st = alloc_out(out, rows.n, naggs))) goto done;
    out->ngroups = rows.n;
    if (rows.n) {
        memcpy(out->group_row, rows.idx, (size_t)rows.n * 8);
        memcpy(out->khash, rows.khash, (size_t)rows.n * 8);
    }
    st = export_accs(acc, rows.n, aggs, naggs, out);
done:
    dbsp_rows_free(&rows);
    free(acc);
    if (st) dbsp_reduce_free(out);
    return st;
}

int dbsp_group_reduce(const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                      const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out) {
    return group_reduce(b, keys, nkeys, aggs, naggs, 1, out);
}

int dbsp_group_reduce_all(const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                          const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out) {
    return group_reduce(b, keys, nkeys, aggs, naggs, 0, out);
}
