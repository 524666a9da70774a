"""The constant operator: a stream whose integral is a fixed Z-set, emitted once, at a pipeline's first step (SQL's ``SELECT 1``, the row of an aggregate over an empty table).

Invariants:
  1. The Z-set is emitted in the step whose ``ctx.prev_now_ns`` is None (the first step of a pipeline, which a
     durable pipeline logs like every determinant, so a replay of that step emits it again and a replay of a
     later step does not) and never after, so integral(output) is the Z-set from the first step on.
  2. Only worker 0 emits it, so the sum over workers holds it once; the operator keeps no state.
  3. A runtime that runs steps without a clock (``ctx.now_ns`` None) cannot tell the first step: the step
     raises DbspError naming the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbsp_core.errors import DbspError
from dbsp_core.operators.base import Operator, empty, nullable_schema

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Constant(Operator):
    """``circuit.constant(z)``: ``z`` at the first step, nothing after (invariant 1)."""

    kind = "constant"

    def __init__(self, z: "ZSet") -> None:
        from dbsp_core.operators.base import conform

        schema = nullable_schema(z.schema)
        super().__init__((), schema, None)
        self.value = conform(z.consolidate(), schema)
        self.rows = repr(sorted(self.value.to_dict().items(), key=repr))  # the value, for the circuit fingerprint

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        if ctx.now_ns is None:
            raise DbspError(f"{self.label}: this runtime runs steps without a clock, so the first step of the "
                            f"pipeline (when the constant is emitted) cannot be told")
        if ctx.prev_now_ns is None and ctx.worker == 0:
            return self.value
        return empty(self.schema)
