"""_storage.advise_pages with MADV_DONTNEED (the spill cache's eviction, dbsp_core/trace/spill.py invariant 12) drops only pages inside the mapping it is given, whatever page numbers it is handed."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from dbsp_core._storage import advise_pages

PAGE = mmap.PAGESIZE


def drop_pages(m: mmap.mmap, first: np.ndarray, count: np.ndarray, page: int) -> int:
    return advise_pages(m, first, count, page, mmap.MADV_DONTNEED)


def _private(pages: int) -> mmap.mmap:
    """A private anonymous mapping whose every page holds its number: a dropped page reads back as zeros."""
    m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE)
    for p in range(pages):
        m[p * PAGE:p * PAGE + 8] = (p + 1).to_bytes(8, "little")
    return m


def _kept(m: mmap.mmap, pages: int) -> list[int]:
    return [p for p in range(pages) if m[p * PAGE:p * PAGE + 8] == (p + 1).to_bytes(8, "little")]


@pytest.mark.parametrize("first, count", [
    (2**52, 1),           # first * page wraps to byte 0: page 0 was dropped
    (2**52 + 1, 1),       # ... to byte PAGE: page 1
    (1, 2**52),           # count * page wraps: the run's end below its start
    (1, 2**62),
    (-1, 2), (0, 0), (0, -3),
    (4, 1), (2**40, 2**40),
])
def test_out_of_range_runs_drop_nothing(first: int, count: int) -> None:
    m = _private(4)
    done = drop_pages(m, np.array([first], np.int64), np.array([count], np.int64), PAGE)
    if count > 2**40 and 0 <= first < 4:  # a run from inside the mapping is clipped to its end
        assert done == 1 and _kept(m, 4) == list(range(first)), _kept(m, 4)
    else:
        assert done == 0 and _kept(m, 4) == [0, 1, 2, 3], _kept(m, 4)


def test_runs_inside_are_dropped_and_clipped() -> None:
    m = _private(6)
    done = drop_pages(m, np.array([1, 4], np.int64), np.array([2, 10], np.int64), PAGE)
    assert done == 2 and _kept(m, 6) == [0, 3]


def test_the_last_page_a_mapping_holds_part_of_is_dropped() -> None:
    """A batch file's size is rarely a multiple of the page: its last page is one of the cache's (os_pages)."""
    m = mmap.mmap(-1, 2 * PAGE + 100, flags=mmap.MAP_PRIVATE)
    m[2 * PAGE:2 * PAGE + 3] = b"abc"
    assert drop_pages(m, np.array([3], np.int64), np.array([1], np.int64), PAGE) == 0  # past its end
    assert m[2 * PAGE:2 * PAGE + 3] == b"abc"
    assert drop_pages(m, np.array([2], np.int64), np.array([1], np.int64), PAGE) == 1
    assert m[2 * PAGE:2 * PAGE + 3] == b"\0\0\0"


def test_many_runs_go_in_few_system_calls_and_drop_exactly_their_pages() -> None:
    """An eviction of a 10M-row join step is ~4,300 runs of pages: a madvise each took 13 ms of a 29 ms step. Up to
    1024 runs now go in one process_madvise call (where the kernel takes MADV_DONTNEED through it: Linux 6.13 on),
    and drop exactly the pages a madvise per run drops; on an older kernel every run still gets its own call."""
    from dbsp_core._storage import advise_calls

    pages = 6000
    first = np.arange(0, pages, 2, dtype=np.int64)  # every other page: 3000 runs of one page
    first[-1] = pages - 3  # and one run of three at the end
    count = np.ones(len(first), dtype=np.int64)
    count[-1] = 3
    want = sorted(set(range(pages)) - {p for f, c in zip(first, count) for p in range(f, f + c)})
    kept, calls = [], []
    try:
        for one_by_one in (True, False):
            advise_calls(one_by_one=one_by_one)
            m = _private(pages)
            before = advise_calls()
            assert drop_pages(m, first, count, PAGE) == len(first)
            calls.append(advise_calls() - before)
            kept.append(_kept(m, pages))
    finally:
        advise_calls(one_by_one=False)
    assert kept[0] == want and kept[1] == want
    assert calls[0] == len(first)
    if not _kernel_batches_dontneed():  # before Linux 6.13: one call per run, as before
        pytest.skip("process_madvise(MADV_DONTNEED) on this process is refused by this kernel")
    assert calls[1] <= -(-len(first) // 1024), calls


def _kernel_batches_dontneed() -> bool:
    """Whether this kernel takes process_madvise(MADV_DONTNEED) on this process (asked directly, not through the
    code under test): pidfd_open and process_madvise are system calls 434 and 440 on every architecture."""
    import ctypes
    import os

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    m = _private(2)
    buf = (ctypes.c_char * (2 * PAGE)).from_buffer(m)
    fd = libc.syscall(ctypes.c_long(434), ctypes.c_long(os.getpid()), ctypes.c_long(0))
    if fd < 0:
        return False
    try:
        iov = (IoVec * 2)((ctypes.addressof(buf), PAGE), (ctypes.addressof(buf) + PAGE, PAGE))
        got = libc.syscall(ctypes.c_long(440), ctypes.c_long(fd), iov, ctypes.c_size_t(2),
                           ctypes.c_int(mmap.MADV_DONTNEED), ctypes.c_uint(0))
    finally:
        os.close(fd)
        del buf
    return got == 2 * PAGE
