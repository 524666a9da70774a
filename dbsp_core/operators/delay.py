"""The delay operator z^-1: outputs at step t the input of step t-1 (the empty Z-set at the first step).

Invariant: each worker delays its own part of the stream, so the sum over workers is the delayed stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbsp_core.operators.base import Operator, empty

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Delay(Operator):
    """``s.delay()``: z^-1."""

    kind = "delay"

    def instance(self) -> "_DelayState":
        return _DelayState(self)


class _DelayState:
    def __init__(self, op: Delay) -> None:
        self.prev = empty(op.schema)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        out, self.prev = self.prev, inputs[0]
        return out
