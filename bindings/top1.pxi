# top1.pxi: the first row of each group in a row order, by hash grouping (top1.h).

def top1_rows(table, khash, keys, order):
    """The first row of each group of `table` (groups: equal values of the columns `keys`, whose per-row hashes are
    `khash`, uint64) in the order `order` ((column position, descending) pairs, nulls last; rows equal on every
    pair: the first seen), as an int64 array of row indices, groups in order of first appearance (csrc/top1.h);
    None when two different keys share a hash. Reads only."""
    cdef BatchView v = view_of(table)
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    if kh.shape[0] != v.c.nrows:
        raise ValueError(f"top1_rows: {kh.shape[0]} hashes for {v.c.nrows} rows")
    cdef Int32s k = Int32s(keys)
    cdef Int32s o = Int32s([c for c, _ in order])
    d = np.array([1 if x else 0 for _, x in order] or [0], dtype=np.uint8)
    cdef const uint8_t[::1] pd = d
    cdef int64_t n = v.c.nrows, ng = 0
    best = np.empty(max(n, 1), dtype=np.int64)
    cdef int64_t[::1] pb = best
    cdef const uint64_t[::1] pk = kh if n else np.zeros(1, dtype=np.uint64)
    cdef int st
    with nogil:
        st = dbsp_top1(&v.c, &pk[0], k.p, k.n, o.p, &pd[0], o.n, &pb[0], &ng)
    check_status(st, "top1_rows")
    if ng < 0:
        return None
    return best[:ng]
