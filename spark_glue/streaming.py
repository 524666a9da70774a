"""Structured Streaming into a pipeline: ``foreach_batch(pipeline)`` is a ``foreachBatch`` function whose batch id is a step.

Use::

    q = (df.writeStream.foreachBatch(spark_glue.foreach_batch(pipeline, "bids"))
         .option("checkpointLocation", ck).start())

Design notes (enforced here):
  1. Each micro-batch is pushed with ``producer=<sink id>``, ``seq=<batch id>`` and then exactly one step runs,
     so each batch is one step. The mapping batch id -> step is kept in memory (:meth:`ForeachBatch.step_of`)
     and durably in the pipeline's own output log, whose records name the (producer, seq) ranges each step
     consumed; nothing else is written anywhere.
  2. Exactly once rests on the pipeline's push dedup alone: a batch that Spark delivers again after a restart
     of the query from the same ``checkpointLocation`` is acknowledged as a duplicate and not counted again.
     If it was acknowledged but never stepped (a crash between push and step) the pipeline still holds it as
     pending input, and the step that follows the redelivery consumes it once. If it was already stepped, no
     step is run for it (found from the output log, see 3), so the batch -> step mapping stays one to one.
  3. The sink knows the last batch id it applied: in memory after its first batch, and when a sink object is
     created over a durable pipeline (after ``Pipeline.open``) from the newest of the last ``scan_limit``
     output-log steps that consumed a push of this producer. If that scan finds nothing, a redelivered batch
     is stepped anyway: the step holds no data of the duplicate, so the only cost is one extra step.
  4. A batch id below the last applied one is refused with :class:`StaleBatchError` and changes nothing.
     Spark only ever re-runs its newest batch (the one with an offset-log entry and no commit-log entry), so
     a smaller id means the query's checkpoint was rewound or replaced while the sink id stayed the same; its
     batches may hold different rows than the ones applied under those ids, so skipping them silently could
     lose or double rows. A new query should use a new sink id (the default, the query id, does this).
  5. The default sink id is ``"spark-query:<query id>"``: Spark keeps the query id in the checkpoint, so it
     is stable across restarts from the same ``checkpointLocation`` and differs between queries.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Callable

import pyarrow as pa

from dbsp_core.connectors.inputs import source_input
from dbsp_core.errors import DbspError
from dbsp_core.zset import ZSet, weight_column

__all__ = ["ForeachBatch", "StaleBatchError", "foreach_batch"]


class StaleBatchError(DbspError):
    """A micro-batch id below the last one this sink applied: the query's checkpoint was rewound or replaced."""


class ForeachBatch:
    """The ``foreachBatch`` function made by :func:`foreach_batch`; callable as ``(batch_df, batch_id)``.

    Attributes
    ----------
    stats : dict
        ``batches`` applied as a new step, ``redelivered`` batches acknowledged as already applied (no step),
        ``pending`` redelivered batches that were pushed but not stepped before (stepped now).
    """

    def __init__(self, pipeline: Any, handle: str | None = None, *, producer: str | None = None,
                 on_output: Callable[[int, int | None, dict[str, ZSet]], Any] | None = None,
                 scan_limit: int = 64) -> None:
        handle, schema = source_input("foreach_batch", pipeline, handle, durable=False)
        if producer is not None and (not isinstance(producer, str) or not producer):
            raise TypeError(f"foreach_batch: producer must be a non-empty str, got {producer!r}")
        self.pipeline = pipeline
        self.handle = handle
        self.schema: pa.Schema = schema
        self.producer = producer
        self.on_output = on_output
        self.scan_limit = scan_limit
        # a pipeline with a SparkSession (SparkPipeline) takes the DataFrame itself; the embedded ones take Arrow
        self.to_arrow = getattr(pipeline, "spark", None) is None
        self._last: int | None = None
        self._scanned = False
        self._steps: dict[int, int | None] = {}
        self._lock = threading.Lock()
        self.stats = {"batches": 0, "redelivered": 0, "pending": 0}

    @property
    def last_batch(self) -> int | None:
        """The last batch id this sink applied (None before the first, if the output log names none)."""
        return self._last

    @property
    def batch_steps(self) -> dict[int, int | None]:
        """``{batch id: step}`` for every batch this sink object applied or found in the output log."""
        return dict(self._steps)

    def step_of(self, batch_id: int) -> int | None:
        """The step a batch applied through this sink object became (None if unknown to it)."""
        return self._steps.get(batch_id)

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        with self._lock:  # one query calls its sink sequentially; two queries must not share a sink object
            self._apply(batch_df, int(batch_id))

    # ---- internals ----

    def _apply(self, batch_df: Any, batch_id: int) -> None:
        if self.producer is None:
            self.producer = _query_producer(batch_df)
        if not self._scanned:
            self._scanned = True
            self._last, found = _last_applied(self.pipeline, self.producer, self.scan_limit)
            self._steps.update(found)
        if self._last is not None and batch_id < self._last:
            raise StaleBatchError(
                f"foreach_batch({self.handle!r}, producer={self.producer!r}): batch {batch_id} is below the last "
                f"applied batch {self._last}; Spark only re-runs its newest batch, so this query's checkpoint was "
                f"rewound or replaced. Restore the checkpoint, or give the new query a new producer id")
        if batch_id == self._last:
            self.stats["redelivered"] += 1  # design note 2: applied before, so no push and no step
            return
        data = self._data(batch_df)
        ack = self.pipeline.push(self.handle, data, producer=self.producer, seq=batch_id)
        duplicate = bool(getattr(ack, "duplicate", False))
        out = self.pipeline.step()
        step = None if duplicate else getattr(ack, "step", None)
        if step is None:
            steps = getattr(self.pipeline, "output_steps", None)
            step = steps.stop - 1 if steps is not None and len(steps) else None
        self.stats["pending" if duplicate else "batches"] += 1
        self._steps[batch_id] = step
        self._last = batch_id
        if self.on_output is not None:
            self.on_output(batch_id, step, out)

    def _data(self, batch_df: Any) -> Any:
        if not self.to_arrow:
            return batch_df
        t = batch_df.toArrow()
        names = list(self.schema.names)
        wname = weight_column(self.schema)
        if wname in t.schema.names:
            names.append(wname)  # Z-set form: data columns + integer weights
        if all(n in t.schema.names for n in names):
            t = t.select(names)
            want = pa.schema([self.schema.field(n) if n in self.schema.names else t.schema.field(n) for n in names])
            if not t.schema.equals(want):
                t = t.cast(want)  # Spark's nullability and widths; the push still checks the columns
        return t


def foreach_batch(pipeline: Any, handle: str | None = None, *, producer: str | None = None,
                  on_output: Callable[[int, int | None, dict[str, ZSet]], Any] | None = None,
                  scan_limit: int = 64) -> ForeachBatch:
    """A ``foreachBatch`` function that applies each micro-batch to ``pipeline`` as one step, exactly once.

    Parameters
    ----------
    pipeline
        A durable ``dbsp_core.Pipeline(..., storage=dir)`` or a ``spark_glue.SparkPipeline``; anything with
        ``push(handle, data, producer=, seq=)`` and ``step()``. With an in-memory pipeline a redelivery after a
        failed batch in the same process is still counted once, but a process crash loses the pipeline.
    handle : str, optional
        The input the batches go to (default: the circuit's only input). Batch columns are selected by the
        input's names; an extra integer ``weight`` column gives the rows' weights (deletes are weight -1).
    producer : str, optional
        The sink id used for dedup (default: ``"spark-query:<query id>"``, stable across restarts of the query
        from the same checkpointLocation). Two queries into one pipeline need two ids.
    on_output : callable, optional
        Called as ``on_output(batch_id, step, outputs)`` after each step the sink runs. A batch that is
        delivered again after it was applied runs no step and is not passed again, so after a crash a consumer
        that must see every step once reads the pipeline's output log (``read_output``) by step instead.
    scan_limit : int
        How many output-log steps a new sink object reads back to find the last batch it applied.

    Returns
    -------
    ForeachBatch
        Pass it to ``writeStream.foreachBatch``; ``.step_of(batch_id)`` and ``.stats`` report what it did.

    Examples
    --------
    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp, spark_glue
    >>> c = dbsp.Circuit()
    >>> s = c.input("s", pa.schema([("k", pa.int64())]))
    >>> c.output("n", s.group_by("k").agg(n=dbsp.count()))
    >>> p = dbsp.Pipeline(c, storage=tempfile.mkdtemp())
    >>> sink = spark_glue.foreach_batch(p, producer="q1")
    >>> class Batch:  # stands in for a Spark DataFrame here; Spark passes the real one
    ...     def __init__(self, ks): self.t = pa.table({"k": ks})
    ...     def toArrow(self): return self.t
    >>> sink(Batch([1, 1, 2]), 0); sink(Batch([2]), 1); sink(Batch([2]), 1)   # batch 1 delivered twice
    >>> sink.stats, sink.step_of(1)
    ({'batches': 2, 'redelivered': 1, 'pending': 0}, 1)
    >>> [sorted(z.to_dict().items()) for _, z in p.read_output("n")]
    [[((1, 2), 1), ((2, 1), 1)], [((2, 1), -1), ((2, 2), 1)]]
    >>> p.close()
    """
    return ForeachBatch(pipeline, handle, producer=producer, on_output=on_output, scan_limit=scan_limit)


_SPARK_TEMP = re.compile(r"^\.?\.\d+\.[0-9a-f-]{36}\.tmp(\.crc)?$")


def tidy_checkpoint(location: str) -> list[str]:
    """Remove the temporary files a killed query left in its checkpoint's ``offsets`` and ``commits`` logs.

    Spark writes each log entry to ``.<batch>.<uuid>.tmp`` and renames it; a driver killed between the two leaves
    the temporary file, which Spark never reads. Recent Spark releases (SPARK-53103; seen with 4.3) refuse to
    start a query whose offset log has no entry yet when that directory is not empty
    (``STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY``), so a kill during the very first batch's offset write would
    lock the query out of its checkpoint. Call this
    before ``writeStream...start()`` on a restart; it removes only files named like those temporaries (never an
    entry, which is named by its batch number) and returns the paths it removed. A local or mounted path only.
    """
    if not isinstance(location, str) or not location:
        raise DbspError("tidy_checkpoint: location must be a non-empty path string")
    if location.startswith("file:"):
        location = location[len("file:"):]
    removed = []
    for log in ("offsets", "commits"):
        d = os.path.join(location, log)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if _SPARK_TEMP.match(name):
                os.remove(os.path.join(d, name))
                removed.append(os.path.join(d, name))
    return removed


def _query_producer(batch_df: Any) -> str:
    """``spark-query:<id>`` of the query running this batch (Spark sets it as a local property of its thread)."""
    qid = None
    try:
        qid = batch_df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # not a Spark DataFrame, or no property on this thread
        qid = None
    if not qid:
        raise ValueError("foreach_batch: cannot read the streaming query id here; pass producer=<stable sink id>")
    return f"spark-query:{qid}"


def _last_applied(pipeline: Any, producer: str, limit: int) -> tuple[int | None, dict[int, int]]:
    """The highest batch id of ``producer`` in the newest of the last ``limit`` output-log steps that hold one."""
    steps = getattr(pipeline, "output_steps", None)
    inputs_of = getattr(pipeline, "output_inputs", None)
    if steps is None or inputs_of is None:
        return None, {}
    for step in range(steps.stop - 1, max(steps.start, steps.stop - limit) - 1, -1):
        mine = [r for r in inputs_of(step) if r.get("producer") == producer and r.get("last_seq") is not None]
        if mine:
            found: dict[int, int] = {}
            for r in mine:
                for b in range(r["first_seq"], r["last_seq"] + 1):
                    found[b] = step
            return max(found), found
    return None, {}
