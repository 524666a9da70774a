/* merge.h: a merge cursor computes the consolidated sum of two (or k) canonical batches in bounded steps, into Arrow buffers.
 *
 * Invariants (of a merge cursor, DbspMergeCursor, between steps; checked by the tests against dbsp_zset_merge):
 *  1. Rows a[0..ia) and b[0..ib) are consumed, and output rows [0, n) are their consolidated sum in canonical
 *     order (rows.h), with their weights, key hashes and (when asked for) row hashes: exactly the first n rows
 *     of dbsp_zset_merge's result.
 *     Two equal rows (one per side) are consumed together, so a step never splits a row's weight.
 *  2. The output buffers hold room for a->nrows + b->nrows rows (and all of both sides' bytes), so no step
 *     reallocates: a step costs O(rows consumed), whatever has been merged before.
 *  3. Bits past row n of the output bitmaps are zero, and offsets[0..n] are final: a finished merge is a valid
 *     Arrow array of n rows over these buffers.
 *  4. k-way (dbsp_merge_k_*, 2 <= k <= DBSP_MERGE_MAX_K): the same with k inputs, positions pos[0..k) and n output
 *     rows: the output is the consolidated sum of the k inputs in canonical order, the row for row result of
 *     merging them two at a time (equal rows of any inputs are consumed together, their weights summed, a zero sum
 *     dropped), in the same output form (buffers sized by dbsp_merge_k_sizes), so a caller that builds a two-way
 *     output in place (a scratch file that becomes a batch file) builds a k-way one the same way. A step picks among
 *     the k heads through a tournament of losers (log2 k key-hash comparisons a row; row hashes and values only where
 *     key hashes meet, merge.c design note 4): one
 *     pass writes each row once where a cascade of two-way merges writes it log2(k) times.
 */
#ifndef DBSP_MERGE_H
#define DBSP_MERGE_H

#include <stdint.h>
#include "column.h"

#define DBSP_MERGE_MAX_K 64  /* inputs of a k-way merge at most */

/* One output column, in buffers the caller allocated for cap = a->nrows + b->nrows rows. */
typedef struct DbspOutColumn {
    int32_t type;        /* the DbspType of both inputs' column */
    uint8_t *validity;   /* ceil(cap / 8) bytes, or NULL when neither input column has a validity bitmap */
    void *values;        /* fixed width: cap * width bytes; bool: ceil(cap / 8) bytes; variable width: cap + 1
                          * offsets (int32, int64 for the large types) */
    uint8_t *data;       /* variable width: room for both inputs' bytes; else NULL */
    int64_t null_count;  /* nulls among output rows [0, n) */
} DbspOutColumn;

typedef struct DbspMergeCursor {
    int64_t ia, ib;      /* rows of a and b consumed */
    int64_t n;           /* output rows written */
} DbspMergeCursor;

/* The byte counts of column c's output buffers for cap rows given both inputs' columns (`data` counts the
 * bytes of both sides' rows; 0 for fixed width); validity is 0 when neither side has a bitmap. */
void dbsp_merge_cursor_sizes(const DbspColumn *a, int64_t na, const DbspColumn *b, int64_t nb, int64_t *validity,
                             int64_t *values, int64_t *data);

/* Start a merge: zero the cursor, set each output column's type, null count and first offset. DBSP_ETYPE unless
 * both batches have the same column types (supported ones). */
int dbsp_merge_cursor_init(const DbspBatch *a, const DbspBatch *b, DbspMergeCursor *m, DbspOutColumn *out);

/* Advance merge m of a and b (consolidated, canonical for key columns keys[0..nkeys), nkeys == 0: the whole row,
 * with key hashes akh and bkh, and row hashes arh and brh or NULL) by at least `budget` consumed input rows, or to
 * the end: writes output rows [m->n, ...) into out, w (weights), kh (key hashes) and, unless NULL, rh (row
 * hashes). Where key hashes meet, rows are ordered by row hash: taken from arh/brh, else computed (only for
 * rows that are not equal), so batches that keep their row hashes merge without hashing. Returns DBSP_OK; the
 * merge is finished when m->ia == a->nrows and m->ib == b->nrows. DBSP_EOVERFLOW if two weights sum past int64
 * (the cursor then stands before those rows), DBSP_ETOOBIG if a utf8/binary column's output passes 2^31-1
 * bytes. */
int dbsp_merge_cursor_step(const DbspBatch *a, const uint64_t *akh, const uint64_t *arh, const DbspBatch *b,
                           const uint64_t *bkh, const uint64_t *brh, const int32_t *keys, int32_t nkeys,
                           int64_t budget, DbspMergeCursor *m, DbspOutColumn *out, int64_t *w, uint64_t *kh,
                           uint64_t *rh);

/* k-way (invariant 4): output buffer sizes for the k inputs' column c (cols[x]: input x's, n[x] its rows). */
void dbsp_merge_k_sizes(const DbspColumn *const *cols, const int64_t *n, int32_t k, int64_t *validity,
                        int64_t *values, int64_t *data);

/* k-way: check the k inputs' column types agree and set each output column's type, null count and first offset
 * (the caller zeroes pos[0..k) and its output row count). DBSP_EINVAL unless 2 <= k <= DBSP_MERGE_MAX_K and the
 * column counts agree, DBSP_ETYPE unless the types do. */
int dbsp_merge_k_init(const DbspBatch *const *in, int32_t k, DbspOutColumn *out);

/* k-way: advance the merge of in[0..k) (consolidated, canonical; kh[x] their key hashes, rh[x] their row hashes or
 * NULL) by at least `budget` consumed input rows, or to the end, from positions pos[] and *n output rows: as
 * dbsp_merge_cursor_step, for k inputs (`keys` is unused but for symmetry: nkeys == 0 is a whole-row key). */
int dbsp_merge_k_step(const DbspBatch *const *in, const uint64_t *const *kh, const uint64_t *const *rh, int32_t k,
                      const int32_t *keys, int32_t nkeys, int64_t budget, int64_t *pos, int64_t *n,
                      DbspOutColumn *out, int64_t *w, uint64_t *okh, uint64_t *orh);

#endif
