/* bloom.c: the blocked Bloom filter of a batch file's key hashes, built in one pass (bloom.h). */
#include "bloom.h"

int dbsp_bloom_build(const uint64_t *hashes, size_t n, uint64_t *words, size_t nwords, int k) {
    int bits = 0;
    while (((size_t)1 << bits) < nwords) bits++;
    for (size_t i = 0; i < n; i++) {
        uint64_t h = hashes[i], mask = 0;
        if (i && h < hashes[i - 1]) return -1;
        for (int j = 0; j < k; j++) mask |= (uint64_t)1 << ((h >> (6 * j)) & 63);
        words[bits ? (size_t)(h >> (64 - bits)) : 0] |= mask;
    }
    return 0;
}
