"""SparkPipeline: a durable pipeline whose steps run as Spark jobs, one task per (stage, worker), with Spark's shuffle as the exchange, Spark tasks as the workers and the driver as the coordinator.

The engine-side logic is dbsp_core's: the driver (``dbsp_core.runtime.driver``: step division, input and output
logs, checkpoints; ``recovery`` and ``rescale`` beside it) over the staged executor (``dbsp_core.runtime.staged``, with
``stage_plan`` and ``stage_task``: stages, stage tasks, per-(stage, worker) state, retries). This module only
supplies the job runner, which moves blobs: one Spark job runs a step run (queued steps divided together) as::

    spark.range(W) in W partitions
      -> mapInArrow(stage 0 over the worker's job input file) -> [shuffle to partition = part]
      -> mapInArrow(stage 1) -> [shuffle] -> ... -> toArrow() on the driver (commit acknowledgements)
      -> the driver reads the last stage's output shares from its result files

(a stateless last stage returns its output shares through ``toArrow()`` instead). With an object store each stage
is a Spark job of its own instead, its tasks placed by cache and the blobs between stages passing through the store
(spark_glue.placement; ``SparkJobRunner.place``).

Design notes (each is a requirement this module keeps):
  1. Rows never cross Python one by one: a blob is one Z-set (Arrow IPC with a checksum); the shuffle moves
     ``(part, src, node, step, payload)`` rows, W x nodes x steps of them per job, whatever the data size.
  2. Exact placement: the shuffle is ``repartition(W, code)`` where ``code`` is a per-destination int chosen
     on the driver so that Spark's hash partitioning (``pmod(murmur3(code, 42), W)``) sends it to partition
     ``part``; the codes are computed by Spark itself (``F.hash``), not re-implemented. Stage 0 runs over
     ``spark.range(W)`` in W partitions and task ``w`` reads worker ``w``'s input, so it needs no shuffle.
     ``repartition`` with an explicit count is never coalesced by adaptive execution. Inside a task the worker id is
     ``TaskContext.partitionId()``, and every stage task refuses a blob addressed to another worker
     (dbsp_core.runtime.stage_task invariant 1), so a placement bug fails loudly instead of producing wrong data.
  3. A DataFrame pushed as input is gathered to the driver (``toArrow``): the driver is where the input log
     is, and a push is acknowledged only once logged. Outputs are small changes collected to the driver;
     ``output_df`` / ``view_df`` build DataFrames from logged data, never from the job's lineage, so Spark can
     never re-run a stage task of a finished job by re-evaluating a DataFrame.
  4. A storage directory must be visible at the same path to the driver and every Spark executor (a local path
     in local mode, a shared mount on a cluster); stage state is under ``<storage>/state``. With an object store
     (``storage="s3://..."``) nothing is shared: each Spark executor keeps its tasks' stage state in a cache of
     its own (``task_cache_dir``, default its Spark local directory) and the state moves between Spark executors
     through the store (dbsp_core.runtime.stage_store; the driver's logs, META, driver.db and checkpoints go to
     the store as an embedded store pipeline's, runtime/remote_state.py).
  5. Input and output rows cross the JVM only in the shuffle: the driver writes each worker's stage-0 blobs
     to a job input file under the storage directory (dbsp_core.runtime.job_files: checksummed, named by the
     job, removed when the job ends), and when the last stage is stateful its tasks leave their output shares in
     the result files they write before committing (dbsp_core.runtime.stage_task invariants 3 and 5), which the driver
     reads after the job, checking that each holds this job's committed result. Spark's ``toArrow()`` then
     carries only the commit acknowledgements and control blobs. With an object store, each worker's stage-0
     blobs are one object in it (``jobs/worker-<w>.input``, replaced by each job, read under the job's
     description: stage_store.write_job_inputs) and the output shares come back through ``toArrow()``.
  6. A job's DataFrame holds nothing job-specific but the worker count: the job (driver run id, layout, base
     version, steps with their ``now`` and seed) is described in its control blobs, which the input file carries to stage 0 and every
     stage forwards, and each task builds its StageTask from the one it receives (a stage-0 task checks it
     against the file header). So the next job's DataFrame is built ahead, in a background thread, while the
     driver reads a job's results; each job still gets a DataFrame of its own (an executed DataFrame would
     reuse its shuffle output), and every guarantee of the stage tasks holds as before, since they check the
     job against their databases (dbsp_core.runtime.stage_task invariant 3). A layout change between jobs only
     changes the number of tasks per stage (the DataFrame of the new worker count) and the job description.
  7. Losing a Spark executor (issue 33) costs only that Spark executor's work, never a rollback of the others:
     every acknowledged job's state of every worker is durable outside it before the driver hears of the job
     (with a shared mount: the stage databases on the mount, committed by each task; with an object store: each
     stateful task's delta, uploaded before its commit, stage_store invariant 1). Spark retries the lost task
     attempts (and re-runs the earlier-stage tasks whose shuffle output was lost) wherever it places them; a
     task on a Spark executor whose cache is stale or gone rebuilds its worker's state from the shared mount or
     the chain in the store, while the workers whose Spark executor survived keep their cached state
     (tests/spark/test_spark_lose.py counts both). With an object store the tasks are placed by cache
     (spark_glue.placement): the survivors' tasks stay where their state is, the lost workers go to the warm Spark
     executors with the fewest, a replacement Spark executor takes workers only once a warm-up task ran on it, the
     tasks of a stage in flight that preferred the lost one run on the cores left without waiting out
     ``spark.locality.wait`` (a Spark job per preferred Spark executor, spark_glue.placement design note 6), and
     no stage's output is lost with a Spark executor (the exchange is in the store). A job Spark aborts (a task out of attempts) runs again from the
     same chains (dbsp_core.runtime.staged invariant 5) instead of breaking the pipeline. So the per-job write is the
     default (``worker_recovery="alone"``; the other option is design note 9): it is what replaces the issue's
     in-flight exchange log, and it costs the bytes each job changes (bench/RESULTS.md, issue 33). A lost driver
     still means whole-pipeline recovery: ``SparkPipeline.open`` from the last
     checkpoint, replaying the input log. A task whose state moved asks for its chain's objects at once
     (stage_store._Prefetch). Where the rest of a loss goes (Spark's re-runs of lost shuffle output on the cores
     left, and the replacement Spark executor's cold first tasks) is timed apart in bench/RESULTS.md, issue 33.
  8. With an object store, a layout change (``rescale``, each wave of a live one, ``open(..., workers=)``) is a
     Spark job too (:meth:`SparkJobRunner.run_tasks`): one task per stateful (stage, worker) of the new layout
     fetches the old databases it reads through the store into its Spark executor's cache (reusing a cached
     copy), builds its worker's new database there, uploads it as a base and acknowledges it; the driver only
     assigns the tasks, checks the acknowledgements and records the new chains (dbsp_core.runtime.stage_store
     invariant 6). No state passes through the driver; a retried or duplicated attempt uploads under a token of
     its own, and a driver that dies mid-change recovers from the last checkpoint as for a step.
  9. Recovery policy (issue 33, deliver 3): ``worker_recovery="alone" | "pipeline"``, per pipeline (per driver
     incarnation: ``SparkPipeline(...)`` and ``open(...)`` take it, nothing of it is stored, and either mode opens
     what the other wrote, since a manifest names durable chains only), checked at the API boundary
     (:func:`check_worker_recovery`: another value, or ``"pipeline"`` without an object store, is a ValueError
     before any Spark work).
     - ``"alone"`` (default): design note 7. Every stateful task uploads its delta before its commit; a lost Spark
       executor's workers are rebuilt from their chains while the others keep their cached state.
     - ``"pipeline"``: no task uploads anything (dbsp_core.runtime.stage_store invariant 8): each commits in its
       Spark executor's cache and writes its records to a pending file there, and its acknowledgement names a
       local link; the driver keeps local links apart from the durable chains. Tasks are placed by cache
       (``SparkJobRunner.place``; refused without it) and a worker with local links is pinned to its Spark
       executor (spark_glue.placement design note 7). A flush uploads, per stateful (stage, worker), the pending
       records since its durable chain as one delta (or its page file, by stage_store invariant 4's rule), in a
       Spark job of tasks placed where the state is: at every checkpoint (so a checkpoint uploads what changed
       since the last one, while the steps are paused), before a layout change and before the driver reads the
       state (``view``, ``traces``). A task whose worker's state is missing or behind (its Spark executor was lost,
       or Spark ran it elsewhere) reports WorkerStateLostError (returned, not raised: Spark would retry it in
       vain), as does a job whose pinned worker's Spark executor is gone before it starts; the driver then
       recovers the whole pipeline in place (dbsp_core.runtime.driver invariant 10): every chain back at the last
       durable point, the steps since replayed from the input log with their logged determinants, their outputs
       checked against the output log and not emitted again, then the failed steps run again. Exactly once as
       after a driver loss, with the driver kept.
     The trade (bench/RESULTS.md, issue 33, "Recovery policy"; local-cluster, W=4, 1M keys, moto, load 8-15):
     ``"pipeline"`` saves the per-job upload (a PUT per stateful task a job and the bytes it changed: 0.8 MB a
     2,000-row step, 9.3 MB a 20,000-row one) and moves it to the checkpoint (a flush of 1.3-2.3 s, steps paused,
     at most the page files); a loss then costs a rollback of every worker and a replay of every step since the
     checkpoint. Measured: the upload's per-step cost was inside the noise at 2,000-row steps ("pipeline" 8% slower
     at p50 in one run, 11% faster in the other) and 16% of the mean step at 20,000-row steps, while one Spark
     executor lost 30 s after a checkpoint
     took ``"pipeline"`` 21.9-30.0 s back to the current step against 6.4-12.6 s, latencies 15-24 s against 3.4-8.4
     s. So the default is ``"alone"``: on a cluster where losing an executor is routine (the issue's premise) the
     per-job write costs little and keeps a loss to its own workers; ``"pipeline"`` fits pipelines that write much
     state per step on executors rarely lost, with short checkpoint intervals.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from dbsp_core.circuit import Circuit
from dbsp_core.envvars import parse_memory_limit
from dbsp_core.errors import DbspError, WorkerStateLostError
from dbsp_core.layout import DEFAULT_SHARD_BITS
from dbsp_core.runtime import Pipeline, StagedExecutor
from dbsp_core.runtime.job_files import read_job_input, remove_job_inputs, write_job_inputs
from dbsp_core.runtime.stage_plan import BLOB_SCHEMA, CONTROL_NODE, StagePlan, control_blobs
from dbsp_core.runtime import stage_store
from dbsp_core.runtime.stage_task import StageTask, read_result_outputs, run_stage_task
from dbsp_core.runtime.staged import Job
from dbsp_core.storage.formats import META_FILE
from dbsp_core.storage.remote import is_remote
from dbsp_core.zset import ZSet
from spark_glue.check import check_executors
from spark_glue.executors import SparkExecutors
from spark_glue.placement import (Placement, executor_here, job_of, placed_rdd, run_by_executor, run_placed_task,
                                  stage_task_of, warm_up)

__all__ = ["SparkPipeline", "SparkJobRunner", "partition_codes", "check_worker_recovery"]


def partition_codes(spark: Any, workers: int) -> list[int]:
    """For each partition ``p`` of ``workers``, an int whose Spark hash partition (``pmod(hash(c), W)``) is ``p``.

    Computed by Spark's own ``hash`` over a small range of ints (design note 2).
    """
    from pyspark.sql import functions as F

    for span in (64, 4096, 1 << 20):
        rows = (spark.range(0, span * workers).select(F.col("id").cast("int").alias("c"))
                .select("c", F.expr(f"pmod(hash(c), {workers})").alias("p"))
                .groupBy("p").agg(F.min("c").alias("c")).collect())
        codes = {r["p"]: r["c"] for r in rows}
        if len(codes) == workers:
            return [codes[p] for p in range(workers)]
    raise RuntimeError(f"no int hashes to every one of {workers} Spark partitions")  # pragma: no cover


def check_worker_recovery(mode: Any, storage: Any) -> None:
    """Design note 9: ``worker_recovery`` is ``"alone"`` or ``"pipeline"``, and ``"pipeline"`` needs an object store
    (with a shared directory every job's state is already on the mount: nothing to choose). ValueError otherwise."""
    if not isinstance(mode, str) or mode not in stage_store.RECOVERY_MODES:
        raise ValueError(f"worker_recovery must be one of {', '.join(map(repr, stage_store.RECOVERY_MODES))}, got "
                         f"{mode!r}")
    if mode == "pipeline" and not is_remote(storage):
        raise ValueError("worker_recovery='pipeline' chooses when a store pipeline uploads its state; it needs "
                         "storage='s3://...' (or another store's URI): a shared directory holds every job's state "
                         "already")


def _blob_struct() -> Any:
    """The Spark schema of a blob table (a StructType: mapInArrow then parses no DDL string through the JVM)."""
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StructField, StructType

    return StructType([StructField("part", IntegerType()), StructField("src", IntegerType()),
                       StructField("node", IntegerType()), StructField("step", LongType()),
                       StructField("payload", BinaryType())])


def _describe(tasks: list[StageTask], fault: tuple[int, str, int] | None, attempts: int) -> dict:
    """The job-specific part of a job's stage tasks, which travels with the blobs (design note 6); with an object
    store, the chain of every stateful (stage, worker) (stage_store invariant 2)."""
    task = tasks[0]
    out = {"run": task.run, "version": task.version, "layout": task.layout.to_dict(),
           "steps": [list(s) for s in task.steps], "fault": None if fault is None else [*fault, attempts],
           "memory": [task.memory_limit, task.spill_dir], "recovery": task.worker_recovery}
    if task.store is not None:
        out["chains"] = {str(t.stage): {str(w): c for w, c in t.chains.items()} for t in tasks if t.chains is not None}
    return out


def _stage_fn(plan: StagePlan, stage: int, storage: str | None, outputs_in_result: bool,
              store: stage_store.StageStore | None = None):
    """The mapInArrow function of one stage of any job: take the partition's blobs (stage 0: the worker's input
    file), build the stage task from the job description they carry, run it and yield its blobs."""

    def run(batches):
        from pyspark import TaskContext

        tc = TaskContext.get()
        worker = tc.partitionId()
        where = f"stage {stage} worker {worker}"
        bs = list(batches)
        if stage == 0:
            if store is not None:
                head, table = stage_store.read_job_input(stage_store.remote_of(store), worker)
            else:
                assert storage is not None
                head, table = read_job_input(storage, worker)
        else:
            table = pa.Table.from_batches(bs) if bs else BLOB_SCHEMA.empty_table()
        job = job_of(table, where)
        if stage == 0 and head != job:
            raise DbspError(f"{where}: the input file of job {head} carries the job {job}")
        task = stage_task_of(plan, stage, storage, outputs_in_result, store, job, worker, tc.attemptNumber())
        out = run_stage_task(task, worker, table)
        yield from out.combine_chunks().to_batches()

    return run


class SparkJobRunner:
    """Runs a job's stage tasks as one Spark job (dbsp_core.runtime.staged.JobRunner); see the module docstring.

    ``fault`` (tests only): ``(stage, point, worker)`` makes the first ``fault_attempts`` attempts of that task
    raise at ``point`` (``"before-commit"`` or ``"after-commit"``); Spark retries a failed task when task
    retries are enabled (``local[N,F]`` with F >= 2, or ``spark.task.maxFailures`` >= 2 on a cluster).
    ``outputs_by_file`` (default on): a stateful last stage leaves its output shares in its result files and
    the driver reads them there (design note 5). ``prebuild`` (default on): the next job's DataFrame is
    built in a background thread while the driver reads a job's results (design note 6).
    """

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        # tasks a Spark executor runs at once, each in a Python worker of its own: a memory budget per Spark
        # executor is divided among them (dbsp_core.runtime.staged invariant 6)
        self.task_slots = SparkExecutors(spark).task_slots()
        self._codes: dict[int, list[int]] = {}
        self._schema = _blob_struct()
        self.fault: tuple[int, str, int] | None = None
        self.fault_attempts = 1
        self.outputs_by_file = True
        self.prebuild = True
        self._pool: ThreadPoolExecutor | None = None
        self._next: tuple[tuple, Future] | None = None
        # with an object store: each stage a Spark job of tasks placed by cache (spark_glue.placement); off: one
        # Spark job per step run, stages joined by Spark's shuffle, tasks wherever Spark puts them
        self.place = True
        self.placement = Placement()
        # ... each stage's tasks as one Spark job per preferred Spark executor, so that a lost one's tasks do not
        # wait out spark.locality.wait (spark_glue.placement design note 6); off: one Spark job per stage
        self.job_per_executor = True
        self._executors = SparkExecutors(spark)

    def codes(self, workers: int) -> list[int]:
        """The partition codes of ``workers`` Spark partitions (design note 2), computed once per worker count."""
        if workers not in self._codes:
            self._codes[workers] = partition_codes(self.spark, workers)
        return self._codes[workers]

    def _route(self, df: Any, workers: int) -> Any:
        """Shuffle so that a blob with ``part = p`` lands in partition ``p`` (design note 2)."""
        from pyspark.sql import functions as F

        code = F.element_at(F.array(*[F.lit(c) for c in self.codes(workers)]), F.col("part") + 1)
        return df.repartition(workers, code)

    def _build(self, key: tuple, plan: StagePlan) -> Any:
        """A new DataFrame running every stage of a job (any job with these static parameters: design note 6)."""
        storage, workers, by_file, store = key[1:]
        df = self.spark.range(0, workers, 1, workers)  # W one-row partitions: partition w = worker w
        last = plan.num_stages - 1
        for k in range(plan.num_stages):
            if k:
                df = self._route(df, workers)
            df = df.mapInArrow(_stage_fn(plan, k, storage, by_file and k == last, store), self._schema)
        return df

    def _dataframe(self, key: tuple, plan: StagePlan) -> Any:
        """The prebuilt DataFrame when there is one for ``key`` (a failed prebuild is built again here)."""
        nxt, self._next = self._next, None
        if nxt is not None and nxt[0] == key:
            try:
                return nxt[1].result()
            except Exception:  # e.g. the session was busy stopping: build it in this thread instead
                pass
        return self._build(key, plan)

    def run_job(self, job: Job) -> pa.Table:
        tasks = job.tasks
        t0 = tasks[0]
        plan, storage, last, store = t0.plan, t0.storage, len(tasks) - 1, t0.store
        if storage is None and store is None:
            raise DbspError("SparkJobRunner: stage tasks need a storage directory every Spark executor can see, or an "
                            "object store")
        # design note 5: with a store no file is shared, so the output shares come back through toArrow()
        by_file = self.outputs_by_file and plan.stateful[last] and store is None
        W = job.workers
        key = (id(plan), storage if store is None else None, W, by_file, store)
        df = None if store is not None and self.place else self._dataframe(key, plan)
        desc = _describe(tasks, self.fault, self.fault_attempts)
        inputs = job.inputs
        ctl = inputs.column("node").to_numpy() == CONTROL_NODE
        inputs = pa.concat_tables([inputs.filter(pa.array(~ctl)), _control(W, t0.steps[0].step, desc)])
        if store is not None and t0.worker_recovery == "pipeline" and not self.place:
            raise DbspError("worker_recovery='pipeline' needs tasks placed by cache (SparkJobRunner.place): placed by "
                            "Spark alone, a worker's next task lands on another Spark executor, whose cache lacks "
                            "the state committed since the last checkpoint")
        if store is not None:
            stage_store.write_job_inputs(stage_store.remote_of(store), desc, inputs, W)
            result = self._run_placed(plan, store, W, desc) if self.place else df.toArrow()
        else:
            assert storage is not None
            write_job_inputs(storage, desc, inputs, W)
            try:
                result = df.toArrow()
            finally:
                remove_job_inputs(storage, W)
        if self.prebuild and df is not None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dbsp-spark-plan")
            self._next = (key, self._pool.submit(self._build, key, plan))
        if not by_file:
            return result
        if result.schema != BLOB_SCHEMA:
            result = result.select(BLOB_SCHEMA.names).cast(BLOB_SCHEMA)
        return pa.concat_tables([result, read_result_outputs(tasks[last], W)])

    def _run_placed(self, plan: StagePlan, store: stage_store.StageStore, workers: int, desc: dict) -> pa.Table:
        """Each stage of the job as a Spark job of tasks placed by cache, the blobs between stages through the store
        (spark_glue.placement); the last stage's blobs."""
        sc = self.spark.sparkContext
        pl = self.placement
        desc = json.loads(json.dumps(desc, sort_keys=True))  # as the tasks read it from the objects' tags
        pl.asked, pl.ran = {}, {}
        # design note 9: a worker whose state since the last durable point is in its Spark executor's cache only
        pinned = {(int(k), int(w)) for k, ch in desc.get("chains", {}).items() for w, c in ch.items()
                  if c and c[-1]["kind"] == stage_store.LOCAL}
        if pinned:
            alive0 = set(self._executors.executor_ids())
            gone = sorted(kw for kw in pinned if pl.last.get(kw) is not None and pl.last[kw] not in alive0)
            if gone:
                raise WorkerStateLostError(f"the Spark executors holding the state of (stage, worker) {gone} since "
                                           f"the last checkpoint are lost (worker_recovery='pipeline')")
        tables = []
        sent: list[dict] | None = None  # where each worker's committed attempt put what it sent into stage k
        for k in range(plan.num_stages):
            # per stage: a Spark executor lost meanwhile gets no preference (its workers' tasks would wait out
            # spark.locality.wait), and a replacement registered meanwhile is warmed before it can take one cold
            alive = self._executors.executor_ids()
            self._warm_up(alive, store)
            prefs = pl.assign(plan.stateful, workers, alive, pinned)
            pl.asked.update({(k, w): e for w, e in enumerate(prefs[k]) if pl.location(e) is not None})
            locs = [pl.location(e) for e in prefs[k]]
            rdd = placed_rdd(sc, locs).mapPartitionsWithIndex(run_placed_task(plan, k, store, workers, desc, sent))
            got = run_by_executor(sc, rdd, locs) if self.job_per_executor else rdd.collect()
            got.sort(key=lambda g: g[0])  # worker order, as one job's collect() gives it, whatever job ran first
            if sorted(w for w, _, _ in got) != list(range(workers)):
                raise DbspError(f"stage {k}: results of workers {sorted(w for w, _, _ in got)}, expected one from each "
                                f"of 0..{workers - 1}")
            lost = [f"worker {w}: {data['lost']}" for w, _, data in got if isinstance(data, dict) and "lost" in data]
            if lost:
                raise WorkerStateLostError(f"stage {k}: " + "; ".join(lost))
            sent = [{} for _ in range(workers)]
            for w, here, data in got:
                pl.ran_on(k, w, here, plan.stateful[k])
                if isinstance(data, bytes):
                    tables.append(pa.ipc.open_stream(pa.py_buffer(data)).read_all())
                else:
                    sent[w] = data
        return pa.concat_tables(tables) if tables else BLOB_SCHEMA.empty_table()

    def _warm_up(self, alive: list[str], store: stage_store.StageStore) -> None:
        """Start a warm-up task on each live Spark executor not yet warm (spark_glue.placement design note 5): a
        Spark job of its own in the background, preferring that Spark executor (known by host once any task of its
        host reported; else no preference, and Spark places it where a core is free)."""
        pl = self.placement
        with pl.lock:
            cold = [e for e in alive if e not in pl.warm and e not in pl.warming]
            pl.warming.update(cold)
        if not cold or not pl.warm:  # the first job warms the Spark executors it runs on
            with pl.lock:
                pl.warming.difference_update(cold)
            return
        host = next(iter(pl.hosts.values()))
        sc = self.spark.sparkContext

        def run() -> None:
            try:
                got = placed_rdd(sc, [f"executor_{host}_{e}" for e in cold]).mapPartitionsWithIndex(
                    warm_up(store)).collect()
                with pl.lock:
                    for here in got:
                        if here is not None:
                            pl.hosts[here[1]] = here[0]
                            pl.warm.add(here[1])
                    pl.stats["warmups"] += len(got)
            except Exception:  # noqa: BLE001 - a lost Spark executor or a stopped session: warmed by a later job
                pass
            finally:
                with pl.lock:
                    pl.warming.difference_update(cold)

        threading.Thread(target=run, name="dbsp-spark-warm-up", daemon=True).start()

    def run_tasks(self, fn: Any, items: list[Any]) -> list[dict]:
        """One Spark job of ``len(items)`` tasks, task ``i`` running ``fn(items[i])`` wherever Spark places it (a
        layout change of a store pipeline, design note 8); Spark retries a failed attempt, and ``collect`` returns
        the result of the one attempt per task it took, in task order."""
        if not items:
            return []
        sc, pl = self.spark.sparkContext, self.placement
        locs = [pl.location(pl.last.get((item.stage, item.worker))) if getattr(item, "where_cached", False) else None
                for item in items]
        if any(locs):  # a flush task runs where its worker's state is cached (design note 9)
            rdd = placed_rdd(sc, locs).mapPartitionsWithIndex(_reporting_placed(fn, items))
            got = run_by_executor(sc, rdd, locs) if self.job_per_executor else rdd.collect()
            got = [g for _, g in sorted(got, key=lambda x: x[0])]
        else:
            got = sc.parallelize(items, len(items)).map(_reporting(fn)).collect()
        lost = [r["lost"] for r, _ in got if isinstance(r, dict) and "lost" in r]
        if lost:
            raise WorkerStateLostError("; ".join(lost))
        pl.asked = {}
        for item, (_, here) in zip(items, got):  # a layout change's task built its worker's state where it ran
            stage, worker = getattr(item, "stage", None), getattr(item, "worker", None)
            if stage is not None and worker is not None:
                pl.ran_on(stage, worker, here, True)
        return [r for r, _ in got]

    def release(self, pipeline: str) -> None:
        """Not done on Spark: a task runs in any idle Python worker of a Spark executor, so no job reaches each
        worker's cached stage workers of the closed pipeline; they stay until newer entries push them out (at most
        64 per Python worker, stage_task invariant 4) or the Python worker exits."""

    def close(self) -> None:
        """Wait for a prebuild in flight and stop its thread."""
        self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _reporting(fn: Any) -> Any:
    """``fn`` returning its result with the Spark executor it ran on (spark_glue.placement design note 3); a
    WorkerStateLostError is returned as ``{"lost": why}`` (placement design note 7)."""

    def run(item: Any) -> tuple[Any, Any]:
        from dbsp_core.errors import WorkerStateLostError

        try:
            return fn(item), executor_here()
        except WorkerStateLostError as exc:
            return {"lost": str(exc)}, executor_here()

    return run


def _reporting_placed(fn: Any, items: list[Any]) -> Any:
    """:func:`_reporting` as the function of a placed RDD's partitions: partition ``i`` runs ``items[i]``."""
    one = _reporting(fn)

    def run(index: int, it: Any) -> Any:
        for _ in it:  # read to its end, else the Python worker is not reused
            pass
        yield index, one(items[index])

    return run


def _control(workers: int, step: int, desc: dict) -> pa.Table:
    """The job's control blobs (stages.control_blobs) carrying the job description (design note 6)."""
    t = control_blobs(workers, step)
    return t.set_column(4, "payload", pa.array([json.dumps(desc, sort_keys=True).encode()] * workers, pa.binary()))


class SparkPipeline(Pipeline):
    """The :class:`dbsp_core.Pipeline` driver over the staged executor with a Spark job runner: each step run
    is one Spark job. It adds Spark DataFrames as input and output; everything else is the Pipeline's.

    Parameters
    ----------
    spark : pyspark.sql.SparkSession
        The session whose Spark executors run the stage tasks.
    circuit : dbsp_core.Circuit
        The circuit.
    workers : int
        W: Spark partitions per stage (one per worker). Results do not depend on it.
    storage : str or os.PathLike or pyarrow.fs.FileSystem or None
        Directory for the input log, output log and stage state; every Spark executor must see it at the same path
        (None: a new temporary directory, for local mode). Or an object store's URI (``s3://bucket/prefix?...``,
        credentials from the environment of the driver and of every Spark executor): nothing is shared then
        (design note 4), and state moves between Spark executors only through the store, never through the
        driver, on a rescale as on a task rescheduled elsewhere (design notes 7 and 8); ``cache_dir`` is the
        driver's local cache (logs and records, no stage state), as for ``dbsp_core.Pipeline``.
    task_cache_dir : str or None
        With an object store: where each Spark executor keeps its tasks' stage state, a directory local to it
        (None: its own Spark directory, ``SPARK_EXECUTOR_DIRS`` / YARN's ``LOCAL_DIRS``).
    memory_limit : int or str or None
        A memory budget for operator state per Spark executor (bytes, or a size such as ``"4GiB"``, parsed as
        ``dbsp_core.Pipeline``'s): each task runs in a Python worker of the Spark executor, so each Python worker
        keeps the traces it holds (its cache of live operator instances and the state a task loads from its stage
        database) under the budget divided by the tasks the Spark executor runs at once (``local[N]``: N;
        ``spark.executor.cores / spark.task.cpus``). Beyond it the biggest, oldest batches go to batch files in
        the Spark executor's local directory (or ``spill_dir``, a local path on every Spark executor's machine),
        read in place through a cache; results do not change. A job still commits the rows of spilled batches
        into the stage databases (the files are one process's scratch: dbsp_core/runtime/stage_task.py
        invariant 7). ``p.metrics()["spill"]`` and ``p.stats["task_spill"]`` sum what the tasks report. The
        ``DBSP_MEMORY_LIMIT`` setting does not apply here: only the argument sets a budget.
    spill_dir : str or None
        With ``memory_limit``: the base directory of the Python workers' batch files on every Spark executor.
    worker_recovery : str
        With an object store, how the state of a lost Spark executor's workers comes back (design note 9):
        ``"alone"`` (default) uploads every job's state delta before the job is acknowledged, so those workers are
        rebuilt from the store while the others keep their state; ``"pipeline"`` uploads nothing between
        checkpoints (each checkpoint uploads what changed since the last one) and recovers the whole pipeline from
        the last checkpoint, replaying the input log, when a worker's state is lost. ValueError for another value,
        or for ``"pipeline"`` without an object store.
    shard_bits, max_steps_per_job, checkpoint_interval, replay_check, output_retention, output_sync, autoscale
        As for ``dbsp_core.Pipeline`` and ``dbsp_core.runtime.StagedExecutor``. With ``autoscale`` the worker count
        (tasks per stage) follows the policy, up to its ``max_workers``, and Spark executors are asked for and
        released to match where the cluster manager allows it (spark_glue.executors).

    Examples
    --------
    A session and a pipeline (not run as a doctest: it starts a JVM)::

        p = SparkPipeline(spark, circuit, workers=2, storage="/shared/pipe")
        p.push("bids", spark.read.parquet("bids.parquet"))    # or a ZSet / pa.Table / RecordBatch
        out = p.step()                                        # {output: ZSet}, one Spark job
        for batch in batches: p.push("bids", batch); p.queue_step()
        outs = p.run_queued()                                 # several steps in one job
        p.output_df("totals").show(); p.view_df("totals").show()
        p.close()
        p = SparkPipeline.open(spark, "/shared/pipe", circuit)             # recover after a stop or a crash
        p = SparkPipeline.open(spark, "/shared/pipe", circuit, workers=4)  # ... at another worker count
        # no shared path: the state's durable home is an object store, each Spark executor caches its tasks' state
        p = SparkPipeline(spark, circuit, workers=2, storage="s3://bucket/pipe", cache_dir="/local/driver-cache")
        p = SparkPipeline.open(spark, "s3://bucket/pipe", circuit)        # a new driver, any machine
        # operator state beyond memory: at most 8 GiB of it per Spark executor, the rest in its local directory
        p = SparkPipeline(spark, circuit, workers=8, storage="/shared/pipe", memory_limit="8GiB")
    """

    def __init__(self, spark: Any, circuit: Circuit, workers: int = 1, storage: Any = None, *,
                 shard_bits: int = DEFAULT_SHARD_BITS, max_steps_per_job: int = 64,
                 task_cache_dir: str | os.PathLike | None = None, worker_recovery: str = "alone",
                 **kwargs: Any) -> None:
        from pyspark.sql import SparkSession

        if not isinstance(spark, SparkSession):
            raise TypeError(f"SparkPipeline needs a SparkSession, got {type(spark).__name__}")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"SparkPipeline: workers must be a positive int, got {workers!r}")
        check_worker_recovery(worker_recovery, storage)  # design note 9, before any Spark work
        parse_memory_limit(kwargs.get("memory_limit"))  # before any Spark work (Pipeline checks it again)
        self.spark = spark
        check_executors(spark)  # fails at once, saying what to set, if the workers cannot import the engine
        if storage is None:
            storage = tempfile.mkdtemp(prefix="dbsp-spark-")
        self._views: dict[str, tuple[int, ZSet]] = {}
        executor = StagedExecutor(SparkJobRunner(spark), max_steps_per_job=max_steps_per_job,
                                  task_cache_dir=task_cache_dir, worker_recovery=worker_recovery)
        self._capacity = SparkExecutors(spark)  # an autoscaled worker count asks for Spark executors through it
        super().__init__(circuit, workers, shard_bits, storage, executor=executor, **kwargs)

    @classmethod
    def open(cls, spark: Any, path: Any, circuit: Circuit, workers: int | None = None,  # type: ignore[override]
             **kwargs: Any) -> "SparkPipeline":
        """Recover the pipeline stored in ``path``; ``workers`` continues it at another worker count (a cold
        rescale, as :meth:`dbsp_core.Pipeline.open`)."""
        from dbsp_core.errors import RecoveryError

        if is_remote(path):  # an object store: its newest manifest says whether it holds a pipeline
            return cls(spark, circuit, 1, path, _rescale_to=workers, _open_only=True, **kwargs)
        root = os.fspath(path)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"SparkPipeline.open: no storage directory {root!r}")
        if not os.path.exists(os.path.join(root, META_FILE)):
            raise RecoveryError(f"SparkPipeline.open: {root!r} holds no pipeline (META is missing)")
        return cls(spark, circuit, 1, root, _rescale_to=workers, _open_only=True, **kwargs)

    @property
    def runner(self) -> "SparkJobRunner":
        """The Spark job runner (tests set its fault injection)."""
        return self.executor.runner  # type: ignore[attr-defined,return-value]

    # ---- input ----

    def push(self, handle: str, data: Any, weights: Any = None, *, producer: str | None = None,
             seq: int | None = None) -> Any:
        """Durably record ``data`` for the next step: a Spark DataFrame or any form :meth:`Pipeline.push` takes.

        A DataFrame is collected to the driver as Arrow (design note 3) and then validated like every other form
        by :meth:`Pipeline.push`: columns by the input's names, types cast safely (e.g. Spark ``string`` to
        ``utf8``). Invalid input raises and records nothing, as for the durable pipeline.
        """
        from pyspark.sql import DataFrame

        if isinstance(data, DataFrame):
            self._check_usable()
            if handle not in self._inputs:
                raise KeyError(f"push: unknown input handle {handle!r}; inputs are {sorted(self._inputs)}")
            data = data.toArrow()
        return super().push(handle, data, weights, producer=producer, seq=seq)

    # ---- outputs as DataFrames ----

    def output_df(self, name: str, step: int | None = None) -> Any:
        """The change of output ``name`` in ``step`` (default: the latest step) as a DataFrame with a ``weight``
        column."""
        if name not in self._out_schemas:
            raise KeyError(f"unknown output {name!r}; outputs are {sorted(self._out_schemas)}")
        if step is None:
            step = self.steps - 1
        if step < 0:
            z = ZSet.empty(self._out_schemas[name])
        else:
            z = self._output.get(step)[name]
        return self._df(z)

    def view_df(self, name: str) -> Any:
        """The integrated view of output ``name`` (the sum of every logged change) as a DataFrame with ``weight``.

        A materialized view (``CREATE MATERIALIZED VIEW``, ``materialized=True``) is read from the engine's state
        in the stage databases, as :meth:`dbsp_core.Pipeline.view` with ``weights=True`` reads it (also
        ``p.view(name)`` here: an Arrow table). Another output's view is kept on the driver and brought up to date
        from the output log on each call (only new steps are read); it needs the output log from step 0 (no
        ``output_retention``).
        """
        if name in self._out_schemas and name in self.circuit.readable:
            return self.spark.createDataFrame(self.view(name, weights=True))
        if name not in self._out_schemas:
            raise KeyError(f"unknown output {name!r}; outputs are {sorted(self._out_schemas)}")
        upto, acc = self._views.get(name, (0, ZSet.empty(self._out_schemas[name])))
        parts = [acc] + [z for _, z in self.read_output(name, upto)]
        acc = (ZSet.concat(parts) if len(parts) > 1 else acc).consolidate()
        self._views[name] = (self._output.last, acc)
        return self._df(acc)

    def _df(self, z: ZSet) -> Any:
        t = z.to_arrow()
        return self.spark.createDataFrame(t)

    def __repr__(self) -> str:
        return f"SparkPipeline({self.storage!r}, workers={self.workers}, steps={self.steps})"
