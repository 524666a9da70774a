/* column.h: read-only views of Arrow-layout columns and batches, with inline value access, equality and order.
 *
 * Invariants (the kernels rely on them; the bindings establish them):
 *  1. A DbspColumn views one Arrow array of a supported type: `values` points at the fixed-width values
 *     (for DBSP_BOOL: the value bitmap; for variable width: the int32 or int64 offsets), `data` at the
 *     character data of variable-width types, `validity` at the validity bitmap or NULL when no value is null.
 *     `offset` is the Arrow array offset, applied to every buffer (bits for bitmaps, elements otherwise).
 *  2. Row identity follows Spark SQL: null equals null, -0.0 equals 0.0, NaN equals NaN.
 *  3. The total order used to break hash ties (dbsp_value_cmp) is: null first; integers by value;
 *     floats by value with -0.0 == 0.0 and NaN last; bytes lexicographically, shorter first on a common prefix.
 *  4. An Arrow decimal64(p, s) column is viewed as DBSP_INT64 over its unscaled values (value * 10^s): equality
 *     and order within one column type are the decimal's, and an integer sum of them is the exact unscaled sum.
 *     Its Arrow type (p, s) lives only in the schema the bindings keep, never in C.
 */
#ifndef DBSP_COLUMN_H
#define DBSP_COLUMN_H

#include <stdint.h>
#include <string.h>
#include <math.h>

typedef enum {
    DBSP_BOOL = 1,
    DBSP_INT8, DBSP_INT16, DBSP_INT32, DBSP_INT64,
    DBSP_UINT8, DBSP_UINT16, DBSP_UINT32, DBSP_UINT64,
    DBSP_FLOAT32, DBSP_FLOAT64,
    DBSP_DATE32, DBSP_TIMESTAMP,
    DBSP_UTF8, DBSP_LARGE_UTF8, DBSP_BINARY, DBSP_LARGE_BINARY,
    DBSP_TYPE_END
} DbspType;

typedef struct DbspColumn {
    int32_t type;            /* a DbspType */
    int64_t offset;          /* Arrow array offset */
    const uint8_t *validity; /* NULL = no nulls */
    const void *values;      /* fixed values, bool bitmap, or var-width offsets */
    const uint8_t *data;     /* var-width bytes */
} DbspColumn;

typedef struct DbspBatch {
    int64_t nrows;
    int32_t ncols;
    const DbspColumn *cols;
    const int64_t *weights;  /* nrows weights; NULL = every weight is +1 */
} DbspBatch;

/* value classes: how a type is hashed and compared */
enum { DBSP_CLASS_SIGNED = 1, DBSP_CLASS_UNSIGNED, DBSP_CLASS_FLOAT, DBSP_CLASS_BYTES };

static inline int dbsp_type_class(int32_t t) {
    switch (t) {
    case DBSP_BOOL: case DBSP_UINT8: case DBSP_UINT16: case DBSP_UINT32: case DBSP_UINT64:
        return DBSP_CLASS_UNSIGNED;
    case DBSP_INT8: case DBSP_INT16: case DBSP_INT32: case DBSP_INT64: case DBSP_DATE32: case DBSP_TIMESTAMP:
        return DBSP_CLASS_SIGNED;
    case DBSP_FLOAT32: case DBSP_FLOAT64:
        return DBSP_CLASS_FLOAT;
    case DBSP_UTF8: case DBSP_LARGE_UTF8: case DBSP_BINARY: case DBSP_LARGE_BINARY:
        return DBSP_CLASS_BYTES;
    default:
        return 0;
    }
}

/* width in bytes of a fixed-width type's serialized value (bool: 1); 0 for variable width */
static inline int dbsp_type_width(int32_t t) {
    switch (t) {
    case DBSP_BOOL: case DBSP_INT8: case DBSP_UINT8: return 1;
    case DBSP_INT16: case DBSP_UINT16: return 2;
    case DBSP_INT32: case DBSP_UINT32: case DBSP_DATE32: case DBSP_FLOAT32: return 4;
    case DBSP_INT64: case DBSP_UINT64: case DBSP_TIMESTAMP: case DBSP_FLOAT64: return 8;
    default: return 0;
    }
}

static inline int dbsp_bit(const uint8_t *bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1; }

static inline int dbsp_col_valid(const DbspColumn *c, int64_t i) {
    return c->validity == NULL || dbsp_bit(c->validity, c->offset + i);
}

/* the integer value of a signed/unsigned/bool column as 64 bits (sign- or zero-extended) */
static inline uint64_t dbsp_col_u64(const DbspColumn *c, int64_t i) {
    int64_t k = c->offset + i;
    switch (c->type) {
    case DBSP_BOOL: return (uint64_t)dbsp_bit((const uint8_t *)c->values, k);
    case DBSP_INT8: return (uint64_t)(int64_t)((const int8_t *)c->values)[k];
    case DBSP_INT16: return (uint64_t)(int64_t)((const int16_t *)c->values)[k];
    case DBSP_INT32: case DBSP_DATE32: return (uint64_t)(int64_t)((const int32_t *)c->values)[k];
    case DBSP_INT64: case DBSP_TIMESTAMP: return (uint64_t)((const int64_t *)c->values)[k];
    case DBSP_UINT8: return ((const uint8_t *)c->values)[k];
    case DBSP_UINT16: return ((const uint16_t *)c->values)[k];
    case DBSP_UINT32: return ((const uint32_t *)c->values)[k];
    case DBSP_UINT64: return ((const uint64_t *)c->values)[k];
    default: return 0;
    }
}

static inline double dbsp_col_f64(const DbspColumn *c, int64_t i) {
    int64_t k = c->offset + i;
    return c->type == DBSP_FLOAT32 ? (double)((const float *)c->values)[k] : ((const double *)c->values)[k];
}

/* canonical bits of a double: -0.0 -> 0.0, every NaN -> one quiet NaN */
static inline uint64_t dbsp_canon_f64_bits(double d) {
    uint64_t u;
    if (d == 0.0) return 0;
    if (d != d) return 0x7ff8000000000000ULL;
    memcpy(&u, &d, 8);
    return u;
}

static inline const uint8_t *dbsp_col_bytes(const DbspColumn *c, int64_t i, int64_t *len) {
    int64_t k = c->offset + i;
    if (c->type == DBSP_LARGE_UTF8 || c->type == DBSP_LARGE_BINARY) {
        const int64_t *o = (const int64_t *)c->values;
        *len = o[k + 1] - o[k];
        return c->data + o[k];
    } else {
        const int32_t *o = (const int32_t *)c->values;
        *len = (int64_t)o[k + 1] - o[k];
        return c->data + o[k];
    }
}

static inline int dbsp_cmp_u64(uint64_t a, uint64_t b) { return a < b ? -1 : a > b; }
static inline int dbsp_cmp_i64(int64_t a, int64_t b) { return a < b ? -1 : a > b; }

static inline int dbsp_cmp_f64(double a, double b) {
    int an = a != a, bn = b != b;
    if (an || bn) return an - bn;  /* NaN last, NaN == NaN */
    return a < b ? -1 : a > b;     /* -0.0 == 0.0 */
}

/* Compare value i of column a with value j of column b (same value class) in the order of invariant 3. */
static inline int dbsp_value_cmp(const DbspColumn *a, int64_t i, const DbspColumn *b, int64_t j) {
    int va = dbsp_col_valid(a, i), vb = dbsp_col_valid(b, j);
    if (!va || !vb) return va - vb;
    switch (dbsp_type_class(a->type)) {
    case DBSP_CLASS_SIGNED:
        if (dbsp_type_class(b->type) == DBSP_CLASS_UNSIGNED) {
            int64_t x = (int64_t)dbsp_col_u64(a, i);
            uint64_t y = dbsp_col_u64(b, j);
            return x < 0 ? -1 : dbsp_cmp_u64((uint64_t)x, y);
        }
        return dbsp_cmp_i64((int64_t)dbsp_col_u64(a, i), (int64_t)dbsp_col_u64(b, j));
    case DBSP_CLASS_UNSIGNED:
        if (dbsp_type_class(b->type) == DBSP_CLASS_SIGNED) return -dbsp_value_cmp(b, j, a, i);
        return dbsp_cmp_u64(dbsp_col_u64(a, i), dbsp_col_u64(b, j));
    case DBSP_CLASS_FLOAT:
        return dbsp_cmp_f64(dbsp_col_f64(a, i), dbsp_col_f64(b, j));
    case DBSP_CLASS_BYTES: {
        int64_t la, lb;
        const uint8_t *pa = dbsp_col_bytes(a, i, &la), *pb = dbsp_col_bytes(b, j, &lb);
        int64_t m = la < lb ? la : lb;
        int r = m ? memcmp(pa, pb, (size_t)m) : 0;
        if (r) return r < 0 ? -1 : 1;
        return dbsp_cmp_i64(la, lb);
    }
    default:
        return 0;
    }
}

/* Compare rows over the listed columns of each batch (acols[k] of a against bcols[k] of b). */
static inline int dbsp_row_cmp(const DbspBatch *a, int64_t i, const int32_t *acols,
                               const DbspBatch *b, int64_t j, const int32_t *bcols, int32_t ncols) {
    for (int32_t k = 0; k < ncols; k++) {
        int r = dbsp_value_cmp(&a->cols[acols ? acols[k] : k], i, &b->cols[bcols ? bcols[k] : k], j);
        if (r) return r;
    }
    return 0;
}

/* 1 if value i of x and value j of y (one fixed-width type of width wd, 1, 2, 4 or 8) have the same bits */
static inline int dbsp_same_bits(const DbspColumn *x, int64_t i, const DbspColumn *y, int64_t j, int wd) {
    int64_t a = x->offset + i, b = y->offset + j;
    switch (wd) {
    case 8: return ((const uint64_t *)x->values)[a] == ((const uint64_t *)y->values)[b];
    case 4: return ((const uint32_t *)x->values)[a] == ((const uint32_t *)y->values)[b];
    case 2: return ((const uint16_t *)x->values)[a] == ((const uint16_t *)y->values)[b];
    default: return ((const uint8_t *)x->values)[a] == ((const uint8_t *)y->values)[b];
    }
}

/* dbsp_row_cmp, quicker where the rows are equal (a tie of hashes, a probe that finds its key): a column whose
 * values are bit-identical (one fixed-width type, both valid or both null) is equal without the type-general
 * comparison; any other column is compared by value. */
static inline int dbsp_row_cmp_eqfast(const DbspBatch *a, int64_t i, const int32_t *acols,
                                      const DbspBatch *b, int64_t j, const int32_t *bcols, int32_t ncols) {
    for (int32_t k = 0; k < ncols; k++) {
        const DbspColumn *x = &a->cols[acols ? acols[k] : k], *y = &b->cols[bcols ? bcols[k] : k];
        if (x->type == y->type && x->type != DBSP_BOOL) {
            int wd = dbsp_type_width(x->type);
            if (wd) {
                int vx = dbsp_col_valid(x, i);
                if (vx == dbsp_col_valid(y, j) && (!vx || dbsp_same_bits(x, i, y, j, wd))) continue;
            }
        }
        int r = dbsp_value_cmp(x, i, y, j);
        if (r) return r;
    }
    return 0;
}

#endif
