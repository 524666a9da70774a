"""Traces other than an aggregate's totals hold their low levels (trace/levels.py invariant 18, ``DBSP_TOTALS_HOLD``): a
distinct's input and a count_distinct's pairs while their key index serves their reads (distinct.py and
count_distinct.py invariant 5), a join's sides (inner, left, semi) and a materialized view's trace while nothing reads
them (``hold_unread``: join.py invariant 9, presence.py invariant 5, materialize.py invariant 5).

Over random splits into steps after a load (rows of ints and strings, inserts and deletions, multiplicities above 1),
with a second input ``u`` joined with the first that changes only at a few steps (so the join's side of ``t`` goes
unread for runs of steps, then is read), and a materialized view read at a few steps, at W = 1 and 2, through the fused
step plan and without it: with the holds on, every step's output, every view read and every trace's content equal the
run with them off, traces pass ``Trace.check``, and merges of more than two batches did run on each trace that may hold;
the distinct over rows with a string column (no key index: its batches are walked every step) and the sides of a join of
``t`` with itself (both read every step) merge two at a time. The same across a checkpoint and reopen and a step rolled
back (StepError). DBSP_HOLD_SEED replays."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import envvars
from dbsp_core.runtime.embedded import EmbeddedExecutor
from tests.core.test_linear_run import add_poison
from tests.core.test_totals_hold import BUDGET, SCHEMA, SEED, _deltas, _push, poisoned_step

U = pa.schema([("j", pa.int64()), ("tag", pa.string())])
HELD = ("distinct#4.input", "count_distinct#11.values", "join#17.left", "materialize#21.contents", "left_join#27.left",
        "semi_join#31.left")
WALKED = ("distinct#6.input", "join#25.left", "join#25.right")  # read every step, so merged two at a time: rows
# with a string column (no key index), and both sides of a join of t with itself
U_STEPS = (0, 70, 71, 130)  # the steps that change u (each reads the join's side of t after a run unread)
READS = (60, 100, 150)  # the steps after which the materialized view is read


def _circuit(poison: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t, u = c.input("t", SCHEMA), c.input("u", U)
    c.output("d", t.select(k="k", j="j").distinct())
    c.output("ds", t.distinct())
    c.output("cd", t.group_by("j").agg(n=dbsp.count_distinct("k")))
    c.output("jn", t.join(u, on="j").select(k="k", v="v", tag="tag"))
    c.output("m", t.select(k="k", s="s"), materialized=True)
    c.output("self", t.join(t.select(k2="k", v2="v"), left_on="k", right_on="k2").select(k="k", v="v", v2="v2"))
    c.output("lj", t.left_join(u, on="j").select(k="k", tag="tag"))
    c.output("sj", t.semi_join(u, on="j"))
    if poison:
        add_poison(c, t, SCHEMA)
    return c


def _u_rows(i: int) -> dbsp.ZSet:
    """u's change at step ``i`` of U_STEPS: tags for j = 0..2 first, then one replaced, one added, one deleted."""
    rows = {0: [((0, "a"), 1), ((1, "b"), 1), ((2, "c"), 2)], 70: [((1, "b"), -1), ((1, "bb"), 1)],
            71: [((0, "a2"), 1)], 130: [((2, "c"), -1), ((0, "a"), -1)]}[i]
    return dbsp.ZSet.from_rows([r for r, _ in rows], U, weights=[w for _, w in rows])


def _set_hold(monkeypatch, hold: int) -> None:
    """DBSP_TOTALS_HOLD as read by the operators' states when a pipeline builds them."""
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(totals_hold=hold))


def _traces(p: dbsp.Pipeline) -> list:
    return [((w, name), tr) for w in range(p.workers) for name, tr in sorted(p.traces(w).items())
            if name in HELD + WALKED]


def _state(p: dbsp.Pipeline) -> dict:
    out: dict = {}
    for (_, name), tr in _traces(p):
        tr.check()
        out.setdefault(name, Counter()).update(tr.consolidated().zset.to_dict())
    return {n: {r: w for r, w in c.items() if w} for n, c in out.items()}


def _held(p: dbsp.Pipeline) -> Counter:
    n: Counter = Counter()
    for (_, name), tr in _traces(p):
        n[name] += tr.held_merges
    return n


def _step(p: dbsp.Pipeline, i: int, d: Counter) -> dict:
    _push(p, d)
    if i in U_STEPS:
        p.push("u", _u_rows(i))
    out = {n: z.to_dict() for n, z in p.step().items()}
    if i in READS:  # a multiset of the view's rows (Pipeline.view reads the materialized trace)
        out["view m"] = Counter(tuple(r.values()) for r in p.view("m").to_pylist())
    return out


def _run(deltas: list, hold: int, workers: int, monkeypatch, plan: bool = True, **kw) -> tuple:
    _set_hold(monkeypatch, hold)
    outs = []
    with dbsp.Pipeline(_circuit(), workers=workers, executor=EmbeddedExecutor(step_plan=plan), **kw) as p:
        assert {name for (_, name), _ in _traces(p)} == set(HELD + WALKED)
        for i, d in enumerate(deltas):
            outs.append(_step(p, i, d))
        return outs, _state(p), _held(p)


@pytest.mark.parametrize("workers,plan", [(1, True), (2, True), (1, False)])
def test_held_traces_give_the_outputs_and_state_of_two_way_merges(workers: int, plan: bool, monkeypatch) -> None:
    rng = np.random.default_rng(SEED + 300 + workers + 10 * plan)
    deltas = _deltas(rng, 170, nulls=workers == 2)
    off, state_off, held_off = _run(deltas, 0, workers, monkeypatch, plan)
    assert not +held_off
    for hold in (16,) if BUDGET else (16, 4):  # (under a budget no trace holds: one run is the check)
        on, state_on, held_on = _run(deltas, hold, workers, monkeypatch, plan)
        for i, (a, b) in enumerate(zip(on, off)):
            assert a == b, f"hold {hold}, step {i}, W={workers} (DBSP_HOLD_SEED={SEED})"
        assert state_on == state_off, f"hold {hold} (DBSP_HOLD_SEED={SEED})"
        assert all(held_on[n] == 0 for n in WALKED), held_on
        if BUDGET:  # DBSP_MEMORY_LIMIT: every trace has a batch store, whose levels merge by invariant 15 alone
            assert not +held_on
        else:
            assert all(held_on[n] >= 1 for n in HELD), held_on


def test_held_traces_across_checkpoint_reopen_and_rollback(tmp_path, monkeypatch) -> None:
    """Holds on and off in lockstep, durable: a checkpoint and reopen every 40 steps, and two steps a later node
    fails on (StepError) after the distinct stored its weights, discarded. Outputs and state equal."""
    rng = np.random.default_rng(SEED + 400)
    deltas = _deltas(rng, 85 if BUDGET else 160, False)  # (every step spills under a budget: a reopen less)
    pipes, held = {}, Counter()  # held merges of the durable runs, summed over their sessions
    for hold in (16, 0):
        _set_hold(monkeypatch, hold)
        pipes[hold] = dbsp.Pipeline(_circuit(poison=True), workers=1, storage=str(tmp_path / f"h{hold}"))
    try:
        for i, d in enumerate(deltas):
            outs = {}
            for hold in (16, 0):
                _set_hold(monkeypatch, hold)
                p = pipes[hold]
                if i in (30, 95):
                    poisoned_step(p)
                outs[hold] = _step(p, i, d)
                if i % 40 == 39:
                    p.checkpoint()
                    held[hold] += sum(_held(p)[n] for n in HELD)
                    p.close()
                    pipes[hold] = p = dbsp.Pipeline.open(str(tmp_path / f"h{hold}"), _circuit(poison=True))
                    assert all(max(tr.hold, tr.hold_unread) == hold for _, tr in _traces(p))
            assert outs[16] == outs[0], f"step {i} (DBSP_HOLD_SEED={SEED})"
            if i % 25 == 24:
                assert _state(pipes[16]) == _state(pipes[0]), f"step {i} (DBSP_HOLD_SEED={SEED})"
        assert _state(pipes[16]) == _state(pipes[0])
        assert held[0] == 0 and (BUDGET or held[16] >= 1), held
    finally:
        for p in pipes.values():
            p.close()
