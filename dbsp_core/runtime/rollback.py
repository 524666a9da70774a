"""Putting operator instances back where they were before a step (or a job) that failed: a capture of their state by reference, not by copy, because traces are levels of immutable batches.

Invariants (enforced here):
  1. :func:`capture` records every attribute of every instance and, for each Trace attribute, the Trace's own
     attributes with their lists copied (the levels and the pending batches are lists of immutable
     entries, so copying the lists is enough); Z-set attributes are values. It costs O(attributes and
     numbers of levels and batches), never O(rows).
  2. :func:`restore` puts back exactly what :func:`capture` recorded, keeping the identity of every Trace
     object (snapshots and caches refer to them), so the instances behave as if the steps after the capture
     never ran. Operator state is only ever held in such attributes (dbsp_core.storage.snapshot invariant 2
     refuses anything else).
  3. But for one thing held in place: a trace that keeps its totals per key (trace/levels.py invariant 19) holds
     state in its key index, which a step writes in place. :func:`capture` takes a mark of such a trace
     (``Trace._pk_mark``: while a mark lives, every change of a key index in place is logged with its inverse), and
     :func:`restore` undoes the changes made since, newest first (``Trace._pk_rollback``), before putting the
     attributes back: the index then holds what it held at the capture, exactly. O(rows changed since), never
     O(state).
"""

from __future__ import annotations

from typing import Any, Iterable

from dbsp_core.trace import Trace

__all__ = ["capture", "restore"]


def capture(instances: Iterable[Any]) -> list:
    """What :func:`restore` needs to put ``instances`` back in their present state (invariant 1).

    >>> import pyarrow as pa
    >>> from dbsp_core import ZSet
    >>> class Op:
    ...     def __init__(self): self.t = Trace(pa.schema([("k", pa.int64())]), ("k",)); self.n = 0
    >>> op = Op(); saved = capture([op])
    >>> op.t.insert(ZSet.from_rows([(1,)], op.t.schema).index_by(["k"])); op.n = 5
    >>> restore(saved); op.t.num_rows, op.n
    (0, 0)
    """
    saved = []
    for inst in instances:
        attrs = vars(inst).copy()
        traces = []
        for name in _shape(attrs)[1]:
            t = attrs[name]
            tv = vars(t).copy()  # then its lists copied in place (a step's capture: ~35 attributes, 3 lists a trace)
            for k in _shape(tv)[0]:
                tv[k] = tv[k].copy()
            traces.append((t, tv, t._pk_mark()))
        saved.append((inst, attrs, traces))
    return saved


_SHAPES: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # an attribute dict's shape -> _shape's answer


def _shape(attrs: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of ``attrs``'s values that are lists and those that are Traces (invariant 1), found once per shape
    of the dict (its names and the types of their values, in order: what decides both, read in C) instead of by a
    loop of Python over every attribute at every step's capture (~35 a trace, ~500 bytecodes a trace a step)."""
    key = (tuple(attrs), tuple(map(type, attrs.values())))
    got = _SHAPES.get(key)
    if got is None:
        if len(_SHAPES) >= 4096:  # shapes are few (a class's attributes and their types); this bounds the odd one
            _SHAPES.clear()
        got = _SHAPES[key] = (tuple(k for k, v in attrs.items() if isinstance(v, list)),
                              tuple(k for k, v in attrs.items() if isinstance(v, Trace)))
    return got


def restore(saved: list) -> None:
    """Put back the state :func:`capture` recorded (invariant 2)."""
    for inst, attrs, traces in saved:
        vars(inst).clear()
        vars(inst).update(attrs)
        for t, tv, mark in traces:
            if mark is not None:  # invariant 3: the key index's changes in place undone first
                t._pk_rollback(mark)
            vars(t).clear()
            vars(t).update({k: (list(v) if isinstance(v, list) else v) for k, v in tv.items()})
