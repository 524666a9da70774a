# merge.pxi: MergeCursor (merge.h): a merge of two canonical batches advanced in bounded steps.

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
