"""A Trace is the integrated, indexed state of a stateful operator: a spine of consolidated IndexedZSets sorted by key hash, merged in amortized fashion.

Invariants (enforced here):
  1. Every batch is a consolidated IndexedZSet on the trace's key, rows ascending by key hash; the trace's
     content is the sum of its batches (the same row may sit in several batches until they merge).
  2. Merging is lazy: inserted batches wait in ``pending`` (at most MAX_PENDING = 1024 of them) and are settled
     into the spine before any read. Settled batch sizes strictly shrink from oldest to newest: a newer
     batch holding at least as many rows as its older neighbour is merged into it (a binary counter), so
     the spine of n rows has at most log2(n) + 1 batches and each row is merged at most log2(n) times.
     A trace that is never read (e.g. a join side whose other input never changes) never pays for merges.
  3. A lookup touches only the rows whose key hash is asked for (a galloping C search per batch), or whole batches
     smaller than a few rows per asked key, so per-step cost grows with the change, not with the state.
  4. State is grouped by shard: a shard (top ``shard_bits`` bits of the key hash) is a contiguous row range
     of every batch, so :meth:`Trace.shard` extracts one shard's state without scanning the others.
  5. :meth:`Trace.drop_below` forgets the rows whose time key columns are below a bound (state that no later
     change can reach, dbsp_core/time/cleanup.py): every batch keeps its other rows in order (still
     consolidated and key-hash sorted; emptied batches leave), and the spine is re-merged into the shape of
     invariant 2. It scans the trace only once the rows inserted since the last scan reach the rows kept by
     it (and at least ``PRUNE_MIN``), so its cost is O(1) amortized per inserted row and the trace holds at
     most about twice the rows it must keep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from dbsp_core.zset import IndexedZSet


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


def unique_sorted(hashes: np.ndarray) -> np.ndarray:
    """Distinct values of an ascending uint64 array (linear time)."""
    if len(hashes) < 2:
        return hashes
    keep = np.empty(len(hashes), dtype=bool)
    keep[0] = True
    np.not_equal(hashes[1:], hashes[:-1], out=keep[1:])
    return hashes[keep]


class Trace:
    """A spine of consolidated, key-hash-sorted batches: the integral of an indexed stream.

    Parameters
    ----------
    schema : pa.Schema
        Data columns of the indexed Z-sets.
    key : tuple of str
        Index key columns.

    Examples
    --------
    >>> import pyarrow as pa
    >>> from dbsp_core import ZSet
    >>> t = Trace(pa.schema([("k", pa.int64()), ("v", pa.int64())]), ("k",))
    >>> z = ZSet.from_rows([(1, 10), (2, 20)], t.schema)
    >>> t.insert(z.index_by(["k"]))
    >>> t.num_rows
    2
    >>> [b.zset.to_dict() for b in t.lookup(z.hash(["k"])[:1])]
    [{(1, 10): 1}]
    """

    MAX_PENDING = 1024  # bounds the per-batch overhead of a trace that is written but never read
    PRUNE_MIN = 4096  # rows inserted before drop_below scans at all (invariant 5)

    def __init__(self, schema: pa.Schema, key: tuple[str, ...]) -> None:
        self.schema = schema
        self.key = tuple(key)
        self._spine: list[IndexedZSet] = []
        self.pending: list[IndexedZSet] = []
        self._grown = 0  # rows inserted since drop_below last scanned (amortization only, not state)
        self._kept = 0  # rows it kept then

    @property
    def batches(self) -> list["IndexedZSet"]:
        """The settled spine (oldest and largest first); reading it settles pending batches."""
        self.settle()
        return self._spine

    def parts(self) -> tuple[list["IndexedZSet"], list["IndexedZSet"]]:
        """The settled spine and the pending batches as they are, without settling (no merges): what a
        checkpoint saves. The lists are the trace's own; do not modify them."""
        return self._spine, self.pending

    @property
    def num_rows(self) -> int:
        """Stored rows over all batches (a row may be counted once per batch holding it)."""
        return sum(len(b) for b in self._spine) + sum(len(b) for b in self.pending)

    def insert(self, batch: "IndexedZSet") -> None:
        """Add a consolidated indexed batch (same key) to the trace; merging waits for a read (invariant 2)."""
        if len(batch) == 0:
            return
        self._grown += len(batch)
        self.pending.append(batch)
        if len(self.pending) > self.MAX_PENDING:
            self.settle()

    def settle(self) -> None:
        """Merge pending batches into the spine as a binary counter (invariant 2)."""
        bs = self._spine
        for batch in self.pending:
            bs.append(batch)
            while len(bs) >= 2 and len(bs[-1]) >= len(bs[-2]):
                newer = bs.pop()
                bs[-1] = bs[-1].merge(newer)
                if len(bs[-1]) == 0:
                    bs.pop()
        self.pending = []

    def lookup(self, hashes: np.ndarray, dense_ratio: float = 1.0) -> list["IndexedZSet"]:
        """The rows of each batch whose key hash is in ``hashes`` (ascending uint64; duplicates allowed).

        May return more: rows whose hash collides with an asked hash, and whole batches with fewer than
        ``dense_ratio * len(hashes)`` rows (cheaper to pass on than to search). Callers must be indifferent
        to extra keys: the join kernel skips them, and operators that compare a key's old and new state
        find them unchanged (the extra rows cancel), so this costs at most ``dense_ratio`` rows per key
        and batch.
        """
        out = []
        if len(hashes) == 0:
            return out
        for b in self.batches:
            if len(b) < dense_ratio * len(hashes):
                out.append(b)
                continue
            idx = b.lookup(hashes)  # one galloping C call per batch
            if len(idx) == len(b):
                out.append(b)
            elif len(idx):
                out.append(b.take(idx))
        return out

    def match_weights(self, change: "IndexedZSet") -> np.ndarray:
        """The trace's weight of each row of ``change`` (same schema and key; whole-row identity), 0 for rows it
        does not hold: one galloping C walk per batch, so the cost grows with the change, not the state."""
        from dbsp_core import _zset

        acc = np.zeros(len(change), dtype=np.int64)
        batches = self.batches if len(change) else []
        if batches:
            change._check_compatible(batches[0], "match_weights")  # every batch has the trace's schema and key
            view, schema = change._view(), change.schema
            for b in batches:
                if len(b):
                    _zset.match_weights(view, None, None, b._view_as(schema), None, None, acc)
        return acc

    def key_sums(self, probe: pa.Table, probe_keys: list[str], khash: np.ndarray, rows: np.ndarray,
                 columns: list[str], view: object = None) -> np.ndarray:
        """The trace's weighted sums of int64 ``columns`` per probed key (:meth:`IndexedZSet.key_sums`, summed
        over every batch): one galloping C walk per batch, no rows copied, so the cost grows with the probe.
        ``view`` is a ``_zset.BatchView`` of ``probe`` the caller already holds (else one is built)."""
        from dbsp_core import _zset
        from dbsp_core.zset import _key_sums_positions

        acc = np.zeros((len(rows), len(columns)), dtype=np.int64)
        batches = self.batches if len(rows) else []
        if batches:
            ppos, cpos = _key_sums_positions(batches[0], probe, probe_keys, columns)
            if view is None:
                view = _zset.BatchView(probe)  # built once for every batch
            for b in batches:
                if len(b):
                    b._key_sums(view, ppos, khash, rows, cpos, acc)
        return acc

    def consolidated(self) -> "IndexedZSet":
        """The whole trace as one consolidated batch (merges a copy; the spine is unchanged)."""
        from dbsp_core.zset import IndexedZSet

        acc = IndexedZSet.empty(self.schema, self.key)
        for b in self.batches:
            acc = acc.merge(b)
        return acc

    def shard(self, shard_bits: int, shard: int) -> "IndexedZSet":
        """The consolidated state of one shard (invariant 4)."""
        from dbsp_core.zset import IndexedZSet

        acc = IndexedZSet.empty(self.schema, self.key)
        for b in self.batches:
            bounds = b.shard_bounds(shard_bits)
            lo, hi = int(bounds[shard]), int(bounds[shard + 1])
            if hi > lo:
                acc = acc.merge(b.take(np.arange(lo, hi, dtype=np.int64)))
        return acc

    def drop_below(self, bounds: dict[str, int], force: bool = False) -> int:
        """Forget the rows whose column ``c`` is below ``bounds[c]`` for any ``c`` (invariant 5); returns the rows
        dropped. Columns hold integers or timestamps (compared as int64 in their own unit); nulls are kept.
        Unless ``force``, does nothing until the rows inserted since the last scan reach the rows it kept.

        >>> import pyarrow as pa
        >>> from dbsp_core import ZSet
        >>> t = Trace(pa.schema([("w", pa.int64()), ("v", pa.int64())]), ("w",))
        >>> t.insert(ZSet.from_rows([(1, 10), (5, 20)], t.schema).index_by(["w"]))
        >>> t.drop_below({"w": 3}, force=True), [b.zset.to_dict() for b in t.batches]
        (1, [{(5, 20): 1}])
        """
        if not bounds or (not force and self._grown < max(self._kept, self.PRUNE_MIN)):
            return 0
        import pyarrow.compute as pc

        def filtered(batches: list["IndexedZSet"]) -> list["IndexedZSet"]:
            out = []
            for b in batches:
                keep = None
                for col, bound in bounds.items():
                    c = b.zset.data.column(col)
                    if not pa.types.is_integer(c.type):
                        c = pc.cast(c, pa.int64())
                    k = pc.fill_null(pc.greater_equal(c, pa.scalar(int(bound), pa.int64())), True)
                    keep = k if keep is None else pc.and_(keep, k)
                n = pc.sum(pc.cast(keep, pa.int64())).as_py() or 0
                if n == len(b):
                    out.append(b)
                elif n:
                    mask = np.asarray(keep.to_numpy(zero_copy_only=False), dtype=bool)
                    out.append(b.take(np.flatnonzero(mask)))
            return out

        before = self.num_rows
        spine, self.pending = filtered(self._spine), filtered(self.pending)
        self._spine = []
        for batch in spine:  # re-merge into the shape of invariant 2
            self._spine.append(batch)
            while len(self._spine) >= 2 and len(self._spine[-1]) >= len(self._spine[-2]):
                newer = self._spine.pop()
                self._spine[-1] = self._spine[-1].merge(newer)
                if len(self._spine[-1]) == 0:
                    self._spine.pop()
        self._kept, self._grown = self.num_rows, 0
        return before - self._kept

    def clear(self) -> None:
        """Drop all state."""
        self._spine = []
        self.pending = []

    def __repr__(self) -> str:
        return f"Trace(key={self.key}, batches={[len(b) for b in self._spine]}, pending={len(self.pending)})"
