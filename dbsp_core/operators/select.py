"""The select operator: computes named columns from pyarrow.compute expressions, row by row but vectorized (linear)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.operators.base import Operator, empty, make
from dbsp_core.operators.expr import project_rows, project_schema

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Select(Operator):
    """``select(name=expr, ...)``: one output column per keyword, in keyword order; weights unchanged."""

    kind = "select"
    split_safe = True  # base.py invariant 6 (linear)

    def __init__(self, node: int, in_schema: pa.Schema, in_partitioning: tuple[str, ...] | None,
                 columns: dict[str, pc.Expression], where: str) -> None:
        names = list(columns)
        exprs = list(columns.values())
        schema = project_schema(in_schema, exprs, names, where)
        # the output stays partitioned if every key column is passed through unchanged
        part = in_partitioning
        if part is not None and not all(k in columns and columns[k].equals(pc.field(k)) for k in part):
            part = None
        super().__init__((node,), schema, part)
        self.names = names
        self.exprs = exprs
        # a select of plain column references is a zero-copy column pick, no expression engine needed
        picks = [next((c for c in in_schema.names if e.equals(pc.field(c))), None) for e in exprs]
        self.picks = tuple(picks) if all(p is not None for p in picks) else None

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows == 0:
            return empty(self.schema)
        if self.picks is not None:
            return make(z.data.select(list(self.picks)).rename_columns(self.names), z.weights, self.schema)
        data, w = project_rows(z.data, z.weights, self.exprs, self.names)
        return make(data, w, self.schema)
