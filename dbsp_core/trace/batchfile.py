"""The batch file: one trace batch written once to an immutable, checksummed file whose columns are an Arrow IPC file
that is memory-mapped and read in place, with a Bloom filter and a fence of its key hashes for lookups.

Format (version 1, ``BATCH_FILE_MAGIC``; listed in dbsp_core/storage/formats.py), all integers little-endian::

    [0, 64)          header: magic "DBSPBTCH" (8) | format version u32 | flags u32 (0) | arrow offset u64 (= 64) |
                     arrow length u64 | rows u64 | 20 bytes zero | CRC-32C of bytes 0..59 u32
    [64, 64 + A)     an Arrow IPC file (starts and ends with ``ARROW1``), byte for byte what any Arrow reader reads:
                     one record batch of the batch's data columns in index order, then ``__dbsp_weight`` (int64),
                     ``__dbsp_key_hash`` (uint64, ascending) and, when the batch keeps row hashes apart from its
                     key hashes, ``__dbsp_row_hash`` (uint64); schema metadata ``dbsp.key`` (JSON list of key
                     columns) and ``dbsp.row_hash`` ("0", "1": a column, "key": the key hashes are the row hashes).
                     No compression: every buffer is 8-byte aligned and read in place through mmap(2) or pread(2)
    [.., +8F)        fence: every 64th key hash (csrc/lookup.h's fence), so a seek needs no scan of the key hashes
    [.., +8B)        Bloom filter: B u64 words (a power of two), blocked: K bits in one word per key hash
                     (``bloom_build``)
    [.., +4P)        CRC-32C of each ``PAGE``-byte page of the Arrow file (the last page may be short)
    [EOF-64, EOF)    footer: magic "DBSPBTFT" | version u32 | K u32 | fence offset u64 | F u64 | bloom offset u64 |
                     B u64 | page-CRC offset u64 | CRC-32C of bytes [0, EOF-64) u32 | CRC-32C of footer bytes 0..55 u32

Invariants (enforced here; checked by :func:`verify`):
  1. A batch file is written whole to ``<name>.tmp``, fsynced, renamed to its name and its directory fsynced
     (csrc/smallfile.c through the VFS, so the fault-injecting VFS covers it); after that it never changes. A file
     under its final name is therefore complete, and its name can be handed to a checkpoint or an upload as is.
  2. Its rows are a consolidated batch in index order (trace invariant 1): key hashes ascending, so the fence and
     a key hash locate the rows of a key, and the rows of a shard are one range (trace invariant 7).
  3. The Bloom filter holds every key hash of the batch: a key hash it rejects has no row, so a lookup skips the
     batch without touching a page of it.
  4. Every byte is covered by a checksum: header and footer by their own, each Arrow page by its page CRC, the
     whole file by the footer's. :func:`open_batch` checks header, footer and the sections it keeps in memory
     (fence, filter, page CRCs) and the Arrow pages holding its schema and footer; with ``verify=True`` (a file not
     written by this process: one a checkpoint names, one downloaded) every page and the whole-file CRC. Pages read
     later through the mapping are not checked again: the file is immutable and was checked when opened.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.storage.formats import BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_MAGIC, BATCH_FILE_VERSION

__all__ = ["BatchFile", "write_batch", "open_batch", "verify", "bloom_build", "bloom_may_contain",
           "BATCH_FILE_MAGIC", "BATCH_FILE_FOOTER_MAGIC", "BATCH_FILE_VERSION", "PAGE"]

PAGE = 65536  # bytes per page CRC
HEADER = struct.Struct("<8sIIQQQ20xI")  # 64 bytes
FOOTER = struct.Struct("<8sIIQQQQQII")  # 64 bytes
assert HEADER.size == 64 and FOOTER.size == 64
BLOOM_BITS_PER_KEY = 10  # ~1.5-2% false positives with K = 6 bits in one word (blocked)
BLOOM_K = 6
FENCE_STEP = 64  # csrc/lookup.h: a fence holds every 64th key hash

WEIGHT_COL, KEY_HASH_COL, ROW_HASH_COL = "__dbsp_weight", "__dbsp_key_hash", "__dbsp_row_hash"


def _crc(data: Any, crc: int = 0) -> int:
    from dbsp_core import _storage

    return _storage.crc32c(data, crc)


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


def bloom_build(hashes: np.ndarray, k: int = BLOOM_K) -> np.ndarray:
    """A blocked Bloom filter (uint64 words, a power of two of them, at most 2**28) holding every hash of
    ``hashes``, ascending (invariant 3): word ``h >> (64 - log2 words)`` has bits ``(h >> 6 i) mod 64`` set, i < k.

    >>> f = bloom_build(np.sort(np.array([1, 2, 3], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)))
    >>> bool(bloom_may_contain(f, np.array([2], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[0])
    True
    """
    n = max(1, len(hashes))
    words = min(1 << 28, 1 << max(0, (n * BLOOM_BITS_PER_KEY + 63) // 64 - 1).bit_length())
    f = np.zeros(words, dtype=np.uint64)
    if len(hashes):
        word, mask = _bloom_parts(hashes, words, k)
        starts = np.concatenate(([0], np.flatnonzero(word[1:] != word[:-1]) + 1))
        if len(word) > 1 and bool((word[1:] < word[:-1]).any()):
            raise ValueError("bloom_build: key hashes must ascend")
        f[word[starts]] = np.bitwise_or.reduceat(mask, starts)
    return f


def bloom_may_contain(f: np.ndarray, hashes: np.ndarray, k: int = BLOOM_K) -> np.ndarray:
    """Per hash: False when the filter ``f`` proves it absent, True when it may be present."""
    if len(hashes) == 0:
        return np.zeros(0, dtype=bool)
    word, mask = _bloom_parts(hashes, len(f), k)
    return (f[word] & mask) == mask


def _fence(kh: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(kh[::FENCE_STEP])


def write_batch(path: str, batch: Any, vfs: str = "posix", sync: bool = True) -> int:
    """Write ``batch`` (an IndexedZSet) as a batch file at ``path`` (invariant 1: temporary file, fsync, rename,
    directory fsync, all through ``vfs``); returns the file's size. One buffer is built in C++ (the Arrow IPC
    writer) and numpy (filter, fence, CRCs): no per-row Python. ``sync=False`` (scratch files of a pipeline
    without storage, which no crash needs to find again) writes and renames without fsync."""
    from dbsp_core import _storage

    z = batch.zset
    data = z.data.combine_chunks()
    kh = np.ascontiguousarray(batch.key_hash, dtype=np.uint64)
    rh = batch._rh
    rh_mode = "0" if rh is None else ("key" if rh is kh or rh is batch.key_hash else "1")
    cols = list(data.columns) + [pa.array(np.ascontiguousarray(z.weights, dtype=np.int64)), pa.array(kh)]
    names = list(data.schema.names) + [WEIGHT_COL, KEY_HASH_COL]
    fields = list(data.schema) + [pa.field(WEIGHT_COL, pa.int64(), False), pa.field(KEY_HASH_COL, pa.uint64(), False)]
    if rh_mode == "1":
        cols.append(pa.array(np.ascontiguousarray(rh, dtype=np.uint64)))
        names.append(ROW_HASH_COL)
        fields.append(pa.field(ROW_HASH_COL, pa.uint64(), False))
    schema = pa.schema(fields, metadata={b"dbsp.key": json.dumps(list(batch.key)).encode(), b"dbsp.row_hash": rh_mode.encode()})
    rb = pa.RecordBatch.from_arrays([c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in cols],
                                    schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_batch(rb)
    arrow = sink.getvalue()
    alen = arrow.size
    fence = _fence(kh)
    bloom = bloom_build(kh)
    npages = (alen + PAGE - 1) // PAGE
    fence_off = _pad8(64 + alen)
    bloom_off = fence_off + 8 * len(fence)
    crc_off = bloom_off + 8 * len(bloom)
    size = _pad8(crc_off + 4 * npages) + FOOTER.size
    buf = bytearray(size)
    mv = memoryview(buf)
    mv[64:64 + alen] = memoryview(arrow).cast("B")
    mv[fence_off:bloom_off] = fence.tobytes()
    mv[bloom_off:crc_off] = bloom.tobytes()
    crcs = np.array([_crc(mv[64 + i * PAGE:64 + min(alen, (i + 1) * PAGE)]) for i in range(npages)], dtype="<u4")
    mv[crc_off:crc_off + 4 * npages] = crcs.tobytes()
    head = HEADER.pack(BATCH_FILE_MAGIC, BATCH_FILE_VERSION, 0, 64, alen, len(batch), 0)
    mv[0:64] = HEADER.pack(BATCH_FILE_MAGIC, BATCH_FILE_VERSION, 0, 64, alen, len(batch), _crc(head[:60]))
    end = size - FOOTER.size
    whole = _crc(mv[:end])
    foot = FOOTER.pack(BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_VERSION, BLOOM_K, fence_off, len(fence), bloom_off,
                       len(bloom), crc_off, whole, 0)
    mv[end:] = FOOTER.pack(BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_VERSION, BLOOM_K, fence_off, len(fence), bloom_off,
                           len(bloom), crc_off, whole, _crc(foot[:60]))
    del mv
    if sync:
        _storage.file_replace(path, buf, vfs)
    else:
        with open(path + ".tmp", "wb") as out:
            out.write(buf)
        os.replace(path + ".tmp", path)
    return size


class BatchFile(NamedTuple):
    """An open batch file: its mapping and what is kept in memory of it (fence, filter, page CRCs, ~1.4 bytes per
    row), and the batch read in place from the mapping (its buffers are the file's pages)."""

    path: str
    size: int
    rows: int
    map: mmap.mmap
    arrow_off: int
    arrow_len: int
    fence: np.ndarray
    bloom: np.ndarray
    bloom_k: int
    page_crcs: np.ndarray
    batch: Any  # IndexedZSet over the mapping

    def may_contain(self, hashes: np.ndarray) -> np.ndarray:
        """Per key hash: whether the batch may hold it (the Bloom filter, invariant 3)."""
        return bloom_may_contain(self.bloom, hashes, self.bloom_k)

    def memory_bytes(self) -> int:
        """Bytes this open file keeps in memory besides the mapping (fence, filter, page CRCs)."""
        return int(self.fence.nbytes + self.bloom.nbytes + self.page_crcs.nbytes)


def _bad(path: str, what: str) -> CorruptionError:
    return CorruptionError(f"{path}: batch file damaged: {what}")


def _check_pages(path: str, mv: memoryview, arrow_off: int, alen: int, crcs: np.ndarray, pages: range) -> None:
    for i in pages:
        lo = arrow_off + i * PAGE
        if _crc(mv[lo:min(arrow_off + alen, lo + PAGE)]) != int(crcs[i]):
            raise _bad(path, f"page {i} of the Arrow section fails its CRC-32C")


def open_batch(path: str, verify: bool = False, advice: int | None = None) -> BatchFile:
    """Map the batch file at ``path`` and read the batch in place (invariant 4: header, footer, fence, filter and
    page CRCs are checked; every page too with ``verify``). ``advice``: an ``mmap.MADV_*`` for the mapping (default
    MADV_RANDOM: a lookup wants its pages, not the kernel's read-ahead around them)."""
    from dbsp_core.zset import IndexedZSet, ZSet

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size + FOOTER.size:
            raise _bad(path, f"{size} bytes, shorter than a header and a footer")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if advice is None:
        advice = getattr(mmap, "MADV_RANDOM", None)
    if advice is not None:
        m.madvise(advice)
    mv = memoryview(m)
    try:
        magic, version, _flags, aoff, alen, rows, hcrc = HEADER.unpack_from(mv, 0)
        if magic != BATCH_FILE_MAGIC:
            raise _bad(path, f"magic {magic!r}, not {BATCH_FILE_MAGIC!r}")
        if version != BATCH_FILE_VERSION:
            raise FormatVersionError(f"{path}: batch file format {version}; this build reads {BATCH_FILE_VERSION}")
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
        fence = np.frombuffer(mv, dtype="<u8", count=nfence, offset=fence_off).astype(np.uint64)
        bloom = np.frombuffer(mv, dtype="<u8", count=nbloom, offset=bloom_off).astype(np.uint64)
        crcs = np.frombuffer(mv, dtype="<u4", count=npages, offset=crc_off).copy()
        if verify:
            if _crc(mv[:end]) != whole:
                raise _bad(path, "the whole-file CRC-32C does not match")
            _check_pages(path, mv, aoff, alen, crcs, range(npages))
        else:  # the Arrow footer and schema pages, which opening reads
            _check_pages(path, mv, aoff, alen, crcs, sorted({0, max(0, npages - 1)}))
        rb = pa.ipc.open_file(pa.py_buffer(m)[aoff:aoff + alen]).get_batch(0)
    finally:
        mv.release()
    if rb.num_rows != rows:
        raise _bad(path, f"the Arrow record batch holds {rb.num_rows} rows, the header {rows}")
    meta = rb.schema.metadata or {}
    key = tuple(json.loads(meta[b"dbsp.key"]))
    rh_mode = meta.get(b"dbsp.row_hash", b"0").decode()
    ndata = rb.num_columns - (3 if rh_mode == "1" else 2)
    data = pa.Table.from_batches([pa.RecordBatch.from_arrays(rb.columns[:ndata],
                                                             schema=pa.schema(list(rb.schema)[:ndata]))])
    w = rb.column(ndata).to_numpy(zero_copy_only=True)
    kh = rb.column(ndata + 1).to_numpy(zero_copy_only=True)
    ix = IndexedZSet._make(ZSet._make(data, w), key, kh)
    ix._rh = kh if rh_mode == "key" else (rb.column(ndata + 2).to_numpy(zero_copy_only=True) if rh_mode == "1" else None)
    if len(fence) and rows >= IndexedZSet.FENCE_MIN:
        ix._fx = fence  # kernels seek through it without reading the key hashes (csrc/lookup.h)
    return BatchFile(path, size, rows, m, aoff, alen, fence, bloom, k, crcs, ix)


def verify(path: str) -> int:
    """Check every checksum of the batch file at ``path`` (invariant 4); returns its rows, or raises
    CorruptionError naming what is damaged."""
    return open_batch(path, verify=True).rows
