/* fold.h: the linear aggregate's step kernel: a step's changed groups as rows of new (+1) and old (-1) partial sums, in index order. */
#ifndef DBSP_FOLD_H
#define DBSP_FOLD_H

#include <stdint.h>

/* Given ng groups (key hashes khash[0..ng) ascending, each the row hash of the group's key columns) with old
 * totals old[g * ns + j] and a step's sums delta[g * ns + j] over ns int64 slots (slot 0 is the row count):
 * for each group with a non-zero delta, emit a row of its new totals (old + delta) with weight +1 if the new
 * count is not 0, and a row of its old totals with weight -1 if the old count is not 0. Rows are emitted in
 * canonical index order (rows.h): by key hash, then by the row hash of (key columns, slots), which extends the
 * key hash by the slots as int64 columns (hash.h). Outputs (room for 2 * ng rows): grp[k] the group, w[k],
 * kh[k] its key hash, vals[j * cap + k] slot j of row k (column-major, cap = 2 * ng); *n the row count;
 * *ordered = 0 when two emitted groups share a key hash or a group's two rows share a row hash (the rows are
 * then emitted but their order is not canonical: the caller sorts them). With rh (room for 2 * ng), rh[k] is
 * row k's row hash. DBSP_EOVERFLOW if old + delta leaves int64 (nothing is emitted). */
int dbsp_linear_fold(int64_t ng, int32_t ns, const int64_t *old, const int64_t *delta, const uint64_t *khash,
                     int64_t *grp, int64_t *w, uint64_t *kh, int64_t *vals, int64_t *n, int *ordered, uint64_t *rh);

/* dbsp_linear_fold in key-hash order only when canon is 0 and rh is NULL (for a caller whose rows need no order
 * within a key: csrc/linrun.h invariant 8): no row hash is computed, a group's new row (+1) comes before its old
 * row (-1), and *ordered is 0 only when two emitted groups share a key hash. canon 1: dbsp_linear_fold. */
int dbsp_linear_fold2(int64_t ng, int32_t ns, const int64_t *old, const int64_t *delta, const uint64_t *khash,
                      int64_t *grp, int64_t *w, uint64_t *kh, int64_t *vals, int64_t *n, int *ordered, uint64_t *rh,
                      int canon);

#endif
