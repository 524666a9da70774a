/* spillread.h: what a step's reads of spilled batches cost the Python side, batched (dbsp_core/trace/spillread.py):
 * the Bloom tests of a step's key hashes against a spilled batch's filter, and the pages of a batch file's mapping
 * that a fenced seek of those hashes and a read of the rows found touch (the cache's accounting, spill.py invariant
 * 12). Both were numpy per batch (batchfile.py ``bloom_may_contain``, ``BatchFile._pages_read``): ~50-100 us of
 * Python per batch read a step, where the work itself is a few us. */
#ifndef DBSP_SPILLREAD_H
#define DBSP_SPILLREAD_H

#include <stddef.h>
#include <stdint.h>

/* out[i] = 1 when the blocked Bloom filter words[0..nwords) (a power of two; bloom.h's layout, k bits in word
 * h >> (64 - log2 nwords)) may hold hashes[i], else 0; returns how many may. */
size_t dbsp_bloom_probe(const uint64_t *words, size_t nwords, int k, const uint64_t *hashes, size_t m,
                        uint8_t *out);

/* A byte range kind of a batch's buffer, per row (DbspSpan.kind). */
enum {
    DBSP_SPAN_FIXED = 0, /* width bytes a row at off + (row + aoff) * width */
    DBSP_SPAN_BITS = 1,  /* a bit a row at bit (row + aoff) of the bytes at off (validity, booleans) */
    DBSP_SPAN_VAR = 2    /* offsets of width 4 or 8 at off (one more than the rows), and the values they delimit at
                            data (read only with values) */
};

/* One buffer of a batch read in place from a mapping: offsets are from the mapping's first byte. */
typedef struct {
    int64_t kind, width, off, aoff, data;
} DbspSpan;

/* Set in bits (npages bits, one per page of 1 << pageshift bytes numbered from the mapping's first byte) the pages
 * that a fenced seek (lookup.h's dbsp_seek: the key hashes from the fence block before each hash to one block and
 * two rows past the last fence entry not above it) of each of hashes[0..m) (any order) in a batch of n rows whose
 * key hashes are at kh_off and whose fence is fence[0..nfence) (entry j = key hash of row j << fence_shift) reads,
 * and then the rows found, rows[0..nrows) (rows NULL: for each hash, the rows from the fence entry below it to the
 * one above it, where its rows are), in every span spans[0..nspans) (a VAR span's values too when values is set;
 * their offsets are read at base + off). Exactly batchfile.py ``BatchFile._pages_read``'s pages.
 * Returns 0, or -1 when a page falls outside [0, npages) (nothing more is marked; the caller counts another way). */
int dbsp_pages_read(const uint64_t *fence, int64_t nfence, int fence_shift, int64_t n, int64_t kh_off,
                    const uint64_t *hashes, int64_t m, const int64_t *rows, int64_t nrows,
                    const DbspSpan *spans, int64_t nspans, const uint8_t *base, int values,
                    uint64_t *bits, int64_t npages, int pageshift);

/* The pages set in bits[0..(npages + 63) / 64), ascending, into out (NULL: only counted); returns how many. */
int64_t dbsp_bits_list(const uint64_t *bits, int64_t npages, int64_t *out);

/* The cache's clock stamp of a read's pages (spill.py ``_trim_cache``): the pages pages[0..m) (each < the clock's
 * length) whose clock is 0 are counted (returned: the misses), and every page's clock becomes now. */
int64_t dbsp_pages_stamp(int32_t *clock, const int64_t *pages, int64_t m, int32_t now);

#endif
