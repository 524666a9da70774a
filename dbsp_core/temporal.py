"""Views that depend on the step's wall-clock ``now``: ``within_last(stream, column, seconds)`` keeps the rows whose event time lies in the last ``seconds`` before the step's now, retracting them as now moves on; ``filter_now(stream, predicate)`` filters by any expression built from now.

Invariants (enforced here):
  1. After every step, integral(output) == {rows r of integral(input) with now - window <= r[column] <= now},
     where now is the step's determinant (``ctx.now_ns``): logged with the step's input division by the durable
     pipeline, so a replayed step sees the same now and emits the same change. The in-memory pipeline has no
     log and uses the wall clock.
  2. The durable pipeline makes now non-decreasing across steps and restarts, so a row older than the window
     never re-enters it; the state drops such rows once their retraction is emitted, and holds only the rows
     of the window and of the future.
  3. The state is two Z-sets per worker (pending rows and the current window), checkpointed like any other
     Z-set state; the operator is linear in its input, so each worker handles its own rows.
  4. ``filter_now``: after every step, integral(output) == filter(integral(input), predicate(now)). Its state is
     the whole integral of its input (a row may come back into the filter), so a step costs O(state);
     prefer ``within_last`` for sliding windows.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from dbsp_core.errors import SchemaError
from dbsp_core.operators.base import Operator, check_columns, conform, empty

if TYPE_CHECKING:
    from dbsp_core.circuit import Stream
    from dbsp_core.runtime import WorkerContext
    from dbsp_core.zset import ZSet

_UNIT_NS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}


class WithinLast(Operator):
    """A circuit node keeping the rows whose ``column`` is within the last ``window_ns`` of the step's now."""

    kind = "within_last"

    def __init__(self, node: int, schema: pa.Schema, partitioning, column: str, window_ns: int, unit_ns: int
                 ) -> None:
        super().__init__((node,), schema, partitioning)
        self.column = column
        self.window_ns = window_ns
        self.unit_ns = unit_ns

    def instance(self) -> "_WithinLastState":
        return _WithinLastState(self)


class _WithinLastState:
    def __init__(self, op: WithinLast) -> None:
        self.op = op
        self.schema = op.schema
        self.pending = empty(op.schema)  # integral of the input, minus rows that left the window for good
        self.window = empty(op.schema)   # integral of the output so far

    def _times_ns(self, z: "ZSet") -> np.ndarray:
        col = z.data.column(self.op.column)
        if pat.is_timestamp(col.type):
            col = pc.cast(col, pa.int64())
        t = col.to_numpy(zero_copy_only=False)
        if z.data.column(self.op.column).null_count:
            t = np.where(pc.is_null(z.data.column(self.op.column)).to_numpy(zero_copy_only=False), np.iinfo(np.int64).min,
                         t)
        return t.astype(np.int64) * self.op.unit_ns

    def step(self, inputs: list["ZSet"], ctx: "WorkerContext") -> "ZSet":
        now = getattr(ctx, "now_ns", None)
        if now is None:
            now = time.time_ns()
        z = inputs[0]
        if z.num_rows:
            self.pending = (self.pending + conform(z, self.schema)).consolidate()
        if self.pending.num_rows == 0 and self.window.num_rows == 0:
            return empty(self.schema)
        t = self._times_ns(self.pending)
        lo = now - self.op.window_ns
        inside = (t >= lo) & (t <= now)
        new = self.pending.data.filter(pa.array(inside))
        from dbsp_core.zset import ZSet

        new_window = ZSet._make(new, np.array(self.pending.weights[inside], dtype=np.int64))
        out = new_window - self.window
        self.window = new_window
        keep = t >= lo  # invariant 2: older rows can never come back
        if not keep.all():
            self.pending = ZSet._make(self.pending.data.filter(pa.array(keep)),
                                      np.array(self.pending.weights[keep], dtype=np.int64))
        return out


def within_last(stream: "Stream", column: str, seconds: float, unit: str = "s") -> "Stream":
    """The rows of ``stream`` whose event time ``column`` lies in ``[now - seconds, now]`` at each step.

    ``column`` is a timestamp column, or an integer column counting ``unit`` (``"s"``, ``"ms"``, ``"us"``,
    ``"ns"``) since the Unix epoch. ``now`` is the step's logged wall-clock time, so recovery replays it exactly.

    Examples
    --------
    >>> import time, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("id", pa.int64()), ("ts", pa.int64())]))
    >>> c.output("last_hour", within_last(bids, "ts", 3600))
    >>> p = dbsp.Pipeline(c)
    >>> now = int(time.time())
    >>> p.push("bids", pa.table({"id": [1, 2], "ts": [now - 10, now - 7200]}))
    >>> [row[0] for row in p.step()["last_hour"].to_dict()]
    [1]
    """
    from dbsp_core.circuit import Stream

    if not isinstance(stream, Stream):
        raise TypeError(f"within_last: expected a Stream, got {type(stream).__name__}")
    where = stream._where("within_last")
    check_columns(stream.schema, [column], where)
    typ = stream.schema.field(column).type
    if not (pat.is_integer(typ) or pat.is_timestamp(typ)):
        raise SchemaError(f"{where}: column {column!r} must be a timestamp or an integer time, got {typ}")
    if pat.is_timestamp(typ):
        unit = typ.unit
    if unit not in _UNIT_NS:
        raise ValueError(f"{where}: unit must be one of {sorted(_UNIT_NS)}, got {unit!r}")
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{where}: seconds must be a positive number, got {seconds!r}")
    op = WithinLast(stream.node_id, stream.schema, stream.op.partitioning, column, int(seconds * 10**9),
                    _UNIT_NS[unit])
    return stream.circuit._add(op)


class FilterNow(Operator):
    """A circuit node filtering the integral of its input by ``predicate(now_ns)`` at every step."""

    kind = "filter_now"

    def __init__(self, node: int, schema: pa.Schema, partitioning, predicate) -> None:
        super().__init__((node,), schema, partitioning)
        self.predicate = predicate

    def instance(self) -> "_FilterNowState":
        return _FilterNowState(self)


class _FilterNowState:
    def __init__(self, op: FilterNow) -> None:
        self.op = op
        self.schema = op.schema
        self.acc = empty(op.schema)   # integral of the input
        self.shown = empty(op.schema)  # integral of the output so far

    def step(self, inputs: list["ZSet"], ctx: "WorkerContext") -> "ZSet":
        from dbsp_core.zset import ZSet

        now = getattr(ctx, "now_ns", None)
        if now is None:
            now = time.time_ns()
        z = inputs[0]
        if z.num_rows:
            self.acc = (self.acc + conform(z, self.schema)).consolidate()
        if self.acc.num_rows == 0 and self.shown.num_rows == 0:
            return empty(self.schema)
        ds = self.acc.data
        sel = _evaluate(ds, self.op.predicate(now))
        new = ZSet._make(ds.filter(pa.array(sel)), np.array(self.acc.weights[sel], dtype=np.int64))
        out = new - self.shown
        self.shown = new
        return out


def _evaluate(table: pa.Table, expr: pc.Expression) -> np.ndarray:
    """A boolean numpy mask: rows of ``table`` where ``expr`` is true (null counts as false)."""
    idx = pa.array(np.arange(table.num_rows, dtype=np.int64))
    t = table.append_column("__dbsp_row", idx)
    kept = t.filter(expr).column("__dbsp_row").to_numpy(zero_copy_only=False)
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[kept] = True
    return mask


def filter_now(stream: "Stream", predicate) -> "Stream":
    """The rows of ``stream`` for which ``predicate(now_ns)`` (a pyarrow compute expression) holds at each step.

    ``now_ns`` is the step's logged wall-clock time in nanoseconds, so recovery replays the filter exactly.

    Examples
    --------
    >>> import time, pyarrow as pa, pyarrow.compute as pc, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> ev = c.input("ev", pa.schema([("id", pa.int64()), ("due_ns", pa.int64())]))
    >>> c.output("due", filter_now(ev, lambda now: pc.field("due_ns") <= now))
    >>> p = dbsp.Pipeline(c)
    >>> p.push("ev", pa.table({"id": [1, 2], "due_ns": [0, 2**62]}))
    >>> [row[0] for row in p.step()["due"].to_dict()]
    [1]
    """
    from dbsp_core.circuit import Stream

    if not isinstance(stream, Stream):
        raise TypeError(f"filter_now: expected a Stream, got {type(stream).__name__}")
    if not callable(predicate):
        raise TypeError(f"filter_now: predicate must be a callable now_ns -> pyarrow expression, got {predicate!r}")
    where = stream._where("filter_now")
    probe = predicate(time.time_ns())
    if not isinstance(probe, pc.Expression):
        raise TypeError(f"{where}: predicate(now) must return a pyarrow compute expression, got "
                        f"{type(probe).__name__}")
    try:  # validate the columns and types once, on an empty table
        pa.Table.from_batches([], schema=stream.schema).filter(probe)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as e:
        raise SchemaError(f"{where}: predicate does not apply to columns {stream.schema.names}: {e}") from e
    op = FilterNow(stream.node_id, stream.schema, stream.op.partitioning, predicate)
    return stream.circuit._add(op)
