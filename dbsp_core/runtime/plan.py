"""The step plan: a worker's copy of a circuit lowered, when the pipeline is built, to the calls one step makes, with chains of operators fused into one call where a fused form exists.

Design notes (where the plan goes; what is built today is marked **built**, the rest is the design the next
slices follow, in this order):

  1. Lowering. When an executor builds a worker (embedded: ``_Worker``, at start and at every layout change; staged:
     a stage task, once per stage), the live nodes of the circuit, in id order, are lowered to a list of calls over
     the worker's operator instances. A call covers one node (today's path: the operator's ``step``) or a fused
     chain: a run of nodes with one consumer each whose intermediate Z-sets nobody else reads. **Built**: the
     lowering, per-node calls, and one fused chain (note 4).
  2. The native interpreter. The target form of a plan is a program of a small instruction set (filter by a
     compiled predicate, project/gather columns, index, partition for an exchange, trace lookup / fold / insert,
     emit) over column buffers in C-owned scratch memory, run by one C call per step (``dbsp_plan_run``) that
     releases the GIL once: Arrow record batches cross into C at the inputs and out of C at the outputs and at
     nodes that stay in Python, never between fused operators. Chains of stateless linear operators (filter,
     select, map, negate, plus) fuse into one pass over the change's buffers; keyed operators (aggregate, join,
     distinct) call their trace operations (lookup, fold into the totals kept per key, insert) from C, as
     ``linear_step`` already does for one operator. Not built: every fused chain still enters C once per
     kernel and builds Arrow objects between kernels of one operator.
  3. What stays in Python: building and validating circuits, lowering, operators that run user code (flat_map,
     UDF-like expressions pyarrow evaluates), the boundary (pushes, division, the output log, checkpoints,
     rollback on a StepError), and every node the plan does not cover: such a node is a call of today's
     ``step`` and the plan hands it Arrow Z-sets, so a plan is correct for any circuit whatever it fuses.
  4. **Built**: the linear group-by chain ``PreAggregate -> [Exchange] -> Aggregate`` whose aggregates are counts
     and int64 sums (``Aggregate.int_slots``), on a worker whose exchange is the identity (W = 1). The
     aggregate reads the change's own rows (keys and value columns in place, a shared column of ones for
     counts) in one C call that groups, probes the key index of its totals and stores the new totals
     (``_zset.linear_step``), and finalizes its output from the slot values (``Aggregate.finalize_ints``)
     without the partial-row table, the combiner's call, nor a table of slots. A step it cannot serve (a value
     or count column with nulls, a trace without a current key index) runs the chain unfused, as before.
     The exchange: at W > 1 a fused chain ends at the exchange's partition (the C partition kernel fills the
     other workers' mailboxes) and the receiving worker's chain starts after its barrier; on Spark each stage
     is one plan, so a stage task crosses into C once per stage.
  5. State stays where the runtime finds it: a plan holds no state of its own, only the operator instances'
     traces, which it reads and writes through the same Trace methods (insert, lookup, key index). So
     checkpoints (snapshot by shard), rollback (rollback.py copies the instances' attributes), live rescale
     (migrate.py moves traces by shard, then the executor rebuilds its workers and so their plans: a plan is
     lowered for one layout) and spilled traces all see the state they see today. Spilled, file-backed
     traces (dbsp_core/trace/: batches in files read through a cache) stay behind the Trace interface: a
     native trace operation reads a batch through its memory view, which the cache pins for the call, and a
     lookup into the totals kept per key (the key index) never walks the levels; a plan never assumes a
     batch is in memory.
  6. Proof of equality: a fused call must produce exactly the Z-set of the chain it replaces (multiset equal
     after consolidation) and leave the same state. The DuckDB-checked suites (tests/core, tests/sql,
     tests/nexmark) run with the plan on (the default), and tests/core/test_step_plan.py runs random circuits
     over random splits into steps with the plan on and off (``EmbeddedExecutor(step_plan=False)``, or
     ``DBSP_STEP_PLAN=0``) and compares outputs step by step, asserting through :attr:`StepPlan.counts` that
     the fused path ran.

Invariants (enforced here):
  1. A plan has one call per live node, in id order (the timers and ``failed_node`` index calls as nodes); a
     fused chain's inner calls pass their input through unchanged, and only the chain's last node computes.
  2. A chain is fused only when every inner node has exactly one consumer, is no output, and (an exchange) is
     the identity on this worker's layout; a plan is lowered again whenever the layout changes.
  3. Per step, a fused call either serves the whole chain or changes nothing and runs the chain's own steps
     (``counts["fused"]`` / ``counts["unfused"]`` count which).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pyarrow as pa

from dbsp_core.circuit import Circuit
from dbsp_core.operators.aggregate import Aggregate, PreAggregate, _LinearState
from dbsp_core.operators.base import conform
from dbsp_core.operators.exchange import Exchange
from dbsp_core.zset import ZSet

__all__ = ["StepPlan"]

Call = tuple[Callable[[list, Any], Any], tuple, int]


def _passthrough(inputs: list, ctx: Any) -> Any:
    """An inner call of a fused chain (invariant 1): the chain's input, untouched."""
    return inputs[0]


class _LinearGroupBy:
    """The fused linear group-by chain (design note 4): ``pre`` -> [identity exchange] -> ``agg``, run as ``agg``'s call
    over the rows that reach ``pre``."""

    def __init__(self, pre: PreAggregate, agg: Aggregate, state: _LinearState, counts: dict[str, int]) -> None:
        self.pre, self.agg, self.state, self.counts = pre, agg, state, counts
        schema = agg.in_schema
        self.keypos = tuple(schema.get_field_index(k) for k in agg.keys)
        ncols = len(schema)
        # per kernel slot: the input column it sums (a count, of rows or of a column without nulls: the column of
        # ones appended at position ncols; a sum: its int64 column)
        self.slotpos = tuple(schema.get_field_index(col) if kind == "sum" else ncols for kind, col in agg.kernel)
        self.checked = tuple(sorted({col for kind, col in agg.kernel if col is not None}))  # nulls unfuse a step
        self.ones: pa.Array = pa.array(np.ones(1024, dtype=np.int64))

    def _ones(self, n: int) -> pa.Array:
        if len(self.ones) < n:
            self.ones = pa.array(np.ones(max(n, 2 * len(self.ones)), dtype=np.int64))
        return self.ones.slice(0, n)

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        z = inputs[0]
        if z.num_rows:
            z = conform(z, self.agg.in_schema)
            data = z.data
            if not any(data.column(c).null_count for c in self.checked):
                rows = ZSet._make(data.append_column("__dbsp_ones", self._ones(z.num_rows)), z.weights)
                out = self.state.step_rows(rows, self.keypos, self.slotpos, ctx)
                if out is not None:
                    self.counts["fused"] += 1
                    return out
        self.counts["unfused"] += 1  # invariant 3: the chain's own steps (the exchange is the identity)
        return self.state.step([self.pre.step([z], ctx)], ctx)


class StepPlan:
    """The calls of one worker's step (the module docstring): ``calls`` as ``dbsp_core.profile.run_nodes`` takes
    them, and ``counts`` of the steps fused chains served (``"fused"``) or left to their nodes (``"unfused"``)."""

    def __init__(self, circuit: Circuit, live: list[int], instances: dict[int, Any], workers: int,
                 fuse: bool = True) -> None:
        nodes = circuit.nodes
        self.counts = {"fused": 0, "unfused": 0}
        self.fused_nodes: list[int] = []  # the last node of each fused chain
        steps: dict[int, Callable] = {i: instances[i].step for i in live}
        if fuse:
            for agg, pre in self._linear_groupbys(circuit, live, instances, workers):
                chain = _LinearGroupBy(nodes[pre], nodes[agg], instances[agg], self.counts)
                for j in self._between(circuit, pre, agg):
                    steps[j] = _passthrough
                steps[agg] = chain
                self.fused_nodes.append(agg)
        self.calls: list[Call] = [(steps[i], nodes[i].inputs, i) for i in live]

    @staticmethod
    def _between(circuit: Circuit, pre: int, agg: int) -> set[int]:
        """The inner nodes of the chain ending at ``agg``: ``pre`` and the exchange between, if any."""
        inner = {pre}
        src = circuit.nodes[agg].inputs[0]
        if src != pre:
            inner.add(src)
        return inner

    @staticmethod
    def _linear_groupbys(circuit: Circuit, live: list[int], instances: dict[int, Any], workers: int
                         ) -> list[tuple[int, int]]:
        """(aggregate, pre-aggregate) of every chain design note 4 fuses here (invariant 2)."""
        nodes = circuit.nodes
        consumers: dict[int, int] = {}
        for i in live:
            for j in nodes[i].inputs:
                consumers[j] = consumers.get(j, 0) + 1
        outputs = set(circuit.outputs.values())

        def inner(j: int) -> bool:
            return consumers.get(j, 0) == 1 and j not in outputs

        found = []
        for i in live:
            op = nodes[i]
            if not (isinstance(op, Aggregate) and isinstance(instances[i], _LinearState) and op.int_slots
                    and len(op.inputs) == 1):
                continue
            src = op.inputs[0]
            if isinstance(nodes[src], Exchange):
                if workers != 1 or not inner(src):
                    continue
                src = nodes[src].inputs[0]
            pre = nodes[src]
            if isinstance(pre, PreAggregate) and pre.agg is op and inner(src):
                found.append((i, src))
        return found
