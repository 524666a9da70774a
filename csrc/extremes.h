/* extremes.h: the min/max aggregate's step kernel: a step's groups folded into their totals (linear slots and
 * extremes) read from and stored in a key index, recomputing an extreme only when a deleted value reached it.
 *
 * Design notes:
 *  1. Slots follow the aggregate's kernel: COUNT, COUNT_COL and SUM (integer) are linear (new = old + the
 *     change's sum); MIN and MAX are extremes of an integer-class column (dates and timestamps included, no
 *     uint64, no floats), over values of rows with positive weight. The key index holds, per group, one value
 *     per slot (an extreme as int64, 0 while null) and then, per extreme slot, 1 while the extreme is not null:
 *     V = nslots + nextremes values. These are sums over the totals trace's content (keyindex.h: a weight times
 *     a value, and a weight times "not null"), which per key is its one totals row, so a rebuild of the index
 *     from the trace's batches gives them back.
 *  2. A group's new extreme is the extreme of its old one and the change's inserted values, unless a deleted
 *     value reaches the old extreme (for MIN: is not strictly greater) or the old extreme is null and values
 *     are deleted: then need[g] is set and the caller recomputes it (value and "not null") from the group's
 *     values (dbsp_extremes_scan, over the batches of the column's value multiset: a seek per batch and group,
 *     never a pass over the trace). So an extreme turns null only through a recompute, or with its group's count at 0.
 *  3. Groups are runs of the indexed change (canonical order for its key: equal keys are adjacent), or, for a
 *     change of insertions only (dbsp_extremes_probe_inserts), the groups of a hash grouping of its rows in any
 *     order (reduce.h), in the same key-hash order.
 *  4. dbsp_extremes_emit is a step's second half in C (operators/aggregate.py ``_ExtremesState._through_index``):
 *     the rows dbsp_extremes_store emits, as the trace batch (row hashes and canonical order included, so the
 *     trace neither hashes nor sorts them) and as the output Z-set (finalized: min/max, counts and integer sums
 *     shown as the aggregate's columns; equal old and new rows of a group dropped), then the same stores.
 *  5. One probe per group: a probe given room for slots keeps, per group, where the index holds its values
 *     (dbsp_keyindex_get_slots), and an emit given them writes a held group's new values there in place
 *     (dbsp_keyindex_set_slot) instead of probing again with a put. Such a pointer is valid until the index changes
 *     shape, so nothing may store into the index between the probe and the emit, and the emit stores in three
 *     passes: held groups that stay, in place; then new groups (dbsp_keyindex_put: the only stores that allocate);
 *     then groups whose count reaches 0 (removals, which allocate nothing). A put that fails for memory or a size
 *     limit (DBSP_ENOMEM, DBSP_ETOOBIG) is undone (csrc/linrun.h invariant 4's rule): the broken mark the refusal
 *     set cleared, the new groups put before it removed, the held ones' old values put back (in place: nothing was
 *     removed yet), the refusal counted (dbsp_keyindex_note_refusal), so the index is whole and as before the call,
 *     and its owner (trace/keyindex.py ``through_index``) drops it and walks the batches.
 *  6. A recompute's keys are few against a value trace's large batch (a 1k-row step of a 1M-row state: ~20 keys a
 *     step, one per ~50k rows), so each seek lands in a cold part of the batch's key hashes: a gallop from the last
 *     key's position misses the cache a dozen times and more. dbsp_extremes_scan seeks through the batch's fence
 *     (lookup.h: a small array the seeks keep warm, then one 512-byte block of the key hashes) where the caller has
 *     one (batches of IndexedZSet.FENCE_MIN rows and more), SCAN_CHUNK keys at a time with the seeks of each batch in
 *     one prefetching pass (dbsp_seek_all), and prefetches the rows of the key SCAN_PF ahead while it reads one; the
 *     same positions as galloping. (A directory, as the join's, was tried for the 1M-row batch: more cache misses
 *     than the fence in callgrind's model of cold scans, and a pass to build it.)
 *  7. The totals batch is built only for a reader (operators/aggregate.py invariant 12): a totals trace that keeps its
 *     totals per key reads a step's batch only to record fresh keys, to insert it on a fallback, or to undo the step
 *     on a rollback; once every key is dirty none of these happens in a step that holds all its groups, and the
 *     emit leaves the batch out (its slot columns, the gather of its keys and its export: ~0.1M instructions at 1k
 *     groups). dbsp_extremes_batch builds it afterwards from the step's arrays, by the same code (emit_rows, then
 *     the export), so a late batch equals the one the emit would have built.
 *  8. A recompute's seeks in stages across every value batch (dbsp_extremes_scan, keys ascending): first each key's
 *     fence entry in every fenced batch, prefetching the 512-byte block of key hashes it bounds; then the search in
 *     those blocks (the gallop over a small batch without a fence), prefetching the row found (key hash, values,
 *     weight); then the rows are read. Design note 6's pass went batch by batch and prefetched rows a few keys ahead,
 *     so the first keys' rows in every batch and each batch's first blocks were read by demand misses one after
 *     another; at ~15 keys over 10-17 batches (the bench's 1M-row state) the staged seeks keep a stage's misses
 *     in flight together. The same positions as dbsp_seek_all.
 *  9. The probe folds slot by slot over every group, not group by group over every slot: a 1k-row step of a 1M-row
 *     state has ~1 row a group, so the per-group dispatch on each slot's kind and column was most of the fold. A min
 *     and a max of one column (the usual pair) are folded in one pass over the rows, and an int64 column without
 *     nulls is read directly. The emit compares a group's old and new values once (emit_rows) and the stores read
 *     that flag.
 */
#ifndef DBSP_EXTREMES_H
#define DBSP_EXTREMES_H

#include <stdint.h>
#include "column.h"
#include "keyindex.h"
#include "agg.h"
#include "cdata.h"
#include "lookup.h"

/* Phase 1. For each group of the indexed change b (key columns keys, key hashes kh ascending): group_row[g] (its
 * first row), gkh[g], old[g * V + v] (the index's values, 0 when absent), nw[g * V + v] (the new ones, design
 * note 2; an extreme to recompute is left as the old one), need[g]; *ng groups (room for b->nrows). Nothing is
 * stored. held: NULL, or room for b->nrows pointers: held[g], where the index holds group g's values (NULL when
 * absent; design note 5). DBSP_EOVERFLOW if a linear total leaves int64, DBSP_ETYPE for an extreme column it cannot
 * hold. */
int dbsp_extremes_probe(DbspKeyIndex *ix, const DbspBatch *b, const uint64_t *kh, const int32_t *keys,
                        int32_t nkeys, const DbspAggSpec *slots, int32_t ns, int64_t *group_row, uint64_t *gkh,
                        int64_t *old, int64_t *nw, uint8_t *need, int64_t *ng, int64_t **held);

/* Phase 1 for a change of insertions only (every weight >= 0; DBSP_EINVAL otherwise), in any row order: its
 * groups by hash grouping (reduce.h's dbsp_group_reduce_all, groups in key-hash order: no sort of the change's
 * rows), their old totals read from the index and their new ones (linear slots add; an extreme becomes the
 * extreme of the old one and the inserted values: no deleted value can reach it, design note 2, so no group
 * needs a recompute). Allocates *group_row, *gkh, *old and *nw (*ng groups, V values each; free() them); nothing
 * is allocated on an error. The same groups, totals and order as dbsp_extremes_probe over the indexed change.
 * Errors: DBSP_EOVERFLOW, DBSP_ETYPE, DBSP_EINVAL, DBSP_ENOMEM. */
int dbsp_extremes_probe_inserts(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                                const DbspAggSpec *slots, int32_t ns, int64_t **group_row, uint64_t **gkh,
                                int64_t **old, int64_t **nw, int64_t *ng);

/* Phase 2, once the caller filled in the recomputed extremes: for each group whose new values differ from its
 * old ones, in group order, a row of its old totals (weight -1, when its old count, value 0, is not 0) and one
 * of its new totals (+1, when the new count is not 0): grp[k] (the group), w[k]; *n rows (room for 2 * ng);
 * and the index then holds the new values (the key removed at a count of 0). Errors as dbsp_keyindex_put's. */
int dbsp_extremes_store(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t ng, int32_t nv,
                        const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                        int64_t *grp, int64_t *w, int64_t *n);

/* Phase 2 and the step's outputs in one call (design note 4), in place of dbsp_extremes_store and the Python that
 * built the trace batch and the output from its rows. For each group g < ng whose new values nw differ from its
 * old ones, in group order: a row of its old totals (weight -1, when its old count is not 0) and one of its new
 * totals (+1, when its new count is not 0), the two in row-hash order. Exported, when at least one row:
 *   *batch: the totals trace batch: the key columns of b at the group's row, then ns int64 slot columns, slot j
 *     null where snull[j] >= 0 and the row's value snull[j] (a "not null" flag) is 0, its values narrowed to
 *     swidth[j] bytes (1, 2, 4 or 8: the slot column's width; the importer's schema says its type); with its
 *     weights *w, key hashes *kh and row hashes *rh (hash.h: the key hash extended by the slot columns; *n rows,
 *     malloc'ed) and *ordered: 0 when two emitted groups share a key hash or a group's two rows a row hash (the
 *     rows are then not in canonical order: the caller sorts them); with keyorder set (the caller needs the batch in
 *     key-hash order only: a totals trace that records it per key, trace/keyindex.py ``pk_keyorder``) no row hash is
 *     computed, a group's old row comes first, *rh stays NULL and *ordered is 0 only for a key-hash tie;
 *   *out: the output: the key columns, then for o < nout the value of slot shown[o], null where nonnull[o] >= 0
 *     and the row's value nonnull[o] is 0, narrowed to owidth[o] bytes; with its weights *ow (*on rows): the rows
 *     of the batch less a group's two rows when they show the same output (equal values, nulls alike), so the
 *     rows of a change whose groups differ in their keys are distinct.
 * Then the index holds the new values (the key removed at a count of 0), as dbsp_extremes_store leaves it, stored as
 * design note 5 says (in place where held, from the probe of the same groups with nothing stored since, is not
 * NULL). The store is last: an error before it (DBSP_ENOMEM) exports and changes nothing; one of the store (the
 * index could not grow) is undone (design note 5: the index as before, a refusal counted) and exports nothing.
 * V = ns + the extremes among slots. With *n == 0 nothing is exported (the releases stay NULL) and the arrays are
 * NULL. batch NULL: the batch's columns are neither built nor exported (design note 7), its rows' weights, key hashes
 * (and row hashes) still are; dbsp_extremes_batch builds it from the same arguments. */
int dbsp_extremes_emit(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t nkeys, int32_t ns,
                       int32_t nv, int64_t ng, const int64_t *group_row, const uint64_t *gkh, const int64_t *old,
                       const int64_t *nw, const int32_t *snull, const int32_t *swidth, int32_t nout,
                       const int32_t *shown, const int32_t *nonnull, const int32_t *owidth,
                       struct ArrowArray *batch, struct ArrowArray *out, int64_t **w, uint64_t **kh, uint64_t **rh,
                       int64_t *n, int *ordered, int64_t **ow, int64_t *on, int64_t *const *held, int keyorder);

/* The totals batch dbsp_extremes_emit exports for the same arguments (design note 7), the same rows in the same order
 * with the same *w, *kh, *rh, *n and *ordered; nothing is stored. For a step that asked the emit for none (batch
 * NULL) and then needs its rows after all. Errors: DBSP_EINVAL, DBSP_ENOMEM (nothing exported). */
int dbsp_extremes_batch(const DbspBatch *b, const int32_t *keys, int32_t nkeys, int32_t ns, int32_t nv, int64_t ng,
                        const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                        const int32_t *snull, const int32_t *swidth, int keyorder, struct ArrowArray *batch,
                        int64_t **w, uint64_t **kh, uint64_t **rh, int64_t *n, int *ordered);

/* The extremes a deleted value reached, recomputed (design note 2): for i < n, the key of row rows[i] of b (key
 * columns keys) with key hash kh[i], over the rows of the value batches vb[0..nb) (a value trace's batches, each
 * canonical for its key columns vkeys, key hashes vkh[k], and optionally a fence vfence[k] of them: a NULL array or
 * entry for none) that hold that key, the weights of equal values summed across batches:
 * has[i] = 1 and the least and greatest value of column vcol (integer-like, as int64) among those with a positive
 * sum in mn[i], mx[i]; has[i] = 0 when none has. Cost: a seek per batch and key (design note 6), then the key's
 * rows; never the trace's size. */
int dbsp_extremes_scan(const DbspBatch *b, const int32_t *keys, int32_t nkeys, const int64_t *rows, const uint64_t *kh,
                       int64_t n, const DbspBatch *const *vb, const uint64_t *const *vkh,
                       const uint64_t *const *vfence, int32_t nb, const int32_t *vkeys, int32_t vcol, uint8_t *has,
                       int64_t *mn, int64_t *mx);

#endif
