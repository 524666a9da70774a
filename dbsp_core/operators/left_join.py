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
  5. A step whose right side does not change runs in one C call (``_zset.JoinRun`` with a pad, csrc/joinrun.h
     invariant 4; join.py invariant 7's call for the inner part): the left change indexed, joined with every right
     batch, and the padded rows those pairs leave (a key whose right weights, summed over its pairs, are at most 0)
     gathered with null right columns; the same change as invariant 2's (no key flips without a right change), the
     same left trace; its output is flagged distinct when the call says no padded row met a right row and at most
     one batch gave pairs. A step that changes the right side, or whose walk would read a spilled batch, runs
     invariant 2's path; ``c_steps`` counts the steps the call served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pyarrow as pa

from dbsp_core import _zset
from dbsp_core.operators.base import concat, conform
from dbsp_core.operators.join import Join, inner_change, run_side, walked_in_memory
from dbsp_core.operators.presence import PresenceState
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import IndexedZSet

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
    C_STEP = True  # invariant 5 (tests turn it off to compare with invariant 2's path)

    def __init__(self, op: LeftJoin) -> None:
        super().__init__(op)
        self.c_steps = 0  # steps served by invariant 5's call (counts for tests, not state)
        self.run = None
        if op.stored is None:  # (a join whose traces keep only some columns, join.py invariant 6, pads in Python)
            rschema = pa.schema([pa.field(f.name, f.type) for f in op.rschema])
            nulls = pa.Table.from_arrays([pa.nulls(1, f.type) for f in rschema], schema=rschema)
            self.run = _zset.JoinRun([op.lschema.get_field_index(k) for k in op.left_on],
                                     [op.rschema.get_field_index(k) for k in op.right_on], True, None,
                                     op.right_kept_pos, op.lschema, op.schema, nulls)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        a, b = inputs
        op = self.op
        if self.run is not None and self.C_STEP and a.num_rows and not b.num_rows and not op.in_times:
            batches = walked_in_memory(self.right)
            if batches is not None:  # invariant 5
                self.c_steps += 1
                _, parts = run_side(self.run, self.left, conform(a, op.lschema), batches, True)
                out = concat([p for _, p in parts], op.schema)
                inner = sum(k < len(batches) for k, _ in parts)
                if len(parts) == 2 and inner == 1 and not self.run.pad_met:  # csrc/joinrun.h invariant 4
                    out = ZSet._make(out.data, out.weights, distinct=True, chunked=True)
                return out
        return super().step(inputs, ctx)

    def parts(self, da: "IndexedZSet | None", db: "IndexedZSet | None") -> list["ZSet"]:
        op = self.op
        unmatched = self.unmatched_left(da, db)  # before the inserts
        parts = inner_change(op, self.left, self.right, da, db)  # invariant 2, first part
        # the padded part's change (invariant 2, second part): operators/presence.py
        parts.extend(op.padded_left(batch, li, w) for batch, li, w in unmatched)
        return parts
