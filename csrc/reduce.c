/* reduce.c: grouped aggregation over runs of equal key hash, split by key value when hashes collide. */
#include <stdlib.h>
#include <string.h>
#include "reduce.h"
#include "status.h"

void dbsp_reduce_free(DbspReduceOut *r) {
    free(r->group_row); free(r->ivals); free(r->fvals); free(r->valid);
    memset(r, 0, sizeof *r);
}

static int reserve_groups(DbspReduceOut *o, int64_t extra) {
    if (o->ngroups + extra <= o->cap) return DBSP_OK;
    int64_t cap = o->cap ? o->cap : 64;
    while (cap < o->ngroups + extra) cap *= 2;
    size_t na = (size_t)(o->naggs ? o->naggs : 1);
    int64_t *g = realloc(o->group_row, (size_t)cap * 8); if (!g) return DBSP_ENOMEM; o->group_row = g;
    int64_t *iv = realloc(o->ivals, (size_t)cap * na * 8); if (!iv) return DBSP_ENOMEM; o->ivals = iv;
    double *fv = realloc(o->fvals, (size_t)cap * na * 8); if (!fv) return DBSP_ENOMEM; o->fvals = fv;
    uint8_t *v = realloc(o->valid, (size_t)cap * na); if (!v) return DBSP_ENOMEM; o->valid = v;
    o->cap = cap;
    return DBSP_OK;
}

/* fold row r (weight w) into the accumulators of group g */
static int fold(const DbspBatch *b, const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *o, int64_t g,
                int64_t r, int64_t w) {
    for (int32_t k = 0; k < naggs; k++) {
        int64_t at = g * naggs + k;
        const DbspColumn *c = aggs[k].kind == DBSP_AGG_COUNT ? NULL : &b->cols[aggs[k].col];
        switch (aggs[k].kind) {
        case DBSP_AGG_COUNT:
            if (__builtin_add_overflow(o->ivals[at], w, &o->ivals[at])) return DBSP_EOVERFLOW;
            break;
        case DBSP_AGG_COUNT_COL:
            if (dbsp_col_valid(c, r) && __builtin_add_overflow(o->ivals[at], w, &o->ivals[at])) return DBSP_EOVERFLOW;
            break;
        case DBSP_AGG_SUM:
            if (!dbsp_col_valid(c, r)) break;
            o->valid[at] = 1;
            if (dbsp_type_class(c->type) == DBSP_CLASS_FLOAT) {
                o->fvals[at] += dbsp_col_f64(c, r) * (double)w;
            } else {
                uint64_t u = dbsp_col_u64(c, r);
                if (dbsp_type_class(c->type) == DBSP_CLASS_UNSIGNED && u > (uint64_t)INT64_MAX) return DBSP_EOVERFLOW;
                int64_t p;
                if (__builtin_mul_overflow((int64_t)u, w, &p) || __builtin_add_overflow(o->ivals[at], p, &o->ivals[at]))
                    return DBSP_EOVERFLOW;
            }
            break;
        case DBSP_AGG_MIN: case DBSP_AGG_MAX:
            if (w <= 0 || !dbsp_col_valid(c, r)) break;
            if (o->ivals[at] < 0) { o->ivals[at] = r; o->valid[at] = 1; break; }
            {
                int cmp = dbsp_value_cmp(c, r, c, o->ivals[at]);
                if (aggs[k].kind == DBSP_AGG_MIN ? cmp < 0 : cmp > 0) o->ivals[at] = r;
            }
            break;
        default:
            return DBSP_EINVAL;
        }
    }
    return DBSP_OK;
}

static int open_group(const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *o, int64_t leader) {
    int st = reserve_groups(o, 1);
    if (st) return st;
    int64_t g = o->ngroups++;
    o->group_row[g] = leader;
    for (int32_t k = 0; k < naggs; k++) {
        int64_t at = g * naggs + k;
        int minmax = aggs[k].kind == DBSP_AGG_MIN || aggs[k].kind == DBSP_AGG_MAX;
        o->ivals[at] = minmax ? -1 : 0;
        o->fvals[at] = 0.0;
        o->valid[at] = aggs[k].kind == DBSP_AGG_COUNT || aggs[k].kind == DBSP_AGG_COUNT_COL;
    }
    return DBSP_OK;
}

int dbsp_reduce(const DbspBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys,
                const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out) {
    memset(out, 0, sizeof *out);
    out->naggs = naggs;
    for (int32_t k = 0; k < naggs; k++) {
        if (aggs[k].kind < DBSP_AGG_COUNT || aggs[k].kind > DBSP_AGG_MAX) return DBSP_EINVAL;
        if (aggs[k].kind == DBSP_AGG_COUNT) continue;
        if (aggs[k].col < 0 || aggs[k].col >= b->ncols) return DBSP_EINVAL;
        if (aggs[k].kind == DBSP_AGG_SUM && dbsp_type_class(b->cols[aggs[k].col].type) == DBSP_CLASS_BYTES) return DBSP_ETYPE;
    }
    int st = DBSP_OK;
    const int64_t *wts = b->weights;
    int64_t n = b->nrows, s = 0;
    while (s < n) {
        int64_t e = s + 1;
        while (e < n && kh[e] == kh[s]) e++;
        int64_t g0 = out->ngroups;
        if ((st = open_group(aggs, naggs, out, s))) goto fail;
        for (int64_t r = s; r < e; r++) {
            int64_t g = g0;
            /* a run of one key hash is almost always one key; compare with each group opened in this run */
            while (g < out->ngroups && dbsp_row_cmp(b, r, keys, b, out->group_row[g], keys, nkeys) != 0) g++;
            if (g == out->ngroups && (st = open_group(aggs, naggs, out, r))) goto fail;
            if ((st = fold(b, aggs, naggs, out, g, r, wts ? wts[r] : 1))) goto fail;
        }
        s = e;
    }
    return DBSP_OK;
fail:
    dbsp_reduce_free(out);
    return st;
}
