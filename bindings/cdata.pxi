# cdata.pxi: take and take_pairs (cdata.h): rows gathered in C and handed to Arrow through the C data interface.

_EXPORTED_SCHEMAS = {}  # id(schema) -> (schema, its exported C schema capsule): operators reuse their schemas


cdef object exported_schema_capsule(schema):
    """The capsule of the C data interface export of `schema`, made once per schema object and kept (the capsule
    keeps its ArrowSchema alive for whoever holds it, after the cache dropped it)."""
    hit = _EXPORTED_SCHEMAS.get(id(schema))
    if hit is None or hit[0] is not schema:
        if len(_EXPORTED_SCHEMAS) >= 4096:
            _EXPORTED_SCHEMAS.clear()
        hit = _EXPORTED_SCHEMAS[id(schema)] = (schema, schema.__arrow_c_schema__())
    return hit[1]


cdef ArrowSchema *exported_schema(schema) except NULL:
    """The C data interface export of `schema`, made once per schema object and kept."""
    return <ArrowSchema *>PyCapsule_GetPointer(exported_schema_capsule(schema), "arrow_schema")


cdef int check_types(schema, BatchView a, const int32_t *acols, int32_t na, BatchView b, const int32_t *bcols,
                     int32_t nb) except -1:
    """TypeError unless `schema` has exactly the types of the gathered columns: Arrow reads the buffers by the
    schema's types, so a mismatch would read past them (formats compared in C, cdata.h)."""
    cdef ArrowSchema *t = exported_schema(schema)
    cdef int32_t k
    if t.n_children != na + nb:
        raise TypeError(f"the output schema has {t.n_children} columns, the gathered rows {na + nb}")
    for k in range(na + nb):
        if k < na:
            ok = dbsp_cdata_same_type(t, k, a.cs, acols[k] if acols != NULL else k)
        else:
            ok = dbsp_cdata_same_type(t, k, b.cs, bcols[k - na] if bcols != NULL else k - na)
        if not ok:
            raise TypeError(f"column {schema.field(k).name!r} of the output schema ({schema.field(k).type}) "
                            f"differs from the gathered column's type")
    return 0


cdef object import_batch(ArrowArray *out, schema):
    """Hand an exported record batch to Arrow (moved; released here if the import fails) as a one-chunk Table."""
    try:
        batch = pa.RecordBatch._import_from_c(<uintptr_t>out, schema)
    finally:
        if out.release != NULL:  # not moved into Arrow: the import failed
            out.release(out)
    return pa.Table.from_batches([batch], schema=schema)


def take(table, idx, schema=None, cols=None):
    """The rows of `table` (a Table, RecordBatch or BatchView) at `idx` (int64, each in range, else IndexError) as a
    Table of one chunk per column: Arrow's take value for value, by one C call over every column (csrc/cdata.h)
    whose buffers are handed to Arrow through the C data interface. With `cols` (positions), only those columns.
    The result has the table's schema, or `schema` (required with `cols`; TypeError unless its types are the
    gathered columns'). For small takes: per call it costs a fraction of Arrow's compute dispatch."""
    cdef BatchView v = view_of(table)
    cdef Int32s c = Int32s(cols if cols is not None else [])
    cdef const int32_t *cp = c.p if cols is not None else NULL
    cdef int32_t nc = c.n if cols is not None else v.c.ncols
    cdef int32_t k
    if cols is not None:
        for k in range(nc):
            if cp[k] < 0 or cp[k] >= v.c.ncols:
                raise IndexError(f"take: column {cp[k]} is outside 0..{v.c.ncols - 1}")
        if schema is None:
            raise ValueError("take: a column selection needs its schema")
    if schema is None:
        schema = v.pyschema  # the types the view was built from
    elif nc:
        check_types(schema, v, cp, nc, None, NULL, 0)
    ix = np.ascontiguousarray(idx, dtype=np.int64)
    cdef const int64_t[::1] pi = ix
    cdef int64_t m = ix.shape[0]
    cdef const int64_t *p = &pi[0] if m else NULL
    cdef int st
    cdef ArrowArray out
    out.release = NULL
    with nogil:
        st = dbsp_gather_check(p, m, v.c.nrows)
        if st == DBSP_OK:
            st = dbsp_cdata_gather2(&v.c, cp, nc, p, NULL, NULL, 0, NULL, m, &out)
    if st == DBSP_EINVAL:
        raise IndexError(f"take: an index is outside 0..{v.c.nrows - 1}")
    check_status(st, "take")
    return import_batch(&out, schema)


def take_pairs(left, lidx, rright, ridx, rcols, schema, lcols=None):
    """A join's output rows: every column of `left` (or, with `lcols`, those positions) at `lidx`, then columns
    `rcols` (positions) of `rright` at `ridx` (int64 arrays of one length, each index in range, else IndexError), as
    a Table of `schema` (those columns' types, in that order) with one chunk per column, from one C call
    (csrc/cdata.h)."""
    cdef BatchView a = view_of(left)
    cdef BatchView b = view_of(rright)
    cdef Int32s bc = Int32s(rcols)
    cdef Int32s ac = Int32s(lcols if lcols is not None else [])
    cdef const int32_t *ap = ac.p if lcols is not None else NULL
    cdef int32_t na = ac.n if lcols is not None else a.c.ncols
    li = np.ascontiguousarray(lidx, dtype=np.int64)
    ri = np.ascontiguousarray(ridx, dtype=np.int64)
    if li.shape[0] != ri.shape[0]:
        raise ValueError(f"take_pairs: {li.shape[0]} left rows but {ri.shape[0]} right rows")
    for k in range(bc.n):
        if bc.p[k] < 0 or bc.p[k] >= b.c.ncols:
            raise IndexError(f"take_pairs: right column {bc.p[k]} is outside 0..{b.c.ncols - 1}")
    for k in range(na if ap != NULL else 0):
        if ap[k] < 0 or ap[k] >= a.c.ncols:
            raise IndexError(f"take_pairs: left column {ap[k]} is outside 0..{a.c.ncols - 1}")
    check_types(schema, a, ap, na, b, bc.p, bc.n)
    cdef const int64_t[::1] pl = li
    cdef const int64_t[::1] pr = ri
    cdef int64_t m = li.shape[0]
    cdef const int64_t *lp = &pl[0] if m else NULL
    cdef const int64_t *rp = &pr[0] if m else NULL
    cdef int st
    cdef ArrowArray out
    out.release = NULL
    with nogil:
        st = dbsp_gather_check(lp, m, a.c.nrows)
        if st == DBSP_OK:
            st = dbsp_gather_check(rp, m, b.c.nrows)
        if st == DBSP_OK:
            st = dbsp_cdata_gather2(&a.c, ap, na, lp, &b.c, bc.p, bc.n, rp, m, &out)
    if st == DBSP_EINVAL:
        raise IndexError("take_pairs: a row index or column position is out of range")
    check_status(st, "take_pairs")
    return import_batch(&out, schema)
