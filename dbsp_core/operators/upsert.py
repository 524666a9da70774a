"""The upsert operator: a table with a primary key, kept in a trace keyed by it, turning each step's upserts and deletes by key into the Z-set change of the table (the old row retracted, the new one inserted).

Invariants:
  1. The trace holds the table: at most one row per key, weight 1. After every step its sum over workers is
     the table a SQL ``INSERT OR REPLACE`` / ``DELETE ... WHERE key = ...`` sequence in push order leaves.
  2. The step's change reaches the operator with at most one row per key (the runtime keeps the last row of
     each key of the step, in the order the input log recorded the pushes (in memory, the order they were
     queued; from one thread, the order of the calls) and, within a push, in row order:
     :func:`last_per_key`): weight +1 replaces the key's row (or inserts it), weight -1 deletes the key's row
     whatever the other columns hold (a key that is absent is a no-op). Other weights and null key values are
     refused at the push (:func:`check_keyed`), before anything is recorded.
  3. The output is ``-old + new`` for the changed keys, consolidated: an upsert of the row already held emits
     nothing. Old rows are found by key in the trace (a lookup per changed key, then an exact key match), so the
     cost grows with the change, not with the table.
  4. The input is exchanged by the key: a key's whole history lives in one worker, so the state is placed by
     shard (checkpointed, rescaled and spilled like any trace) and the result does not depend on W.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.errors import PrimaryKeyError
from dbsp_core.operators.base import concat, empty, keyed_change
from dbsp_core.operators.materialize import Materialize, _MaterializeState
from dbsp_core.trace.levels import unique_sorted
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext


class Upsert(Materialize):
    """The table ``name`` with primary key ``key``: a materialize node keyed by the primary key whose output is the
    table's change (invariant 3)."""

    kind = "upsert"
    split_safe = True  # base.py invariant 6: the driver keeps a key's last row over the whole step (invariant 2)

    def instance(self) -> "_UpsertState":
        return _UpsertState(self)


class _UpsertState(_MaterializeState):
    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        schema, key = self.op.schema, self.trace.key
        dix = keyed_change(self, inputs, ctx, schema, key, cleanup=False)  # the table keeps every row
        if dix is None:
            return empty(schema)
        parts = []
        old = concat([b.zset for b in self.trace.lookup(unique_sorted(dix.key_hash))], schema)
        if old.num_rows:
            oix = old.index_by(list(key))  # consolidated: a row and its retraction in two batches cancel
            _, ri, _ = dix.join(oix)  # exact key equality: rows a lookup returns for other keys drop out
            if len(ri):
                ri = np.asarray(ri, dtype=np.int64)
                parts.append(ZSet._make(oix.zset.data.take(pa.array(ri)), -oix.zset.weights[ri]))
        z = dix.zset
        put = z.weights > 0
        if put.any():
            parts.append(ZSet._make(z.data.filter(pa.array(put)), np.ones(int(put.sum()), dtype=np.int64)))
        if not parts:
            return empty(schema)
        out = concat(parts, schema).index_by(list(key))  # consolidated: an upsert of the held row cancels out
        if len(out) == 0:
            return empty(schema)
        self.trace.insert(out)
        return out.zset


def check_keyed(z: ZSet, key: Sequence[str], where: str) -> None:
    """PrimaryKeyError unless every weight of ``z`` is +1 (upsert) or -1 (delete by key) and no key value is null
    (invariant 2)."""
    w = z.weights
    bad = np.flatnonzero((w != 1) & (w != -1))
    if len(bad):
        i = int(bad[0])
        raise PrimaryKeyError(f"{where}: row {i} has weight {int(w[i])}; a table with a primary key takes weight +1 "
                              f"(insert or replace the row of its key) or -1 (delete the row of its key), nothing else")
    for c in key:
        col = z.data.column(c)
        if col.null_count:
            i = int(np.flatnonzero(np.asarray(pc.is_null(col).to_numpy(zero_copy_only=False)))[0])
            raise PrimaryKeyError(f"{where}: primary key column {c!r} is null at row {i}; key values must not be null")


def last_per_key(parts: list[ZSet], key: Sequence[str]) -> ZSet:
    """The rows of ``parts`` (one table's pushes of one step, in order) less every row a later row of the same key
    overrides: the last row of each key wins (invariant 2), in the order of the rows kept.

    >>> s = pa.schema([("k", pa.int64()), ("v", pa.string())])
    >>> a = ZSet.from_rows([(1, "a"), (2, "b"), (1, "c")], s)
    >>> b = ZSet.from_rows([(2, None)], s, weights=[-1])
    >>> last_per_key([a, b], ["k"]).to_arrow().to_pylist()
    [{'k': 1, 'v': 'c', 'weight': 1}, {'k': 2, 'v': None, 'weight': -1}]
    """
    z = ZSet.concat(parts) if len(parts) > 1 else parts[0]
    n = z.num_rows
    if n <= 1:
        return z
    t = z.data.select(list(key)).append_column("__dbsp_row", pa.array(np.arange(n, dtype=np.int64)))
    last = t.group_by(list(key), use_threads=False).aggregate([("__dbsp_row", "max")]).column("__dbsp_row_max")
    if len(last) == n:
        return z
    idx = np.sort(np.asarray(last.to_numpy(), dtype=np.int64))
    return ZSet._make(z.data.take(pa.array(idx)), np.ascontiguousarray(z.weights[idx]))


def keep_last(pushes: list[tuple[str, ZSet]], keys: dict[str, tuple[str, ...]]) -> list[tuple[str, ZSet]]:
    """A step's pushes as an executor runs them: the pushes of each input with a primary key (``keys``) made into
    one Z-set by :func:`last_per_key`, the others as they are.

    >>> s = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    >>> p = keep_last([("t", ZSet.from_rows([(1, 5)], s)), ("u", ZSet.from_rows([(1, 5)], s)),
    ...                ("t", ZSet.from_rows([(1, 6)], s))], {"t": ("k",)})
    >>> [(h, z.to_dict()) for h, z in p]
    [('u', {(1, 5): 1}), ('t', {(1, 6): 1})]
    """
    if not keys or not any(h in keys for h, _ in pushes):
        return pushes
    out = [(h, z) for h, z in pushes if h not in keys]
    for handle, key in keys.items():
        mine = [z for h, z in pushes if h == handle]
        if mine:
            out.append((handle, last_per_key(mine, key)))
    return out
