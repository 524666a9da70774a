/* zset.h: Z-set kernels over Arrow-layout batches: consolidate (also the index build), merge, negate. */
#ifndef DBSP_ZSET_H
#define DBSP_ZSET_H

#include <stdint.h>
#include "column.h"
#include "rows.h"

/* Consolidate b: sum the weights of equal rows, drop zero sums, and order the result canonically (rows.h)
 * with the key hash over keys[0..nkeys) (nkeys == 0: the whole row is the key). Fills *out (caller frees
 * with dbsp_rows_free). Errors: DBSP_EOVERFLOW if a sum leaves int64, DBSP_ETOOBIG past 2^32-1 rows. */
int dbsp_zset_consolidate(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out);

/* dbsp_zset_consolidate that also hands over the output rows' row hashes (over every column) when it has them: for
 * *rhash is a malloc'ed array of out->n hashes (the caller frees it): a batch of at most dbsp_small_rows rows (sorted
 * by them) and a larger one grouped by the grouping engine (its identity hashes, group.h dbsp_group_ih); NULL when
 * the engine's one-integer-column path ran (a one-column batch: its row hash is computed on demand). */
int dbsp_zset_consolidate_rh(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out,
                             uint64_t **rhash);

/* Consolidate the rows sel[0..n) (ascending; NULL and n == b->nrows: every row) of b, which are already in key-hash
 * order: kh[r] is row r's key hash, not decreasing over the selection (an indexed batch's rows projected onto its key
 * columns and some others, whose key hash is the same). The result is dbsp_zset_consolidate's for that key (rows.h
 * canonical order, each group represented by its first row, exact sums, zero sums dropped), found by sorting only
 * within each run of equal key hashes; out->khash holds kh of the kept rows, orh (room for n, unless NULL) their row
 * hashes over every column of b. DBSP_EINVAL if kh decreases over the selection or a row is out of range;
 * DBSP_EOVERFLOW, DBSP_ETYPE as dbsp_zset_consolidate. */
int dbsp_zset_consolidate_runs(const DbspBatch *b, const uint64_t *kh, const int64_t *sel, int64_t n, DbspRows *out,
                               uint64_t *orh);

/* Batches of at most this many rows are consolidated by sorting instead of the grouping engine (same result;
 * zset.c "small-batch design notes"). A variable so tests can force either path. */
#define DBSP_SMALL_ROWS 4096
extern int64_t dbsp_small_rows;

/* Merge two consolidated batches of one schema, both in canonical order for the same key, given their key
 * hashes: the result is the consolidated sum, in canonical order; rows of b are numbered from a->nrows. */
int dbsp_zset_merge(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                    const int32_t *keys, int32_t nkeys, DbspRows *out);

/* Sum the runs of adjacent equal rows of b whose hashes h are equal (h: any hash that equal rows share, such
 * as the key hash of a batch in index order), dropping zero sums: rows that can only be equal when adjacent (a
 * linear aggregate's step emits a group's old and new row side by side) are consolidated without sorting. The
 * kept rows are idx[0..*n) (each run's first row) with weights w (room for b->nrows each); *n == b->nrows when
 * no run has two rows. DBSP_EOVERFLOW if a sum leaves int64. */
int dbsp_zset_sum_adjacent(const DbspBatch *b, const uint64_t *h, int64_t *idx, int64_t *w, int64_t *n);

/* Sum the equal rows of b in no particular order (no sort): rh[i] is row i's row hash (dbsp_hash_columns over
 * every column); each set of equal rows is kept as its first row, with the exact sum of their weights
 * (dbsp_add_exact), zero sums dropped. The kept rows are idx[0..*n) in row order with weights w (room for
 * b->nrows each); *n == b->nrows when no two rows are equal and no weight is 0. A step's output needs only
 * this (zset.py invariant 2, "distinct"), not canonical order. DBSP_EOVERFLOW if a sum leaves int64. */
int dbsp_zset_distinct(const DbspBatch *b, const uint64_t *rh, int64_t *idx, int64_t *w, int64_t *n);

/* dbsp_zset_distinct with the row hashes computed here (rh: room for b->nrows, filled with dbsp_hash_columns's
 * hashes over every column): each block of rows hashed and then probed in one pass (zset.c design note 4).
 * DBSP_ETYPE for a column type the hash does not know, else as dbsp_zset_distinct. */
int dbsp_zset_hash_distinct(const DbspBatch *b, uint64_t *rh, int64_t *idx, int64_t *w, int64_t *n);

/* dbsp_zset_distinct without row hashes, given or made: the probe uses a hash of its own that equal rows share
 * (zset.c design note 5: cheaper than the row hash, never stored), for a Z-set made distinct whose row hashes
 * nobody reads. DBSP_ETYPE for a column type the hash does not know, else as dbsp_zset_distinct. */
int dbsp_zset_distinct_rows(const DbspBatch *b, int64_t *idx, int64_t *w, int64_t *n);

/* out[i] = -w[i]; DBSP_EOVERFLOW for INT64_MIN. out may equal w. */
int dbsp_weights_negate(const int64_t *w, int64_t n, int64_t *out);

/* 0 if the selection of b (b's own rows if sel is NULL) is consolidated and in canonical order, else -1. */
int dbsp_rows_check_order(const DbspBatch *b, const int64_t *sel, const int64_t *weights, const uint64_t *khash,
                          int64_t n, const int32_t *keys, int32_t nkeys);

#endif
