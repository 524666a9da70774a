/* top1.h: the first row of each group in a row order, by one hash grouping (a top-1 per group without a sort).
 *
 * Design notes:
 *  1. Rows are grouped by their key hash (kh, given), in an open-addressing table of the groups' current first rows;
 *     two rows of one hash are one group only when their key columns are equal (column.h: null equals null); a hash
 *     shared by two different keys ends the call with *ngroups = -1 (the caller then sorts).
 *  2. The order is the given columns in turn, each ascending or descending by column.h's value order (floats: NaN
 *     above every number, -0.0 == 0.0), nulls last whatever the direction; rows equal on every column keep the one
 *     seen first (a stable sort's choice).
 *  3. One pass over the rows, O(n) expected; reads only.
 */
#ifndef DBSP_TOP1_H
#define DBSP_TOP1_H

#include <stdint.h>
#include "column.h"

/* best[g] (caller's array of b->nrows) := the first row of group g, groups numbered in order of first appearance;
 * *ngroups := their number, or -1 when two different keys share a hash. */
int dbsp_top1(const DbspBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys, const int32_t *ocols,
              const uint8_t *desc, int32_t nord, int64_t *best, int64_t *ngroups);

#endif
