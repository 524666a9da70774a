"""The count-distinct operator: turns changes of a grouped column into the partial rows that move each group's ``count_distinct(column)`` by +1 or -1 when a value appears in or leaves the group.

Invariants:
  1. The state is the integral of the (group keys, value) pairs with a non-null value, indexed by the whole
     pair (keys, value), which is also the operator's exchange key: a pair lives in exactly one worker and
     moves with its shard, while one group's pairs spread over every worker (a two-phase distinct count: a
     group of a few keys, such as Nexmark q15's day, does not put all its values on one worker).
  2. A step emits, for each group, the sum of the signs of its pairs whose accumulated multiplicity crosses
     zero (0 -> positive: +1, positive -> 0 or below: -1), as one partial row of the aggregate's partial
     schema (keys, then one int64 per kernel slot) with that sum in this column's ``count_distinct`` slot and
     0 in every other slot, weight 1 (no row for a group whose signs sum to 0). The partial rows are exchanged
     by the group keys and summed by the linear aggregate with the other workers' and the other slots': since
     each pair crosses zero in one worker only, they give exactly the number of distinct non-null values per
     group under insertions and deletions alike, whatever the split into steps and workers.
  3. A step reads only the multiplicities of the change's pairs: one probe per pair in the whole-row key
     index when the pair's columns are fixed-width, else one galloping C walk per trace batch by row hash, so
     a big group costs log of its size per changed pair, not its size (Nexmark q15/q16 have a handful of
     (channel, day) groups holding 10^5-10^6 distinct values each).
  4. Equal pairs of a change may be summed by one hashing pass before the change is indexed (a pair whose weights
     sum to 0 moves no multiplicity; index_by consolidates what is not summed), so a change of many rows over few
     pairs (q15's 92K bids of a step over 2K-6K (day, bidder) pairs) sorts the pairs, not the rows. A pass that left
     more than ``PAIRS_PER_ROW`` pairs per row (q16's (channel, day, bidder): 50K of 92K) is not tried again for
     ``RETRY`` steps.
  5. The state's trace holds its low levels as distinct's does (operators/distinct.py invariant 5, trace/levels.py
     invariant 18): merged many step batches at a time while its key index serves every read (fixed-width pairs),
     two at a time otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.envvars import settings
from dbsp_core.errors import WeightOverflowError
from dbsp_core.operators.base import Operator, conform, empty, make
from dbsp_core.time.cleanup import prune
from dbsp_core.time.lineage import input_times
from dbsp_core.trace import Trace
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.operators.aggregate import Aggregate
    from dbsp_core.operators.context import StepContext


def pair_key(keys: tuple[str, ...], column: str) -> tuple[str, ...]:
    """The exchange and trace key of a count distinct of ``column`` grouped by ``keys``: the whole (keys, value)
    pair (invariant 1), the value's column once even when it is also a group key."""
    return tuple(dict.fromkeys(tuple(keys) + (column,)))


class CountDistinct(Operator):
    """The distinct-value flips of ``column`` per group of ``agg``, as partial rows for ``agg`` (invariant 2)."""

    kind = "count_distinct"
    split_safe = True  # base.py invariant 6 (invariant 2: the same counts whatever the split into steps)

    def __init__(self, node: int, in_schema: pa.Schema, agg: "Aggregate", column: str) -> None:
        super().__init__((node,), agg.pschema, pair_key(agg.keys, column))
        self.keys = agg.keys
        self.column = column
        self.vschema = pa.schema([pa.field(k, in_schema.field(k).type) for k in self.partitioning])
        self.slot = agg.kernel.index(("count_distinct", column))
        self.nslots = len(agg.kernel)

    def instance(self) -> "_CountDistinctState":
        return _CountDistinctState(self)


class _CountDistinctState:
    HOLD: int | None = None  # the trace's ``hold`` (invariant 5); None: ``DBSP_TOTALS_HOLD``'s (tests set it)
    PAIRS_PER_ROW = 0.5  # a change that sums to more pairs per row than this is not summed for RETRY steps
    RETRY = 16

    def __init__(self, op: CountDistinct) -> None:
        self.op = op
        # steps left before equal pairs are summed again (invariant 4): of the step's change, and of what a fused
        # exchange sends (counters that steer cost, not state: any value gives the same results)
        self._sum_skip = self._send_skip = 0
        self.keys = list(op.keys)
        self.pair = list(op.partitioning)
        self.values = Trace(op.vschema, op.partitioning)
        self.values.keep_index((None,), on="row")  # each pair's multiplicity in one probe (trace invariant 11)
        self.values.hold = settings().totals_hold if self.HOLD is None else self.HOLD  # (invariant 5)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"values": self.values}

    def pairs(self, z: "ZSet", sender: bool = False) -> "ZSet | None":
        """The change's (keys, value) pairs with a non-null value, equal pairs summed and zero sums dropped when that
        pays (invariant 4); None when none is left. A fused exchange (dbsp_core/runtime/plan.py) sends these
        (``sender``: its own tries)."""
        op = self.op
        data = z.data.select(self.pair)
        w = z.weights
        if data.column(op.column).null_count:
            valid = pc.is_valid(data.column(op.column))
            mask = np.asarray(valid.to_numpy(zero_copy_only=False), dtype=bool)
            data, w = data.filter(valid), w[mask]
        if not data.num_rows:
            return None
        rows = conform(make(data, w, op.vschema), op.vschema)
        attr = "_send_skip" if sender else "_sum_skip"
        skip = getattr(self, attr)
        if skip:  # the last try kept most rows: not summed (index_by consolidates them all the same)
            setattr(self, attr, skip - 1)
            return rows
        # equal pairs summed first, by hashing: the sort of index_by (or the exchange) then sees each pair once
        pairs = rows._distinct_unsorted()
        if pairs.num_rows > self.PAIRS_PER_ROW * rows.num_rows:
            setattr(self, attr, self.RETRY)
        return pairs if pairs.num_rows else None

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        op = self.op
        prune(self, input_times(op), ctx)  # state no later change can reach (dbsp_core.time.cleanup)
        z = inputs[0]
        pairs = self.pairs(z) if z.num_rows else None
        if pairs is None:
            return empty(op.schema)
        return self._flips(pairs.index_by(self.pair))

    def _flips(self, dix) -> "ZSet":
        op = self.op
        try:  # each pair's accumulated multiplicity before this step, and the change into the trace
            old = self.values.match_and_insert(dix)
        except WeightOverflowError:
            raise WeightOverflowError(f"{op.label}: a value's accumulated multiplicity overflows int64") from None
        new = old + dix.zset.weights
        flip = np.flatnonzero((old > 0) != (new > 0))
        if len(flip) == 0:
            return empty(op.schema)
        idx = pa.array(flip, pa.int64())
        keys = dix.zset.data.select(self.keys).take(idx)
        sign = np.where(new[flip] > 0, 1, -1).astype(np.int64)
        if len(flip) > 1:  # invariant 2: one partial row per group, the sum of its signs, before the exchange
            nk = len(self.keys)
            flips = ZSet._make(keys.append_column(_SIGN, pa.array(sign)), np.ones(len(flip), dtype=np.int64))
            summed = flips.aggregate(self.keys, [("sum", _SIGN)], consolidate=False)
            sums = summed.column(nk).to_numpy()
            moved = np.flatnonzero(sums)
            if len(moved) < len(sums):
                summed = summed.take(pa.array(moved, pa.int64()))
                sums = sums[moved]
            if len(sums) == 0:
                return empty(op.schema)
            keys, sign = summed.select(self.keys), np.ascontiguousarray(sums, dtype=np.int64)
        n = keys.num_rows
        zeros = pa.array(np.zeros(n, dtype=np.int64))
        cols = list(keys.columns) + [pa.array(sign) if j == op.slot else zeros for j in range(op.nslots)]
        return make(pa.Table.from_arrays(cols, schema=op.schema), np.ones(n, dtype=np.int64), op.schema)


_SIGN = "__dbsp_sign"  # the flips' sign column while they are summed per group (never a column of the output)
