/* linrun.h: a linear group-by's whole step in one call (dbsp_core/runtime/plan.py design notes 2 and 4): from the
 * change's buffers to the buffers of the trace batch and of the output Z-set, through the totals' key index.
 *
 * Invariants:
 *  1. dbsp_linear_apply is the one place that reads a step's old totals from a key index, folds them (fold.h) and
 *     stores the new totals back: linear_step (bindings/fold.pxi) and dbsp_linear_run both call it, so the two
 *     paths leave the same index and emit the same rows in the same order.
 *  2. dbsp_linear_run's outputs are exactly what the Python chain builds from linear_step's (operators/aggregate.py
 *     ``_LinearState._emit`` with ``Aggregate.finalize_ints``): the trace batch holds the key columns gathered at
 *     each row's carrying row, then the ns slot columns; the output holds the key columns (unless hidden), then
 *     per shown aggregate its slot, null where its non-null count slot is 0; ``distinct`` is
 *     ``not Aggregate.ints_may_cancel``.
 *  3. Scratch (old totals, slot pointers, groups, rows) lives in a DbspLinRun kept by the caller across steps and
 *     grows to the largest step up to DBSP_LINRUN_KEEP groups; a larger step's scratch is freed at its end, so a bulk
 *     load does not leave its buffers behind. The slot values are not scratch: the fold writes them into the buffer
 *     the exports hand over (invariant 8).
 *  4. A step reads and folds first (dbsp_linear_read), exports its outputs (dbsp_linear_run), and stores last
 *     (dbsp_linear_store): the new totals of keys held in place (no allocation), then the new keys (the only
 *     stores that allocate), then the removals (none allocates). A store that fails for memory or a size limit
 *     (DBSP_ENOMEM, DBSP_ETOOBIG: the table, the entries or the arena could not grow) is undone before it returns:
 *     the new keys stored are removed and the old totals put back in place (from the step's `old`, which
 *     dbsp_linear_read filled), neither of which allocates, and the index is whole and as it was
 *     (dbsp_keyindex_refusals counts it; keyindex.h invariant 4). An error before the store (overflow, memory for
 *     the scratch or the exports) changes nothing. So a step either stores all of its totals or none: an owner
 *     whose index is its state (trace invariant 19) loses nothing to a failure half way.
 *  5. The dirty-key probe of a trace keeping its totals per key (trace/keyindex.py ``store_totals``) is made here,
 *     when asked (dbsp_linear_run3): once per group of the change, at the row carrying its key, before anything is
 *     stored (the dirty index is not written here); every output row of a group gets that group's answer, the
 *     answer store_totals' probe of each row gives, as a group's rows share its key.
 *  6. With found_dirty set in the scratch (the caller knows every key the index holds to be dirty: trace/keyindex.py
 *     ``pk_found_dirty``, no key of the index clean since the last sync), invariant 5's probe is made only for the
 *     groups the index does not hold (the read found no entry); a group it holds is dirty (fresh 0) without a probe.
 *     A 1k-row step into a 100k-key state so probes a few keys of the dirty index instead of one per group.
 *  7. A change that dbsp_lingroup serves (fixed-width keys and summed columns without nulls; counts, integer sums and
 *     limbs: lingroup.h invariant 1) is grouped by it, in one hashing pass into a table sized by the change, with
 *     limbs computed as it reads the rows; any other change (a null, a string key, a uint64 or float sum, a sum that
 *     leaves int64 half way) by dbsp_group_reduce_all over limb columns made first. Both give the same groups, sums
 *     and key-hash order, so the read, fold, exports and store after them (invariants 1-6) are one path.
 *  8. dbsp_linear_run's exports copy nothing they can share (cdata.h invariant 5): the fold writes the slot values
 *     into one buffer per step (ns columns, packed to the rows emitted), which the trace batch's slot columns and the
 *     output's shown non-avg columns both point into, and the key columns are gathered once for both batches. With
 *     keyorder set in the scratch (the caller needs the trace batch in key-hash order only: trace/keyindex.py
 *     ``pk_keyorder``, a batch recorded per key and never inserted as it stands), the fold computes no row hash
 *     and a group's new row precedes its old row (fold.h dbsp_linear_fold2); *ordered then says only that no two
 *     groups share a key hash, and the caller puts the rows in canonical order before a batch is inserted.
 */
#ifndef DBSP_LINRUN_H
#define DBSP_LINRUN_H

#include <stdint.h>
#include "agg.h"
#include "cdata.h"
#include "column.h"
#include "keyindex.h"
#include "lingroup.h"
#include "reduce.h"

#define DBSP_LINRUN_KEEP 65536  /* groups of scratch kept between steps (invariant 3) */

typedef struct DbspLinRun {
    int found_dirty; /* invariant 6: set by the caller before each call (a free clears it) */
    int keyorder;    /* invariant 8: set by the caller before each call (a free clears it) */
    int64_t groups;  /* groups the scratch has room for */
    int32_t ns;
    int64_t *old;    /* groups * ns */
    int64_t **slots; /* groups */
    int64_t *grp, *rows;  /* 2 * groups each */
    DbspLinGroup lg; /* invariant 7: the hashing pass's scratch */
    int fused;       /* invariant 7: whether the last call's change was grouped by dbsp_lingroup (for tests) */
} DbspLinRun;

void dbsp_linrun_free(DbspLinRun *s);

/* dbsp_linear_apply's two halves (invariant 4): the read and fold (everything but the store; ix unchanged), and the
 * store of the m rows read (cap: the stride of vals, 2 * ng), undone on DBSP_ENOMEM or DBSP_ETOOBIG. */
int dbsp_linear_read(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const DbspReduceOut *r, int32_t ns,
                     int64_t *old, int64_t **slots, int64_t *grp, int64_t *rows, int64_t *w, uint64_t *kh,
                     int64_t *vals, uint64_t *rh, int64_t *n, int *ordered);
int dbsp_linear_store(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t ns, const int64_t *old,
                      int64_t *const *slots, const int64_t *grp, const int64_t *rows, const int64_t *w,
                      const uint64_t *kh, const int64_t *vals, int64_t cap, int64_t m);

/* Given the change b's groups r (dbsp_group_reduce_all over keys, ns sums: slot 0 the row count): read each group's
 * old totals from ix into old (ng * ns, zeroed here), emit the rows of new (+1) and old (-1) totals of the changed
 * groups (dbsp_linear_fold: grp, w, kh, vals with stride 2 * ng, rh if not NULL, *n, *ordered), set rows[i] to the
 * row of b carrying row i's key, then store each changed group's new totals in ix (in place where the key was
 * found, else a new entry), or drop the group when its new count is 0. Room: ng for old and slots, 2 * ng for the
 * rest. A DBSP_EOVERFLOW leaves ix unchanged; DBSP_ENOMEM or DBSP_ETOOBIG while storing is undone (invariant 4). */
int dbsp_linear_apply(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const DbspReduceOut *r, int32_t ns,
                      int64_t *old, int64_t **slots, int64_t *grp, int64_t *rows, int64_t *w, uint64_t *kh,
                      int64_t *vals, uint64_t *rh, int64_t *n, int *ordered);

/* The whole step (invariant 2): group b by keys[0..nkeys) summing specs[0..ns) (COUNT: weights; SUM: an int64
 * column without nulls), dbsp_linear_apply through ix, then export the trace batch (the key columns at the carrying
 * rows, the ns slot columns) into *batch and the output (the key columns when out_keys, then for o < nout slot
 * shown[o], null where slot nonnull[o] is 0 when nonnull[o] >= 0) into *out, with their weights *w and key hashes
 * *kh (malloc'ed, *n each; the caller frees them) and *ordered, *distinct. With *n == 0 nothing is exported (the
 * releases stay NULL) and *w, *kh are NULL. */
int dbsp_linear_run(DbspLinRun *s, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                    int32_t ns, DbspKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, int32_t nout,
                    int out_keys, struct ArrowArray *batch, struct ArrowArray *out, int64_t **w, uint64_t **kh,
                    int64_t *n, int *ordered, int *distinct);

/* Slot kinds beside agg.h's for dbsp_linear_run's specs: the high / low limb of an int64 column (operators/aggregate.py
 * invariant 5: value >> 32 rounded down, and its low 32 bits), summed times the weights. */
enum { DBSP_LINRUN_SUM_HI = 100, DBSP_LINRUN_SUM_LO = 101 };

/* An output column that is an avg (float64, its 8-byte values exported as dbsp_linear_run's int64 ones are): for
 * shown[o] >= 0 and avg_lo[o] >= -1 given, the value (hi + (lo >> 32)) * 2^32 + (lo & 0xffffffff) (hi = slot
 * shown[o], lo = slot avg_lo[o], or hi alone when avg_lo[o] is -1) divided by slot nonnull[o], in long double, as
 * Aggregate.finalize divides (null where the count is 0). dbsp_linear_run2 is dbsp_linear_run with, per output, avg[o]
 * (1: such a column, 0: an int64 one) and avg_lo[o]; its distinct check compares the values shown (an avg's double). */
int dbsp_linear_run2(DbspLinRun *s, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                     int32_t ns, DbspKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, const int32_t *avg,
                     const int32_t *avg_lo, int32_t nout, int out_keys, struct ArrowArray *batch,
                     struct ArrowArray *out, int64_t **w, uint64_t **kh, int64_t *n, int *ordered, int *distinct);

/* dbsp_linear_run2 that also, given the index of a totals trace's dirty keys (dirty: one value per key, trace/levels.py
 * invariant 19), sets *fresh (malloc'ed, *n bytes; NULL when *n is 0 or on an error) to 1 for each output row whose
 * key dirty does not hold (its count 0), 0 otherwise: invariant 5. */
int dbsp_linear_run3(DbspLinRun *s, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                     int32_t ns, DbspKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, const int32_t *avg,
                     const int32_t *avg_lo, int32_t nout, int out_keys, struct ArrowArray *batch,
                     struct ArrowArray *out, int64_t **w, uint64_t **kh, int64_t *n, int *ordered, int *distinct,
                     const DbspKeyIndex *dirty, uint8_t **fresh);

#endif
