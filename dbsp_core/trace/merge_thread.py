"""The merge thread: a background thread that advances the merges traces hand it, so a step does not wait for them.

Invariant (trace invariant 10, enforced here and by dbsp_core/trace/levels.py, ``Trace._work``):
 10. Background merging (a :class:`MergeThread` in force on the inserting thread, see :func:`merging`):
     invariant 3's merges are the same, but the thread that inserts only starts them and hands them to the
     merge thread, which advances them in GIL-free chunks while steps run (merges of at most INLINE_MERGE
     rows of work are not handed over: they advance by fuel as in invariant 3); the inserting thread pays
     invariant 3's fuel itself only for a merge that is due (its level already holds two more loose batches, or
     FAN_IN on a tiered level, invariant 15: the merge thread fell behind), so a level holds at most a merge and
     two (FAN_IN) loose batches and the bound on batches, and on a step's merge work, stays that of invariant 3. Only the inserting thread changes the
     levels: it installs finished merges at its next insert or read (a read still merges nothing). A merge's
     lock keeps the two threads from advancing it at once; its result does not depend on who advanced it,
     so the content, the batches once merges finish, checkpoints and outputs are those of invariant 3. When a
     merge's last chunk is merged, this thread also builds its output and, built on disk, makes it its batch file
     (levels.py ``_Merge.seal``: through a VFS in spill.py ``ASYNC_VFS``, and always for a compaction), so the install
     on the inserting thread only swaps batches. It advances level merges before background compactions (trace
     invariant 16), which yield between chunks whenever a merge may have been handed over.

When its queue runs empty after merging, the thread trims its own C scratch cache (csrc/scratch.c: per thread, up
to DBSP_SCRATCH_MB) and the region cache to ``DBSP_CACHE_KEEP_MB``, as a step's end does for the stepping thread
(runtime/embedded.py ``release_memory``): buffers a large merge left would otherwise stay resident beside the state.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from dbsp_core import _zset
from dbsp_core.envvars import settings
from dbsp_core.trace.at_exit import stop_at_exit
from dbsp_core.trace.threadvalue import ThreadValue

if TYPE_CHECKING:
    from dbsp_core.trace.levels import Trace

log = logging.getLogger(__name__)

__all__ = ["MergeThread", "SharedMerge", "merging", "current_merge_thread"]


class SharedMerge:
    """What a merge handed to a MergeThread shares between the two threads (invariant 10)."""

    __slots__ = ("lock", "error", "merged", "out", "failed", "writer")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.error: BaseException | None = None  # what advancing it on the merge thread raised
        self.merged = 0  # input rows the merge thread merged (counted into the trace when installed)
        self.out: Any = None  # its output once sealed (levels.py ``_Merge.seal``: its file written there)
        self.failed: BaseException | None = None  # what sealing a compaction raised (it is abandoned when installed)
        self.writer: Any = None  # its file's write in pieces while the steps pay it (levels.py invariant 17)


class MergeThread:
    """A thread that advances the merges traces hand it, in GIL-free chunks of ``CHUNK`` input rows
    (invariant 10). One serves any number of traces; :meth:`close` stops it. Traces use it while
    :func:`merging` puts it in force on their inserting thread.

    >>> import pyarrow as pa
    >>> from dbsp_core import ZSet
    >>> from dbsp_core.trace import Trace
    >>> t = Trace(pa.schema([("k", pa.int64())]), ("k",))
    >>> with MergeThread() as mt, merging(mt):
    ...     for i in range(64):
    ...         t.insert(ZSet.from_rows([(i,)], t.schema).index_by(["k"]))
    ...     idle = mt.wait_idle()
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
        self._submits = 0  # submit() calls, ever: a compaction in progress yields to the merges they may bring
        self.merged_rows = 0  # input rows merged on this thread, ever
        self.failed = False  # the loop stopped on an unexpected error (_loop): closed since
        self._thread = threading.Thread(target=self._loop, name="dbsp-merge-thread", daemon=True)
        self._thread.start()
        stop_at_exit(self)  # a pipeline never closed: stopped before Python finalizes (at_exit.py)

    def __enter__(self) -> "MergeThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, trace: "Trace") -> None:
        """``trace`` has merges in progress for this thread to advance."""
        with self._cond:
            trace._hand_overs += 1
            self._submits += 1
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

    def _stop_for_exit(self) -> None:
        self.close()

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException:  # a bug outside a merge's own step (which its trace raises): the thread stops as
            log.exception("the merge thread stopped on an unexpected error; traces finish their merges themselves")
            with self._cond:  # closed, so waiters return and traces merge on their inserting threads (close())
                self._closed, self._busy, self.failed = True, False, True
                self._cond.notify_all()

    def _run(self) -> None:
        worked = False  # merged since this thread last trimmed its scratch cache
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                idle = not self._queue and not self._closed
            if idle and worked:  # its own scratch cache, which no step's trim reaches (csrc/scratch.c note 6)
                worked = False
                _zset.trim_caches(settings().cache_keep_mb << 20)
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                queued = [(tid, t, t._hand_overs) for tid, t in self._queue.items()]
                submits = self._submits
                self._busy = True
            m = self._pick(queued)
            if m is None:
                continue
            while not self._closed:  # the same merge to its end, with no scan or queue work between chunks
                # (an error is kept for the inserting thread, which raises it when it needs the merge; the last chunk
                # also writes the output's file here, not at the install: invariant 10)
                used, _paid, more = m.pay(self.CHUNK, None, BaseException)
                self.merged_rows += used
                worked = worked or used > 0
                if not more:
                    break
                if m.compaction and self._submits != submits:  # a level merge may be waiting: it goes first
                    break
            del m, queued  # (a merge's inputs, their files, go once the trace installed it: not held here)

    def _pick(self, queued: list) -> "Any":
        """The merge to advance next among the queued traces ``queued`` ((id, trace, hand-overs) each, oldest
        first): the lowest unfinished level merge of the first trace that has one, else the first compaction
        (trace invariant 16: level merges are what steps wait for); traces with neither, and nothing handed over
        since the scan began, leave the queue. None when nothing is left."""
        found = [(tid, t, seq) + t._unfinished() for tid, t, seq in queued]
        pick = next((e[3] for e in found if e[3] is not None), None) or next((e[4] for e in found if e[4] is not None),
                                                                             None)
        with self._cond:
            for tid, t, seq, lv, cp in found:
                if lv is None and cp is None and t._hand_overs == seq:  # nothing handed over since the scan began
                    self._queue.pop(tid, None)
        return pick


class merging(ThreadValue):
    """Traces inserted into on this thread, inside the block, hand their merges to the merge thread given (invariant
    10); None: they merge on the inserting thread (invariant 3)."""

    __slots__ = ()
    tls = threading.local()
    attr = "merge_thread"


def current_merge_thread() -> "MergeThread | None":
    """The MergeThread in force on this thread (:func:`merging`), or None."""
    return merging.current()
