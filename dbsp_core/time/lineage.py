"""Time lineage: which columns of a stream are bounded below by an input's watermark, so that operators keyed by them know which state no later change can reach.

A stream's lineage maps a column to ``(input, offset)``: from the step in which ``ctx.watermarks[input]`` is W
on, every row of the stream's change (insertion or deletion) has ``column >= W + offset`` (column as int64 in
the input's time unit; watermarks as in watermark.py). The circuit derives it node by node when the node is
built.

Invariants (the rules below keep the law above):
  1. An input with event time gives its time column offset 0 (late rows are dropped, watermark.py invariant 2).
  2. Filter, exchange, negate and a select's plain column references (under their new names) keep the lineage
     of the columns they pass; windows derive their window columns (operators/window.py). A sum keeps the columns both
     sides bound by the same input, with the smaller offset.
  3. Keyed operators (aggregate, top-k, count-distinct) keep the lineage of their key columns only (a change of
     a group carries the group's key); a join keeps its key columns' lineage when both sides bound them by the
     same input (the smaller offset), since an output row's key comes from whichever side changed.
  4. Every other operator (delay, integrate, differentiate, flat_map, within_last, left join) drops the lineage:
     it may emit rows of earlier steps.
"""

from __future__ import annotations

from typing import Any

Times = dict[str, tuple[str, int]]


def passed(times: Times, renames: dict[str, str]) -> Times:
    """The lineage of the columns ``renames`` passes on (``{new name: old name}``), under their new names."""
    return {new: times[old] for new, old in renames.items() if old in times}


def meet(a: Times, b: Times) -> Times:
    """The lineage two streams share (invariant 2, a sum; invariant 3, a join key): same input, smaller offset."""
    out = {}
    for col, (src, off) in a.items():
        other = b.get(col)
        if other is not None and other[0] == src:
            out[col] = (src, min(off, other[1]))
    return out


def bounds(times: Times, ctx: Any) -> dict[str, int]:
    """``{column: lowest value a later change can have}`` under the step's watermarks (``ctx.watermarks``);
    empty when the runtime gives none or no watermark has moved yet."""
    wms = getattr(ctx, "watermarks", None)
    if not wms or not times:
        return {}
    from dbsp_core.time.watermark import NO_WATERMARK

    out = {}
    for col, (src, off) in times.items():
        wm = wms.get(src, NO_WATERMARK)
        if wm != NO_WATERMARK:
            out[col] = wm + off
    return out


def input_times(op: Any, i: int = 0) -> Times:
    """The lineage of input ``i`` of a stateful operator (set by the circuit as ``op.in_times``; empty if none)."""
    t = getattr(op, "in_times", ())
    return t[i] if i < len(t) else {}
