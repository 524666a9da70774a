"""dbsp_core/trace/prefault.py invariant 5: its counters are exact when the stepping threads of several workers add to
them at once (``late`` from :func:`before_step`)."""

from __future__ import annotations

import sys
import threading

import pytest

from dbsp_core.trace import prefault


class _Cursor:
    """The two things :func:`prefault.before_step` asks of a merge cursor (bindings/merge.pxi ``MergeCursor``): a
    file-backed output (``mapping``) and ``populate_ahead``, here populating ``n`` bytes each call. The counters are
    what is tested; a real cursor's populate is test_spill_folios.py's."""

    mapping = object()

    def __init__(self, n: int) -> None:
        self.n = n

    def populate_ahead(self, ahead: int, rows: int = 0) -> int:
        return self.n


def test_late_is_exact_under_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads call ``before_step`` 40,000 times each, populating 3 bytes a call, with the interpreter switching
    threads every microsecond (so that a thread is stopped between the read and the write of ``late += n`` often):
    ``late`` grows by exactly 4 x 40,000 x 3. Watched fail without the lock (``late`` short by thousands)."""
    monkeypatch.setattr(prefault, "AHEAD", 4 << 20)
    monkeypatch.setattr(prefault, "late", 0)
    threads, calls, n = 4, 40_000, 3
    start = threading.Barrier(threads)

    def work() -> None:
        c = _Cursor(n)
        start.wait()
        for _ in range(calls):
            prefault.before_step(c, 0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert prefault.late == threads * calls * n


def test_nothing_populated_takes_no_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose pieces the prefault thread reached first (``populate_ahead`` returns 0: the usual case) leaves
    ``late`` alone and takes no lock (one held elsewhere does not block it)."""
    monkeypatch.setattr(prefault, "AHEAD", 4 << 20)
    before = prefault.late
    with prefault._tally:
        done = threading.Event()
        t = threading.Thread(target=lambda: (prefault.before_step(_Cursor(0), 0), done.set()))
        t.start()
        assert done.wait(5.0)
        t.join()
    assert prefault.late == before
