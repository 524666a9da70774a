"""The step plan: a worker's copy of a circuit lowered, when the pipeline is built, to the calls one step makes, with chains of operators fused into one call where a fused form exists.

Design notes (where the plan goes; what is built today is marked **built**, the rest is the design the next
slices follow, in this order):

  1. Lowering. When an executor builds a worker (embedded: ``_Worker``, at start and at every layout change; staged:
     a stage task, once per stage), the live nodes of the circuit, in id order, are lowered to a list of calls over
     the worker's operator instances. A call covers one node (today's path: the operator's ``step``) or a fused
     chain: a run of nodes with one consumer each whose intermediate Z-sets nobody else reads. **Built**: the
     lowering, per-node calls, and the fused chains of note 4.
  2. The native interpreter. The target form of a plan is a program of a small instruction set (filter by a
     compiled predicate, project/gather columns, index, partition for an exchange, trace lookup / fold / insert,
     emit) over column buffers in C-owned scratch memory, run by one C call per step (``dbsp_plan_run``) that
     releases the GIL once: Arrow record batches cross into C at the inputs and out of C at the outputs and at
     nodes that stay in Python, never between fused operators. Chains of stateless linear operators (filter,
     select, map, negate, plus) fuse into one pass over the change's buffers; keyed operators (aggregate, join,
     distinct) call their trace operations (lookup, fold into the totals kept per key, insert) from C, as
     ``linear_step`` already does for one operator. **Built** for one chain: the linear group-by of note 4 at
     W = 1, its receiving aggregate at W > 1, and at W = 1 a linear group-by with avgs of int64 columns (limb slots,
     a float64 result: ``_CGroupBy``, which note 4's chain does not fuse) run their step in one C call that releases
     the GIL once (``_zset.LinearRun``, csrc/linrun.h): from the change's buffers (its keys, a count as the weights'
     sum, an int64 column's sum or limbs; a null in a counted or summed column sends the step back) through the
     grouping, the key index's probes and stores and the fold, to the trace batch's and the output Z-set's columns,
     exported as two record batches through the C data interface, with the check that says whether the output is
     distinct as it stands; its scratch is kept across steps (``counts["cstep"]``). **Built** too: an inner join
     whose inputs are Z-sets (W = 1, or exchanges not fused) runs each changed side's step in one C call that
     releases the GIL once (``_zset.JoinRun``, csrc/joinrun.h; :class:`_CJoin`, and :class:`_JoinSlots` for the
     columns a fused group-by reads): the change indexed as ``index_by`` indexes it, its pairs with every batch of
     the other side's trace (the join kernel) and each meeting's output columns gathered, exported as one record
     batch for the change's trace and one per batch met (operators/join.py invariant 7; ``counts["cjoin"]``); a
     batch store or time lineage sends the step to the join's own step. Not built: the other chains
     (and the steps around that call: the pushes, the driver, the trace's insert and merges stay in Python) enter C
     once per kernel and build Arrow objects between kernels of one operator.
     The pushes and the step's concatenation in C (the floor every small step pays; issue 37, branch r37-floor3,
     bench/history/RESULTS-2026-11-28-to-2026-12-02.md "The floor of a small step, again"): **not built**, and not as planned here, for what it was
     measured to cost. A passthrough step of 1k rows (two pushes, 410k instructions) spends ~25k in the Arrow crossing
     of its one C call (a 3-column batch exported through ``__arrow_c_array__``: ~12k the array, ~5k the schema, the
     capsules; an import back, as ``LinearRun``'s two outputs, ~15k each) and ~45k in pyarrow's own concatenation of
     the pushes (``to_batches``, ``concat_batches``, ``from_batches``, the weights' ``np.concatenate``). Pushes
     gathered in C would pay an export per push (the pushes are Arrow tables) and an import of the result: no less
     than pyarrow's concatenation. It pays only once the rows reach C without an export (a push taking buffers, or a
     ZSet holding a C view from its construction, the schema exported once per input) and leave it once (the plan's
     program of note 2 running from the inputs' buffers to the outputs). What was cut instead: the distinct check of
     integer rows (csrc/zset.c design note 7) and the per-key counters' writes to a class attribute every step, which
     dropped the method cache of ``Trace`` (trace/keyindex.py ``_PK_COUNTS``): -2.4% passthrough, -2.4% / -2.6%
     group-by count / sum.
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
     The exchange, **built** for two chains at W > 1: a fused chain ends at the exchange's call, which cuts the
     rows it sends into runs of consecutive rows per owner (``ShardMap.runs`` over rows sorted by key hash, or
     the partition kernel's permutation) and fills the mailboxes with slices of them
     (``StepContext.exchange_runs``); the receiving worker's chain starts after the barrier over the parts as
     they were cut. (a) The linear group-by: the sender groups the change in one C pass (groups come out in
     key-hash order, so the runs need no permutation) when grouping shrinks it, else gathers only the key and
     slot columns through the partition kernel's permutation; the aggregate runs one ``linear_step`` over the
     received partial rows (one call per part was measured slower: see ``_PartialsReceive``). (b) An exchange
     whose one consumer is an inner join on the exchange's key: the sender builds the index the join would
     build and sends runs of it; the join merges the sorted runs it received (csrc/merge.h) instead of the
     exchange's gather, the concatenation and a second ``index_by``. **Built**, at any W: an inner join whose one
     consumer is the linear group-by chain (``Join -> PreAggregate -> [Exchange] -> Aggregate``, the group key and
     the counted and summed columns taken from the joined columns): the join's call gathers from the join
     kernel's pairs (``da JOIN (B + db) + A JOIN db``, one part per meeting of a change with a trace batch) only the
     columns the aggregate reads (``Join.pairs`` with ``cols``), and the chain's aggregate call folds them into
     the totals per key as it folds its own input rows (``linear_step`` at W = 1, partial rows at W > 1): the
     joined rows are never built, nor indexed, nor concatenated whole. **Built** at W = 1 (issue 37), when every
     gathered column is fixed-width: the join's call hands its two inputs on and the aggregate's call runs the whole
     chain in one C call (:class:`_JoinFolded`, ``_zset.JoinLinearRun``, csrc/joinlin.h; operators/join.py invariant
     8): both changes indexed for the join's traces, their pairs found and folded straight into the totals, no
     Arrow batch of the gathered columns built between the join and the fold. Measured: 1.7% fewer instructions a
     step (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "Join folded into its group-by"): the parts it removes were small; the step's cost is
     the kernels it keeps and the Python around them. Since r37-jgb2 the folded call is told what ``LinearRun``'s is
     (``Aggregate.step_run``): whether every key of the index is dirty (``pk_found_dirty``, csrc/linrun.h invariant
     6: no probe of the dirty index for a key the index holds) and whether its totals batch may come in key-hash
     order only (``pk_keyorder``, invariant 8: no row hash per output row); it had been asked neither, so it probed
     every group and hashed every row (join then group-by, 1M rows: 1.90M -> 1.75M instructions a step; the rest
     of that step, and why it costs more than the join's: bench/history/RESULTS-2026-11-28-to-2026-12-02.md
     "Join then group-by's step against the join's"). Not built: other consumers of an exchange
     (outer joins, distinct, non-linear aggregates), which get a concatenated Z-set as before; on Spark each
     stage is to be one plan, so a stage task crosses into C once per stage. **Built**, at W > 1: an exchange
     whose one consumer is an append-only min/max aggregate that reduces its change (operators/aggregate.py
     invariant 8) reduces it on the sender, before partitioning it (``_ReducedExchange``): a group's rows cross
     workers as one row per sender (a window's max: every bid of a step to the one worker owning the window, else).
     **Built**, at any W: a hopping window whose one consumer is a linear group-by chain keyed by a window column
     (``Window(hop) -> PreAggregate -> [Exchange] -> Aggregate``): the window's call sums the combiner's partial rows
     per slice (the rows of one group-key value and one latest window), then copies each into its size / slide
     windows (``_HopSlices``, Flink's sliced window aggregation): rows are never copied per window (Nexmark q5: 4.6M
     window rows of 920K bids became 300K partial rows, the step's CPU 1.14 -> 0.5 s).
     **Built**, at W > 1: an exchange whose one consumer is a count-distinct on its (keys, value) pair sends the
     change's distinct non-null pairs, equal pairs summed (``_PairsExchange``; q15: 92K bids of a step over 2K-6K
     (day, bidder) pairs, for each of its 8 count-distincts).
     **Built**, at W > 1: an exchange whose one consumer is a min/max aggregate that projects its change
     (operators/aggregate.py invariant 9) projects it on the sender (``_ProjectedExchange``): only the keys and the
     read columns are gathered and sent (the demo's category_stats and last_hour: 2 of the join's 8 columns); when
     that exchange's input is an inner join with no other consumer, the join gathers only those columns from its
     pairs (``_JoinSlots``, as for a linear group-by: the demo's last_hour).
     **Built**, at W > 1: an exchange whose one consumer is a distinct on its whole row, or such a projecting min/max
     aggregate, sends its change indexed as the operator would index it, cut into runs of shards, as for a join
     (``_IndexedChangeExchange``); the operator merges the runs it received (``_MergedChange``: one k-way pass, the
     row hashes kept) and steps from that index (``step_indexed``): no partition and gather of the change, no
     concatenation and no ``index_by`` on the receiver (the demo's bidders_per_category, category_stats and
     last_hour).
  5. State stays where the runtime finds it: a plan holds no state of its own, only the operator instances'
     traces, which it reads and writes through the same Trace methods (insert, lookup, key index). So
     checkpoints (snapshot by shard), rollback (rollback.py copies the instances' attributes), live rescale
     (migrate.py moves traces by shard, then the executor rebuilds its workers and so their plans: a plan is
     lowered for one layout) and spilled traces all see the state they see today. Spilled, file-backed
     traces (dbsp_core/trace/: batches in files read through a cache) stay behind the Trace interface: a
     native trace operation reads a batch through its memory view, which the cache pins for the call, and a
     lookup into the totals kept per key (the key index) never walks the levels; a plan never assumes a
     batch is in memory.
     Totals kept per key (the linear aggregate's; issue 37). The key index already holds every group's totals, and
     the step reads and stores them there (``linear_step``, ``LinearRun``); the trace is read by nothing else on a
     step, yet every step inserts a batch of the changed groups' old (-1) and new (+1) totals, and every level merges
     it until old and new totals meet (1k-row steps into 100k groups: ~14k merge input rows a step, 1.2-2.4M of a
     3.3-4.5M-instruction step). The target: the index is the state and the trace a view of it, written only when
     something reads it. Design: (a) the step stores into the index and appends its changed keys (no rows) to a
     dirty set; (b) the trace is brought up to date from the index on demand, one batch per sync: the dirty keys'
     new totals (+1, from the index's slots) and the totals the trace holds for them (-1, from the slots as of the
     last sync, kept beside the dirty set by the first step that touched each key), consolidated, key-hash sorted,
     inserted as any batch; (c) a sync runs before every reader of the trace sees it: a checkpoint (``parts``), a
     shard cut or rescale (``shard``, ``replace``, migrate.py), a view or a walk (``_read``), a drop_below, a
     BatchStore's enforce (the index stays in memory, spill.py invariant 17: its bytes count), and a rollback
     capture (rollback.py copies attributes; the index is written in place by the step, so a capture must either
     sync and mark the index stale, or the C step must keep an undo log of the slots it overwrote); (d) the index
     can no longer be dropped quietly (trace invariant 11's size limits, an overflow, DBSP_KEY_INDEX=0): a drop
     syncs first, and the trace then serves as today. What (a)-(d) buy: no per-step batch and no merges between
     syncs; a sync costs the dirty keys (at most the state) once, at the cadence of checkpoints. **Built** instead
     (the part that is safe today): the merges amortized, trace invariant 18 (``Trace.hold``, ``DBSP_TOTALS_HOLD``):
     the totals trace's low levels merge up to 8 step batches at a time (one k-way pass) while its key index serves
     its reads: its merge input rows halve (13.9k -> 6.7k a step) with the content, and so every reader above,
     unchanged; but a k-way pass costs ~2x a two-way one a row (and hashes more rows: the batches keep no row
     hashes), so a step's instructions fell ~9% (4.18M -> 3.79M over 400 steps), not the merges' half. **Built**
     since (branch r37-perkey; the default since r37-perkey-on2, ``DBSP_TOTALS_PER_KEY=0`` turns it off): (a)-(d) as
     trace invariant 19 (trace/levels.py, ``PerKeyTotals`` in trace/keyindex.py). The dirty set is a second key
     index (a count per key) plus the recorded old totals (the step batch's -1 rows of keys not dirty yet, which the
     C call builds anyway);
     the sync is ``_levels``' (every reader's) first act. (c)'s rollback takes the undo log, in Python: a capture
     marks the trace, and while a mark lives every in-place change of its indexes is logged (the step's store is
     +batch of its old and new totals, so its undo is -batch), undone newest first by the restore (rollback.py
     invariant 3). (d): without a batch store only (joining one syncs and turns it off); an index dropped for size
     or memory half way through a step with dirty keys raises a DbspError (state lost) instead of syncing, since its
     totals are then partly written: the C step does not yet record its slots' old values before a failing store.
     Measured (bench/history/RESULTS-2026-11-28-to-2026-12-02.md "Totals kept per key"): 2.62M instructions a step against main's 4.08M (p99 2.83M
     against 21.33M), p50 +13% (the dirty-key probe); a sync costs its dirty keys once. The default since 2026-12-01.
     Since r37-jgb the one-call steps (``LinearRun``, ``JoinLinearRun``) probe the dirty keys themselves, once per
     group before they store (csrc/linrun.h invariant 5), and ``store_totals`` takes their answers instead of
     probing each row of the batch from Python (group_by, 1M rows / 100k groups: 2.31M -> 2.15M instructions a
     step).
  6. Proof of equality: a fused call must produce exactly the Z-set of the chain it replaces (multiset equal
     after consolidation) and leave the same state. The DuckDB-checked suites (tests/core, tests/sql,
     tests/nexmark) run with the plan on (the default), and tests/core/test_step_plan.py runs random circuits
     over random splits into steps with the plan on and off (``EmbeddedExecutor(step_plan=False)``, or
     ``DBSP_STEP_PLAN=0``) and compares outputs step by step, asserting through :attr:`StepPlan.counts` that
     the fused path ran.

Invariants (enforced here):
  1. A plan has one call per live node, in id order (the timers and ``failed_node`` index calls as nodes); a
     fused chain's inner calls pass their input through unchanged (a folded join: its two inputs, as one
     :class:`_JoinPair`), and only the chain's last node computes, but for a fused exchange (it cuts, reduces or
     projects what it sends), a fused join (it gathers the aggregate's columns) and a sliced hopping window (it sums
     the combiner's partial rows).
  2. A chain is fused only when every inner node has exactly one consumer and is no output; an inner exchange is
     skipped only where it is the identity (W = 1), at W > 1 it is the chain's fused exchange, on the key of the
     chain's last node. At W = 1 every exchange, inner or not, is lowered to a pass-through call. A plan is lowered for one layout, and again whenever the layout changes (every worker
     then reaches every exchange's barrier, fused or not, once a step).
  3. Per step, a fused call either serves the whole chain or changes nothing and runs the chain's own steps
     (``counts["fused"]`` / ``counts["unfused"]`` count which); a W > 1 fused exchange always sends parts of the
     form its receiver reads (partial rows, or runs of an index), whichever way it built them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core import _zset
from dbsp_core.circuit import Circuit
from dbsp_core.errors import WeightOverflowError
from dbsp_core.operators.aggregate import Aggregate, PreAggregate, _ExtremesState, _LinearState
from dbsp_core.operators.base import concat, conform
from dbsp_core.operators.count_distinct import CountDistinct, _CountDistinctState
from dbsp_core.operators.distinct import Distinct, _DistinctState
from dbsp_core.operators.exchange import Exchange
from dbsp_core.operators.join import Join, _JoinState
from dbsp_core.operators.window import Window
from dbsp_core.zset import IndexedZSet, ZSet, merge_cursor, merged

__all__ = ["StepPlan"]

Call = tuple[Callable[[list, Any], Any], tuple, int]


def _passthrough(inputs: list, ctx: Any) -> Any:
    """An inner call of a fused chain (invariant 1): the chain's input, untouched."""
    return inputs[0]


class _RowsOfSlots:
    """A linear aggregate's input rows as the values of its kernel slots, without building partial rows: the rows
    with a column of ones appended (keys at ``keypos``; per slot, the column it sums at ``slotpos``: a count's
    ones, a sum's int64 column), as PreAggregate.rowwise would sum them. ``schema``: the rows' (the aggregate's
    input schema, or the columns of it a fused join gathers, :class:`_JoinSlots`)."""

    def __init__(self, agg: Aggregate, pre: PreAggregate, schema: pa.Schema | None = None) -> None:
        self.agg, self.pre = agg, pre
        self.schema = schema = agg.in_schema if schema is None else schema
        self.keypos = tuple(schema.get_field_index(k) for k in agg.keys)
        ncols = len(schema)
        self.partial = schema is pre.schema  # the rows are partial rows already (:class:`_HopSlices`)
        if self.partial:  # a partial row's slot j sums its column p_j (no nulls: the combiner fills them)
            self.slotpos = tuple(range(len(agg.keys), ncols))
            self.checked: tuple = ()
        else:
            # per kernel slot: the input column it sums (a count, of rows or of a column without nulls: the column
            # of ones appended at position ncols; a sum: its int64 column)
            self.slotpos = tuple(schema.get_field_index(col) if kind == "sum" else ncols for kind, col in agg.kernel)
            self.checked = tuple(sorted({col for kind, col in agg.kernel if col is not None}))  # nulls unfuse
        self.ones: pa.Array = pa.array(np.ones(1024, dtype=np.int64))

    def _ones(self, n: int) -> pa.Array:
        if len(self.ones) < n:
            self.ones = pa.array(np.ones(max(n, 2 * len(self.ones)), dtype=np.int64))
        return self.ones.slice(0, n)

    def of(self, z: ZSet) -> ZSet | None:
        """``z`` (with rows) as slot values; None when a counted or summed column has a null."""
        z = conform(z, self.schema)
        if self.partial:
            return z
        data = z.data
        if any(data.column(c).null_count for c in self.checked):
            return None
        return ZSet._make(data.append_column("__dbsp_ones", self._ones(z.num_rows)), z.weights)

    def partials(self, z: ZSet, ctx: Any) -> ZSet:
        """The combiner's partial rows of ``z`` (a step the fused path cannot serve): PreAggregate's step over the
        aggregate's input rows, its ``rowwise`` over the columns a fused join gathered (it reads them by name),
        ``z`` itself when it is partial rows."""
        if self.partial:
            return conform(z, self.schema)
        if self.schema is self.agg.in_schema:
            return self.pre.step([z], ctx)
        return self.pre.rowwise(conform(z, self.schema)) if z.num_rows else self.pre.step([z], ctx)


class _HopSlices:
    """The hopping window's call in a fused chain ``Window(hop) -> PreAggregate -> [Exchange] -> linear Aggregate``
    (design note 4): the window's rows as the combiner's partial rows, by slices (as Flink's sliced window
    aggregates). A row with time t is in the n = size / slide windows that start at ``last - k * slide``
    (0 <= k < n; ``last``: the largest multiple of slide at most t), so every row of one slice (the same input
    values of the group keys and the same ``last``) is in the same n windows: the combiner sums each slice once,
    over the rows in their latest window only (``Window.assign(latest=True)``: no copy of a row), and each slice's
    partial row is then copied into its n windows, its window columns moved back by ``k * slide``. The copies sum
    in the aggregate to the totals of the copied rows (a partial row with weight w stands for w times its values),
    so the output and the state are the unfused chain's; the rows copied n times are the slices', not the rows'."""

    def __init__(self, win: Any, pre: PreAggregate, counts: dict[str, int]) -> None:
        self.win, self.pre, self.counts = win, pre, counts
        self.n = win.size // win.slide
        names = pre.schema.names
        # the partial rows' window columns: (position, offset of the column from window_start)
        self.moved = [(names.index(c), off) for c, off in ((win.start, 0), (win.end, win.size))
                      if c is not None and c in pre.agg.keys]

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        self.counts["sliced"] += 1
        slices = self.pre.step([self.win.assign(inputs[0], latest=True)], ctx)
        m = slices.num_rows
        if m == 0:
            return slices
        n, data = self.n, slices.data
        rows = np.repeat(np.arange(m, dtype=np.int64), n)
        back = np.tile(np.arange(n, dtype=np.int64), m) * self.win.slide
        cols = list(data.take(pa.array(rows)).columns)
        for pos, off in self.moved:  # every window column is window_start plus its offset
            col = data.column(pos)
            start = pc.cast(col, pa.int64()).to_numpy() - off
            cols[pos] = pa.array(start[rows] - back + off, pa.int64()).cast(col.type)
        return ZSet._make(pa.Table.from_arrays(cols, schema=self.pre.schema), slices.weights[rows])


class _LinearGroupBy:
    """The fused linear group-by chain (design note 4): ``pre`` -> [identity exchange] -> ``agg``, run as ``agg``'s call
    over the rows that reach ``pre``: in one C call (``_zset.LinearRun``, design note 2: :meth:`_LinearState.step_run`)
    when it serves the step, else through ``linear_step`` and Python (:meth:`_LinearState.step_rows`), else the chain's
    own steps."""

    C_STEP = True  # the one-call step (tests turn it off to compare with the path before it)

    def __init__(self, pre: PreAggregate, agg: Aggregate, state: _LinearState, counts: dict[str, int],
                 schema: pa.Schema | None = None) -> None:
        self.pre, self.agg, self.state, self.counts = pre, agg, state, counts
        self.rows = _RowsOfSlots(agg, pre, schema)
        self.run = self._linear_run(self.rows, agg, state) if self.C_STEP else None

    @staticmethod
    def _linear_run(rows: _RowsOfSlots, agg: Aggregate, state: _LinearState) -> Any:
        """The chain's one-call step over the rows as they reach it (their columns at ``rows``' positions): per kernel
        slot a count of weights or an int64 column's sum; per aggregate its slot, a sum null where its non-null count
        is 0 (:meth:`Aggregate.finalize_ints`)."""
        specs, shown, nonnull, checked = _run_slots(rows, agg)
        return _zset.LinearRun(list(rows.keypos), specs, shown, nonnull, agg.output_keys, state.pschema, agg.schema,
                               checked)

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        z = inputs[0]
        if z.num_rows and self.run is not None:
            out = self.state.step_run(conform(z, self.rows.schema), self.run, ctx)
            if out is not None:
                self.counts["fused"] += 1
                self.counts["cstep"] += 1
                return out
        if z.num_rows:
            rows = self.rows.of(z)
            if rows is not None:
                out = self.state.step_rows(rows, self.rows.keypos, self.rows.slotpos, ctx)
                if out is not None:
                    self.counts["fused"] += 1
                    return out
        self.counts["unfused"] += 1  # invariant 3: the chain's own steps (the exchange is the identity)
        return self.state.step([self.rows.partials(z, ctx)], ctx)


def _run_slots(rows: Any, agg: Aggregate) -> tuple:
    """A linear one-call step's slots over ``rows``' columns (``LinearRun``, ``JoinLinearRun``): per kernel slot a count
    of weights or an int64 column's sum, the outputs :func:`_run_outputs` shows, and the columns a null in which sends
    the step to the Python paths."""
    ncols = len(rows.schema)
    specs = [("sum", p) if p < ncols else ("count", None) for p in rows.slotpos]
    shown, nonnull, _ = _run_outputs(agg)
    return specs, shown, nonnull, [rows.schema.get_field_index(c) for c in rows.checked]


def _run_outputs(agg: Aggregate) -> tuple[list[int], list[int], list[int | None]]:
    """What a one-call step (``_zset.LinearRun``) makes of ``agg``'s slots, per aggregate: the slot it shows, the
    slot of its non-null count (-1: a count, never null) and, for an avg, the slot of its low limb (-1: none; None:
    no avg)."""
    shown, nonnull, avg = [], [], []
    for kind, slots in agg.plan:
        shown.append(slots[0])
        nonnull.append(slots[-1] if kind in ("sum", "avg") else -1)
        avg.append((slots[1] if len(slots) == 3 else -1) if kind == "avg" else None)
    return shown, nonnull, avg


class _CGroupBy:
    """A linear group-by chain ``pre`` -> [identity exchange] -> ``agg`` at W = 1 whose aggregates the C step serves
    and :class:`_LinearGroupBy` does not (an avg of an int64 column: two limb slots and a float64 result, invariant 5 of
    operators/aggregate.py), run as ``agg``'s call over the rows that reach ``pre``: in one C call
    (:meth:`_LinearState.step_run`), else the chain's own steps."""

    def __init__(self, pre: PreAggregate, agg: Aggregate, state: _LinearState, counts: dict[str, int]) -> None:
        self.pre, self.agg, self.state, self.counts = pre, agg, state, counts
        schema = agg.in_schema
        specs, checked = [], []
        for kind, col in agg.kernel:
            pos = None if col is None else schema.get_field_index(col)
            if kind in ("count", "count_col"):
                specs.append(("count", None))
                if pos is not None:
                    checked.append(pos)  # a null there: the chain's own steps
            else:
                specs.append((kind, pos))  # sum, sum_hi, sum_lo
        shown, nonnull, avg = _run_outputs(agg)
        self.run = _zset.LinearRun([schema.get_field_index(k) for k in agg.keys], specs, shown, nonnull,
                                   agg.output_keys, state.pschema, agg.schema, checked, avg)

    @staticmethod
    def serves(agg: Aggregate) -> bool:
        """Whether the C step computes every aggregate of ``agg``: counts, sums of int64 columns (int64 results) and
        avgs of int64 columns (float64 results)."""
        if not agg.linear or agg.distinct_columns or agg.extras:
            return False
        fields = list(agg.schema)[len(agg.keys) if agg.output_keys else 0:]
        for (kind, slots), field in zip(agg.plan, fields):
            cols = {agg.kernel[j][1] for j in slots} - {None}
            if any(not pa.types.is_int64(agg.in_schema.field(c).type) for c in cols):
                return False
            want = {"count": pa.int64(), "sum": pa.int64(), "avg": pa.float64()}.get(kind)
            if want is None or not field.type.equals(want) or (kind == "sum" and len(slots) != 2):
                return False
        return True

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        z = inputs[0]
        if z.num_rows:
            out = self.state.step_run(conform(z, self.agg.in_schema), self.run, ctx)
            if out is not None:
                self.counts["fused"] += 1
                self.counts["cstep"] += 1
                return out
        self.counts["unfused"] += 1  # invariant 3: the chain's own steps (the exchange is the identity)
        return self.state.step([self.pre.step([z], ctx)], ctx)


class _Received:
    """What a fused exchange hands its chain's last node: the parts sent to this worker (all Z-sets, or all indexed
    Z-sets), as their senders cut them (``ctx.exchange_runs``), not added up."""

    __slots__ = ("parts", "num_rows")

    def __init__(self, parts: list) -> None:
        sizes = [p.num_rows if isinstance(p, ZSet) else len(p) for p in parts]
        self.parts = [p for p, n in zip(parts, sizes) if n]
        self.num_rows = sum(sizes)


class _PartialsExchange:
    """The sending half of the fused linear group-by chain at W > 1 (design note 4), as the exchange's call over the
    rows that reach ``pre``. Two forms, chosen per step (both send partial rows that sum to the same totals):

    - grouped (a change of many rows per group): one C grouping pass (``_zset.group_reduce``) sums each group's
      partial values and leaves the groups in key-hash order, so each worker's shards are runs of groups that go to
      its mailbox as slices of one table of partial rows (no permutation);
    - partitioned (about a row per group, where grouping twice would cost more than it saves): the key hashes,
      the partition kernel's permutation and one gather of the key and slot columns only, cut into the workers'
      parts: each row a partial row of its own, as ``PreAggregate.rowwise``.

    A step groups when it has at least ``GROUP_ROWS`` rows and the last grouping pass left at most
    ``GROUPS_PER_ROW`` groups per row, or ``RETRY`` steps have passed since it was last tried."""

    GROUP_ROWS = PreAggregate.GROUP_ABOVE  # rows; below, a grouping pass costs more than it saves
    GROUPS_PER_ROW = 0.5
    RETRY = 16

    def __init__(self, node: int, pre: PreAggregate, agg: Aggregate, counts: dict[str, int],
                 schema: pa.Schema | None = None) -> None:
        self.node, self.pre, self.agg, self.counts = node, pre, agg, counts
        self.rows = _RowsOfSlots(agg, pre, schema)
        self.kschema = pa.schema(list(pre.schema)[:len(agg.keys)])  # the key columns of the partial rows
        self.cols = list(self.rows.keypos) + list(self.rows.slotpos)  # the partial row's columns in the rows
        self.groups_well, self.since = True, 0

    def __call__(self, inputs: list, ctx: Any) -> _Received:
        z = inputs[0]
        runs: list = []
        cut = None
        if z.num_rows:
            rows = self.rows.of(z)
            if rows is None:  # a null in a counted or summed column: the combiner's own partial rows, indexed
                ix = self.rows.partials(z, ctx).index_by(list(self.agg.keys))
                table, w, runs = ix.zset.data, ix.zset.weights, ctx.shard_map.runs(ix.key_hash)
                self.counts["unfused"] += 1
            else:
                self.since += 1
                group = z.num_rows >= self.GROUP_ROWS and (self.groups_well or self.since >= self.RETRY)
                try:
                    table, w, runs = self._grouped(rows, ctx) if group else self._partitioned(rows, ctx)
                except WeightOverflowError as e:
                    self.agg.raise_overflow(e)
                self.counts["sent"] += 1

            def cut(s: int, e: int) -> ZSet:
                return ZSet._make(table.slice(s, e - s), w[s:e])
        return _Received(ctx.exchange_runs(self.node, runs, cut))

    def _grouped(self, rows: ZSet, ctx: Any) -> tuple:
        view = _zset.BatchView(rows.data, rows.weights)
        specs = [("sum", j) for j in self.rows.slotpos]
        group_row, khash, sums, _, _ = _zset.group_reduce(view, None, self.rows.keypos, specs, True)
        self.counts["grouped"] += 1
        self.groups_well, self.since = len(group_row) <= self.GROUPS_PER_ROW * rows.num_rows, 0
        keys = _zset.take(view, group_row, self.kschema, self.rows.keypos)
        table = pa.Table.from_arrays(list(keys.columns) + [pa.array(c) for c in np.ascontiguousarray(sums.T)],
                                     schema=self.pre.schema)
        return table, np.ones(len(group_row), dtype=np.int64), ctx.shard_map.runs(khash)

    def _partitioned(self, rows: ZSet, ctx: Any) -> tuple:
        khash = _zset.hash_columns(rows.data, list(self.rows.keypos))
        m = ctx.shard_map
        perm, offsets = _zset.partition(khash, m.part_of_shard, m.workers)
        table = _zset.take(rows.data, perm, self.pre.schema, self.cols)
        bounds = offsets.tolist()
        return table, rows.weights[perm], [(p, bounds[p], bounds[p + 1]) for p in range(m.workers)]


class _PartialsReceive:
    """The receiving half: the aggregate's step over the received parts of partial rows, concatenated into one
    grouping call (``_LinearState.step``). One call per part (``_LinearState.step_parts``) was measured slower:
    every part after the first re-emits the totals the one before stored, so the output is no longer distinct and
    the driver sorts it, and each part adds a trace batch to merge (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, the step plan's W > 1
    slice); the parts are the key and slot columns only, so their concatenation is the smallest copy of the
    chain."""

    def __init__(self, state: _LinearState, pschema: pa.Schema, counts: dict[str, int]) -> None:
        self.state, self.pschema, self.counts = state, pschema, counts
        agg = state.op
        self.run = None  # the one-call step over the partial rows (design note 2; _LinearGroupBy's C_STEP)
        if _LinearGroupBy.C_STEP:
            nk = len(agg.keys)
            shown, nonnull, _ = _run_outputs(agg)
            self.run = _zset.LinearRun(list(range(nk)), [("sum", nk + j) for j in range(len(agg.kernel))], shown,
                                       nonnull, agg.output_keys, state.pschema, agg.schema)

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        self.counts["received"] += 1
        z = concat(inputs[0].parts, self.pschema)
        if z.num_rows and self.run is not None:
            out = self.state.step_run(z, self.run, ctx)
            if out is not None:
                self.counts["cstep"] += 1
                return out
        return self.state.step([z], ctx)


class _IndexedExchange:
    """An exchange whose one consumer is a join on the exchange's key (design note 4, at W > 1): the sender indexes
    its change by the key (sorted by key hash: the index a join builds anyway), so each worker's shards are runs of
    the index that go to its mailbox as slices, without the exchange's gather nor its concatenation."""

    def __init__(self, node: int, join: _JoinState, side: int, counts: dict[str, int]) -> None:
        self.node, self.join, self.side, self.counts = node, join, side, counts

    def __call__(self, inputs: list, ctx: Any) -> _Received:
        z = inputs[0]
        runs: list = []
        cut = None
        ix = self.join.indexed(z, self.side)  # as the join indexes it (projected first when it keeps fewer columns)
        if ix is not None:
            runs, cut = ctx.shard_map.runs(ix.key_hash), ix._slice
            self.counts["indexed"] += 1
        return _Received(ctx.exchange_runs(self.node, runs, cut))


class _ReducedExchange:
    """An exchange whose one consumer is an append-only min/max aggregate that reduces its change (design note 4,
    at W > 1): the sender reduces its change as the aggregate would (one row per group, ``_ExtremesState._reduced``,
    which decides whether it pays, apart from the aggregate's own tries), then exchanges the rows it kept; the
    aggregate folds them as it folds the rows they stand for."""

    def __init__(self, node: int, state: _ExtremesState, key: tuple[str, ...], counts: dict[str, int]) -> None:
        self.node, self.state, self.key, self.counts = node, state, tuple(key), counts
        self.schema = state.op.in_schema

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        z = inputs[0]
        if z.num_rows:
            z = conform(z, self.schema)
            r = self.state._reduced(z, sender=True)
            if r is not z:
                self.counts["reduced"] += 1
                z = r
        return ctx.exchange(self.node, z, self.key, self.schema)


class _IndexedChangeExchange:
    """An exchange whose one consumer is a keyed operator that indexes its change by the exchange's key (design note 4,
    at W > 1): a distinct (its key is the whole row), or a min/max aggregate that projects its change
    (:class:`_ProjectedExchange`). The sender indexes its change as the operator would (``index``: the change, or
    None when nothing is left), so each worker's shards are runs of that index that go to its mailbox as slices; the
    operator's call (:class:`_MergedChange`) merges the sorted runs it received (csrc/merge.h) instead of the
    exchange's partition and gather, the concatenation and a second ``index_by`` of the received rows."""

    def __init__(self, node: int, index: Callable[[ZSet], IndexedZSet | None], counts: dict[str, int],
                 counted: str = "keyed") -> None:
        self.node, self.index, self.counts, self.counted = node, index, counts, counted

    def __call__(self, inputs: list, ctx: Any) -> _Received:
        runs: list = []
        cut = None
        ix = self.index(inputs[0])
        if ix is not None:
            runs, cut = ctx.shard_map.runs(ix.key_hash), ix._slice
            self.counts[self.counted] += 1
        return _Received(ctx.exchange_runs(self.node, runs, cut))


class _ProjectedExchange(_IndexedChangeExchange):
    """An exchange whose one consumer is a min/max aggregate that projects its change (operators/aggregate.py
    invariant 9; design note 4, at W > 1): the sender projects the change onto the columns the aggregate reads (no
    row copied) and indexes it by the keys, as the aggregate would (``_ExtremesState.index_projected``); only those
    columns are gathered, by the index, and sent as runs of it; the aggregate merges them
    (:class:`_MergedChange`)."""

    def __init__(self, node: int, state: _ExtremesState, counts: dict[str, int]) -> None:
        super().__init__(node, state.index_projected, counts, "projected")


class _MergedChange:
    """The keyed operator's call after an :class:`_IndexedChangeExchange`: the indexed runs it received merged into
    one indexed change (one pass of the k-way merge, row hashes kept), which ``step_indexed`` takes as the change
    its own ``index_by`` would have built (the same rows in the same canonical order: the consolidated sum)."""

    def __init__(self, step_indexed: Callable[[IndexedZSet | None, Any], ZSet], counts: dict[str, int],
                 overflow: Callable[[WeightOverflowError], Any] | None = None) -> None:
        self.step_indexed, self.counts, self.overflow = step_indexed, counts, overflow

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        self.counts["changes_merged"] += 1
        try:
            dix = merge_parts(inputs[0].parts)
        except WeightOverflowError as e:
            if self.overflow is None:
                raise
            self.overflow(e)
        return self.step_indexed(dix, ctx)


def merge_parts(parts: list) -> IndexedZSet | None:
    """The consolidated sum of indexed Z-sets of one schema and key (the runs an exchange of indexed rows sent), in
    k-way merges of up to the cursor's bound at a time (csrc/merge.h invariant 4), row hashes kept; None for none."""
    parts = [p for p in parts if len(p)]
    while len(parts) > 1:
        done = []
        for i in range(0, len(parts), MERGE_K):
            group = parts[i:i + MERGE_K]
            if len(group) == 1:
                done.append(group[0])
                continue
            m = merge_cursor(*group, row_hashes=True)
            m.step(sum(len(p) for p in group))
            done.append(merged(group[0], m))
        parts = [p for p in done if len(p)]
    return parts[0] if parts else None


MERGE_K = 64  # inputs of one k-way merge at most (csrc/merge.h DBSP_MERGE_MAX_K)


class _PairsExchange:
    """An exchange whose one consumer is a count-distinct on the exchange's key, its (keys, value) pairs (design note
    4, at W > 1): the sender sends its change's non-null pairs with equal pairs summed (``pairs``,
    operators/count_distinct.py invariant 4, when that pays), so a pair crosses workers once per sender, not once
    per row."""

    def __init__(self, node: int, state: Any, schema: pa.Schema, key: tuple[str, ...], counts: dict[str, int]
                 ) -> None:
        self.node, self.state, self.schema, self.key, self.counts = node, state, schema, tuple(key), counts

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        z = inputs[0]
        if z.num_rows:
            pairs = self.state.pairs(conform(z, self.schema), sender=True)
            z = ZSet.empty(self.schema) if pairs is None else conform(pairs, self.schema)
            self.counts["paired"] += 1
        return ctx.exchange(self.node, z, self.key, self.schema)


class _IndexedJoin:
    """The join's call after one or two fused exchanges: the indexed parts it received are merged into one indexed
    change per side (the merge of sorted runs, csrc/merge.h: one gather), a side without a fused exchange is
    indexed as the join would."""

    def __init__(self, state: _JoinState, counts: dict[str, int]) -> None:
        self.state, self.counts = state, counts

    def _side(self, x: Any, side: int) -> IndexedZSet | None:
        if not isinstance(x, _Received):
            return self.state.indexed(x, side)
        self.counts["merged"] += 1
        parts = x.parts
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out.merge(p)
        return out

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        return self.state.step_indexed(self._side(inputs[0], 0), self._side(inputs[1], 1), ctx)


class _JoinSlots(_IndexedJoin):
    """The join's call in a fused chain ``Join -> PreAggregate -> [Exchange] -> linear Aggregate`` (design note 4):
    the join's change as the columns the aggregate reads (its keys, counted and summed columns), gathered from the
    join kernel's pairs of each meeting of a change with a trace batch, without building the joined rows; the
    chain's aggregate call (:class:`_LinearGroupBy`, or at W > 1 :class:`_PartialsExchange`) folds them into the
    totals kept per key as it folds its own input rows. The join's traces change as its own step changes them."""

    def __init__(self, state: _JoinState, agg: Aggregate, counts: dict[str, int]) -> None:
        super().__init__(state, counts)
        op = state.op
        nl = len(op.lschema)
        names = dict.fromkeys(list(agg.keys) + [col for _, col in agg.kernel if col is not None])
        pos = [op.schema.get_field_index(n) for n in names]  # in the join's output rows
        left, right = [i for i in pos if i < nl], [i for i in pos if i >= nl]
        self.schema = pa.schema([op.schema.field(i) for i in left + right])  # the columns, left side's first
        self.cols = (left, [op.right_kept_pos[i - nl] for i in right], self.schema)
        self.op = op

        self.spec = state.join_runs(self.cols) if _CJoin.C_STEP else None  # the one-call step (join.py invariant 7)

    def _pairs(self, left: IndexedZSet, right: IndexedZSet) -> ZSet:
        return self.state.pairs(left, right, self.cols)

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        self.counts["joined"] += 1
        a, b = inputs
        if self.spec is not None and not isinstance(a, _Received) and not isinstance(b, _Received):
            parts = self.state.step_run(a, b, ctx, self.spec)
            if parts is not None:
                self.counts["cjoin"] += 1
                return concat(parts, self.schema)
        parts = self.state.step_parts(self._side(a, 0), self._side(b, 1), ctx, self._pairs)
        return concat(parts, self.schema)


class _JoinPair:
    """What a folded join's call hands its chain (:class:`_JoinFolded`): the join's two inputs, untouched."""

    __slots__ = ("inputs", "num_rows")

    def __init__(self, inputs: list) -> None:
        self.inputs = inputs
        self.num_rows = sum(z.num_rows for z in inputs)


class _JoinFolded:
    """The fused chain ``Join -> PreAggregate -> [identity Exchange] -> linear Aggregate`` at W = 1 whose gathered
    columns are all fixed-width (design note 4, issue 37; operators/join.py invariant 8): the join's call hands its
    inputs on (:meth:`join_call`), and the aggregate's call runs the whole chain's step in one C call
    (``_zset.JoinLinearRun``, csrc/joinlin.h): both changes indexed for the join's traces, their pairs with the other
    side's batches folded straight into the totals per key, the trace batch and the output built as
    :class:`_LinearGroupBy`'s C step builds them; the joined rows (:class:`_JoinSlots`' parts) are never built. A
    step it does not serve runs :class:`_JoinSlots`' call, then :class:`_LinearGroupBy`'s (``counts["folded"]``:
    steps it served)."""

    C_STEP = True  # the folded step (tests turn it off to compare with the chain it replaces)

    def __init__(self, slots: _JoinSlots, chain: _LinearGroupBy, counts: dict[str, int]) -> None:
        self.slots, self.chain, self.counts = slots, chain, counts
        self.run = self._fold_run(slots, chain)

    @staticmethod
    def serves(slots: _JoinSlots, chain: _LinearGroupBy) -> bool:
        """Whether the folded step can run this chain: its C steps on, the join's columns in its traces' order and
        every gathered column fixed-width (not bool: csrc/joinlin.h invariant 3)."""
        if not (_JoinFolded.C_STEP and chain.run is not None and slots.spec is not None):
            return False
        if slots.state.fold_positions(slots.cols) is None:
            return False
        return all(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_date32(t)
                   or pa.types.is_timestamp(t) for t in slots.schema.types)

    @staticmethod
    def _fold_run(slots: _JoinSlots, chain: _LinearGroupBy) -> Any:
        """The one C call: :meth:`_LinearGroupBy._linear_run`'s slots over the columns :class:`_JoinSlots` gathers."""
        lkeys, rkeys, lcols, rcols = slots.state.fold_positions(slots.cols)
        rows, agg, state = chain.rows, chain.agg, chain.state
        specs, shown, nonnull, checked = _run_slots(rows, agg)
        checked = set(checked) | {p for kind, p in specs if kind == "sum"}
        return _zset.JoinLinearRun(lkeys, rkeys, [(0, c) for c in lcols] + [(1, c) for c in rcols], sorted(checked),
                                   slots.state.left.schema, slots.state.right.schema, list(rows.keypos), specs, shown,
                                   nonnull, agg.output_keys, state.pschema, agg.schema)

    def join_call(self, inputs: list, ctx: Any) -> _JoinPair:
        return _JoinPair(inputs)

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        za, zb = inputs[0].inputs
        if za.num_rows or zb.num_rows:
            join, run = self.slots.state, self.run
            done: list = []

            agg = self.chain.state

            def call(ix: Any, dirty: Any, keyorder: bool) -> tuple | None:  # (as Aggregate.step_run's call)
                found = dirty is not None and agg.trace.pk_found_dirty()
                got = join.step_folded(za, zb, lambda *args: run.step(*args, ix, dirty, found, keyorder))
                if got is not None:
                    done.append(1)
                return got

            out = agg.step_call(call, ctx, keyorder=True)
            if done:  # (a step with no current key index never called it)
                self.counts["folded"] += 1
                self.counts["fused"] += 1
                return out
        z = self.slots([za, zb], ctx)
        return self.chain([z], ctx)


class _CJoin:
    """An inner join's call on a worker whose join inputs are Z-sets (no fused exchange: W = 1, or exchanges not
    fused): its step in one C call (operators/join.py invariant 7, ``_zset.JoinRun``; design note 2) when it serves
    the step, else the join's own step."""

    C_STEP = True  # the one-call step (tests turn it off to compare with the path before it)

    def __init__(self, state: _JoinState, counts: dict[str, int]) -> None:
        self.state, self.counts = state, counts
        self.spec = state.join_runs()
        self.schema = state.op.schema

    def __call__(self, inputs: list, ctx: Any) -> ZSet:
        parts = self.state.step_run(inputs[0], inputs[1], ctx, self.spec)
        if parts is None:
            return self.state.step(inputs, ctx)
        self.counts["cjoin"] += 1
        return concat(parts, self.schema)


class StepPlan:
    """The calls of one worker's step (the module docstring): ``calls`` as ``dbsp_core.profile.run_nodes`` takes
    them, and ``counts`` of what fused chains did (invariant 3): ``"fused"`` / ``"unfused"``, steps the W = 1
    group-by chain served or left to its nodes (at W > 1, ``"unfused"``: steps whose partial rows the combiner
    built because of a null); ``"cstep"``, steps of a linear group-by's aggregate run in one C call (design note 2:
    at W = 1 counted in ``"fused"`` too; at W > 1 of the ``"received"``); ``"sent"``, steps whose partial rows the
    W > 1 chain's sender built and partitioned
    (``"grouped"``: of them, by a grouping pass); ``"received"``, aggregate steps over received parts;
    ``"indexed"``, changes a join's fused exchange indexed before it partitioned them; ``"merged"``, join sides
    built from received indexed parts; ``"joined"``, steps of a join that gathered its group-by's columns from its
    pairs (:class:`_JoinSlots`); ``"reduced"``, changes an exchange reduced for its min/max aggregate before it
    partitioned them (:class:`_ReducedExchange`); ``"sliced"``, steps of a hopping window that summed its group-by's
    slices (:class:`_HopSlices`); ``"paired"``, changes an exchange summed into distinct (keys, value) pairs for its
    count-distinct before it partitioned them (:class:`_PairsExchange`); ``"projected"``, changes an exchange
    projected onto the columns its min/max aggregate reads and indexed before it cut them (:class:`_ProjectedExchange`);
    ``"keyed"``, changes an exchange indexed for its distinct before it cut them (:class:`_IndexedChangeExchange`);
    ``"changes_merged"``, steps of such a distinct or min/max over the received runs merged (:class:`_MergedChange`);
    ``"cjoin"``, steps of an inner join run in one C call (:class:`_CJoin`, or a :class:`_JoinSlots` over Z-sets:
    operators/join.py invariant 7); ``"folded"``, steps of a join and its linear group-by run as one C call that
    folds the join's pairs into the totals (:class:`_JoinFolded`, operators/join.py invariant 8; counted in
    ``"fused"`` too)."""

    def __init__(self, circuit: Circuit, live: list[int], instances: dict[int, Any], workers: int,
                 fuse: bool = True) -> None:
        nodes = circuit.nodes
        self.workers = workers  # the layout's worker count it was lowered for (invariant 2)
        self.counts = dict.fromkeys(("fused", "cstep", "unfused", "sent", "grouped", "received", "indexed", "merged",
                                     "joined", "reduced", "sliced", "paired", "projected", "keyed",
                                     "changes_merged", "cjoin", "folded"), 0)
        self.fused_nodes: list[int] = []  # the last node of each fused chain
        steps: dict[int, Callable] = {i: instances[i].step for i in live}
        if fuse:
            inner = self._inner(circuit, live)
            slot_joins: set[int] = set()
            for agg, pre in self._linear_groupbys(circuit, live, instances, workers, inner):
                src = nodes[agg].inputs[0]
                steps[pre] = _passthrough
                schema = None  # the aggregate's input rows, unless a fused join gathers the columns it reads
                j = nodes[pre].inputs[0]
                if (type(nodes[j]) is Join and type(instances[j]) is _JoinState and inner(j)
                        and (nodes[agg].keys or any(col for _, col in nodes[agg].kernel))):  # a column to gather
                    steps[j] = _JoinSlots(instances[j], nodes[agg], self.counts)
                    schema = steps[j].schema
                    slot_joins.add(j)
                    self.fused_nodes.append(j)
                elif inner(j) and self._sliceable(nodes[j], nodes[agg]):
                    steps[j] = _HopSlices(nodes[j], nodes[pre], self.counts)
                    schema = nodes[pre].schema  # the chain's rows are partial rows
                    self.fused_nodes.append(j)
                if src == pre or workers == 1:  # no exchange, or the identity (W = 1)
                    steps[src] = _passthrough
                    steps[agg] = _LinearGroupBy(nodes[pre], nodes[agg], instances[agg], self.counts, schema)
                    if j in slot_joins and _JoinFolded.serves(steps[j], steps[agg]):  # issue 37: one C call
                        steps[agg] = folded = _JoinFolded(steps[j], steps[agg], self.counts)
                        steps[j] = folded.join_call
                else:
                    steps[src] = _PartialsExchange(src, nodes[pre], nodes[agg], self.counts, schema)
                    steps[agg] = _PartialsReceive(instances[agg], nodes[pre].schema, self.counts)
                self.fused_nodes.append(agg)
            if workers == 1 and _LinearGroupBy.C_STEP:  # linear group-bys only the C step serves (an avg)
                for agg, pre in self._c_groupbys(circuit, live, instances, inner):
                    steps[pre] = steps[nodes[agg].inputs[0]] = _passthrough
                    steps[agg] = _CGroupBy(nodes[pre], nodes[agg], instances[agg], self.counts)
                    self.fused_nodes.append(agg)
            if workers > 1:
                for agg in self._extremes_fed_by_exchange(circuit, live, instances, inner, "reduce_specs"):
                    e = nodes[agg].inputs[0]
                    steps[e] = _ReducedExchange(e, instances[agg], nodes[e].key, self.counts)
                for agg in self._extremes_fed_by_exchange(circuit, live, instances, inner, "projected"):
                    e = nodes[agg].inputs[0]
                    steps[e] = _ProjectedExchange(e, instances[agg], self.counts)
                    steps[agg] = _MergedChange(instances[agg].step_indexed, self.counts, nodes[agg].raise_overflow)
                    self.fused_nodes.append(agg)
                    j = nodes[e].inputs[0]
                    if type(nodes[j]) is Join and type(instances[j]) is _JoinState and inner(j):
                        steps[j] = _JoinSlots(instances[j], nodes[agg], self.counts)  # gathers the read columns
                        slot_joins.add(j)
                        self.fused_nodes.append(j)
                for d in self._distincts(circuit, live, instances, inner):
                    e = nodes[d].inputs[0]
                    steps[e] = _IndexedChangeExchange(e, instances[d].index_change, self.counts)
                    steps[d] = _MergedChange(instances[d].step_indexed, self.counts)
                    self.fused_nodes.append(d)
                for cd in self._count_distincts(circuit, live, instances, inner):
                    e = nodes[cd].inputs[0]
                    steps[e] = _PairsExchange(e, instances[cd], nodes[e].schema, nodes[e].key, self.counts)
                for join, sides in self._indexed_joins(circuit, live, instances, inner):
                    op = nodes[join]
                    for side in sides:
                        e = op.inputs[side]
                        steps[e] = _IndexedExchange(e, instances[join], side, self.counts)
                    if join not in slot_joins:  # a _JoinSlots reads the received parts as _IndexedJoin does
                        steps[join] = _IndexedJoin(instances[join], self.counts)
                        self.fused_nodes.append(join)
            if workers == 1:  # every other exchange is the identity too (the embedded exchanger hands a W = 1
                for i in live:  # change back): its call is the chain's pass-through, not three calls of Python
                    if type(nodes[i]) is Exchange and steps[i] == instances[i].step:
                        steps[i] = _passthrough
            if _CJoin.C_STEP:  # every other inner join: its step in one C call when it serves it
                for j in live:
                    if (type(nodes[j]) is Join and type(instances[j]) is _JoinState and steps[j] == instances[j].step):
                        steps[j] = _CJoin(instances[j], self.counts)
        self.calls: list[Call] = [(steps[i], nodes[i].inputs, i) for i in live]

    @staticmethod
    def _inner(circuit: Circuit, live: list[int]) -> Callable[[int], bool]:
        """Whether a node may be an inner node of a chain (invariant 2): one consumer, and no output."""
        consumers: dict[int, int] = {}
        for i in live:
            for j in circuit.nodes[i].inputs:
                consumers[j] = consumers.get(j, 0) + 1
        outputs = set(circuit.outputs.values())
        return lambda j: consumers.get(j, 0) == 1 and j not in outputs

    @staticmethod
    def _linear_groupbys(circuit: Circuit, live: list[int], instances: dict[int, Any], workers: int,
                         inner: Callable[[int], bool]) -> list[tuple[int, int]]:
        """(aggregate, pre-aggregate) of every group-by chain design note 4 fuses here (invariant 2): through an
        exchange at any W (the identity at W = 1, partitioned partial rows at W > 1)."""
        nodes = circuit.nodes
        found = []
        for i in live:
            op = nodes[i]
            if not (isinstance(op, Aggregate) and isinstance(instances[i], _LinearState) and op.int_slots
                    and len(op.inputs) == 1):
                continue
            src = op.inputs[0]
            if isinstance(nodes[src], Exchange):
                if not inner(src) or (workers > 1 and tuple(nodes[src].key) != tuple(op.keys)):
                    continue  # at W > 1 the chain routes groups by the hash of the aggregate's keys
                src = nodes[src].inputs[0]
            pre = nodes[src]
            if isinstance(pre, PreAggregate) and pre.agg is op and inner(src):
                found.append((i, src))
        return found

    @staticmethod
    def _c_groupbys(circuit: Circuit, live: list[int], instances: dict[int, Any], inner: Callable[[int], bool]
                    ) -> list[tuple[int, int]]:
        """(aggregate, pre-aggregate) of every linear group-by chain at W = 1 that :meth:`_linear_groupbys` leaves and
        the C step serves (:class:`_CGroupBy`): counts, int64 sums and avgs of int64 columns."""
        nodes = circuit.nodes
        found = []
        for i in live:
            op = nodes[i]
            if not (isinstance(op, Aggregate) and type(instances[i]) is _LinearState and not op.int_slots
                    and len(op.inputs) == 1 and _CGroupBy.serves(op)):
                continue
            src = op.inputs[0]
            if isinstance(nodes[src], Exchange):
                if not inner(src):
                    continue
                src = nodes[src].inputs[0]
            if isinstance(nodes[src], PreAggregate) and nodes[src].agg is op and inner(src):
                found.append((i, src))
        return found

    @staticmethod
    def _sliceable(win: Any, agg: Aggregate) -> bool:
        """Whether a linear group-by over hopping window ``win`` sums slices (:class:`_HopSlices`): a window column is a
        group key (else there is nothing to share) and no aggregate reads one (a slice's copies move it)."""
        if not (type(win) is Window and win.mode == "hop" and win.size > win.slide):
            return False
        cols = {win.start, win.end} - {None}
        return bool(cols & set(agg.keys)) and not cols & {col for _, col in agg.kernel}

    @staticmethod
    def _extremes_fed_by_exchange(circuit: Circuit, live: list[int], instances: dict[int, Any],
                                  inner: Callable[[int], bool], attr: str) -> list[int]:
        """Every min/max aggregate whose state's ``attr`` is set (``reduce_specs``: it reduces its change,
        operators/aggregate.py invariant 8; ``projected``: it projects it, invariant 9) and whose input is an exchange
        on its keys with no other consumer (design note 4 at W > 1)."""
        nodes = circuit.nodes
        found = []
        for i in live:
            op = nodes[i]
            if not (isinstance(op, Aggregate) and type(instances[i]) is _ExtremesState
                    and getattr(instances[i], attr) is not None and len(op.inputs) == 1):
                continue
            e = op.inputs[0]
            if isinstance(nodes[e], Exchange) and inner(e) and tuple(nodes[e].key) == tuple(op.keys):
                found.append(i)
        return found

    @staticmethod
    def _count_distincts(circuit: Circuit, live: list[int], instances: dict[int, Any], inner: Callable[[int], bool]
                         ) -> list[int]:
        """Every count-distinct whose input is an exchange on its (keys, value) pair with no other consumer (design
        note 4 at W > 1)."""
        nodes = circuit.nodes
        return [i for i in live if type(nodes[i]) is CountDistinct and type(instances[i]) is _CountDistinctState
                and isinstance(nodes[nodes[i].inputs[0]], Exchange) and inner(nodes[i].inputs[0])
                and tuple(nodes[nodes[i].inputs[0]].key) == tuple(nodes[i].partitioning)]

    @staticmethod
    def _distincts(circuit: Circuit, live: list[int], instances: dict[int, Any], inner: Callable[[int], bool]
                   ) -> list[int]:
        """Every distinct whose input is an exchange on its whole row (its columns, in order) with no other consumer
        (design note 4 at W > 1)."""
        nodes = circuit.nodes
        return [i for i in live if type(nodes[i]) is Distinct and type(instances[i]) is _DistinctState
                and isinstance(nodes[nodes[i].inputs[0]], Exchange) and inner(nodes[i].inputs[0])
                and tuple(nodes[nodes[i].inputs[0]].key) == tuple(instances[i].cols)]

    @staticmethod
    def _indexed_joins(circuit: Circuit, live: list[int], instances: dict[int, Any], inner: Callable[[int], bool]
                       ) -> list[tuple[int, list[int]]]:
        """(join, its input sides fed by a fused exchange) of every inner join whose input is an exchange on that
        side's join key with no other consumer (design note 4 at W > 1)."""
        nodes = circuit.nodes
        found = []
        for i in live:
            op = nodes[i]
            if not (type(op) is Join and type(instances[i]) is _JoinState):
                continue
            sides = [k for k, key in enumerate((op.left_on, op.right_on))
                     if isinstance(nodes[op.inputs[k]], Exchange) and inner(op.inputs[k])
                     and tuple(nodes[op.inputs[k]].key) == tuple(key)]
            if sides:
                found.append((i, sides))
        return found
