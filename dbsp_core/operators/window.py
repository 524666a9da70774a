"""Windows over event time: tumbling and hopping window assignment (a linear operator adding window bounds to each row) and the interval join built from it; window aggregates and window joins are ordinary aggregates and joins keyed by the window columns, whose time lineage lets them drop closed windows.

Invariants:
  1. ``tumble(column, size)``: each row with a non-null time t gets ``window_start = floor(t / size) * size`` and
     ``window_end = window_start + size`` (same type as the time column). ``hop(column, size, slide)`` (size a
     multiple of slide): the row appears once per window containing t, i.e. for every multiple s of ``slide``
     with ``t - size < s <= t``, with ``window_start = s``. Rows with a null time belong to no window. Windows are
     assigned row by row, so the operator is linear and each worker handles its own rows.
  2. Lineage (time/lineage.py): if t is bounded by ``W + off``, then ``window_start >= W + off - size`` and
     ``window_end >= W + off``, so an aggregate or join keyed by a window column drops a window's state once the
     watermark passes it (time/cleanup.py).
  3. ``interval_join(left, right, ..., lower, upper)`` keeps the pairs with equal keys and
     ``right_time + lower <= left_time <= right_time + upper``: left rows are put in buckets of
     ``B = upper - lower + 1`` time units, each right row in the (one or two) buckets its range meets, and the
     two are equi-joined on keys and bucket, then filtered by the exact condition, so each matching pair is
     produced exactly once, and both sides' state is dropped as the other side's watermark passes it.
  4. Mode "points" (``_window(..., "points", size, 0, lo, hi, column, None, ...)``): each row with a non-null time t
     appears once per multiple p of ``size`` with ``t + lo <= p <= t + hi`` (none when there is no such multiple),
     with p in the added column; lineage: ``p >= W + off + lo``. It lists exactly the window bounds a condition
     ``p - hi <= t <= p - lo`` accepts (q7's window ends), where "range" lists every bucket meeting the interval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from dbsp_core.errors import SchemaError
from dbsp_core.operators.base import Operator, check_columns, empty, make
from dbsp_core.time.watermark import event_times

if TYPE_CHECKING:
    from dbsp_core.circuit import Stream
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet

BUCKET = "__dbsp_bucket"


MAX_SPAN = 2**62  # sizes, slides and interval bounds: a time plus or minus one stays inside int64
MAX_HOPS = 2**20  # windows per row of a hop (size // slide): each row is copied that many times


def _positive(value: object, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{where}: {what} must be a positive int (time-column units), got {value!r}")
    if value > MAX_SPAN:
        raise ValueError(f"{where}: {what} {value} is larger than the limit of 2**62 time units (a window's end "
                         f"must stay inside int64)")
    return int(value)


class Window(Operator):
    """Window assignment (invariant 1): ``mode`` is "tumble", "hop", "range" (the interval join's buckets: every
    bucket of ``size`` meeting ``[t + lo, t + hi]``) or "points" (invariant 4: every multiple of ``size`` in
    ``[t + lo, t + hi]``)."""

    kind = "window"
    split_safe = True  # base.py invariant 6 (linear: windows assigned row by row (invariant 1))

    def __init__(self, node: int, in_schema: pa.Schema, partitioning: tuple[str, ...] | None, column: str,
                 mode: str, size: int, slide: int, lo: int, hi: int, start: str, end: str | None, where: str
                 ) -> None:
        check_columns(in_schema, [column], where, "time column")
        typ = in_schema.field(column).type
        if not (pat.is_integer(typ) or pat.is_timestamp(typ)):
            raise SchemaError(f"{where}: time column {column!r} must be an integer or a timestamp, got {typ}")
        for name in (start, end):
            if name is not None and name in in_schema.names:
                raise SchemaError(f"{where}: output column {name!r} clashes with an input column")
        out_type = typ if pat.is_timestamp(typ) else pa.int64()
        fields = list(in_schema) + [pa.field(start, out_type)] + ([pa.field(end, out_type)] if end else [])
        super().__init__((node,), pa.schema(fields), partitioning)
        self.column, self.mode, self.size, self.slide, self.lo, self.hi = column, mode, size, slide, lo, hi
        self.start, self.end, self.out_type = start, end, out_type

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        return self.assign(inputs[0])

    def assign(self, z: "ZSet", latest: bool = False) -> "ZSet":
        """The step's output for the change ``z``; with ``latest`` (mode "hop"), each row once, in the latest of its
        windows only (``window_start`` the largest multiple of slide at most t): the slices of
        dbsp_core/runtime/plan.py's fused hop, whose other windows start ``k * slide`` earlier (0 < k < size / slide)."""
        if z.num_rows == 0:
            return empty(self.schema)
        data, w = z.data, z.weights
        valid = pc.is_valid(data.column(self.column))
        if data.column(self.column).null_count:  # no window for a null time
            mask = np.asarray(valid.to_numpy(zero_copy_only=False), dtype=bool)
            data, w = data.filter(valid), w[mask]
        t = event_times(data, self.column)
        rows = None
        if self.mode == "tumble":
            start = np.floor_divide(t, self.size) * self.size
        elif self.mode == "hop":
            n = self.size // self.slide
            start = last = np.floor_divide(t, self.slide) * self.slide
            if not latest:
                rows = np.repeat(np.arange(len(t), dtype=np.int64), n)
                start = last[rows] - np.tile(np.arange(n, dtype=np.int64), len(t)) * self.slide
        else:  # range: the buckets meeting [t + lo, t + hi]; points: the multiples of size in it (invariant 4)
            if self.mode == "range":
                first = np.floor_divide(t + self.lo, self.size)
            else:
                first = -np.floor_divide(-(t + self.lo), self.size)  # ceil((t + lo) / size)
            cnt = np.maximum(np.floor_divide(t + self.hi, self.size) - first + 1, 0)
            rows = np.repeat(np.arange(len(t), dtype=np.int64), cnt)
            within = np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            start = (first[rows] + within) * self.size
        if rows is not None:
            data, w = data.take(pa.array(rows)), w[rows]
        cols = list(data.columns) + [pa.array(start, pa.int64()).cast(self.out_type)]
        if self.end:
            cols.append(pa.array(start + self.size, pa.int64()).cast(self.out_type))
        return make(pa.Table.from_arrays(cols, schema=self.schema), w, self.schema)


def _window(stream: "Stream", column: str, mode: str, size: int, slide: int, lo: int, hi: int, start: str,
            end: str | None, kind: str) -> "Stream":
    where = stream._where(kind)
    op = Window(stream.node_id, stream.schema, stream.op.partitioning, column, mode, size, slide, lo, hi, start,
                end, where)
    times = dict(stream.times)
    if column in times:  # invariant 2
        src, off = times[column]
        times[start] = (src, off - size if mode not in ("range", "points") else
                        off + lo - size if mode == "range" else off + lo)
        if end:
            times[end] = (src, off)
    return stream.circuit.add_operator(op, times)


def tumble(stream: "Stream", column: str, size: int, start: str = "window_start", end: str = "window_end"
           ) -> "Stream":
    """Tumbling windows of ``size`` time units over ``column``: adds ``start`` and ``end`` columns (invariant 1).

    >>> import pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bid = c.input("bid", pa.schema([("price", pa.int64()), ("t", pa.int64())]), event_time="t", lateness=5)
    >>> c.output("w", bid.tumble("t", 10).group_by("window_start").agg(n=dbsp.count()))
    >>> p = dbsp.Pipeline(c)
    >>> p.push("bid", pa.table({"price": [1, 2, 3], "t": [3, 12, 14]}))
    >>> sorted(p.step()["w"].to_dict()), p.watermarks
    ([(0, 1), (10, 2)], {'bid': 9})
    >>> p.push("bid", pa.table({"price": [4], "t": [8]}))  # below the watermark 14 - 5: late, dropped
    >>> p.step()["w"].to_dict(), p.late_rows
    ({}, {'bid': 1})
    """
    return _window(stream, column, "tumble", _positive(size, "size", stream._where("tumble")), 0, 0, 0, start, end,
                   "tumble")


def hop(stream: "Stream", column: str, size: int, slide: int, start: str = "window_start",
        end: str = "window_end") -> "Stream":
    """Hopping windows of ``size`` every ``slide`` time units over ``column`` (``size`` a multiple of ``slide``).

    >>> import pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bid = c.input("bid", pa.schema([("t", pa.int64())]))
    >>> c.output("w", bid.hop("t", 10, 5))
    >>> p = dbsp.Pipeline(c)
    >>> p.push("bid", pa.table({"t": [12]}))
    >>> sorted(p.step()["w"].to_dict())
    [(12, 5, 15), (12, 10, 20)]
    """
    where = stream._where("hop")
    size, slide = _positive(size, "size", where), _positive(slide, "slide", where)
    if size % slide:
        raise ValueError(f"{where}: size ({size}) must be a multiple of slide ({slide})")
    if size // slide > MAX_HOPS:
        raise ValueError(f"{where}: size / slide = {size // slide} windows per row is more than the limit of "
                         f"{MAX_HOPS}")
    return _window(stream, column, "hop", size, slide, 0, 0, start, end, "hop")


def interval_join(left: "Stream", right: "Stream", left_time: str, right_time: str, lower: int, upper: int,
                  on: str | Sequence[str] | None = None, left_on: str | Sequence[str] | None = None,
                  right_on: str | Sequence[str] | None = None) -> "Stream":
    """Pairs with equal keys and ``right_time + lower <= left_time <= right_time + upper`` (invariant 3).

    The output columns are those of ``left.join(right, ...)`` with the same ``on`` / ``left_on`` / ``right_on``.

    >>> import pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> a = c.input("a", pa.schema([("k", pa.int64()), ("t", pa.int64())]))
    >>> b = c.input("b", pa.schema([("k", pa.int64()), ("t", pa.int64())]))
    >>> c.output("j", a.interval_join(b, "t", "t", -5, 0, on="k"))
    >>> p = dbsp.Pipeline(c)
    >>> p.push("a", pa.table({"k": [1, 1], "t": [10, 20]})); p.push("b", pa.table({"k": [1], "t": [12]}))
    >>> sorted(p.step()["j"].to_dict())
    [(1, 10, 12)]
    """
    where = left._where("interval_join")
    left.circuit.check_stream(right, where)
    check_columns(left.schema, [left_time], where, "left time column")
    check_columns(right.schema, [right_time], where, "right time column")
    for v, what in ((lower, "lower"), (upper, "upper")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{where}: {what} must be an int (time-column units), got {v!r}")
        if abs(v) > MAX_SPAN:
            raise ValueError(f"{where}: {what} {v} is outside the limit of +-2**62 time units")
    if lower > upper:
        raise ValueError(f"{where}: lower ({lower}) must not exceed upper ({upper})")
    if upper - lower + 1 > MAX_SPAN:
        raise ValueError(f"{where}: upper - lower + 1 = {upper - lower + 1} is larger than the limit of 2**62 time "
                         f"units")
    lk, rk, drop = type(left)._keys(on, left_on, right_on, where)  # Stream's rule for on= / left_on= / right_on=
    size = int(upper - lower + 1)
    lb = _window(left, left_time, "tumble", size, 0, 0, 0, BUCKET, None, "interval_join")
    rb = _window(right, right_time, "range", size, 0, int(lower), int(upper), BUCKET, None, "interval_join")
    j = lb._join(rb, lk + [BUCKET], rk + [BUCKET], drop, kind="join")
    names = j.schema.names
    rt = right_time + "_right" if (right_time in left.schema.names and not (drop and right_time in rk)) \
        else right_time
    lt_i, rt_i = pc.field(left_time).cast(pa.int64()), pc.field(rt).cast(pa.int64())
    j = j.filter((lt_i >= rt_i + int(lower)) & (lt_i <= rt_i + int(upper)))
    keep = [n for n in names if n not in (BUCKET, BUCKET + "_right")]
    return j.select(**{n: pc.field(n) for n in keep})
