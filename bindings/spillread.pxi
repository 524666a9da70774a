# spillread.pxi (included by storage.pyx): the batched Bloom tests and page accounting of a step's reads of spilled
# batches (csrc/spillread.h; dbsp_core/trace/spillread.py calls these).
from libc.stdint cimport int32_t, uint8_t
from posix.mman cimport MADV_DONTNEED, MADV_NORMAL, MADV_RANDOM

cdef extern from "spillread.h" nogil:
    ctypedef struct DbspSpan:
        int64_t kind, width, off, aoff, data
    size_t dbsp_bloom_probe(const uint64_t *words, size_t nwords, int k, const uint64_t *hashes, size_t m,
                            uint8_t *out)
    int dbsp_pages_read(const uint64_t *fence, int64_t nfence, int fence_shift, int64_t n, int64_t kh_off,
                        const uint64_t *hashes, int64_t m, const int64_t *rows, int64_t nrows,
                        const DbspSpan *spans, int64_t nspans, const uint8_t *base, int values,
                        uint64_t *bits, int64_t npages, int pageshift)
    int64_t dbsp_bits_list(const uint64_t *bits, int64_t npages, int64_t *out)
    int64_t dbsp_pages_stamp(int32_t *clock, const int64_t *pages, int64_t m, int32_t now)

import numpy as _np


def bloom_probe(filters, ks, const uint64_t[::1] hashes):
    """Per filter ``filters[i]`` (uint64 words, a power of two of them; ``ks[i]`` bits a key) and key hash: whether
    the filter may hold it. Returns a bool array (filters x hashes) and the count of each row (int64): one call for
    every spilled batch a step reads."""
    cdef Py_ssize_t nb = len(filters), m = hashes.shape[0], i
    out = _np.zeros((nb, m), dtype=_np.uint8)
    counts = _np.zeros(nb, dtype=_np.int64)
    cdef uint8_t[:, ::1] o = out
    cdef int64_t[::1] c = counts
    cdef const uint64_t[::1] w
    for i in range(nb):
        w = filters[i]
        nw = w.shape[0]
        if nw == 0 or (nw & (nw - 1)):
            raise ValueError(f"bloom_probe: {nw} words, not a power of two")
        if m:
            c[i] = dbsp_bloom_probe(&w[0], nw, ks[i], &hashes[0], m, &o[i, 0])
    return out.view(_np.bool_), counts


def pages_read(entries, int fence_shift, int pageshift):
    """The pages (sorted, unique, int64) each entry's read touches (spillread.h ``dbsp_pages_read``), None for an
    entry one of whose pages falls outside its mapping. An entry: (fence uint64, rows of the batch, key hashes' offset,
    hashes uint64, rows found int64 or None, spans int64 (n x 5: kind, width, off, aoff, data), the mapping's address,
    values, pages of the mapping). One call for every batch a step read."""
    cdef const uint64_t[::1] fence, hashes
    cdef const int64_t[::1] rows
    cdef const int64_t[:, ::1] spans
    cdef uint64_t[::1] bits
    cdef int64_t[::1] out
    cdef int64_t npages, nrows, cnt, nf, m
    cdef const int64_t *rp
    cdef const uint64_t *fp
    cdef const uint64_t *hp
    cdef const DbspSpan *sp
    cdef uintptr_t base
    res = []
    for fen, n, kh_off, hs, rws, sps, addr, values, npg in entries:
        fence, hashes, spans = fen, hs, sps
        if spans.shape[1] != 5:
            raise ValueError("pages_read: spans are n x 5")
        npages = npg
        nf, m = fence.shape[0], hashes.shape[0]
        fp = &fence[0] if nf else NULL
        hp = &hashes[0] if m else NULL
        sp = <const DbspSpan *>&spans[0, 0] if spans.shape[0] else NULL
        rp, nrows = NULL, 0
        if rws is not None:
            rows = rws
            nrows = rows.shape[0]
            rp = &rows[0] if nrows else <const int64_t *>&nrows  # (not NULL: found none)
        base = addr
        words = _np.zeros((npages + 63) // 64 or 1, dtype=_np.uint64)
        bits = words
        if dbsp_pages_read(fp, nf, fence_shift, n, kh_off, hp, m, rp, nrows, sp, spans.shape[0],
                           <const uint8_t *>base, 1 if values else 0, &bits[0], npages, pageshift):
            res.append(None)
            continue
        pages = _np.empty(dbsp_bits_list(&bits[0], npages, NULL), dtype=_np.int64)
        out = pages
        if pages.shape[0]:
            dbsp_bits_list(&bits[0], npages, &out[0])
        res.append(pages)
    return res


def pages_stamp(int32_t[::1] clock, const int64_t[::1] pages, int32_t now):
    """Stamp ``clock[pages] = now``; returns how many of those pages had clock 0 (spill.py's cache misses)."""
    cdef Py_ssize_t i, m = pages.shape[0], nc = clock.shape[0]
    for i in range(m):
        if pages[i] < 0 or pages[i] >= nc:
            raise IndexError(f"pages_stamp: page {pages[i]} of a clock of {nc}")
    return dbsp_pages_stamp(&clock[0] if nc else NULL, &pages[0] if m else NULL, m, now)



def evict_mappings(entries, size_t page, bint recency):
    """The cache's evictions of one enforce (dbsp_core/trace/spill.py ``_evict``) in one call: per entry ``(mapping,
    pages)`` madvise(MADV_DONTNEED) of the runs of adjacent pages of ``pages`` (sorted, unique page numbers of
    ``page`` bytes, clipped to the mapping as :func:`advise_pages`; None: the whole mapping) of ``mapping`` (an mmap);
    every entry's runs go to the kernel together, up to 1024 a system call (``dbsp_advise_runs``: one mmap lock and TLB
    flush a call, instead of a madvise or three and as many Python calls a file). With ``recency`` each mapping is
    MADV_NORMAL for the drop and MADV_RANDOM after it (spill.py ``_recency``: a madvise each, which flush nothing). A
    closed mapping (its batch gone) is skipped. The mappings stay exported, so open, for the call. Returns the system
    calls that dropped pages (as ``advise_calls``; the recency's are not counted)."""
    cdef list views = []
    cdef const unsigned char[::1] view
    cdef const int64_t[::1] pages
    cdef size_t n, lo, hi
    cdef Py_ssize_t i, j, k = 0, total = 0, nmaps, np_
    cdef int64_t p0, p1
    cdef long before = dbsp_advise_syscalls
    cdef iovec *iov
    cdef iovec *whole
    cdef char *base
    for m, pg in entries:
        try:
            view = memoryview(m).cast("B")
        except (ValueError, TypeError):  # closed: its batch is gone
            continue
        if view.shape[0] == 0:
            continue
        if pg is None:
            total += 1
        else:
            pages = pg
            total += pages.shape[0]
        views.append((view, pg))
    nmaps = len(views)
    if nmaps == 0:
        return 0
    iov = <iovec *> malloc((total + nmaps) * sizeof(iovec))
    if iov == NULL:
        raise MemoryError("evict_mappings: out of memory")
    whole = iov + total
    try:
        for j in range(nmaps):
            view, pg = views[j]
            n = view.shape[0]
            base = <char *> &view[0]
            whole[j].iov_base = base
            whole[j].iov_len = n
            if pg is None:
                iov[k].iov_base = base
                iov[k].iov_len = n
                k += 1
                continue
            pages = pg
            np_ = pages.shape[0]
            i = 0
            while i < np_:
                p0 = pages[i]
                p1 = p0
                while i + 1 < np_ and pages[i + 1] == p1 + 1:
                    i += 1
                    p1 += 1
                i += 1
                if p0 < 0 or <size_t> p0 > (n - 1) / page:
                    continue  # (a last page the mapping holds part of is in it)
                lo = <size_t> p0 * page
                hi = n if <size_t> (p1 - p0 + 1) >= (n - lo + page - 1) / page else lo + <size_t> (p1 - p0 + 1) * page
                iov[k].iov_base = base + lo
                iov[k].iov_len = hi - lo
                k += 1
        with nogil:
            if recency:
                for j in range(nmaps):
                    madvise(whole[j].iov_base, whole[j].iov_len, MADV_NORMAL)
            if k:
                dbsp_advise_runs(iov, k, MADV_DONTNEED)
            if recency:
                for j in range(nmaps):
                    madvise(whole[j].iov_base, whole[j].iov_len, MADV_RANDOM)
    finally:
        free(iov)
    return dbsp_advise_syscalls - before
