"""The staged executor with its stage state in an object store (runtime/stage_store.py) on moto's S3 server, tasks run in this process by the reference runner with one stage cache per "process" in turn (no cache shared with the driver, none holding the previous job's state): steps against the embedded runtime and DuckDB, compaction, a live rescale 2 -> 3 -> 2, a cold rescale, and a driver restart on an empty disk."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

from staged_circuits import build, changes, check_duckdb, embedded, feed, same_outputs  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
import dbsp_core.runtime.driver as driver_module  # noqa: E402
from dbsp_core.runtime import stage_store  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.runtime.staged import LocalJobRunner  # noqa: E402
from dbsp_core.storage.formats import state_db_paths  # noqa: E402

SEED = int(os.environ.get("DBSP_STAGE_STORE_SEED", np.random.SeedSequence().entropy % 10**6))


def _pipe(c, uri, cache, caches, workers=2, runner=None, **kw):
    ex = StagedExecutor(runner or LocalJobRunner(cache_dirs=caches, seed=SEED),
                        max_steps_per_job=kw.pop("max_steps_per_job", 64))
    return dbsp.Pipeline(c, workers, 8, uri, executor=ex, cache_dir=cache, checkpoint_interval=None, **kw)


def _open(c, uri, cache, caches, workers=None):
    ex = StagedExecutor(LocalJobRunner(cache_dirs=caches, seed=SEED + 1))
    return dbsp.Pipeline.open(uri, c, workers, executor=ex, cache_dir=cache, checkpoint_interval=None)




def _checkpointed(s3_server, tmp_path, steps, n: int) -> tuple:
    """A join_agg store pipeline (two task caches, a driver directory) that ran ``steps[:n]``, checkpointed, and ran
    one more step: (circuit, sql, uri, caches, driver, pipeline, outputs so far)."""
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(2)]
    driver = str(tmp_path / "driver")
    p = _pipe(c, uri, driver, caches)
    outs = feed(p, steps[:n])
    p.checkpoint()
    outs += feed(p, steps[n:n + 1])
    return c, sql, uri, caches, driver, p, outs


def test_stage_state_moves_and_the_driver_restarts(s3_server, tmp_path) -> None:
    """The short variant: steps, a checkpoint, two more steps, and a new driver on an empty disk."""
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    steps, bags = changes(SEED, 6)
    c, sql, uri, caches, driver, p, outs = _checkpointed(s3_server, tmp_path, steps, 3)
    fetched = p.stats["state_fetches"]
    p._shutdown()
    shutil.rmtree(driver)
    q = _open(c, uri, driver, caches)
    outs += feed(q, steps[4:])
    fetched += q.stats["state_fetches"]
    q.close()
    assert fetched > 0
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["carried", "join_agg"])
def test_stage_state_moves_through_the_store(s3_server, tmp_path, name) -> None:
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    steps, bags = changes(SEED, 12)
    c, sql = build(name)
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(3)]
    driver = str(tmp_path / "driver")
    p = _pipe(c, uri, driver, caches)
    outs = feed(p, steps[:5])
    st = p.stats
    # three caches picked at random by each task: most tasks find their cache stale or empty
    assert st["state_fetches"] > 0 and st["state_fetch_bytes"] > 0, st
    assert len(st["state_cache_roots"]) == 3 and all(not r.startswith(driver) for r in st["state_cache_roots"])
    assert state_db_paths(driver) == [], "no stage database on the driver's disk"
    p.rescale(3)
    outs += feed(p, steps[5:7])
    p.rescale(2)
    outs += feed(p, steps[7:8])
    p.checkpoint()
    outs += feed(p, steps[8:10])  # after the checkpoint: replayed by the restart
    p._shutdown()  # the driver dies without closing
    shutil.rmtree(driver)
    q = _open(c, uri, driver, caches[1:], workers=3)  # a cold rescale at open, on an empty driver disk
    assert q.steps == 10 and q.layout.workers == 3
    outs += feed(q, steps[10:])
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_chains_compact(s3_server, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(stage_store, "CHAIN_LIMIT", 2)  # merged deltas keep chains short: force compactions
    steps, _ = changes(SEED + 1, 10, max_rows=3)
    c, _ = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = _pipe(c, uri, str(tmp_path / "driver"), [str(tmp_path / "a"), str(tmp_path / "b")])
    outs = feed(p, steps)
    assert p.stats["state_compactions"] > 0
    assert max(len(ch) for ch in p.executor.chains.chains.values()) <= 2
    p.checkpoint()
    names = p._remote.list("stage")
    live = {link["object"] for ch in p.executor.chains.chains.values() for link in ch}
    assert live <= set(names) and len(names) == len(live), "retention leaves only the live chains"
    p.close()
    same_outputs(outs, embedded(c, steps))


def test_duplicates_and_retries_on_other_caches(s3_server, tmp_path) -> None:
    """Every task runs twice, on two different caches (a speculative duplicate on another Spark executor that
    commits and uploads too), and some first attempts fail before or after their commit and are retried: the
    driver keeps the acknowledged attempt's objects, a cache holding a duplicate's version discards it, and the
    outputs are exact."""
    steps, bags = changes(SEED + 2, 6)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(3)]
    runner = LocalJobRunner({(1, "after-commit", 0), (2, "before-commit", 1)}, caches, SEED, duplicates=True)
    p = _pipe(c, uri, str(tmp_path / "driver"), caches, runner=runner)
    outs = feed(p, steps)
    assert runner.retries == 2 and p.stats["state_fetches"] > 0
    names = set(p._remote.list("stage"))
    live = {link["object"] for ch in p.executor.chains.chains.values() for link in ch}
    assert live < names, "the duplicates uploaded objects of their own, and the chains name none of them"
    from dbsp_core.runtime import stage_task

    def cached() -> list:  # this pipeline's stage workers cached in this process, under any of the task caches
        return [k for k in stage_task._CACHE if os.path.basename(k[0]) == p.executor.store.key]

    assert {os.path.dirname(os.path.dirname(k[0])) for k in cached()} <= set(caches) and cached()
    p.close()
    assert not cached(), "a closed store pipeline's cached stage workers are still held"
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


class ProcessRunner(LocalJobRunner):
    """The reference runner with every task attempt run in one of two spawned processes (as Spark runs tasks in its
    Python workers): nothing of a task runs in the driver's process, so what the driver's process fetches from the
    store is the driver's own."""

    def __init__(self, caches: list[str], seed: int) -> None:
        super().__init__(cache_dirs=caches, seed=seed)
        self.pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))

    def call(self, fn, *args):
        return self.pool.submit(fn, *args).result()

    def close(self) -> None:
        self.pool.shutdown()


class _Crash(BaseException):
    """The driver dies here (not an Exception: the live rescale does not undo itself, as after a kill)."""


def _rescale_by_tasks(p, runner, tmp_path, workers: int, **kw) -> dict:
    """``p.rescale(workers)`` with its tasks on a new, empty stage cache (a Spark executor just added): asserts the
    driver's process fetched and uploaded no object of the store meanwhile, and the tasks fetched the old state."""
    before = dict(p._remote.stats)
    fetched, tasks = p.stats.get("state_fetch_bytes", 0), p.stats.get("move_tasks", 0)
    fresh = str(tmp_path / f"fresh-{workers}-{len(runner.cache_dirs)}")
    caches, runner.cache_dirs = runner.cache_dirs, [fresh]
    try:
        rep = p.rescale(workers, **kw)
    finally:
        runner.cache_dirs = caches + [fresh]
    now = p._remote.stats
    assert (now["gets"], now["get_bytes"]) == (before["gets"], before["get_bytes"]), \
        f"the driver fetched {now['get_bytes'] - before['get_bytes']} bytes from the store during the rescale"
    assert now["put_bytes"] == before["put_bytes"], "the driver uploaded state during the rescale"
    assert p.executor.store.key not in stage_store._REMOTES, \
        "a task of this pipeline ran in the driver's process"
    stateful = sum(p.executor.plan.stateful)
    assert p.stats["move_tasks"] - tasks >= stateful * workers, "the change ran as tasks, one per (stage, worker)"
    assert p.stats["state_fetch_bytes"] > fetched, "the tasks fetched the old state from the store"
    assert rep["moved_bytes"] > 0 and rep["to_workers"] == workers
    return rep


def test_a_rescale_moves_state_through_tasks_never_the_driver(s3_server, tmp_path) -> None:
    """2 -> 3 -> 2 (live) with every task in another process: the driver's process GETs no object during either
    change and the tasks fetch what they need; every step's output equals the embedded runtime's and DuckDB's."""
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    steps, bags = changes(SEED + 3, 6)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(2)]
    runner = ProcessRunner(caches, SEED)
    p = _pipe(c, uri, str(tmp_path / "driver"), caches, runner=runner)
    outs = feed(p, steps[:3])
    p.checkpoint()
    _rescale_by_tasks(p, runner, tmp_path, 3, batch_shards=64)
    outs += feed(p, steps[3:4])
    _rescale_by_tasks(p, runner, tmp_path, 2, batch_shards=64)
    outs += feed(p, steps[4:])
    assert p.layout.workers == 2
    p.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


CRASH_POINTS = ["live-begin:1", "rescale-intent:2", "rescale-commit:1", "rescale-commit:2", "rescale-committed:1",
                "rescale-layout:2", "live-batch:1"]


def test_a_driver_crash_mid_rescale_recovers_exactly_once(s3_server, tmp_path, monkeypatch) -> None:
    """The driver dies at a crash point of a live rescale 2 -> 3 (a point drawn from the seed); a new driver on an
    empty disk recovers from the store and goes on, rescaling again: every step's output, before and after, equals
    the embedded runtime's and DuckDB's (nothing lost, nothing doubled)."""
    point = CRASH_POINTS[SEED % len(CRASH_POINTS)]
    print(f"DBSP_STAGE_STORE_SEED={SEED} crash point {point}")
    name, n = point.split(":")
    hits = [int(n)]

    def crash(at: str) -> None:
        if at == name:
            hits[0] -= 1
            if hits[0] == 0:
                raise _Crash(point)

    steps, bags = changes(SEED + 4, 7)
    c, sql, uri, caches, driver, p, outs = _checkpointed(s3_server, tmp_path, steps, 2)  # its last step: replayed
    monkeypatch.setattr(driver_module, "crashpoint", crash)
    with pytest.raises(_Crash):
        p.rescale(3, batch_shards=64)
    monkeypatch.undo()
    p._shutdown()
    shutil.rmtree(driver)
    q = _open(c, uri, driver, caches)
    assert q.steps == 3, "every logged step is recovered, once"
    outs += feed(q, steps[3:5])
    q.rescale(3, batch_shards=64)
    outs += feed(q, steps[5:])
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_a_moved_worker_downloads_its_chain_at_once(s3_server, tmp_path, monkeypatch) -> None:
    """Issue 33: a task whose state moved to a cache that holds none of it (a replacement Spark executor) asks for
    every object of its chain at once (stage_store._Prefetch) instead of one after another, applies them in order
    (outputs equal the embedded runtime's), and leaves no downloaded file behind."""
    import threading
    import time

    from dbsp_core.storage.remote import Remote

    steps, _ = changes(SEED + 3, 6)
    c, _ = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    runner = LocalJobRunner(cache_dirs=[old], seed=SEED)
    monkeypatch.setattr(stage_store, "MERGE_FANOUT", 64)  # no merged deltas: a chain of one object a job
    p = _pipe(c, uri, str(tmp_path / "driver"), [old], runner=runner)
    outs = feed(p, steps[:5])  # each stateful (stage, worker) has a chain of 5 deltas, all cached in `old`
    assert min(len(ch) for ch in p.executor.chains.chains.values()) >= 5
    state = {"now": 0, "most": 0, "gets": 0}
    lock = threading.Lock()
    get_file = Remote.get_file

    def slow_get_file(self, name, path, *a, **kw):  # a store with latency: overlapping GETs show up
        if not name.startswith("stage/"):
            return get_file(self, name, path, *a, **kw)
        with lock:
            state["now"] += 1
            state["gets"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            time.sleep(0.05)
            return get_file(self, name, path, *a, **kw)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(Remote, "get_file", slow_get_file)
    runner.cache_dirs = [new]  # the next job's tasks all run where no state is
    fetches = p.stats["state_fetches"]
    outs += feed(p, steps[5:])
    assert p.stats["state_fetches"] - fetches == len(p.executor.chains.chains), p.stats
    assert state["gets"] >= 5 * len(p.executor.chains.chains), state
    assert state["most"] > 1, f"the chain's objects were downloaded one after another: {state}"
    left = [os.path.join(d, f) for d, _, fs in os.walk(new) for f in fs if ".delta" in f or f.endswith(".tmp")]
    assert left == [], left
    p.close()
    same_outputs(outs, embedded(c, steps))


def _group_by_pipe(tmp_path, s3_server, caches: int):
    """The group-by of bench_spark_store.py as a store pipeline with ``caches`` task caches taking the jobs in turn."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "bench"))
    from bench_spark_store import circuit

    uri = s3_server.uri(s3_server.bucket(), "pipe")
    return circuit, uri, _pipe(circuit(), uri, str(tmp_path / "driver"), [str(tmp_path / f"c{i}") for i in range(caches)])


def test_a_chain_from_a_base_is_not_compacted_at_every_job(s3_server, tmp_path) -> None:
    """Invariant 4 counts a chain's deltas, not its base, against the page file: after a compaction the next small
    jobs append deltas (the chain grows) instead of uploading the whole page file again each time (found by
    bench_spark_lose.py at 10M keys: 2,000-row steps re-uploaded every worker's state)."""
    import pyarrow as pa

    rng = np.random.default_rng(SEED + 4)
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    _, _, p = _group_by_pipe(tmp_path, s3_server, 1)
    keys = 200_000
    for lo in range(0, keys, 50_000):  # deltas that outgrow the page file: a compaction to a base
        k = np.arange(lo, lo + 50_000)
        p.push("s", pa.table({"k": k, "v": k % 1000}))
        p.step()
    steps = 6
    c0, u0 = p.stats.get("state_compactions", 0), p.stats["state_upload_bytes"]
    bases = {k: ch[0] for k, ch in p.executor.chains.chains.items()}
    for _ in range(steps):
        p.push("s", pa.table({"k": rng.integers(0, keys, 500), "v": rng.integers(0, 1000, 500)}))
        p.step()
    chains = p.executor.chains.chains
    compactions = p.stats.get("state_compactions", 0) - c0
    uploaded = p.stats["state_upload_bytes"] - u0
    p.close()
    assert all(b["kind"] == "base" for b in bases.values()), "the load compacted each chain to a base"
    assert compactions == 0, f"{compactions} compactions in {steps} small jobs of {len(chains)} chains"
    assert {k: ch[0] for k, ch in chains.items()} == bases, "the small jobs' deltas follow the load's bases"
    base = min(b["bytes"] for b in bases.values())
    assert uploaded < base, f"{uploaded} bytes uploaded by {steps} small jobs (a base: {base})"


def test_the_upload_of_small_steps_follows_the_change(s3_server, tmp_path) -> None:
    """Invariant 4 over many small steps: no step uploads a page file (found by bench_spark_lose.py at 2M keys: every
    16th job re-uploaded each worker's page file, and the first compaction after a load landed on the small steps
    after it, 15.8 MB per 2,000-row step), the bytes uploaded stay within 1 + log8(jobs) times the jobs' own deltas,
    the chains stay short, and the merged deltas replay right: the jobs move between two task caches (each
    brings its copy up to the chain through the merged objects), then a new driver restores from a checkpoint and
    a third cache rebuilds from the chains; every step's output summed against a dict model (a multiset)."""
    import pyarrow as pa

    rng = np.random.default_rng(SEED + 5)
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    circuit, uri, p = _group_by_pipe(tmp_path, s3_server, 2)
    keys, small, rows = 400_000, 20, 300
    pushed = []
    for lo in range(0, keys, 200_000):
        k = np.arange(lo, lo + 200_000)
        pushed.append(pa.table({"k": k, "v": k % 1000}))
    for _ in range(small):
        pushed.append(pa.table({"k": rng.integers(0, keys, rows), "v": rng.integers(0, 1000, rows)}))
    outs = feed(p, [[("s", t)] for t in pushed[:2]])
    state = min(sum(link["bytes"] for link in ch) for ch in p.executor.chains.chains.values())
    c0, d0 = p.stats.get("state_compactions", 0), p.stats.get("state_delta_bytes", 0)
    per_step, deltas = [], []
    for t in pushed[2:]:
        u, d = p.stats["state_upload_bytes"], p.stats.get("state_delta_bytes", 0)
        outs += feed(p, [[("s", t)]])
        per_step.append(p.stats["state_upload_bytes"] - u)
        deltas.append(p.stats.get("state_delta_bytes", 0) - d)
    own = p.stats.get("state_delta_bytes", 0) - d0
    chains = p.executor.chains.chains
    print(f"state {state:,} bytes a chain; small steps uploaded {per_step}; their own deltas {deltas}")
    assert max(per_step) < state / 4, f"a small step uploaded {max(per_step):,} bytes, a chain's state is {state:,}"
    assert p.stats.get("state_compactions", 0) == c0
    assert p.stats.get("state_merges", 0) > 0, "the small jobs' deltas were merged"
    assert 0 < sum(per_step) <= (1 + np.log(small) / np.log(stage_store.MERGE_FANOUT)) * own, (sum(per_step), own)
    assert max(len(ch) for ch in chains.values()) <= 1 + stage_store.MERGE_AT, {k: len(ch) for k, ch in chains.items()}
    assert p.stats.get("state_fetches", 0) >= small // 2, "the jobs moved between the two caches"
    p.checkpoint()
    p._shutdown()
    shutil.rmtree(str(tmp_path / "driver"))
    q = _open(circuit(), uri, str(tmp_path / "driver"), [str(tmp_path / "c2")])  # a cache rebuilt from the chains
    pushed.append(pa.table({"k": rng.integers(0, keys, rows), "v": rng.integers(0, 1000, rows)}))
    outs += feed(q, [[("s", pushed[-1])]])
    assert q.stats.get("state_fetches", 0) > 0
    q.close()
    model = pa.concat_tables(pushed).group_by("k").aggregate([("v", "count"), ("v", "sum")])  # Arrow's, not ours
    want = Counter(zip(model.column("k").to_pylist(), model.column("v_count").to_pylist(),
                       model.column("v_sum").to_pylist()))
    got: Counter = Counter()
    for out in outs:
        for row, w in out["agg"].to_dict().items():
            got[row] += w
    assert +got == want and len(want) == keys
