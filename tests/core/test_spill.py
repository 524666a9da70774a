"""Circuits whose every trace spills to batch files (a memory budget of 1 byte) checked against DuckDB: joins, aggregates, distinct, min/max under deletion, top-k, count distinct, windows and a fixpoint, each asserting that batches did go to disk; and the memory_limit argument's checks."""

from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.envvars import parse_memory_limit
from dbsp_core.trace.groupedfile import verify
from dbsp_core.trace.spill import BatchStore, batch_bytes, spilling
from oracle import run_against_duckdb
from test_circuit_composed import JOIN_GROUP_SQL, _join_then_group
from test_fixpoint import QUERIES as FIXPOINT_SQL, build as fixpoint_build
from time_oracle import run_event_time

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

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
        from dbsp_core.trace import Trace

        monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)
        monkeypatch.setattr(Trace, "FAN_IN", 3)  # tiered levels merge three at once (the k-way cursor), so that
        # these 8 steps merge some on disk (FAN_IN 8 waits for 8 spilled batches a level: invariant 15)
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
        for n in names:  # every file is whole and checks out (of either format: trace/spill.py invariant 18)
            assert verify(os.path.join(store.directory, n)) > 0
    with dbsp.Pipeline.open(d, c, memory_limit="1KiB") as q:
        for x in (pa.table({"k": [1, 3], "v": [-100, 7]}), pa.table({"k": [1], "v": [-3]})):
            q.push("t", x)
            ref.push("t", x)
            assert q.step() == ref.step()
        assert q.executor.batch_store.stats["files_written"] > 0
    ref.close()


@FORMAT_1
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
            s = pa.array([None if x % 7 == 0 else str(x) for x in k], pa.utf8())  # typed: all None is type null
            z = ZSet.from_arrow(pa.table({"k": k, "s": s, "v": rng.integers(-5, 5, n)}),
                                weights=rng.choice([1, 2, -1], n))
            ix = z.consolidate().index_by(["k"])
            mem.insert(ix)
            disk.insert(ix)
            store.enforce()
        store.settle()  # the spill thread's writes done: a big batch (a merge's output) is written there, not inline
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


@FORMAT_1
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
    monkeypatch.setattr(Trace, "FAN_IN", 2)  # two spilled batches merge at once (not tiered: levels.py invariant 15)
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


def test_spill_dir_needs_a_limit_and_staged_gives_it_to_its_tasks(monkeypatch) -> None:
    import dbsp_core.runtime.driver as driver_module
    from dbsp_core.envvars import load
    from dbsp_core.runtime.staged import StagedExecutor

    monkeypatch.setattr(driver_module, "settings", lambda: load({}))  # as without DBSP_MEMORY_LIMIT (CI sets it)

    c = dbsp.Circuit()
    c.output("o", c.input("t", pa.schema([("k", pa.int64())])).distinct())
    with pytest.raises(ValueError, match="give memory_limit"):
        dbsp.Pipeline(c, spill_dir=tempfile.mkdtemp())
    # the staged executor's task processes keep the budget (runtime/stage_task.py invariant 7; tests in
    # tests/core/test_staged_spill.py): the driver's process holds no store
    with dbsp.Pipeline(c, storage=tempfile.mkdtemp(), executor=StagedExecutor(), memory_limit="1MiB") as p:
        assert p.executor.memory_limit == 1 << 20 and p.executor.batch_store is None


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


@FORMAT_1
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


@FORMAT_1
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


def _lookup_matches_model(t, keys, schema: pa.Schema, model) -> None:
    """The rows ``t.lookup`` finds for ``keys`` (column ``k``) are the dict model's rows of those keys (multisets)."""
    from collections import Counter

    import numpy as np
    from dbsp_core import ZSet

    hashes = np.sort(ZSet.from_arrow(pa.table({"k": keys, "v": keys}, schema=schema)).hash(["k"]))
    asked = set(keys.tolist())
    got = Counter(r for x in t.lookup(hashes) for r in zip(x.zset.data.column("k").to_pylist(),
                                                             x.zset.data.column("v").to_pylist())
                  if r[0] in asked)
    assert got == Counter({r: c for r, c in model.items() if r[0] in asked})


@FORMAT_1
def test_cache_keeps_the_pages_steps_read_over_a_state_bigger_than_its_share(monkeypatch) -> None:
    """The cache accounts the pages reads touch, not whole files (spill.py invariant 12): over two spilled batches
    each bigger than the cache share, lookups of the same 20 keys step after step miss only in the first step and
    hit every page after it (whole-file accounting evicted both files at every enforce: no hit after the first
    step); lookups of 300 other keys each step keep the cache within its share by evicting the oldest pages, and
    20 keys read after them hit when read again. The rows found are those of a dict model, as multisets."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", False)  # the per-page clock (spill.py invariant 15)
    import mmap
    from collections import Counter

    import numpy as np
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace

    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t = Trace(schema, ("k",))
    model: Counter = Counter()
    limit = 4 << 20  # cache share 1 MiB; the batches' files 4-8 MiB
    with BatchStore(limit) as store, spilling(store):
        for lo, n in ((0, 200_000), (200_000, 100_000)):  # one batch per level: they do not merge
            k = np.arange(lo, lo + n)
            v = rng.integers(0, 1000, n)
            t.insert(ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=schema)).index_by(["k"]))
            model.update(zip(k.tolist(), v.tolist()))
            store.settle()
            store.enforce()
            store.settle()
        files = [store.file_of(b) for b in t._levels()]  # (not t.batches: a read of every row)
        assert len(files) == 2 and all(f is not None for f in files), files
        assert sum(f.size for f in files) > 2 * store.cache_cap(), (files, store.cache_cap())

        def step(keys: np.ndarray) -> tuple[int, int]:
            before = (store.stats["cache_hits"], store.stats["cache_misses"])
            _lookup_matches_model(t, keys, schema, model)
            store.enforce()
            assert store.cached_pages() * mmap.PAGESIZE <= store.cache_cap()
            return store.stats["cache_hits"] - before[0], store.stats["cache_misses"] - before[1]

        same = rng.choice(300_000, 20, replace=False)
        first = step(same)
        assert first[0] == 0 and first[1] > 0, first  # never read: every page misses
        for _ in range(4):
            assert step(same) == (first[1], 0)  # the same pages, held across steps: hits only
        evicted = store.stats["evictions"]
        for _ in range(6):  # 300 other keys each step: more pages than the cache share
            step(rng.choice(300_000, 300, replace=False))
        assert store.stats["evictions"] > evicted
        last = rng.choice(300_000, 20, replace=False)
        read = sum(step(last))
        assert step(last) == (read, 0)


def _spill_right_side(p: dbsp.Pipeline, ys) -> BatchStore:
    """Push rows (id, ys[id]) for ids 0..300k into input "r" of ``p`` as two batches (one per level: they do not
    merge) and wait until its store has spilled them; returns the store."""
    import numpy as np

    for lo, n in ((0, 200_000), (200_000, 100_000)):
        p.push("r", pa.table({"id": np.arange(lo, lo + n), "y": ys[lo:lo + n]}))
        p.step()
    store = p.executor.batch_store
    store.settle()
    store.enforce()
    store.settle()
    return store


@FORMAT_1
def test_join_steps_hit_the_pages_of_their_keys_in_a_spilled_side(monkeypatch) -> None:
    """An inner join's walk of a change over a spilled side reports the pages of the change's keys to the cache
    (Trace.walked, Trace.narrowed: spill.py invariant 12), not whole files: with the side's files bigger than the
    cache share, steps probing the same keys hit after the first one (whole-file accounting: 0 hits), and each
    step's output is the dict model's join."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", False)  # the per-page clock (spill.py invariant 15)
    import numpy as np
    from collections import Counter
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    rng = np.random.default_rng(SEED)
    c = dbsp.Circuit()
    left = c.input("l", pa.schema([("a", pa.int64()), ("x", pa.int64())]))
    right = c.input("r", pa.schema([("id", pa.int64()), ("y", pa.int64())]))
    c.output("v", left.join(right, left_on="a", right_on="id"))
    limit = 4 << 20  # cache share 1 MiB
    p = dbsp.Pipeline(c, executor=EmbeddedExecutor(background_merge=False), memory_limit=limit)
    try:
        ys = rng.integers(0, 1000, 300_000)
        store = _spill_right_side(p, ys)
        assert store.disk_bytes() > 2 * limit * BatchStore.CACHE_SHARE, store.disk_bytes()
        keys = rng.choice(300_000, 30, replace=False)
        hits = []
        for s in range(4):
            before = store.stats["cache_hits"]
            p.push("l", pa.table({"a": keys, "x": np.full(len(keys), s)}))
            out = p.step()
            want = Counter({(int(a), s, int(a), int(ys[a])): 1 for a in keys})
            assert Counter(out["v"].to_dict()) == want
            hits.append(store.stats["cache_hits"] - before)
        assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
    finally:
        p.close()


def _rss_of(regions: list[tuple[int, int]]) -> int:
    """Bytes the process holds of these mappings (the Rss of each in /proc/self/smaps)."""
    starts = {a for a, _ in regions}
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) in starts
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_a_key_index_under_a_budget_lives_in_files_the_cache_evicts(monkeypatch) -> None:
    """spill.py invariant 17 (csrc/keyindex.h invariant 7): a trace's key index under a BatchStore keeps its large
    regions in files of the store's directory; once its bytes pass the cache share, the enforce after a read drops
    its pages from the process (its regions' Rss goes to about 0, where an index in anonymous memory kept every
    page), and reads through it fault back what they touch (not the index) and still give a dict model's sums."""
    import numpy as np
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace

    monkeypatch.setattr(BatchStore, "INDEX_MAX_SHARE", None)  # kept however big (else dropped: invariant 17)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t = Trace(schema, ("k",))
    assert t.keep_index(("v",))
    model: dict = {}
    with BatchStore(4 << 20) as store, spilling(store):  # cache share 1 MiB, far below the index's ~9 MiB
        for lo in range(0, 300_000, 50_000):
            k = rng.permutation(np.arange(lo, lo + 50_000, dtype=np.int64))
            v = rng.integers(-9, 10, len(k))
            t.insert(ZSet.from_arrow(pa.table({"k": k, "v": v})).index_by(["k"]))
            for a, b in zip(k.tolist(), v.tolist()):
                model[a] = model.get(a, 0) + b
            store.enforce()
        ix = t.held_index
        assert ix is not None and ix.nbytes > 4 * store.memory_limit * store.CACHE_SHARE
        regions = ix.regions
        assert regions and sum(n for _, n in regions) >= 0.9 * ix.nbytes  # slot table and entries are mapped

        def read(keys: np.ndarray) -> np.ndarray:
            probe = pa.table({"k": keys})
            kh = ZSet.from_arrow(probe).hash(["k"])
            order = np.argsort(kh)
            out = np.empty(len(keys), np.int64)
            out[order] = t.key_sums(probe, ["k"], kh[order], order, ["v"])[:, 0]
            assert t.held_index is ix, "the read did not go through the index"
            return out

        keys = rng.choice(300_000, 1000, replace=False).astype(np.int64)
        assert read(keys).tolist() == [model[k] for k in keys.tolist()]
        held = _rss_of(regions)
        before = store.stats["evictions"]
        store.enforce()  # the trace was read: its index counts as used, over the cache share, and is evicted
        assert store.stats["evictions"] > before
        assert _rss_of(regions) <= held // 8, (_rss_of(regions), held)
        few = keys[:8]  # pages fault back from the files: those the probes touch (and the kernel's fault-around
        assert read(few).tolist() == [model[k] for k in few.tolist()]  # window of up to 64 KiB each, from the page
        assert _rss_of(regions) < ix.nbytes // 2  # cache), not the index
        assert read(keys).tolist() == [model[k] for k in keys.tolist()]
        t.check()


def _drop_cached(store: BatchStore) -> None:
    """Every batch file's pages out of the process and out of the page cache (written back first: a scratch store's
    files are not synced, and the kernel keeps dirty pages)."""
    import mmap

    for f in list(store._files.values()):
        f.map.madvise(mmap.MADV_DONTNEED)
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@FORMAT_1
def test_a_step_prefetches_its_pages_of_spilled_batches_instead_of_faulting_them(monkeypatch) -> None:
    """Before a step's walks (an inner join's, Trace.walked with the change's keys) and lookups (a semi-join's,
    Trace.lookup) seek the changed keys in spilled batches, the store starts reading the pages the fence names for
    them (BatchStore.prefetch, spill.py invariant 12), so the walks find them in the page cache instead of waiting
    for each from the disk: with every file's pages dropped from the page cache before each step, the process's
    major faults (a page read from the disk while the thread waits on it) in a step of 150 present and 150 absent
    keys fall to under a quarter of those of the same step without the prefetch (BatchStore.PREFETCH "off"); the
    pages prefetched are counted. By default ("auto") a step prefetches after a step that read pages from the disk
    and not after one that found them all in the page cache. Every step's outputs are the dict model's, as
    multisets."""
    import resource
    from collections import Counter

    import numpy as np
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    rng = np.random.default_rng(SEED)
    c = dbsp.Circuit()
    left = c.input("l", pa.schema([("a", pa.int64()), ("x", pa.int64())]))
    right = c.input("r", pa.schema([("id", pa.int64()), ("y", pa.int64())]))
    c.output("v", left.join(right, left_on="a", right_on="id"))
    c.output("s", left.semi_join(right, left_on="a", right_on="id"))
    n = 300_000
    p = dbsp.Pipeline(c, executor=EmbeddedExecutor(background_merge=False), memory_limit=4 << 20)
    try:
        ys = rng.integers(0, 1000, n)
        store = _spill_right_side(p, ys)
        assert store.disk_bytes() > 8 << 20, store.disk_bytes()
        faults: dict[bool, list[int]] = {False: [], True: []}
        for s, prefetch in enumerate([False, True, False, True]):
            monkeypatch.setattr(BatchStore, "PREFETCH", "on" if prefetch else "off")
            keys = np.concatenate([rng.choice(n, 150, replace=False), n + rng.choice(10 * n, 150, replace=False)])
            x = rng.integers(0, 100, len(keys))
            _drop_cached(store)
            before = (resource.getrusage(resource.RUSAGE_SELF).ru_majflt, store.stats["pages_prefetched"])
            p.push("l", pa.table({"a": keys, "x": x}))
            out = p.step()
            faults[prefetch].append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before[0])
            prefetched = store.stats["pages_prefetched"] - before[1]
            hit = [(int(a), int(b)) for a, b in zip(keys, x) if a < n]
            assert Counter(out["v"].to_dict()) == Counter({(a, b, a, int(ys[a])): 1 for a, b in hit}), (s, SEED)
            assert Counter(out["s"].to_dict()) == Counter({(a, b): 1 for a, b in hit}), (s, SEED)
            if prefetch:  # both operators' traces, ~4 pages (key hashes, weights, id, y) per present key
                assert prefetched >= 2 * 150, (prefetched, SEED)
            else:
                assert prefetched == 0, prefetched
        monkeypatch.setattr(BatchStore, "PREFETCH", "auto")
        monkeypatch.setattr(BatchStore, "PREFETCH_FROM", 200)  # a dropped step reads ~1,000 pages, a warm one ~0:
        # the margin keeps a few pages the kernel reclaims meanwhile (a busy machine) from deciding
        keys = np.concatenate([rng.choice(n, 150, replace=False), n + rng.choice(10 * n, 150, replace=False)])
        for s, (drop, want) in enumerate([(True, True), (False, True), (False, False), (True, False), (False, True)]):
            x = rng.integers(0, 100, len(keys))  # the same keys: their pages are cached unless dropped (whether the
            if drop:  # step before read pages from the disk decides)
                _drop_cached(store)
            before = store.stats["pages_prefetched"]
            p.push("l", pa.table({"a": keys, "x": x}))
            out = p.step()
            assert (store.stats["pages_prefetched"] > before) == want, (s, store.stats["pages_prefetched"] - before)
            hit = [(int(a), int(b)) for a, b in zip(keys, x) if a < n]
            assert Counter(out["v"].to_dict()) == Counter({(a, b, a, int(ys[a])): 1 for a, b in hit}), (s, SEED)
        if min(faults[False]) < 150:
            pytest.skip(f"the files' pages did not leave the page cache (a tmpfs?): major faults {faults}")
        assert max(faults[True]) * 4 < min(faults[False]), (faults, SEED)
    finally:
        p.close()


def test_a_group_by_key_index_updated_in_one_pass_counts_as_used_and_is_evicted(monkeypatch) -> None:
    """spill.py invariant 17 in a pipeline: a linear aggregate (sum, count) probes and updates its trace's key index
    in one pass (``Trace.through_index``), without reading the batches. That use never reached the store, so the
    index (8 MiB here, in files of the spill directory) was never counted in the cache nor evicted: its pages stayed
    in the process, beyond the budget, at every step. After each small step the index must count as used, be
    evicted (its regions' Rss drops to a fraction), and the sums still equal a dict model's."""
    import numpy as np

    monkeypatch.setattr(BatchStore, "INDEX_MAX_SHARE", None)  # kept however big (else dropped: invariant 17)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    t = c.input("t", schema)
    c.output("g", t.group_by("k").agg(s=dbsp.sum("v"), n=dbsp.count()))
    p = dbsp.Pipeline(c, memory_limit="4MiB")  # a cache share of 1 MiB, far below the index
    try:
        n = 150_000
        k = rng.permutation(np.arange(n, dtype=np.int64))
        v = rng.integers(-9, 10, n)
        model = {int(a): [int(b), 1] for a, b in zip(k, v)}
        p.push("t", pa.table({"k": k, "v": v}, schema=schema))
        p.step()
        store = p.executor.batch_store
        (trace,) = [tr for tr in p.traces(0).values() if tr.held_index is not None]
        for i in range(3):
            keys = rng.choice(n, 50, replace=False).astype(np.int64)
            ix = trace.held_index
            assert ix is not None and ix.nbytes > 4 * store.memory_limit * store.CACHE_SHARE
            regions = ix.regions
            assert regions, "the key index has no regions in files"
            before = store.stats["evictions"]
            p.push("t", pa.table({"k": keys, "v": np.full(50, i + 1)}, schema=schema))
            out = p.step()["g"].to_dict()
            assert trace.held_index is ix, "the step did not go through the key index"
            for a in keys.tolist():
                old = model[a]
                model[a] = [old[0] + i + 1, old[1] + 1]
                assert out.get((a, *old)) == -1 and out.get((a, *model[a])) == 1, (a, old, model[a])
            assert store.stats["evictions"] > before, "the key index the step used was not evicted"
            assert _rss_of(regions) <= ix.nbytes // 8, (_rss_of(regions), ix.nbytes)
    finally:
        p.close()


@FORMAT_1
def test_an_eviction_drops_the_pages_mapped_around_its_faults(monkeypatch) -> None:
    """A read fault maps besides its page the page-cache pages of the aligned 64 KiB around it (fault-around), which
    no read counts: evicting only the pages reads counted left those mapped, so a 3M-row join's files held 51 MiB
    against the cache's 7.5 MiB. With ``BatchStore.EVICT_AROUND`` an eviction drops each evicted page's 64 KiB but
    for the pages the cache holds (spill.py invariant 12): after every enforce the files' Rss fits in the 64 KiB
    windows of the pages the cache holds. Steps of 300 lookups over a spilled batch 8x the cache share; the rows
    found are a dict model's (multisets), and evictions happened."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", False)  # the per-page clock (spill.py invariant 15)
    import mmap
    from collections import Counter

    import numpy as np
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace
    from dbsp_core.trace.spill import FAULT_AROUND

    monkeypatch.setattr(BatchStore, "EVICT_AROUND", True)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t = Trace(schema, ("k",))
    n = 300_000
    k, v = np.arange(n), rng.integers(0, 1000, n)
    model = Counter(zip(k.tolist(), v.tolist()))
    with BatchStore(4 << 20) as store, spilling(store):  # a cache share of 1 MiB; the file ~8 MiB
        t.insert(ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=schema)).index_by(["k"]))
        store.settle()
        store.enforce()
        store.settle()
        (b,) = t._levels()
        f = store.file_of(b)
        assert f is not None and f.size > 4 * (1 << 20), f
        f.map.madvise(mmap.MADV_DONTNEED)  # what opening it read: out, so the Rss below is the steps' reads
        region = [(np.frombuffer(f.map, dtype=np.uint8).ctypes.data, len(f.map))]
        evictions = store.stats["evictions"]
        for _ in range(6):
            keys = rng.choice(n, 300, replace=False)
            _lookup_matches_model(t, keys, schema, model)
            store.enforce()
            held = np.flatnonzero(store._resident[id(b)])
            shift = (f.base // mmap.PAGESIZE) % FAULT_AROUND
            windows = len(np.unique((held + shift) // FAULT_AROUND))
            assert _rss_of(region) <= windows * FAULT_AROUND * mmap.PAGESIZE, (_rss_of(region), windows, len(held))
        assert store.stats["evictions"] > evictions


def _cascade(defer: bool, monkeypatch) -> tuple[dict, dict, dict]:
    """Six "steps" of 16 inserts into a trace under a 1-byte budget, every merge built on disk, an enforce after each
    step; the inserts grow, so an insert's merge work cascades up the levels. Returns (trace content, dict model,
    store stats). ``defer``: outputs spilled at the end of the insert's merge work, else when installed."""
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace

    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)
    monkeypatch.setattr(Trace, "SPILL_AT_WORK_END", defer)
    monkeypatch.setattr(Trace, "FAN_IN", 2)  # two-way merges cascade up every level (not tiered: invariant 15)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t, want = Trace(schema, ("k",)), {}
    with BatchStore(TINY) as store, spilling(store):
        for _step in range(6):
            for i in range(16):
                n = 10 * (i + 1)
                z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 500, n), "v": rng.integers(0, 3, n)}),
                                    weights=rng.choice([1, 2, -1], n)).consolidate()
                for r, w in z.to_dict().items():
                    want[r] = want.get(r, 0) + w
                t.insert(z.index_by(["k"]))
            store.enforce()
            store.settle()
        t.check()
        got = t.consolidated().zset.to_dict()
        stats = dict(store.stats)
        assert all(store.is_spilled(b) for b in t.batches)
    return got, {r: w for r, w in want.items() if w}, stats


def test_a_merge_output_merged_away_within_its_step_is_never_written(monkeypatch) -> None:
    """Every merge built on disk spilled its output as soon as it was installed, even when a merge of the level above
    took it in and finished within the same insert's merge work (a big step's merges cascade): q9 under a budget
    wrote 31 merge outputs at 2M events, 15 of which were deleted unread. The outputs are spilled at the end of the
    work now, and those merged away by then are never written: fewer files for the same content."""
    got, want, deferred = _cascade(True, monkeypatch)
    assert got == want
    got, want, at_once = _cascade(False, monkeypatch)  # each output spilled when installed, as before
    assert got == want
    assert deferred["merges_on_disk"] == at_once["merges_on_disk"] > 0
    assert deferred["outputs_never_written"] > 0 and at_once["outputs_never_written"] == 0
    assert (deferred["files_written"] + deferred["outputs_never_written"] == at_once["files_written"]), (deferred,
                                                                                                     at_once)



def test_a_restored_trace_never_read_spills_its_pending_batches_and_merges_again() -> None:
    """A trace restored (cleared, its saved batches inserted and settled: trace invariant 5) and then only inserted
    into stays fresh, its inserts pending; the store's enforce spilled loose batches only, so up to MAX_PENDING of
    them stayed in memory whatever the budget (issue 31: a retried staged task's trace, DBSP_STAGED_SPILL_SEED=9119767).
    Now enforce places them once the loose batches are not enough, ending freshness as a first read would: none is
    left in memory, content and placement order are unchanged, and later inserts pay for their merges again (O(log n)
    batches, which placing them and staying fresh would not keep). Under a budget the loose batches meet, they stay
    pending and the trace fresh."""
    from dbsp_core import ZSet
    from dbsp_core.trace import Trace
    from dbsp_core.trace.levels import level_of

    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    for limit in (1 << 30, TINY):
        model: dict = {}

        def insert(t: Trace) -> None:
            n = int(rng.integers(1, 40))
            z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 300, n), "v": rng.integers(0, 5, n)})).consolidate()
            t.insert(z.index_by(["k"]))
            for r, w in z.to_dict().items():
                model[r] = model.get(r, 0) + w

        with BatchStore(limit) as store, spilling(store):
            t = Trace(schema, ("k",))
            for _ in range(6):
                insert(t)
                store.enforce()
            placed, pending = t.parts()
            t.clear()  # a restore, as storage/snapshot.py loads a trace
            for b in placed:
                t.insert(b)
            t.settle()
            for b in pending:
                t.insert(b)
            restored = [id(b) for b in t.parts()[0]]
            insert(t)  # the retried job's step: inserts, no read
            new = [id(b) for b in t.pending]
            store.enforce()
            if limit > TINY:
                assert t._fresh and [id(b) for b in t.pending] == new and not store.is_spilled(t.pending[0])
                continue
            placed, pending = t.parts()
            assert not pending and not t._fresh, f"seed {SEED}: {len(pending)} pending batches left in memory"
            assert [id(b) for b in placed] == restored + new and all(store.is_spilled(b) for b in placed)
            for _ in range(200):  # no read yet: the inserts merge as a read trace's do (trace invariant 3)
                insert(t)
                store.enforce()
            assert len(t.parts()[0]) <= 2 * (level_of(t.inserted_rows) + 1), f"seed {SEED}: {t.levels()}"
            loose = [e[1] for level in t._by_level for e in level.loose]  # (a merge's inputs stay in memory)
            assert not t.pending and all(store.is_spilled(b) for b in loose), f"seed {SEED}"
            t.check()
            assert t.consolidated().zset.to_dict() == {r: w for r, w in model.items() if w}, f"seed {SEED}"


def _join_over_a_spilled_side(ys) -> tuple[dbsp.Pipeline, BatchStore]:
    """A pipeline under a 4 MiB budget joining ``l`` (a, x) with ``r`` (id, y) on a = id into ``v``, its right side
    loaded with ids 0..len(ys)-1 and ``ys`` and spilled (``_spill_right_side``); the pipeline and its batch store."""
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    c = dbsp.Circuit()
    left = c.input("l", pa.schema([("a", pa.int64()), ("x", pa.int64())]))
    right = c.input("r", pa.schema([("id", pa.int64()), ("y", pa.int64())]))
    c.output("v", left.join(right, left_on="a", right_on="id"))
    p = dbsp.Pipeline(c, executor=EmbeddedExecutor(background_merge=False), memory_limit=4 << 20)
    try:
        return p, _spill_right_side(p, ys)
    except BaseException:
        p.close()
        raise


@FORMAT_1
def test_a_warm_step_with_a_few_pages_from_the_disk_does_not_prefetch_the_next(monkeypatch) -> None:
    """``PREFETCH`` "auto" (spill.py invariant 12, ``BatchStore.prefetching``): the next step asks for its pages
    ahead only when the last one read from the disk at least ``PREFETCH_FROM`` pages and ``PREFETCH_SHARE`` of the
    pages its lookups missed in the cache. A warm step of a big state whose few pages the host took back (tens read
    from the disk among ~1,000 missed) used to turn the prefetch on for the next step, which then paid a madvise per
    run of its pages for nothing (a 10M-row join step +1.7-2.0 ms of CPU). The step's measured reads are set by hand
    (``_from_disk``: what getrusage would have said); the misses are the step's own. Outputs as the dict model's."""
    from collections import Counter

    import numpy as np

    rng = np.random.default_rng(SEED)
    n = 300_000
    ys = rng.integers(0, 1000, n)
    p, store = _join_over_a_spilled_side(ys)
    try:
        monkeypatch.setattr(BatchStore, "PREFETCH", "auto")
        monkeypatch.setattr(BatchStore, "PREFETCH_FROM", 16)
        for s, cold in enumerate([True, True, False, False, True]):  # cold: all of the step's misses from the disk
            keys = rng.choice(n, 300, replace=False)  # new keys: their pages missed in the cache
            x = rng.integers(0, 100, len(keys))
            before = store.stats["pages_prefetched"]
            p.push("l", pa.table({"a": keys, "x": x}))
            out = p.step()
            assert Counter(out["v"].to_dict()) == Counter({(int(a), int(b), int(a), int(ys[a])): 1
                                                           for a, b in zip(keys, x)}), (s, SEED)
            if s > 0:  # what the step before it measured decides
                assert (store.stats["pages_prefetched"] > before) == want, (s, SEED)
            misses = store._step_misses
            assert misses >= 300, misses  # ~4 pages a present key (key hashes, weights, id, y)
            # the step's pages from the disk: all of its misses, or a few (40: over PREFETCH_FROM, under 1/8 of them)
            store._from_disk = misses if cold else 40
            want = cold
    finally:
        p.close()


@FORMAT_1
def test_a_small_steps_lookups_and_pages_are_bounded_by_its_keys_and_files(monkeypatch) -> None:
    """Issue 31's lookup bound, counted by the store (spill.py invariants 12, 15, 16): a step that changes k keys of a
    spilled join side seeks at most its present keys (plus the filter's false positives) in each spilled batch, and
    the pages its reads use (the cache's hits + misses: the fence-located key-hash block and each column's pages of
    the rows found) are O(k x files), however big the files. Steps of 150 present and 150 absent keys: sought <= 1.1 x
    150 x files + 10, pages <= 8 per key sought + 4 per file. Outputs as the dict model's. Fails with the filters
    off (every absent key sought)."""
    from collections import Counter

    import numpy as np

    rng = np.random.default_rng(SEED)
    n = 300_000
    ys = rng.integers(0, 1000, n)
    p, store = _join_over_a_spilled_side(ys)
    try:
        files = sum(1 for t in p.executor._all_traces() for b in t._levels() if store.is_spilled(b))
        assert files >= 1
        for s in range(4):
            keys = np.concatenate([rng.choice(n, 150, replace=False), n + rng.choice(10 * n, 150, replace=False)])
            x = rng.integers(0, 100, len(keys))
            before = dict(store.stats)
            p.push("l", pa.table({"a": keys, "x": x}))
            out = p.step()
            hit = [(int(a), int(b)) for a, b in zip(keys, x) if a < n]
            assert Counter(out["v"].to_dict()) == Counter({(a, b, a, int(ys[a])): 1 for a, b in hit}), (s, SEED)
            sought = store.stats["keys_sought"] - before["keys_sought"]
            pages = (store.stats["cache_hits"] + store.stats["cache_misses"]
                     - before["cache_hits"] - before["cache_misses"])
            assert sought <= 1.1 * 150 * files + 10, (s, sought, files, SEED)
            assert pages <= 8 * sought + 4 * files, (s, pages, sought, files, SEED)
    finally:
        p.close()
