"""Merge outputs built on disk become their batch files in place (spill.py ``BatchStore.IN_PLACE``, batchfile.py
invariant 7): the same content as the copy into a new file, every file checksummed and readable, the rows never
written a second time, and no scratch file left behind."""

from __future__ import annotations

import gc
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dbsp_core import ZSet, _storage
from dbsp_core.trace import Trace
from dbsp_core.trace.batchfile import open_batch, verify
from dbsp_core.trace.spill import BatchStore, spilling

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _run(in_place: bool, durable: bool, monkeypatch, tmp_path) -> tuple[dict, dict, dict, int, list]:
    """Steps of growing inserts (int keys, nullable strings, weights that cancel) into a trace under a 1-byte budget,
    every merge built on disk, an enforce after each step. Returns (content, dict model, store stats, bytes handed to
    the VFS by the writers that adopt a scratch file, the batch files' paths at the end, each verified)."""
    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)
    monkeypatch.setattr(BatchStore, "IN_PLACE", in_place)
    written = [0]

    class Counted(_storage.FileWriter):  # the bytes handed to the VFS by writers that adopt a scratch file
        def __init__(self, path, vfs="posix", adopt=None):
            self.adopted = adopt is not None

        def pwrite(self, data, offset):
            if self.adopted:
                written[0] += len(memoryview(data).cast("B"))
            return super().pwrite(data, offset)

    monkeypatch.setattr(_storage, "FileWriter", Counted)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64())])
    t, want = Trace(schema, ("k",)), {}
    directory = tmp_path / ("in-place" if in_place else "copy")
    with BatchStore(1, directory=str(directory), durable=durable) as store, spilling(store):
        for _step in range(5):
            for i in range(12):
                n = 40 * (i + 1)
                k = pa.array(rng.integers(0, 3000, n))
                s = pc.if_else(pc.equal(pc.bit_wise_and(k, 7), 0), pa.scalar(None, pa.utf8()),
                               pc.cast(pc.bit_wise_and(k, 63), pa.utf8()))
                z = ZSet.from_arrow(pa.table({"k": k, "s": s, "v": rng.integers(0, 3, n)}),
                                    weights=rng.choice([1, 2, -1], n)).consolidate()
                for r, w in z.to_dict().items():
                    want[r] = want.get(r, 0) + w
                t.insert(z.index_by(["k"]))
            store.enforce()
            store.settle()
        t.check()
        got = t.consolidated().zset.to_dict()
        stats = dict(store.stats)
        stats["running"] = sum(1 for lv in t._by_level if lv.merge is not None and lv.merge.cursor.mapping is not None)
        assert all(store.is_spilled(b) for b in t.batches)
        paths = sorted(f.path for f in store._files.values())
        for p in paths:
            verify(p)  # every checksum, the whole-file CRC included
            assert open_batch(p).batch.zset.to_dict()  # read back by Arrow's reader
        del t
        gc.collect()
        left = [n for n in os.listdir(directory) if n.startswith("merge-")]
        assert not left, left  # scratch files not adopted went with their merges
    return got, {r: w for r, w in want.items() if w}, stats, written[0], paths


@FORMAT_1
@pytest.mark.parametrize("durable", [False, True])
def test_merge_outputs_become_their_batch_files_in_place(durable: bool, monkeypatch, tmp_path) -> None:
    """Against the dict model and against the copy (IN_PLACE False, the same merges on disk): the same content, and
    the spilled outputs became their files without their rows passing through a write: what the spill handed to
    the VFS's pwrite is the header, the Arrow metadata, the fence, filter and page CRCs, a small part of the files. Breaking
    the relocation of the record batch's buffers (their offsets moved by 8 bytes) fails the files' reads (Arrow: file
    too short); without the finalizer that unlinks a scratch file not adopted (bindings/merge.pxi), the check for
    scratch files left behind fails."""
    got, want, stats, pwritten, _paths = _run(True, durable, monkeypatch, tmp_path)
    assert got == want
    copy_got, copy_want, copy_stats, _copy_pwritten, _ = _run(False, durable, monkeypatch, tmp_path)
    assert copy_got == copy_want == want
    assert stats["merges_on_disk"] == copy_stats["merges_on_disk"] > 0
    assert copy_stats["written_in_place"] == 0
    assert stats["written_in_place"] > 0, stats
    # every merge output spilled went in place (none fell back to the copy): the others were merged away first
    # (but for merges on disk still running at the end: a tiered level's, levels.py invariant 15)
    assert stats["written_in_place"] == stats["merges_on_disk"] - stats["outputs_never_written"] - stats["running"], \
        stats
    assert 0 < pwritten < stats["bytes_in_place"] / 2, (pwritten, stats["bytes_in_place"])
