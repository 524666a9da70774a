# merge.pxi: MergeCursor (merge.h): a merge of two or more canonical batches advanced in bounded steps.

# A file-backed output's scratch mapping is madvised MADV_HUGEPAGE (``DBSP_HUGEPAGES=0``: not), so that the page
# cache takes its pages, which the merge writes through the mapping, in 2 MiB folios: a write fault on a page not
# cached allocates a PMD-sized folio for a VM_HUGEPAGE mapping (Linux's mmap read-around otherwise starts at order 0
# and leaves a mix of small ones). The output becomes a batch file in place (dbsp_core/trace/batchfile.py
# invariant 7), and the steps that read it later fault a page of a 2 MiB folio with one PMD entry where a small
# folio costs a fault per 64 KiB of fault-around (batchfile.py invariant 6: the same for files written by pwrite).
# Measured: a 1k-row step on a 10M-row spilled join, its state compacted into such a file, 7.0 -> 2.6 ms of CPU and
# 617 -> 170 minor faults (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-flat100).
# Tests set it False to see the old way.
HUGE_SCRATCH = os.environ.get("DBSP_HUGEPAGES", "1").strip() != "0"

# The cost of those folios is the write fault that allocates one: a fresh 2 MiB folio of the page cache, allocated
# (THP defrag "madvise": with synchronous reclaim and compaction for a VM_HUGEPAGE mapping), zeroed and its blocks
# mapped, 16-29 ms of system time on a loaded host in the slice that first writes a new 2 MiB of a region (measured:
# bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-30, branches r31-reclaim and r31-slicefault). :meth:`MergeCursor.populate_ahead` takes
# those faults ahead of the writer with MADV_POPULATE_WRITE (Linux 5.14), called off the stepping thread
# (dbsp_core/trace/prefault.py): the same folios, allocated by another thread, the file's bytes
# unchanged (its blocks were reserved by fallocate and read as zeros; a populate writes nothing, it only faults the
# pages in writable, so crash safety and the file format are untouched).
cdef int MADV_POPULATE_WRITE_ = 23  # <linux/mman.h>; EINVAL before Linux 5.14: then populate_ahead does nothing
cdef bint populate_refused = False  # the kernel refused MADV_POPULATE_WRITE once (set racily: either is right)

cdef class MergeCursor:
    """A merge cursor: a merge of k >= 2 canonical batches (BatchViews with key hashes, of one schema and key)
    advanced in bounded steps (csrc/merge.h; two inputs go through the two-way kernel, more through the k-way one,
    invariant 4): ``step(budget)`` consumes at least `budget` input rows (or the rest) and writes their consolidated
    sum into buffers sized for all inputs; ``result()`` then hands the rows to Arrow and numpy (unused pages returned
    to the system). The output is dbsp_zset_merge's (of the inputs two at a time), row for row. Given an input's row
    hashes (``rhs[x]``: uint64 in index order, or None) its rows of meeting keys are ordered without hashing; with
    `row_hashes` the result carries the output's row hashes (computed for rows of an input without them).

    With `spill_dir` the output buffers are a shared mapping of a scratch file created there (and unlinked at once):
    rows a step writes are the file's pages, so :meth:`drop` returns them from the process to the kernel's page
    cache (which writes them back) without losing them, and a merge bigger than a memory budget holds only the
    rows written since the last drop (trace invariant 12). ``result()`` then reads the same mapping in place.
    With ``prefix`` > 0 as well, the regions start ``prefix`` bytes into the file (page-aligned), and the file keeps
    its name (``scratch_path``) until its mapping is gone: the output can then become a batch file in place
    (dbsp_core/trace/batchfile.py ``write_in_place``: the header and Arrow metadata in the prefix, the sections
    after the rows), which :meth:`adopt_scratch` takes over; a file not adopted is unlinked with its mapping."""
    cdef list views  # the inputs' BatchViews
    cdef BatchView a
    cdef list rh_refs
    cdef int32_t k
    cdef const CBatch **inp
    cdef const uint64_t **khs
    cdef const uint64_t **rhs
    cdef int64_t *pos
    cdef int64_t total
    cdef Int32s keys
    cdef CMergeCursor m
    cdef COutColumn *out
    cdef list regions  # per column: [validity or None, values, data or None]
    cdef Region w
    cdef Region kh
    cdef Region rh
    cdef readonly object schema
    cdef readonly object mapping  # the scratch file's mapping of a file-backed output, else None
    cdef object _scratch  # [path] of a named scratch file (``prefix``), None once adopted; else None
    cdef bint finished
    cdef char *fbase  # the scratch mapping's first byte (file-backed output), else NULL
    cdef list spans  # per output region of a file-backed output: [file offset, bytes, populated up to (offset)]
    cdef object plock  # serializes populate_ahead's calls

    def __cinit__(self):
        self.out = NULL
        self.inp = NULL
        self.khs = NULL
        self.rhs = NULL
        self.pos = NULL
        self.fbase = NULL
        self.spans = []
        self.plock = None

    def __dealloc__(self):
        free(self.out)
        free(self.inp)
        free(self.khs)
        free(self.rhs)
        free(self.pos)

    def __init__(self, views, keys, rhs=None, bint row_hashes=False, spill_dir=None, int64_t prefix=0):
        cdef const uint64_t[::1] hv
        cdef int32_t c, x, ncols, k
        cdef int64_t nv = 0, nx = 0, nd = 0, cap = 0
        cdef int st
        cdef Region rv, rx, rd
        cdef BatchView v
        cdef const CColumn **cols = NULL
        cdef int64_t *ns = NULL
        self.views = [<BatchView?>view for view in views]
        k = len(self.views)
        if k < 2 or k > 64:
            raise ValueError(f"MergeCursor: {k} inputs (2 to 64)")
        self.k = k
        self.a = self.views[0]
        rhs = list(rhs) if rhs is not None else [None] * k
        if len(rhs) != k:
            raise ValueError("MergeCursor: one row-hash array (or None) per input")
        self.inp = <const CBatch **>calloc(k, sizeof(CBatch *))
        self.khs = <const uint64_t **>calloc(k, sizeof(uint64_t *))
        self.rhs = <const uint64_t **>calloc(k, sizeof(uint64_t *))
        self.pos = <int64_t *>calloc(k, sizeof(int64_t))
        if self.inp == NULL or self.khs == NULL or self.rhs == NULL or self.pos == NULL:
            raise MemoryError()
        self.rh_refs = []
        for x in range(k):
            v = self.views[x]
            if v.c.nrows and v.kh == NULL:
                raise ValueError("MergeCursor: every view needs its key hashes")
            self.inp[x] = &v.c
            self.khs[x] = v.kh
            ref = None
            if rhs[x] is not None and v.c.nrows:
                ref = np.ascontiguousarray(rhs[x], dtype=np.uint64)
                if ref.shape[0] != v.c.nrows:
                    raise ValueError("MergeCursor: one row hash per row")
                hv = ref
                self.rhs[x] = &hv[0]
            self.rh_refs.append(ref)
            cap += v.c.nrows
        self.total = cap
        self.keys = Int32s(keys)
        self.schema = self.a.pyschema
        ncols = self.a.c.ncols
        for x in range(1, k):
            if (<BatchView>self.views[x]).c.ncols != ncols:
                ncols = -1
        if ncols <= 0:
            raise ValueError(f"MergeCursor: inputs of {[(<BatchView>v).c.ncols for v in self.views]} columns "
                             f"(a merge needs key columns, the same on every side)")
        self.out = <COutColumn *>malloc(max(ncols, 1) * sizeof(COutColumn))
        if self.out == NULL:
            raise MemoryError()
        memset(self.out, 0, max(ncols, 1) * sizeof(COutColumn))
        self.regions = []
        sizes = []  # per column: (validity or 0, values, data or -1)
        cols = <const CColumn **>malloc(k * sizeof(CColumn *))
        ns = <int64_t *>malloc(k * sizeof(int64_t))
        try:
            if cols == NULL or ns == NULL:
                raise MemoryError()
            for c in range(ncols):
                for x in range(k):
                    v = self.views[x]
                    if v.cols[c].type != self.a.cols[c].type:
                        raise SchemaError(f"MergeCursor: column {c} has different types on two sides")
                    cols[x] = &v.cols[c]
                    ns[x] = v.c.nrows
                dbsp_merge_k_sizes(cols, ns, k, &nv, &nx, &nd)
                sizes.append((nv, nx, nd if self.a.cols[c].type in (DBSP_UTF8, DBSP_LARGE_UTF8, DBSP_BINARY,
                                                                    DBSP_LARGE_BINARY) else -1))
        finally:
            free(cols)
            free(ns)
        alloc = new_region if spill_dir is None else self._file_regions(spill_dir, sizes, cap, row_hashes, prefix)
        for c in range(ncols):
            nv, nx, nd = sizes[c]
            rv = alloc(nv) if nv else None
            rx = alloc(nx)
            rd = alloc(nd) if nd >= 0 else None
            self.out[c].validity = <uint8_t *>rv.ptr if rv is not None else NULL
            self.out[c].values = rx.ptr
            self.out[c].data = <uint8_t *>rd.ptr if rd is not None else NULL
            self.regions.append([rv, rx, rd])
        self.w = alloc(cap * 8)
        self.kh = alloc(cap * 8)
        self.rh = alloc(cap * 8) if row_hashes else None
        memset(&self.m, 0, sizeof(CMergeCursor))
        st = dbsp_merge_k_init(self.inp, k, self.out)
        check_status(st, "merge")
        self.finished = False

    def _file_regions(self, spill_dir, sizes, int64_t cap, bint row_hashes, int64_t prefix=0):
        """An allocator of the output's regions, in the order __init__ asks for them, from one shared mapping of a
        scratch file in `spill_dir` sized for all of them (each region page-aligned), from ``prefix`` bytes on (a
        page multiple; > 0: the file keeps its name, see the class)."""
        import mmap as _mmap
        import tempfile
        import threading
        import weakref
        cdef unsigned char[::1] fb
        page = _mmap.PAGESIZE
        prefix = (prefix + page - 1) // page * page
        want = []
        for nv, nx, nd in sizes:
            want += ([nv] if nv else []) + [nx] + ([nd] if nd >= 0 else [])
        want += [cap * 8, cap * 8] + ([cap * 8] if row_hashes else [])
        total = prefix + sum((max(n, 1) + page - 1) // page * page for n in want)
        fd, path = tempfile.mkstemp(prefix="merge-", suffix=".tmp", dir=spill_dir)
        try:
            if prefix == 0:
                os.unlink(path)  # nobody needs the file once the mapping goes: the kernel frees its pages then
            else:
                self._scratch = [path]
            os.ftruncate(fd, total)
            try:  # blocks reserved now: a full disk is an error here, not a SIGBUS when a step writes a page
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
                    raise StorageError(e.errno, f"a merge's output needs {total} bytes of scratch space in "
                                                f"{spill_dir}, and its file system has no room left: free space "
                                                f"there, or point spill_dir at a bigger one") from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            self.mapping = _mmap.mmap(fd, total, flags=_mmap.MAP_SHARED, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
            if HUGE_SCRATCH and hasattr(_mmap, "MADV_HUGEPAGE"):  # the output's page cache in 2 MiB folios (below)
                self.mapping.madvise(_mmap.MADV_HUGEPAGE)
                fb = self.mapping
                self.fbase = <char *>&fb[0]  # (populate_ahead: only for a huge-page mapping)
                self.plock = threading.Lock()
            if self._scratch is not None:  # unlinked with its mapping unless adopted (a crash leaves it: swept)
                weakref.finalize(self.mapping, _unlink_scratch, self._scratch)
        except BaseException:
            if self._scratch is not None:
                _unlink_scratch(self._scratch)
            raise
        finally:
            os.close(fd)
        offset = [prefix]

        def alloc(n):
            r = file_region(self.mapping, offset[0], n)
            self.spans.append([offset[0], n, offset[0]])
            offset[0] += (max(n, 1) + page - 1) // page * page
            return r
        return alloc

    @property
    def scratch_path(self):
        """The path of the named scratch file the output is built in (``prefix`` > 0), None otherwise or once
        adopted."""
        return self._scratch[0] if self._scratch is not None else None

    def adopt_scratch(self):
        """Take over the named scratch file (it is no longer unlinked with the mapping): returns its path."""
        path = self.scratch_path
        if path is None:
            raise ValueError("MergeCursor.adopt_scratch: no named scratch file")
        self._scratch[0] = None
        return path

    def drop(self):
        """Return the pages of a file-backed output written so far from the process to the page cache (they stay
        the file's; a later read or write faults them back). Nothing for an output in memory."""
        import mmap as _mmap
        if self.mapping is not None and hasattr(_mmap, "MADV_DONTNEED"):
            self.mapping.madvise(_mmap.MADV_DONTNEED)

    def populate_ahead(self, int64_t lead, int64_t rows=0):
        """Fault in, writable, the pages of each output region of a file-backed huge-page output from where it was
        populated so far up to ``lead`` bytes past where its writer is (the region's share of the output rows
        written: exact for fixed-width columns, weights and hashes, whose regions hold one slot per input row and
        are written in order; a variable-width column's bytes taken as proportional), in 2 MiB-aligned pieces of
        the file (the page cache's folios; comment above the class): MADV_POPULATE_WRITE, without the GIL. With
        ``rows``, past where the writer will be after that many more output rows (the stepping thread, before a
        step: what the prefault thread has not populated yet). Meant for a thread other than the stepping one,
        concurrently with :meth:`step` (it reads the cursor's progress only; the caller keeps this cursor, so its
        mapping, alive). Calls are serialized (a lock of the cursor) and each piece is populated once: two
        threads' first faults on one 2 MiB range at once can leave it in small folios (the loser's readahead falls
        back to order 0), so the writer must find its pieces populated, never populate them alongside. Returns the
        bytes populated; 0 for an output in memory, without huge pages, or where the kernel refuses (before Linux
        5.14)."""
        cdef int64_t total = self.total
        if self.fbase == NULL or populate_refused or total <= 0 or self.finished:
            return 0
        with self.plock:
            if self.finished:
                return 0
            return self._populate(min(total, self.m.n + max(rows, 0)), lead)

    cdef int64_t _populate(self, int64_t used, int64_t lead) except -1:
        global populate_refused
        cdef int64_t done = 0, total = self.total, off, n, at, want, end, piece = 2 << 20
        cdef int rc = 0, err = 0
        for sp in self.spans:
            off, n, at = sp
            end = (off + n + 4095) // 4096 * 4096
            want = off + <int64_t>(<double>n * used / total) + lead
            want = min(end, (want + piece - 1) // piece * piece)
            while at < want:
                n = min(want, (at // piece + 1) * piece) - at
                with nogil:
                    rc = madvise(self.fbase + at, <size_t>n, MADV_POPULATE_WRITE_)
                    if rc != 0:
                        err = c_errno
                if rc != 0:
                    if err == errno.EINVAL or err == errno.ENOSYS:
                        populate_refused = True
                        return done
                    if err != errno.EINTR and err != errno.EAGAIN:
                        raise OSError(err, f"merge: MADV_POPULATE_WRITE of the scratch file: {os.strerror(err)}")
                    continue
                at += n
                done += n
                sp[2] = at
        return done

    cdef int64_t _consumed(self):
        cdef int64_t s = 0
        cdef int32_t x
        if self.k == 2:
            return self.m.ia + self.m.ib
        for x in range(self.k):
            s += self.pos[x]
        return s

    @property
    def inputs(self):
        """The number of inputs (k)."""
        return self.k

    @property
    def consumed(self):
        """Input rows merged so far."""
        return self._consumed()

    @property
    def remaining(self):
        """Input rows still to merge."""
        return self.total - self._consumed()

    @property
    def done(self):
        return self._consumed() == self.total

    def step(self, int64_t budget):
        """Merge at least `budget` more input rows (or the rest); returns the number merged."""
        cdef int64_t before = self._consumed()
        cdef int st
        if self.finished:
            raise ValueError("MergeCursor.step: the result was already taken")
        cdef uint64_t *rh = <uint64_t *>self.rh.ptr if self.rh is not None else NULL
        if self.k == 2:
            with nogil:
                st = dbsp_merge_cursor_step(self.inp[0], self.khs[0], self.rhs[0], self.inp[1], self.khs[1],
                                            self.rhs[1], self.keys.p, self.keys.n, budget, &self.m, self.out,
                                            <int64_t *>self.w.ptr, <uint64_t *>self.kh.ptr, rh)
        else:
            with nogil:
                st = dbsp_merge_k_step(self.inp, self.khs, self.rhs, self.k, self.keys.p, self.keys.n, budget,
                                       self.pos, &self.m.n, self.out, <int64_t *>self.w.ptr, <uint64_t *>self.kh.ptr,
                                       rh)
        check_status(st, "merge")
        return self._consumed() - before

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
        if self.mapping is not None:
            return self._file_result(n)
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

    def _file_result(self, int64_t n):
        """result() of a file-backed output: Arrow arrays over the mapping's regions, in place (no copy)."""
        cdef int32_t c, code
        cdef int64_t nbytes, ndata
        arrays = []
        for c in range(self.a.c.ncols):
            rv, rx, rd = self.regions[c]
            code = self.out[c].type
            ndata = 0
            if code == DBSP_BOOL:
                nbytes = (n + 7) // 8
            elif rd is not None:
                if code in (DBSP_LARGE_UTF8, DBSP_LARGE_BINARY):
                    nbytes = (n + 1) * 8
                    ndata = (<int64_t *>(<Region>rx).ptr)[n]
                else:
                    nbytes = (n + 1) * 4
                    ndata = (<int32_t *>(<Region>rx).ptr)[n]
            else:
                nbytes = n * dbsp_type_width(code)
            bufs = [pa.py_buffer(rv)[:(n + 7) // 8] if rv is not None else None, pa.py_buffer(rx)[:nbytes]]
            if rd is not None:
                bufs.append(pa.py_buffer(rd)[:ndata])
            arrays.append(pa.Array.from_buffers(self.schema.field(c).type, n, bufs,
                                                null_count=self.out[c].null_count if rv is not None else 0))
        self.regions = []
        table = pa.Table.from_batches([pa.RecordBatch.from_arrays(arrays, schema=self.schema)], schema=self.schema)
        w = np.frombuffer(self.w, dtype=np.int64, count=n)
        kh = np.frombuffer(self.kh, dtype=np.uint64, count=n)
        rh = np.frombuffer(self.rh, dtype=np.uint64, count=n) if self.rh is not None else None
        return table, w, kh, rh


def _unlink_scratch(holder):
    """Unlink a named scratch file not adopted (MergeCursor ``prefix``), quietly (gone already: nothing to do)."""
    path, holder[0] = holder[0], None
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
