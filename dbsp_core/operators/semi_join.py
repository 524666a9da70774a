"""The semi and anti join operator: the rows of the left side whose key has (semi) or has not (anti) a row on the right side, with their own multiplicity (SQL ``EXISTS`` / ``IN`` and ``NOT EXISTS``).

Invariants:
  1. After every step, integral(output) is the rows of integral(left), each with its whole weight, whose key
     has right rows (semi join) or has none (anti join) in integral(right); a key "has right rows" when their
     weights sum to more than 0, and a null key never has any (so an anti join keeps every left row whose key
     holds a null, as SQL's ``NOT EXISTS`` does; ``NOT IN`` adds its own null rules on top, see dbsp_core.sql).
  2. The right side holds only the key columns (the Stream API projects it); the output has the left columns.
  3. A step emits the anti part's change from presence.py ``unmatched_change``; the semi join's change is the
     left change minus it (semi = left - anti), so both cost what the changed keys cost.
  4. Both inputs are exchanged by their keys; the traces hold the integrated left rows and right keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pyarrow as pa

from dbsp_core.operators.base import Operator, empty, negate
from dbsp_core.operators.join import join_schema
from dbsp_core.operators.presence import PresenceState, take_parts

if TYPE_CHECKING:
    from dbsp_core.zset import IndexedZSet, ZSet


class SemiJoin(Operator):
    """``left.semi_join(right, ...)`` (``anti=False``) and ``left.anti_join(right, ...)`` (``anti=True``)."""

    split_safe = True  # base.py invariant 6 (invariant 1: a function of the integrated inputs)

    def __init__(self, left: int, right: int, lschema: pa.Schema, rschema: pa.Schema,
                 left_on: Sequence[str], right_on: Sequence[str], anti: bool, where: str) -> None:
        join_schema(lschema, rschema, left_on, right_on, False, where)  # validates the keys (join invariant 3)
        super().__init__((left, right), lschema, tuple(left_on))
        self.kind = "anti_join" if anti else "semi_join"
        self.anti = bool(anti)
        self.lschema, self.rschema = lschema, rschema
        self.left_on, self.right_on = tuple(left_on), tuple(right_on)

    def instance(self) -> "_SemiJoinState":
        return _SemiJoinState(self)


class _SemiJoinState(PresenceState):
    def parts(self, da: "IndexedZSet | None", db: "IndexedZSet | None") -> list["ZSet"]:
        op = self.op
        anti = take_parts(self.unmatched_left(da, db), op.schema)
        if db is not None:
            self.right.insert(db)
        if op.anti:
            return [anti]
        return [da.zset if da is not None else empty(op.schema), negate(anti)]
