"""A Trace is the integrated, indexed state of a stateful operator: consolidated batches kept in levels by the work that went into them, merged a little on every insert.

Invariants (enforced here; :meth:`Trace.check` asserts 1, 2, 5 and 11):
  1. Every batch is a consolidated IndexedZSet on the trace's key, rows ascending by key hash; the trace's
     content is the sum of its batches: the loose batches of every level, both inputs of every merge in
     progress, and the pending batches (the same row may sit in several batches until they merge).
  2. A batch's work is the number of rows inserted into it, not its size: an inserted batch's work is its row
     count; a merge's output has its inputs' summed work, capped at WORK_CAP times its own rows. The batch
     sits at level ``ceil(log2(work))``, and a merge only joins two batches of one level. So the output of a
     merge that did not shrink moves at least one level up and never meets the same batches again: a merge
     at level L needs 2**(L-1) newly inserted rows behind it, while its inputs hold at most 2**(L+1) rows.
     The cap only lets an output that shrank to half its work or less stay low (its rows are few), so the
     level count is at most log2(WORK_CAP * rows) + 1 even when the key set is saturated and every merge
     returns a batch of the same size.
  3. Merging is paid by inserts, in bounded steps: inserting n rows places the batch, then advances each
     level's merge in progress (starting one where a level holds two loose batches) by FUEL * n input rows (a
     resumable C merge, csrc/merge.h). A merge at level L then finishes before the 2**(L-1) rows that could
     bring its level another batch are in, so levels hold about one batch each (a batch that arrives earlier
     waits, loose), and a step's merge work is at most FUEL times its rows per level, amortized at most its
     rows per level: the cost of a step grows with the change, never with the state.
  4. Reads (lookup, match_weights, key_sums, batches, consolidated, shard) never merge: they read every batch
     of invariant 1 as it stands, O(log n) batches. A merge's inputs stay readable until it finishes; then
     its output replaces them.
 10. Background merging (a :class:`BackgroundMerger` in force on the inserting thread, see :func:`merging`):
     invariant 3's merges are the same, but the thread that inserts only starts them and hands them to the
     merger's thread, which advances them in GIL-free chunks while steps run (merges of at most INLINE_MERGE
     rows of work are not handed over: they advance by fuel as in invariant 3); the inserting thread pays
     invariant 3's fuel itself only for a merge that is due (its level already holds two more loose batches:
     the merger fell behind), so a level holds at most a merge and two loose batches and the bound on
     batches, and on a step's merge work, stays that of invariant 3. Only the inserting thread changes the
     levels: it installs finished merges at its next insert or read (a read still merges nothing). A merge's
     lock keeps the two threads from advancing it at once; its result does not depend on who advanced it,
     so the content, the batches once merges finish, checkpoints and outputs are those of invariant 3.
  5. A cleared trace is fresh (a checkpoint being restored): its inserts stay pending, in order, and merge
     nothing; settle() places pending batches without merging, so a restore that inserts the batches of
     ``parts()`` and settles gets the same batches back (``parts()`` lists placed batches in the order they
     were placed). Freshness ends at the first read, which places the pending batches (no merge work: later
     inserts pay for their merges); while no read comes, an insert beyond MAX_PENDING pending batches inserts
     the oldest one as above. A new trace is not fresh.
  6. A lookup touches only the rows whose key hash is asked for (a galloping C search per batch), or whole
     batches smaller than a few rows per asked key, so its cost grows with the change, not with the state.
  7. State is grouped by shard: a shard (top ``shard_bits`` bits of the key hash) is a contiguous row range
     of every batch, so :meth:`Trace.shard` extracts one shard's state without scanning the others.
  8. :meth:`Trace.drop_below` forgets the rows whose time key columns are below a bound (state that no later
     change can reach, dbsp_core/time/cleanup.py): every batch keeps its other rows in order (still
     consolidated and key-hash sorted; emptied batches leave) at the level of its work, capped as a merge's
     output is (invariant 2); a merge whose inputs lost rows starts again from them. It scans the trace only
     once the rows inserted since the last scan reach the rows kept by it (and at least ``PRUNE_MIN``), so its
     cost is O(1) amortized per inserted row and the trace holds at most about twice the rows it must keep.
  9. :meth:`Trace.replace` puts pieces of batches in their place (what a shard cut keeps of each batch,
     dbsp_core/runtime/migrate.py: zero-copy slices that keep the batch's row hashes): each piece at the level of
     its batch's work capped as a merge's output is (invariant 2), in the batch's place in placement order
     (invariant 5); a merge whose inputs changed starts again from their pieces, every other merge goes on;
     pending batches stay pending and freshness is unchanged. It merges nothing, reads no rows and hashes
     nothing: its cost grows with the number of batches, not with the rows they hold.
 11. A trace may keep a key index (:meth:`Trace.keep_index`, csrc/keyindex.h): per key (the trace key, or the whole
     row), the sums over the trace's content of weight times some int64 columns (or of the weight alone). It is a
     cache: the batches stay the state (checkpoints, shard cuts, rollback and merges never read it). Every change of
     content takes a fresh token (``_token``, from one process-wide counter); the index holds the token of the
     content its sums match, so it is read only while the two are equal. An insert adds the batch to the sums, a
     shard cut subtracts the moved rows; anything else (clear, drop_below, a rollback that puts back an earlier
     token) leaves the index stale. A stale index is rebuilt from the batches, O(rows) once, by the third read
     that wants it (the first two walk the batches), so a trace that is loaded afresh for every job (a stage task
     without its cache) never pays for an index it would not keep. Reads through a current index give exactly
     what the walk over the batches gives.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from dbsp_core.envvars import parse_number
from dbsp_core.errors import IndexDroppedWarning, WeightOverflowError

if TYPE_CHECKING:
    from dbsp_core.zset import IndexedZSet


_TOKENS = itertools.count(1)  # content tokens (invariant 11): unique in the process, never reused
KEY_INDEX = os.environ.get("DBSP_KEY_INDEX", "1") != "0"  # DBSP_KEY_INDEX=0: no trace keeps a key index


def memory_bytes() -> int | None:
    """The memory this process may use: the machine's physical memory, or a cgroup's limit (a container) when lower;
    None when neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:  # "max" (v2) or a huge number (v1) when unlimited
            limits.append(int(text))
    limits = [x for x in limits if x > 0]
    return min(limits) if limits else None


def key_index_mb(env: str | None, memory: int | None, name: str = "DBSP_KEY_INDEX_MB") -> float:
    """The size limit of one key index in MiB (invariant 11): ``DBSP_KEY_INDEX_MB`` when set (a positive number),
    else an eighth of the process's memory (:func:`memory_bytes`), at least 512 MiB (512 MiB when unknown). An
    index holds about 1.5 to 3 times its trace's bytes per key (a table 3/8 to 3/4 full), so a limit that does not
    grow with the machine would turn the indexes off exactly where the state is large (at 10M groups a two-sum
    index needs 640 MiB).

    >>> key_index_mb(None, 24 * 2**30), key_index_mb(None, 2 * 2**30), key_index_mb(None, None), key_index_mb("64", None)
    (3072.0, 512.0, 512.0, 64.0)
    """
    if env is not None and env.strip():
        return parse_number(env, name, positive=True)
    return max(512.0, memory / 8 / 2**20) if memory else 512.0


def key_index_total_mb(env: str | None, memory: int | None) -> float:
    """The budget on every key index of the process together, in MiB (csrc/keyindex.h invariant 6):
    ``DBSP_KEY_INDEX_TOTAL_MB`` when set (a positive number), else a quarter of the process's memory
    (:func:`memory_bytes`), at least 1024 MiB (1024 MiB when unknown). It keeps many large indexes (one per stateful
    operator and worker) from taking the memory the state needs: the index that would pass it is dropped instead.

    >>> key_index_total_mb(None, 24 * 2**30), key_index_total_mb(None, None), key_index_total_mb("2048", None)
    (6144.0, 1024.0, 2048.0)
    """
    if env is not None and env.strip():
        return parse_number(env, "DBSP_KEY_INDEX_TOTAL_MB", positive=True)
    return max(1024.0, memory / 4 / 2**20) if memory else 1024.0


_MEMORY = memory_bytes()
KEY_INDEX_MB = key_index_mb(os.environ.get("DBSP_KEY_INDEX_MB"), _MEMORY)  # above this, a trace drops its index
KEY_INDEX_TOTAL_MB = key_index_total_mb(os.environ.get("DBSP_KEY_INDEX_TOTAL_MB"), _MEMORY)


from dbsp_core import _zset as _native  # noqa: E402  (the C core: the budget is process-wide, set once)

_native.keyindex_budget(int(KEY_INDEX_TOTAL_MB * 2**20))


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


def summable(t: pa.DataType) -> bool:
    """Whether a key index can sum a column of type ``t`` as int64 (csrc/keyindex.h): integers other than uint64,
    dates (date32) and timestamps.

    >>> summable(pa.int32()), summable(pa.timestamp("ms")), summable(pa.uint64()), summable(pa.float64())
    (True, True, False, False)
    """
    return ((pa.types.is_integer(t) and not pa.types.is_uint64(t)) or pa.types.is_date32(t)
            or pa.types.is_timestamp(t))


def level_of(work: int) -> int:
    """The level of a batch with ``work`` inserted rows: ``ceil(log2(work))`` (invariant 2).

    >>> [level_of(w) for w in (1, 2, 3, 4, 5, 1024, 1025)]
    [0, 1, 2, 2, 3, 10, 11]
    """
    return (work - 1).bit_length()


class _Merge:
    """A merge in progress of two batches of one level; its inputs stay readable until it finishes."""

    __slots__ = ("a", "b", "work", "merger", "_out", "shared")

    def __init__(self, a: tuple[int, "IndexedZSet", int], b: tuple[int, "IndexedZSet", int]) -> None:
        from dbsp_core.zset import merger

        self.a, self.b = a, b  # (placement number, batch, work)
        self.work = a[2] + b[2]
        self.merger = merger(a[1], b[1], row_hashes=True)
        self._out: IndexedZSet | None = None
        self.shared: _Shared | None = None  # set when handed to a BackgroundMerger (invariant 10)

    def renumbered(self, pa_: int, pb: int) -> "_Merge":
        """The same merge (sharing its progress) with its inputs at placement numbers ``pa_`` and ``pb``: a new
        object, so a shallow copy of the trace taken before still sees the old numbers."""
        m = object.__new__(_Merge)
        m.a, m.b = (pa_,) + self.a[1:], (pb,) + self.b[1:]
        m.work, m.merger, m._out, m.shared = self.work, self.merger, self._out, self.shared
        return m

    def advance(self, budget: int) -> int:
        """Merge at least ``budget`` more input rows (or the rest) on this thread; returns the rows merged."""
        sh = self.shared
        if sh is None:
            return self.merger.step(budget) if not self.merger.done else 0
        with sh.lock:
            if sh.error is not None:
                raise sh.error
            return self.merger.step(budget) if not self.merger.done else 0

    def finished(self, wait: bool = True) -> bool:
        """Whether every input row is merged (with ``wait=False``: False while the merger's thread holds it)."""
        sh = self.shared
        if sh is None:
            return self.merger.done
        if not sh.lock.acquire(wait):
            return False
        try:
            if sh.error is not None:
                raise sh.error
            return self.merger.done
        finally:
            sh.lock.release()

    def result(self) -> "IndexedZSet":
        """The finished merge's output (the same object every time: a rolled-back trace may finish it again)."""
        from dbsp_core.zset import merged

        if self._out is None:
            self._out = merged(self.a[1], self.merger)
        return self._out


class _Shared:
    """What a merge handed to a BackgroundMerger shares between the two threads (invariant 10)."""

    __slots__ = ("lock", "error", "merged")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.error: BaseException | None = None  # what advancing it on the merger's thread raised
        self.merged = 0  # input rows the merger's thread merged (counted into the trace when installed)


class BackgroundMerger:
    """A thread that advances the merges traces hand it, in GIL-free chunks of ``CHUNK`` input rows
    (invariant 10). One serves any number of traces; :meth:`close` stops it. Traces use it while
    :func:`merging` puts it in force on their inserting thread.

    >>> import pyarrow as pa
    >>> from dbsp_core import ZSet
    >>> t = Trace(pa.schema([("k", pa.int64())]), ("k",))
    >>> with BackgroundMerger() as bg, merging(bg):
    ...     for i in range(64):
    ...         t.insert(ZSet.from_rows([(i,)], t.schema).index_by(["k"]))
    ...     idle = bg.wait_idle()
    >>> sorted(t.consolidated().zset.to_dict()) == [(i,) for i in range(64)]
    True
    """

    CHUNK = 131_072  # rows a GIL-free call merges (~1-3 ms): between chunks this thread takes the GIL for a few
    # Python lines (fewer hand-offs than 16k-row chunks; the difference in step latency was within noise), and a
    # step that needs a merge this thread holds (invariant 10: due) waits at most one chunk. What does slow
    # steps is a big merge running beside them on a state that does not fit in cache (memory traffic): up to
    # ~1.8x at 50M rows; EmbeddedExecutor.settle_merges() lets a bulk load's merges finish first

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: dict[int, "Trace"] = {}  # id(trace) -> trace with merges to advance, oldest first
        self._busy = False
        self._closed = False
        self.merged_rows = 0  # input rows merged on this thread, ever
        self._thread = threading.Thread(target=self._loop, name="dbsp-merger", daemon=True)
        self._thread.start()

    def __enter__(self) -> "BackgroundMerger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, trace: "Trace") -> None:
        """``trace`` has merges in progress for this thread to advance."""
        with self._cond:
            trace._bg_seq += 1
            if id(trace) not in self._queue:
                self._queue[id(trace)] = trace
                self._cond.notify()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every merge handed over is finished (tests and benchmarks); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (not self._queue and not self._busy), timeout)

    def close(self) -> None:
        """Stop the thread (merges it did not finish are finished by their traces' inserts, as without it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                tid, trace = next(iter(self._queue.items()))
                seq = trace._bg_seq
                self._busy = True
            m = trace._unfinished()
            if m is None:
                with self._cond:
                    if trace._bg_seq == seq:  # nothing handed over since the scan began
                        self._queue.pop(tid, None)
                    else:  # move it to the back: fair among traces
                        self._queue[tid] = self._queue.pop(tid)
                continue
            sh = m.shared
            while not self._closed:  # the same merge to its end, with no scan or queue work between chunks
                with sh.lock:
                    if sh.error is not None or m.merger.done:
                        break
                    try:
                        used = m.merger.step(self.CHUNK)
                    except BaseException as exc:  # the inserting thread raises it when it needs the merge
                        sh.error = exc
                        break
                    sh.merged += used
                    self.merged_rows += used


_tls = threading.local()


@contextmanager
def merging(merger: "BackgroundMerger | None") -> Iterator[None]:
    """Traces inserted into on this thread, inside the block, hand their merges to ``merger`` (invariant 10);
    None: they merge on the inserting thread (invariant 3)."""
    prev = getattr(_tls, "merger", None)
    _tls.merger = merger
    try:
        yield
    finally:
        _tls.merger = prev


def background() -> "BackgroundMerger | None":
    """The BackgroundMerger in force on this thread (:func:`merging`), or None."""
    return getattr(_tls, "merger", None)

def _check_pieces(batch: "IndexedZSet", pieces: list["IndexedZSet"]) -> None:
    """Pieces of ``batch`` (:meth:`Trace.replace`) hold at most its rows, on its key (a cheap guard, no row read)."""
    if sum(len(x) for x in pieces) > len(batch) or any(x.key != batch.key for x in pieces):
        raise ValueError(f"Trace.replace: pieces of a {len(batch)}-row batch on {batch.key} hold "
                         f"{[len(x) for x in pieces]} rows on {[x.key for x in pieces]}")


class _Level(NamedTuple):
    """The batches of one level: loose ones (placement number, batch, work), oldest first, and a merge.

    Immutable (a change replaces the level), so a shallow copy of the trace's attributes is a snapshot of it:
    a failed step or staged attempt is rolled back that way (dbsp_core/runtime/rollback.py). A merge's progress
    is not part of the content (its inputs are), so a rolled-back trace may find its merges further along."""

    loose: tuple = ()
    merge: _Merge | None = None


class Trace:
    """Consolidated, key-hash-sorted batches in levels by work: the integral of an indexed stream.

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

    FUEL = 8  # merge input rows per inserted row, per level with a merge to advance (invariant 3); 4 would do,
    # but shorter merges leave fewer levels with two inputs to read (measured: 9.2 -> 7.3 batches a step)
    WORK_CAP = 2  # a merge's output counts at most this many times its rows as work (invariant 2)
    MAX_PENDING = 64  # a fresh trace's pending batches beyond which it inserts the oldest (invariant 5)
    PRUNE_MIN = 4096  # rows inserted before drop_below scans at all (invariant 8)
    INDEX_WAIT = 2  # reads that walk the batches before a stale key index is rebuilt (invariant 11)
    INLINE_MERGE = 4096  # work (input rows) up to which a merge is not handed to a merger thread (invariant 10):
    # handing over a small step's merge (lock, wake-up, GIL hand-offs) cost more than merging it by fuel here
    # (1k-row steps on 1M rows, 600 steps alternated twice: mean 5-15% lower for distinct, group_by and join)

    def __init__(self, schema: pa.Schema, key: tuple[str, ...]) -> None:
        self.schema = schema
        self.key = tuple(key)
        self.merged_rows = 0  # input rows consumed by merges, ever (counts, not timings, for tests and benchmarks)
        self.inserted_rows = 0  # rows inserted, ever
        self._levels: list[_Level] = []
        self.pending: list[IndexedZSet] = []
        self._fresh = False
        self._placed = 0  # placement numbers handed out
        self._grown = 0  # rows inserted since drop_below last scanned (amortization only, not state)
        self._kept = 0  # rows it kept then
        self._bg_seq = 0  # hand-overs to a BackgroundMerger (invariant 10: it drops a trace only when unchanged)
        self._handed = False  # merges were handed to a BackgroundMerger: the next read installs finished ones
        self._token = next(_TOKENS)  # the content's token (invariant 11)
        self._kix_spec: tuple | None = None  # ("key" | "row", sum columns) of the key index kept, if any
        self._kix = None  # the key index (a _zset.KeyIndex), current while its token is self._token
        self._kix_off = False  # the index failed (overflow, memory, size): this trace walks its batches
        self._kix_wait = 0  # reads that walk the batches before a stale index is rebuilt (invariant 11)

    def clear(self) -> None:
        """Drop all state; the trace is fresh (invariant 5): what a restore does before inserting saved batches."""
        self._levels = []
        self.pending = []
        self._fresh = True
        self._changed()
        self._stale_index()

    # ---- the key index (invariant 11) ----

    def keep_index(self, columns: tuple, on: str = "key") -> bool:
        """Keep a key index of the sums of weight times each column of ``columns`` (an integer column other than
        uint64, a date or a timestamp, summed as int64; None: the weight alone; ``("valid", c)``: the weight where
        column ``c`` is not null), per trace key (``on="key"``: serves :meth:`key_sums` of int64 columns, and
        :meth:`index_for_update`) or per whole row (``on="row"`` with ``(None,)``: serves :meth:`match_weights`).
        Returns whether the index is kept: only for keys of fixed-width columns (no strings), and not when
        ``DBSP_KEY_INDEX=0``. Costs memory beside the batches (about 8 bytes per key column and sum, plus 16, per
        key, over a table at most 3/4 full); a trace whose index would pass ``KEY_INDEX_MB`` (:func:`key_index_mb`:
        ``DBSP_KEY_INDEX_MB``, by default an eighth of the memory, at least 512 MiB), or take the indexes of the
        process past ``KEY_INDEX_TOTAL_MB`` together (:func:`key_index_total_mb`), drops it with an
        IndexDroppedWarning and walks its batches as without one."""
        from dbsp_core import _zset

        if on not in ("key", "row"):
            raise ValueError(f"keep_index: on must be 'key' or 'row', got {on!r}")
        if on == "row" and tuple(columns) != (None,):
            raise ValueError("keep_index: a whole-row index keeps the weights only (columns=(None,))")
        names = list(self.key) if on == "key" else list(self.schema.names)
        for c in columns:
            if isinstance(c, tuple):
                if len(c) != 2 or c[0] != "valid" or self.schema.get_field_index(c[1]) < 0:
                    raise ValueError(f"keep_index: {c!r} is not ('valid', <column>)")
            elif c is not None and not summable(self.schema.field(c).type):
                raise ValueError(f"keep_index: column {c!r} is {self.schema.field(c).type}, which does not sum as int64")
        if not KEY_INDEX or not columns or not _zset.keyindex_supports([self.schema.field(n).type for n in names]):
            return False
        self._kix_spec = (on, tuple(columns))
        self._kix = None  # built from the batches at the first read that wants it
        if not self._levels and not self.pending:  # empty: an empty index is current, inserts keep it so
            self._kix = self._new_index()
        return True

    @property
    def index_spec(self) -> tuple | None:
        """``(on, columns)`` of the key index this trace keeps (:meth:`keep_index`), None when it keeps none (not
        asked for, not supported for its key, or turned off after a failure)."""
        return None if self._kix_off else self._kix_spec

    def _changed(self) -> int:
        """The content changes: take a fresh token (invariant 11); returns the previous one."""
        prev, self._token = self._token, next(_TOKENS)
        return prev

    def _stale_index(self) -> None:
        """Drop the key index: the third read that wants it rebuilds it from the batches (invariant 11)."""
        self._kix, self._kix_wait = None, self.INDEX_WAIT

    @property
    def index_bytes(self) -> int:
        """Memory held by the key index (its slot table), 0 without one."""
        return int(self._kix.nbytes) if self._kix is not None else 0

    def _new_index(self) -> Any:
        from dbsp_core import _zset

        on, cols = self._kix_spec
        names = self.key if on == "key" else self.schema.names
        ix = _zset.KeyIndex([self.schema.field(n).type for n in names], len(cols), int(KEY_INDEX_MB * 2**20))
        ix.token = self._token
        return ix

    def _index_args(self, b: "IndexedZSet") -> tuple:
        """(view, key positions, key hashes, sum positions) of a batch for the key index."""
        on, cols = self._kix_spec
        ncols = len(b.schema)
        cpos = [-1 if c is None else -2 - b.schema.get_field_index(c[1]) if isinstance(c, tuple)
                else b.schema.get_field_index(c) for c in cols]
        if on == "key":
            return b._view(), b._keypos, b._kh, cpos
        return b._view(), list(range(ncols)), b._row_hashes(), cpos

    def _index_fold(self, batches: list["IndexedZSet"], sign: int, prev: int) -> None:
        """Fold ``batches`` into the index (sign +1: inserted, -1: removed) if it matched the content of token
        ``prev``; the content is now at ``self._token``. A stale index is dropped; a failing one turns it off."""
        ix = self._kix
        if ix is None:
            return
        if ix.token != prev:
            self._stale_index()
            return
        ix.token = None  # a failure half way leaves it stale
        try:
            for b in batches:
                if len(b):
                    view, keys, kh, cpos = self._index_args(b)
                    ix.add(view, None, keys, kh, cpos, sign)
        except (ArithmeticError, MemoryError, ValueError) as exc:  # WeightOverflowError, SchemaError included: walk
            self._drop_index(exc)  # instead
            return
        ix.token = self._token

    def _index_sums(self, spec: tuple, batches: list["IndexedZSet"], view: Any, ppos: list[int], khash: np.ndarray,
                    rows: np.ndarray | None, acc: np.ndarray) -> bool:
        """Add the sums of the key index for ``spec`` to ``acc`` (one row per probed row: ``rows[i]`` of ``view``,
        or row i without ``rows``; key columns ``ppos``, key hashes ``khash``); False, with ``acc`` untouched, when
        the index cannot serve: none kept for ``spec``, stale and not rebuilt yet, or probe key types that differ
        from the trace's (the caller then walks the batches)."""
        if self._kix_spec != spec or self._kix_off:
            return False
        names = self.key if spec[0] == "key" else self.schema.names
        probe = view.pyschema
        if len(ppos) != len(names) or not all(probe.field(p).type.equals(self.schema.field(n).type)
                                              for p, n in zip(ppos, names)):
            return False
        ix = self._index(spec, batches)
        if ix is None:
            return False
        ix.get(view, ppos, khash, acc, sel=rows)
        return True

    def _index(self, spec: tuple, batches: list["IndexedZSet"]) -> Any:
        """The key index for ``spec`` matching the content (``batches``: every batch, as read), rebuilt if stale;
        None when the trace keeps no such index."""
        if self._kix_spec != spec or self._kix_off:
            return None
        ix = self._kix
        if ix is not None and ix.token == self._token:
            return ix
        if self._kix_wait > 0:
            self._kix_wait -= 1
            return None
        self._kix = self._new_index()
        self._index_fold(batches, 1, self._token)
        return self._kix

    def index_for_update(self, spec: tuple) -> Any:
        """The key index kept for ``spec`` (invariant 11), current with the content, for a caller that stores a
        batch's effect in it itself (the linear aggregate's one-pass step, ``_zset.linear_step``) and then inserts
        that batch with ``insert(batch, indexed=ix)``, or calls :meth:`index_done` when it inserts nothing. Until
        then the index counts as stale, so a failure in between leaves it to be rebuilt, never read. None when the
        trace keeps no such index, or it is stale and not rebuilt yet: the caller then reads with :meth:`key_sums`
        and inserts plainly."""
        if self._kix_spec != spec or self._kix_off:
            return None
        ix = self._kix
        if ix is None or ix.token != self._token:
            ix = self._index(spec, self._read())  # a stale index: the third read that wants it rebuilds it
            if ix is None:
                return None
        ix.token = None
        return ix

    def index_done(self, ix: Any, failed: BaseException | None = None) -> None:
        """The caller of :meth:`index_for_update` left ``ix`` as it found it (nothing to insert), or broke it half
        way with the error ``failed`` (memory, size limit): the trace then walks its batches from now on."""
        if ix is not self._kix:
            return
        if failed is not None:
            self._drop_index(failed)
        else:
            ix.token = self._token

    def _drop_index(self, exc: BaseException | None) -> None:
        """Turn the key index off for good (it failed with ``exc``; None: a size limit met half way): this trace
        walks its batches from now on, and says so once with an IndexDroppedWarning."""
        ix, self._kix, self._kix_off = self._kix, None, True
        from dbsp_core import _zset

        if isinstance(exc, ArithmeticError):
            why = f"a sum leaves int64 ({exc})"
        elif isinstance(exc, MemoryError):
            why = f"out of memory ({exc})"
        elif exc is None or (type(exc) is ValueError and ix is not None and ix.broken):  # the size limits
            why = (f"growing past {int(ix.nbytes if ix is not None else 0) / 2**20:.1f} MiB would pass "
                   f"DBSP_KEY_INDEX_MB ({KEY_INDEX_MB:.0f}) or the budget of all indexes together, "
                   f"DBSP_KEY_INDEX_TOTAL_MB ({KEY_INDEX_TOTAL_MB:.0f}; {_zset.keyindex_total_bytes() / 2**20:.0f} MiB "
                   f"held now)")
        else:
            why = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"a trace on key {list(self.key)} dropped its key index ({len(ix) if ix is not None else 0} "
                      f"keys): {why}. Its results stay exact; its steps walk the batches from now on, slower on a "
                      f"large state", IndexDroppedWarning, stacklevel=2)

    def through_index(self, spec: tuple, fn: Any) -> Any:
        """``fn(ix)`` with the key index for ``spec`` handed out by :meth:`index_for_update` (``fn`` reads and stores
        through it, then inserts with ``insert(batch, indexed=ix)`` or calls :meth:`index_done`, or returns None
        having called it); None when no current index serves. A WeightOverflowError is raised with the index left
        as found when the failed call stored nothing, else stale; a failure that broke the index on its memory or
        size limit turns it off (the trace walks its batches from then on) and returns None, so the caller takes
        the path without it."""
        ix = self.index_for_update(spec)
        if ix is None:
            return None
        try:
            return fn(ix)
        except WeightOverflowError:
            if not ix.broken:  # refused before anything was stored
                self.index_done(ix)
            raise  # else broken half way, and stale since index_for_update: a later read rebuilds it
        except (MemoryError, ValueError) as exc:
            if not ix.broken:
                raise
            self.index_done(ix, failed=exc)
            return None

    # ---- writing ----

    def insert(self, batch: "IndexedZSet", indexed: Any = None) -> None:
        """Add a consolidated indexed batch (same key): place it, then pay its share of merge work (invariant 3).
        ``indexed``: the key index from :meth:`index_for_update`, which the caller already brought up to this
        batch (invariant 11: it then matches the new content); else an index kept is updated here."""
        if len(batch) == 0:
            if indexed is not None:
                self.index_done(indexed)
            return
        batch._row_hashes()  # kept with the batch: merges order meeting keys without hashing (csrc/merge.h)
        prev = self._changed()
        if indexed is not None:
            if indexed is self._kix:
                indexed.token = self._token
        elif self._kix is not None:
            self._index_fold([batch], 1, prev)
        self.inserted_rows += len(batch)
        self._grown += len(batch)
        if self._fresh:
            self.pending.append(batch)
            if len(self.pending) <= self.MAX_PENDING:
                return
            batch = self.pending.pop(0)
        self._place(batch, len(batch))
        self._work(len(batch))

    def settle(self) -> None:
        """Place the pending batches into their levels, merging nothing (invariant 5: a restore inserts the batches
        of :meth:`parts` and settles; merges go on as later inserts pay for them)."""
        for b in self.pending:
            self._place(b, len(b))
        self.pending = []

    def _place(self, batch: "IndexedZSet", work: int) -> None:
        lvl = level_of(work)
        while len(self._levels) <= lvl:
            self._levels.append(_Level())
        level = self._levels[lvl]
        self._levels[lvl] = level._replace(loose=level.loose + ((self._placed, batch, work),))
        self._placed += 1

    def _work(self, rows: int) -> None:
        """Advance every level's merge by FUEL * rows input rows, lowest level first (invariant 3); with a
        BackgroundMerger in force, start merges and hand them over, paying fuel only for due ones (invariant 10)."""
        fuel = max(1, int(self.FUEL * rows)) if rows else 0
        bg = background()
        handed = False
        lvl = 0
        while lvl < len(self._levels):  # a finished merge may add a level above
            budget = fuel
            while True:
                level = self._levels[lvl]
                m = level.merge
                if m is None:
                    if len(level.loose) < 2:
                        break
                    m = self._start_merge(lvl, bg is not None)
                    level = self._levels[lvl]
                if bg is not None and m.shared is not None and len(level.loose) < 2:  # not due: the merger's
                    # thread advances it
                    if not m.finished(wait=False):
                        handed = True
                        break
                elif budget > 0 and not m.finished():
                    used = m.advance(budget)
                    budget -= used
                    self.merged_rows += used
                if not m.finished():
                    break
                self._install(lvl, m)
            lvl += 1
        if bg is not None:
            self._handed = handed
            if handed:
                bg.submit(self)

    def _start_merge(self, lvl: int, handing: bool) -> _Merge:
        """Start merging the two oldest loose batches of level ``lvl`` (it has no merge in progress); with
        ``handing`` (a merger thread in force) a merge of more than INLINE_MERGE rows of work is made shareable, to
        be handed over (invariant 10)."""
        level = self._levels[lvl]
        m = _Merge(level.loose[0], level.loose[1])
        if handing and m.work > self.INLINE_MERGE:
            m.shared = _Shared()
        self._levels[lvl] = _Level(level.loose[2:], m)
        return m

    def _install(self, lvl: int, m: _Merge) -> None:
        """Replace a finished merge's inputs by its output (invariant 4)."""
        self._levels[lvl] = self._levels[lvl]._replace(merge=None)
        if m.shared is not None:
            self.merged_rows += m.shared.merged
            m.shared.merged = 0
        out = m.result()
        if len(out):
            self._place(out, min(m.work, self.WORK_CAP * len(out)))

    def install_finished(self, merger: "BackgroundMerger | None" = None) -> int:
        """Install the merges a merger's thread has finished (invariant 10), from any thread while the inserting one
        is between steps, so a checkpoint or a layout change sees merged batches; with ``merger``, also start the
        merges the installed outputs make possible and hand them to it. Merges nothing, waits for nothing; returns
        the merges installed."""
        if not self._handed:
            return 0
        installed, handed = 0, False
        for lvl in range(len(self._levels)):  # a level's output lands higher up: one pass sees it
            level = self._levels[lvl]
            m = level.merge
            if m is not None and m.shared is not None and m.finished(wait=False):
                self._install(lvl, m)
                installed += 1
                level, m = self._levels[lvl], None
            if m is None and merger is not None and len(level.loose) >= 2:
                m = self._start_merge(lvl, True)
            handed = handed or (m is not None and m.shared is not None)
        if merger is not None and handed:
            merger.submit(self)
        return installed

    def _unfinished(self) -> "_Merge | None":
        """A handed-over merge not finished yet, lowest level first (the merger's thread calls this)."""
        for level in list(self._levels):
            m = level.merge
            if m is not None and m.shared is not None and m.shared.error is None and not m.merger.done:
                return m
        return None

    # ---- reading ----

    def _read(self) -> list["IndexedZSet"]:
        """Every batch of invariant 1 (a read ends a trace's freshness, placing its pending batches: invariant 5)."""
        if self._fresh:
            self.settle()
            self._fresh = False
        if self._handed and background() is not None:  # install the merges the merger's thread finished
            self._work(0)  # (invariant 10); merges nothing
        return self._spine()

    def _spine(self) -> list["IndexedZSet"]:
        """The placed batches (merge inputs included), in the order they were placed."""
        entries = []
        for level in self._levels:
            entries.extend(level.loose)
            if level.merge is not None:
                entries.append(level.merge.a)
                entries.append(level.merge.b)
        entries.sort(key=lambda e: e[0])
        return [e[1] for e in entries]

    @property
    def batches(self) -> list["IndexedZSet"]:
        """Every batch the trace's content is the sum of (invariant 1); reading it merges nothing."""
        return self._read()

    def parts(self) -> tuple[list["IndexedZSet"], list["IndexedZSet"]]:
        """The placed batches (in placement order) and the pending ones, as they are: what a checkpoint saves.
        Inserting both lists into a cleared trace, with :meth:`settle` between them, restores it (invariant 5)."""
        return self._spine(), list(self.pending)

    def levels(self) -> list[tuple[int, list[int], tuple[int, int] | None]]:
        """Per non-empty level: its number, its loose batches' sizes and its merge's input sizes (for tests)."""
        out = []
        for lvl, level in enumerate(self._levels):
            m = level.merge
            if level.loose or m is not None:
                out.append((lvl, [len(e[1]) for e in level.loose], (len(m.a[1]), len(m.b[1])) if m else None))
        return out

    def check(self) -> None:
        """Raise AssertionError unless invariants 1, 2 and 5 hold (tests and debugging; reads every row): each batch
        non-empty and consolidated in canonical order for the key, with the row hashes it keeps; each loose batch
        and merge at the level of its work; placement numbers distinct and below the next one."""
        from dbsp_core import _zset

        seen = set()
        for lvl, level in enumerate(self._levels):
            entries = list(level.loose) + ([level.merge.a, level.merge.b] if level.merge is not None else [])
            for placed, b, work in entries:
                assert placed < self._placed and placed not in seen, (lvl, placed)
                seen.add(placed)
                assert len(b) and work >= 1, (lvl, len(b), work)
                assert level_of(work) == lvl, (lvl, work)
            if level.merge is not None:
                assert level.merge.work == level.merge.a[2] + level.merge.b[2]
        ix = self._kix
        if ix is not None and ix.token == self._token:  # invariant 11: the index holds the batches' sums
            ix.check()
            fresh = self._new_index()
            for b in self._spine() + self.pending:
                view, keys, kh, cpos = self._index_args(b)
                fresh.add(view, None, keys, kh, cpos)
            assert len(fresh) == len(ix), ("key index entries", len(ix), len(fresh))
            for b in self._spine() + self.pending:
                view, keys, kh, _ = self._index_args(b)
                got, want = (np.zeros((len(b), ix.nvals), dtype=np.int64) for _ in range(2))
                ix.get(view, keys, kh, got)
                fresh.get(view, keys, kh, want)
                assert np.array_equal(got, want), "key index sums differ from the batches'"
        for b in self._spine() + self.pending:
            keypos = [b.schema.get_field_index(k) for k in b.key]
            assert _zset.check_order(b.zset.data, b.zset.weights, b.key_hash, keypos), "a batch out of canonical order"
            if b._rh is not None:
                assert np.array_equal(b._rh, _zset.hash_columns(b.zset.data, list(range(len(b.schema))))), "row hashes"

    @property
    def num_rows(self) -> int:
        """Stored rows over all batches (a row may be counted once per batch holding it)."""
        return sum(len(b) for b in self._spine()) + sum(len(b) for b in self.pending)

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
        for b in self._read():
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
        batches = self._read() if len(change) else []
        if batches:
            change._check_compatible(batches[0], "match_weights")  # every batch has the trace's schema and key
            if self._index_sums(("row", (None,)), batches, change._view(), list(range(len(change.schema))),
                                change._row_hashes(), None, acc.reshape(-1, 1)):
                return acc  # invariant 11: one probe per row instead of a walk per batch
            view, schema = change._view(), change.schema
            rh = change._row_hashes()  # rows of one key are in row-hash order: gallop within a big group's run
            for b in batches:
                same = b.schema.equals(schema)  # a cast batch's hashes are not the change's: walk it plainly
                _zset.match_weights(view, None, None, b._view_as(schema), None, None, acc,
                                    rh if same else None, b._row_hashes() if same else None)
        return acc

    def match_and_insert(self, change: "IndexedZSet") -> np.ndarray:
        """:meth:`match_weights` of ``change`` (a consolidated batch on the trace's whole-row key), then
        ``insert(change)``: through a whole-row key index (invariant 11) one probe per row reads each row's weight
        and adds the change's (``KeyIndex.add(before=)``); else the walk and the insert. A WeightOverflowError (a row's
        weight leaving int64) leaves the trace unchanged (an index it broke is stale, rebuilt by a later read)."""
        def add(ix: Any) -> np.ndarray:
            before = np.zeros((len(change), 1), dtype=np.int64)
            ix.add(change._view(), None, list(range(len(change.schema))), change._row_hashes(), [-1], before=before)
            self.insert(change, indexed=ix)
            return before[:, 0]

        found = self.through_index(("row", (None,)), add) if len(change) else None
        if found is not None:
            return found
        old = self.match_weights(change)
        d = change.zset.weights
        new = old + d
        if bool((((old ^ new) & (d ^ new)) < 0).any()):
            raise WeightOverflowError("a row's accumulated weight overflows int64")
        self.insert(change)
        return old

    def key_sums(self, probe: pa.Table, probe_keys: list[str], khash: np.ndarray, rows: np.ndarray,
                 columns: list[str], view: object = None) -> np.ndarray:
        """The trace's weighted sums of int64 ``columns`` per probed key (:meth:`IndexedZSet.key_sums`, summed
        over every batch): one galloping C walk per batch, no rows copied, so the cost grows with the probe.
        ``view`` is a ``_zset.BatchView`` of ``probe`` the caller already holds (else one is built)."""
        from dbsp_core import _zset
        from dbsp_core.zset import _key_sums_positions

        acc = np.zeros((len(rows), len(columns)), dtype=np.int64)
        batches = self._read() if len(rows) else []
        if batches:
            ppos, cpos = _key_sums_positions(batches[0], probe, probe_keys, columns)
            if view is None:
                view = _zset.BatchView(probe)  # built once for every batch
            if self._index_sums(("key", tuple(columns)), batches, view, ppos, khash, rows, acc):
                return acc  # invariant 11: one probe per key
            for b in batches:
                b._key_sums(view, ppos, khash, rows, cpos, acc)
        return acc

    def key_weights(self, probe: pa.Table, probe_keys: list[str], khash: np.ndarray, rows: np.ndarray,
                    view: object = None) -> np.ndarray | None:
        """The trace's summed weight per probed key (row ``rows[i]`` of ``probe``, key hash ``khash[i]``) through
        the key index kept with ``keep_index((None,))`` (invariant 11): one probe per key. None when the trace
        keeps no such index, or its index is stale and not rebuilt yet, or the probe's key types differ from the
        trace's: the caller then reads the batches."""
        from dbsp_core import _zset
        from dbsp_core.zset import _column_positions

        spec = ("key", (None,))
        batches = self._read()
        acc = np.zeros((len(rows), 1), dtype=np.int64)
        if not batches or not len(rows):
            return acc[:, 0] if self.index_spec == spec else None
        ppos = _column_positions(probe.schema, probe_keys, "key_weights (probe)")
        if not self._index_sums(spec, batches, view if view is not None else _zset.BatchView(probe), ppos, khash,
                                rows, acc):
            return None
        return acc[:, 0]

    def consolidated(self) -> "IndexedZSet":
        """The whole trace as one consolidated batch (merges a copy; the trace is unchanged)."""
        from dbsp_core.zset import IndexedZSet

        acc = IndexedZSet.empty(self.schema, self.key)
        for b in self._read():
            acc = acc.merge(b)
        return acc

    def shard(self, shard_bits: int, shard: int) -> "IndexedZSet":
        """The consolidated state of one shard (invariant 7)."""
        from dbsp_core.zset import IndexedZSet

        acc = IndexedZSet.empty(self.schema, self.key)
        for b in self._read():
            bounds = b.shard_bounds(shard_bits)
            lo, hi = int(bounds[shard]), int(bounds[shard + 1])
            if hi > lo:
                acc = acc.merge(b.take(np.arange(lo, hi, dtype=np.int64)))
        return acc

    def drop_below(self, bounds: dict[str, int], force: bool = False) -> int:
        """Forget the rows whose column ``c`` is below ``bounds[c]`` for any ``c`` (invariant 8); returns the rows
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

        def kept(b: "IndexedZSet") -> "IndexedZSet | None":
            keep = None
            for col, bound in bounds.items():
                c = b.zset.data.column(col)
                if not pa.types.is_integer(c.type):
                    c = pc.cast(c, pa.int64())
                k = pc.fill_null(pc.greater_equal(c, pa.scalar(int(bound), pa.int64())), True)
                keep = k if keep is None else pc.and_(keep, k)
            n = pc.sum(pc.cast(keep, pa.int64())).as_py() or 0
            if n == len(b):
                return b
            if n == 0:
                return None
            return b.take(np.flatnonzero(np.asarray(keep.to_numpy(zero_copy_only=False), dtype=bool)))

        before = self.num_rows
        levels, self._levels = self._levels, []
        redo: list[tuple[int, IndexedZSet, int]] = []
        for lvl, level in enumerate(levels):
            m = level.merge
            if m is not None:
                a, b = kept(m.a[1]), kept(m.b[1])
                if a is m.a[1] and b is m.b[1]:  # untouched: the merge goes on where it was
                    while len(self._levels) <= lvl:
                        self._levels.append(_Level())
                    self._levels[lvl] = _Level((), m)
                else:
                    redo += [(e[0], x, e[2]) for e, x in ((m.a, a), (m.b, b)) if x is not None]
            redo += [(p, x, w) for p, x, w in ((p, kept(b), w) for p, b, w in level.loose) if x is not None]
        for p, b, w in sorted(redo, key=lambda e: e[0]):  # placement order kept (invariant 5)
            w = min(w, self.WORK_CAP * len(b))
            lvl = level_of(w)
            while len(self._levels) <= lvl:
                self._levels.append(_Level())
            level = self._levels[lvl]
            self._levels[lvl] = level._replace(loose=level.loose + ((p, b, w),))
        self.pending = [x for x in map(kept, self.pending) if x is not None]
        self._kept, self._grown = self.num_rows, 0
        if self._kept != before:  # rows left: the key index goes stale (invariant 11)
            self._changed()
            self._stale_index()
        return before - self._kept

    def replace(self, pieces: dict[int, list["IndexedZSet"]], removed: list["IndexedZSet"] | None = None) -> None:
        """Put pieces of batches in their place (invariant 9): ``pieces`` maps ``id(batch)`` of batches of
        :meth:`parts` to the batches that replace it, in order (an empty list drops it). Each piece must hold some
        of its batch's rows, consolidated and in index order (a zero-copy slice, :meth:`IndexedZSet.slice`);
        the trace's content loses the rows the pieces leave out. Merges nothing, reads no rows. ``removed``, when
        given, is exactly those rows (a shard cut's moved slices): a key index then subtracts them and stays
        current (invariant 11); without it the index goes stale.

        >>> import pyarrow as pa
        >>> from dbsp_core import ZSet
        >>> t = Trace(pa.schema([("k", pa.int64())]), ("k",))
        >>> t.insert(ZSet.from_rows([(i,) for i in range(8)], t.schema).index_by(["k"]))
        >>> b = t.batches[0]
        >>> t.replace({id(b): [b.slice(0, 3), b.slice(5, 8)]})
        >>> [len(x) for x in t.batches], t.merged_rows
        ([3, 3], 0)
        """
        if not pieces:
            return
        prev = self._changed()
        if self._kix is not None:
            if removed is None:
                self._stale_index()
            else:
                self._index_fold(removed, -1, prev)
        entries: list[tuple[int, "IndexedZSet", int]] = []  # every placed batch outside a merge that goes on
        merges: list[tuple[int, _Merge]] = []  # (level, merge) that go on
        for lvl, level in enumerate(self._levels):
            m = level.merge
            if m is not None:
                if id(m.a[1]) in pieces or id(m.b[1]) in pieces:
                    entries += [m.a, m.b]  # starts again from the pieces of its inputs
                else:
                    merges.append((lvl, m))
            entries.extend(level.loose)
        # one list in placement order, merge inputs included, renumbered from _placed on (pieces are new
        # batches and need numbers of their own, in their batch's place: invariant 5)
        items: list[tuple[int, int, tuple]] = [(e[0], 0, ("loose", e)) for e in entries]
        for lvl, m in merges:
            items.append((m.a[0], 0, ("a", lvl, m)))
            items.append((m.b[0], 1, ("b", lvl, m)))
        items.sort(key=lambda it: (it[0], it[1]))
        nxt = self._placed
        loose: list[tuple[int, "IndexedZSet", int]] = []
        newnum: dict[tuple[int, str], int] = {}
        for _, _, it in items:
            if it[0] == "loose":
                _, b, w = it[1]
                got = pieces.get(id(b))
                if got is None:
                    loose.append((nxt, b, w))
                    nxt += 1
                    continue
                _check_pieces(b, got)
                for x in got:
                    if len(x):
                        loose.append((nxt, x, min(w, self.WORK_CAP * len(x))))
                        nxt += 1
            else:
                newnum[(id(it[2]), it[0])] = nxt
                nxt += 1
        self._placed = nxt
        levels: list[_Level] = []

        def at(lvl: int) -> _Level:
            while len(levels) <= lvl:
                levels.append(_Level())
            return levels[lvl]

        for lvl, m in merges:
            at(lvl)
            levels[lvl] = _Level((), m.renumbered(newnum[(id(m), "a")], newnum[(id(m), "b")]))
        for e in loose:  # oldest first within each level
            lvl = level_of(e[2])
            levels[lvl] = at(lvl)._replace(loose=at(lvl).loose + (e,))
        self._levels = levels
        pending = []
        for b in self.pending:
            got = pieces.get(id(b))
            if got is None:
                pending.append(b)
            else:
                _check_pieces(b, got)
                pending.extend(x for x in got if len(x))
        self.pending = pending

    def __repr__(self) -> str:
        return f"Trace(key={self.key}, levels={self.levels()}, pending={len(self.pending)})"
