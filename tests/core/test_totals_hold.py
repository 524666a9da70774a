"""The totals trace of a linear aggregate merges its low levels many batches at a time while its key index serves its
reads (dbsp_core/trace/levels.py invariant 18, ``DBSP_TOTALS_HOLD``; runtime/plan.py design note 5).

Over random group-by circuits (keys of ints and strings, counts, int64 sums, counts of a column with nulls, avgs) and
random splits into steps after a load, at W = 1 and 2: with ``hold`` on, every step's output and every worker's trace
content (consolidated) equal the run with it off, the traces' batches and key indexes pass ``Trace.check``, and merges
of more than two batches did run. The same across a checkpoint and reopen, a step rolled back (StepError), a live
rescale, and with every batch spilled (``memory_limit``: a trace under a batch store merges as before).
DBSP_HOLD_SEED replays the random rows."""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.envvars import settings
from dbsp_core.errors import StepError
from dbsp_core.operators.aggregate import _LinearState
from dbsp_core.runtime.embedded import EmbeddedExecutor
from tests.core.test_linear_run import add_poison

SEED = int(os.environ.get("DBSP_HOLD_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int64()), ("v", pa.int64()), ("s", pa.string())])
GROUPS = 3000  # keys of k: a load of about this many groups puts the totals' top level well above a step's batches
AGGS = {"n": lambda: dbsp.count(), "total": lambda: dbsp.sum("v"), "nv": lambda: dbsp.count("v"),
        "m": lambda: dbsp.avg("v")}
KEYS = [("k",), ("k", "j"), ("s",), ("j",)]
BUDGET = settings().memory_limit is not None  # DBSP_MEMORY_LIMIT set: every pipeline spills, nothing holds


def _circuit(views: list, poison: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    for i, (keys, names) in enumerate(views):
        c.output(f"g{i}", t.group_by(*keys).agg(**{n: AGGS[n]() for n in names}))
    if poison:
        add_poison(c, t, SCHEMA)
    return c


def _row(rng: np.random.Generator, nulls: bool) -> tuple:
    k = int(rng.integers(0, GROUPS))
    v = None if nulls and rng.random() < 0.05 else int(rng.integers(-50, 50))
    return (k, int(rng.integers(0, 3)), v, f"s{k % 400}")


def _deltas(rng: np.random.Generator, steps: int, nulls: bool) -> list[Counter]:
    """A load of about GROUPS rows, then small steps of inserts and deletions of rows present."""
    bag: Counter = Counter()
    out = []
    for i in range(steps):
        d: Counter = Counter()
        for _ in range(2 * GROUPS if i == 0 else int(rng.integers(0, 40))):
            d[_row(rng, nulls)] += 1
        live = [r for r, w in bag.items() if w > 0]
        for j in rng.permutation(len(live))[:int(rng.integers(0, 15))]:
            d[live[j]] -= int(rng.integers(1, bag[live[j]] + 1))
        d = Counter({r: w for r, w in d.items() if w})
        bag.update(d)
        bag = Counter({r: w for r, w in bag.items() if w})
        out.append(d)
    return out


def _push(p: dbsp.Pipeline, d: Counter) -> None:
    if d:
        p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))


def poisoned_step(p: dbsp.Pipeline, rows: list | None = None, schema: pa.Schema = SCHEMA) -> None:
    """A push (``rows`` of ``schema``) that a later node (``add_poison``) fails on: the step raises StepError after the
    aggregates stored their totals (a rollback), and the push is discarded."""
    p.push("t", dbsp.ZSet.from_rows(rows or [(1, 0, 5, "s1"), (9, 2, 666, "s9")], schema))
    with pytest.raises(StepError, match="poison") as info:
        p.step()
    producer, seq = info.value.inputs[-1][1:]
    p.discard(producer, seq)


def _totals(p: dbsp.Pipeline) -> list:
    """Every linear aggregate's totals trace: (worker, name) -> the trace."""
    return [((w, name), tr) for w in range(p.workers) for name, tr in sorted(p.traces(w).items())
            if name.endswith("partials")]


def _state(p: dbsp.Pipeline) -> dict:
    """Each totals trace's content, consolidated, by node name (summed over workers), after Trace.check."""
    out: dict = {}
    for (_, name), tr in _totals(p):
        tr.check()  # batches consolidated, at their levels, the key index equal to their sums
        acc = out.setdefault(name, Counter())
        acc.update(tr.consolidated().zset.to_dict())
    return {n: {r: w for r, w in c.items() if w} for n, c in out.items()}


def _held(p: dbsp.Pipeline) -> int:
    return sum(tr.held_merges for _, tr in _totals(p))


def _run(views: list, deltas: list, hold: int, workers: int, monkeypatch, plan: bool = True, **kw) -> tuple:
    monkeypatch.setattr(_LinearState, "HOLD", hold)
    monkeypatch.setattr(_LinearState, "PER_KEY", False)  # held levels are of step batches (not totals per key)
    outs = []
    with dbsp.Pipeline(_circuit(views), workers=workers, executor=EmbeddedExecutor(step_plan=plan), **kw) as p:
        assert all(tr.hold == (hold if hold > 2 else 0) for _, tr in _totals(p))
        for d in deltas:
            _push(p, d)
            outs.append({n: z.to_dict() for n, z in p.step().items()})
        return outs, _state(p), _held(p)


def _random_case(rng: np.random.Generator, case: int) -> tuple[list, int, bool]:
    """A random case's views (group keys, aggregates), worker count (1 or 2 by case) and whether v has nulls (a null
    in v sends a step of count(v)/sum(v)/avg off the C path: linear_step or Python)."""
    keys = [KEYS[0]] + [KEYS[int(i)] for i in rng.choice(range(1, len(KEYS)), int(rng.integers(0, 3)), replace=False)]
    views = [(k, [str(n) for n in sorted(rng.choice(sorted(AGGS), int(rng.integers(1, 4)), replace=False))])
             for k in keys]
    return views, 1 + case % 2, case % 3 == 2


@pytest.mark.parametrize("case", range(6))
def test_held_levels_give_the_outputs_and_state_of_two_way_merges(case: int, monkeypatch) -> None:
    """Random circuits over random splits: hold 16 (and 4) against hold off, step by step, and the state."""
    rng = np.random.default_rng(SEED + case)
    views, workers, nulls = _random_case(rng, case)
    deltas = _deltas(rng, 160, nulls)
    off, state_off, held_off = _run(views, deltas, 0, workers, monkeypatch)
    for hold in (16, 4):
        on, state_on, held_on = _run(views, deltas, hold, workers, monkeypatch)
        for i, (a, b) in enumerate(zip(on, off)):
            assert a == b, f"hold {hold}, step {i}, views {views}, W={workers} (DBSP_HOLD_SEED={SEED})"
        assert state_on == state_off, f"hold {hold} (DBSP_HOLD_SEED={SEED})"
        if BUDGET:  # DBSP_MEMORY_LIMIT: every trace has a batch store, whose levels merge by invariant 15 alone
            assert held_on == 0
        else:
            assert held_on >= workers, (held_on, views)  # the totals by k (GROUPS groups) merged more than two at once
    assert held_off == 0
    # and the unplanned path (no fused chain: the aggregate's own step) holds the same way
    unplanned, state_u, held_u = _run(views, deltas, 16, workers, monkeypatch, plan=False)
    assert unplanned == off and state_u == state_off and (held_u == 0 if BUDGET else held_u >= workers)


def test_held_levels_across_checkpoint_reopen_rollback_and_live_rescale(tmp_path, monkeypatch) -> None:
    """A durable pipeline stepping with hold on and one with it off, in lockstep: a checkpoint and reopen every 40
    steps (the reopened traces get their pending batches back; the key index is rebuilt), a push a later node fails
    on (StepError) after the aggregates stored their totals, discarded; live rescales 1 -> 2 -> 1 workers. Outputs
    step by step and the consolidated totals equal, traces checked."""
    rng = np.random.default_rng(SEED + 100)
    views = [(("k",), ["n", "total"]), (("s",), ["n", "nv"]), (("k", "j"), ["m"])]
    deltas = _deltas(rng, 150, False)
    pipes = {}
    monkeypatch.setattr(_LinearState, "PER_KEY", False)  # held levels are of step batches (not totals per key)
    for hold in (16, 0):
        monkeypatch.setattr(_LinearState, "HOLD", hold)
        pipes[hold] = dbsp.Pipeline(_circuit(views, poison=True), workers=1, storage=str(tmp_path / f"h{hold}"))
    try:
        for i, d in enumerate(deltas):
            outs = {}
            for hold in (16, 0):
                monkeypatch.setattr(_LinearState, "HOLD", hold)
                p = pipes[hold]
                if i in (50, 110):
                    p.rescale(workers=2 if p.workers == 1 else 1)
                _push(p, d)
                if i in (30, 95):
                    poisoned_step(p)
                outs[hold] = {n: z.to_dict() for n, z in p.step().items()}
                if i % 40 == 39:
                    p.checkpoint()
                    p.close()
                    pipes[hold] = p = dbsp.Pipeline.open(str(tmp_path / f"h{hold}"), _circuit(views, poison=True))
                    assert all(tr.hold == (16 if hold else 0) for _, tr in _totals(p))
            assert outs[16] == outs[0], f"step {i} (DBSP_HOLD_SEED={SEED})"
            if i % 25 == 24:
                assert _state(pipes[16]) == _state(pipes[0]), f"step {i} (DBSP_HOLD_SEED={SEED})"
        assert _state(pipes[16]) == _state(pipes[0])
        assert _held(pipes[0]) == 0
    finally:
        for p in pipes.values():
            p.close()


def test_held_traces_under_a_memory_budget_merge_as_before(tmp_path, monkeypatch) -> None:
    """With every batch spilled (memory_limit of a byte) a totals trace belongs to a batch store and merges by
    invariant 15 as any trace (hold is not used): outputs and state equal hold off, and no held merge ran."""
    rng = np.random.default_rng(SEED + 200)
    views = [(("k",), ["n", "total"]), (("s",), ["nv"])]
    deltas = _deltas(rng, 80, False)
    off, state_off, _ = _run(views, deltas, 0, 1, monkeypatch)
    on, state_on, held = _run(views, deltas, 16, 1, monkeypatch, memory_limit=1, spill_dir=str(tmp_path))
    assert on == off and state_on == state_off
    assert held == 0
