# reduce.pxi: the grouped aggregates (agg.h, reduce.h): aggregate specs, reduce and group_reduce.

AGG_KINDS = {"count": DBSP_AGG_COUNT, "count_col": DBSP_AGG_COUNT_COL, "sum": DBSP_AGG_SUM,
             "min": DBSP_AGG_MIN, "max": DBSP_AGG_MAX}


cdef CAggSpec *agg_specs(object aggs) except NULL:
    cdef CAggSpec *specs = <CAggSpec *>malloc(max(len(aggs), 1) * sizeof(CAggSpec))
    if specs == NULL:
        raise MemoryError()
    for i, (kind, col) in enumerate(aggs):
        if kind not in AGG_KINDS:
            free(specs)
            raise ValueError(f"unknown aggregate {kind!r}; expected one of {sorted(AGG_KINDS)}")
        specs[i].kind = AGG_KINDS[kind]
        specs[i].col = -1 if col is None else col
    return specs


cdef object reduce_result(CReduceOut *r, int32_t na):
    """Hand a DbspReduceOut's arrays to numpy (ownership moves) as (group_row, khash, ivals, fvals, valid)."""
    g = r.ngroups
    group_row = own_array(r.group_row, g, np.int64)
    khash = own_array(r.khash, g, np.uint64)
    ivals = own_array(r.ivals, g * na, np.int64).reshape(g, na)
    fvals = own_array(r.fvals, g * na, np.float64).reshape(g, na)
    valid = own_array(r.valid, g * na, np.uint8).reshape(g, na)
    r.group_row = NULL; r.khash = NULL; r.ivals = NULL; r.fvals = NULL; r.valid = NULL
    return group_row, khash, ivals, fvals, valid


def reduce(table, weights, khash, keys, aggs):
    """(group_row, khash, ivals, fvals, valid) of an indexed batch's groups; aggs: (kind name, column position)."""
    cdef BatchView v = view_of(table, weights, khash)
    cdef Int32s k = Int32s(keys)
    cdef CAggSpec *specs = agg_specs(aggs)
    cdef int32_t na = len(aggs)
    cdef CReduceOut r
    cdef int st
    with nogil:
        st = dbsp_reduce(&v.c, v.kh, k.p, k.n, specs, na, &r)
    free(specs)
    check_status(st, "reduce")
    return reduce_result(&r, na)


def group_reduce(table, weights, keys, aggs, bint keep_zero=False):
    """Like reduce, for any batch (no index), by hash grouping; groups in key-hash order. Groups whose weights
    sum to 0 are left out unless `keep_zero`."""
    cdef BatchView v = view_of(table, weights)
    cdef Int32s k = Int32s(keys)
    cdef CAggSpec *specs = agg_specs(aggs)
    cdef int32_t na = len(aggs)
    cdef CReduceOut r
    cdef int st
    with nogil:
        if keep_zero:
            st = dbsp_group_reduce_all(&v.c, k.p, k.n, specs, na, &r)
        else:
            st = dbsp_group_reduce(&v.c, k.p, k.n, specs, na, &r)
    free(specs)
    check_status(st, "group_reduce")
    return reduce_result(&r, na)
