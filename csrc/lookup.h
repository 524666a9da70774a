/* lookup.h: find the rows of a key-hash-sorted batch that a small change touches, without scanning the batch.
 *
 * Both kernels walk the change's ascending key hashes and gallop (exponential then binary search, dbsp_gallop) over
 * the batch's ascending key hashes, so a change of m keys against a batch of n rows costs O(m log(n / m) +
 * matches) and a small change never scans a large batch.
 */
#ifndef DBSP_LOOKUP_H
#define DBSP_LOOKUP_H

#include <stdint.h>
#include "column.h"

/* A fence over an ascending key-hash array kh[0..n): fence[k] = kh[k << DBSP_FENCE_SHIFT] for k < ceil(n / 64).
 * Seeking through the fence reads a few cache lines of a small array and one 512-byte block of kh, where a
 * gallop over a large, cache-cold kh misses the cache a dozen times per sought hash. */
#define DBSP_FENCE_SHIFT 6

/* The fence length for n hashes. */
static inline int64_t dbsp_fence_len(int64_t n) { return (n + (1 << DBSP_FENCE_SHIFT) - 1) >> DBSP_FENCE_SHIFT; }

/* The seek of want in kh[0..n) once its fence entry is known: f, the first fence entry >= want (dbsp_gallop over the
 * fence, dbsp_fence_len(n) if none), so fence[f - 1] < want <= fence[f] and the answer is in ((f - 1) * 64, f * 64]:
 * a binary search of that one 512-byte block. */
static inline int64_t dbsp_fence_block_seek(const uint64_t *kh, int64_t n, int64_t f, uint64_t want) {
    int64_t nf = dbsp_fence_len(n);
    int64_t s = f ? ((f - 1) << DBSP_FENCE_SHIFT) + 1 : 0, e = f < nf ? f << DBSP_FENCE_SHIFT : n;
    while (s < e) {
        int64_t mid = s + (e - s) / 2;
        if (kh[mid] < want) s = mid + 1; else e = mid;
    }
    return s;
}

/* Prefetch the 512-byte block of kh[0..n) that fence entry f bounds (the block dbsp_fence_block_seek searches). */
static inline void dbsp_prefetch_fence_block(const uint64_t *kh, int64_t n, int64_t f) {
    int64_t nf = dbsp_fence_len(n);
    int64_t s = f ? (f - 1) << DBSP_FENCE_SHIFT : 0, e = f < nf ? f << DBSP_FENCE_SHIFT : n;
    for (int64_t t = s; t < e; t += 8) __builtin_prefetch(&kh[t]);
}

/* First index in [lo, hi) with h[index] >= target (hi if none), by exponential then binary search from lo. */
int64_t dbsp_gallop(const uint64_t *h, int64_t lo, int64_t hi, uint64_t target);

/* First index in [lo, n) with kh[index] >= target (n if none), by the fence when it is not NULL, else by
 * galloping from lo (dbsp_gallop). */
int64_t dbsp_seek(const uint64_t *kh, int64_t n, const uint64_t *fence, int64_t lo, uint64_t target);

/* pos[i] = dbsp_seek(kh, n, fence, 0, want[i]) for every i < m, for ascending want (duplicates allowed), in one
 * pass that prefetches the fence blocks the next few hashes need: a small change against a large, cache-cold
 * batch is bound by memory latency. */
void dbsp_seek_all(const uint64_t *kh, int64_t n, const uint64_t *fence, const uint64_t *want, int64_t m,
                   int64_t *pos);

/* A directory over an ascending key-hash array kh[0..n) (DBSP_DIR_MIN <= n < 2^32), for a batch that changes are sought
 * in again and again (the other side of a join): with b = dbsp_dir_bits(n) bits, dir[x] for x in [0, 2^b] is the
 * first row whose key hash's top b bits are >= x (dir[2^b] = n). A seek of h reads dir[h >> (64 - b)] and the next
 * entry, then scans kh between them: DBSP_DIR_ROWS to 2 * DBSP_DIR_ROWS rows on average (key hashes are spread
 * evenly, hash.h), one cache line of the directory and one of kh, where a fence's seek binary-searches 64 rows. It
 * costs 4 bytes per bucket: 0.5 to 1 byte a row. A run of one key hash (a key with many rows) fills one bucket: its
 * scan gallops (dbsp_gallop) past a few rows, so a seek never walks a long run. */
#define DBSP_DIR_ROWS 4
#define DBSP_DIR_MIN 4096

typedef struct DbspDir {
    const uint32_t *dir;  /* (1 << bits) + 1 entries */
    int32_t bits;
} DbspDir;

/* The directory bits for n rows: floor(log2(n / DBSP_DIR_ROWS)), at least 1, at most 32. */
static inline int32_t dbsp_dir_bits(int64_t n) {
    int32_t b = 1;
    while (b < 32 && ((int64_t)DBSP_DIR_ROWS << (b + 1)) <= n) b++;
    return b;
}

/* Fill dir[0 .. (1 << bits)] for kh[0..n) as DbspDir says. DBSP_EINVAL when n >= 2^32, bits is outside [1, 32] or kh
 * is not ascending (dir is then partly written). */
int dbsp_dir_build(const uint64_t *kh, int64_t n, int32_t bits, uint32_t *dir);

/* First index with kh[index] >= h (n if none), through directory d of kh[0..n). */
int64_t dbsp_dir_seek(const uint64_t *kh, const DbspDir *d, uint64_t h);

/* dbsp_seek_all through directory dir of kh (NULL: through the fence, as dbsp_seek_all). */
void dbsp_seek_all_dir(const uint64_t *kh, int64_t n, const uint64_t *fence, const DbspDir *dir, const uint64_t *want,
                       int64_t m, int64_t *pos);

/* Prefetch row y of b: its values in columns cols[0..ncols) (cols NULL: the first ncols columns) and its weight. */
void dbsp_prefetch_row(const DbspBatch *b, int64_t y, const int32_t *cols, int32_t ncols);

/* The rows of a batch whose key hash kh[0..n) (ascending) occurs in want[0..nwant) (ascending; duplicates
 * allowed and skipped). *idx receives the row numbers, ascending (caller frees with free(); NULL when none),
 * *nidx their count. Errors: DBSP_EINVAL if want is not ascending, DBSP_ENOMEM. */
int dbsp_lookup(const uint64_t *kh, int64_t n, const uint64_t *want, int64_t nwant, int64_t **idx, int64_t *nidx);

/* dbsp_lookup seeking through a fence of kh (NULL: none). */
int dbsp_lookup_fenced(const uint64_t *kh, int64_t n, const uint64_t *fence, const uint64_t *want, int64_t nwant,
                       int64_t **idx, int64_t *nidx);

/* For every row i of a, acc[i] += the weight of the row of b equal to it (whole-row identity, column.h
 * invariant 2; 0 if b has none). a and b have one schema (same value class per column) and are consolidated
 * in canonical order for the same key, with key hashes akh and bkh (rows.h). Inside a run of one key hash the
 * rows are compared pairwise, so it is meant for keys that are (nearly) whole rows, e.g. distinct's.
 * Errors: DBSP_ETYPE (schemas differ), DBSP_EOVERFLOW (a sum leaves int64; acc is then partly updated), DBSP_ENOMEM. */
int dbsp_match_weights(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                       int64_t *acc);

/* dbsp_match_weights seeking in b through a fence of bkh (NULL: none). */
int dbsp_match_weights_fenced(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                              const uint64_t *bfence, int64_t *acc);
/* dbsp_match_weights_fenced with the row hashes of both sides (arh, brh: one per row, in row order; NULL: the
 * plain walk). Rows of one key are in row-hash order in a canonical batch, so each row of a is found by
 * galloping over the row hashes of b's run: O(|a| log run) instead of O(|a| x run) for a big group. */
int dbsp_match_weights_rh(const DbspBatch *a, const uint64_t *akh, const uint64_t *arh, const DbspBatch *b,
                          const uint64_t *bkh, const uint64_t *bfence, const uint64_t *brh, int64_t *acc);

/* Weighted sums of b's int64 columns per key of a: for the i-th selected row of a (row sel[i], or row i when sel is
 * NULL; i < n), whose key hash akh[i] is ascending in i and whose key columns akeys[0..nkeys) are distinct from
 * the other selected rows' (group identity, null equal to null), add to acc[i * ncols + c] the sum, over the
 * rows y of b with an equal key (bkeys), of weight(y) * cols[c](y) (a null value counts as 0). b is in
 * canonical order for bkeys, with key hashes bkh and optionally a fence of them (NULL: none). So a change's groups read their old totals from a trace batch
 * without copying its rows. Errors: DBSP_ETYPE (a key class differs, a sum column is not int64), DBSP_EINVAL
 * (a column position out of range), DBSP_EOVERFLOW (a product or sum leaves int64; acc is then partly updated), DBSP_ENOMEM. */
int dbsp_match_sums(const DbspBatch *a, const uint64_t *akh, const int64_t *sel, int64_t n, const int32_t *akeys,
                    const DbspBatch *b, const uint64_t *bkh, const uint64_t *bfence, const int32_t *bkeys,
                    int32_t nkeys, const int32_t *cols, int32_t ncols, int64_t *acc);

#endif
