"""The right and full outer join operator: incremental inner equi-join plus the unmatched rows of the right side (right join) or of both sides (full join), padded with nulls.

Invariants:
  1. After every step, integral(output) == L RIGHT JOIN R (or L FULL JOIN R) over the integrated inputs: the
     inner join's pairs, every right row whose key has no left rows once with null left columns, and for a
     full join every left row whose key has no right rows once with null right columns (a null key never
     matches, so a row with a null key is always padded).
  2. A step emits the inner join's change (join.py ``inner_change``) and the change of each padded part
     (presence.py ``unmatched_change``, run for the right side against the left and, for a full join, for the
     left side against the right), all computed from the changed keys only.
  3. Output columns follow the inner join's naming rules (``on=`` keeps one key column, "_right" suffix). With
     ``on=`` the kept key columns of a padded right row hold the right row's key values, as SQL's ``USING``.
  4. Both inputs are exchanged by their keys; the two traces hold the integrated left and right inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

from dbsp_core.operators.base import empty, make
from dbsp_core.operators.join import Join, inner_change
from dbsp_core.operators.presence import Presence, PresenceState, unmatched_change

if TYPE_CHECKING:
    from dbsp_core.zset import IndexedZSet, ZSet

HOW = ("right", "full")


class OuterJoin(Join):
    """``left.right_join(right, ...)`` and ``left.full_join(right, ...)`` (``how`` = "right" or "full")."""

    def __init__(self, left: int, right: int, lschema: pa.Schema, rschema: pa.Schema,
                 left_on: Sequence[str], right_on: Sequence[str], drop_right_keys: bool, where: str,
                 how: str) -> None:
        if how not in HOW:
            raise ValueError(f"{where}: how must be one of {HOW}, got {how!r}")
        super().__init__(left, right, lschema, rschema, left_on, right_on, drop_right_keys, where)
        self.kind = f"{how}_join"
        self.how = how
        if not drop_right_keys:  # a padded right row's left key is null: rows of one key may sit anywhere
            self.partitioning = None
        nl = len(lschema)
        self.pad_types = [f.type for f in list(self.schema)[nl:]]
        # a padded right row: left columns null, except the left key columns when on= dropped the right ones
        self.fill = tuple((i, rschema.get_field_index(rk)) for i, name in enumerate(lschema.names)
                          for lk, rk in zip(self.left_on, self.right_on) if drop_right_keys and name == lk)

    def instance(self) -> "_OuterJoinState":
        return _OuterJoinState(self)

    def padded_right(self, right: "IndexedZSet", ri: np.ndarray, w: np.ndarray) -> "ZSet":
        """Right rows ``ri`` with null left columns (but the kept key columns, invariant 3) and weights ``w``."""
        if len(ri) == 0:
            return empty(self.schema)
        rows = right.zset.data.take(ri)
        fill = dict(self.fill)
        cols = [rows.column(fill[i]) if i in fill else pa.nulls(len(ri), f.type)
                for i, f in enumerate(self.lschema)]
        cols += [rows.column(p) for p in self.right_kept_pos]
        return make(pa.Table.from_arrays(cols, names=self.schema.names), w, self.schema)


class _OuterJoinState(PresenceState):
    def __init__(self, op: OuterJoin) -> None:
        super().__init__(op)  # self.presence: left rows against the right side
        self.right_presence = Presence(op.lschema, op.left_on)  # right rows against the left side
        self.left.keep_index((None,))  # each touched key's left row count in one probe (trace invariant 11)

    def parts(self, da: "IndexedZSet | None", db: "IndexedZSet | None") -> list["ZSet"]:
        op = self.op
        # both padded parts are computed before either trace takes the change (presence.py invariant 1)
        right_only = unmatched_change(self.right_presence, self.right, self.left, db, da)
        left_only = self.unmatched_left(da, db) if op.how == "full" else []
        parts = inner_change(op, self.left, self.right, da, db)
        parts.extend(op.padded_right(batch, ri, w) for batch, ri, w in right_only)
        parts.extend(op.padded_left(batch, li, w) for batch, li, w in left_only)
        return parts
