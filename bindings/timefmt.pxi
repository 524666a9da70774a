# timefmt.pxi: time values formatted by fixed-width fields (timefmt.h) into buffers from Arrow's memory pool.

def time_format(array, fmt, int64_t units_per_day):
    """The strings of ``array`` (an int64-backed timestamp or date64, or a date32 Array, one chunk) formatted by
    ``fmt`` (csrc/timefmt.h invariant 1: %Y %m %d %H %M %% and literal text), each value ``units_per_day`` units a
    day (1 for a date32), as a utf8 Array with ``array``'s nulls; None when a non-null value's year is outside
    [0, 9999] (invariant 3: the caller formats it another way). ValueError for a format or unit the kernel does not
    take."""
    cdef bytes fb = fmt.encode()
    cdef const uint8_t *pf = fb
    cdef int64_t fl = len(fb), n = len(array), w = dbsp_timefmt_width(pf, fl)
    cdef int width = 4 if pa.types.is_date32(array.type) else 8
    if w < 0:
        raise ValueError(f"time_format: format {fmt!r} has a field other than %Y %m %d %H %M %%")
    bufs = array.buffers()
    vbuf, dbuf = bufs[0], bufs[1]
    cdef const uint8_t *validity = NULL
    if array.null_count and vbuf is not None:
        validity = mut_addr(vbuf)
    cdef int64_t vbit = array.offset
    cdef const uint8_t *values = NULL
    if n:
        values = mut_addr(dbuf) + vbit * width
    offs = pa.allocate_buffer((n + 1) * 4)
    data = pa.allocate_buffer(max(n * w, 1))
    cdef int32_t *po = <int32_t *>mut_addr(offs)
    cdef uint8_t *pd = mut_addr(data)
    cdef int st
    with nogil:
        st = dbsp_timefmt(values, width, validity, vbit, n, units_per_day, pf, fl, po, pd)
    if st == DBSP_ETOOBIG:
        return None
    check_status(st, "time_format")
    valid = None
    if array.null_count:
        # the input's bitmap when it starts at bit 0, else one rebuilt from bit 0 (is_valid's values)
        valid = vbuf if array.offset == 0 else pa.compute.is_valid(array).buffers()[1]
    return pa.Array.from_buffers(pa.string(), n, [valid, offs, data], null_count=array.null_count)
