"""The engine inside a user's own ``mapInArrow`` / ``mapInPandas`` / ``applyInPandas`` functions on Spark executors: route rows to partitions by the engine's shard map, build Z-sets from the batches, and keep each partition's state in a durable embedded pipeline, applied exactly once across task retries.

Use (the README has a complete example)::

    routed = udf.shard_partition(df, ["auction"], workers=4)     # partition w = the rows of worker w's shards
    def fn(batches):                                            # runs on the Spark executors
        with udf.partition_pipeline(circuit, "/shared/state") as p:   # this partition's state, recovered
            out = udf.apply_once(p, {"bids": udf.as_table(batches, schema)}, producer="bids", seq=run)
            yield from out["totals"].to_arrow().to_batches()
    routed.mapInArrow(fn, "auction long, total long, weight long")

Design notes (each is a requirement this module keeps):
  1. Routing is the engine's: a row goes to partition ``ShardMap(W, shard_bits).worker_of(shard)`` of its key
     hash's shard (dbsp_core.layout), placed by ``repartition(W, code)`` with per-partition codes Spark's own
     hash sends to that partition (spark_glue.pipeline.partition_codes); so the same key always meets the same
     partition's state, job after job, and Spark's adaptive execution never coalesces the W partitions.
  2. A partition's state is a durable ``dbsp_core.Pipeline`` in ``<root>/part-<partition>``, which every
     executor must see at the same path (a shared mount on a cluster), opened (recovered) by the task and
     closed with a checkpoint when the task's function ends.
  3. Exactly once across task retries rests on the pipeline's ``(producer, seq)`` dedup: ``apply_once`` pushes
     one whole partition's input per ``(producer, seq)`` (a retry's rows may arrive in another order or batch
     split, so batches are never the unit), steps once, and when a retried task finds its input already
     recorded it returns the logged output of the step that consumed it instead of stepping again. ``seq``
     must identify the job's input (a run number, a micro-batch id) and grow from 0 per producer.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa

from dbsp_core.errors import DbspError
from dbsp_core.storage.remote import Remote, is_remote
from dbsp_core.circuit import Circuit
from dbsp_core.layout import DEFAULT_SHARD_BITS, ShardMap
from dbsp_core.runtime import Pipeline
from dbsp_core.zset import ZSet
from spark_glue.check import check_executors
from spark_glue.pipeline import partition_codes

__all__ = ["apply_once", "as_table", "partition_pipeline", "shard_partition", "worker_of"]

CODE_COLUMN = "__dbsp_code"


def worker_of(table: pa.Table | pa.RecordBatch, key: list[str], shard_map: ShardMap) -> np.ndarray:
    """The worker of every row of ``table`` by the shard of its ``key`` columns' hash (the exchange's routing).

    >>> import pyarrow as pa
    >>> from dbsp_core.layout import ShardMap
    >>> worker_of(pa.table({"k": [1, 2, 3, 4, 5]}), ["k"], ShardMap(2)).tolist()
    [1, 1, 1, 0, 1]
    """
    t = table.select(key)
    t = pa.Table.from_batches([t]) if isinstance(t, pa.RecordBatch) else t
    h = ZSet.from_arrow(t).hash(key)
    return shard_map.part_of_shard[shard_map.shard_of_hash(h)]


def _code_fn(key: list[str], workers: int, shard_bits: int, codes: list[int]) -> Any:
    smap = ShardMap(workers, shard_bits)
    code = np.asarray(codes, dtype=np.int32)

    def add_code(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            yield b.append_column(CODE_COLUMN, pa.array(code[worker_of(b, key, smap)], pa.int32()))

    return add_code


def shard_partition(df: Any, key: list[str], workers: int, shard_bits: int = DEFAULT_SHARD_BITS) -> Any:
    """``df`` in ``workers`` partitions, partition ``w`` holding exactly the rows whose ``key`` the layout
    ``ShardMap(workers, shard_bits)`` gives worker ``w`` (design note 1). Checks the Spark executors first."""
    from pyspark.sql.types import IntegerType, StructField, StructType

    spark = df.sparkSession
    check_executors(spark)
    codes = partition_codes(spark, workers)
    schema = StructType(list(df.schema.fields) + [StructField(CODE_COLUMN, IntegerType(), False)])
    return (df.mapInArrow(_code_fn(list(key), workers, shard_bits, codes), schema)
            .repartition(workers, CODE_COLUMN).drop(CODE_COLUMN))


def as_table(batches: Iterable[Any], schema: pa.Schema) -> pa.Table:
    """All of a partition's batches (Arrow record batches, or pandas DataFrames from mapInPandas /
    applyInPandas) as one table with ``schema``'s columns and types."""
    parts = []
    for b in batches:
        t = pa.Table.from_pandas(b, preserve_index=False) if not isinstance(b, (pa.RecordBatch, pa.Table)) else b
        t = pa.Table.from_batches([t]) if isinstance(t, pa.RecordBatch) else t
        names = list(schema.names) + (["weight"] if "weight" in t.column_names and "weight" not in schema.names
                                      else [])
        target = pa.schema(list(schema) + [pa.field("weight", pa.int64())] * (len(names) - len(schema.names)))
        parts.append(t.select(names).cast(target))
    return pa.concat_tables(parts) if parts else schema.empty_table()


@contextlib.contextmanager
def partition_pipeline(circuit: Circuit, root: str | os.PathLike, *, partition: int | None = None,
                       workers: int = 1, **kwargs: Any) -> Iterator[Pipeline]:
    """This task's partition's durable pipeline, ``<root>/part-<partition>`` (created or recovered), closed with
    a checkpoint at the end (design note 2). ``partition`` defaults to the running task's partition id."""
    if partition is None:
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc is None:
            raise RuntimeError("partition_pipeline: not inside a Spark task; pass partition=")
        partition = tc.partitionId()
    if is_remote(root):
        raise DbspError(f"partition_pipeline: root must be a directory every task can reach; an object store "
                        f"({Remote.of(root, '.').shown}) is not supported here yet (give a shared directory, or use "
                        f"SparkPipeline, whose storage may be an object store)")
    kwargs.setdefault("checkpoint_interval", None)
    p = Pipeline(circuit, workers=workers, storage=os.path.join(os.fspath(root), f"part-{partition:05d}"), **kwargs)
    try:
        yield p
    except BaseException:
        p.close(checkpoint=False)
        raise
    else:
        p.close()


def apply_once(p: Pipeline, inputs: dict[str, Any], producer: str, seq: int) -> dict[str, ZSet]:
    """Push ``inputs`` (``{handle: data}``) as ``(producer/handle, seq)`` and run one step; returns
    ``{output: change}``. If this input was recorded before (a retried task), returns the logged change of the
    step that consumed it, or steps once if it was recorded but not yet stepped (design note 3)."""
    acks = [p.push(h, data, producer=f"{producer}/{h}", seq=seq) for h, data in inputs.items()]
    if acks and all(a.duplicate for a in acks):
        wanted = {f"{producer}/{h}" for h in inputs}
        steps = p.output_steps
        for step in range(steps.stop - 1, steps.start - 1, -1):
            got = {r["producer"] for r in p.output_inputs(step)
                   if r.get("first_seq") is not None and r["first_seq"] <= seq <= r["last_seq"]}
            if got & wanted:
                return {name: next(iter(p.read_output(name, step)))[1] for name in p.circuit.outputs}
    return p.step()
