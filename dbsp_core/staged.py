"""The staged durable pipeline: the driver side of running a circuit as jobs of stage tasks (stages.py, stagetask.py) on an engine that moves blobs between workers, with the durable pipeline's input log, step division, dedup and output log, and recovery by seed 000's rule over the stage databases.

A **job** runs one or more consecutive divided steps: the driver encodes each step's input as blobs (each push
spread in contiguous slices over the W workers), hands the job to a :class:`JobRunner` (one task per stage and
worker, stages in order, blobs routed by their ``part``), and gets back every output share and one commit
acknowledgement per stateful (stage, worker). :class:`LocalJobRunner` runs the tasks in this process (the
reference); ``spark_glue`` runs them as Spark tasks with the shuffle as the router.

Storage directory layout (in addition to the durable pipeline's ``META``, ``input/`` and ``output/``)::

    stages/stage-<k>/worker-<w>.db   state of each stateful (stage, worker) (stages.py invariant 3)
    stages/JOB                       the running (or last) job: base version and steps (invariant 4)
    driver.db                        the dedup set and the clock floor at the last checkpoint, and its step

Invariants (enforced here):
  1. All of the durable pipeline's input invariants hold unchanged (this class reuses its push, division,
     dedup and output log): a push is acknowledged once logged, a step's division (with ``now`` and ``seed``) is
     durable before the step runs, every step's output goes through ``OutputLog.write``.
  2. Every job commits every stateful stage database once, from the common base version ``v`` to ``v + 1``;
     the driver checks that it got an acknowledgement of ``v + 1`` at the job's end step from every stateful
     (stage, worker) before it writes any of the job's output, else the pipeline is broken (recover with
     ``open``). So after each job the stage databases are a consistent checkpoint.
  3. ``checkpoint()`` saves the dedup set and clock floor in ``driver.db`` at the step all stage databases
     are at, then truncates the input log below that step (recovery never picks an older version: a job in
     flight opens its base version everywhere it runs, and a database that has not run it still holds it).
  4. Before a job runs, ``stages/JOB`` durably records its base version ``v`` and steps. Stage tasks commit
     ``v + 1`` before the driver logs the job's output, so recovery opens every stage database at the maximum
     of the intersection of their versions, but not above ``v`` when the output log lacks some step of that
     job (the job then runs again, its logged steps verified); this discards a partial job. It loads the
     dedup set from ``driver.db`` and completes it from the log records up to the
     stage step, replays every divided step from there in jobs (output verified by the output log), then
     queues the acknowledged input never divided into a step.
  5. Results do not depend on W, on how steps are grouped into jobs, nor on task retries (stages.py invariant 1,
     stagetask.py invariant 3).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
import uuid
from typing import Any, NamedTuple, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.circuit import Circuit
from dbsp_core.codec import decode_json, encode_json
from dbsp_core.durable import _DEDUP_TABLE, DurablePipeline, read_meta
from dbsp_core.errors import DbspError, RecoveryError
from dbsp_core.operators.base import concat
from dbsp_core.shard import DEFAULT_SHARD_BITS
from dbsp_core.storage.snapshot import WorkerSnapshot
from dbsp_core.stages import (ACK_NODE, BLOB_SCHEMA, CONTROL_NODE, StagePlan, StageWorker, control_blobs,
                              encode_blobs, gather, read_acks)
from dbsp_core.stagetask import (InjectedFault, StageTask, StepInfo, choose_version, open_stage_databases,
                                 run_stage_task, stage_db_path)
from dbsp_core.storage import Database
from dbsp_core.zset import ZSet

__all__ = ["Job", "JobRunner", "LocalJobRunner", "StagedPipeline"]


class Job(NamedTuple):
    """One job: a task description per stage (in stage order) and the stage-0 input blobs."""

    tasks: list[StageTask]
    inputs: pa.Table
    workers: int


class JobRunner(Protocol):
    """Runs every stage task of a job for every worker and returns the blobs left after the last stage."""

    def run_job(self, job: Job) -> pa.Table: ...


class LocalJobRunner:
    """Runs a job's tasks one after another in this process, routing blobs by ``part`` (the reference runner).

    ``fail_first`` (tests): ``{(stage, point, worker), ...}``; the first attempt of each such task raises
    :class:`~dbsp_core.stagetask.InjectedFault` at ``point`` and is retried once, as Spark retries a failed task.
    """

    def __init__(self, fail_first: set[tuple[int, str, int]] | None = None) -> None:
        self.fail_first = set(fail_first or ())
        self.retries = 0

    def run_job(self, job: Job) -> pa.Table:
        blobs = job.inputs
        for task in job.tasks:
            parts = blobs.column("part").to_numpy()
            outs = []
            for w in range(job.workers):
                mine = blobs.filter(pa.array(parts == w))
                for k, point, wk in sorted(self.fail_first):
                    if (k, wk) == (task.stage, w):  # a failed first attempt, then the retry below
                        self.fail_first.discard((k, point, wk))
                        try:
                            run_stage_task(dataclasses.replace(task, fault=(point, w)), w, mine)
                        except InjectedFault:
                            self.retries += 1
                outs.append(run_stage_task(task, w, mine))
            blobs = pa.concat_tables(outs) if outs else blobs.slice(0, 0)
        return blobs


class _StageState:
    """The driver's handle on the state: the stage database paths and ``driver.db`` (closed with the pipeline)."""

    def __init__(self, storage: str, plan: StagePlan, workers: int) -> None:
        self.paths = [p for _, _, p in open_stage_databases(storage, plan, workers)]
        self.driver = Database(os.path.join(storage, "driver.db"))

    def close(self) -> None:
        self.driver.close()


class StagedPipeline(DurablePipeline):
    """A durable pipeline whose steps run as jobs of stage tasks on a :class:`JobRunner`; see the module docstring.

    Parameters
    ----------
    circuit, workers, shard_bits, storage
        As for the durable pipeline (``storage`` is required: stage state lives under it).
    runner : JobRunner or None
        Where the tasks run (default: :class:`LocalJobRunner`, in this process).
    max_steps_per_job : int
        At most this many queued steps run in one job.
    checkpoint_interval, replay_check, output_retention, output_sync, segment_bytes
        As for the durable pipeline.

    Examples
    --------
    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
    >>> c.output("totals", bids.group_by("auction").agg(total=dbsp.sum("price")))
    >>> d = tempfile.mkdtemp()
    >>> p = StagedPipeline(c, workers=2, storage=d)
    >>> _ = p.push("bids", pa.table({"auction": [1, 1], "price": [10, 5]}))
    >>> p.queue_step()
    0
    >>> _ = p.push("bids", pa.table({"auction": [1], "price": [1]}))
    >>> p.queue_step()
    1
    >>> [out["totals"].to_dict() for out in p.run_queued()]   # both steps in one job
    [{(1, 15): 1}, {(1, 15): -1, (1, 16): 1}]
    >>> p.close()
    >>> q = StagedPipeline.open(d, c)
    >>> [(s, z.to_dict()) for s, z in q.read_output("totals", from_step=1)]
    [(1, {(1, 15): -1, (1, 16): 1})]
    >>> q.close()
    """

    def __init__(self, circuit: Circuit, workers: int = 1, shard_bits: int = DEFAULT_SHARD_BITS,
                 storage: Any = None, *, runner: JobRunner | None = None, max_steps_per_job: int = 64,
                 checkpoint_interval: float | None = 10.0, replay_check: bool = True,
                 output_retention: int | None = None, output_sync: bool = True,
                 segment_bytes: int = 64 << 20) -> None:
        if not isinstance(max_steps_per_job, int) or max_steps_per_job < 1:
            raise ValueError(f"max_steps_per_job must be a positive int, got {max_steps_per_job!r}")
        if not isinstance(circuit, Circuit):
            raise TypeError(f"{type(self).__name__} needs a Circuit, got {type(circuit).__name__}")
        self.plan = StagePlan(circuit)
        self.runner: JobRunner = runner if runner is not None else LocalJobRunner()
        self.max_steps_per_job = max_steps_per_job
        self.run_id = uuid.uuid4().hex  # cache entries of an earlier incarnation are never used (stagetask inv. 4)
        self.version = 0
        self.jobs = 0
        self.job_seconds = 0.0
        self._queue: list[tuple] = []
        self._replaying: list[tuple] = []
        super().__init__(circuit, workers, shard_bits, storage, checkpoint_interval=checkpoint_interval,
                         replay_check=replay_check, output_retention=output_retention, output_sync=output_sync,
                         segment_bytes=segment_bytes)

    @classmethod
    def open(cls, path: Any, circuit: Circuit, **kwargs: Any) -> "StagedPipeline":  # type: ignore[override]
        """Recover the pipeline stored in ``path`` (workers and shard bits come from the directory)."""
        root = os.fspath(path)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{cls.__name__}.open: no storage directory {root!r}")
        try:
            meta = read_meta(root)
        except FileNotFoundError:
            raise RecoveryError(f"{cls.__name__}.open: {root!r} holds no pipeline (META is missing)") from None
        return cls(circuit, meta["workers"], meta["shard_bits"], root, **kwargs)

    # ---- state and recovery (DurablePipeline hooks) ----

    def _open_state(self) -> None:
        self._coord = _StageState(self.storage, self.plan, self.workers)  # type: ignore[assignment]

    def _job_path(self) -> str:
        return os.path.join(self.storage, "stages", "JOB")

    def _record_job(self, first: int, end: int) -> None:
        """Durably record the job about to run (invariant 4)."""
        path = self._job_path()
        with open(path + ".tmp", "wb") as f:
            f.write(encode_json(b"DJOB", {"version": self.version, "first": first, "end": end}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _restore_state(self) -> int:
        st: _StageState = self._coord  # type: ignore[assignment]
        at_most = None
        try:
            with open(self._job_path(), "rb") as f:
                job = decode_json(b"DJOB", f.read(), self._job_path())
            if job["end"] > self._output.last:  # its output is not all logged: run it again from its base
                at_most = job["version"]
        except FileNotFoundError:
            pass
        v, x = choose_version(st.paths, at_most)
        self.version = v
        db = st.driver
        dv = db.versions().stop - 1
        with db.open(dv) as h:  # the newest committed driver state; discards an older one
            self._seen.load(h, f"{db.path}")
            clock = h.get(_DEDUP_TABLE + ".clock", b"now")
            if clock is not None:
                self._now_floor = int(decode_json(b"DCLK", clock, f"{db.path} clock")["now_ns"])
            d = h.get_step()
        if not st.paths:
            x = d  # no stateful stage: the checkpoint is the driver's
        if d > x:
            raise RecoveryError(f"{self.storage}: driver.db is at step {d} but the stage databases only at {x}")
        if x > d:  # complete the dedup set and clock from the records the stages already consumed
            for r in self._input.iter_from(d, x - 1):
                if r.handle.startswith("\x00"):
                    self._now_floor = max(self._now_floor, decode_json(b"DDIV", r.payload, "division")["now_ns"])
                elif r.producer:
                    self._seen.add(r.producer, r.seq)
        self.steps = x
        return x

    def _replay_step(self, step: int, inputs: list[tuple[str, ZSet]], now_ns: int, seed: int,
                     ranges: list[dict]) -> None:
        self._replaying.append((step, inputs, now_ns, seed, ranges))

    def _replay_done(self) -> None:
        steps, self._replaying = self._replaying, []
        self._run_steps(steps)
        self.stats["replayed_steps"] += len(steps)

    # ---- steps ----

    def _run_step(self, step: int, inputs: list[tuple[str, ZSet]], now_ns: int, seed: int,
                  ranges: list[dict]) -> dict[str, ZSet]:
        return self._run_steps([(step, inputs, now_ns, seed, ranges)])[0]

    def step(self) -> dict[str, ZSet]:
        """Divide the acknowledged input into a step, run it (with any queued steps, in one job), return its output."""
        self._check_usable()
        with self._step_lock:
            self._queue.append(self._divide())
            outs = self._run_queue()
            return outs[-1]

    def queue_step(self) -> int:
        """Divide the acknowledged input into a step (durably) without running it; returns the step number.

        Queued steps run together, in as few jobs as ``max_steps_per_job`` allows, at the next
        :meth:`run_queued` or :meth:`step` (or on recovery, if the pipeline stops first).
        """
        self._check_usable()
        with self._step_lock:
            self._queue.append(self._divide())
            return self._queue[-1][0]

    def run_queued(self) -> list[dict[str, ZSet]]:
        """Run every queued step; returns each one's ``{output: change}``, in step order."""
        self._check_usable()
        with self._step_lock:
            return self._run_queue()

    @property
    def queued(self) -> int:
        """How many divided steps wait to run."""
        return len(self._queue)

    def _run_queue(self) -> list[dict[str, ZSet]]:
        steps, self._queue = self._queue, []
        outs = self._run_steps(steps)
        if self.checkpoint_interval is not None and \
                time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
            self.checkpoint()
        return outs

    def _run_steps(self, steps: list[tuple]) -> list[dict[str, ZSet]]:
        outs: list[dict[str, ZSet]] = []
        for lo in range(0, len(steps), self.max_steps_per_job):
            outs.extend(self._run_job(steps[lo:lo + self.max_steps_per_job]))
        return outs

    def _input_blobs(self, steps: list[tuple]) -> pa.Table:
        """Stage-0 blobs of a job: each push spread in contiguous slices over the workers (as the embedded runtime
        does)."""
        rows = []
        wk = self.workers
        for step, inputs, _, _, _ in steps:
            per: dict[tuple[str, int], list[ZSet]] = {}
            cursor = step % wk
            for handle, z in inputs:
                if handle not in self.plan.inputs:
                    continue  # feeds no output
                n = z.num_rows
                base, extra = divmod(n, wk)
                start = 0
                for k in range(wk):
                    size = base + (1 if k < extra else 0)
                    if size:
                        w = (cursor + k) % wk
                        per.setdefault((handle, w), []).append(
                            ZSet._make(z.data.slice(start, size), z.weights[start:start + size]))
                        start += size
                cursor = (cursor + n) % wk
            for (handle, w), parts in per.items():
                rows.append((w, -1, self.plan.inputs[handle], step, concat(parts, self._inputs[handle])))
        return encode_blobs(rows)

    def _make_job(self, steps: list[tuple]) -> Job:
        infos = [StepInfo(s[0], s[2], s[3]) for s in steps]
        tasks = [StageTask(self.plan, k, self.workers, self.shard_map.shard_bits, self.storage, self.run_id,
                           self.version, infos) for k in range(self.plan.num_stages)]
        inputs = pa.concat_tables([self._input_blobs(steps), control_blobs(self.workers, steps[0][0])])
        return Job(tasks, inputs, self.workers)

    def _run_job(self, steps: list[tuple]) -> list[dict[str, ZSet]]:
        if not steps:
            return []
        first, end = steps[0][0], steps[-1][0] + 1
        if first != self.steps:
            raise DbspError(f"job for steps {first}..{end - 1} but the pipeline is at step {self.steps}")
        t0 = time.perf_counter()
        try:
            if self.plan.stateful and any(self.plan.stateful):
                self._record_job(first, end)
            job = self._make_job(steps)
            result = self.runner.run_job(job)
            outs = self._collect(result, first, end)
        except BaseException as exc:
            self._broken = exc  # stage databases may be at different versions: recover with open()
            raise
        self.job_seconds += time.perf_counter() - t0
        self.jobs += 1
        if any(self.plan.stateful):
            self.version += 1
        results = []
        for (step, _, now_ns, seed, ranges), out in zip(steps, outs):
            try:
                self._output.write(step, out, ranges)
            except BaseException as exc:
                self._broken = exc
                raise
            self.now_ns, self.seed = now_ns, seed
            self.steps = step + 1
            results.append(out)
        return results

    def _collect(self, result: pa.Table, first: int, end: int) -> list[dict[str, ZSet]]:
        """Each step's outputs from the final blobs, after checking every commit acknowledgement (invariant 2)."""
        if result.schema != BLOB_SCHEMA:
            result = result.select(BLOB_SCHEMA.names).cast(BLOB_SCHEMA)
        want = {(k, w) for k in range(self.plan.num_stages) if self.plan.stateful[k] for w in range(self.workers)}
        acks = read_acks(result)
        got = {(a["stage"], a["worker"]) for a in acks}
        bad = [a for a in acks if (a["version"], a["step"]) != (self.version + 1, end)]
        if got != want or len(acks) != len(want) or bad:
            raise RecoveryError(f"job for steps {first}..{end - 1}: commit acknowledgements {sorted(got)} "
                                f"(bad: {bad}) do not match the stateful (stage, worker) set {sorted(want)}")
        for a in acks:  # executor cache effectiveness (stagetask.py invariant 4)
            key = {"cache": "state_cache_hits", "partial": "state_partial_loads"}.get(a.get("loaded"), "state_loads")
            self.stats[key] = self.stats.get(key, 0) + 1
        nodes = result.column("node")
        control = result.filter(pc.equal(nodes, CONTROL_NODE)).column("part").to_pylist()
        if sorted(control) != list(range(self.workers)):
            raise DbspError(f"job for steps {first}..{end - 1}: control blobs came back from workers "
                            f"{sorted(control)}, expected one from each of 0..{self.workers - 1}")
        outb = result.filter(pc.and_(pc.less(nodes, 0), pc.and_(pc.not_equal(nodes, ACK_NODE),
                                                                  pc.not_equal(nodes, CONTROL_NODE))))
        other = result.num_rows - outb.num_rows - len(acks) - len(control)
        if other:
            raise DbspError(f"job for steps {first}..{end - 1}: {other} blobs were left unconsumed after the last "
                            "stage")
        got_out = gather(self.plan, outb, f"job {first}..{end - 1} output")
        names = self.plan.output_names
        outs = []
        for step in range(first, end):
            out = {}
            for k, name in enumerate(names):
                z = got_out.get((-1 - k, step))
                out[name] = z.consolidate() if z is not None else ZSet.empty(self._out_schemas[name])
            outs.append(out)
        return outs

    # ---- checkpoints ----

    def checkpoint(self, wait: bool = True) -> int:  # type: ignore[override]
        """Record a checkpoint at the step every stage database has committed (each job commits); returns it.

        Saves the dedup set and the clock floor in ``driver.db``, then truncates the input log below the step
        (invariant 3). Queued steps are not run; they stay in the log and recovery runs them.
        """
        self._check_usable()
        with self._step_lock:
            step = self.steps
            db: Database = self._coord.driver  # type: ignore[union-attr]
            try:
                with db.open(db.versions().stop - 1) as h:
                    self._seen.save(h)
                    h.put(_DEDUP_TABLE + ".clock", b"now", encode_json(b"DCLK", {"now_ns": self._now_floor}))
                    h.set_step(step)
                    h.commit()
                self._output.flush()
                self._input.truncate_below(step)
                if self.output_retention is not None:
                    self._output.truncate_below(min(step, self._output.last - self.output_retention))
            except BaseException as exc:
                self._broken = exc
                raise
            self.stats["checkpoints"] += 1
            self._last_checkpoint = time.monotonic()
            return step

    def _join_checkpoint(self) -> None:
        self._check_usable()

    # ---- inspection ----

    def traces(self, worker: int) -> dict:  # type: ignore[override]
        """All keyed state of one worker after the steps run so far (queued steps not yet run are not in it), as
        ``{"<operator label>.<trace name>": Trace}`` like :meth:`Pipeline.traces`.

        The state lives in the stage databases, not in this process: each stateful stage's database of
        ``worker`` is read at the pipeline's current version through a read-only handle (no version is
        discarded, nothing is written), under the lock stage tasks take, and loaded into fresh traces.
        """
        self._check_usable()
        if not 0 <= worker < self.workers:
            raise ValueError(f"traces: worker {worker} is outside 0..{self.workers - 1}")
        out: dict = {}
        with self._step_lock:
            v = self.version
            for k in range(self.plan.num_stages):
                if not self.plan.stateful[k]:
                    continue
                path = stage_db_path(self.storage, k, worker)
                sw = StageWorker(self.circuit, self.plan, k, worker, self.shard_map)
                lockfd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(lockfd, fcntl.LOCK_EX)  # no stage task of this (stage, worker) meanwhile
                    db = Database(path)
                    try:
                        if v not in db.versions():
                            raise RecoveryError(f"{path}: holds versions {db.versions()}, the pipeline is at {v}")
                        with db.read(v) as h:
                            WorkerSnapshot(sw.stateful, self.shard_map.shard_bits).load(h, f"{path} v{v}")
                    finally:
                        db.close()
                finally:
                    os.close(lockfd)
                for i, inst in sw.stateful.items():
                    get = getattr(inst, "traces", None)
                    if get is not None:
                        for name, trace in get().items():
                            out[f"{self.circuit.nodes[i].label}.{name}"] = trace
        return out

    def disk_usage(self) -> dict[str, int]:
        def du(p: str) -> int:
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
        return {"input": du(os.path.join(self.storage, "input")), "output": du(os.path.join(self.storage, "output")),
                "state": du(os.path.join(self.storage, "stages"))}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.storage!r}, workers={self.workers}, steps={self.steps}, "
                f"stages={self.plan.num_stages})")
