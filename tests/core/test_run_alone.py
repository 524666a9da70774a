"""The per-step floor's shortcuts (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, branch r37-floor2) against the paths they shortcut: a one-worker step without a budget (EmbeddedExecutor._run_alone, embedded.py invariant 6) against the general path (_run_pieces), an in-memory push (Pipeline._push_memory) against push_many's, the rollback's capture by shape, and the weights of ones."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples

import dbsp_core as dbsp
from dbsp_core.envvars import settings as dbsp_settings
from dbsp_core.errors import AppendOnlyError, PrimaryKeyError, SchemaError, StepError
from dbsp_core.runtime import rollback
from dbsp_core.trace import Trace
from dbsp_core.trace.threadvalue import ThreadValue, ThreadValuePair
from dbsp_core.zset import ZSet, ones

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
USCHEMA = pa.schema([("id", pa.int64()), ("x", pa.int64())])
SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def poisoned(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A flat_map's function that fails on a batch holding v == 666 (a step that must roll back), else hands the
    batch on."""
    if batch.num_rows and 666 in batch.column("v").to_pylist():
        raise ValueError("poison")
    return batch


def _circuit() -> dbsp.Circuit:
    """A pass-through (whose output a bag of equal rows makes not distinct), a distinct, a linear group-by, a
    min (not linear), a join and a failing flat_map after them all (a step with v = 666 fails)."""
    c = dbsp.Circuit()
    t, u = c.input("t", SCHEMA), c.input("u", USCHEMA)
    c.output("pass", t)
    c.output("d", t.select(k="k").distinct())
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    c.output("m", t.group_by("k").agg(lo=dbsp.min("v")))
    c.output("j", t.join(u, left_on=["k"], right_on=["id"]))

    c.output("x", t.filter(pc.field("v") >= 0).flat_map(poisoned, schema=SCHEMA))
    return c


def _general(p: dbsp.Pipeline) -> dbsp.Pipeline:
    """``p`` with its one worker stepping by the general path (the pieces of invariant 5, the sums of invariant 3)."""
    ex = p.executor
    ex._run_alone = ex._run_pieces  # type: ignore[method-assign]
    return p


def _state(p: dbsp.Pipeline) -> dict:
    return {name: sorted(t.consolidated().zset.to_dict().items(), key=repr) for name, t in p.traces(0).items()}


def _timers(p: dbsp.Pipeline) -> list:
    return [(t.nodes, t.rows_in, t.rows_out, t.steps, [s for s, _ in t.recent]) for t in p.executor.node_timers()]


@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 6), st.integers(-3, 3)), max_size=12),
                          st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), max_size=4),
                          st.integers(0, 3), st.booleans()), min_size=1, max_size=8))
def test_a_step_alone_is_the_general_path(steps: list) -> None:
    """embedded.py invariant 6: over the same steps (bags with equal rows, deletions of rows there now, pushes of
    two inputs, steps that fail on their data and are discarded, empty steps), a pipeline stepping alone and one
    stepping by the general path give equal outputs (as multisets, and both distinct), state, metrics, operator
    timings' rows and failures."""
    alone, general = dbsp.Pipeline(_circuit()), _general(dbsp.Pipeline(_circuit()))
    with alone, general:
        for rows, urows, dup, poison in steps:
            for p in (alone, general):
                t = pa.table({"k": [k for k, _ in rows], "v": [v for _, v in rows]}, schema=SCHEMA)
                p.push("t", t)
                if dup and t.num_rows:  # the same rows again, some deleted: a bag of equal rows
                    p.push("t", t.slice(0, dup), weights=np.full(min(dup, t.num_rows), -1 if dup == 2 else 1))
                p.push("u", pa.table({"id": [k for k, _ in urows], "x": [x for _, x in urows]}, schema=USCHEMA))
                if poison:
                    p.push("t", pa.table({"k": [1], "v": [666]}, schema=SCHEMA))
            outs = []
            for p in (alone, general):
                if poison:
                    with pytest.raises(StepError) as info:
                        p.step()
                    p.discard(*info.value.inputs[-1][1:])
                outs.append(p.step())
            a, g = outs
            assert set(a) == set(g)
            for name in a:
                assert a[name]._distinct and g[name]._distinct, name
                assert a[name].to_dict() == g[name].to_dict(), name
        assert _state(alone) == _state(general)
        sa, sg = alone.metrics(), general.metrics()
        for key in ("steps", "pushes", "rows_in", "rows_out", "net_rows"):
            assert sa[key] == sg[key], key
        assert _timers(alone) == _timers(general)
        assert alone.stats.get("failed_steps") == general.stats.get("failed_steps")


def test_a_step_alone_runs_alone_only_without_a_budget_and_on_one_worker(monkeypatch) -> None:
    """invariant 6's condition: one worker without a memory budget steps alone; two workers, or a budget, do not."""
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    ran = []
    real = EmbeddedExecutor._run_alone
    monkeypatch.setattr(EmbeddedExecutor, "_run_alone", lambda self, s: ran.append(s.step) or real(self, s))
    t = pa.table({"k": [1, 2, 2], "v": [1, 2, 2]}, schema=SCHEMA)
    for workers, limit in ((1, None), (2, None), (1, "64MiB")):
        ran.clear()
        with dbsp.Pipeline(_circuit(), workers=workers, memory_limit=limit) as p:
            alone = workers == 1 and p.executor.batch_store is None  # (DBSP_MEMORY_LIMIT gives every one a budget)
            assert alone == (workers == 1 and limit is None and dbsp_settings().memory_limit is None)
            p.push("t", t)
            assert p.step()["pass"].to_dict() == {(1, 1): 1, (2, 2): 2}
        assert ran == ([0] if alone else []), (workers, limit)


def test_an_in_memory_push_is_push_manys() -> None:
    """Pipeline._push_memory against _prepare and _push_all (push_many): the same change queued, the same backlog,
    counters and seqs, and the same refusals recording nothing."""
    c = dbsp.Circuit()
    c.output("a", c.input("a", SCHEMA))
    c.output("o", c.input("o", SCHEMA, append_only=True))
    c.output("kt", c.input("kt", SCHEMA, primary_key=["k"]))
    rng = np.random.default_rng(SEED)
    t = pa.table({"k": rng.integers(0, 9, 50), "v": rng.integers(0, 9, 50)}, schema=SCHEMA)
    w = rng.integers(-3, 4, 50)
    one, many = dbsp.Pipeline(c), dbsp.Pipeline(c)
    with one, many:
        for args in (("a", t, None), ("a", t.to_batches()[0], w), ("a", {"k": [1], "v": [2]}, None),
                     ("a", ZSet.from_arrow(t, w), None), ("o", t, None), ("kt", t.slice(0, 1), None)):
            one.push(*args)
            many.push_many([args])
        for bad in (("nope", t, None), ("a", t, w[:3]), ("o", t, w), ("a", t.select(["k"]), None),
                    ("kt", pa.table({"k": [1, 1], "v": [1, 2]}, schema=SCHEMA), np.array([1, 5]))):
            errors = []
            for p in (one, many):
                with pytest.raises((KeyError, ValueError, AppendOnlyError, SchemaError, TypeError,
                                    PrimaryKeyError)) as info:
                    p.push(*bad) if p is one else p.push_many([bad])
                errors.append((type(info.value), str(info.value).replace("push_many", "push")))
            assert errors[0][0] is errors[1][0], bad
        assert [(h, z.to_dict(), z.weights.flags.writeable) for h, z in one._pending] == \
            [(h, z.to_dict(), z.weights.flags.writeable) for h, z in many._pending]
        assert one._step_inputs == many._step_inputs
        assert one._backlog(0.0)[:2] == many._backlog(0.0)[:2]
        assert one._metrics.snapshot()["rows_in"] == many._metrics.snapshot()["rows_in"]
        assert one._metrics.pushes == many._metrics.pushes == 6
        assert {n: z.to_dict() for n, z in one.step().items()} == {n: z.to_dict() for n, z in many.step().items()}


def test_ones_are_new_writable_arrays() -> None:
    """zset.ones: each call a new writable array of ones (a push's weights), whatever a caller does with the last."""
    a = ones(5)
    a[0] = 7
    b = ones(5)
    assert b.tolist() == [1] * 5 and b.dtype == np.int64 and b.flags.writeable and not np.shares_memory(a, b)
    assert ones(0).shape == (0,) and ones(70_000).sum() == 70_000
    t = pa.table({"k": [1, 2], "v": [3, 4]}, schema=SCHEMA)
    with dbsp.Pipeline(_circuit()) as p:
        p.push("t", t)
        p._pending[0][1].weights[0] = 5  # a kernel writing a push's weights in place changes no later push
        p.push("t", t)
        assert p._pending[1][1].weights.tolist() == [1, 1]


class _Op:
    def __init__(self) -> None:
        self.t = Trace(SCHEMA, ("k",))
        self.n = 0


def test_capture_by_shape_copies_every_list_whatever_the_shape() -> None:
    """rollback invariant 1 with _shape: a trace whose attribute becomes a list (or stops being one) after an
    earlier capture of the same names, an instance that gains a trace, each has its lists copied and its traces
    captured; restore puts back the lists as they were."""
    op = _Op()
    z = ZSet.from_rows([(1, 2)], SCHEMA).index_by(["k"])
    rollback.restore(rollback.capture([op]))  # this shape seen once
    attr = next(k for k, v in vars(op.t).items() if v is None)
    setattr(op.t, attr, [1, 2])  # same names, another type: another shape
    saved = rollback.capture([op])
    getattr(op.t, attr).append(3)
    op.t.insert(z)
    op.u = Trace(SCHEMA, ("k",))  # a new trace attribute after the capture: dropped by the restore
    rollback.restore(saved)
    assert getattr(op.t, attr) == [1, 2] and op.t.num_rows == 0 and not hasattr(op, "u")
    op.u = Trace(SCHEMA, ("k",))  # a shape with two traces: both captured
    saved = rollback.capture([op])
    op.u.insert(z)
    op.t.insert(z)
    rollback.restore(saved)
    assert op.t.num_rows == 0 and op.u.num_rows == 0


class _A(ThreadValue):
    __slots__ = ()
    tls = __import__("threading").local()
    attr = "a"


class _B(ThreadValue):
    __slots__ = ()
    tls = __import__("threading").local()
    attr = "b"


def test_a_pair_of_thread_values_is_two_nested_blocks() -> None:
    """ThreadValuePair sets both for the block and puts back what each was, also when the block raises."""
    with _A(1), _B(2):
        with ThreadValuePair(_A, 3, _B, None):
            assert (_A.current(), _B.current()) == (3, None)
        assert (_A.current(), _B.current()) == (1, 2)
        with pytest.raises(RuntimeError):
            with ThreadValuePair(_A, 5, _B, 6):
                raise RuntimeError
        assert (_A.current(), _B.current()) == (1, 2)
    assert (_A.current(), _B.current()) == (None, None)
