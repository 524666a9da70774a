# scratch.pxi: Region (scratch.h): mapped memory lent to Arrow and numpy, trimmed to what a result uses.

cdef class Region:
    """Owns memory from dbsp_region_alloc (scratch.h) and lends it to Arrow and numpy through the buffer protocol;
    ``trim`` returns the pages past a length to the system without moving the rest. A region borrowed from a file
    mapping (:func:`file_region`) keeps its ``owner`` (the mapping) alive and frees nothing."""
    cdef void *ptr
    cdef size_t mapped
    cdef object owner
    cdef Py_ssize_t nbytes
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        if self.owner is None:
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
        if self.owner is None:
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


cdef Region file_region(object mapping, Py_ssize_t offset, Py_ssize_t nbytes):
    """A region of ``nbytes`` at ``offset`` of a writable ``mapping`` (an ``mmap.mmap`` of a file), which it keeps
    alive: pages written there are the file's, so dropping them from the process (madvise) loses nothing."""
    cdef unsigned char[::1] v = mapping
    cdef Region r = Region.__new__(Region)
    r.ptr = <void *>&v[offset]
    r.mapped = 0
    r.owner = mapping
    r.nbytes = nbytes
    return r


def trim_caches(keep, bint all_threads_memory=False):
    """Return cached memory to the system (csrc/scratch.c design note 6): the calling thread's scratch cache and
    the process's region cache, each down to at most ``keep`` bytes; with ``all_threads_memory``, also glibc's
    free memory (``malloc_trim(0)``, every arena). Returns the bytes the two caches released."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"trim_caches: keep must be an int >= 0, got {keep!r}")
    cdef size_t k = keep, released
    with nogil:
        released = dbsp_scratch_trim(k) + dbsp_region_cache_trim(k)
        if all_threads_memory:
            dbsp_malloc_trim()
    return released


def region_cache_limit(limit):
    """Set the process's region cache limit in bytes (csrc/scratch.h; DBSP_REGION_CACHE_MB sets the first one),
    trimming the cache to it; returns the previous limit."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"region_cache_limit: an int >= 0, got {limit!r}")
    return dbsp_region_cache_limit(<size_t>limit)


def scratch_cache_limit(limit):
    """Set the limit of every thread's scratch cache in bytes (csrc/scratch.c design note 3; DBSP_SCRATCH_MB sets
    the first one), trimming the calling thread's cache to it; returns the previous limit."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"scratch_cache_limit: an int >= 0, got {limit!r}")
    return dbsp_scratch_cache_limit(<size_t>limit)


def cached_bytes():
    """(the calling thread's scratch cache, the process's region cache): bytes held for reuse (csrc/scratch.c)."""
    return dbsp_scratch_cached(), dbsp_region_cached()


def hugepages():
    """Whether the C core madvises its buffers of 2 MiB and more for transparent huge pages (csrc/scratch.c design
    note 2; ``DBSP_HUGEPAGES``, read once)."""
    return bool(dbsp_hugepages())
