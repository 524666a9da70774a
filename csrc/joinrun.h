/* joinrun.h: an inner equi-join's step over one side's change in one call (dbsp_core/runtime/plan.py design note 2):
 * from the change's buffers to the indexed change (its trace batch) and the output rows met in each batch of the
 * other side's trace.
 *
 * Invariants:
 *  1. The indexed change is exactly ZSet.index_by's (dbsp_zset_consolidate_rh over the key columns, the rows
 *     gathered by dbsp_cdata_gather): the same rows, weights, key hashes and row hashes in the same order.
 *  2. The pairs of the change with batch k are dbsp_join_fenced's with the indexed change as its left input (a small
 *     change against a large batch: one seek per key hash, never a scan of the batch; through the batch's directory
 *     when it has one, lookup.h DbspDir: the same positions, found without a binary search), whichever side of the join
 *     the change is on; weights multiply (DBSP_EOVERFLOW past int64). Part k's rows are the output columns gathered
 *     from the pairs by dbsp_cdata_gather2: the left side's columns lcols, then the right side's rcols (NULL: every
 *     column), the change's or the batch's as the change is the left or the right side. So each part holds the
 *     rows Join.pairs builds for that meeting, in the change's key-hash order.
 *  3. Nothing is exported on an error; the caller owns what is exported on DBSP_OK.
 *  4. A left outer join's padded rows (operators/left_join.py, a step whose right side does not change): with a pad
 *     batch (change_left only), part nb holds the change's rows whose key's right rows, over every batch, have
 *     weights summing to at most 0 (a null key meets no row: it sums to 0), each with its own weight: the change's
 *     columns lcols, then pad's columns rcols at its row 0 (one row of nulls of the right side's types). The sum is
 *     taken over the pairs the join already found (a right row's weight per pair), so it costs no probe: it is the
 *     key's right row count that the right trace's key index would give. pad_met says whether a padded row met a
 *     right row as well (its key's right rows cancel): when not, and at most one batch gave pairs, no padded row
 *     equals an inner row (their left rows differ: the indexed change is consolidated), so the parts together are
 *     distinct rows.
 *  5. The indexed change's columns come out viewed as well (out->cols, the view the join read them through): a caller
 *     that keeps the change's buffers alive (the Arrow import of out->change) has its C batch without exporting it
 *     again (bindings/join.pxi: the BatchView a trace merge reads the batch through, operators/join.py invariant 7).
 */
#ifndef DBSP_JOINRUN_H
#define DBSP_JOINRUN_H

#include <stdint.h>
#include "cdata.h"
#include "column.h"
#include "lookup.h"

typedef struct DbspJoinRunOut {
    struct ArrowArray change;  /* the indexed change (release NULL when no row is left: n == 0) */
    DbspColumn *cols;          /* its columns viewed (dbsp_cdata_view of change: pointers into change's buffers, which
                                * the caller keeps alive with it, invariant 5), malloc'ed; NULL when n == 0 */
    int64_t n;                 /* its rows */
    int64_t *w;                /* its weights, key hashes and row hashes (rh NULL: not computed, a one-column */
    uint64_t *kh, *rh;         /* batch whose row hash is its key hash), malloc'ed, n each */
    struct ArrowArray *parts;  /* nb parts (room given by the caller): release NULL where no pair was found */
    int64_t **pw;              /* nb weight arrays (malloc'ed, pn[k] each; NULL where no pair) */
    int64_t *pn;               /* nb pair counts */
    int pad_met;               /* with a pad (invariant 4): 1 when a padded row met a right row too, else 0 */
} DbspJoinRunOut;

/* Index change c (its exported schema cs: the indexed change is viewed through it) by ckeys[0..nkeys), then join it
 * with each batch bs[k] (key hashes bkh[k] ascending, fence bfence[k] or NULL, directory bdir[k] or NULL, bdir NULL:
 * none; keys bkeys) and gather each part's output columns (invariant 2; change_left: c is the join's left side). out->parts, pw and pn have room for nb, and
 * one more when pad is not NULL (invariant 4: change_left only, DBSP_EINVAL otherwise or for a pad without rows);
 * DBSP_EOVERFLOW when a key's right weights sum past int64. */
int dbsp_join_run(const DbspBatch *c, const struct ArrowSchema *cs, const int32_t *ckeys, int32_t nkeys, int change_left,
                  int32_t nb, const DbspBatch *const *bs, const uint64_t *const *bkh, const uint64_t *const *bfence,
                  const DbspDir *const *bdir, const int32_t *bkeys, const int32_t *lcols, int32_t nl, const int32_t *rcols,
                  int32_t nr, const DbspBatch *pad, DbspJoinRunOut *out);

/* Release everything dbsp_join_run exported into out (the caller's arrays stay): nb parts (nb + 1 with a pad), and
 * out->cols unless the caller took it (set it NULL). */
void dbsp_join_run_free(DbspJoinRunOut *out, int32_t nb);

#endif
