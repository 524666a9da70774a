# lookup.pxi: the lookups of a change in a sorted batch (lookup.h): fences, lookup, match_weights, match_sums.

FENCE_SHIFT = DBSP_FENCE_SHIFT


def fence(khash):
    """The fence of an ascending key-hash array (every 64th hash, lookup.h), for set_fence and lookup."""
    return np.ascontiguousarray(np.asarray(khash, dtype=np.uint64)[::1 << DBSP_FENCE_SHIFT])


def lookup(khash, want, fence=None):
    """Row numbers (ascending int64) of the rows whose key hash (`khash`, ascending uint64) occurs in `want`
    (ascending uint64, duplicates allowed), by galloping (or seeking through `fence`, the fence of `khash`): the
    cost grows with `want`, not with `khash`."""
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    wq = np.ascontiguousarray(want, dtype=np.uint64)
    cdef const uint64_t[::1] pk = kh
    cdef const uint64_t[::1] pw = wq
    cdef const uint64_t[::1] pf
    cdef const uint64_t *fp = NULL
    cdef int64_t n = kh.shape[0], nw = wq.shape[0], m = 0
    cdef int64_t *idx = NULL
    cdef int st
    if fence is not None:
        fa = np.ascontiguousarray(fence, dtype=np.uint64)
        if fa.shape[0] != (n + (1 << DBSP_FENCE_SHIFT) - 1) >> DBSP_FENCE_SHIFT:
            raise ValueError(f"lookup: {fa.shape[0]} fence entries for {n} hashes")
        if fa.shape[0]:
            pf = fa
            fp = &pf[0]
    with nogil:
        st = dbsp_lookup_fenced(&pk[0] if n else NULL, n, fp, &pw[0] if nw else NULL, nw, &idx, &m)
    check_status(st, "lookup")
    return own_array(idx, m, np.int64)


def match_weights(ta, wa, kha, tb, wb, khb, acc, rha=None, rhb=None):
    """acc[i] += the weight of b's row equal to a's row i (both canonical for one key); `acc` is int64, updated
    in place. With the row hashes of both sides (`rha`, `rhb`: uint64, one per row in row order) the rows of a
    key are found by galloping over b's row hashes, so a big group costs log of its size, not its size."""
    cdef BatchView a = view_of(ta, wa, kha)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef int64_t[::1] out = acc
    if out.shape[0] != ta.num_rows:
        raise ValueError(f"match_weights: {out.shape[0]} accumulators for {ta.num_rows} rows")
    cdef int st
    if ta.num_rows == 0 or tb.num_rows == 0:
        return acc
    cdef const uint64_t[::1] ra
    cdef const uint64_t[::1] rb
    cdef const uint64_t *pra = NULL
    cdef const uint64_t *prb = NULL
    if rha is not None and rhb is not None:
        ra = np.ascontiguousarray(rha, dtype=np.uint64)
        rb = np.ascontiguousarray(rhb, dtype=np.uint64)
        if ra.shape[0] != ta.num_rows or rb.shape[0] != tb.num_rows:
            raise ValueError(f"match_weights: {ra.shape[0]} and {rb.shape[0]} row hashes for {ta.num_rows} and "
                             f"{tb.num_rows} rows")
        pra, prb = &ra[0], &rb[0]
    with nogil:
        st = dbsp_match_weights_rh(&a.c, a.kh, pra, &b.c, b.kh, b.fence, prb, &out[0])
    check_status(st, "match_weights")
    return acc


def match_sums(ta, akh, sel, akeys, tb, wb, khb, bkeys, cols, acc):
    """acc[i, c] += sum over b's rows whose key equals that of a's row sel[i] of weight * b[cols[c]] (int64 columns);
    `akh` holds the key hashes of the selected rows, ascending; `acc` is an int64 (len(sel), len(cols)) array,
    updated in place."""
    if len(akeys) != len(bkeys):
        raise ValueError(f"match_sums: {len(akeys)} left keys but {len(bkeys)} right keys")
    kh = np.ascontiguousarray(akh, dtype=np.uint64)
    sl = np.ascontiguousarray(sel, dtype=np.int64)
    cdef int64_t n = sl.shape[0]
    if kh.shape[0] != n:
        raise ValueError(f"match_sums: {kh.shape[0]} key hashes for {n} selected rows")
    if n and (sl.min() < 0 or sl.max() >= ta.num_rows):
        raise ValueError("match_sums: a selected row is out of range")
    if acc.dtype != np.int64 or acc.ndim != 2 or acc.shape[0] != n or acc.shape[1] != len(cols) \
            or not acc.flags.c_contiguous:
        raise ValueError(f"match_sums: acc must be a C-contiguous int64 array of shape ({n}, {len(cols)})")
    cdef BatchView a = view_of(ta)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef Int32s ak = Int32s(akeys)
    cdef Int32s bk = Int32s(bkeys)
    cdef Int32s cs = Int32s(cols)
    cdef const uint64_t[::1] pk = kh
    cdef const int64_t[::1] ps = sl
    cdef int64_t[:, ::1] out = acc
    cdef int st
    if n == 0 or tb.num_rows == 0 or len(cols) == 0:
        return acc
    with nogil:
        st = dbsp_match_sums(&a.c, &pk[0], &ps[0], n, ak.p, &b.c, b.kh, b.fence, bk.p, ak.n, cs.p, cs.n,
                             &out[0, 0])
    check_status(st, "match_sums")
    return acc
