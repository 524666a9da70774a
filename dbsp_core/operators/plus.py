"""The plus operator: the signed sum of two or more streams of equal schema (serves ``s + t`` and ``s - t``; linear)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pyarrow as pa

from dbsp_core.operators.base import Operator, concat, conform, negate

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Plus(Operator):
    """Sum of the inputs, each multiplied by its sign (+1 or -1); no consolidation."""

    kind = "plus"
    split_safe = True  # base.py invariant 6 (linear)

    def __init__(self, nodes: Sequence[int], signs: Sequence[int], schema: pa.Schema,
                 partitioning: tuple[str, ...] | None) -> None:
        super().__init__(nodes, schema, partitioning)
        self.signs = tuple(signs)
        if self.signs == (1, -1):
            self.kind = "minus"

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        parts = []
        for z, sign in zip(inputs, self.signs):
            if z.num_rows:
                z = conform(z, self.schema)
                parts.append(z if sign > 0 else negate(z))
        return concat(parts, self.schema)
