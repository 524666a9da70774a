"""A progress line on the terminal for long operations (recovery replay, rescale, a checkpoint of a large state): shown on stderr only when it is a terminal (or ``DBSP_PROGRESS=1``), only once the operation has lasted a second (``DBSP_PROGRESS_DELAY`` seconds), and never with ``DBSP_PROGRESS=0``.

A ticker thread redraws the line every ``interval`` seconds with the elapsed time and, where the caller reports
it, ``done/total``; the line is cleared (or, if it was shown, ended with the final figures) when the operation
ends. Nothing is printed for operations shorter than ``delay``, so tests and short runs see no output.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from dbsp_core.envvars import settings

__all__ = ["Progress", "progress"]


def _enabled(stream: IO[str]) -> bool:
    flag = settings().progress  # DBSP_PROGRESS
    if flag is not None:
        return flag
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """One operation's progress line; use :func:`progress` (a context manager).

    >>> import io
    >>> out = io.StringIO()
    >>> with Progress("replay", total=3, stream=out, delay=0, force=True) as pr:
    ...     pr.update(3)
    >>> "replay 3/3" in out.getvalue()
    True
    """

    def __init__(self, what: str, total: int | None = None, unit: str = "", *, stream: IO[str] | None = None,
                 delay: float = 1.0, interval: float = 0.5, force: bool = False) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.delay, self.interval = delay, interval
        self.enabled = force or _enabled(self.stream)
        self.done = 0
        self.t0 = time.monotonic()
        self._shown = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="dbsp-progress", daemon=True)
            self._thread.start()
        return self

    def update(self, done: int) -> None:
        """Report ``done`` units of ``total`` finished."""
        self.done = done

    def _line(self) -> str:
        el = time.monotonic() - self.t0
        count = f" {self.done}/{self.total}{self.unit}" if self.total is not None else \
            (f" {self.done}{self.unit}" if self.done else "")
        pct = f" ({self.done / self.total:.0%})" if self.total else ""
        return f"{self.what}{count}{pct}  {el:.1f} s"

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self._line())
        self.stream.flush()
        self._shown = True

    def _tick(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            self._draw()
            if self._stop.wait(self.interval):
                return

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown:
            self._draw()
            self.stream.write(" failed\n" if exc_type is not None else " done\n")
            self.stream.flush()


def progress(what: str, total: int | None = None, unit: str = "") -> Progress:
    """A :class:`Progress` on stderr: ``with progress("recovery replay", total=n) as pr: ... pr.update(k)``."""
    return Progress(what, total, unit, delay=settings().progress_delay)  # DBSP_PROGRESS_DELAY
