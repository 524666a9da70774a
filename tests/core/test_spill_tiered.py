"""Tiered levels under a budget (trace invariant 15): the bytes a spilled trace writes per byte of its state, and its content, against a dict model."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa

from dbsp_core import ZSet
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore, spilling

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def _insert(t: Trace, store: BatchStore, z: ZSet, model: dict) -> None:
    """``z`` (consolidated) added to ``model`` and inserted into ``t``, then the store's budget enforced and its
    spill thread settled, as between steps."""
    for r, w in z.to_dict().items():
        model[r] = model.get(r, 0) + w
    t.insert(z.index_by(["k"]))
    store.enforce()
    store.settle()


def test_a_growing_spilled_trace_writes_at_most_three_times_its_state() -> None:
    """64 steps of 2,000 new keys into a trace under a 256 KiB budget (a final state ~20x the budget), an enforce after
    each: the batch files written in all come to at most 3x the files the state ends in (measured 2.3x; 2.8x with
    FAN_IN 4; every level from the first 2,000-row batch up is spilled; two-way merges of the spilled levels wrote
    3.5x, each row rewritten once per level above the budget), and the trace holds the dict model's sum, in at most
    2 * FAN_IN loose batches and a merge of FAN_IN per level."""
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t, model = Trace(schema, ("k",)), {}
    with BatchStore(256 << 10) as store, spilling(store):
        for _ in range(64):
            z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 1 << 40, 2000), "v": rng.integers(0, 3, 2000)}))
            _insert(t, store, z.consolidate(), model)
        written, disk = store.stats["bytes_written"], store.disk_bytes()
        assert disk > 10 * (256 << 10)  # the state is many times the budget: most levels are spilled
        assert written <= 3 * disk, (written, disk, written / disk, store.stats["merges_on_disk"], t.levels())
        for _lvl, loose, merge in t.levels():
            assert len(loose) <= 2 * Trace.FAN_IN and (merge is None or len(merge) <= Trace.FAN_IN), t.levels()
        t.check()
        assert t.consolidated().zset.to_dict() == {r: w for r, w in model.items() if w}


def test_compact_spilled_leaves_one_spilled_batch_and_the_content() -> None:
    """After a tiered load (several spilled batches, some at one level), ``compact_spilled`` (what settle_merges
    calls) merges them into one spilled batch, in place on disk: the content is the dict model's, invariants 1, 2
    and 5 hold, the merged-away files are deleted, and a second call finds nothing to merge."""
    import gc

    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64())])
    t, model = Trace(schema, ("k",)), {}
    with BatchStore(256 << 10) as store, spilling(store):
        for _ in range(24):
            k = rng.integers(0, 30_000, 3000)
            z = ZSet.from_arrow(pa.table({"k": k, "s": pa.array([None if x % 5 == 0 else str(x % 97) for x in k]),
                                          "v": rng.integers(0, 3, 3000)}), weights=rng.choice([1, 2, -1], 3000))
            _insert(t, store, z.consolidate(), model)
        spilled = [b for b in t.batches if store.is_spilled(b)]
        assert len(spilled) >= 3, t.levels()
        assert t.compact_spilled() >= 2
        loose = [e[1] for lv in t._by_level if lv.merge is None for e in lv.loose if store.is_spilled(e[1])]
        assert len(loose) == 1, t.levels()
        assert t.compact_spilled() == 0
        t.check()
        assert t.consolidated().zset.to_dict() == {r: w for r, w in model.items() if w}
        del spilled, loose
        gc.collect()
        assert len(store._files) == len([b for b in t.batches if store.is_spilled(b)])


def test_the_first_small_step_after_a_bulk_load_compacts_the_tiered_spilled_batches(monkeypatch) -> None:
    """A pipeline under a 1 MiB budget loads a distinct in six big steps (BIG_STEP_ROWS lowered to 20,000 rows:
    tiered levels leave several spilled batches), then runs small steps without any call of settle_merges: the
    first small step compacts (one compaction, every trace left with at most one spilled batch), a second small
    step does not compact again, and every output equals the unbudgeted twin's (multisets). Watched fail with
    the executor's hook (``_compact_after_load``) removed: no compaction, 3 spilled batches left."""
    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])

    def circuit() -> "dbsp.Circuit":
        c = dbsp.Circuit()
        c.output("d", c.input("t", schema).distinct())
        return c

    budgeted = dbsp.Pipeline(circuit(), executor=EmbeddedExecutor(background_merge=False), memory_limit=1 << 20)
    twin = dbsp.Pipeline(circuit())
    store = budgeted.executor.batch_store
    assert store is not None

    def spilled() -> list[int]:
        return [sum(store.is_spilled(e[1]) for level in t._by_level for e in level.loose)
                for t in budgeted.executor._all_traces()]

    try:
        for n in [30_000] * 6 + [500, 500]:
            z = pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}, schema=schema)
            budgeted.push("t", z)
            twin.push("t", z)
            a, b = budgeted.step(), twin.step()
            assert a["d"].to_dict() == b["d"].to_dict()
            if n == 30_000:
                loaded = spilled()
            elif store.stats["compactions"] == 1 and "after" not in locals():
                after = spilled()
        assert max(loaded) >= 2, loaded  # the load left tiered spilled batches to compact
        assert store.stats["compactions"] == 1, (store.stats["compactions"], spilled())
        assert max(after) <= 1 and max(spilled()) <= 1, (after, spilled())
    finally:
        budgeted.close()
        twin.close()


def test_compaction_after_loads_while_threads_load_step_checkpoint_and_read(tmp_path, monkeypatch) -> None:
    """A durable pipeline under a 1 MiB budget while three threads run at once: one pushes big batches (over
    BIG_STEP_ROWS, lowered to 20,000) and steps, one pushes small ones and steps, one checkpoints and reads
    metrics and traces. They keep going until the small steps after loads compacted at least twice and two
    checkpoints ran (a minute at most); then the distinct's summed outputs equal the set of every pushed row, and
    a reopen holds the same state."""
    import threading
    import time

    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])

    def circuit() -> "dbsp.Circuit":
        c = dbsp.Circuit()
        c.output("d", c.input("t", schema).distinct())
        return c

    root = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), storage=root, memory_limit=1 << 20, checkpoint_interval=None)
    store = p.executor.batch_store
    assert store is not None
    pushed: list[pa.Table] = []
    outs: list = []
    counts = {"checkpoints": 0, "steps": 0}
    errors: list = []
    lock = threading.Lock()
    done = threading.Event()

    def done_yet() -> bool:
        return store.stats["compactions"] >= 2 and counts["checkpoints"] >= 2

    def stepper(n: int, t: int) -> None:
        rng = np.random.default_rng(SEED + t)
        try:
            while not done.is_set():
                z = pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}, schema=schema)
                with lock:
                    pushed.append(z)
                p.push("t", z, producer=f"p{t}", seq=len(pushed))
                out = p.step()["d"]
                with lock:
                    outs.append(out)
                    counts["steps"] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                p.checkpoint()
                counts["checkpoints"] += 1
                p.metrics()
                p.traces(0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            done.set()

    threads = [threading.Thread(target=stepper, args=(30_000, 1)), threading.Thread(target=stepper, args=(200, 2)),
               threading.Thread(target=reader)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while not done.is_set() and not done_yet() and time.monotonic() < deadline:
        time.sleep(0.05)
    done.set()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert done_yet(), (store.stats["compactions"], counts)
    outs.append(p.step()["d"])
    acc: dict = {}
    for z in outs:
        for r, w in z.to_dict().items():
            acc[r] = acc.get(r, 0) + w
    want = {r: 1 for t in pushed for r in zip(t["k"].to_pylist(), t["v"].to_pylist())}
    assert {r: w for r, w in acc.items() if w} == want, SEED
    p.close()
    old = next(iter(want))
    with dbsp.Pipeline.open(root, circuit(), memory_limit=1 << 20) as q:  # the state held: a row seen adds nothing
        q.push("t", pa.table({"k": [old[0], -1], "v": [old[1], 0]}, schema=schema))
        assert q.step()["d"].to_dict() == {(-1, 0): 1}


def test_settle_merges_finishes_a_due_merge_and_compacts_its_level(monkeypatch) -> None:
    """``EmbeddedExecutor.settle_merges`` after a load with the merge thread on: a tiered level whose merge became due
    (the level filled with FAN_IN more loose batches while it ran, so the inserting thread kept it to advance by fuel
    and handed nothing) is handed and finished too, and the compaction then leaves each trace one spilled batch and
    no merge in progress (before, the merge stayed unfinished and ``compact_spilled`` skipped its level: a 30M-row
    distinct kept 8 spilled batches, bench/RESULTS.md, 2026-11-29, branch r31-flat100). Content as the unbudgeted
    twin's."""
    import dbsp_core as dbsp
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    monkeypatch.setattr(Trace, "FAN_IN", 3)
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])

    def circuit() -> "dbsp.Circuit":
        c = dbsp.Circuit()
        c.output("d", c.input("t", schema).distinct())
        return c

    budgeted = dbsp.Pipeline(circuit(), executor=EmbeddedExecutor(background_merge=True), memory_limit=1 << 20)
    twin = dbsp.Pipeline(circuit())
    store = budgeted.executor.batch_store
    # the merge thread is held off during the load (it finds nothing to advance), as a busy one falls behind: the
    # merges it was handed become due as their levels fill, and the steps' fuel advances them
    monkeypatch.setattr(Trace, "_unfinished", lambda self: None)
    try:
        for n in [20_000] * 40:
            z = pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}, schema=schema)
            budgeted.push("t", z)
            twin.push("t", z)
            budgeted.step()
            twin.step()
        running = sum(level.merge is not None and level.merge.shared is not None and not level.merge.cursor.done
                      for t in budgeted.executor._all_traces() for level in t._by_level)
        monkeypatch.undo()  # the merge thread back (and FAN_IN 2 again: the levels as they are)
        monkeypatch.setattr(Trace, "FAN_IN", 3)
        assert running, "no handed merge left unfinished by the load: the case is not built"
        for t in budgeted.executor._all_traces():  # as a last step leaves it whose pass found every running merge
            t._handed = False  # due (advanced by its fuel, none handed): the 30M distinct's level 20
        budgeted.executor.settle_merges()
        for t in budgeted.executor._all_traces():
            running = [lvl for lvl, level in enumerate(t._by_level) if level.merge is not None]
            spilled = sum(store.is_spilled(e[1]) for level in t._by_level for e in level.loose)
            assert not running and spilled <= 1, (t.levels(), SEED)
        z = pa.table({"k": rng.integers(0, 1 << 40, 100), "v": rng.integers(0, 3, 100)}, schema=schema)
        budgeted.push("t", z)
        twin.push("t", z)
        assert budgeted.step()["d"].to_dict() == twin.step()["d"].to_dict()
    finally:
        budgeted.close()
        twin.close()
