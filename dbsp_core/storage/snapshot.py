"""Saving and restoring the operator state of one worker in its Database, every value grouped by shard so a shard's state moves between workers as a unit.

Invariants (enforced here):
  1. Only stateful operator instances (``node.instance() is not node``) persist anything; stateless operators
     persist nothing (the Falkirk Wheel "ephemeral" policy).
  2. A stateful instance's state is exactly its attributes holding a ``Trace`` or a ``ZSet``; every other
     attribute is configuration rebuilt by ``instance()``. Each instance is checked once when the pipeline is
     built: an attribute of another mutable kind (list, dict, ndarray, IndexedZSet) raises, so state can never
     be silently left out.
  3. Every stored value holds the rows of ONE shard and sits under :func:`shard_key` ``(shard, number)``, so a
     shard's state is one contiguous key range of each table: moving a shard moves those values and nothing
     else (dbsp_core.storage.shardmove); the one exception is invariant 11's range values, keyed by their first
     shard and never crossing a multiple of ``RANGE_SHARDS``. ``number`` comes from one counter per database (``snapshot/next``),
     never reused; the state of a table is the sum of its values.
  4. A trace (table ``s<node>.<attr>``) is stored as its batches, settled and pending alike (saving never
     settles, so it never merges what the running pipeline would not), each split into its shards' row ranges
     (a trace batch is sorted by key hash, and the trace's key decides where its rows live: keyed operators
     read their input exchanged by that key). Key ``order.<table>`` of table ``snapshot`` lists the batch
     numbers in trace order, how many batches each number holds and how many of them are settled, so a
     restored trace has the same levels and pending batches. The values of one number, in shard order,
     concatenate to the batch (or to the part of it still in this database after a move); a listed number
     whose values all moved away loads as nothing.
  5. A plain Z-set (table ``z<node>.<attr>``: integrate, delay, differentiate, filter-now state) is split by the
     hash of the node's partitioning columns (rows of a partitioned stream live with their key's shard), or of
     all its columns when the node is not partitioned; each piece is one value. A Z-set is rewritten only
     when the attribute holds another object than the one saved last.
  6. Saving writes only values not saved before and deletes the keys of batches merged away, so the stored
     state equals the in-memory state after every save, at a cost that follows the trace's merges.
  7. With ``group_pending`` (the embedded durable pipeline), consecutive new pending batches of a trace are
     saved as one group: one value per shard holding that shard's rows of each batch in turn plus the run
     lengths, so a trace written every step but rarely read (a join side) costs one Arrow message per shard
     and checkpoint, not one per shard and step. A group is one entry of the order record (with its batch
     count) and loads back as the same batches (minus any that moved away entirely); once any of its batches
     is merged away, the group is deleted and its remaining batches are saved again.
  8. A settled batch that lives in a batch file (spilled under a memory budget by a durable store,
     dbsp_core/trace/spill.py invariant 13) is saved as references, not rows: one ``DRBF`` value per shard naming
     the file and the shard's row range in it; the file is pinned from the plan on. Loading reads the batch in
     place from the file, a single slice when its shards' ranges are contiguous: with a batch store the file is
     opened lazily and its bytes are checked as reads touch them (dbsp_core/trace/spill.py invariant 14), without
     one it is checked whole once per load.
     :meth:`WorkerSnapshot.referenced` is the set of files the stored values name.
  9. A load with ``renames`` (a program change, dbsp_core.runtime.change) reads node ``n``'s state from the tables
     node ``renames[n]`` wrote and leaves a node ``renames`` does not name empty; the next save then deletes
     every state table the database held (values and order records) and writes all state again under the
     current node numbers, in one commit, so a database never mixes two circuits' numbering.
 10. A load with ``drop_unread`` (a worker's whole state, the embedded coordinator's) that finds a stored state
     table no instance reads any more (an engine upgrade changed the state an operator keeps: operators/top_k.py
     invariant 7 left the general top-k's ``input`` table) has the next save delete it, values and order record;
     the batch files its values name count as named (:meth:`WorkerSnapshot.referenced`) until that save, so the
     opened checkpoint's files stay on disk until a checkpoint that no longer names them has committed
     (dbsp_core/trace/spill.py invariant 13), and a crash before it reopens the same directory.
 11. With ``shard_ranges`` (the embedded durable pipeline), a trace batch or group written as rows is saved as one
     value per aligned block of ``RANGE_SHARDS`` shards that holds any of its rows, not one per shard: a ``DRBR``
     value from the block's first to its last shard with rows (its key: the first), holding each shard's rows
     (of each batch of a group in turn) and their run lengths; a block with one such shard keeps invariant 3's
     one-shard form (``DRB1``, ``DRBG``). A checkpoint's cost follows its values more than its bytes (about 8 us a
     value against 0.6 ns a byte: bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r37-demo5), and a step's 12k-row batch spread over a
     worker's 128 shards made 128 values of ~100 rows. A load splits a range value into its shards' rows, so a
     number's values still concatenate, in key order, to the batch (invariant 4). What moves state by shard
     splits a range value a move cuts into one-shard values first (shardmove.py invariant 6); a live rescale's
     cut (:meth:`WorkerSnapshot.rebind`) that falls inside a range value's shards saves that batch again.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from dbsp_core.codec import (decode_batch, decode_json, decode_runs, decode_width_runs, decode_zset, encode_batch,
                             encode_json, encode_runs, encode_width_runs, encode_zset, zset_batch)
from dbsp_core.errors import CorruptionError, DbspError
from dbsp_core.storage.database import SHARD_PREFIX_BYTES, DatabaseHandle, shard_key, shard_of_key
from dbsp_core.storage.formats import (BATCH_FILE_GROUPED_VERSION, BATCH_GROUP_MAGIC, BATCH_MAGIC, BATCH_RANGE_MAGIC,
                                       BATCH_REF_MAGIC, ORDER_MAGIC, RANGE_SHARDS, SNAPSHOT_NEXT, SNAPSHOT_TABLE,
                                       ZSET_MAGIC, is_state_table, order_key, trace_table, zset_table)
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet, ZSet

_CONFIG_TYPES = (str, int, float, bool, bytes, tuple, pa.Schema, type(None))



class _Rows:
    """A format-2 batch file's rows read whole (a copy), read where a format-1 file's mapped batch is: a restore of
    part of one (spill.py invariant 18)."""

    def __init__(self, batch: Any) -> None:
        self.batch, self.rows = batch, len(batch)

    def check_all(self) -> int:
        return 0

class TableSpec(NamedTuple):
    """What one state table holds, for code that handles stored state without the live instances (rescaling).

    ``kind`` is ``"trace"`` (values are batches of rows sorted by the hash of ``key``) or ``"zset"`` (values are
    Z-set pieces grouped by the hash of ``key``); ``schema`` is the rows' data columns.
    """

    kind: str
    schema: pa.Schema
    key: tuple[str, ...]


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


def state_tables(instances: dict[int, Any], groupings: dict[int, tuple[str, ...] | None]) -> dict[str, TableSpec]:
    """``{table: TableSpec}`` of every state table of ``instances`` (``{node id: instance}``); ``groupings[i]`` is
    node ``i``'s partitioning (None: not partitioned)."""
    out: dict[str, TableSpec] = {}
    for node_id, inst in instances.items():
        traces, zsets = state_attrs(node_id, inst)
        for name in traces:
            t: Trace = getattr(inst, name)
            out[trace_table(node_id, name)] = TableSpec("trace", t.schema, tuple(t.key))
        for name in zsets:
            z: ZSet = getattr(inst, name)
            out[zset_table(node_id, name)] = TableSpec("zset", z.schema, zset_grouping(z.schema, groupings.get(node_id)))
    return out


def zset_grouping(schema: pa.Schema, partitioning: tuple[str, ...] | None) -> tuple[str, ...]:
    """The columns whose hash groups a Z-set attribute by shard (invariant 5)."""
    if partitioning:
        return tuple(partitioning)
    return tuple(schema.names)


def zset_shards(z: ZSet, columns: tuple[str, ...], shard_bits: int) -> np.ndarray:
    """The shard of every row of ``z`` by the hash of ``columns`` (int64 array)."""
    if shard_bits == 0:
        return np.zeros(z.num_rows, dtype=np.int64)
    h = np.asarray(z.hash(list(columns)), dtype=np.uint64)
    return (h >> np.uint64(64 - shard_bits)).astype(np.int64)


def zset_pieces(z: ZSet, columns: tuple[str, ...], shard_bits: int) -> list[tuple[int, ZSet]]:
    """``[(shard, rows of z in that shard)]`` for every non-empty shard, by the hash of ``columns``."""
    if z.num_rows == 0:
        return []
    sh = zset_shards(z, columns, shard_bits)
    order = np.argsort(sh, kind="stable")
    ssh = sh[order]
    shards, starts = np.unique(ssh, return_index=True)
    ends = np.append(starts[1:], len(ssh))
    data = z.data.take(pa.array(order, pa.int64()))
    w = np.asarray(z.weights, dtype=np.int64)[order]
    return [(int(s), ZSet._make(data.slice(int(a), int(b - a)), w[a:b]))
            for s, a, b in zip(shards.tolist(), starts.tolist(), ends.tolist())]


def ranges_to_indices(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenate the integer ranges ``[lo[i], hi[i])`` into one int64 array, vectorized.

    >>> ranges_to_indices(np.array([0, 5]), np.array([2, 7])).tolist()
    [0, 1, 5, 6]
    """
    lens = (hi - lo).astype(np.int64)
    keep = lens > 0
    lo, lens = lo[keep].astype(np.int64), lens[keep]
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    return np.repeat(lo - starts, lens) + np.arange(total, dtype=np.int64)


def range_spans(shards: list[int]) -> list[tuple[int, int]]:
    """``[(first, end)]``: the shards with rows (ascending) by aligned block of ``RANGE_SHARDS``, each from the
    block's first to past its last shard with rows (invariant 11).

    >>> range_spans([0, 3, 15, 16, 40, 41])
    [(0, 16), (16, 17), (40, 42)]
    """
    out: list[tuple[int, int]] = []
    for sh in shards:
        if out and sh // RANGE_SHARDS == out[-1][0] // RANGE_SHARDS:
            out[-1] = (out[-1][0], sh + 1)
        else:
            out.append((sh, sh + 1))
    return out


def range_pieces(value: bytes, first: int, schema: pa.Schema, where: str) -> tuple[int, list[tuple[int, list[ZSet]]]]:
    """``(width, [(shard, its rows of each batch)])`` of a ``DRBR`` value keyed at shard ``first`` (invariant 11),
    the shards without rows left out."""
    width, runs = decode_width_runs(value, schema, where, BATCH_RANGE_MAGIC)
    nb = len(runs) // width
    if first % RANGE_SHARDS + width > RANGE_SHARDS:
        raise CorruptionError(f"{where}: a range of {width} shards from shard {first} crosses a block of "
                              f"{RANGE_SHARDS}")
    out = []
    for i in range(width):
        part = runs[i * nb:(i + 1) * nb]
        if any(r.num_rows for r in part):
            out.append((first + i, part))
    return width, out


def encode_range_value(parts: list[list[ZSet]], schema: pa.Schema) -> bytes:
    """The value of consecutive shards' rows (``parts[i]``: shard i's rows of each batch, empty ones included):
    ``DRBR`` for several shards, ``DRB1`` (``DRBG`` for several batches) for one (invariant 11)."""
    runs = [r for part in parts for r in part]
    rows = [r for r in runs if r.num_rows]
    z = ZSet.concat(rows) if len(rows) > 1 else rows[0] if rows else ZSet.empty(schema)
    return _span_value(zset_batch(z), len(parts), [r.num_rows for r in runs], len(parts[0]))


def _span_value(rb: pa.RecordBatch, width: int, counts: list[int], batches: int) -> bytes:
    """The value of ``width`` consecutive shards' rows ``rb`` (shard by shard, each shard's ``batches`` batches in
    turn, run lengths ``counts``): ``DRBR`` for several shards, else ``DRB1`` for one batch, ``DRBG`` for several
    (invariant 11)."""
    if width > 1:
        return encode_width_runs(rb, width, counts, BATCH_RANGE_MAGIC)
    if batches == 1:
        return encode_batch(rb, BATCH_MAGIC)
    return encode_runs(rb, counts, BATCH_GROUP_MAGIC)


def _shard_major(run: list, bounds: list[np.ndarray], sel: np.ndarray) -> tuple[pa.RecordBatch, np.ndarray]:
    """The rows of shards ``sel`` of consecutive batches ``run``, shard by shard and each shard's batches in turn,
    as one record batch, and the row counts ``(len(sel), len(run))``."""
    if len(run) == 1:  # one batch: each shard's rows are one slice; a take only when shards are skipped
        edges = bounds[0]
        lo, hi = edges[:-1][sel], edges[1:][sel]
        rb = zset_batch(run[0].zset)
        if len(sel) and np.all(lo[1:] == hi[:-1]):
            return rb.slice(int(lo[0]), int(hi[-1] - lo[0])), (hi - lo)[:, None]
        return rb.take(pa.array(ranges_to_indices(lo, hi))), (hi - lo)[:, None]
    rbs = [zset_batch(b.zset) for b in run]
    if hasattr(pa, "concat_batches"):  # pyarrow >= 19
        whole = pa.concat_batches(rbs)
    else:  # pragma: no cover - older pyarrow
        whole = pa.Table.from_batches(rbs).combine_chunks().to_batches()[0]
    offs = np.cumsum([0] + [rb.num_rows for rb in rbs])[:-1]
    lo = np.stack([bd[:-1][sel] + o for bd, o in zip(bounds, offs)], axis=1)  # (shard, batch) row ranges
    hi = np.stack([bd[1:][sel] + o for bd, o in zip(bounds, offs)], axis=1)
    return whole.take(pa.array(ranges_to_indices(lo.ravel(), hi.ravel()))), hi - lo  # by shard, then batch


def _put_ranges(h: DatabaseHandle, table: str, run: list, bounds: list[np.ndarray], spans: list[tuple[int, int]],
                keys: list[bytes]) -> int:
    """Write a batch (or consecutive batches) as one value per span of shards (invariant 11): ``DRBR`` for a span
    of several shards, ``DRB1`` (``DRBG`` for several batches) for one."""
    sel = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in spans])
    rows, counts = _shard_major(run, bounds, sel)
    start, i, tname = 0, 0, table.encode("utf-8")
    for (a, e), key in zip(spans, keys):
        c = counts[i:i + e - a]
        i += e - a
        n = int(c.sum())
        piece = rows.slice(start, n)
        start += n
        h.put(tname, key, _span_value(piece, e - a, c.ravel().tolist(), len(run)))
    return len(keys)


def _put_group(h: DatabaseHandle, table: str, run: list, bounds: list[np.ndarray], shards: list[int],
               keys: list[bytes]) -> int:
    """Write consecutive batches as one value per shard: each shard's rows of every batch, batch after batch,
    with the run lengths (invariant 7): one Arrow message per shard instead of one per batch and shard."""
    rows, counts = _shard_major(run, bounds, np.asarray(shards, dtype=np.int64))
    counts = counts.tolist()
    start, tname = 0, table.encode("utf-8")
    for key, cnt in zip(keys, counts):
        n = sum(cnt)
        h.put(tname, key, encode_runs(rows.slice(start, n), cnt, BATCH_GROUP_MAGIC))
        start += n
    return len(keys)


def _must_get(h: DatabaseHandle, table: str, key: bytes, where: str) -> bytes:
    v = h.get(table, key)
    if v is None:
        raise CorruptionError(f"{where} {table}: listed key {key!r} is missing")
    return v


def read_order(h: DatabaseHandle, table: str, where: str) -> tuple[list[int], list[int], int] | None:
    """The order record of trace table ``table``: ``(numbers, counts, settled)``, or None if it has none."""
    rec = h.get(SNAPSHOT_TABLE, order_key(table))
    if rec is None:
        return None
    d = decode_json(ORDER_MAGIC, rec, f"{where} snapshot order of {table}")
    numbers = [int(n) for n in d["numbers"]]
    counts = [int(c) for c in d.get("counts", [1] * len(numbers))]
    settled = int(d["settled"])
    if len(counts) != len(numbers) or min(counts, default=1) < 1 or not 0 <= settled <= sum(counts):
        raise CorruptionError(f"{where} {table}: inconsistent order record {d}")
    return numbers, counts, settled


def write_order(h: DatabaseHandle, table: str, numbers: list[int], counts: list[int], settled: int) -> None:
    """Store the order record of trace table ``table`` (invariant 4)."""
    rec: dict[str, Any] = {"numbers": numbers, "settled": settled}
    if any(c != 1 for c in counts):
        rec["counts"] = counts
    h.put(SNAPSHOT_TABLE, order_key(table), encode_json(ORDER_MAGIC, rec))


def read_next(h: DatabaseHandle) -> int:
    """The database's next unused value number (invariant 3)."""
    nxt = h.get(SNAPSHOT_TABLE, SNAPSHOT_NEXT)
    return int.from_bytes(nxt, "big") if nxt is not None else 0


def write_next(h: DatabaseHandle, n: int) -> None:
    h.put(SNAPSHOT_TABLE, SNAPSHOT_NEXT, n.to_bytes(8, "big"))


class WorkerSnapshot:
    """The checkpointed state of one worker's stateful instances, saved incrementally (invariants 3-7).

    A trace is saved batch by batch: every batch (settled or pending) is written once, split by shard, under
    ``shard_key(shard, number)``; a later checkpoint writes only the batches that appeared since (new changes
    and merge results) and deletes the keys of batches that were merged away. So a checkpoint costs what the
    trace's merges cost, amortized, not the size of the state. Its record of saved batches (``_saved``, by
    ``id()``) holds them weakly, so a batch merged away is freed at once instead of at the next checkpoint (a
    strong reference kept up to a second copy of the trace in memory: 643 MiB of merged-away batches for 30M
    rows of join + group-by state at a 10 s interval). An id is unique only among live objects, so a save reads
    the trace's batches (which may change them: a trace keeping its totals per key syncs, and its insert may merge
    saved batches away), then drops the record's entries whose batch is gone (:meth:`_purge`: their keys are
    deleted, a group's live members saved again); a new entry moves a gone batch's entry under its id aside
    (:meth:`_put`), and a lookup by id checks that the entry's batch is alive.

    Parameters
    ----------
    instances : dict
        ``{node id: stateful instance}``.
    shard_bits : int
        The layout's shard bits: values are grouped by these shards.
    group_pending : bool
        Save consecutive new pending batches of a trace as one group (invariant 7).
    groupings : dict or None
        ``{node id: partitioning columns or None}``: how Z-set attributes are grouped (invariant 5).
    shard_ranges : bool
        Save a trace batch's rows as one value per block of shards (invariant 11).
    """

    def __init__(self, instances: dict[int, Any], shard_bits: int, group_pending: bool = False,
                 groupings: dict[int, tuple[str, ...] | None] | None = None, shard_ranges: bool = False) -> None:
        self.instances = instances
        self.shard_bits = shard_bits
        self.group_pending = group_pending
        self.shard_ranges = shard_ranges
        self._ranged: dict[bytes, int] = {}  # key of a stored DRBR value -> its width in shards (invariant 11)
        self.groupings = dict(groupings or {})
        # (table) -> {id(batch): (weak reference to the batch, [keys written for it])}; the batches of a group
        # (saved together, invariant 7) share one keys list object. An entry whose batch is gone is dropped by
        # _purge before any lookup (its id may now belong to another batch).
        self._saved: dict[str, dict[int, tuple[Any, list[bytes]]]] = {}
        # (table) -> (the Z-set object saved last, the keys its pieces were written under)
        self._saved_z: dict[str, tuple[ZSet, list[bytes]]] = {}
        # (table) -> keys of stored values no live batch maps to any more (a group that lost members to a move,
        # batches merged while loading): deleted by the next save
        self._orphans: dict[str, list[list[bytes]]] = {}
        self._next = 0  # number of the next value written
        self._stale = 0  # the last key under which _put moved an entry whose batch is gone (negative: no id's)
        # invariant 8: the durable BatchStore whose files may be named (None: rows are copied), the directory
        # files named by stored values are read from, and the file each stored reference value names
        self._dropped: list[tuple[str, list[bytes]]] = []  # invariant 9: (table, keys) the next save deletes
        self.batch_store: Any = None
        self.batch_dir: str | None = None
        # called with each trace :meth:`load` has restored, before the next is read (a stage task's memory budget
        # is enforced there: runtime/stage_task.py invariant 7)
        self.after_trace: Any = None
        self._key_file: dict[bytes, str] = {}

    def referenced(self) -> set[str]:
        """The batch files the stored values name (invariant 8), as of the last :meth:`prepare` or :meth:`load`."""
        return set(self._key_file.values())

    def tables(self) -> dict[str, TableSpec]:
        """The state tables this snapshot saves (see :func:`state_tables`)."""
        return state_tables(self.instances, self.groupings)

    def rebind(self, node_id: int, attr: str, changed: dict[int, list], mask: np.ndarray) -> None:
        """A trace's batches were cut by shard (dbsp_core.runtime.migrate): each kept slice owns the stored values of
        the shards it covers, and the values of the cut shards (``mask``) are deleted by the next save, so a cut
        writes nothing where the rows stay. ``changed``: ``{id(old batch): [(slice, first shard, end shard)]}``;
        the caller keeps the old batches alive until this returns (their ids must stay theirs). A batch saved in
        a group gives its whole group up (saved again)."""
        table = trace_table(node_id, attr)
        saved = self._saved.get(table)
        if not saved:
            return
        sharing: dict[int, int] = {}
        for _, keys in saved.values():
            sharing[id(keys)] = sharing.get(id(keys), 0) + 1
        for oid, kept in changed.items():
            entry = saved.get(oid)
            if entry is None or entry[0]() is None:  # never saved; an entry whose batch is gone under its id is
                continue  # another batch's (the caller keeps the cut batches alive): dropped by the next _purge
            del saved[oid]
            keys = entry[1]
            if sharing.get(id(keys), 1) > 1:  # a group: every member is saved again
                for bid in [k for k, (_, ks) in saved.items() if ks is keys]:
                    del saved[bid]
                self._orphans.setdefault(table, []).append(keys)
                continue
            if not self._ranges_fit(keys, kept, mask):  # invariant 11: a cut inside a range value's shards
                self._orphans.setdefault(table, []).append(keys)
                continue
            by_shard = {shard_of_key(k): k for k in keys}
            for piece, lo, hi in kept:
                self._put(saved, piece, [k for sh, k in sorted(by_shard.items()) if lo <= sh < hi])
            cut = [k for sh, k in by_shard.items() if mask[sh]]
            if cut:
                self._orphans.setdefault(table, []).append(cut)

    def _ranges_fit(self, keys: list[bytes], kept: list, mask: np.ndarray) -> bool:
        """Whether every range value among ``keys`` (invariant 11) lies whole in one kept slice's shards, or whole
        among the cut ones (``mask``), so the values can be shared out by shard as they are."""
        for k in keys:
            width = self._ranged.get(k)
            if width is None:
                continue
            a = shard_of_key(k)
            e = a + width
            if not (mask[a:e].all() or (not mask[a:e].any() and any(lo <= a and e <= hi for _, lo, hi in kept))):
                return False
        return True

    def set_shard_bits(self, bits: int) -> None:
        """The layout's shard count changed: every stored value is deleted and saved again at the new count."""
        if bits == self.shard_bits:
            return
        for table, saved in self._saved.items():
            lists = {id(keys): keys for _, keys in saved.values()}
            self._orphans.setdefault(table, []).extend(lists.values())
        for table, (_, keys) in self._saved_z.items():
            self._orphans.setdefault(table, []).append(keys)
        self._saved, self._saved_z = {}, {}
        self.shard_bits = bits

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
        plan: list[tuple] = [("delete", table, keys) for table, keys in self._dropped]  # invariant 9: first
        self._dropped = []
        for node_id, inst in self.instances.items():
            traces, zsets = state_attrs(node_id, inst)
            for name in traces:
                self._prepare_trace(trace_table(node_id, name), getattr(inst, name), plan)
            for name in zsets:
                table = zset_table(node_id, name)
                for keys in self._orphans.pop(table, []):
                    plan.append(("delete", table, keys))
                z: ZSet = getattr(inst, name)
                old = self._saved_z.get(table)
                if old is not None and old[0] is z:
                    continue
                keys: list[bytes] = []  # filled in by apply: which shards have rows is known only there
                plan.append(("zset", table, z, [] if old is None else old[1], self._next, keys,
                             zset_grouping(z.schema, self.groupings.get(node_id)), self.shard_bits))
                self._next += 1
                self._saved_z[table] = (z, keys)
        plan.append(("next", self._next))
        for op in plan:  # the files the stored values name once the plan is applied (invariant 8), the range values
            if op[0] == "delete":
                for k in op[2]:
                    self._key_file.pop(k, None)
                    self._ranged.pop(k, None)
        return plan

    def _put(self, saved: dict, b: Any, keys: list[bytes]) -> None:
        """Record ``b`` as saved under ``keys``. An entry under its id whose batch is gone (not purged yet: its id
        was freed and given to ``b``) moves to a key no batch has, so its keys are still deleted by the next save
        instead of being forgotten (they would stay in the database, unlisted by the order record)."""
        e = saved.get(id(b))
        if e is not None and e[0]() is not b:
            self._stale -= 1
            saved[self._stale] = e
        saved[id(b)] = (weakref.ref(b), keys)

    def _purge(self, table: str) -> None:
        """Drop the entries of ``table``'s record whose batch is gone (merged away, dropped by a pruning): their
        keys become orphans, deleted by the next save, and so do those of a group any member of which is gone
        (its live members are saved again). After it every entry's batch is alive, so ids identify batches."""
        saved = self._saved.get(table)
        if not saved:
            return
        dead = {id(keys): keys for ref, keys in saved.values() if ref() is None}
        if not dead:
            return
        for bid in [bid for bid, (_, keys) in saved.items() if id(keys) in dead]:
            del saved[bid]
        self._orphans.setdefault(table, []).extend(dead.values())

    def _prepare_trace(self, table: str, trace: Trace, plan: list) -> None:
        # the batches first, then the purge: reading them may change them (a trace keeping its totals per key syncs,
        # trace/levels.py invariant 19: its insert may merge saved batches away and free them, and a new batch may
        # get a freed one's id); purged after, every saved entry's batch is alive, so an id names one batch
        settled, pending = trace.parts()  # no settling (only a per-key trace's sync pays its insert's merges)
        self._purge(table)
        saved = self._saved.setdefault(table, {})
        for keys in self._orphans.pop(table, []):
            plan.append(("delete", table, keys))
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
            store = self.batch_store
            f = ((store.file_of(run[0]) or store.grouped_of(run[0])) if store is not None and len(run) == 1
                 and i < len(settled) else None)  # (a file of either format: spill.py invariant 18)
            number = self._next.to_bytes(8, "big")
            self._next += 1
            bounds = [b.shard_bounds(self.shard_bits) if len(b) else np.zeros((1 << self.shard_bits) + 1,
                                                                              dtype=np.int64) for b in run]
            nonempty = np.zeros(len(bounds[0]) - 1, dtype=bool)
            for bd in bounds:
                nonempty |= np.diff(bd) > 0
            shards = np.flatnonzero(nonempty).tolist()
            keys = [shard_key(sh, number) for sh in shards]
            for b in run:
                self._put(saved, b, keys)
            if f is not None:  # invariant 8: the file's name and row ranges, not the rows
                name = os.path.basename(f.path)
                store.pin(name)
                for k in keys:
                    self._key_file[k] = name
                plan.append(("ref", table, name, store.offset_of(run[0]), bounds[0], shards, keys))
            elif self.shard_ranges:  # invariant 11: one value per block of shards with rows
                spans = range_spans(shards)
                keys[:] = [shard_key(a, number) for a, _ in spans]
                self._ranged.update((k, e - a) for k, (a, e) in zip(keys, spans) if e - a > 1)
                plan.append(("ranges", table, run, bounds, spans, keys))
            elif len(run) == 1:
                plan.append(("batch", table, run[0], bounds[0], shards, keys))
            else:
                plan.append(("group", table, run, bounds, shards, keys))
            i = j
        numbers, counts, in_levels = [], [], 0
        prev, listed = None, set()
        for i, b in enumerate(batches):  # the trace order of the stored values (invariant 4)
            keys = saved[id(b)][1]
            if not keys:  # an empty batch stores nothing (traces hold none)
                continue
            number = int.from_bytes(keys[0][SHARD_PREFIX_BYTES:], "big")
            if keys is prev:
                counts[-1] += 1
            elif number in listed:  # a slice of a batch listed already (rebind): its values load with that batch
                continue
            else:
                numbers.append(number)
                counts.append(1)
                listed.add(number)
            prev = keys
            in_levels += i < len(settled)
        plan.append(("order", table, numbers, counts, in_levels))

    def _referenced_batch(self, trace: Trace, values: list[tuple[bytes, str]], keys: list[bytes]) -> IndexedZSet:
        """The batch whose shards' values name row ranges of batch files (invariant 8; values in shard order):
        a slice of the file's batch read in place when the ranges are one file's and contiguous, else its rows
        gathered (a batch some of whose shards moved, say)."""
        from dbsp_core.trace import groupedbatch
        from dbsp_core.trace.batchfile import open_batch
        from dbsp_core.trace.groupedfile import GroupedFile, file_version, open_grouped

        parts = []
        for (v, where), k in zip(values, keys):
            if v[:4] != BATCH_REF_MAGIC:
                z = decode_batch(v, trace.schema, where, BATCH_MAGIC)
                parts.append((None, 0, z.num_rows, z))
                continue
            d = decode_json(BATCH_REF_MAGIC, v, where)
            name, lo, hi = str(d["file"]), int(d["lo"]), int(d["hi"])
            f = self._files.get(name)
            if f is None:
                if self.batch_dir is None:
                    raise CorruptionError(f"{where}: names batch file {name!r}, but no batch file directory is known")
                path = (self.batch_store.path(name) if self.batch_store is not None
                        else os.path.join(self.batch_dir, os.path.basename(name)))
                if not os.path.exists(path):
                    raise CorruptionError(f"{where}: batch file {path} named by the checkpoint is missing")
                # a store checks what reads touch (spill.py invariant 14): opening reads metadata, not rows; a
                # format-2 file (spill.py invariant 18) checks its metadata on opening and each group as it is read
                if file_version(path) == BATCH_FILE_GROUPED_VERSION:
                    f = self._files[name] = open_grouped(path, verify=self.batch_store is None)
                else:
                    f = self._files[name] = open_batch(path, verify=self.batch_store is None,
                                                       lazy=self.batch_store is not None)
            fkey, fschema = ((f.key, groupedbatch.data_schema(f)) if isinstance(f, GroupedFile)
                             else (f.batch.key, f.batch.schema))
            if not 0 <= lo <= hi <= f.rows or fkey != trace.key or not fschema.equals(trace.schema):
                raise CorruptionError(f"{where}: rows {lo}..{hi} of batch file {name!r} ({f.rows} rows, key "
                                      f"{fkey}) do not fit trace key {trace.key}")
            self._key_file[k] = name
            parts.append((f, lo, hi, None))
        f0 = parts[0][0]
        one = f0 is not None and all(p[0] is f0 for p in parts) and all(a[2] == b[1] for a, b in zip(parts, parts[1:]))
        if one and isinstance(f0, GroupedFile) and (parts[0][1], parts[-1][2]) == (0, f0.rows) \
                and self.batch_store is not None:  # the whole file: read from it, its rows not read (invariant 8)
            b = groupedbatch.reopened(f0, trace.key)
            self.batch_store.adopt_grouped(b, f0)
            return b
        whole = {id(p[0]): p[0].read_all() for p in parts if isinstance(p[0], GroupedFile)}  # (a copy: a slice of
        parts = [(_Rows(whole[id(p[0])]), *p[1:]) if id(p[0]) in whole else p for p in parts]  # one, or no store)
        f0 = parts[0][0]
        if one:
            lo, hi = parts[0][1], parts[-1][2]
            b = f0.batch if (lo, hi) == (0, f0.rows) else f0.batch.slice(lo, hi)
            if self.batch_store is not None and not isinstance(f0, _Rows):
                self.batch_store.adopt(b, f0._replace(batch=None), lo)
            return b
        for p in parts:
            if p[0] is not None:
                p[0].check_all()  # its rows are gathered now
        zs = [p[3] if p[0] is None else p[0].batch.slice(p[1], p[2]).zset for p in parts]
        z = ZSet.concat(zs) if len(zs) > 1 else zs[0]
        return IndexedZSet._make(ZSet._make(z.data, z.weights), trace.key, z.hash(list(trace.key)))

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
                    put(tname, key, encode_batch(rb.slice(edges[sh], edges[sh + 1] - edges[sh]), BATCH_MAGIC))
                changed += len(keys)
            elif op[0] == "ref":
                _, table, name, offset, bounds, shards, keys = op
                edges, tname = bounds.tolist(), table.encode("utf-8")
                for sh, key in zip(shards, keys):
                    h.put(tname, key, encode_json(BATCH_REF_MAGIC, {"file": name, "lo": offset + edges[sh],
                                                                    "hi": offset + edges[sh + 1]}))
                changed += len(keys)
            elif op[0] == "group":
                _, table, run, bounds, shards, keys = op
                changed += _put_group(h, table, run, bounds, shards, keys)
            elif op[0] == "ranges":
                _, table, run, bounds, spans, keys = op
                changed += _put_ranges(h, table, run, bounds, spans, keys)
            elif op[0] == "order":
                _, table, numbers, counts, settled = op
                write_order(h, table, numbers, counts, settled)
                changed += 1
            elif op[0] == "zset":
                _, table, z, old_keys, number, keys, grouping, bits = op
                for k in old_keys:
                    h.delete(table, k)
                keys.clear()
                for sh, piece in zset_pieces(z, grouping, bits):
                    key = shard_key(sh, number.to_bytes(8, "big"))
                    h.put(table, key, encode_zset(piece, ZSET_MAGIC))
                    keys.append(key)
                changed += len(old_keys) + len(keys)
            else:
                write_next(h, op[1])
        return changed

    def save(self, h: DatabaseHandle) -> int:
        """Write the state into ``h`` (:meth:`prepare` then :meth:`apply`); returns the keys written or deleted."""
        return self.apply(h, self.prepare())

    def load(self, h: DatabaseHandle, where: str, reuse: "WorkerSnapshot | None" = None,
             listing: dict[str, list[bytes]] | None = None, renames: dict[int, int] | None = None,
             drop_unread: bool = False) -> int:
        """Restore the state saved by :meth:`save` into fresh instances; returns the number of rows loaded.

        ``reuse``: an older snapshot of the same worker's state, saved into an earlier version of the same
        database. A value is saved once under a number never given again, so a stored batch whose number and
        shard keys ``reuse`` holds is that batch: it is taken from memory instead of being decoded and hashed.
        ``listing``: every key of every trace table (``{table: keys}``), when the caller knows them (e.g. from
        a log of the saves since ``reuse``): the tables are then not scanned and only values of batches not
        taken from ``reuse`` are read.
        ``renames``: ``{node: node whose tables hold its state}`` after a program change (invariant 9).
        ``drop_unread``: ``instances`` are all the state ``h`` holds; a stored table none reads is deleted by the
        next save (invariant 10).
        """
        known: dict[str, dict[bytes, tuple[Any, list[bytes]]]] = {}
        if reuse is not None:
            for table, saved in reuse._saved.items():
                known[table] = {keys[0][SHARD_PREFIX_BYTES:]: (ref(), keys) for ref, keys in saved.values()
                                if keys and ref() is not None}  # a batch gone from memory is read back
        rows = 0
        self._ranged = dict(reuse._ranged) if reuse is not None else {}  # keys taken from reuse are not read
        self._next = read_next(h)
        self._saved, self._saved_z, self._orphans, self._key_file = {}, {}, {}, {}
        self._files: dict[str, Any] = {}  # batch files opened by this load (each checked whole once)
        for node_id, inst in self.instances.items():
            src = node_id if renames is None else renames.get(node_id)
            if src is None:
                continue  # invariant 9: a node of the changed program, built by the caller
            traces, zsets = state_attrs(node_id, inst)
            for name in traces:
                rows += self._load_trace(h, trace_table(src, name), getattr(inst, name), where,
                                         known.get(trace_table(src, name), {}), listing)
                if self.after_trace is not None:
                    self.after_trace(getattr(inst, name))
            for name in zsets:
                cur: ZSet = getattr(inst, name)
                table = zset_table(src, name)
                parts, keys = [], []
                for k, v in h.scan(table):
                    parts.append(decode_zset(v, cur.schema, f"{where} {table} shard {shard_of_key(k)}", ZSET_MAGIC))
                    keys.append(k)
                z = (ZSet.concat(parts) if len(parts) > 1 else parts[0]).consolidate() if parts \
                    else ZSet.empty(cur.schema)
                setattr(inst, name, z)
                self._saved_z[table] = (z, keys)
                rows += z.num_rows
        if renames is not None:
            self._drop_all(h)
        elif drop_unread:
            self._drop_unread(h, where)
        return rows

    def _drop_unread(self, h: DatabaseHandle, where: str) -> None:
        """Invariant 10: every stored state table that no instance reads (and its order record) is deleted by the
        next save; the batch files its values name stay named until then."""
        read = set(self.tables())
        for table in h.tables():
            if not is_state_table(table) or table in read:
                continue
            keys = []
            for k, v in h.scan(table):
                keys.append(k)
                if v[:4] == BATCH_REF_MAGIC:
                    self._key_file[k] = str(decode_json(BATCH_REF_MAGIC, v, f"{where} {table}")["file"])
            self._dropped.append((table, keys))
            if h.get(SNAPSHOT_TABLE, order_key(table)) is not None:
                self._dropped.append((SNAPSHOT_TABLE, [order_key(table)]))

    def _drop_all(self, h: DatabaseHandle) -> None:
        """Invariant 9: every stored state table (and trace order record) is deleted by the next save, and every
        loaded batch and Z-set is saved again."""
        for table in h.tables():
            if is_state_table(table):
                self._dropped.append((table, [k for k, _ in h.scan(table)]))
        self._dropped.append((SNAPSHOT_TABLE, [k for k, _ in h.scan(SNAPSHOT_TABLE, prefix=order_key(""))]))
        self._saved, self._saved_z, self._orphans = {}, {}, {}

    def _load_trace(self, h: DatabaseHandle, table: str, trace: Trace, where: str, mine: dict,
                    listing: dict[str, list[bytes]] | None) -> int:
        groups: dict[bytes, tuple[list[bytes], list[bytes]]] = {}
        listed = h.scan(table) if listing is None else ((k, None) for k in sorted(listing.get(table, ())))
        for k, v in listed:  # keys sort by shard, then number
            blobs, keys = groups.setdefault(k[SHARD_PREFIX_BYTES:], ([], []))
            blobs.append(v)
            keys.append(k)
        trace.clear()
        order = read_order(h, table, where)
        if order is None:
            if groups:
                raise CorruptionError(f"{where} {table}: {len(groups)} stored batches but no order record")
            numbers_i, counts, settled = [], [], 0
        else:
            numbers_i, counts, settled = order
        listed = [n.to_bytes(8, "big") for n in numbers_i]
        if not set(groups) <= set(listed) or len(set(listed)) != len(listed):
            raise CorruptionError(f"{where} {table}: the recorded batch order names {len(listed)} batches, the "
                                  f"table holds {len(groups)} that are not all among them")
        # a listed number without values moved to another worker entirely (dbsp_core.storage.shardmove)
        keep = [i for i, n in enumerate(listed) if n in groups]
        keepset = set(keep)
        pos, kept_settled = 0, 0
        for i, c in enumerate(counts):
            if i in keepset and pos < settled:
                kept_settled += min(c, settled - pos)
            pos += c
        numbers = [listed[i] for i in keep]
        counts = [counts[i] for i in keep]
        settled = kept_settled
        restored: list[tuple[Any, list[bytes], bool]] = []  # (batch, keys, settled)
        partial: set[int] = set()  # groups some of whose batches moved away entirely: saved again
        pos = 0
        for number, count in zip(numbers, counts):
            blobs, keys = groups[number]
            old = mine.get(number)
            is_settled = pos < settled
            pos += count
            if count == 1 and old is not None and sorted(old[1]) == sorted(keys):
                restored.append((old[0], keys, is_settled))
                continue
            values = [(v if v is not None else _must_get(h, table, k, where),
                       f"{where} {table} shard {shard_of_key(k)}") for k, v in zip(keys, blobs)]
            if count == 1 and any(v[:4] == BATCH_REF_MAGIC for v, _ in values):  # invariant 8
                b = self._referenced_batch(trace, values, keys)
                restored.append((b, keys, is_settled))
                continue
            runs: list[list[ZSet]] = []  # per shard, its rows of each of the number's batches
            for (v, w), k in zip(values, keys):
                if v[:4] == BATCH_RANGE_MAGIC:  # invariant 11: several shards' rows
                    self._ranged[k], pieces = range_pieces(v, shard_of_key(k), trace.schema, w)
                    runs.extend(r for _, r in pieces)
                elif count == 1:
                    runs.append([decode_batch(v, trace.schema, w, BATCH_MAGIC)])
                else:
                    runs.append(decode_runs(v, trace.schema, w, BATCH_GROUP_MAGIC))
            if any(len(r) != count for r in runs):
                raise CorruptionError(f"{where} {table}: a value of batch {number.hex()} does not hold {count} runs")
            members = [[r[i] for r in runs if r[i].num_rows] for i in range(count)]
            if count > 1 and any(not parts for parts in members):
                partial.add(id(keys))
            for parts in members:
                if not parts:
                    continue  # every shard of this member of a group moved to another worker
                z = parts[0] if len(parts) == 1 else ZSet.concat(parts)
                # shard slices of one key-hash-sorted batch, in shard order: the batch itself
                b = IndexedZSet._make(ZSet._make(z.data, z.weights), trace.key, z.hash(list(trace.key)))
                restored.append((b, keys, is_settled))  # a group's batches share its keys list (see _saved)
        rows = 0
        settled_done = False
        for b, keys, is_settled in restored:
            if not is_settled and not settled_done:
                trace.settle()  # the settled batches shrink strictly (trace invariant 2): no merges
                settled_done = True
            trace.insert(b)  # the rest stay pending, as they were saved
            rows += len(b)
        if not settled_done:
            trace.settle()
        self._files = {}
        live = {id(b) for b in sum(trace.parts(), [])}
        # values whose batches are not all live as saved (merged while settling, or a group that lost members):
        # their live batches are saved again and their keys deleted by the next save
        gone = {id(keys): keys for b, keys, _ in restored if id(b) not in live or id(keys) in partial}
        self._saved[table] = {id(b): (weakref.ref(b), keys) for b, keys, _ in restored
                              if id(b) in live and id(keys) not in gone}
        if gone:
            self._orphans[table] = list(gone.values())
        return rows
