"""Page faults of a merge's scratch output taken ahead of the thread that writes it (issue 31).

A merge whose output is built in a scratch file (spill.py invariant 12) writes it through a MADV_HUGEPAGE mapping
(bindings/merge.pxi ``HUGE_SCRATCH``), so the output's page cache is made of 2 MiB folios, which make the steps
that later read the compacted file cheap. The write fault that allocates such a folio is expensive (a fresh 2 MiB
of memory, with synchronous reclaim and compaction under THP defrag "madvise", zeroed, its blocks mapped: 16-29 ms
of system time measured on a loaded host), and it lands in whichever slice of the merge first writes a new 2 MiB of
an output region: on the stepping thread when the steps pay a compaction in slices (levels.py invariant 17).

Invariants:
  1. :func:`ask` (levels.py ``_Merge``: at its start and after each piece of its cursor's steps) wakes one daemon
     thread per process, ``dbsp-prefault``, which calls the cursor's ``populate_ahead(AHEAD)``: MADV_POPULATE_WRITE
     of each output region's next 2 MiB-aligned pieces up to ``AHEAD`` bytes past the writer's share of the rows
     consumed. The folios are the same the writer would have faulted (same mapping, same VM_HUGEPAGE fault path);
     only the thread that pays for them changes. A populate writes no byte of the file (the pages read as the
     zeros fallocate reserved), so the file format and crash safety do not change.
  2. The writer must find its pieces populated, never populate them alongside: two threads' first faults on one
     2 MiB range at once can leave it in small folios (the loser's readahead falls back to order 0). So before each
     piece of a step :func:`before_step` populates, on the stepping thread, what the thread has not yet reached of
     the rows that piece writes (``populate_ahead(0, rows)``; the cursor serializes populates and does each piece
     once): nothing when the thread is ahead (the usual case), a wait or the faults themselves when it is late
     (counted in ``late``).
  3. It is an optimisation only: an error of a populate (a kernel without MADV_POPULATE_WRITE, a merge gone) is
     dropped and the writer faults its pages itself, as before. ``AHEAD = 0`` turns it off (measurements, tests).
  4. Its work is kernel CPU like before, on another thread: the process pays the same (measured: bench/history/RESULTS-2026-11-28-to-2026-12-02.md,
     2026-11-30, branch r31-slicefault). The queue holds a cursor (so its mapping) only until its populate
     returns; the thread ends after ``IDLE`` seconds without work and at interpreter exit, and a forked child starts
     its own.
  5. Its counters (``populated``, ``late``, the CPU of ended threads) are added to under ``_tally``, a lock of their
     own: the stepping threads of a pipeline's workers call :func:`before_step` at once, and ``late += n`` is a read
     and a write another thread may come between (an update lost). A step that populated nothing (the thread ahead,
     the usual case) takes no lock.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

AHEAD = 4 << 20  # bytes of each output region populated past where its writer is (0: off)
IDLE = 2.0  # seconds without work after which the thread ends (the next ask starts another)

_cond = threading.Condition(threading.Lock())
_want: dict[int, Any] = {}  # id(cursor) -> cursor, to populate
_thread: threading.Thread | None = None  # (None in a forked child: _after_fork)
_closing = False
populated = 0  # bytes populated by this process's thread (tests, measurements)
late = 0  # bytes the stepping threads populated themselves, the thread being late (invariant 2)
_spent = [0.0]  # CPU seconds of the threads that ended
_tally = threading.Lock()  # the counters above (invariant 5)


def ask(cursor: Any) -> None:
    """Have the prefault thread populate ``cursor``'s file-backed output ahead of its writer (invariant 1)."""
    global _thread
    if AHEAD <= 0 or getattr(cursor, "mapping", None) is None or _closing:
        return
    with _cond:
        _want[id(cursor)] = cursor
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="dbsp-prefault", daemon=True)
            _thread.start()
        else:
            _cond.notify()


def before_step(cursor: Any, rows: int) -> None:
    """Before a piece of ``rows`` output rows at most of ``cursor``'s step on this thread: populate what the
    prefault thread has not reached of what it writes (invariant 2)."""
    global late
    if AHEAD > 0 and getattr(cursor, "mapping", None) is not None:
        n = cursor.populate_ahead(0, rows + 4096)  # (a step may finish a key's rows past its budget)
        if n:
            with _tally:  # (invariant 5)
                late += n


def _run() -> None:
    global populated, _thread
    me = threading.current_thread()
    while True:
        with _cond:
            if not _want and not _closing:
                _cond.wait(IDLE)
            if not _want or _closing:
                if _thread is me:
                    _thread = None
                with _tally:
                    _spent[0] += time.thread_time()
                return
            _, cursor = _want.popitem()
        try:
            n = cursor.populate_ahead(AHEAD)
        except Exception:  # (invariant 3) the writer faults these pages itself
            n = 0
        if n:
            with _tally:  # (invariant 5: a thread that just ended may still be adding its CPU; a restarted one)
                populated += n
        del cursor


def cpu_seconds() -> float:
    """CPU seconds this process's prefault threads have used so far, the running one's included (measurements:
    bench/probe_compaction.py)."""
    t, spent = _thread, _spent[0]
    if t is not None and t.ident is not None and t.is_alive():
        try:
            spent += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError):  # it just ended (and added its own)
            pass
    return spent


def _stop() -> None:
    global _closing
    t = _thread
    with _cond:
        _closing = True
        _want.clear()
        _cond.notify_all()
    if t is not None and t is not threading.current_thread() and t.is_alive():
        t.join(1.0)


def _after_fork() -> None:  # the parent's thread is not in the child
    global _cond, _thread, _want, _tally
    _cond, _thread, _want, _tally = threading.Condition(threading.Lock()), None, {}, threading.Lock()


atexit.register(_stop)
os.register_at_fork(after_in_child=_after_fork)
