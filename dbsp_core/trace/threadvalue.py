"""A value set for the current thread inside a ``with`` block: the trace layer's per-thread settings (the merge thread
a trace hands its merges to, trace/merge_thread.py; the batch store that keeps it under a budget, trace/spill.py).

A class, not a contextlib generator: a worker enters each once a step, where contextlib's machinery cost ~2 us."""

from __future__ import annotations

import threading
from typing import Any


class ThreadValue:
    """``with Sub(value):`` sets ``Sub.attr`` of ``Sub.tls`` (a ``threading.local``) to ``value`` for the block and
    puts back what it was after it; ``Sub.current()`` reads it (None outside every block). Subclasses set ``tls`` and
    ``attr``."""

    __slots__ = ("_new", "_prev")
    tls: threading.local
    attr: str

    def __init__(self, value: Any) -> None:
        self._new = value

    def __enter__(self) -> None:
        self._prev = getattr(self.tls, self.attr, None)
        setattr(self.tls, self.attr, self._new)

    def __exit__(self, *exc: object) -> None:
        setattr(self.tls, self.attr, self._prev)

    @classmethod
    def current(cls) -> Any:
        return getattr(cls.tls, cls.attr, None)


class ThreadValues:
    """``with ThreadValues((SubA, a), (SubB, b)):`` is ``with SubA(a), SubB(b):``: one object and two calls of Python
    where nested blocks make two objects and four calls (a worker enters the merge thread's and the batch store's
    every step: ~5k instructions less)."""

    __slots__ = ("_pairs", "_prev")

    def __init__(self, *pairs: tuple[type[ThreadValue], Any]) -> None:
        self._pairs = pairs

    def __enter__(self) -> None:
        prev = []
        for sub, value in self._pairs:
            tls, attr = sub.tls, sub.attr
            prev.append(getattr(tls, attr, None))
            setattr(tls, attr, value)
        self._prev = prev

    def __exit__(self, *exc: object) -> None:
        for (sub, _), value in zip(self._pairs, self._prev):
            setattr(sub.tls, sub.attr, value)
