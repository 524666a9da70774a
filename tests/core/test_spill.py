"""Circuits whose every trace spills to batch files (a memory budget of 1 byte) checked against DuckDB: joins, aggregates, distinct, min/max under deletion, top-k, count distinct, windows and a fixpoint, each asserting that batches did go to disk; and the memory_limit argument's checks."""

from __future__ import annotations

import os
import random
import tempfile

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.envvars import parse_memory_limit
from dbsp_core.trace.batchfile import open_batch
from dbsp_core.trace.spill import BatchStore, batch_bytes, spilling
from oracle import run_against_duckdb
from test_circuit_composed import JOIN_GROUP_SQL, _join_then_group
from test_fixpoint import QUERIES as FIXPOINT_SQL, build as fixpoint_build
from time_oracle import run_event_time

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
TINY = 1  # bytes: every batch of every trace spills after every step


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _spilled(stores: list[BatchStore]):
    """The after-hook: the pipeline's store wrote batch files and holds some now (bytes on disk > 0)."""
    def check(p: dbsp.Pipeline) -> None:
        store = p.executor.batch_store
        assert store is not None and store.memory_limit == TINY
        assert store.stats["files_written"] > 0 and store.disk_bytes() > 0, store.stats
        loose = [e[1] for t in store.traces() for level in t._by_level for e in level.loose]
        assert loose and all(store.is_spilled(b) for b in loose), "a loose batch stayed in memory under 1 byte"
        stores.append(store)
    return check


@pytest.mark.parametrize("workers, on_disk", [(1, False), (3, False), (2, True)])
def test_joins_aggregates_distinct_spilled(workers: int, on_disk: bool, monkeypatch) -> None:
    """``on_disk``: every merge builds its output in a scratch file and spills it when it ends (spill.py invariant
    12; by default only merges from BatchStore.FILE_MERGE_MIN bytes on, which these small steps never reach)."""
    if on_disk:
        monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)
    stores: list[BatchStore] = []
    queries = dict(JOIN_GROUP_SQL)
    queries.update({
        "d": "SELECT DISTINCT auction, bidder FROM bids",
        "ext": "SELECT auction, min(price), max(bidder), count(*) FROM bids GROUP BY auction",
        "nd": "SELECT auction, count(DISTINCT bidder) FROM bids GROUP BY auction",
    })

    def build(c: dbsp.Circuit, s: dict) -> dict:
        out = _join_then_group(c, s)
        out["d"] = s["bids"].select(auction="auction", bidder="bidder").distinct()
        out["ext"] = s["bids"].group_by("auction").agg(lo=dbsp.min("price"), hi=dbsp.max("bidder"), n=dbsp.count())
        out["nd"] = s["bids"].group_by("auction").agg(nd=dbsp.count_distinct("bidder"))
        return out

    run_against_duckdb(build, queries, SEED, workers, steps=8, max_rows=12, after=_spilled(stores),
                       memory_limit=TINY)
    assert stores and stores[0].stats["files_deleted"] > 0  # merged-away batches took their files with them
    assert (stores[0].stats["merges_on_disk"] > 0) == on_disk, stores[0].stats


def test_top_k_spilled() -> None:
    order = "ORDER BY price DESC NULLS LAST, bidder ASC NULLS LAST, f ASC NULLS LAST"
    run_against_duckdb(lambda c, s: {"top": s["bids"].group_by("auction").top_k(2, ("price", "descending"))},
                       {"top": f"SELECT auction, bidder, price, f FROM (SELECT *, row_number() OVER (PARTITION BY "
                               f"auction {order}) AS r FROM bids) WHERE r <= 2"},
                       SEED, 2, inputs=("bids",), steps=8, max_rows=12, after=_spilled([]), memory_limit=TINY)


def test_windows_spilled() -> None:
    from test_time_windows import fl

    stores: list[BatchStore] = []

    def pipeline(c: dbsp.Circuit) -> dbsp.Pipeline:
        p = dbsp.Pipeline(c, workers=2, memory_limit=TINY)
        stores.append(p.executor.batch_store)
        return p

    run_event_time(lambda c, s: {
        "tum": s["a"].tumble("t", 10).group_by("k", "window_start", "window_end").agg(n=dbsp.count(), hi=dbsp.max("v")),
    }, {
        "tum": f"SELECT k, {fl('t', 10)} AS ws, {fl('t', 10)} + 10, count(*), max(v) FROM a GROUP BY k, ws",
    }, SEED, 2, steps=10, pipeline=pipeline)
    assert stores[0].stats["files_written"] > 0


def test_fixpoint_spilled() -> None:
    from oracle import ChangeGen, _diff, accumulate, duckdb_query, normalize, to_zset
    from test_fixpoint import E
    import numpy as np

    rng = np.random.default_rng(SEED)
    gen = ChangeGen(rng, E)
    c = dbsp.Circuit()
    e = c.input("e", E)
    outs = fixpoint_build(c, e)
    for name, s in outs.items():
        c.output(name, s)
    views: dict[str, dict] = {name: {} for name in outs}
    with dbsp.Pipeline(c, workers=2, memory_limit=TINY) as p:
        for step in range(6):
            ch = gen.change(6)
            if ch:
                p.push("e", to_zset(ch, E))
            out = p.step()
            for name in outs:
                accumulate(views[name], out[name])
            for name, sql in FIXPOINT_SQL.items():
                want, got = duckdb_query(sql, {"e": (E, dict(gen.bag))}), normalize(views[name])
                assert got == want, (name, step, SEED, _diff(got, want), _diff(want, got))
        assert p.executor.batch_store.stats["files_written"] > 0


def test_durable_pipeline_spills_under_its_storage_and_recovers() -> None:
    d = tempfile.mkdtemp()
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v")))
    ref = dbsp.Pipeline(c)  # the same steps in memory, no budget
    pushes = [pa.table({"k": [i % 7, i % 5], "v": [i, -i]}) for i in range(20)]
    with dbsp.Pipeline(c, storage=d, memory_limit="1KiB") as p:
        for x in pushes:
            p.push("t", x)
            ref.push("t", x)
            assert p.step() == ref.step()
        store = p.executor.batch_store
        assert store.directory == os.path.join(d, "spill") and store.durable
        names = [n for n in os.listdir(store.directory) if n.endswith(".batch")]
        assert names and store.stats["files_written"] > 0
        for n in names:  # every file is whole and checks out
            assert open_batch(os.path.join(store.directory, n), verify=True).rows > 0
    with dbsp.Pipeline.open(d, c, memory_limit="1KiB") as q:
        for x in (pa.table({"k": [1, 3], "v": [-100, 7]}), pa.table({"k": [1], "v": [-3]})):
            q.push("t", x)
            ref.push("t", x)
            assert q.step() == ref.step()
        assert q.executor.batch_store.stats["files_written"] > 0
    ref.close()


def test_trace_reads_the_same_spilled() -> None:
    """A trace read in place from batch files answers lookups, key sums and whole reads as in memory."""
    import numpy as np
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace

    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64())])
    mem, disk = Trace(schema, ("k",)), Trace(schema, ("k",))
    with BatchStore(TINY) as store, spilling(store):
        for _ in range(12):
            n = int(rng.integers(1, 400))
            k = rng.integers(0, 300, n)
            z = ZSet.from_arrow(pa.table({"k": k, "s": pa.array([None if x % 7 == 0 else str(x) for x in k]),
                                          "v": rng.integers(-5, 5, n)}), weights=rng.choice([1, 2, -1], n))
            ix = z.consolidate().index_by(["k"])
            mem.insert(ix)
            disk.insert(ix)
            store.enforce()
        spilled = [b for b in disk.batches if store.is_spilled(b)]
        assert spilled
        for b in spilled:  # read in place: the buffers are the file's read-only mapping, not a copy in memory
            f = store.file_of(b)
            assert not b.key_hash.flags.writeable and not b.zset.weights.flags.writeable
            assert b.zset.data.column(0).chunks[0].buffers()[1].address >= np.frombuffer(f.map, np.uint8).ctypes.data
        probe_keys = np.unique(rng.integers(0, 400, 50))
        probe = pa.table({"k": probe_keys})
        kh = ZSet.from_arrow(probe).hash(["k"])
        order = np.argsort(kh)
        hashes = kh[order]
        for t in (mem, disk):
            t.check()
        assert disk.consolidated().zset.to_dict() == mem.consolidated().zset.to_dict()
        def looked(t):
            acc = {}
            for b in t.lookup(hashes, dense_ratio=0.0):
                for r, w in b.zset.to_dict().items():
                    if r[0] in set(probe_keys.tolist()):
                        acc[r] = acc.get(r, 0) + w
            return {r: w for r, w in acc.items() if w}
        assert looked(disk) == looked(mem)
        assert np.array_equal(disk.key_sums(probe, ["k"], hashes, order, ["v"]),
                              mem.key_sums(probe, ["k"], hashes, order, ["v"]))


class _SampledStore(BatchStore):
    """A batch store that records its own accounting (:meth:`BatchStore.memory`: batches and merge outputs in memory,
    fences and filters) at every piece of a merge, before the piece's pages leave the process."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.samples: list[int] = []

    def merge_pages_out(self, m) -> None:
        mem, kept = self.memory()
        self.samples.append(mem + kept)
        super().merge_pages_out(m)


def test_merge_over_the_budget_stays_within_it(monkeypatch) -> None:
    """A merge of two spilled batches whose output is many times the budget builds it on disk: the store's accounting
    stays within the limit at every piece of the merge (a merge in memory holds its whole output: about 7 MiB here
    against a 1 MiB limit, of which the files' fences and filters take ~0.3), the output is spilled when the merge
    ends, and the trace holds the inputs' sum."""
    import pyarrow.compute as pc
    import numpy as np
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace
    from dbsp_core.trace.levels import _Merge

    monkeypatch.setattr(_Merge, "DROP_ROWS", 4096)  # pieces of 4k rows: many samples in a 100k-row merge
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64())])
    limit = 1 << 20
    want: dict = {}
    t = Trace(schema, ("k",))
    with _SampledStore(limit) as store, spilling(store):
        for _ in range(2):  # two batches of one level, each spilled before the merge starts
            n = 100_000
            k = pa.array(rng.integers(0, 80_000, n))
            text = pc.if_else(pc.equal(pc.bit_wise_and(k, 7), 0), pa.scalar(None, pa.utf8()),
                              pc.cast(pc.bit_wise_and(k, 127), pa.utf8()))
            z = ZSet.from_arrow(pa.table({"k": k, "s": text, "v": rng.integers(0, 3, n)}),
                                weights=rng.choice([1, 2, -1], n)).consolidate()
            for r, w in z.to_dict().items():
                want[r] = want.get(r, 0) + w
            t.insert(z.index_by(["k"]), defer=True)  # placed, merge work owed: the merge runs below
            store.enforce()
            store.settle()  # a batch this big is written by the spill thread: switched to its file here
        assert [store.is_spilled(b) for b in t.batches] == [True, True]
        need = sum(batch_bytes(b) for b in t.batches)
        assert need > 4 * limit
        t.pay_deferred(1 << 30)  # the whole merge, in 4k-row pieces
        assert len(store.samples) > 10
        assert max(store.samples) <= limit, (max(store.samples), limit)
        assert t.levels()[-1][2] is None and len(t.batches) == 1, t.levels()  # merged and installed
        assert store.stats["merges_on_disk"] == 1
        assert store.is_spilled(t.batches[0])  # spilled when installed, without an enforce
        t.check()
        assert t.consolidated().zset.to_dict() == {r: w for r, w in want.items() if w}


@pytest.mark.parametrize("value, want", [("4GiB", 4 << 30), ("512MB", 512_000_000), (1, 1), ("1.5KiB", 1536),
                                         (" 64 kib ", 65536), ("100", 100)])
def test_memory_limit_forms(value, want) -> None:
    assert parse_memory_limit(value) == want


@pytest.mark.parametrize("value, error", [("4 gigs", ValueError), (0, ValueError), (-5, ValueError),
                                          ("", ValueError), (1.5, TypeError), (True, TypeError), ([1], TypeError)])
def test_memory_limit_refused_at_the_boundary(value, error) -> None:
    c = dbsp.Circuit()
    c.output("o", c.input("t", pa.schema([("k", pa.int64())])).distinct())
    with pytest.raises(error, match="memory_limit"):
        dbsp.Pipeline(c, memory_limit=value)


def test_spill_dir_needs_a_limit_and_staged_refuses_one(monkeypatch) -> None:
    import dbsp_core.runtime.driver as driver_module
    from dbsp_core.envvars import load
    from dbsp_core.errors import DbspError
    from dbsp_core.runtime.staged import StagedExecutor

    monkeypatch.setattr(driver_module, "settings", lambda: load({}))  # as without DBSP_MEMORY_LIMIT (CI sets it)

    c = dbsp.Circuit()
    c.output("o", c.input("t", pa.schema([("k", pa.int64())])).distinct())
    with pytest.raises(ValueError, match="give memory_limit"):
        dbsp.Pipeline(c, spill_dir=tempfile.mkdtemp())
    with pytest.raises(DbspError, match="staged executor does not spill"):
        dbsp.Pipeline(c, storage=tempfile.mkdtemp(), executor=StagedExecutor(), memory_limit="1MiB")


def test_metrics_show_memory_and_disk_per_operator() -> None:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("g", t.group_by("k").agg(n=dbsp.count()))
    with dbsp.Pipeline(c, workers=2, memory_limit=TINY) as p:
        for i in range(6):
            p.push("t", pa.table({"k": list(range(i, i + 50)), "v": [i] * 50}))
            p.step()
        m = p.metrics()["spill"]
        assert m["limit"] == TINY and m["disk_bytes"] > 0 and m["files_written"] > 0
        ops = m["operators"]
        assert sum(o["disk_bytes"] for o in ops.values()) > 0 and sum(o["rows"] for o in ops.values()) >= 50
        text = p.serve_metrics(0)
        import urllib.request
        body = urllib.request.urlopen(f"http://127.0.0.1:{text[1]}/metrics").read().decode()
        assert "dbsp_trace_disk_bytes{operator=" in body and "dbsp_spill_disk_bytes" in body


def _big_batch(rng, n: int, schema: pa.Schema):
    """A consolidated batch of ``n`` random rows (k, v) indexed by k: above BatchStore.ASYNC_BYTES for n >= 4k."""
    import numpy as np
    from dbsp_core import ZSet

    z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 10 * n, n), "v": rng.integers(-9, 9, n)}, schema=schema),
                        weights=np.ones(n, dtype=np.int64))
    return z.consolidate().index_by(["k"])


def test_big_batches_spill_off_the_stepping_thread(monkeypatch) -> None:
    """A batch of at least ASYNC_BYTES is written by the spill thread: enforce returns before its file exists (the
    step does not wait for the write), the batch is read from memory meanwhile, the next enforce (or settle)
    switches it to its file; one merged away while written leaves no file; a write's error is raised by the next
    enforce."""
    import threading

    import numpy as np
    from dbsp_core.trace import Trace
    from dbsp_core.trace import spill as spill_mod
    from dbsp_core.trace.spill import batch_bytes

    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    writers: list[int] = []
    real_write = spill_mod.write_batch

    def write_batch(*a, **k):  # the real write, noting which thread ran it
        writers.append(threading.get_ident())
        return real_write(*a, **k)

    monkeypatch.setattr(spill_mod, "write_batch", write_batch)
    t = Trace(schema, ("k",))
    with BatchStore(TINY) as store, spilling(store):
        b = _big_batch(rng, 20_000, schema)
        assert batch_bytes(b) >= BatchStore.ASYNC_BYTES
        want = b.zset.to_dict()
        t.insert(b)
        assert store.enforce() == batch_bytes(b)
        assert store.stats["files_written"] == 0 and not store.is_spilled(b)  # handed over, not written in the step
        assert t.consolidated().zset.to_dict() == want
        store.settle()
        assert store.is_spilled(b) and store.stats["files_written"] == 1 and store.stats["written_in_background"] == 1
        assert writers and threading.get_ident() not in writers
        assert t.consolidated().zset.to_dict() == want
        assert store.enforce() == 0  # spilled once: not handed over again
        # merged away while queued or written: not written, or its file goes; nothing is switched
        u = Trace(schema, ("k",))
        c = _big_batch(rng, 20_000, schema)
        u.insert(c)
        store.enforce()
        u.clear()
        del c
        store.settle()
        assert store.stats["written_for_nothing"] <= 1 and store.stats["files_written"] == 1  # (skipped if queued)
        assert len([n for n in os.listdir(store.directory) if n.endswith(".batch")]) == 1
        # a write that fails: raised by the next enforce, and no file is left
        def failing(*a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(spill_mod, "write_batch", failing)
        w = Trace(schema, ("k",))
        w.insert(_big_batch(rng, 20_000, schema))
        assert store.enforce() > 0
        with pytest.raises(OSError, match="No space"):
            store.settle()
        assert len([n for n in os.listdir(store.directory) if n.endswith(".batch")]) == 1


def test_walks_seek_only_the_keys_a_spilled_batch_may_hold() -> None:
    """A distinct's match_weights and an inner join's walk over spilled batches seek a changed key only in the
    batches whose Bloom filter may hold it (spill.py invariant 16): 1,100 changed keys (100 present, each in one of
    five spilled batches) cost about 100 seeks plus the filters' false positives, not 1,100 x 5; the results are
    those of the same state in memory."""
    import numpy as np
    from dbsp_core import ZSet
    from dbsp_core.runtime.embedded import EmbeddedExecutor
    from dbsp_core.trace import Trace

    rng = np.random.default_rng(SEED)
    sizes = [40_000, 20_000, 10_000, 5_000, 2_500]  # one batch per level: no two merge
    starts = np.cumsum([0] + sizes)
    present = rng.choice(int(starts[-1]), 100, replace=False)
    absent = int(starts[-1]) + rng.choice(10 * int(starts[-1]), 1_000, replace=False)
    keys = np.concatenate([present, absent])
    bound = 0.06 * len(keys) * len(sizes)  # the filter's false positives (~2%) with room; unfiltered: 5,500

    # distinct: match_weights of a whole-row change against a whole-row trace
    schema = pa.schema([("k", pa.int64())])
    mem, disk = Trace(schema, ("k",)), Trace(schema, ("k",))
    with BatchStore(TINY) as store, spilling(store):
        for lo, hi in zip(starts[:-1], starts[1:]):
            ix = ZSet.from_arrow(pa.table({"k": np.arange(lo, hi)}, schema=schema)).index_by(["k"])
            mem.insert(ix)
            disk.insert(ix)
            store.settle()
            store.enforce()
            store.settle()
        assert sum(store.is_spilled(b) for b in disk.batches) == len(sizes)
        change = ZSet.from_arrow(pa.table({"k": keys}, schema=schema)).index_by(["k"])
        before = store.stats["keys_sought"]
        got = disk.match_weights(change)
        sought = store.stats["keys_sought"] - before
        assert np.array_equal(got, mem.match_weights(change)) and int(got.sum()) == len(present)
        assert len(present) <= sought <= len(present) + bound, sought

    # an inner join probing a spilled right side
    c = dbsp.Circuit()
    left = c.input("l", pa.schema([("a", pa.int64()), ("x", pa.int64())]))
    right = c.input("r", pa.schema([("id", pa.int64()), ("y", pa.int64())]))
    c.output("v", left.join(right, left_on="a", right_on="id"))
    pipes = [dbsp.Pipeline(c, executor=EmbeddedExecutor(background_merge=False), memory_limit=lim)
             for lim in (TINY, None)]
    try:
        for lo, hi in zip(starts[:-1], starts[1:]):
            for p in pipes:
                p.push("r", pa.table({"id": np.arange(lo, hi), "y": np.arange(lo, hi) % 7}))
                p.step()
        store = pipes[0].executor.batch_store
        store.settle()
        store.enforce()
        store.settle()
        before = store.stats["keys_sought"]
        outs = []
        for p in pipes:
            p.push("l", pa.table({"a": keys, "x": np.arange(len(keys))}))
            outs.append(p.step()["v"].to_dict())
        sought = store.stats["keys_sought"] - before
        assert outs[0] == outs[1] and sum(outs[0].values()) == len(present)
        assert len(present) <= sought <= len(present) + bound, sought
    finally:
        for p in pipes:
            p.close()
