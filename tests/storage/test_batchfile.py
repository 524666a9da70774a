"""The batch file format: a round trip of batches of every column kind, the Bloom filter and fence kept beside the rows, a damaged byte in any section refused by its checksum, and its one streamed write path, every operation of which the fault VFS sees, crashes or fails."""

from __future__ import annotations

import errno
import os
import random
import struct
import tempfile

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet, _zset
from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.trace.batchfile import (BLOOM_K, FOOTER, HEADER, _bloom_parts, bloom_build, bloom_may_contain,
                                       open_batch, verify, write_batch)

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _batch(rng: np.random.Generator, n: int, key=("k",)):
    k = rng.integers(0, max(1, n // 3), n)
    t = pa.table({"k": k, "s": pa.array([None if x % 5 == 0 else "x" * int(x % 9) for x in k], pa.utf8()),
                  "f": pa.array(rng.random(n)), "b": pa.array(rng.random(n) < 0.5),
                  "d": pa.array(k.astype("datetime64[us]"))})
    return ZSet.from_arrow(t, weights=rng.choice([1, 3, -2], n)).consolidate().index_by(list(key))


@pytest.mark.parametrize("n, key", [(1, ("k",)), (700, ("k",)), (9000, ("k", "s")), (5000, ("k", "s", "f", "b", "d"))])
def test_round_trip(n: int, key) -> None:
    rng = np.random.default_rng(SEED + n)
    b = _batch(rng, n, key)
    b._row_hashes()
    path = os.path.join(tempfile.mkdtemp(), "x.batch")
    size = write_batch(path, b)
    assert size == os.path.getsize(path) and size % 8 == 0
    f = open_batch(path, verify=True)
    got = f.batch
    assert got.key == b.key and got.schema.equals(b.schema) and f.rows == len(b)
    assert got.zset.to_dict() == b.zset.to_dict()
    assert np.array_equal(got.key_hash, b.key_hash) and np.array_equal(got._row_hashes(), b._row_hashes())
    assert np.array_equal(f.fence, _zset.fence(b.key_hash))  # csrc/lookup.h's fence, read without a scan
    assert bloom_may_contain(f.bloom, b.key_hash).all()  # no false negative (invariant 3)
    absent = np.arange(1, 2001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    absent = absent[~np.isin(absent, b.key_hash)]
    assert bloom_may_contain(f.bloom, absent).mean() < 0.05  # ~1% false positives at 10 bits per key
    # the Arrow section is a standard Arrow IPC file
    with open(path, "rb") as fh:
        raw = fh.read()
    _, _, _, aoff, alen, *_ = HEADER.unpack_from(raw, 0)
    rb = pa.ipc.open_file(pa.py_buffer(raw[aoff:aoff + alen])).get_batch(0)
    assert rb.num_rows == len(b) and rb.schema.names[:len(b.schema)] == b.schema.names


def _damage(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_every_section_is_checked() -> None:
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 20000)
    d = tempfile.mkdtemp()
    src = os.path.join(d, "good.batch")
    size = write_batch(src, b)
    with open(src, "rb") as fh:
        raw = fh.read()
    _, _, _, aoff, alen, *_ = HEADER.unpack_from(raw, 0)
    _, _, _, fence_off, nfence, bloom_off, nbloom, crc_off, _, _ = FOOTER.unpack_from(raw, size - FOOTER.size)
    places = {"header": 20, "arrow first page": aoff + 100, "arrow middle page": aoff + alen // 2,
              "arrow last page": aoff + alen - 3, "fence": fence_off + 8, "bloom": bloom_off + 8 * (nbloom // 2),
              "page crcs": crc_off + 1, "footer": size - 30}
    tried = 0
    for what, off in places.items():
        path = os.path.join(d, f"{what}.batch")
        with open(path, "wb") as fh:
            fh.write(raw)
        _damage(path, off)
        with pytest.raises(CorruptionError, match="batch file damaged"):
            verify(path)
        tried += 1
    assert tried == len(places)
    with open(src, "r+b") as fh:  # a newer format is refused by its version, not read
        head = bytearray(raw[:64])
        struct.pack_into("<I", head, 8, 2)
        fh.write(bytes(head))
    with pytest.raises((FormatVersionError, CorruptionError)):
        verify(src)


def test_a_short_file_is_refused() -> None:
    path = os.path.join(tempfile.mkdtemp(), "short.batch")
    with open(path, "wb") as fh:
        fh.write(b"DBSPBTCH" + b"\0" * 40)
    with pytest.raises(CorruptionError):
        open_batch(path)


def _wide_batch(n: int):
    """``n`` rows of an int64 key and a 100-byte string, indexed, with row hashes: about 130 bytes a row."""
    pad = pa.array(np.full(n, "x" * 100, dtype=object), pa.string())
    b = ZSet.from_arrow(pa.table({"k": np.arange(n, dtype=np.int64), "pad": pad})).index_by(["k"])
    b._row_hashes()
    return b


def test_a_durable_batch_file_over_64_mib_is_written() -> None:
    """A durable store's batch files go through the VFS's atomic replace, which refused more than 64 MiB (the bound
    of a small file's read): a 10M-row join's first big merge output failed to spill."""
    n = 600_000  # k int64 + 100-byte strings + offsets + weight + key hash + row hash: about 80 MiB
    b = _wide_batch(n)
    path = os.path.join(tempfile.mkdtemp(), "big.batch")
    size = write_batch(path, b, sync=True)
    assert size > 64 << 20 and os.path.getsize(path) == size
    assert verify(path) == n
    os.unlink(path)


@pytest.mark.parametrize("vfs", ["posix", "fault"])
def test_a_durable_batch_file_is_streamed_not_built_in_memory(vfs: str) -> None:
    """A durable store's spill (``sync=True``) built the whole file's image in a bytearray: through the posix VFS
    until 8184d3c (the spill of a 100M-row state's merged level, 5 GB, took 6 GB of RSS under a 64 MiB budget), and
    through the fault VFS after it, so the crash tests no longer ran the path production runs. Both stream it now,
    through one path; the fault VFS's own copies of unsynced writes (its model of a crash, C memory) are not the
    writer's. Posix and fault write the same bytes."""
    import tracemalloc

    from dbsp_core.storage import FaultInjector

    b = _wide_batch(300_000)  # about 40 MiB of file
    d = tempfile.mkdtemp()
    path = os.path.join(d, "big.batch")
    FaultInjector.arm()
    tracemalloc.start()
    try:
        size = write_batch(path, b, vfs, sync=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        FaultInjector.disarm()
    assert size > 32 << 20 and os.path.getsize(path) == size
    assert peak < size // 4, f"writing a {size >> 20} MiB file held {peak >> 20} MiB of Python memory at its peak"
    assert os.listdir(d) == ["big.batch"]
    assert verify(path) == len(b)
    got = open_batch(path, verify=True).batch
    assert got.zset.to_dict() == b.zset.to_dict() and np.array_equal(got.key_hash, b.key_hash)
    other = os.path.join(d, "other.batch")
    write_batch(other, b, "fault" if vfs == "posix" else "posix", sync=True)
    with open(path, "rb") as x, open(other, "rb") as y:
        assert x.read() == y.read()
    os.unlink(path)
    os.unlink(other)


def _write_ops(b, path: str, sync: bool) -> list[tuple[str, str]]:
    """The VFS operations (name, path) ``write_batch`` makes, read off the fault VFS: a crash at operation n names
    it in its error. Leaves ``path``'s directory empty."""
    import re

    from dbsp_core.errors import StorageError
    from dbsp_core.storage import FaultInjector

    FaultInjector.arm()
    write_batch(path, b, "fault", sync=sync)
    n = FaultInjector.ops()
    os.unlink(path)
    ops = []
    for i in range(1, n + 1):
        FaultInjector.arm(crash_at=i, mode="keep")
        with pytest.raises(StorageError) as e:
            write_batch(path, b, "fault", sync=sync)
        FaultInjector.disarm()
        m = re.search(r"(\w+(?: directory)?) (\S+): simulated crash at operation (\d+)", str(e.value))
        assert m and int(m.group(3)) == i, str(e.value)
        ops.append((m.group(1), m.group(2)))
        for x in os.listdir(os.path.dirname(path)):
            os.unlink(os.path.join(os.path.dirname(path), x))
    return ops


@pytest.mark.parametrize("sync", [True, False])
def test_a_batch_file_write_makes_every_io_operation_through_the_vfs(sync: bool) -> None:
    """The streamed write went around the VFS (os.pwrite, os.fsync, os.replace), and the fault VFS saw one whole
    image written instead: it now sees each operation, in production's order: the temporary file created and
    truncated, the Arrow file's pieces (at most STREAM_CHUNK each), the sections, the header, the footer (its
    whole-file CRC combined, not read back), then (``sync``) its fsync, the rename and (``sync``) the directory's
    fsync."""
    from dbsp_core.trace.batchfile import STREAM_CHUNK

    b = _wide_batch(70_000)  # about 9 MiB: three pieces of its string column's values
    d = tempfile.mkdtemp()
    path = os.path.join(d, "x.batch")
    ops = _write_ops(b, path, sync)
    names = [o for o, _ in ops]
    size = write_batch(path, b, "posix", sync=sync)
    tail = (["fsync", "rename", "fsync directory"] if sync else ["rename"])
    writes = len(names) - 2 - 1 - len(tail)
    assert names == ["open", "truncate"] + ["pwrite"] * writes + ["pwrite"] + tail, names
    assert writes >= 2 + -(-size // STREAM_CHUNK), names  # the pieces, then the sections and the header
    assert all(p == path + ".tmp" for o, p in ops if o != "fsync directory")
    assert [p for o, p in ops if o == "fsync directory"] == ([d] if sync else [])
    os.unlink(path)


@pytest.mark.parametrize("modes", [("drop", "chaos"),
                                   pytest.param(("keep", "drop", "tear", "reorder", "chaos"), marks=pytest.mark.slow)])
def test_a_crash_at_every_io_operation_of_a_batch_file_write_leaves_no_file_or_the_whole_file(modes) -> None:
    """A crash at any operation of a durable batch file's write, with any damage to its unsynced writes, leaves no
    file under its name or the whole file (batch file invariant 1): never a prefix or a mix. A temporary file may
    remain (the store's sweep deletes it). Counts and prints the crash points tried."""
    from dbsp_core.errors import StorageError
    from dbsp_core.storage import FaultInjector

    b = _wide_batch(70_000)
    want = b.zset.to_dict()
    d = tempfile.mkdtemp()
    path = os.path.join(d, "x.batch")
    FaultInjector.arm()
    write_batch(path, b, "fault", sync=True)
    n = FaultInjector.ops()
    os.unlink(path)
    tried = whole = 0
    for i in range(1, n + 1):
        for mode in modes:
            FaultInjector.arm(crash_at=i, mode=mode, seed=SEED + i)
            with pytest.raises(StorageError, match="simulated crash"):
                write_batch(path, b, "fault", sync=True)
            assert FaultInjector.crashed()
            FaultInjector.disarm()
            if os.path.exists(path):
                assert verify(path) == len(b), (i, mode, SEED)
                assert open_batch(path).batch.zset.to_dict() == want, (i, mode, SEED)
                whole += 1
            assert set(os.listdir(d)) <= {"x.batch", "x.batch.tmp"}, os.listdir(d)
            for x in os.listdir(d):
                os.unlink(os.path.join(d, x))
            tried += 1
    assert tried == n * len(modes) and n > 10
    print(f"\n[batch file crash] {n} I/O operations x {len(modes)} modes = {tried} crashes, {whole} left the whole "
          f"file, 0 a partial one (DBSP_TEST_SEED={SEED})")


def test_a_filter_is_built_a_piece_at_a_time_and_equals_one_built_at_once() -> None:
    """bloom_build held temporaries of about 40 bytes per key hash of the batch it filtered (words, masks, shifts,
    run starts): spilling a merged level of millions of rows took hundreds of MiB beyond the budget, growing with
    the state (Nexmark q20's overhead over its limit doubled from 2M to 20M events). It works a piece at a time
    now; the filter is the same bits as the reference, every hash ORed into its word (``np.bitwise_or.at``)."""
    import tracemalloc

    rng = np.random.default_rng(SEED)
    n = 4_000_000
    hashes = np.sort(rng.integers(0, 2**64, n, dtype=np.uint64))
    hashes[1000:1010] = hashes[1000]  # duplicate key hashes (one key's rows) are one entry of the filter
    tracemalloc.start()
    try:
        f = bloom_build(hashes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = np.zeros(len(f), dtype=np.uint64)
    word, mask = _bloom_parts(hashes, len(f), BLOOM_K)
    np.bitwise_or.at(want, word, mask)
    assert np.array_equal(f, want)
    assert bloom_may_contain(f, hashes).all()
    assert peak < f.nbytes + 4 * n, f"a filter of {f.nbytes >> 20} MiB for {n:,} hashes took {peak >> 20} MiB"
    with pytest.raises(ValueError, match="ascend"):  # across pieces too: the first hash of the second piece
        bad = hashes.copy()
        bad[1 << 18] = 0
        bloom_build(bad)


@pytest.mark.parametrize("sync", [True, False])
def test_a_full_disk_while_a_batch_file_streams_is_a_storage_error_naming_it(sync: bool) -> None:
    """The streamed write (a scratch file, and since 8184d3c a durable one) let a raw OSError out of os.pwrite; it
    is a StorageError naming the file and what to do, and leaves no temporary file behind, whichever write of it
    finds the disk full (ENOSPC injected by the fault VFS at each one in turn)."""
    from dbsp_core.errors import StorageError
    from dbsp_core.storage import FaultInjector

    b = _wide_batch(50_000)
    d = tempfile.mkdtemp()
    path = os.path.join(d, "full.batch")
    ops = _write_ops(b, path, sync)
    at = [i for i, (o, _) in enumerate(ops, start=1) if o == "pwrite"]
    assert len(at) >= 3
    for i in at:
        FaultInjector.arm(error_at=i, error="ENOSPC")
        try:
            with pytest.raises(StorageError, match="full.batch.*spill_dir") as e:
                write_batch(path, b, "fault", sync=sync)
            assert FaultInjector.ops() >= i  # the write was under way when the disk filled
        finally:
            FaultInjector.disarm()
        assert e.value.errno == errno.ENOSPC
        assert os.listdir(d) == []


def test_an_io_error_at_any_operation_of_a_batch_file_write_leaves_no_temporary_file() -> None:
    """An I/O error (EIO, injected by the fault VFS) at any operation of a durable batch file's write is a
    StorageError naming the file, and leaves no temporary file: one at the commit's fsync or rename left it (the
    writer was gone, so giving it up removed nothing). After the rename (the directory's fsync failing), the file
    is whole under its name; before it, no file is."""
    from dbsp_core.errors import StorageError
    from dbsp_core.storage import FaultInjector

    b = _wide_batch(50_000)
    d = tempfile.mkdtemp()
    path = os.path.join(d, "eio.batch")
    ops = _write_ops(b, path, True)
    renamed = [o for o, _ in ops].index("rename") + 1
    for i in range(1, len(ops) + 1):
        FaultInjector.arm(error_at=i, error="EIO")
        try:
            with pytest.raises(StorageError, match="eio.batch") as e:
                write_batch(path, b, "fault", sync=True)
        finally:
            FaultInjector.disarm()
        assert e.value.errno == errno.EIO, (i, ops[i - 1], e.value)
        assert os.listdir(d) == (["eio.batch"] if i > renamed else []), (i, ops[i - 1], os.listdir(d))
        if i > renamed:
            assert verify(path) == len(b)
            os.unlink(path)


def test_the_pages_a_seek_reads_are_those_of_np_unique() -> None:
    """BatchFile.pages_read's page numbers come from a few ascending runs (one per column and section); they are
    made sorted and unique by a stable sort of those runs instead of np.unique (2-4 ms of a 10M-row join step): the
    same numbers, for runs that overlap, repeat and are empty, as np.unique gives."""
    from dbsp_core.trace.batchfile import _sorted_unique

    rng = np.random.default_rng(SEED)
    for _ in range(50):
        runs = [np.sort(rng.integers(0, rng.integers(1, 5000), rng.integers(0, 3000))) for _ in range(rng.integers(1, 9))]
        pages = np.concatenate(runs).astype(np.int64) if runs else np.zeros(0, np.int64)
        got = _sorted_unique(pages)
        assert got.dtype == np.int64 and np.array_equal(got, np.unique(pages)), (len(pages), len(got))


def test_the_pages_a_large_seek_reads_are_located_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """BatchFile.pages_read locates the pages of many hashes (and rows) PAGES_CHUNK at a time, gathered in a mask
    of the mapping's pages, so its temporaries follow the piece (a 1M-row step's accounting held ~450 MiB of them):
    the same pages as one pass over all of them, for hashes found and not, with and without rows, a string column
    included. Fails if a piece is dropped or misplaced (e.g. the loop stops after the first piece)."""
    import dbsp_core.trace.batchfile as bf

    rng = np.random.default_rng(SEED)
    b = _batch(rng, 60_000, ("k", "s"))
    b._row_hashes()
    path = os.path.join(tempfile.mkdtemp(), "p.batch")
    write_batch(path, b)
    f = open_batch(path)
    got = f.batch
    assert got._fence() is not None
    kh = np.asarray(got.key_hash)
    hashes = np.sort(np.concatenate((rng.choice(kh, 3000), rng.integers(0, 2**63, 2000).astype(np.uint64))))
    rows = np.sort(rng.choice(len(got), 4000, replace=False)).astype(np.int64)
    monkeypatch.setattr(bf, "PAGES_CHUNK", 700)
    for r in (None, rows):
        whole = f._pages_read(got, hashes, r)
        assert whole is not None and len(whole) > 10
        pieces = f.pages_read(got, hashes, r)
        assert pieces.dtype == np.int64 and np.array_equal(pieces, whole), (len(pieces), len(whole))
    os.unlink(path)


@pytest.mark.parametrize("sync", [False, True])
def test_a_streamed_batch_file_is_not_read_back_for_its_whole_file_crc(sync: bool) -> None:
    """The streamed write read the whole file back (pread in pieces) to compute the footer's whole-file CRC: a
    spilled merge output was copied out of the page cache once more and checksummed twice (q9 under a budget: 1 GB
    written, 1 GB read back at 2M events). The CRC is now combined from the header's, the Arrow file's (summed as it
    is written) and the sections' (``crc_combine``): the VFS sees no read, and the file checks whole (``verify``)."""
    import dbsp_core.trace.batchfile as bf

    rng = np.random.default_rng(SEED)
    b = _batch(rng, 200_000, ("k", "s"))  # several STREAM_CHUNKs of Arrow file, a last page cut short
    path = os.path.join(tempfile.mkdtemp(), "w.batch")
    ops = _write_ops(b, path, sync)
    assert [o for o, _ in ops if o == "pread"] == [], ops
    size = write_batch(path, b, "posix", sync=sync)
    assert size > 2 * bf.STREAM_CHUNK
    assert verify(path) == len(b)  # the whole-file CRC (and every page's) is right
    got = open_batch(path, verify=True).batch
    assert got.zset.to_dict() == b.zset.to_dict()
    os.unlink(path)


def test_big_writes_are_cut_at_2_mib_multiples_of_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 6: every aligned FOLIO_ALIGN (2 MiB) of the file that lies inside one big write of the Arrow writer
    (a column's buffer) goes to the VFS in one pwrite, so the page cache may hold it as one folio, mapped with one
    page-table entry; pieces cut from the write's start (offset 64 + its place in the Arrow file: before) split
    them. The bytes are the same: the file reads back as a dict model of the batch, every checksum right. Fails
    with ``FOLIO_ALIGN = 0`` (the pieces of before): aligned regions split by a cut."""
    import dbsp_core.trace.batchfile as bf

    rng = np.random.default_rng(SEED)
    n = 700_000 + int(rng.integers(0, 100_000))  # 5.6-6.4 MiB columns: two pieces each, at several alignments
    t = pa.table({"k": rng.integers(0, n // 2, n), "v": rng.integers(-5, 5, n)})
    w = rng.choice([1, 2, -1], n)
    b = ZSet.from_arrow(t, weights=w).consolidate().index_by(["k"])
    code = t.column("k").to_numpy() * 16 + t.column("v").to_numpy() + 5  # the model: weight per distinct (k, v)
    rows, inv = np.unique(code, return_inverse=True)
    sums = np.bincount(inv, weights=w).astype(np.int64)
    rows, sums = rows[sums != 0], sums[sums != 0]
    big, cuts = [], []  # the Arrow writer's big writes [start, end) and every pwrite's (start, end), file offsets
    write, pwrite = bf._PageSink.write, bf._PageSink._pwrite

    def spy_write(self, data):
        m = memoryview(data).cast("B")
        if len(m) >= bf.GATHER:
            big.append((64 + self.pos, 64 + self.pos + len(m)))
        return write(self, data)

    def spy_pwrite(self, data, offset):
        cuts.append((offset, offset + len(memoryview(data).cast("B"))))
        return pwrite(self, data, offset)

    monkeypatch.setattr(bf._PageSink, "write", spy_write)
    monkeypatch.setattr(bf._PageSink, "_pwrite", spy_pwrite)
    path = os.path.join(tempfile.mkdtemp(), "aligned.batch")
    write_batch(path, b, "posix", sync=False)
    A = 2 << 20
    assert bf.STREAM_CHUNK % A == 0
    assert all(hi - lo <= bf.STREAM_CHUNK for lo, hi in cuts)
    starts = np.array(sorted(lo for lo, _ in cuts))
    regions = 0
    for lo, hi in big:
        for r in range(-(-lo // A) * A, hi - A + 1, A):  # the aligned regions inside this write
            regions += 1
            inside = starts[(starts > r) & (starts < r + A)]
            assert len(inside) == 0, (lo, hi, r, inside.tolist())
    assert regions >= 4  # the columns' writes hold such regions
    got = open_batch(path, verify=True).batch
    gc = got.zset.data.column("k").to_numpy() * 16 + got.zset.data.column("v").to_numpy() + 5
    order = np.argsort(gc, kind="stable")
    assert np.array_equal(gc[order], rows) and np.array_equal(got.zset.weights[order], sums)
    os.unlink(path)


def _mapped(addr: int, n: int) -> np.ndarray:
    """Per page of [addr, addr + n) of this process: whether a page-table entry maps it (/proc/self/pagemap bit 63)."""
    import mmap

    first, last = addr // mmap.PAGESIZE, (addr + n - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return (np.frombuffer(raw, dtype="<u8") >> np.uint64(63)).astype(bool)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_a_write_from_a_dropped_mapping_maps_each_piece_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 6: a batch read from a mapping whose pages the writer drops after each piece (``drop``: a merge
    built on disk) has each piece's pages mapped when it goes to the VFS, so the kernel's copy does not come up short
    and fall back to small folios. Read off the page tables (pagemap) at each pwrite; the file written reads back as
    the batch. Fails without ``_touch`` (every page of a piece unmapped: the previous piece's drop took them)."""
    import mmap

    import dbsp_core.trace.batchfile as bf

    rng = np.random.default_rng(SEED)
    n = 700_000
    t = pa.table({"k": rng.integers(0, n, n), "v": rng.integers(0, 9, n)})
    b = ZSet.from_arrow(t).consolidate().index_by(["k"])
    d = tempfile.mkdtemp()
    write_batch(os.path.join(d, "src.batch"), b, sync=False)
    src = open_batch(os.path.join(d, "src.batch"))
    src.map.madvise(mmap.MADV_DONTNEED)
    lo, hi = src.base, src.base + src.size
    seen = []
    pwrite = bf._PageSink._pwrite

    def spy(self, data, offset):
        m = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        at = m.ctypes.data
        if lo <= at < hi and len(m) >= bf.GATHER:  # a piece read in place from the source's mapping
            seen.append(bool(_mapped(at, len(m)).all()))
        return pwrite(self, data, offset)

    monkeypatch.setattr(bf._PageSink, "_pwrite", spy)
    out = os.path.join(d, "out.batch")
    write_batch(out, src.batch, sync=False, drop=lambda: src.map.madvise(mmap.MADV_DONTNEED))
    assert len(seen) >= 4 and all(seen), seen
    assert open_batch(out, verify=True).batch.zset.to_dict() == b.zset.to_dict()


def test_crc_combine_equals_the_crc_of_the_concatenation() -> None:
    """crc_combine (the whole-file CRC of a streamed write) against the CRC of the bytes joined, random lengths."""
    from dbsp_core.trace.batchfile import _crc, crc_combine

    rng = random.Random(SEED)
    for _ in range(50):
        a, b = rng.randbytes(rng.randrange(0, 3000)), rng.randbytes(rng.choice([0, 1, 7, 64, 65536, 70001]))
        assert crc_combine(_crc(a), _crc(b), len(b)) == _crc(a + b)
