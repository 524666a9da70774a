"""Session windows over event time: per group, rows whose times follow each other within a gap form one session, and every row is tagged with its session's start and end; kept up to date by recomputing the sessions of the groups a step touches, under insertions and deletions.

Invariants:
  1. After every step, integral(output) holds each row r of integral(input) whose weight w is positive and whose
     time t is not null, with weight w, followed by its session's ``start`` and ``end``: sort a group's such rows
     by time; two consecutive times t1 <= t2 are in one session when ``t2 - t1 <= gap`` (Flink's SESSION: each
     row opens the window [t, t + gap), and windows that overlap or touch merge); ``start`` is the session's
     first time and ``end`` its last time + gap (same type as the time column). Any split into steps or
     workers gives the same integral.
  2. The state is one trace ``rows`` keyed by the group keys (the operator's exchange key): the integral of the
     input, each row followed by its session bounds as in invariant 1, or by null bounds when its weight is not
     positive or its time is null (such rows are kept, so later changes add up, but never shown).
  3. A step touches only the groups in its change: it reads their rows from the trace, recomputes their
     sessions (one Arrow sort and numpy cumulative operations, no Python per row) and emits and stores the
     difference. Its cost follows the touched groups' stored rows and the change, not the other groups; the
     output change of a group is the rows of the sessions the change reaches (a session that grows is retracted
     and inserted again with its new bounds).
  4. Cleanup: when the time column has a lineage bound B (every later change has ``t >= B``, lineage.py), a
     session with ``end < B`` is closed: a later row neither joins it (``t > end``) nor bridges it with a later
     session, and a deletion of one of its rows would be late. The trace drops the rows of closed sessions
     (``drop_below`` on ``end``, amortized as trace invariant 5); the output integral keeps them. The closed
     sessions of a group come before its open ones, so sessions recomputed without them are unchanged.
  5. Lineage: every output row belongs to a session that a changed row (time >= B) joined, left or sat next
     to, so its ``end`` is >= B: ``end`` takes the time column's lineage. The group keys keep theirs (a change
     of a group carries its key); the time column and ``start`` lose it (a session reaches back in time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from dbsp_core.errors import SchemaError
from dbsp_core.operators.aggregate import lookup_exact
from dbsp_core.operators.base import (Operator, check_columns, check_new_columns, concat, empty, keyed_change, make,
                                      run_starts, sort_order)
from dbsp_core.time.lineage import bounds, input_times
from dbsp_core.time.watermark import event_times
from dbsp_core.trace import Trace, unique_sorted
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext

_T = "__dbsp_time"


class Session(Operator):
    """``group_by(*keys).session(column, gap)``: the input rows followed by their session's bounds (invariant 1)."""

    kind = "session"
    split_safe = True  # base.py invariant 6 (invariant 1: any split into steps gives the same integral)
    in_times: tuple = ()  # time lineage of the input, set by the circuit when there is one (dbsp_core.time)

    def __init__(self, node: int, in_schema: pa.Schema, keys: Sequence[str], column: str, gap: int, start: str,
                 end: str, where: str, hidden_key: str | None = None) -> None:
        keys = tuple(keys)
        check_columns(in_schema, keys, where, "group_by column")
        check_columns(in_schema, [column], where, "time column")
        typ = in_schema.field(column).type
        if not (pat.is_integer(typ) or pat.is_timestamp(typ)):
            raise SchemaError(f"{where}: time column {column!r} must be an integer or a timestamp, got {typ}")
        if isinstance(gap, bool) or not isinstance(gap, (int, np.integer)) or gap <= 0:
            raise ValueError(f"{where}: gap must be a positive int (time-column units), got {gap!r}")
        check_new_columns(in_schema, start, end, where, "session")
        out_type = typ if pat.is_timestamp(typ) else pa.int64()
        self.state_schema = pa.schema(list(in_schema) + [pa.field(start, out_type), pa.field(end, out_type)])
        schema = pa.schema([f for f in self.state_schema if f.name != hidden_key])
        super().__init__((node,), schema, None if hidden_key else keys)
        self.in_schema = in_schema
        self.keys = keys
        self.column = column
        self.gap = int(gap)
        self.start, self.end, self.out_type = start, end, out_type
        self.hidden_key = hidden_key

    def instance(self) -> "_SessionState":
        return _SessionState(self)


def sessions(op: Session, z: ZSet) -> ZSet:
    """Every row of the consolidated ``z`` (input schema) followed by its session bounds, computed from the rows
    of ``z`` alone (invariant 1); null bounds for rows of weight <= 0 or a null time."""
    data, w = z.data, z.weights
    n = data.num_rows
    times = event_times(data, op.column)
    valid = (w > 0) & np.asarray(pc.is_valid(data.column(op.column)).to_numpy(zero_copy_only=False), dtype=bool)
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    rows = np.flatnonzero(valid)
    if len(rows):
        keyed = data.select(list(op.keys)).take(pa.array(rows)).append_column(_T, pa.array(times[rows]))
        order = rows[sort_order(keyed, [(k, "ascending") for k in op.keys] + [(_T, "ascending")])]
        t = times[order]
        first = run_starts(data.select(list(op.keys)).take(pa.array(order)), op.keys)
        first[1:] |= (t[1:] - t[:-1]) > op.gap  # a gap wider than ``gap`` starts a session
        heads = np.flatnonzero(first)
        sid = np.cumsum(first) - 1
        last = t[np.append(heads[1:], len(t)) - 1]  # sorted by time within a session: its last row
        start[order] = t[heads][sid]
        end[order] = last[sid] + op.gap
    mask = ~valid
    cols = list(data.columns) + [pa.array(start, pa.int64(), mask=mask).cast(op.out_type),
                                 pa.array(end, pa.int64(), mask=mask).cast(op.out_type)]
    return make(pa.Table.from_arrays(cols, schema=op.state_schema), w, op.state_schema)


class _SessionState:
    """Invariants 2-4."""

    def __init__(self, op: Session) -> None:
        self.op = op
        self.keys = list(op.keys)
        self.rows = Trace(op.state_schema, op.keys)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"rows": self.rows}

    def step(self, inputs: list[ZSet], ctx: "StepContext") -> ZSet:
        op = self.op
        bound = bounds(input_times(op), ctx).get(op.column)
        if bound is not None:  # invariant 4: the rows of closed sessions
            self.rows.drop_below({op.end: bound})
        dix = keyed_change(self, inputs, ctx, op.in_schema, self.keys, cleanup=False)  # dropped by end just above
        if dix is None:
            return empty(op.schema)
        old = lookup_exact(self.rows, unique_sorted(dix.key_hash), op.state_schema).consolidate()
        bare = ZSet._make(old.data.select(op.in_schema.names), old.weights)
        new = sessions(op, concat([bare, dix.zset], op.in_schema).consolidate())
        delta = (new - old) if old.num_rows else new
        if delta.num_rows == 0:
            return empty(op.schema)
        self.rows.insert(delta.index_by(self.keys))
        shown = np.asarray(pc.is_valid(delta.data.column(op.end)).to_numpy(zero_copy_only=False), dtype=bool)
        data, w = delta.data, delta.weights
        if not shown.all():
            data, w = data.filter(pa.array(shown)), w[shown]
        if op.hidden_key is not None:
            data = data.drop_columns([op.hidden_key])
        return make(data, w, op.schema)
