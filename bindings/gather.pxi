# gather.pxi: gather (gather.h): rows at indices into buffers from Arrow's memory pool.

cdef uint8_t *mut_addr(object buf):
    return <uint8_t *><uintptr_t>buf.address


def gather(table, idx):
    """The rows of `table` at `idx` (int64), as a table of single-chunk columns: Arrow's take, value for value, by
    a prefetching C gather (csrc/gather.h) into buffers from Arrow's memory pool. IndexError if an index is out
    of range."""
    cdef BatchView v = view_of(table)
    ix = np.ascontiguousarray(idx, dtype=np.int64)
    cdef const int64_t[::1] pi = ix
    cdef int64_t m = ix.shape[0], nulls = 0, nbytes = 0
    cdef const int64_t *p = &pi[0] if m else NULL
    cdef int32_t k
    cdef int st
    cdef uint8_t *vb
    cdef uint8_t *xb
    with nogil:
        st = dbsp_gather_check(p, m, v.c.nrows)
    if st != DBSP_OK:
        raise IndexError(f"gather: an index is outside 0..{v.c.nrows - 1}")
    arrays = []
    src = None  # each variable-width row's source offset, between the two passes (one buffer for all columns)
    cdef int64_t *sp = NULL
    for k in range(v.c.ncols):
        typ = table.schema.field(k).type
        code = v.cols[k].type
        var = code in (DBSP_UTF8, DBSP_BINARY, DBSP_LARGE_UTF8, DBSP_LARGE_BINARY)
        if code == DBSP_BOOL:
            nvalues = (m + 7) // 8
        elif var:
            nvalues = (m + 1) * (8 if code in (DBSP_LARGE_UTF8, DBSP_LARGE_BINARY) else 4)
            if src is None:
                src = pa.allocate_buffer(max(m, 1) * 8)
                sp = <int64_t *>mut_addr(src)
        else:
            nvalues = m * (typ.bit_width // 8)
        validity = pa.allocate_buffer((m + 7) // 8) if v.cols[k].validity != NULL else None
        values = pa.allocate_buffer(nvalues)
        vb = mut_addr(validity) if validity is not None else NULL
        xb = mut_addr(values)
        with nogil:
            st = dbsp_gather_column(&v.cols[k], p, m, vb, xb, sp, &nulls, &nbytes)
        check_status(st, "gather")
        bufs = [validity if nulls else None, values]
        if var:
            data = pa.allocate_buffer(nbytes + 16)
            vb = mut_addr(data)
            with nogil:
                st = dbsp_gather_data(&v.cols[k], v.c.nrows, m, xb, sp, vb)
            check_status(st, "gather")
            bufs.append(data.slice(0, nbytes))
        arrays.append(pa.Array.from_buffers(typ, m, bufs, null_count=nulls))
    return pa.Table.from_arrays(arrays, schema=table.schema)
