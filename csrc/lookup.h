/* lookup.h: find the rows of a key-hash-sorted batch that a small change touches, without scanning the batch.
 *
 * Both kernels walk the change's ascending key hashes and gallop (exponential then binary search, join.h) over
 * the batch's ascending key hashes, so a change of m keys against a batch of n rows costs O(m log(n / m) +
 * matches) and a small change never scans a large batch.
 */
#ifndef DBSP_LOOKUP_H
#define DBSP_LOOKUP_H

#include <stdint.h>
#include "column.h"

/* The rows of a batch whose key hash kh[0..n) (ascending) occurs in want[0..nwant) (ascending; duplicates
 * allowed and skipped). *idx receives the row numbers, ascending (caller frees with free(); NULL when none),
 * *nidx their count. Errors: DBSP_EINVAL if want is not ascending, DBSP_ENOMEM. */
int dbsp_lookup(const uint64_t *kh, int64_t n, const uint64_t *want, int64_t nwant, int64_t **idx, int64_t *nidx);

/* For every row i of a, acc[i] += the weight of the row of b equal to it (whole-row identity, column.h
 * invariant 2; 0 if b has none). a and b have one schema (same value class per column) and are consolidated
 * in canonical order for the same key, with key hashes akh and bkh (rows.h). Inside a run of one key hash the
 * rows are compared pairwise, so it is meant for keys that are (nearly) whole rows, e.g. distinct's.
 * Errors: DBSP_ETYPE (schemas differ), DBSP_EOVERFLOW (a sum leaves int64; acc is then partly updated). */
int dbsp_match_weights(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                       int64_t *acc);

#endif
