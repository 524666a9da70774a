"""The left outer join operator: incremental inner equi-join plus every left row without a match, padded with nulls.

Invariants:
  1. After every step, integral(output) == L LEFT JOIN R over the integrated inputs: each left row once per
     matching right row, or once with null right columns when its key has no right rows (a key "has right
     rows" when their weights sum to more than 0; a null key never matches).
  2. A step emits the inner join's change (as the join operator does) and the change of the padded part:
     padded new left rows whose key has no right rows after the step, and, for every key whose right side
     turns empty (or non-empty) in this step, the old left rows of that key padded with weight +1 (or -1).
  3. Both inputs are exchanged by their keys; the traces hold the integrated left and right inputs; the padded
     part's change comes from operators/presence.py (one grouping pass over the right rows of the touched keys).
  4. Output columns follow the inner join's naming rules (``on=`` keeps one key column; "_right" suffix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

from dbsp_core.operators.base import concat, conform, empty, make
from dbsp_core.operators.join import Join, inner_change
from dbsp_core.operators.presence import Presence, unmatched_change
from dbsp_core.trace import Trace

if TYPE_CHECKING:
    from dbsp_core.runtime.context import StepContext
    from dbsp_core.zset import IndexedZSet, ZSet

class LeftJoin(Join):
    """``left.left_join(right, ...)``: the inner join plus unmatched left rows padded with nulls."""

    kind = "left_join"

    def __init__(self, left: int, right: int, lschema: pa.Schema, rschema: pa.Schema,
                 left_on: Sequence[str], right_on: Sequence[str], drop_right_keys: bool, where: str) -> None:
        super().__init__(left, right, lschema, rschema, left_on, right_on, drop_right_keys, where)
        self.kind = "left_join"
        nl = len(lschema)
        self.pad_types = [f.type for f in list(self.schema)[nl:]]
        self.keyschema = pa.schema([pa.field(k, rschema.field(k).type) for k in self.right_on])  # fingerprint only

    def instance(self) -> "_LeftJoinState":
        return _LeftJoinState(self)

    def padded(self, left: "IndexedZSet", li: np.ndarray, w: np.ndarray) -> "ZSet":
        """Left rows ``li`` with null right columns and weights ``w``."""
        if len(li) == 0:
            return empty(self.schema)
        cols = list(left.zset.data.take(li).columns) + [pa.nulls(len(li), t) for t in self.pad_types]
        return make(pa.Table.from_arrays(cols, schema=self.schema), w, self.schema)


class _LeftJoinState:
    def __init__(self, op: LeftJoin) -> None:
        self.op = op
        self.left = Trace(op.lschema, op.left_on)
        self.right = Trace(op.rschema, op.right_on)
        self.presence = Presence(op.rschema, op.right_on)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"left": self.left, "right": self.right}

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        op = self.op
        a, b = inputs
        da = conform(a, op.lschema).index_by(list(op.left_on)) if a.num_rows else None
        db = conform(b, op.rschema).index_by(list(op.right_on)) if b.num_rows else None
        if da is not None and len(da) == 0:
            da = None
        if db is not None and len(db) == 0:
            db = None
        if da is None and db is None:
            return empty(op.schema)
        unmatched = unmatched_change(self.presence, self.left, self.right, da, db)  # before the inserts
        parts = inner_change(op, self.left, self.right, da, db)  # invariant 2, first part
        # the padded part's change (invariant 2, second part): operators/presence.py
        parts.extend(op.padded(batch, li, w) for batch, li, w in unmatched)
        if da is not None:
            self.left.insert(da)
        return concat(parts, op.schema)
