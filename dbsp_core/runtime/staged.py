"""The staged executor (driver side): runs a circuit's steps as jobs of stage tasks (stage_plan.py, stage_task.py) on a job runner that moves blobs between workers, with the state of each stateful (stage, worker) in its own Database, committed by every job.

A **job** runs one or more consecutive divided steps: the executor encodes each step's input as blobs (each push
spread in contiguous slices over the W workers), hands the job to a :class:`JobRunner` (one task per stage and
worker, stages in order, blobs routed by their ``part``), and gets back every output share and one commit
acknowledgement per stateful (stage, worker). :class:`LocalJobRunner` runs the tasks in this process (the
reference); ``spark_glue`` runs them as Spark tasks with the shuffle as the router.

Invariants (enforced here):
  1. Every job commits every stateful stage database once, from the common base version ``v`` to ``v + 1``;
     the executor checks that it got an acknowledgement of ``v + 1`` at the job's end step from every stateful
     (stage, worker) before it returns any of the job's output, else it raises (the driver marks the pipeline
     broken; recover with ``open``). So after each job the stage databases are a consistent checkpoint, and
     a step's division must be durable before the step runs (``division_first``).
  2. Before a job runs, ``state/JOB`` durably records its base version ``v`` and steps. Stage tasks commit
     ``v + 1`` before the driver logs the job's output, so :meth:`StagedExecutor.open_state` opens every stage
     database at the maximum of the intersection of their versions, but not above ``v`` when the output log
     lacks some step of that job (the job then runs again, its logged steps verified); this discards a
     partial job. Once every database holds that one version, the record has done its work and is removed.
  3. Results do not depend on W, on the layout, on how steps are grouped into jobs, nor on task retries
     (stage_plan.py invariant 1, stage_task.py invariant 3).
  4. With an object store (:meth:`StagedExecutor.use_store`) no stage database is on the driver: the driver's
     chains (runtime/stage_store.py) say which objects make each (stage, worker)'s state, every job's tasks get
     the chains of their stage and the driver records the objects the acknowledgements name, after the checks of
     invariant 1; invariant 2's JOB record is not needed (the chains move only when a job succeeded, and
     recovery takes the chains of the manifest it restores). Layout changes, ``traces`` and ``view`` rebuild the
     databases they read in the driver's scratch directory (stage_store invariant 6).
  5. With an object store, a job that fails for any reason but its data (the job runner gave up: e.g. Spark
     aborted the job after a lost Spark executor took a task's last attempt; or a task died between its upload
     and its acknowledgement) is run again, up to :data:`JOB_RETRIES` times, before the failure reaches the
     driver (which would mark the pipeline broken): nothing of it counts, since the chains did not move
     (invariant 4) and the objects and cache versions its attempts left are not on them (stage_store invariants
     1 and 3). Without a store the JOB record and the stage databases decide (invariant 2): no retry here.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import random
import shutil
import time
import uuid
from typing import Any, Callable, NamedTuple, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.circuit import Circuit
from dbsp_core.errors import DbspError, RecoveryError
from dbsp_core.layout import Layout
from dbsp_core.operators.base import concat
from dbsp_core.profile import NodeTimer, reset_task_timers, task_timers
from dbsp_core.runtime.executor import StateGroup, StepInput, groupings, spread, step_error_of, traces_by_label
from dbsp_core.runtime.stage_plan import (ACK_NODE, BLOB_SCHEMA, CONTROL_NODE, StagePlan, StageWorker, StepInfo,
                                          control_blobs, encode_blobs, gather, read_acks)
from dbsp_core.runtime.stage_store import StageChains, StageStore
from dbsp_core.runtime.stage_task import (InjectedFault, StageTask, choose_stage_version, open_stage_databases,
                                          run_stage_task, stage_db_path)
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import read_record, remove_record, write_record
from dbsp_core.storage.formats import JOB_MAGIC, STATE_DIR, job_path, lock_path, stage_dir_name
from dbsp_core.storage.snapshot import WorkerSnapshot, state_tables
from dbsp_core.trace import Trace
from dbsp_core.zset import ZSet

__all__ = ["Job", "JobRunner", "LocalJobRunner", "StagedExecutor"]


class Job(NamedTuple):
    """One job: a task description per stage (in stage order) and the stage-0 input blobs."""

    tasks: list[StageTask]
    inputs: pa.Table
    workers: int


JOB_RETRIES = 2  # runs of a job again after a failure not of its data, with an object store (invariant 5)


class JobRunner(Protocol):
    """Runs every stage task of a job for every worker and returns the blobs left after the last stage."""

    def run_job(self, job: Job) -> pa.Table: ...


class LocalJobRunner:
    """Runs a job's tasks one after another in this process, routing blobs by ``part`` (the reference runner).

    ``fail_first`` (tests): ``{(stage, point, worker), ...}``; the first attempt of each such task raises
    :class:`~dbsp_core.runtime.stage_task.InjectedFault` at ``point`` and is retried once, as Spark retries a
    failed task. ``cache_dirs`` (tests of a store pipeline): each task's stage cache is one of these, picked at
    random from ``seed``; with ``duplicates`` every task of a store pipeline first runs once more on another
    of them and that attempt's blobs are dropped (a speculative duplicate on another Spark executor).
    ``abort_first`` (tests): as ``fail_first``, but the fault ends the whole job (as Spark aborts a job whose task
    ran out of attempts), once per entry.
    """

    def __init__(self, fail_first: set[tuple[int, str, int]] | None = None,
                 cache_dirs: list[str] | None = None, seed: int = 0, duplicates: bool = False,
                 abort_first: set[tuple[int, str, int]] | None = None) -> None:
        self.fail_first = set(fail_first or ())
        self.abort_first = set(abort_first or ())
        self.retries = 0
        # tests of a store pipeline: each task runs with one of these as its stage cache, picked at random (from
        # ``seed``), as if on one of several processes with no common disk (stage_store invariant 7)
        self.cache_dirs = list(cache_dirs or ())
        self._rng = random.Random(seed)
        self.duplicates = duplicates

    def run_job(self, job: Job) -> pa.Table:
        blobs = job.inputs
        for task in job.tasks:
            parts = blobs.column("part").to_numpy()
            outs = []
            for w in range(job.workers):
                mine = blobs.filter(pa.array(parts == w))
                if task.store is not None and self.cache_dirs:
                    pick = self._rng.sample(self.cache_dirs, 2 if self.duplicates else 1)
                    if self.duplicates:  # it commits and uploads in its cache too; the driver never hears of it
                        run_stage_task(dataclasses.replace(task, store=dataclasses.replace(
                            task.store, cache_dir=pick[1])), w, mine)
                    task = dataclasses.replace(task, store=dataclasses.replace(task.store, cache_dir=pick[0]))
                for k, point, wk in sorted(self.fail_first):
                    if (k, wk) == (task.stage, w):  # a failed first attempt, then the retry below
                        self.fail_first.discard((k, point, wk))
                        try:
                            run_stage_task(dataclasses.replace(task, fault=(point, w)), w, mine)
                        except InjectedFault:
                            self.retries += 1
                for k, point, wk in sorted(self.abort_first):
                    if (k, wk) == (task.stage, w):  # the job ends here
                        self.abort_first.discard((k, point, wk))
                        run_stage_task(dataclasses.replace(task, fault=(point, w)), w, mine)
                outs.append(run_stage_task(task, w, mine))
            blobs = pa.concat_tables(outs) if outs else blobs.slice(0, 0)
        return blobs


class StagedExecutor:
    """Runs a circuit's steps as jobs of stage tasks on a :class:`JobRunner` (see the module docstring).

    Parameters
    ----------
    runner : JobRunner or None
        Where the tasks run (default: :class:`LocalJobRunner`, in this process).
    max_steps_per_job : int
        At most this many consecutive steps run in one job.
    task_cache_dir : str or None
        With ``storage="s3://..."`` (invariant 4): where each task process keeps its stage cache, a directory local to
        it (None: the Spark executor's own directory, or the temporary directory; runtime/stage_store.py).

    Examples
    --------
    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
    >>> c.output("totals", bids.group_by("auction").agg(total=dbsp.sum("price")))
    >>> d = tempfile.mkdtemp()
    >>> p = dbsp.Pipeline(c, workers=2, storage=d, executor=StagedExecutor())
    >>> _ = p.push("bids", pa.table({"auction": [1, 1], "price": [10, 5]}))
    >>> p.queue_step()
    0
    >>> _ = p.push("bids", pa.table({"auction": [1], "price": [1]}))
    >>> p.queue_step()
    1
    >>> [out["totals"].to_dict() for out in p.run_queued()]   # both steps in one job
    [{(1, 15): 1}, {(1, 15): -1, (1, 16): 1}]
    >>> p.executor.jobs
    1
    >>> p.close()
    >>> q = dbsp.Pipeline.open(d, c, executor=StagedExecutor())
    >>> [(s, z.to_dict()) for s, z in q.read_output("totals", from_step=1)]
    [(1, {(1, 15): -1, (1, 16): 1})]
    >>> q.close()
    """

    kind = "staged"
    takes_store = True  # its state can live in an object store (invariant 4; the driver calls use_store)
    division_first = True  # invariant 1: a job commits state, so its steps' divisions are durable first
    state_in_memory = False  # the stage databases hold the state: a live rescale moves it as cold changes

    def __init__(self, runner: JobRunner | None = None, max_steps_per_job: int = 64,
                 task_cache_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(max_steps_per_job, int) or max_steps_per_job < 1:
            raise ValueError(f"max_steps_per_job must be a positive int, got {max_steps_per_job!r}")
        if task_cache_dir is not None and not isinstance(task_cache_dir, (str, os.PathLike)):
            raise TypeError(f"task_cache_dir must be a directory path or None, got {type(task_cache_dir).__name__}")
        # with an object store: the base of every task process's stage cache, local to it (stage_store invariant 7)
        self.task_cache_dir = None if task_cache_dir is None else os.fspath(task_cache_dir)
        self.runner: JobRunner = runner if runner is not None else LocalJobRunner()
        self.max_steps_per_job = max_steps_per_job
        self.run_id = uuid.uuid4().hex  # cache entries of an earlier incarnation are never used (stage_task inv. 4)
        self.version = 0
        self.step = 0
        self.jobs = 0
        self.job_seconds = 0.0
        self.stats: dict[str, int] = {}
        self.busy: list[float] | None = None  # not measured: the stage tasks run in other processes
        self.output_steps: Callable[[], int] = lambda: 2**62  # the driver's output log end (invariant 2)
        self.circuit: Circuit | None = None
        self.layout: Layout | None = None
        self.storage: str | None = None
        self.store: StageStore | None = None
        self.chains: StageChains | None = None

    # ---- setup ----

    def use_store(self, store: StageStore, chains: StageChains) -> None:
        """Keep the stage state in an object store (invariant 4): ``chains`` as the manifest restored has them."""
        self.store, self.chains = store, chains

    def start(self, circuit: Circuit, layout: Layout, storage: str | None) -> None:
        if storage is None:
            raise DbspError("the staged executor keeps its state in a storage directory; give storage=<dir>")
        self.circuit, self.layout, self.storage = circuit, layout, storage
        self.plan = StagePlan(circuit)
        reset_task_timers(storage)  # dbsp_core.profile: this run's timings only
        self._out_schemas = {name: circuit.nodes[i].schema for name, i in circuit.outputs.items()}
        self._in_schemas = {name: circuit.nodes[i].schema for name, i in circuit.inputs.items()}

    def groups(self, layout: Layout) -> list[StateGroup]:
        assert self.storage is not None and self.circuit is not None
        root, out = self.storage, []
        if self.chains is not None:  # invariant 4: the driver's own copies, made by before_change
            root = self.chains.scratch_dir()
        for k in range(self.plan.num_stages):
            if not self.plan.stateful[k]:
                continue
            sw = StageWorker(self.circuit, self.plan, k, 0, layout.shard_map)
            out.append(StateGroup(stage_dir_name(k), lambda w, k=k: stage_db_path(root, k, w),
                                  state_tables(sw.stateful, groupings(self.circuit))))
        return out

    def _job_path(self) -> str:
        assert self.storage is not None
        return job_path(self.storage)

    def open_state(self) -> tuple[int, int | None]:
        assert self.storage is not None and self.layout is not None
        if self.chains is not None:  # invariant 4: the chains of the restored manifest
            self.version, self.step = self.chains.version, self.chains.step
            return self.version, (self.step if any(self.plan.stateful) else None)
        paths = [p for _, _, p in open_stage_databases(self.storage, self.plan, self.layout.workers)]
        at_most = None
        job = read_record(self._job_path(), JOB_MAGIC)
        if job is not None and job["end"] > self.output_steps():
            at_most = job["version"]  # invariant 2: its output is not all logged; run it again from its base
        v, x = choose_stage_version(paths, at_most)
        if job is not None:
            remove_record(self._job_path())  # every database now holds v only: the record did its work
        self.version, self.step = v, x
        return v, (x if paths else None)

    def load_state(self, step: int) -> None:
        """Stage tasks load their state themselves (stage_task.py invariant 4); only the step is noted."""
        self.step = step

    def rename_state(self, renames: dict[int, int]) -> None:
        raise DbspError("a program change keeps the state of the unchanged views only on the embedded executor: "
                        "the staged executor's stage databases follow the circuit's stages; open the directory "
                        "with the circuit that wrote it, or rebuild the pipeline in a new directory")

    def bootstrap(self, nodes: set[int], step: StepInput) -> dict[str, ZSet]:
        raise DbspError("bootstrap: the staged executor does not take program changes (see rename_state)")

    def resume(self, version: int, step: int) -> None:
        """Every stage database now holds ``version`` at ``step`` (a layout change committed it): jobs go on from
        there, as a new run (stage_task.py invariant 4): the change may have deleted a worker's database and
        created it again, whose value numbers then start over, so a batch cached from before it under the same
        number and shard keys is not the stored one (reusing it put rows of shards that had moved away back into
        a worker: groups counted in two workers)."""
        self.version, self.step = version, step
        self.run_id = uuid.uuid4().hex

    # ---- live layout changes ----

    def prepare_relayout(self, final: Layout) -> None:
        """Nothing to build: each wave of a live change is a cold change, which creates the databases it needs."""

    def abandon_relayout(self) -> None:
        """Nothing to release (see :meth:`prepare_relayout`)."""

    def pay_deferred(self, rows: int) -> bool:
        """Nothing is deferred: each wave is a cold change of the stage databases (see :meth:`prepare_relayout`)."""
        return False

    def relayout(self, layout: Layout) -> int:
        raise DbspError("relayout: the staged executor's state is in its stage databases, not in memory; a live "
                        "rescale moves it as cold changes of those databases (dbsp_core.runtime.rescale)")

    # ---- steps ----

    def run(self, steps: list[StepInput]) -> list[dict[str, ZSet]]:
        outs: list[dict[str, ZSet]] = []
        for lo in range(0, len(steps), self.max_steps_per_job):
            job = steps[lo:lo + self.max_steps_per_job]
            try:
                outs.extend(self._run_job_retried(job))
            except Exception as exc:
                err = step_error_of(exc)
                if err is None:
                    raise
                self._undo_job()  # executor.py invariant 4: every stage database back at the job's base version
                if err.step is None or not job[0].step <= err.step <= job[-1].step:
                    err.step = job[0].step
                err.done = outs
                if err is exc:
                    raise
                raise err from exc
        return outs

    def _run_job_retried(self, steps: list[StepInput]) -> list[dict[str, ZSet]]:
        """:meth:`_run_job`, run again after a failure not of its data when the state is in a store (invariant 5)."""
        tries = 0
        while True:
            try:
                return self._run_job(steps)
            except Exception as exc:
                if self.chains is None or step_error_of(exc) is not None or tries >= JOB_RETRIES:
                    raise
                tries += 1
                self.stats["job_retries"] = self.stats.get("job_retries", 0) + 1
                self.stats["last_job_retry"] = f"{type(exc).__name__}: {str(exc)[:500]}"

    def _undo_job(self) -> None:
        """After a job failed on its data: discard the version its tasks committed (some may have) and the JOB
        record, so every stage database is at ``self.version`` again, at ``self.step``."""
        assert self.storage is not None and self.layout is not None
        if self.chains is not None:
            return  # invariant 4: the chains did not move; the attempts' objects are garbage
        paths = [p for _, _, p in open_stage_databases(self.storage, self.plan, self.layout.workers)]
        v, _ = choose_stage_version(paths, self.version)
        if v != self.version:
            raise RecoveryError(f"{self.storage}: after a failed job the stage databases are at version {v}, not "
                                f"{self.version}")
        remove_record(self._job_path())

    def _input_blobs(self, steps: list[StepInput]) -> pa.Table:
        """Stage-0 blobs of a job: each push spread in contiguous slices over the workers."""
        assert self.layout is not None
        rows = []
        W = self.layout.workers
        for s in steps:
            for w, per in enumerate(spread(s.pushes, W, s.step % W, keep=self.plan.inputs)):
                for handle, parts in per.items():
                    rows.append((w, -1, self.plan.inputs[handle], s.step, concat(parts, self._in_schemas[handle])))
        return encode_blobs(rows)

    def _make_job(self, steps: list[StepInput]) -> Job:
        assert self.layout is not None
        infos = [StepInfo(s.step, s.now_ns, s.prev_now_ns, s.seed, dict(s.watermarks), len(s.pushes)) for s in steps]
        W = self.layout.workers
        tasks = [StageTask(self.plan, k, self.layout, self.storage, self.run_id, self.version, infos,
                           store=self.store, chains=None if self.chains is None or not self.plan.stateful[k] else
                           {w: self.chains.chain(k, w) for w in range(W)})
                 for k in range(self.plan.num_stages)]
        inputs = pa.concat_tables([self._input_blobs(steps), control_blobs(self.layout.workers, steps[0].step)])
        return Job(tasks, inputs, self.layout.workers)

    def _run_job(self, steps: list[StepInput]) -> list[dict[str, ZSet]]:
        if not steps:
            return []
        first, end = steps[0].step, steps[-1].step + 1
        if first != self.step:
            raise DbspError(f"job for steps {first}..{end - 1} but the executor is at step {self.step}")
        t0 = time.perf_counter()
        stateful = any(self.plan.stateful)
        if stateful and self.chains is None:
            write_record(self._job_path(), JOB_MAGIC, {"version": self.version, "first": first, "end": end})
        result = self.runner.run_job(self._make_job(steps))
        outs = self._collect(result, first, end)
        self.job_seconds += time.perf_counter() - t0
        self.jobs += 1
        if stateful:
            self.version += 1
        self.step = end
        return outs

    def _collect(self, result: pa.Table, first: int, end: int) -> list[dict[str, ZSet]]:
        """Each step's outputs from the final blobs, after checking every commit acknowledgement (invariant 1)."""
        assert self.layout is not None
        W = self.layout.workers
        if result.schema != BLOB_SCHEMA:
            result = result.select(BLOB_SCHEMA.names).cast(BLOB_SCHEMA)
        want = {(k, w) for k in range(self.plan.num_stages) if self.plan.stateful[k] for w in range(W)}
        acks = read_acks(result)
        got = {(a["stage"], a["worker"]) for a in acks}
        bad = [a for a in acks if (a["version"], a["step"]) != (self.version + 1, end)]
        if got != want or len(acks) != len(want) or bad:
            raise RecoveryError(f"job for steps {first}..{end - 1}: commit acknowledgements {sorted(got)} "
                                f"(bad: {bad}) do not match the stateful (stage, worker) set {sorted(want)}")
        for a in acks:  # task-side cache effectiveness (stage_task.py invariant 4)
            key = {"cache": "state_cache_hits", "partial": "state_partial_loads"}.get(a.get("loaded"), "state_loads")
            self.stats[key] = self.stats.get(key, 0) + 1
        if self.chains is not None:
            missing = [a for a in acks if "delta" not in a]
            if missing:
                raise RecoveryError(f"job for steps {first}..{end - 1}: acknowledgements without a delta object "
                                    f"{missing} (a task that does not know the store)")
        nodes = result.column("node")
        control = result.filter(pc.equal(nodes, CONTROL_NODE)).column("part").to_pylist()
        if sorted(control) != list(range(W)):
            raise DbspError(f"job for steps {first}..{end - 1}: control blobs came back from workers "
                            f"{sorted(control)}, expected one from each of 0..{W - 1}")
        outb = result.filter(pc.and_(pc.less(nodes, 0), pc.and_(pc.not_equal(nodes, ACK_NODE),
                                                                  pc.not_equal(nodes, CONTROL_NODE))))
        other = result.num_rows - outb.num_rows - len(acks) - len(control)
        if other:
            raise DbspError(f"job for steps {first}..{end - 1}: {other} blobs were left unconsumed after the last "
                            "stage")
        got_out = gather(self.plan, outb, f"job {first}..{end - 1} output")
        outs = []
        for step in range(first, end):
            out = {}
            for k, name in enumerate(self.plan.output_names):
                z = got_out.get((-1 - k, step))
                out[name] = z.consolidate() if z is not None else ZSet.empty(self._out_schemas[name])
            outs.append(out)
        if self.chains is not None and any(self.plan.stateful):  # invariant 4: only now does any chain move
            self.chains.record(acks, self.version + 1, end)
            for a in acks:
                st = self.stats
                fetched = a.get("fetch") in ("fetched", "rebuilt")
                st["state_fetches"] = st.get("state_fetches", 0) + fetched
                st["state_fetch_bytes"] = st.get("state_fetch_bytes", 0) + int(a.get("fetched_bytes", 0))
                st["state_upload_bytes"] = (st.get("state_upload_bytes", 0) + a["delta"]["bytes"]
                                            + (a["base"]["bytes"] if a.get("base") else 0))
                st["state_compactions"] = st.get("state_compactions", 0) + bool(a.get("base"))
                roots = st.setdefault("state_cache_roots", [])
                if a.get("cache_root") and a["cache_root"] not in roots:
                    roots.append(a["cache_root"])
                if fetched:  # per (stage, worker): which workers' tasks found their state missing (issue 33)
                    by = st.setdefault("state_fetches_by", {})
                    by[(a["stage"], a["worker"])] = by.get((a["stage"], a["worker"]), 0) + 1
            # the last job's tasks, (stage, worker) -> (fetch, cache root): where each ran and how it got its state
            self.stats["state_last_job"] = {(a["stage"], a["worker"]): (a.get("fetch"), a.get("cache_root"))
                                            for a in acks}
        return outs

    # ---- durability ----

    def checkpoint(self, step: int) -> Callable[[], None]:
        """Every job commits the stage databases (invariant 1): the state is durable at the executor's step."""
        if step != self.step:
            raise DbspError(f"checkpoint at step {step}, but the stage databases are at step {self.step}")
        if self.chains is not None:  # stage_store invariant 5: the manifest names the chains as they are now
            self.chains.capture()
        return lambda: None

    # ---- layout changes with an object store (stage_store invariant 6) ----

    def before_change(self, old: Layout, version: int) -> None:
        """Before a cold layout change from ``old`` at ``version``: the old workers' databases in the scratch
        directory, rebuilt from their chains (runtime/rescale.py then changes them there)."""
        if self.chains is None:
            return
        if version != self.chains.version:
            raise RecoveryError(f"a layout change at version {version}, but the stage chains are at "
                                f"{self.chains.version}")
        root = self.chains.scratch_dir()
        for name in os.listdir(root):  # the copies of an earlier change: this one starts from the chains
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        for k in range(self.plan.num_stages):
            if self.plan.stateful[k]:
                for w in range(old.workers):
                    self.chains.materialize(stage_db_path(root, k, w), k, w)

    def after_change(self, new: Layout, version: int, step: int) -> None:
        """After the change committed ``version`` in the scratch directory: every database of ``new`` is uploaded
        as the base of its chain."""
        if self.chains is None:
            return
        root = self.chains.scratch_dir()
        paths = {(k, w): stage_db_path(root, k, w) for k in range(self.plan.num_stages) if self.plan.stateful[k]
                 for w in range(new.workers)}
        self.chains.upload_all(paths, version, step)

    # ---- inspection ----

    def traces(self, worker: int) -> dict[str, Trace]:
        """All keyed state of one worker after the steps run so far, loaded from the stage databases.

        Each stateful stage's database of ``worker`` is read at the current version through a read-only
        handle (no version is discarded, nothing is written), under the lock stage tasks take.
        """
        assert self.layout is not None and self.circuit is not None
        if not 0 <= worker < self.layout.workers:
            raise ValueError(f"traces: worker {worker} is outside 0..{self.layout.workers - 1}")
        out: dict[str, Trace] = {}
        for k in range(self.plan.num_stages):
            if self.plan.stateful[k]:
                out.update(traces_by_label(self.circuit, self._load_stage(k, worker)))
        return out

    def view(self, node: int) -> ZSet:
        """The contents of readable node ``node`` after the steps run so far: its trace in every worker's database
        of its stage, loaded alone (the stage's other operators are not read)."""
        assert self.layout is not None and self.circuit is not None
        k = self.plan.stage_of[node]
        parts = [self._load_stage(k, w, node)[node].trace.consolidated().zset for w in range(self.layout.workers)]
        return ZSet.concat(parts)

    def _load_stage(self, k: int, worker: int, node: int | None = None) -> dict[int, Any]:
        """The stateful instances of stage ``k`` (only ``node``'s, if given) of ``worker`` with their state at the
        current version, read through a read-only handle under the lock stage tasks take."""
        assert self.layout is not None and self.storage is not None and self.circuit is not None
        v = self.version
        path = stage_db_path(self.storage, k, worker)
        if self.chains is not None:  # invariant 4: a copy in the driver's scratch directory
            path = stage_db_path(os.path.join(self.chains.scratch_dir(), "read"), k, worker)
            self.chains.materialize(path, k, worker)
        sw = StageWorker(self.circuit, self.plan, k, worker, self.layout.shard_map)
        instances = sw.stateful if node is None else {node: sw.stateful[node]}
        lockfd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lockfd, fcntl.LOCK_EX)  # no stage task of this (stage, worker) meanwhile
            db = Database(path)
            try:
                if v not in db.versions():
                    raise RecoveryError(f"{path}: holds versions {db.versions()}, the pipeline is at {v}")
                with db.read(v) as h:
                    WorkerSnapshot(instances, self.layout.shard_bits,
                                   groupings=groupings(self.circuit)).load(h, f"{path} v{v}")
            finally:
                db.close()
        finally:
            os.close(lockfd)
        return instances

    def node_timers(self) -> list[NodeTimer]:
        """The operator timings of the stage tasks that ran in this process (dbsp_core.profile)."""
        assert self.storage is not None
        return task_timers(self.storage)

    def disk_bytes(self) -> int:
        assert self.storage is not None
        if self.chains is not None:  # invariant 4: the bytes of the chains in the store
            return self.chains.bytes()
        root = os.path.join(self.storage, STATE_DIR)
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)

    def state_bytes(self) -> int:
        """The state is in the stage databases: their bytes on disk."""
        return self.disk_bytes()

    batch_store = None  # no memory budget (spill refuses one)

    def spill(self, store: Any) -> None:
        """A memory budget is the embedded executor's (trace invariant 12): a staged run keeps its traces in stage
        databases between jobs; refuses any store with DbspError."""
        if store is not None:
            store.close()
            raise DbspError("memory_limit: the staged executor does not spill batches yet; run the pipeline with "
                            "the embedded executor, or without memory_limit (and DBSP_MEMORY_LIMIT unset)")

    def referenced_files(self) -> set[str]:
        """Stage databases hold rows, never names of batch files."""
        return set()

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.chains is not None:
            self.chains.close()

    def __repr__(self) -> str:
        return f"StagedExecutor(stages={getattr(self, 'plan', None)}, jobs={self.jobs})"

