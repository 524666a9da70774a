"""Match presence: the change, in one step, of the rows of one join side that have no match on the other side, which left, right, full outer, semi and anti joins are all built from.

Invariants (enforced here; every caller keeps the order of calls):
  1. ``unmatched_change(L, R, dl, dr, ...)`` is called before ``dl`` and ``dr`` are inserted into the traces ``L``
     and ``R`` (the integrated left and right sides, keyed by their join keys). Its result, summed, is
     ``U(L + dl, R + dr) - U(L, R)`` where ``U(L, R)`` is the rows of L whose key has no row in R (a key "has rows"
     when their weights sum to more than 0; a null key never has any).
  2. The result has two parts: the new left rows whose key has no right rows after the step, and, for every key
     whose right side turns empty (or non-empty) in the step, the old left rows of that key with weight +1 (or
     -1). The right side's per-key row counts before and after the step come from one grouping pass over the
     right rows of the touched keys, so the cost grows with the change and the rows of its keys; when the right
     trace keeps a key index of its weights (trace invariant 11) and both sides' key types are equal, the old
     counts come from it instead (one probe per touched key) and the grouping pass sees only the change's keys;
     in a step that changes only the left side, each new left row's key is probed once and nothing is grouped.
  3. The parts are returned as ``(batch, rows, weights)``: indices into an indexed left batch and the weights
     of the chosen rows, so a caller builds what it outputs (padded rows, plain rows) with one take.
  4. ``PresenceState`` is what the states of those joins share: the two traces, each step's changes indexed by
     the join keys (None for a side without rows), the unmatched left rows' change (invariant 1), and the step
     itself: a join's :meth:`PresenceState.parts` computes its change while the left trace does not hold ``da``
     yet, and inserts ``db`` into the right trace (``inner_change`` does); the step then inserts ``da``.
  5. Both traces hold their low levels while unread (``hold_unread``, as an inner join's sides: join.py invariant 9,
     trace/levels.py invariant 18): the left side is read only when the right side changes. The right side, read
     through its key index for every left change but walked for the matches of a left change, is read whenever the
     left side changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

from dbsp_core.envvars import settings
from dbsp_core.operators.base import Operator, concat, conform, empty, make
from dbsp_core.trace import Trace, unique_sorted

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import IndexedZSet, ZSet

OLD = "__dbsp_old__"

Part = tuple["IndexedZSet", np.ndarray, np.ndarray]


class Presence:
    """What :func:`unmatched_change` needs to know about the right side: its schema and key columns."""

    def __init__(self, rschema: pa.Schema, right_on: Sequence[str]) -> None:
        self.right_on = tuple(right_on)
        self.keyschema = pa.schema([pa.field(k, rschema.field(k).type) for k in self.right_on])
        self.counts_schema = pa.schema(list(rschema) + [pa.field(OLD, pa.int64())])

    def keys_with_weights(self, keys: pa.Table, weights: np.ndarray) -> "IndexedZSet":
        """A Z-set of right-key tuples, indexed by the right key, for matching left rows with the join kernel."""
        return make(keys.select(list(self.right_on)), weights, self.keyschema).index_by(list(self.right_on))

    def _with_old(self, z: "ZSet", old: bool) -> "ZSet":
        flag = np.full(z.num_rows, 1 if old else 0, dtype=np.int64)
        return make(z.data.append_column(OLD, pa.array(flag)), z.weights, self.counts_schema)

    def right_counts(self, right: Trace, dl: "IndexedZSet | None", dr: "IndexedZSet | None") -> pa.Table | None:
        """Per touched right key: its right row count after the step and before it (invariant 2)."""
        counts = self._indexed_counts(right, dl, dr)
        if counts is not None:
            return counts
        hashes = touched_keys(dl, dr)
        old = [self._with_old(b.zset, True) for b in right.lookup(hashes)]
        new = [self._with_old(dr.zset, False)] if dr is not None and len(dr) else []
        rows = concat(old + new, self.counts_schema)
        if rows.num_rows == 0:
            return None
        return rows.index_by(list(self.right_on)).reduce([("count", None), ("sum", OLD)])

    def _indexed_counts(self, right: Trace, dl: "IndexedZSet | None", dr: "IndexedZSet | None") -> pa.Table | None:
        """:meth:`right_counts` from the right trace's key index (trace invariant 11): the touched keys grouped
        once (the change's right rows with their weights, the left rows' keys with weight 0), each key's old count
        in one probe. None when the index cannot serve (no current index, key types that differ between sides):
        the caller then looks the right rows up."""
        from dbsp_core import _zset

        if right.index_spec != ("key", (None,)):
            return None
        names = list(self.right_on)
        parts, weights = [], []
        if dr is not None and len(dr):
            parts.append(dr.zset.data.select(names))
            weights.append(dr.zset.weights)
        if dl is not None and len(dl):
            keys = dl.zset.data.select(list(dl.key)).rename_columns(names)
            if not keys.schema.equals(self.keyschema):
                return None
            parts.append(keys)
            weights.append(np.zeros(len(dl), dtype=np.int64))
        if not parts:
            return None
        table = parts[0] if len(parts) == 1 else pa.concat_tables(parts).combine_chunks()
        w = weights[0] if len(weights) == 1 else np.concatenate(weights)
        keypos = list(range(len(names)))
        view = _zset.BatchView(table, w)
        group_row, khash, delta, _, _ = _zset.group_reduce(view, None, keypos, [("count", None)], True)
        old = right.key_weights(table, names, khash, group_row, view)
        if old is None:
            return None
        new = old + np.asarray(delta[:, 0], dtype=np.int64)
        keys = _zset.take(view, group_row, self.keyschema, keypos)
        return pa.Table.from_arrays(list(keys.columns) + [pa.array(new), pa.array(old)],
                                    names=names + ["agg_0", "agg_1"])


def touched_keys(*changes: "IndexedZSet | None") -> np.ndarray:
    """The distinct key hashes (ascending) of the given indexed changes (None: no change)."""
    hashes = [x.key_hash for x in changes if x is not None]
    if not hashes:
        return np.zeros(0, dtype=np.uint64)
    return np.unique(np.concatenate(hashes)) if len(hashes) > 1 else unique_sorted(hashes[0])


def unmatched_change(presence: Presence, left: Trace, right: Trace, dl: "IndexedZSet | None",
                     dr: "IndexedZSet | None") -> list[Part]:
    """The change of the left rows without a right match (invariants 1-3), as ``[(batch, rows, weights)]``."""
    if dl is None and dr is None:
        return []
    if dr is None and len(dl):  # the right side does not change: no key flips, only the new left rows count
        found = right.key_weights(dl.zset.data, list(dl.key), dl.key_hash, np.arange(len(dl), dtype=np.int64),
                                  dl._view())
        if found is not None:  # each new left row's key probed once in the right trace's key index (invariant 2)
            nomatch = found <= 0
            for k in dl.key:  # a null key never matches (the index counts it as a key like any other)
                col = dl.zset.data.column(k)
                if col.null_count:
                    nomatch |= col.is_null().to_numpy(zero_copy_only=False)
            miss = np.flatnonzero(nomatch)
            return [(dl, miss, dl.zset.weights[miss])] if len(miss) else []
    counts = presence.right_counts(right, dl, dr)
    nk = len(presence.right_on)
    new_n = counts.column(nk).to_numpy() if counts is not None else np.zeros(0, dtype=np.int64)
    old_n = counts.column(nk + 1).to_numpy() if counts is not None else np.zeros(0, dtype=np.int64)
    parts: list[Part] = []
    # old left rows of keys whose right side turns empty (+1) or non-empty (-1)
    flip = np.where((old_n > 0) & (new_n <= 0), 1, np.where((old_n <= 0) & (new_n > 0), -1, 0))
    if counts is not None and flip.any():
        sel = np.flatnonzero(flip)
        flips = presence.keys_with_weights(counts.take(pa.array(sel)), flip[sel].astype(np.int64))
        for batch in left.lookup(unique_sorted(flips.key_hash)):
            li, _ri, w = batch.join(flips)
            if len(li):
                parts.append((batch, li, w))
    # new left rows whose key has no right rows after the step
    if dl is not None and len(dl):
        present = np.flatnonzero(new_n > 0)
        if len(present):
            keys = presence.keys_with_weights(counts.take(pa.array(present)), np.ones(len(present), dtype=np.int64))
            li, ri, w = dl.join(keys, left_outer=True)
            miss = ri < 0
            parts.append((dl, li[miss], w[miss]))
        else:
            parts.append((dl, np.arange(len(dl), dtype=np.int64), dl.zset.weights))
    return parts


class PresenceState(ABC):
    """The state of a left, right or full outer, semi or anti join (invariant 4): the integrated left and right
    inputs, each a trace keyed by its join keys, and the presence of the left rows' keys on the right side.
    ``op`` has ``lschema``, ``rschema``, ``left_on`` and ``right_on``."""

    def __init__(self, op: Operator) -> None:
        self.op = op
        self.left = Trace(op.lschema, op.left_on)
        self.right = Trace(op.rschema, op.right_on)
        self.right.keep_index((None,))  # each touched key's right row count in one probe (trace invariant 11)
        self.left.hold_unread = self.right.hold_unread = settings().totals_hold  # (invariant 5)
        self.presence = Presence(op.rschema, op.right_on)  # left rows against the right side

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name (each trace can be read per shard)."""
        return {"left": self.left, "right": self.right}

    def changes(self, inputs: list["ZSet"]) -> tuple["IndexedZSet | None", "IndexedZSet | None"]:
        """A step's left and right changes, indexed by their join keys; None for a side without rows."""
        op = self.op
        a, b = inputs
        da = conform(a, op.lschema).index_by(list(op.left_on)) if a.num_rows else None
        db = conform(b, op.rschema).index_by(list(op.right_on)) if b.num_rows else None
        return (da if da is not None and len(da) else None), (db if db is not None and len(db) else None)

    def unmatched_left(self, da: "IndexedZSet | None", db: "IndexedZSet | None") -> list[Part]:
        """The change of the left rows without a right match (invariant 1: before ``da``, ``db`` are inserted)."""
        return unmatched_change(self.presence, self.left, self.right, da, db)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        """One step of the join (invariant 4): its change, unconsolidated."""
        da, db = self.changes(inputs)
        if da is None and db is None:
            return empty(self.op.schema)
        parts = self.parts(da, db)
        if da is not None:
            self.left.insert(da)
        return concat(parts, self.op.schema)

    @abstractmethod
    def parts(self, da: "IndexedZSet | None", db: "IndexedZSet | None") -> list["ZSet"]:
        """The join's change from the step's changes; inserts ``db`` into the right trace, not ``da`` (invariant 4)."""


def take_parts(parts: list[Part], schema: pa.Schema) -> "ZSet":
    """The left rows of ``parts`` as one Z-set of ``schema`` (the left side's columns)."""
    out = []
    for batch, li, w in parts:
        if len(li):
            out.append(make(batch.zset.data.take(pa.array(li, pa.int64())), w, schema))
    return concat(out, schema)
