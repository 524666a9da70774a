# split.pxi: string parts at a literal separator (split.h) into buffers from Arrow's memory pool.

def split_parts(array, sep, indexes):
    """Parts ``indexes`` (0-based, >= 0) of each string of ``array`` (a utf8 or binary Array, one chunk) split at
    the literal bytes ``sep`` (non-empty), as one Array per index of ``array``'s type: null where the string is null
    or has too few parts (csrc/split.h invariant 1)."""
    cdef BatchView v = view_of(pa.table({"s": array}))
    cdef bytes sb = sep.encode() if isinstance(sep, str) else bytes(sep)
    ix = np.ascontiguousarray(indexes, dtype=np.int64)
    cdef int32_t k = <int32_t>ix.shape[0], j
    cdef int64_t n = v.c.nrows
    if k < 1 or len(sb) < 1:
        raise ValueError("split_parts: needs at least one part index and a non-empty separator")
    cdef const int64_t[::1] iv = ix
    starts = np.empty(max(n * k, 1), dtype=np.int64)
    cdef int64_t[::1] sv = starts
    nulls = np.zeros(k, dtype=np.int64)
    nbytes = np.zeros(k, dtype=np.int64)
    cdef int64_t[::1] nv = nulls
    cdef int64_t[::1] bv = nbytes
    offs = [pa.allocate_buffer((n + 1) * 4) for _ in range(k)]
    valid = [pa.allocate_buffer(max((n + 7) // 8, 1)) for _ in range(k)]
    cdef int32_t **po = <int32_t **>malloc(k * sizeof(int32_t *))
    cdef uint8_t **pv = <uint8_t **>malloc(k * sizeof(uint8_t *))
    cdef const uint8_t *ps = sb
    cdef int64_t seplen = len(sb)
    cdef int st
    if po == NULL or pv == NULL:
        free(po)
        free(pv)
        raise MemoryError("split_parts: no memory for the part pointers")
    for j in range(k):
        po[j] = <int32_t *>mut_addr(offs[j])
        pv[j] = mut_addr(valid[j])
    with nogil:
        st = dbsp_split_locate(&v.cols[0], n, ps, seplen, &iv[0], k, &sv[0], po, pv, &nv[0], &bv[0])
    free(po)
    free(pv)
    check_status(st, "split_parts")
    typ = array.type
    out = []
    cdef uint8_t *pd
    cdef const int32_t *pj
    for j in range(k):
        data = pa.allocate_buffer(max(nbytes[j], 1))
        pd = mut_addr(data)
        pj = <const int32_t *>mut_addr(offs[j])
        with nogil:
            st = dbsp_split_copy(&v.cols[0], n, &sv[j * n], pj, pd)
        check_status(st, "split_parts")
        out.append(pa.Array.from_buffers(typ, n, [valid[j] if nulls[j] else None, offs[j], data],
                                         null_count=int(nulls[j])))
    return out
