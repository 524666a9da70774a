# scratch.pxi: Region (scratch.h): mapped memory lent to Arrow and numpy, trimmed to what a result uses.

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
