/* bloom.h: the blocked Bloom filter of a batch file's key hashes (dbsp_core/trace/batchfile.py invariant 3), built in one pass. */
#ifndef DBSP_BLOOM_H
#define DBSP_BLOOM_H

#include <stddef.h>
#include <stdint.h>

/* Set in words[0..nwords) (a power of two, zeroed by the caller or holding earlier hashes) the k bits of each of the
   n key hashes: word h >> (64 - log2 nwords), bits (h >> 6 i) & 63 for i < k (batchfile.py ``bloom_build``, bit for
   bit). The hashes must ascend: returns -1 at the first that does not (nothing after it is set), else 0. */
int dbsp_bloom_build(const uint64_t *hashes, size_t n, uint64_t *words, size_t nwords, int k);

#endif
