"""The top-k operator: per group, the k first rows in a given order (``ORDER BY ... LIMIT k`` per key, argmax/argmin for k = 1), maintained incrementally and correct under deletion.

Invariants:
  1. After every step, integral(output) holds, for each group of integral(input), its first k rows (with
     multiplicity: a row of weight w fills up to w places) in the order of the ``order`` columns, then of the
     remaining columns ascending (a total order, so ties are broken the same way whatever the split into steps
     or workers); nulls sort last, and floats in DuckDB's order (NaN above +inf, so first when descending;
     -0.0 tied with 0.0: operators/base.py sort_order). With ``with_ties``, every row tied (on the order
     columns) with a row in the first k is kept as well (SQL ``FETCH FIRST k ROWS WITH TIES``), so a group may
     show more than k rows.
  2. The state is two traces indexed by the group keys (the operator's exchange key): ``input``, the
     integrated input, and ``shown``, the integrated output (the current top rows of every group).
  3. A step touches only the groups in the change. A group whose change only inserts, or deletes rows ranked
     after its last shown row while it shows k or more, or deletes from a group showing fewer than k (then
     every row of the group is shown), is recomputed from its shown rows and the change: O(k + change). Only a
     group where a deletion reaches its shown rows is recomputed from its whole input: O(group).
  4. Rows are never iterated in Python: one sort (Arrow) and numpy cumulative sums per step.
  5. Over a stream that is inserts only by the circuit's structure (``Circuit.inserts_only``: append-only inputs
     through filters, selects, inner joins, ...), ``append_only`` is set and the state is ``shown`` alone: a group's
     top rows after an insert are the top rows of its shown rows and the change, so the input trace that only a
     deletion reaching the shown rows would read is never kept (k rows per group instead of every row). A
     change with a retraction then cannot be served and raises DbspError (the driver refuses retractions into
     append-only inputs before recording them, operators/input.py invariant 3).
  6. An argmax/argmin with ties (k = 1, ``with_ties``) over one signed integer column whose rows hold no null
     there finds a group's top rows without a sort: one hash grouping gives each group's max (min), and its rows
     with that value are its top rows (every one of them, with its weight: ties are kept whole, so the order of
     the other columns decides nothing). Groups are told apart by key hash; when two groups of a step share one,
     the sort serves that step.
  7. Over an aggregate's output ordered first by its row count (``count()``) descending, when the aggregate's input
     is inserts only, its keys include the top-k's group keys and it has no count_distinct (``grows``, set by the
     circuit, q5's hot items): the state is ``shown`` alone, as in invariant 5. A step changes a group of the
     aggregate only by inserting rows, so it retracts the group's row only beside the group's new row, of a
     strictly larger count, in the same top-k group: that row sorts before the one it replaces, and every row
     the step does not touch keeps its place, so the rows shown before and not retracted, with the step's new
     rows, hold the top rows after the step. A step consolidates the shown rows of its groups with its change
     (a retraction cancels the shown row it deletes) and takes their top rows. ``grows`` is not part of the
     circuit's fingerprint (circuit.py ``_node_text``): it changes the state kept, not the rows shown, so a
     directory written by the general form (before this invariant) opens with the same circuit, its ``shown``
     trace serving the growing form as it stands (its ``input`` table, which nothing reads, is deleted with the
     batch files only it names by the first checkpoint after the reopen: storage/snapshot.py invariant 10).
  9. An append-only top-1 without ties (invariant 5, k = 1; q18's latest bid per key, SQL's ``ROW_NUMBER() ... = 1``
     deduplication) over columns the C grouping orders takes the change's first row of each group by that
     grouping (no sort), then each such candidate against its group's shown row by the grouping again (the shown
     row first: a candidate equal to it changes nothing); the output is the candidates that won and the shown rows
     they replace, indexed once for ``shown``. The change and the top rows are neither sorted nor consolidated.
     Two keys of one hash send the step to the general path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

from dbsp_core import _zset
from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.operators.aggregate import lookup_exact
from dbsp_core.operators.base import (Operator, check_columns, concat, empty, keyed_change, make, opened_change,
                                      run_starts, sort_order)
from dbsp_core.trace import Trace, unique_sorted
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext

_TAG = "__dbsp_tag"


def order_spec(order_by: object, where: str) -> tuple[tuple[str, str], ...]:
    """``order_by`` (a column, ``(column, "ascending" | "descending")``, or a list of those) as a tuple of pairs."""
    items = [order_by] if isinstance(order_by, (str, tuple)) else list(order_by)  # type: ignore[call-overload]
    out = []
    for it in items:
        col, direction = (it, "ascending") if isinstance(it, str) else tuple(it)
        if direction not in ("ascending", "descending") or not isinstance(col, str):
            raise SchemaError(f"{where}: order_by items are a column name or (column, 'ascending'|'descending'), "
                              f"got {it!r}")
        out.append((col, direction))
    if not out:
        raise SchemaError(f"{where}: order_by needs at least one column")
    return tuple(out)


class TopK(Operator):
    """``group_by(*keys).top_k(k, order_by)``: the first ``k`` rows of each group (invariant 1)."""

    kind = "top_k"
    split_safe = True  # base.py invariant 6 (invariant 1: a function of the integrated input)
    in_times: tuple = ()  # time lineage of the input, set by the circuit when there is one (dbsp_core.time)
    append_only = False  # invariant 5; set only when the input is inserts only
    grows = False  # invariant 7; set only when the input is a row count that only grows

    def __init__(self, node: int, in_schema: pa.Schema, keys: Sequence[str], order: tuple[tuple[str, str], ...],
                 k: int, with_ties: bool, where: str, hidden_key: str | None = None,
                 append_only: bool = False, grows: bool = False) -> None:
        keys = tuple(keys)
        check_columns(in_schema, keys, where, "group_by column")
        check_columns(in_schema, [c for c, _ in order], where, "order_by column")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"{where}: k must be a positive int, got {k!r}")
        schema = pa.schema([f for f in in_schema if f.name != hidden_key])
        super().__init__((node,), schema, None if hidden_key else keys)
        self.in_schema = in_schema
        self.keys = keys
        self.order = order
        self.k = int(k)
        self.with_ties = bool(with_ties)
        self.hidden_key = hidden_key
        if append_only:  # set only then: the fingerprint of the general form is unchanged
            self.append_only = True
        if grows and not append_only:  # likewise
            self.grows = True
        ordered = set(keys) | {c for c, _ in order}
        self.rest = tuple(c for c in in_schema.names if c not in ordered)

    def instance(self) -> "_TopKState":
        return _TopKState(self)

    def sort_keys(self, extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """Group keys, the order, the remaining columns (the total order of invariant 1), then ``extra``."""
        return ([(c, "ascending") for c in self.keys] + list(self.order) + [(c, "ascending") for c in self.rest]
                + list(extra))


def _sorted(op: TopK, table: pa.Table, extra: Sequence[tuple[str, str]] = ()) -> np.ndarray:
    """The row order of invariant 1 (nulls last), then ``extra``."""
    return sort_order(table, op.sort_keys(extra))


def _argmax_rows(op: TopK, z: ZSet) -> ZSet | None:
    """Invariant 6: the top rows of ``z`` (every weight positive) when ``op`` is an argmax/argmin with ties over one
    signed integer column without nulls: each group's rows whose value is the group's max (min), by one hash
    grouping, no sort; None when that does not apply (the sort of :func:`top_rows` then serves)."""
    if not (op.k == 1 and op.with_ties and len(op.order) == 1):
        return None
    col, direction = op.order[0]
    values = z.data.column(col)
    if not pa.types.is_signed_integer(values.type) or values.null_count:
        return None
    keypos = [z.data.schema.get_field_index(c) for c in op.keys]
    vpos = z.data.schema.get_field_index(col)
    kind = "max" if direction == "descending" else "min"
    _, khash, ivals, _, _ = _zset.group_reduce(z.data, z.weights, keypos, [(kind, vpos)], True)
    if len(khash) > 1 and bool((khash[1:] == khash[:-1]).any()):  # two groups share a key hash: rows can't tell
        return None
    v = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
    # groups in key-hash order, every row's group among them; a group's extreme is the value of its row ivals
    keep = v == v[ivals[np.searchsorted(khash, z.hash(list(op.keys))), 0]]
    rows = np.flatnonzero(keep)
    return make(z.data.take(pa.array(rows)), z.weights[rows], op.in_schema)


_TOP1_TYPES = (pa.types.is_integer, pa.types.is_float32, pa.types.is_float64, pa.types.is_boolean,
               pa.types.is_date32, pa.types.is_timestamp, pa.types.is_string, pa.types.is_large_string,
               pa.types.is_binary, pa.types.is_large_binary)


def _top1_plan(op: TopK, schema: pa.Schema) -> tuple[list[int], list[tuple[int, bool]]] | None:
    """The key positions and the (position, descending) order the C top-1 grouping takes, for a top-1 without ties
    over columns of types it orders; None otherwise."""
    if op.k != 1 or op.with_ties:
        return None
    if not all(any(f(fld.type) for f in _TOP1_TYPES) for fld in schema):
        return None
    pos = schema.get_field_index
    order = [(pos(c), d == "descending") for c, d in op.order] + [(pos(c), False) for c in op.rest]
    return [pos(c) for c in op.keys], order


def _top1_rows(op: TopK, z: ZSet) -> ZSet | None:
    """Invariant 8: the top row of every group of ``z`` (every weight positive) for a top-1 without ties, by the C
    hash grouping; None when that does not apply (the sort of :func:`top_rows` then serves)."""
    plan = _top1_plan(op, z.data.schema)
    if plan is None:
        return None
    keypos, order = plan
    rows = _zset.top1_rows(z.data, z.hash(list(op.keys)), keypos, order)
    if rows is None:  # two groups share a key hash
        return None
    return make(_zset.gather(z.data, rows), np.ones(len(rows), np.int64), op.in_schema)


def top_rows(op: TopK, z: ZSet) -> ZSet:
    """The top rows of every group of ``z`` (consolidated; rows of weight <= 0 are ignored), invariant 1."""
    pos = z.weights > 0
    if not pos.all():
        z = ZSet._make(z.data.filter(pa.array(pos)), z.weights[pos])
    if z.num_rows == 0:
        return empty(op.in_schema)
    fast = _argmax_rows(op, z)
    if fast is None:
        fast = _top1_rows(op, z)
    if fast is not None:
        return fast
    idx = _sorted(op, z.data)
    # the runs are found on the group (and order) columns alone; only the rows kept are gathered whole
    runs = dict.fromkeys(list(op.keys) + ([c for c, _ in op.order] if op.with_ties else []))
    t = z.data.select(list(runs)).take(pa.array(idx))
    w = z.weights[idx]
    ng = run_starts(t, op.keys)
    gid = np.cumsum(ng) - 1
    cw = np.cumsum(w)
    first = cw - w  # weight before each row, over the whole table
    base = first[ng][gid]  # weight before each row's group
    if op.with_ties:
        nr = ng | run_starts(t, [c for c, _ in op.order])
        before = first[nr][np.cumsum(nr) - 1] - base  # weight of the group before the row's run of ties
        out = np.where(before < op.k, w, 0)
    else:
        out = np.clip(op.k - (first - base), 0, w)
    keep = out > 0
    return make(z.data.take(pa.array(idx[keep])), out[keep], op.in_schema)


def reaching(op: TopK, shown: ZSet, deleted: ZSet) -> np.ndarray:
    """For each row of ``deleted``: may its deletion change its group's top rows (invariant 3)? True when the
    group shows at least k rows and the row sorts at or before the group's last shown row."""
    n_s, n_d = shown.num_rows, deleted.num_rows
    tag = pa.array(np.concatenate([np.zeros(n_s, np.int8), np.ones(n_d, np.int8)]))
    both = pa.concat_tables([shown.data, deleted.data]).append_column(_TAG, tag)
    idx = _sorted(op, both, [(_TAG, "descending")])  # a deleted row sorts before an identical shown one
    t = both.take(pa.array(idx))
    w = np.concatenate([shown.weights, np.zeros(n_d, np.int64)])[idx]
    is_shown = idx < n_s
    ng = run_starts(t, op.keys)
    starts = np.flatnonzero(ng)
    gid = np.cumsum(ng) - 1
    total = np.add.reduceat(np.where(is_shown, w, 0), starts)
    last = np.maximum.reduceat(np.where(is_shown, np.arange(len(idx)), -1), starts)
    reach_sorted = (~is_shown) & (total[gid] >= op.k) & (np.arange(len(idx)) < last[gid])
    out = np.zeros(n_d, dtype=bool)
    out[idx[~is_shown] - n_s] = reach_sorted[~is_shown]
    return out


class _TopKState:
    """Invariants 2, 3 and 5."""

    def __init__(self, op: TopK) -> None:
        self.op = op
        self.keys = list(op.keys)
        self.input = None if op.append_only or op.grows else Trace(op.in_schema, op.keys)
        self.shown = Trace(op.in_schema, op.keys)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        if self.input is None:
            return {"shown": self.shown}
        return {"input": self.input, "shown": self.shown}

    def step(self, inputs: list[ZSet], ctx: "StepContext") -> ZSet:
        op = self.op
        if self.input is None:
            return self._step_inserts(inputs, ctx)
        dix = keyed_change(self, inputs, ctx, op.in_schema, self.keys)
        if dix is None:
            return empty(op.schema)
        change = dix.zset
        old = lookup_exact(self.shown, unique_sorted(dix.key_hash), op.in_schema).consolidate()
        parts = [change]
        neg = change.weights < 0
        redo = np.zeros(0, dtype=np.uint64)
        if neg.any():
            deleted = ZSet._make(change.data.filter(pa.array(neg)), change.weights[neg])
            hit = reaching(op, old, deleted) if old.num_rows else np.zeros(int(neg.sum()), dtype=bool)
            if hit.any():
                redo = np.unique(dix.key_hash[neg][hit])
        if len(redo):  # whole groups from the input trace, in place of their shown rows
            parts.append(lookup_exact(self.input, redo, op.in_schema))
            in_redo = np.isin(old.hash(self.keys), redo) if old.num_rows else np.zeros(0, dtype=bool)
            if (~in_redo).any():
                parts.append(ZSet._make(old.data.filter(pa.array(~in_redo)), old.weights[~in_redo]))
        else:
            parts.append(old)
        new = top_rows(op, concat(parts, op.in_schema).consolidate())
        self.input.insert(dix)
        return self._show(new, old)

    def _step_inserts(self, inputs: list[ZSet], ctx: "StepContext") -> ZSet:
        """Invariant 5: the change (inserts only) is not indexed, only its keys hashed to look up the shown rows;
        it is not consolidated either, as top_rows orders equal rows together and counts their weights. Invariant
        7: the same over a growing count, the change's retractions cancelling the shown rows they delete."""
        op = self.op
        change = opened_change(self, inputs, ctx, op.in_schema)
        if change is None:
            return empty(op.schema)
        if op.grows:
            old = lookup_exact(self.shown, np.unique(change.hash(self.keys)), op.in_schema).consolidate()
            return self._show(top_rows(op, concat([change, old], op.in_schema).consolidate()), old)
        if (change.weights < 0).any():
            raise DbspError(f"{op.label}: a retraction reached a top-k over an append-only stream, which keeps only "
                            f"its shown rows; declare the inputs without append_only=True to push deletions")
        out = self._step_top1_inserts(change)
        if out is not None:
            return out
        old = lookup_exact(self.shown, np.unique(change.hash(self.keys)), op.in_schema).consolidate()
        return self._show(top_rows(op, concat([change, old], op.in_schema)).consolidate(), old)

    def _step_top1_inserts(self, change: ZSet) -> ZSet | None:
        """Invariant 9: an append-only top-1 without ties: the change's first row of each group (the C grouping,
        on the change alone), then each such candidate against its group's shown row (the grouping again, on the
        two sets of at most one row per touched group, the shown row first so that an equal candidate changes
        nothing). The output is the candidates that won and the shown rows they replace; no sort, no
        consolidation of the change or of the top rows. None when it does not apply (the general path then
        serves): another shape, a type the grouping does not order, or two keys sharing a hash."""
        op = self.op
        plan = _top1_plan(op, change.data.schema)
        if plan is None:
            return None
        keypos, order = plan
        w = change.weights
        if not (w > 0).all():  # weights of 0 left by the driver's conform: not rows
            change = ZSet._make(change.data.filter(pa.array(w > 0)), w[w > 0])
            if change.num_rows == 0:
                return empty(op.schema)
        kh = change.hash(self.keys)
        rows = _zset.top1_rows(change.data, kh, keypos, order)
        if rows is None:
            return None
        ch = kh[rows]
        by_hash = np.argsort(ch)
        old = lookup_exact(self.shown, ch[by_hash], op.in_schema).consolidate()
        if old.num_rows and not (old.weights > 0).all():  # not a state this path made: the general path decides
            return None
        cand = make(_zset.gather(change.data, rows), np.ones(len(rows), np.int64), op.in_schema)
        n_old = old.num_rows
        if n_old:
            both = concat([old, cand], op.in_schema)
            bh = np.concatenate([old.hash(self.keys), ch])
            best = _zset.top1_rows(both.data, bh, keypos, order)
            if best is None:
                return None
            won = best[best >= n_old] - n_old
            lost = np.ones(n_old, dtype=bool)
            lost[best[best < n_old]] = False
        else:
            won = np.arange(len(rows))
            lost = np.zeros(0, dtype=bool)
        if len(won) == 0:
            return empty(op.schema)
        parts = [ZSet._make(cand.data.take(pa.array(won)), cand.weights[won]) if len(won) < len(rows) else cand]
        if lost.any():
            parts.append(ZSet._make(old.data.filter(pa.array(lost)), -old.weights[lost]))
        dix = concat(parts, op.in_schema).index_by(self.keys)
        self.shown.insert(dix)
        delta = dix.zset
        if op.hidden_key is not None:
            return make(delta.data.drop_columns([op.hidden_key]), delta.weights, op.schema)
        return delta

    def _show(self, new: ZSet, old: ZSet) -> ZSet:
        """The step's output, ``new - old`` (the touched groups' top rows after and before), also added to
        ``shown``."""
        op = self.op
        delta = (new - old) if old.num_rows else new
        if delta.num_rows == 0:
            return empty(op.schema)
        self.shown.insert(delta.index_by(self.keys))
        if op.hidden_key is not None:
            return make(delta.data.drop_columns([op.hidden_key]), delta.weights, op.schema)
        return delta
