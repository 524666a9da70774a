"""A merge output built on disk lands in the page cache in 2 MiB folios (bindings/merge.pxi ``HUGE_SCRATCH``: its
scratch mapping is MADV_HUGEPAGE), as a batch file written by pwrite does (batchfile.py invariant 6): the steps that
read the file after it became a batch file in place then fault one PMD entry per 2 MiB instead of one small folio per
64 KiB (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-flat100). Skipped where this kernel and file system keep no file in
2 MiB folios (the check of a file written by 2 MiB-aligned pwrites first)."""

from __future__ import annotations

import mmap
import os
import random
import re

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet, _zset
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore, spilling

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _pmd_share(path: str, touches: int = 128) -> float:
    """The share of a fresh MADV_RANDOM read-only mapping of ``path`` that ``touches`` random page reads mapped with
    PMD entries (smaps FilePmdMapped / Rss): ~1 when the file's page cache is in 2 MiB folios."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        m.madvise(mmap.MADV_RANDOM)
        base = np.frombuffer(m, dtype=np.uint8).ctypes.data
        pages = np.random.default_rng(SEED).integers(0, size // mmap.PAGESIZE, touches)
        mv = memoryview(m)
        total = sum(mv[int(p) * mmap.PAGESIZE] for p in pages)  # the reads fault the pages in
        del mv
        with open("/proc/self/smaps") as f:
            for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read()):
                lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
                if lo <= base < hi:
                    rss = int(re.search(r"\nRss:\s+(\d+)", block).group(1))
                    pmd = int(re.search(r"\nFilePmdMapped:\s+(\d+)", block).group(1))
                    assert total >= 0
                    return pmd / max(1, rss)
        raise AssertionError("mapping not in smaps")
    finally:
        m.close()


def _large_folios(tmp_path) -> bool:
    """Whether this kernel and file system hold a file written in 2 MiB-aligned pwrites in 2 MiB folios."""
    path = str(tmp_path / "probe.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for i in range(16):
            os.pwrite(fd, np.full(1 << 18, i, dtype=np.uint64).tobytes(), i << 21)
    finally:
        os.close(fd)
    try:
        return _pmd_share(path) > 0.9
    finally:
        os.unlink(path)


@FORMAT_1
@pytest.mark.parametrize("huge", [True, False])
def test_a_merge_output_made_in_place_is_in_2mib_folios(huge: bool, monkeypatch, tmp_path) -> None:
    if not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE") or not _large_folios(tmp_path):
        pytest.skip("no file in 2 MiB folios here")
    monkeypatch.setattr(_zset, "HUGE_SCRATCH", huge)
    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)
    monkeypatch.setattr(BatchStore, "IN_PLACE", True)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t, want = Trace(schema, ("k",)), {}
    with BatchStore(1, directory=str(tmp_path / "spill")) as store, spilling(store):
        _two_spilled_then_compacted(rng, schema, t, want, store)
        assert store.stats["written_in_place"] >= 1
        shares = {f.path: _pmd_share(f.path) for f in store._files.values() if f.map is not None}
        got = t.consolidated().zset.to_dict()
    assert got == {r: x for r, x in want.items() if x}
    made = list(shares.values())
    assert made
    if huge:
        assert min(made) > 0.9, shares  # a read of the file maps 2 MiB folios
    else:
        assert max(made) < 0.9, shares  # the old way: small folios (the check can fail: a parametrized witness)


def _mapping_smaps(addr: int) -> tuple[int, int]:
    """(Rss, FilePmdMapped) in KiB of the mapping of this process holding address ``addr``."""
    with open("/proc/self/smaps") as f:
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read()):
            lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
            if lo <= addr < hi:
                return (int(re.search(r"\nRss:\s+(\d+)", block).group(1)),
                        int(re.search(r"\nFilePmdMapped:\s+(\d+)", block).group(1)))
    raise AssertionError("mapping not in smaps")


@pytest.mark.parametrize("huge", [True, False])
def test_populate_ahead_faults_a_merge_outputs_next_pieces_and_changes_no_row(huge: bool, monkeypatch,
                                                                                 tmp_path) -> None:
    """``MergeCursor.populate_ahead`` (bindings/merge.pxi, called by dbsp_core/trace/prefault.py off the stepping
    thread) faults in, writable, each output region's pieces up to its lead past the writer's share: before any step
    the first 2 MiB pieces of the scratch file's regions are resident (in 2 MiB folios where the file system keeps
    them), a populate between steps keeps the lead, and the merged rows equal a merge in memory. Without huge pages
    it does nothing (0). Watched fail with populate_ahead's madvise removed: 0 bytes, nothing resident."""
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps")
    from dbsp_core.zset import merge_cursor, merged

    monkeypatch.setattr(_zset, "HUGE_SCRATCH", huge)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    n = 400_000  # ~3 MiB a column a side: the output's regions span several 2 MiB pieces

    def side():
        k, v, w = rng.integers(0, 1 << 40, n), rng.integers(0, 5, n), rng.choice([1, 2, -1], n)
        return ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=schema), weights=w).consolidate().index_by(["k"])
    a, b = side(), side()
    want = merged(a, _done(merge_cursor(a, b))).zset.to_dict()
    c = merge_cursor(a, b, spill_dir=str(tmp_path), prefix=mmap.PAGESIZE)
    addr = np.frombuffer(c.mapping, dtype=np.uint8).ctypes.data
    rss0 = _mapping_smaps(addr)[0]
    got = c.populate_ahead(4 << 20)
    rss1, pmd1 = _mapping_smaps(addr)
    if not huge:
        assert got == 0 and rss1 == rss0
    else:
        assert got >= 4 << 20, got  # every region's first pieces (each region at least a page)
        assert (rss1 - rss0) * 1024 >= got * 0.9, (rss0, rss1, got)
        if _large_folios(tmp_path):
            assert pmd1 * 1024 >= got * 0.9, (pmd1, got)  # as 2 MiB folios, mapped by PMD entries
        assert c.populate_ahead(4 << 20) == 0  # nothing more before the writer moves
    total = 0
    while not c.done:
        c.step(50_000)
        total += c.populate_ahead(4 << 20)
    if huge:
        assert total > 0
    assert merged(a, c).zset.to_dict() == want
    assert c.populate_ahead(4 << 20) == 0  # its result taken: nothing


def _done(c):
    while not c.done:
        c.step(1 << 30)
    return c


@FORMAT_1  # (a merge of format-2 inputs streams them: no scratch mapping to populate, groupedmerge.py)
def test_a_spilled_compaction_is_populated_ahead_by_the_prefault_thread(monkeypatch, tmp_path) -> None:
    """A compaction on disk under a batch store (``Trace.compact_spilled``, levels.py ``_Merge.step``) asks the
    prefault thread (prefault.py) to populate its output ahead: its byte count grows while the rows stay right; with
    ``AHEAD`` 0 it does not. Watched fail with ``_Merge.step``'s ``prefault.ask`` removed."""
    import time

    from dbsp_core.trace import prefault

    monkeypatch.setattr(_zset, "HUGE_SCRATCH", True)
    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)
    monkeypatch.setattr(BatchStore, "IN_PLACE", True)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    for ahead in (4 << 20, 0):
        monkeypatch.setattr(prefault, "AHEAD", ahead)
        rng = np.random.default_rng(SEED)
        t, want = Trace(schema, ("k",)), {}
        while prefault._want:  # (the last round's asks done)
            time.sleep(0.01)
        time.sleep(0.05)
        before = prefault.populated
        with BatchStore(1, directory=str(tmp_path / f"spill{ahead}")) as store, spilling(store):
            _two_spilled_then_compacted(rng, schema, t, want, store)
            got = t.consolidated().zset.to_dict()
        assert got == {r: x for r, x in want.items() if x}
        deadline = time.monotonic() + 10
        while ahead and prefault.populated == before and time.monotonic() < deadline:
            time.sleep(0.01)  # (the thread may still be in its populate)
        assert (prefault.populated > before) == bool(ahead), (ahead, before, prefault.populated)


def _two_spilled_then_compacted(rng: np.random.Generator, schema: pa.Schema, t: Trace, want: dict,
                                store: BatchStore) -> None:
    """Two batches of ~10 MiB each inserted into ``t`` and spilled (their rows added to ``want``), then merged on disk
    into one file made in place (the budget is a byte)."""
    for _ in range(2):
        n = 300_000
        k, v, w = rng.integers(0, 1 << 40, n), rng.integers(0, 5, n), rng.choice([1, 2, -1], n)
        z = ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=schema), weights=w).consolidate()
        for r, x in z.to_dict().items():
            want[r] = want.get(r, 0) + x
        t.insert(z.index_by(["k"]))
        store.enforce()
        store.settle()
    t.compact_spilled()
    store.enforce()
    store.settle()
