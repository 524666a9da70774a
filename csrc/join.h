/* join.h: equi-joins (weights multiply): a merge join of indexed batches, and a hash join of any batches. */
#ifndef DBSP_JOIN_H
#define DBSP_JOIN_H

#include <stdint.h>
#include "column.h"
#include "lookup.h"

typedef struct DbspPairs {
    int64_t n, cap;
    int64_t *li, *ri, *w;  /* left row, right row (-1: no match, left outer), weight product */
} DbspPairs;

void dbsp_pairs_free(DbspPairs *p);

/* Every pair (x, y) with a's key columns akeys equal to b's bkeys (positionally; integer widths may differ,
 * a null never matches), in a's row order; with left_outer, each left row with no match appears once as
 * (x, -1, weight of x). Cost is O(|a| + matches) plus O(log |b|) per distinct left key, so a small a against a
 * large b never scans b. Errors: DBSP_EOVERFLOW when a weight product leaves int64; DBSP_ETYPE when key value
 * classes differ. */
int dbsp_join(const DbspBatch *a, const uint64_t *akh, const int32_t *akeys,
              const DbspBatch *b, const uint64_t *bkh, const int32_t *bkeys, int32_t nkeys,
              int left_outer, DbspPairs *out);

/* dbsp_join seeking in each side through a fence of its key hashes (lookup.h; NULL: gallop). */
int dbsp_join_fenced(const DbspBatch *a, const uint64_t *akh, const uint64_t *afence, const int32_t *akeys,
                     const DbspBatch *b, const uint64_t *bkh, const uint64_t *bfence, const int32_t *bkeys,
                     int32_t nkeys, int left_outer, DbspPairs *out);

/* dbsp_join_fenced seeking in b through directory bdir of its key hashes (lookup.h DbspDir; NULL: through bfence). */
int dbsp_join_dir(const DbspBatch *a, const uint64_t *akh, const uint64_t *afence, const int32_t *akeys,
                  const DbspBatch *b, const uint64_t *bkh, const uint64_t *bfence, const DbspDir *bdir,
                  const int32_t *bkeys, int32_t nkeys, int left_outer, DbspPairs *out);

/* The same pairs for any two batches (no index, no consolidation: the join is bilinear), by radix-partitioned
 * hashing: both sides are split by the top bits of their key hash, each partition of b becomes a chained hash
 * table that stays in cache, and a's rows of that partition probe it. Pairs come partition by partition, in
 * a's row order within each; left_outer as above. */
int dbsp_hash_join(const DbspBatch *a, const int32_t *akeys, const DbspBatch *b, const int32_t *bkeys,
                   int32_t nkeys, int left_outer, DbspPairs *out);

#endif
