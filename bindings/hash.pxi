# hash.pxi: the DBSP row hash (hash.h): its version and hash_columns.

HASH_VERSION = DBSP_HASH_VERSION


def hash_columns(table, cols):
    """Row hash (DBSP hash v1) of every row of `table` over column positions `cols`, as uint64."""
    cdef BatchView v = view_of(table)
    cdef Int32s c = Int32s(cols)
    out = np.empty(table.num_rows, dtype=np.uint64)
    cdef uint64_t[::1] o = out
    cdef int st
    with nogil:
        st = dbsp_hash_columns(&v.c, c.p, c.n, &o[0] if o.shape[0] else NULL)
    check_status(st, "hash")
    return out
