"""The distinct operator: turns a bag into a set (every row with positive multiplicity once), incrementally.

Invariants:
  1. After every step, integral(output) == {row: 1 for rows with integral(input)[row] > 0}; rows with
     zero or negative accumulated weight are absent. Row identity treats null as equal to null.
  2. The trace holds the integral of the input, indexed by all columns; a step reads only the weights of
     the change's rows, one probe each into the trace's key index, which also stores their new weights
     (trace invariant 11, Trace.match_and_insert; for rows with string columns, a galloping C walk over each
     trace batch), so its cost grows with the change, and emits +1 for rows that become positive, -1 for rows
     that stop being positive, consolidated.
  3. The input is exchanged by all columns, so each row's whole history lives in one worker (at W > 1 a fused
     exchange sends the change indexed, :meth:`_DistinctState.index_change`, and the step merges what it received,
     :meth:`_DistinctState.step_indexed`: the same index, dbsp_core/runtime/plan.py design note 4).
  4. Rows whose time columns (dbsp_core/time lineage) are below their bounds are dropped from the trace: no later
     change can carry them.
  5. The trace holds its low levels (``hold``, ``DBSP_TOTALS_HOLD``, trace/levels.py invariant 18): while its key
     index serves every read, it merges a low level's step batches many at a time instead of two, so each row is
     rewritten about once per few levels (measured: 1k-row steps into 1M rows, hold 8, instructions a step -11% mean,
     -17% median). Without a current index (rows the index does not hold) or under a batch store it merges two at a
     time, as every trace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dbsp_core.envvars import settings
from dbsp_core.errors import WeightOverflowError
from dbsp_core.operators.base import Operator, conform, empty, keyed_change
from dbsp_core.time.cleanup import prune
from dbsp_core.time.lineage import input_times
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet, ZSet, _take

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext


class Distinct(Operator):
    """``s.distinct()``."""

    kind = "distinct"
    split_safe = True  # base.py invariant 6 (invariant 1: a function of the integrated input)
    in_times: tuple = ()  # time lineage of the input, set by the circuit when there is one (dbsp_core.time)

    def __init__(self, node: int, schema: pa.Schema) -> None:
        super().__init__((node,), schema, tuple(schema.names))

    def instance(self) -> "_DistinctState":
        return _DistinctState(self)


class _DistinctState:
    HOLD: int | None = None  # the trace's ``hold`` (invariant 5); None: ``DBSP_TOTALS_HOLD``'s (tests set it)

    def __init__(self, op: Distinct) -> None:
        self.op = op
        self.schema = op.schema
        self.cols = list(op.schema.names)
        self.trace = Trace(op.schema, tuple(self.cols))
        self.trace.keep_index((None,), on="row")  # each row's weight in one probe (trace invariant 11)
        self.trace.hold = settings().totals_hold if self.HOLD is None else self.HOLD  # (invariant 5)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"input": self.trace}

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        dix = keyed_change(self, inputs, ctx, self.schema, self.cols)  # pruned first: invariant 4
        return self._step_indexed(dix)

    def index_change(self, z: ZSet) -> IndexedZSet | None:
        """A fused exchange's half of a step (invariant 3 at W > 1, runtime/plan.py ``_IndexedChangeExchange``): the
        change indexed by every column, as :meth:`step` indexes it, which the exchange cuts into runs of shards; None
        when it has no rows."""
        if z.num_rows == 0:
            return None
        dix = conform(z, self.schema).index_by(self.cols)
        return dix if len(dix) else None

    def step_indexed(self, dix: IndexedZSet | None, ctx: "StepContext") -> "ZSet":
        """The step over a change already indexed by every column (:meth:`index_change` on the senders, their runs
        merged): the trace's unreachable rows dropped first (invariant 4), as :meth:`step` drops them."""
        prune(self, input_times(self.op), ctx)
        return self._step_indexed(dix if dix is not None and len(dix) else None)

    def _step_indexed(self, dix: IndexedZSet | None) -> "ZSet":
        if dix is None:
            return empty(self.schema)
        try:  # each changed row's accumulated weight before this step, and the change into the trace
            old = self.trace.match_and_insert(dix)
        except WeightOverflowError:
            raise WeightOverflowError("distinct: a row's accumulated weight overflows int64") from None
        new = old + dix.zset.weights
        flip = np.flatnonzero((old > 0) != (new > 0))
        if len(flip) == 0:
            return empty(self.schema)
        # the flipped rows keep dix's order, which is canonical (the key is the whole row, so the key hash is
        # the row hash): the output is consolidated as it stands
        w = np.where(new[flip] > 0, 1, -1).astype(np.int64)
        # one C gather through the view the key index's add built (zset._take: every row flipped, dix's own rows)
        return ZSet._make(_take(dix.zset.data, flip, dix._view()), w, consolidated=True, rhash=dix.key_hash[flip],
                          chunked=True)
