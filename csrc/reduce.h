/* reduce.h: weight-aware grouped aggregation (count, count of a column, sum, min, max), indexed or by hashing. */
#ifndef DBSP_REDUCE_H
#define DBSP_REDUCE_H

#include <stdint.h>
#include "column.h"
#include "agg.h"

/* Results, row-major: value k of group g is at [g * naggs + k].
 *   COUNT      ivals: sum of weights                          (always valid)
 *   COUNT_COL  ivals: sum of weights of rows whose value is not null (always valid)
 *   SUM        ivals (integer/bool columns, overflow-checked) or fvals (float columns): sum of value * weight
 *              over non-null values; valid iff the group has a non-null value
 *   MIN/MAX    ivals: the row holding the extreme among rows with weight > 0 and a non-null value (ties: the
 *              first such row); valid iff there is one (else ivals = -1) */
typedef struct DbspReduceOut {
    int64_t ngroups, cap;
    int32_t naggs;
    int64_t *group_row;  /* the first row of each group (it carries the key values) */
    int64_t *khash;      /* the key hash of each group */
    int64_t *ivals;
    double *fvals;
    uint8_t *valid;
} DbspReduceOut;

void dbsp_reduce_free(DbspReduceOut *r);

/* One group per distinct key of b (keys compared column-wise, null equal to null), in b's order, which must be
 * canonical (key hashes kh ascending, rows.h): the cost is one pass over b. Errors: DBSP_EOVERFLOW, DBSP_ETYPE
 * (sum over bytes), DBSP_EINVAL. */
int dbsp_reduce(const DbspBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys,
                const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out);

/* The same result for any batch (no index needed), by hash grouping (group.h), groups in key-hash order;
 * groups whose weights sum to 0 are left out. */
int dbsp_group_reduce(const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                      const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out);

/* dbsp_group_reduce keeping every group, also those whose weights sum to 0 (their sums need not be 0: a
 * batch of partial rows, where a row's values stand for several source rows, is one). */
int dbsp_group_reduce_all(const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                          const DbspAggSpec *aggs, int32_t naggs, DbspReduceOut *out);

#endif
