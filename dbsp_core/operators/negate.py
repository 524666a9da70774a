"""The negate operator: ``-s`` flips the sign of every weight (linear)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbsp_core.operators.base import Operator, negate

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Negate(Operator):
    """``-s``: every weight negated; WeightOverflowError for the weight -2**63."""

    kind = "negate"
    split_safe = True  # base.py invariant 6 (linear)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        return negate(inputs[0])
