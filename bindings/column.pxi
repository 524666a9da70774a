# column.pxi: Arrow columns viewed as C batches (column.h): the status check, type codes, BatchView and owned C arrays.

cdef uint8_t _EMPTY_BYTES[8]


cdef int check_status(int st, str where) except -1:
    """The one error path: turn a C status into a typed exception naming the kernel."""
    if st == DBSP_OK:
        return 0
    if st == DBSP_EOVERFLOW:
        raise WeightOverflowError(f"{where}: a weight or integer sum overflowed int64")
    if st == DBSP_ENOMEM:
        raise MemoryError(f"{where}: out of memory")
    if st == DBSP_ETYPE:
        raise SchemaError(f"{where}: unsupported or mismatched column types")
    if st == DBSP_ETOOBIG:
        raise ValueError(f"{where}: batch or value too large (at most 2^32-1 rows, 4 GiB per value)")
    if st == DBSP_EINVAL:
        raise ValueError(f"{where}: invalid argument")
    raise DbspError(f"{where}: native status {st}")


_TYPE_CODES = {}


def type_code(t):
    """The C column type for an Arrow type, or None when the type is not supported (cached per type)."""
    try:
        return _TYPE_CODES[t]
    except KeyError:
        code = _TYPE_CODES[t] = _type_code(t)
        return code


def _type_code(t):
    import pyarrow.types as pt
    if pt.is_boolean(t): return DBSP_BOOL
    if pt.is_int8(t): return DBSP_INT8
    if pt.is_int16(t): return DBSP_INT16
    if pt.is_int32(t): return DBSP_INT32
    if pt.is_int64(t) or pt.is_decimal64(t): return DBSP_INT64  # decimal64: its unscaled value (column.h inv. 4)
    if pt.is_uint8(t): return DBSP_UINT8
    if pt.is_uint16(t): return DBSP_UINT16
    if pt.is_uint32(t): return DBSP_UINT32
    if pt.is_uint64(t): return DBSP_UINT64
    if pt.is_float32(t): return DBSP_FLOAT32
    if pt.is_float64(t): return DBSP_FLOAT64
    if pt.is_date32(t) or pt.is_time32(t): return DBSP_DATE32
    if pt.is_timestamp(t) or pt.is_date64(t) or pt.is_time64(t) or pt.is_duration(t): return DBSP_TIMESTAMP
    if pt.is_string(t): return DBSP_UTF8
    if pt.is_large_string(t): return DBSP_LARGE_UTF8
    if pt.is_binary(t): return DBSP_BINARY
    if pt.is_large_binary(t): return DBSP_LARGE_BINARY
    return None


cdef class CBuffer:
    """Owns a malloc'ed C array and lends it to numpy through the buffer protocol (zero copy)."""
    cdef void *ptr
    cdef Py_ssize_t nbytes
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef bytes fmt
    cdef Py_ssize_t itemsize

    def __dealloc__(self):
        free(self.ptr)
        self.ptr = NULL

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self.ptr if self.ptr != NULL else <void *>_EMPTY_BYTES
        view.obj = self
        view.len = self.nbytes
        view.readonly = 0
        view.itemsize = self.itemsize
        if flags & PyBUF_FORMAT:
            view.format = self.fmt
        else:
            view.format = NULL
        view.ndim = 1
        self.shape[0] = self.nbytes // self.itemsize
        self.strides[0] = self.itemsize
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass


cdef dict _NPY_NUMS = {np.int64: (cnp.NPY_INT64, 8, b"q"), np.uint64: (cnp.NPY_UINT64, 8, b"Q"),
                        np.float64: (cnp.NPY_FLOAT64, 8, b"d"), np.uint8: (cnp.NPY_UINT8, 1, b"B")}


cdef object own_array(void *ptr, int64_t n, object dtype):
    """Wrap n items of a malloc'ed array as a numpy array that frees it when collected (takes ownership): made by
    numpy's C API over the pointer, its base a CBuffer that frees it (~0.9k instructions a call; the buffer protocol's
    np.frombuffer took ~7k)."""
    cdef CBuffer b = CBuffer.__new__(CBuffer)
    cdef cnp.npy_intp dims[1]
    b.ptr = ptr
    spec = _NPY_NUMS.get(dtype)
    if spec is None:  # (another dtype: through the buffer protocol)
        dt = np.dtype(dtype)
        b.itemsize = dt.itemsize
        b.nbytes = n * dt.itemsize
        b.fmt = dt.char.encode()
        return np.frombuffer(b, dtype=dt, count=n)
    num, b.itemsize, b.fmt = spec  # (the CBuffer's own buffer protocol stays whole)
    b.nbytes = n * b.itemsize
    dims[0] = n
    arr = cnp.PyArray_SimpleNewFromData(1, dims, <int>num, ptr if ptr != NULL else <void *>_EMPTY_BYTES)
    cnp.set_array_base(<cnp.ndarray>arr, b)  # (b frees ptr when the array goes)
    return arr


cdef class BatchView:
    """A C batch (DbspBatch) viewing the columns of a pyarrow Table or RecordBatch and an int64 weight array, without
    copying.

    The rows are exported once through the Arrow C data interface (``__arrow_c_array__``) and the exported structs are
    owned by the view (released with it), so the buffers outlive the view; the weights, key hashes and fence are
    kept as references. A view of at least DBSP_DIR_MIN rows with key hashes builds a directory of them (lookup.h
    DbspDir) the first time a join seeks into it (:meth:`seek_dir`) and keeps it while it lives (0.5 to 1 byte a
    row): a batch view is kept per trace batch (IndexedZSet._view), so only the batches that changes are sought in
    pay for one, once."""
    cdef CBatch c
    cdef CColumn *cols
    cdef const uint64_t *kh  # the key hashes given with the batch (NULL if none)
    cdef const uint64_t *fence  # a fence of kh (lookup.h; NULL if none)
    cdef uint32_t *dirbuf  # the directory's entries once built (NULL: not built)
    cdef CDir dir  # the directory over them
    cdef bint dir_off  # no directory for this view (too few or too many rows, no key hashes)
    cdef object refs
    cdef ArrowSchema schema
    cdef ArrowArray array
    cdef const ArrowSchema *cs  # the rows' exported schema: &schema, or a kept export's (view_over)
    cdef readonly object pyschema  # the pyarrow Schema of the viewed rows

    def __cinit__(self):
        self.cols = NULL
        self.dirbuf = NULL
        self.dir_off = False
        self.schema.release = NULL
        self.array.release = NULL
        self.cs = &self.schema

    def __dealloc__(self):
        free(self.cols)
        free(self.dirbuf)
        if self.array.release != NULL:
            self.array.release(&self.array)
        if self.schema.release != NULL:
            self.schema.release(&self.schema)

    @property
    def num_rows(self):
        return self.c.nrows

    cdef const CDir *seek_dir(self) except? NULL:
        """The directory of the key hashes (lookup.h DbspDir), built on the first call; NULL when the view has none
        (fewer than DBSP_DIR_MIN rows or 2^32 or more, no key hashes)."""
        cdef int32_t bits
        cdef int st
        cdef uint32_t *buf
        if self.dirbuf != NULL:
            return &self.dir
        if self.dir_off or self.kh == NULL or self.c.nrows < DBSP_DIR_MIN or self.c.nrows >= (<int64_t>1 << 32):
            self.dir_off = True
            return NULL
        bits = dbsp_dir_bits(self.c.nrows)
        buf = <uint32_t *>malloc(((<size_t>1 << bits) + 1) * sizeof(uint32_t))
        if buf == NULL:
            raise MemoryError()
        with nogil:
            st = dbsp_dir_build(self.kh, self.c.nrows, bits, buf)
        if st != DBSP_OK:
            free(buf)
            raise ValueError(f"BatchView: the key hashes of a {self.c.nrows}-row batch are not ascending")
        self.dirbuf = buf
        self.dir.dir = buf
        self.dir.bits = bits
        return &self.dir

    @property
    def dir_bytes(self):
        """Bytes of the directory (0 until built: :meth:`seek_dir`)."""
        return ((1 << self.dir.bits) + 1) * 4 if self.dirbuf != NULL else 0

    def dir_seek(self, uint64_t h):
        """The first row whose key hash is >= h, through the directory (built here if need be; ValueError when the
        view has none): for tests against a search of the key hashes."""
        cdef const CDir *d = self.seek_dir()
        if d == NULL:
            raise ValueError("dir_seek: the view has no directory")
        return dbsp_dir_seek(self.kh, d, h)

    def set_fence(self, fence):
        """Attach a fence of the key hashes (fence(khash)): kernels then seek through it instead of galloping."""
        cdef const uint64_t[::1] fv
        if self.kh == NULL:
            raise ValueError("set_fence: the view has no key hashes")
        f = np.ascontiguousarray(fence, dtype=np.uint64)
        if f.shape[0] != (self.c.nrows + (1 << DBSP_FENCE_SHIFT) - 1) >> DBSP_FENCE_SHIFT:
            raise ValueError(f"set_fence: {f.shape[0]} fence entries for {self.c.nrows} rows")
        self.refs.append(f)
        fv = f
        self.fence = &fv[0] if f.shape[0] else NULL

    def __init__(self, table, weights=None, khash=None):
        cdef int32_t ncols = table.num_columns
        cdef int64_t nrows = 0
        cdef int32_t bad = -1
        cdef int st
        cdef ArrowSchema *ps
        cdef ArrowArray *pa_
        self.refs = []
        self.kh = NULL
        self.fence = NULL
        self.cols = <CColumn *>malloc(max(ncols, 1) * sizeof(CColumn))
        if self.cols == NULL:
            raise MemoryError()
        memset(self.cols, 0, max(ncols, 1) * sizeof(CColumn))
        self.pyschema = table.schema
        if ncols == 0:  # no columns to view: only the row count
            self.c.nrows = table.num_rows
            self.c.ncols = 0
            self.c.cols = self.cols
            self.c.weights = NULL
            self._attach(weights, khash)
            return
        batch = _one_batch(table)
        schema_capsule, array_capsule = batch.__arrow_c_array__()
        ps = <ArrowSchema *>PyCapsule_GetPointer(schema_capsule, "arrow_schema")
        pa_ = <ArrowArray *>PyCapsule_GetPointer(array_capsule, "arrow_array")
        # move the structs out of the capsules (the C data interface's move: the source is marked released)
        memcpy(&self.schema, ps, sizeof(ArrowSchema))
        ps.release = NULL
        memcpy(&self.array, pa_, sizeof(ArrowArray))
        pa_.release = NULL
        st = dbsp_cdata_view(&self.schema, &self.array, ncols, self.cols, &nrows, _EMPTY_BYTES, &bad)
        if st == DBSP_ETYPE:
            f = table.schema.field(bad)
            raise SchemaError(f"column {f.name!r} has unsupported type {f.type}")
        if st != DBSP_OK:
            raise ValueError(f"BatchView: the exported batch does not match its schema ({ncols} columns)")
        self.c.nrows = nrows
        self.c.ncols = ncols
        self.c.cols = self.cols
        self.c.weights = NULL
        self._attach(weights, khash)

    cdef _attach(self, weights, khash):
        """Point the batch at its weights and key hashes (checked against the row count), keeping references."""
        cdef const int64_t[::1] wv
        cdef const uint64_t[::1] kv
        cdef int64_t nrows = self.c.nrows
        if type(weights) is np.ndarray and cnp.PyArray_TYPE(weights) == cnp.NPY_INT64 \
                and cnp.PyArray_IS_C_CONTIGUOUS(weights) and cnp.PyArray_NDIM(weights) == 1 \
                and cnp.PyArray_DIM(weights, 0) == nrows and nrows > 0:  # a Z-set's own weights: their pointer, no
            self.refs.append(weights)  # ascontiguousarray call nor memoryview to acquire (~3k instructions a view)
            self.c.weights = <const int64_t *>cnp.PyArray_DATA(weights)
            weights = None
        if weights is not None:
            w = np.ascontiguousarray(weights, dtype=np.int64)
            if w.shape[0] != nrows:
                raise ValueError(f"{w.shape[0]} weights for {nrows} rows")
            self.refs.append(w)
            if w.shape[0] > 0:
                wv = w
                self.c.weights = &wv[0]
        if khash is not None:
            kh = np.ascontiguousarray(khash, dtype=np.uint64)
            if kh.shape[0] != nrows:
                raise ValueError(f"{kh.shape[0]} key hashes for {nrows} rows")
            self.refs.append(kh)
            if kh.shape[0] > 0:
                kv = kh
                self.kh = &kv[0]


cdef BatchView view_over(CColumn *cols, int32_t ncols, int64_t nrows, table, schema, weights, khash):
    """A view of ``table`` (a Table of one record batch, ``nrows`` rows, of pyarrow Schema ``schema``: its exported C
    schema is made once per schema object and kept) whose columns a kernel already viewed: ``cols``
    (malloc'ed, pointing into the table's buffers; the view takes it and frees it), so the rows are not exported again
    (csrc/joinrun.h invariant 5). The table is kept with the view, which keeps its buffers alive; weights and key hashes
    as in BatchView(table, weights, khash)."""
    cdef BatchView v = BatchView.__new__(BatchView)
    v.cols = cols
    v.refs = [table]
    v.kh = NULL
    v.fence = NULL
    v.pyschema = schema
    cap = exported_schema_capsule(v.pyschema)
    v.refs.append(cap)
    v.cs = <ArrowSchema *>PyCapsule_GetPointer(cap, "arrow_schema")
    v.c.nrows = nrows
    v.c.ncols = ncols
    v.c.cols = cols
    v.c.weights = NULL
    if type(weights) is np.ndarray and type(khash) is np.ndarray and cnp.PyArray_TYPE(weights) == cnp.NPY_INT64 \
            and cnp.PyArray_TYPE(khash) == cnp.NPY_UINT64 and cnp.PyArray_IS_C_CONTIGUOUS(weights) \
            and cnp.PyArray_IS_C_CONTIGUOUS(khash) and weights.shape[0] == nrows == khash.shape[0] and nrows > 0:
        v.refs.append(weights)  # (own_array's arrays, as a kernel returned them: their pointers, no memoryviews)
        v.refs.append(khash)
        v.c.weights = <const int64_t *>cnp.PyArray_DATA(weights)
        v.kh = <const uint64_t *>cnp.PyArray_DATA(khash)
    else:
        v._attach(weights, khash)
    return v


cdef object _one_batch(table):
    """`table` as one RecordBatch (a Table of one chunk per column is the common case: no copy)."""
    if isinstance(table, pa.RecordBatch):
        return table
    batches = table.to_batches()
    if len(batches) == 1:
        return batches[0]
    return pa.RecordBatch.from_arrays([col.combine_chunks() for col in table.columns], schema=table.schema)


cdef BatchView view_of(table, weights=None, khash=None):
    """`table` itself when it is already a BatchView (built once for a batch that is read many times; it carries
    its own weights and key hashes), else a new view of (table, weights, khash)."""
    if isinstance(table, BatchView):
        return <BatchView>table
    return BatchView(table, weights, khash)


cdef class Int32s:
    """An owned C array of int32 (column positions), freed with the object."""
    cdef int32_t *p
    cdef int32_t n

    def __cinit__(self, xs):
        self.n = len(xs)
        self.p = <int32_t *>malloc(max(self.n, 1) * sizeof(int32_t))
        if self.p == NULL:
            raise MemoryError()
        for i, x in enumerate(xs):
            self.p[i] = x

    def __dealloc__(self):
        free(self.p)
