# join.pxi: the equi-joins (join.h): the merge join of indexed batches and the hash join.

def join(ta, wa, kha, akeys, tb, wb, khb, bkeys, bint left_outer=False):
    """(li, ri, w): matching row pairs of two indexed batches (ri = -1 for unmatched left rows if left_outer)."""
    if len(akeys) != len(bkeys):
        raise ValueError(f"join: {len(akeys)} left keys but {len(bkeys)} right keys")
    cdef BatchView a = view_of(ta, wa, kha)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef Int32s ak = Int32s(akeys)
    cdef Int32s bk = Int32s(bkeys)
    cdef CPairs p
    cdef int st
    with nogil:
        st = dbsp_join_fenced(&a.c, a.kh, a.fence, ak.p, &b.c, b.kh, b.fence, bk.p, ak.n, left_outer, &p)
    check_status(st, "join")
    return pairs_result(&p)


def hash_join(ta, wa, akeys, tb, wb, bkeys, bint left_outer=False):
    """(li, ri, w): matching row pairs of any two batches, by hashing (no index needed)."""
    if len(akeys) != len(bkeys):
        raise ValueError(f"join: {len(akeys)} left keys but {len(bkeys)} right keys")
    cdef BatchView a = view_of(ta, wa)
    cdef BatchView b = view_of(tb, wb)
    cdef Int32s ak = Int32s(akeys)
    cdef Int32s bk = Int32s(bkeys)
    cdef CPairs p
    cdef int st
    with nogil:
        st = dbsp_hash_join(&a.c, ak.p, &b.c, bk.p, ak.n, left_outer, &p)
    check_status(st, "hash_join")
    return pairs_result(&p)


cdef object pairs_result(CPairs *p):
    """Hand a DbspPairs' arrays to numpy (ownership moves) as (li, ri, w)."""
    li = own_array(p.li, p.n, np.int64)
    ri = own_array(p.ri, p.n, np.int64)
    w = own_array(p.w, p.n, np.int64)
    p.li = NULL; p.ri = NULL; p.w = NULL
    return li, ri, w
