"""Rollbacks of a linear aggregate keeping its totals per key (trace/levels.py invariant 19, rollback.py invariant 3),
against a dict model: random steps of a group-by (count, sum) with rollback captures taken at random points, held
over one to several steps and nested two deep (a stage task's capture spans its steps; the executor's, one step),
restored or dropped at random. After each step the output equals the model's change; at random points the totals
trace's synced content and its key index (``Trace.check``) equal a recompute of the model. DBSP_PERKEY_SEED replays."""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.envvars import settings
from dbsp_core.operators.aggregate import _LinearState
from dbsp_core.runtime.rollback import capture, restore
from dbsp_core.trace.keyindex import PerKeyTotals

SEED = int(os.environ.get("DBSP_PERKEY_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _view(bag: Counter) -> dict:
    """The group-by's output over ``bag``: (k, n, total) -> 1."""
    n: Counter = Counter()
    s: Counter = Counter()
    for (k, v), w in bag.items():
        n[k] += w
        s[k] += w * v
    return {(k, n[k], s[k]): 1 for k in n if n[k]}


def _diff(a: dict, b: dict) -> dict:
    out = Counter(b)
    out.subtract(a)
    return {r: w for r, w in out.items() if w}


@pytest.mark.parametrize("case", range(4))
def test_rollbacks_of_totals_per_key_against_a_model(case: int, monkeypatch) -> None:
    monkeypatch.setattr(_LinearState, "PER_KEY", True)
    rng = np.random.default_rng(SEED + case)
    c = dbsp.Circuit()
    c.output("g", c.input("t", SCHEMA).group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    groups = int(rng.choice([20, 300, 3000]))
    steps0 = PerKeyTotals.pk_steps
    undone = 0
    with dbsp.Pipeline(c, workers=1) as p:
        insts = list(p.executor._workers[0].stateful().values())
        trace = next(t for name, t in p.traces(0).items() if name.endswith("partials"))
        bag: Counter = Counter()
        marks: list = []  # (saved, bag as then), oldest first; at most two held
        for i in range(160):
            if len(marks) < 2 and rng.random() < 0.3:
                marks.append((capture(insts), Counter(bag)))
            d: Counter = Counter()
            for _ in range(int(rng.integers(1, 4 * groups if i == 0 else 60))):
                d[(int(rng.integers(0, groups)), int(rng.integers(-9, 10)))] += 1
            live = [r for r, w in bag.items() if w > 0]
            for j in rng.permutation(len(live))[:int(rng.integers(0, 30))]:
                d[live[j]] -= int(rng.integers(1, bag[live[j]] + 1))
            d = Counter({r: w for r, w in d.items() if w})
            before = _view(bag)
            if d:
                p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))
            out = p.step()["g"].to_dict()
            bag.update(d)
            bag = Counter({r: w for r, w in bag.items() if w})
            assert out == _diff(before, _view(bag)), f"step {i} (DBSP_PERKEY_SEED={SEED})"
            if marks and rng.random() < 0.35:
                at = 0 if len(marks) == 2 and rng.random() < 0.3 else len(marks) - 1
                saved, was = marks[at]
                if rng.random() < 0.7:  # restore it: the captures taken after it are of a state undone, dropped
                    restore(saved)
                    bag = was
                    undone += 1
                    marks = marks[:at]
                else:  # drop it (a step that did not fail)
                    marks.pop(at)
                del saved
            if rng.random() < 0.1:
                trace.check()  # synced batches consolidated; the key index equal to their sums
                got = {r: w for r, w in trace.consolidated().zset.to_dict().items() if w}
                assert got == {(k, n, s, n): 1 for (k, n, s) in _view(bag)}, f"step {i} (DBSP_PERKEY_SEED={SEED})"
        trace.check()
        assert {r: w for r, w in trace.consolidated().zset.to_dict().items() if w} == \
            {(k, n, s, n): 1 for (k, n, s) in _view(bag)}
    assert undone > 0
    assert (settings().memory_limit is not None) or PerKeyTotals.pk_steps - steps0 >= 160  # (a budget: batches)



@pytest.mark.parametrize("low", [-(2**63), 2**63 - 1], ids=["min", "max"])
def test_a_rollback_restores_totals_whose_rows_overflow_one_at_a_time(low: int, monkeypatch) -> None:
    """A step whose row of old totals (-1 times a sum of INT64_MIN) and row of new ones (a count up, the sum the same)
    the step put as their net, then rolled back: taking back the step's rows one at a time overflows on the first,
    so the rollback failed and the pipeline kept a broken state (found at W=2 by test_integer_range, where the other
    worker's overflow rolls back a step this worker stored: DBSP_HYPOTHESIS_SEED=107366087 shrunk, a race). Here the
    capture and restore are made by hand at W=1, so it happens every run; the index is then the one before, and the
    steps after it match the model."""
    monkeypatch.setattr(_LinearState, "PER_KEY", True)
    c = dbsp.Circuit()
    c.output("g", c.input("t", SCHEMA).group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    with dbsp.Pipeline(c, workers=1) as p:
        insts = list(p.executor._workers[0].stateful().values())
        trace = next(t for name, t in p.traces(0).items() if name.endswith("partials"))
        bag: Counter = Counter({(0, low): 1, (1, low): 1})
        p.push("t", dbsp.ZSet.from_rows(list(bag), SCHEMA))
        assert p.step()["g"].to_dict() == _view(bag)
        undone0 = PerKeyTotals.pk_steps
        for rows in ([(0, 0)], [(0, 0), (1, 0), (2, low)], [(1, 0), (1, 0)]):
            saved = capture(insts)
            p.push("t", dbsp.ZSet.from_rows(rows, SCHEMA))
            after = bag + Counter(rows)
            assert p.step()["g"].to_dict() == _diff(_view(bag), _view(after))
            restore(saved)  # as if the step failed on another worker
            trace.check()  # the key index equal to the batches' sums, synced
            assert {r: w for r, w in trace.consolidated().zset.to_dict().items() if w} == \
                {(k, n, s, n): 1 for (k, n, s) in _view(bag)}
        # the steps stored per key, so their undo took them back (under a memory budget the totals are in batches,
        # and the restore puts their lists back: checked the same way above)
        assert settings().memory_limit is not None or PerKeyTotals.pk_steps - undone0 == 3
        p.push("t", dbsp.ZSet.from_rows([(0, 0), (2, 1)], SCHEMA))
        after = bag + Counter([(0, 0), (2, 1)])
        assert p.step()["g"].to_dict() == _diff(_view(bag), _view(after))
