/* hash.h: the DBSP row/key hash, version 1: a 64-bit hash that decides shard placement, so it never changes within a version.
 *
 * Specification of version 1 (stable across processes, machines, Python hash seeds and byte orders):
 *   mix(z)   = splitmix64 finalizer: z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27;
 *              z *= 0x94d049bb133111eb; z ^= z >> 31.
 *   value hash v(x):
 *     null                         -> mix(0x9ae16a3b2f90404f)
 *     integer class (bool, int*, uint*, date32, timestamp): u = the value as 64 bits, sign-extended for
 *                                     signed types, zero-extended for unsigned -> mix(u ^ 0x243f6a8885a308d3)
 *                                     (so int32 5 and int64 5 hash alike, which lets join keys differ in width)
 *     float class (float32 widened to float64 exactly): b = the IEEE-754 bits after -0.0 -> 0.0 and every
 *                                     NaN -> 0x7ff8000000000000 -> mix(b ^ 0x13198a2e03707344)
 *     bytes (utf8, large_utf8, binary, large_binary), length L:
 *                                     h = mix(L ^ 0xa4093822299f31d0); then for each full 8-byte word w
 *                                     (read little-endian): h = mix(h ^ w) * 0x9e3779b97f4a7c15;
 *                                     a final partial word (the L % 8 tail bytes, little-endian, zero-padded)
 *                                     is folded the same way; result mix(h).
 *   row hash over columns c1..cn:    h0 = 0x082efa98ec4e6c89; hk = mix(h(k-1) * 0x9e3779b97f4a7c15 + v(ck)).
 *   The key hash of a row is its row hash over the key columns, in key order.
 */
#ifndef DBSP_HASH_H
#define DBSP_HASH_H

#include <stdint.h>
#include "column.h"

#define DBSP_HASH_VERSION 1

#define DBSP_HASH_NULL 0x9ae16a3b2f90404fULL
#define DBSP_HASH_S_INT 0x243f6a8885a308d3ULL
#define DBSP_HASH_S_FLOAT 0x13198a2e03707344ULL
#define DBSP_HASH_S_BYTES 0xa4093822299f31d0ULL
#define DBSP_HASH_ROW_SEED 0x082efa98ec4e6c89ULL
#define DBSP_HASH_K_GOLD 0x9e3779b97f4a7c15ULL

/* mix(z) of the specification (splitmix64's finalizer, a bijection of 64-bit words) */
static inline uint64_t dbsp_mix(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

/* The row hash of a row whose only column is a non-null integer u (as 64 bits): out[i] of dbsp_hash_columns
 * over that column, inline. A bijection of u, so distinct values never share a hash. */
static inline uint64_t dbsp_hash_int_row(uint64_t u) {
    return dbsp_mix(DBSP_HASH_ROW_SEED * DBSP_HASH_K_GOLD + dbsp_mix(u ^ DBSP_HASH_S_INT));
}

/* out[i] = row hash of row i of b over columns cols[0..ncols) (cols NULL = all columns in order). */
int dbsp_hash_columns(const DbspBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out);

/* dbsp_hash_columns continued: out[i] (row i's hash over some columns c1..ck) becomes its hash over c1..ck then
 * cols[0..ncols): a row hash whose first columns are a key's continues from the key hash (one pass less). */
int dbsp_hash_columns_more(const DbspBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out);

/* The row hash of row i of b over columns cols[0..ncols) (cols NULL = all columns): out[i] of
 * dbsp_hash_columns, for one row (column indices must be valid). */
uint64_t dbsp_hash_row(const DbspBatch *b, int64_t i, const int32_t *cols, int32_t ncols);

/* The hash of one value (exposed for tests and for documentation of the spec). */
uint64_t dbsp_hash_value(const DbspColumn *c, int64_t i);
uint64_t dbsp_hash_mix(uint64_t z);

#endif
