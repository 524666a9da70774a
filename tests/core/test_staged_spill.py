"""A memory budget on the staged executor (runtime/stage_task.py invariant 7) with the in-process job runner: state many times the budget, every stateful stage's traces spilled, every step equal to the embedded runtime and DuckDB across a task retry and a reopen, and with the state in an object store across a driver restart; and the argument's checks."""

from __future__ import annotations

import gc
import os
import socket
import tempfile

import numpy as np
import pytest
from staged_circuits import (build, changes, check_duckdb, embedded, open_staged, run_job, run_random_jobs,
                             same_outputs, staged_pipeline)

import dbsp_core as dbsp
from dbsp_core.errors import DbspError
from dbsp_core.runtime import StagedExecutor, stage_task
from dbsp_core.runtime.staged import LocalJobRunner
from dbsp_core.trace.spill import BatchStore

SEED = int(os.environ.get("DBSP_STAGED_SPILL_SEED", "1"))  # drawn per run by tests/conftest.py, printed after it
LIMIT = 1  # byte per task process: every loose batch of every trace spills after each step and each trace loaded


def _stateful(p) -> set[int]:
    plan = p.executor.plan
    return {k for k in range(plan.num_stages) if plan.stateful[k]}


@pytest.mark.parametrize("name", ["group_agg", "join_agg", "distinct", "carried"])
def test_budgeted_staged_pipeline_matches_embedded_and_duckdb_across_a_retry_and_a_reopen(name: str) -> None:
    seed = SEED + sum(map(ord, name))
    rng = np.random.default_rng(seed)
    steps, bags = changes(seed, 9, max_rows=120)
    c, sql = build(name)
    d = tempfile.mkdtemp()
    W = 2
    # the task store is this process's (stage_task invariant 7): stage workers another test of this process left in
    # its cache would count in its memory and disk below (the README run failed so under xdist: 3.6 MB in memory)
    stage_task.drop_cache()
    gc.collect()
    runner = LocalJobRunner(fail_first={(1, "before-commit", 1)})  # the first attempt of stage 1, worker 1 fails
    p = staged_pipeline(c, workers=W, storage=d, runner=runner, memory_limit=LIMIT)
    assert p.executor.memory_limit == LIMIT  # one task slot: the whole budget per task process
    outs = run_random_jobs(p, steps[:5], rng)
    assert runner.retries == 1, f"seed {seed}: the injected fault did not fire"
    m = p.metrics()["spill"]
    assert m["limit"] == LIMIT and m["bytes_written"] > 0
    written = {int(sw.split(".")[0]) for sw, n in m["files_by_stage_worker"].items() if n > 0}
    assert written == _stateful(p), f"seed {seed}: batch files written by stages {written} only"
    # what stays in memory is the output of merges under way (a level merge advances a step at a time, its output
    # built in memory until it is finished and spilled; with a few rows a step that can be 10% of the files, as
    # DBSP_STAGED_SPILL_SEED=868886276 showed): no loose or pending batch of any trace, not even of a trace still
    # fresh (restored by the retried task and not read since: the store places and spills its pending batches when
    # the budget needs it, trace/spill.py "What is not spilled"; DBSP_STAGED_SPILL_SEED=9119767 left five)
    loose = [(lvl, len(e[1])) for store in stage_task._STORES.values() for t in store.traces()
             for lvl, level in enumerate(t._by_level) for e in level.loose if not store.is_spilled(e[1])]
    loose += [("pending", len(b)) for store in stage_task._STORES.values() for t in store.traces() for b in t.pending]
    assert not loose, f"seed {seed}: batches left in memory under a budget of {LIMIT} byte: {loose}"
    assert m["disk_bytes"] > 1000 * LIMIT and m["memory_bytes"] <= m["disk_bytes"] // 4, f"seed {seed}: {m}"
    p.close()
    stage_task.drop_cache()  # a new driver on other processes: state is loaded from the stage databases
    q = open_staged(d, c, memory_limit=LIMIT)
    loads = q.stats.get("state_loads", 0)
    outs += run_random_jobs(q, steps[5:], rng)
    assert q.stats["state_loads"] > loads  # the reopened pipeline's tasks loaded their state under the budget...
    assert q.stats["task_spill"]["files_written"] > 0  # ... and spilled it
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_the_budget_is_divided_among_a_runners_task_slots_and_checked_at_the_boundary(tmp_path) -> None:
    c, _ = build("group_agg")

    class FourSlots(LocalJobRunner):
        task_slots = 4

    p = staged_pipeline(c, storage=str(tmp_path / "a"), runner=FourSlots(), memory_limit="1MiB",
                        spill_dir=str(tmp_path / "spill"))
    try:
        assert p.executor.memory_limit == (1 << 20) // 4 and p.executor.spill_dir == str(tmp_path / "spill")
        steps, _ = changes(SEED, 1, max_rows=50)
        run_job(p, steps, False)
        # this process's batch files are under the spill directory given, in a directory of its own
        assert os.listdir(tmp_path / "spill" / stage_task.SPILL_SUBDIR) == [f"{socket.gethostname()}-{os.getpid()}"]
    finally:
        p.close()
    with pytest.raises(ValueError, match="memory_limit must be"):
        staged_pipeline(c, storage=str(tmp_path / "b"), memory_limit="lots")
    with pytest.raises(ValueError, match="give memory_limit too"):
        staged_pipeline(c, storage=str(tmp_path / "c"), spill_dir=str(tmp_path))
    with pytest.raises(DbspError, match="task processes"):  # a store of the driver's process is refused
        StagedExecutor().spill(BatchStore(1))


def test_a_dead_processs_batch_files_are_removed_by_the_next_store(tmp_path) -> None:
    base = tmp_path / stage_task.SPILL_SUBDIR
    host = socket.gethostname()
    dead = base / f"{host}-999999999"  # above any pid_max: no such process
    other = base / "another-host-999999999"  # another host's process, on a shared directory: left alone
    dead.mkdir(parents=True)
    (dead / "x.batch").write_bytes(b"left by a killed Python worker")
    other.mkdir()
    store = stage_task.task_store(1 << 20, str(tmp_path))
    try:
        assert not dead.exists() and other.exists() and store.directory == str(base / f"{host}-{os.getpid()}")
    finally:
        store.close()
        stage_task._STORES.pop(str(base), None)


def test_budgeted_store_pipeline_uploads_what_its_spilled_tasks_commit(s3_server, tmp_path) -> None:
    """With an object store (stage_store.py) a task's commit uploads its delta from the rows of spilled batches:
    a driver restart on an empty disk, in task caches that are not the ones the budgeted tasks ran in, reads the
    same state (invariant 7: the batch files are never named by what is committed)."""
    seed = SEED + 7
    steps, bags = changes(seed, 6, max_rows=120)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(2)]
    kw = {"memory_limit": LIMIT, "spill_dir": str(tmp_path / "local"), "checkpoint_interval": None}
    p = dbsp.Pipeline(c, 2, 8, uri, executor=StagedExecutor(LocalJobRunner(cache_dirs=caches, seed=seed)),
                      cache_dir=str(tmp_path / "driver"), **kw)
    outs = run_random_jobs(p, steps[:4], np.random.default_rng(seed))
    assert p.stats["task_spill"]["files_written"] > 0 and p.stats["state_upload_bytes"] > 0
    p.checkpoint()
    p.close()
    stage_task.drop_cache()
    q = dbsp.Pipeline.open(uri, c, executor=StagedExecutor(LocalJobRunner(cache_dirs=[str(tmp_path / "other")],
                                                                          seed=seed)),
                           cache_dir=str(tmp_path / "driver-2"), **kw)
    outs += run_random_jobs(q, steps[4:], np.random.default_rng(seed + 1))
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_a_staged_spill_dir_without_memory_limit_is_refused_whatever_the_setting(tmp_path, monkeypatch) -> None:
    """DBSP_MEMORY_LIMIT is the embedded executor's only (README); the check that spill_dir comes with a budget
    read the setting first, so with it set (as CI runs the suites) a staged pipeline given spill_dir and no
    memory_limit was accepted and its spill_dir silently unused. It must be refused, as without the setting,
    while an embedded pipeline takes the setting's budget and the spill_dir."""
    import dbsp_core.runtime.driver as driver_module
    from dbsp_core.envvars import load

    monkeypatch.setattr(driver_module, "settings", lambda: load({"DBSP_MEMORY_LIMIT": "1"}))
    c, _ = build("group_agg")
    with pytest.raises(ValueError, match="give memory_limit too"):
        staged_pipeline(c, storage=str(tmp_path / "c"), spill_dir=str(tmp_path / "s"))
    with dbsp.Pipeline(c, storage=str(tmp_path / "e"), spill_dir=str(tmp_path / "s")) as p:
        assert p.executor.batch_store is not None and p.executor.batch_store.memory_limit == 1


def test_a_commit_holds_the_jobs_new_batches_on_disk_not_in_memory(tmp_path) -> None:
    """A job's commit encoded every new batch into the stage database's page cache and held it there until the commit
    (runtime/stage_task.py invariant 7), so a task process's peak grew with the batches its merges made, not with its
    budget. Here a state of 10x the budget (min under deletion keeps every input row), one worker and two shards (a
    batch is two values): each commit holds at most a quarter of the budget in memory (the stage database's dirty
    pages once the job's state is written) while the job's batches go to the file, and the view is a dict model's.
    Before the fix the largest commit held about its largest new batch, several times the budget."""
    import pyarrow as pa

    lim = 512 << 10
    c = dbsp.Circuit()
    s = c.input("s", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("agg", s.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v")))
    rng = np.random.default_rng(SEED)
    p = staged_pipeline(c, workers=1, storage=str(tmp_path), shard_bits=1, memory_limit=lim)
    rows: dict[tuple[int, int], int] = {}  # the input's multiset: (k, v) -> multiplicity
    view: dict[tuple, int] = {}
    for step in range(4):
        k, v = rng.integers(0, 10_000, 40_000), rng.integers(0, 1_000_000, 40_000)
        w = np.ones(len(k), dtype=np.int64)
        if step >= 2:  # retract 2k rows pushed before: min under deletion reads the rows left
            old = list(rows)
            pick = [old[i] for i in rng.choice(len(old), 2_000, replace=False)]
            k = np.concatenate([k, [r[0] for r in pick]])
            v = np.concatenate([v, [r[1] for r in pick]])
            w = np.concatenate([w, -np.ones(len(pick), dtype=np.int64)])
        for r in zip(k.tolist(), v.tolist(), w.tolist()):
            rows[r[:2]] = rows.get(r[:2], 0) + r[2]
            if rows[r[:2]] == 0:
                del rows[r[:2]]
        p.push("s", pa.table({"k": k, "v": v}), weights=w)
        for r, n in p.step()["agg"].to_dict().items():
            view[r] = view.get(r, 0) + n
            if view[r] == 0:
                del view[r]
    spill = p.stats["task_spill"]
    (stage,) = _stateful(p)
    db = stage_task.stage_db_path(str(tmp_path), stage, 0)
    p.close()
    want: dict[int, list[int]] = {}
    for (kk, vv), n in rows.items():
        assert n > 0
        want.setdefault(kk, []).extend([vv] * n)
    assert view == {(kk, len(vs), min(vs)): 1 for kk, vs in want.items()}, f"seed {SEED}"
    assert os.path.getsize(db) >= 10 * lim, f"seed {SEED}: a state of {os.path.getsize(db)} bytes is too small"
    assert spill["bytes_written"] > 0  # the traces spilled under the budget
    assert 0 < spill["commit_held_max"] <= lim // 4, f"seed {SEED}: a commit held {spill['commit_held_max']} bytes"
