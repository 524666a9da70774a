"""Watermarks: the pure, vectorized function from the previous watermarks and one step's pushes to the step's watermarks and late-row counts, which the runtime computes once per step and logs with the step's division.

Invariants (enforced here):
  1. An input declared with ``event_time=column, lateness=L`` has after step s the watermark
     ``W_s = max(W_{s-1}, max event time of the rows pushed in step s - L)`` (``W_{-1}`` = :data:`NO_WATERMARK`,
     below every time): non-decreasing, and a function of the previous watermarks and the step's pushes only,
     so a replayed step computes (and the durable runtime logs with the step's division) the same value. Null
     times do not move it.
  2. The watermark *in force* during step s is ``W_{s-1}``, computed from the steps before it: operators read it
     as ``ctx.watermarks``. A row of step s is *late* when its event time is null or below it; the input operator
     drops late rows (operators/input.py), and :func:`advance` counts them with the same rule for the pipeline's
     statistics. So every row that enters the circuit at step s or later has event time >= ``W_{s-1}``, which is
     what time-aware operators rely on to drop state at the start of step s (cleanup.py). A late row is below
     ``W_{s-1}``, so it could not have moved the watermark anyway.
  3. Times are int64 in the column's own unit: an integer column as it is, a timestamp column as its int64
     value (e.g. milliseconds since the epoch for ``timestamp[ms]``); the lateness is in the same unit.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

NO_WATERMARK = int(np.iinfo(np.int64).min)  # the watermark of an input before any row: nothing is late
_UNIT_NS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}


class EventTime(NamedTuple):
    """The event-time declaration of one input: its time column and allowed lateness (column units)."""

    column: str
    lateness: int


def lateness_units(lateness: Any, typ: pa.DataType, where: str) -> int:
    """``lateness`` (an int in the column's unit, or a ``datetime.timedelta`` for a timestamp column) as an int.

    >>> import datetime, pyarrow as pa
    >>> lateness_units(datetime.timedelta(seconds=4), pa.timestamp("ms"), "input 'bid'")
    4000
    """
    if isinstance(lateness, datetime.timedelta):
        if not pat.is_timestamp(typ):
            raise TypeError(f"{where}: a timedelta lateness needs a timestamp column, the column is {typ}; give an "
                            f"int in the column's unit")
        ns = (lateness.days * 86_400 + lateness.seconds) * 10**9 + lateness.microseconds * 1000
        return ns // _UNIT_NS[typ.unit]
    if isinstance(lateness, bool) or not isinstance(lateness, (int, np.integer)):
        raise TypeError(f"{where}: lateness must be an int (column units) or a datetime.timedelta, got {lateness!r}")
    if lateness < 0:
        raise ValueError(f"{where}: lateness must be >= 0, got {lateness}")
    if lateness > 2**62:
        raise ValueError(f"{where}: lateness {lateness} is larger than the limit of 2**62 column units (the watermark, "
                         f"an event time minus it, must stay inside int64)")
    return int(lateness)


def time_array(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """A time column as int64 values in its own unit (invariant 3); nulls stay null."""
    if pat.is_int64(col.type):
        return col
    return pc.cast(col, pa.int64())


def event_times(data: pa.Table, column: str) -> np.ndarray:
    """The event times of ``data`` as an int64 numpy array; a null time becomes :data:`NO_WATERMARK`.

    >>> import pyarrow as pa
    >>> event_times(pa.table({"t": pa.array([5, None], pa.int64())}), "t").tolist()
    [5, -9223372036854775808]
    """
    col = time_array(data.column(column))
    if col.null_count:
        col = pc.fill_null(col, NO_WATERMARK)
    return np.asarray(col.to_numpy() if isinstance(col, pa.Array) else
                      col.to_numpy(), dtype=np.int64)


def late_mask(data: pa.Table, column: str, watermark: int) -> pa.ChunkedArray | pa.Array:
    """True for the rows that are *not* late under ``watermark`` (time not null and >= it), invariant 2."""
    col = time_array(data.column(column))
    return pc.fill_null(pc.greater_equal(col, pa.scalar(int(watermark), pa.int64())), False)


def advance(specs: dict[str, EventTime], previous: dict[str, int], pushes: Iterable[tuple[str, Any]]
            ) -> tuple[dict[str, int], dict[str, int]]:
    """The watermarks after a step and the late rows of each input in it (invariants 1 and 2).

    ``specs``: the inputs that declare event time; ``previous``: their watermarks after the previous step, in
    force during this one (an input missing is at :data:`NO_WATERMARK`); ``pushes``: the step's pushes as
    ``(input, Z-set or Arrow table)`` in any order (pushes to other inputs are ignored). Returns
    ``(watermarks, late)``, both with one entry per input of ``specs``. Costs two vectorized passes over the
    pushed time columns.

    >>> import pyarrow as pa
    >>> specs = {"bid": EventTime("t", 10)}
    >>> advance(specs, {}, [("bid", pa.table({"t": [100, 95, 80]}))])
    ({'bid': 90}, {'bid': 0})
    >>> advance(specs, {"bid": 90}, [("bid", pa.table({"t": [85, 120]}))])
    ({'bid': 110}, {'bid': 1})
    """
    tables: dict[str, list[pa.Table]] = {name: [] for name in specs}
    for name, data in pushes:
        if name in tables:
            tables[name].append(data if isinstance(data, (pa.Table, pa.RecordBatch)) else data.data)
    out, late = {}, {}
    for name, spec in specs.items():
        prev = wm = int(previous.get(name, NO_WATERMARK))
        n = 0
        for t in tables[name]:
            if t.num_rows:
                top = pc.max(time_array(t.column(spec.column))).as_py()
                if top is not None:
                    wm = max(wm, max(int(top) - spec.lateness, NO_WATERMARK))
                n += t.num_rows - (pc.sum(pc.cast(late_mask(t, spec.column, prev), pa.int64())).as_py() or 0)
        out[name], late[name] = wm, n
    return out, late


def specs_of(circuit: Any) -> dict[str, EventTime]:
    """The event-time declarations of a circuit's inputs, ``{input name: EventTime}``."""
    out = {}
    for name, i in circuit.inputs.items():
        op = circuit.nodes[i]
        if getattr(op, "event_time", None) is not None:
            out[name] = EventTime(op.event_time, op.lateness)
    return out
