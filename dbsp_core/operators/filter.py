"""The filter operator: keeps the rows for which a pyarrow.compute predicate is true (linear: works on changes directly)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.operators.base import Operator, empty, make
from dbsp_core.operators.expr import check_predicate, filter_rows

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Filter(Operator):
    """``filter(predicate)``: rows where the predicate is true; null counts as false, as in SQL WHERE."""

    kind = "filter"
    split_safe = True  # base.py invariant 6 (linear)

    def __init__(self, node: int, schema: pa.Schema, partitioning: tuple[str, ...] | None,
                 predicate: pc.Expression, where: str) -> None:
        check_predicate(schema, predicate, where)
        super().__init__((node,), schema, partitioning)
        self.predicate = predicate

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows == 0:
            return empty(self.schema)
        data, w = filter_rows(z.data, z.weights, self.predicate)
        return make(data, w, self.schema)
