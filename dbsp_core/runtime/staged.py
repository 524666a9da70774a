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
     recovery takes the chains of the manifest it restores). A layout change is a job of tasks too
     (:meth:`StagedExecutor.move_state`, stage_store invariant 6): no state passes through the driver; only
     ``traces`` and ``view`` rebuild the databases they read in the driver's scratch directory.
  5. With an object store, a job that fails for any reason but its data (the job runner gave up: e.g. Spark
     aborted the job after a lost Spark executor took a task's last attempt; or a task died between its upload
     and its acknowledgement) is run again, up to :data:`JOB_RETRIES` times, before the failure reaches the
     driver (which would mark the pipeline broken): nothing of it counts, since the chains did not move
     (invariant 4) and the objects and cache versions its attempts left are not on them (stage_store invariants
     1 and 3). Without a store the JOB record and the stage databases decide (invariant 2): no retry here.
  6. A memory budget (``Pipeline(memory_limit=...)``, :meth:`StagedExecutor.task_budget`) is per process that
     runs tasks at once in parallel slots (a Spark executor: its Python workers): each task process gets
     ``memory_limit // runner.task_slots`` and keeps its traces under it (stage_task.py invariant 7). The
     driver's own reads of the state (``traces``, ``view``, layout changes) load it without a budget.
  7. ``worker_recovery`` (with an object store; spark_glue/pipeline.py design note 9): ``"alone"`` (the default)
     is invariant 4 (every job's delta uploaded before its commit, so a lost worker is rebuilt from its chain
     alone); ``"pipeline"`` makes every job commit in its task processes' caches only (stage_store invariant 8) and
     uploads what changed since the last durable point in a flush (:meth:`StagedExecutor.flush`: one task per
     stateful (stage, worker), where its state is) at each checkpoint, before a layout change and before the
     driver reads the state. A task that finds its worker's state missing or behind raises WorkerStateLostError,
     which a job is never run again for (invariant 5 would only lose it again): it reaches the driver, which
     calls :meth:`StagedExecutor.rollback_lost` (the chains back at the durable version and step, a new run id)
     and replays the input log from there (driver invariant 10).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import random
import time
import uuid
from typing import Any, Callable, NamedTuple, Protocol, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.circuit import Circuit
from dbsp_core.errors import DbspError, RecoveryError, WorkerStateLostError
from dbsp_core.layout import Layout
from dbsp_core.operators.base import concat
from dbsp_core.profile import NodeTimer, reset_task_timers, task_timers
from dbsp_core.runtime.executor import (StateGroup, StepInput, groupings, spread, state_lost_of, step_error_of,
                                        traces_by_label)
from dbsp_core.runtime.stage_plan import (ACK_NODE, BLOB_SCHEMA, CONTROL_NODE, StagePlan, StageWorker, StepInfo,
                                          control_blobs, encode_blobs, gather, read_acks)
from dbsp_core.runtime.stage_store import (RECOVERY_MODES, FlushTask, MoveTask, StageChains, StageStore,
                                          run_flush_task, run_move_task)
from dbsp_core.runtime.stage_task import (SPILL_COUNTERS, InjectedFault, StageTask, choose_stage_version,
                                          open_stage_databases, run_stage_task, stage_db_path)
from dbsp_core.runtime.stage_task import release as release_stage_workers
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import read_record, remove_record, tree_bytes, write_record
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


T = TypeVar("T")
JOB_RETRIES = 2  # runs of a job again after a failure not of its data, with an object store (invariant 5)


class JobRunner(Protocol):
    """Runs every stage task of a job for every worker and returns the blobs left after the last stage; and, for a
    layout change of a store pipeline (stage_store invariant 6), runs ``fn(item)`` as one task per item wherever it
    places tasks, returning one result per item, in order (a failed attempt is retried or the call raises).

    ``task_slots``: how many tasks one of its processes' hosts runs at once, each in a process of its own (a Spark
    executor's cores per task); a memory budget is divided among them (invariant 6)."""

    task_slots: int

    def run_job(self, job: Job) -> pa.Table: ...

    def run_tasks(self, fn: Callable[[Any], dict], items: list[Any]) -> list[dict]: ...

    def release(self, pipeline: str) -> None:
        """The pipeline ``pipeline`` (stage_task.release) closed: free its cached stage workers in the task
        processes this runner can reach."""
        ...


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

    task_slots = 1  # one task at a time, in this process

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

    def _pick(self, store: StageStore, n: int) -> list[StageStore]:
        """``n`` stores of a task, each with one of :attr:`cache_dirs` as its stage cache (tests)."""
        return [dataclasses.replace(store, cache_dir=d) for d in self._rng.sample(self.cache_dirs, n)]

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one task attempt (here: in this thread; a test's runner may run it in another process)."""
        return fn(*args)

    def run_tasks(self, fn: Callable[[Any], dict], items: list[Any]) -> list[dict]:
        """Each item's task in turn; with :attr:`cache_dirs`, on one of them (with ``duplicates``, after an attempt
        on another whose result is dropped), as :meth:`run_job` runs a store pipeline's stage tasks."""
        out = []
        for item in items:
            store = getattr(item, "store", None)
            if store is not None and self.cache_dirs:
                picks = self._pick(store, 2 if self.duplicates else 1)
                if self.duplicates:
                    self.call(fn, dataclasses.replace(item, store=picks[1]))
                item = dataclasses.replace(item, store=picks[0])
            out.append(self.call(fn, item))
        return out

    def release(self, pipeline: str) -> None:
        """Its tasks ran in this process: forget their cached stage workers of ``pipeline``."""
        release_stage_workers(pipeline)

    def run_job(self, job: Job) -> pa.Table:
        blobs = job.inputs
        for task in job.tasks:
            parts = blobs.column("part").to_numpy()
            outs = []
            for w in range(job.workers):
                mine = blobs.filter(pa.array(parts == w))
                if task.store is not None and self.cache_dirs:
                    picks = self._pick(task.store, 2 if self.duplicates else 1)
                    if self.duplicates:  # it commits and uploads in its cache too; the driver never hears of it
                        self.call(run_stage_task, dataclasses.replace(task, store=picks[1]), w, mine)
                    task = dataclasses.replace(task, store=picks[0])
                for k, point, wk in sorted(self.fail_first):
                    if (k, wk) == (task.stage, w):  # a failed first attempt, then the retry below
                        self.fail_first.discard((k, point, wk))
                        try:
                            self.call(run_stage_task, dataclasses.replace(task, fault=(point, w)), w, mine)
                        except InjectedFault:
                            self.retries += 1
                for k, point, wk in sorted(self.abort_first):
                    if (k, wk) == (task.stage, w):  # the job ends here
                        self.abort_first.discard((k, point, wk))
                        self.call(run_stage_task, dataclasses.replace(task, fault=(point, w)), w, mine)
                outs.append(self.call(run_stage_task, task, w, mine))
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
    worker_recovery : str
        With ``storage="s3://..."`` (invariant 7): ``"alone"`` (default) uploads every job's state delta so a lost
        worker is rebuilt alone; ``"pipeline"`` uploads at checkpoints only and recovers the whole pipeline from the
        last one when a worker's state is lost.

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
    range_values = False  # its state is saved one shard per value: its directories keep format 2 or 3
    state_in_memory = False  # the stage databases hold the state: a live rescale moves it as cold changes

    def __init__(self, runner: JobRunner | None = None, max_steps_per_job: int = 64,
                 task_cache_dir: str | os.PathLike | None = None, worker_recovery: str = "alone") -> None:
        if worker_recovery not in RECOVERY_MODES:
            raise ValueError(f"worker_recovery must be one of {', '.join(map(repr, RECOVERY_MODES))}, got "
                             f"{worker_recovery!r}")
        self.worker_recovery = worker_recovery
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
        self.memory_limit: int | None = None  # the budget per task process (invariant 6), and its files' base
        self.spill_dir: str | None = None

    # ---- setup ----

    def use_store(self, store: StageStore, chains: StageChains) -> None:
        """Keep the stage state in an object store (invariant 4): ``chains`` as the manifest restored has them."""
        self.store, self.chains = store, chains

    @property
    def local_commits(self) -> bool:
        """Whether jobs commit in the task processes' caches only (invariant 7, ``worker_recovery="pipeline"``)."""
        return self.chains is not None and self.worker_recovery == "pipeline"

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
        if self.chains is not None:  # invariant 4: the driver's scratch directory (no stage database is there)
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
        return self._retried(lambda: self._run_job(steps))

    def _retried(self, run: Callable[[], T]) -> T:
        """``run()``, run again after a failure not of its data when the state is in a store (invariant 5)."""
        tries = 0
        while True:
            try:
                return run()
            except Exception as exc:
                lost = state_lost_of(exc) if self.chains is not None else None
                if lost is not None:  # invariant 7: a lost state stays lost; the driver recovers the pipeline
                    if lost is exc:
                        raise
                    raise lost from exc
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
                           {w: self.chains.task_chain(k, w) for w in range(W)}, memory_limit=self.memory_limit,
                           spill_dir=self.spill_dir,
                           worker_recovery="pipeline" if self.local_commits else "alone")
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
        self._count_spills(acks)
        if self.chains is not None:
            missing = [a for a in acks if not a.get("delta") and not a.get("base")
                       and not (self.local_commits and a.get("local"))]
            if missing:
                raise RecoveryError(f"job for steps {first}..{end - 1}: acknowledgements without a delta or a base "
                                    f"object {missing} (a task that does not know the store)")
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
                for s in ("fetch_s", "load_s"):  # task seconds bringing the state to the chain / into memory
                    st[f"state_{s}"] = st.get(f"state_{s}", 0.0) + float(a.get(s, 0.0))
                up = a.get("delta") or a.get("base")  # invariant 7: none in "pipeline" mode (a local link)
                st["state_upload_bytes"] = st.get("state_upload_bytes", 0) + (up["bytes"] if up else 0)
                st["state_job_uploads"] = st.get("state_job_uploads", 0) + bool(up)
                st["state_local_commits"] = st.get("state_local_commits", 0) + bool(a.get("local"))
                st["state_delta_bytes"] = st.get("state_delta_bytes", 0) + int(a.get("delta_bytes", 0))
                st["state_compactions"] = st.get("state_compactions", 0) + bool(a.get("base"))
                st["state_merges"] = st.get("state_merges", 0) + bool(a.get("replaces"))
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

    def _count_spills(self, acks: list[dict]) -> None:
        """Sum what the acknowledgements say of the task processes' batch stores (stage_task.py invariant 7) into
        ``stats["task_spill"]``: counters over every job, files written per (stage, worker), per task process
        (``host:pid``) its store's bytes in memory and in files after the last task it ran, and the most bytes any
        task's commit held in memory (``commit_held_max``, stage_task.py invariant 7)."""
        reports = [(a["stage"], a["worker"], a["spill"]) for a in acks if a.get("spill")]
        if not reports:
            return
        tot = self.stats.setdefault("task_spill", {"limit": 0, "by_stage_worker": {}, "by_process": {},
                                                   "commit_held_max": 0, **dict.fromkeys(SPILL_COUNTERS, 0)})
        for k, w, r in reports:
            for name in SPILL_COUNTERS:
                tot[name] += int(r.get(name, 0))
            tot["commit_held_max"] = max(tot["commit_held_max"], int(r.get("commit_held", 0)))
            tot["limit"] = int(r["limit"])
            tot["by_stage_worker"][(k, w)] = tot["by_stage_worker"].get((k, w), 0) + int(r["files_written"])
            tot["by_process"][r["process"]] = {"memory_bytes": int(r["memory_bytes"]),
                                               "disk_bytes": int(r["disk_bytes"])}

    # ---- durability ----

    def checkpoint(self, step: int) -> Callable[[], None]:
        """Every job commits the stage databases (invariant 1): the state is durable at the executor's step."""
        if step != self.step:
            raise DbspError(f"checkpoint at step {step}, but the stage databases are at step {self.step}")
        if self.chains is not None:  # stage_store invariant 5: the manifest names the chains as they are now
            self.flush()  # invariant 7: what the tasks committed locally since the last durable point, first
            self.chains.capture()
        return lambda: None

    def flush(self) -> None:
        """Invariant 7: upload what every stateful (stage, worker) committed in its task process's cache since the
        durable chains (one :class:`FlushTask` each, where its state is; run again after a failure not of a lost
        state, invariant 5), then record the uploaded links. Nothing to do unless local links are pending.
        WorkerStateLostError if a task found its worker's state missing or behind (the chains do not move)."""
        ch = self.chains
        if ch is None or not any(ch.pending.values()):
            return
        assert self.store is not None and self.layout is not None
        t0 = time.perf_counter()
        tasks = [FlushTask(self.store, k, w, ch.task_chain(k, w)) for k in range(self.plan.num_stages)
                 if self.plan.stateful[k] for w in range(self.layout.workers)]

        def run() -> list[dict]:
            acks = self.runner.run_tasks(run_flush_task, tasks)
            want = sorted((t.stage, t.worker) for t in tasks)
            got = sorted((a.get("stage"), a.get("worker")) for a in acks)
            bad = [a for a in acks if a.get("version") != ch.version or not (a.get("delta") or a.get("base"))]
            if got != want or bad:
                raise RecoveryError(f"a flush's tasks acknowledged {got} (bad: {bad}), expected {want}")
            return acks

        acks = self._retried(run)
        ch.record_flush(acks)
        st = self.stats
        st["state_flushes"] = st.get("state_flushes", 0) + 1
        st["state_flush_uploads"] = st.get("state_flush_uploads", 0) + len(acks)
        st["state_flush_compactions"] = st.get("state_flush_compactions", 0) + sum(bool(a.get("base")) for a in acks)
        n = sum((a.get("delta") or a["base"])["bytes"] for a in acks)
        st["state_flush_bytes"] = st.get("state_flush_bytes", 0) + n
        st["state_upload_bytes"] = st.get("state_upload_bytes", 0) + n
        st["state_flush_s"] = st.get("state_flush_s", 0.0) + time.perf_counter() - t0

    def rollback_lost(self) -> int:
        """After WorkerStateLostError (invariant 7): every chain back at the durable version and step, its local
        links forgotten, under a new run id (no task process's cached instances of the lost lineage are used);
        returns the step the driver replays from."""
        if not self.local_commits:
            raise DbspError("rollback_lost: this pipeline's jobs upload their state (worker_recovery='alone'); a "
                            "lost worker is rebuilt from its chain, nothing to roll back")
        assert self.chains is not None
        self.step = self.chains.rollback()
        self.version = self.chains.version
        self.run_id = uuid.uuid4().hex
        self.stats["state_rollbacks"] = self.stats.get("state_rollbacks", 0) + 1
        return self.step

    # ---- layout changes with an object store (stage_store invariant 6) ----

    @property
    def moves_by_tasks(self) -> bool:
        """Whether a layout change runs as a job of tasks (:meth:`move_state`) instead of on stage databases the
        driver reaches: with an object store (invariant 4)."""
        return self.chains is not None

    def move_state(self, old: Layout, new: Layout, version: int, step: int, measure_total: bool = True) -> dict:
        """Change the state from layout ``old`` at ``version`` to ``new`` as one job of tasks, one per stateful
        (stage, worker) of ``new`` (stage_store invariant 6), run again after a failure (invariant 5; nothing
        counts until every acknowledgement checks out), then restart the chains from the bases the tasks uploaded,
        at ``version + 1`` and ``step``. Returns ``{moved_bytes, total_bytes, fetched_bytes, tasks}`` (``total_bytes``:
        the bytes of every state value of the new layout, None unless ``measure_total``)."""
        assert self.chains is not None and self.store is not None and self.circuit is not None
        self.flush()  # invariant 7: the move tasks read the durable chains
        if version != self.chains.version:
            raise RecoveryError(f"a layout change at version {version}, but the stage chains are at "
                                f"{self.chains.version}")
        tasks = []
        for k in range(self.plan.num_stages):
            if not self.plan.stateful[k]:
                continue
            sw = StageWorker(self.circuit, self.plan, k, 0, new.shard_map)
            specs = state_tables(sw.stateful, groupings(self.circuit))
            for w in range(new.workers):
                tasks.append(MoveTask(self.store, k, w, old.to_dict(), new.to_dict(), version, step,
                                      {s: self.chains.chain(k, s) for s in MoveTask.sources(old, new, w)}, specs,
                                      measure_total))

        def run() -> list[dict]:
            acks = self.runner.run_tasks(run_move_task, tasks) if tasks else []
            self._check_moved(tasks, acks, version + 1, step)
            return acks

        acks = self._retried(run)
        self.chains.record_move(acks, version + 1, step)
        st = self.stats
        fetched = sum(int(a["fetched_bytes"]) for a in acks)
        st["state_fetch_bytes"] = st.get("state_fetch_bytes", 0) + fetched
        st["state_upload_bytes"] = st.get("state_upload_bytes", 0) + sum(a["base"]["bytes"] for a in acks)
        st["move_tasks"] = st.get("move_tasks", 0) + len(acks)
        group = {}  # a change of the shard count: each task of a stage reports the whole stage's moved bytes
        for a in acks:
            if "group_moved" in a:
                group[a["stage"]] = int(a["group_moved"])
        moved = sum(int(a.get("moved_bytes", 0)) for a in acks) + sum(group.values())
        total = sum(int(a["total_bytes"]) for a in acks) if measure_total else None
        return {"moved_bytes": moved, "total_bytes": total, "fetched_bytes": fetched, "tasks": len(acks)}

    @staticmethod
    def _check_moved(tasks: list[MoveTask], acks: list[dict], version: int, step: int) -> None:
        """One acknowledgement per task, of its (stage, worker), ``version`` and ``step``, naming a base object of
        its own (stage_store invariant 6); else RecoveryError (the job runs again)."""
        want = [(t.stage, t.worker) for t in tasks]
        got = [(a.get("stage"), a.get("worker")) for a in acks]
        bad = [a for a in acks if (a.get("version"), a.get("step")) != (version, step) or not a.get("base")
               or not str(a["base"].get("object", "")).startswith(f"stage/{a.get('stage')}/{a.get('worker')}/")]
        if sorted(got) != sorted(want) or len(got) != len(want) or bad:
            raise RecoveryError(f"a layout change's tasks acknowledged {sorted(got)} (bad: {bad}); the new layout "
                                f"has the stateful (stage, worker) set {sorted(want)}")

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
            self.flush()  # invariant 7: the driver reads the durable chains
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
        return tree_bytes(root)

    def state_bytes(self) -> int:
        """The state is in the stage databases: their bytes on disk."""
        return self.disk_bytes()

    batch_store = None  # the traces live in the task processes, each with a store of its own (invariant 6)

    def task_budget(self, memory_limit: int, spill_dir: str | None) -> bool:
        """Keep the traces of every task process under ``memory_limit`` bytes per runner host (a Spark executor),
        their spilled batches under ``spill_dir`` on the host running the task (None: its local directory), from
        the next job on (invariant 6); True: the budget is kept in the task processes."""
        slots = self.runner.task_slots
        if not isinstance(slots, int) or slots < 1:
            raise DbspError(f"{type(self.runner).__name__}.task_slots must be a positive int, got {slots!r}")
        self.memory_limit = max(1, int(memory_limit) // slots)
        self.spill_dir = spill_dir
        return True

    def spill(self, store: Any) -> None:
        """The traces are not in this process (invariant 6: :meth:`task_budget` gives the task processes their
        budget); refuses a store of this process with DbspError."""
        if store is not None:
            store.close()
            raise DbspError("a staged executor's traces live in its task processes: give the pipeline "
                            "memory_limit=..., which it divides among them, instead of a BatchStore")

    def referenced_files(self) -> set[str]:
        """Stage databases hold rows, never names of batch files."""
        return set()

    def close(self) -> None:
        if self.storage is not None:  # stage_task invariant 4: no later job uses this run's cached stage workers
            self.runner.release(self.store.key if self.store is not None else self.storage)
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.chains is not None:
            self.chains.close()

    def __repr__(self) -> str:
        return f"StagedExecutor(stages={getattr(self, 'plan', None)}, jobs={self.jobs})"

