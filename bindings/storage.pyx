# storage.pyx: cdef classes owning the C page store, transactions, cursors and step log (dbsp_core._storage).
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from libc.errno cimport EINTR, EIO, ENOSPC, EOPNOTSUPP, errno
from cpython.bytes cimport PyBytes_FromStringAndSize
from posix.mman cimport madvise
from posix.uio cimport iovec

from storage cimport *

import os

import numpy

from dbsp_core.errors import CorruptionError, FormatVersionError, InUseError, StorageError

CRASH_MODES = {"keep": 0, "drop": 1, "tear": 2, "reorder": 3, "chaos": 4}


class NotFound(Exception):
    """Internal: a version, table or key does not exist."""


cdef int check(int st) except -1:
    """The one error path: turn a storage status into a typed exception carrying the C message."""
    if st == DBSP_OK:
        return 0
    msg = dbsp_storage_errmsg().decode("utf-8", "replace")
    err = dbsp_storage_errno()
    if st == DBSP_ECORRUPT:
        raise CorruptionError(EIO, msg)
    if st == DBSP_EFORMAT:
        raise FormatVersionError(EIO, msg)
    if st == DBSP_ENOSPC:
        raise StorageError(ENOSPC, msg)
    if st == DBSP_EBUSY:
        raise InUseError(err or EIO, msg)
    if st == DBSP_ENOTSUP:
        raise StorageError(EOPNOTSUPP, msg)
    if st == DBSP_EIO or st == DBSP_ECRASHED or st == DBSP_ESTATE:
        raise StorageError(err or EIO, msg)
    if st == DBSP_ENOTFOUND:
        raise NotFound(msg)
    if st == DBSP_ENOMEM:
        raise MemoryError(msg or "storage: out of memory")
    if st == DBSP_EINVAL or st == DBSP_ETOOBIG:
        raise ValueError(msg)
    raise StorageError(EIO, f"storage: unknown status {st}: {msg}")


_FAULT_VFSES = {}  # name ("fault:N") -> address of a fault VFS made by fault_new (never freed: vfs.c model 6)


cdef DbspVfs *pick_vfs(str vfs) except NULL:
    if vfs == "posix":
        return dbsp_vfs_posix()
    if vfs == "fault":
        return dbsp_vfs_fault()
    if vfs in _FAULT_VFSES:
        return <DbspVfs *><uintptr_t>_FAULT_VFSES[vfs]
    raise ValueError(f"unknown vfs {vfs!r}; expected 'posix', 'fault' or a name fault_new returned")


cdef DbspVfs *pick_fault(str vfs) except NULL:
    if vfs != "fault" and vfs not in _FAULT_VFSES:
        raise ValueError(f"{vfs!r} is not a fault VFS; expected 'fault' or a name fault_new returned")
    return pick_vfs(vfs)


def crc32c(data, unsigned int crc=0):
    """CRC-32C of a bytes-like object (continuing from ``crc``); releases the GIL (frames of large pushes)."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef const unsigned char *p = &view[0] if n else NULL
    with nogil:
        crc = dbsp_crc32c(crc, p, n)
    return crc


cdef extern from "<unistd.h>" nogil:
    ssize_t c_pread "pread"(int fd, void *buf, size_t count, long offset)


def pread_ranges(int fd, const int64_t[::1] offsets, const int64_t[::1] lengths, const int64_t[::1] dst, out):
    """Read ``lengths[i]`` bytes of file ``fd`` at ``offsets[i]`` into ``out`` (a writable bytes-like object) at
    ``dst[i]``, for every i, by pread(2) without the GIL (dbsp_core/trace/groupedfile.py: a group a call); raises
    OSError on an error, returns the index of the first range read short (the file ended), or -1."""
    cdef unsigned char[::1] view = memoryview(out).cast("B")
    cdef Py_ssize_t n = offsets.shape[0], i, size = view.shape[0]
    cdef int64_t got, r
    cdef int err = 0
    cdef Py_ssize_t short = -1
    if lengths.shape[0] != n or dst.shape[0] != n:
        raise ValueError("pread_ranges: offsets, lengths and dst differ in length")
    for i in range(n):
        if dst[i] < 0 or lengths[i] < 0 or offsets[i] < 0 or dst[i] + lengths[i] > size:
            raise ValueError(f"pread_ranges: range {i} does not fit the buffer")
    with nogil:
        for i in range(n):
            got = 0
            while got < lengths[i]:
                r = c_pread(fd, &view[dst[i] + got], lengths[i] - got, offsets[i] + got)
                if r < 0:
                    err = errno
                    if err == EINTR:
                        err = 0
                        continue
                    break
                if r == 0:
                    break
                got += r
            if err:
                break
            if got < lengths[i]:
                short = i
                break
    if err:
        raise OSError(err, os.strerror(err))
    return short



cdef extern from "groupdecode.h" nogil:
    ctypedef struct DbspGBuf:
        pass
    ctypedef struct DbspGDec:
        int fd
        int64_t slot
        int64_t arrow_end
        const unsigned int *page_crcs
        unsigned char *checked
        int64_t npages
        int ncols
        const int *kind
        const int *width
        int khcol
        int64_t nrows
        int64_t *var_bytes
        int64_t *nulls
        int64_t bad_group
        int64_t bad_page
        int err
        char what[160]
        int64_t pages_checked
        int64_t groups_read
        int advise
        unsigned char *verified
        const unsigned char *map
        int64_t map_len
        unsigned char *units
        int64_t nunits
        const int64_t *gid
        unsigned char *buf
        DbspGBuf *bufs
        int *sel_g
        int *sel_r
        int64_t sel_cap
    int DBSP_GCOL_VAR32, DBSP_GCOL_VAR64, DBSP_GCOL_BOOL
    int DBSP_GDEC_OK, DBSP_GDEC_DAMAGED, DBSP_GDEC_SHORT, DBSP_GDEC_IOERR, DBSP_GDEC_NOMEM, DBSP_GDEC_UNSUPPORTED
    int DBSP_GDEC_CRC
    int dbsp_gdec_scan(DbspGDec *d, int64_t ng, const int64_t *slot_of, const int64_t *nslots,
                       const int64_t *msg_len, const int64_t *rows, const uint64_t *first_hash,
                       const uint64_t *hashes, int64_t nh)
    void dbsp_gdec_fill(DbspGDec *d, unsigned char **valid, unsigned char **data, unsigned char **vals)
    int dbsp_gdec_lookup(DbspGDec *d, const uint64_t *bloom, int64_t nwords, int k, int64_t ngroups,
                         const uint64_t *first_hash, const int64_t *slot_of, const int64_t *nslots,
                         const int64_t *msg_len, const int64_t *rows, const uint64_t *hashes, int64_t m)
    void dbsp_gdec_free(DbspGDec *d)
    size_t dbsp_gdec_keep_limit(size_t limit)


def grouped_keep_limit(limit):
    """Set the most bytes each thread keeps of the format-2 decoder's read buffer between calls (csrc/groupdecode.h;
    32 MiB at first); returns the previous limit."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"grouped_keep_limit: an int >= 0, got {limit!r}")
    return dbsp_gdec_keep_limit(<size_t>limit)


GATHER_STATUS = {"damaged": 1, "short": 2, "ioerr": 3, "nomem": 4, "unsupported": 5, "crc": 6}


cdef void _gdec_init(DbspGDec *d, int fd, int64_t slot, int64_t arrow_end, const unsigned int[::1] page_crcs,
                     unsigned char[::1] checked, const int[::1] kind, const int[::1] width, int khcol,
                     int64_t[::1] var_bytes, int64_t[::1] nulls):
    """A decoder over file ``fd`` (grouped_gather's and grouped_lookup's shared setup; the caller keeps every array
    alive while ``d`` is used)."""
    memset(d, 0, sizeof(d[0]))
    d.fd = fd
    d.slot = slot
    d.arrow_end = arrow_end
    d.page_crcs = &page_crcs[0] if page_crcs.shape[0] else NULL
    d.checked = &checked[0] if checked.shape[0] else NULL
    d.npages = page_crcs.shape[0]
    d.ncols = <int>kind.shape[0]
    d.kind = &kind[0]
    d.width = &width[0]
    d.khcol = khcol
    d.var_bytes = &var_bytes[0]
    d.nulls = &nulls[0]


cdef void _gdec_map(DbspGDec *d, const unsigned char[::1] mv, unsigned char[::1] units):
    """Read in place from the file's mapping ``mv`` (its whole length from offset 0), flagging ``units`` (a flag a 2
    MiB unit of its address space, or None); ``mv`` None: pread. The caller holds ``mv`` (an export of the mapping,
    so that it cannot be closed meanwhile) while ``d`` is used."""
    if mv is None:
        return
    d.map = &mv[0] if mv.shape[0] else NULL
    d.map_len = mv.shape[0]
    if units is not None and units.shape[0]:
        d.units = &units[0]
        d.nunits = units.shape[0]


def grouped_gather(int fd, int64_t slot, int64_t arrow_end, const unsigned int[::1] page_crcs,
                   unsigned char[::1] checked, const int[::1] kind, const int[::1] width, int khcol,
                   const int64_t[::1] slot_of, const int64_t[::1] nslots, const int64_t[::1] msg_len,
                   const int64_t[::1] rows, const uint64_t[::1] first_hash, hashes, mapping=None,
                   unsigned char[::1] units=None):
    """A format-2 lookup in C (csrc/groupdecode.h), the GIL released for the reads and the decode: groups
    ``slot_of``/``nslots``/``msg_len``/``rows``/``first_hash`` (one entry a group, ascending) read by pread from ``fd``,
    their slots not ``checked`` yet checked against ``page_crcs`` (and marked), their Arrow record-batch messages
    parsed for the flat schema ``kind``/``width`` (DBSP_GCOL_*: fixed-width, boolean, 32/64-bit offsets), and the rows
    whose key hash (column ``khcol``) is in ``hashes`` (uint64, ascending, unique; None: every row) gathered into one
    set of buffers. ``mapping`` (the file's ``mmap``, or None): read in place from it instead, flagging the 2 MiB
    ``units`` of its address space read (csrc/groupdecode.h). Returns ``(0, rows, columns, nulls, pages checked)``, each column ``(validity or None, values
    or offsets, var values or None)`` as numpy uint8 arrays; or ``(status, group, page, what, errno)`` (a
    GATHER_STATUS value; ``group`` the failing group's position in the call's list)."""
    cdef Py_ssize_t ng = slot_of.shape[0], nc = kind.shape[0], c
    cdef DbspGDec d
    cdef int st
    cdef const uint64_t[::1] hv
    cdef const uint64_t *hp = NULL
    cdef int64_t nh = -1
    if nslots.shape[0] != ng or msg_len.shape[0] != ng or rows.shape[0] != ng or first_hash.shape[0] != ng:
        raise ValueError("grouped_gather: the group arrays differ in length")
    if width.shape[0] != nc or nc == 0 or khcol < 0 or khcol >= nc:
        raise ValueError("grouped_gather: kind and width differ in length, or no key hash column")
    if checked.shape[0] != page_crcs.shape[0]:
        raise ValueError("grouped_gather: a checked flag a CRC page")
    if hashes is not None:
        hv = hashes
        nh = hv.shape[0]
        if nh:
            hp = &hv[0]
    cdef int64_t[::1] var_bytes = numpy.zeros(nc, dtype=numpy.int64)
    cdef int64_t[::1] nulls = numpy.zeros(nc, dtype=numpy.int64)
    cdef const unsigned char[::1] mv = mapping
    _gdec_init(&d, fd, slot, arrow_end, page_crcs, checked, kind, width, khcol, var_bytes, nulls)
    _gdec_map(&d, mv, units)
    try:
        with nogil:
            st = dbsp_gdec_scan(&d, ng, &slot_of[0] if ng else NULL, &nslots[0] if ng else NULL,
                                &msg_len[0] if ng else NULL, &rows[0] if ng else NULL,
                                &first_hash[0] if ng else NULL, hp, nh)
        if st != DBSP_GDEC_OK:
            return (st, d.bad_group, d.bad_page, d.what.decode("utf-8", "replace"), d.err)
        cols = _gather_fill(&d, kind, width)
        return (0, d.nrows, cols, numpy.asarray(nulls), d.pages_checked)
    finally:
        dbsp_gdec_free(&d)


cdef list _gather_fill(DbspGDec *d, const int[::1] kind, const int[::1] width):
    """The picked rows of a successful scan gathered (dbsp_gdec_fill, GIL released) into numpy uint8 arrays, a column
    ``(validity or None, values or offsets, var values or None)``."""
    cdef Py_ssize_t nc = kind.shape[0], c
    cdef int64_t n = d.nrows
    cdef unsigned char **vp = <unsigned char **>malloc(3 * nc * sizeof(unsigned char *))
    cdef unsigned char **dp
    cdef unsigned char **xp
    cdef unsigned char[::1] m
    if vp == NULL:
        raise MemoryError("grouped_gather")
    dp = vp + nc
    xp = dp + nc
    try:
        cols = []
        for c in range(nc):
            valid = numpy.zeros((n + 7) // 8, dtype=numpy.uint8) if d.nulls[c] else None
            k = kind[c]
            if k == DBSP_GCOL_BOOL:
                data = numpy.zeros((n + 7) // 8, dtype=numpy.uint8)
            elif k == DBSP_GCOL_VAR32:
                data = numpy.empty(4 * (n + 1), dtype=numpy.uint8)
            elif k == DBSP_GCOL_VAR64:
                data = numpy.empty(8 * (n + 1), dtype=numpy.uint8)
            else:
                data = numpy.empty(n * width[c], dtype=numpy.uint8)
            vals = numpy.empty(d.var_bytes[c], dtype=numpy.uint8) if k == DBSP_GCOL_VAR32 or k == DBSP_GCOL_VAR64 \
                else None
            cols.append((valid, data, vals))
            vp[c] = dp[c] = xp[c] = NULL
            if valid is not None and len(valid):
                m = valid
                vp[c] = &m[0]
            if len(data):
                m = data
                dp[c] = &m[0]
            if vals is not None and len(vals):
                m = vals
                xp[c] = &m[0]
        with nogil:
            dbsp_gdec_fill(d, vp, dp, xp)
        return cols
    finally:
        free(vp)


def grouped_lookup(int fd, int64_t slot, int64_t arrow_end, const unsigned int[::1] page_crcs,
                   unsigned char[::1] checked, const int[::1] kind, const int[::1] width, int khcol,
                   const uint64_t[::1] bloom, int bloom_k, const uint64_t[::1] first_hash, const int64_t[::1] slot_of,
                   const int64_t[::1] nslots, const int64_t[::1] msg_len, const int64_t[::1] rows,
                   const uint64_t[::1] hashes, bint advise=False, unsigned char[::1] verified=None, mapping=None,
                   unsigned char[::1] units=None):
    """A whole format-2 lookup in one call (csrc/groupdecode.h dbsp_gdec_lookup), the GIL released: the probed key
    ``hashes`` (uint64, any order, repeats allowed) tested against the Bloom filter ``bloom`` (``bloom_k`` bits), each
    one's group found among the file's groups (``first_hash``/``slot_of``/``nslots``/``msg_len``/``rows``, one entry
    a group), those groups read, checked and decoded as :func:`grouped_gather` does and their rows of those hashes
    gathered. ``advise``: a WILLNEED of every run of groups first (a cold file). ``verified`` (a flag a group, or
    None): set for each group whose key hashes a read checked ascending; a flagged group is not checked again
    (csrc/groupdecode.h). ``mapping``/``units``: read in place, as :func:`grouped_gather`. Returns ``(0, rows,
    columns, nulls, pages checked, groups read)`` or ``(status, group, page, what, errno)``, ``group`` the file's group number (-1:
    none)."""
    cdef Py_ssize_t ng = first_hash.shape[0], nc = kind.shape[0]
    cdef DbspGDec d
    cdef int st
    cdef int64_t m = hashes.shape[0]
    if slot_of.shape[0] != ng or nslots.shape[0] != ng or msg_len.shape[0] != ng or rows.shape[0] != ng:
        raise ValueError("grouped_lookup: the group arrays differ in length")
    if width.shape[0] != nc or nc == 0 or khcol < 0 or khcol >= nc:
        raise ValueError("grouped_lookup: kind and width differ in length, or no key hash column")
    if checked.shape[0] != page_crcs.shape[0]:
        raise ValueError("grouped_lookup: a checked flag a CRC page")
    if bloom.shape[0] == 0 and ng and m:
        raise ValueError("grouped_lookup: no Bloom filter")
    cdef int64_t[::1] var_bytes = numpy.zeros(nc, dtype=numpy.int64)
    cdef int64_t[::1] nulls = numpy.zeros(nc, dtype=numpy.int64)
    cdef const unsigned char[::1] mv = mapping
    _gdec_init(&d, fd, slot, arrow_end, page_crcs, checked, kind, width, khcol, var_bytes, nulls)
    _gdec_map(&d, mv, units)
    d.advise = 1 if advise else 0
    if verified is not None:
        if verified.shape[0] != ng:
            raise ValueError("grouped_lookup: a verified flag a group")
        if ng:
            d.verified = &verified[0]
    try:
        if ng and m:
            with nogil:
                st = dbsp_gdec_lookup(&d, &bloom[0], bloom.shape[0], bloom_k, ng, &first_hash[0], &slot_of[0],
                                      &nslots[0], &msg_len[0], &rows[0], &hashes[0], m)
        else:
            st = DBSP_GDEC_OK
        if st != DBSP_GDEC_OK:
            return (st, d.bad_group, d.bad_page, d.what.decode("utf-8", "replace"), d.err)
        cols = _gather_fill(&d, kind, width)
        return (0, d.nrows, cols, numpy.asarray(nulls), d.pages_checked, d.groups_read)
    finally:
        dbsp_gdec_free(&d)


cdef extern from *:
    """
    #include <errno.h>
    #include <sys/mman.h>
    #include <sys/syscall.h>
    #include <sys/uio.h>
    #include <unistd.h>

    /* Whether this kernel refused process_madvise on this process (before Linux 6.13 it takes only MADV_COLD and
     * MADV_PAGEOUT; or no such call): then every run is its own madvise. Set once, read racily (either is right). */
    static int dbsp_advise_one_by_one = 0;
    static long dbsp_advise_syscalls = 0;  /* system calls made by dbsp_advise_runs (advise_calls()) */

    /* madvise(advice) of runs[0..n) of this process, at most 1024 (UIO_MAXIOV) per system call: process_madvise(2)
     * on a pidfd of this process, so that the kernel takes the mmap lock, and flushes the TLBs of the process's other
     * threads' CPUs, once per call rather than once per run; a run the call did not reach (partial: an error) and
     * every run on a kernel that refuses it get a madvise of their own. Returns the runs advised. */
    static long dbsp_advise_runs(struct iovec *runs, long n, int advice) {
        long done = 0, i = 0, i0;
    #if defined(SYS_process_madvise) && defined(SYS_pidfd_open)
        if (n > 1 && !dbsp_advise_one_by_one) {
            int fd = (int)syscall(SYS_pidfd_open, getpid(), 0);
            if (fd >= 0) {
                while (i < n) {
                    long k = n - i < 1024 ? n - i : 1024, j = i;
                    long got = syscall(SYS_process_madvise, fd, runs + i, (size_t)k, advice, 0u);
                    __atomic_fetch_add(&dbsp_advise_syscalls, 1, __ATOMIC_RELAXED);
                    if (got < 0) {
                        if (errno == EINVAL || errno == ENOSYS || errno == EPERM) dbsp_advise_one_by_one = 1;
                        break;
                    }
                    /* the runs it advised whole: a call that failed on a run returns the bytes before it */
                    for (size_t left = (size_t)got; j < i + k && left >= runs[j].iov_len; j++) left -= runs[j].iov_len;
                    done += j - i;
                    if (j < i + k) {  /* stopped at run j: it and the rest, one by one */
                        i = j;
                        break;
                    }
                    i = j;
                }
                close(fd);
            }
        }
    #endif
        i0 = i;
        for (; i < n; i++)
            if (madvise(runs[i].iov_base, runs[i].iov_len, advice) == 0) done++;
        __atomic_fetch_add(&dbsp_advise_syscalls, n - i0, __ATOMIC_RELAXED);
        return done;
    }
    """
    long dbsp_advise_runs(iovec *runs, long n, int advice) nogil
    int dbsp_advise_one_by_one
    long dbsp_advise_syscalls


def advise_calls(one_by_one=None):
    """System calls :func:`advise_pages` made so far in this process; ``one_by_one`` True/False: from now on a
    madvise per run / up to 1024 runs a call where the kernel takes it (tests compare the two)."""
    global dbsp_advise_one_by_one
    if one_by_one is not None:
        dbsp_advise_one_by_one = 1 if one_by_one else 0
    return dbsp_advise_syscalls


def advise_pages(mapping, const int64_t[::1] first, const int64_t[::1] count, size_t page, int advice):
    """madvise(``advice``) runs of pages of ``mapping`` (an mmap: pages ``first[i]`` to ``first[i] + count[i]``, of
    ``page`` bytes, clipped to it), the GIL released: MADV_DONTNEED for the batch store's cache evictions,
    MADV_WILLNEED for its prefetch of the pages a step's keys will read (dbsp_core/trace/spill.py invariant 12: each
    call starts the reads of its run without waiting for them, so the runs' reads overlap). Up to 1024 runs go in
    one system call (``dbsp_advise_runs``: process_madvise, or a madvise per run where the kernel refuses it). The
    mapping stays exported, so open, for the call. Returns the runs advised."""
    cdef const unsigned char[::1] view = memoryview(mapping).cast("B")
    cdef size_t n = view.shape[0], lo, hi
    cdef Py_ssize_t i, runs = first.shape[0], done = 0, k = 0
    cdef char *base = <char *> &view[0] if n else NULL
    cdef iovec *iov
    if count.shape[0] != runs:
        raise ValueError("advise_pages: first and count differ in length")
    if page == 0:
        raise ValueError("advise_pages: a page of 0 bytes")
    if runs == 0:
        return 0
    iov = <iovec *> malloc(runs * sizeof(iovec))
    if iov == NULL:
        raise MemoryError("advise_pages: out of memory")
    try:
        with nogil:
            for i in range(runs):
                # in pages first, so that no product wraps (a wrapped start would drop a page at the mapping's start)
                if first[i] < 0 or count[i] <= 0 or n == 0 or <size_t> first[i] > (n - 1) / page:
                    continue  # (a last page the mapping holds part of is in it)
                lo = <size_t> first[i] * page
                hi = n if <size_t> count[i] >= (n - lo + page - 1) / page else lo + <size_t> count[i] * page
                iov[k].iov_base = base + lo
                iov[k].iov_len = hi - lo
                k += 1
            done = dbsp_advise_runs(iov, k, advice)
    finally:
        free(iov)
    return done


def crc32c_pages(data, size_t page, unsigned int[::1] out, unsigned int crc=0):
    """The CRC-32C of each ``page``-byte page of a bytes-like object into ``out`` (uint32, one per page, the last may
    be short), in one pass without the GIL; returns the CRC-32C of all of it continuing from ``crc``."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef const unsigned char *p = &view[0] if n else NULL
    if page == 0 or <size_t>out.shape[0] < (n + page - 1) // page:
        raise ValueError(f"crc32c_pages: {out.shape[0]} slots for {n} bytes in pages of {page}")
    with nogil:
        crc = dbsp_crc32c_pages(crc, p, n, page, &out[0] if out.shape[0] else NULL)
    return crc


def crc32c_combine(unsigned int crc_a, unsigned int crc_b, uint64_t len_b):
    """The CRC-32C of A + B from A's, B's and len(B)."""
    return dbsp_crc32c_combine(crc_a, crc_b, len_b)


def bloom_build(const uint64_t[::1] hashes, uint64_t[::1] words, int k):
    """Set the ``k`` bits of each key hash (ascending) in the blocked Bloom filter ``words`` (bloom.h), without the GIL;
    ValueError when the hashes do not ascend."""
    cdef size_t n = hashes.shape[0], nw = words.shape[0]
    cdef int st
    if nw == 0 or (nw & (nw - 1)):
        raise ValueError(f"bloom_build: {nw} words, not a power of two")
    with nogil:
        st = dbsp_bloom_build(&hashes[0] if n else NULL, n, &words[0], nw, k)
    if st:
        raise ValueError("bloom_build: key hashes must ascend")


def crc32c_portable(data, unsigned int crc=0):
    """The same CRC-32C by the portable slicing-by-8 code only (for tests against the hardware path)."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    return dbsp_crc32c_portable(crc, &view[0] if n else NULL, n)


def fault_new():
    """The name ("fault:N", a ``vfs`` argument) of a new fault VFS with a counter, arming and remembered writes of
    its own (vfs.c model 6); the functions below take it as ``vfs`` ("fault": the process-wide one)."""
    cdef DbspVfs *v = dbsp_vfs_fault_new()
    if v == NULL:
        raise MemoryError("fault_new: out of memory")
    name = f"fault:{len(_FAULT_VFSES) + 1}"
    _FAULT_VFSES[name] = <uintptr_t>v
    return name


def fault_arm(uint64_t crash_at=0, str mode="drop", uint64_t seed=0, uint64_t error_at=0, str error="EIO",
              str vfs="fault"):
    if mode not in CRASH_MODES:
        raise ValueError(f"unknown crash mode {mode!r}; expected one of {sorted(CRASH_MODES)}")
    errors = {"EIO": EIO, "ENOSPC": ENOSPC, "EOPNOTSUPP": EOPNOTSUPP}
    if error not in errors:
        raise ValueError(f"unknown error {error!r}; expected one of {sorted(errors)}")
    dbsp_vfs_fault_arm(pick_fault(vfs), crash_at, CRASH_MODES[mode], seed, error_at, errors[error])


def fault_ops(str vfs="fault"):
    return dbsp_vfs_fault_ops(pick_fault(vfs))


def fault_crashed(str vfs="fault"):
    return bool(dbsp_vfs_fault_crashed(pick_fault(vfs)))


def fault_crash_now(str mode="drop", uint64_t seed=0, str vfs="fault"):
    dbsp_vfs_fault_crash_now(pick_fault(vfs), CRASH_MODES[mode], seed)


cdef class PageStore:
    cdef DbspPageStore *ps
    cdef object txn
    cdef readonly str path

    def __cinit__(self, str path, str vfs="posix", size_t cache_pages=65536, create_version=None,
                  bint readonly=False):
        cdef bytes p = path.encode()
        cdef const char *cp = p
        cdef DbspVfs *v = pick_vfs(vfs)
        cdef int st
        cdef uint64_t cv = 0 if create_version is None else create_version
        cdef bint create = create_version is not None
        self.path = path
        with nogil:
            if create:
                st = dbsp_pagestore_create(cp, v, cv, cache_pages, &self.ps)
            elif readonly:
                st = dbsp_pagestore_open_readonly(cp, v, cache_pages, &self.ps)
            else:
                st = dbsp_pagestore_open(cp, v, cache_pages, &self.ps)
        check(st)

    def __dealloc__(self):
        if self.ps != NULL:
            dbsp_pagestore_close(self.ps)

    cdef int alive(self) except -1:
        if self.ps == NULL:
            raise StorageError(EIO, f"pagestore {self.path}: the database is closed")
        return 0

    def close(self):
        if self.txn is not None and (<Txn>self.txn).busy:
            raise StorageError(EIO, f"pagestore {self.path}: cannot close while another thread uses its handle")
        if self.txn is not None:
            (<Txn>self.txn).t = NULL  # dbsp_pagestore_close aborts it
            self.txn = None
        if self.ps != NULL:
            dbsp_pagestore_close(self.ps)
            self.ps = NULL

    @property
    def closed(self):
        return self.ps == NULL

    def versions(self):
        cdef uint64_t first, count
        self.alive()
        check(dbsp_pagestore_versions(self.ps, &first, &count))
        return first, count

    def check(self):
        cdef int st
        self.alive()
        with nogil:
            st = dbsp_pagestore_check(self.ps)
        check(st)

    def check_version(self, uint64_t version):
        cdef int st
        self.alive()
        with nogil:
            st = dbsp_pagestore_check_version(self.ps, version)
        check(st)

    def stats(self):
        cdef uint64_t pc, nf, lc, cp, dp
        self.alive()
        check(dbsp_pagestore_stats(self.ps, &pc, &nf, &lc, &cp, &dp))
        return pc, nf, lc, cp, dp

    def begin(self, uint64_t v, bint readonly=False):
        """A transaction writing v+1 from v (discarding the other version), or with ``readonly`` one reading v
        as it is (discarding nothing, refusing writes)."""
        cdef DbspTxn *t
        cdef int st
        self.alive()
        if self.txn is not None and (<Txn>self.txn).t != NULL:
            raise StorageError(EIO, f"pagestore {self.path}: a handle is already open")
        with nogil:
            if readonly:
                st = dbsp_pagestore_read(self.ps, v, &t)
            else:
                st = dbsp_pagestore_begin(self.ps, v, &t)
        check(st)
        tx = Txn.__new__(Txn)
        (<Txn>tx).t = t
        (<Txn>tx).store = self
        self.txn = tx
        return tx


cdef inline const unsigned char[::1] as_view(object b):
    return memoryview(b).cast("B") if not isinstance(b, bytes) else b


cdef class Txn:
    cdef DbspTxn *t
    cdef object store
    cdef readonly uint64_t generation
    cdef bint busy  # a call is running without the GIL: another thread must not touch the handle

    cdef int alive(self) except -1:
        if self.t == NULL:
            raise StorageError(EIO, "pagestore: the handle is closed (committed, closed, or its database closed)")
        if self.busy:
            raise StorageError(EIO, "pagestore: the handle is in use by another thread (handles are single-threaded)")
        return 0

    @property
    def closed(self):
        return self.t == NULL

    @property
    def version(self):
        self.alive()
        return dbsp_txn_version(self.t)

    def get(self, bytes table, bytes key):
        cdef const void *val
        cdef size_t vlen
        cdef int st
        cdef const char *tp = table
        cdef const char *kp = key
        cdef size_t tl = len(table), kl = len(key)
        self.alive()
        self.busy = True
        with nogil:
            st = dbsp_txn_get(self.t, tp, tl, kp, kl, &val, &vlen)
        self.busy = False
        if st == DBSP_ENOTFOUND:
            return None
        check(st)
        return PyBytes_FromStringAndSize(<const char *>val, vlen)

    def put(self, bytes table, bytes key, value):
        cdef const unsigned char[::1] v = as_view(value)
        cdef size_t vl = v.shape[0]
        cdef const void *vp = &v[0] if vl else NULL
        cdef const char *tp = table
        cdef const char *kp = key
        cdef size_t tl = len(table), kl = len(key)
        cdef int st
        self.alive()
        self.generation += 1
        self.busy = True
        with nogil:
            st = dbsp_txn_put(self.t, tp, tl, kp, kl, vp, vl)
        self.busy = False
        check(st)

    def delete(self, bytes table, bytes key):
        cdef int found = 0, st
        cdef const char *tp = table
        cdef const char *kp = key
        cdef size_t tl = len(table), kl = len(key)
        self.alive()
        self.generation += 1
        self.busy = True
        with nogil:
            st = dbsp_txn_delete(self.t, tp, tl, kp, kl, &found)
        self.busy = False
        check(st)
        return bool(found)

    def get_step(self):
        cdef int64_t s
        self.alive()
        check(dbsp_txn_get_step(self.t, &s))
        return s

    def set_step(self, int64_t step):
        self.alive()
        check(dbsp_txn_set_step(self.t, step))

    def commit(self):
        cdef int st
        cdef DbspTxn *t = self.t
        self.alive()
        self.t = NULL
        self.generation += 1
        self.busy = True
        with nogil:
            st = dbsp_txn_commit(t)
        self.busy = False
        check(st)

    def abort(self):
        if self.busy:
            raise StorageError(EIO, "pagestore: the handle is in use by another thread (handles are single-threaded)")
        if self.t != NULL:
            dbsp_txn_abort(self.t)
            self.t = NULL
            self.generation += 1

    def cursor(self, table, bytes start=None, bytes end=None):
        """Cursor over [start, end) of a table (bytes name), or of the catalog if table is None."""
        cdef DbspCursor *c
        cdef const char *tp = NULL
        cdef const char *sp = NULL
        cdef const char *ep = NULL
        cdef size_t tl = 0, sl = 0, el = 0
        self.alive()
        if table is not None:
            tp = <bytes>table
            tl = len(table)
        if start is not None:
            sp = start
            sl = len(start)
        if end is not None:
            ep = end
            el = len(end)
        check(dbsp_cursor_open(self.t, tp, tl, sp, sl, ep, el, &c))
        cur = Cursor.__new__(Cursor)
        (<Cursor>cur).c = c
        (<Cursor>cur).txn = self
        (<Cursor>cur).generation = self.generation
        return cur


cdef class Cursor:
    cdef DbspCursor *c
    cdef Txn txn
    cdef uint64_t generation

    def __dealloc__(self):
        if self.c != NULL:
            dbsp_cursor_close(self.c)

    def next_batch(self, size_t n=256):
        """Up to n (key, value) pairs; an empty list at the end."""
        cdef const void *k
        cdef const void *v
        cdef size_t kl, vl
        cdef int st
        out = []
        if self.c == NULL:
            return out
        if self.txn.t == NULL or self.txn.generation != self.generation:
            raise StorageError(EIO, "pagestore: the handle changed or closed during a scan")
        while len(out) < n:
            st = dbsp_cursor_next(self.c, &k, &kl, &v, &vl)
            if st == DBSP_ENOTFOUND:
                dbsp_cursor_close(self.c)
                self.c = NULL
                break
            check(st)
            out.append((PyBytes_FromStringAndSize(<const char *>k, kl), PyBytes_FromStringAndSize(<const char *>v, vl)))
        return out


cdef class Log:
    cdef DbspStepLog *log
    cdef readonly str path
    cdef readonly bint is_readonly
    cdef int active  # calls running without the GIL; close waits for none

    def __cinit__(self, str path, str vfs="posix", uint64_t segment_bytes=0, bint readonly=False,
                  bint log_file=True):
        cdef bytes p = path.encode()
        cdef const char *cp = p
        cdef DbspVfs *v = pick_vfs(vfs)
        cdef int st
        cdef int flags = (DBSP_STEPLOG_READONLY if readonly else 0) | (0 if log_file else DBSP_STEPLOG_NO_LOG_FILE)
        self.path = path
        self.is_readonly = readonly
        with nogil:
            st = dbsp_steplog_open(cp, v, segment_bytes, flags, &self.log)
        check(st)

    def __dealloc__(self):
        if self.log != NULL:
            dbsp_steplog_close(self.log)

    cdef int alive(self) except -1:
        if self.log == NULL:
            raise StorageError(EIO, f"steplog {self.path}: the log is closed")
        return 0

    def close(self):
        if self.active:
            raise StorageError(EIO, f"steplog {self.path}: cannot close while {self.active} calls are running")
        if self.log != NULL:
            dbsp_steplog_close(self.log)
            self.log = NULL

    @property
    def closed(self):
        return self.log == NULL

    def refresh(self):
        """A read-only log: read what the writer appended (and forget what it dropped) since the last scan."""
        cdef int st
        self.alive()
        self.active += 1
        with nogil:
            st = dbsp_steplog_refresh(self.log)
        self.active -= 1
        check(st)

    def append(self, int64_t step, bytes handle, bytes producer, uint64_t seq, payload):
        cdef const unsigned char[::1] v = as_view(payload)
        cdef size_t n = v.shape[0]
        cdef const void *vp = &v[0] if n else NULL
        cdef const char *hp = handle
        cdef const char *pp = producer
        cdef size_t hl = len(handle), pl = len(producer)
        cdef int st
        self.alive()
        self.active += 1
        with nogil:
            st = dbsp_steplog_append(self.log, step, hp, hl, pp, pl, seq, vp, n)
        self.active -= 1
        check(st)

    def enqueue(self, int64_t step, bytes handle, bytes producer, uint64_t seq, payload):
        """Buffer one record in log order without writing it; returns its ticket for :meth:`write` / :meth:`sync`.

        ``payload`` is one bytes-like object or a list of them, gathered back to back (never joined first)."""
        cdef list parts = list(payload) if isinstance(payload, (list, tuple)) else [payload]
        cdef Py_ssize_t n = len(parts), i
        cdef DbspSlice *sl = <DbspSlice *>malloc((n if n else 1) * sizeof(DbspSlice))
        cdef const unsigned char[::1] v
        cdef const char *hp = handle
        cdef const char *pp = producer
        cdef size_t hl = len(handle), pl = len(producer)
        cdef uint64_t ticket = 0
        cdef int st
        if sl == NULL:
            raise MemoryError("steplog: out of memory")
        views = []  # holds every part's buffer until the copy into the log's buffer is done
        try:
            for i in range(n):
                v = as_view(parts[i])
                views.append(v)
                sl[i].data = &v[0] if v.shape[0] else NULL
                sl[i].len = v.shape[0]
            self.alive()
            self.active += 1
            with nogil:
                st = dbsp_steplog_enqueuev(self.log, step, hp, hl, pp, pl, seq, sl, n, &ticket)
            self.active -= 1
            check(st)
        finally:
            free(sl)
        return ticket

    def write(self, uint64_t ticket):
        """Return once every record up to ``ticket`` is written (visible to readers), without an fsync."""
        cdef int st
        self.alive()
        self.active += 1
        with nogil:
            st = dbsp_steplog_write(self.log, ticket)
        self.active -= 1
        check(st)

    def sync(self, uint64_t ticket):
        """Return once every record up to ``ticket`` is durable."""
        cdef int st
        self.alive()
        self.active += 1
        with nogil:
            st = dbsp_steplog_sync(self.log, ticket)
        self.active -= 1
        check(st)

    def read(self, int64_t from_step, int64_t to_step, size_t max_bytes, uint64_t resume_seg, uint64_t resume_off):
        """(list of (step, handle, producer, seq, payload), resume_seg, resume_off)."""
        cdef unsigned char *buf = NULL
        cdef size_t blen = 0, pos = 0, body
        cdef int st
        cdef unsigned int hl, pl
        cdef unsigned char *b
        self.alive()
        self.active += 1
        with nogil:
            st = dbsp_steplog_read(self.log, from_step, to_step, max_bytes, &resume_seg, &resume_off, &buf, &blen)
        self.active -= 1
        check(st)
        out = []
        try:
            while pos < blen:
                b = buf + pos
                body = b[0] | (b[1] << 8) | (b[2] << 16) | (<size_t>b[3] << 24)
                b = b + 4
                hl = b[16] | (b[17] << 8)
                pl = b[18] | (b[19] << 8)
                out.append((
                    int.from_bytes(PyBytes_FromStringAndSize(<const char *>b, 8), "little", signed=True),
                    PyBytes_FromStringAndSize(<const char *>b + 24, hl),
                    PyBytes_FromStringAndSize(<const char *>b + 24 + hl, pl),
                    int.from_bytes(PyBytes_FromStringAndSize(<const char *>b + 8, 8), "little"),
                    PyBytes_FromStringAndSize(<const char *>b + 24 + hl + pl, body - 24 - hl - pl),
                ))
                pos += 4 + body
        finally:
            free(buf)
        return out, resume_seg, resume_off

    def truncate_below(self, int64_t step):
        cdef uint64_t dropped = 0
        cdef int st
        self.alive()
        self.active += 1
        with nogil:
            st = dbsp_steplog_truncate_below(self.log, step, &dropped)
        self.active -= 1
        check(st)
        return dropped

    def info(self):
        """(has_records, first_step, last_step, records, segments, fsyncs)."""
        cdef int has
        cdef int64_t first, last
        cdef uint64_t records, segments, fsyncs
        self.alive()
        check(dbsp_steplog_info(self.log, &has, &first, &last, &records, &segments, &fsyncs))
        return bool(has), first, last, records, segments, fsyncs

    def segments(self):
        """[(number, format, bytes, records, distinct steps, first step, last step)], oldest first."""
        cdef size_t count = 0, cap = 0, i
        cdef DbspStepLogSegment *segs = NULL
        self.alive()
        while True:
            check(dbsp_steplog_segments(self.log, segs, cap, &count))
            if count <= cap:
                break
            free(segs)
            cap = count + 4
            segs = <DbspStepLogSegment *>malloc(cap * sizeof(DbspStepLogSegment))
            if segs == NULL:
                raise MemoryError("steplog: out of memory")
        try:
            return [(segs[i].num, segs[i].format, segs[i].bytes, segs[i].records, segs[i].steps,
                     segs[i].first_step, segs[i].last_step) for i in range(count)]
        finally:
            free(segs)


STEPLOG_FORMAT = DBSP_STEPLOG_FORMAT
MAX_PAYLOAD = DBSP_STEPLOG_MAX_PAYLOAD  # the largest payload of one step-log record (bytes)

# ---- small files replaced atomically (csrc/smallfile.h) ----

def file_replace(str path, data, str vfs="posix"):
    """Make ``path`` durably hold ``data`` (temporary file, fsync, rename, fsync of the directory)."""
    cdef bytes p = path.encode()
    cdef const char *cp = p
    cdef const unsigned char[::1] view = as_view(data)
    cdef size_t n = view.shape[0]
    cdef const void *dp = &view[0] if n else NULL
    cdef DbspVfs *v = pick_vfs(vfs)
    cdef int st
    with nogil:
        st = dbsp_file_replace(v, cp, dp, n)
    check(st)


def file_read(str path, str vfs="posix"):
    """The bytes of ``path``, or None if it does not exist."""
    cdef bytes p = path.encode()
    cdef const char *cp = p
    cdef DbspVfs *v = pick_vfs(vfs)
    cdef unsigned char *buf = NULL
    cdef size_t n = 0
    cdef int st
    with nogil:
        st = dbsp_file_read(v, cp, &buf, &n)
    if st == DBSP_ENOTFOUND:
        return None
    check(st)
    try:
        return PyBytes_FromStringAndSize(<char *>buf, n)
    finally:
        free(buf)


def vfs_adopts(str vfs):
    """Whether the VFS ``vfs`` can take over a file written outside it and punch holes in it (FileWriter ``adopt``):
    a merge's scratch output then becomes its batch file in place (batchfile.py invariant 7)."""
    return pick_vfs(vfs).punch != NULL


def file_remove(str path, str vfs="posix"):
    """Durably remove ``path`` (unlink and fsync of its directory); a missing file is fine."""
    cdef bytes p = path.encode()
    cdef const char *cp = p
    cdef DbspVfs *v = pick_vfs(vfs)
    cdef int st
    with nogil:
        st = dbsp_file_remove(v, cp)
    check(st)


# ---- files streamed in pieces and put in place atomically (csrc/smallfile.h, invariant 3) ----

cdef class FileWriter:
    """``path`` written in pieces through the VFS ``vfs``: to ``path``.tmp (created or truncated), or with ``adopt``
    to that existing file (written outside the VFS, through a mapping, and never synced: csrc/smallfile.h), then put
    in place by :meth:`commit` (fsync, rename, fsync of the directory) or given up by :meth:`abort`. Every call is
    one VFS operation (the fault VFS counts and can crash each); the I/O runs without the GIL."""
    cdef DbspFileWriter *w
    cdef readonly str path

    def __cinit__(self, str path, str vfs="posix", str adopt=None):
        cdef bytes p = path.encode()
        cdef const char *cp = p
        cdef bytes t = (adopt or "").encode()
        cdef const char *tp = t
        cdef DbspVfs *v = pick_vfs(vfs)
        cdef int st
        self.path = path
        with nogil:
            if adopt is None:
                st = dbsp_file_writer_open(v, cp, &self.w)
            else:
                st = dbsp_file_writer_adopt(v, tp, cp, &self.w)
        check(st)

    def __dealloc__(self):
        if self.w != NULL:
            dbsp_file_writer_abort(self.w, 0)
            self.w = NULL

    @property
    def done(self):
        """Whether :meth:`commit` or :meth:`abort` was called (whatever it returned: the writer is gone)."""
        return self.w == NULL

    cdef int alive(self) except -1:
        if self.w == NULL:
            raise ValueError(f"file writer of {self.path} is committed or aborted")
        return 0

    def pwrite(self, data, uint64_t offset):
        """Write the bytes of ``data`` (any buffer) at ``offset`` of the temporary file."""
        self.alive()
        cdef const unsigned char[::1] view = as_view(data)
        cdef size_t n = view.shape[0]
        cdef const void *dp = &view[0] if n else NULL
        cdef int st
        with nogil:
            st = dbsp_file_writer_pwrite(self.w, dp, n, offset)
        check(st)

    def truncate(self, uint64_t size):
        """Set the temporary file's size."""
        self.alive()
        cdef int st
        with nogil:
            st = dbsp_file_writer_truncate(self.w, size)
        check(st)

    def punch(self, uint64_t offset, uint64_t length):
        """Punch a hole (the blocks given back, zeros read) in the temporary file; False (nothing done) when its
        file system cannot."""
        self.alive()
        cdef int st
        with nogil:
            st = dbsp_file_writer_punch(self.w, offset, length)
        if st == DBSP_ENOTSUP:
            return False
        check(st)
        return True

    def pread(self, size_t n, uint64_t offset):
        """Up to ``n`` bytes of the temporary file from ``offset`` (fewer only at its end)."""
        self.alive()
        cdef bytearray out = bytearray(n)
        cdef unsigned char[::1] view = out
        cdef size_t got = 0
        cdef int st
        with nogil:
            st = dbsp_file_writer_pread(self.w, &view[0] if n else NULL, n, offset, &got)
        check(st)
        del view
        if got < n:
            del out[got:]
        return out

    cdef int finish(self, bint commit, bint flag) except -1:
        """Commit (``flag``: sync) or abort (``flag``: unlink) the file; the writer is gone either way."""
        cdef DbspFileWriter *w = self.w
        cdef int st
        self.w = NULL
        with nogil:
            st = dbsp_file_writer_commit(w, flag) if commit else dbsp_file_writer_abort(w, flag)
        return check(st)

    def commit(self, bint sync=True):
        """Put the file in place: fsync it (``sync``), rename it over ``path``, fsync the directory (``sync``)."""
        self.alive()
        self.finish(True, sync)

    def abort(self, bint unlink=True):
        """Give the file up: close it and (``unlink``) remove the temporary file; a second call does nothing."""
        if self.w != NULL:
            self.finish(False, unlink)
include "spillread.pxi"
