/* agg.h: weight-aware aggregate accumulators shared by the indexed reduce and the hash group kernel.
 *
 * Laws (per group; w is a row's weight, v its value, nulls skipped except by COUNT):
 *   COUNT = sum(w); COUNT_COL = sum(w | v not null); SUM = sum(v * w) (overflow-checked for integers, null when
 *   no value is non-null); MIN/MAX = the extreme v over rows with w > 0, the first such row on ties.
 * Integer sums are exact (rows.h dbsp_add_exact): DBSP_EOVERFLOW when a group's sum does not fit in int64
 * (dbsp_acc_check), never for a partial sum, so whether a sum overflows does not depend on the row order.
 */
#ifndef DBSP_AGG_H
#define DBSP_AGG_H

#include <stdint.h>
#include "column.h"
#include "rows.h"
#include "status.h"

enum { DBSP_AGG_COUNT = 1, DBSP_AGG_COUNT_COL, DBSP_AGG_SUM, DBSP_AGG_MIN, DBSP_AGG_MAX };

typedef struct DbspAggSpec { int32_t kind; int32_t col; } DbspAggSpec;

/* one aggregate's running state */
typedef struct DbspAcc {
    int64_t i;      /* COUNT, COUNT_COL, integer SUM */
    double f;       /* float SUM */
    uint64_t best;  /* MIN/MAX of numeric columns: the best value's bits (class of the column) */
    int64_t row;    /* MIN/MAX: the row holding the best value, -1 if none */
    uint8_t valid;
    int32_t carry;  /* COUNT, COUNT_COL, integer SUM: wraps of i (rows.h dbsp_add_exact); 0 when i is the sum */
} DbspAcc;

/* a value as the accumulators see it: integers as 64 bits, floats as double bits */
typedef struct DbspAggValue { uint64_t bits; int valid; } DbspAggValue;

static inline void dbsp_acc_init(DbspAcc *a, int32_t kind) {
    a->i = 0; a->f = 0.0; a->best = 0; a->row = -1; a->carry = 0;
    a->valid = kind == DBSP_AGG_COUNT || kind == DBSP_AGG_COUNT_COL;
}

static inline DbspAggValue dbsp_agg_value(const DbspColumn *c, int64_t r) {
    DbspAggValue v = { 0, dbsp_col_valid(c, r) };
    if (!v.valid) return v;
    int cls = dbsp_type_class(c->type);
    if (cls == DBSP_CLASS_FLOAT) { double d = dbsp_col_f64(c, r); memcpy(&v.bits, &d, 8); }
    else if (cls != DBSP_CLASS_BYTES) v.bits = dbsp_col_u64(c, r);
    return v;
}

/* fold row r (value v of column c, weight w) into a */
static inline int dbsp_acc_fold(DbspAcc *a, int32_t kind, const DbspColumn *c, int64_t r, DbspAggValue v, int64_t w) {
    switch (kind) {
    case DBSP_AGG_COUNT:
        dbsp_add_exact(&a->i, w, &a->carry);
        return DBSP_OK;
    case DBSP_AGG_COUNT_COL:
        if (v.valid) dbsp_add_exact(&a->i, w, &a->carry);
        return DBSP_OK;
    case DBSP_AGG_SUM: {
        if (!v.valid) return DBSP_OK;
        a->valid = 1;
        int cls = dbsp_type_class(c->type);
        if (cls == DBSP_CLASS_FLOAT) { double d; memcpy(&d, &v.bits, 8); a->f += d * (double)w; return DBSP_OK; }
        if (cls == DBSP_CLASS_UNSIGNED && v.bits > (uint64_t)INT64_MAX) return DBSP_EOVERFLOW;
        int64_t p;
        if (__builtin_mul_overflow((int64_t)v.bits, w, &p)) return DBSP_EOVERFLOW;
        dbsp_add_exact(&a->i, p, &a->carry);
        return DBSP_OK;
    }
    case DBSP_AGG_MIN: case DBSP_AGG_MAX: {
        if (w <= 0 || !v.valid) return DBSP_OK;
        if (a->row >= 0) {
            int cmp;
            switch (dbsp_type_class(c->type)) {
            case DBSP_CLASS_SIGNED: cmp = dbsp_cmp_i64((int64_t)v.bits, (int64_t)a->best); break;
            case DBSP_CLASS_UNSIGNED: cmp = dbsp_cmp_u64(v.bits, a->best); break;
            case DBSP_CLASS_FLOAT: { double x, y; memcpy(&x, &v.bits, 8); memcpy(&y, &a->best, 8); cmp = dbsp_cmp_f64(x, y); break; }
            default: cmp = dbsp_value_cmp(c, r, c, a->row);
            }
            if (!(kind == DBSP_AGG_MIN ? cmp < 0 : cmp > 0)) return DBSP_OK;
        }
        a->best = v.bits; a->row = r; a->valid = 1;
        return DBSP_OK;
    }
    default:
        return DBSP_EINVAL;
    }
}

/* validate aggregate specs against a batch */
static inline int dbsp_aggs_check(const DbspBatch *b, const DbspAggSpec *aggs, int32_t naggs) {
    for (int32_t k = 0; k < naggs; k++) {
        if (aggs[k].kind < DBSP_AGG_COUNT || aggs[k].kind > DBSP_AGG_MAX) return DBSP_EINVAL;
        if (aggs[k].kind == DBSP_AGG_COUNT) continue;
        if (aggs[k].col < 0 || aggs[k].col >= b->ncols) return DBSP_EINVAL;
        if (aggs[k].kind == DBSP_AGG_SUM && dbsp_type_class(b->cols[aggs[k].col].type) == DBSP_CLASS_BYTES) return DBSP_ETYPE;
    }
    return DBSP_OK;
}

/* DBSP_EOVERFLOW if a finished accumulator's integer sum does not fit in int64. */
static inline int dbsp_acc_check(const DbspAcc *a) { return a->carry ? DBSP_EOVERFLOW : DBSP_OK; }
#endif
