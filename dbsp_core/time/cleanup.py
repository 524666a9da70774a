"""State cleanup by watermark: the rows of an operator's traces that no later change can reach (a time key below its lineage bound) are dropped, so a windowed view over an endless stream runs in bounded memory.

Invariants:
  1. A trace row is dropped only when one of the trace's *key* columns has a lineage bound (lineage.py) and the
     row's value is below it: every later change that could meet the row (same group, or a join match) would
     carry the same key value, and no later change can (lineage law), so the operator never reads the row
     again and its output is unchanged. The integral of the operator's output keeps every row it emitted.
  2. A join drops a side's rows by the lineage of the *other* side's matching key column (only the other side's
     later changes meet a side's state); keyed operators by their input's lineage.
  3. Cleanup is amortized (trace invariant 5): it runs at the start of a step, before the step's change, whose
     rows are at or above the bounds too (late rows never enter).
"""

from __future__ import annotations

from typing import Any

from dbsp_core.time.lineage import Times, bounds
from dbsp_core.trace import Trace


def prune_trace(trace: Trace, times: Times, ctx: Any, force: bool = False) -> int:
    """Drop the rows of ``trace`` below the bounds of its key columns under ``times`` (invariant 1)."""
    if not times:
        return 0
    b = {c: v for c, v in bounds(times, ctx).items() if c in trace.key}
    return trace.drop_below(b, force) if b else 0


def prune(state: Any, times: Times, ctx: Any, force: bool = False) -> int:
    """Prune every trace of a keyed operator's instance (``state.traces()``) by its input's lineage."""
    if not times:
        return 0
    return sum(prune_trace(t, times, ctx, force) for t in state.traces().values())
