# partition.pxi: partition (partition.h): rows ordered part by part for a shard map.

def partition(khash, part_of_shard, int32_t nparts):
    """(perm, offsets): rows ordered part by part (stable) for shard = top bits of khash; parts from the map."""
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    pos = np.ascontiguousarray(part_of_shard, dtype=np.int32)
    nshards = pos.shape[0]
    if nshards == 0 or nshards & (nshards - 1):
        raise ValueError(f"part_of_shard must have a power-of-two length, got {nshards}")
    cdef int bits = int(nshards).bit_length() - 1
    cdef int64_t n = kh.shape[0]
    perm = np.empty(n, dtype=np.int64)
    offsets = np.empty(nparts + 1, dtype=np.int64)
    cdef const uint64_t[::1] pk = kh
    cdef const int32_t[::1] ps = pos
    cdef int64_t[::1] pp = perm
    cdef int64_t[::1] po = offsets
    cdef int st
    with nogil:
        st = dbsp_partition(&pk[0] if n else NULL, n, &ps[0], bits, nparts, &pp[0] if n else NULL, &po[0])
    check_status(st, "partition")
    return perm, offsets
