"""The batch file: one trace batch written once to an immutable, checksummed file whose columns are an Arrow IPC file
that is memory-mapped and read in place, with a Bloom filter and a fence of its key hashes for lookups.

Format (version 1, ``BATCH_FILE_MAGIC``; listed in dbsp_core/storage/formats.py), all integers little-endian::

    [0, 64)          header: magic "DBSPBTCH" (8) | format version u32 | flags u32 | arrow offset u64 (= 64) |
                     arrow length u64 | rows u64 | CRC-32C of the page-CRC section u32 | CRC-32C of the fence and
                     filter sections u32 | 12 bytes zero | CRC-32C of bytes 0..59 u32. Flags bit 0
                     (``FLAG_SECTION_CRCS``): the two section CRCs are set (files written before it have flags 0 and
                     zeros there: they are checked whole when opened lazily)
    [64, 64 + A)     an Arrow IPC file (starts and ends with ``ARROW1``), byte for byte what any Arrow reader reads:
                     one record batch of the batch's data columns in index order, then ``__dbsp_weight`` (int64),
                     ``__dbsp_key_hash`` (uint64, ascending) and, when the batch keeps row hashes apart from its
                     key hashes, ``__dbsp_row_hash`` (uint64); schema metadata ``dbsp.key`` (JSON list of key
                     columns) and ``dbsp.row_hash`` ("0", "1": a column, "key": the key hashes are the row hashes).
                     No compression: every buffer is 8-byte aligned and read in place through mmap(2) or pread(2).
                     The body's buffers follow one another, or, in a file made in place from a merge's scratch file
                     (invariant 7), lie where the merge wrote them, page-aligned, with room between them (the
                     metadata's buffer offsets say where; any Arrow reader reads it so)
    [.., +8F)        fence: every 64th key hash (csrc/lookup.h's fence), so a seek needs no scan of the key hashes
    [.., +8B)        Bloom filter: B u64 words (a power of two), blocked: K bits in one word per key hash
                     (``bloom_build``)
    [.., +4P)        CRC-32C of each ``PAGE``-byte page of the Arrow file (the last page may be short)
    [EOF-64, EOF)    footer: magic "DBSPBTFT" | version u32 | K u32 | fence offset u64 | F u64 | bloom offset u64 |
                     B u64 | page-CRC offset u64 | CRC-32C of bytes [0, EOF-64) u32 | CRC-32C of footer bytes 0..55 u32

Format version 2 (``BATCH_FILE_GROUPED_VERSION``, formats.py): **written and read by dbsp_core/trace/groupedfile.py
(byte by byte there; branch r31-grouped), and by the spill store under ``DBSP_SPILL_GROUPED``** (off by default:
spill.py invariant 18, branch r31-wire2; :func:`open_batch`, the mapped reader, refuses a version-2 file with
FormatVersionError naming ``groupedfile.open_grouped``; ``groupedfile.verify`` checks either version, and ``dbsp
inspect`` calls it).
Row groups, so that
a key's rows lie in one small span of the file instead of one place in each column buffer. What it is for, measured
first (bench/probe_groups.py, bench/history/RESULTS-2026-11-28-to-2026-12-02.md "Row-grouped batch files, measured before building"): a 1k-row step's
seeks read 5.1-6.2 pages of 4 KiB a key sought (the key hashes 1.2, the weights 1, the row hashes 1, each column 1),
in as many 2 MiB units of the file; the layout below reads one. Changes against version 1:

    header           version 2; flags bit 1 (``FLAG_GROUPED``); in the 12 reserved bytes: the slot size G (u32, a
                     power of two, 4096 by default) and the number of groups (u64)
    [64, 64 + A)     an Arrow IPC file of the same schema holding one record batch per row group, in index order. A
                     group is a run of whole keys (a key's rows are never split between groups) whose record-batch
                     block (message metadata and body, buffers 8-byte aligned) fits one G-byte slot aligned to G in
                     the file; a key whose rows alone do not fit takes a run of slots, alone. Each block starts on a
                     slot boundary (the Arrow footer's blocks say where; the gap to the next slot is zeros, which any
                     Arrow reader skips, as it skips invariant 7's room between buffers)
    [.., +24N)       the group index, in place of version 1's fence (the footer's fence offset and count name it):
                     per group its first key hash u64, first row u64, first slot u32 and slots u32
    Bloom filter and footer as version 1; page CRCs one a slot (as built: groupedfile.py, where this design's one
    a ``PAGE`` made a group's first read check 64 KiB).

G is 4 KiB because the measure says so: with G = 16 KiB a key's rows still lie in ~3.9 pages and with 64 KiB in
4.9-6.0 (each buffer's share of a group is a page or more), the same as version 1; only 2 MiB units are saved by
those. The cost: a record batch's metadata is ~250-350 bytes for 3-5 columns, ~8% of a 4 KiB slot, and the Arrow
footer 24 bytes a group (a file of 100M rows of 40 bytes: ~1M groups, a generic Arrow reader sees that many chunks).

Readers (designed):
  - A version-1 file is one group: the fence, the whole record batch, read as today.
  - The 1k-row lookup path (spill.py's seeks and cache accounting, levels.py ``narrowed``, the C kernels behind
    ``lookup`` / ``key_sums`` / the join's walk, csrc/lookup.h): Bloom filter, then the group index (binary search of
    the in-memory first key hashes, as the fence) gives the groups a step's keys lie in; each is read by one pread(2)
    of its slots (adjacent groups in one call) into a scratch buffer of the step. The touched groups, concatenated in
    order, are a consolidated batch in index order (whole keys, ascending key hashes), so the kernels of csrc/lookup.h
    run on it unchanged; a caller that needs the file's row numbers adds each group's first row. No mapping, no
    fault, nothing to drop after the step: the page cache is the cache, the budget counts the scratch (the store's
    per-page cache accounting and mapped bound, spill.py invariants 12 and 15, have nothing to count for such a
    file). A lazily opened file's slot is checked the first time its CRC page is read (invariant 5: that read takes
    the whole ``PAGE`` bytes once, then the page is marked checked).
  - Whole reads (a merge's or compaction's input, a scan, ``check_all``, :func:`verify`, ``dbsp inspect``): the
    groups in order. The merge kernels (csrc merge, bindings/merge.pxi) take an input as a chain of segments (a
    cursor that steps to the next group's buffers); a reader that needs one contiguous batch (verify, inspect)
    concatenates (a copy, bounded by the file).
  - Writers: :func:`write_batch` cuts the groups at key boundaries and writes each record batch at its slot (the
    Arrow footer's block offsets are the slots: written by this module, not pyarrow's writer, which places blocks back
    to back). A merge output built on disk (invariant 7) would have to be written in groups by the merge itself (its
    output cursor cutting a group when the slot fills): the compacted files a big state's steps read are merge
    outputs, so version 2 for the spill writer alone would leave the measured states' hot files in version 1.
  - Switch: ``DBSP_BATCH_GROUPS`` (envvars.py; 0 = version 1, the default until measured, or G) - not added, as
    nothing reads it yet.

What it would buy (measured by replaying 1k-row steps' reads on the store's own files, bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-groups): through the mapping,
the 2 MiB units a step faults fall only where a step's keys are fewer than the units its pages lie in: the same at
10M rows (186 -> 189 for a join; faults and drops 0.3-0.5 ms of a 5-7 ms step either way), -16 to -22% at 30M, -56%
at 100M (1,771 -> 784; the replay's faults and drops 9-30 -> 2.7-7.8 ms); by one pread of a group a key, 0.9-1.3 ms a step at 10M and 30M and 2.9-5.7 at 100M (no
mapping, no fault, no drop), against the mapping's 0.35-0.48, 1.1-1.6 and 9-30 ms: the read that makes the step flat.

Invariants (enforced here; checked by :func:`verify`):
  1. A batch file is written whole to ``<name>.tmp``, fsynced, renamed to its name and its directory fsynced;
     after that it never changes. A file under its final name is therefore complete, and its name can be handed to
     a checkpoint or an upload as is. The write path (:func:`write_batch`), one for every VFS: the file is streamed
     through csrc/smallfile.c's writer (``_storage.FileWriter``), each step one operation of the VFS the store
     names: open and truncate ``<name>.tmp``; the Arrow file in pieces of at most ``STREAM_CHUNK`` bytes (its small
     writes gathered up to ``GATHER``), the page CRCs computed as the pieces go; the fence, filter and page-CRC
     sections in one write and the header in another; the footer, its whole-file CRC combined from the CRCs of
     the parts as they were written (never read back); fsync, rename, fsync of the directory. So no copy of the batch is in
     memory while it is written (a spilled merge output may be gigabytes), and the fault-injecting VFS of the
     crash tests sees, and can crash or fail, exactly the operations production makes. A scratch file (a store
     without storage: no crash needs it) takes the same path without the two fsyncs.
  2. Its rows are a consolidated batch in index order (trace invariant 1): key hashes ascending, so the fence and
     a key hash locate the rows of a key, and the rows of a shard are one range (trace invariant 7).
  3. The Bloom filter holds every key hash of the batch: a key hash it rejects has no row, so a lookup skips the
     batch without touching a page of it.
  4. Every byte is covered by a checksum: header and footer by their own, each Arrow page by its page CRC, the
     page-CRC section and the fence and filter sections by the header's section CRCs, the whole file by the
     footer's. :func:`open_batch` checks header, footer, the page CRCs and the Arrow pages holding its schema and
     footer, and then, by how it is asked:
     - default (a file this process just wrote): the fence and filter, which it copies into memory;
     - ``verify=True`` (a file checked once for all: ``dbsp inspect``, a file a store without lazy checks reads):
       every page and the whole-file CRC;
     - ``lazy=True`` (a file a checkpoint names, opened by ``Pipeline.open``: invariant 5): nothing more.
  5. A lazily opened file reads metadata, not rows: header, footer, page CRCs (4 bytes per 64 KiB) and two
     Arrow pages; its fence and filter are read in place from the mapping. Its :attr:`BatchFile.checked` records
     what has been checked (a flag per Arrow page, then one for the fence and filter), and no byte of it is used
     before it is checked: the reader (the batch store, dbsp_core/trace/spill.py invariant 14) calls
     :meth:`BatchFile.check_sections` before the fence or filter is used, :meth:`BatchFile.check_seek` and
     :meth:`BatchFile.check_rows` around a lookup of some keys (the pages a fenced seek and the rows found touch),
     and :meth:`BatchFile.check_all` before any other read. A page that fails raises CorruptionError naming the
     file and the page: a damaged file is never read as data. The filter a file this process wrote kept in memory
     may be let go (:meth:`BatchFile.release_filter`: the batch store does so when it switches a batch to its file,
     spill.py invariant 16): the first probe after (:attr:`BatchFile.bloom`) copies it back from the mapping, the
     fence and filter checked against their section CRC first as here, so a trace whose filters no read probes
     holds none of them.
  6. A big write's pieces (invariant 1) end at multiples of ``FOLIO_ALIGN`` (2 MiB) of the file, whatever the Arrow
     file's offset (64) and the buffer's place in it: a write that covers an aligned 2 MiB of the file whole lets
     the page cache hold it as one folio (Linux's large folios, ext4 from 6.16, xfs), which the mapping maps with one
     PMD entry at a read fault and unmaps as one at an eviction (dbsp_core/trace/spill.py invariant 12), where pieces
     from offset 64 left about half of each file in smaller folios, mapped and unmapped a page-table entry per 4 KiB.
     The bytes written are the same; only the cuts between the VFS's pwrites move. A file made in place from a
     merge's scratch file (invariant 7), whose rows the merge wrote through a shared mapping, gets 2 MiB folios from
     that mapping's MADV_HUGEPAGE (bindings/merge.pxi ``HUGE_SCRATCH``): without it the page cache took those writes
     in a mix of small folios, and every compacted state's steps faulted 64 KiB at a time. A piece read from a mapping whose
     pages were dropped (a merge built on disk, ``drop``) is mapped first (:func:`_touch`): the kernel's copy from
     pages not mapped comes up short and it retries in smaller folios.
  7. A merge output built on disk becomes its batch file in place (:func:`write_in_place`, spill.py ``IN_PLACE``):
     the merge wrote its columns into a scratch file (``merge-*.tmp`` in the store's directory, named until its
     mapping goes) from :func:`in_place_room` bytes on; the Arrow IPC writer is run over the batch to a sink that
     records its metadata and the addresses of the buffers it hands over in place (nothing of the rows is copied),
     the record batch's buffer offsets and body length are moved to where the merge put each buffer (the flatbuffer
     fields, found by their vtables; any buffer not in the scratch mapping, or a byte of the body the writer made
     itself, and the file is written by :func:`write_batch` instead), and then, by pwrite(2) on the scratch file:
     the metadata before the rows, the Arrow footer, fence, filter and page CRCs after them (the CRCs read the
     rows from the scratch mapping, a piece at a time: the file's bytes, never read through the file), the header,
     the footer; the room the output did not fill is given back (a hole) before the CRCs read it; fsync, rename to
     the batch file's name, fsync of the directory, as in invariant 1 (a crash before the rename leaves a
     ``merge-*.tmp``, which an open sweeps). The rows are written once, by the merge; the spill writes O(metadata +
     sections). The same format, checksums and checks. Every step is an operation of the store's VFS (a
     ``_storage.FileWriter`` that adopts the scratch file, csrc/smallfile.h invariant 4: open, truncate, each hole,
     each pwrite, fsync, rename, fsync of the directory), so the fault VFS counts, crashes and fails each as it
     does invariant 1's; it models the rows the merge wrote through the mapping as unsynced writes of a file not
     yet durable in its directory (csrc/vfs.c, model 2), so a missing fsync before the rename loses them at a
     crash. A file system without hole punching (EOPNOTSUPP) keeps the blocks (the bytes are zeros either way).
     A VFS that cannot adopt a file (no ``punch`` entry; posix and fault both can) gets the copy.
  8. Invariant 7's write can be made in pieces (:class:`InPlaceWrite`: a compaction paid in slices by the steps,
     dbsp_core/trace/levels.py invariant 17): the same operations and bytes in the same order, cut between calls that
     each do about the bytes of work they are given (at least one piece): the opening operations (adopt, truncate,
     holes, the Arrow metadata: O(metadata)); the page CRCs, a piece of the scratch mapping at a time; the Bloom
     filter and the fence, a piece of the key hashes at a time (a filter built from the pieces in order is bit for
     bit the one built whole); the sections after the Arrow file, a piece at a time, their CRC-32Cs folded as they are
     written; then the header, the footer (its whole-file CRC combined from the parts') and the commit. So no call
     passes over the file: the one that commits does O(metadata) work and the fsync. Until the commit the scratch
     file is a temporary file no reader takes (a crash leaves a ``merge-*.tmp``, which an open sweeps) and the
     writer holds the filter, fence and page CRCs (about 1.4 bytes a row: the batch store counts them,
     dbsp_core/trace/spill.py ``merge_bytes``); the file is then opened with them (``open_batch(sections=...)``),
     not read back.
  9. Every mapping of a batch file this process makes is registered, by the file's identity (``st_dev``,
     ``st_ino``: a rename keeps it, and no other file takes it while the inode lives), with a weak reference to its
     ``mmap`` object (:func:`note_mapping`): :func:`open_batch`'s (the store's switch, the spill thread's, a
     checkpoint's restore, a shard move, ``verify``), and the merge's scratch mapping of a file made in place
     (:class:`InPlaceWrite`: the same inode becomes the batch file, and views of the output taken before its switch
     read that mapping). The ``mmap`` object lives as long as anything built over it (an Arrow buffer from
     ``pa.py_buffer``, a numpy array, a merge Region keep it as their owner), and it is unmapped when it dies, so
     :func:`mapped` (a live reference under the identity) is False only once no byte of the file is mapped in the
     process. The batch store truncates a deleted file only then (dbsp_core/trace/spill.py invariant 12, the
     reclaim): a truncated file under a live mapping is a bus error when a page past the new end is read.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError
from dbsp_core.storage.formats import (BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_GROUPED_VERSION, BATCH_FILE_MAGIC,
                                       BATCH_FILE_VERSION)
from dbsp_core.zset import FENCE_STEP

__all__ = ["BatchFile", "write_batch", "write_in_place", "InPlaceWrite", "in_place_room", "open_batch", "verify", "bloom_build", "bloom_may_contain",
           "note_mapping", "mapped", "file_key", "BATCH_FILE_MAGIC", "BATCH_FILE_FOOTER_MAGIC", "BATCH_FILE_VERSION", "PAGE"]

PAGE = 65536  # bytes per page CRC
HEADER = struct.Struct("<8sIIQQQII12xI")  # 64 bytes
FLAG_SECTION_CRCS = 1  # header flags bit 0: the page-CRC and fence+filter section CRCs are set
FOOTER = struct.Struct("<8sIIQQQQQII")  # 64 bytes
assert HEADER.size == 64 and FOOTER.size == 64
BLOOM_BITS_PER_KEY = 10  # ~1.5-2% false positives with K = 6 bits in one word (blocked)
BLOOM_K = 6
BLOOM_CHUNK = 1 << 18  # key hashes per piece of bloom_build: its temporaries, not the batch, bound its memory
PAGES_CHUNK = 1 << 16  # hashes (and rows) per piece of BatchFile.pages_read: its temporaries (two int64 arrays per
# column and section, a page run per range) are O(piece), not O(hashes): the accounting of a 1M-row step's reads
# in a 10M-row spilled join held ~450 MiB of them at once (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "Where the anonymous memory goes")

WEIGHT_COL, KEY_HASH_COL, ROW_HASH_COL = "__dbsp_weight", "__dbsp_key_hash", "__dbsp_row_hash"


# ---- the mappings of batch files (invariant 9) ----

_maps_lock = threading.Lock()
_maps: dict[tuple[int, int], list] = {}  # file identity -> weak references to the mmap objects mapping it
_maps_pruned = 0  # identities after the last whole prune: the next one runs at twice as many


def file_key(st: os.stat_result) -> tuple[int, int]:
    """A file's identity (device, inode) from its ``os.stat``/``os.fstat``: what :func:`note_mapping` files it under."""
    return st.st_dev, st.st_ino


def note_mapping(m: Any, key: tuple[int, int]) -> None:
    """Register ``m`` (an ``mmap.mmap``) as a mapping of the file with identity ``key`` (:func:`file_key`) while it
    lives (invariant 9). O(1) but for a prune of dead references, amortized."""
    global _maps_pruned
    ref = weakref.ref(m)
    with _maps_lock:
        refs = _maps.get(key)
        if refs is None:
            _maps[key] = [ref]
        else:
            refs[:] = [r for r in refs if r() is not None]
            refs.append(ref)
        if len(_maps) > 2 * _maps_pruned + 64:  # identities of files gone (unlinked, closed elsewhere): dropped
            for k in [k for k, refs in _maps.items() if all(r() is None for r in refs)]:
                del _maps[k]
            _maps_pruned = len(_maps)


def mapped(key: tuple[int, int]) -> bool:
    """Whether a mapping of the file with identity ``key`` registered by :func:`note_mapping` is still alive; when
    none is, the identity is forgotten (invariant 9)."""
    with _maps_lock:
        refs = _maps.get(key)
        if refs is None:
            return False
        refs[:] = [r for r in refs if r() is not None]
        if not refs:
            del _maps[key]
        return bool(refs)


def _crc(data: Any, crc: int = 0) -> int:
    from dbsp_core import _storage

    return _storage.crc32c(data, crc)


_CRC32C_POLY = 0x82F63B78  # reflected


def _gf2_mulmod(a: int, b: int) -> int:
    """a * b modulo the CRC-32C polynomial, both as reflected 32-bit polynomials (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
        m >>= 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..63 (x^1 = bit 30 reflected)
for _ in range(63):
    _X2N.append(_gf2_mulmod(_X2N[-1], _X2N[-1]))


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` of A, ``crc2`` of B and ``len(B)`` (zlib's crc32_combine, for the
    Castagnoli polynomial): no byte is read again. ``crc_combine(_crc(a), _crc(b), len(b)) == _crc(a + b)``.

    >>> a, b = b"12345", b"6789"
    >>> crc_combine(_crc(a), _crc(b), len(b)) == _crc(a + b)
    True
    """
    from dbsp_core import _storage
    from dbsp_core.trace import spillread

    if spillread.NATIVE:  # in C (csrc/crc32c.h; else the Python below, the reference: tests compare the two)
        return _storage.crc32c_combine(crc1, crc2, len2)
    p, n, k = 1 << 31, len2, 3  # x^(8 len2): the shift of crc1 past B's bits
    while n:
        if n & 1:
            p = _gf2_mulmod(_X2N[k], p)
        n >>= 1
        k += 1
    return _gf2_mulmod(p, crc1) ^ crc2


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _bloom_parts(hashes: np.ndarray, words: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The word (the top bits of the key hash) and the mask of ``k`` bits in it (6-bit fields of the low bits) of
    each key hash: a blocked Bloom filter, one 64-bit word per key, so building and probing touch one word per hash.
    Top bits for the word: a batch's key hashes ascend, so their words do too and building needs no sort."""
    h = np.asarray(hashes, dtype=np.uint64)
    shift = 64 - (words.bit_length() - 1)
    word = (h >> np.uint64(shift)).astype(np.int64) if shift < 64 else np.zeros(len(h), dtype=np.int64)
    mask = np.zeros(len(h), dtype=np.uint64)
    for i in range(k):
        mask |= np.uint64(1) << ((h >> np.uint64(6 * i)) & np.uint64(63))
    return word, mask


def bloom_words(n: int) -> int:
    """The words of the Bloom filter of ``n`` key hashes: a power of two, about ``BLOOM_BITS_PER_KEY`` bits a hash,
    at most 2**28."""
    n = max(1, n)
    return min(1 << 28, 1 << max(0, (n * BLOOM_BITS_PER_KEY + 63) // 64 - 1).bit_length())


def bloom_build(hashes: np.ndarray, k: int = BLOOM_K) -> np.ndarray:
    """A blocked Bloom filter (uint64 words, a power of two of them, at most 2**28) holding every hash of
    ``hashes``, ascending (invariant 3): word ``h >> (64 - log2 words)`` has bits ``(h >> 6 i) mod 64`` set, i < k.

    >>> f = bloom_build(np.sort(np.array([1, 2, 3], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)))
    >>> bool(bloom_may_contain(f, np.array([2], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[0])
    True
    """
    f = np.zeros(bloom_words(len(hashes)), dtype=np.uint64)
    _bloom_add(f, hashes, k)
    return f


def _bloom_add(f: np.ndarray, hashes: np.ndarray, k: int = BLOOM_K) -> None:
    """Set the bits of ``hashes`` (ascending) in the filter ``f`` (a piece at a time: a filter built from pieces
    of a batch's key hashes, in order, is the one :func:`bloom_build` makes of them all, bit for bit)."""
    from dbsp_core import _storage
    from dbsp_core.trace import spillread

    if spillread.NATIVE:  # one pass in C (csrc/bloom.h), bit for bit the pieces below (the reference)
        _storage.bloom_build(np.ascontiguousarray(hashes, dtype=np.uint64), f, k)
        return
    last = -1  # the word of the previous piece's last hash
    for lo in range(0, len(hashes), BLOOM_CHUNK):  # a piece at a time: the temporaries (~40 B a hash) stay a
        word, mask = _bloom_parts(hashes[lo:lo + BLOOM_CHUNK], len(f), k)  # piece's, not the batch's
        starts = np.concatenate(([0], np.flatnonzero(word[1:] != word[:-1]) + 1))
        if word[0] < last or (len(word) > 1 and bool((word[1:] < word[:-1]).any())):
            raise ValueError("bloom_build: key hashes must ascend")
        f[word[starts]] |= np.bitwise_or.reduceat(mask, starts)  # a word may span two pieces: or, not set
        last = int(word[-1])


def bloom_may_contain(f: np.ndarray, hashes: np.ndarray, k: int = BLOOM_K) -> np.ndarray:
    """Per hash: False when the filter ``f`` proves it absent, True when it may be present."""
    if len(hashes) == 0:
        return np.zeros(0, dtype=bool)
    word, mask = _bloom_parts(hashes, len(f), k)
    return (f[word] & mask) == mask


def _fence(kh: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(kh[::FENCE_STEP])


def write_batch(path: str, batch: Any, vfs: str = "posix", sync: bool = True, drop: Any = None) -> int:
    """Write ``batch`` (an IndexedZSet) as a batch file at ``path`` through the VFS ``vfs`` (invariant 1: temporary
    file, fsync, rename, directory fsync); returns the file's size. The Arrow IPC writer (C++) and numpy (filter,
    fence, CRCs) write it: no per-row Python. The file is streamed in pieces of at most ``STREAM_CHUNK`` bytes, so
    writing holds no copy of the batch, and ``drop()`` is called after each piece: a batch whose buffers are a file's
    mapping (a merge's output built in a scratch file) then returns the pages the writer read, and a spill of it
    stays within a piece of memory. ``sync=False`` (scratch files of a pipeline without storage, which no crash
    needs to find again) skips the two fsyncs. One path for every VFS: the fault-injecting one sees (and can crash)
    each operation production makes."""
    schema, rb = _record_batch(batch)
    sizer = pa.MockOutputStream()  # the Arrow file's size, so the sections' offsets are known before it is written
    with pa.ipc.new_file(sizer, schema) as w:
        w.write_batch(rb)
    alen = sizer.size()
    fence_off, crc_off, end, size, sections, header, footer = _layout(batch, alen)
    _stream_batch(path, vfs, schema, rb, alen, header, footer, sections, fence_off, crc_off, end, drop, sync)
    return size


def _record_batch(batch: Any) -> tuple[pa.Schema, pa.RecordBatch]:
    """The Arrow schema and record batch of a batch file's Arrow part (the format above): ``batch``'s data columns,
    weights, key hashes and the row hashes it keeps apart from them, over its own buffers (no copy)."""
    z = batch.zset
    data = z.data.combine_chunks()
    kh = np.ascontiguousarray(batch.key_hash, dtype=np.uint64)
    rh = batch._rh
    rh_mode = "0" if rh is None else ("key" if rh is kh or rh is batch.key_hash else "1")
    cols = list(data.columns) + [pa.array(np.ascontiguousarray(z.weights, dtype=np.int64)), pa.array(kh)]
    fields = list(data.schema) + [pa.field(WEIGHT_COL, pa.int64(), False), pa.field(KEY_HASH_COL, pa.uint64(), False)]
    if rh_mode == "1":
        cols.append(pa.array(np.ascontiguousarray(rh, dtype=np.uint64)))
        fields.append(pa.field(ROW_HASH_COL, pa.uint64(), False))
    schema = pa.schema(fields, metadata={b"dbsp.key": json.dumps(list(batch.key)).encode(), b"dbsp.row_hash": rh_mode.encode()})
    return schema, pa.RecordBatch.from_arrays([_one_chunk(c) for c in cols], schema=schema)


def _layout(batch: Any, alen: int) -> tuple:
    """Where a batch file's parts go once its Arrow part (``alen`` bytes at 64) is known: (fence offset, page-CRC
    offset, footer offset, file size, the fence and filter sections' bytes, ``header(page_crcs)``,
    ``footer(whole_crc)``)."""
    kh = np.ascontiguousarray(batch.key_hash, dtype=np.uint64)
    fence = _fence(kh)
    bloom = bloom_build(kh)
    fence_off, bloom_off, crc_off, end, size = _places(len(batch), alen)
    sections = fence.tobytes() + bloom.tobytes()
    filt_sec = _crc(sections)
    rows = len(batch)
    return (fence_off, crc_off, end, size, sections, lambda crcs: _header(alen, rows, _crc(crcs), filt_sec),
            lambda whole: _footer(fence_off, len(fence), bloom_off, len(bloom), crc_off, whole))


def _places(rows: int, alen: int) -> tuple[int, int, int, int, int]:
    """The offsets of a batch file of ``rows`` rows whose Arrow part is ``alen`` bytes (at 64): (fence, filter,
    page CRCs, footer, the file's size)."""
    fence_off = _pad8(64 + alen)
    bloom_off = fence_off + 8 * -(-rows // FENCE_STEP)
    crc_off = bloom_off + 8 * bloom_words(rows)
    size = _pad8(crc_off + 4 * ((alen + PAGE - 1) // PAGE)) + FOOTER.size
    return fence_off, bloom_off, crc_off, size - FOOTER.size, size


def _header(alen: int, rows: int, crcs_crc: int, filt_sec: int) -> bytes:
    """A batch file's header: ``crcs_crc`` the CRC-32C of its page-CRC section, ``filt_sec`` its fence and filter's."""
    fields = (BATCH_FILE_MAGIC, BATCH_FILE_VERSION, FLAG_SECTION_CRCS, 64, alen, rows, crcs_crc, filt_sec)
    return HEADER.pack(*fields, _crc(HEADER.pack(*fields, 0)[:60]))


def _footer(fence_off: int, nfence: int, bloom_off: int, nbloom: int, crc_off: int, whole: int) -> bytes:
    """A batch file's footer: ``whole`` the CRC-32C of every byte before it."""
    foot = (BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_VERSION, BLOOM_K, fence_off, nfence, bloom_off, nbloom, crc_off, whole)
    return FOOTER.pack(*foot, _crc(FOOTER.pack(*foot, 0)[:60]))


def _one_chunk(c: Any) -> Any:
    """A column as one array, in place when it is one already (``ChunkedArray.combine_chunks`` copies even one
    chunk: a spill would hold its batch's data twice)."""
    if not isinstance(c, pa.ChunkedArray):
        return c
    return c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()


STREAM_CHUNK = 4 << 20  # bytes a streamed write hands the VFS at a time, at most (a multiple of FOLIO_ALIGN)
# a big write's pieces end at multiples of this many bytes of the file (invariant 6; 0: pieces of STREAM_CHUNK from
# wherever the write starts, as before): the page cache then holds most of the file in folios of this size (2 MiB, the
# PMD size on x86-64 and arm64 with 4 KiB pages), which a read fault maps with one page-table entry and an eviction
# unmaps as one; a replay of a 10M-row join's spilled steps cost the kernel 1.68 ms a step on files written from
# offset 64 against 0.29 aligned (bench/bench_pread_micro.py, bench/history/RESULTS-2026-11-28-to-2026-12-02.md 2026-11-29)
FOLIO_ALIGN = 2 << 20
GATHER = 64 << 10  # the Arrow writer's small writes (metadata, padding) are gathered up to this many bytes per pwrite


def _pieces(at: int, n: int) -> list[tuple[int, int]]:
    """The pieces [lo, hi) in which a write of ``n`` bytes at file offset ``at`` goes to the VFS (invariant 6): at most
    ``STREAM_CHUNK`` bytes each, every one but the last ending at a multiple of ``FOLIO_ALIGN`` of the file.

    >>> _pieces(64, (5 << 20) - 64) == [(0, (4 << 20) - 64), ((4 << 20) - 64, (5 << 20) - 64)]
    True
    """
    out, lo = [], 0
    while lo < n:
        hi = min(n, lo + STREAM_CHUNK - ((at + lo) % FOLIO_ALIGN if FOLIO_ALIGN else 0))
        out.append((lo, hi))
        lo = hi
    return out


def _touch(piece: memoryview) -> None:
    """Read a byte of every page of ``piece`` (a slice of a mapping), so that its pages are mapped when the kernel
    copies them into the page cache: a write from pages that are not (a merge's scratch mapping after a drop) copies
    short, and the kernel retries with smaller and smaller folios (a 280 MiB merge output: 757 faults to map it
    whole against ~140 for 2 MiB folios; a C probe: 503 faults against 201, and 201 with the source mapped first)."""
    np.frombuffer(piece, dtype=np.uint8)[::mmap.PAGESIZE].max(initial=0)


class _PageSink:
    """A write-only file object for the Arrow IPC writer (``pa.PythonFile``): writes what it is given to the
    ``_storage.FileWriter`` ``out`` at ``64 + position``, small writes gathered up to ``GATHER`` bytes and big ones in
    pieces of at most ``STREAM_CHUNK`` ending at multiples of ``FOLIO_ALIGN`` (:func:`_pieces`), keeping the CRC of each ``PAGE`` of it (invariant 4), and calls ``drop`` after each piece
    of a big write (the Arrow writer hands the batch's buffers over in place, as ``pa.Buffer``). After a write
    fails, later ones do nothing (the Arrow writer closing on the way out must not hide the first error)."""

    closed = False
    pbase = 0  # where a CRC page starts: at multiples of ``page`` of ``pos + pbase`` (format 2: of the file, 64)
    page = PAGE  # bytes a page CRC covers (format 2: its slot size)

    def __init__(self, out: Any, drop: Any) -> None:
        self.out, self.drop, self.pos, self.cur, self.crcs = out, drop, 0, 0, []
        self.gathered, self.at = bytearray(), 0  # small writes not written yet, and their file position
        self.failed = False
        self.whole = 0  # CRC-32C of every byte written so far (the footer's whole-file CRC needs no read-back)

    def _pwrite(self, data: Any, offset: int) -> None:
        try:
            self.out.pwrite(data, offset)
        except BaseException:
            self.failed = True
            raise

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self.failed:
            return n
        if n < GATHER:
            if not self.gathered:
                self.at = self.pos
            self.gathered += mv
            self._crc(mv)
            if len(self.gathered) >= GATHER:
                self.flush()
            return n
        self.flush()
        for lo, hi in _pieces(64 + self.pos, n):
            piece = mv[lo:hi]
            if self.drop is not None:  # a scratch mapping whose pages the last drop took out of the process: map
                _touch(piece)  # the piece's first (invariant 6: else the copy faults and the folios come out small)
            self._pwrite(piece, 64 + self.pos)
            self._crc(piece)
            if self.drop is not None:
                self.drop()
        return n

    def _crc(self, piece: memoryview) -> None:
        """Add ``piece`` (the bytes at ``pos``) to the page CRCs, page by page, and to the whole CRC, and move ``pos``
        past it."""
        from dbsp_core import _storage

        self.whole = _crc(piece, self.whole)
        i, n, page = 0, len(piece), self.page
        while i < n:
            if (self.pos + self.pbase) % page == 0 and n - i >= page:  # whole pages: their CRCs in one C call
                full = (n - i) // page
                got = np.empty(full, dtype=np.uint32)
                _storage.crc32c_pages(piece[i:i + full * page], page, got)
                self.crcs.extend(got.tolist())
                self.pos += full * page
                i += full * page
                continue
            take = min(page - (self.pos + self.pbase) % page, n - i)
            self.cur = _crc(piece[i:i + take], self.cur)
            self.pos += take
            i += take
            if (self.pos + self.pbase) % page == 0:
                self.crcs.append(self.cur)
                self.cur = 0

    def page_crcs(self) -> bytes:
        last = [self.cur] if (self.pos + self.pbase) % self.page else []
        return np.array(self.crcs + last, dtype="<u4").tobytes()

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        if self.gathered and not self.failed:
            self._pwrite(self.gathered, 64 + self.at)
        self.gathered = bytearray()

    def close(self) -> None:
        self.flush()
        self.closed = True


def _stream_batch(path: str, vfs: str, schema: pa.Schema, rb: pa.RecordBatch, alen: int, header: Any, footer: Any,
                  sections: bytes, fence_off: int, crc_off: int, end: int, drop: Any, sync: bool) -> None:
    """:func:`write_batch`'s I/O, every operation through the VFS (a ``_storage.FileWriter``): the Arrow file through
    a :class:`_PageSink`, then the sections, the header and the footer, whose whole-file CRC is combined from the
    header's, the Arrow file's (the sink's, as written) and the sections' (:func:`crc_combine`: nothing is read back);
    the commit fsyncs the temporary file (``sync``), renames it and fsyncs the directory (``sync``). An error is a
    StorageError naming the file (ENOSPC: a full spill directory) and leaves no temporary file."""
    from dbsp_core import _storage

    out = None
    try:
        out = _storage.FileWriter(path, vfs)
        sink = _PageSink(out, drop)
        with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as w:
            w.write_batch(rb)
        sink.close()
        if sink.pos != alen:
            raise StorageError(0, f"writing batch file {path}: the Arrow writer wrote {sink.pos} bytes, {alen} "
                                  f"expected; a bug: report it")
        crcs = sink.page_crcs()
        tail = bytes(fence_off - 64 - alen) + sections + crcs + bytes(end - crc_off - len(crcs))
        out.pwrite(tail, 64 + alen)
        head = header(crcs)
        out.pwrite(head, 0)
        whole = _crc(tail, crc_combine(_crc(head), sink.whole, alen))  # not read back: combined from its parts
        out.pwrite(footer(whole), end)
        out.commit(sync)
    except (OSError, pa.ArrowException) as e:  # StorageError is an OSError; pa.PythonFile wraps the sink's errors
        try:  # the temporary file goes (a failed open or commit has closed it already)
            if out is not None and not out.done:
                out.abort()
            else:
                _storage.file_remove(path + ".tmp", vfs)
        except OSError:  # the fault VFS crashed: a crash leaves the temporary file, the next open sweeps it
            pass
        code = getattr(e, "errno", None) or 0
        where = os.path.dirname(path) or "."
        hint = (f"free space in {where} or give the pipeline a spill_dir with room" if code == errno.ENOSPC
                else f"check the disk of {where}")
        raise StorageError(code, f"writing batch file {path}: {getattr(e, 'strerror', None) or e}; {hint}") from e


def in_place_room(batch: Any) -> int:
    """Bytes a merge output's scratch file reserves before its rows so that it can become a batch file in place
    (:func:`write_in_place`): the header and an upper bound of the Arrow file's magic, schema message and record
    batch metadata for ``batch``'s schema and key (the output's are its inputs'), rounded up to whole pages."""
    fields = list(batch.schema) + [pa.field(WEIGHT_COL, pa.int64(), False), pa.field(KEY_HASH_COL, pa.uint64(), False),
                                  pa.field(ROW_HASH_COL, pa.uint64(), False)]
    meta = {b"dbsp.key": json.dumps(list(batch.key)).encode(), b"dbsp.row_hash": b"key"}
    schema_msg = pa.schema(fields, metadata=meta).serialize().size
    need = 64 + 8 + schema_msg + 256 + 48 * (3 * len(fields))  # record batch metadata: nodes, buffers, header
    return (need + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class _Capture:
    """A write-only file object for the Arrow IPC writer that records what it writes instead of writing it: bytes
    (metadata, padding) as they are, and each buffer of the batch (``pa.Buffer``, handed over in place) as its
    address and length (:func:`write_in_place`)."""

    closed = False

    def __init__(self) -> None:
        self.pos, self.parts = 0, []  # (position, bytes or None, address, length)

    def write(self, data: Any) -> int:
        if isinstance(data, pa.Buffer):
            self.parts.append((self.pos, None, data.address, data.size))
            n = data.size
        else:
            b = bytes(data)
            self.parts.append((self.pos, b, 0, len(b)))
            n = len(b)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _fb_table(buf: bytes, at: int) -> tuple[int, int, int]:
    """A flatbuffer table at ``at``: (its position, its vtable's position, the vtable's size)."""
    vt = at - struct.unpack_from("<i", buf, at)[0]
    return at, vt, struct.unpack_from("<H", buf, vt)[0]


def _fb_field(buf: bytes, table: tuple[int, int, int], i: int) -> int | None:
    """The position of field ``i`` of a flatbuffer table, None when absent."""
    at, vt, vsize = table
    if 4 + 2 * i >= vsize:
        return None
    off = struct.unpack_from("<H", buf, vt + 4 + 2 * i)[0]
    return at + off if off else None


def _fb_deref(buf: bytes, pos: int) -> int:
    """What the uoffset at ``pos`` points to."""
    return pos + struct.unpack_from("<I", buf, pos)[0]


def _relocate(arrow: bytes, body_at: int, moves: dict[int, int], body_len: int, meta_at: int) -> bytearray:
    """The Arrow file's bytes before the body (``arrow[:body_at]``) with the record batch message at ``meta_at`` (its
    continuation marker) patched: each buffer at body offset ``k`` of ``moves`` moved to ``moves[k]``, and the body's
    length set to ``body_len``. Raises ValueError when the metadata is not the flatbuffer expected (the caller then
    writes the file the ordinary way)."""
    out = bytearray(arrow[:body_at])
    if struct.unpack_from("<I", out, meta_at)[0] != 0xFFFFFFFF:
        raise ValueError("no continuation marker")
    fb = meta_at + 8  # the Message flatbuffer
    msg = _fb_table(out, _fb_deref(out, fb))
    pos = _fb_field(out, msg, 3)  # bodyLength
    head = _fb_field(out, msg, 2)  # header: the RecordBatch table
    if pos is None or head is None:
        raise ValueError("no body length or header")
    struct.pack_into("<q", out, pos, body_len)
    rb = _fb_table(out, _fb_deref(out, head))
    bufs = _fb_field(out, rb, 2)  # buffers: [Buffer { offset: long, length: long }]
    if bufs is None:
        raise ValueError("no buffers")
    vec = _fb_deref(out, bufs)
    for i in range(struct.unpack_from("<I", out, vec)[0]):
        at = vec + 4 + 16 * i
        off, length = struct.unpack_from("<qq", out, at)
        if length:
            if off not in moves:
                raise ValueError(f"buffer {i} at body offset {off} not placed")
            struct.pack_into("<q", out, at, moves[off])
    return out


def _relocate_footer(trailer: bytes, body_len: int) -> bytearray:
    """The Arrow file's footer part (footer flatbuffer, its length, the magic) with its one record batch block's body
    length set to ``body_len``."""
    out = bytearray(trailer)
    flen = struct.unpack_from("<i", out, len(out) - 10)[0]
    fb = len(out) - 10 - flen
    foot = _fb_table(out, _fb_deref(out, fb))
    pos = _fb_field(out, foot, 3)  # recordBatches: [Block { offset: long, metaDataLength: int, bodyLength: long }]
    if pos is None:
        raise ValueError("no record batch blocks")
    vec = _fb_deref(out, pos)
    if struct.unpack_from("<I", out, vec)[0] != 1:
        raise ValueError("not one record batch")
    struct.pack_into("<q", out, vec + 4 + 16, body_len)
    return out


def write_in_place(path: str, batch: Any, cursor: Any, sync: bool = True, vfs: str = "posix") -> int | None:
    """Make the finished merge output ``batch``, built by ``cursor`` in a named scratch file with room before its
    rows (bindings/merge.pxi ``prefix``), the batch file at ``path`` without copying its rows (invariant 7); returns
    the file's size, or None when the output's buffers are not where the file needs them (then nothing is written
    and the caller writes the file with :func:`write_batch`). Every write, the truncate, the holes and the commit
    are operations of the VFS ``vfs`` (it must adopt files: ``_storage.vfs_adopts``), so the fault VFS counts and can
    crash or fail each; an error is a StorageError naming the file, and leaves the scratch file to its cursor. One
    :class:`InPlaceWrite` run to its end (invariant 8 runs it in pieces)."""
    w = InPlaceWrite.plan(path, batch, cursor, sync=sync, vfs=vfs)
    if w is None:
        return None
    w.advance(None)
    return w.size


WORK_KEYS = 8  # what a byte of key hashes costs InPlaceWrite (the filter and fence of them), in bytes checksummed
WORK_WRITE = 16  # and a byte of the sections written (copied to the page cache, checksummed): measured at 5M and 20M
# rows, a byte checksummed from the scratch mapping 0.1 ns, a byte of key hashes 0.7-1.15 ns, a byte written 1.6-2.4 ns


class InPlaceWrite:
    """:func:`write_in_place` in pieces (invariant 8): :meth:`plan` reads the output's metadata only (no I/O, no row),
    then each :meth:`advance` does about the bytes of work it is given, in this order: the opening operations
    (adopt the scratch file, truncate it, punch the holes, write the Arrow metadata before and after the rows:
    O(metadata)); the page CRCs of the Arrow file, read from the scratch mapping a piece at a time (``_PageCrcs``);
    the Bloom filter and the fence, from the key hashes a piece of rows at a time (``_bloom_add``); the sections
    after the Arrow file (fence, filter, page CRCs) written a piece at a time, their CRC-32Cs folded as they go;
    then the header, the footer (its whole-file CRC combined from the parts' CRCs: nothing is read back) and the
    commit (fsync, rename, fsync of the directory). The bytes and the operations are :func:`write_in_place`'s; only
    the cut between calls moves. After an error (a StorageError naming the file) the writer is given up and the
    scratch file left to its cursor; :meth:`abort` gives up one no longer wanted. ``fence`` and ``bloom`` are the
    sections it wrote, for :func:`open_batch` to take as they are once it is done (``sections``)."""

    def __init__(self, path: str, batch: Any, cursor: Any, sync: bool, vfs: str, head: bytes, tail: bytes,
                 body_at: int, new_len: int, holes: list[tuple[int, int]]) -> None:
        self.path, self.cursor, self.sync, self.vfs = path, cursor, sync, vfs
        self.scratch = cursor.scratch_path
        note_mapping(cursor.mapping, file_key(os.stat(self.scratch)))  # the batch file's inode, mapped (invariant 9)
        self.head, self.tail, self.body_at, self.new_len, self.holes = head, tail, body_at, new_len, holes
        self.rows = len(batch)
        self.kh = batch.key_hash  # (in the scratch mapping: read a piece at a time)
        self.alen = alen = body_at + new_len + len(tail)
        self.fence_off, self.bloom_off, self.crc_off, self.end, self.size = _places(self.rows, alen)
        self.fence = self.bloom = np.zeros(0, dtype=np.uint64)  # (made when the page CRCs are done: held less long)
        new_at = 64 + body_at
        self.pages = _PageCrcs((head, cursor.mapping, tail), (0, new_at, new_at + new_len), new_len, cursor.drop)
        self.out: Any = None  # the _storage.FileWriter, once opened
        self.row = 0  # key hashes in the filter and fence so far
        self.parts: list | None = None  # the sections after the Arrow file, once the page CRCs are known
        self.pieces: list[tuple[int, int]] = []  # their writes not done yet
        self.rest_crc = self.filt_crc = 0  # CRC-32C of the sections written so far, and of their fence and filter
        self.done = self.failed = False

    @classmethod
    def plan(cls, path: str, batch: Any, cursor: Any, sync: bool = True, vfs: str = "posix") -> "InPlaceWrite | None":
        """The writer of ``batch``'s file in place of ``cursor``'s scratch file (:func:`write_in_place`'s arguments),
        or None when its buffers are not where the file needs them. Reads metadata only; does no I/O."""
        scratch = cursor.scratch_path
        mapping = cursor.mapping
        if scratch is None or mapping is None or len(batch) == 0:
            return None
        schema, rb = _record_batch(batch)
        cap = _Capture()
        with pa.ipc.new_file(pa.PythonFile(cap, mode="w"), schema) as w:
            w.write_batch(rb)
        last = len(cap.parts)  # the writes after the last buffer: padding, end of stream, the footer
        while last and cap.parts[last - 1][1] is not None:
            last -= 1
        if last == 0:
            return None
        end_at = cap.parts[last][0] if last < len(cap.parts) else cap.pos
        ending = b"".join(b for _p, b, _a, _n in cap.parts[last:])
        flen = struct.unpack_from("<i", ending, len(ending) - 10)[0]
        foot = _fb_table(ending, _fb_deref(ending, len(ending) - 10 - flen))
        pos = _fb_field(ending, foot, 3)
        if pos is None:
            return None
        vec = _fb_deref(ending, pos)
        meta_at, meta_len, _pad, body_len = struct.unpack_from("<qiiq", ending, vec + 4)
        body_at = meta_at + meta_len
        if body_at + body_len < end_at:
            return None
        opening = b"".join(b for p, b, _a, _n in cap.parts if p < body_at)
        if len(opening) != body_at or any(b is None for p, b, _a, _n in cap.parts if p < body_at):
            return None
        mv = memoryview(mapping)
        base = pa.py_buffer(mv).address
        room = len(mv)
        mv.release()
        new_at = 64 + body_at  # the body's first byte in the file
        moves: dict[int, int] = {}
        new_len = 0
        for p, b, addr, n in cap.parts:
            if not body_at <= p < body_at + body_len:
                continue
            if b is not None:
                if b.strip(b"\0"):
                    return None  # bytes of the batch the writer made (not a buffer in place): not in the scratch file
                continue
            rel = addr - base - new_at
            if not (0 <= rel and addr + n <= base + room and rel % 8 == 0):
                return None
            moves[p - body_at] = rel
            new_len = max(new_len, _pad8(rel + n))
        try:
            head = _relocate(opening, body_at, moves, new_len, meta_at)
            tail = _relocate_footer(ending[body_at + body_len - end_at:], new_len)
        except (ValueError, struct.error):
            return None
        holes = _holes(new_at, [(new_at + rel, n) for (_p, _b, _a, n), rel in _placed(cap.parts, body_at, body_len,
                                                                                       base, new_at)])
        return cls(path, batch, cursor, sync, vfs, bytes(head), bytes(tail), body_at, new_len, holes)

    @property
    def row_bytes(self) -> int:
        """The Arrow file's bytes a row, at least 1 (a budget in rows times this is one in bytes of work)."""
        return max(1, self.alen // max(1, self.rows))

    def memory_bytes(self) -> int:
        """Bytes it holds until done: the filter, the fence and the page CRCs (the budget counts them, spill.py)."""
        return int(self.fence.nbytes + self.bloom.nbytes) + 4 * len(self.pages.crcs)

    def advance(self, budget: int | None) -> bool:
        """Do about ``budget`` bytes of the write's work (None: all of it; at least one piece of what is next), in
        the order of the class's description: a byte checksummed is one, a byte of key hashes ``WORK_KEYS``, a byte
        of the sections written ``WORK_WRITE`` (so that a budget costs about the same in every part); True once the
        file is committed (its scratch file adopted by it)."""
        if self.done:
            return True
        if self.failed:
            raise StorageError(0, f"writing batch file {self.path} in place of {self.scratch}: given up after an error")
        left = (1 << 62) if budget is None else budget
        try:
            if self.out is None:
                self._open()
            while left > 0 and not self.done:
                if not self.pages.done:
                    left -= self.pages.run(left)
                elif self.row < self.rows:
                    left -= self._keys(left)
                elif self.parts is None or self.pieces:
                    left -= self._sections(left)
                else:
                    self._finish()
        except BaseException as e:
            self.abort()
            if not isinstance(e, OSError):  # StorageError is an OSError
                raise
            code = getattr(e, "errno", None) or 0
            raise StorageError(code, f"writing batch file {self.path} in place of {self.scratch}: "
                                     f"{getattr(e, 'strerror', None) or e}; check the disk of "
                                     f"{os.path.dirname(self.path) or '.'}") from e
        return self.done

    def abort(self) -> None:
        """Give the write up: the scratch file stays its cursor's (not adopted), as it was or with the holes and
        metadata written so far (a temporary file under no name a reader takes)."""
        if not self.done:
            self.failed = True
            if self.out is not None and not self.out.done:
                try:
                    self.out.abort(unlink=False)
                except OSError:  # the fault VFS crashed: the file goes with the cursor's mapping, or the next open
                    pass

    def _open(self) -> None:
        from dbsp_core import _storage

        self.out = _storage.FileWriter(self.path, self.vfs, adopt=self.scratch)  # the scratch file as the temporary
        self.out.truncate(self.size)  # file (invariant 7)
        for lo, n in self.holes:
            if not self.out.punch(lo, n):  # a file system without hole punching keeps the blocks (zeros either way)
                break
        self.out.pwrite(self.head, 64)
        self.out.pwrite(self.tail, 64 + self.body_at + self.new_len)

    def _keys(self, budget: int) -> int:
        """The filter and fence of the next key hashes, about ``budget`` bytes of work (``WORK_KEYS`` a byte of
        them; at least one); returns the work done."""
        r0 = self.row
        if r0 == 0:
            self.fence = np.empty((self.bloom_off - self.fence_off) // 8, dtype=np.uint64)
            self.bloom = np.zeros((self.crc_off - self.bloom_off) // 8, dtype=np.uint64)
        r1 = min(self.rows, r0 + max(1, budget // (8 * WORK_KEYS)))
        kh = self.kh
        if r0 and kh[r0] < kh[r0 - 1]:
            raise ValueError("bloom_build: key hashes must ascend")
        _bloom_add(self.bloom, kh[r0:r1])
        f0, f1 = -(-r0 // FENCE_STEP), -(-r1 // FENCE_STEP)
        self.fence[f0:f1] = kh[f0 * FENCE_STEP:r1:FENCE_STEP]
        self.row = r1
        self.cursor.drop()  # the key hashes read leave the process (spill.py invariant 12)
        return 8 * WORK_KEYS * (r1 - r0)

    def _sections(self, budget: int) -> int:
        """Write the next pieces of the sections after the Arrow file (fence, filter, page CRCs, between their
        paddings), about ``budget`` bytes of work (``WORK_WRITE`` a byte written; at least a ``PAGE``), cut at
        multiples of ``PAGE`` within invariant 6's pieces; returns the work done."""
        if self.parts is None:
            crcs = np.array(self.pages.crcs, dtype="<u4")
            self.crc_bytes = crcs.tobytes()
            at = 64 + self.alen
            self.parts = [(at, bytes(self.fence_off - at)), (self.fence_off, self.fence), (self.bloom_off, self.bloom),
                          (self.crc_off, self.crc_bytes), (self.crc_off + len(self.crc_bytes),
                                                           bytes(self.end - self.crc_off - len(self.crc_bytes)))]
            self.pieces = [(at + lo, at + hi) for lo, hi in reversed(_pieces(at, self.end - at))]
        done = 0
        while self.pieces and done < budget:
            lo, hi = self.pieces.pop()
            cut = (lo + max(PAGE, (budget - done) // WORK_WRITE)) // PAGE * PAGE
            if lo < cut < hi:  # the rest of the piece is the next call's
                self.pieces.append((cut, hi))
                hi = cut
            views = []
            for k, (start, part) in enumerate(self.parts):
                mv = memoryview(part).cast("B")
                a, b = max(lo, start), min(hi, start + len(mv))
                if a < b:
                    views.append(mv[a - start:b - start])
                    c = _crc(views[-1])
                    self.rest_crc = crc_combine(self.rest_crc, c, b - a)
                    if k in (1, 2):  # the fence and the filter
                        self.filt_crc = crc_combine(self.filt_crc, c, b - a)
            self.out.pwrite(views[0] if len(views) == 1 else b"".join(views), lo)
            done += WORK_WRITE * (hi - lo)
        return max(done, 1)

    def _finish(self) -> None:
        hb = _header(self.alen, self.rows, _crc(self.crc_bytes), self.filt_crc)
        self.out.pwrite(hb, 0)
        whole = crc_combine(crc_combine(_crc(hb), self.pages.whole, self.alen), self.rest_crc, self.end - 64 - self.alen)
        self.out.pwrite(_footer(self.fence_off, len(self.fence), self.bloom_off, len(self.bloom), self.crc_off, whole),
                        self.end)
        self.out.commit(self.sync)  # fsync, rename over path, fsync of the directory (sync)
        self.cursor.adopt_scratch()  # renamed: nothing to unlink with the mapping
        self.done = True
        self.kh = None


def _placed(parts: list, body_at: int, body_len: int, base: int, new_at: int) -> list:
    """The buffers of the body among the writes ``parts`` (:class:`_Capture`), each with its offset from ``new_at``
    in the file."""
    return [(x, x[2] - base - new_at) for x in parts if x[1] is None and body_at <= x[0] < body_at + body_len]


def _holes(at: int, used: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages (offset, length) between the buffers ``used`` ((file offset, length)) of a body starting at
    ``at``, runs of at least ``PUNCH_MIN`` bytes: the room a merge's output did not fill (it shrank), which
    :func:`write_in_place` gives back (a hole: read as zeros from then on; a file system without hole punching keeps
    the blocks, zeros too).

    >>> _holes(0, [(0, 10), (200_000, 8)])
    [(4096, 192512)]
    """
    page = mmap.PAGESIZE
    holes = []
    prev = at
    for off, n in sorted(used):
        lo, hi = -(-prev // page) * page, off // page * page
        if hi - lo >= PUNCH_MIN:
            holes.append((lo, hi - lo))
        prev = max(prev, off + n)
    return holes


PUNCH_MIN = 64 << 10  # bytes of unfilled room from which write_in_place gives its blocks back


class _PageCrcs:
    """The CRC-32C of each ``PAGE`` of the Arrow file made of ``parts`` (byte strings, and the scratch mapping), and
    of all of them, a piece at a time (:meth:`run`): part i from file offset ``starts[i]`` on (the Arrow file's first
    byte at 64), the mapping's part ``big`` bytes long (the file's bytes are the mapping's: the rows the merge wrote,
    the holes punched), read at most a ``STREAM_CHUNK`` at a time, its pages leaving the process after each
    (``drop``, spill.py invariant 12). Nothing is read through the file: its bytes are in memory already, so the
    fault VFS's model of them is the writes'."""

    def __init__(self, parts: tuple, starts: tuple, big: int, drop: Any) -> None:
        self.parts, self.starts, self.big, self.drop = parts, starts, big, drop
        self.crcs: list[int] = []
        self.whole = self.cur = self.pos = 0
        self.k = 0  # the part being read
        self.i: int | None = None  # the offset in it
        self.done = False

    def run(self, budget: int) -> int:
        """Read about ``budget`` more bytes (at least one; whole pages in pieces of at most ``STREAM_CHUNK``);
        returns the bytes read."""
        from dbsp_core import _storage

        n = 0
        while not self.done and n < budget:
            part, at = self.parts[self.k], self.starts[self.k]
            mapped = not isinstance(part, (bytes, bytearray))
            lo, hi = (at, at + self.big) if mapped else (0, len(part))
            i = lo if self.i is None else self.i
            mv = memoryview(part).cast("B")
            try:
                while i < hi and n < budget:
                    if self.pos % PAGE == 0 and hi - i >= PAGE:  # whole pages: one C pass a piece
                        take = min(hi - i, STREAM_CHUNK, max(PAGE, budget - n)) // PAGE * PAGE
                        out = np.empty(take // PAGE, dtype=np.uint32)
                        self.whole = crc_combine(self.whole, _storage.crc32c_pages(mv[i:i + take], PAGE, out), take)
                        self.crcs.extend(out.tolist())
                        if mapped and self.drop is not None:
                            self.drop()
                    else:
                        take = min(PAGE - self.pos % PAGE, hi - i)
                        c = _crc(mv[i:i + take])
                        self.cur = crc_combine(self.cur, c, take)
                        self.whole = crc_combine(self.whole, c, take)
                        if (self.pos + take) % PAGE == 0:
                            self.crcs.append(self.cur)
                            self.cur = 0
                    i += take
                    self.pos += take
                    n += take
            finally:
                mv.release()
            self.i = i
            if i >= hi:
                self.k, self.i = self.k + 1, None
                if self.k == len(self.parts):
                    self.done = True
                    if self.pos % PAGE:
                        self.crcs.append(self.cur)
                    if self.drop is not None:
                        self.drop()
        return max(n, 1)


class BatchFile(NamedTuple):
    """An open batch file: its mapping and what is kept of it (fence, filter, page CRCs, ~1.4 bytes per row: in
    memory, or read in place from the mapping when opened lazily), and the batch read in place from the mapping
    (its buffers are the file's pages). ``checked``: None when every byte was checked when opened, else a flag per
    Arrow page and a last one for the fence and filter (invariant 5), shared by the copies ``_replace`` makes; so is
    ``filt``, the cell of the Bloom filter (None once let go: :meth:`release_filter`, :attr:`bloom`)."""

    path: str
    size: int
    rows: int
    map: mmap.mmap
    arrow_off: int
    arrow_len: int
    fence: np.ndarray
    filt: list  # [the Bloom filter's words, or None: let go, read back from the mapping at the next probe]
    bloom_k: int
    page_crcs: np.ndarray
    batch: Any  # IndexedZSet over the mapping
    checked: np.ndarray | None = None
    base: int = 0  # the address of the mapping's first byte
    sections: tuple[int, int, int] = (0, 0, 0)  # fence offset, page-CRC offset, their CRC-32C (invariant 5)

    def may_contain(self, hashes: np.ndarray) -> np.ndarray:
        """Per key hash: whether the batch may hold it (the Bloom filter, invariant 3): one C call
        (trace/spillread.py; ``bloom_may_contain``'s numpy with its ``NATIVE`` False)."""
        from dbsp_core.trace import spillread

        if not spillread.NATIVE or len(hashes) == 0:
            return bloom_may_contain(self.bloom, hashes, self.bloom_k)
        return spillread.may_contain([self], hashes)[0][0]

    def memory_bytes(self) -> int:
        """Bytes this open file keeps besides the rows (fence, filter, page CRCs)."""
        held = self.filt[0]
        return int(self.fence.nbytes + (held.nbytes if held is not None else 0) + self.page_crcs.nbytes)

    @property
    def bloom(self) -> np.ndarray:
        """The Bloom filter's words (invariant 3): the copy held, else (let go by :meth:`release_filter`) copied
        back from the mapping, the fence and filter checked against their section CRC first (invariant 5), and
        held again; the pages that read mapped leave the process."""
        held = self.filt[0]
        if held is None:
            lo, hi, want = self.sections
            mv = memoryview(self.map)
            try:
                if _crc(mv[lo:hi]) != want:
                    raise _bad(self.path, "its fence and Bloom filter fail their CRC-32C")
                at = lo + 8 * len(self.fence)
                held = np.frombuffer(mv, dtype="<u8", count=(hi - at) // 8, offset=at).astype(np.uint64)
            finally:
                mv.release()
            page = mmap.PAGESIZE
            start = lo // page * page
            try:  # (clean file pages: a read of them faults them back)
                self.map.madvise(mmap.MADV_DONTNEED, start, min(len(self.map), -(-hi // page) * page) - start)
            except (OSError, ValueError):
                pass
            self.filt[0] = held
        return held

    def release_filter(self) -> bool:
        """Let go of the filter's copy in memory (invariant 5): only a file whose fence and filter have a section
        CRC (header flag ``FLAG_SECTION_CRCS``) and were checked or written by this process (``checked`` None: a
        lazily opened file reads its filter in place). Returns whether it was let go."""
        if self.checked is not None or self.filt[0] is None or self.sections[1] <= self.sections[0]:
            return False
        if not HEADER.unpack_from(self.map, 0)[2] & FLAG_SECTION_CRCS:
            return False
        self.filt[0] = None
        return True

    def filter_held(self) -> bool:
        """Whether the Bloom filter's words are in memory (or read in place, a lazily opened file's)."""
        return self.filt[0] is not None

    # ---- lazy checks (invariant 5) ----

    def unchecked(self) -> bool:
        """Whether some byte of the file has not been checked yet."""
        return self.checked is not None and not bool(self.checked.all())

    def check_sections(self) -> None:
        """Check the fence and filter (before either is used)."""
        c = self.checked
        if c is None or c[-1]:
            return
        lo, hi, want = self.sections
        if _crc(memoryview(self.map)[lo:hi]) != want:
            raise _bad(self.path, "its fence and Bloom filter fail their CRC-32C")
        c[-1] = True

    def check_pages(self, pages: np.ndarray) -> int:
        """Check the Arrow pages ``pages`` (indexes; duplicates allowed) not checked yet; returns how many."""
        c = self.checked
        if c is None:
            return 0
        todo = np.unique(np.asarray(pages, dtype=np.int64))
        todo = todo[(todo >= 0) & (todo < len(c) - 1)]
        todo = todo[~c[todo]]
        if len(todo):
            mv = memoryview(self.map)
            try:
                _check_pages(self.path, mv, self.arrow_off, self.arrow_len, self.page_crcs, todo.tolist())
            finally:
                mv.release()
            c[todo] = True
        return len(todo)

    def check_all(self) -> int:
        """Check every byte not checked yet (before a read that may touch any row); returns the pages checked."""
        if not self.unchecked():
            return 0
        self.check_sections()
        return self.check_pages(np.flatnonzero(~self.checked[:-1]))

    def _pages_of(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The Arrow pages holding the file bytes [starts[i], ends[i]) (absolute offsets in the file)."""
        return _pages(self.arrow_off, starts, ends)

    def check_seek(self, batch: Any, hashes: np.ndarray) -> None:
        """Check what a fenced seek for each of ``hashes`` (ascending) in ``batch`` (this file's whole batch) reads:
        the fence and filter, and for each hash the key hashes from the fence block before it to one block past
        the last fence entry not above it (csrc/lookup.h's dbsp_seek, the walk over equal hashes after it and the
        next seek's probe one block on), and the first block (the first seek's probes)."""
        self.check_sections()
        kh = batch.key_hash
        n = len(kh)
        if n == 0 or len(hashes) == 0:
            return
        if batch._fx is None:  # no fence: the seek gallops from the start
            self.check_rows(batch, None)
            return
        lo = np.maximum(np.searchsorted(self.fence, hashes, "left") - 1, 0) * FENCE_STEP
        hi = np.minimum(np.searchsorted(self.fence, hashes, "right") * FENCE_STEP + FENCE_STEP + 2, n)
        lo, hi = np.append(lo, 0), np.append(hi, min(n, FENCE_STEP + 2))  # the first seek reads kh[0], kh[64]
        addr = kh.ctypes.data - self.base
        self.check_pages(self._pages_of(addr + lo * 8, addr + hi * 8))

    def check_rows(self, batch: Any, rows: np.ndarray | None) -> None:
        """Check the pages holding rows ``rows`` (ascending row numbers of ``batch``, a batch read from this file;
        None: every row) of every column, weights and hashes: what a take of those rows reads."""
        if not self.unchecked():
            return
        if rows is None:
            self.check_all()
            return
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return
        fixed = _row_ranges(batch, rows, self.base)
        if fixed is None:
            self.check_all()  # a type whose pages this does not locate: all of them
            return
        starts, ends, varwidth = fixed
        self.check_pages(self._pages_of(np.concatenate(starts), np.concatenate(ends)))
        if varwidth:  # their offsets are checked now: the bytes they delimit
            starts, ends = _var_ranges(varwidth, rows, self.base)
            self.check_pages(self._pages_of(starts, ends))

    def os_pages(self) -> int:
        """Pages (``mmap.PAGESIZE``) of the mapping: what a read of every row may bring into the process."""
        return (self.size + mmap.PAGESIZE - 1) // mmap.PAGESIZE

    def pages_read(self, batch: Any, hashes: np.ndarray, rows: np.ndarray | None = None, values: bool = True,
                   row_hashes: bool = True) -> np.ndarray | None:
        """:meth:`_pages_read` in pieces of ``PAGES_CHUNK`` hashes and rows, the pages gathered in a mask of the
        mapping's pages: the same pages, with temporaries bounded by the piece, not by the read."""
        n = max(len(hashes), 0 if rows is None else len(rows))
        if n <= PAGES_CHUNK:
            return self._pages_read(batch, hashes, rows, values, row_hashes)
        seen = np.zeros(self.os_pages(), dtype=bool)
        for i in range(0, n, PAGES_CHUNK):
            part = self._pages_read(batch, hashes[i:i + PAGES_CHUNK], None if rows is None else
                                    rows[i:i + PAGES_CHUNK], values, row_hashes)
            if part is None:
                return None
            if len(part) and part[-1] >= len(seen):  # (sorted: the last is the largest)
                seen = np.concatenate((seen, np.zeros(int(part[-1]) + 1 - len(seen), dtype=bool)))
            seen[part] = True
        return np.flatnonzero(seen).astype(np.int64)

    def _pages_read(self, batch: Any, hashes: np.ndarray, rows: np.ndarray | None = None, values: bool = True,
                    row_hashes: bool = True) -> np.ndarray | None:
        """The pages (``mmap.PAGESIZE``, numbered from the mapping's start; sorted, unique) a fenced seek of ``hashes``
        (ascending) in ``batch`` (this file's whole batch) reads, and then a read of rows ``rows`` (the rows found,
        ascending) of every column, weights and hashes; ``rows`` None: of the rows between the fence entries below
        and above each hash (where its rows are; located from the fence alone, no seek). The key hashes read are
        those from the fence block before each hash to one block past it (csrc/lookup.h). None when the seek does
        not go through a fence (a small batch gallops from its start) or a column's type is not located: the caller
        counts the whole file (spill.py invariant 12's cache accounting). ``values`` False: not the bytes of
        variable-width values, which only their offsets locate (reading those offsets would fault their pages one
        at a time: a prefetch leaves those bytes to the walk). ``row_hashes`` False: not the row hashes a batch keeps
        apart from its key hashes (a join's walk does not read them)."""
        kh = batch.key_hash
        n = len(kh)
        if batch._fx is None or n == 0:
            return None
        lo = np.maximum(np.searchsorted(self.fence, hashes, "left") - 1, 0) * FENCE_STEP
        right = np.searchsorted(self.fence, hashes, "right") * FENCE_STEP
        hi = np.minimum(right + FENCE_STEP + 2, n)
        if rows is None:  # a hash's rows lie between the fence entries below and above it: after the last entry
            rows, upto = lo, np.minimum(right, n)  # below it, before the first entry above it (row ``right``)
        else:
            rows, upto = np.asarray(rows, dtype=np.int64), None
        fixed = _row_ranges(batch, rows, self.base, upto, row_hashes)
        if fixed is None:
            return None
        starts, ends, varwidth = fixed
        addr = kh.ctypes.data - self.base
        starts.append(addr + lo * 8)
        ends.append(addr + hi * 8)
        if varwidth and len(rows) and values:
            vs, ve = _var_ranges(varwidth, rows, self.base, upto)
            starts.append(vs)
            ends.append(ve)
        return _sorted_unique(_pages(0, np.concatenate(starts), np.concatenate(ends), mmap.PAGESIZE))


def _row_ranges(batch: Any, rows: np.ndarray, base: int, hi: np.ndarray | None = None, row_hashes: bool = True
                ) -> tuple[list, list, list] | None:
    """The byte ranges (offsets from ``base``, a mapping's first byte) rows ``rows`` of ``batch`` (with ``hi``: the
    rows ``rows[i]`` to ``hi[i]`` excluded) occupy in its weights, hashes (its row hashes with ``row_hashes``) and
    columns (validity bits and values, or
    offsets of a variable-width column), and the variable-width columns (whose bytes :func:`_var_ranges` locates
    once their offsets may be read); None for a column of a type this does not locate."""
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    end = rows + 1 if hi is None else hi
    for a in (batch.zset.weights, batch.key_hash, batch._rh if row_hashes else None):
        if a is not None:
            starts.append(a.ctypes.data - base + rows * a.itemsize)
            ends.append(a.ctypes.data - base + end * a.itemsize)
    varwidth = []
    for col in batch.zset.data.columns:
        arr = col.chunk(0) if col.num_chunks == 1 else None
        kind = None if arr is None else _fixed_ranges(arr, rows, base, starts, ends, hi)
        if kind is None:
            return None
        if kind == "var":
            varwidth.append(arr)
    return starts, ends, varwidth


def _var_ranges(varwidth: list, rows: np.ndarray, base: int, hi: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges (offsets from ``base``) of the values of rows ``rows`` (to ``hi``, as :func:`_row_ranges`) of
    variable-width arrays ``varwidth`` (reads their offsets)."""
    starts, ends = [], []
    end = rows + 1 if hi is None else hi
    for arr in varwidth:
        bufs = arr.buffers()
        wide = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
        offs = np.frombuffer(bufs[1], dtype=np.int64 if wide else np.int32)
        at = bufs[2].address - base
        starts.append(at + offs[rows + arr.offset].astype(np.int64))
        ends.append(at + offs[end + arr.offset].astype(np.int64))
    return np.concatenate(starts), np.concatenate(ends)


def _sorted_unique(pages: np.ndarray) -> np.ndarray:
    """``np.unique(pages)`` for pages made of a few ascending runs (one per column and section, as
    :meth:`BatchFile.pages_read` makes them): a stable sort merges the runs (timsort: O(n log runs)), where
    ``np.unique``'s hash and sort took 4-12x as long on a 10M-row join step's ~20k pages."""
    if len(pages) < 2:
        return pages
    s = np.sort(pages, kind="stable")
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def _pages(arrow_off: int, starts: np.ndarray, ends: np.ndarray, page: int = PAGE) -> np.ndarray:
    """The pages of ``page`` bytes (of a section at ``arrow_off``) holding the file bytes [starts[i], ends[i])."""
    keep = ends > starts
    first = (starts[keep] - arrow_off) // page
    last = (ends[keep] - 1 - arrow_off) // page
    if len(first) == 0:
        return np.zeros(0, dtype=np.int64)
    span = last - first
    if int(span.max()) == 0:
        return first
    n = span + 1
    rep = np.repeat(first - np.concatenate(([0], np.cumsum(n)[:-1])), n)
    return rep + np.arange(int(n.sum()), dtype=np.int64)


def _fixed_ranges(arr: pa.Array, rows: np.ndarray, base: int, starts: list, ends: list,
                  hi: np.ndarray | None = None) -> str | None:
    """Append the file byte ranges rows ``rows`` of ``arr`` (read in place from a mapping at ``base``; with ``hi``,
    the rows ``rows[i]`` to ``hi[i]`` excluded) occupy in its validity bits and values (fixed width) or offsets
    (variable width: returns "var", the bytes they delimit are for the caller once the offsets are checked); None
    for a type this does not locate."""
    t = arr.type
    bufs = arr.buffers()
    pos = rows + arr.offset
    end = pos + 1 if hi is None else hi + arr.offset
    if bufs[0] is not None:
        starts.append(bufs[0].address - base + pos // 8)
        ends.append(bufs[0].address - base + (end + 7) // 8)
    if pa.types.is_boolean(t):
        starts.append(bufs[1].address - base + pos // 8)
        ends.append(bufs[1].address - base + (end + 7) // 8)
        return "fixed"
    if len(bufs) == 2 and pa.types.is_primitive(t) and t.bit_width % 8 == 0:
        w = t.bit_width // 8
        starts.append(bufs[1].address - base + pos * w)
        ends.append(bufs[1].address - base + end * w)
        return "fixed"
    if len(bufs) == 3 and (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
                           or pa.types.is_large_binary(t)):
        w = 8 if (pa.types.is_large_string(t) or pa.types.is_large_binary(t)) else 4
        starts.append(bufs[1].address - base + pos * w)
        ends.append(bufs[1].address - base + (end + 1) * w)
        return "var"
    return None


def _bad(path: str, what: str) -> CorruptionError:
    return CorruptionError(f"{path}: batch file damaged: {what}")


def _check_pages(path: str, mv: memoryview, arrow_off: int, alen: int, crcs: np.ndarray, pages: range) -> None:
    for i in pages:
        lo = arrow_off + i * PAGE
        if _crc(mv[lo:min(arrow_off + alen, lo + PAGE)]) != int(crcs[i]):
            raise _bad(path, f"page {i} of the Arrow section fails its CRC-32C")


def open_batch(path: str, verify: bool = False, advice: int | None = None, lazy: bool = False,
               sections: tuple[np.ndarray, np.ndarray] | None = None) -> BatchFile:
    """Map the batch file at ``path`` and read the batch in place (invariant 4: header, footer, page CRCs and the
    Arrow pages opening reads are checked; the fence and filter, copied into memory, too; every page with
    ``verify``). ``lazy`` (invariant 5): the fence and filter stay in the mapping, unchecked, and
    :attr:`BatchFile.checked` records what the reader still has to check (a file written before the section CRCs
    existed is checked whole instead). ``advice``: an ``mmap.MADV_*`` for the mapping (default MADV_RANDOM: a
    lookup wants its pages, not the kernel's read-ahead around them). ``sections``: the fence and filter this
    process just wrote to the file (:class:`InPlaceWrite`), kept as they are instead of read back and checked
    (invariant 8: opening then reads no section)."""
    from dbsp_core.zset import IndexedZSet, ZSet

    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        if size < HEADER.size + FOOTER.size:
            raise _bad(path, f"{size} bytes, shorter than a header and a footer")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    note_mapping(m, file_key(st))  # (invariant 9)
    if advice is None:
        advice = getattr(mmap, "MADV_RANDOM", None)
    if advice is not None:
        m.madvise(advice)
    mv = memoryview(m)
    try:
        magic, version, flags, aoff, alen, rows, crc_sec, filt_sec, hcrc = HEADER.unpack_from(mv, 0)
        if magic != BATCH_FILE_MAGIC:
            raise _bad(path, f"magic {magic!r}, not {BATCH_FILE_MAGIC!r}")
        if version == BATCH_FILE_GROUPED_VERSION and magic == BATCH_FILE_MAGIC:
            raise FormatVersionError(f"{path}: batch file format {version} (row groups) is read by pread, not mapped: "
                                     f"open it with dbsp_core.trace.groupedfile.open_grouped (this build's spill "
                                     f"store reads format {BATCH_FILE_VERSION} only)")
        if version != BATCH_FILE_VERSION:
            raise FormatVersionError(f"{path}: batch file format {version}; this build reads {BATCH_FILE_VERSION} "
                                     f"and {BATCH_FILE_GROUPED_VERSION} (dbsp_core.trace.groupedfile)")
        if _crc(mv[:60]) != hcrc:
            raise _bad(path, "the header fails its CRC-32C")
        end = size - FOOTER.size
        fmagic, fversion, k, fence_off, nfence, bloom_off, nbloom, crc_off, whole, fcrc = FOOTER.unpack_from(mv, end)
        if fmagic != BATCH_FILE_FOOTER_MAGIC or _crc(mv[end:end + 60]) != fcrc or fversion != version:
            raise _bad(path, "the footer fails its magic, version or CRC-32C")
        npages = (alen + PAGE - 1) // PAGE
        if not (aoff + alen <= fence_off <= bloom_off <= crc_off and crc_off + 4 * npages <= end
                and fence_off + 8 * nfence == bloom_off and bloom_off + 8 * nbloom == crc_off):
            raise _bad(path, "its section offsets do not fit the file")
        sectioned = bool(flags & FLAG_SECTION_CRCS)
        if sectioned and _crc(mv[crc_off:crc_off + 4 * npages]) != crc_sec:
            raise _bad(path, "its page CRCs fail their CRC-32C")
        crcs = np.frombuffer(mv, dtype="<u4", count=npages, offset=crc_off).copy()
        lazy = lazy and sectioned and not verify
        if sections is not None and not verify and len(sections[0]) == nfence and len(sections[1]) == nbloom:
            fence, bloom = sections  # what was written, in memory already (not read back)
            lazy = False
        elif lazy:  # in place, checked before use (invariant 5)
            fence = np.frombuffer(m, dtype="<u8", count=nfence, offset=fence_off)
            bloom = np.frombuffer(m, dtype="<u8", count=nbloom, offset=bloom_off)
        else:
            if sectioned and _crc(mv[fence_off:crc_off]) != filt_sec:
                raise _bad(path, "its fence and Bloom filter fail their CRC-32C")
            fence = np.frombuffer(mv, dtype="<u8", count=nfence, offset=fence_off).astype(np.uint64)
            bloom = np.frombuffer(mv, dtype="<u8", count=nbloom, offset=bloom_off).astype(np.uint64)
        if verify or (lazy is False and not sectioned):
            if _crc(mv[:end]) != whole:
                raise _bad(path, "the whole-file CRC-32C does not match")
            if verify:
                _check_pages(path, mv, aoff, alen, crcs, range(npages))
        opened = sorted({0, max(0, npages - 1)})  # the Arrow footer and schema pages, which opening reads
        if not verify:
            _check_pages(path, mv, aoff, alen, crcs, opened)
        buf = pa.py_buffer(m)
        rb = pa.ipc.open_file(buf[aoff:aoff + alen]).get_batch(0)
        if rb.num_rows != rows:
            raise _bad(path, f"the Arrow record batch holds {rb.num_rows} rows, the header {rows}")
        meta = rb.schema.metadata or {}
        key = tuple(json.loads(meta[b"dbsp.key"]))
        rh_mode = meta.get(b"dbsp.row_hash", b"0").decode()
        ndata = rb.num_columns - (3 if rh_mode == "1" else 2)
        checked = None
        if lazy:  # building the batch validates each column's first and last offsets: their pages first
            checked = np.zeros(npages + 1, dtype=bool)
            checked[opened] = True
            starts: list[np.ndarray] = []
            ends: list[np.ndarray] = []
            ends_rows = np.array([0, max(0, rows - 1)], dtype=np.int64)
            if rows and any(_fixed_ranges(c, ends_rows, buf.address, starts, ends) is None for c in rb.columns[:ndata]):
                todo = np.arange(npages, dtype=np.int64)  # a type whose pages this does not locate: all of them
            else:
                todo = np.unique(_pages(aoff, np.concatenate(starts), np.concatenate(ends))) if starts else \
                    np.zeros(0, dtype=np.int64)
            todo = todo[~checked[todo]]
            _check_pages(path, mv, aoff, alen, crcs, todo.tolist())
            checked[todo] = True
    finally:
        mv.release()
    data = pa.Table.from_batches([pa.RecordBatch.from_arrays(rb.columns[:ndata],
                                                             schema=pa.schema(list(rb.schema)[:ndata]))])
    w = rb.column(ndata).to_numpy(zero_copy_only=True)
    kh = rb.column(ndata + 1).to_numpy(zero_copy_only=True)
    ix = IndexedZSet._make(ZSet._make(data, w), key, kh)
    ix._rh = kh if rh_mode == "key" else (rb.column(ndata + 2).to_numpy(zero_copy_only=True) if rh_mode == "1" else None)
    if len(fence) and rows >= IndexedZSet.FENCE_MIN:
        ix._fx = fence  # kernels seek through it without reading the key hashes (csrc/lookup.h)
    return BatchFile(path, size, rows, m, aoff, alen, fence, [bloom], k, crcs, ix, checked, buf.address,
                     (fence_off, crc_off, filt_sec))


def verify(path: str) -> int:
    """Check every checksum of the format-1 batch file at ``path`` (invariant 4); returns its rows, or raises
    CorruptionError naming what is damaged (FormatVersionError for a format-2 file:
    :func:`dbsp_core.trace.groupedfile.verify` checks either format)."""
    return open_batch(path, verify=True).rows
