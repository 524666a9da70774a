/* rows.h: DbspRows, a selection of source rows with weights and key hashes, the output of the Z-set kernels.
 *
 * Invariants of a consolidated selection (checked by dbsp_rows_check_order under DBSP_CHECK_INVARIANTS):
 *  1. No two selected rows are equal (column-wise, in the identity of column.h) and no weight is 0.
 *  2. Rows are in canonical order: by key hash, then by row hash, then by dbsp_row_cmp over all columns.
 *     Equal keys therefore have equal key hashes and are adjacent up to hash collisions, which the join and
 *     reduce kernels resolve by comparing key values inside each run of equal key hashes.
 */
#ifndef DBSP_ROWS_H
#define DBSP_ROWS_H

#include <stdint.h>
#include <stdlib.h>
#include "column.h"
#include "status.h"

typedef struct DbspRows {
    int64_t n;
    int64_t cap;
    int64_t *idx;       /* source row index (merge: a's rows are 0..na-1, b's rows na..na+nb-1) */
    int64_t *weights;
    uint64_t *khash;    /* key hash of each row (row hash when the key is the whole row) */
} DbspRows;

void dbsp_rows_free(DbspRows *r);

/* internal: reserve room for `extra` more rows */
int dbsp_rows_reserve(DbspRows *r, int64_t extra);

static inline int dbsp_add_weight(int64_t *acc, int64_t w) {
    return __builtin_add_overflow(*acc, w, acc) ? DBSP_EOVERFLOW : DBSP_OK;
}

/* Adds w to *acc exactly, whatever the order of the terms: the int64 sum wraps and *carry counts the wraps
 * (+1 past INT64_MAX, -1 past INT64_MIN), so the true sum is *acc + *carry * 2^64, and it fits in int64 iff
 * *carry == 0 once every term is added. An overflow is then reported for a sum, never for a partial sum. */
static inline void dbsp_add_exact(int64_t *acc, int64_t w, int32_t *carry) {
    if (__builtin_add_overflow(*acc, w, acc)) *carry += w > 0 ? 1 : -1;
}

#endif
