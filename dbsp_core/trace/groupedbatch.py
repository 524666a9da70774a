"""A spilled batch read from a format-2 batch file (dbsp_core/trace/groupedfile.py): its rows stay in the file, a read
of some keys gathers theirs by pread, and a read of every row brings a copy of them into memory until the next
``BatchStore.enforce``.

Invariants (dbsp_core/trace/spill.py invariant 18 cites them):
  B1. A batch spilled to a format-2 file keeps its identity (levels, placement numbers, key indexes and checkpoint
      records hold the same object) and its content: its class becomes :class:`GroupedBatch`, a subclass of
      IndexedZSet with the same slots, whose rows, weights, key hashes and row hashes (``_z``, ``_kh``, ``_rh``) are
      read from the file when first asked for (:func:`rows_of`: the whole file, one contiguous copy, every slot
      checked: groupedfile.py invariant G2) and kept in the slots until :func:`release_rows` empties them again.
      Its length, schema and key never read the file.
  B2. Reads of some keys never ask for those slots: ``Trace.walked`` (a join's walks), ``lookup``, ``match_weights``
      and ``key_sums`` (dbsp_core/trace/levels.py ``_gathered``) read instead :func:`gather` of the keys they seek,
      the rows of those key hashes (``GroupedFile.lookup``: the Bloom filter, the group index, one pread a run of
      adjacent groups, decoded in C), an in-memory batch that holds every row of those keys, so any walk over it
      finds what a walk over the whole batch would.
  B3. The store (spill.py) counts a copy made by B1 as bytes in memory (``copied_bytes``) and empties it at every
      enforce, between steps: a whole read (a key index build, a checkpoint's rows, a shard cut) costs memory while
      it runs and no longer. A merge does not make one: it streams a grouped input (groupedmerge.py, :func:`file_of`).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from dbsp_core.zset import IndexedZSet, _column_positions

if TYPE_CHECKING:
    from dbsp_core.trace.groupedfile import GroupedFile

__all__ = ["GroupedBatch", "become_grouped", "is_grouped", "rows_of", "release_rows", "gather", "file_of",
           "spilled_bytes", "copied_bytes", "reopened", "data_schema", "row_bytes"]

_Z, _KH, _RH = IndexedZSet._z, IndexedZSet._kh, IndexedZSet._rh  # the base class's slot descriptors


class _Source:
    """What a grouped batch reads from: its open file, its rows, its schema, the bytes its rows held in memory
    before the spill (a merge's size estimate, spill.py ``batch_bytes``), and whether its slots hold a copy."""

    __slots__ = ("file", "rows", "schema", "nbytes", "copied", "lock")

    def __init__(self, f: "GroupedFile", rows: int, schema: pa.Schema, nbytes: int) -> None:
        self.file, self.rows, self.schema, self.nbytes = f, rows, schema, nbytes
        self.copied = 0  # bytes of the copy the slots hold (0: none)
        self.lock = threading.Lock()


COPIES = {"reads": 0, "bytes": 0}  # whole reads of grouped batches (invariant B1) and their bytes, this process
_SOURCES: dict[int, _Source] = {}  # id(batch) -> its source, while the batch lives (a finalizer removes it)


def _source(b: IndexedZSet) -> _Source:
    s = _SOURCES.get(id(b))
    if s is None:
        raise RuntimeError("a grouped batch without its file (spill.py invariant 18): a bug")
    return s


def source_file(b: IndexedZSet) -> Any:
    """The open format-2 file (groupedfile.GroupedFile) grouped batch ``b`` reads its rows from."""
    return _source(b).file


def _slot(desc: Any) -> property:
    """A property over one of the base class's data slots: the slot's value once :func:`rows_of` filled it."""

    def get(self: IndexedZSet) -> Any:
        try:
            return desc.__get__(self, IndexedZSet)
        except AttributeError:
            rows_of(self)
            return desc.__get__(self, IndexedZSet)

    def put(self: IndexedZSet, value: Any) -> None:
        desc.__set__(self, value)

    return property(get, put)


class GroupedBatch(IndexedZSet):
    """An IndexedZSet whose rows live in a format-2 batch file (invariant B1). Made only by :func:`become_grouped`."""

    __slots__ = ()
    _z = _slot(_Z)
    _kh = _slot(_KH)
    _rh = _slot(_RH)

    @property
    def schema(self) -> pa.Schema:
        return _source(self).schema

    def __len__(self) -> int:
        return _source(self).rows

    def size_bytes(self) -> int:
        """The bytes its rows held when it was spilled (:meth:`IndexedZSet.size_bytes` without reading the file)."""
        return spilled_bytes(self)

    def shard_bounds(self, shard_bits: int, near: bool = False) -> np.ndarray:
        """:meth:`IndexedZSet.shard_bounds` from the file's group index, without a copy of the rows (invariant B1):
        ``near``, each bound the first row of the group it falls before (within a group's rows of the exact one);
        else exact, the key hashes of the groups the bounds fall in read (one group a bound)."""
        src = _source(self)
        if src.copied or not 0 < shard_bits <= 30:
            return super().shard_bounds(shard_bits, near)
        f, n = src.file, src.rows
        starts = np.arange(1 << shard_bits, dtype=np.uint64) << np.uint64(64 - shard_bits)
        first_row = f.row_starts()
        g = np.searchsorted(f.first_hash, starts, side="left")  # the first group at or above each start
        out = np.where(g < f.groups, first_row[np.minimum(g, max(0, f.groups - 1))], n).astype(np.int64)
        if not near and f.groups:
            inside = np.flatnonzero(g > 0)  # the bound may lie in group g - 1
            groups = np.unique(g[inside] - 1).astype(np.int64)
            kh = _group_hashes(f, groups)
            ends = np.cumsum(f.g_rows[groups])
            for i in inside.tolist():
                k = int(np.searchsorted(groups, g[i] - 1))
                lo = int(ends[k] - f.g_rows[groups[k]])
                seg = kh[lo:int(ends[k])]
                out[i] = first_row[groups[k]] + int(np.searchsorted(seg, starts[i], side="left"))
        return np.append(out, np.int64(n))


def is_grouped(b: Any) -> bool:
    return type(b) is GroupedBatch


def file_of(b: IndexedZSet) -> "GroupedFile | None":
    """The format-2 file ``b`` reads from, or None when it is not a grouped batch."""
    s = _SOURCES.get(id(b)) if type(b) is GroupedBatch else None
    return None if s is None else s.file


def row_bytes(b: IndexedZSet) -> int:
    """Bytes of ``b``'s rows, weights and key hashes (a size estimate: metrics, profiles): its buffers', or for a
    grouped batch those it held when it was spilled (its rows not read: invariant B1). ``b.size_bytes()``."""
    return b.size_bytes()


def spilled_bytes(b: IndexedZSet) -> int:
    """The bytes ``b``'s rows held in memory when it was spilled (what a merge of it is sized by)."""
    return _source(b).nbytes


def _empty(b: IndexedZSet) -> None:
    """Drop ``b``'s rows, weights, hashes and the views made of them from its slots (the base class's descriptors)."""
    b._cv = None
    b._fx = None
    for desc in (_Z, _KH, _RH):
        try:
            desc.__delete__(b)
        except AttributeError:
            pass


def become_grouped(b: IndexedZSet, f: "GroupedFile", nbytes: int) -> None:
    """Switch ``b`` in place to a grouped batch read from ``f`` (invariant B1): its buffers leave it (the memory goes
    with the last reference to them), its identity, key and schema stay."""
    src = _Source(f, len(b), b.schema, nbytes)
    _SOURCES[id(b)] = src
    weakref.finalize(b, _SOURCES.pop, id(b), None)
    b.__class__ = GroupedBatch
    _empty(b)


def _group_hashes(f: "GroupedFile", groups: np.ndarray) -> np.ndarray:
    """The key hashes of the rows of ``groups`` (ascending group numbers) of ``f``, group after group."""
    from dbsp_core.trace.batchfile import _one_chunk

    rb = f._gather(groups, None)
    t = pa.Table.from_batches([rb]) if rb is not None else f._table(groups)
    return np.asarray(_one_chunk(t.column(f.ndata + 1)).to_numpy(zero_copy_only=False), dtype=np.uint64)


def data_schema(f: "GroupedFile") -> pa.Schema:
    """The schema of the rows of format-2 file ``f`` (its Arrow schema less weights, key hashes, row hashes)."""
    assert f.schema is not None
    return pa.schema(list(f.schema)[:f.ndata])


def reopened(f: "GroupedFile", key: tuple, nbytes: int = 0) -> IndexedZSet:
    """A grouped batch of every row of format-2 file ``f`` on key ``key``, its rows not read (a checkpoint's batch
    restored: invariant B1)."""
    schema = data_schema(f)
    b = object.__new__(GroupedBatch)
    b._key = tuple(key)
    b._keypos = _column_positions(schema, key, "index")
    b._cv = None
    b._fx = None
    src = _Source(f, f.rows, schema, nbytes or f.size)
    _SOURCES[id(b)] = src
    weakref.finalize(b, _SOURCES.pop, id(b), None)
    return b


def rows_of(b: IndexedZSet) -> int:
    """Fill grouped batch ``b``'s slots with a copy of its rows read from its file (invariant B1); returns the bytes
    of the copy (0 when the slots held one already)."""
    src = _source(b)
    with src.lock:
        try:
            _KH.__get__(b, IndexedZSet)
            return 0
        except AttributeError:
            pass
        whole = src.file.read_all()
        if len(whole) != src.rows:
            from dbsp_core.trace.groupedfile import _bad

            raise _bad(src.file.path, f"{len(whole)} rows read, {src.rows} spilled")
        z, kh, rh = whole._z, whole._kh, whole._rh
        n = int(z.data.nbytes) + int(z.weights.nbytes) + int(kh.nbytes) + (
            int(rh.nbytes) if rh is not None and rh is not kh else 0)
        _Z.__set__(b, z)
        _RH.__set__(b, rh)
        _KH.__set__(b, kh)  # (last: its presence says the copy is whole)
        src.copied = n
        COPIES["reads"] += 1
        COPIES["bytes"] += n
        return n


def release_rows(b: IndexedZSet) -> int:
    """Empty grouped batch ``b``'s slots of the copy :func:`rows_of` made (invariant B3); returns its bytes."""
    src = _SOURCES.get(id(b))
    if src is None or not src.copied:
        return 0
    with src.lock:
        n, src.copied = src.copied, 0
        _empty(b)
        return n


def copied_bytes(b: IndexedZSet) -> int:
    src = _SOURCES.get(id(b))
    return 0 if src is None else src.copied


def gather(b: IndexedZSet, hashes: Any, advise: bool = False) -> IndexedZSet | None:
    """The rows of grouped batch ``b`` whose key hash is in ``hashes`` (uint64, any order; invariant B2): an
    in-memory IndexedZSet in index order, None when there are none. ``advise``: its file is cold (its groups' pages
    asked for before the first read)."""
    src = _source(b)
    got = src.file.lookup(hashes, advise)
    if not len(got):
        return None
    got._keypos = b._keypos
    got._key = b._key
    return got
