/* gather.c: the rows of an Arrow-layout column at an index array, with software prefetch.
 *
 * Design notes:
 *  1. A consolidated batch is in canonical (hash) order, so materializing it gathers rows in random order: each
 *     row costs a cache miss per buffer, and variable width two dependent ones (offsets, then bytes). Every loop
 *     prefetches the row DIST indices ahead, so many misses are in flight at once instead of one or two.
 *  2. Variable width takes two calls: the first writes the output offsets and each row's source offset (the
 *     caller then allocates the bytes), the second reads the source offsets in order and copies the bytes,
 *     prefetched by source offset, so neither pass waits on a miss that depends on another miss. Values of up
 *     to 16 bytes are copied as one 16-byte move where both buffers have room (the output has 16 spare bytes).
 *  3. Output buffers come from the caller (the bindings take them from Arrow's memory pool, which reuses freed
 *     memory: fresh pages from the kernel cost more to fault in and zero than the gather itself).
 *  4. The result equals Arrow's take value for value (null slots of variable-width columns keep their bytes).
 */
#include <string.h>
#include "gather.h"
#include "status.h"

#define DIST 16  /* rows ahead whose cache lines are prefetched */

int dbsp_gather_check(const int64_t *idx, int64_t m, int64_t n) {
    uint64_t bad = 0;
    for (int64_t i = 0; i < m; i++) bad |= (uint64_t)idx[i] >= (uint64_t)n;
    return bad ? DBSP_EINVAL : DBSP_OK;
}

/* out bit i = bit (off + idx[i]) of src; returns the number of set bits */
static int64_t gather_bits(const uint8_t *src, int64_t off, const int64_t *idx, int64_t m, uint8_t *out) {
    int64_t ones = 0;
    uint8_t byte = 0;
    for (int64_t i = 0; i < m; i++) {
        if (i + DIST < m) __builtin_prefetch(src + ((off + idx[i + DIST]) >> 3));
        int64_t r = off + idx[i];
        byte |= (uint8_t)(((src[r >> 3] >> (r & 7)) & 1) << (i & 7));
        if ((i & 7) == 7 || i == m - 1) {
            out[i >> 3] = byte;
            ones += __builtin_popcount(byte);
            byte = 0;
        }
    }
    return ones;
}

#define GATHER_FIXED(T)                                                              \
    do {                                                                             \
        const T *s = (const T *)c->values + c->offset;                               \
        T *o = (T *)values;                                                          \
        int64_t i = 0;                                                               \
        for (; i + DIST < m; i++) {  /* (the last DIST rows: no prefetch, no test) */ \
            __builtin_prefetch(&s[idx[i + DIST]]);                                   \
            o[i] = s[idx[i]];                                                        \
        }                                                                            \
        for (; i < m; i++) o[i] = s[idx[i]];                                         \
    } while (0)

#define GATHER_OFFSETS(T, LIMIT)                                                     \
    do {                                                                             \
        const T *so = (const T *)c->values + c->offset;                              \
        T *oo = (T *)values;                                                         \
        int64_t acc = 0;                                                             \
        oo[0] = 0;                                                                   \
        for (int64_t i = 0; i < m; i++) {                                            \
            if (i + DIST < m) __builtin_prefetch(&so[idx[i + DIST]]);                \
            int64_t r = idx[i];                                                      \
            src[i] = (int64_t)so[r];                                                 \
            acc += (int64_t)so[r + 1] - (int64_t)so[r];                              \
            if (acc > (LIMIT)) return DBSP_ETOOBIG;                                  \
            oo[i + 1] = (T)acc;                                                      \
        }                                                                            \
        *data_bytes = acc;                                                           \
    } while (0)

int dbsp_gather_column(const DbspColumn *c, const int64_t *idx, int64_t m, uint8_t *validity, void *values,
                       int64_t *src, int64_t *null_count, int64_t *data_bytes) {
    int cls = dbsp_type_class(c->type);
    *null_count = 0;
    *data_bytes = 0;
    if (cls == 0) return DBSP_ETYPE;
    if (c->validity) *null_count = m - gather_bits(c->validity, c->offset, idx, m, validity);
    if (c->type == DBSP_BOOL) {
        gather_bits((const uint8_t *)c->values, c->offset, idx, m, (uint8_t *)values);
    } else if (cls == DBSP_CLASS_BYTES) {
        if (c->type == DBSP_LARGE_UTF8 || c->type == DBSP_LARGE_BINARY) GATHER_OFFSETS(int64_t, INT64_MAX);
        else GATHER_OFFSETS(int32_t, (int64_t)INT32_MAX);
    } else {
        switch (dbsp_type_width(c->type)) {
        case 1: GATHER_FIXED(uint8_t); break;
        case 2: GATHER_FIXED(uint16_t); break;
        case 4: GATHER_FIXED(uint32_t); break;
        default: GATHER_FIXED(uint64_t); break;
        }
    }
    return DBSP_OK;
}

#define GATHER_BYTES(T)                                                                        \
    do {                                                                                       \
        const T *so = (const T *)c->values + c->offset;                                        \
        const T *oo = (const T *)offsets;                                                      \
        const int64_t end = (int64_t)so[nrows] - 16;  /* values starting at or before: 16 readable bytes */ \
        for (int64_t i = 0; i < m; i++) {                                                      \
            if (i + DIST < m) __builtin_prefetch(c->data + src[i + DIST]);                     \
            int64_t len = (int64_t)(oo[i + 1] - oo[i]);                                        \
            if (len <= 16 && src[i] <= end) memcpy(data + oo[i], c->data + src[i], 16);        \
            else memcpy(data + oo[i], c->data + src[i], (size_t)len);                          \
        }                                                                                      \
    } while (0)

int dbsp_gather_data(const DbspColumn *c, int64_t nrows, int64_t m, const void *offsets, const int64_t *src,
                     uint8_t *data) {
    if (dbsp_type_class(c->type) != DBSP_CLASS_BYTES) return DBSP_ETYPE;
    if (c->type == DBSP_LARGE_UTF8 || c->type == DBSP_LARGE_BINARY) GATHER_BYTES(int64_t);
    else GATHER_BYTES(int32_t);
    return DBSP_OK;
}

/* out bits at .. at + m - 1 := bit (off + idx[i]) of src, or 1 each when src is NULL (a column without a validity
 * bitmap); the bits before `at` in its byte are kept; returns the number of set bits written */
static int64_t gather_bits_at(const uint8_t *src, int64_t off, const int64_t *idx, int64_t m, uint8_t *out,
                              int64_t at) {
    if (src && (at & 7) == 0) return gather_bits(src, off, idx, m, out + (at >> 3));
    int64_t ones = 0;
    for (int64_t i = 0; i < m; i++) {
        int bit = 1;
        if (src) {
            if (i + DIST < m) __builtin_prefetch(src + ((off + idx[i + DIST]) >> 3));
            int64_t r = off + idx[i];
            bit = (src[r >> 3] >> (r & 7)) & 1;
        }
        int64_t o = at + i;
        uint8_t mask = (uint8_t)(1u << (o & 7));
        out[o >> 3] = (uint8_t)(bit ? (out[o >> 3] | mask) : (out[o >> 3] & ~mask));
        ones += bit;
    }
    return ones;
}

#define GATHER_OFFSETS_AT(T, LIMIT)                                                  \
    do {                                                                             \
        const T *so = (const T *)c->values + c->offset;                              \
        T *oo = (T *)values + at;                                                    \
        int64_t *sr = src + at;                                                      \
        int64_t acc = base;                                                          \
        oo[0] = (T)base;                                                             \
        for (int64_t i = 0; i < m; i++) {                                            \
            if (i + DIST < m) __builtin_prefetch(&so[idx[i + DIST]]);                \
            int64_t r = idx[i];                                                      \
            sr[i] = (int64_t)so[r];                                                  \
            acc += (int64_t)so[r + 1] - (int64_t)so[r];                              \
            if (acc > (LIMIT)) return DBSP_ETOOBIG;                                  \
            oo[i + 1] = (T)acc;                                                      \
        }                                                                            \
        *data_bytes = acc - base;                                                    \
    } while (0)

int dbsp_gather_column_at(const DbspColumn *c, const int64_t *idx, int64_t m, int64_t at, int64_t base,
                          uint8_t *validity, void *values, int64_t *src, int64_t *null_count, int64_t *data_bytes) {
    int cls = dbsp_type_class(c->type);
    *null_count = 0;
    *data_bytes = 0;
    if (cls == 0) return DBSP_ETYPE;
    if (validity) *null_count = m - gather_bits_at(c->validity, c->offset, idx, m, validity, at);
    if (c->type == DBSP_BOOL) {
        gather_bits_at((const uint8_t *)c->values, c->offset, idx, m, (uint8_t *)values, at);
    } else if (cls == DBSP_CLASS_BYTES) {
        if (c->type == DBSP_LARGE_UTF8 || c->type == DBSP_LARGE_BINARY) GATHER_OFFSETS_AT(int64_t, INT64_MAX);
        else GATHER_OFFSETS_AT(int32_t, (int64_t)INT32_MAX);
    } else {
        int64_t width = dbsp_type_width(c->type);
        values = (uint8_t *)values + at * width;
        switch (width) {
        case 1: GATHER_FIXED(uint8_t); break;
        case 2: GATHER_FIXED(uint16_t); break;
        case 4: GATHER_FIXED(uint32_t); break;
        default: GATHER_FIXED(uint64_t); break;
        }
    }
    return DBSP_OK;
}
