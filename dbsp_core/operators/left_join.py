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

import pyarrow as pa

from dbsp_core.operators.join import Join, inner_change
from dbsp_core.operators.presence import PresenceState

if TYPE_CHECKING:
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


class _LeftJoinState(PresenceState):
    def parts(self, da: "IndexedZSet | None", db: "IndexedZSet | None") -> list["ZSet"]:
        op = self.op
        unmatched = self.unmatched_left(da, db)  # before the inserts
        parts = inner_change(op, self.left, self.right, da, db)  # invariant 2, first part
        # the padded part's change (invariant 2, second part): operators/presence.py
        parts.extend(op.padded_left(batch, li, w) for batch, li, w in unmatched)
        return parts
