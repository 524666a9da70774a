"""The keyless aggregate: ``group_by()`` with no keys, one row over the whole stream (no row once every row is deleted), built as an aggregate over a hidden constant key.

Invariants:
  1. :class:`AddGlobalKey` appends the constant int64 column :data:`GLOBAL_KEY` (= 0) to every row (linear);
     the aggregate (or top-k) that follows groups by it and hides it from its output, so its state is a trace
     keyed by the operator's exchange key like any keyed operator's, in the one shard of key 0.
  2. After every step, integral(output) is one row of aggregates over integral(input) while that integral has
     rows, and no row once it has none (SQL would give one row of count 0 over an empty table; a Z-set view
     has no row for an empty group, as for every group_by).
  3. A linear keyless aggregate combines each worker's change into one partial row before the exchange, so at
     most W rows per step cross to the worker owning the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dbsp_core.errors import SchemaError
from dbsp_core.operators.base import Operator, empty, make

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet

GLOBAL_KEY = "__dbsp_global"


class AddGlobalKey(Operator):
    """Each row with the constant column :data:`GLOBAL_KEY` appended (invariant 1)."""

    kind = "add_global_key"
    split_safe = True  # base.py invariant 6 (linear)

    def __init__(self, node: int, schema: pa.Schema, partitioning: tuple[str, ...] | None, where: str) -> None:
        if GLOBAL_KEY in schema.names:
            raise SchemaError(f"{where}: column name {GLOBAL_KEY!r} is reserved")
        super().__init__((node,), pa.schema(list(schema) + [pa.field(GLOBAL_KEY, pa.int64())]), partitioning)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows == 0:
            return empty(self.schema)
        data = z.data.append_column(GLOBAL_KEY, pa.array(np.zeros(z.num_rows, dtype=np.int64)))
        return make(data, z.weights, self.schema)
