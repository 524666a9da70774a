"""The differentiate operator: outputs at step t the input of step t minus the input of step t-1 (consolidated).

Invariant: ``integrate(differentiate(s)) == s`` and ``differentiate(integrate(s)) == s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbsp_core.operators.base import Operator, conform, empty

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Differentiate(Operator):
    """``s.differentiate()``: D(s)[t] = s[t] - s[t-1]."""

    kind = "differentiate"

    def instance(self) -> "_DifferentiateState":
        return _DifferentiateState(self)


class _DifferentiateState:
    def __init__(self, op: Differentiate) -> None:
        self.schema = op.schema
        self.prev = empty(op.schema)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = conform(inputs[0], self.schema)
        out = z - self.prev
        self.prev = z
        return out
