"""The input operator: a circuit's source, yielding each step the Z-set pushed to its handle on this worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from dbsp_core.operators.base import Operator, empty

if TYPE_CHECKING:
    from dbsp_core.runtime.context import StepContext
    from dbsp_core.zset import ZSet


class Input(Operator):
    """Source node of input handle ``name``; its rows may sit in any worker (no partitioning)."""

    kind = "input"

    def __init__(self, name: str, schema: pa.Schema) -> None:
        super().__init__((), schema, None)
        self.name = name

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = ctx.inputs.get(self.name)
        return empty(self.schema) if z is None else z
