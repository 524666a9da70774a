"""The materialize operator: keeps the integral of a view's (or a table's) changes in a trace, so ``Pipeline.view`` and ``Pipeline.query`` can read its current contents.

Invariants:
  1. After every step, the sum over workers of the trace is the integral of the input: the view's contents
     as of that step, consolidated within each worker.
  2. The input is partitioned by the trace's key (the stream's own partitioning when it has one, else all its
     columns, through an exchange), so each row's whole history lives in one worker, its +1 and -1 meet in one
     trace, and the state is placed by shard: checkpointed, moved by a rescale and spilled like any trace.
  3. The output is always empty: the node is a sink the runtime runs because the circuit lists it in
     ``Circuit.readable``; nothing downstream reads it.
  4. Nothing is pruned by time lineage: a closed window is still part of the view's contents.
  5. The trace holds its low levels while no view read reads it (``hold_unread``, ``DBSP_TOTALS_HOLD``,
     trace/levels.py invariant 18): its step batches merge many at a time between reads instead of two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from dbsp_core.envvars import settings
from dbsp_core.operators.base import Operator, empty, keyed_change
from dbsp_core.trace import Trace

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Materialize(Operator):
    """The integral of its input, kept in a trace keyed like the input (invariant 2); outputs nothing."""

    kind = "materialize"
    split_safe = True  # base.py invariant 6 (invariant 1: its trace is the integral, its output empty)

    def __init__(self, node: int, schema: pa.Schema, key: tuple[str, ...], name: str) -> None:
        super().__init__((node,), schema, tuple(key))
        self.name = name

    def instance(self) -> "_MaterializeState":
        return _MaterializeState(self)


class _MaterializeState:
    def __init__(self, op: Materialize) -> None:
        self.op = op
        self.trace = Trace(op.schema, tuple(op.partitioning or ()))
        self.trace.hold_unread = settings().totals_hold  # (invariant 5)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"contents": self.trace}

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        dix = keyed_change(self, inputs, ctx, self.op.schema, self.trace.key, cleanup=False)  # invariant 4
        if dix is not None:
            self.trace.insert(dix)
        return empty(self.op.schema)
