"""The nested forms of join and distinct that run inside a fixpoint (operators/fixpoint.py): incremental over both the outer steps and the iterations of each step, as DBSP's nested circuits are.

Inside a fixpoint a stream has two times, the step t and the iteration i; what flows is its 2-D change
``d[t][i]`` (the value at (t, i) minus the values at (t-1, i) and (t, i-1) plus the value at (t-1, i-1)), and an
operator Q must emit the 2-D change of Q applied to the 2-D integral of its inputs.

Invariants (enforced here):
  1. State: every nested operator keeps, per input, one trace of the changes of all earlier steps, each row
     tagged with its iteration in the column :data:`ITER` (a row's weight is the sum over earlier steps of its
     change at that iteration), keyed by the operator's exchange key like the flat operator's traces. A step
     reads only the rows of the keys (join) or rows (distinct) that change in it, fetched once per step
     (:class:`Fetched`), and adds its own changes, tagged, at the end of the step.
  2. Join, at iteration i of a step, with ``a``/``b`` the current step's changes and ``A``/``B`` the earlier
     steps' (per iteration), emits ``a[i] x (B[<=i] + b[<=i]) + (A[<i] + a[<i]) x b[i] + A[i] x b[<=i] +
     a[<i] x B[i]``: every pair whose later step is t and whose later iteration is i, minus the pairs of two
     earlier-step changes (the 2-D change of a bilinear operator).
  3. Distinct, for each row r touched in the step, emits at iteration i ``[O_i + C_i > 0] - [O_i > 0] -
     [O_{i-1} + C_{i-1} > 0] + [O_{i-1} > 0]`` where ``O_i`` (``C_i``) is r's weight summed over the earlier
     steps' (this step's) changes of iterations up to i; only rows changed at i, or with an earlier-step change
     at i, can emit anything, and only they are evaluated. Row identity treats null as equal to null.
  4. ``bound`` is the largest iteration at which an earlier step changed a key (row) this step has touched: an
     iteration past it with no current change emits nothing, so a fixpoint may stop once its feedback is
     empty and it has passed every operator's bound.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from dbsp_core import _zset
from dbsp_core.operators.base import concat, conform, empty, make
from dbsp_core.operators.distinct import Distinct
from dbsp_core.operators.join import Join
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet, ZSet

ITER = "__dbsp_iter"


def tagged_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` plus the iteration column."""
    return pa.schema(list(schema) + [pa.field(ITER, pa.int64())])


def tag(z: ZSet, i: int, schema: pa.Schema) -> ZSet:
    """``z`` with every row tagged with iteration ``i`` (``schema`` is the tagged schema)."""
    return make(z.data.append_column(ITER, pa.array(np.full(z.num_rows, i, dtype=np.int64))), z.weights, schema)


def untag(z: ZSet, schema: pa.Schema) -> ZSet:
    """``z`` without its iteration column (``schema`` is the untagged schema)."""
    return make(z.data.drop_columns([ITER]), z.weights, schema)


def iterations(ix: IndexedZSet) -> np.ndarray:
    """The iteration of every row of a tagged batch."""
    return np.asarray(ix.zset.data.column(ITER).to_numpy(zero_copy_only=False), dtype=np.int64)


class Fetched:
    """The earlier steps' rows of the keys touched in this step, fetched once per key, split by iteration:
    ``below`` holds the rows of iterations already passed, ``at[j]`` those of iteration j to come."""

    def __init__(self, schema: pa.Schema, key: Sequence[str]) -> None:
        self.schema, self.key = schema, tuple(key)
        self.seen = np.zeros(0, dtype=np.uint64)
        self.below = Trace(schema, self.key)
        self.at: dict[int, list[IndexedZSet]] = {}

    def fetch(self, old: Trace, hashes: np.ndarray, i: int) -> None:
        """Fetch the rows of ``old`` whose key hash is in ``hashes`` and was not fetched before (iteration i)."""
        new = np.setdiff1d(np.unique(hashes), self.seen, assume_unique=True)
        if len(new) == 0:
            return
        self.seen = np.union1d(self.seen, new)
        for b in old.lookup(new):
            mine = np.flatnonzero(np.isin(b.key_hash, new))  # lookup may return more (Trace.lookup)
            if len(mine) == 0:
                continue
            b = b if len(mine) == len(b) else b.take(mine)
            its = iterations(b)
            for j in np.unique(its).tolist():
                part = b if len(its) == 1 or bool((its == j).all()) else b.take(np.flatnonzero(its == j))
                if j < i:
                    self.below.insert(part)
                else:
                    self.at.setdefault(j, []).append(part)

    def now(self, i: int) -> list[IndexedZSet]:
        """The fetched rows of iteration i (call before :meth:`advance`)."""
        return self.at.get(i, [])

    def advance(self, i: int) -> None:
        """Iteration i is done: its rows join the passed ones."""
        for b in self.at.pop(i, []):
            self.below.insert(b)

    @property
    def bound(self) -> int:
        return max(self.at, default=-1)


class NestedJoin:
    """One inner join of a fixpoint body (invariant 2); :meth:`new_traces` makes its state."""

    def __init__(self, op: Join) -> None:
        self.op = op
        self.lschema, self.rschema = tagged_schema(op.lschema), tagged_schema(op.rschema)
        nl = len(op.lschema)
        self.out_tagged = pa.schema(list(self.lschema) + list(op.schema)[nl:])
        self.names = ("left", "right")
        self.keys = (op.left_on, op.right_on)
        self.schemas = (self.lschema, self.rschema)

    def new_traces(self) -> tuple[Trace, Trace]:
        return Trace(self.lschema, self.op.left_on), Trace(self.rschema, self.op.right_on)

    def begin(self, old: tuple[Trace, Trace]) -> None:
        self.old_l, self.old_r = old
        self.cur_l, self.cur_r = Trace(self.lschema, self.op.left_on), Trace(self.rschema, self.op.right_on)
        self.f_l = Fetched(self.lschema, self.op.left_on)  # earlier left rows of keys touched on the right
        self.f_r = Fetched(self.rschema, self.op.right_on)  # earlier right rows of keys touched on the left

    def _pairs(self, left: IndexedZSet, right: IndexedZSet, out: list[ZSet]) -> None:
        if not len(left) or not len(right):
            return
        lv, rv = left._view(), right._view()
        li, ri, w = _zset.join(lv, None, None, left._keypos, rv, None, None, right._keypos, False)
        if len(li):
            t = _zset.take_pairs(lv, li, rv, ri, self.op.right_kept_pos, self.out_tagged)
            out.append(make(t.drop_columns([ITER]), w, self.op.schema))

    def iterate(self, i: int, inputs: list[ZSet]) -> ZSet:
        op = self.op
        a, b = inputs
        da = tag(conform(a, op.lschema), i, self.lschema).index_by(list(op.left_on)) if a.num_rows else None
        db = tag(conform(b, op.rschema), i, self.rschema).index_by(list(op.right_on)) if b.num_rows else None
        da = da if da is not None and len(da) else None
        db = db if db is not None and len(db) else None
        if da is not None:
            self.f_r.fetch(self.old_r, da.key_hash, i)
        if db is not None:
            self.f_l.fetch(self.old_l, db.key_hash, i)
            self.cur_r.insert(db)
        out: list[ZSet] = []
        if da is not None:  # a[i] x (B[<=i] + b[<=i])
            for r in self.f_r.below.batches + self.f_r.now(i) + self.cur_r.batches:
                self._pairs(da, r, out)
        if db is not None:  # (A[<i] + a[<i]) x b[i]
            for left in self.f_l.below.batches + self.cur_l.batches:
                self._pairs(left, db, out)
        for left in self.f_l.now(i):  # A[i] x b[<=i]
            for r in self.cur_r.batches:
                self._pairs(left, r, out)
        for r in self.f_r.now(i):  # a[<i] x B[i]
            for left in self.cur_l.batches:
                self._pairs(left, r, out)
        if da is not None:
            self.cur_l.insert(da)
        self.f_l.advance(i)
        self.f_r.advance(i)
        return concat(out, op.schema)

    @property
    def bound(self) -> int:
        return max(self.f_l.bound, self.f_r.bound)

    def current(self) -> tuple[list[IndexedZSet], list[IndexedZSet]]:
        """This step's tagged changes, per input, to add to the state at the end of the step."""
        return self.cur_l.batches, self.cur_r.batches


class NestedDistinct:
    """One inner distinct of a fixpoint body (invariant 3); :meth:`new_traces` makes its state."""

    def __init__(self, op: Distinct) -> None:
        self.op = op
        self.cols = list(op.schema.names)
        self.tschema = tagged_schema(op.schema)
        self.names = ("input",)
        self.keys = (tuple(self.cols),)
        self.schemas = (self.tschema,)

    def new_traces(self) -> tuple[Trace]:
        return (Trace(self.tschema, tuple(self.cols)),)

    def begin(self, old: tuple[Trace]) -> None:
        (self.old,) = old
        self.fetched = Fetched(self.tschema, self.cols)
        empty_ix = IndexedZSet.empty(self.op.schema, self.cols)
        self.o_sum = empty_ix  # earlier steps' weight of each touched row, iterations <= the last one done
        self.c_sum = empty_ix  # this step's weight of each touched row, likewise
        self.cur: list[IndexedZSet] = []

    def _plain(self, parts: list[IndexedZSet]) -> IndexedZSet:
        zs = [untag(p.zset, self.op.schema) for p in parts]
        return concat(zs, self.op.schema).index_by(self.cols)

    def iterate(self, i: int, inputs: list[ZSet]) -> ZSet:
        op = self.op
        a = inputs[0]
        da = conform(a, op.schema).index_by(self.cols) if a.num_rows else None
        da = da if da is not None and len(da) else None
        if da is not None:
            self.fetched.fetch(self.old, da.key_hash, i)
        late = self.fetched.below.batches  # rows first touched now, of iterations before i: into o_sum at once
        if late:
            self.o_sum = self.o_sum.merge(self._plain(late))
            self.fetched.below.clear()
        now = self.fetched.at.pop(i, [])
        if da is None and not now:
            return empty(op.schema)
        cands = ([da.zset] if da is not None else []) + [untag(p.zset, op.schema) for p in now]
        cand = concat(cands, op.schema)
        cand = make(cand.data, np.ones(cand.num_rows, dtype=np.int64), op.schema).index_by(self.cols)
        o_prev = cand.match_weights(self.o_sum)
        c_prev = cand.match_weights(self.c_sum)
        if now:
            self.o_sum = self.o_sum.merge(self._plain(now))
        if da is not None:
            self.c_sum = self.c_sum.merge(da)
            self.cur.append(tag(da.zset, i, self.tschema).index_by(self.cols))
        o_now = cand.match_weights(self.o_sum)
        c_now = cand.match_weights(self.c_sum)
        out = ((o_now + c_now > 0).astype(np.int64) - (o_now > 0) - (o_prev + c_prev > 0) + (o_prev > 0))
        keep = np.flatnonzero(out)
        if len(keep) == 0:
            return empty(op.schema)
        return ZSet._make(cand.zset.data.take(pa.array(keep, pa.int64())), out[keep].astype(np.int64))

    @property
    def bound(self) -> int:
        return self.fetched.bound

    def current(self) -> tuple[list[IndexedZSet]]:
        return (self.cur,)


def nested_state(op: object) -> "NestedJoin | NestedDistinct | None":
    """The nested form of a body operator, None for one that runs iteration by iteration as it is (linear)."""
    if type(op) is Join:
        return NestedJoin(op)
    if type(op) is Distinct:
        return NestedDistinct(op)
    return None
