# zset.pxi: the Z-set kernels (zset.h, rows.h): consolidate, merge, negate, sum_adjacent, distinct and the order checker.

cdef object rows_result(CRows *r):
    """Hand a DbspRows' arrays to numpy (ownership moves) as (idx, weights, khash)."""
    idx = own_array(r.idx, r.n, np.int64)
    w = own_array(r.weights, r.n, np.int64)
    kh = own_array(r.khash, r.n, np.uint64)
    r.idx = NULL; r.weights = NULL; r.khash = NULL
    return idx, w, kh


def consolidate(table, weights, keys, bint row_hashes=False):
    """(idx, weights, khash): the consolidated rows of (table, weights) in canonical order for key positions `keys`;
    with `row_hashes`, (idx, weights, khash, rhash) where rhash holds the rows' row hashes when the kernel had
    them (csrc/zset.h dbsp_zset_consolidate_rh: every batch but one of one integer column), else None."""
    cdef BatchView v = view_of(table, weights)
    cdef Int32s k = Int32s(keys)
    cdef CRows r
    cdef uint64_t *rh = NULL
    cdef int st
    with nogil:
        st = dbsp_zset_consolidate_rh(&v.c, k.p, k.n, &r, &rh if row_hashes else NULL)
    check_status(st, "consolidate")
    out = rows_result(&r)
    if not row_hashes:
        return out
    return out + ((own_array(rh, out[0].shape[0], np.uint64) if rh != NULL else None),)


def consolidate_runs(table, weights, khash, sel=None):
    """(idx, weights, khash, rhash): the consolidated rows of (table, weights), or of its rows ``sel`` (ascending),
    in canonical order for a key whose hash each row already has in ``khash`` (ascending over the rows taken: an
    indexed batch's rows projected onto its key and other columns), sorted only within runs of equal key hashes;
    rhash: the kept rows' row hashes over every column (csrc/zset.h dbsp_zset_consolidate_runs)."""
    cdef BatchView v = view_of(table, weights)
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    if kh.shape[0] != v.c.nrows:
        raise ValueError(f"consolidate_runs: {kh.shape[0]} key hashes for {v.c.nrows} rows")
    cdef const uint64_t[::1] pk = kh
    cdef const int64_t[::1] ps
    cdef const int64_t *psel = NULL
    cdef int64_t n = v.c.nrows
    if sel is not None:
        s = np.ascontiguousarray(sel, dtype=np.int64)
        ps = s
        n = s.shape[0]
        psel = &ps[0] if n else NULL
    rh = np.empty(max(n, 1), dtype=np.uint64)
    cdef uint64_t[::1] prh = rh
    cdef CRows r
    cdef int st = DBSP_OK
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.uint64), np.empty(0, np.uint64)
    with nogil:
        st = dbsp_zset_consolidate_runs(&v.c, &pk[0], psel, n, &r, &prh[0])
    check_status(st, "consolidate_runs")
    out = rows_result(&r)
    return out + (rh[:out[0].shape[0]],)


def merge(ta, wa, kha, tb, wb, khb, keys):
    """(idx, weights, khash) of the consolidated sum of two canonical batches; b's rows are numbered after a's."""
    cdef BatchView a = view_of(ta, wa, kha)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef Int32s k = Int32s(keys)
    cdef CRows r
    cdef int st
    with nogil:
        st = dbsp_zset_merge(&a.c, a.kh, &b.c, b.kh, k.p, k.n, &r)
    check_status(st, "merge")
    return rows_result(&r)


def small_rows(n=None):
    """The row count up to which consolidate sorts instead of running the grouping engine (csrc/zset.h); with
    `n`, set it and return the previous value (tests force either path; both give the same result)."""
    global dbsp_small_rows
    old = dbsp_small_rows
    if n is not None:
        if n < 0:
            raise ValueError(f"small_rows must be >= 0, got {n}")
        dbsp_small_rows = n
    return old


def weight_sum(weights):
    """The exact sum of an int64 weight array (a Python int), in one C loop the compiler vectorizes: numpy's reduce
    costs ~9k instructions whatever the rows (a step's metrics sum each output's weights). Each weight's unsigned
    high and low 32 bits and its sign bit are summed apart (logical shifts and adds only, which SSE2 has), so no sum
    can overflow below 2**31 rows (a longer array is summed in Python): the sum is (high - 2**32 * negatives) *
    2**32 + low."""
    cdef const uint64_t *p
    cdef int64_t i, n
    cdef uint64_t hi = 0, lo = 0, neg = 0
    if type(weights) is np.ndarray and cnp.PyArray_TYPE(weights) == cnp.NPY_INT64 \
            and cnp.PyArray_IS_C_CONTIGUOUS(weights) and cnp.PyArray_NDIM(weights) == 1 \
            and cnp.PyArray_DIM(weights, 0) < (<int64_t>1 << 31):
        p = <const uint64_t *>cnp.PyArray_DATA(weights)
        n = cnp.PyArray_DIM(weights, 0)
        with nogil:
            for i in range(n):
                hi += p[i] >> 32
                lo += p[i] & 0xffffffffU
                neg += p[i] >> 63
        return ((<object>hi - (<object>neg << 32)) << 32) + <object>lo
    return int(np.asarray(weights, dtype=np.int64).astype(object).sum())


def negate(weights):
    """-weights as a new int64 array; WeightOverflowError for INT64_MIN."""
    w = np.ascontiguousarray(weights, dtype=np.int64)
    out = np.empty_like(w)
    cdef const int64_t[::1] wi = w
    cdef int64_t[::1] wo = out
    cdef int64_t n = w.shape[0]
    cdef int st = DBSP_OK
    if n:
        with nogil:
            st = dbsp_weights_negate(&wi[0], n, &wo[0])
    check_status(st, "negate")
    return out


def sum_adjacent(table, weights, h):
    """The runs of adjacent equal rows of (table, weights) that share a hash h[i], summed (csrc/zset.h): (idx,
    weights) of the rows kept, zero sums dropped; None when no run has two rows (every row stays as it is)."""
    cdef BatchView v = view_of(table, weights)
    hh = np.ascontiguousarray(h, dtype=np.uint64)
    cdef int64_t m = v.c.nrows, n = 0
    if hh.shape[0] != m:
        raise ValueError(f"sum_adjacent: {hh.shape[0]} hashes for {m} rows")
    if m == 0:
        return None
    idx = np.empty(m, dtype=np.int64)
    w = np.empty(m, dtype=np.int64)
    cdef const uint64_t[::1] ph = hh
    cdef int64_t[::1] pi = idx
    cdef int64_t[::1] pw = w
    cdef int st
    with nogil:
        st = dbsp_zset_sum_adjacent(&v.c, &ph[0], &pi[0], &pw[0], &n)
    check_status(st, "sum_adjacent")
    return None if n == m else (idx[:n], w[:n])


def distinct(table, weights, rh):
    """The equal rows of (table, weights) summed, in no particular order (csrc/zset.h dbsp_zset_distinct), given the
    rows' row hashes rh: (idx, weights) of the rows kept, in row order, zero sums dropped; None when no two rows are
    equal and no weight is 0 (every row stays as it is)."""
    cdef BatchView v = view_of(table, weights)
    hh = np.ascontiguousarray(rh, dtype=np.uint64)
    cdef int64_t m = v.c.nrows, n = 0
    if hh.shape[0] != m:
        raise ValueError(f"distinct: {hh.shape[0]} row hashes for {m} rows")
    if m == 0:
        return None
    idx = np.empty(m, dtype=np.int64)
    w = np.empty(m, dtype=np.int64)
    cdef const uint64_t[::1] ph = hh
    cdef int64_t[::1] pi = idx
    cdef int64_t[::1] pw = w
    cdef int st
    with nogil:
        st = dbsp_zset_distinct(&v.c, &ph[0], &pi[0], &pw[0], &n)
    check_status(st, "distinct")
    return None if n == m else (idx[:n], w[:n])


def hash_distinct(table, weights):
    """:func:`hash_columns` over every column and :func:`distinct` in one C pass (csrc/zset.h
    dbsp_zset_hash_distinct): ``(rh, kept)``, rh the rows' row hashes, kept None when no two rows are equal and no
    weight is 0, else (idx, weights) of the rows kept, in row order, zero sums dropped. ``table`` may be a
    BatchView (its weights are then the view's)."""
    cdef BatchView v = view_of(table, weights)
    cdef int64_t m = v.c.nrows, n = 0
    rh = np.empty(m, dtype=np.uint64)
    if m == 0:
        return rh, None
    idx = np.empty(m, dtype=np.int64)
    w = np.empty(m, dtype=np.int64)
    cdef uint64_t[::1] ph = rh
    cdef int64_t[::1] pi = idx
    cdef int64_t[::1] pw = w
    cdef int st
    with nogil:
        st = dbsp_zset_hash_distinct(&v.c, &ph[0], &pi[0], &pw[0], &n)
    check_status(st, "hash_distinct")
    return rh, (None if n == m else (idx[:n], w[:n]))


def distinct_rows(table, weights):
    """:func:`distinct` without row hashes (csrc/zset.h dbsp_zset_distinct_rows: the probe hashes rows its own,
    cheaper way, and keeps no hash): None when no two rows are equal and no weight is 0, else (idx, weights) of
    the rows kept, in row order, zero sums dropped. ``table`` may be a BatchView (its weights are then the view's)."""
    cdef BatchView v = view_of(table, weights)
    cdef int64_t m = v.c.nrows, n = 0
    if m == 0:
        return None
    cdef cnp.npy_intp dims[1]
    dims[0] = m
    idx = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)  # (new arrays' pointers: no memoryview to acquire)
    w = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
    cdef int64_t *pi = <int64_t *>cnp.PyArray_DATA(idx)
    cdef int64_t *pw = <int64_t *>cnp.PyArray_DATA(w)
    cdef int st
    with nogil:
        st = dbsp_zset_distinct_rows(&v.c, pi, pw, &n)
    check_status(st, "distinct_rows")
    return None if n == m else (idx[:n], w[:n])


def check_order(table, weights, khash, keys):
    """True if (table, weights) is consolidated and in canonical order for `keys` (a debug checker)."""
    cdef BatchView v = view_of(table, weights, khash)
    cdef Int32s k = Int32s(keys)
    return dbsp_rows_check_order(&v.c, NULL, v.c.weights, v.kh, v.c.nrows, k.p, k.n) == 0
