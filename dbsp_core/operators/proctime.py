"""Processing-time tumbling windows: every row gets the window of the step in which it arrives, from the step's logged now (``ctx.now_ns``, the same on replay), and a deletion retracts the copies of its row that arrived last.

Invariants:
  1. A step whose now is N nanoseconds (``ctx.now_ns``: logged with the step's input division, identical when the
     step is replayed, never decreasing) has the window ``start = floor(N / u / size) * size`` and
     ``end = start + size``, in the output columns' unit u (``timestamp[unit]``).
  2. Each copy of a row carries the window of the step in which it arrived. A step's change of row r by d
     copies first cancels up to |d| of r's stored copies of the opposite sign, those of the latest windows
     first (a deletion retracts the copies that arrived last); the rest become copies in the step's window
     (negative ones if more copies are deleted than were inserted, which a later insertion cancels first). So
     for every row the output integral's weights over all windows add up to the input integral's weight, and
     an append-only input is windowed row by row.
  3. The state is two traces keyed by the whole input row (the operator's exchange key): ``held``, the positive
     copies with their windows, and ``owed``, the negative ones. A step looks up its insertions in ``owed``
     (empty unless rows were deleted before being inserted) and its deletions in ``held``, so an append-only
     step costs O(change) and no lookup into a large trace.
  4. Cleanup: a row whose time column lies below its lineage bound (the input's event time, time/lineage.py) can be
     neither inserted nor deleted any more (its change would be late), so its copies leave both traces
     (time/cleanup.py: the time column is a key column of both). Without event time the state is the input's
     integral, each row with the windows of its copies.
  5. Lineage: an output row is a changed row (insertion or retraction of one of its copies) with a window, so
     the input columns keep their lineage; the window columns get none (they follow now, not event time).
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dbsp_core.operators.aggregate import lookup_exact
from dbsp_core.operators.base import (Operator, check_new_columns, concat, conform, empty, make, run_starts,
                                      sort_order)
from dbsp_core.time.cleanup import prune
from dbsp_core.time.lineage import input_times
from dbsp_core.trace import Trace, unique_sorted
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.circuit import Stream
    from dbsp_core.operators.context import StepContext

UNIT_NS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
_TAG = "__dbsp_tag"


class ProcTumble(Operator):
    """``stream.proc_tumble(size)``: each row with the processing-time window of its arrival (invariants 1, 2)."""

    kind = "proc_tumble"
    in_times: tuple = ()  # time lineage of the input, set by the circuit when there is one (dbsp_core.time)

    def __init__(self, node: int, in_schema: pa.Schema, size: int, unit: str, start: str, end: str, where: str
                 ) -> None:
        if unit not in UNIT_NS:
            raise ValueError(f"{where}: unit must be one of {sorted(UNIT_NS)}, got {unit!r}")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
            raise ValueError(f"{where}: size must be a positive int (units of {unit!r}), got {size!r}")
        check_new_columns(in_schema, start, end, where, "window")
        typ = pa.timestamp(unit)
        key = tuple(in_schema.names)
        super().__init__((node,), pa.schema(list(in_schema) + [pa.field(start, typ), pa.field(end, typ)]), key)
        self.in_schema = in_schema
        self.key = key
        self.size, self.unit, self.start, self.end = int(size), unit, start, end

    def window(self, now_ns: int) -> tuple[int, int]:
        """The step's window ``(start, end)`` in the column unit (invariant 1)."""
        start = now_ns // UNIT_NS[self.unit] // self.size * self.size
        return start, start + self.size

    def instance(self) -> "_ProcTumbleState":
        return _ProcTumbleState(self)


def cancel(op: ProcTumble, change: ZSet, copies: ZSet) -> tuple[ZSet, ZSet]:
    """Invariant 2 for rows changed in one direction: ``change`` (input schema, consolidated, every weight of one
    sign) against stored ``copies`` of the opposite sign (output schema; may hold rows of other keys). Returns
    ``(cancelled, rest)``: the copies' weights to add (sign of the change), latest windows first, and the part of
    each change row left over (input schema, sign of the change)."""
    n_c, n_s = change.num_rows, copies.num_rows
    if n_s == 0:
        return empty(op.schema), change
    names = op.in_schema.names
    both = pa.concat_tables([
        pa.Table.from_arrays(list(change.data.columns) + [pa.nulls(n_c, pa.int64())], names=names + [op.start]),
        pa.Table.from_arrays([copies.data.column(c) for c in names] + [copies.data.column(op.start).cast(pa.int64())],
                             names=names + [op.start])])
    both = both.append_column(_TAG, pa.array(np.repeat(np.array([0, 1], np.int8), [n_c, n_s])))
    # each row's change first, then its copies, latest window first
    idx = sort_order(both, [(c, "ascending") for c in names] + [(_TAG, "ascending"), (op.start, "descending")])
    amount = np.abs(np.concatenate([change.weights, copies.weights]))[idx]
    is_copy = idx >= n_c
    first = run_starts(both.select(names).take(pa.array(idx)), names)
    starts = np.flatnonzero(first)
    gid = np.cumsum(first) - 1
    want = np.add.reduceat(np.where(is_copy, 0, amount), starts)[gid]  # the group's change amount (0 if none)
    held = np.where(is_copy, amount, 0)
    before = np.cumsum(held) - held
    before -= before[starts][gid]  # copies' amount ahead of each copy within its group
    take = np.where(is_copy, np.clip(want - before, 0, held), 0)
    sign = 1 if n_c == 0 or change.weights[0] > 0 else -1
    used = np.add.reduceat(take, starts)[gid]
    cancelled_rows = idx[is_copy & (take > 0)] - n_c
    cancelled = make(copies.data.take(pa.array(cancelled_rows)), sign * take[is_copy & (take > 0)], op.schema)
    left = (~is_copy) & (want > used)
    rest = make(change.data.take(pa.array(idx[left])), sign * (want - used)[left], op.in_schema)
    return cancelled, rest


class _ProcTumbleState:
    """Invariants 2-4."""

    def __init__(self, op: ProcTumble) -> None:
        self.op = op
        self.held = Trace(op.schema, op.key)
        self.owed = Trace(op.schema, op.key)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"held": self.held, "owed": self.owed}

    def _stored(self, trace: Trace, part: ZSet) -> ZSet:
        if trace.num_rows == 0 or part.num_rows == 0:
            return empty(self.op.schema)
        hashes = unique_sorted(np.sort(part.hash(list(self.op.key))))
        return lookup_exact(trace, hashes, self.op.schema)

    def _in_window(self, rest: ZSet, now_ns: int) -> ZSet:
        op = self.op
        if rest.num_rows == 0:
            return empty(op.schema)
        start, end = op.window(now_ns)
        n = rest.num_rows
        typ = pa.timestamp(op.unit)
        cols = list(rest.data.columns) + [pa.array(np.full(n, start, np.int64)).cast(typ),
                                          pa.array(np.full(n, end, np.int64)).cast(typ)]
        return make(pa.Table.from_arrays(cols, schema=op.schema), rest.weights, op.schema)

    def step(self, inputs: list[ZSet], ctx: "StepContext") -> ZSet:
        op = self.op
        prune(self, input_times(op), ctx)  # invariant 4
        z = inputs[0]
        if z.num_rows == 0:
            return empty(op.schema)
        z = conform(z, op.in_schema).consolidate()
        now = ctx.now_ns if ctx.now_ns is not None else time.time_ns()
        pos = z.weights > 0
        out: list[ZSet] = []
        for mask, paid, grows in ((pos, self.owed, self.held), (~pos, self.held, self.owed)):
            if not mask.any():
                continue
            part = z if mask.all() else ZSet._make(z.data.filter(pa.array(mask)), z.weights[mask])
            cancelled, rest = cancel(op, part, self._stored(paid, part).consolidate())
            fresh = self._in_window(rest, now)
            if cancelled.num_rows:
                paid.insert(cancelled.consolidate().index_by(list(op.key)))
            if fresh.num_rows:
                grows.insert(fresh.consolidate().index_by(list(op.key)))
            out += [cancelled, fresh]
        return concat(out, op.schema)


def proc_tumble(stream: "Stream", size: int | datetime.timedelta, unit: str = "ms", start: str = "window_start",
                end: str = "window_end") -> "Stream":
    """Tumbling windows of processing time: each row gets the window of ``size`` (``unit`` units, or a timedelta)
    holding the now of the step in which it arrives, as ``timestamp[unit]`` columns ``start`` and ``end``.

    Now is the step's logged wall-clock time (``Pipeline(clock=...)`` drives it), so a replayed step assigns the
    same windows. This is SQL's ``TUMBLE(PROCTIME(), size)``.

    >>> import pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bid = c.input("bid", pa.schema([("bidder", pa.int64())]))
    >>> c.output("n", bid.proc_tumble(10_000).group_by("bidder", "window_start").agg(n=dbsp.count()))
    >>> now = iter([12_000_000_000, 15_000_000_000, 21_000_000_000])  # nanoseconds since the epoch
    >>> p = dbsp.Pipeline(c, clock=lambda: next(now))
    >>> for rows in ([1, 1, 2], [1], [2]):
    ...     p.push("bid", pa.table({"bidder": rows}))
    ...     print(sorted((b, str(w), n, d) for (b, w, n), d in p.step()["n"].to_dict().items()))
    [(1, '1970-01-01 00:00:10', 2, 1), (2, '1970-01-01 00:00:10', 1, 1)]
    [(1, '1970-01-01 00:00:10', 2, -1), (1, '1970-01-01 00:00:10', 3, 1)]
    [(2, '1970-01-01 00:00:20', 1, 1)]
    """
    where = stream._where("proc_tumble")
    if isinstance(size, datetime.timedelta):
        if unit not in UNIT_NS:
            raise ValueError(f"{where}: unit must be one of {sorted(UNIT_NS)}, got {unit!r}")
        ns = (size.days * 86_400 + size.seconds) * 10**9 + size.microseconds * 1000
        if ns % UNIT_NS[unit] or ns <= 0:
            raise ValueError(f"{where}: size {size} is not a positive whole number of {unit!r}")
        size = ns // UNIT_NS[unit]
    ProcTumble(-1, stream.schema, size, unit, start, end, where)  # validate before adding nodes
    src = stream._exchanged(tuple(stream.schema.names))
    op = ProcTumble(src.node_id, src.schema, size, unit, start, end, where)
    return stream.circuit.add_operator(op, src.times, (src.times,))
