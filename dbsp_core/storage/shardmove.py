"""Moving operator state between the databases of a group of workers, shard by shard, without decoding it: what a layout change does to stored state.

Invariants (enforced here):
  1. A shard moves as its values: every value under ``shard_key(shard, ·)`` of every state table of its old
     owner's database is put, byte for byte, into its new owner's database and deleted from the old one. State
     that is not keyed (a Z-set attribute) has values under every shard in every worker's database, and any
     placement of it is correct; it moves with the shards its worker owned, and a worker that leaves gives up
     all of its values, each to its shard's new owner. Nothing else is copied between databases, so the bytes
     written to other databases are exactly the moved values' bytes.
  2. Moved values get new numbers from the destination's counter (a number is never reused in a database);
     the values of one source batch that move to one destination share one new number, so they load back as
     one batch (their shards are disjoint key-hash ranges, concatenated in shard order). Moved trace batches
     join the end of the destination's order record as pending batches; the source's order record drops the
     numbers that kept no value. The content of every trace (the sum of its values over all databases) is
     unchanged.
  3. A change of the shard count re-keys values inside each database, never across databases: doubling S
     splits each value at the child boundary of the key hash (decoding it: the only place stored rows are
     read), halving S concatenates the values of the two children of a shard (moves run first at the finer
     count, so both children are in the same database by then). A value that names a row range of a batch file
     (``DRBF``, snapshot.py invariant 8) splits into two ranges of the same file at the child boundary (read from
     the file's key hashes); the children's ranges of one file concatenate into one range when they meet, and
     into rows otherwise.
  4. Everything happens in the caller's open handles (each writing version v+1 of its database): the change
     is durable only when the caller commits them all, so a crash before leaves version v everywhere.
  5. One destination at a time (a layout change whose tasks each build one new database, runtime/stage_store.py
     invariant 6): when the shard count stays, :func:`moving_to` reads from one source database what moves to
     one destination, and :func:`build_target` changes the destination's database with what every source sent;
     the destination ends byte for byte as :func:`relayout_group` leaves it (the same values under the same new
     numbers: moved values are put in the same order), and no other database is read for it.
  6. A range value (``DRBR``: the rows of several shards of one block of ``RANGE_SHARDS``, snapshot.py invariant 11)
     moves by its shards: reading what leaves a database scans from the start of each block a moving shard is
     in, and splits a range value found there that a move cuts into one value (range or one-shard) per run of
     consecutive shards going to the same worker or staying, under its number, and takes the leaving ones;
     where the source is changed, the range value is deleted and its staying part put under the same number,
     so the number's values still concatenate to the batch. A change of the shard count splits every range
     value into one-shard values first. So a move
     reads and rewrites at most one block's values beyond the moved ones at each end of a run of moving shards; a
     range value all of whose shards move to one worker moves as it is.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from dbsp_core.codec import (decode_batch, decode_json, decode_runs, decode_zset, encode_batch, encode_json,
                             encode_runs, encode_zset, frame, unframe, width_runs_head, zset_batch)
from dbsp_core.errors import CorruptionError, RecoveryError
from dbsp_core.layout import Layout, resample_owners, shard_runs
from dbsp_core.storage.database import SHARD_PREFIX_BYTES, Database, DatabaseHandle, shard_key
from dbsp_core.storage.formats import (BATCH_GROUP_MAGIC, BATCH_MAGIC, BATCH_RANGE_MAGIC, BATCH_REF_MAGIC,
                                       RANGE_SHARDS, SNAPSHOT_LAYOUT, SNAPSHOT_TABLE, WORKER_LAYOUT_MAGIC, ZSET_MAGIC,
                                       is_state_table, order_key)
from dbsp_core.storage.snapshot import TableSpec, encode_range_value, range_pieces, read_next, read_order, write_next, write_order
from dbsp_core.zset import ZSet

__all__ = ["relayout_group", "change_handles", "moving_to", "build_target", "check_source", "state_bytes",
           "write_worker_layout", "read_worker_layout"]


def _state_tables(h: DatabaseHandle) -> list[str]:
    return [t for t in h.tables() if isinstance(t, str) and is_state_table(t)]


def _entries(h: DatabaseHandle) -> Iterator[tuple[str, bytes, bytes]]:
    for t in _state_tables(h):
        for k, v in h.scan(t):
            yield t, k, v


def _check_known(tables: Iterable[str], specs: dict[str, TableSpec], where: str) -> None:
    """CorruptionError naming ``where`` when one of the state ``tables`` belongs to no operator of the circuit."""
    for t in tables:
        if t not in specs:
            raise CorruptionError(f"{where}: state table {t!r} belongs to no operator of this circuit")


def _batch_counts(h: DatabaseHandle, table: str, where: str) -> dict[int, int]:
    """The batch count of every number of a trace table, as its order record has it (empty without one)."""
    order = read_order(h, table, where)
    return dict(zip(order[0], order[1])) if order is not None else {}


def _shard_of(key: bytes) -> int:
    """The shard a state value's key names (its first SHARD_PREFIX_BYTES bytes, big-endian)."""
    return int.from_bytes(key[:SHARD_PREFIX_BYTES], "big")


def _split_range(table: str, spec: TableSpec, key: bytes, value: bytes, where: str,
                 side: Callable[[int], Any] | None = None) -> list[tuple[bytes, bytes]]:
    """The values ``(key, value)`` a range value splits into (invariant 6), under its number, in shard order: one
    per run of consecutive shards with rows on the same ``side`` (``side(shard)``; None: one per shard with rows);
    any other value as it is."""
    if value[:4] != BATCH_RANGE_MAGIC:
        return [(key, value)]
    if spec.kind != "trace":
        raise CorruptionError(f"{where}: a range value in {table}, which is not a trace")
    number = key[SHARD_PREFIX_BYTES:]
    _, pieces = range_pieces(value, _shard_of(key), spec.schema, f"{where} shard {_shard_of(key)}")
    out: list[tuple[bytes, bytes]] = []
    i = 0
    while i < len(pieces):
        j = i + 1
        while side is not None and j < len(pieces) and side(pieces[j][0]) == side(pieces[i][0]):
            j += 1
        first, last = pieces[i][0], pieces[j - 1][0]
        by_shard = dict(pieces[i:j])
        empty = [ZSet.empty(spec.schema)] * len(pieces[i][1])
        parts = [by_shard.get(s, empty) for s in range(first, last + 1)]
        out.append((shard_key(first, number), encode_range_value(parts, spec.schema)))
        i = j
    return out


def _remove(h: DatabaseHandle, removals: list[tuple[str, bytes, list[tuple[bytes, bytes]]]]) -> None:
    """Delete what leaves a database (:func:`_outgoing`): each removed key, and for a range value the one-shard
    values of its shards that stay, put back under its number (invariant 6)."""
    for t, k, stay in removals:
        h.delete(t, k)
        for sk, sv in stay:
            h.put(t, sk, sv)


def state_bytes(h: DatabaseHandle) -> int:
    """Bytes of every stored state value of one database version (the size a full copy would move)."""
    return sum(len(v) for _, _, v in _entries(h))


def write_worker_layout(h: DatabaseHandle, layout: Layout, worker: int) -> None:
    """Record in this version the layout the state belongs to (the whole layout: a live rescale passes through
    layouts recorded nowhere else), the worker, and the shard bits of its values."""
    # the bytes encode_json writes for {"epoch", "layout", "shard_bits", "worker", "workers"} (sorted keys), with
    # the layout's JSON encoded once per layout, not once per worker (W copies of an O(S) record: rescale cost)
    body = (f'{{"epoch":{int(layout.epoch)},"layout":{layout.to_json()},"shard_bits":{int(layout.shard_bits)},'
            f'"worker":{int(worker)},"workers":{int(layout.workers)}}}')
    h.put(SNAPSHOT_TABLE, SNAPSHOT_LAYOUT, frame(WORKER_LAYOUT_MAGIC, body.encode("utf-8")))


_HEADER = re.compile(rb'^\{"epoch":(\d+),"layout":\{.*\},"shard_bits":(\d+),"worker":(\d+),"workers":(\d+)\}$', re.S)


def read_worker_layout(h: DatabaseHandle, where: str, whole: bool = False) -> dict | None:
    """The record :func:`write_worker_layout` stored, or None (a database that never held state). Without
    ``whole``, only its ``epoch``, ``worker``, ``shard_bits`` and ``workers`` (the checksum is verified, the
    O(S) layout is not decoded: a load of W databases must not decode W layouts); with ``whole``, also
    ``layout``."""
    rec = h.get(SNAPSHOT_TABLE, SNAPSHOT_LAYOUT)
    if rec is None:
        return None
    if not whole:
        m = _HEADER.match(unframe(WORKER_LAYOUT_MAGIC, rec, f"{where} layout record"))
        if m is not None:
            return {k: int(v) for k, v in zip(("epoch", "shard_bits", "worker", "workers"), m.groups())}
    return decode_json(WORKER_LAYOUT_MAGIC, rec, f"{where} layout record")


def check_source(h: DatabaseHandle, old: Layout, worker: int, where: str, root: str) -> None:
    """A change moves state only from a database that holds worker ``worker``'s state of ``old`` (or none yet):
    else RecoveryError naming the database ``where`` (runtime/rescale.py invariant 5)."""
    rec = read_worker_layout(h, where)
    if rec is not None and (int(rec["epoch"]), int(rec["worker"])) != (old.epoch, worker):
        raise RecoveryError(
            f"{root}: moving state from layout epoch {old.epoch} (LAYOUT), but {where} holds the state of worker "
            f"{rec['worker']} of layout epoch {rec['epoch']}: the shards it moved away would be read from a database "
            f"that no longer holds them, and their groups would restart from empty. Nothing was changed. The "
            f"directory was written mid-way through a live rescale (a checkpoint taken during the move); restore it "
            f"from a copy taken before, or run `dbsp repair` to see what it can save")


def _halves_at(z: ZSet, key: tuple[str, ...], bit: int) -> tuple[ZSet, ZSet]:
    """Rows of ``z`` whose key-hash bit ``bit`` (0 = least significant) is 0, then those where it is 1."""
    if z.num_rows == 0:
        return z, z
    hashes = np.asarray(z.hash(list(key)), dtype=np.uint64)
    upper = ((hashes >> np.uint64(bit)) & np.uint64(1)).astype(bool)
    lo_idx, hi_idx = np.flatnonzero(~upper), np.flatnonzero(upper)
    return _take(z, lo_idx), _take(z, hi_idx)


def _take(z: ZSet, idx: np.ndarray) -> ZSet:
    import pyarrow as pa

    if len(idx) == z.num_rows:
        return z
    return ZSet._make(z.data.take(pa.array(idx, pa.int64())), np.asarray(z.weights[idx], dtype=np.int64))


class _Group:
    """The open handles of one group's databases and what each holds, read once."""

    def __init__(self, handles: dict[int, DatabaseHandle], specs: dict[str, TableSpec], where: str,
                 batch_dir: str | None = None) -> None:
        self.h = handles
        self.specs = specs
        self.where = where
        self.refs = _Refs(batch_dir)
        # worker -> table -> {key: value}, and the batch count of every number of every trace table as read
        self.values: dict[int, dict[str, dict[bytes, bytes]]] = {}
        self.counts: dict[int, dict[str, dict[int, int]]] = {}
        for w, h in handles.items():
            tables: dict[str, dict[bytes, bytes]] = {}
            ranges = []
            for t, k, v in _entries(h):
                if v[:4] == BATCH_RANGE_MAGIC:
                    ranges.append((t, k, v))
                else:
                    tables.setdefault(t, {})[k] = v
            _check_known(tables.keys() | {t for t, _, _ in ranges}, specs, f"{where} worker {w}")
            for t, k, v in ranges:  # invariant 6: a change of the shard count works on one-shard values
                h.delete(t, k)
                for sk, sv in _split_range(t, specs[t], k, v, f"{where} worker {w} {t}"):
                    h.put(t, sk, sv)
                    tables.setdefault(t, {})[sk] = sv
            self.values[w] = tables
            self.counts[w] = {t: _batch_counts(h, t, f"{where} worker {w}") for t in tables
                              if specs[t].kind == "trace"}

    def total_bytes(self) -> int:
        return sum(len(v) for tables in self.values.values() for kv in tables.values() for v in kv.values())


def _rekey(g: _Group, w: int, bits: int, to_bits: int) -> None:
    """Re-key every value of worker ``w`` from ``bits`` to ``to_bits`` shard bits (invariant 3)."""
    h, tables = g.h[w], g.values[w]
    for t, kv in tables.items():
        spec = g.specs[t]
        new: dict[bytes, list[bytes]] = {}
        for k, v in kv.items():
            shard, number = _shard_of(k), k[SHARD_PREFIX_BYTES:]
            where = f"{g.where} worker {w} {t} shard {shard}"
            if to_bits > bits:
                vals = [(shard, v)]
                for b in range(bits, to_bits):  # one level at a time: bit (63 - b) decides the child
                    nxt = []
                    for s, val in vals:
                        lo, hi = _split_with_bit(t, spec, val, 63 - b, where, g.refs)
                        if lo is not None:
                            nxt.append((2 * s, lo))
                        if hi is not None:
                            nxt.append((2 * s + 1, hi))
                    vals = nxt
                for s, val in vals:
                    new.setdefault(shard_key(s, number), []).append(val)
            else:
                new.setdefault(shard_key(shard >> (bits - to_bits), number), []).append(v)
            h.delete(t, k)
        kv.clear()
        for k, vals in new.items():
            val = vals[0] if len(vals) == 1 else _concat_values(t, spec, vals, f"{g.where} worker {w} {t}", g.refs)
            h.put(t, k, val)
            kv[k] = val


class _Refs:
    """The batch files values name (invariant 3): read from ``batch_dir``, each opened once."""

    def __init__(self, batch_dir: str | None) -> None:
        self.batch_dir = batch_dir
        self.files: dict[str, Any] = {}

    def get(self, value: bytes, where: str) -> tuple[dict, Any]:
        """The reference of a ``DRBF`` value and its open batch file."""
        from dbsp_core.trace.groupedfile import open_rows

        d = decode_json(BATCH_REF_MAGIC, value, where)
        name = os.path.basename(str(d["file"]))
        f = self.files.get(name)
        if f is None:
            if self.batch_dir is None:
                raise CorruptionError(f"{where}: names batch file {name!r}, but no batch file directory is known")
            f = self.files[name] = open_rows(os.path.join(self.batch_dir, name))
        if not 0 <= int(d["lo"]) <= int(d["hi"]) <= f.rows:
            raise CorruptionError(f"{where}: rows {d['lo']}..{d['hi']} are not in batch file {name!r}")
        return {"file": name, "lo": int(d["lo"]), "hi": int(d["hi"])}, f

    def rows(self, value: bytes, where: str) -> ZSet:
        d, f = self.get(value, where)
        return f.batch.slice(d["lo"], d["hi"]).zset


def _ref(name: str, lo: int, hi: int) -> bytes | None:
    return None if lo == hi else encode_json(BATCH_REF_MAGIC, {"file": name, "lo": lo, "hi": hi})


def _split_with_bit(table: str, spec: TableSpec, value: bytes, bit: int, where: str, refs: _Refs
                    ) -> tuple[bytes | None, bytes | None]:
    magic = value[:4]
    if magic == BATCH_REF_MAGIC and spec.kind == "trace":  # rows ascend by key hash: bit 0 first, then 1
        d, f = refs.get(value, where)
        kh = f.batch.key_hash[d["lo"]:d["hi"]]
        mid = d["lo"] + int(np.count_nonzero(((kh >> np.uint64(bit)) & np.uint64(1)) == 0))
        return _ref(d["file"], d["lo"], mid), _ref(d["file"], mid, d["hi"])
    if spec.kind == "zset":
        lo, hi = _halves_at(decode_zset(value, spec.schema, where, ZSET_MAGIC), spec.key, bit)
        return (None if lo.num_rows == 0 else encode_zset(lo, ZSET_MAGIC),
                None if hi.num_rows == 0 else encode_zset(hi, ZSET_MAGIC))
    if magic == BATCH_MAGIC:
        lo, hi = _halves_at(decode_batch(value, spec.schema, where, BATCH_MAGIC), spec.key, bit)
        return (None if lo.num_rows == 0 else encode_batch(zset_batch(lo), BATCH_MAGIC),
                None if hi.num_rows == 0 else encode_batch(zset_batch(hi), BATCH_MAGIC))
    if magic == BATCH_GROUP_MAGIC:
        runs = decode_runs(value, spec.schema, where, BATCH_GROUP_MAGIC)
        sides = list(zip(*[_halves_at(r, spec.key, bit) for r in runs]))
        return _encode_runs(sides[0], spec), _encode_runs(sides[1], spec)
    raise CorruptionError(f"{where}: unknown value kind {magic!r} in {table}")


def _encode_runs(runs: tuple[ZSet, ...], spec: TableSpec) -> bytes | None:
    parts = [r for r in runs if r.num_rows]
    if not parts:
        return None
    whole = ZSet.concat(parts) if len(parts) > 1 else parts[0]
    return encode_runs(zset_batch(whole), [r.num_rows for r in runs], BATCH_GROUP_MAGIC)


def _concat_values(table: str, spec: TableSpec, vals: list[bytes], where: str, refs: _Refs) -> bytes:
    """One value holding the rows of ``vals`` (children of a merged shard, in child order)."""
    if spec.kind == "zset":
        return encode_zset(ZSet.concat([decode_zset(v, spec.schema, where, ZSET_MAGIC) for v in vals]), ZSET_MAGIC)
    kinds = {v[:4] for v in vals}
    if BATCH_REF_MAGIC in kinds and kinds <= {BATCH_REF_MAGIC, BATCH_MAGIC}:
        if kinds == {BATCH_REF_MAGIC}:
            ds = [refs.get(v, where)[0] for v in vals]
            if len({d["file"] for d in ds}) == 1 and all(a["hi"] == b["lo"] for a, b in zip(ds, ds[1:])):
                out = _ref(ds[0]["file"], ds[0]["lo"], ds[-1]["hi"])
                assert out is not None
                return out
        parts = [refs.rows(v, where) if v[:4] == BATCH_REF_MAGIC else decode_batch(v, spec.schema, where, BATCH_MAGIC)
                 for v in vals]
        return encode_batch(zset_batch(ZSet.concat(parts)), BATCH_MAGIC)
    if kinds == {BATCH_MAGIC}:
        parts = [decode_batch(v, spec.schema, where, BATCH_MAGIC) for v in vals]
        return encode_batch(zset_batch(ZSet.concat(parts)), BATCH_MAGIC)
    if kinds == {BATCH_GROUP_MAGIC}:
        runs = [decode_runs(v, spec.schema, where, BATCH_GROUP_MAGIC) for v in vals]
        if len({len(r) for r in runs}) != 1:
            raise CorruptionError(f"{where}: the children of a merged shard hold groups of different sizes")
        merged = tuple(_cat([r[i] for r in runs], spec) for i in range(len(runs[0])))
        out = _encode_runs(merged, spec)
        assert out is not None
        return out
    raise CorruptionError(f"{where}: the children of a merged shard hold values of different kinds {kinds}")


def _cat(parts: list[ZSet], spec: TableSpec) -> ZSet:
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return ZSet.empty(spec.schema)
    return ZSet.concat(parts) if len(parts) > 1 else parts[0]


def _outgoing(h: DatabaseHandle, w: int, old: Layout, new: Layout, specs: dict[str, TableSpec], where: str,
              to: int | None = None) -> tuple[list[tuple[str, bytes, bytes]], dict[str, dict[int, int]], list, int]:
    """The values of worker ``w``'s database (``h``, at layout ``old``) that leave it for layout ``new`` when the
    shard count stays (all of them for a leaving worker; only ``to``'s, when given), as ``(table, key, value)``,
    the batch counts of each trace table they come from (:func:`_batch_counts`), and what :func:`_remove` deletes
    from ``h`` for them. Reads only the key ranges of the shards ``w`` gives up (invariant 1), from the start of
    their blocks (a range value there is split, invariant 6). Last, the stored bytes that leave: a value's length,
    and for a range value that is split its share of it by the bytes of its pieces (a piece has an Arrow header of
    its own, so the pieces' bytes may exceed the value's: the report's ``moved_bytes`` stays a part of the state's
    ``total_bytes``, rescale.py invariant 3)."""
    src_owner, dst_owner = old.shard_map.part_of_shard, new.shard_map.part_of_shard
    tables = _state_tables(h)
    _check_known(tables, specs, f"{where} worker {w}")
    if w >= new.workers:
        ranges: list[tuple[bytes | None, bytes | None]] = [(None, None)]
    else:
        away = np.flatnonzero((src_owner == w) & (dst_owner != w if to is None else dst_owner == to))
        ranges = [(shard_key(a - a % RANGE_SHARDS, b""), shard_key(b, b"") if b < len(src_owner) else None)
                  for a, b in shard_runs(away)]

    def leaves(k: bytes) -> bool:
        return int(dst_owner[_shard_of(k)]) != w and (to is None or int(dst_owner[_shard_of(k)]) == to)

    out: list[tuple[str, bytes, bytes]] = []
    counts: dict[str, dict[int, int]] = {}
    removals: list[tuple[str, bytes, list[tuple[bytes, bytes]]]] = []
    stored = 0
    for t in tables:
        got = []
        seen: set[bytes] = set()
        for a, b in ranges:
            for k, v in h.scan(t, a, b):
                if k in seen:  # two runs of moving shards in one block
                    continue
                seen.add(k)
                if v[:4] != BATCH_RANGE_MAGIC:
                    if leaves(k):
                        got.append((k, v))
                        removals.append((t, k, []))
                        stored += len(v)
                    continue
                width, _ = width_runs_head(v, f"{where} worker {w} {t}")
                a = _shard_of(k)
                dst = np.unique(dst_owner[a:a + width])
                if len(dst) == 1 and leaves(k):  # its whole block leaves for one worker: moved as it is
                    got.append((k, v))
                    removals.append((t, k, []))
                    stored += len(v)
                    continue
                parts = _split_range(t, specs[t], k, v, f"{where} worker {w} {t}",
                                     lambda s: int(dst_owner[s]) if leaves(shard_key(s, b"")) else -1)
                gone = [(pk, pv) for pk, pv in parts if leaves(pk)]
                if gone:
                    stored += len(v) * sum(len(pv) for _pk, pv in gone) // max(1, sum(len(pv) for _pk, pv in parts))
                    got.extend(gone)
                    removals.append((t, k, [(pk, pv) for pk, pv in parts if not leaves(pk)]))
        if not got:
            continue
        if specs[t].kind == "trace":
            counts[t] = _batch_counts(h, t, f"{where} worker {w}")
        out.extend((t, k, v) for k, v in got)
    return out, counts, removals, stored


def _move_same_bits(handles: dict[int, DatabaseHandle], old: Layout, new: Layout, specs: dict[str, TableSpec],
                    where: str, measure_total: bool) -> dict:
    """:func:`relayout_group` when the shard count stays: reads only the values that move (key ranges of the
    shards each worker gives up; everything of a leaving worker), so its cost follows the moved bytes."""
    dst_owner = new.shard_map.part_of_shard
    moving = np.flatnonzero(old.shard_map.part_of_shard != dst_owner)
    total = sum(state_bytes(h) for h in handles.values()) if measure_total else None
    incoming: dict[int, list[tuple[int, str, bytes, bytes]]] = {w: [] for w in handles}
    counts: dict[tuple[int, str], dict[int, int]] = {}
    moved_bytes = 0
    for w, h in handles.items():
        out, cnt, removals, stored = _outgoing(h, w, old, new, specs, where)
        counts.update({(w, t): c for t, c in cnt.items()})
        for t, k, v in out:
            incoming[int(dst_owner[_shard_of(k)])].append((w, t, k, v))
        moved_bytes += stored
        _remove(h, removals)  # the source's order record keeps the number; a load skips numbers with no value
    _import(handles, incoming, specs, counts, where)
    for w, h in handles.items():
        write_worker_layout(h, new, w)
    return {"moved_shards": int(len(moving)), "moved_bytes": int(moved_bytes), "total_bytes": total,
            "rekeyed_values": 0}


def moving_to(h: DatabaseHandle, source: int, target: int, old: Layout, new: Layout, specs: dict[str, TableSpec],
              where: str) -> tuple[list[tuple[int, str, bytes, bytes]], dict[tuple[int, str], dict[int, int]]]:
    """One worker's database at a time, for a change that keeps the shard count (invariant 5): the values of
    ``source``'s database (``h``, read only) that move to worker ``target``, as ``(source, table, key, value)``, and
    the batch counts of their trace tables by ``(source, table)``; :func:`build_target` takes them."""
    out, cnt, _, _ = _outgoing(h, source, old, new, specs, where, to=target)
    return [(source, t, k, v) for t, k, v in out], {(source, t): c for t, c in cnt.items()}


def build_target(h: DatabaseHandle, target: int, old: Layout, new: Layout, specs: dict[str, TableSpec],
                 incoming: list[tuple[int, str, bytes, bytes]], counts: dict[tuple[int, str], dict[int, int]],
                 where: str) -> int:
    """Invariant 5: make ``h`` (a write handle on ``target``'s database at ``old``: its own one, or an empty one for
    a joining worker) hold ``target``'s state of ``new``: the values it gives up are deleted and ``incoming`` (what
    :func:`moving_to` read from every other source) is put under new numbers, exactly as :func:`relayout_group`
    changes ``target``'s database. Returns the bytes moved in."""
    if target < old.workers:
        _remove(h, _outgoing(h, target, old, new, specs, where)[2])
    _import({target: h}, {target: incoming}, specs, counts, where)
    write_worker_layout(h, new, target)
    return sum(len(v) for *_, v in incoming)


def _import(handles: dict[int, DatabaseHandle], incoming: dict[int, list[tuple[int, str, bytes, bytes]]],
            specs: dict[str, TableSpec], counts: dict[tuple[int, str], dict[int, int]], where: str,
            written: dict[int, dict[str, dict[bytes, bytes]]] | None = None) -> None:
    """Put moved values into their destinations under new numbers; moved trace batches join the end of the
    destination's order record as pending batches (invariant 2). ``incoming``: per destination, the moved
    ``(source, table, key, value)``; ``counts``: per ``(source, table)`` of a trace, the batch count of each
    number as the source's order record had it (1 when it has none); ``written``, when given: every value put
    is also recorded in ``written[destination][table][new key]``."""
    for w, items in incoming.items():
        if not items:
            continue
        h = handles[w]
        nxt = read_next(h)
        renumber: dict[tuple[int, str, bytes], int] = {}
        added: dict[str, list[int]] = {}
        for src, t, k, v in sorted(items, key=lambda x: (x[1], x[0], x[2][SHARD_PREFIX_BYTES:], x[2])):
            num = k[SHARD_PREFIX_BYTES:]
            ident = (src, t, num)
            if ident not in renumber:
                renumber[ident] = nxt
                nxt += 1
                added.setdefault(t, []).append(renumber[ident])
            key = k[:SHARD_PREFIX_BYTES] + renumber[ident].to_bytes(8, "big")
            h.put(t, key, v)
            if written is not None:
                written[w].setdefault(t, {})[key] = v
        for t, numbers in added.items():
            if specs[t].kind != "trace":
                continue
            order = read_order(h, t, f"{where} worker {w}") or ([], [], 0)
            back = {n: (src, num) for (src, tt, num), n in renumber.items() if tt == t}
            cnt = [counts.get((back[n][0], t), {}).get(int.from_bytes(back[n][1], "big"), 1) for n in numbers]
            write_order(h, t, order[0] + numbers, order[1] + cnt, order[2])
        write_next(h, nxt)


@contextmanager
def change_handles(paths: dict[int, str], version: int, fresh: Iterable[int] = (), vfs: str = "posix"
                   ) -> Iterator[dict[int, DatabaseHandle]]:
    """Write handles on ``version`` of the databases ``paths`` (worker -> path; a worker in ``fresh`` gets a new,
    empty one there, at ``version``), for :func:`relayout_group`; on exit every handle is closed (what was not
    committed is discarded) and every database too."""
    fresh = set(fresh)
    dbs: dict[int, Database] = {}
    handles: dict[int, DatabaseHandle] = {}
    try:
        for w, path in paths.items():
            if w in fresh:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                dbs[w] = Database.create(path, version, vfs=vfs)
            else:
                dbs[w] = Database(path, vfs=vfs)
            handles[w] = dbs[w].open(version)
        yield handles
    finally:
        for h in handles.values():
            if not h.closed:
                h.close()
        for db in dbs.values():
            db.close()


def relayout_group(handles: dict[int, DatabaseHandle], old: Layout, new: Layout, specs: dict[str, TableSpec],
                   where: str, measure_total: bool = True, batch_dir: str | None = None) -> dict:
    """Change the state of one group of databases from layout ``old`` to ``new`` (invariants 1-4).

    ``handles`` holds an open write handle for every worker of either layout (a worker only in ``new`` has an
    empty database; one only in ``old`` ends empty). Returns ``{"moved_shards", "moved_bytes", "total_bytes",
    "rekeyed_values"}`` (``total_bytes`` None unless ``measure_total``, which reads every value); the caller
    commits every handle.
    """
    missing = sorted(set(range(max(old.workers, new.workers))) - set(handles))
    if missing:
        raise ValueError(f"relayout_group: no handle for workers {missing}")
    if old.shard_bits == new.shard_bits:
        return _move_same_bits(handles, old, new, specs, where, measure_total)
    g = _Group(handles, specs, where, batch_dir)  # batch_dir: where named batch files are (invariant 3)
    total = g.total_bytes()
    fine = max(old.shard_bits, new.shard_bits)
    rekeyed = 0
    if old.shard_bits < fine:
        for w in handles:
            rekeyed += sum(len(kv) for kv in g.values[w].values())
            _rekey(g, w, old.shard_bits, fine)
    src_owner = resample_owners(old.shard_map.part_of_shard, old.shard_bits, fine)
    dst_owner = resample_owners(new.shard_map.part_of_shard, new.shard_bits, fine)
    moving = np.flatnonzero(src_owner != dst_owner)
    moved_bytes = 0
    # exports first (nothing is deleted until every move is read), per destination: (src, table, key, value)
    incoming: dict[int, list[tuple[int, str, bytes, bytes]]] = {w: [] for w in handles}
    outgoing: dict[int, dict[str, list[bytes]]] = {w: {} for w in handles}
    for w, tables in g.values.items():
        leaving = w >= new.workers
        for t, kv in tables.items():
            for k, v in kv.items():
                s = _shard_of(k)
                dst = int(dst_owner[s])
                # invariant 1: a shard's values leave its old owner; a leaving worker gives up every value it holds
                # (state that is not keyed, e.g. an integral, sits in every worker's database under every shard)
                if dst != w and (leaving or src_owner[s] == w):
                    incoming[dst].append((w, t, k, v))
                    outgoing[w].setdefault(t, []).append(k)
                    moved_bytes += len(v)
    for w, tables in outgoing.items():  # the sources: drop the values and the numbers left without one
        h = handles[w]
        for t, keys in tables.items():
            kv = g.values[w][t]
            for k in keys:
                h.delete(t, k)
                del kv[k]
            if g.specs[t].kind == "trace":
                _drop_numbers(h, t, {k[SHARD_PREFIX_BYTES:] for k in kv}, f"{where} worker {w}")
    # the destinations: new numbers, pending batches at the end (the counts as every source's order record had them)
    counts = {(src, t): c for src, tables in g.counts.items() for t, c in tables.items()}
    _import(handles, incoming, g.specs, counts, where, written=g.values)
    if new.shard_bits < fine:
        for w in handles:
            rekeyed += sum(len(kv) for kv in g.values[w].values())
            _rekey(g, w, fine, new.shard_bits)
    for w, h in handles.items():
        write_worker_layout(h, new, w)
    return {"moved_shards": int(len(moving)), "moved_bytes": int(moved_bytes), "total_bytes": int(total),
            "rekeyed_values": int(rekeyed)}


def _drop_numbers(h: DatabaseHandle, table: str, kept: set[bytes], where: str) -> None:
    """Remove from a trace table's order record every number that holds no value any more (invariant 2)."""
    order = read_order(h, table, where)
    if order is None:
        return
    numbers, counts, settled = order
    keep_n, keep_c, pos, new_settled = [], [], 0, 0
    for n, c in zip(numbers, counts):
        if n.to_bytes(8, "big") in kept:
            keep_n.append(n)
            keep_c.append(c)
            if pos < settled:
                new_settled += min(c, settled - pos)
        pos += c
    if keep_n:
        write_order(h, table, keep_n, keep_c, new_settled)
    else:
        h.delete(SNAPSHOT_TABLE, order_key(table))
