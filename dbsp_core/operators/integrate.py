"""The integrate operator: outputs at step t the sum of the inputs of steps 0..t (the running total, consolidated).

Invariant: the state is the consolidated integral of this worker's part; the sum over workers is the
integral of the stream, and ``differentiate(integrate(s)) == s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbsp_core.operators.base import Operator, conform, empty

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Integrate(Operator):
    """``s.integrate()``: I(s)[t] = s[0] + ... + s[t]."""

    kind = "integrate"

    def instance(self) -> "_IntegrateState":
        return _IntegrateState(self)


class _IntegrateState:
    def __init__(self, op: Integrate) -> None:
        self.schema = op.schema
        self.acc = empty(op.schema)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows:
            self.acc = self.acc + conform(z, self.schema)
        return self.acc
