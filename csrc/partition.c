/* partition.c: the exchange kernel: a stable counting sort of rows by destination part. */
#include <stdlib.h>
#include <string.h>
#include "partition.h"
#include "status.h"

int dbsp_partition(const uint64_t *khash, int64_t n, const int32_t *part_of_shard, int shard_bits,
                   int32_t nparts, int64_t *perm, int64_t *offsets) {
    if (shard_bits < 0 || shard_bits > 30 || nparts < 1) return DBSP_EINVAL;
    int64_t nshards = (int64_t)1 << shard_bits;
    for (int64_t s = 0; s < nshards; s++)
        if (part_of_shard[s] < 0 || part_of_shard[s] >= nparts) return DBSP_EINVAL;
    memset(offsets, 0, (size_t)(nparts + 1) * 8);
    for (int64_t i = 0; i < n; i++) offsets[part_of_shard[dbsp_shard_of(khash[i], shard_bits)] + 1]++;
    for (int32_t p = 0; p < nparts; p++) offsets[p + 1] += offsets[p];
    int64_t *cur = malloc((size_t)nparts * 8);
    if (!cur) return DBSP_ENOMEM;
    memcpy(cur, offsets, (size_t)nparts * 8);
    for (int64_t i = 0; i < n; i++) perm[cur[part_of_shard[dbsp_shard_of(khash[i], shard_bits)]]++] = i;
    free(cur);
    return DBSP_OK;
}
