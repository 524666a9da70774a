"""A Trace in levels: the integrated, indexed state of a stateful operator, consolidated batches kept in levels by the work that went into them, merged a little on every insert.

Invariants (enforced here; :meth:`Trace.check` asserts 1, 2, 5 and 11; 10 is the merge thread's,
dbsp_core/trace/merge_thread.py, 11 the key index's, dbsp_core/trace/keyindex.py, and 12-13 the batch store's,
dbsp_core/trace/spill.py: a spilled batch is read in place from its file, and lookups ask its Bloom filter first):
  1. Every batch is a consolidated IndexedZSet on the trace's key, rows ascending by key hash; the trace's
     content is the sum of its batches: the loose batches of every level, both inputs of every merge in
     progress, and the pending batches (the same row may sit in several batches until they merge). Inserted
     and merged batches keep their row hashes (8 B a row), so merges order rows of meeting keys without hashing
     them, unless the trace is made with ``row_hashes=False``: then no batch keeps them (merges hash the rows
     whose keys meet and differ, csrc/merge.h), for state that is read by key only, whose memory counts more
     than its merges' hashing (a linear aggregate's partial totals, dbsp_core/operators/aggregate.py).
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
  5. A cleared trace is fresh (a checkpoint being restored): its inserts stay pending, in order, and merge
     nothing; settle() places pending batches without merging, so a restore that inserts the batches of
     ``parts()`` and settles gets the same batches back (``parts()`` lists placed batches in the order they
     were placed). Freshness ends at the first read, which places the pending batches (no merge work: later
     inserts pay for their merges); while no read comes, an insert beyond MAX_PENDING pending batches inserts
     the oldest one as above. A new trace is not fresh. Freshness protects the restore only (the saved batches
     back unmerged, in their order, settled or pending as saved); once a trace's load has returned, ending it
     changes no batch and no content, so the batch store ends it too (:meth:`Trace.end_fresh`) when its budget
     needs the pending batches spilled (spill.py invariant 12: between steps, never inside a load, which calls
     it only once a trace is restored). Placing them must end freshness, as a read does: placed and still fresh,
     a trace inserted into and never read would place every step's batch loose, never merging (no insert would
     pay fuel below MAX_PENDING), so invariant 3's bound on its batches would not hold.
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
 14. Deferred work (what a live rescale's wave does, dbsp_core/runtime/migrate.py, so that its pause of the steps
     costs the rows it cuts and places, not their merges): ``insert(batch, defer=True)`` places the batch and pays
     no merge work; its rows are owed (``deferred[0]``). ``insert(..., defer=True)`` and ``replace(..., defer=True)``
     fold nothing into a key index either: the index is parked with the folds it is owed (trace invariant 11,
     ``deferred[1]``). :meth:`Trace.pay_deferred` (P) pays up to P rows of it: P owed rows folded into the parked
     index (which serves reads again once nothing is owed), and the fuel of P / FUEL owed rows (P more merge input
     rows per level), so a payment costs about P rows per level whatever was moved; owed fuel is due no more once
     it has nothing to do (no merge in progress, no level with two loose batches). The live rescale pays it in
     small pauses between the steps after its last wave (dbsp_core/runtime/rescale.py invariant 7), and every
     plain insert of n rows pays ``DEFER_RATE * n`` besides its own invariant-3 fuel (so a trace left owing
     work, by a rescale that failed, say, still pays it). The work is the same, only later, in bounded pieces;
     the content never depends on it (a parked index is not read, and until the merges are paid a level may
     hold more loose batches than invariant 3 bounds: reads read them all).
  15. Tiered levels under a budget (spill.py invariant 12): a level whose two oldest loose batches would merge on disk
     (they do not fit what the budget has left, or one of them is spilled: ``BatchStore.on_disk``) merges nothing
     until it holds FAN_IN loose batches, then merges the FAN_IN oldest in one pass (the k-way cursor, csrc/merge.h
     invariant 4), whose output's work (their summed work, capped as invariant 2 says) lands about log2(FAN_IN)
     levels up: a row is written once per log2(FAN_IN) levels above the budget instead of once per level (two-way
     merges of spilled levels rewrite both inputs at each level). Such a level holds at most 2 * FAN_IN loose batches
     and a merge of FAN_IN (its merge, paid FUEL per inserted row as in invariant 3, finishes before FAN_IN more arrive;
     with a merge thread, invariant 10, it is due when FAN_IN more are loose), so a read of some keys touches
     O(levels x FAN_IN) spilled batches, each asked through its Bloom filter and fence first (invariant 12). Levels
     in memory, and traces without a store, merge two at a time as before. The content never depends on it.
     A tiered merge starts once its FAN_IN inputs are spilled (or the level holds 2 * FAN_IN loose batches): a
     merge pins its inputs' buffers until it ends, so one started from batches in memory would keep them beyond
     the budget for the whole merge; loose ones the store's next enforce spills (the highest levels first). But
     for one case (``FROM_MEMORY``, :meth:`Trace._from_memory`): when the insert that brings the level its FAN_IN-th
     loose batch pays fuel enough to merge them all, the merge starts at once with its inputs in memory and ends
     within that insert (never handed to the merge thread), so it pins nothing past the insert, and those inputs
     are written once, in its output, instead of once alone and again in it (a budget that holds FAN_IN of a
     level's step batches: Nexmark q4 at 20M events under 10%, 2.24x -> 1.86x the final state written). While the
     store holds (``BatchStore.holding``: a step run in at least FAN_IN pieces, dbsp_core/runtime/substep.py) a
     tiered level takes HOLD_FAN_IN (64, the k-way cursor's bound) loose batches instead: the pieces' batches stay
     loose files, each written once, and at the step's end the executor merges each trace's loose batches placed
     by the pieces in one pass (:meth:`Trace.compact_spilled` with ``since``), so a load in pieces writes its
     rows about twice, not FAN_IN at a time and then again by the compaction after the load.
     The price is reads: a step's lookups ask up to 2 * FAN_IN batches per tiered level instead of about one, so
     when a bulk load is over (``EmbeddedExecutor.settle_merges``: :meth:`Trace.compact_spilled`) the spilled loose
     batches merge into one, in one k-way pass (a rewrite of the spilled state, once), and the small steps that
     follow read one spilled batch. Without that call the tiered files stay until their levels fill.
  16. Background compaction (with a merge thread, invariant 10): what ``compact_spilled`` does, off the stepping
     thread. :meth:`Trace.start_compaction`, on the inserting thread or between steps (the executor calls it at the end
     of a step once a compaction is due and the merge thread is idle: runtime/embedded.py ``_compact_after_load``),
     takes the batches ``compact_spilled`` would (the loose ones of the levels with no merge in progress that are
     spilled or on a tiered level: those in memory are pinned until it ends, bytes the budget counted already and
     that its enforce then leaves for other batches) as the inputs of one k-way merge, parked in the merge
     slot of the level of their summed work (or the first free one above it) and handed to the merge thread, which
     advances it only while no level merge is handed over (level merges are what steps wait for: it yields between
     chunks when one may have come) and, once its cursor is done, makes the output its batch file there, in place when
     built on disk (``_Merge.seal``). Until installed it is a merge like any other: its inputs are read by steps and
     named by checkpoints (``parts``), a merge slot of one level is taken (that level's loose batches wait, and pay
     its fuel if they reach their fan-in: invariant 3's due merge), shard cuts and drop_below restart it from its
     inputs, a rollback keeps it. The install (at a step's read, or between steps) replaces the inputs by the output
     in one change of the levels, so a checkpoint names the old batches or the new one, never a mix, and the inputs'
     files go when their batch objects do (spill.py invariant 13: not before a checkpoint that does not name them has
     committed). A compaction whose merge or seal fails is abandoned when installed: its inputs go back loose at their
     levels, in placement order, the store counts ``compactions_abandoned``, and nothing else changes (its output
     file, if any, goes with its batch). The content never depends on it.
  17. Compaction in slices (no merge thread: ``background_merge`` off, as when the workers take every core): the same
     compaction (invariant 16's, started by :meth:`Trace.start_compaction` with no thread, handed nowhere) is paid by
     the steps, as a level merge is by fuel (invariants 3 and 14): at each step's end the executor
     (runtime/embedded.py ``_compact_after_load``) calls :meth:`Trace.advance_compaction` with what is left of the
     step's slice, ``max(COMPACT_SLICE, COMPACT_FUEL * rows)`` input rows for a step that pushed ``rows`` rows, shared
     by every trace compacting (the first unfinished one first); once its last row is merged, the slices write the
     output's file (``_Merge.seal``: batchfile.py invariant 8, the in-place write in pieces: page CRCs, Bloom filter
     and fence, the sections, then header, footer and commit), ``SEAL_FUEL`` output rows' worth of that write per
     slice row (what the merge left of the slice that merged the last row, then whole slices), and the slice that
     commits the file installs it. So a step pays at most one slice of compaction rows or of the file's write (the
     commit's fsync aside), never a pass over the output, and a compaction of R rows is installed within
     ceil(R / COMPACT_SLICE) steps plus about 3.7 R / (COMPACT_SLICE x SEAL_FUEL) for its file's write (rows of
     32-40 bytes; measured ~8% more steps). Inserts leave it alone (``_merge_levels`` advances it by fuel, its file's
     write included, only when its level's loose batches reach their fan-in, as a due merge). Until installed its inputs are read, as in invariant 16; a failed
     slice abandons it. The merge thread (invariant 10) and the slices advance a compaction by one body,
     ``_Merge.pay``. The page faults that allocate its scratch output's 2 MiB folios are taken ahead of the slices by
     the prefault thread (prefault.py: ``_Merge`` asks it at its start and after each piece; a piece populates
     itself only what the thread has not reached, as the first slice, paid right after the start, may), so a slice
     does not pay a folio's allocation (up to 36 ms of system time measured on a loaded host).
 18. Held levels (``hold``, set per trace: an aggregate's totals, a distinct's input, a count_distinct's pairs;
     ``DBSP_TOTALS_HOLD``): a trace without a batch store whose reads of keys go through a current key index (invariant
     11: a step never walks its batches) merges a level's loose batches ``2 ** j`` at a time, the largest ``2 ** j <=
     hold`` whose output (about j levels up: their summed work) stays below the trace's highest non-empty level, in one
     k-way pass (csrc/merge.h invariant 4), as a tiered level does (invariant 15, without its spill rules: nothing is
     pinned against a budget), else two. Every step's batch is then rewritten about once per j levels on its way up
     instead of once per level (measured, 1k-row steps into 100k groups, hold 8: 13.9k -> 6.7k merge input rows a step;
     instructions -9%: a k-way pass costs more a row), and such a level holds up to 2 * hold loose batches, which only
     an index rebuild, a checkpoint, a shard cut or a view read reads. ``hold_unread`` (the sides of joins of every
     kind, a materialized view) does the same while the trace is not read: UNREAD_INSERTS inserts or more since its last
     read (:meth:`_read`, which every walk, lookup and view read passes; a checkpoint's ``parts`` does not); the first
     read after such a run walks the held loose batches, and the merges after it take two. The content, the placement
     order and every reader's view of it are invariant 1's, whatever the fan-in; under a store (and with no current
     index, or read within UNREAD_INSERTS inserts) the fan-in is invariant 15's or 2, as for every trace.
     ``hold_keyed`` (a min/max's value multisets, operators/aggregate.py invariant 11) holds whatever its reads: every
     read of such a trace is of a few keys (the groups whose extreme a deletion reached), a seek per key in each batch,
     so the held batches cost a read a few seeks more while every insert's batch is rewritten j times fewer.
 19. Totals kept per key (``keep_totals_per_key``, a linear or min/max aggregate's totals: a key index of its integer-
     like columns, a min/max's with "valid" flags that a sync turns back into nulls; ``DBSP_TOTALS_PER_KEY=0`` turns
     it off; dbsp_core/trace/keyindex.py ``PerKeyTotals``): the key index is the state and the batches a view of it,
     synced on demand. A step that stored its groups' totals in the index (``store_totals``) inserts no batch: it
     records each of its keys not dirty yet, once, with the totals the batches hold for it (its -1 row, or none). The
     content is the batches plus, per dirty key, its index totals less its recorded ones; every reader of the batches
     syncs first (``_levels``, so ``_read``, ``parts``, ``shard``, views, walks, ``check``; and ``insert``,
     ``replace``, ``drop_below``, a stale or dropped index): one consolidated, key-hash-sorted batch of the dirty
     keys' recorded totals (-1) and index totals (+1), where they differ, inserted as any batch. So between reads a
     step costs its groups' probes and a probe of the dirty-key index, and no merge. Only without a batch store (a
     trace that joins one syncs and keeps batches from then on: spill.py invariant 17 weighs and may drop the index).
     An index that cannot grow half way through a step (memory, size limits) loses nothing: the step's store is undone
     in C (csrc/linrun.h invariant 4), or the dirty-key index's adds are (csrc/keyindex.h invariant 4), the trace
     syncs from its whole index, drops it (an IndexDroppedWarning, as without totals per key) and keeps its totals in
     batches from then on; the step completes through them (``PerKeyTotals.pk_fallbacks`` counts it). Only an overflow
     half way, or an undo that must put back a removed string key with no arena room, still breaks the index: a
     DbspError says so. A rollback capture marks the trace, and every change of its key index in place is then logged
     and undone by the restore (rollback.py invariant 3). Size figures (metrics, the profile, the autoscaler's) sync
     nothing: they add ``unsynced_size`` (the rows the next sync would insert at most, from a snapshot of the records,
     no index probe) to the batches'. No batch store is joined while totals are kept per key, so a memory budget never
     has unsynced totals to weigh: its accounting of the index is spill.py invariant 17's.
"""

from __future__ import annotations

import logging
import weakref
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa

from dbsp_core.errors import WeightOverflowError
from dbsp_core.trace.keyindex import KeyIndexed, PerKeyTotals
from dbsp_core.trace import prefault, spillread
from dbsp_core.trace.merge_thread import MergeThread, SharedMerge, current_merge_thread
from dbsp_core.trace.groupedbatch import is_grouped
from dbsp_core.trace.groupedmerge import StreamedMerge, streams
from dbsp_core.trace.spill import batch_bytes, current_batch_store

_log = logging.getLogger("dbsp_core.trace")

if TYPE_CHECKING:
    from dbsp_core.zset import IndexedZSet

__all__ = ["Trace", "level_of", "unique_sorted"]


def unique_sorted(hashes: np.ndarray) -> np.ndarray:
    """Distinct values of an ascending uint64 array (linear time): the key hashes to ask :meth:`Trace.lookup` for."""
    if len(hashes) < 2:
        return hashes
    keep = np.empty(len(hashes), dtype=bool)
    keep[0] = True
    np.not_equal(hashes[1:], hashes[:-1], out=keep[1:])
    return hashes[keep]


def level_of(work: int) -> int:
    """The level of a batch with ``work`` inserted rows: ``ceil(log2(work))`` (invariant 2).

    >>> [level_of(w) for w in (1, 2, 3, 4, 5, 1024, 1025)]
    [0, 1, 2, 2, 3, 10, 11]
    """
    return (work - 1).bit_length()


class _Merge:
    """A merge in progress of two (or, on a tiered level, more: invariant 15) batches of one level; its inputs stay
    readable until it finishes."""

    __slots__ = ("inputs", "work", "cursor", "_out", "shared", "store", "dropped", "scratch", "compaction", "unchecked")

    def __init__(self, inputs: tuple[tuple[int, "IndexedZSet", int], ...], store: Any = None,
                 row_hashes: bool = True, compaction: bool = False) -> None:
        from dbsp_core.zset import merge_cursor

        self.compaction = compaction  # a background compaction of loose batches of several levels (invariant 16)
        # a compaction's inputs read from lazily opened files (spill.py invariant 14): checked by its first step, on
        # the merge thread, not by the stepping thread that starts it
        self.unchecked: tuple = tuple(e[1] for e in inputs) if compaction and store is not None else ()
        self.inputs = tuple(inputs)  # (placement number, batch, work) each, oldest first
        self.work = sum(e[2] for e in self.inputs)
        # the merge cursor: the resumable C merge (csrc/merge.h; k-way for more than two inputs); its output in a
        # scratch file when the batch store says it does not fit what the budget has left (spill.py invariant 12)
        self.store = store
        batches = [e[1] for e in self.inputs]
        where = store.merge_dir(batches) if store is not None else None
        if store is not None and streams(batches):  # a grouped input: its groups read a window at a time, the
            # output written as it goes (groupedmerge.py; spill.py invariant 18)
            # (a level merge's through a VFS whose writes may leave the step only, as :meth:`seal` makes its file:
            # a crash test's fault VFS numbers the step's operations in order, and a merge thread may run this;
            # there the output is kept in memory and spilled by an enforce; a compaction's always)
            self.cursor = StreamedMerge(batches, row_hashes, store, on_disk=where is not None and (
                compaction or store.vfs in store.ASYNC_VFS))
        else:
            room = store.merge_room(batches[0]) if where is not None else 0  # (its batch file's header, metadata)
            self.cursor = merge_cursor(*batches, row_hashes=row_hashes, spill_dir=where, prefix=room)  # (inv. 1)
        prefault.ask(self.cursor)  # a scratch output's first pages faulted off this thread (prefault.py)
        self._out: IndexedZSet | None = None
        self.shared: SharedMerge | None = None  # set when handed to a MergeThread (invariant 10)
        self.dropped = 0  # input rows consumed when the output's pages last left the process (store.merge_pages_out)
        self.scratch: tuple = ()  # drop() of each input read from a merge's scratch file (not spilled yet: Trace._work)

    def renumbered(self, numbers: list[int]) -> "_Merge":
        """The same merge (sharing its progress) with its inputs at placement numbers ``numbers``: a new object, so a
        shallow copy of the trace taken before still sees the old numbers."""
        m = object.__new__(_Merge)
        m.inputs = tuple((p,) + e[1:] for p, e in zip(numbers, self.inputs))
        m.work, m.cursor, m._out, m.shared, m.store = self.work, self.cursor, self._out, self.shared, self.store
        m.dropped, m.scratch = self.dropped, self.scratch
        m.compaction, m.unchecked = self.compaction, self.unchecked
        return m

    def step(self, budget: int) -> int:
        """One cursor step of at least ``budget`` input rows (or the rest); under a batch store, in pieces of at most
        DROP_ROWS after which the pages written to a scratch output and read from spilled inputs leave the process
        (spill.py invariant 12), so a merge holds about one piece of them whatever its size. The caller holds the
        shared lock, if any."""
        if self.store is None:
            return self.cursor.step(budget)
        if self.unchecked:  # (a compaction: every row is read)
            for b in self.unchecked:
                self.store.check(b)
            self.unchecked = ()
        used = 0
        while True:
            rows = min(max(budget - used, 1), self.DROP_ROWS)
            prefault.before_step(self.cursor, rows)  # (pieces the prefault thread has not reached yet)
            used += self.cursor.step(rows)
            prefault.ask(self.cursor)  # its next pieces' faults taken off this thread (prefault.py)
            self.store.merge_pages_out(self)
            for drop in self.scratch:  # the pages read of an input still in its scratch file leave too
                drop()
            if used >= budget or self.cursor.done:
                return used

    DROP_ROWS = 131_072  # input rows between drops of a merge's pages under a budget (the merge thread's CHUNK)

    def advance(self, budget: int, seal_fuel: int = 1) -> int:
        """Merge at least ``budget`` more input rows (or the rest) on this thread; returns the rows merged. A
        compaction (invariant 16) is paid as a step's slice pays it (:meth:`pay`: its file written in pieces of what
        the budget leaves, ``seal_fuel`` output rows' worth a row; a failure abandons it)."""
        sh = self.shared
        if sh is None:
            return self.step(budget) if not self.cursor.done else 0
        if self.compaction:
            return self.pay(budget, seal_fuel, count=False)[0]
        with sh.lock:
            if sh.error is not None:
                raise sh.error
            return self.step(budget) if not self.cursor.done else 0

    def pay(self, budget: int, seal_fuel: int | None = None, catch: type = Exception, count: bool = True
            ) -> tuple[int, int, bool]:
        """Advance a merge handed over (``shared``), under its lock, as the merge thread (invariant 10) and a step's
        slice of a compaction (invariant 17) do: merge at least ``budget`` more input rows, an error (of ``catch``)
        kept in ``shared.error`` (the inserting thread raises it when it needs a level merge; a compaction is
        abandoned when installed); once every row is merged, :meth:`seal` it: whole with ``seal_fuel`` None, else
        with what the merge left of ``budget``, ``seal_fuel`` output rows' worth of its file's write for each row.
        A level merge is sealed only by the call whose rows finished it (one the inserting thread finished by fuel
        is its install's), a compaction by whichever call finds it unsealed. The rows merged are added to
        ``shared.merged`` (``count``: the trace adds them when installed). Returns (input rows merged, budget used:
        all of it once the seal had a share, whether work is left)."""
        sh = self.shared
        merged = paid = 0
        with sh.lock:
            stepped = sh.error is None and not self.cursor.done
            if stepped:
                try:
                    merged = paid = self.step(budget)
                except catch as exc:
                    sh.error = exc
                if count:
                    sh.merged += merged
            if (sh.error is None and self.cursor.done and sh.out is None and sh.failed is None
                    and (stepped or self.compaction)):
                if seal_fuel is None:
                    self.seal()
                elif budget > paid:
                    self.seal((budget - paid) * seal_fuel)
                    paid = budget
            more = sh.error is None and sh.failed is None and sh.out is None and (
                not self.cursor.done or self.compaction)
            return merged, paid, more

    def finished(self, wait: bool = True) -> bool:
        """Whether every input row is merged (with ``wait=False``: False while the merge thread holds it), and for a
        compaction its output sealed (:meth:`seal`: its file written, perhaps in pieces); a compaction that failed
        counts as finished (its install abandons it, invariant 16)."""
        sh = self.shared
        if sh is None:
            return self.cursor.done
        if not sh.lock.acquire(wait):
            return False
        try:
            if sh.error is not None:
                if self.compaction:
                    return True
                raise sh.error
            if self.compaction:
                return sh.failed is not None or sh.out is not None
            return self.cursor.done
        finally:
            sh.lock.release()

    def abandoned(self) -> BaseException | None:
        """What made a compaction fail (its cursor's step or its seal), None when it did not (invariant 16)."""
        sh = self.shared
        if not self.compaction or sh is None:
            return None
        return sh.failed or sh.error

    @property
    def sealed(self) -> bool:
        """Whether the merge thread built its output (:meth:`seal`); kept in the shared part, so a renumbered copy
        (:meth:`renumbered`) sees it too."""
        return self.shared is not None and self.shared.out is not None

    def seal(self, budget: int | None = None) -> None:
        """Under the shared lock, once every input row is merged (invariants 10 and 17): build the output and, when it
        was built in a scratch file, make it its batch file (``BatchStore.spill_output``: in place, with its page
        checksums, filter and fence), so that the install only swaps batches. A level merge's output is made its
        file here (on the merge thread) only through a VFS whose writes may leave the step (spill.py ``ASYNC_VFS``: a
        crash test's fault VFS numbers the step's operations in order), a compaction's always. ``budget`` (a
        compaction paid in slices by the steps, invariant 17): only about that many output rows' worth of the write
        now (``BatchStore.output_writer``, batchfile.py invariant 8: the writer kept in the shared part, so the next
        call goes on), the output sealed by the call that finishes it; None: all of it. Never raises: a compaction
        that fails is abandoned when installed (``failed``); a level merge's output left unwritten is spilled by its
        install as before, which raises what fails again."""
        sh = self.shared
        if sh is None or sh.out is not None or sh.failed is not None or not self.cursor.done:
            return
        st = self.store
        try:
            out = self.result()
            w = sh.writer
            if w is None:
                if not (len(out) and st is not None and self.cursor.mapping is not None
                        and (self.compaction or st.vfs in st.ASYNC_VFS)):
                    sh.out = out
                    return
                w = st.output_writer(out, self.cursor) if budget is not None else None
                if w is None:  # whole (or not in place: the copy, whole)
                    st.spill_output(out, self.cursor)
                    if self.compaction:
                        st.count("bytes_compacted", st.file_size(out))
                    sh.out = out
                    return
                sh.writer = w
            if not w.advance(None if budget is None else budget * w.row_bytes):
                return
            sh.writer = None
            st.output_written(out, w)
            if self.compaction:
                st.count("bytes_compacted", w.size)
        except BaseException as exc:  # noqa: BLE001 - kept for the install (see above)
            if sh.writer is not None:
                sh.writer.abort()
                sh.writer = None
            if self.compaction:
                sh.failed = exc
            return
        sh.out = out

    def result(self) -> "IndexedZSet":
        """The finished merge's output (the same object every time: a rolled-back trace may finish it again)."""
        from dbsp_core.zset import merged

        if self._out is None:
            sh = self.shared
            if sh is not None and sh.out is not None:
                self._out = sh.out
            elif isinstance(self.cursor, StreamedMerge):
                self._out = self.cursor.output()
            else:
                self._out = merged(self.inputs[0][1], self.cursor)
        return self._out


def _check_pieces(batch: "IndexedZSet", pieces: list["IndexedZSet"]) -> None:
    """Pieces of ``batch`` (:meth:`Trace.replace`) hold at most its rows, on its key (a cheap guard, no row read)."""
    if sum(len(x) for x in pieces) > len(batch) or any(x.key != batch.key for x in pieces):
        raise ValueError(f"Trace.replace: pieces of a {len(batch)}-row batch on {batch.key} hold "
                         f"{[len(x) for x in pieces]} rows on {[x.key for x in pieces]}")


_PLACED = itemgetter(0)  # a loose entry's placement number


class _Level(NamedTuple):
    """The batches of one level: loose ones (placement number, batch, work), oldest first, and a merge.

    Immutable (a change replaces the level), so a shallow copy of the trace's attributes is a snapshot of it:
    a failed step or staged attempt is rolled back that way (dbsp_core/runtime/rollback.py). A merge's progress
    is not part of the content (its inputs are), so a rolled-back trace may find its merges further along."""

    loose: tuple = ()
    merge: _Merge | None = None


class Trace(KeyIndexed, PerKeyTotals):
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
    FAN_IN = 8  # loose batches one merge of a tiered level takes (invariant 15): each row is rewritten once per
    # log2(FAN_IN) levels above the budget instead of once per level, a lookup reads up to 2 * FAN_IN batches there
    # (measured, 20M events under a 10% budget: 4 wrote 2.45-2.60x the final state, 8 wrote 1.71-2.24x, less CPU)
    FROM_MEMORY = True  # a tiered merge whose inputs are not all spilled starts when this insert's fuel finishes it
    # (invariant 15): its inputs in memory are then written once, in its output, and never alone
    HOLD_FAN_IN = 64  # a tiered level's fan-in while the store holds (a step run in pieces, invariant 15): the
    # pieces' batches stay loose files, merged once at the step's end (compact_spilled(since=)); the k-way cursor's bound
    COMPACT_SLICE = 16_384  # compaction input rows a step pays at least without a merge thread (invariant 17): about a
    # 1k-row step's own CPU on a spilled distinct (a k-way merge of ~5M rows/s: ~3 ms)
    COMPACT_FUEL = 16  # and per row the step pushed, when more: a slice is max(COMPACT_SLICE, COMPACT_FUEL * rows)
    SEAL_FUEL = 48  # output rows' worth of its file's write (batchfile.py invariant 8: page CRCs, filter and fence,
    # sections, each byte of work weighed by its cost) a compaction's slice pays per row once its merge is done
    # (invariant 17): measured, a 16,384-row slice of it costs about what a slice of the merge does (~2-3 ms), and
    # the write takes ~8% more steps than the merge
    compacted_rows = 0  # (set per instance by __init__)
    _placed = 0  # placement numbers handed out (set per instance by __init__; here for a trace built without it)
    MAX_PENDING = 64  # a fresh trace's pending batches beyond which it inserts the oldest (invariant 5)
    PRUNE_MIN = 4096  # rows inserted before drop_below scans at all (invariant 8)
    DEFER_RATE = 2  # rows of deferred work (index folds; merge input rows per level) an insert pays per row it
    # inserts (invariant 14): the live rescale pays the rest between steps, so a small step stays small
    row_hashes = True  # whether its batches keep their row hashes (invariant 1; a trace object made without
    # __init__, as a restore may make one, keeps them)
    SPILL_AT_WORK_END = True  # a merge output built on disk is spilled at the end of the _work that installed it
    # (one merged away by then is never written), else when installed
    _unspilled: "list | None" = None  # those outputs, during a _work
    _keeps: "tuple | None" = None  # the last _filters: (the key hashes, its tests, their matrix, counts per batch
    # and batch ids), for a join's narrowed
    _taken: "tuple | None" = None  # the last narrowed take of every batch's rows: (change, tests, {id(b): part})
    NARROW_TOGETHER_MAX = 1 << 16  # change rows up to which they are taken together (a bigger step: per batch,
    # so that it holds no more than one batch's narrowed change at a time besides the parts its walks made)
    FILTERS_MAX = 1 << 22  # a read's Bloom tests in one call up to this many (batch, hash) pairs (a byte each, kept
    # until the next read's): the per-batch Python they save matters for small steps, a big one tests per batch
    held_merges = 0  # merges of more than two batches started on a held level (invariant 18), for tests
    hold = 0  # invariant 18: the fan-in up to which the low levels of a trace read through its key index merge (0:
    # two at a time, as every trace); set per instance (a linear aggregate's totals: operators/aggregate.py)
    hold_unread = 0  # invariant 18: the same fan-in while the trace is not read (UNREAD_INSERTS inserts since its
    # last read); set per instance (a join's sides, whose reads come only with the other side's changes)
    UNREAD_INSERTS = 8
    hold_keyed = 0  # invariant 18: the same fan-in whatever the reads, for a trace read only by a few keys at a time
    # (a min/max's value multisets); set per instance
    _unread = 0  # inserts since the last read (invariant 18)
    INLINE_MERGE = 4096  # work (input rows) up to which a merge is not handed to the merge thread (invariant 10):
    # handing over a small step's merge (lock, wake-up, GIL hand-offs) cost more than merging it by fuel here
    # (1k-row steps on 1M rows, 600 steps alternated twice: mean 5-15% lower for distinct, group_by and join)

    def __init__(self, schema: pa.Schema, key: tuple[str, ...], row_hashes: bool = True) -> None:
        self.schema = schema
        self.key = tuple(key)
        self.row_hashes = row_hashes  # its batches keep their row hashes (invariant 1)
        self.merged_rows = 0  # input rows consumed by merges, ever (counts, not timings, for tests and benchmarks)
        self.compacted_rows = 0  # of which by advance_compaction's slices (invariant 17)
        self.inserted_rows = 0  # rows inserted, ever
        self._by_level: list[_Level] = []
        self.pending: list[IndexedZSet] = []
        self._fresh = False
        self._placed = 0  # placement numbers handed out
        self._grown = 0  # rows inserted since drop_below last scanned (amortization only, not state)
        self._kept = 0  # rows it kept then
        self._hand_overs = 0  # hand-overs to a MergeThread (invariant 10: it drops a trace only when unchanged)
        self._handed = False  # merges were handed to a MergeThread: the next read installs finished ones
        self._owed = 0  # rows placed by deferred inserts whose merge fuel is not paid yet (invariant 14)
        self._init_key_index()  # the content's token and no key index (invariant 11)
        self._init_per_key()  # totals kept in the batches (invariant 19 off)
        self._store: Any = None  # the BatchStore keeping this trace's batches under a memory budget (invariant 12)

    def clear(self) -> None:
        """Drop all state; the trace is fresh (invariant 5): what a restore does before inserting saved batches."""
        self._by_level = []
        self.pending = []
        self._fresh = True
        self._pk_rec, self._pk_dirty = [], None  # (invariant 19) the content is gone, the dirty keys' with it
        self._changed()
        self._stale_index()

    # ---- writing ----

    def insert(self, batch: "IndexedZSet", indexed: Any = None, defer: bool = False) -> None:
        """Add a consolidated indexed batch (same key): place it, then pay its share of merge work (invariant 3)
        and of the work deferred before (invariant 14). ``indexed``: the key index from :meth:`index_for_update`,
        which the caller already brought up to this batch (invariant 11: it then matches the new content); else an
        index kept is updated here. ``defer``: place it only; its merge work and index fold are owed, paid by later
        inserts (invariant 14)."""
        if self._pk_rec and not self._pk_syncing:  # invariant 19: the batches up to date first
            self._pk_sync()
        if len(batch) == 0:
            if indexed is not None:
                self.index_done(indexed)
            return
        if self.row_hashes and not is_grouped(batch):  # (a format-2 file holds them: spill.py invariant 18)
            batch._row_hashes()  # kept with the batch: merges order meeting keys without hashing (csrc/merge.h)
        if self._store is None:
            self._attach()
        prev = self._changed()
        if indexed is not None:
            if indexed is self._kix:
                indexed.token = self._token
        elif defer or self._kix_parked is not None:
            self._owe_folds([batch], 1, prev)
        elif self._kix is not None:
            self._index_fold([batch], 1, prev)
        self.inserted_rows += len(batch)
        self._unread += 1  # (invariant 18)
        self._grown += len(batch)
        if self._fresh:
            self.pending.append(batch)
            if len(self.pending) <= self.MAX_PENDING:
                return
            batch = self.pending.pop(0)
        self._place(batch, len(batch))
        if defer:
            self._owed += len(batch)
            return
        self._work(len(batch) + self._pay(self.DEFER_RATE * len(batch)))
        self._settle_owed()

    def pay_deferred(self, rows: int) -> bool:
        """Pay up to ``rows`` rows of the work deferred inserts and cuts left (invariant 14): that many owed folds
        into the parked key index and that many merge input rows per level. Call it where an insert may run (on
        the inserting thread, or between steps). Returns whether work is still owed."""
        if self._owed or self._kix_parked is not None:
            self._work(self._pay(rows))
            self._settle_owed()
        return bool(self._owed or self._kix_parked is not None)

    def _settle_owed(self) -> None:
        """Owed merge fuel is due no more once it has nothing to do (invariant 14): no merge in progress and no
        level with two loose batches to start one."""
        if self._owed and all(not self._ready(level) and level.merge is None for level in self._by_level):
            self._owed = 0

    def _pay(self, rows: int) -> int:
        """Fold up to ``rows`` owed rows into a parked key index; returns the owed rows whose merge fuel (FUEL per
        row, so about ``rows`` merge input rows per level) the caller's :meth:`_work` pays now (invariant 14)."""
        if self._kix_parked is not None and rows > 0:
            self._pay_folds(rows)
        extra = min(self._owed, -(-rows // self.FUEL)) if self._owed and rows > 0 else 0
        self._owed -= extra
        return extra

    def settle(self) -> None:
        """Place the pending batches into their levels, merging nothing (invariant 5: a restore inserts the batches
        of :meth:`parts` and settles; merges go on as later inserts pay for them)."""
        for b in self.pending:
            self._place(b, len(b))
        self.pending = []

    def end_fresh(self) -> bool:
        """End freshness (invariant 5): place the pending batches, merging nothing (later inserts pay for their
        merges), as a first read does; returns whether the trace was fresh. Call it on the inserting thread or
        between steps, never inside a restore (between :meth:`clear` and the last insert of the saved batches)."""
        if not self._fresh:
            return False
        self.settle()
        self._fresh = False
        return True

    def _place(self, batch: "IndexedZSet", work: int) -> None:
        lvl = level_of(work)
        while len(self._by_level) <= lvl:
            self._by_level.append(_Level())
        level = self._by_level[lvl]
        self._by_level[lvl] = level._replace(loose=level.loose + ((self._placed, batch, work),))
        self._placed += 1

    def _work(self, rows: int) -> None:
        """Advance every level's merge by FUEL * rows input rows, lowest level first (invariant 3); with a
        MergeThread in force, start merges and hand them over, paying fuel only for due ones (invariant 10)."""
        fuel = max(1, int(self.FUEL * rows)) if rows else 0
        mt = current_merge_thread()
        self._unspilled = []
        try:
            self._merge_levels(fuel, mt)
        finally:
            self._spill_outputs()

    def _spill_outputs(self) -> None:
        """Spill the merge outputs built on disk by this work that no merge of the level above took in and finished
        meanwhile (spill.py invariant 12); those merged away are never written."""
        outputs, self._unspilled = self._unspilled, None
        if not outputs:
            return
        alive = {id(b) for b in self._levels()}
        for out, cursor, store in outputs:
            if id(out) in alive:
                store.spill_output(out, cursor)
            else:
                store.stats["outputs_never_written"] += 1

    def _merge_levels(self, fuel: int, mt: Any) -> None:
        """:meth:`_work`'s merging, its outputs built on disk left to spill to :meth:`_spill_outputs`."""
        handed = False
        lvl = 0
        while lvl < len(self._by_level):  # a finished merge may add a level above
            level = self._by_level[lvl]
            if level.merge is None and len(level.loose) < 2:  # idle (most levels of a step): nothing to start or
                lvl += 1  # advance, as the loop below finds, without its budget and reads
                continue
            budget = fuel
            while True:
                level = self._by_level[lvl]
                m = level.merge
                if m is None:
                    if len(level.loose) < 2 or not self._ready(level, budget):  # (a fan-in is 2 at least)
                        break
                    m = self._start_merge(lvl, mt is not None)
                    level = self._by_level[lvl]
                if (m.shared is not None and (mt is not None or m.compaction)
                        and len(level.loose) < self._fan_in(level)):  # not due: the merge thread advances it, or a
                    # compaction without one is paid in slices between steps (invariant 17)
                    if not m.finished(wait=False):
                        handed = handed or mt is not None
                        break
                elif budget > 0 and not m.finished():
                    used = m.advance(budget, self.SEAL_FUEL)
                    budget -= used
                    self.merged_rows += used
                if not m.finished():
                    break
                self._install(lvl, m)
            lvl += 1
        if mt is not None:
            self._handed = handed
            if handed:
                mt.submit(self)

    def _fan_in(self, level: _Level) -> int:
        """How many loose batches of ``level`` one merge takes (invariant 15): FAN_IN when the level is tiered (its
        two oldest loose batches would merge on disk: the batch store says so); without a store, on a trace with
        ``hold`` that reads through a current key index, or with ``hold_unread`` while it is not read (invariant 18),
        up to that on a low level; else 2."""
        store = self._store
        if store is None and (self.hold > 2 or self.hold_unread > 2 or self.hold_keyed > 2) and len(level.loose) >= 2:
            return self._held_fan_in(level)
        if store is None or self.FAN_IN <= 2 or len(level.loose) < 2:
            return 2
        if not store.on_disk(level.loose[0][1], level.loose[1][1]):
            return 2
        return max(self.FAN_IN, self.HOLD_FAN_IN) if store.holding else self.FAN_IN

    def _ready(self, level: _Level, fuel: int = 0) -> bool:
        """Whether ``level`` (no merge in progress) starts one now (invariant 15): it holds its fan-in of loose
        batches, and on a tiered level the FAN_IN oldest are spilled (a merge pins its inputs' buffers until it ends, so
        one started from batches in memory would hold them beyond the budget; the store's next enforce spills them),
        or it holds twice that, or (``FROM_MEMORY``) ``fuel``, the merge input rows this insert pays the level, covers
        the whole merge, which then ends within the insert."""
        k = self._fan_in(level)
        if len(level.loose) < k:
            return False
        if k == 2 or len(level.loose) >= 2 * k:
            return True
        if not self._from_memory(level, k):
            return True
        return self.FROM_MEMORY and fuel >= sum(len(e[1]) for e in level.loose[:k])

    def _held_fan_in(self, level: _Level) -> int:
        """Invariant 18: the fan-in of a level of a trace that holds (``hold``) whose reads of keys go through a current
        key index, or that holds while unread (``hold_unread``, no read for UNREAD_INSERTS inserts): ``2 ** j`` for the
        largest j with ``2 ** j <=`` that hold whose output (about j levels up) stays below the trace's highest level by
        at least one, else 2."""
        if self.hold > 2 and not (self._kix_spec is None or self._kix_off or self._kix is None):
            hold = self.hold
        elif self.hold_unread > 2 and self._unread >= self.UNREAD_INSERTS:
            hold = self.hold_unread
        elif self.hold_keyed > 2:
            hold = self.hold_keyed
        else:
            return 2
        lvl = level_of(level.loose[0][2])
        top = len(self._by_level) - 1
        while top > lvl and not self._by_level[top].loose and self._by_level[top].merge is None:
            top -= 1
        k = 2
        while 2 * k <= hold and lvl + (2 * k).bit_length() - 1 < top:
            k *= 2
        return k

    def _from_memory(self, level: _Level, k: int) -> bool:
        """Whether a merge of the ``k`` oldest loose batches of ``level`` is a tiered one that only this insert's fuel
        may start (invariant 15): some input is still in memory and the level holds fewer than 2 * k loose batches.
        Such a merge runs to its end within the insert (never handed to the merge thread): it pins its inputs. Never
        without a batch store (a held level, invariant 18, pins nothing a budget counts)."""
        return (k > 2 and self._store is not None and len(level.loose) < 2 * k
                and not all(self._store.is_spilled(e[1]) for e in level.loose[:k]))

    def _start_merge(self, lvl: int, handing: bool) -> _Merge:
        """Start merging the oldest loose batches of level ``lvl`` (it has no merge in progress): its fan-in of them
        (invariant 15); with ``handing`` (a merge thread in force) a merge of more than INLINE_MERGE rows of work is
        made shareable, to be handed over (invariant 10)."""
        level = self._by_level[lvl]
        k = min(self._fan_in(level), len(level.loose))
        if self._store is not None and self._store._unchecked:  # the merge reads every row (spill.py invariant 14)
            for e in level.loose[:k]:
                self._store.check(e[1])
        m = _Merge(level.loose[:k], self._store, self.row_hashes)
        if k > 2 and self._store is None:
            self.held_merges += 1  # (invariant 18; a count for tests)
        if self._unspilled:  # an input is an output of this work still read from its scratch file
            ins = {id(e[1]) for e in m.inputs}
            m.scratch = tuple(c.drop for o, c, _s in self._unspilled if id(o) in ins)
        if handing and m.work > self.INLINE_MERGE and not self._from_memory(level, k):
            m.shared = SharedMerge()
        self._by_level[lvl] = _Level(level.loose[k:], m)
        return m

    def _install(self, lvl: int, m: _Merge) -> None:
        """Replace a finished merge's inputs by its output (invariant 4); a compaction that failed puts its inputs back
        loose instead (invariant 16)."""
        self._by_level[lvl] = self._by_level[lvl]._replace(merge=None)
        if m.shared is not None:
            self.merged_rows += m.shared.merged
            m.shared.merged = 0
        failed = m.abandoned()
        if failed is not None:
            self._unpick(m.inputs)
            if m.store is not None:
                m.store.count("compactions_abandoned", 1)
            _log.warning("a background compaction of %d spilled batches failed and was abandoned (the batches stay as "
                         "they were): %s", len(m.inputs), failed)
            return
        out = m.result()
        if len(out):
            if m.cursor.mapping is not None and m.store is not None and not m.store.is_spilled(out):  # built in a
                # scratch file and not made its batch file by the merge thread (_Merge.seal): to its batch file,
                if self._unspilled is not None and self.SPILL_AT_WORK_END:  # a piece at a time (spill.py invariant
                    self._unspilled.append((out, m.cursor, m.store))  # 12), at the end of the work, or now
                else:
                    m.store.spill_output(out, m.cursor)
            self._place(out, min(m.work, self.WORK_CAP * len(out)))

    def install_finished(self, thread: "MergeThread | None" = None) -> int:
        """Install the merges the merge thread has finished (invariant 10), from any thread while the inserting one
        is between steps, so a checkpoint or a layout change sees merged batches; with ``thread``, also start the
        merges the installed outputs make possible and hand them to it. Merges nothing, waits for nothing; returns
        the merges installed. With ``thread``, a shareable merge the inserting thread kept for itself (due: its level
        filled up, so ``_merge_levels`` advanced it by fuel and handed nothing) is handed too: else a settle
        (``EmbeddedExecutor.settle_merges``) left it unfinished and ``compact_spilled`` skipped its level (a 30M-row
        distinct kept 8 spilled batches after a load; bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-flat100)."""
        if not self._handed and (thread is None or not any(
                lv.merge is not None and lv.merge.shared is not None for lv in self._by_level)):
            return 0
        installed, handed = 0, False
        for lvl in range(len(self._by_level)):  # a level's output lands higher up: one pass sees it
            level = self._by_level[lvl]
            m = level.merge
            if m is not None and m.shared is not None and m.finished(wait=False):
                self._install(lvl, m)
                installed += 1
                level, m = self._by_level[lvl], None
            if m is None and thread is not None and self._ready(level):
                m = self._start_merge(lvl, True)
            handed = handed or (m is not None and m.shared is not None)
        if thread is not None and handed:
            self._handed = True
            thread.submit(self)
        return installed

    def _unpick(self, entries: tuple) -> None:
        """Put the inputs of a compaction abandoned back loose at their levels, in placement order (invariant 16)."""
        for e in entries:
            lvl = level_of(e[2])
            while len(self._by_level) <= lvl:
                self._by_level.append(_Level())
            level = self._by_level[lvl]
            self._by_level[lvl] = level._replace(loose=tuple(sorted(level.loose + (e,), key=lambda x: x[0])))

    def _to_compact(self, since: int = 0) -> list:
        """What a compaction merges (invariants 15-16): the loose batches of every level with no merge in progress that
        are spilled or on a tiered level (whose in-memory ones wait to be spilled: left, they are batches every read
        asks), the oldest 64 at most (the k-way cursor's bound), in placement order; [] when fewer than two. ``since``:
        only the batches placed from that placement number on (invariant 15: a step in pieces merges its own)."""
        store = self._store
        if store is None or self._fresh:
            return []
        picked = [e for level in self._by_level if level.merge is None
                  for e in level.loose if e[0] >= since and (self._fan_in(level) > 2 or store.is_spilled(e[1]))]
        return sorted(picked, key=lambda e: e[0])[:64] if len(picked) >= 2 else []

    def start_compaction(self, thread: "MergeThread | None") -> int:
        """Start a background compaction (invariant 16): what :meth:`compact_spilled` merges (``_to_compact``) becomes
        the inputs of one k-way merge parked in a
        free merge slot at or above the level of their summed work and handed to ``thread``, which merges them and
        makes the output its batch file; the inserting thread installs it as any merge. With ``thread`` None (no merge
        thread) nothing is handed over: :meth:`advance_compaction` pays it in slices between steps (invariant 17). Call
        on the inserting thread or between steps. Returns the batches it merges (0: fewer than two, nothing started)."""
        picked = self._to_compact()
        if not picked:
            return 0
        store = self._store
        gone = {id(e[1]) for e in picked}
        m = _Merge(tuple(picked), store, self.row_hashes, compaction=True)
        m.shared = SharedMerge()
        levels = [level._replace(loose=tuple(e for e in level.loose if id(e[1]) not in gone))
                  for level in self._by_level]
        at = level_of(m.work)  # (at or above every input's level)
        while at < len(levels) and levels[at].merge is not None:
            at += 1
        while len(levels) <= at:
            levels.append(_Level())
        levels[at] = levels[at]._replace(merge=m)
        self._by_level = levels
        if thread is not None:
            self._handed = True
            thread.submit(self)
        return len(picked)

    def advance_compaction(self, rows: int) -> int:
        """Pay a slice of a compaction started without a merge thread (invariant 17): merge at least ``rows`` more of
        its input rows (or the rest; a failure abandons it, as on the merge thread), and once every row is in, write
        its output's file with what is left (``SEAL_FUEL`` output rows' worth a row, ``_Merge.seal``, batchfile.py
        invariant 8) and install it once written. Call between steps. Returns the rows of the slice used (all of it
        once the file's write had a share); the input rows merged are added to ``compacted_rows``."""
        for lvl, level in enumerate(self._by_level):
            m = level.merge
            if m is None or not m.compaction or m.shared is None:
                continue
            merged, used, _more = m.pay(rows, self.SEAL_FUEL)
            self.compacted_rows += merged
            if m.finished():
                self._install(lvl, m)
            return used
        return 0

    def loose_spilled_bytes(self) -> tuple[int, int]:
        """The bytes of the batches a compaction would merge (``_to_compact``: loose spilled batches, and loose ones of
        tiered levels still in memory), their files' or their buffers': (those beyond the largest one, the largest
        one's), (0, 0) when fewer than two. A reopened trace's share of the executor's compaction rule
        (runtime/embedded.py ``_compact_after_load``: what was written since the last compaction is not known there)."""
        store = self._store
        sizes = [f if f else batch_bytes(e[1]) for e, f in ((e, store.file_size(e[1])) for e in self._to_compact())]
        return (sum(sizes) - max(sizes), max(sizes)) if len(sizes) >= 2 else (0, 0)

    @property
    def compacting(self) -> bool:
        """Whether a background compaction (invariant 16) is in progress."""
        return any(level.merge is not None and level.merge.compaction for level in self._by_level)

    def compact_spilled(self, since: int = 0) -> int:
        """Merge the spilled loose batches of every level with no merge in progress, and the loose batches of tiered
        levels still in memory, into one, in one k-way pass (on disk when the store says so), placed at the level of
        their summed work (capped as invariant 2 says): what a bulk load's end does
        (``EmbeddedExecutor.settle_merges``, invariant 15), so the small steps after it ask one spilled batch where
        tiered levels left up to 2 * FAN_IN per level. The content is unchanged (a merge's), as is a key index.
        ``since``: only the batches placed from that placement number on (``_placed`` before a step in pieces: its
        pieces' batches and what merged them, invariant 15). Call between steps or pieces. Returns the batches
        merged (0: fewer than two)."""
        picked = self._to_compact(since)
        if not picked:
            return 0
        store = self._store
        gone = {id(e[1]) for e in picked}
        for e in picked:
            store.check(e[1])  # (a merge reads every row: spill.py invariant 14)
        m = _Merge(tuple(picked), store, self.row_hashes)
        m.step(m.cursor.remaining)
        self.merged_rows += sum(len(e[1]) for e in picked)
        self._by_level = [level._replace(loose=tuple(e for e in level.loose if id(e[1]) not in gone))
                          for level in self._by_level]
        out = m.result()
        if len(out):
            if m.cursor.mapping is not None:
                store.spill_output(out, m.cursor)
            self._place(out, min(m.work, self.WORK_CAP * len(out)))
        return len(picked)

    def _unfinished(self) -> tuple["_Merge | None", "_Merge | None"]:
        """The handed-over level merge not finished yet, lowest level first, and the compaction not finished yet (the
        merge thread calls this: it advances level merges first, invariant 16)."""
        found: "_Merge | None" = None
        compaction: "_Merge | None" = None
        for level in list(self._by_level):
            m = level.merge
            if m is not None and m.shared is not None and m.shared.error is None and (not m.cursor.done or (
                    m.compaction and m.shared.out is None and m.shared.failed is None)):  # (or its file unwritten)
                if m.compaction:
                    compaction = compaction or m
                elif found is None:
                    found = m
        return found, compaction

    # ---- reading ----

    def _read(self, pages: bool = False) -> list["IndexedZSet"]:
        """Every batch of invariant 1 (a read ends a trace's freshness, placing its pending batches: invariant 5).
        The seam of the batch store (invariant 12, dbsp_core/trace/spill.py): a spilled batch is read in place from
        its file's mapping; the read marks the trace's files used for the store's cache, and a batch of a file
        opened lazily is checked first (spill.py invariant 14), whole unless ``pages`` (the caller checks the
        pages it reads, and reports them to the store's cache: :meth:`lookup`, :meth:`narrowed`)."""
        store = self._store if self._store is not None else self._attach()
        if store is not None:
            store.note_read(self, whole=not pages)
        self._unread = 0  # (invariant 18: a trace read holds by hold_unread no more)
        self.end_fresh()
        if self._handed and current_merge_thread() is not None:  # install the merges the merge thread finished
            self._work(0)  # (invariant 10); merges nothing
        out = self._levels()
        if not pages and store is not None and store._unchecked:
            for b in out:
                store.check(b)
        return out

    def _read_for(self, spec: tuple) -> list["IndexedZSet"]:
        """:meth:`_read` for a read of some keys that a key index for ``spec`` may serve: the pages of lazily opened
        files are checked by the walk that reads them (:meth:`_check_probe`) or whole by an index build
        (``_index``; spill.py invariant 14); a current index reads no row."""
        return self._read(pages=True)

    def walked(self, keys: np.ndarray | None = None) -> list["IndexedZSet"]:
        """Every batch (as :attr:`batches`), for a join's walks of a change's keys that go through :meth:`narrowed`,
        which checks the pages each walk reads of a lazily opened file and reports them to the store's cache
        (spill.py invariants 12 and 14): such a read uses the pages of its keys, not the whole files. ``keys``: the
        key hashes of the change, whose pages of spilled batches start being read first (:meth:`prefetch`; a
        join's walk reads no row hashes)."""
        out = self._read(pages=True)
        if keys is not None:
            out = self._gathered(out, keys)
            self._filters(out, keys)  # every spilled batch's Bloom test of the keys, one C call (:meth:`narrowed`)
            self.prefetch(out, keys, row_hashes=False)
        return out

    def keyed(self, hashes: np.ndarray) -> list["IndexedZSet"]:
        """Every batch (as :attr:`batches`), for a read of the rows of key hashes ``hashes`` only: a batch read from a
        format-2 file is its rows of those keys (:meth:`_gathered`), not a copy of all of them."""
        return self._gathered(self._read(), hashes)

    def _gathered(self, batches: list["IndexedZSet"], hashes: np.ndarray) -> list["IndexedZSet"]:
        """``batches`` with each one read from a format-2 file replaced by its rows of key hashes ``hashes`` (spill.py
        invariant 18, groupedbatch.py B2: gathered by pread, an in-memory batch holding every row of those keys),
        left out when it holds none: for a read of those keys only (a walk, a lookup, sums or weights of them)."""
        store = self._store
        if store is None or not store._grouped:
            return batches
        out = []
        for b in batches:
            if store.grouped_of(b) is None:
                out.append(b)
            elif len(hashes):
                got = store.gather(b, hashes)
                if got is not None:
                    out.append(got)
        return out

    def pieces(self, b: "IndexedZSet", n: int, walk_rows: int | None = None) -> Iterable[tuple[int, int]]:
        """The (lo, hi) ranges of ``n`` change rows (key-hash order) a walk over batch ``b`` takes in turn, part of a
        walk of ``walk_rows`` change rows over every batch (``n`` unless given): (0, n) unless ``b`` is spilled and
        the walk would map more than a piece may (spill.py ``walk_pieces``, invariant 12 "mapped": what the walks
        before it keep mapped counts too); then its mapping is dropped after each piece (as the next range is asked
        for)."""
        store = self._store
        g = store.walk_pieces(b, n, walk_rows) if store is not None else 1
        if g == 1:
            return ((0, n),)  # (no generator: a read calls this per batch)
        cuts = np.linspace(0, n, g + 1).astype(np.int64).tolist()

        def cut() -> Iterator[tuple[int, int]]:
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                if hi > lo:
                    yield lo, hi
                    store.walked_out(b)
        return cut()

    def in_pieces(self, b: "IndexedZSet", change: "IndexedZSet", walk: Any, walk_rows: int | None = None) -> list:
        """What ``walk(piece)`` returns for each piece of ``change`` (an indexed batch) :meth:`pieces` cuts for b."""
        n = len(change)
        return [walk(change if hi - lo == n else change.slice(lo, hi)) for lo, hi in self.pieces(b, n, walk_rows)]

    def prefetch(self, batches: list["IndexedZSet"], hashes: np.ndarray, row_hashes: bool = True) -> None:
        """Before walks seek key hashes ``hashes`` in ``batches``: start reading the pages they will read of the
        spilled ones (their row hashes too unless ``row_hashes`` is False), all batches before the first walk, so
        that the reads overlap instead of each walk waiting for its page faults one at a time (spill.py
        ``BatchStore.prefetch``, invariant 12)."""
        store = self._store
        if store is None or len(hashes) == 0 or not store.prefetching():
            return
        for b in batches:
            store.prefetch(b, hashes, row_hashes)

    def _check_probe(self, b: "IndexedZSet", hashes: np.ndarray) -> None:
        """Before a C walk seeks ``hashes`` (ascending) in ``b`` through its fence and reads the rows found: check
        those pages when ``b`` is read from a lazily opened file (spill.py invariant 14)."""
        store = self._store
        if store is None or id(b) not in store._unchecked:
            return
        if store.check_seek(b, hashes):
            asked = self._filtered(b, hashes)
            if len(asked):
                store.check_rows(b, b.lookup(asked))

    def _check_files(self, reads_all: bool = True) -> None:
        """Check every batch read from a lazily opened file whole (spill.py invariant 14): before a read of rows
        that does not go through :meth:`_read` (a shard cut, :meth:`drop_below`, a key index build). A read of
        every row (``reads_all``: not a cut, which seeks key hashes), or a check, touches every page of the spilled
        batches: they count as used for the store's cache (invariant 12), which else never evicted them."""
        store = self._store
        if store is None:
            return
        checked = False
        if store._unchecked:
            for b in self._levels() + self.pending:
                checked = checked or id(b) in store._unchecked
                store.check(b)
        if reads_all or checked:
            store.note_read(self)

    def _attach(self) -> Any:
        """Register with the BatchStore in force on this thread, if any (invariant 12); returns it."""
        store = current_batch_store()
        if store is not None:
            store.register(self)
            self._store = store
            self._index_to_files(store.directory)  # spill.py invariant 17
        return store

    def _filtered(self, b: "IndexedZSet", hashes: np.ndarray) -> np.ndarray:
        """``hashes`` less those a spilled batch's Bloom filter rules out (invariant 12: an absent key touches none
        of its pages); all of them for a batch in memory."""
        f = self._store.file_of(b) if self._store is not None else None
        return hashes if f is None else hashes[f.may_contain(hashes)]

    def _filters(self, batches: list["IndexedZSet"], hashes: np.ndarray) -> dict[int, tuple[Any, np.ndarray]]:
        """The Bloom test of key hashes ``hashes`` against the filter of every spilled batch of ``batches`` in one C
        call (spillread.may_contain; per batch in numpy it cost ~50 us of Python a batch a step): per batch read
        from a file, ``id(b) -> (weakref to b, keep)``; also kept for :meth:`narrowed` of a change with these very
        key hashes (a join's walks, which ask per batch). A lazily opened file whose filter is not checked yet
        (spill.py invariant 14) is left to the test per batch, after its check."""
        store = self._store
        if store is None or len(hashes) == 0:
            return {}
        files = [(b, f) for b in batches for f in (store.file_of(b),)
                 if f is not None and id(b) not in store._unchecked]
        if not files or len(files) * len(hashes) > self.FILTERS_MAX:
            return {}  # (a big step: its filters' test per batch, a mask at a time, as its walk goes)
        keep, counts = spillread.may_contain([f for _, f in files], hashes)
        out = {id(b): (weakref.ref(b), keep[i]) for i, (b, _) in enumerate(files)}
        self._keeps = (hashes, out, keep, counts, [id(b) for b, _ in files])  # (narrowed takes from all of them)
        self._taken = None
        return out

    def _keep_of(self, b: "IndexedZSet", hashes: np.ndarray, keeps: dict | None = None) -> np.ndarray | None:
        """``b``'s Bloom test of ``hashes`` made by :meth:`_filters` (``keeps``, else the last one made for these
        very hashes), None when none was."""
        if keeps is None:
            memo = self._keeps
            if memo is None or memo[0] is not hashes:
                return None
            keeps = memo[1]
        got = keeps.get(id(b))
        return got[1] if got is not None and got[0]() is b else None

    def narrowed(self, b: "IndexedZSet", change: "IndexedZSet", keeps: dict | None = None
                 ) -> tuple["IndexedZSet | None", np.ndarray | None]:
        """``change`` (an indexed batch whose key hashes are comparable with batch ``b``'s) less the rows whose key
        ``b``'s Bloom filter rules out when ``b`` is spilled (invariant 12: a walk of the change against ``b`` then
        seeks only keys ``b`` may hold, so an absent key touches no page of it), and the row numbers kept: (change,
        None) when ``b`` is in memory or every row may match, (None, None) when none may. Checks the pages the walk
        reads of a lazily opened file (spill.py invariant 14) and reports them to the store's cache (invariant 12):
        callers read the trace with :meth:`walked`. ``keeps``: :meth:`_filters` of the change's key hashes (else the
        one :meth:`walked` made for them, if any, else the filter is asked here)."""
        f = self._store.file_of(b) if self._store is not None and len(change) else None
        if f is None:
            return change, None
        self._check_probe(b, change.key_hash)
        if keeps is None and self._keeps is not None and self._keeps[0] is change.key_hash:
            keeps = self._keeps[1]
        keep = self._keep_of(b, change.key_hash, keeps)
        part = self._taken_part(b, change, keeps) if keep is not None else None
        if keep is None:
            keep = f.may_contain(change.key_hash)
        n = int(keep.sum()) if part is None else part[2]
        self._store.stats["keys_sought"] += n
        self._store.note_pages(self, b, change.key_hash[keep])  # the pages the walk reads (invariant 12)
        if n == len(keep):
            return change, None
        if n == 0:
            return None, None
        if part is not None:
            return part[0], part[1]
        rows = np.flatnonzero(keep)
        return change.take(rows), rows

    def _taken_part(self, b: "IndexedZSet", change: "IndexedZSet", keeps: dict
                    ) -> "tuple[IndexedZSet | None, np.ndarray | None, int] | None":
        """:meth:`narrowed`'s (rows of ``change`` kept, their row numbers, how many) for batch ``b`` from the Bloom
        tests ``keeps`` (:meth:`_filters` of the change's key hashes): the first call for a change takes the rows
        every tested batch keeps in one take (ascending within each batch; a batch's part is a slice of it, no
        copy), instead of a take a batch (~45 us each under cProfile; a join over 25 spilled batches took 17 a
        step). None: not taken together (the reference path, spillread ``NATIVE`` off, tests made otherwise, more than
        ``NARROW_TOGETHER_MAX`` rows), the caller takes per batch."""
        tests = self._keeps
        if not spillread.NATIVE or tests is None or tests[1] is not keeps:
            return None
        memo = self._taken
        if memo is None or memo[0]() is not change or memo[1] is not keeps:
            keep, counts, ids = tests[2:]
            if len(ids) != len(keep) or keep.shape[1] != len(change):
                return None
            part = (counts > 0) & (counts < len(change))  # (all or none kept: no take)
            total = int(counts[part].sum())
            parts: dict = {}
            if total > self.NARROW_TOGETHER_MAX:
                return None
            if total:
                _, rows = np.nonzero(keep[part])  # (row-major: each batch's rows ascending, batch after batch)
                taken = change.take(rows)
                ends = np.cumsum(counts[part]).tolist()
                lo = 0
                for i, hi in zip(np.flatnonzero(part).tolist(), ends):
                    parts[ids[i]] = (lo, hi)
                    lo = hi
                parts[None] = (taken, rows)
            for i in np.flatnonzero(~part).tolist():
                parts[ids[i]] = int(counts[i])
            memo = self._taken = (weakref.ref(change), keeps, parts)
        where = memo[2].get(id(b))
        if where is None:
            return None
        if isinstance(where, int):
            return None, None, where
        lo, hi = where
        taken, rows = memo[2][None]
        return taken.slice(lo, hi), rows[lo:hi], hi - lo

    def _levels(self, sync: bool = True) -> list["IndexedZSet"]:
        """The batches of every level (merge inputs included; not the pending ones), in the order they were placed.
        ``sync``: synced first (invariant 19); False for a size estimate, which may run on another thread."""
        if sync and self._pk_rec and not self._pk_syncing:  # invariant 19: every reader of the batches reads them synced
            self._pk_sync()
        entries = []
        for level in self._by_level:
            entries.extend(level.loose)
            if level.merge is not None:
                entries.extend(level.merge.inputs)
        entries.sort(key=_PLACED)  # (a key read in C: no call of Python per batch, as a lambda costs)
        return [e[1] for e in entries]

    @property
    def batches(self) -> list["IndexedZSet"]:
        """Every batch the trace's content is the sum of (invariant 1); reading it merges nothing."""
        return self._read()

    def parts(self, sync: bool = True) -> tuple[list["IndexedZSet"], list["IndexedZSet"]]:
        """The placed batches (in placement order) and the pending ones, as they are: what a checkpoint saves.
        Inserting both lists into a cleared trace, with :meth:`settle` between them, restores it (invariant 5).
        ``sync=False``: without the sync of invariant 19 (a size estimate, which may run on another thread than the
        steps: totals kept per key since the last sync are not in these batches; :meth:`unsynced_size` counts them)."""
        return self._levels(sync), list(self.pending)

    @property
    def deferred(self) -> tuple[int, int]:
        """The work owed (invariant 14): rows whose merge fuel is unpaid, and rows the parked key index is owed."""
        return self._owed, sum(len(b) for b, _ in self._kix_owed)

    def levels(self) -> list[tuple[int, list[int], tuple[int, int] | None]]:
        """Per non-empty level: its number, its loose batches' sizes and its merge's input sizes (for tests)."""
        out = []
        for lvl, level in enumerate(self._by_level):
            m = level.merge
            if level.loose or m is not None:
                out.append((lvl, [len(e[1]) for e in level.loose], tuple(len(e[1]) for e in m.inputs) if m else None))
        return out

    def check(self) -> None:
        """Raise AssertionError unless invariants 1, 2 and 5 hold (tests and debugging; reads every row): each batch
        non-empty and consolidated in canonical order for the key, with the row hashes it keeps; each loose batch
        and merge at the level of its work; placement numbers distinct and below the next one."""
        from dbsp_core import _zset

        seen = set()
        for lvl, level in enumerate(self._by_level):
            entries = list(level.loose) + (list(level.merge.inputs) if level.merge is not None else [])
            for placed, b, work in entries:
                assert placed < self._placed and placed not in seen, (lvl, placed)
                seen.add(placed)
                assert len(b) and work >= 1, (lvl, len(b), work)
                # (a compaction's inputs come from its level and those below: invariant 16)
                ins = {e[0] for e in level.merge.inputs} if level.merge is not None and level.merge.compaction else ()
                assert level_of(work) == lvl or (placed in ins and level_of(work) < lvl), (lvl, work)
            if level.merge is not None:
                assert level.merge.work == sum(e[2] for e in level.merge.inputs)
        self._check_index()  # invariant 11: a current index holds the batches' sums
        for b in self._levels() + self.pending:
            keypos = [b.schema.get_field_index(k) for k in b.key]
            assert _zset.check_order(b.zset.data, b.zset.weights, b.key_hash, keypos), "a batch out of canonical order"
            if b._rh is not None:
                assert np.array_equal(b._rh, _zset.hash_columns(b.zset.data, list(range(len(b.schema))))), "row hashes"

    @property
    def num_rows(self) -> int:
        """Stored rows over all batches (a row may be counted once per batch holding it)."""
        return sum(len(b) for b in self._levels()) + sum(len(b) for b in self.pending)

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
        store = self._store
        batches = self._gathered(self._read(pages=True), hashes)
        sought = [b for b in batches if len(b) >= dense_ratio * len(hashes)]
        keeps = self._filters(sought, hashes)  # one C call for every spilled batch's Bloom test
        self.prefetch(sought, hashes)
        for b in batches:
            lazy = store is not None and id(b) in store._unchecked  # check what it reads (spill.py invariant 14)
            if len(b) < dense_ratio * len(hashes):
                if lazy:
                    store.check(b)
                if store is not None:
                    store.note_pages(self, b)  # passed on whole: every page of it may be read
                out.append(b)
                continue
            if lazy:
                lazy = store.check_seek(b, hashes)
            keep = self._keep_of(b, hashes, keeps)
            asked = self._filtered(b, hashes) if keep is None else hashes[keep]
            if len(asked) == 0:
                continue
            idx = b.lookup(asked)  # one galloping C call per batch
            if lazy:
                store.check_rows(b, idx)
            if store is not None and store.is_spilled(b):
                store.stats["keys_sought"] += len(asked)
                store.note_pages(self, b, asked, idx)
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
        batches = self._read_for(("row", (None,))) if len(change) else []
        if batches:
            change._check_compatible(batches[0], "match_weights")  # every batch has the trace's schema and key
            if self._index_sums(("row", (None,)), batches, change._view(), list(range(len(change.schema))),
                                change._row_hashes(), None, acc.reshape(-1, 1)):
                return acc  # invariant 11: one probe per row instead of a walk per batch
            view, schema = change._view(), change.schema
            batches = self._gathered(batches, change.key_hash)
            rh = change._row_hashes()  # rows of one key are in row-hash order: gallop within a big group's run
            alike = [b for b in batches if b.schema.equals(schema)]
            keeps = self._filters(alike, change.key_hash)  # one C call for every spilled batch's Bloom test
            self.prefetch(alike, change.key_hash)
            for b in batches:
                same = b.schema.equals(schema)  # a cast batch's hashes are not the change's: walk it plainly
                if same:
                    sub, rows = self.narrowed(b, change, keeps)  # a spilled batch: the rows its filter may hold
                    if sub is None:
                        continue
                    for lo, hi in self.pieces(b, len(sub), len(change)):
                        if hi - lo == len(change):
                            break  # one piece, the whole change: the plain walk below
                        s, part = sub.slice(lo, hi), np.zeros(hi - lo, dtype=np.int64)
                        _zset.match_weights(s._view(), None, None, b._view_as(schema), None, None, part,
                                            s._row_hashes(), b._row_hashes())
                        acc[slice(lo, hi) if rows is None else rows[lo:hi]] += part
                    else:
                        continue
                elif self._store is not None:
                    self._store.check(b)
                    self._store.note_pages(self, b)  # a plain walk: any page of it
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
        batches = self._read_for(("key", tuple(columns))) if len(rows) else []
        if batches:
            ppos, cpos = _key_sums_positions(batches[0], probe, probe_keys, columns)
            if view is None:
                view = _zset.BatchView(probe)  # built once for every batch
            if self._index_sums(("key", tuple(columns)), batches, view, ppos, khash, rows, acc):
                return acc  # invariant 11: one probe per key
            batches = self._gathered(batches, khash)  # (khash: the probed rows' key hashes)
            spilled = self._store is not None and any(self._store.is_spilled(b) for b in batches)
            keeps = {}
            if spilled:
                keeps = self._filters(batches, khash)  # one C call for every spilled batch's Bloom test
                self.prefetch(batches, khash, row_hashes=False)  # (the sums read keys and values, not row hashes)
            for b in batches:
                self._check_probe(b, khash)
                sel = None  # the probed keys the walk seeks (positions), None: all of them
                if spilled and self._store.is_spilled(b):  # invariant 12: only the keys its filter may hold
                    keep = self._keep_of(b, khash, keeps)
                    if keep is None:
                        keep = self._store.file_of(b).may_contain(khash)
                    self._store.stats["keys_sought"] += int(keep.sum())
                    self._store.note_pages(self, b, khash[keep])  # the pages the walk reads (invariant 12)
                    if not keep.any():
                        continue
                    sel = None if keep.all() else np.flatnonzero(keep)
                for lo, hi in self.pieces(b, len(rows) if sel is None else len(sel), len(rows)):  # (12, "mapped")
                    p = slice(lo, hi) if sel is None else sel[lo:hi]
                    sub = acc[p]  # (a view of acc for a slice)
                    b._key_sums(view, ppos, khash[p], rows[p], cpos, sub)
                    if sel is not None:
                        acc[p] = sub
        return acc

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
        self._pk_sync()  # invariant 19
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

        self._check_files()
        before = self.num_rows
        levels, self._by_level = self._by_level, []
        redo: list[tuple[int, IndexedZSet, int]] = []
        for lvl, level in enumerate(levels):
            m = level.merge
            if m is not None:
                got = [kept(e[1]) for e in m.inputs]
                if all(x is e[1] for x, e in zip(got, m.inputs)):  # untouched: the merge goes on where it was
                    while len(self._by_level) <= lvl:
                        self._by_level.append(_Level())
                    self._by_level[lvl] = _Level((), m)
                else:
                    redo += [(e[0], x, e[2]) for e, x in zip(m.inputs, got) if x is not None]
            redo += [(p, x, w) for p, x, w in ((p, kept(b), w) for p, b, w in level.loose) if x is not None]
        for p, b, w in sorted(redo, key=lambda e: e[0]):  # placement order kept (invariant 5)
            w = min(w, self.WORK_CAP * len(b))
            lvl = level_of(w)
            while len(self._by_level) <= lvl:
                self._by_level.append(_Level())
            level = self._by_level[lvl]
            self._by_level[lvl] = level._replace(loose=level.loose + ((p, b, w),))
        self.pending = [x for x in map(kept, self.pending) if x is not None]
        self._kept, self._grown = self.num_rows, 0
        if self._kept != before:  # rows left: the key index goes stale (invariant 11)
            self._changed()
            self._stale_index()
        return before - self._kept

    def replace(self, pieces: dict[int, list["IndexedZSet"]], removed: list["IndexedZSet"] | None = None,
                defer: bool = False) -> None:
        """Put pieces of batches in their place (invariant 9): ``pieces`` maps ``id(batch)`` of batches of
        :meth:`parts` to the batches that replace it, in order (an empty list drops it). Each piece must hold some
        of its batch's rows, consolidated and in index order (a zero-copy slice, :meth:`IndexedZSet.slice`);
        the trace's content loses the rows the pieces leave out. Merges nothing, reads no rows. ``removed``, when
        given, is exactly those rows (a shard cut's moved slices): a key index then subtracts them and stays
        current (invariant 11), or with ``defer`` is parked owing their subtraction (invariant 14); without it the
        index goes stale.

        >>> import pyarrow as pa
        >>> from dbsp_core import ZSet
        >>> t = Trace(pa.schema([("k", pa.int64())]), ("k",))
        >>> t.insert(ZSet.from_rows([(i,) for i in range(8)], t.schema).index_by(["k"]))
        >>> b = t.batches[0]
        >>> t.replace({id(b): [b.slice(0, 3), b.slice(5, 8)]})
        >>> [len(x) for x in t.batches], t.merged_rows
        ([3, 3], 0)
        """
        self._pk_sync()  # invariant 19
        if not pieces:
            return
        prev = self._changed()
        if self._kix is not None or self._kix_parked is not None:
            if removed is None:
                self._stale_index()
            elif defer or self._kix_parked is not None:
                self._owe_folds(removed, -1, prev)
            else:
                self._index_fold(removed, -1, prev)
        entries: list[tuple[int, "IndexedZSet", int]] = []  # every placed batch outside a merge that goes on
        merges: list[tuple[int, _Merge]] = []  # (level, merge) that go on
        for lvl, level in enumerate(self._by_level):
            m = level.merge
            if m is not None:
                if any(id(e[1]) in pieces for e in m.inputs):
                    entries += list(m.inputs)  # starts again from the pieces of its inputs
                else:
                    merges.append((lvl, m))
            entries.extend(level.loose)
        # one list in placement order, merge inputs included, renumbered from _placed on (pieces are new
        # batches and need numbers of their own, in their batch's place: invariant 5)
        items: list[tuple[int, int, tuple]] = [(e[0], 0, ("loose", e)) for e in entries]
        for lvl, m in merges:
            for i, e in enumerate(m.inputs):
                items.append((e[0], i, ("in", lvl, m, i)))
        items.sort(key=lambda it: (it[0], it[1]))
        nxt = self._placed
        loose: list[tuple[int, "IndexedZSet", int]] = []
        newnum: dict[tuple[int, int], int] = {}
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
                newnum[(id(it[2]), it[3])] = nxt
                nxt += 1
        self._placed = nxt
        levels: list[_Level] = []

        def at(lvl: int) -> _Level:
            while len(levels) <= lvl:
                levels.append(_Level())
            return levels[lvl]

        for lvl, m in merges:
            at(lvl)
            levels[lvl] = _Level((), m.renumbered([newnum[(id(m), i)] for i in range(len(m.inputs))]))
        for e in loose:  # oldest first within each level
            lvl = level_of(e[2])
            levels[lvl] = at(lvl)._replace(loose=at(lvl).loose + (e,))
        self._by_level = levels
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
