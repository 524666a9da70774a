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


def gather_parts(tables, idxs):
    """The rows of ``tables[0]`` at ``idxs[0]``, then of ``tables[1]`` at ``idxs[1]``, ... (tables of one schema), as
    one table of single-chunk columns: the concatenation of their gathers, written once (csrc/gather.h
    dbsp_gather_column_at; an exchange's receiver gathers its rows from every sender this way, not a gather per
    sender and a concatenation). IndexError if an index is out of range; OverflowError if a utf8/binary column's
    result passes 2**31 - 1 bytes."""
    cdef list views = [view_of(t) for t in tables]
    cdef list ixs = [np.ascontiguousarray(i, dtype=np.int64) for i in idxs]
    if not views or len(views) != len(ixs):
        raise ValueError("gather_parts: one index array per table, at least one")
    schema = tables[0].schema
    cdef BatchView v
    cdef const int64_t[::1] pi
    cdef int64_t m = 0, mj, nulls = 0, nb = 0, total_nulls, at, base, width
    cdef int st
    cdef Py_ssize_t j, nparts = len(views)
    cdef int32_t k, ncols = (<BatchView>views[0]).c.ncols
    for j in range(nparts):
        v = <BatchView>views[j]
        if v.c.ncols != ncols or not tables[j].schema.equals(schema):
            raise ValueError("gather_parts: the tables differ in schema")
        pi = ixs[j]
        mj = ixs[j].shape[0]
        with nogil:
            st = dbsp_gather_check(&pi[0] if mj else NULL, mj, v.c.nrows)
        if st != DBSP_OK:
            raise IndexError(f"gather_parts: an index is outside 0..{v.c.nrows - 1}")
        m += mj
    cdef uint8_t *vb
    cdef uint8_t *xb
    cdef uint8_t *db
    cdef int64_t *sp = NULL
    src = None
    arrays = []
    cdef list part_bytes
    for k in range(ncols):
        typ = schema.field(k).type
        code = (<BatchView>views[0]).cols[k].type
        var = code in (DBSP_UTF8, DBSP_BINARY, DBSP_LARGE_UTF8, DBSP_LARGE_BINARY)
        large = code in (DBSP_LARGE_UTF8, DBSP_LARGE_BINARY)
        if code == DBSP_BOOL:
            nvalues = (m + 7) // 8
        elif var:
            nvalues = (m + 1) * (8 if large else 4)
            if src is None:
                src = pa.allocate_buffer(max(m, 1) * 8)
                sp = <int64_t *>mut_addr(src)
        else:
            nvalues = m * (typ.bit_width // 8)
        has_validity = any((<BatchView>views[j]).cols[k].validity != NULL for j in range(nparts))
        validity = pa.allocate_buffer((m + 7) // 8) if has_validity else None
        values = pa.allocate_buffer(max(nvalues, 1))
        vb = mut_addr(validity) if validity is not None else NULL
        xb = mut_addr(values)
        at = base = total_nulls = 0
        part_bytes = []
        for j in range(nparts):
            v = <BatchView>views[j]
            pi = ixs[j]
            mj = ixs[j].shape[0]
            if mj == 0:
                part_bytes.append(0)
                continue
            with nogil:
                st = dbsp_gather_column_at(&v.cols[k], &pi[0], mj, at, base, vb, xb, sp, &nulls, &nb)
            if st == DBSP_ETOOBIG:
                raise OverflowError("gather_parts: a utf8/binary result passes 2**31 - 1 bytes")
            check_status(st, "gather_parts")
            total_nulls += nulls
            part_bytes.append(nb)
            at += mj
            base += nb
        if m == 0 and var:  # no part wrote the first offset
            memset(xb, 0, 8 if large else 4)
        bufs = [validity if total_nulls else None, values]
        if var:
            data = pa.allocate_buffer(base + 16)
            db = mut_addr(data)
            width = 8 if large else 4
            at = 0
            for j in range(nparts):
                v = <BatchView>views[j]
                mj = ixs[j].shape[0]
                if mj:
                    with nogil:
                        st = dbsp_gather_data(&v.cols[k], v.c.nrows, mj, xb + at * width, sp + at, db)
                    check_status(st, "gather_parts")
                at += mj
            bufs.append(data.slice(0, base))
        arrays.append(pa.Array.from_buffers(typ, m, bufs, null_count=total_nulls))
    return pa.Table.from_arrays(arrays, schema=schema)
