"""The join operator: incremental inner equi-join on one or several key columns, keeping a trace of each side.

Invariants:
  1. Each step emits  da JOIN (B + db)  +  A JOIN db, where A, B are the integrated inputs before the step
     and da, db their changes, so integral(output) == integral(left) JOIN integral(right) after every step.
  2. Output rows have the left columns, then the right columns; with ``on=`` the right key columns are
     dropped (one key column kept); any other right column whose name clashes gets the suffix "_right".
  3. Null keys never match. Key columns must have compatible types: integers of any width together,
     strings together, otherwise the same type; else SchemaError naming the operator and the columns.
  4. Both inputs are exchanged by their keys, so matching rows meet in one worker; the output's weight is
     the product of the weights (WeightOverflowError on overflow).
  5. When a key column of one side has a time lineage (dbsp_core/time), the other side's rows whose matching
     key is below that bound are dropped at the start of a step: no later change of the first side can match
     them (dbsp_core/time/cleanup.py invariant 2).
  6. With ``stored`` set (operators/pruned.py, by the pass of dbsp_core/runtime/prune.py), each side's trace holds
     only that side's kept columns (keys included): a change is projected before it is indexed (which
     consolidates it), pairs gather the kept columns and the output is padded with nulls to ``schema``.
  7. The one-call step (:meth:`_JoinState.step_run`, dbsp_core/runtime/plan.py design note 2): each changed side's
     change is indexed, joined with every batch of the other side's trace (seeking its keys through each large
     batch's directory of key hashes, csrc/lookup.h DbspDir, built at the batch's first such seek) and its output
     columns gathered in one C call (``_zset.JoinRun``, csrc/joinrun.h), then inserted as :meth:`_JoinState.step_parts` inserts it: the same
     indexed change, the same parts (one per batch met), the same state. With both sides changed, ``L JOIN db``
     first, then ``da JOIN (R + db)`` over R's batches as read before db went in, and db. A step of an operator with
     time lineage (invariant 5), or whose walk would read a spilled batch (trace/spill.py invariants 12 and 14: its
     Bloom filter, pages and pieces), returns None there, having changed nothing, and runs
     :meth:`_JoinState.step_parts`. The inserted batch keeps the C view the call read its rows through (csrc/joinrun.h
     invariant 5) as its own: the trace merge that reads it later exports nothing.
  8. The folded step (:meth:`_JoinState.step_folded`, dbsp_core/runtime/plan.py design note 4): a join whose one
     consumer is a linear group-by (W = 1) hands both changes and the other sides' batches to one C call
     (``_zset.JoinLinearRun``, csrc/joinlin.h) that indexes each change as invariant 7's step does, finds invariant
     1's pairs (``L JOIN db``, then ``da JOIN (R + db)``) and folds their columns into the group-by's totals; the
     indexed changes are then inserted into the traces: the state invariant 7's step leaves. The joined rows are
     never built. A step it does not serve (time lineage, a spilled batch, a weight product past int64, a null in a
     summed or counted column) changes nothing and runs the join's and the group-by's own calls.
  9. Each side's trace holds its low levels while it is not read (``hold_unread``, ``DBSP_TOTALS_HOLD``, trace/levels.py
     invariant 18): a side is read only when the other side changes, so the side of a stream joined with a table
     that rarely changes merges its step batches many at a time instead of two (measured: 1k-row steps into a 1M-row
     side, hold 8, instructions a step -15% mean, -21% median). The first read after such a run walks up to twice
     the hold's batches on a low level, and the next merges go two at a time again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from dbsp_core import _zset
from dbsp_core.envvars import settings
from dbsp_core.errors import SchemaError
from dbsp_core.operators.base import Operator, check_columns, concat, conform, empty, make
from dbsp_core.operators.pruned import JoinStored, pad, project
from dbsp_core.time.cleanup import prune_trace
from dbsp_core.time.lineage import input_times
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet, ZSet

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext


def _key_class(t: pa.DataType) -> object:
    if pat.is_integer(t):
        return "int"
    if pat.is_string(t) or pat.is_large_string(t):
        return "string"
    if pat.is_binary(t) or pat.is_large_binary(t):
        return "binary"
    return t


def join_schema(left: pa.Schema, right: pa.Schema, left_on: Sequence[str], right_on: Sequence[str],
                drop_right_keys: bool, where: str) -> tuple[pa.Schema, list[str]]:
    """Output schema of a join and the right columns it keeps (invariants 2 and 3)."""
    check_columns(left, left_on, where, "left key column")
    check_columns(right, right_on, where, "right key column")
    if len(left_on) != len(right_on) or not left_on:
        raise SchemaError(f"{where}: left_on and right_on need the same, non-zero number of columns, "
                          f"got {list(left_on)} and {list(right_on)}")
    for lk, rk in zip(left_on, right_on):
        lt, rt = left.field(lk).type, right.field(rk).type
        if _key_class(lt) != _key_class(rt):
            raise SchemaError(f"{where}: key types do not match: left {lk!r} is {lt}, right {rk!r} is {rt}")
    fields = [pa.field(f.name, f.type) for f in left]
    names = set(left.names)
    kept = []
    for f in right:
        if drop_right_keys and f.name in right_on:
            continue
        name = f.name + "_right" if f.name in names else f.name
        if name in names:
            raise SchemaError(f"{where}: right column {f.name!r} clashes with {name!r} even after the "
                              f"'_right' suffix; rename it with select first")
        names.add(name)
        fields.append(pa.field(name, f.type))
        kept.append(f.name)
    return pa.schema(fields), kept


class Join(Operator):
    """Inner equi-join of two streams on ``left_on`` = ``right_on``."""

    kind = "join"
    split_safe = True  # base.py invariant 6 (invariant 1 here and the outer joins': a function of the integrals)
    in_times: tuple = ()  # time lineage of both inputs, set by the circuit when there is one (dbsp_core.time)
    pad_types: list[pa.DataType]  # the right columns' types, set by the joins that pad left rows (padded_left)
    stored: "JoinStored | None" = None  # invariant 6: the columns each side's trace keeps (None: all)

    def __init__(self, left: int, right: int, lschema: pa.Schema, rschema: pa.Schema,
                 left_on: Sequence[str], right_on: Sequence[str], drop_right_keys: bool, where: str) -> None:
        schema, kept = join_schema(lschema, rschema, left_on, right_on, drop_right_keys, where)
        super().__init__((left, right), schema, tuple(left_on))
        self.lschema, self.rschema = lschema, rschema
        self.left_on, self.right_on = tuple(left_on), tuple(right_on)
        self.right_kept = kept
        self.right_kept_pos = [rschema.get_field_index(c) for c in kept]

    def keep(self, left: "Sequence[str] | None", right: "Sequence[str] | None" = None) -> None:
        """Invariant 6: keep only columns ``left`` and ``right`` of each side in the traces (None: every column); set
        before the instances are built (dbsp_core/runtime/prune.py)."""
        if left is None:
            self.__dict__.pop("stored", None)
        else:
            self.stored = JoinStored(self, left, right or ())

    def instance(self) -> "_JoinState":
        return _JoinState(self)

    def pairs(self, left: "IndexedZSet", right: "IndexedZSet",
              cols: "tuple[list[int], list[int], pa.Schema] | None" = None, st: "JoinStored | None" = None
              ) -> "ZSet":
        """The join of two indexed batches as a Z-set of output rows: the C join kernel, then one C gather of the
        left rows' columns and the kept right columns (key types were checked when the operator was built). With
        ``cols`` (left positions, right positions, the schema of those columns in that order), only those columns
        of each output row: what an aggregate fused after the join reads (dbsp_core/runtime/plan.py note 4). ``st``: the
        columns the batches keep (invariant 6; the instance's, :meth:`_JoinState.pairs`), None for every column."""
        lv, rv = left._view(), right._view()
        li, ri, w = _zset.join(lv, None, None, left._keypos, rv, None, None, right._keypos, False)
        if st is not None:  # invariant 6: the batches hold the kept columns; positions map to theirs
            if cols is None:
                if len(li) == 0:
                    return empty(self.schema)
                return pad(ZSet._make(_zset.take_pairs(lv, li, rv, ri, st.rcols, st.schema, None), w, distinct=True),
                           self.schema)
            cols = ([st.lmap[i] for i in cols[0]], [st.rmap[i] for i in cols[1]], cols[2])
        lcols, rcols, schema = (None, self.right_kept_pos, self.schema) if cols is None else cols
        if len(li) == 0:
            return empty(schema)
        # distinct (zset.py invariant 2): both batches are consolidated, so no two pairs are equal rows (two right
        # rows that meet one left row share its key, so they differ in a column the output keeps), and a product
        # of non-zero weights is not zero; a step whose change meets one batch needs no sort of its output (a
        # selection of columns may make two rows equal)
        return ZSet._make(_zset.take_pairs(lv, li, rv, ri, rcols, schema, lcols), w, distinct=cols is None)

    def padded_left(self, left: "IndexedZSet", li: np.ndarray, w: np.ndarray) -> "ZSet":
        """Left rows ``li`` of ``left`` with null right columns and weights ``w``: the unmatched left rows of a left
        or full outer join."""
        if len(li) == 0:
            return empty(self.schema)
        cols = list(left.zset.data.take(li).columns) + [pa.nulls(len(li), t) for t in self.pad_types]
        return make(pa.Table.from_arrays(cols, schema=self.schema), w, self.schema)


def inner_change(op: Join, left: Trace, right: Trace, da: "IndexedZSet | None", db: "IndexedZSet | None",
                 pairs: "Callable[[IndexedZSet, IndexedZSet], Any] | None" = None) -> list:
    """The inner join's change ``da JOIN (R + db) + L JOIN db`` (invariant 1), as the join operator computes it: a
    change joined with each whole trace batch (the kernel gallops over the batch's key hashes, so no rows are
    copied out first). Inserts ``db`` into ``right``; the caller inserts ``da`` into ``left`` after. ``pairs``: what
    each (left, right) meeting becomes, ``op.pairs`` (output rows) unless given (dbsp_core/runtime/plan.py: the
    columns a fused aggregate reads); a None it returns is left out."""
    pairs = op.pairs if pairs is None else pairs
    parts = []
    if db is not None:
        right.insert(db)
    if da is not None and len(da):
        for batch in right.walked(da.key_hash):
            d, _ = right.narrowed(batch, da)  # a spilled batch: only the change rows its filter may hold
            if d is not None:  # (in pieces when the walk would map much of a spilled batch: trace/spill.py 12)
                parts.extend(right.in_pieces(batch, d, lambda piece, batch=batch: pairs(piece, batch), len(da)))
    if db is not None and len(db):
        for batch in left.walked(db.key_hash):
            d, _ = left.narrowed(batch, db)
            if d is not None:
                parts.extend(left.in_pieces(batch, d, lambda piece, batch=batch: pairs(batch, piece), len(db)))
    return [p for p in parts if p is not None]


class _JoinState:
    def __init__(self, op: Join) -> None:
        self.op = op
        self.stored = st = op.stored  # invariant 6, as it was when this instance was built
        self.left = Trace(op.lschema if st is None else st.lschema, op.left_on)
        self.right = Trace(op.rschema if st is None else st.rschema, op.right_on)
        self.left.hold_unread = self.right.hold_unread = settings().totals_hold  # (invariant 9)

    def pairs(self, left: "IndexedZSet", right: "IndexedZSet",
              cols: "tuple[list[int], list[int], pa.Schema] | None" = None) -> "ZSet":
        """:meth:`Join.pairs` of two batches of this instance (its kept columns)."""
        return self.op.pairs(left, right, cols, self.stored)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"left": self.left, "right": self.right}

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        return self.step_indexed(self.indexed(inputs[0], 0), self.indexed(inputs[1], 1), ctx)

    def indexed(self, z: "ZSet", side: int) -> "IndexedZSet | None":
        """Input ``side``'s change (0 left, 1 right) indexed by its join key, None when empty."""
        if not z.num_rows:
            return None
        return self.prepared(z, side).index_by(list(self.op.left_on if side == 0 else self.op.right_on))

    def prepared(self, z: "ZSet", side: int) -> "ZSet":
        """Input ``side``'s change as its trace holds rows: conformed to the side's schema and, under invariant 6,
        projected to its kept columns (before it is indexed, which consolidates it)."""
        op = self.op
        z = conform(z, op.lschema if side == 0 else op.rschema)
        if self.stored is not None:
            z = project(z, self.stored.left if side == 0 else self.stored.right)
        return z

    def step_indexed(self, da: "IndexedZSet | None", db: "IndexedZSet | None", ctx: "StepContext") -> "ZSet":
        """The step over changes already indexed by their join keys (:meth:`indexed`, or a fused exchange that
        indexed them before it partitioned them, dbsp_core/runtime/plan.py note 4)."""
        # unconsolidated: a consumer that needs it consolidates once
        return concat(self.step_parts(da, db, ctx), self.op.schema)

    def step_parts(self, da: "IndexedZSet | None", db: "IndexedZSet | None", ctx: "StepContext",
                   pairs: "Callable[[IndexedZSet, IndexedZSet], Any] | None" = None) -> list:
        """The step's change as parts, one per meeting of a change with a batch (:func:`inner_change`'s, ``pairs``
        included), the traces brought up to the step as :meth:`step_indexed` does."""
        op = self.op
        if op.in_times:  # invariant 5
            lt, rt = input_times(op, 0), input_times(op, 1)
            on = list(zip(op.left_on, op.right_on))
            prune_trace(self.left, {lk: rt[rk] for lk, rk in on if rk in rt}, ctx)
            prune_trace(self.right, {rk: lt[lk] for lk, rk in on if lk in lt}, ctx)
        parts = inner_change(op, self.left, self.right, da, db, self.pairs if pairs is None else pairs)
        if da is not None:
            self.left.insert(da)
        return parts

    def join_runs(self, cols: "tuple[list[int], list[int], pa.Schema] | None" = None) -> "tuple | None":
        """The one-call steps of invariant 7, per side of the change (0: left, 1: right), and how their parts become
        output Z-sets: ``(runs, schema, distinct, padded)``, as :meth:`Join.pairs` builds them (``cols``: only those
        output columns, :meth:`Join.pairs`'s); None when the kept columns (invariant 6) are not in the traces' order."""
        op, st = self.op, self.stored
        ltr, rtr = self.left, self.right
        pos = self.fold_positions(([], [], op.schema))
        if pos is None:
            return None  # (a projection in another order than the traces' columns: the join's own step)
        lkeys, rkeys = pos[0], pos[1]
        if st is None:
            lcols, rcols, schema = (None, op.right_kept_pos, op.schema) if cols is None else cols
            padded = None
        elif cols is None:
            lcols, rcols, schema, padded = None, st.rcols, st.schema, op.schema
        else:
            lcols, rcols, schema = [st.lmap[i] for i in cols[0]], [st.rmap[i] for i in cols[1]], cols[2]
            padded = None
        runs = (_zset.JoinRun(lkeys, rkeys, True, lcols, rcols, ltr.schema, schema),
                _zset.JoinRun(rkeys, lkeys, False, lcols, rcols, rtr.schema, schema))
        return runs, schema, cols is None, padded

    def fold_positions(self, cols: "tuple[list[int], list[int], pa.Schema]") -> "tuple | None":
        """Invariant 8: ``(lkeys, rkeys, lcols, rcols)``, the key columns of each side and the output columns ``cols``
        (:meth:`Join.pairs`'s) as positions in the traces' rows; None when the kept columns (invariant 6) are not in
        the traces' order."""
        op, st = self.op, self.stored
        if st is not None and (st.left != tuple(st.lschema.names) or st.right != tuple(st.rschema.names)):
            return None
        lkeys = [self.left.schema.get_field_index(k) for k in op.left_on]
        rkeys = [self.right.schema.get_field_index(k) for k in op.right_on]
        if st is None:
            return lkeys, rkeys, list(cols[0]), list(cols[1])
        return lkeys, rkeys, [st.lmap[i] for i in cols[0]], [st.rmap[i] for i in cols[1]]

    def step_folded(self, za: "ZSet", zb: "ZSet", fold: "Callable[..., Any]") -> "Any | None":
        """Invariant 8: the step whose pairs only a linear group-by's totals read, in one C call: ``fold(lt, lw, lviews,
        rt, rw, rviews)`` (``_zset.JoinLinearRun.step`` with the group-by's key index bound; a side's table None when
        it did not change) returns None, having changed nothing, or ``(left, right, result)``: each side's indexed
        change, inserted here into its trace, and what the group-by made of the pairs, returned. None, having changed
        nothing, for a step it does not serve (time lineage, a spilled batch to walk)."""
        if self.op.in_times:
            return None
        args: list = []
        for side, z, other in ((0, za, self.right), (1, zb, self.left)):
            views: list = []
            if z.num_rows:
                batches = walked_in_memory(other)
                if batches is None:
                    return None
                z = self.prepared(z, side)
                views = [b._view() for b in batches]
                args += [z.data, z.weights, views]
            else:
                args += [None, None, views]
        # fold's order: the left change and the right trace's batches, the right change and the left trace's
        got = fold(args[0], args[1], args[5], args[3], args[4], args[2])
        if got is None:
            return None
        for side, ix in enumerate(got[:2]):
            if ix is None:
                continue
            insert_indexed(self.left if side == 0 else self.right, *ix)
        return got[2]

    def step_run(self, za: "ZSet", zb: "ZSet", ctx: "StepContext", spec: "tuple | None") -> "list | None":
        """Invariant 7: the step's parts (as :meth:`step_parts` returns them) from one C call per changed side of
        ``spec`` (:meth:`join_runs`): the right side's change first, against the left trace as it was (``L JOIN db``),
        inserted into the right trace, then the left side's against it (``da JOIN (R + db)``), inserted into the left
        trace: invariant 1's change. None, having changed nothing, for a step it does not serve (time lineage, a
        batch store)."""
        if spec is None or self.op.in_times:
            return None
        walks = []  # (side, change, the other side's batches)
        for side, z, other in ((1, zb, self.left), (0, za, self.right)):
            if z.num_rows:
                batches = walked_in_memory(other)
                if batches is None:
                    return None
                walks.append((side, z, batches))
        out: list = []
        db = None
        for side, z, batches in walks:
            if side == 0 and db is not None:  # da JOIN (R + db): R's batches as read before db went in, and db
                batches = batches + [db]
            db = self._run_side(z, side, batches, spec, out)
        return out

    def _run_side(self, z: "ZSet", side: int, batches: list, spec: tuple, out: list) -> "IndexedZSet | None":
        """:meth:`step_run` of side ``side``'s change ``z`` against the other side's ``batches``: its parts appended to
        ``out``, then it is inserted; returns it indexed (None: it consolidated to nothing)."""
        pair, _, distinct, padded = spec
        ix, parts = run_side(pair[side], self.left if side == 0 else self.right, self.prepared(z, side), batches,
                             distinct)
        out.extend(p if padded is None else pad(p, padded) for _, p in parts)
        return ix


def run_side(run: "_zset.JoinRun", own: Trace, z: "ZSet", batches: list, distinct: bool
             ) -> "tuple[IndexedZSet | None, list[tuple[int, ZSet]]]":
    """One side's change ``z`` (as its trace ``own`` holds rows) through ``run`` (invariant 7) against the other side's
    ``batches``: the change indexed and inserted into ``own``, and each part the call returned as ``(k, Z-set)`` (k:
    the batch met, ``len(batches)`` for a pad's part; flagged ``distinct``); ``(None, [])`` when the change consolidated
    to nothing."""
    got = run.step(z.data, z.weights, [b._view() for b in batches])
    if got is None:  # the change consolidated to nothing
        return None, []
    table, w, kh, rh, parts, view = got
    ix = insert_indexed(own, table, w, kh, rh, view)
    return ix, [(k, ZSet._make(t, pw, distinct=distinct, chunked=True)) for k, t, pw in parts]


def insert_indexed(own: Trace, table: pa.Table, w: "np.ndarray", kh: "np.ndarray", rh: "np.ndarray | None",
                   view: Any = None) -> "IndexedZSet":
    """A change a one-call step indexed (its rows, weights, key hashes and row hashes, as the C call returned them)
    inserted into its side's trace ``own``, and returned. ``view``: the C view of those rows the call returned
    (csrc/joinrun.h invariant 5), kept as the batch's own (``IndexedZSet._view``), so the merge that reads it later
    does not export its rows again."""
    # (the kernel's tables hold one record batch each: one chunk per column as they are, zset.py invariant 1)
    ix = IndexedZSet._make(ZSet._make(table, w, chunked=True), own.key, kh)
    ix._rh = rh  # (index_by's: the row hashes when the kernel had them)
    if view is not None:
        ix._cv = view
        f = ix._fence()  # (as _view attaches it: a large batch's)
        if f is not None:
            view.set_fence(f)
    own.insert(ix)
    return ix


def walked_in_memory(trace: Trace) -> list | None:
    """Every batch of ``trace`` for a one-call step, or None when one is spilled (a spilled batch is walked through
    ``narrowed`` and ``in_pieces``: trace/spill.py invariants 12 and 14)."""
    batches = trace.walked()
    store = trace._store
    if store is not None and any(store.is_spilled(b) for b in batches):  # (format 1 or 2)
        return None
    return batches
