"""Moving operator state between the workers of the embedded executor in memory, a wave of shards at a time, at a step boundary: what a live rescale does while the pipeline runs.

Invariants (enforced here):
  1. State whose placement the circuit relies on moves with its shard: the traces and Z-sets of a node whose
     output is partitioned or whose state is keyed inside it (``Operator.state_placed``: the fixpoint) (keyed operators read their input exchanged by their key, so a key's state must sit
     with the owner of its shard, and partitioned Z-set state feeds operators that rely on the same placement).
     For each moving shard the rows of the old owner's state in that shard's key-hash range are cut out and
     handed to the new owner; nothing else changes, so the sum over workers of every piece of state is the
     same before and after.
  2. State whose placement does not matter (a node with unpartitioned output: any worker may hold any row,
     results are the sum over workers) stays where it is, except that a worker leaving the layout hands all of
     it over (each row to the new owner of its shard).
  3. A cut costs what the moved rows cost, not what the source holds: a trace batch is sorted by key hash, so a
     run of consecutive shards is one row range, cut out and kept as zero-copy slices (IndexedZSet.slice, which
     keep the batch's row hashes); the kept slices take their batch's place (Trace.replace: same level, merges
     of untouched batches go on), so the cut merges nothing and hashes nothing. A Z-set is split by shard (it
     is small next to traces: the partitioned Z-set state of a circuit).
  4. A wave's pause costs its cut and its placing, not their merges: the moved slices are inserted and the
     cut replaced with deferred work (trace invariant 14: no merge fuel paid, key indexes parked owing their
     folds), which the steps after the move pay in bounded pieces with their own inserts.
  5. The snapshot of a source worker learns which stored values the cut kept and which it moved
     (WorkerSnapshot.rebind), so the next checkpoint writes the moved rows once, to their new owner, and only
     deletes keys at the source.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.layout import shard_runs
from dbsp_core.storage.snapshot import WorkerSnapshot, state_attrs, zset_grouping, zset_shards
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet, ZSet

__all__ = ["cut_trace", "move_shards", "hand_over"]


def _split(b: IndexedZSet, bits: int, runs: list[tuple[int, int]]
           ) -> tuple[list[tuple[IndexedZSet, int, int]], list[IndexedZSet]]:
    """A batch as its kept slices (with the shard range each covers) and its moved slices (invariant 3)."""
    bounds = b.shard_bounds(bits)
    nshards = len(bounds) - 1
    kept: list[tuple[IndexedZSet, int, int]] = []
    moved: list[IndexedZSet] = []
    at = 0  # first shard not yet assigned
    for a, z in runs:
        lo, hi = int(bounds[a]), int(bounds[z])
        klo = int(bounds[at])
        if lo > klo:
            kept.append((b.slice(klo, lo), at, a))
        if hi > lo:
            moved.append(b.slice(lo, hi))
        at = z
    if int(bounds[nshards]) > int(bounds[at]):
        kept.append((b.slice(int(bounds[at]), int(bounds[nshards])), at, nshards))
    return kept, moved


def cut_trace(trace: Trace, mask: np.ndarray, bits: int) -> tuple[list[IndexedZSet], dict[int, list]]:
    """Cut the rows of the shards in ``mask`` (a boolean array over the ``2**bits`` shards) out of ``trace``.

    Returns the moved slices and ``{id(old batch): [(kept slice, first shard, end shard), ...]}`` for the
    batches that changed (for :meth:`WorkerSnapshot.rebind`). The trace keeps the rest of every batch in its
    place (:meth:`Trace.replace`: each slice at its batch's level, merges of untouched batches going on,
    pending batches pending), so a cut merges nothing and hashes nothing (invariant 3): the slices keep their
    batch's row hashes. A key index of the trace is owed the moved rows' subtraction (invariant 4).
    """
    runs = shard_runs(np.flatnonzero(mask))
    if not runs:
        return [], {}
    trace._check_files(reads_all=False)  # the cut seeks key hashes and moves rows (trace/spill.py invariant 14)
    placed, pending = trace.parts()
    moved: list[IndexedZSet] = []
    changed: dict[int, list] = {}
    for b in list(placed) + list(pending):
        kept, out = _split(b, bits, runs)
        if not out:
            continue
        moved.extend(out)
        changed[id(b)] = kept
    if not moved:
        return [], {}
    trace.replace({oid: [k for k, _, _ in kept] for oid, kept in changed.items()}, removed=moved, defer=True)
    return moved, changed


def _zset_split(z: ZSet, columns: tuple[str, ...], bits: int, mask: np.ndarray) -> tuple[ZSet, ZSet]:
    """``z`` as (rows outside the shards of ``mask``, rows inside them)."""
    if z.num_rows == 0:
        return z, z
    sel = mask[zset_shards(z, columns, bits)]
    if not sel.any():
        return z, ZSet.empty(z.schema)
    if sel.all():
        return ZSet.empty(z.schema), z
    w = np.asarray(z.weights, dtype=np.int64)
    return (ZSet._make(z.data.filter(pa.array(~sel)), w[~sel]), ZSet._make(z.data.filter(pa.array(sel)), w[sel]))


def _nbytes(z: ZSet) -> int:
    return int(z.data.nbytes) + int(z.weights.nbytes)


def move_shards(nodes: list, src: dict[int, Any], dst: dict[int, Any], mask: np.ndarray, bits: int,
                src_snapshot: WorkerSnapshot | None, placement_free: bool = False) -> int:
    """Move the state of the shards in ``mask`` from one worker's stateful instances ``src`` to another's ``dst``
    (both ``{node id: instance}``): the placement-bound state (invariant 1), or with ``placement_free`` the other
    kind (invariant 2). Returns the bytes moved (Arrow buffers of the moved rows)."""
    moved_bytes = 0
    for i, inst in src.items():
        bound = nodes[i].state_placed
        if bound == placement_free:
            continue
        other = dst[i]
        traces, zsets = state_attrs(i, inst)
        for name in traces:
            t: Trace = getattr(inst, name)
            before = t.parts()  # the cut batches stay alive through rebind, which finds their records by id
            pieces, changed = cut_trace(t, mask, bits)
            if src_snapshot is not None and changed:
                src_snapshot.rebind(i, name, changed, mask)
            del before
            target: Trace = getattr(other, name)
            for p in pieces:
                target.insert(p, defer=True)  # invariant 4: merged and indexed by the steps after
                moved_bytes += _nbytes(p.zset)
        for name in zsets:
            z: ZSet = getattr(inst, name)
            keep, move = _zset_split(z, zset_grouping(z.schema, nodes[i].partitioning), bits, mask)
            if move.num_rows:
                setattr(inst, name, keep)
                cur: ZSet = getattr(other, name)
                setattr(other, name, (cur + move) if cur.num_rows else move.consolidate())
                moved_bytes += _nbytes(move)
    return moved_bytes


def hand_over(nodes: list, src: dict[int, Any], dsts: list[dict[int, Any]], owners: np.ndarray, bits: int) -> int:
    """A leaving worker's remaining state, every row to the new owner of its shard (``owners``: shard -> index
    into ``dsts``). Returns the bytes moved."""
    total = 0
    for w, dst in enumerate(dsts):
        mask = owners == w
        if mask.any():
            total += move_shards(nodes, src, dst, mask, bits, None, placement_free=False)
            total += move_shards(nodes, src, dst, mask, bits, None, placement_free=True)
    return total
