"""The flat_map operator: the escape hatch, a user function from RecordBatch to RecordBatch applied to the rows of each weight (linear).

Invariants:
  1. Every output row produced from input rows of weight w has weight w: the function is called once
     per distinct weight in the step's change (typically +1 and -1), never once per row.
  2. The function must be row-wise (the output for a record batch is the concatenation of the outputs for
     its rows); otherwise results would depend on how input is split into steps and workers.
  3. Its output must have the declared schema (names and types), else SchemaError naming the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow as pa

from dbsp_core.errors import SchemaError
from dbsp_core.operators.base import Operator, concat, empty, make, nullable_schema, same_columns

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet

FlatMapFn = Callable[[pa.RecordBatch], "pa.RecordBatch | pa.Table"]


def _as_batch(table: pa.Table) -> pa.RecordBatch:
    table = table.combine_chunks()
    batches = table.to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


class FlatMap(Operator):
    """``flat_map(fn, schema=...)``: output rows are ``fn(batch)`` for the record batch of the rows of each weight."""

    kind = "flat_map"
    split_safe = True  # base.py invariant 6 (linear)

    def __init__(self, node: int, in_schema: pa.Schema, fn: FlatMapFn, schema: pa.Schema | None,
                 where: str) -> None:
        if not callable(fn):
            raise TypeError(f"{where}: fn must be callable, got {fn!r}")
        self.fn = fn
        self.where = where
        if schema is None:  # infer from the function applied to an empty record batch
            out = fn(pa.RecordBatch.from_pylist([], schema=in_schema))
            if not isinstance(out, (pa.RecordBatch, pa.Table)):
                raise TypeError(f"{where}: fn must return a pyarrow RecordBatch, got {type(out).__name__}")
            schema = out.schema
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"{where}: schema must be a pyarrow.Schema, got {schema!r}")
        super().__init__((node,), nullable_schema(schema), None)

    def _apply(self, data: pa.Table) -> pa.Table:
        out = self.fn(_as_batch(data))
        if isinstance(out, pa.RecordBatch):
            out = pa.Table.from_batches([out])
        if not isinstance(out, pa.Table):
            raise TypeError(f"{self.where}: fn must return a pyarrow RecordBatch, got {type(out).__name__}")
        if not same_columns(out.schema, self.schema):
            raise SchemaError(f"{self.where}: fn returned columns {out.schema} but the declared schema is "
                              f"{self.schema}")
        return out

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows == 0:
            return empty(self.schema)
        w = z.weights
        distinct_w = np.unique(w)
        parts = []
        for wv in distinct_w:  # one call per distinct weight (invariant 1), not per row
            data = z.data if len(distinct_w) == 1 else z.data.filter(pa.array(w == wv))
            out = self._apply(data)
            parts.append(make(out, np.full(out.num_rows, wv, dtype=np.int64), self.schema))
        return concat(parts, self.schema)
