"""A distinct's input trace and a count_distinct's pairs hold their low levels as an aggregate's totals do
(operators/distinct.py invariant 5, count_distinct.py invariant 5, trace/levels.py invariant 18, ``DBSP_TOTALS_HOLD``).

Over random splits into steps after a load (rows of ints and strings, inserts and deletions, multiplicities above 1),
at W = 1 and 2: with ``hold`` on, every step's output and every trace's content equal the run with it off, traces pass
``Trace.check``, and merges of more than two batches did run on the traces whose key index serves their reads (the
fixed-width rows); the distinct over rows with a string column (no key index: its batches are walked) merges two at a
time. The same across a checkpoint and reopen and a step rolled back (StepError). DBSP_HOLD_SEED replays the rows."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import StepError
from dbsp_core.operators.count_distinct import _CountDistinctState
from dbsp_core.operators.distinct import _DistinctState
from tests.core.test_linear_run import add_poison
from tests.core.test_totals_hold import BUDGET, SCHEMA, SEED, _deltas, _push

HELD = ("distinct#3.input", "count_distinct#10.values")  # fixed-width rows: read through their key index
WALKED = ("distinct#5.input",)  # rows with a string column: no key index, two at a time


def _circuit(poison: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("d", t.select(k="k", j="j").distinct())
    c.output("ds", t.distinct())
    c.output("cd", t.group_by("j").agg(n=dbsp.count_distinct("k")))
    if poison:
        add_poison(c, t, SCHEMA)
    return c


def _set_hold(monkeypatch, hold: int) -> None:
    monkeypatch.setattr(_DistinctState, "HOLD", hold)
    monkeypatch.setattr(_CountDistinctState, "HOLD", hold)


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


def _run(deltas: list, hold: int, workers: int, monkeypatch, **kw) -> tuple:
    _set_hold(monkeypatch, hold)
    outs = []
    with dbsp.Pipeline(_circuit(), workers=workers, **kw) as p:
        assert {name for _, name in (k for k, _ in _traces(p))} == set(HELD + WALKED)
        for d in deltas:
            _push(p, d)
            outs.append({n: z.to_dict() for n, z in p.step().items()})
        return outs, _state(p), _held(p)


@pytest.mark.parametrize("workers", [1, 2])
def test_held_distinct_gives_the_outputs_and_state_of_two_way_merges(workers: int, monkeypatch) -> None:
    rng = np.random.default_rng(SEED + 300 + workers)
    deltas = _deltas(rng, 160, nulls=workers == 2)
    off, state_off, held_off = _run(deltas, 0, workers, monkeypatch)
    assert not +held_off
    for hold in (16, 4):
        on, state_on, held_on = _run(deltas, hold, workers, monkeypatch)
        for i, (a, b) in enumerate(zip(on, off)):
            assert a == b, f"hold {hold}, step {i}, W={workers} (DBSP_HOLD_SEED={SEED})"
        assert state_on == state_off, f"hold {hold} (DBSP_HOLD_SEED={SEED})"
        assert all(held_on[n] == 0 for n in WALKED), held_on
        if BUDGET:  # DBSP_MEMORY_LIMIT: every trace has a batch store, whose levels merge by invariant 15 alone
            assert not +held_on
        else:
            assert all(held_on[n] >= 1 for n in HELD), held_on


def test_held_distinct_across_checkpoint_reopen_and_rollback(tmp_path, monkeypatch) -> None:
    """Hold on and off in lockstep, durable: a checkpoint and reopen every 40 steps, and two steps a later node
    fails on (StepError) after the distinct stored its weights, discarded. Outputs and state equal."""
    rng = np.random.default_rng(SEED + 400)
    deltas = _deltas(rng, 120, False)
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
                _push(p, d)
                if i in (30, 95):
                    p.push("t", dbsp.ZSet.from_rows([(1, 0, 5, "s1"), (9, 2, 666, "s9")], SCHEMA))
                    with pytest.raises(StepError, match="poison") as info:
                        p.step()
                    producer, seq = info.value.inputs[-1][1:]
                    p.discard(producer, seq)
                outs[hold] = {n: z.to_dict() for n, z in p.step().items()}
                if i % 40 == 39:
                    p.checkpoint()
                    held[hold] += _held(p)[HELD[0]]
                    p.close()
                    pipes[hold] = p = dbsp.Pipeline.open(str(tmp_path / f"h{hold}"), _circuit(poison=True))
                    assert all(tr.hold == hold for _, tr in _traces(p))
            assert outs[16] == outs[0], f"step {i} (DBSP_HOLD_SEED={SEED})"
            if i % 25 == 24:
                assert _state(pipes[16]) == _state(pipes[0]), f"step {i} (DBSP_HOLD_SEED={SEED})"
        assert _state(pipes[16]) == _state(pipes[0])
        assert held[0] == 0 and (BUDGET or held[16] >= 1), held
    finally:
        for p in pipes.values():
            p.close()
