"""Tiered levels under a budget (trace invariant 15): the bytes a spilled trace writes per byte of its state, and its content, against a dict model."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import pyarrow as pa

from dbsp_core import ZSet
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore, spilling

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


KV = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _distinct_circuit() -> "dbsp.Circuit":
    """``d``: the distinct rows of input ``t`` (KV): the compaction tests' circuit."""
    import dbsp_core as dbsp

    c = dbsp.Circuit()
    c.output("d", c.input("t", KV).distinct())
    return c


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
    schema = KV
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


def test_step_batches_a_budget_holds_merge_from_memory_and_are_written_once() -> None:
    """64 steps of 20,000 new keys under a 4 MiB budget (each step's batch ~0.9 MiB, a tiered level's FAN_IN of them
    fit the batch share): a tiered merge whose inputs are in memory starts when the insert's fuel finishes it
    (invariant 15, ``Trace.FROM_MEMORY``), so those inputs are written once, in its output, never alone. The batch
    files written come to at most 1.75x the state's (measured 1.56x; 1.89x when such a merge waited for the enforce
    to spill every input first), and the trace holds the dict model's sum."""
    rng = np.random.default_rng(SEED)
    schema = KV
    t, pushed = Trace(schema, ("k",)), []
    with BatchStore(4 << 20) as store, spilling(store):
        for _ in range(64):
            pushed.append(pa.table({"k": rng.integers(0, 1 << 40, 20_000), "v": rng.integers(0, 3, 20_000)}))
            t.insert(ZSet.from_arrow(pushed[-1]).consolidate().index_by(["k"]))
            store.enforce()
            store.settle()
        written, disk = store.stats["bytes_written"], store.disk_bytes()
        assert disk > 8 * (4 << 20)  # the state is many times the budget
        assert written <= 1.75 * disk, (written, disk, written / disk, store.stats["merges_on_disk"], t.levels())
        t.check()
        # the model: every pushed row once (a multiset: ZSet equality consolidates it in C, no dict of 1.3M rows)
        assert t.consolidated().zset == ZSet.from_arrow(pa.concat_tables(pushed))


def test_a_one_push_load_in_pieces_writes_its_pieces_once_and_merges_them_once() -> None:
    """2M auctions pushed in one step into a join under 8 MiB (12 pieces of MIN_PIECE_BYTES: at least FAN_IN, so the
    store holds tiered merges while they run), then ``settle_merges`` (the compaction the first small step after a
    load does): the pieces' batches are written once as loose files of their tiered level and merged once at the
    step's end (invariant 15, ``BatchStore.holding``), so the batch files written come to at most 2.2x the state's
    (measured 1.91x; 2.65x when the pieces merged FAN_IN at a time and the compaction rewrote it all), and a
    step of bids after it joins as the unbudgeted twin does."""
    import dbsp_core as dbsp
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    rng = np.random.default_rng(SEED)
    auctions = pa.schema([("id", pa.int64()), ("category", pa.int64())])
    bids = pa.schema([("auction", pa.int64()), ("price", pa.int64())])

    def circuit() -> "dbsp.Circuit":
        c = dbsp.Circuit()
        b, a = c.input("bids", bids), c.input("auctions", auctions)
        c.output("v", b.join(a, left_on="auction", right_on="id"))
        return c

    budgeted = dbsp.Pipeline(circuit(), executor=EmbeddedExecutor(background_merge=False), memory_limit=8 << 20)
    twin = dbsp.Pipeline(circuit())
    try:
        ids = rng.permutation(2_000_000)
        for p in (budgeted, twin):
            p.push("auctions", pa.table({"id": ids, "category": ids % 50}, schema=auctions))
            p.step()
        store = budgeted.executor.batch_store
        assert budgeted.executor.stats["substeps"]["pieces"] >= Trace.FAN_IN
        budgeted.executor.settle_merges()
        written, disk = store.stats["bytes_written"], store.disk_bytes()
        assert written <= 2.2 * disk, (written, disk, written / disk, store.stats["files_written"])
        assert not store.holding
        z = pa.table({"auction": rng.integers(0, 2_100_000, 5000), "price": rng.integers(0, 9, 5000)}, schema=bids)
        for p in (budgeted, twin):
            p.push("bids", z)
        assert budgeted.step()["v"].to_dict() == twin.step()["v"].to_dict()
    finally:
        budgeted.close()
        twin.close()


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
        assert len(store._files) + len(store._grouped) == len([b for b in t.batches if store.is_spilled(b)])


def test_the_first_small_step_after_a_bulk_load_compacts_the_tiered_spilled_batches(monkeypatch) -> None:
    """A pipeline under a 1 MiB budget loads a distinct in six big steps (BIG_STEP_ROWS lowered to 20,000 rows:
    tiered levels leave several spilled batches), then runs small steps without any call of settle_merges: the
    first small step starts the compaction (one compaction, every trace left with at most one loose spilled batch:
    the others are its inputs, paid in slices by the steps, trace invariant 17), a second small step does not start
    another, and every output equals the unbudgeted twin's (multisets). Watched fail with the executor's hook
    (``_compact_after_load``) removed: no compaction, 3 spilled batches left."""
    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    rng = np.random.default_rng(SEED)
    schema = KV

    budgeted = dbsp.Pipeline(_distinct_circuit(), executor=EmbeddedExecutor(background_merge=False),
                             memory_limit=1 << 20)
    twin = dbsp.Pipeline(_distinct_circuit())
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
    schema = KV

    root = str(tmp_path / "d")
    p = dbsp.Pipeline(_distinct_circuit(), storage=root, memory_limit=1 << 20, checkpoint_interval=None)
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
    with dbsp.Pipeline.open(root, _distinct_circuit(), memory_limit=1 << 20) as q:  # the state held: a row seen adds
        # nothing
        q.push("t", pa.table({"k": [old[0], -1], "v": [old[1], 0]}, schema=schema))
        assert q.step()["d"].to_dict() == {(-1, 0): 1}


@FORMAT_1
@pytest.mark.parametrize("workers", [1, 2])
def test_the_compaction_after_a_load_runs_on_the_merge_thread_while_steps_run(tmp_path, monkeypatch, workers) -> None:
    """With a merge thread (trace invariant 16), the compaction after a bulk load (BIG_STEP_ROWS lowered to 20,000)
    runs off the stepping thread: every step of its merge and the writing of its file are on the merge thread; its
    file is held back (a gate in ``_Merge.seal``) until a small step has run meanwhile over the old batches, then
    released; a later step's end installs it (one spilled loose batch per trace). Every output, the traces' content
    after it and after a reopen equal the unbudgeted twin's (multisets). W=1 and W=2 (one merge thread for both
    workers). Watched fail with the executor's start of it removed (``start_compaction`` never called: no
    compaction, a step ran with nothing gated, tiered batches left) and with the seal back on the installing thread."""
    import threading

    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded
    from dbsp_core.runtime.embedded import EmbeddedExecutor
    from dbsp_core.trace import levels

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    rng = np.random.default_rng(SEED)
    schema = KV
    where: dict[str, set] = {"step": set(), "seal": set()}
    gate, gated = threading.Event(), threading.Event()
    real_step, real_seal = levels._Merge.step, levels._Merge.seal

    watched: dict = {}  # the budgeted pipeline's store (the twin's compacts in slices under DBSP_MEMORY_LIMIT)

    def step(self, budget):  # noqa: ANN001
        if self.compaction and self.store is watched.get("store"):
            where["step"].add(threading.current_thread().name)
        return real_step(self, budget)

    def seal(self):  # noqa: ANN001
        if self.compaction and self.cursor.done and not self.sealed and self.store is watched.get("store"):
            where["seal"].add(threading.current_thread().name)
            gated.set()
            assert gate.wait(60), "the test never opened the gate"
        return real_seal(self)

    monkeypatch.setattr(levels._Merge, "step", step)
    monkeypatch.setattr(levels._Merge, "seal", seal)

    root = str(tmp_path / "p")
    budgeted = dbsp.Pipeline(_distinct_circuit(), workers=workers, storage=root, checkpoint_interval=None,
                             memory_limit=1 << 20, executor=EmbeddedExecutor(background_merge=True))
    twin = dbsp.Pipeline(_distinct_circuit(), workers=workers, executor=EmbeddedExecutor(background_merge=False))
    ex = budgeted.executor
    store = watched["store"] = ex.batch_store
    assert store is not None

    def spilled() -> int:  # (merge inputs included)
        return max(sum(store.is_spilled(b) for b in t._levels()) for t in ex._all_traces())

    def content(p: "dbsp.Pipeline") -> dict:
        out: dict = {}
        for w in range(workers):
            for label, t in p.traces(w).items():
                for r, n in t.consolidated().zset.to_dict().items():
                    out[(label, r)] = out.get((label, r), 0) + n
        return out

    def push(n: int) -> None:
        z = pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}, schema=schema)
        budgeted.push("t", z, producer="gen", seq=push.seq)
        twin.push("t", z)
        push.seq += 1
        a, b = budgeted.step(), twin.step()
        assert a["d"].to_dict() == b["d"].to_dict()
    push.seq = 0

    try:
        for _ in range(6):
            push(30_000)
        loaded = spilled()
        assert loaded >= 2, loaded  # the load left tiered spilled batches to compact
        ran_during, started = 0, False
        for _ in range(400):  # small steps until the end of one finds the merge thread idle and starts it, then
            push(300)  # until the end of one installs it
            if ex._compacting and not started:
                started = True
                assert gated.wait(30), "the compaction never reached its seal"  # merged, its file held back
                push(300)  # a step while it is in progress: it reads the old batches and does not wait
                ran_during += bool(ex._compacting and not gate.is_set())
                gate.set()
                assert ex._merge_thread.wait_idle(60)
            elif started and not ex._compacting:
                break
        assert store.stats["compactions"] == 1 and not ex._compacting, (store.stats["compactions"], ex._compacting)
        assert ran_during == 1, "no step ran while the compaction was in progress"
        assert where["step"] and where["seal"] and all(n.startswith("dbsp-merge-thread") for n in
                                                       where["step"] | where["seal"]), where
        assert spilled() <= 1, (loaded, spilled())
        assert store.stats["compactions_abandoned"] == 0
        push(300)
        want = content(twin)
        assert content(budgeted) == want
        budgeted.close()
        with dbsp.Pipeline.open(root, _distinct_circuit(), memory_limit=1 << 20) as q:
            assert content(q) == want
    finally:
        gate.set()
        if not budgeted._closed:
            budgeted.close()
        twin.close()


def test_settle_merges_finishes_a_due_merge_and_compacts_its_level(monkeypatch) -> None:
    """``EmbeddedExecutor.settle_merges`` after a load with the merge thread on: a tiered level whose merge became due
    (the level filled with FAN_IN more loose batches while it ran, so the inserting thread kept it to advance by fuel
    and handed nothing) is handed and finished too, and the compaction then leaves each trace one spilled batch and
    no merge in progress (before, the merge stayed unfinished and ``compact_spilled`` skipped its level: a 30M-row
    distinct kept 8 spilled batches, bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-flat100). Content as the unbudgeted
    twin's."""
    import dbsp_core as dbsp
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    monkeypatch.setattr(Trace, "FAN_IN", 3)
    rng = np.random.default_rng(SEED)
    schema = KV

    budgeted = dbsp.Pipeline(_distinct_circuit(), executor=EmbeddedExecutor(background_merge=True),
                             memory_limit=1 << 20)
    twin = dbsp.Pipeline(_distinct_circuit())
    store = budgeted.executor.batch_store
    # the merge thread is held off during the load (it finds nothing to advance), as a busy one falls behind: the
    # merges it was handed become due as their levels fill, and the steps' fuel advances them
    monkeypatch.setattr(Trace, "_unfinished", lambda self: (None, None))
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


def _content(p: "dbsp.Pipeline", workers: int) -> dict:
    """Every trace's rows, summed over the workers, by trace label (multisets)."""
    out: dict = {}
    for w in range(workers):
        for label, t in p.traces(w).items():
            for r, n in t.consolidated().zset.to_dict().items():
                out[(label, r)] = out.get((label, r), 0) + n
    return {k: n for k, n in out.items() if n}


def _push_both(budgeted, twin, rng, n: int) -> None:  # noqa: ANN001
    """Push ``n`` random rows of KV to both pipelines, step both, and check the view's changes are equal."""
    z = pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}, schema=KV)
    budgeted.push("t", z)
    twin.push("t", z)
    a, b = budgeted.step(), twin.step()
    assert a["d"].to_dict() == b["d"].to_dict()


@pytest.mark.parametrize("workers", [1, 2])
def test_without_a_merge_thread_the_compaction_after_a_load_is_paid_in_slices(tmp_path, monkeypatch, workers) -> None:
    """Without a merge thread (trace invariant 17) the compaction after a bulk load (BIG_STEP_ROWS lowered to 20,000,
    COMPACT_SLICE to 3,000 rows) is paid by the small steps that follow: no step merges more compaction rows than its
    slice (``compaction_slice``: counted, not timed), it takes several steps and is installed within
    ceil(rows / slice) + 1 of them and those its file's write takes (``SEAL_FUEL`` output rows' worth a slice row:
    at most ceil(4 rows / (slice x SEAL_FUEL)) + 1 here), its inputs replaced by its output; every output, the traces' content and
    a reopen's equal the unbudgeted twin's (multisets). W=1 and W=2. Watched fail with the slice removed (the whole
    compaction at the first small step, as on main: 'step 0 merged 180000 > 3000')."""
    import math

    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded
    from dbsp_core.runtime.embedded import EmbeddedExecutor, compaction_slice

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    monkeypatch.setattr(Trace, "COMPACT_SLICE", 3_000)
    monkeypatch.setattr(Trace, "COMPACT_FUEL", 4)
    rng = np.random.default_rng(SEED)
    root = str(tmp_path / "p")
    budgeted = dbsp.Pipeline(_distinct_circuit(), workers=workers, storage=root, checkpoint_interval=None,
                             memory_limit=1 << 20, executor=EmbeddedExecutor(background_merge=False))
    twin = dbsp.Pipeline(_distinct_circuit(), workers=workers, executor=EmbeddedExecutor(background_merge=False))
    ex = budgeted.executor
    store = ex.batch_store
    assert store is not None and ex._merge_thread is None

    def spilled() -> int:  # loose spilled batches of the fullest trace (a compaction's inputs are not loose)
        return max(sum(store.is_spilled(e[1]) for level in t._by_level for e in level.loose) for t in ex._all_traces())

    def compacted() -> int:
        return sum(t.compacted_rows for t in ex._all_traces())

    def push(n: int) -> None:
        _push_both(budgeted, twin, rng, n)

    try:
        for _ in range(6):
            push(30_000)
        assert spilled() >= 2, spilled()  # the load left tiered spilled batches to compact
        per_step, rows, started = [], 0, None
        for i in range(200):
            before = compacted()
            push(300)
            per_step.append(compacted() - before)
            assert per_step[-1] <= compaction_slice(300), f"step {i} merged {per_step[-1]} > {compaction_slice(300)}"
            if ex._compacting and started is None:
                started = i
                inputs = [e[1] for t in ex._compacting for lv in t._by_level if lv.merge is not None
                          and lv.merge.compaction for e in lv.merge.inputs]
                rows = sum(len(b) for b in inputs)
            if started is not None and not ex._compacting:
                break
        assert started is not None and not ex._compacting, (started, per_step)
        steps = i - started + 1
        seal = math.ceil(4 * rows / (compaction_slice(300) * Trace.SEAL_FUEL)) + 1  # then its file's write in pieces
        # (its work weighed, batchfile.InPlaceWrite.advance: about 3.7 rows' worth a row of these 32-byte rows)
        assert 1 < steps <= math.ceil(rows / compaction_slice(300)) + seal + 1, (steps, rows, per_step)
        assert store.stats["compactions"] == 1 and store.stats["compactions_abandoned"] == 0
        assert sum(per_step) == rows, (sum(per_step), rows)
        left = {id(b) for t in ex._all_traces() for b in t._levels()}  # its inputs replaced by its output
        assert not any(id(b) in left for b in inputs)
        del inputs
        push(300)
        want = _content(twin, workers)
        assert _content(budgeted, workers) == want
        budgeted.close()
        with dbsp.Pipeline.open(root, _distinct_circuit(), workers=workers, memory_limit=1 << 20,
                                executor=EmbeddedExecutor(background_merge=False)) as q:
            assert _content(q, workers) == want
    finally:
        if not budgeted._closed:
            budgeted.close()
        twin.close()


@FORMAT_1
@pytest.mark.parametrize("workers", [1, 2])
def test_a_sliced_compaction_writes_its_file_a_slice_at_a_time(tmp_path, monkeypatch, workers) -> None:
    """Without a merge thread (trace invariant 17) the compaction's batch file is written in pieces by the slices
    (batchfile.py invariant 8): no step's share of its write, the install step's included, passes over the file.
    Counted (not timed) per step, within the compaction's seal (``_Merge.seal``): the bytes checksummed (CRC-32C, page
    CRCs), written (``FileWriter.pwrite``) and put in the Bloom filter (8 a key hash). Each step's count is at most
    its slice's share (``compaction_slice`` x ``SEAL_FUEL`` output rows of the file's bytes a row) and a few pieces
    of 64 KiB (``STREAM_CHUNK`` lowered: a write's piece, an Arrow page, the two pages opening checks); the whole
    count covers the file (so the counting sees the write); the write takes several steps, the last of them the
    install's; the outputs and the content equal the unbudgeted twin's. W=1 and W=2 (the slice is shared by the
    workers' traces). Watched fail on main, which writes the file at the install step in one pass: 'step 59 paid
    8.49 MB > its bound 1.22 MB' (W=1; W=2: 4.36 MB at each worker's install)."""
    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded
    from dbsp_core import _storage
    from dbsp_core.runtime.embedded import EmbeddedExecutor, compaction_slice
    from dbsp_core.trace import batchfile, levels

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    monkeypatch.setattr(Trace, "COMPACT_SLICE", 3_000)
    monkeypatch.setattr(Trace, "COMPACT_FUEL", 4)
    piece = 64 << 10
    monkeypatch.setattr(batchfile, "STREAM_CHUNK", piece)  # the write's pieces (and the bound's slack): 64 KiB
    monkeypatch.setattr(batchfile, "FOLIO_ALIGN", 0)
    fuel = 8
    monkeypatch.setattr(Trace, "SEAL_FUEL", fuel, raising=False)  # (a tighter bound than the default's; main has none)
    rng = np.random.default_rng(SEED)
    budgeted = dbsp.Pipeline(_distinct_circuit(), workers=workers, storage=str(tmp_path / "p"),
                             checkpoint_interval=None, memory_limit=1 << 20,
                             executor=EmbeddedExecutor(background_merge=False))
    twin = dbsp.Pipeline(_distinct_circuit(), workers=workers, executor=EmbeddedExecutor(background_merge=False))
    ex = budgeted.executor
    store = ex.batch_store
    assert store is not None and ex._merge_thread is None
    count = [0]  # bytes of the compaction's write so far
    sealing: dict[int, int] = {}  # seals of it in progress by thread (this store's only: under DBSP_MEMORY_LIMIT the
    # twin compacts too; a seal runs on its worker's thread, and at W=2 the other worker's own spills, checksummed and
    # written at the same time on its thread, are not the seal's)
    real_seal = levels._Merge.seal

    def seal(m, *args, **kw):  # noqa: ANN001, ANN002, ANN003
        mine = bool(m.compaction and m.store is store)
        me = threading.get_ident()
        sealing[me] = sealing.get(me, 0) + mine
        try:
            return real_seal(m, *args, **kw)
        finally:
            sealing[me] -= mine

    def counted(f, size):  # noqa: ANN001
        def call(*args, **kw):  # noqa: ANN002, ANN003
            if sealing.get(threading.get_ident()):
                count[0] += size(*args)
            return f(*args, **kw)
        return call

    class Counted(_storage.FileWriter):
        def pwrite(self, data, offset):  # noqa: ANN001
            if sealing.get(threading.get_ident()):
                count[0] += memoryview(data).nbytes
            return super().pwrite(data, offset)

    monkeypatch.setattr(levels._Merge, "seal", seal)
    monkeypatch.setattr(_storage, "crc32c", counted(_storage.crc32c, lambda data, *_: memoryview(data).nbytes))
    monkeypatch.setattr(_storage, "crc32c_pages", counted(_storage.crc32c_pages,
                                                          lambda data, *_: memoryview(data).nbytes))
    monkeypatch.setattr(_storage, "bloom_build", counted(_storage.bloom_build, lambda hashes, *_: 8 * len(hashes)))
    monkeypatch.setattr(_storage, "FileWriter", Counted)

    def push(n: int) -> None:
        _push_both(budgeted, twin, rng, n)

    try:
        for _ in range(6):
            push(30_000)
        per_step: list[int] = []
        started = None
        for i in range(300):
            before = count[0]
            push(300)
            per_step.append(count[0] - before)
            started = i if started is None and ex._compacting else started
            if started is not None and not ex._compacting:
                break
        assert started is not None and not ex._compacting and store.stats["compactions"] == 1, (started, per_step)
        out = max(store._files.values(), key=lambda f: f.rows)  # the compaction's output (W=2: the larger)
        bound = int(1.25 * compaction_slice(300) * fuel * out.arrow_len / out.rows) + 4 * piece
        for j, n in enumerate(per_step):
            assert n <= bound, f"step {j} paid {n / 1e6:.2f} MB > its bound {bound / 1e6:.2f} MB ({per_step})"
        assert sum(per_step) >= out.size, (sum(per_step), out.size)  # every byte of it went through the counting
        assert sum(1 for n in per_step if n) >= 3, per_step  # its write took several steps
        assert per_step[-1] > 0, per_step  # the last, the install step's, committed it
        push(300)
        assert _content(budgeted, workers) == _content(twin, workers)
    finally:
        budgeted.close()
        twin.close()


@FORMAT_1
@pytest.mark.parametrize("background", [False, True], ids=["sliced", "merge-thread"])
def test_a_reopened_state_with_loose_spilled_files_compacts(tmp_path, monkeypatch, background) -> None:
    """A state closed right after a bulk load (tiered levels of several spilled files, no small step: no compaction)
    and reopened counts those files toward the compaction's write rule (``Trace.loose_spilled_bytes``): small steps
    after the reopen compact it (one compaction, installed, one spilled loose batch per trace left), with and
    without a merge thread, and the content equals the unbudgeted twin's before and after. Watched fail with the
    reopen hook removed (``_reopened`` never set: no compaction, 2-3 spilled batches left)."""
    import dbsp_core as dbsp
    import dbsp_core.runtime.embedded as embedded
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", 20_000)
    monkeypatch.setattr(Trace, "FAN_IN", 4)
    rng = np.random.default_rng(SEED)
    root = str(tmp_path / "p")
    twin = dbsp.Pipeline(_distinct_circuit(), executor=EmbeddedExecutor(background_merge=False))

    def push(p: "dbsp.Pipeline", n: int) -> None:
        z = pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}, schema=KV)
        p.push("t", z)
        twin.push("t", z)
        assert p.step()["d"].to_dict() == twin.step()["d"].to_dict()

    try:
        with dbsp.Pipeline(_distinct_circuit(), storage=root, checkpoint_interval=None, memory_limit=1 << 20,
                           executor=EmbeddedExecutor(background_merge=background)) as p:
            for _ in range(6):
                push(p, 30_000)
            assert p.executor.batch_store.stats["compactions"] == 0
        with dbsp.Pipeline.open(root, _distinct_circuit(), memory_limit=1 << 20,
                                executor=EmbeddedExecutor(background_merge=background)) as q:
            ex = q.executor
            store = ex.batch_store

            def spilled() -> int:
                return max(sum(store.is_spilled(e[1]) for level in t._by_level for e in level.loose)
                           for t in ex._all_traces())

            push(q, 300)
            assert spilled() >= 2 or ex._compacting, spilled()  # the reopened loose files (or their compaction)
            for _ in range(400):
                push(q, 300)
                if store.stats["compactions"] and not ex._compacting:
                    break
                if ex._merge_thread is not None:
                    ex._merge_thread.wait_idle(5)
            assert store.stats["compactions"] == 1 and not ex._compacting, (store.stats["compactions"], spilled())
            assert spilled() <= 1, spilled()
            assert _content(q, 1) == _content(twin, 1)
    finally:
        twin.close()


def test_a_deleted_files_blocks_are_given_back_a_piece_at_a_time(monkeypatch) -> None:
    """A batch file deleted (its batch gone) keeps a descriptor across the unlink, and each enforce then truncates it
    from its end, ``RECLAIM_BYTES`` at most (lowered to 64 KiB here), once its mapping is gone; emptied, the
    descriptor is closed (spill.py invariant 12: the kernel frees a file at ~30 us a MiB, and a compaction's install
    drops all its inputs at once). Watched fail with ``_reclaim_files`` a no-op ('not given back in pieces: [2073408,
    2073408, ...]')."""
    import gc

    piece = 64 << 10
    monkeypatch.setattr(BatchStore, "RECLAIM_BYTES", piece)
    monkeypatch.setattr(BatchStore, "RECLAIM_FILES", 256)  # (off by default: spill.py RECLAIM_FILES says why)
    rng = np.random.default_rng(SEED)
    t = Trace(KV, ("k",))
    with BatchStore(1) as store, spilling(store):
        z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 1 << 40, 50_000), "v": rng.integers(0, 3, 50_000)}))
        t.insert(z.consolidate().index_by(["k"]))
        store.enforce()
        store.settle()
        size = store.disk_bytes()
        assert size > 8 * piece and not store._reclaim, size
        del t, z
        gc.collect()
        assert len(store._reclaim) == 1, store._reclaim  # deleted, not freed yet
        fd = store._reclaim[0].fd
        assert os.fstat(fd).st_nlink == 0  # unlinked: no name reaches it
        left = [os.fstat(fd).st_size]
        for _ in range(size // piece + 10):
            store.enforce()
            if not store._reclaim:
                break
            left.append(os.fstat(fd).st_size)
        assert not store._reclaim and len(left) >= size // piece and all(
            0 < a - b <= piece for a, b in zip(left, left[1:])), f"not given back in pieces: {left}"
        with pytest.raises(OSError):
            os.fstat(fd)  # closed once empty
