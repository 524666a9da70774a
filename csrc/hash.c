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

static inline uint64_t load_le32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap32(w);
#endif
    return w;
}

/* The r (1..7) bytes at p as a little-endian word, zero-padded, reading only those bytes: two overlapping 4-byte
 * loads (r >= 4) or three byte loads (r < 4), instead of a loop per byte (same value: the specification's final
 * partial word). */
static inline uint64_t load_short(const uint8_t *p, int64_t r) {
    if (r >= 4) return load_le32(p) | (load_le32(p + r - 4) << (8 * (r - 4)));
    return (uint64_t)p[0] | ((uint64_t)p[r >> 1] << (8 * (r >> 1))) | ((uint64_t)p[r - 1] << (8 * (r - 1)));
}

/* hash_bytes from word k on, h being the state after the words before k */
static inline uint64_t hash_bytes_from(uint64_t h, const uint8_t *p, int64_t len, int64_t k) {
    for (; k + 8 <= len; k += 8) h = mix(h ^ load_le64(p + k)) * K_GOLD;
    int64_t r = len - k;
    if (r > 0) {  /* the partial word: the last 8 bytes of the value shifted down when it has 8, else its r */
        uint64_t w = len >= 8 ? load_le64(p + len - 8) >> (8 * (8 - r)) : load_short(p, r);
        h = mix(h ^ w) * K_GOLD;
    }
    return mix(h);
}

static inline uint64_t hash_bytes(const uint8_t *p, int64_t len) {
    return hash_bytes_from(mix((uint64_t)len ^ S_BYTES), p, len, 0);
}

/* hash_bytes of two values at once: their common full words in one loop, so the two chains of dependent
 * multiplies overlap (a value's words are folded one after the other: a long string waits on each mix) */
static inline void hash_bytes2(const uint8_t *p, int64_t len, const uint8_t *q, int64_t qlen, uint64_t *hp,
                               uint64_t *hq) {
    uint64_t a = mix((uint64_t)len ^ S_BYTES), b = mix((uint64_t)qlen ^ S_BYTES);
    int64_t both = (len < qlen ? len : qlen) & ~(int64_t)7, k = 0;
    for (; k < both; k += 8) {
        a = mix(a ^ load_le64(p + k)) * K_GOLD;
        b = mix(b ^ load_le64(q + k)) * K_GOLD;
    }
    *hp = hash_bytes_from(a, p, len, k);
    *hq = hash_bytes_from(b, q, qlen, k);
}

/* hash_bytes of four values at once (as hash_bytes2) */
static inline void hash_bytes4(const uint8_t *const *p, const int64_t *len, uint64_t *h) {
    uint64_t a = mix((uint64_t)len[0] ^ S_BYTES), b = mix((uint64_t)len[1] ^ S_BYTES);
    uint64_t c = mix((uint64_t)len[2] ^ S_BYTES), d = mix((uint64_t)len[3] ^ S_BYTES);
    int64_t both = len[0];
    for (int j = 1; j < 4; j++) both = len[j] < both ? len[j] : both;
    both &= ~(int64_t)7;
    int64_t k = 0;
    for (; k < both; k += 8) {
        a = mix(a ^ load_le64(p[0] + k)) * K_GOLD;
        b = mix(b ^ load_le64(p[1] + k)) * K_GOLD;
        c = mix(c ^ load_le64(p[2] + k)) * K_GOLD;
        d = mix(d ^ load_le64(p[3] + k)) * K_GOLD;
    }
    h[0] = hash_bytes_from(a, p[0], len[0], k);
    h[1] = hash_bytes_from(b, p[1], len[1], k);
    h[2] = hash_bytes_from(c, p[2], len[2], k);
    h[3] = hash_bytes_from(d, p[3], len[3], k);
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
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {  /* four rows at a time (hash_bytes4) */
            const uint8_t *p[4];
            int64_t len[4];
            uint64_t h[4];
            for (int j = 0; j < 4; j++) {
                p[j] = c->data + off[i + j];
                len[j] = (int64_t)off[i + j + 1] - off[i + j];
            }
            hash_bytes4(p, len, h);
            for (int j = 0; j < 4; j++) COMBINE(out[i + j], h[j]);
        }
        for (; i + 2 <= n; i += 2) {  /* two rows at a time (hash_bytes2) */
            uint64_t a, b;
            hash_bytes2(c->data + off[i], (int64_t)off[i + 1] - off[i], c->data + off[i + 1],
                        (int64_t)off[i + 2] - off[i + 1], &a, &b);
            COMBINE(out[i], a);
            COMBINE(out[i + 1], b);
        }
        for (; i < n; i++) COMBINE(out[i], hash_bytes(c->data + off[i], (int64_t)off[i + 1] - off[i]));
        break;
    }
    default:
        if (dbsp_type_class(c->type) == 0) return DBSP_ETYPE;
        for (int64_t i = 0; i < n; i++) COMBINE(out[i], dbsp_hash_value(c, i));
    }
    return DBSP_OK;
}

int dbsp_hash_columns(const DbspBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out) {
    for (int64_t i = 0; i < b->nrows; i++) out[i] = ROW_SEED;
    return dbsp_hash_columns_more(b, cols, ncols, out);
}

int dbsp_hash_columns_more(const DbspBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out) {
    if (!cols) ncols = b->ncols;
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
