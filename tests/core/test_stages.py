"""The staged executor (dbsp_core.runtime.stage_plan, stage_task, staged) against the embedded runtime and DuckDB: stage workers run by hand, the staged pipeline with any W and any grouping of steps into jobs, retried tasks, stale attempts, cache loss and recovery after a partial job."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st
from oracle import BIDS
from staged_circuits import CIRCUITS, build, changes, check_duckdb, embedded, open_staged, same_outputs, staged_pipeline

import dbsp_core as dbsp
from dbsp_core.runtime import stage_task as stagetask
from dbsp_core.errors import DbspError, RecoveryError, ReplayMismatchError
from dbsp_core.operators.base import concat
from dbsp_core.runtime.staged import Job, LocalJobRunner
from dbsp_core.runtime.stage_plan import StagePlan, StageWorker, read_acks
from dbsp_core.runtime.stage_task import StaleAttemptError, run_stage_task
from dbsp_core.storage import Database

NAMES = sorted(CIRCUITS)


def by_hand(circuit: dbsp.Circuit, steps: list[list[tuple[str, dbsp.ZSet]]], workers: int, rng) -> list[dict]:
    """Run every stage worker by hand, routing sends and carried values like a shuffle; each push goes to a
    random worker (a result must not depend on where input lands)."""
    plan = StagePlan(circuit)
    sm = dbsp.ShardMap(workers)
    sw = [[StageWorker(circuit, plan, k, w, sm) for w in range(workers)] for k in range(plan.num_stages)]
    res = []
    for pushes in steps:
        box: dict[tuple[int, int], list[tuple[int, dbsp.ZSet]]] = {}  # (node, worker) -> [(src, z)]
        for h, z in pushes:
            if h in plan.inputs:
                box.setdefault((plan.inputs[h], int(rng.integers(workers))), []).append((-1, z))
        outs: dict[str, list[dbsp.ZSet]] = {n: [] for n in plan.output_names}
        for k in range(plan.num_stages):
            for w in range(workers):
                got = {j: concat([z for _, z in sorted(box.get((j, w), []), key=lambda t: t[0])],
                                 circuit.nodes[j].schema) for j in plan.receive[k]}
                r = sw[k][w].step(got)
                for x, parts in r.sends.items():
                    for p, z in enumerate(parts):
                        box.setdefault((x, p), []).append((w, z))
                for j, z in r.carried.items():
                    box.setdefault((j, w), []).append((w, z))
                for n, z in r.outputs.items():
                    outs[n].append(z)
        res.append({n: concat(zs, plan.output_schemas[n]).consolidate() for n, zs in outs.items()})
    return res


@settings(max_examples=examples(12))
@given(name=st.sampled_from(NAMES), workers=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31 - 1))
def test_stage_workers_by_hand_match_embedded(name: str, workers: int, seed: int) -> None:
    c, _ = build(name)
    steps, _ = changes(seed, 6)
    same_outputs(by_hand(c, steps, workers, np.random.default_rng(seed)), embedded(c, steps, workers=2))


def test_plan_of_carried_circuit() -> None:
    c, _ = build("carried")
    plan = StagePlan(c)
    assert plan.num_stages == 3
    assert plan.stateful == [False, True, True]
    carried = [j for k in range(3) for j in plan.emit[k]]
    assert carried and all(plan.stage_of[j] == 0 for j in carried)
    # auctions' exchange is received in stage 1 and read in stage 2: it is forwarded
    x = [j for j in plan.receive[1] if plan.last_needed[j] == 2]
    assert x and all(plan.forwards(j, 1) for j in x)


def _run_staged(tmp, name: str, workers: int, steps, groups: list[int], runner=None, shard_bits: int = 8
                ) -> list[dict]:
    c, _ = build(name)
    p = staged_pipeline(c, workers=workers, shard_bits=shard_bits, storage=str(tmp), runner=runner)
    outs: list[dict] = []
    i = 0
    for g in groups:
        for pushes in steps[i:i + g]:
            for h, z in pushes:
                p.push(h, z)
            p.queue_step()
        outs.extend(p.run_queued())
        i += g
    p.close()
    return outs


@settings(max_examples=examples(10))
@given(name=st.sampled_from(NAMES), workers=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31 - 1),
       groups=st.lists(st.integers(1, 4), min_size=1, max_size=4), shard_bits=st.sampled_from([2, 3, 8]))
def test_staged_pipeline_matches_embedded_and_duckdb(tmp_path_factory, name, workers, seed, groups,
                                                     shard_bits) -> None:
    n = sum(groups)
    steps, bags = changes(seed, n)
    c, sql = build(name)
    outs = _run_staged(tmp_path_factory.mktemp("staged"), name, workers, steps, groups, shard_bits=shard_bits)
    same_outputs(outs, embedded(c, steps, workers=1))
    check_duckdb(sql, outs, bags)


@pytest.mark.parametrize("point", ["before-commit", "after-commit"])
@pytest.mark.parametrize("name", ["join_agg", "carried"])
def test_retried_tasks_give_the_same_output_once(tmp_path, name: str, point: str) -> None:
    steps, _ = changes(7, 6)
    c, _ = build(name)
    plan = StagePlan(c)
    faults = {(k, point, w) for k in range(plan.num_stages) for w in range(2)}
    runner = LocalJobRunner(fail_first=faults)
    before = dict(stagetask.cache_stats)
    outs = _run_staged(tmp_path, name, 2, steps, [2, 1, 3], runner=runner)
    assert runner.retries == len(faults)
    same_outputs(outs, embedded(c, steps))
    if point == "after-commit":  # the retry found the committed version and returned the stored result
        assert stagetask.cache_stats["replayed_results"] > before["replayed_results"]
    else:  # the retry in this process rolled the cached instances back
        assert stagetask.cache_stats["rollbacks"] > before["rollbacks"]
    q = open_staged(str(tmp_path), c)
    assert [z for _, z in q.read_output(next(iter(outs[0])))] == [o[next(iter(o))] for o in outs]  # exactly once
    q.close()


def _job_and_blobs(tmp_path, workers: int = 2):
    """A pipeline after one step, and the stage-1 task and input blobs of its next job (run by hand)."""
    c, _ = build("group_agg")
    p = staged_pipeline(c, workers=workers, storage=str(tmp_path))
    steps, _ = changes(3, 2)
    for h, z in steps[0]:
        p.push(h, z)
    p.step()
    p.push("bids", pa.table({"auction": [1, 2, 3, 4], "bidder": ["a", "b", "c", "d"], "price": [5, 6, 7, 8],
                             "f": [0.5, 1.0, 1.5, 2.0]}))
    step = p._divide(wait=True).input
    job: Job = p.executor._make_job([step])
    t0, t1 = job.tasks
    mid = pa.concat_tables([run_stage_task(t0, w, job.inputs.filter(pa.compute.equal(job.inputs["part"], w)))
                            for w in range(workers)])
    return p, t1, mid


def test_duplicate_attempt_returns_the_committed_result_and_keeps_the_versions(tmp_path) -> None:
    p, t1, mid = _job_and_blobs(tmp_path)
    mine = mid.filter(pa.compute.equal(mid["part"], 0))
    first = run_stage_task(t1, 0, mine)
    path = stagetask.stage_db_path(p.storage, 1, 0)
    with dbsp.Database(path) as db:
        vs = db.versions()
    stagetask.drop_cache()
    again = run_stage_task(t1, 0, mine)  # a speculative duplicate after the first attempt committed
    assert again.equals(first)
    with dbsp.Database(path) as db:
        assert db.versions() == vs == range(t1.version, t1.version + 2)
    p.close(checkpoint=False)


def test_stale_attempt_raises_and_changes_nothing(tmp_path) -> None:
    p, t1, mid = _job_and_blobs(tmp_path)
    mine = mid.filter(pa.compute.equal(mid["part"], 0))
    run_stage_task(t1, 0, mine)  # job 1 commits version 2
    old = dataclasses.replace(t1, version=t1.version - 1, steps=t1.steps[:1])  # a zombie of job 0 arrives late
    path = stagetask.stage_db_path(p.storage, 1, 0)
    with dbsp.Database(path) as db:
        vs = db.versions()
    with pytest.raises(StaleAttemptError, match="stale attempt"):
        run_stage_task(old, 0, mine)
    with dbsp.Database(path) as db:
        assert db.versions() == vs
    p.close(checkpoint=False)


def test_misrouted_blob_is_refused(tmp_path) -> None:
    p, t1, mid = _job_and_blobs(tmp_path)
    with pytest.raises(DbspError, match="misrouted"):
        assert mid.num_rows
        wrong = mid.set_column(0, "part", pa.array(np.ones(mid.num_rows, dtype=np.int32)))
        run_stage_task(t1, 0, wrong)
    p.close(checkpoint=False)


def test_cache_loss_between_jobs_loads_state_from_the_databases(tmp_path) -> None:
    class Forgetful(LocalJobRunner):
        def run_job(self, job):
            stagetask.drop_cache()
            return super().run_job(job)

    steps, bags = changes(11, 6)
    c, sql = build("carried")
    before = stagetask.cache_stats["loads"]
    outs = _run_staged(tmp_path, "carried", 3, steps, [1, 2, 3], runner=Forgetful())
    assert stagetask.cache_stats["loads"] > before
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_closing_a_pipeline_releases_its_cached_stage_workers(tmp_path) -> None:
    """A task process kept a closed pipeline's cached stage workers (their operator instances, traces and key
    indexes) until 64 newer entries or drop_cache pushed them out. Closing it releases them (the traces are freed,
    not only unlisted), and only its own: another open pipeline's stay, and its next job is a cache hit."""
    import gc
    import weakref

    from dbsp_core.trace import Trace

    c, _ = build("carried")
    steps, _ = changes(5, 3)
    a = staged_pipeline(c, 2, str(tmp_path / "a"))
    b = staged_pipeline(build("carried")[0], 2, str(tmp_path / "b"))
    for p in (a, b):
        for batch in steps[:2]:
            for name, z in batch:
                p.push(name, z)
            p.step()

    def entries(p: dbsp.Pipeline) -> list:
        return [e for k, e in stagetask._CACHE.items() if k[0] == p.executor.storage]

    held = entries(a)
    assert held and entries(b), "the staged pipelines ran no stateful stage task in this process"
    traces = [weakref.ref(t) for e in held for inst in e.worker.stateful.values() for t in vars(inst).values()
              if isinstance(t, Trace)]
    assert traces
    del held
    a.close()
    gc.collect()
    assert not entries(a), "a closed pipeline's cached stage workers are still held"
    assert not [r for r in traces if r() is not None], "a closed pipeline's traces are still alive"
    hits = stagetask.cache_stats["hits"]
    for name, z in steps[2]:
        b.push(name, z)
    b.step()
    assert entries(b) and stagetask.cache_stats["hits"] > hits  # the open pipeline's entries were kept
    b.close()
    assert not entries(b)


class PartialJob(LocalJobRunner):
    """Runs the first ``n`` jobs, then commits only worker 0 of every stateful stage and fails (a crashed job)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def run_job(self, job):
        if self.n:
            self.n -= 1
            return super().run_job(job)
        blobs = job.inputs
        for task in job.tasks:
            blobs = run_stage_task(task, 0, blobs.filter(pa.compute.equal(blobs["part"], 0)))
            break
        raise RuntimeError("the driver lost the job")


@pytest.mark.parametrize("name", ["join_agg", "left_join"])
def test_reopen_after_a_partial_job_recovers_exactly(tmp_path, name: str) -> None:
    steps, bags = changes(5, 7)
    c, sql = build(name)
    ref = embedded(c, steps)
    p = staged_pipeline(c, workers=2, storage=str(tmp_path), runner=PartialJob(2), checkpoint_interval=None)
    for pushes in steps[:2]:
        for h, z in pushes:
            p.push(h, z)
        p.step()
    for pushes in steps[2:4]:
        for h, z in pushes:
            p.push(h, z)
        p.queue_step()
    for h, z in steps[4][:1]:  # acknowledged but never divided
        p.push(h, z)
    with pytest.raises(RuntimeError, match="lost the job"):
        p.run_queued()
    with pytest.raises(DbspError, match="broken"):
        p.step()
    p.close()  # broken: no checkpoint, files released
    q = open_staged(str(tmp_path), c)
    assert q.steps == 4 and q.stats["replayed_steps"] >= 2
    for h, z in steps[4][1:]:
        q.push(h, z)
    q.step()
    for pushes in steps[5:]:
        for h, z in pushes:
            q.push(h, z)
        q.step()
    name_out = next(iter(sql))
    got = [z for _, z in q.read_output(name_out)]
    same_outputs([{name_out: z} for z in got], [{name_out: r[name_out]} for r in ref])
    q.close()


def test_replayed_steps_are_verified_against_the_output_log(tmp_path) -> None:
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    c.output("raw", bids.filter(pa.compute.field("price") > 3))  # no state: the checkpoint is the driver's
    p = staged_pipeline(c, workers=2, storage=str(tmp_path), checkpoint_interval=None)
    for i in range(3):
        p.push("bids", pa.table({"auction": [i], "bidder": ["x"], "price": [10 + i], "f": [0.0]}))
        p.step()
        if i == 0:
            p.checkpoint()
    p.close(checkpoint=False)
    q = open_staged(str(tmp_path), c)
    assert q.stats["replayed_steps"] == 2
    assert [z.to_dict() for _, z in q.read_output("raw")] == [{(i, "x", 10 + i, 0.0): 1} for i in range(3)]
    q.close(checkpoint=False)

    class Tamper(LocalJobRunner):
        def run_job(self, job):
            out = super().run_job(job)
            lost = pa.compute.and_(pa.compute.less(out["node"], 0), pa.compute.greater(out["node"], -1000))
            return out.filter(pa.compute.invert(lost))  # every output share lost

    with pytest.raises(ReplayMismatchError, match="replayed step 1"):
        open_staged(str(tmp_path), c, runner=Tamper())


def test_push_validation_records_nothing(tmp_path) -> None:
    c, _ = build("group_agg")
    p = staged_pipeline(c, workers=2, storage=str(tmp_path))
    with pytest.raises(KeyError, match="unknown input handle"):
        p.push("nope", pa.table({"x": [1]}))
    with pytest.raises(dbsp.SchemaError, match="do not match"):
        p.push("bids", pa.table({"auction": [1]}))
    assert all(not z.num_rows for z in p.step().values())
    assert p.read_input(0) == {h: dbsp.ZSet.empty(s) for h, s in p._inputs.items()}
    p.close()


@pytest.mark.parametrize("name", ["dbsp_core.runtime.stage_plan", "dbsp_core.runtime.stage_task", "dbsp_core.runtime.staged", "dbsp_core.runtime.job_files"])
def test_docstring_examples(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


class CrashAfterCommit(LocalJobRunner):
    """Runs the first ``n`` jobs; the next one runs completely (every stage database commits) and then the
    driver dies before it logs any output."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def run_job(self, job):
        out = super().run_job(job)
        if self.n:
            self.n -= 1
            return out
        raise RuntimeError("the driver died after the commits")


@pytest.mark.parametrize("name", ["group_agg", "carried"])
def test_reopen_after_commits_without_logged_output_reruns_the_job(tmp_path, name: str) -> None:
    steps, bags = changes(9, 6)
    c, sql = build(name)
    p = staged_pipeline(c, workers=2, storage=str(tmp_path), runner=CrashAfterCommit(1))
    for pushes in steps[:1]:
        for h, z in pushes:
            p.push(h, z)
        p.step()
    for pushes in steps[1:4]:
        for h, z in pushes:
            p.push(h, z)
        p.queue_step()
    with pytest.raises(RuntimeError, match="died"):
        p.run_queued()
    p.close()
    q = open_staged(str(tmp_path), c)  # the databases are at step 4, the output log at step 1
    assert q.steps == 4 and q.stats["replayed_steps"] == 3
    for pushes in steps[4:]:
        for h, z in pushes:
            q.push(h, z)
        q.step()
    outs = [q._output.get(s) for s in range(len(steps))]
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_reopen_after_part_of_a_jobs_output_was_logged(tmp_path, monkeypatch) -> None:
    steps, bags = changes(10, 5)
    c, sql = build("join_agg")
    p = staged_pipeline(c, workers=3, storage=str(tmp_path))
    for pushes in steps[:4]:
        for h, z in pushes:
            p.push(h, z)
        p.queue_step()
    real = type(p._output).write

    def write(self, step, out, *rest, **kw):  # rest: the input ranges and the references
        if step == 2:
            raise OSError("disk gone while logging step 2")
        return real(self, step, out, *rest, **kw)

    monkeypatch.setattr(type(p._output), "write", write)
    with pytest.raises(OSError, match="disk gone"):
        p.run_queued()
    monkeypatch.undo()
    p.close()
    q = open_staged(str(tmp_path), c)  # steps 0 and 1 are logged, 2 and 3 are not
    assert q.steps == 4 and q.stats["replayed_steps"] == 4
    for h, z in steps[4]:
        q.push(h, z)
    q.step()
    outs = [q._output.get(s) for s in range(len(steps))]
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


class Crashy(LocalJobRunner):
    """Runs jobs normally until job ``at``, which it runs up to stage ``stage``, then only the first ``workers``
    tasks of that stage (``stage`` past the last one: the whole job, committed), then the driver dies."""

    def __init__(self, at: int, stage: int, workers: int) -> None:
        super().__init__()
        self.at, self.stage, self.workers = at, stage, workers

    def run_job(self, job):
        if self.at:
            self.at -= 1
            return super().run_job(job)
        blobs = job.inputs
        for task in job.tasks:
            parts = blobs.column("part").to_numpy()
            n = job.workers if task.stage < self.stage else self.workers if task.stage == self.stage else 0
            outs = [run_stage_task(task, w, blobs.filter(pa.array(parts == w))) for w in range(n)]
            if n < job.workers:
                break
            blobs = pa.concat_tables(outs)
        raise RuntimeError("the driver died in a job")


@settings(max_examples=examples(20))
@given(name=st.sampled_from(NAMES), workers=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31 - 1),
       groups=st.lists(st.integers(1, 3), min_size=2, max_size=5), at=st.integers(0, 3), stage=st.integers(0, 3),
       crash_workers=st.integers(0, 2), checkpoints=st.lists(st.booleans(), min_size=5, max_size=5))
@pytest.mark.slow
def test_a_crash_anywhere_in_a_job_then_reopen_gives_every_step_once(tmp_path_factory, name, workers, seed, groups,
                                                                     at, stage, crash_workers, checkpoints) -> None:
    steps, bags = changes(seed, sum(groups))
    c, sql = build(name)
    d = str(tmp_path_factory.mktemp("crash"))
    p = staged_pipeline(c, workers=workers, storage=d, runner=Crashy(at, stage, min(crash_workers, workers - 1)),
                       checkpoint_interval=None)
    i = 0
    crashed = False
    for g, ck in zip(groups, checkpoints):
        for pushes in steps[i:i + g]:
            for h, z in pushes:
                p.push(h, z)
            p.queue_step()
        i += g
        try:
            p.run_queued()
        except RuntimeError:
            crashed = True
            break
        if ck:
            p.checkpoint()
    p.close()
    q = open_staged(d, c)
    assert q.steps == i  # every divided step ran (again) exactly once
    for pushes in steps[i:]:
        for h, z in pushes:
            q.push(h, z)
        q.step()
    outs = [q._output.get(s) for s in range(len(steps))]
    q.close()
    assert crashed or at >= len(groups)
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags, every=3)


def test_producer_retries_count_once_across_reopens(tmp_path) -> None:
    c, _ = build("group_agg")
    row = pa.table({"auction": [1], "bidder": ["a"], "price": [5], "f": [0.0]})
    p = staged_pipeline(c, workers=2, storage=str(tmp_path), checkpoint_interval=None)
    assert not p.push("bids", row, producer="gen", seq=0).duplicate
    p.step()
    p.checkpoint()  # driver.db: seq 0 seen, at step 1
    assert not p.push("bids", row, producer="gen", seq=1).duplicate
    p.step()  # the stage databases move on to step 2; driver.db stays at step 1
    assert not p.push("bids", row, producer="gen", seq=2).duplicate  # acknowledged, not divided
    p.close(checkpoint=False)
    q = open_staged(str(tmp_path), c)
    assert q.steps == 2
    assert all(q.push("bids", row, producer="gen", seq=s).duplicate for s in range(3))
    assert q.step()["g"].to_dict() == {(1, 2, 10, 5): -1, (1, 3, 15, 5): 1}  # seq 2 counted once
    q.close()


class TwoProcesses(LocalJobRunner):
    """Jobs rotate over ``n`` simulated executor processes (default 2), each with its own stage cache, so every
    stateful task finds a cache entry ``n - 1`` jobs stale (as when Spark hands a task another Python worker)."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.caches = [dict() for _ in range(n)]
        self.n = 0

    def run_job(self, job):
        mine = self.caches[self.n % len(self.caches)]
        self.n += 1
        outside = dict(stagetask._CACHE)
        stagetask._CACHE.clear()
        stagetask._CACHE.update(mine)
        try:
            return super().run_job(job)
        finally:
            mine.clear()
            mine.update(stagetask._CACHE)
            stagetask._CACHE.clear()
            stagetask._CACHE.update(outside)


@pytest.mark.parametrize("name,processes,keep", [("join_agg", 2, 16), ("left_join", 3, 16), ("carried", 3, 0),
                                                 ("carried", 2, 16)])
def test_stale_cache_entries_give_partial_loads_and_the_same_results(tmp_path, monkeypatch, name: str,
                                                                     processes: int, keep: int) -> None:
    """With the save log (keep=16) a stale entry reads only new batches; with it cut short (keep=0 and entries
    two jobs stale) it scans the state and still reuses the batches it holds."""
    monkeypatch.setattr(stagetask, "_SAVELOG_KEEP", keep)
    steps, bags = changes(17, 12, max_rows=12)
    c, sql = build(name)
    before, listed = stagetask.cache_stats["partial_loads"], stagetask.cache_stats["listed_loads"]
    p = staged_pipeline(c, workers=2, storage=str(tmp_path), runner=TwoProcesses(processes))
    outs = []
    for pushes in steps:
        for h, z in pushes:
            p.push(h, z)
        outs.append(p.step())
    assert p.stats.get("state_partial_loads", 0) >= len(steps) - processes and not p.stats.get("state_cache_hits")
    assert stagetask.cache_stats["partial_loads"] > before
    assert (stagetask.cache_stats["listed_loads"] > listed) == (keep > 0)
    p.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags, every=4)


def test_stateful_stage_zero_and_plain_zset_state(tmp_path) -> None:
    """Delay and integrate keep plain Z-set state in stage 0 (before any exchange): one database per worker
    there too, and results equal the embedded runtime's however steps are grouped into jobs."""
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    prev = bids.select(a="auction").delay()
    c.output("prev", prev)
    c.output("seen", (bids.select(a="auction") + prev).integrate().distinct())
    plan = StagePlan(c)
    assert plan.stateful[0] and plan.stateful[-1]
    steps, _ = changes(23, 7)
    steps = [[(h, z) for h, z in pushes if h == "bids"] for pushes in steps]
    p = staged_pipeline(c, workers=3, storage=str(tmp_path), runner=TwoProcesses())
    outs = []
    for g in (1, 3, 1, 2):
        for pushes in steps[len(outs):len(outs) + g]:
            for h, z in pushes:
                p.push(h, z)
            p.queue_step()
        outs.extend(p.run_queued())
    p.close()
    q = open_staged(str(tmp_path), c)
    for h, z in steps[0]:
        q.push(h, z)
    outs.append(q.step())
    q.close()
    same_outputs(outs, embedded(c, steps + steps[:1]))


def test_a_save_log_that_lists_a_missing_key_falls_back_to_reading_the_tables(tmp_path) -> None:
    steps, _ = changes(31, 6)
    c, _ = build("join_agg")
    runner = TwoProcesses()
    p = staged_pipeline(c, workers=2, storage=str(tmp_path), runner=runner)
    outs = []
    for pushes in steps[:3]:
        for h, z in pushes:
            p.push(h, z)
        outs.append(p.step())
    for cache in runner.caches:  # make every stale entry claim a batch key the database never held
        for entry in cache.values():
            for saved in entry.snapshot._saved.values():
                if saved:
                    b, keys = next(iter(saved.values()))
                    keys.append(keys[0][:4] + b"\xff" * 8)
    before = stagetask.cache_stats["listing_fallbacks"]
    for pushes in steps[3:]:
        for h, z in pushes:
            p.push(h, z)
        outs.append(p.step())
    assert stagetask.cache_stats["listing_fallbacks"] > before
    p.close()
    same_outputs(outs, embedded(c, steps))


class OutputsInResult(LocalJobRunner):
    """Like the Spark runner: a stateful last stage leaves its output shares in its result files, which are read
    after the job (stage_task.py invariant 5)."""

    def __init__(self, fail_first=None) -> None:
        super().__init__(fail_first)
        self.by_file = 0

    def run_job(self, job):
        last = len(job.tasks) - 1
        if not job.tasks[last].plan.stateful[last]:
            return super().run_job(job)
        tasks = job.tasks[:last] + [dataclasses.replace(job.tasks[last], outputs_in_result=True)]
        got = super().run_job(job._replace(tasks=tasks))
        own = [-1 - k for k, _, _ in job.tasks[last].plan.outputs[last]]  # outputs of earlier stages are forwarded
        assert not np.isin(got.column("node").to_numpy(), own).any()
        self.by_file += 1
        return pa.concat_tables([got, stagetask.read_result_outputs(tasks[last], job.workers)])


@pytest.mark.parametrize("point", [None, "before-commit", "after-commit"])
@pytest.mark.parametrize("name", ["join_agg", "carried", "group_agg"])
def test_outputs_read_from_the_result_files_match_embedded(tmp_path, name: str, point: str | None) -> None:
    steps, bags = changes(13, 6)
    c, sql = build(name)
    plan = StagePlan(c)
    last = plan.num_stages - 1
    runner = OutputsInResult({(last, point, w) for w in range(2)} if point else None)
    outs = _run_staged(tmp_path, name, 2, steps, [2, 1, 3], runner=runner)
    assert runner.by_file == 3 and runner.retries == (2 if point else 0)
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_result_outputs_of_another_job_are_refused(tmp_path) -> None:
    p, t1, mid = _job_and_blobs(tmp_path)
    t1 = dataclasses.replace(t1, outputs_in_result=True)
    for w in range(2):
        back = run_stage_task(t1, w, mid.filter(pa.compute.equal(mid["part"], w)))
        assert len(read_acks(back)) == 1 and not stagetask._is_output(back).any()  # acknowledgement and control
    outs = stagetask.read_result_outputs(t1, 2)
    assert outs.num_rows > 0
    with pytest.raises(RecoveryError, match="holds the result of job"):
        stagetask.read_result_outputs(dataclasses.replace(t1, version=t1.version + 1), 2)
    with pytest.raises(DbspError, match="needs a stateful stage"):
        run_stage_task(dataclasses.replace(t1, stage=0, outputs_in_result=True), 0, mid.slice(0, 0))
    # a duplicate attempt that wants its outputs back gets exactly the shares the driver reads from the file
    mine = mid.filter(pa.compute.equal(mid["part"], 0))
    whole = run_stage_task(dataclasses.replace(t1, outputs_in_result=False), 0, mine)
    assert whole.filter(pa.array(stagetask._is_output(whole))).equals(outs.filter(pa.compute.equal(outs["part"], 0)))
    p.close(checkpoint=False)


@pytest.mark.parametrize("name", NAMES)
def test_traces_read_from_the_stage_databases_match_embedded(tmp_path, name: str) -> None:
    """``StagedPipeline.traces`` loads each worker's keyed state from its stage databases (read-only: their
    versions do not change) and holds the same names and contents as the embedded runtime's traces."""
    steps, _ = changes(5, 4)
    c, _ = build(name)
    p = staged_pipeline(c, workers=2, storage=str(tmp_path))
    ref = dbsp.Pipeline(c, workers=2)
    for i, pushes in enumerate(steps):
        for h, z in pushes:
            p.push(h, z)
            ref.push(h, z)
        if i % 2:
            p.queue_step()
            p.run_queued()
        else:
            p.step()
        ref.step()
    p.queue_step()  # queued, not run: not in the traces yet
    paths = [path for _, _, path in stagetask.open_stage_databases(str(tmp_path), p.executor.plan, 2)]

    def versions() -> list[range]:
        out = []
        for path in paths:
            with Database(path) as db:
                out.append(db.versions())
        return out

    before = versions()
    for w in range(2):
        got, want = p.traces(w), ref.traces(w)
        assert sorted(got) == sorted(want) and got
        for label, t in want.items():
            assert got[label].consolidated().zset.to_dict() == t.consolidated().zset.to_dict(), label
    assert versions() == before
    with pytest.raises(ValueError, match="outside"):
        p.traces(2)
    ref.close()
    p.close(checkpoint=False)
