/* hash.c: the DBSP hash, version 1 (specified in hash.h), computed column by column. */
#include "hash.h"
#include "status.h"

#define H_NULL DBSP_HASH_NULL
#define S_INT DBSP_HASH_S_INT
#define S_FLOAT DBSP_HASH_S_FLOAT
#define S_BYTES DBSP_HASH_S_BYTES
#define ROW_SEED DBSP_HASH_ROW_SEED
#define K_GOLD DBSP_HASH_K_GOLD
#define mix dbsp_mix

uint64_t dbsp_hash_mix(uint64_t z) { return mix(z); }

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static inline uint64_t hash_bytes(const uint8_t *p, int64_t len) {
    uint64_t h = mix((uint64_t)len ^ S_BYTES);
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) h = mix(h ^ load_le64(p + k)) * K_GOLD;
    if (k < len) {
        uint64_t w = 0;
        for (int64_t t = 0; k + t < len; t++) w |= (uint64_t)p[k + t] << (8 * t);
        h = mix(h ^ w) * K_GOLD;
    }
    return mix(h);
}

uint64_t dbsp_hash_value(const DbspColumn *c, int64_t i) {
    if (!dbsp_col_valid(c, i)) return mix(H_NULL);
    switch (dbsp_type_class(c->type)) {
    case DBSP_CLASS_SIGNED: case DBSP_CLASS_UNSIGNED:
        return mix(dbsp_col_u64(c, i) ^ S_INT);
    case DBSP_CLASS_FLOAT:
        return mix(dbsp_canon_f64_bits(dbsp_col_f64(c, i)) ^ S_FLOAT);
    default: {
        int64_t len;
        const uint8_t *p = dbsp_col_bytes(c, i, &len);
        return hash_bytes(p, len);
    }
    }
}

#define COMBINE(acc, v) (acc) = mix((acc) * K_GOLD + (v))

/* fold one column into out[], with the type switch hoisted out of the row loop */
static int fold_column(const DbspColumn *c, int64_t n, uint64_t *out) {
    const uint64_t hnull = mix(H_NULL);
    int64_t o = c->offset;
    if (c->validity) {
        for (int64_t i = 0; i < n; i++) {
            uint64_t v = dbsp_col_valid(c, i) ? dbsp_hash_value(c, i) : hnull;
            COMBINE(out[i], v);
        }
        return DBSP_OK;
    }
    switch (c->type) {
    case DBSP_INT64: case DBSP_TIMESTAMP: case DBSP_UINT64: {
        const uint64_t *v = (const uint64_t *)c->values + o;
        for (int64_t i = 0; i < n; i++) COMBINE(out[i], mix(v[i] ^ S_INT));
        break;
    }
    case DBSP_INT32: case DBSP_DATE32: {
        const int32_t *v = (const int32_t *)c->values + o;
        for (int64_t i = 0; i < n; i++) COMBINE(out[i], mix((uint64_t)(int64_t)v[i] ^ S_INT));
        break;
    }
    case DBSP_FLOAT64: {
        const double *v = (const double *)c->values + o;
        for (int64_t i = 0; i < n; i++) COMBINE(out[i], mix(dbsp_canon_f64_bits(v[i]) ^ S_FLOAT));
        break;
    }
    case DBSP_UTF8: case DBSP_BINARY: {
        const int32_t *off = (const int32_t *)c->values + o;
        for (int64_t i = 0; i < n; i++) COMBINE(out[i], hash_bytes(c->data + off[i], (int64_t)off[i + 1] - off[i]));
        break;
    }
    default:
        if (dbsp_type_class(c->type) == 0) return DBSP_ETYPE;
        for (int64_t i = 0; i < n; i++) COMBINE(out[i], dbsp_hash_value(c, i));
    }
    return DBSP_OK;
}

int dbsp_hash_columns(const DbspBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out) {
    if (!cols) ncols = b->ncols;
    for (int64_t i = 0; i < b->nrows; i++) out[i] = ROW_SEED;
    for (int32_t k = 0; k < ncols; k++) {
        int32_t ci = cols ? cols[k] : k;
        if (ci < 0 || ci >= b->ncols) return DBSP_EINVAL;
        int st = fold_column(&b->cols[ci], b->nrows, out);
        if (st) return st;
    }
    return DBSP_OK;
}

uint64_t dbsp_hash_row(const DbspBatch *b, int64_t i, const int32_t *cols, int32_t ncols) {
    if (!cols) ncols = b->ncols;
    uint64_t h = ROW_SEED;
    for (int32_t k = 0; k < ncols; k++) COMBINE(h, dbsp_hash_value(&b->cols[cols ? cols[k] : k], i));
    return h;
}
