# zset.pyx: cdef classes that view Arrow columns as C batches and own the C kernels' results (dbsp_core._zset).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, malloc, free
from libc.string cimport memset
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_WRITABLE
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.string cimport memcpy

from zset cimport *

import numpy as np
import pyarrow as pa

from dbsp_core.errors import DbspError, SchemaError, WeightOverflowError

HASH_VERSION = DBSP_HASH_VERSION

AGG_KINDS = {"count": DBSP_AGG_COUNT, "count_col": DBSP_AGG_COUNT_COL, "sum": DBSP_AGG_SUM,
             "min": DBSP_AGG_MIN, "max": DBSP_AGG_MAX}

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
    if pt.is_int64(t): return DBSP_INT64
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


cdef object own_array(void *ptr, int64_t n, object dtype):
    """Wrap n items of a malloc'ed array as a numpy array that frees it when collected (takes ownership)."""
    cdef CBuffer b = CBuffer.__new__(CBuffer)
    dt = np.dtype(dtype)
    b.ptr = ptr
    b.itemsize = dt.itemsize
    b.nbytes = n * dt.itemsize
    b.fmt = dt.char.encode()
    return np.frombuffer(b, dtype=dt, count=n)


cdef class BatchView:
    """A C batch (DbspBatch) viewing the columns of a pyarrow Table or RecordBatch and an int64 weight array, without
    copying.

    The rows are exported once through the Arrow C data interface (``__arrow_c_array__``) and the exported structs are
    owned by the view (released with it), so the buffers outlive the view; the weights, key hashes and fence are
    kept as references."""
    cdef CBatch c
    cdef CColumn *cols
    cdef const uint64_t *kh  # the key hashes given with the batch (NULL if none)
    cdef const uint64_t *fence  # a fence of kh (lookup.h; NULL if none)
    cdef object refs
    cdef ArrowSchema schema
    cdef ArrowArray array
    cdef readonly object pyschema  # the pyarrow Schema of the viewed rows

    def __cinit__(self):
        self.cols = NULL
        self.schema.release = NULL
        self.array.release = NULL

    def __dealloc__(self):
        free(self.cols)
        if self.array.release != NULL:
            self.array.release(&self.array)
        if self.schema.release != NULL:
            self.schema.release(&self.schema)

    @property
    def num_rows(self):
        return self.c.nrows

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


cdef object rows_result(CRows *r):
    """Hand a DbspRows' arrays to numpy (ownership moves) as (idx, weights, khash)."""
    idx = own_array(r.idx, r.n, np.int64)
    w = own_array(r.weights, r.n, np.int64)
    kh = own_array(r.khash, r.n, np.uint64)
    r.idx = NULL; r.weights = NULL; r.khash = NULL
    return idx, w, kh


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


def consolidate(table, weights, keys, bint row_hashes=False):
    """(idx, weights, khash): the consolidated rows of (table, weights) in canonical order for key positions `keys`;
    with `row_hashes`, (idx, weights, khash, rhash) where rhash holds the rows' row hashes when the kernel had
    them (batches of at most small_rows() rows), else None."""
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


cdef class Region:
    """Owns memory from dbsp_region_alloc (scratch.h) and lends it to Arrow and numpy through the buffer protocol;
    ``trim`` returns the pages past a length to the system without moving the rest."""
    cdef void *ptr
    cdef size_t mapped
    cdef Py_ssize_t nbytes
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        dbsp_region_free(self.ptr, self.mapped)
        self.ptr = NULL

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self.ptr
        view.obj = self
        view.len = self.nbytes
        view.readonly = 0
        view.itemsize = 1
        if flags & PyBUF_FORMAT:
            view.format = "B"
        else:
            view.format = NULL
        view.ndim = 1
        self.shape[0] = self.nbytes
        self.strides[0] = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass

    cdef void trim(self, Py_ssize_t keep):
        """Shrink to `keep` bytes (only before any export: an export keeps its own length)."""
        self.mapped = dbsp_region_trim(self.ptr, self.mapped, keep)
        if keep < self.nbytes:
            self.nbytes = keep


cdef Region new_region(Py_ssize_t nbytes):
    cdef Region r = Region.__new__(Region)
    r.ptr = dbsp_region_alloc(max(nbytes, 1), &r.mapped)
    if r.ptr == NULL:
        raise MemoryError(f"merge: cannot allocate {nbytes} bytes")
    r.nbytes = nbytes
    return r


cdef class MergeCursor:
    """A merge cursor: a merge of two canonical batches (BatchViews with key hashes, of one schema and key)
    advanced in bounded steps (csrc/merge.h): ``step(budget)`` consumes at least `budget` input rows (or the rest)
    and writes their consolidated sum into buffers sized for both inputs; ``result()`` then hands the rows to Arrow
    and numpy (unused pages returned to the system). The output is dbsp_zset_merge's, row for row. Given a side's
    row hashes (`arh`, `brh`: uint64 in index order) its rows of meeting keys are ordered without hashing; with
    `row_hashes` the result carries the output's row hashes (computed for rows of a side without them)."""
    cdef BatchView a
    cdef BatchView b
    cdef object arh_ref
    cdef object brh_ref
    cdef const uint64_t *arh
    cdef const uint64_t *brh
    cdef Int32s keys
    cdef CMergeCursor m
    cdef COutColumn *out
    cdef list regions  # per column: [validity or None, values, data or None]
    cdef Region w
    cdef Region kh
    cdef Region rh
    cdef readonly object schema
    cdef bint finished

    def __cinit__(self):
        self.out = NULL
        self.arh = NULL
        self.brh = NULL

    def __dealloc__(self):
        free(self.out)

    def __init__(self, a, b, keys, arh=None, brh=None, bint row_hashes=False):
        cdef const uint64_t[::1] av
        cdef const uint64_t[::1] bv
        cdef int32_t c, ncols
        cdef int64_t nv = 0, nx = 0, nd = 0, cap
        cdef int st
        cdef Region rv, rx, rd
        self.a = <BatchView?>a
        self.b = <BatchView?>b
        if (self.a.c.nrows and self.a.kh == NULL) or (self.b.c.nrows and self.b.kh == NULL):
            raise ValueError("MergeCursor: both views need their key hashes")
        self.keys = Int32s(keys)
        self.schema = self.a.pyschema
        if arh is not None and self.a.c.nrows:
            self.arh_ref = np.ascontiguousarray(arh, dtype=np.uint64)
            if self.arh_ref.shape[0] != self.a.c.nrows:
                raise ValueError("MergeCursor: one row hash per row")
            av = self.arh_ref
            self.arh = &av[0]
        if brh is not None and self.b.c.nrows:
            self.brh_ref = np.ascontiguousarray(brh, dtype=np.uint64)
            if self.brh_ref.shape[0] != self.b.c.nrows:
                raise ValueError("MergeCursor: one row hash per row")
            bv = self.brh_ref
            self.brh = &bv[0]
        ncols = self.a.c.ncols
        if ncols == 0 or self.b.c.ncols != ncols:
            raise ValueError(f"MergeCursor: {ncols} columns against {self.b.c.ncols} (a merge needs key columns)")
        cap = self.a.c.nrows + self.b.c.nrows
        self.out = <COutColumn *>malloc(max(ncols, 1) * sizeof(COutColumn))
        if self.out == NULL:
            raise MemoryError()
        memset(self.out, 0, max(ncols, 1) * sizeof(COutColumn))
        self.regions = []
        for c in range(ncols):
            if self.a.cols[c].type != self.b.cols[c].type:
                raise SchemaError(f"MergeCursor: column {c} has different types on the two sides")
            dbsp_merge_cursor_sizes(&self.a.cols[c], self.a.c.nrows, &self.b.cols[c], self.b.c.nrows, &nv, &nx, &nd)
            rv = new_region(nv) if nv else None
            rx = new_region(nx)
            rd = new_region(nd) if self.a.cols[c].type in (DBSP_UTF8, DBSP_LARGE_UTF8, DBSP_BINARY,
                                                           DBSP_LARGE_BINARY) else None
            self.out[c].validity = <uint8_t *>rv.ptr if rv is not None else NULL
            self.out[c].values = rx.ptr
            self.out[c].data = <uint8_t *>rd.ptr if rd is not None else NULL
            self.regions.append([rv, rx, rd])
        self.w = new_region(cap * 8)
        self.kh = new_region(cap * 8)
        self.rh = new_region(cap * 8) if row_hashes else None
        st = dbsp_merge_cursor_init(&self.a.c, &self.b.c, &self.m, self.out)
        check_status(st, "merge")
        self.finished = False

    @property
    def consumed(self):
        """Input rows merged so far."""
        return self.m.ia + self.m.ib

    @property
    def remaining(self):
        """Input rows still to merge."""
        return self.a.c.nrows + self.b.c.nrows - self.m.ia - self.m.ib

    @property
    def done(self):
        return self.m.ia == self.a.c.nrows and self.m.ib == self.b.c.nrows

    def step(self, int64_t budget):
        """Merge at least `budget` more input rows (or the rest); returns the number merged."""
        cdef int64_t before = self.m.ia + self.m.ib
        cdef int st
        if self.finished:
            raise ValueError("MergeCursor.step: the result was already taken")
        cdef uint64_t *rh = <uint64_t *>self.rh.ptr if self.rh is not None else NULL
        with nogil:
            st = dbsp_merge_cursor_step(&self.a.c, self.a.kh, self.arh, &self.b.c, self.b.kh, self.brh, self.keys.p, self.keys.n,
                                 budget, &self.m, self.out, <int64_t *>self.w.ptr, <uint64_t *>self.kh.ptr, rh)
        check_status(st, "merge")
        return self.m.ia + self.m.ib - before

    def result(self):
        """(table, weights, key hashes, row hashes or None) of the finished merge, over its own buffers (trimmed
        to size): the columns' regions move into one exported record batch that Arrow imports (csrc/cdata.h)."""
        cdef int32_t c, ncols = self.a.c.ncols
        cdef int64_t n = self.m.n, nbytes
        cdef Region rv, rx, rd
        cdef ArrowArray out
        if not self.done or self.finished:
            raise ValueError("MergeCursor.result: the merge is not finished" if not self.finished
                             else "MergeCursor.result: the result was already taken")
        self.finished = True
        cdef void **bufs = <void **>calloc(max(3 * ncols, 1), sizeof(void *))
        cdef size_t *mapped = <size_t *>calloc(max(3 * ncols, 1), sizeof(size_t))
        cdef int32_t *types = <int32_t *>malloc(max(ncols, 1) * sizeof(int32_t))
        cdef int64_t *nulls = <int64_t *>malloc(max(ncols, 1) * sizeof(int64_t))
        cdef int st
        try:
            if bufs == NULL or mapped == NULL or types == NULL or nulls == NULL:
                raise MemoryError("MergeCursor.result: out of memory")
            for c in range(ncols):
                rv, rx, rd = self.regions[c]
                code = self.out[c].type
                if code == DBSP_BOOL:
                    nbytes = (n + 7) // 8
                elif rd is not None:
                    if code in (DBSP_LARGE_UTF8, DBSP_LARGE_BINARY):
                        nbytes = (n + 1) * 8
                        rd.trim((<int64_t *>rx.ptr)[n])
                    else:
                        nbytes = (n + 1) * 4
                        rd.trim((<int32_t *>rx.ptr)[n])
                else:
                    nbytes = n * dbsp_type_width(code)
                rx.trim(nbytes)
                if rv is not None:
                    rv.trim((n + 7) // 8)
                types[c] = code
                nulls[c] = self.out[c].null_count
                for i, r in enumerate((rv, rx, rd)):
                    if r is not None:
                        bufs[3 * c + i] = (<Region>r).ptr
                        mapped[3 * c + i] = (<Region>r).mapped
            out.release = NULL
            st = dbsp_cdata_export_regions(ncols, types, n, nulls, bufs, mapped, &out)
            check_status(st, "MergeCursor.result")
            for c in range(ncols):  # the regions now belong to the export
                for r in self.regions[c]:
                    if r is not None:
                        (<Region>r).ptr = NULL
        finally:
            free(bufs); free(mapped); free(types); free(nulls)
        self.regions = []
        table = import_batch(&out, self.schema)
        self.w.trim(n * 8)
        self.kh.trim(n * 8)
        w = np.frombuffer(self.w, dtype=np.int64, count=n)
        kh = np.frombuffer(self.kh, dtype=np.uint64, count=n)
        rh = None
        if self.rh is not None:
            self.rh.trim(n * 8)
            rh = np.frombuffer(self.rh, dtype=np.uint64, count=n)
        return table, w, kh, rh


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


def partition(khash, part_of_shard, int32_t nparts):
    """(perm, offsets): rows ordered part by part (stable) for shard = top bits of khash; parts from the map."""
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    pos = np.ascontiguousarray(part_of_shard, dtype=np.int32)
    nshards = pos.shape[0]
    if nshards == 0 or nshards & (nshards - 1):
        raise ValueError(f"part_of_shard must have a power-of-two length, got {nshards}")
    cdef int bits = int(nshards).bit_length() - 1
    cdef int64_t n = kh.shape[0]
    perm = np.empty(n, dtype=np.int64)
    offsets = np.empty(nparts + 1, dtype=np.int64)
    cdef const uint64_t[::1] pk = kh
    cdef const int32_t[::1] ps = pos
    cdef int64_t[::1] pp = perm
    cdef int64_t[::1] po = offsets
    cdef int st
    with nogil:
        st = dbsp_partition(&pk[0] if n else NULL, n, &ps[0], bits, nparts, &pp[0] if n else NULL, &po[0])
    check_status(st, "partition")
    return perm, offsets


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


def check_order(table, weights, khash, keys):
    """True if (table, weights) is consolidated and in canonical order for `keys` (a debug checker)."""
    cdef BatchView v = view_of(table, weights, khash)
    cdef Int32s k = Int32s(keys)
    return dbsp_rows_check_order(&v.c, NULL, v.c.weights, v.kh, v.c.nrows, k.p, k.n) == 0


FENCE_SHIFT = DBSP_FENCE_SHIFT


def fence(khash):
    """The fence of an ascending key-hash array (every 64th hash, lookup.h), for set_fence and lookup."""
    return np.ascontiguousarray(np.asarray(khash, dtype=np.uint64)[::1 << DBSP_FENCE_SHIFT])


def lookup(khash, want, fence=None):
    """Row numbers (ascending int64) of the rows whose key hash (`khash`, ascending uint64) occurs in `want`
    (ascending uint64, duplicates allowed), by galloping (or seeking through `fence`, the fence of `khash`): the
    cost grows with `want`, not with `khash`."""
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    wq = np.ascontiguousarray(want, dtype=np.uint64)
    cdef const uint64_t[::1] pk = kh
    cdef const uint64_t[::1] pw = wq
    cdef const uint64_t[::1] pf
    cdef const uint64_t *fp = NULL
    cdef int64_t n = kh.shape[0], nw = wq.shape[0], m = 0
    cdef int64_t *idx = NULL
    cdef int st
    if fence is not None:
        fa = np.ascontiguousarray(fence, dtype=np.uint64)
        if fa.shape[0] != (n + (1 << DBSP_FENCE_SHIFT) - 1) >> DBSP_FENCE_SHIFT:
            raise ValueError(f"lookup: {fa.shape[0]} fence entries for {n} hashes")
        if fa.shape[0]:
            pf = fa
            fp = &pf[0]
    with nogil:
        st = dbsp_lookup_fenced(&pk[0] if n else NULL, n, fp, &pw[0] if nw else NULL, nw, &idx, &m)
    check_status(st, "lookup")
    return own_array(idx, m, np.int64)


def match_weights(ta, wa, kha, tb, wb, khb, acc, rha=None, rhb=None):
    """acc[i] += the weight of b's row equal to a's row i (both canonical for one key); `acc` is int64, updated
    in place. With the row hashes of both sides (`rha`, `rhb`: uint64, one per row in row order) the rows of a
    key are found by galloping over b's row hashes, so a big group costs log of its size, not its size."""
    cdef BatchView a = view_of(ta, wa, kha)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef int64_t[::1] out = acc
    if out.shape[0] != ta.num_rows:
        raise ValueError(f"match_weights: {out.shape[0]} accumulators for {ta.num_rows} rows")
    cdef int st
    if ta.num_rows == 0 or tb.num_rows == 0:
        return acc
    cdef const uint64_t[::1] ra
    cdef const uint64_t[::1] rb
    cdef const uint64_t *pra = NULL
    cdef const uint64_t *prb = NULL
    if rha is not None and rhb is not None:
        ra = np.ascontiguousarray(rha, dtype=np.uint64)
        rb = np.ascontiguousarray(rhb, dtype=np.uint64)
        if ra.shape[0] != ta.num_rows or rb.shape[0] != tb.num_rows:
            raise ValueError(f"match_weights: {ra.shape[0]} and {rb.shape[0]} row hashes for {ta.num_rows} and "
                             f"{tb.num_rows} rows")
        pra, prb = &ra[0], &rb[0]
    with nogil:
        st = dbsp_match_weights_rh(&a.c, a.kh, pra, &b.c, b.kh, b.fence, prb, &out[0])
    check_status(st, "match_weights")
    return acc


def match_sums(ta, akh, sel, akeys, tb, wb, khb, bkeys, cols, acc):
    """acc[i, c] += sum over b's rows whose key equals that of a's row sel[i] of weight * b[cols[c]] (int64 columns);
    `akh` holds the key hashes of the selected rows, ascending; `acc` is an int64 (len(sel), len(cols)) array,
    updated in place."""
    if len(akeys) != len(bkeys):
        raise ValueError(f"match_sums: {len(akeys)} left keys but {len(bkeys)} right keys")
    kh = np.ascontiguousarray(akh, dtype=np.uint64)
    sl = np.ascontiguousarray(sel, dtype=np.int64)
    cdef int64_t n = sl.shape[0]
    if kh.shape[0] != n:
        raise ValueError(f"match_sums: {kh.shape[0]} key hashes for {n} selected rows")
    if n and (sl.min() < 0 or sl.max() >= ta.num_rows):
        raise ValueError("match_sums: a selected row is out of range")
    if acc.dtype != np.int64 or acc.ndim != 2 or acc.shape[0] != n or acc.shape[1] != len(cols) \
            or not acc.flags.c_contiguous:
        raise ValueError(f"match_sums: acc must be a C-contiguous int64 array of shape ({n}, {len(cols)})")
    cdef BatchView a = view_of(ta)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef Int32s ak = Int32s(akeys)
    cdef Int32s bk = Int32s(bkeys)
    cdef Int32s cs = Int32s(cols)
    cdef const uint64_t[::1] pk = kh
    cdef const int64_t[::1] ps = sl
    cdef int64_t[:, ::1] out = acc
    cdef int st
    if n == 0 or tb.num_rows == 0 or len(cols) == 0:
        return acc
    with nogil:
        st = dbsp_match_sums(&a.c, &pk[0], &ps[0], n, ak.p, &b.c, b.kh, b.fence, bk.p, ak.n, cs.p, cs.n,
                             &out[0, 0])
    check_status(st, "match_sums")
    return acc


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


_EXPORTED_SCHEMAS = {}  # id(schema) -> (schema, its exported C schema capsule): operators reuse their schemas


cdef ArrowSchema *exported_schema(schema) except NULL:
    """The C data interface export of `schema`, made once per schema object and kept."""
    hit = _EXPORTED_SCHEMAS.get(id(schema))
    if hit is None or hit[0] is not schema:
        if len(_EXPORTED_SCHEMAS) >= 4096:
            _EXPORTED_SCHEMAS.clear()
        hit = _EXPORTED_SCHEMAS[id(schema)] = (schema, schema.__arrow_c_schema__())
    return <ArrowSchema *>PyCapsule_GetPointer(hit[1], "arrow_schema")


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
            ok = dbsp_cdata_same_type(t, k, &a.schema, acols[k] if acols != NULL else k)
        else:
            ok = dbsp_cdata_same_type(t, k, &b.schema, bcols[k - na] if bcols != NULL else k - na)
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


def take_pairs(left, lidx, rright, ridx, rcols, schema):
    """A join's output rows: every column of `left` at `lidx`, then columns `rcols` (positions) of `rright` at
    `ridx` (int64 arrays of one length, each index in range, else IndexError), as a Table of `schema` (those
    columns' types, in that order) with one chunk per column, from one C call (csrc/cdata.h)."""
    cdef BatchView a = view_of(left)
    cdef BatchView b = view_of(rright)
    cdef Int32s bc = Int32s(rcols)
    li = np.ascontiguousarray(lidx, dtype=np.int64)
    ri = np.ascontiguousarray(ridx, dtype=np.int64)
    if li.shape[0] != ri.shape[0]:
        raise ValueError(f"take_pairs: {li.shape[0]} left rows but {ri.shape[0]} right rows")
    for k in range(bc.n):
        if bc.p[k] < 0 or bc.p[k] >= b.c.ncols:
            raise IndexError(f"take_pairs: right column {bc.p[k]} is outside 0..{b.c.ncols - 1}")
    check_types(schema, a, NULL, a.c.ncols, b, bc.p, bc.n)
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
            st = dbsp_cdata_gather2(&a.c, NULL, a.c.ncols, lp, &b.c, bc.p, bc.n, rp, m, &out)
    if st == DBSP_EINVAL:
        raise IndexError("take_pairs: a row index or column position is out of range")
    check_status(st, "take_pairs")
    return import_batch(&out, schema)


def linear_fold(old, delta, khash):
    """A linear aggregate's step (csrc/fold.h): for `ng` groups with old totals `old` and a step's sums `delta`
    ((ng, ns) int64, slot 0 the row count) and key hashes `khash` (ng, ascending), the rows of new (+1) and old
    (-1) totals of the changed groups: (group of each row, weights, key hashes, slot values as an (ns, n) array,
    whether the rows are in canonical index order). WeightOverflowError if a total leaves int64."""
    o = np.ascontiguousarray(old, dtype=np.int64)
    d = np.ascontiguousarray(delta, dtype=np.int64)
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    if o.ndim != 2 or d.shape != o.shape or kh.shape != (o.shape[0],):
        raise ValueError(f"linear_fold: old {o.shape}, delta {d.shape} and khash {kh.shape} do not match")
    cdef int64_t ng = o.shape[0], cap = 2 * o.shape[0], n = 0
    cdef int32_t ns = o.shape[1]
    cdef int ordered = 1, st
    grp = np.empty(max(cap, 1), dtype=np.int64)
    w = np.empty(max(cap, 1), dtype=np.int64)
    kho = np.empty(max(cap, 1), dtype=np.uint64)
    vals = np.empty((ns, max(cap, 1)), dtype=np.int64)
    cdef const int64_t[:, ::1] po = o
    cdef const int64_t[:, ::1] pd = d
    cdef const uint64_t[::1] pk = kh
    cdef int64_t[::1] pg = grp
    cdef int64_t[::1] pw = w
    cdef uint64_t[::1] pkh = kho
    cdef int64_t[:, ::1] pv = vals
    if ng == 0 or ns == 0:
        return grp[:0], w[:0], kho[:0], vals[:, :0], True
    with nogil:
        st = dbsp_linear_fold(ng, ns, &po[0, 0], &pd[0, 0], &pk[0], &pg[0], &pw[0], &pkh[0], &pv[0, 0], &n, &ordered,
                              NULL)
    check_status(st, "linear_fold")
    return grp[:n], w[:n], kho[:n], vals[:, :n], bool(ordered)


def linear_step(table, keys, cols, KeyIndex ix):
    """A linear aggregate's step through its key index, in one call: group the rows of `table` (a Table or BatchView
    with weights) by the key columns `keys`, summing weight times each int64 column of `cols` (csrc/reduce.h); read
    each group's old sums from `ix` (whose sums are those columns' totals per key); emit the rows of new (+1) and old
    (-1) totals of the changed groups (csrc/fold.h); then store each changed group's new totals in `ix` (in place
    where the key was found), or drop the group when its new count (slot 0) is 0. Returns (rows, w, kh, rh, vals,
    ordered): per emitted row, the row of `table` carrying its key, its weight, key hash and row hash; the slot
    values as an (ns, n) array; and whether the rows are in canonical index order (linear_fold's). A
    WeightOverflowError (a sum or total leaves int64) leaves `ix` unchanged; a MemoryError or ValueError (past its
    size limit) while storing leaves it broken."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef int32_t ns = len(cols)
    if k.n != ix.nkeys or ns != ix.nvals or ns == 0:
        raise ValueError(f"linear_step: {k.n} keys and {ns} columns for an index of {ix.nkeys} and {ix.nvals}")
    cdef CAggSpec *specs = agg_specs([("sum", c) for c in cols])
    cdef CReduceOut r
    cdef int st
    memset(&r, 0, sizeof(r))
    with nogil:
        st = dbsp_group_reduce_all(&v.c, k.p, k.n, specs, ns, &r)
    free(specs)
    if st != DBSP_OK:
        dbsp_reduce_free(&r)
        check_status(st, "linear_step")
    cdef int64_t ng = r.ngroups, cap = max(2 * r.ngroups, 1), n = 0, i, g
    cdef int ordered = 1
    buf = np.empty(cap * (4 + ns), dtype=np.int64)  # rows, w, kh, rh, then the slots: one allocation
    cdef int64_t[::1] pb = buf
    cdef int64_t *rows = &pb[0]
    cdef int64_t *w = rows + cap
    cdef uint64_t *kh = <uint64_t *>(rows + 2 * cap)
    cdef uint64_t *rh = <uint64_t *>(rows + 3 * cap)
    cdef int64_t *vals = rows + 4 * cap
    cdef int64_t *old = <int64_t *>calloc(max(ng * ns, 1), 8)
    cdef int64_t *grp = <int64_t *>malloc(cap * 8)
    cdef int64_t **slots = <int64_t **>malloc(max(ng, 1) * sizeof(int64_t *))
    if old == NULL or grp == NULL or slots == NULL:
        free(old); free(grp); free(slots); dbsp_reduce_free(&r)
        raise MemoryError("linear_step: out of memory")
    with nogil:
        if ng:
            st = dbsp_keyindex_get_slots(ix.ix, &v.c, k.p, r.group_row, <uint64_t *>r.khash, ng, old, slots)
            if st == DBSP_OK:
                st = dbsp_linear_fold(ng, ns, old, r.ivals, <uint64_t *>r.khash, grp, w, kh, vals, &n, &ordered, rh)
        if st == DBSP_OK:
            for i in range(n):  # new totals of keys the index holds: in place, before anything changes its shape
                g = grp[i]
                rows[i] = r.group_row[g]
                if w[i] > 0 and slots[g] != NULL:
                    dbsp_keyindex_set_slot(ix.ix, slots[g], vals + i, cap)
            i = 0
            while st == DBSP_OK and i < n:  # then new keys, and groups whose new count is 0 (their old row alone)
                g = grp[i]
                if w[i] > 0:
                    if slots[g] == NULL:
                        st = dbsp_keyindex_put(ix.ix, &v.c, k.p, rows[i], kh[i], vals + i, cap, n)
                elif (i + 1 >= n or grp[i + 1] != g) and (i == 0 or grp[i - 1] != g):
                    st = dbsp_keyindex_put(ix.ix, &v.c, k.p, rows[i], kh[i], NULL, cap, n)
                i += 1
    free(old); free(grp); free(slots)
    dbsp_reduce_free(&r)
    check_status(st, "linear_step")
    return (buf[:n], buf[cap:cap + n], buf[2 * cap:2 * cap + n].view(np.uint64),
            buf[3 * cap:3 * cap + n].view(np.uint64), buf[4 * cap:].reshape(ns, cap)[:, :n], bool(ordered))


def extremes_probe(table, keys, slots, KeyIndex ix):
    """A min/max aggregate's step, phase 1 (csrc/extremes.h): the groups of the indexed change `table` (a BatchView
    with weights and key hashes, in canonical order for the key columns `keys`), their old totals read from `ix`
    and their new ones for the kernel `slots` ((kind, column) pairs). Returns (group_row, gkh, old, nw, need):
    old and nw are (ng, V) int64 arrays (V = slots, then one "not null" flag per extreme), need a bool array of the
    groups whose extremes must be recomputed from their values. Reads only."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef int32_t ns = len(slots), ne = sum(1 for kind, _ in slots if kind in ("min", "max"))
    cdef int32_t V = ns + ne
    if v.kh == NULL and v.c.nrows:
        raise ValueError("extremes_probe: the change needs its key hashes")
    if k.n != ix.nkeys or V != ix.nvals:
        raise ValueError(f"extremes_probe: {k.n} keys and {V} values for an index of {ix.nkeys} and {ix.nvals}")
    cdef int64_t n = v.c.nrows, ng = 0
    group_row = np.empty(max(n, 1), dtype=np.int64)
    gkh = np.empty(max(n, 1), dtype=np.uint64)
    old = np.empty((max(n, 1), V), dtype=np.int64)
    nw = np.empty((max(n, 1), V), dtype=np.int64)
    need = np.zeros(max(n, 1), dtype=np.uint8)
    if n == 0:
        return group_row[:0], gkh[:0], old[:0], nw[:0], need[:0].view(bool)
    cdef CAggSpec *specs = agg_specs(slots)
    cdef int64_t[::1] pg = group_row
    cdef uint64_t[::1] pk = gkh
    cdef int64_t[:, ::1] po = old
    cdef int64_t[:, ::1] pn = nw
    cdef uint8_t[::1] pe = need
    cdef int st
    with nogil:
        st = dbsp_extremes_probe(ix.ix, &v.c, v.kh, k.p, k.n, specs, ns, &pg[0], &pk[0], &po[0, 0], &pn[0, 0],
                                 &pe[0], &ng)
    free(specs)
    check_status(st, "extremes_probe")
    return group_row[:ng], gkh[:ng], old[:ng], nw[:ng], need[:ng].view(bool)


def extremes_scan(table, keys, rows, khash, batches, vkeys, int32_t vcol):
    """Extremes recomputed from a value trace (csrc/extremes.h): for each row ``rows[i]`` of ``table`` (a Table or
    BatchView; key columns ``keys``, key hash ``khash[i]``), over the rows of ``batches`` (BatchViews with key
    hashes: a value trace's batches, key columns ``vkeys``) holding its key, equal values' weights summed across
    batches, the least and greatest value of column ``vcol`` with a positive sum. Returns (has, mn, mx): a bool
    array and two int64 arrays (0 where has is False)."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef Int32s vk = Int32s(vkeys)
    if vk.n != k.n:
        raise ValueError(f"extremes_scan: {k.n} key columns against {vk.n}")
    r = np.ascontiguousarray(rows, dtype=np.int64)
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    cdef int64_t n = r.shape[0]
    if kh.shape[0] != n:
        raise ValueError(f"extremes_scan: {kh.shape[0]} key hashes for {n} rows")
    views = [<BatchView?>b for b in batches]
    cdef int32_t nb = len(views), i
    for bv in views:
        if (<BatchView>bv).kh == NULL and (<BatchView>bv).c.nrows:
            raise ValueError("extremes_scan: every batch needs its key hashes")
    has = np.zeros(max(n, 1), dtype=np.uint8)
    mn = np.zeros(max(n, 1), dtype=np.int64)
    mx = np.zeros(max(n, 1), dtype=np.int64)
    if n == 0:
        return has[:0].view(bool), mn[:0], mx[:0]
    cdef const CBatch **pb = <const CBatch **>malloc(max(nb, 1) * sizeof(CBatch *))
    cdef const uint64_t **pk = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
    if pb == NULL or pk == NULL:
        free(pb); free(pk)
        raise MemoryError("extremes_scan: out of memory")
    for i in range(nb):
        pb[i] = &(<BatchView>views[i]).c
        pk[i] = (<BatchView>views[i]).kh
    cdef const int64_t[::1] pr = r
    cdef const uint64_t[::1] pkh = kh
    cdef uint8_t[::1] ph = has
    cdef int64_t[::1] pmn = mn
    cdef int64_t[::1] pmx = mx
    cdef int st
    with nogil:
        st = dbsp_extremes_scan(&v.c, k.p, k.n, &pr[0], &pkh[0], n, pb, pk, nb, vk.p, vcol, &ph[0], &pmn[0], &pmx[0])
    free(pb); free(pk)
    check_status(st, "extremes_scan")
    return has[:n].view(bool), mn[:n], mx[:n]


def extremes_store(table, keys, group_row, gkh, old, nw, KeyIndex ix):
    """Phase 2 (csrc/extremes.h): the rows of the groups whose totals changed, -old then +new, as (grp, w), with
    `ix` left holding the new totals `nw`. A MemoryError or ValueError (past its size limit) leaves it broken."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    gr = np.ascontiguousarray(group_row, dtype=np.int64)
    kh = np.ascontiguousarray(gkh, dtype=np.uint64)
    o = np.ascontiguousarray(old, dtype=np.int64)
    x = np.ascontiguousarray(nw, dtype=np.int64)
    cdef int64_t ng = gr.shape[0], n = 0
    cdef int32_t nv = ix.nvals
    if o.ndim != 2 or o.shape != x.shape or o.shape[0] != ng or kh.shape[0] != ng or o.shape[1] != ix.nvals:
        raise ValueError("extremes_store: group rows, hashes, old and new totals do not match")
    grp = np.empty(max(2 * ng, 1), dtype=np.int64)
    w = np.empty(max(2 * ng, 1), dtype=np.int64)
    if ng == 0:
        return grp[:0], w[:0]
    cdef const int64_t[::1] pg = gr
    cdef const uint64_t[::1] pk = kh
    cdef const int64_t[:, ::1] po = o
    cdef const int64_t[:, ::1] px = x
    cdef int64_t[::1] pgo = grp
    cdef int64_t[::1] pw = w
    cdef int st
    with nogil:
        st = dbsp_extremes_store(ix.ix, &v.c, k.p, ng, nv, &pg[0], &pk[0], &po[0, 0], &px[0, 0],
                                 &pgo[0], &pw[0], &n)
    check_status(st, "extremes_store")
    return grp[:n], w[:n]


cdef class KeyIndex:
    """A hash index from a key of fixed-width columns to int64 sums (csrc/keyindex.h): ``get`` adds each probed
    key's sums to an accumulator with one probe per key, ``add`` folds a batch's rows into the sums (weight times
    int64 columns, or the weight alone for a column position of -1). ``token`` is free for the owner's use (a
    Trace records which state of its batches the sums match)."""
    cdef CKeyIndex *ix
    cdef readonly int32_t nkeys
    cdef readonly int32_t nvals
    cdef readonly tuple types
    cdef public object token

    def __cinit__(self, types, int32_t nvals, int64_t max_bytes=0):
        cdef Int32s t = Int32s([type_code(x) if type_code(x) is not None else -1 for x in types])
        self.ix = NULL
        self.nkeys = t.n
        self.nvals = nvals
        self.types = tuple(types)
        self.token = None
        check_status(dbsp_keyindex_new(t.p, t.n, nvals, max_bytes, &self.ix), "KeyIndex")

    def __dealloc__(self):
        dbsp_keyindex_free(self.ix)

    def __len__(self):
        return dbsp_keyindex_len(self.ix)

    @property
    def nbytes(self):
        """Bytes of the slot tables (the new and the old one while growing)."""
        return dbsp_keyindex_bytes(self.ix)

    @property
    def growing(self):
        """True while the index moves its entries into a table of twice the slots, a few per new entry
        (csrc/keyindex.h invariant 5)."""
        return bool(dbsp_keyindex_growing(self.ix))

    @property
    def spills(self):
        """New keys that spilled into the new table while growing, ever (csrc/keyindex.h invariant 5; for tests)."""
        return dbsp_keyindex_spills(self.ix)

    @property
    def broken(self):
        """True after an update failed (overflow, memory): the sums are partly updated and must not be read."""
        return bool(dbsp_keyindex_broken(self.ix))

    def get(self, table, keys, khash, acc, sel=None):
        """acc[i, v] += sum v of the key of row ``sel[i]`` (or row i) of ``table`` (a Table or BatchView) over the
        key columns ``keys``, whose key hash is ``khash[i]``; ``acc`` is a C-contiguous int64 (n, nvals) array."""
        cdef BatchView b = view_of(table)
        cdef Int32s k = Int32s(keys)
        kh = np.ascontiguousarray(khash, dtype=np.uint64)
        cdef int64_t n = kh.shape[0]
        if k.n != self.nkeys:
            raise ValueError(f"KeyIndex.get: {k.n} key columns for an index of {self.nkeys}")
        if acc.dtype != np.int64 or acc.ndim != 2 or acc.shape[0] != n or acc.shape[1] != self.nvals \
                or not acc.flags.c_contiguous:
            raise ValueError(f"KeyIndex.get: acc must be a C-contiguous int64 array of shape ({n}, {self.nvals})")
        cdef const int64_t[::1] ps
        cdef const int64_t *psel = NULL
        if sel is not None:
            sl = np.ascontiguousarray(sel, dtype=np.int64)
            if sl.shape[0] != n:
                raise ValueError(f"KeyIndex.get: {sl.shape[0]} selected rows for {n} key hashes")
            ps = sl
            psel = &ps[0] if n else NULL
        elif n != b.c.nrows:
            raise ValueError(f"KeyIndex.get: {n} key hashes for {b.c.nrows} rows")
        cdef const uint64_t[::1] pk = kh
        cdef int64_t[:, ::1] out = acc
        cdef int st
        if n == 0:
            return acc
        with nogil:
            st = dbsp_keyindex_get(self.ix, &b.c, k.p, psel, &pk[0], n, &out[0, 0])
        check_status(st, "KeyIndex.get")
        return acc

    def add(self, table, weights, keys, khash, cols, int64_t sign=1, before=None):
        """Fold every row of ``table`` (weights int64 or None for +1) into the sums of its key (columns ``keys``,
        key hash ``khash[i]``): sum v += weight * sign * table[cols[v]] (an integer column), weight * sign where
        cols[v] is -1, weight * sign where column -2 - cols[v] is not null for cols[v] <= -2. With ``before`` (a
        C-contiguous int64 (n, nvals) array), also the sums of each row's key just before that row (the sums before
        the call, for rows with distinct keys). Raises WeightOverflowError, MemoryError, or ValueError past
        ``max_bytes`` (the index is then broken)."""
        cdef BatchView b = view_of(table, weights)
        cdef Int32s k = Int32s(keys)
        cdef Int32s c = Int32s(cols)
        kh = np.ascontiguousarray(khash, dtype=np.uint64)
        if k.n != self.nkeys or c.n != self.nvals:
            raise ValueError(f"KeyIndex.add: {k.n} keys and {c.n} columns for an index of {self.nkeys} and "
                             f"{self.nvals}")
        if kh.shape[0] != b.c.nrows:
            raise ValueError(f"KeyIndex.add: {kh.shape[0]} key hashes for {b.c.nrows} rows")
        cdef const uint64_t[::1] pk = kh
        cdef int64_t[:, ::1] pb
        cdef int64_t *pbefore = NULL
        cdef int st
        if before is not None:
            if before.dtype != np.int64 or before.ndim != 2 or before.shape[0] != b.c.nrows \
                    or before.shape[1] != self.nvals or not before.flags.c_contiguous:
                raise ValueError(f"KeyIndex.add: before must be a C-contiguous int64 array of shape "
                                 f"({b.c.nrows}, {self.nvals})")
            if b.c.nrows:
                pb = before
                pbefore = &pb[0, 0]
        if b.c.nrows == 0:
            return
        with nogil:
            st = dbsp_keyindex_add_before(self.ix, &b.c, k.p, &pk[0], c.p, sign, pbefore)
        check_status(st, "KeyIndex.add")

    def check(self):
        """Raise AssertionError unless csrc/keyindex.h invariants 1-3 hold (tests)."""
        assert dbsp_keyindex_check(self.ix) == DBSP_OK, "KeyIndex invariants violated"


def keyindex_budget(bytes=None):
    """The process-wide budget on the slot tables of every KeyIndex (csrc/keyindex.h invariant 6), in bytes (0:
    none); with ``bytes``, set it first (an int >= 0). A growth that would pass it fails as one past the index's
    own ``max_bytes`` does."""
    if bytes is not None:
        if isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0:
            raise ValueError(f"keyindex_budget: bytes must be an int >= 0, got {bytes!r}")
        dbsp_keyindex_set_budget(bytes)
    return dbsp_keyindex_budget()


def keyindex_total_bytes():
    """Bytes held by the slot tables of every KeyIndex in the process now (csrc/keyindex.h invariant 6)."""
    return dbsp_keyindex_total_bytes()


def keyindex_supports(types):
    """Whether a KeyIndex can key on columns of these Arrow types (the C constructor's rule: fixed width, at most
    DBSP_KEYINDEX_MAX_KEYS columns)."""
    try:
        KeyIndex(types, 1)
    except (SchemaError, ValueError):
        return False
    return True
