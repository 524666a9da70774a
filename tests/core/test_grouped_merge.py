"""A merge of format-2 inputs streams them (dbsp_core/trace/groupedmerge.py): its output equals the C merge's of the
same batches read whole, row for row (so their multisets too), and it never holds more than its windows of rows, in a
trace under a budget as in a merge alone."""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet
from dbsp_core.trace import Trace, groupedbatch, groupedmerge
from dbsp_core.trace.spill import BatchStore, spilling
from dbsp_core.zset import merge_cursor, merged

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])


def _batch(rng: random.Random, n: int, keys: int, key: tuple) -> ZSet:
    rows = [(0 if rng.random() < 0.04 else rng.randrange(keys), rng.choice(["a", "bb", "", "c" * 40]), rng.randrange(4))
            for _ in range(n)]  # (key 0: a key hash of many rows, carried over rounds)
    w = [rng.choice([1, 1, 2, -1]) for _ in rows]
    return ZSet.from_rows(rows, SCHEMA, weights=w).index_by(list(key))


def _rows(b) -> tuple:
    rh = None if b._rh is None else np.asarray(b._rh).tolist()
    return (b.zset.data.to_pylist(), np.asarray(b.zset.weights).tolist(), np.asarray(b.key_hash).tolist(), rh)


@pytest.mark.parametrize("key,row_hashes,on_disk", [(("k",), True, True), (("k",), False, False),
                                                    (("k", "s", "v"), True, True), (("k",), True, False)])
def test_a_streamed_merge_equals_the_whole_merge(tmp_path, monkeypatch, key, row_hashes, on_disk) -> None:
    """Three inputs, two spilled to format-2 files and one in memory, some rows cancelling across inputs: the streamed
    merge's output (on disk: a format-2 file adopted by the store; else in memory) is the C merge's of the same
    batches, row for row, weights, key hashes and row hashes; it read no input whole and held at most its windows."""
    monkeypatch.setattr(BatchStore, "GROUPED_FROM", 1)
    monkeypatch.setattr(groupedmerge, "WINDOW", 8192)  # (dozens of windows a file)
    rng = random.Random(SEED)
    a, b, c = (_batch(rng, n, 300, key) for n in (3000, 2500, 800))
    cancel = ZSet.from_rows([tuple(r.values()) for r in a.zset.data.slice(0, 200).to_pylist()], SCHEMA,
                            weights=(-np.asarray(a.zset.weights[:200])).tolist()).index_by(list(key))
    b = _plus(b, cancel)
    want_c = merge_cursor(a, b, c, row_hashes=row_hashes)
    want_c.step(want_c.remaining)
    want = merged(a, want_c)
    with BatchStore(1 << 30, directory=str(tmp_path)) as store:
        for x in (a, b):
            store._spill(x)
            assert groupedbatch.is_grouped(x) and not groupedbatch.copied_bytes(x)
        copies = dict(groupedbatch.COPIES)
        groupedmerge.STATS["peak_rows"] = 0
        m = groupedmerge.StreamedMerge([a, b, c], row_hashes, store, on_disk=on_disk)
        steps = 0
        while not m.done:
            m.step(500)
            steps += 1
        out = m.output()
        assert steps > 3 and m.consumed == len(a) + len(b) + len(c)
        assert groupedbatch.COPIES == copies, "an input was read whole"
        assert groupedbatch.is_grouped(out) == on_disk and store.is_spilled(out) == on_disk
        assert _rows(out)[:3] == _rows(want)[:3]
        if row_hashes and len(key) == 1:
            assert _rows(out)[3] == _rows(want)[3]
        peak = groupedmerge.STATS["peak_rows"]  # (rows read of the files and a round's output; besides, the writer's
        whole = sum(groupedbatch.spilled_bytes(x) for x in (a, b))  # metadata, at most 1 MiB gathered, and an
        assert 0 < peak <= 6 * groupedmerge.WINDOW < whole / 3, (peak, whole)  # output in memory, merge_bytes counts)
        assert m.output() is out


def _plus(x, y):
    c = merge_cursor(x, y)
    c.step(c.remaining)
    return merged(x, c)


def test_a_trace_of_format_2_batches_merges_them_streamed(tmp_path, monkeypatch) -> None:
    """A trace whose every batch spills to format 2 under a budget of 1 byte (merges built on disk): its merges stream
    (no whole read of a grouped batch), their outputs are format-2 files, the content equals the dict model's and the
    same inserts' content in a format-1 store, and what a merge holds is counted by the store (merge_bytes)."""
    monkeypatch.setattr(BatchStore, "ASYNC_BYTES", 1 << 40)
    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 1)  # (every merge on disk)
    monkeypatch.setattr(groupedmerge, "WINDOW", 4096)
    rng = random.Random(SEED)
    seeds = [rng.randrange(2**31) for _ in range(17)]  # (each store spills its own batches: made anew for each)
    got = {}
    for grouped in (None, 1):
        monkeypatch.setattr(BatchStore, "GROUPED_FROM", grouped)
        t = Trace(SCHEMA, ("k",))
        before = dict(groupedbatch.COPIES)
        merges = groupedmerge.STATS["merges"]
        groupedmerge.STATS["peak_rows"] = 0
        with BatchStore(1, directory=str(tmp_path / f"g{grouped}")) as store, spilling(store):
            for sd in seeds:
                t.insert(_batch(random.Random(sd), 800, 400, ("k",)))
                store.enforce()
            if grouped:
                assert groupedmerge.STATS["merges"] > merges, "no merge streamed"
                fan_in = Trace.FAN_IN  # (a window and the rows of a key hash carried over an input, a round's output)
                inputs = sum(groupedbatch.spilled_bytes(b) for b in t._levels()) // 2  # (about a merge's inputs)
                assert 0 < groupedmerge.STATS["peak_rows"] <= (2 * fan_in + 1) * groupedmerge.WINDOW < inputs
                assert groupedbatch.COPIES == before, "a merge read a grouped batch whole"
                assert store.stats.get("streamed_merges", 0) > 0
            got[grouped] = Counter({r: w for r, w in t.consolidated().zset.to_dict().items() if w})
    model: Counter = Counter()
    for sd in seeds:
        model.update(_batch(random.Random(sd), 800, 400, ("k",)).zset.to_dict())
    assert got[None] == got[1] == Counter({r: w for r, w in model.items() if w})


def test_a_join_over_format_2_state_reads_no_batch_whole(monkeypatch) -> None:
    """A join's steps under a 1-byte budget with every spilled file in format 2: its walks gather the keys they seek
    (the one-call C step is for batches in memory: a grouped batch's view would copy its rows) and its merges stream,
    so no step reads a grouped batch whole; the output equals the same steps in memory."""
    import dbsp_core as dbsp
    from dbsp_core import envvars

    monkeypatch.setattr(BatchStore, "GROUPED_FROM", 1)
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))  # (the reference's)

    def circuit() -> "dbsp.Circuit":
        c = dbsp.Circuit()
        bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
        auctions = c.input("auctions", pa.schema([("id", pa.int64()), ("cat", pa.int64())]))
        c.output("j", bids.join(auctions, left_on="auction", right_on="id"))
        return c

    rng = np.random.default_rng(SEED)
    got: Counter = Counter()
    want: Counter = Counter()
    copies = groupedbatch.COPIES["reads"]
    with dbsp.Pipeline(circuit(), memory_limit=1) as p, dbsp.Pipeline(circuit()) as ref:
        for i in range(12):
            bids = pa.table({"auction": rng.integers(0, 120, 300), "price": rng.integers(0, 9, 300)})
            auctions = pa.table({"id": np.arange(i * 10, i * 10 + 10), "cat": np.arange(10) % 3})
            for q, acc in ((p, got), (ref, want)):
                q.push("bids", bids)
                q.push("auctions", auctions)
                acc.update(q.step()["j"].to_dict())
        store = p.executor.batch_store
        assert store.stats.get("grouped_lookups", 0) > 0 and store.stats.get("grouped_files_written", 0) > 0
    assert groupedbatch.COPIES["reads"] == copies, "a step read a grouped batch whole"
    assert +got == +want
