"""The distinct operator: turns a bag into a set (every row with positive multiplicity once), incrementally.

Invariants:
  1. After every step, integral(output) == {row: 1 for rows with integral(input)[row] > 0}; rows with
     zero or negative accumulated weight are absent. Row identity treats null as equal to null.
  2. The trace holds the integral of the input, indexed by all columns; a step reads only the rows whose
     hash occurs in the change (so its cost grows with the change) and emits +1 for rows that become
     positive, -1 for rows that stop being positive.
  3. The input is exchanged by all columns, so each row's whole history lives in one worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from dbsp_core.operators.base import Operator, concat, conform, empty, negate, positive_set
from dbsp_core.trace import Trace, unique_sorted

if TYPE_CHECKING:
    from dbsp_core.runtime import WorkerContext
    from dbsp_core.zset import ZSet


class Distinct(Operator):
    """``s.distinct()``."""

    kind = "distinct"

    def __init__(self, node: int, schema: pa.Schema) -> None:
        super().__init__((node,), schema, tuple(schema.names))

    def instance(self) -> "_DistinctState":
        return _DistinctState(self)


class _DistinctState:
    def __init__(self, op: Distinct) -> None:
        self.schema = op.schema
        self.cols = list(op.schema.names)
        self.trace = Trace(op.schema, tuple(self.cols))

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"input": self.trace}

    def step(self, inputs: list["ZSet"], ctx: "WorkerContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows == 0:
            return empty(self.schema)
        dix = conform(z, self.schema).index_by(self.cols)
        if len(dix) == 0:
            return empty(self.schema)
        old = concat([b.zset for b in self.trace.lookup(unique_sorted(dix.key_hash))], self.schema)
        new = concat([old, dix.zset], self.schema).consolidate()
        self.trace.insert(dix)
        if old.num_rows == 0:
            return positive_set(new)
        return concat([positive_set(new), negate(positive_set(old.consolidate()))], self.schema)
