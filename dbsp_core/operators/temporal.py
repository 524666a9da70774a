"""Views that depend on the step's wall-clock ``now``: ``within_last(stream, column, seconds)`` keeps the rows whose event time lies in the last ``seconds`` before the step's now, retracting them as now moves on; ``filter_now(stream, predicate)`` filters by any expression built from now.

Invariants (enforced here):
  1. After every step, integral(output) == {rows r of integral(input) with now - window <= r[column] <= now},
     where now is the step's determinant (``ctx.now_ns``): logged with the step's input division by the durable
     pipeline, so a replayed step sees the same now and emits the same change. The in-memory pipeline has no
     log and uses the wall clock.
  2. The durable pipeline makes now non-decreasing across steps and restarts, so a row older than the window
     never re-enters it; the state drops such rows once their retraction is emitted, and holds only the rows
     of the window and of the future.
  3. The state is a trace of the held rows (window and future) indexed by time bucket, checkpointed like any
     other state; the previous step's now comes from the step context (``ctx.prev_now_ns``, logged like now).
     A step reads only the buckets the window's ends crossed, so it costs O(change + rows entering or leaving
     the window). The operator is linear in its input, so each worker handles its own rows, and its output is
     not partitioned: the held rows are grouped by time bucket, so a layout change may move a row to another
     worker than its input's key would (any placement of a linear operator's state gives the same sum).
  4. With ``stored`` set (operators/pruned.py, by the pass of dbsp_core/runtime/prune.py), ``within_last`` holds only
     the kept columns (its time column among them) and pads its output with nulls to its schema.
  5. ``filter_now``: after every step, integral(output) == filter(integral(input), predicate(now)). Its state is
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
from dbsp_core.operators.base import Operator, check_columns, concat, conform, empty
from dbsp_core.operators.aggregate import lookup_exact
from dbsp_core.operators.pruned import RowsStored, pad, project
from dbsp_core.trace import Trace

if TYPE_CHECKING:
    from dbsp_core.circuit import Stream
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet

_UNIT_NS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
_MAX_WINDOW_NS = 2**62  # the window's low end (now minus the window) stays inside int64 nanoseconds


def _stream(stream: object, where: str) -> "Stream":
    """``stream``, checked by its circuit to be a Stream (operators sit below dbsp_core.circuit and never import it)."""
    circuit = getattr(stream, "circuit", None)
    if not callable(getattr(circuit, "check_stream", None)):
        raise TypeError(f"{where}: expected a Stream, got {type(stream).__name__}")
    return circuit.check_stream(stream, where)


class WithinLast(Operator):
    """A circuit node keeping the rows whose ``column`` is within the last ``window_ns`` of the step's now."""

    kind = "within_last"
    stored: "RowsStored | None" = None  # invariant 4: the columns the state keeps (None: all)

    def __init__(self, node: int, schema: pa.Schema, column: str, window_ns: int, unit_ns: int) -> None:
        super().__init__((node,), schema, None)  # invariant 3: state grouped by bucket, not by the input's key
        self.column = column
        self.state_format = 3  # part of the circuit fingerprint: older state (with a clock Z-set) is refused
        self.window_ns = window_ns
        self.unit_ns = unit_ns

    def keep(self, names: "list[str] | None") -> None:
        """Invariant 4: keep only columns ``names`` (the time column among them; None: every column); set before the
        instances are built (dbsp_core/runtime/prune.py)."""
        if names is None:
            self.__dict__.pop("stored", None)
        else:
            self.stored = RowsStored(self.schema, names)

    def instance(self) -> "_WithinLastState":
        return _WithinLastState(self)


class _WithinLastState:
    """Invariants 1-3 at a cost that follows the rows entering and leaving the window, not the rows inside it.

    ``held`` is the integral of the input minus the rows that left the window for good (event time below the
    window's low end), indexed by a time bucket (``window / 64`` wide) so a step reads only the buckets that
    the window's two ends crossed since the previous step's now (``ctx.prev_now_ns``). A step emits: the change's rows inside the window; minus the held rows that
    the low end passed; plus the held future rows that the high end reached.
    """

    MAX_BUCKETS = 4096  # a longer jump of now (a long pause) reads the whole state once instead

    def __init__(self, op: WithinLast) -> None:
        self.op = op
        self.stored = op.stored  # invariant 4, as it was when this instance was built
        self.schema = op.schema if op.stored is None else op.stored.schema  # the rows held and emitted
        self.bucket_ns = max(1, op.window_ns // 64)
        self.hschema = pa.schema(list(self.schema) + [pa.field("__bucket", pa.int64())])
        self.held = Trace(self.hschema, ("__bucket",))

    def traces(self) -> dict[str, "Trace"]:
        """The operator's keyed state, by name."""
        return {"held": self.held}

    def _times_ns(self, data: pa.Table) -> np.ndarray:
        col = data.column(self.op.column)
        raw = pc.cast(col, pa.int64()) if pat.is_timestamp(col.type) else col
        t = np.asarray(pc.fill_null(raw, np.iinfo(np.int64).min).to_numpy(zero_copy_only=False), dtype=np.int64)
        unit = self.op.unit_ns
        if unit == 1:
            return t
        lo, hi = np.iinfo(np.int64).min // unit, np.iinfo(np.int64).max // unit
        return np.clip(t, lo, hi) * unit  # nulls (and times beyond the int64 ns range) saturate

    def _rows(self, data: pa.Table, weights: np.ndarray, mask: np.ndarray, sign: int) -> "ZSet":
        from dbsp_core.zset import ZSet

        if not mask.any():
            return empty(self.schema)
        rows = data.filter(pa.array(mask)).select(self.schema.names)
        return ZSet._make(rows, np.asarray(weights[mask], dtype=np.int64) * sign)

    def _held_between(self, ranges: list[tuple[int, int]]) -> "ZSet":
        """The held rows (consolidated) of every bucket meeting the time ranges [a, b] (may hold more)."""
        from dbsp_core.zset import ZSet

        spans = [(a // self.bucket_ns, b // self.bucket_ns) for a, b in ranges if a <= b]
        n = sum(hi - lo + 1 for lo, hi in spans)  # counted before anything is allocated: now may jump by years
        if n == 0:
            return empty(self.hschema)
        if n > self.MAX_BUCKETS:
            return self.held.consolidated().zset
        ids = [np.arange(lo, hi + 1, dtype=np.int64) for lo, hi in spans]
        keys = np.unique(np.concatenate(ids))
        hashes = np.unique(ZSet.from_arrow(pa.table({"__bucket": keys})).hash(["__bucket"]))
        return lookup_exact(self.held, hashes, self.hschema).consolidate()

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        from dbsp_core.zset import ZSet

        now = ctx.now_ns if ctx.now_ns is not None else time.time_ns()
        prev = ctx.prev_now_ns
        if prev is not None:
            now = max(now, prev)  # the window never moves back (the driver's now never does)
        win = self.op.window_ns
        lo = now - win
        out: list[ZSet] = []
        # held rows that the window's ends passed since the previous step (before this step's change is held)
        if prev is None:
            old = self.held.consolidated().zset
            prev_lo, prev_hi = np.iinfo(np.int64).min, np.iinfo(np.int64).min
        else:
            old = self._held_between([(prev - win, lo - 1), (prev + 1, now)])
            prev_lo, prev_hi = prev - win, prev
        if old.num_rows:
            t = self._times_ns(old.data)
            was_in = (t >= prev_lo) & (t <= prev_hi)
            is_in = (t >= lo) & (t <= now)
            out.append(self._rows(old.data, old.weights, was_in & ~is_in, -1))
            out.append(self._rows(old.data, old.weights, is_in & ~was_in, 1))
            gone = t < lo  # invariant 2: these can never come back; drop them from the state
            if gone.any():
                rows = old.data.filter(pa.array(gone))
                self.held.insert(ZSet._make(rows, -np.asarray(old.weights[gone], dtype=np.int64))
                                 .index_by(["__bucket"]))
        z = inputs[0]
        if z.num_rows:
            z = conform(z, self.op.schema)
            if self.stored is not None:
                z = project(z, self.stored.names)
            t = self._times_ns(z.data)
            out.append(self._rows(z.data, z.weights, (t >= lo) & (t <= now), 1))
            keep = t >= lo
            if keep.any():
                buckets = pa.array(np.floor_divide(t[keep], self.bucket_ns))
                rows = z.data.filter(pa.array(keep)).append_column("__bucket", buckets)
                self.held.insert(ZSet._make(rows, np.asarray(z.weights[keep], dtype=np.int64))
                                 .index_by(["__bucket"]))
        if self.stored is not None:
            return pad(concat(out, self.schema), self.op.schema)
        return concat(out, self.schema)


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
    _stream(stream, "within_last")
    where = stream._where("within_last")
    check_columns(stream.schema, [column], where)
    typ = stream.schema.field(column).type
    if not (pat.is_signed_integer(typ) or pat.is_timestamp(typ)):
        raise SchemaError(f"{where}: column {column!r} must be a timestamp or a signed integer time, got {typ}")
    if pat.is_timestamp(typ):
        unit = typ.unit
    if unit not in _UNIT_NS:
        raise ValueError(f"{where}: unit must be one of {sorted(_UNIT_NS)}, got {unit!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{where}: seconds must be a positive number, got {seconds!r}")
    if not seconds * 10**9 <= _MAX_WINDOW_NS:
        raise ValueError(f"{where}: a window of {seconds!r} s is longer than the limit of {_MAX_WINDOW_NS // 10**9} s "
                         f"(about 146 years: now minus the window must be a time in nanoseconds in int64)")
    op = WithinLast(stream.node_id, stream.schema, column, int(seconds * 10**9), _UNIT_NS[unit])
    return stream.circuit.add_operator(op)


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

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        from dbsp_core.zset import ZSet

        now = ctx.now_ns if ctx.now_ns is not None else time.time_ns()
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
    _stream(stream, "filter_now")
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
    return stream.circuit.add_operator(op)
