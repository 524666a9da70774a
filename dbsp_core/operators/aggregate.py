"""The aggregate operator: ``group_by(keys).agg(...)`` maintained incrementally, one output row per non-empty group.

Invariants:
  1. After every step, integral(output) has exactly one row per group whose accumulated row count is
     non-zero: the key columns, then one column per aggregate, in the order given (weight 1).
  2. A step touches only the groups whose key occurs in the change; for each it emits -old row +new row
     (they cancel when the group did not change). Groups are matched by row identity (null key = a group).
  3. Two strategies give the same results:
     - linear (only count, and sum/avg over integer columns): the trace keeps one partial row per group
       (count, sums, non-null counts as int64); a step adds the change's partials to the old ones. Integer
       arithmetic is exact, so the result does not depend on the split into steps or workers.
     - extremes (min/max with only count and integer sum/avg besides): one trace keeps each group's current
       totals row (linear slots and extremes), and one trace per min/max column keeps the multiset of the
       group's non-null values ((keys, value) rows with their counts). A step folds the change into the old
       totals in one grouping pass: linear slots add, and an extreme becomes the extreme of the old one and
       the inserted values, unless a deleted value reaches the old extreme (for min: is not strictly greater
       than it); only those groups are re-reduced, over their value multisets. So an insert-only step costs
       O(change), and deleting an extreme costs O(distinct values of that group), never O(state).
     - recompute (any float sum/avg, and the whole-group kinds of dbsp_core/aggregates.py, invariant 6 there:
       the variance family, string_agg, first, last): the trace keeps the integrated input indexed by key; a
       step re-reduces the affected groups' rows, so float sums are computed over the group's consolidated rows
       in one fixed order whatever the split (exact results that do not depend on steps or workers), and the
       whole-group kinds over every row of the group (:func:`group_values`): a step costs the size of the
       groups it changes, not of the change.
  4. The input is exchanged by the group keys, so a group lives in exactly one worker. A linear aggregate
     first turns each worker's change into partial rows (PreAggregate, before the exchange: a combiner), so
     a large change crosses workers as one row per group instead of one per input row.
  5. Integer sums are exact whatever the split into steps, workers and rows: a uint64 sum, and an int64 column's
     sum for avg, are kept as two int64 limb slots (``sum_hi``: the value >> 32, ``sum_lo``: its low 32 bits,
     :func:`limb`), which no partial sum in a C kernel can overflow; :meth:`Aggregate.finalize` joins them. A
     group's sum outside the result type (int64, uint64 for a uint64 column) fails the step with a
     WeightOverflowError naming the aggregate and its column; an int64 ``sum`` keeps one slot (the state format
     of checkpoints written before), so a step may also fail when a group's old total and the step's values
     sum, in magnitude, past int64. ``avg`` divides the exact sum by the count in long double (as DuckDB does).
  6. When a group key column has a time lineage (dbsp_core/time), the groups below its bound are dropped from
     every trace at the start of a step (dbsp_core/time/cleanup.py): no later change can reach them.
  7. Over a stream that is inserts only by the circuit's structure (``Circuit.inserts_only``), the extremes
     strategy has ``append_only`` set and keeps the totals alone: no deletion can reach an extreme, so the value
     multisets that only a recompute reads are never kept. A change with a retraction then raises DbspError
     (the driver refuses retractions into append-only inputs before recording them, operators/input.py). With
     the totals' key index, such a step does not index (sort) its change: the kernel groups its rows by hashing
     (csrc/extremes.h, dbsp_extremes_probe_inserts), the same groups in the same key-hash order, in the one pass
     that folds them (linear slots summed, each extreme the extreme of the group's non-null values).
  8. With ``append_only``, one min/max over an integer-like or a string (or binary) column and otherwise only row
     counts, a large change whose weights are all positive is reduced to one row per group, by hash grouping (no
     sort), where a grouping or an exchange follows that would otherwise take every row: on the sender of a fused
     exchange (dbsp_core/runtime/plan.py: a group crosses workers as a row per sender) and before the change is
     indexed (a string extreme, which no key index holds, or invariant 7's path when the totals' key index does
     not serve). The reduced row of a group is its row that holds its extreme (its first row when every value is
     null), weighted by the group's row count; the totals fold it exactly as the whole change (a count adds the
     weights, an extreme is the extreme of the positive-weight rows, in the order the fold uses: csrc/agg.h). On
     invariant 7's unindexed path the aggregate does not reduce its change: the kernel's hash grouping is the
     reduction, so a worker hashes and groups the key columns of its change once per step (a receiver groups the
     rows its senders reduced: a group's rows from several senders meet only there). A step whose reduction
     left more than ``GROUPS_PER_ROW`` groups per row stops reducing for ``RETRY`` steps (about a row per group:
     the grouping pass would cost more than it saves).
  9. The extremes strategy without ``append_only``, over an input with columns it does not read, projects its
     change onto the keys and the columns its aggregates read before indexing it (its result is a function of
     that projection: counts add weights, sums add weight times value, an extreme reads the value multiset), so
     only those columns are hashed, sorted and gathered, and rows equal on them are consolidated; limb columns
     (invariant 5), functions of their column, are appended after the indexing. When the projection is the keys
     and one value column without nulls, the indexed change is the value multiset's batch as it stands.
 10. Through the totals' key index, once phase 1 (csrc/extremes.h: the probe, then the recomputed extremes) has the
     step's groups with their old and new totals, the rest of the step is one C call (``_zset.ExtremesEmit``,
     extremes.h design note 4) when every output column is a min/max (its column's type), a count or an int64
     sum: the totals batch (the key columns gathered, the slots narrowed to their types, null where an extreme
     is; its row hashes and canonical order, so the trace neither hashes nor sorts it), the finalized output (a
     group's old and new rows dropped when they show the same: distinct as it stands) and the index's stores. A
     key-hash or row-hash tie leaves the batch to be sorted in Python; other aggregates (avg, a uint64 sum)
     build both from the probe's arrays in Python. ``emitted_steps`` counts the steps it served. The probe is the
     emit's (``ExtremesEmit.probe``, extremes.h design note 5) on the indexed change's path: it keeps where the index
     holds each group, and the emit writes a held group's new totals there in place (one index probe per group);
     a store refused for the index's size is undone, so the trace drops the index and the step walks its batches.
     The totals trace, read only through that index, holds its low levels as a linear aggregate's does (trace
     invariant 18, ``DBSP_TOTALS_HOLD``; ``_LinearState.HOLD`` in tests): a step's batch of old and new totals is
     rewritten about once per three levels on its way up, not once per level.
 11. A value multiset's trace is read only for the groups whose extreme a deletion reached (a seek per group in each
     batch, ``_recompute_into``, or ``lookup_exact`` on the path without the key index), so it holds its low levels
     whatever its reads (trace invariant 18, ``hold_keyed``; ``DBSP_TOTALS_HOLD``, ``_LinearState.HOLD`` in tests): a
     step's batch of values is rewritten about once per three levels on its way up instead of once per level.
 12. Unless ``DBSP_TOTALS_PER_KEY=0`` (``_ExtremesState.PER_KEY`` None follows it; tests set True or False), the
     totals trace, read only through its key index (invariant 10), keeps its totals per key (trace invariant 19) as a
     linear aggregate's does: the index is the state
     (its sums over a group's one totals row are that row, an extreme null where its "valid" flag is 0), a step that
     stored its groups there (the emit's in-place writes, or ``extremes_store``) inserts no batch but records each of
     its groups not dirty yet with its old row, and the batches are synced from the index when something reads them
     (a checkpoint, a shard cut, the walk of ``_through_totals``). So a step merges no totals at all; a rollback
     undoes the step's writes into the index from its batch (-old +new) by the undo log of trace invariant 19. A step
     probes the dirty-key index once per group, and not at all when every key the index held before it is dirty
     (``Trace.pk_found_dirty``: true from the first step after a sync that touched them all, as a state built by steps
     is) and every group it changed was held (a -1 row each): none of its keys can be fresh. Such a step reads none of
     its batch's rows either: the emit leaves the batch out (csrc/extremes.h design note 7) and the step hands
     ``store_totals`` a ``PendingBatch`` (its rows' key hashes and weights), built from the step's arrays only if a
     rollback undoes the step (or a fallback inserts it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from dbsp_core.aggregates import GROUP_KINDS, PAIR_KINDS, Aggregate as AggSpec
from dbsp_core.envvars import settings
from dbsp_core.errors import DbspError, SchemaError, WeightOverflowError
from dbsp_core.operators.base import (Operator, check_columns, concat, conform, empty, keyed_change, make,
                                      opened_change)
from dbsp_core import _zset
from dbsp_core.time.cleanup import prune
from dbsp_core.time.lineage import input_times
from dbsp_core.trace import Trace, summable, unique_sorted
from dbsp_core.trace.keyindex import PendingBatch, int_array
from dbsp_core.zset import IndexedZSet, ZSet, _agg_specs, _take, sum_adjacent

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext


class Aggregate(Operator):
    """``group_by(*keys).agg(name=aggregate, ...)``."""

    kind = "aggregate"
    split_safe = True  # base.py invariant 6 (invariant 1: a function of the integrated input)
    output_keys = True  # the key columns lead the output (False: a keyless aggregate's hidden key)
    distinct_columns: tuple[str, ...] = ()  # columns of count_distinct slots (partials from CountDistinct)
    in_times: tuple = ()  # time lineage of the input, set by the circuit when there is one (dbsp_core.time)
    extras: tuple = ()  # the whole-group aggregates (invariant 3, recompute), set only when there are some, so
    # circuits written before keep their fingerprint
    append_only = False  # invariant 7; set by the circuit only over an inserts-only stream, extremes strategy

    def __init__(self, node: int, in_schema: pa.Schema, keys: Sequence[str], aggs: dict[str, AggSpec],
                 where: str, output_keys: bool = True) -> None:
        keys = tuple(keys)
        if not keys:
            raise SchemaError(f"{where}: group_by needs at least one key column")
        check_columns(in_schema, keys, where, "group_by column")
        if len(set(keys)) != len(keys):
            raise SchemaError(f"{where}: duplicate group_by column in {list(keys)}")
        if not aggs:
            raise SchemaError(f"{where}: agg() needs at least one aggregate")
        if not output_keys:  # the keys are hidden (a keyless aggregate's constant key); set only when not the
            self.output_keys = False  # default, so circuits written before keep their fingerprint
        fields = [pa.field(k, in_schema.field(k).type) for k in keys] if output_keys else []
        for name, agg in aggs.items():
            if not isinstance(agg, AggSpec):
                raise TypeError(f"{where}: {name}= must be an aggregate such as dbsp.count(), got {agg!r}")
            if name in keys and output_keys:
                raise SchemaError(f"{where}: output column {name!r} clashes with a group_by column")
            fields.append(pa.field(name, agg.output_type(in_schema, where)))
        super().__init__((node,), pa.schema(fields), keys if output_keys else None)
        self.state_format = 2  # part of the circuit fingerprint: state saved by format 1 (no extremes) is refused
        self.in_schema = in_schema
        self.keys = keys
        self.names = list(aggs)
        # kernel aggregates: slot 0 is always the row count (groups with count 0 have no row, invariant 1)
        self.kernel: list[tuple[str, str | None]] = [("count", None)]
        self.plan: list[tuple[str, list[int]]] = []  # per user aggregate: its kind and kernel slots
        extras: list[AggSpec] = []
        for agg in aggs.values():
            if agg.kind in GROUP_KINDS:  # computed after the kernel's slots, over whole groups (group_values)
                self.plan.append(("group", [len(extras)]))
                extras.append(agg)
                continue
            if agg.kind == "count":
                slots = [0] if agg.column is None else [self._slot("count_col", agg.column)]
            elif agg.kind == "count_distinct":  # partials come from operators/count_distinct.py
                slots = [self._slot("count_distinct", agg.column)]
            elif agg.kind in ("sum", "avg"):  # the non-null count decides when the result is null
                t = in_schema.field(agg.column).type
                if pat.is_uint64(t) or (agg.kind == "avg" and pat.is_int64(t)):  # invariant 5: limb slots
                    slots = [self._slot("sum_hi", agg.column), self._slot("sum_lo", agg.column)]
                else:
                    slots = [self._slot("sum", agg.column)]
                slots.append(self._slot("count_col", agg.column))
            else:
                slots = [self._slot(agg.kind, agg.column)]
            self.plan.append((agg.kind, slots))
        if extras:
            self.extras = tuple(extras)
        self.linear = not extras and all(k in ("count", "count_col", "count_distinct") or k in LIMBS
                                         or (k == "sum" and pat.is_integer(in_schema.field(c).type))
                                         for k, c in self.kernel)
        distinct_columns = tuple(c for k, c in self.kernel if k == "count_distinct")
        if distinct_columns:
            self.distinct_columns = distinct_columns
        if distinct_columns and not self.linear:
            raise SchemaError(f"{where}: count_distinct combines only with count and integer sum/avg in one agg(); "
                              f"compute min/max and float aggregates in another agg() and join the results")
        self.partial_slots = [f"p_{j}" for j in range(len(self.kernel))]
        self.pschema = pa.schema([pa.field(k, in_schema.field(k).type) for k in keys]
                                 + [pa.field(c, pa.int64()) for c in self.partial_slots])

    def _slot(self, kind: str, column: str | None) -> int:
        if (kind, column) not in self.kernel:
            self.kernel.append((kind, column))
        return self.kernel.index((kind, column))

    @property
    def extremes(self) -> bool:
        """Whether the extremes strategy serves this aggregate (invariant 3)."""
        return not self.linear and not self.extras and all(
            k in ("count", "count_col", "min", "max") or pat.is_integer(self.in_schema.field(c).type)
            for k, c in self.kernel)

    def instance(self) -> "_LinearState | _ExtremesState | _RecomputeState":
        if self.linear:
            return _LinearState(self)
        if self.extremes:
            return _ExtremesState(self)
        return _RecomputeState(self)

    def finalize(self, totals: pa.Table) -> pa.Table:
        """User rows from a table of keys then one column per kernel slot (positional)."""
        nk = len(self.keys)
        cols = [totals.column(i) for i in range(nk)] if self.output_keys else []
        for (kind, slots), field, name in zip(self.plan, list(self.schema)[len(cols):], self.names):
            if kind == "group":  # computed whole by group_values, after the kernel's slots
                col = totals.column(nk + len(self.kernel) + slots[0])
            elif kind == "avg" and pat.is_floating(totals.schema.field(nk + slots[0]).type):
                s = totals.column(nk + slots[0])
                n = pc.cast(totals.column(nk + slots[1]), pa.float64())
                col = pc.if_else(pc.equal(n, 0.0), pa.scalar(None, pa.float64()), pc.divide(s, n))
            elif kind == "avg":  # an integer sum: exact, divided in long double (invariant 5)
                hi, lo, n = _slot_ints(totals, nk, slots)
                s = hi.astype(np.longdouble) if lo is None else hi.astype(np.longdouble) * 2**32 + lo
                with np.errstate(invalid="ignore", divide="ignore"):
                    col = pa.array((s / n).astype(np.float64), pa.float64(), mask=n == 0)
            elif kind == "sum" and len(slots) == 3:  # a uint64 sum in limbs (invariant 5)
                hi, lo, n = _slot_ints(totals, nk, slots)
                bad = (hi < 0) | (hi >= 2**32)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise WeightOverflowError(
                        f"{self.label}: sum({self.kernel[slots[0]][1]!r}) as {name!r} of a group is "
                        f"{int(hi[i]) * 2**32 + int(lo[i])}, outside uint64 (the result type of a uint64 sum)")
                u = (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)
                col = pa.array(u, pa.uint64(), mask=n == 0 if (n == 0).any() else None)
            elif kind == "sum":
                s, n = totals.column(nk + slots[0]), totals.column(nk + slots[1])
                if n.null_count or not bool(n.to_numpy().all()):  # null where the group has no non-null value
                    s = pc.if_else(pc.equal(n, 0), pa.scalar(None, s.type), s)
                col = s
            else:
                col = totals.column(nk + slots[0])
            if not col.type.equals(field.type):
                col = pc.cast(col, field.type)
            cols.append(col)
        return pa.Table.from_arrays(cols, schema=self.schema)

    @property
    def int_slots(self) -> bool:
        """Whether every aggregate is a count or the sum of an int64 column (one slot), all int64 results:
        the aggregates :meth:`finalize_ints` finalizes (dbsp_core/runtime/plan.py fuses the steps of such
        linear aggregates)."""
        return self.linear and not self.distinct_columns and all(
            (kind == "count" or (kind == "sum" and len(slots) == 2
                                 and pat.is_int64(self.in_schema.field(self.kernel[slots[0]][1]).type)))
            and pat.is_int64(field.type)
            for (kind, slots), field in zip(self.plan, list(self.schema)[len(self.keys) if self.output_keys else 0:]))

    def finalize_ints(self, keys: pa.Table, vals: np.ndarray) -> pa.Table:
        """:meth:`finalize` of an aggregate with :attr:`int_slots` from the keys and the slot values as an
        (slots, rows) int64 array, without a table of slots: a sum is null where its non-null count is 0."""
        cols = list(keys.columns) if self.output_keys else []
        for kind, slots in self.plan:
            if kind == "sum":
                none = vals[slots[1]] == 0
                cols.append(pa.array(vals[slots[0]], pa.int64(), mask=none if none.any() else None))
            else:
                cols.append(pa.array(vals[slots[0]], pa.int64()))
        return pa.Table.from_arrays(cols, schema=self.schema)

    def ints_may_cancel(self, rows: np.ndarray, vals: np.ndarray) -> bool:
        """Whether two adjacent output rows of :meth:`finalize_ints` over a linear step's rows (``rows``: the change's
        row carrying each output row's key; ``vals``: the slot values) may be equal: rows of one group (the same
        carrying row) whose shown slots agree (a null sum's slot is 0, so equal rows have equal slots: the test is
        conservative). False means the step's output is distinct as it stands (rows of two groups differ in their
        keys), so no ``sum_adjacent`` pass is needed; an aggregate whose output leaves its keys out answers True."""
        if not self.output_keys:
            return True
        if len(rows) < 2:
            return False
        same = rows[1:] == rows[:-1]
        for _, slots in self.plan:
            if not same.any():
                return False
            v = vals[slots[0]]
            same &= v[1:] == v[:-1]
        return bool(same.any())

    def raise_overflow(self, exc: WeightOverflowError) -> None:
        """Raise ``exc``, which a kernel raised in a step of this aggregate, as an error naming the aggregate and its
        one-slot integer sums (invariant 5); ``exc`` itself when it already names the aggregate."""
        if str(exc).startswith(self.label):
            raise exc
        sums = ", ".join(f"{kind}({self.kernel[slots[0]][1]!r}) as {name!r}" for (kind, slots), name
                         in zip(self.plan, self.names) if kind in ("sum", "avg") and len(slots) == 2)
        raise WeightOverflowError(f"{self.label}: a group's count or integer sum leaves int64"
                                  + (f" (integer sums: {sums})" if sums else "")) from exc

    def nonempty(self, totals: pa.Table) -> pa.Table:
        """Drop groups whose row count (slot 0) is zero."""
        counts = totals.column(len(self.keys))
        mask = pc.not_equal(counts, 0)
        return totals if pc.all(mask).as_py() is not False else totals.filter(mask)

    def output(self, new: pa.Table | None, old: pa.Table | None) -> "ZSet":
        """The change: +finalize(new) - finalize(old), unconsolidated (rows of unchanged groups cancel when a
        consumer consolidates: the next operator's index or the pipeline's output)."""
        parts = []
        if new is not None and new.num_rows:
            parts.append(make(self.finalize(new), np.ones(new.num_rows, dtype=np.int64), self.schema))
        if old is not None and old.num_rows:
            parts.append(make(self.finalize(old), np.full(old.num_rows, -1, dtype=np.int64), self.schema))
        return concat(parts, self.schema)


def reduce_groups(ix: "IndexedZSet", kernel: list[tuple[str, str | None]]) -> pa.Table:
    """``ix.reduce(kernel)`` with sums taken over the column with nulls replaced by 0 (same sum; the
    non-null count slot tells an all-null group apart)."""
    data, kern = _sum_columns(ix.zset.data, kernel)
    if data is not ix.zset.data:
        ix = IndexedZSet._make(ZSet._make(data, ix.zset.weights), ix.key, ix.key_hash)
    return ix.reduce(kern)


def _sum_columns(data: pa.Table, kernel: list[tuple[str, str | None]]) -> tuple[pa.Table, list[tuple[str, str | None]]]:
    """``data`` with the columns the kernel's slots sum (nulls as 0, limbs, zeros for count_distinct) appended,
    and the kernel over them: what :func:`reduce_groups` and the combiner (PreAggregate) reduce."""
    extra: dict[str, pa.ChunkedArray] = {}
    kern = []
    for kind, col in kernel:
        if kind == "count_distinct":  # its partials come from operators/count_distinct.py: 0 here
            if "__zero" not in extra:
                extra["__zero"] = pa.chunked_array([np.zeros(data.num_rows, dtype=np.int64)], pa.int64())
            kern.append(("sum", "__zero"))
        elif kind == "sum" and col is not None and data.column(col).null_count:
            name = f"__nonnull_{col}"
            if name not in extra:
                extra[name] = pc.fill_null(data.column(col), 0)
            kern.append((kind, name))
        elif kind in LIMBS:
            name = f"__{kind}_{col}"
            if name not in extra:
                extra[name] = limb(kind, data.column(col))
            kern.append(("sum", name))
        else:
            kern.append((kind, col))
    for name, col in extra.items():
        data = data.append_column(name, col)
    return data, kern


class _GroupedState(ABC):
    """What the recompute and extremes states share: a step (``_step``) whose weight overflow is reported as the
    aggregate's (:meth:`Aggregate.raise_overflow`)."""

    op: Aggregate

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        try:
            return self._step(inputs, ctx)
        except WeightOverflowError as e:
            self.op.raise_overflow(e)

    @abstractmethod
    def _step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        """The step's change of the aggregate (``step`` names the view when a weight overflows)."""


class _RecomputeState(_GroupedState):
    """Invariant 3, recompute strategy: re-reduce the affected groups from the integrated input."""

    def __init__(self, op: Aggregate) -> None:
        self.op = op
        self.trace = Trace(op.in_schema, op.keys)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"input": self.trace}

    def _reduce(self, z: "ZSet") -> pa.Table | None:
        if z.num_rows == 0:
            return None
        ix = z.index_by(list(self.op.keys))
        if not len(ix):
            return None
        table = reduce_groups(ix, self.op.kernel)
        for j, col in enumerate(group_values(ix, self.op.extras, table.num_rows)):
            table = table.append_column(f"__group_{j}", col)
        return self.op.nonempty(table)

    def _step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        op = self.op
        dix = keyed_change(self, inputs, ctx, op.in_schema, op.keys)
        if dix is None:
            return empty(op.schema)
        old = concat([b.zset for b in self.trace.lookup(unique_sorted(dix.key_hash))], op.in_schema)
        new = concat([old, dix.zset], op.in_schema)
        self.trace.insert(dix)
        return op.output(self._reduce(new), self._reduce(old))


def _group_ids(ix: "IndexedZSet") -> np.ndarray:
    """Each row's group number in ``ix`` (whose rows of equal keys are adjacent), numbered in row order: the order of
    :func:`reduce_groups`' rows. Keys match as the kernel matches them: null equals null, NaN equals NaN."""
    data, n = ix.zset.data, ix.zset.num_rows
    kh = np.asarray(ix.key_hash)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = kh[1:] != kh[:-1]
        for k in ix.key:
            col = data.column(k).combine_chunks()
            a, b = col.slice(1), col.slice(0, n - 1)
            d = pc.fill_null(pc.not_equal(a, b), False)
            if pat.is_floating(col.type):
                d = pc.and_(d, pc.invert(pc.and_(pc.fill_null(pc.is_nan(a), False), pc.fill_null(pc.is_nan(b), False))))
            d = pc.or_(d, pc.xor(pc.is_null(a), pc.is_null(b)))
            brk[1:] |= d.to_numpy(zero_copy_only=False)
    return np.cumsum(brk) - 1


def _order_indices(data: pa.Table, gid: np.ndarray, order: tuple, value: str, rows: np.ndarray) -> np.ndarray:
    """``rows`` sorted by group, then ``order`` ((column, descending, nulls_first) each), then the value (nulls
    last): one sort, no Python per row."""
    cols: dict[str, pa.Array] = {"g": pa.array(gid[rows])}
    keys: list[tuple[str, str]] = [("g", "ascending")]
    take = pa.array(rows, pa.int64())
    for i, (c, desc, nulls_first) in enumerate(tuple(order) + ((value, False, False),)):
        v = data.column(c).take(take)
        cols[f"n{i}"] = pc.cast(pc.is_null(v), pa.int8())
        keys.append((f"n{i}", "descending" if nulls_first else "ascending"))
        if not (pat.is_null(v.type) or v.null_count == len(v)):
            cols[f"v{i}"] = v
            keys.append((f"v{i}", "descending" if desc else "ascending"))
    order_ix = pc.sort_indices(pa.table(cols), sort_keys=keys).to_numpy()
    return rows[order_ix]


def group_values(ix: "IndexedZSet", extras: Sequence[AggSpec], ngroups: int) -> list[pa.Array]:
    """The whole-group aggregates (dbsp_core/aggregates.py invariant 6) of each group of ``ix``, in the order of
    :func:`reduce_groups`' rows (``ngroups`` of them): one array per aggregate. Vectorized: group sums by
    ``np.bincount`` in row order, orders by one sort."""
    if not extras:
        return []
    data = ix.zset.data
    w = np.asarray(ix.zset.weights).astype(np.float64)
    gid = _group_ids(ix)
    if len(gid) and int(gid[-1]) + 1 != ngroups:
        raise DbspError(f"internal: {int(gid[-1]) + 1} groups found where the kernel reduced {ngroups}")
    out = []
    for agg in extras:
        if agg.kind in ("first", "last", "string_agg"):
            out.append(_ordered_value(data, w, gid, ngroups, agg))
        else:
            out.append(_statistic(data, w, gid, ngroups, agg))
    return out


def _statistic(data: pa.Table, w: np.ndarray, gid: np.ndarray, ng: int, agg: AggSpec) -> pa.Array:
    """The variance family by the two-pass method: the group's mean, then the centred sums (float64 throughout;
    an integer value is exact in float64 up to 2^53)."""
    cols = [agg.column] + ([agg.args[0]] if agg.kind in PAIR_KINDS else [])
    valid = np.ones(len(gid), dtype=bool)
    xs = []
    for c in cols:
        col = data.column(c)
        valid &= pc.is_valid(col).to_numpy(zero_copy_only=False)
        xs.append(pc.cast(pc.fill_null(col, 0), pa.float64()).to_numpy(zero_copy_only=False))
    ww = np.where(valid, w, 0.0)
    n = np.bincount(gid, weights=ww, minlength=ng)
    with np.errstate(invalid="ignore", divide="ignore"):
        devs = []
        for x in xs:
            x = np.where(valid, x, 0.0)
            mean = np.bincount(gid, weights=ww * x, minlength=ng) / n
            devs.append(np.where(valid, x - mean[gid], 0.0))
        dx, dy = devs[0], devs[-1]
        sxy = np.bincount(gid, weights=ww * dx * dy, minlength=ng)
        samp = agg.kind.endswith("_samp")
        if agg.kind == "corr":
            sxx = np.bincount(gid, weights=ww * dx * dx, minlength=ng)
            syy = np.bincount(gid, weights=ww * dy * dy, minlength=ng)
            val = sxy / np.sqrt(sxx * syy)
        else:
            val = sxy / (n - 1 if samp else n)
            if agg.kind.startswith("stddev"):
                val = np.sqrt(val)
    null = n < (2 if samp else 1)
    return pa.array(np.where(null, 0.0, val), pa.float64(), mask=null if null.any() else None)


def _ordered_value(data: pa.Table, w: np.ndarray, gid: np.ndarray, ng: int, agg: AggSpec) -> pa.Array:
    """first / last (a row's value, in the group's order) and string_agg (the group's non-null strings, each as
    often as its weight, joined in order)."""
    col = data.column(agg.column)
    if agg.kind in ("first", "last"):
        idx = _order_indices(data, gid, agg.args[0], agg.column, np.arange(len(gid)))
        g = gid[idx]
        at = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if agg.kind == "first" else \
            np.flatnonzero(np.r_[g[1:] != g[:-1], True])
        return col.take(pa.array(idx[at], pa.int64())).combine_chunks() if len(at) else pa.array([], col.type)
    sep, order = agg.args
    rows = np.flatnonzero(pc.is_valid(col).to_numpy(zero_copy_only=False))
    idx = _order_indices(data, gid, order, agg.column, rows) if len(rows) else rows
    # a trace lookup may bring rows of groups the change does not touch, partial (a deletion without its row):
    # they reduce alike in the old and the new totals and cancel, so any value will do, but not a negative repeat
    rep = np.repeat(idx, np.maximum(w[idx], 0).astype(np.int64))
    counts = np.bincount(gid[rep], minlength=ng)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = pc.cast(col.take(pa.array(rep, pa.int64())), pa.string()).combine_chunks()
    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), values), sep)
    return pc.if_else(pa.array(counts > 0), joined, pa.scalar(None, pa.string()))


class PreAggregate(Operator):
    """The combiner of a linear aggregate: its input change as partial rows (keys, then one int64 per slot).

    A partial row with weight w stands for w times its values. Small changes become one partial row per input
    row (vectorized, no grouping pass); large ones are grouped first, one row per group, which shrinks what
    crosses the exchange and what the aggregate's grouping pass sees (20% less CPU at W = 1 on 100k-row
    changes into 1000 groups). Both forms sum to the same totals in exact integer arithmetic, so results do
    not depend on the choice.
    """

    split_safe = True  # base.py invariant 6 (linear: a change as partial rows)

    kind = "pre_aggregate"
    GROUP_ABOVE = 16_384  # rows; below this, a grouping pass costs more than it saves

    def __init__(self, node: int, agg: Aggregate, partitioning: tuple[str, ...] | None) -> None:
        super().__init__((node,), agg.pschema, partitioning)
        self.agg = agg

    def rowwise(self, z: "ZSet") -> "ZSet":
        """Each row as a partial row of its own, weight kept."""
        data, n = z.data, z.num_rows
        cols = [data.column(k) for k in self.agg.keys]
        ones = None
        for kind, col in self.agg.kernel:
            c = data.column(col) if col is not None else None
            if kind == "count_distinct":  # its partials come from operators/count_distinct.py
                cols.append(pa.array(np.zeros(n, dtype=np.int64)))
            elif kind == "count" or (kind == "count_col" and c.null_count == 0):
                ones = pa.array(np.ones(n, dtype=np.int64)) if ones is None else ones
                cols.append(ones)
            elif kind == "count_col":
                cols.append(pc.cast(pc.is_valid(c), pa.int64()))
            elif kind in LIMBS:
                cols.append(limb(kind, c))
            elif c.null_count == 0 and pat.is_int64(c.type):  # integer sum of an int64 column without nulls
                cols.append(c)
            else:
                cols.append(pc.cast(pc.fill_null(c, 0), pa.int64()))
        return make(pa.Table.from_arrays(cols, schema=self.schema), z.weights, self.schema)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = inputs[0]
        if z.num_rows == 0:
            return empty(self.schema)
        z = conform(z, self.agg.in_schema)
        if z.num_rows < self.GROUP_ABOVE:
            return self.rowwise(z)
        # hash grouping by the keys alone: no index (a sort of whole rows) is built for a one-off reduce, and
        # every group is kept, since a group whose weights sum to 0 may still move the sums
        data, kern = _sum_columns(z.data, self.agg.kernel)
        try:
            table = ZSet._make(data, z.weights).aggregate(list(self.agg.keys), kern, consolidate=False,
                                                          keep_zero=True).rename_columns(self.schema.names)
        except WeightOverflowError as e:
            self.agg.raise_overflow(e)
        return make(table, np.ones(table.num_rows, dtype=np.int64), self.schema)


class _LinearState:
    """Invariant 3, linear strategy: keep one partial row per group and add the change's partial rows.

    A step groups the change's partial rows once (a C hash grouping that keeps groups whose weights sum to 0,
    since a partial row stands for several rows: their sums need not be 0), then reads each group's old totals
    with one probe into the trace's key index (trace invariant 11) and stores its new ones there, all in one C
    call (``_zset.linear_step``); for keys with string columns, or while the index is off or stale, the old
    totals come from a galloping C walk over every trace batch that sums the matching partial rows in place, and
    the trace's insert updates an index it keeps. New totals are old plus the change's sums; only groups whose
    totals changed produce output and trace rows.
    """

    HOLD: int | None = None  # the totals trace's ``hold`` (trace invariant 18); None: ``DBSP_TOTALS_HOLD``'s (tests set it)
    PER_KEY: bool | None = None  # totals kept per key (trace invariant 19); None: ``DBSP_TOTALS_PER_KEY``'s (tests set it)

    def __init__(self, op: Aggregate) -> None:
        self.op = op
        self.keys = list(op.keys)
        self.p = op.partial_slots
        self.pschema = op.pschema
        nk = len(self.keys)
        self.keypos = tuple(range(nk))
        self.combine = [("sum", nk + j) for j in range(len(self.p))]  # the p_j columns of pschema
        self.kschema = pa.schema(list(self.pschema)[:nk])  # the key columns of pschema
        # read by key only (the key index, or key_sums' walk): its batches keep no row hashes (trace invariant 1)
        self.trace = Trace(self.pschema, op.keys, row_hashes=False)
        self.spec = ("key", tuple(self.p))
        self.slotpos = tuple(nk + j for j in range(len(self.p)))  # the p_j columns of pschema
        self.trace.keep_index(tuple(self.p))  # a group's old totals in one probe (trace invariant 11)
        hold = settings().totals_hold if self.HOLD is None else self.HOLD
        if hold > 2:  # its low levels merge many at a time while the index serves its reads (trace invariant 18)
            self.trace.hold = hold
        if (settings().totals_per_key if self.PER_KEY is None else self.PER_KEY):
            self.trace.keep_totals_per_key()  # the index is the state, the batches synced on reads (invariant 19)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"partials": self.trace}

    def _through_index(self, view: "_zset.BatchView", keypos: tuple | None = None, slotpos: tuple | None = None
                       ) -> tuple | None:
        """The step's groups and rows through the trace's key index in one C call (``_zset.linear_step``), which
        also stores the new totals in the index; None when the trace cannot serve it (no index, or a stale one).
        ``keypos`` and ``slotpos``: where the keys and the partial values sit in ``view`` (default: partial rows)."""
        keypos = self.keypos if keypos is None else keypos
        slotpos = self.slotpos if slotpos is None else slotpos

        def step(ix: object) -> tuple:
            rows, w, kh, rh, vals, ordered = _zset.linear_step(view, keypos, slotpos, ix)
            return rows, w, kh, vals, rh, ordered, ix

        return self.trace.through_index(self.spec, step)

    def _through_batches(self, view: "_zset.BatchView", data: pa.Table) -> tuple:
        """The same as :meth:`_through_index` by a grouping pass, old totals read with :meth:`Trace.key_sums` (the
        index, or a galloping walk over every batch), and the fold."""
        # the change's groups (group_row: a row carrying the key), their key hashes (ascending) and partial sums
        group_row, khash, delta, _, _ = _zset.group_reduce(view, None, self.keypos, self.combine, True)
        old = self.trace.key_sums(data, self.keys, khash, group_row, self.p, view)
        # the changed groups' rows of new (+1) and old (-1) totals, in index order (csrc/fold.h)
        grp, w, kh, vals, ordered = _zset.linear_fold(old, delta, khash)
        return group_row[grp], w, kh, vals, None, ordered, None

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        op = self.op
        prune(self, input_times(op), ctx)  # groups no later change can reach (dbsp_core.time.cleanup)
        z = inputs[0]  # partial rows from PreAggregate
        if z.num_rows == 0:
            return empty(op.schema)
        z = conform(z, self.pschema)
        data = z.data
        view = _zset.BatchView(data, z.weights)  # one view for the grouping pass, the probes and the take
        try:
            found = self._through_index(view) or self._through_batches(view, data)
        except WeightOverflowError as e:
            op.raise_overflow(e)
        return self._emit(view, self.keypos, found, op.finalize)

    def step_rows(self, z: "ZSet", keypos: tuple, slotpos: tuple, ctx: "StepContext") -> "ZSet | None":
        """The step of this aggregate straight from its input rows (dbsp_core/runtime/plan.py: a fused chain
        PreAggregate -> exchange -> aggregate where the exchange is the identity): ``z``'s rows are the partial
        rows (keys at ``keypos``, each slot's int64 value at ``slotpos``: a count's column of ones, a sum's
        column), as PreAggregate.rowwise would build them, without building them. Output as :meth:`finalize_ints`
        makes it. None, having changed nothing, when the key index cannot serve the step (the caller then runs
        the unfused chain)."""
        op = self.op
        prune(self, input_times(op), ctx)
        view = _zset.BatchView(z.data, z.weights)
        try:
            found = self._through_index(view, keypos, slotpos)
        except WeightOverflowError as e:
            op.raise_overflow(e)
        if found is None:
            return None
        return self._emit(view, keypos, found, None)

    def step_run(self, z: "ZSet", run: "_zset.LinearRun", ctx: "StepContext") -> "ZSet | None":
        """:meth:`step_rows` in one C call (``run``, a ``_zset.LinearRun`` over ``z``'s columns: csrc/linrun.h): the
        grouping, the key index's probes and stores, the trace batch's and the output's columns, built without a
        Python or Arrow call between them. None, having changed nothing, when it cannot serve the step (no current
        key index, or a null in a counted or summed column): the caller then takes another path."""
        return self.step_call(lambda ix, dirty, keyorder: run.step(z.data, z.weights, ix, dirty,
                                                                   dirty is not None and self.trace.pk_found_dirty(),
                                                                   keyorder), ctx, keyorder=True)

    def step_call(self, call: "Callable[[Any, Any], tuple | None]", ctx: "StepContext", keyorder: bool = False
                  ) -> "ZSet | None":
        """:meth:`step_run` over what ``call(ix, dirty)`` returns, ``LinearRun.step``'s tuple from the key index ``ix``
        (or None, having read and stored nothing), with the trace's dirty-key index ``dirty`` (None: none yet) probed
        in the call (csrc/linrun.h invariant 5; its answers go to ``store_totals``): the one-call step of a join
        folded into this group-by's totals (``_zset.JoinLinearRun``, dbsp_core/runtime/plan.py design note 4) takes
        this path too. ``keyorder``: ``call`` takes a third argument, whether to ask for the trace batch in key-hash
        order only (where the trace allows it: ``Trace.pk_keyorder``, csrc/linrun.h invariant 8; a group's rows then
        not by row hash)."""
        op = self.op
        prune(self, input_times(op), ctx)
        fresh: list = []  # (the dirty index probed, per row of the trace batch: its key not dirty)
        canonical = [True]  # the trace batch's rows in canonical order (else in key-hash order only)

        def step(ix: object) -> tuple | None:
            dirty = self.trace.pk_dirty(ix)
            ko = keyorder and self.trace.pk_keyorder(ix)
            canonical[0] = not ko
            r = call(ix, dirty, ko) if keyorder else call(ix, dirty)
            if r is None:  # a null: nothing read nor stored
                self.trace.index_done(ix)
                return None
            if dirty is not None:
                fresh.append((dirty, r[6]))
                r = r[:6]
            return r, ix

        try:
            found = self.trace.through_index(self.spec, step)
        except WeightOverflowError as e:
            op.raise_overflow(e)
        if found is None:
            return None
        (batch, out, w, kh, ordered, distinct), ix = found
        if batch is None:  # no group changed
            self.trace.index_done(ix)
            return empty(op.schema)
        if ordered:  # groups by key hash, a group's two rows by row hash (or in key-hash order only, where the trace
            # records the batch per key): the trace batch as it stands (the C call's tables hold one record batch
            # each: one chunk per column as they are, zset.py invariant 1)
            self.trace.store_totals(IndexedZSet._make(ZSet._make(batch, w, chunked=True), tuple(self.keys), kh), ix,
                                    fresh[0] if fresh else None, canonical=canonical[0])
        else:  # a key-hash or row-hash tie (rare): values decide the order (the rows' answers then not in order)
            self.trace.store_totals(make(batch, w, self.pschema).index_by(self.keys), ix)
        if distinct:  # no group shows equal new and old rows (csrc/linrun.h invariant 2)
            return ZSet._make(out, w, distinct=True, chunked=True)
        return sum_adjacent(make(out, w, op.schema), kh)

    def _emit(self, view: "_zset.BatchView", keypos: tuple, found: tuple, finalize: object) -> "ZSet":
        """The trace batch and the output of a step whose groups ``found`` gave (``_through_index``' tuple) over
        the rows of ``view`` (keys at ``keypos``); ``finalize``: the aggregate's, or None for
        :meth:`Aggregate.finalize_ints` over the slot values."""
        op = self.op
        rows, w, kh, vals, rh, ordered, ix = found  # per output row: the change's row carrying its key, ...
        if len(rows) == 0:
            if ix is not None:
                self.trace.index_done(ix)
            return empty(op.schema)
        keys = _zset.take(view, rows, self.kschema, keypos)
        partials = pa.Table.from_arrays(list(keys.columns) + [pa.array(vals[j]) for j in range(len(self.p))],
                                        schema=self.pschema)
        if ordered:  # groups by key hash, a group's two rows by row hash: the trace batch as it stands
            batch = IndexedZSet._make(ZSet._make(partials, w), tuple(self.keys), kh)
            if rh is not None and self.trace.row_hashes:
                batch._rh = rh  # the row hashes of (keys, slots), which the fold computed (trace merges use them)
        else:  # a key-hash or row-hash tie (rare): values decide the order
            batch = make(partials, w, self.pschema).index_by(self.keys)
        if ix is not None:
            self.trace.store_totals(batch, ix)  # inserted, or with totals per key recorded (trace invariant 19)
        else:
            self.trace.insert(batch)
        # a group's new and old rows sit side by side: they cancel when the view's columns did not change (a sum
        # that a 0 left as it was), and rows of two groups differ in their keys, so no sort makes it distinct
        if finalize is None:
            out = op.finalize_ints(keys, vals)  # one chunk a column, op.schema's own (its from_arrays)
            if not op.ints_may_cancel(rows, vals):  # distinct as it stands: no pass over the rows
                return ZSet._make(out, np.ascontiguousarray(w, dtype=np.int64), distinct=True)
        else:
            out = op.finalize(partials)
        return sum_adjacent(make(out, w, op.schema), kh)


class _ExtremesState(_GroupedState):
    """Invariant 3, extremes strategy: current totals per group plus, per min/max column, the group's values.

    One grouping pass over a combined table folds the change into the old totals. Its rows are the groups'
    old totals rows (weight 1), the change rows (their weight) and a copy of the change's negative rows
    (weight negated, so the weight-aware min/max kernel sees them). Per kernel slot j the columns are:

    - linear slots: ``p_j`` (old total / the row's partial value, summed with weights: the new total) and
      ``q_j`` (old total on old rows, 0 elsewhere: the old total);
    - extreme slots: ``e_j`` (old extreme and the change's values: min/max over positive rows is the extreme
      of the old one and the inserted values), ``o_j`` (the old extreme) and ``d_j`` (the deleted values: their
      min for a min slot, max for a max slot).

    A group whose deleted extreme is not strictly beyond its old extreme is re-reduced from the value traces.
    """

    PER_KEY: bool | None = None  # the totals kept per key (invariant 12); None: ``DBSP_TOTALS_PER_KEY``'s (tests set it)

    def __init__(self, op: Aggregate) -> None:
        self.op = op
        self.keys = list(op.keys)
        key_fields = [pa.field(k, op.in_schema.field(k).type) for k in op.keys]
        self.lin = tuple(j for j, (kind, _) in enumerate(op.kernel) if kind not in ("min", "max"))
        self.ext = tuple((j, kind, col) for j, (kind, col) in enumerate(op.kernel) if kind in ("min", "max"))
        cols = sorted({col for _, _, col in self.ext}) if not op.append_only else []  # invariant 7
        self.val_cols = tuple((col, f"values_{i}") for i, col in enumerate(cols))  # (column, attribute)
        hold = settings().totals_hold if _LinearState.HOLD is None else _LinearState.HOLD
        for col, attr in self.val_cols:
            setattr(self, attr, Trace(pa.schema(key_fields + [op.in_schema.field(col)]), op.keys))
            if hold > 2:  # read only for the groups whose extreme a deletion reached (invariant 11)
                getattr(self, attr).hold_keyed = hold
        slot_type = {j: op.in_schema.field(col).type for j, _, col in self.ext}
        self.sschema = pa.schema(key_fields + [pa.field(f"s_{j}", slot_type.get(j, pa.int64()))
                                               for j in range(len(op.kernel))])
        self.totals = Trace(self.sschema, op.keys)
        self._tkeypos = tuple(self.sschema.get_field_index(k) for k in op.keys)  # (a totals batch's key positions)
        fields = list(key_fields)
        aggs: list[tuple[str, str | None]] = []
        for j in self.lin:
            fields += [pa.field(f"p_{j}", pa.int64()), pa.field(f"q_{j}", pa.int64())]
            aggs += [("sum", f"p_{j}"), ("sum", f"q_{j}")]
        for j, kind, _ in self.ext:
            fields += [pa.field(f"{r}_{j}", slot_type[j]) for r in "eod"]
            aggs += [(kind, f"e_{j}"), ("max", f"o_{j}"), (kind, f"d_{j}")]
        self.cschema = pa.schema(fields)
        self.aggs = tuple(aggs)
        self.names = tuple(f.name for f in fields)  # reduce output: the keys, then one column per agg
        # the one-pass step (csrc/extremes.h) through a key index of the totals: per group its slots, then one
        # "not null" flag per extreme; only where every extreme's values sum as int64 (integers, dates, timestamps)
        # invariant 9: a change with retractions is projected onto the columns the aggregate reads before it is
        # indexed (keys first, then the other columns in input order); the positions below are the projection's
        read = [c for c in op.in_schema.names if c not in op.keys and any(col == c for _, col in op.kernel)]
        self.projected: list[str] | None = None
        if not op.append_only and len(op.keys) + len(read) < len(op.in_schema):
            self.projected = list(op.keys) + read
        src = op.in_schema if self.projected is None else pa.schema([op.in_schema.field(c) for c in self.projected])
        self.proj_schema = src  # what a projected change holds (a fused exchange sends it so, runtime/plan.py)
        self.keypos = tuple(src.get_field_index(k) for k in op.keys)
        # limb slots sum columns appended to the change (invariant 5): their positions follow the input's
        self.limbs = tuple((kind, col) for kind, col in op.kernel if kind in LIMBS)
        nin = len(src)
        self.slot_specs = tuple(("sum", nin + self.limbs.index((kind, col))) if kind in LIMBS
                                else (kind, None if col is None else src.get_field_index(col))
                                for kind, col in op.kernel)
        self.spec = ("key", tuple(f"s_{j}" for j in range(len(op.kernel)))
                     + tuple(("valid", f"s_{j}") for j, _, _ in self.ext))
        if not (all(summable(slot_type[j]) for j, _, _ in self.ext) and self.totals.keep_index(self.spec[1])):
            self.spec = None
        else:  # read through the key index: its low levels merge many at a time (trace invariant 18)
            if hold > 2:
                self.totals.hold = hold
            if settings().totals_per_key if self.PER_KEY is None else self.PER_KEY:
                self.totals.keep_totals_per_key()  # the index is the state, the batches synced on reads (invariant 12)
        # invariant 8: the reduction's grouping specs (row count, the one extreme), when the aggregate allows it
        self.reduce_specs = None
        if (op.append_only and len(self.ext) == 1 and _reducible(slot_type[self.ext[0][0]])
                and all(spec == ("count", None) for j, spec in enumerate(op.kernel) if j != self.ext[0][0])):
            self.reduce_specs = tuple(_agg_specs(op.in_schema, [("count", None), self.ext[0][1:]]))
        self.reduced_steps = 0  # changes reduced (counts for tests, not state)
        self.projected_steps = 0  # changes projected (invariant 9; counts for tests, not state)
        self.emit = self._emitter() if self.spec is not None else None  # phase 2 in one C call (invariant 10)
        self.emitted_steps = 0  # steps whose second half ran in that call (counts for tests, not state)
        self.recomputed = 0  # groups whose extremes were re-reduced from the value multisets (counts for tests)
        # a recompute's fill-in per value column (_recompute_into): (slot, is min, its "not null" flag's position)
        ns = len(op.kernel)
        self._fills = tuple(tuple((j, kind == "min", ns + e) for e, (j, kind, c) in enumerate(self.ext) if c == col)
                            for col, _ in self.val_cols)  # (tuples: configuration, not checkpointed state)
        self._vkeys = tuple(range(len(self.keys)))  # a value batch's key columns
        self.unprobed_steps = 0  # steps stored per key with no dirty-key probe (invariant 12; counts for tests)
        # steps left before the reduction is tried again (invariant 8): of the step's change, and of what a fused
        # exchange sends (dbsp_core/runtime/plan.py): after a sender's reduction a group arrives as about one row
        self._reduce_skip = self._send_skip = 0

    def _emitter(self) -> "_zset.ExtremesEmit | None":
        """Invariant 10: the C call that emits a step's totals batch and output and stores the new totals, configured
        for this aggregate's slots and output columns; None when an output column is not one it finalizes (an avg,
        a uint64 sum in limbs, a cast, hidden keys): :meth:`_through_index` then builds them in Python."""
        op = self.op
        if not op.output_keys:
            return None
        nk, ns = len(self.keys), len(op.kernel)
        ext = {j: ns + e for e, (j, _, _) in enumerate(self.ext)}  # an extreme's "not null" flag among the values
        shown, nonnull, owidth = [], [], []
        for (kind, slots), field in zip(op.plan, list(op.schema)[nk:]):
            if kind in ("min", "max") and field.type.equals(self.sschema.field(nk + slots[0]).type):
                shown.append(slots[0])
                nonnull.append(ext[slots[0]])
            elif kind == "count" and pat.is_int64(field.type):
                shown.append(slots[0])
                nonnull.append(-1)
            elif kind == "sum" and len(slots) == 2 and pat.is_int64(field.type):
                shown.append(slots[0])
                nonnull.append(slots[1])  # null where the group's non-null count is 0 (Aggregate.finalize)
            else:
                return None
            owidth.append(field.type.bit_width // 8)
        slot_types = [self.sschema.field(nk + j).type for j in range(ns)]
        if not all(pat.is_integer(t) or pat.is_timestamp(t) or pat.is_date(t) for t in slot_types):
            return None
        return _zset.ExtremesEmit(self.keypos, ns + len(self.ext), [ext.get(j, -1) for j in range(ns)],
                                  [t.bit_width // 8 for t in slot_types], shown, nonnull, owidth, self.sschema,
                                  op.schema)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        out = {"totals": self.totals}
        for col, attr in self.val_cols:
            out[f"values.{col}"] = getattr(self, attr)
        return out

    def _partial(self, data: pa.Table, j: int, n: int) -> pa.Array:
        kind, col = self.op.kernel[j]
        if kind == "count":
            return pa.array(np.ones(n, dtype=np.int64))
        if kind == "count_col":
            return pc.cast(pc.is_valid(data.column(col)), pa.int64())
        if kind in LIMBS:
            return limb(kind, data.column(col))
        return pc.cast(pc.fill_null(data.column(col), 0), pa.int64())  # integer sum

    def _combined(self, old: pa.Table, change: "ZSet") -> "ZSet":
        data, w = change.data, change.weights
        n_o, n_c = old.num_rows, change.num_rows
        neg = w < 0
        negd = data.filter(pa.array(neg)) if neg.any() else data.slice(0, 0)
        n_n = negd.num_rows
        zeros = pa.array(np.zeros(max(n_c, n_n), dtype=np.int64))
        parts = {k: [old.column(k), data.column(k), negd.column(k)] for k in self.keys}
        for j in self.lin:
            s = old.column(f"s_{j}")
            parts[f"p_{j}"] = [s, self._partial(data, j, n_c), zeros.slice(0, n_n)]
            parts[f"q_{j}"] = [s, zeros.slice(0, n_c), zeros.slice(0, n_n)]
        for j, _, col in self.ext:
            s, t = old.column(f"s_{j}"), old.schema.field(f"s_{j}").type
            parts[f"e_{j}"] = [s, data.column(col), pa.nulls(n_n, t)]
            parts[f"o_{j}"] = [s, pa.nulls(n_c, t), pa.nulls(n_n, t)]
            parts[f"d_{j}"] = [pa.nulls(n_o, t), pa.nulls(n_c, t), negd.column(col)]
        table = pa.Table.from_arrays([_joined(parts[f.name], f.type) for f in self.cschema], schema=self.cschema)
        weights = np.concatenate([np.ones(n_o, dtype=np.int64), w, -w[neg]])
        return make(table, weights, self.cschema)

    def _need_recompute(self, sums: pa.Table) -> pa.Array | None:
        need = None
        for j, kind, _ in self.ext:
            d, o = sums.column(f"d_{j}"), sums.column(f"o_{j}")
            beyond = pc.greater(d, o) if kind == "min" else pc.less(d, o)  # null when either is null
            m = pc.and_(pc.is_valid(d), pc.invert(pc.fill_null(beyond, False)))
            need = m if need is None else pc.or_(need, m)
        return need if need is not None and pc.any(need).as_py() else None

    def _recompute(self, sums: pa.Table, need: pa.Array) -> pa.Table:
        """``sums`` with the extremes of the ``need`` groups re-reduced over their whole value multisets."""
        from dbsp_core.zset import ZSet

        n = sums.num_rows
        keys = sums.select(self.keys)
        self.recomputed += int(pc.sum(need).as_py())
        hashes = np.unique(ZSet._make(keys.filter(need), np.ones(int(pc.sum(need).as_py()), np.int64)).hash(
            self.keys))
        parts = {name: [sums.column(name)] for name in self.names}
        for j, _, _ in self.ext:
            parts[f"e_{j}"] = [pc.if_else(need, pa.scalar(None, sums.schema.field(f"e_{j}").type),
                                          sums.column(f"e_{j}"))]
        weights = [np.ones(n, dtype=np.int64)]
        for col, attr in self.val_cols:
            trace: Trace = getattr(self, attr)
            vals = lookup_exact(trace, hashes, trace.schema).consolidate()
            m = vals.num_rows
            if m == 0:
                continue
            for k in self.keys:
                parts[k].append(vals.data.column(k))
            zeros = pa.array(np.zeros(m, dtype=np.int64))
            for j in self.lin:
                parts[f"p_{j}"].append(zeros)
                parts[f"q_{j}"].append(zeros)
            for j, _, c in self.ext:
                t = self.cschema.field(f"e_{j}").type
                parts[f"e_{j}"].append(vals.data.column(col) if c == col else pa.nulls(m, t))
                parts[f"o_{j}"].append(pa.nulls(m, t))
                parts[f"d_{j}"].append(pa.nulls(m, t))
            weights.append(vals.weights)
        table = pa.Table.from_arrays([_joined(parts[f.name], f.type) for f in self.cschema], schema=self.cschema)
        return self._reduce(make(table, np.concatenate(weights), self.cschema))

    def _reduce(self, combined: "ZSet") -> pa.Table:
        """The grouping pass over a combined table, by hashing its rows as they stand: neither sorted nor
        consolidated (the rows only feed sums and min/max, and two equal rows of opposite weights there carry
        nulls in every extreme column: an old totals row and a change row differ in ``o_j`` unless the old
        extreme is null, a change row and a deleted row's copy in ``d_j`` unless the value is null), every
        group kept as :meth:`IndexedZSet.reduce` keeps it."""
        sums = combined.aggregate(self.keys, list(self.aggs), consolidate=False, keep_zero=True)
        return sums.rename_columns(list(self.names))

    REDUCE_ROWS = 1024  # rows of a change from which it is reduced (invariant 8); below, indexing it is cheap
    GROUPS_PER_ROW = 0.5
    RETRY = 16

    def _reduced(self, z: "ZSet", sender: bool = False) -> "ZSet":
        """``z`` reduced to one row per group (invariant 8), or ``z`` itself when it is small, when it has a weight
        that is not positive (the step then fails as invariant 7 says), or while reducing does not pay; ``sender``:
        for a fused exchange, which keeps its own count of steps to skip."""
        skip = "_send_skip" if sender else "_reduce_skip"
        if z.num_rows < self.REDUCE_ROWS:
            return z
        if getattr(self, skip):
            setattr(self, skip, getattr(self, skip) - 1)
            return z
        w = z.weights
        if not bool((w > 0).all()):
            return z
        group_row, _, ivals, _, valid = _zset.group_reduce(z.data, w, list(self.keypos), list(self.reduce_specs),
                                                           False)
        if len(group_row) > self.GROUPS_PER_ROW * z.num_rows:
            setattr(self, skip, self.RETRY)
        self.reduced_steps += 1
        rows = np.where(valid[:, 1].astype(bool), ivals[:, 1], group_row)  # the extreme's row, else the first
        return ZSet._make(_take(z.data, np.ascontiguousarray(rows, dtype=np.int64)),
                          np.ascontiguousarray(ivals[:, 0], dtype=np.int64))

    def _project(self, z: "ZSet") -> "ZSet":
        """``z`` with only the columns the aggregate reads (invariant 9), no row copied."""
        self.projected_steps += 1
        return ZSet._make(z.data.select(self.projected), z.weights)

    def _as_projected(self, z: "ZSet") -> "ZSet | None":
        """``z`` in the projection's column order when it holds exactly the projected columns in some order (a fused
        exchange or join of runtime/plan.py sent or gathered only those), else None; no row copied."""
        names = z.schema.names
        if self.projected is None or len(names) != len(self.projected) or set(names) != set(self.projected):
            return None
        return z if names == self.projected else ZSet._make(z.data.select(self.projected), z.weights)

    def _limbs_after(self, dix: IndexedZSet) -> IndexedZSet:
        """The projected, indexed change ``dix`` with the limb columns appended (invariant 9): a limb is a function
        of its column, so the rows and their order are those of indexing the change with its limbs; the result is
        read by the fold (group runs in key-hash order), never stored."""
        return IndexedZSet._make(self._with_limbs(dix.zset), dix.key, dix.key_hash)

    def _with_limbs(self, z: "ZSet") -> "ZSet":
        """``z`` with the limb columns the one-pass kernel sums (invariant 5)."""
        data = z.data
        for kind, col in self.limbs:
            data = data.append_column(f"__{kind}_{col}", limb(kind, data.column(col)))
        return make(data, z.weights, data.schema)

    def _step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        op = self.op
        if op.append_only and self.spec is not None:  # invariant 7: totals alone, and no value trace to feed
            # not reduced first (invariant 8): the kernel's one hash grouping of the change is its reduction
            z = opened_change(self, inputs, ctx, op.in_schema, self._with_limbs if self.limbs else None)
            if z is None:
                return empty(op.schema)
            if bool((z.weights < 0).any()):
                self._refuse_retraction()
            # the change is not indexed: the kernel groups its rows by hashing (no sort of the change)
            view = _zset.BatchView(z.data, z.weights)
            out = self.totals.through_index(self.spec, lambda ix: self._through_index(view, ix, inserts=True))
            if out is not None:
                return out
            dix = (self._reduced(z) if self.reduce_specs else z).index_by(self.keys)  # no current index: reduced
            return self._through_totals(dix) if len(dix) else empty(op.schema)
        prepare = self._with_limbs if self.limbs else self._reduced if self.reduce_specs else None
        schema = op.in_schema
        if self.projected is not None:  # invariant 9 (not append-only, so never reduced): limbs after indexing
            prepare = self._project
            done = self._as_projected(inputs[0])  # projected by a fused exchange or join (runtime/plan.py)
            if done is not None:
                inputs, schema, prepare = [done], self.proj_schema, None
        dix = keyed_change(self, inputs, ctx, schema, self.keys, prepare)
        if dix is None:
            return empty(op.schema)
        return self._step_indexed(dix)

    def index_projected(self, z: "ZSet") -> IndexedZSet | None:
        """A fused exchange's half of a projected step (invariant 9 at W > 1, runtime/plan.py ``_ProjectedExchange``):
        the change ``z`` projected as :meth:`_step` projects it and indexed by the keys, which the exchange cuts into
        runs of shards; None when it has no rows. The receiver's :meth:`step_indexed` takes the merged runs."""
        if z.num_rows == 0:
            return None
        done = self._as_projected(z)  # a fused join gathered only those columns (runtime/plan.py ``_JoinSlots``)
        z = conform(self._project(conform(z, self.op.in_schema)) if done is None else done, self.proj_schema)
        try:
            dix = z.index_by(self.keys)
        except WeightOverflowError as e:
            self.op.raise_overflow(e)
        return dix if len(dix) else None

    def step_indexed(self, dix: IndexedZSet | None, ctx: "StepContext") -> "ZSet":
        """The step of a projected min/max (invariant 9) over its change already projected and indexed by the keys
        (:meth:`index_projected` on the senders, their runs merged): the state's unreachable rows are dropped first,
        as :func:`keyed_change` drops them, then the same step as :meth:`_step` takes from the indexed change."""
        try:
            prune(self, input_times(self.op), ctx)
            if dix is None or len(dix) == 0:
                return empty(self.op.schema)
            return self._step_indexed(dix)
        except WeightOverflowError as e:
            self.op.raise_overflow(e)

    def _step_indexed(self, dix: IndexedZSet) -> "ZSet":
        """The step from its change indexed by the keys (projected first when invariant 9 projects it)."""
        op = self.op
        change = dix.zset
        if op.append_only and bool((change.weights < 0).any()):  # invariant 7
            self._refuse_retraction()
        for col, attr in self.val_cols:  # the value multisets first: a recompute must see this step's values
            trace: Trace = getattr(self, attr)
            # the change's (keys, value) rows, nulls left out, are in its key order: sorted only within a key
            whole = change.data.column_names == self.keys + [col]  # the change is (keys, value) already
            proj = change.data if whole else change.data.select(self.keys + [col])
            if not proj.schema.equals(trace.schema):
                proj = proj.cast(trace.schema)
            values = proj.column(col)
            rows = None if values.null_count == 0 else np.flatnonzero(
                np.asarray(pc.is_valid(values).to_numpy(zero_copy_only=False), dtype=bool))
            if whole and rows is None:  # invariant 9: the indexed change is the batch, in index order, as it stands
                batch = dix if proj is change.data else IndexedZSet._make(ZSet._make(proj, change.weights),
                                                                          tuple(self.keys), dix.key_hash)
                if batch is not dix:
                    batch._rh = dix._rh
                trace.insert(batch)
            elif rows is None or len(rows):
                batch = IndexedZSet._from_key_order(ZSet._make(proj, change.weights), self.keys, dix.key_hash, rows)
                if len(batch):
                    trace.insert(batch)
        if self.projected is not None and self.limbs:
            dix = self._limbs_after(dix)
        out = None
        if self.spec is not None:
            out = self.totals.through_index(self.spec, lambda ix: self._through_index(dix._view(), ix))
        return out if out is not None else self._through_totals(dix)

    def _refuse_retraction(self) -> None:
        raise DbspError(f"{self.op.label}: a retraction reached a min/max over an append-only stream, which keeps "
                        f"only its totals; declare the inputs without append_only=True to push deletions")

    def _through_index(self, view: "_zset.BatchView", ix: object, inserts: bool = False) -> "ZSet":
        """The step's totals through the key index of the totals (csrc/extremes.h): each group's old totals in one
        probe, new ones folded in C, the few extremes a deleted value reached recomputed from the value multisets,
        then the changed groups' rows and the index's new values. ``view``: the indexed change's, or with
        ``inserts`` (an append-only change: every weight positive) the change's rows in any order, which the kernel
        groups by hashing (``extremes_probe_inserts``: no recompute can be needed)."""
        op = self.op
        if inserts:
            group_row, gkh, old, nw, need = _zset.extremes_probe_inserts(view, self.keypos, self.slot_specs, ix)
        elif self.emit is not None:  # the emit's probe: its stores go in place (csrc/extremes.h design note 5)
            group_row, gkh, old, nw, need = self.emit.probe(view, self.slot_specs, ix)
        else:
            group_row, gkh, old, nw, need = _zset.extremes_probe(view, self.keypos, self.slot_specs, ix)
        if need.any():
            self._recompute_into(view, group_row, gkh, np.flatnonzero(need), nw)
        if self.emit is not None:  # invariant 10: the rest of the step in one C call
            return self._emitted(view, group_row, gkh, old, nw, ix)
        grp, w = _zset.extremes_store(view, self.keypos, group_row, gkh, old, nw, ix)
        if len(grp) == 0:
            self.totals.index_done(ix)
            return empty(op.schema)
        # np.take gathers whole rows (nw[grp] would iterate each row's values: 3x the CPU at 1k groups)
        vals = np.where((w > 0)[:, None], np.take(nw, grp, axis=0), np.take(old, grp, axis=0))
        nk, ns = len(self.keys), len(op.kernel)
        keys = _zset.take(view, group_row[grp], pa.schema(list(self.sschema)[:nk]), list(self.keypos))
        cols = list(keys.columns)
        ext = {j: e for e, (j, _, _) in enumerate(self.ext)}
        for j in range(ns):
            typ = self.sschema.field(nk + j).type
            if j in ext:
                cols.append(int_array(vals[:, j], typ, vals[:, ns + ext[j]] == 0))
            else:
                cols.append(pa.array(vals[:, j], pa.int64()))
        table = pa.Table.from_arrays(cols, schema=self.sschema)
        # the rows come group by group in the change's key order (a group's old row, then its new one)
        kh = gkh[grp]
        self.totals.store_totals(IndexedZSet._from_key_order(make(table, w, self.sschema), self.keys, kh), ix)
        # a group's old and new rows sit side by side: they cancel when the view's columns did not change
        return sum_adjacent(make(op.finalize(table), w, op.schema), kh)

    def _emitted(self, view: "_zset.BatchView", group_row: np.ndarray, gkh: np.ndarray, old: np.ndarray,
                 nw: np.ndarray, ix: object) -> "ZSet":
        """The step's second half (invariant 10) from its probe's groups, old and new totals (the recomputed extremes
        filled in): the totals batch (row hashes included, unless the trace records it per key: in key-hash order
        only) and the finalized output built in C, the new totals stored in ``ix``; the batch inserted into the totals
        trace, or recorded per key (invariant 12)."""
        keyorder = self.totals.pk_keyorder(ix)  # recorded per key (invariant 12): no row hashes
        # every key the index held is dirty already (trace invariant 19): a step holding all its groups reads none of
        # its batch's rows, which the emit then leaves out (csrc/extremes.h design note 7), built only if one is read
        found = self.totals.pk_found_dirty() if keyorder and self.totals.pk_dirty(ix) is not None else None
        lazy = bool(found)
        batch, w, kh, rh, ordered, out, ow = self.emit.step(view, group_row, gkh, old, nw, ix, keyorder, lazy)
        if w is None:  # no group's totals changed
            self.totals.index_done(ix)
            return empty(self.op.schema)
        probed = None
        if lazy and ordered and self._all_held(w, kh):  # no key fresh: no probe, no batch (invariant 12)
            self.unprobed_steps += 1
            b = PendingBatch(self._tkeypos, kh, w, lambda: self._late_batch(view, group_row, gkh, old, nw, w, kh))
            probed = self.totals.pk_dirty(ix), np.zeros(len(kh), dtype=bool)
        else:
            if batch is None:  # left out by the emit, read after all: a key-hash tie, or a new group to probe
                batch, w, kh, rh, ordered = self.emit.batch(view, group_row, gkh, old, nw, keyorder)
            if ordered:  # groups by key hash, a group's two rows by row hash (keyorder: old first): the batch as it
                # stands (the call's tables hold one record batch each: one chunk per column as they are, zset.py
                # invariant 1)
                b = IndexedZSet._make(ZSet._make(batch, w, chunked=True), tuple(self.keys), kh)
                if rh is not None:
                    b._rh = rh
                probed = self._dirty_per_group(b, ix, found)
            else:  # a key-hash or row-hash tie (rare): values decide the order
                b = IndexedZSet._from_key_order(make(batch, w, self.sschema), self.keys, kh)
        # inserted (put in canonical order first when it is in key order only), or with totals per key recorded
        self.totals.store_totals(b, ix, probed, canonical=rh is not None or not ordered)
        self.emitted_steps += 1
        if not len(ow):  # every changed group shows what it showed
            return empty(self.op.schema)
        # rows of two groups differ in their keys, a group's in a value
        return ZSet._make(out, ow, distinct=True, chunked=True)

    @staticmethod
    def _groups_of(kh: np.ndarray) -> np.ndarray:
        """Per row of an ordered emitted batch with key hashes ``kh``, whether it starts a group: no two groups share a
        key hash, so a group's rows are the runs of equal key hashes."""
        first = np.empty(len(kh), dtype=bool)
        first[0] = True
        np.not_equal(kh[1:], kh[:-1], out=first[1:])
        return first

    def _all_held(self, w: np.ndarray, kh: np.ndarray, first: np.ndarray | None = None) -> bool:
        """Whether every group of an ordered emitted batch (weights ``w``, key hashes ``kh``; ``first``: its
        :meth:`_groups_of`, when made already) was held before the step: one -1 row, its old totals, a group."""
        return np.count_nonzero(w < 0) == np.count_nonzero(self._groups_of(kh) if first is None else first)

    def _late_batch(self, view: "_zset.BatchView", group_row: np.ndarray, gkh: np.ndarray, old: np.ndarray,
                    nw: np.ndarray, w: np.ndarray, kh: np.ndarray) -> IndexedZSet:
        """The totals batch a lazy emit left out (invariant 12, csrc/extremes.h design note 7), built from the step's
        arrays when a reader needs its rows: the rows the step stored, in key-hash order only (its emit's keyorder)."""
        batch, bw, bkh, _, _ = self.emit.batch(view, group_row, gkh, old, nw, True)
        return IndexedZSet._make(ZSet._make(batch, bw, chunked=True), tuple(self.keys), bkh)

    def _dirty_per_group(self, b: IndexedZSet, ix: object, found: bool | None = None) -> "tuple | None":
        """For :meth:`Trace.store_totals` (invariant 12): the dirty-key index and, per row of the emitted batch ``b``,
        whether its key is not dirty yet, probed once per group: in an ordered batch no two groups share a key hash,
        so a group's rows are the runs of equal key hashes. None when the trace keeps no dirty index. ``found``: what
        ``pk_found_dirty()`` answered for this step already (None: not asked yet)."""
        dirty = self.totals.pk_dirty(ix)
        if dirty is None:
            return None
        kh = b._kh
        first = self._groups_of(kh)
        if found is None:
            found = self.totals.pk_found_dirty()
        if found and self._all_held(b.zset.weights, kh, first):
            # every key the index held before the step is dirty (trace invariant 19), and every group of the step
            # was held (a -1 row, its old totals, each): none is fresh, no probe (invariant 12)
            self.unprobed_steps += 1
            return dirty, np.zeros(len(kh), dtype=bool)
        sel = np.flatnonzero(first)
        acc = np.zeros((len(sel), 1), dtype=np.int64)
        dirty.get(b._view(), b._keypos, kh[sel], acc, sel=sel)
        return dirty, (acc[:, 0] == 0)[np.cumsum(first) - 1]

    def _recompute_into(self, view: "_zset.BatchView", group_row: np.ndarray, gkh: np.ndarray, need: np.ndarray,
                        nw: np.ndarray) -> None:
        """Fill in ``nw`` the extremes of groups ``need`` (positions into the probe's groups over ``view``, the
        indexed change), reduced over their whole value multisets (csrc/extremes.h design note 2): one C pass per
        value column over the value trace's batches, seeking each group's key in each, the extremes written into
        ``nw`` by the same call (``_zset.extremes_recompute``)."""
        hashes = gkh[need]
        self.recomputed += len(need)
        nk = len(self.keys)
        for (_, attr), fill in zip(self.val_cols, self._fills):
            trace: Trace = getattr(self, attr)
            batches = [b._view() for b in trace.keyed(hashes)]  # (a format-2 file: those keys' rows read)
            # the scan and the fill-in of each extreme of this column (value, "not null" flag) in one call
            _zset.extremes_recompute(view, self.keypos, group_row, gkh, need, nw, batches, self._vkeys, nk, fill)

    def _through_totals(self, dix: "IndexedZSet") -> "ZSet":
        """The step's totals read from the batches of the totals trace, folded by one grouping pass (the class's
        docstring); extremes whose deleted values reached them re-reduced over their value multisets."""
        op = self.op
        change = dix.zset
        old_z = lookup_exact(self.totals, unique_sorted(dix.key_hash), self.sschema).consolidate()
        if old_z.num_rows and not bool((old_z.weights == 1).all()):
            raise DbspError(f"{op.label}: aggregate state holds a group with weight other than 1 "
                            f"({sorted(set(old_z.weights.tolist()))[:4]}); the state is corrupt")
        sums = self._reduce(self._combined(old_z.data, change))
        need = self._need_recompute(sums)
        if need is not None:
            sums = self._recompute(sums, need)
        nk = len(self.keys)
        new_cols, old_cols = [], []
        for j in range(len(op.kernel)):
            if j in self.lin:
                new_cols.append(f"p_{j}")
                old_cols.append(f"q_{j}")
            else:
                new_cols.append(f"e_{j}")
                old_cols.append(f"o_{j}")
        slot_names = self.sschema.names[nk:]
        new = op.nonempty(sums.select(self.keys + new_cols).rename_columns(self.keys + slot_names))
        prev = op.nonempty(sums.select(self.keys + old_cols).rename_columns(self.keys + slot_names))
        delta = concat([make(new, np.ones(new.num_rows, dtype=np.int64), self.sschema),
                        make(prev, np.full(prev.num_rows, -1, dtype=np.int64), self.sschema)], self.sschema)
        if delta.num_rows:
            self.totals.insert(delta.index_by(self.keys))
        return op.output(new, prev)



LIMBS = ("sum_hi", "sum_lo")  # the two int64 slots of an exact 64-bit integer sum (invariant 5)


def limb(kind: str, col: "pa.Array | pa.ChunkedArray") -> "pa.Array | pa.ChunkedArray":
    """A limb of integer column ``col`` as int64, nulls as 0 (invariant 5): ``sum_hi`` the value >> 32 (rounded down),
    ``sum_lo`` its low 32 bits, so that value = hi * 2^32 + lo and both are below 2^32 in magnitude.

    >>> limb("sum_hi", pa.array([-1, 2**40 + 7])).to_pylist(), limb("sum_lo", pa.array([-1, 2**40 + 7])).to_pylist()
    ([-1, 256], [4294967295, 7])
    """
    c = pc.fill_null(col, 0)
    if kind == "sum_hi":
        return pc.cast(pc.shift_right(c, pa.scalar(32, c.type)), pa.int64())
    return pc.cast(pc.bit_wise_and(c, pa.scalar(0xFFFFFFFF, c.type)), pa.int64())


def _slot_ints(totals: pa.Table, nk: int, slots: list[int]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(sum or high limb, low limb or None, non-null count) of a sum/avg's slots as int64 arrays, nulls as 0; the
    limbs normalized (low limb in [0, 2^32))."""
    def ints(j: int) -> np.ndarray:
        return np.asarray(pc.fill_null(totals.column(nk + j), 0).to_numpy(), dtype=np.int64)

    n = ints(slots[-1])
    if len(slots) == 2:
        return ints(slots[0]), None, n
    hi, lo = ints(slots[0]), ints(slots[1])
    return hi + (lo >> 32), lo & 0xFFFFFFFF, n


def _reducible(t: pa.DataType) -> bool:
    """Whether invariant 8 reduces a change for an extreme of type ``t``: integer-like (the totals' key index holds
    it, invariant 7's path) or string-like (no key index: the reduced change is indexed and folded with the old
    totals, ``_through_totals``), whose order the reduction's kernel (csrc/agg.h) and the fold share."""
    return summable(t) or pat.is_string(t) or pat.is_large_string(t) or pat.is_binary(t) or pat.is_large_binary(t)


def _joined(parts: list, typ: pa.DataType) -> pa.Array:
    """One contiguous array from arrays and chunked arrays (their chunks, in order)."""
    chunks = []
    for p in parts:
        if isinstance(p, pa.ChunkedArray):
            chunks.extend(c for c in p.chunks if len(c))
        elif len(p):
            chunks.append(p)
    if not chunks:
        return pa.array([], typ)
    if len(chunks) == 1:
        return chunks[0] if chunks[0].type.equals(typ) else chunks[0].cast(typ)
    return pa.concat_arrays([c if c.type.equals(typ) else c.cast(typ) for c in chunks])


def lookup_exact(trace: Trace, hashes: np.ndarray, schema: pa.Schema) -> "ZSet":
    """The rows of ``trace`` whose key hash is in ``hashes`` (ascending, distinct), unconsolidated.

    :meth:`Trace.lookup` may hand back whole small batches, i.e. some rows of keys not asked for, without
    those keys' rows in the other batches; a caller that consolidates per key must drop them (a key's
    history is only complete for the keys asked for).
    """
    from dbsp_core.zset import ZSet

    parts = []
    for b in trace.lookup(hashes):
        kh = b.key_hash
        pos = np.searchsorted(hashes, kh)
        pos[pos == len(hashes)] = 0
        keep = hashes[pos] == kh
        if keep.all():
            parts.append(b.zset)
        elif keep.any():
            parts.append(ZSet._make(b.zset.data.filter(pa.array(keep)), np.asarray(b.zset.weights[keep])))
    return concat(parts, schema)
