"""What a step's reads of spilled batches cost the Python side, batched over the batches (csrc/spillread.h).

A 1k-row step over a spilled trace asks every spilled batch's Bloom filter for the step's key hashes, and the store's
cache accounts the pages each read touched (spill.py invariant 12: ``BatchStore._trim_cache``). Done per batch in
numpy (batchfile.py ``bloom_may_contain``, ``BatchFile._pages_read``) each cost ~50-100 us of Python a batch read,
where the work is a few us: a distinct of 3M rows under 16 MiB reading 17 spilled batches a step spent 2.62 ms CPU a
step against 1.22 with 9 (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-open (c)). Here:

- :func:`may_contain` tests the key hashes against the filters of all of a read's spilled batches in one C call
  (a bool row per batch, bit for bit ``bloom_may_contain``);
- :func:`pages_used` locates the pages of all the batches a step read in one C call: per read a bitmap of the
  mapping's pages, marked from the fence (a binary search per hash) and per-batch byte spans of each buffer
  (:func:`spans_of`, located once per batch and kept by the store), listed ascending: the same pages as
  ``BatchFile.pages_read``, which stays the reference.

``NATIVE`` (``DBSP_SPILL_NATIVE``, dbsp_core/envvars.py) is the one switch between these native paths and the
reference ones, for the whole spilled read and write path: with it False, the filters are tested and the pages
located per batch in numpy, the clock stamped in numpy, the evictions made by spill.py ``_evict`` (a file at a time),
``Trace.narrowed`` takes a batch at a time, and batchfile.py builds filters and combines CRCs in numpy/Python.
Tests compare the two (monkeypatch ``spillread.NATIVE``); results, files and counts are the same either way.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.envvars import settings
from dbsp_core.zset import FENCE_STEP

NATIVE = settings().spill_native  # the native paths (False: the reference ones; tests compare the two)

FIXED, BITS, VAR = 0, 1, 2  # csrc/spillread.h DBSP_SPAN_*
_FENCE_SHIFT = FENCE_STEP.bit_length() - 1
_PAGE_SHIFT = mmap.PAGESIZE.bit_length() - 1
assert 1 << _FENCE_SHIFT == FENCE_STEP and 1 << _PAGE_SHIFT == mmap.PAGESIZE


def may_contain(files: list[Any], hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per BatchFile of ``files`` (a row each) and key hash: whether its Bloom filter may hold the hash, and the count
    per file: one C call for every file (``BatchFile.may_contain`` each, with ``NATIVE`` False)."""
    hashes = np.ascontiguousarray(hashes, dtype=np.uint64)
    if not NATIVE:
        keep = np.array([f.may_contain(hashes) for f in files], dtype=bool).reshape(len(files), len(hashes))
        return keep, keep.sum(axis=1).astype(np.int64)
    from dbsp_core import _storage

    return _storage.bloom_probe([f.bloom for f in files], [f.bloom_k for f in files], hashes)


def spans_of(batch: Any, base: int, row_hashes: bool = True) -> np.ndarray | None:
    """The byte spans (n x 5 int64: kind, width, offset from ``base``, array offset, values' offset) of ``batch``'s
    weights, key hashes, row hashes (with ``row_hashes``) and columns (validity bits; values, booleans' bits, or a
    variable-width column's offsets and values): batchfile.py ``_row_ranges`` / ``_fixed_ranges`` as data, so a read's
    ranges are computed in C. None for a column of a type not located (the caller counts the whole file)."""
    out = []
    for a in (batch.zset.weights, batch.key_hash, batch._rh if row_hashes else None):
        if a is not None:
            out.append((FIXED, a.itemsize, a.ctypes.data - base, 0, 0))
    for col in batch.zset.data.columns:
        if col.num_chunks != 1:
            return None
        arr = col.chunk(0)
        t, bufs, off = arr.type, arr.buffers(), arr.offset
        if bufs[0] is not None:
            out.append((BITS, 0, bufs[0].address - base, off, 0))
        if pa.types.is_boolean(t):
            out.append((BITS, 0, bufs[1].address - base, off, 0))
        elif len(bufs) == 2 and pa.types.is_primitive(t) and t.bit_width % 8 == 0:
            out.append((FIXED, t.bit_width // 8, bufs[1].address - base, off, 0))
        elif len(bufs) == 3 and (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
                                 or pa.types.is_large_binary(t)):
            w = 8 if (pa.types.is_large_string(t) or pa.types.is_large_binary(t)) else 4
            out.append((VAR, w, bufs[1].address - base, off, bufs[2].address - base))
        else:
            return None
    return np.array(out, dtype=np.int64).reshape(-1, 5)


def _spans(cache: dict | None, b: Any, f: Any, row_hashes: bool) -> np.ndarray | None:
    """:func:`spans_of` ``b`` (read from ``f``), kept in ``cache`` (by ``id(b)``, the store's: dropped with the batch)
    while ``b`` reads the same buffers (a batch switched to its file in place gets new ones)."""
    if cache is None:
        return spans_of(b, f.base, row_hashes)
    stamp = (id(b._z), b.key_hash.ctypes.data, f.base, row_hashes)
    got = cache.get((id(b), row_hashes))
    if got is not None and got[0] == stamp:
        return got[1]
    s = spans_of(b, f.base, row_hashes)
    cache[(id(b), row_hashes)] = (stamp, s)
    return s


def pages_used(reads: list[tuple[Any, Any, np.ndarray | None, np.ndarray | None]], cache: dict | None = None,
               values: bool = True, row_hashes: bool = True) -> list[np.ndarray | None]:
    """Per read ``(b, f, hashes, rows)`` (a seek of key ``hashes`` in batch ``b`` read from BatchFile ``f``, then of
    the rows found, ``rows``; None: the rows the fence places each hash among): the pages of ``f``'s mapping it
    touches (sorted, unique), as ``f.pages_read(b, hashes, rows, values, row_hashes)``, or None where that is None (no
    fence, a type not located: the caller counts the whole file). The reads' pages are located in one C call."""
    out: list[np.ndarray | None] = [None] * len(reads)
    entries, where = [], []
    for i, (b, f, hashes, rows) in enumerate(reads):
        n = len(b.key_hash)
        if b._fx is None or n == 0:
            continue
        if not NATIVE:
            out[i] = f.pages_read(b, np.sort(np.asarray(hashes, dtype=np.uint64)), rows, values, row_hashes)
            continue
        spans = _spans(cache, b, f, row_hashes)
        if spans is None:
            continue
        entries.append((np.ascontiguousarray(f.fence, dtype=np.uint64), n, b.key_hash.ctypes.data - f.base,
                        np.ascontiguousarray(hashes, dtype=np.uint64),
                        None if rows is None else np.ascontiguousarray(rows, dtype=np.int64), spans, f.base, values,
                        f.os_pages()))
        where.append(i)
    if entries:
        from dbsp_core import _storage

        for i, pages in zip(where, _storage.pages_read(entries, _FENCE_SHIFT, _PAGE_SHIFT)):
            if pages is None:  # a page outside the mapping: the numpy path, whatever it makes of it
                b, f, hashes, rows = reads[i]
                pages = f.pages_read(b, np.sort(np.asarray(hashes, dtype=np.uint64)), rows, values, row_hashes)
            out[i] = pages
    return out


def evict(runs: list[tuple[mmap.mmap, np.ndarray | None]], recency: bool) -> int:
    """Drop from the process the pages of an enforce's evictions (per entry a file's mapping and its pages, sorted
    page numbers, or None: the whole mapping; a mapping evicted whole is not also evicted by runs; several entries of
    one mapping are dropped together), a madvise(MADV_DONTNEED) per run of adjacent pages, in one C call whose runs
    go to the kernel up to 1024 a system call (``_storage.evict_mappings``); with ``recency`` each mapping is
    MADV_NORMAL for the drop (spill.py ``_recency``). spill.py ``_evict`` (a madvise or three and ~10 Python calls a
    file: a join step over 25 spilled batches evicted 17 files whole a step) stays the reference (``NATIVE`` False).
    Returns the system calls that dropped pages."""
    whole = {id(m): m for m, pages in runs if pages is None}  # each mapping once (several reads of it evicted)
    parts: dict[int, list] = {}
    for m, pages in runs:
        if pages is not None and id(m) not in whole:
            parts.setdefault(id(m), [m]).append(pages)
    entries: list[tuple[Any, np.ndarray | None]] = [(m, None) for m in whole.values()]
    for m, *ps in parts.values():
        p = ps[0] if len(ps) == 1 else np.unique(np.concatenate(ps))
        entries.append((m, np.ascontiguousarray(p, dtype=np.int64)))
    if not entries:
        return 0
    from dbsp_core import _storage

    return _storage.evict_mappings(entries, mmap.PAGESIZE, recency)


def stamp(clock: np.ndarray, pages: np.ndarray, now: int) -> int:
    """``clock[pages] = now``; returns how many of ``pages`` had clock 0 (the cache's misses)."""
    if NATIVE:
        from dbsp_core import _storage

        return _storage.pages_stamp(clock, np.ascontiguousarray(pages, dtype=np.int64), now)
    new = int(np.count_nonzero(clock[pages] == 0))
    clock[pages] = now
    return new
