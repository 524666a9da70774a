"""Saving and restoring the operator state of one worker in its Database, grouped by shard.

Invariants (enforced here):
  1. Only stateful operator instances (``node.instance() is not node``) persist anything; stateless operators
     persist nothing (the Falkirk Wheel "ephemeral" policy).
  2. A stateful instance's state is exactly its attributes holding a ``Trace`` or a ``ZSet``; every other
     attribute is configuration rebuilt by ``instance()``. Each instance is checked once when the pipeline is
     built: an attribute of another mutable kind (list, dict, ndarray, IndexedZSet) raises, so state can never
     be silently left out.
  3. A trace is stored as its batches, settled and pending alike (saving never settles a trace, so it never
     merges what the running pipeline would not), each split by shard: one value per (non-empty shard, batch)
     under :func:`shard_key` ``(shard, batch number)`` in table ``s<node>.<attr>``, so a shard's state is one
     contiguous key range and moves as a unit; the trace is the sum of the values. Key ``order.<table>`` of
     table ``snapshot`` lists the batch numbers in trace order and how many of them are settled, so a restored
     trace has the same spine and pending batches (without it, as written before it existed: number order, all
     settled).
     A plain Z-set (integrate, delay, differentiate state, not keyed) is stored whole under key ``b"all"``
     in table ``z<node>.<attr>``. Every value is a checksummed, versioned Z-set encoding.
  4. Saving writes only batches not saved before and deletes the keys of batches merged away, so the stored
     state equals the in-memory state after every save, at a cost that follows the trace's merges.
  5. With ``group_pending`` (the durable pipeline), consecutive new pending batches of a trace are saved as one
     group: one value per shard holding that shard's rows of each batch in turn plus the run lengths, so a
     trace written every step but rarely read (a join side) costs one Arrow message per shard and checkpoint,
     not one per shard and step. A group is one entry of the order record (with its batch count) and loads
     back as the same batches; once any of its batches is merged away, the group is deleted and its
     remaining batches are saved again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.codec import (decode_batch, decode_json, decode_runs, decode_zset, encode_batch, encode_json,
                             encode_runs, encode_zset, zset_batch)
from dbsp_core.errors import CorruptionError, DbspError
from dbsp_core.storage.database import SHARD_PREFIX_BYTES, DatabaseHandle, shard_key, shard_of_key
from dbsp_core.trace import Trace, ranges_to_indices
from dbsp_core.zset import IndexedZSet, ZSet

_CONFIG_TYPES = (str, int, float, bool, bytes, tuple, pa.Schema, type(None))


def state_attrs(node_id: int, inst: Any) -> tuple[list[str], list[str]]:
    """The names of the Trace and the ZSet attributes of a stateful instance (invariant 2)."""
    traces, zsets = [], []
    for name, val in vars(inst).items():
        if isinstance(val, Trace):
            traces.append(name)
        elif isinstance(val, ZSet):
            zsets.append(name)
        elif isinstance(val, (list, dict, set, np.ndarray, IndexedZSet)) and not _is_config_list(val):
            raise DbspError(f"node #{node_id} ({type(inst).__name__}): attribute {name!r} of type "
                            f"{type(val).__name__} may be state that cannot be checkpointed")
    return traces, zsets


def _is_config_list(val: Any) -> bool:
    # lists/tuples of names or (kind, column) pairs are configuration, e.g. key columns
    if isinstance(val, list):
        return all(isinstance(x, (str, tuple)) for x in val)
    return False


def _sync_table(h: DatabaseHandle, table: str, values: dict[bytes, bytes]) -> int:
    """Make ``table`` hold exactly ``values``; returns how many keys were written or deleted."""
    changed = 0
    old = dict(h.scan(table))
    for k in old.keys() - values.keys():
        h.delete(table, k)
        changed += 1
    for k, v in values.items():
        if old.get(k) != v:
            h.put(table, k, v)
            changed += 1
    return changed


def _order_key(table: str) -> bytes:
    return b"order." + table.encode("utf-8")


def _put_group(h: DatabaseHandle, table: str, run: list, bounds: list[np.ndarray], shards: list[int],
               keys: list[bytes]) -> int:
    """Write consecutive batches as one value per shard: each shard's rows of every batch, batch after batch,
    with the run lengths (invariant 5): one Arrow message per shard instead of one per batch and shard."""
    rbs = [zset_batch(b.zset) for b in run]
    if hasattr(pa, "concat_batches"):  # pyarrow >= 19
        whole = pa.concat_batches(rbs)
    else:  # pragma: no cover - older pyarrow
        whole = pa.Table.from_batches(rbs).combine_chunks().to_batches()[0]
    offs = np.cumsum([0] + [rb.num_rows for rb in rbs])[:-1]
    sel = np.asarray(shards, dtype=np.int64)
    lo = np.stack([bd[:-1][sel] + o for bd, o in zip(bounds, offs)], axis=1)  # (shard, batch) row ranges
    hi = np.stack([bd[1:][sel] + o for bd, o in zip(bounds, offs)], axis=1)
    rows = whole.take(pa.array(ranges_to_indices(lo.ravel(), hi.ravel())))  # grouped by shard, then batch
    counts = (hi - lo).tolist()
    start, tname = 0, table.encode("utf-8")
    for key, cnt in zip(keys, counts):
        n = sum(cnt)
        h.put(tname, key, encode_runs(rows.slice(start, n), cnt))
        start += n
    return len(keys)


def _must_get(h: DatabaseHandle, table: str, key: bytes, where: str) -> bytes:
    v = h.get(table, key)
    if v is None:
        raise CorruptionError(f"{where} {table}: listed key {key!r} is missing")
    return v


class WorkerSnapshot:
    """The checkpointed state of one worker's stateful instances, saved incrementally (invariants 3 and 4).

    A trace is saved batch by batch: every batch (settled or pending) is written once, split by shard, under
    ``shard_key(shard, batch number)``; a later checkpoint writes only the batches that appeared since
    (new changes and merge results) and deletes the keys of batches that were merged away. So a checkpoint
    costs what the trace's merges cost, amortized, not the size of the state. It keeps a reference to every
    saved batch (so ids stay unique), so a batch merged away stays in memory until the next checkpoint:
    at most about the size of the trace again.
    """

    def __init__(self, instances: dict[int, Any], shard_bits: int, group_pending: bool = False) -> None:
        self.instances = instances
        self.shard_bits = shard_bits
        self.group_pending = group_pending
        # (table) -> {id(batch): (batch, [keys written for it])}; holding the batch keeps its id unique. The
        # batches of a group (saved together, invariant 5) share one keys list object.
        self._saved: dict[str, dict[int, tuple[Any, list[bytes]]]] = {}
        self._next = 0  # batch number of the next batch written

    def _unsave_broken(self, table: str, saved: dict, batches: list, plan: list) -> None:
        """Delete every saved group (or single batch) that is no longer a consecutive run of live batches, and
        forget its live members so they are saved again."""
        size: dict[int, int] = {}
        for _, keys in saved.values():
            size[id(keys)] = size.get(id(keys), 0) + 1
        good: set[int] = set()
        seen: set[int] = set()
        i = 0
        while i < len(batches):
            e = saved.get(id(batches[i]))
            if e is None:
                i += 1
                continue
            lid, j = id(e[1]), i
            while j < len(batches) and id(batches[j]) in saved and id(saved[id(batches[j])][1]) == lid:
                j += 1
            if lid not in seen and j - i == size[lid]:
                good.add(lid)
            else:
                good.discard(lid)
            seen.add(lid)
            i = j
        gone: dict[int, list[bytes]] = {}
        for bid in [k for k, (_, keys) in saved.items() if id(keys) not in good]:
            keys = saved.pop(bid)[1]
            gone[id(keys)] = keys
        for keys in gone.values():
            plan.append(("delete", table, keys))

    def prepare(self) -> list[tuple]:
        """Capture what the next save writes, without encoding or I/O (cheap; call it while steps are paused).

        Returns a plan for :meth:`apply`: it holds only immutable batches and Z-sets, so steps may run on
        while another thread applies it. Marks the planned batches as saved.
        """
        plan: list[tuple] = []
        for node_id, inst in self.instances.items():
            traces, zsets = state_attrs(node_id, inst)
            for name in traces:
                table = f"s{node_id}.{name}"
                saved = self._saved.setdefault(table, {})
                settled, pending = getattr(inst, name).parts()  # no settling: no merges to pay here
                batches = settled + pending
                self._unsave_broken(table, saved, batches, plan)
                i = 0
                while i < len(batches):  # new batches: runs of pending ones as groups, the others one by one
                    if id(batches[i]) in saved:
                        i += 1
                        continue
                    j = i + 1
                    if self.group_pending and i >= len(settled):
                        while j < len(batches) and id(batches[j]) not in saved:
                            j += 1
                    run = batches[i:j]
                    number = self._next.to_bytes(8, "big")
                    self._next += 1
                    bounds = [b.shard_bounds(self.shard_bits) if len(b) else np.zeros(1, dtype=np.int64)
                              for b in run]
                    nonempty = np.zeros(len(bounds[0]) - 1, dtype=bool)
                    for bd in bounds:
                        nonempty |= np.diff(bd) > 0
                    shards = np.flatnonzero(nonempty).tolist()
                    keys = [shard_key(sh, number) for sh in shards]
                    for b in run:
                        saved[id(b)] = (b, keys)
                    if len(run) == 1:
                        plan.append(("batch", table, run[0], bounds[0], shards, keys))
                    else:
                        plan.append(("group", table, run, bounds, shards, keys))
                    i = j
                numbers, counts, in_spine = [], [], 0
                prev = None
                for i, b in enumerate(batches):  # the trace order of the stored values (invariant 3)
                    keys = saved[id(b)][1]
                    if not keys:  # an empty batch stores nothing (traces hold none)
                        continue
                    if keys is prev:
                        counts[-1] += 1
                    else:
                        numbers.append(int.from_bytes(keys[0][SHARD_PREFIX_BYTES:], "big"))
                        counts.append(1)
                    prev = keys
                    in_spine += i < len(settled)
                plan.append(("order", table, numbers, counts, in_spine))
            for name in zsets:
                plan.append(("zset", f"z{node_id}.{name}", getattr(inst, name)))
        plan.append(("next", self._next))
        return plan

    @staticmethod
    def apply(h: DatabaseHandle, plan: list[tuple]) -> int:
        """Encode and write a :meth:`prepare` plan into ``h``; returns the number of keys written or deleted."""
        changed = 0
        for op in plan:
            if op[0] == "delete":
                for key in op[2]:
                    h.delete(op[1], key)
                changed += len(op[2])
            elif op[0] == "batch":
                _, table, b, bounds, shards, keys = op
                rb, put, tname = zset_batch(b.zset), h.put, table.encode("utf-8")
                edges = bounds.tolist()
                for sh, key in zip(shards, keys):
                    put(tname, key, encode_batch(rb.slice(edges[sh], edges[sh + 1] - edges[sh])))
                changed += len(keys)
            elif op[0] == "group":
                _, table, run, bounds, shards, keys = op
                changed += _put_group(h, table, run, bounds, shards, keys)
            elif op[0] == "order":
                _, table, numbers, counts, settled = op
                rec = {"numbers": numbers, "settled": settled}
                if any(c != 1 for c in counts):
                    rec["counts"] = counts
                h.put("snapshot", _order_key(table), encode_json(b"DORD", rec))
                changed += 1
            elif op[0] == "zset":
                z = op[2]
                changed += _sync_table(h, op[1], {b"all": encode_zset(z)} if z.num_rows else {})
            else:
                h.put("snapshot", b"next", op[1].to_bytes(8, "big"))
        return changed

    def save(self, h: DatabaseHandle) -> int:
        """Write the state into ``h`` (:meth:`prepare` then :meth:`apply`); returns the keys written or deleted."""
        return self.apply(h, self.prepare())

    def load(self, h: DatabaseHandle, where: str, reuse: "WorkerSnapshot | None" = None,
             listing: dict[str, list[bytes]] | None = None) -> int:
        """Restore the state saved by :meth:`save` into fresh instances; returns the number of rows loaded.

        ``reuse``: an older snapshot of the same worker's state, saved into an earlier version of the same
        database. A batch is saved once under a number never given again, so a stored batch whose number and
        shard keys ``reuse`` holds is that batch: it is taken from memory instead of being decoded and hashed.
        ``listing``: every key of every trace table (``{table: keys}``), when the caller knows them (e.g. from
        a log of the saves since ``reuse``): the tables are then not scanned and only values of batches not
        taken from ``reuse`` are read.
        """
        known: dict[str, dict[bytes, tuple[Any, list[bytes]]]] = {}
        if reuse is not None:
            for table, saved in reuse._saved.items():
                known[table] = {keys[0][SHARD_PREFIX_BYTES:]: (b, keys) for b, keys in saved.values() if keys}
        rows = 0
        nxt = h.get("snapshot", b"next")
        self._next = int.from_bytes(nxt, "big") if nxt is not None else 0
        self._saved = {}
        for node_id, inst in self.instances.items():
            traces, zsets = state_attrs(node_id, inst)
            for name in traces:
                trace: Trace = getattr(inst, name)
                table = f"s{node_id}.{name}"
                groups: dict[bytes, tuple[list[bytes], list[bytes]]] = {}
                listed = h.scan(table) if listing is None else ((k, None) for k in sorted(listing.get(table, ())))
                for k, v in listed:  # keys sort by shard, then batch number
                    blobs, keys = groups.setdefault(k[SHARD_PREFIX_BYTES:], ([], []))
                    blobs.append(v)
                    keys.append(k)
                trace.clear()
                batches = []
                mine = known.get(table, {})
                rec = h.get("snapshot", _order_key(table))
                if rec is None:  # written before the order was recorded: every batch settled, in number order
                    numbers, counts, settled = sorted(groups), [1] * len(groups), len(groups)
                else:
                    d = decode_json(b"DORD", rec, f"{where} snapshot order of {table}")
                    numbers, settled = [int(n).to_bytes(8, "big") for n in d["numbers"]], int(d["settled"])
                    counts = [int(c) for c in d.get("counts", [1] * len(numbers))]
                    if sorted(numbers) != sorted(groups) or len(counts) != len(numbers) or \
                            not 0 <= settled <= sum(counts) or min(counts, default=1) < 1:
                        raise CorruptionError(f"{where} {table}: the recorded batch order names {len(numbers)} "
                                              f"batches, the table holds {len(groups)}")
                restored: list[tuple[Any, list[bytes]]] = []
                for number, count in zip(numbers, counts):
                    blobs, keys = groups[number]
                    old = mine.get(number)
                    if count == 1 and old is not None and sorted(old[1]) == sorted(keys):
                        restored.append((old[0], keys))
                        continue
                    values = [(v if v is not None else _must_get(h, table, k, where),
                               f"{where} {table} shard {shard_of_key(k)}") for k, v in zip(keys, blobs)]
                    if count == 1:
                        members = [[decode_batch(v, trace.schema, w) for v, w in values]]
                    else:
                        runs = [decode_runs(v, trace.schema, w) for v, w in values]
                        if any(len(r) != count for r in runs):
                            raise CorruptionError(f"{where} {table}: a value of batch group {number.hex()} does "
                                                  f"not hold {count} runs")
                        members = [[r[i] for r in runs if r[i].num_rows] for i in range(count)]
                    for parts in members:
                        if not parts:
                            raise CorruptionError(f"{where} {table}: batch group {number.hex()} holds an empty batch")
                        z = parts[0] if len(parts) == 1 else ZSet.concat(parts)
                        # shard slices of one key-hash-sorted batch, in shard order: the batch itself
                        b = IndexedZSet._make(ZSet._make(z.data, z.weights), trace.key, z.hash(list(trace.key)))
                        restored.append((b, keys))  # a group's batches share its keys list (see _saved)
                for pos, (b, keys) in enumerate(restored):
                    if pos == settled:
                        trace.settle()  # the settled batches shrink strictly (trace invariant 2): no merges
                    trace.insert(b)  # the rest stay pending, as they were saved
                    batches.append((b, keys))
                    rows += len(b)
                if settled == len(restored):
                    trace.settle()
                spine = {id(b) for b in sum(trace.parts(), [])}
                saved = {id(b): (b, keys) for b, keys in batches}
                if set(saved) != spine:  # pragma: no cover - settling merged restored batches: rewrite them all
                    for _, keys in batches:
                        for k in keys:
                            h.delete(table, k)
                    saved = {}
                self._saved[table] = saved
            for name in zsets:
                cur: ZSet = getattr(inst, name)
                table = f"z{node_id}.{name}"
                v = h.get(table, b"all")
                z = ZSet.empty(cur.schema) if v is None else decode_zset(v, cur.schema, f"{where} {table}")
                setattr(inst, name, z)
                rows += z.num_rows
        return rows
