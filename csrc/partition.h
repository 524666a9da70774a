/* partition.h: split rows into parts by shard (the top bits of the key hash) through a shard-to-part map. */
#ifndef DBSP_PARTITION_H
#define DBSP_PARTITION_H

#include <stdint.h>

/* The shard of a key hash among 2^shard_bits shards: its top shard_bits bits (0 when shard_bits == 0). */
static inline uint64_t dbsp_shard_of(uint64_t h, int shard_bits) {
    return shard_bits ? h >> (64 - shard_bits) : 0;
}

/* Stable counting sort of rows 0..n-1 by part_of_shard[shard_of(khash[i])]: perm[0..n) lists the rows part by
 * part, offsets[0..nparts] delimits each part. Errors: DBSP_EINVAL if shard_bits is outside 0..30 or a map
 * entry is outside 0..nparts-1. */
int dbsp_partition(const uint64_t *khash, int64_t n, const int32_t *part_of_shard, int shard_bits,
                   int32_t nparts, int64_t *perm, int64_t *offsets);

#endif
