"""A merge that streams its format-2 inputs (spill.py invariant 18, groupedbatch.py B1): their row groups read in order,
a bounded window at a time, merged window by window with the C merge (csrc/merge.h), its output written as it goes.

Invariants (levels.py ``_Merge`` uses a :class:`StreamedMerge` as its cursor when an input is a grouped batch):
  S1. Held: each input's unmerged rows read so far (a window of about ``WINDOW`` bytes of its file's groups, or a
      zero-copy slice of an input in memory or mapped, plus at most the rows of one key hash carried over), the rows of
      the piece being merged, and the writer's metadata (group index, Bloom filter, page CRCs) and gathered bytes
      (:meth:`StreamedMerge.held_bytes`, what ``spill.merge_bytes`` counts against the budget); never a whole input
      (no ``rows_of`` copy, groupedbatch.py B1) and, with an output on disk, never the output.
  S2. A round merges, of every input, the rows whose key hash is below the bound: the least last key hash of the rows
      read of the inputs not read to their end (every hash when all are). Inputs are in index order, so every row of
      a key hash below the bound has been read and none is left for a later round: each round's output is the
      whole-merge's rows of its key hashes, in order, and the rounds' outputs in turn are the whole merge's output
      (the same rows, weights, order; a merge of one non-empty piece is that piece). An input whose unmerged rows are
      all of one key hash (the bound's) reads its next window first, so each round merges at least one key hash. A
      step of n rows lowers the bound to just above the key hash of the n-th row in merged order (a compaction paid
      in slices, levels.py invariant 17: at most one key hash's rows past n, as the C cursor's steps).
  S3. Output: in memory (the store's ``merge_dir`` said it fits: the rounds' outputs concatenated at the end), or
      on disk (``GroupedWriter``: a format-2 file written round by round, never held; once finished, opened and
      adopted by the store as a grouped batch, groupedbatch.py B1). A merge dropped before it ends removes its
      temporary file (a crash leaves it to the next open's sweep).
  S4. A round that fails (a write's error, a damaged input) leaves no half-merge behind: its file, if any, is
      removed and the merge starts again from its inputs' first rows with a new file at its next step (a step rolled
      back and run again, or a compaction abandoned, never finds rows missing from the output).
  The windows together hold at most ``WINDOW_SHARE`` of the store's limit (a window an input, between ``MIN_WINDOW``
  and ``WINDOW``: a 64-input tiered merge under 100 MiB reads 100 KiB windows), so a merge holds about that much
  whatever its inputs' sizes.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from dbsp_core.trace import groupedbatch
from dbsp_core.trace.groupedfile import GroupedFile, GroupedWriter

__all__ = ["StreamedMerge", "WINDOW", "streams"]

WINDOW = 4 << 20  # bytes of an input's rows a window reads at most (a format-2 input: its groups' messages)
MIN_WINDOW = 64 << 10  # ... and at least, whatever the budget (but WINDOW, when smaller: tests)
WINDOW_SHARE = 1 / 8  # of the store's memory limit, what a merge's windows may hold together (2 a input: S1)
STATS = {"merges": 0, "windows": 0, "window_bytes": 0, "peak_held": 0, "peak_rows": 0}  # this process (tests;
# peak_rows: the most bytes of rows read of files and not merged, with a round's merged rows, one merge at a time)


def streams(batches: list) -> bool:
    """Whether a merge of ``batches`` streams (invariant S1): some input is a grouped batch whose rows are not
    copied into memory already."""
    return any(groupedbatch.is_grouped(b) and not groupedbatch.copied_bytes(b) for b in batches)


class _Input:
    """One input's reading state: its batch, its file when grouped (the next group to read), its next row otherwise,
    and its rows read and not merged (``pending``)."""

    __slots__ = ("batch", "file", "next_group", "next_row", "pending", "bytes_a_row", "rows", "window")

    def __init__(self, b: Any, window: int) -> None:
        self.batch = b
        self.window = window
        self.file: GroupedFile | None = groupedbatch.file_of(b) if not groupedbatch.copied_bytes(b) else None
        self.next_group = 0
        self.next_row = 0
        self.pending: Any = None
        self.rows = len(b)
        self.bytes_a_row = max(1, groupedbatch.row_bytes(b) // max(1, len(b)))

    @property
    def exhausted(self) -> bool:
        return (self.next_group >= self.file.groups) if self.file is not None else self.next_row >= self.rows

    def read(self) -> Any:
        """The next window of rows (an IndexedZSet in index order), a copy of whole groups for a file (their message
        bytes about WINDOW, at least one group), a zero-copy slice otherwise."""
        f = self.file
        if f is None:
            lo = self.next_row
            hi = min(self.rows, lo + max(1, self.window // self.bytes_a_row))
            self.next_row = hi
            return _part(self.batch, lo, hi)
        g0 = self.next_group
        ends = np.cumsum(f.msg_len[g0:])
        g1 = g0 + max(1, int(np.searchsorted(ends, self.window, "right")))
        self.next_group = g1
        groups = np.arange(g0, g1, dtype=np.int64)
        rb = f._gather(groups, None)
        import pyarrow as pa

        got = f._batch(pa.Table.from_batches([rb]) if rb is not None else f._table(groups))
        got._keypos = self.batch._keypos
        got._key = self.batch._key
        STATS["windows"] += 1
        STATS["window_bytes"] += int(ends[g1 - g0 - 1])
        return got


def _part(b: Any, lo: int, hi: int) -> Any:
    """Rows ``lo .. hi - 1`` of ``b`` as a view (no copy), its row hashes with them; unlike ``IndexedZSet.slice``, no
    check of a consolidated batch's order (which hashes the rows: a round's rest, every step)."""
    from dbsp_core.zset import IndexedZSet, ZSet

    z = b.zset
    out = IndexedZSet._make(ZSet._make(z.data.slice(lo, hi - lo), z.weights[lo:hi]), b._key, b.key_hash[lo:hi])
    out._rh = b._rh[lo:hi] if b._rh is not None else None
    return out


def _bytes(b: Any) -> int:
    if b is None:
        return 0
    n = int(b.zset.data.nbytes) + int(b.zset.weights.nbytes) + int(b.key_hash.nbytes)
    return n + (int(b._rh.nbytes) if b._rh is not None and b._rh is not b.key_hash else 0)


def _concat(a: Any, b: Any) -> Any:
    """Rows of ``a`` then ``b`` (index order: b's key hashes not below a's) as one batch (a copy)."""
    return _concat_all([a, b])


def _concat_all(parts: list) -> Any:
    """The rows of ``parts`` in turn (index order) as one batch (a copy); row hashes kept when every part has them."""
    from dbsp_core.zset import IndexedZSet, ZSet
    import pyarrow as pa

    a = parts[0]
    schema = a.zset.data.schema
    data = pa.concat_tables([p.zset.data.cast(schema) for p in parts]).combine_chunks()
    out = IndexedZSet._make(ZSet._make(data, np.concatenate([p.zset.weights for p in parts])), a._key,
                            np.concatenate([p.key_hash for p in parts]))
    out._rh = np.concatenate([p._rh for p in parts]) if all(p._rh is not None for p in parts) else None
    return out


class StreamedMerge:
    """The cursor of a merge of batches some of which are grouped (invariants S1-S4), with a ``MergeCursor``'s face as
    levels.py ``_Merge`` and spill.py use it: ``step(n)``, ``done``, ``consumed``, ``remaining``, ``drop()``,
    ``mapping`` (None: no scratch mapping), ``scratch_path`` (None); and :meth:`output` once done."""

    mapping = None
    scratch_path = None

    def __init__(self, batches: list, row_hashes: bool, store: Any = None, on_disk: bool = False) -> None:
        limit = getattr(store, "memory_limit", None) or (1 << 62)
        self.window = window = min(WINDOW, max(MIN_WINDOW, int(limit * WINDOW_SHARE / (2 * len(batches)))))
        self.inputs = [_Input(b, window) for b in batches]
        self.first = batches[0]
        self.row_hashes = row_hashes
        self.store = store
        self.total = sum(len(b) for b in batches)
        self.consumed = 0
        self.pieces: list = []  # the rounds' outputs, when in memory (invariant S3)
        self.piece_bytes = self._held = 0
        self.writer: GroupedWriter | None = None
        self.name = self.path = None
        self.on_disk = on_disk and store is not None
        self._out: Any = None
        self._begin()
        STATS["merges"] += 1

    def _begin(self) -> None:
        """(Re)start: every input from its first row, no output yet, a new file when on disk (invariant S4)."""
        for x in self.inputs:
            x.next_group = x.next_row = 0
            x.pending = None
        self.consumed = 0
        self.pieces, self.piece_bytes, self._held = [], 0, 0
        if self.on_disk:
            self.name, self.path = self.store._new_name()
            self.writer = GroupedWriter(self.path, self.total, vfs=self.store.vfs)
            weakref.finalize(self, self.writer.abort)  # (invariant S3: dropped before its end)

    def drop(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return self.consumed >= self.total

    @property
    def remaining(self) -> int:
        return self.total - self.consumed

    def held_bytes(self) -> int:
        """Bytes this merge holds now (invariant S1): rows read and not merged, the output in memory or the writer's."""
        return self._held + self.piece_bytes + (self.writer.memory_bytes() if self.writer is not None else 0)

    def step(self, n: int) -> int:
        """Merge at least ``n`` more input rows (or the rest), a round at a time (invariant S2); returns the rows."""
        used = 0
        try:
            while not self.done and used < max(1, n):
                used += self._round(max(1, n - used))
        except BaseException:
            if self.writer is not None:
                self.writer.abort()
            self._begin()  # (invariant S4)
            raise
        return used

    def _round(self, limit: int) -> int:
        from dbsp_core.zset import merge_cursor, merged

        ins = self.inputs
        for x in ins:  # (invariant S2: a window for every input with none, or whose rows are all of one key hash)
            p = x.pending
            if x.exhausted:
                continue
            if p is None or not len(p):
                x.pending = x.read()
            elif p.key_hash[0] == p.key_hash[-1]:
                x.pending = _concat(p, x.read())
        # (held: the rows read of files; an input in memory or mapped is read in place, its slices are its own)
        self._held = sum(_bytes(x.pending) for x in ins if x.file is not None)
        open_ = [x for x in ins if not x.exhausted and x.pending is not None and len(x.pending)]
        bound = min(int(x.pending.key_hash[-1]) for x in open_) if open_ else None
        below = [(x.pending.key_hash if bound is None else
                  x.pending.key_hash[:int(np.searchsorted(x.pending.key_hash, np.uint64(bound), "left"))])[:limit]
                 for x in ins if x.pending is not None and len(x.pending)]  # (the limit-th row is among each's first)
        if sum(len(h) for h in below) > limit:  # (a step of ``limit`` rows: the bound lowered to the key hash of
            # the limit-th row in merged order, whose rows all go: at most one key hash's rows past the limit)
            h = np.partition(np.concatenate(below), limit - 1)[limit - 1]
            bound = int(h) + 1 if int(h) < (1 << 64) - 1 else None  # (none above it: every input read whole)
        take = []
        for x in ins:
            p = x.pending
            if p is None or not len(p):
                continue
            k = len(p) if bound is None else int(np.searchsorted(p.key_hash, np.uint64(bound), "left"))
            if k:
                take.append(_part(p, 0, k))
                x.pending = _part(p, k, len(p)) if k < len(p) else None
        STATS["peak_held"] = max(STATS["peak_held"], self.held_bytes())
        rows = sum(len(t) for t in take)
        if not rows:
            return 0
        if len(take) == 1:  # (the row hashes the merge would keep: invariant S2)
            out = take[0]
            whole_row = out._keypos == list(range(out.zset.data.num_columns))
            rh = out._row_hashes() if self.row_hashes and not whole_row else None
            out = _part(out, 0, len(out))
            out._rh = rh
        else:
            schema = self.first.schema
            c = merge_cursor(*take, row_hashes=self.row_hashes)
            c.step(c.remaining)
            out = merged(take[0], c)
            if not out.zset.data.schema.equals(schema):
                out = _cast(out, schema)
        self.consumed += rows
        STATS["peak_held"] = max(STATS["peak_held"], self.held_bytes() + (_bytes(out) if self.writer else 0))
        STATS["peak_rows"] = max(STATS["peak_rows"], self._held + _bytes(out))
        if len(out):
            if self.writer is not None:
                self.writer.add(out)
            else:
                self.pieces.append(out)
                self.piece_bytes += _bytes(out)
        return rows

    def output(self) -> Any:
        """The merge's output (the same object every time): its rounds' outputs in memory, or its file finished,
        opened and adopted by the store as a grouped batch (invariant S3)."""
        if self._out is not None:
            return self._out
        from dbsp_core.zset import IndexedZSet, ZSet

        if not self.done:
            raise RuntimeError("the output of a streamed merge not done: a bug")
        w = self.writer
        if w is not None and w.rows:
            try:
                size = w.finish(self.store.durable)
                self._out = self.store.adopt_merged(self.name, self.path, size, self.first._key,
                                                    sum(groupedbatch.row_bytes(x.batch) for x in self.inputs))
            except BaseException:
                w.abort()
                self._begin()  # (invariant S4: not done any more, merged again by the next steps)
                raise
        else:
            if w is not None:
                w.abort()
            parts = self.pieces
            if not parts:
                f = self.first
                schema = f.schema
                self._out = IndexedZSet._make(ZSet._make(schema.empty_table(), np.zeros(0, dtype=np.int64)), f._key,
                                              np.zeros(0, dtype=np.uint64))
            else:
                self._out = parts[0] if len(parts) == 1 else _concat_all(parts)
        self.pieces, self.piece_bytes = [], 0
        return self._out


def _cast(b: Any, schema: Any) -> Any:
    from dbsp_core.zset import IndexedZSet, ZSet

    out = IndexedZSet._make(ZSet._make(b.zset.data.cast(schema), b.zset.weights), b._key, b.key_hash)
    out._rh = b._rh
    return out
