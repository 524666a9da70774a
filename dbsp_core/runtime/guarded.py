"""A live trace handed out by ``Pipeline.traces`` behind the pipeline's step lock, so that reading it from any thread never interleaves with a step, a rescale or a checkpoint (driver.py invariant 11).

Invariants (enforced here):
  1. Every attribute read, attribute write and method call on a :class:`GuardedTrace` runs on the live trace while
     its thread holds the pipeline's step lock (a reentrant lock: the thread that steps may read its own traces
     from inside the lock). A read of a trace can write it: a trace keeping totals per key brings its batches up
     to date from its key index first (trace invariant 19), which, beside a step storing into that index on
     another thread, lost or doubled totals (a corruption of the state that checkpoints and rescales then carry).
  2. What a call returns is the trace's own (batches are immutable; lists are the trace's as they were): a value
     read under the lock stays valid after it, a list may stop being the trace's current one at the next step.
  3. The guard is the trace as far as ``isinstance`` and ``repr`` go, so code that inspects traces takes it as one.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["GuardedTrace"]


class GuardedTrace:
    """``trace`` read and written only under ``lock`` (invariant 1)."""

    __slots__ = ("_trace", "_lock", "__weakref__")

    def __init__(self, trace: Any, lock: Any) -> None:
        object.__setattr__(self, "_trace", trace)
        object.__setattr__(self, "_lock", lock)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # invariant 3: isinstance(guard, Trace) holds
        return type(object.__getattribute__(self, "_trace"))

    def __getattr__(self, name: str) -> Any:
        trace, lock = object.__getattribute__(self, "_trace"), object.__getattribute__(self, "_lock")
        with lock:
            value = getattr(trace, name)  # a property (batches, num_rows) is computed here, under the lock
        if callable(value) and getattr(value, "__self__", None) is trace:  # a bound method: called under the lock

            @functools.wraps(value)
            def locked(*args: Any, **kwargs: Any) -> Any:
                with lock:
                    return value(*args, **kwargs)

            return locked
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        trace, lock = object.__getattribute__(self, "_trace"), object.__getattribute__(self, "_lock")
        with lock:
            setattr(trace, name, value)

    def __delattr__(self, name: str) -> None:
        trace, lock = object.__getattribute__(self, "_trace"), object.__getattribute__(self, "_lock")
        with lock:
            delattr(trace, name)

    def __repr__(self) -> str:
        with object.__getattribute__(self, "_lock"):
            return repr(object.__getattribute__(self, "_trace"))
