"""A linear group-by keeping its totals per key probes the dirty-key index only for the keys its key index does not
hold once every key it holds is dirty (csrc/linrun.h invariant 6, ``PerKeyTotals.pk_found_dirty``): random steps of
inserts and deletions over few keys (groups emptied, groups coming back, rows that cancel within their step, keys
never seen before), reads between steps (each a sync, after which the dirty index starts afresh and the count of
clean keys is known again) and steps rolled back (StepError), at W = 1 and 2. Every step's output equals a dict
model's change of the view; every read's totals equal a lockstep pipeline's with totals per key off; the path ran
(``pk_found_dirty_steps``). DBSP_TEST_SEED replays."""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pytest

import dbsp_core as dbsp
from dbsp_core.operators.aggregate import _LinearState
from dbsp_core.trace.keyindex import PerKeyTotals
from tests.core.test_totals_hold import BUDGET, SCHEMA, _circuit, _state, poisoned_step

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
VIEWS = [(("k",), ["n", "total"])]


def _view(rows: Counter) -> Counter:
    g: dict = {}
    for (k, _, v, _), m in rows.items():
        n, s = g.get(k, (0, 0))
        g[k] = (n + m, s + m * v)
    return Counter({(k, n, s): 1 for k, (n, s) in g.items() if n != 0})


@pytest.mark.skipif(BUDGET, reason="under DBSP_MEMORY_LIMIT the totals are kept in batches: no per-key path")
@pytest.mark.parametrize("workers", [1, 2])
def test_found_dirty_steps_match_a_dict_model(workers: int, monkeypatch) -> None:
    rng = np.random.default_rng(SEED + workers)
    print(f"DBSP_TEST_SEED={SEED}")
    rows: Counter = Counter()  # the integrated input: row -> multiplicity
    ran = PerKeyTotals.pk_found_dirty_steps
    pipes = {}
    for on in (True, False):
        monkeypatch.setattr(_LinearState, "PER_KEY", on)
        pipes[on] = dbsp.Pipeline(_circuit(VIEWS, poison=True), workers=workers)
    try:
        for step in range(150):
            domain = 30 if step < 90 else 45  # later steps bring keys never seen (absent from the index, not dirty)
            n = int(rng.integers(1, 25)) if step else 120
            ins = [(int(rng.integers(0, domain)), 0, int(rng.integers(-3, 4)), "s") for _ in range(n)]
            live = list(rows.elements())
            dels = [live[i] for i in rng.choice(len(live), min(len(live), int(rng.integers(0, 20))), replace=False)] \
                if step else []
            if step % 9 == 4:  # a row inserted and deleted in the same step: it cancels
                dels.append(ins[0])
            d = Counter(ins)
            d.subtract(Counter(dels))
            d = Counter({r: m for r, m in d.items() if m})
            outs = {}
            for on in (True, False):
                monkeypatch.setattr(_LinearState, "PER_KEY", on)
                p = pipes[on]
                if d:
                    p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))
                if step % 17 == 8:  # the step fails after the group-by stored its totals: rolled back, the
                    poisoned_step(p)  # poisoned push discarded, the rest stepped again below
                outs[on] = p.step()["g0"].to_dict()
            before = _view(rows)
            rows.update(d)
            rows = Counter({r: m for r, m in rows.items() if m})
            want = _view(rows)
            want.subtract(before)
            assert outs[True] == {r: m for r, m in want.items() if m}, f"step {step} (DBSP_TEST_SEED={SEED})"
            assert outs[False] == outs[True]
            if step % 13 == 12:  # a read: the totals traces synced from their indexes
                assert _state(pipes[True]) == _state(pipes[False]), f"step {step} (DBSP_TEST_SEED={SEED})"
    finally:
        for p in pipes.values():
            p.close()
    assert PerKeyTotals.pk_found_dirty_steps > ran, "the found-dirty path never ran"
