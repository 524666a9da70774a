/* joinlin.h: an inner equi-join whose one consumer is a linear group-by, its whole step in one call (dbsp_core/runtime/plan.py
 * design note 4, issue 37): both sides' changes indexed for their traces, their pairs with the other side's batches
 * found, and the pairs folded into the group-by's totals per key, without the join's output rows.
 *
 * Invariants:
 *  1. Each changed side's indexed change is dbsp_join_run's (joinrun.h invariant 1: ZSet.index_by's rows, weights,
 *     key hashes and row hashes); the caller inserts it into that side's trace as the join's own step does.
 *  2. The pairs are the join's change of operators/join.py invariant 1, in the order of operators/join.py invariant 7:
 *     the right change against the left trace's batches (L JOIN db), then the left change against the right
 *     trace's batches and the indexed right change (da JOIN (R + db)); each pair's weight is the product of its
 *     rows' weights (dbsp_join_fenced).
 *  3. The joined batch the group-by reads holds, per pair, only the gathered columns (gside: 0 left, 1 right; gcol:
 *     the column of that side's rows), each of a fixed-width type other than bool, equal to gtype (DBSP_ETYPE
 *     otherwise), a null where the source is null; its weights are the pairs'. dbsp_linear_run2 then runs over it
 *     exactly as over the rows a fused join gathers (linrun.h invariants 2 and 4), so the totals, the trace batch
 *     and the output are the unfused chain's.
 *  4. Not served (*served = 0, nothing exported, the index unchanged): a weight product past int64 (the join's own
 *     step raises it, naming the join), or a null in one of the columns nonulls[0..nnn) of the joined batch (a
 *     summed or counted column: the chain's own steps serve it). A failure of dbsp_linear_run2 leaves the index as
 *     it was (linrun.h invariant 4) and exports nothing.
 */
#ifndef DBSP_JOINLIN_H
#define DBSP_JOINLIN_H

#include <stdint.h>
#include "joinrun.h"
#include "linrun.h"

typedef struct DbspJoinLinSide {
    const DbspBatch *c;                 /* the side's change (NULL: unchanged this step) */
    const struct ArrowSchema *cs;       /* its exported schema (the indexed change is viewed through it) */
    int32_t nb;                         /* the other side's trace batches */
    const DbspBatch *const *bs;
    const uint64_t *const *bkh;         /* their key hashes (ascending) */
    const uint64_t *const *bfence;      /* their fences (or NULL) */
    const DbspDir *const *bdir;         /* their directories (lookup.h; NULL, or an entry NULL: none) */
    DbspJoinRunOut out;                 /* the indexed change (invariant 1; out.parts unused) */
} DbspJoinLinSide;

typedef struct DbspJoinLin {
    const int32_t *lkeys, *rkeys;       /* the join's key columns of each side */
    int32_t nkeys;
    const int32_t *gside, *gcol, *gtype;  /* the joined batch's columns (invariant 3) */
    int32_t ng;
    const int32_t *nonulls;             /* columns of the joined batch that must hold no null (invariant 4) */
    int32_t nnn;
} DbspJoinLin;

/* sides[0]: the left change against the right trace's batches; sides[1]: the right change against the left
 * trace's. The linear group-by's parameters are dbsp_linear_run2's (keys: positions in the joined batch). On
 * DBSP_OK with *served, each changed side's out holds its indexed change (released by the caller with
 * dbsp_join_run_free(&out, 0)) and batch/out/w/kh/n/ordered/distinct (and, given dirty, *fresh) are
 * dbsp_linear_run3's. */
int dbsp_join_linear_run(const DbspJoinLin *j, DbspJoinLinSide *sides, DbspLinRun *s, const int32_t *keys,
                         int32_t nkeys, const DbspAggSpec *specs, int32_t ns, DbspKeyIndex *ix, const int32_t *shown,
                         const int32_t *nonnull, const int32_t *avg, const int32_t *avg_lo, int32_t nout,
                         int out_keys, struct ArrowArray *batch, struct ArrowArray *out, int64_t **w, uint64_t **kh,
                         int64_t *n, int *ordered, int *distinct, const DbspKeyIndex *dirty, uint8_t **fresh,
                         int *served);

#endif
