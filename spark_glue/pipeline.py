"""SparkPipeline: a durable pipeline whose steps run as Spark jobs, one task per (stage, worker), with Spark's shuffle as the exchange, executors as the workers and the driver as the coordinator.

The engine-side logic is dbsp_core's (``dbsp_core.stages`` and ``dbsp_core.stagetask``: stages, stage tasks,
per-(stage, worker) state, retries; ``dbsp_core.staged``: step division, input and output logs, checkpoints,
recovery). This module only moves blobs: one Spark job runs a batch of queued steps as::

    parallelize(stage-0 input blobs, one slice per worker)
      -> mapInArrow(stage 0) -> [shuffle to partition = part] -> mapInArrow(stage 1) -> [shuffle] -> ...

(a job whose stage-0 input is under ``SparkJobRunner.INLINE_BYTES`` ships it inside the stage-0 function
over ``spark.range(W)`` instead, one Python pass fewer).
      -> toArrow() on the driver (output shares and commit acknowledgements)

Design notes (each is a requirement this module keeps):
  1. Rows never cross Python one by one: a blob is one Z-set (Arrow IPC with a checksum); the shuffle moves
     ``(part, src, node, step, payload)`` rows, W x nodes x steps of them per job, whatever the data size.
  2. Exact placement: the shuffle is ``repartition(W, code)`` where ``code`` is a per-destination int chosen
     on the driver so that Spark's hash partitioning (``pmod(murmur3(code, 42), W)``) sends it to partition
     ``part``; the codes are computed by Spark itself (``F.hash``), not re-implemented. Stage 0 reads the
     input from ``parallelize`` with one slice per worker, which places it without a shuffle. ``repartition`` with an
     explicit count is never coalesced by adaptive execution. Inside a task the worker id is
     ``TaskContext.partitionId()``, and every stage task refuses a blob addressed to another worker
     (dbsp_core.stagetask invariant 1), so a placement bug fails loudly instead of producing wrong data.
  3. A DataFrame pushed as input is gathered to the driver (``toArrow``): the driver is where the input log
     is, and a push is acknowledged only once logged. Outputs are small changes collected to the driver;
     ``output_df`` / ``view_df`` build DataFrames from logged data, never from the job's lineage, so Spark can
     never re-run a stage task of a finished job by re-evaluating a DataFrame.
  4. The storage directory must be visible at the same path to the driver and every executor (a local path
     in local mode, a shared mount on a cluster); stage state is under ``<storage>/stages``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import pyarrow as pa

from dbsp_core.circuit import Circuit
from dbsp_core.errors import SchemaError
from dbsp_core.shard import DEFAULT_SHARD_BITS
from dbsp_core.staged import Job, StagedPipeline
from dbsp_core.stages import BLOB_SCHEMA
from dbsp_core.stagetask import StageTask, run_stage_task
from dbsp_core.zset import ZSet

__all__ = ["SparkPipeline", "SparkJobRunner", "partition_codes"]

BLOB_DDL = "part int, src int, node int, step long, payload binary"


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


def _stage_fn(task: StageTask, fault: tuple[int, str, int] | None, fault_attempts: int,
              inline: pa.Table | None = None):
    """The mapInArrow function of one stage: gather the partition's blobs, run the stage task, yield its blobs.

    With ``inline`` (stage 0 of a small job) the blobs come with the function and the input rows are ignored.
    """

    def run(batches):
        from pyspark import TaskContext

        tc = TaskContext.get()
        worker = tc.partitionId()
        t = task
        if fault is not None and fault[0] == task.stage and fault[2] == worker and tc.attemptNumber() < fault_attempts:
            t = dataclasses.replace(task, fault=(fault[1], worker))  # tests: fail the first attempt(s)
        bs = list(batches)
        if inline is not None:
            parts = inline.column("part").to_numpy()
            table = inline.filter(pa.array(parts == worker))
        else:
            table = pa.Table.from_batches(bs) if bs else BLOB_SCHEMA.empty_table()
        out = run_stage_task(t, worker, table)
        yield from out.combine_chunks().to_batches()

    return run


class SparkJobRunner:
    """Runs a job's stage tasks as one Spark job (dbsp_core.staged.JobRunner); see the module docstring.

    ``fault`` (tests only): ``(stage, point, worker)`` makes the first ``fault_attempts`` attempts of that task
    raise at ``point`` (``"before-commit"`` or ``"after-commit"``); Spark retries a failed task when task
    retries are enabled (``local[N,F]`` with F >= 2, or ``spark.task.maxFailures`` >= 2 on a cluster).
    """

    INLINE_BYTES = 1 << 20  # stage-0 input up to this size travels inside the task (no input data source)

    def __init__(self, spark: Any, workers: int) -> None:
        from pyspark.sql import functions as F

        self.spark = spark
        self.workers = workers
        self.codes = partition_codes(spark, workers)
        self._code = F.element_at(F.array(*[F.lit(c) for c in self.codes]), F.col("part") + 1)
        self.fault: tuple[int, str, int] | None = None
        self.fault_attempts = 1

    def _route(self, df: Any) -> Any:
        """Shuffle so that a blob with ``part = p`` lands in partition ``p`` (design note 2)."""
        return df.repartition(self.workers, self._code)

    def _inputs(self, blobs: pa.Table) -> Any:
        """The stage-0 blobs as a DataFrame whose partition ``w`` holds exactly the blobs for worker ``w``.

        ``parallelize`` of W per-worker lists into W slices puts list ``w`` in partition ``w`` (one element per
        slice), so stage 0 needs no shuffle; the stage task checks the placement anyway.
        """
        per: list[list[tuple]] = [[] for _ in range(self.workers)]
        cols = [blobs.column(n).to_pylist() for n in BLOB_SCHEMA.names]  # one Python tuple per blob, not per row
        for row in zip(*cols):
            per[row[0]].append(row)
        rdd = self.spark.sparkContext.parallelize(per, self.workers).flatMap(lambda rows: rows)
        return self.spark.createDataFrame(rdd, BLOB_DDL, verifySchema=False)

    def run_job(self, job: Job) -> pa.Table:
        inline = job.inputs if job.inputs.nbytes <= self.INLINE_BYTES else None
        if inline is not None:  # W one-row partitions (range splits evenly): partition w runs worker w
            df = self.spark.range(0, self.workers, 1, self.workers)
        else:
            df = self._inputs(job.inputs)
        for task in job.tasks:
            if task.stage:
                df = self._route(df)
            df = df.mapInArrow(_stage_fn(task, self.fault, self.fault_attempts, inline if task.stage == 0 else None),
                               BLOB_DDL)
        return df.toArrow()


class SparkPipeline(StagedPipeline):
    """The durable :class:`dbsp_core.Pipeline` surface over a SparkSession: each batch of steps is one Spark job.

    Parameters
    ----------
    spark : pyspark.sql.SparkSession
        The session whose executors run the stage tasks.
    circuit : dbsp_core.Circuit
        The circuit.
    workers : int
        W: Spark partitions per stage (one per worker). Results do not depend on it.
    storage : str or os.PathLike or None
        Directory for the input log, output log and stage state; every executor must see it at the same path
        (None: a new temporary directory, for local mode).
    shard_bits, max_steps_per_job, checkpoint_interval, replay_check, output_retention, output_sync
        As for ``dbsp_core.staged.StagedPipeline``.

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
        p = SparkPipeline.open(spark, "/shared/pipe", circuit) # recover after a stop or a crash
    """

    def __init__(self, spark: Any, circuit: Circuit, workers: int = 1, storage: Any = None, *,
                 shard_bits: int = DEFAULT_SHARD_BITS, **kwargs: Any) -> None:
        from pyspark.sql import SparkSession

        if not isinstance(spark, SparkSession):
            raise TypeError(f"SparkPipeline needs a SparkSession, got {type(spark).__name__}")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"SparkPipeline: workers must be a positive int, got {workers!r}")
        self.spark = spark
        if storage is None:
            storage = tempfile.mkdtemp(prefix="dbsp-spark-")
        self._views: dict[str, tuple[int, ZSet]] = {}
        super().__init__(circuit, workers, shard_bits, storage, runner=SparkJobRunner(spark, workers), **kwargs)

    @classmethod
    def open(cls, spark: Any, path: Any, circuit: Circuit, **kwargs: Any) -> "SparkPipeline":  # type: ignore[override]
        """Recover the pipeline stored in ``path`` (workers and shard bits come from the directory)."""
        from dbsp_core.durable import read_meta
        from dbsp_core.errors import RecoveryError

        root = os.fspath(path)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"SparkPipeline.open: no storage directory {root!r}")
        try:
            meta = read_meta(root)
        except FileNotFoundError:
            raise RecoveryError(f"SparkPipeline.open: {root!r} holds no pipeline (META is missing)") from None
        return cls(spark, circuit, meta["workers"], root, shard_bits=meta["shard_bits"], **kwargs)

    # ---- input ----

    def push(self, handle: str, data: Any, weights: Any = None, *, producer: str | None = None,
             seq: int | None = None) -> Any:
        """Durably record ``data`` for the next step: a ZSet, pa.Table, RecordBatch or Spark DataFrame.

        A DataFrame is collected to the driver as Arrow (design note 3); its columns must match the input's
        names, and its types must cast safely to the input's (e.g. Spark ``string`` to ``utf8``). Invalid
        input raises and records nothing, as for the durable pipeline.
        """
        from pyspark.sql import DataFrame

        if isinstance(data, DataFrame):
            self._check_usable()
            if handle not in self._inputs:
                raise KeyError(f"push: unknown input handle {handle!r}; inputs are {sorted(self._inputs)}")
            data = _conform_arrow(data.toArrow(), self._inputs[handle], handle)
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

        The view is kept on the driver and brought up to date from the output log on each call (only new
        steps are read); it needs the output log from step 0 (no ``output_retention``).
        """
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
        return (f"SparkPipeline({self.storage!r}, workers={self.workers}, steps={self.steps}, "
                f"stages={self.plan.num_stages})")


def _conform_arrow(t: pa.Table, schema: pa.Schema, handle: str) -> pa.Table:
    """A DataFrame's Arrow table with the input's types (by name; safe casts only); SchemaError otherwise."""
    names = [n for n in t.column_names if n != "weight"] if "weight" not in schema.names else t.column_names
    if names != schema.names:
        raise SchemaError(f"push({handle!r}): DataFrame columns {t.column_names} do not match the input columns "
                          f"{schema.names}")
    target = pa.schema(list(schema) + ([pa.field("weight", pa.int64())] if len(t.column_names) > len(names) else []))
    try:
        return t.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaError(f"push({handle!r}): DataFrame types {[str(f.type) for f in t.schema]} do not cast to the "
                          f"input types {[str(f.type) for f in schema]}: {e}") from None
