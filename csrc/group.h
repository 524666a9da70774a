/* group.h: the hash grouping engine behind consolidate and the unindexed grouped reduce.
 *
 * Rows of a batch are grouped by their identity columns; each group yields its first row, its weight sum, its
 * key hash and one accumulator per aggregate, in canonical order: by key hash, then identity hash, then the
 * identity columns' values (rows.h invariant 2 when the identity is the whole row).
 */
#ifndef DBSP_GROUP_H
#define DBSP_GROUP_H

#include <stdint.h>
#include "column.h"
#include "rows.h"
#include "agg.h"

/* Group b by icols (NULL: every column), partition and order by the hash of kcols (nkcols == 0: the identity
 * hash). rows receives each group's first row (idx), weight sum (weights) and key hash (khash); if naggs > 0,
 * *acc receives rows->n * naggs accumulators (group-major; free with free()). With drop_zero, groups whose
 * weight sum is 0 are left out. Errors: DBSP_EOVERFLOW, DBSP_ETYPE, DBSP_ETOOBIG, DBSP_ENOMEM, DBSP_EINVAL. */
int dbsp_group(const DbspBatch *b, const int32_t *icols, int32_t nicols, const int32_t *kcols, int32_t nkcols,
               const DbspAggSpec *aggs, int32_t naggs, int drop_zero, DbspRows *rows, DbspAcc **acc);

/* dbsp_group, and with ih_out (not NULL) the identity hash (dbsp_hash_columns over icols) of each output row:
 * *ih_out is then a malloc'ed array of rows->n hashes (free with free()), or NULL when the call took the one-integer-
 * column path (dbsp_group_int, which hashes no identity) or failed. consolidate keeps them as the row hashes of the
 * batch it builds (zset.h dbsp_zset_consolidate_rh): trace merges read them, so nothing hashes the rows again. */
int dbsp_group_ih(const DbspBatch *b, const int32_t *icols, int32_t nicols, const int32_t *kcols, int32_t nkcols,
                  const DbspAggSpec *aggs, int32_t naggs, int drop_zero, DbspRows *rows, DbspAcc **acc,
                  uint64_t **ih_out);

/* Internal status of dbsp_group_int: the input does not qualify (a weight outside int32); run dbsp_group. */
#define DBSP_GROUP_INT_NO (-1)

/* 1 if dbsp_group_int serves this call of dbsp_group: the identity is one 64-bit integer column without nulls
 * (int64, uint64, timestamp), the key is that column or none, fewer than 2^31 rows, and every aggregate is COUNT
 * or a SUM of a non-null int64/timestamp column (at most 4 SUMs). */
int dbsp_group_int_applies(const DbspBatch *b, const int32_t *icols, int32_t nicols, const int32_t *kcols,
                           int32_t nkcols, const DbspAggSpec *aggs, int32_t naggs);

/* dbsp_group for the calls dbsp_group_int_applies accepts (group_int.c), with the aggregates' results written
 * straight to *ivals (rows->n * naggs int64, group-major: COUNT = the weight sum, SUM = the sum; free with
 * free()), the form dbsp_reduce exports. Same groups, order, values and errors as dbsp_group, or
 * DBSP_GROUP_INT_NO (nothing allocated) when a weight is outside int32 or a partial sum leaves int64. */
int dbsp_group_int(const DbspBatch *b, const int32_t *icols, const DbspAggSpec *aggs, int32_t naggs, int drop_zero,
                   DbspRows *rows, int64_t **ivals);

/* Both engines' growth rule for a partition's table (half full after `seen` of its rows, `left` to go): the groups
 * the whole partition is projected to hold at the rate of new groups per row so far; the table grows to twice
 * that at once, not by a doubling series. Only sizes the table: a wrong guess costs another growth, or a larger
 * table to clear. */
static inline int64_t dbsp_group_projection(int64_t groups, int64_t seen, int64_t left) {
    return groups + (int64_t)((double)groups / (double)seen * (double)left);
}

#endif
