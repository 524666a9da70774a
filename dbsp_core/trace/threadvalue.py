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


class ThreadValuePair:
    """``with ThreadValuePair(SubA, a, SubB, b):`` is ``with SubA(a), SubB(b):``: one object and two calls of Python
    where the nested blocks make two objects and four calls (a worker enters the merge thread's and the batch
    store's every step)."""

    __slots__ = ("_a", "_av", "_b", "_bv", "_prev")

    def __init__(self, a: type[ThreadValue], av: Any, b: type[ThreadValue], bv: Any) -> None:
        self._a, self._av, self._b, self._bv = a, av, b, bv

    def __enter__(self) -> None:
        a, b = self._a, self._b
        self._prev = (getattr(a.tls, a.attr, None), getattr(b.tls, b.attr, None))
        setattr(a.tls, a.attr, self._av)
        setattr(b.tls, b.attr, self._bv)

    def __exit__(self, *exc: object) -> None:
        a, b = self._a, self._b
        setattr(b.tls, b.attr, self._prev[1])
        setattr(a.tls, a.attr, self._prev[0])
