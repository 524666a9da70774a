"""The left outer join operator: incremental inner equi-join plus every left row without a match, padded with nulls.

Invariants:
  1. After every step, integral(output) == L LEFT JOIN R over the integrated inputs: each left row once per
     matching right row, or once with null right columns when its key has no right rows (a key "has right
     rows" when their weights sum to more than 0; a null key never matches).
  2. A step emits the inner join's change (as the join operator does) and the change of the padded part:
     padded new left rows whose key has no right rows after the step, and, for every key whose right side
     turns empty (or non-empty) in this step, the old left rows of that key padded with weight +1 (or -1).
  3. Both inputs are exchanged by their keys; the traces hold the integrated left and right inputs, and the
     right side's per-key row counts before and after the step come from one grouping pass over the rows
     of the touched keys.
  4. Output columns follow the inner join's naming rules (``on=`` keeps one key column; "_right" suffix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

from dbsp_core.operators.base import concat, conform, empty, make
from dbsp_core.operators.join import Join
from dbsp_core.trace import Trace, unique_sorted

if TYPE_CHECKING:
    from dbsp_core.runtime.context import StepContext
    from dbsp_core.zset import IndexedZSet, ZSet

OLD = "__dbsp_old__"


class LeftJoin(Join):
    """``left.left_join(right, ...)``: the inner join plus unmatched left rows padded with nulls."""

    kind = "left_join"

    def __init__(self, left: int, right: int, lschema: pa.Schema, rschema: pa.Schema,
                 left_on: Sequence[str], right_on: Sequence[str], drop_right_keys: bool, where: str) -> None:
        super().__init__(left, right, lschema, rschema, left_on, right_on, drop_right_keys, where)
        self.kind = "left_join"
        nl = len(lschema)
        self.pad_types = [f.type for f in list(self.schema)[nl:]]
        self.keyschema = pa.schema([pa.field(k, rschema.field(k).type) for k in self.right_on])

    def instance(self) -> "_LeftJoinState":
        return _LeftJoinState(self)

    def padded(self, left: "IndexedZSet", li: np.ndarray, w: np.ndarray) -> "ZSet":
        """Left rows ``li`` with null right columns and weights ``w``."""
        if len(li) == 0:
            return empty(self.schema)
        cols = list(left.zset.data.take(li).columns) + [pa.nulls(len(li), t) for t in self.pad_types]
        return make(pa.Table.from_arrays(cols, schema=self.schema), w, self.schema)

    def keys_with_weights(self, keys: pa.Table, weights: np.ndarray) -> "IndexedZSet":
        """A Z-set of right-key tuples, indexed by the right key, for matching left rows with the join kernel."""
        return make(keys.select(list(self.right_on)), weights, self.keyschema).index_by(list(self.right_on))


class _LeftJoinState:
    def __init__(self, op: LeftJoin) -> None:
        self.op = op
        self.left = Trace(op.lschema, op.left_on)
        self.right = Trace(op.rschema, op.right_on)
        self.counts_schema = pa.schema(list(op.rschema) + [pa.field(OLD, pa.int64())])

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"left": self.left, "right": self.right}

    def _with_old(self, z: "ZSet", old: bool) -> "ZSet":
        flag = np.full(z.num_rows, 1 if old else 0, dtype=np.int64)
        return make(z.data.append_column(OLD, pa.array(flag)), z.weights, self.counts_schema)

    def _right_counts(self, hashes: np.ndarray, db: "IndexedZSet | None") -> pa.Table | None:
        """Per touched right key: its right row count after the step and before it (invariant 3)."""
        old = [self._with_old(b.zset, True) for b in self.right.lookup(hashes)]
        new = [self._with_old(db.zset, False)] if db is not None and len(db) else []
        rows = concat(old + new, self.counts_schema)
        if rows.num_rows == 0:
            return None
        ix = rows.index_by(list(self.op.right_on))
        return ix.reduce([("count", None), ("sum", OLD)])

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
        hashes = [x.key_hash for x in (da, db) if x is not None]
        touched = np.unique(np.concatenate(hashes)) if len(hashes) > 1 else unique_sorted(hashes[0])
        counts = self._right_counts(touched, db)
        parts = []
        # the inner join's change (invariant 2, first part)
        if db is not None:
            self.right.insert(db)
        if da is not None:
            for batch in self.right.lookup(unique_sorted(da.key_hash), 4.0):
                parts.append(op.pairs(da, batch))
        if db is not None:
            for batch in self.left.lookup(unique_sorted(db.key_hash), 4.0):
                parts.append(op.pairs(batch, db))
        nk = len(op.right_on)
        new_n = counts.column(nk).to_numpy() if counts is not None else np.zeros(0, dtype=np.int64)
        old_n = counts.column(nk + 1).to_numpy() if counts is not None else np.zeros(0, dtype=np.int64)
        # old left rows of keys whose right side turns empty (+1) or non-empty (-1)
        flip = np.where((old_n > 0) & (new_n <= 0), 1, np.where((old_n <= 0) & (new_n > 0), -1, 0))
        if counts is not None and flip.any():
            sel = np.flatnonzero(flip)
            flips = op.keys_with_weights(counts.take(pa.array(sel)), flip[sel].astype(np.int64))
            for batch in self.left.lookup(unique_sorted(flips.key_hash)):
                li, _ri, w = batch.join(flips)
                parts.append(op.padded(batch, li, w))
        # new left rows whose key has no right rows after the step
        if da is not None:
            present = np.flatnonzero(new_n > 0)
            if len(present):
                keys = op.keys_with_weights(counts.take(pa.array(present)), np.ones(len(present), dtype=np.int64))
                li, ri, w = da.join(keys, left_outer=True)
                miss = ri < 0
                parts.append(op.padded(da, li[miss], w[miss]))
            else:
                parts.append(op.padded(da, np.arange(len(da), dtype=np.int64), da.zset.weights))
            self.left.insert(da)
        return concat(parts, op.schema)
