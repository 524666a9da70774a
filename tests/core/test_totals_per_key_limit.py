"""Totals kept per key (dbsp_core/trace/levels.py invariant 19) when the key index cannot grow half way through a
step: the store is undone (csrc/linrun.h invariant 4, csrc/keyindex.h invariant 4) or the dirty-key index's adds are
taken back, the trace syncs its totals into its batches and drops its index, and the step completes through the
batches.

A group-by (count, sum; int and string keys) loaded with GROUPS groups; then the process-wide key index budget
(csrc/keyindex.h invariant 6) is set to the bytes held at that moment, and one step both updates held groups and adds
many new ones (the main index's entries must grow: its store fails half way, after its in-place updates and some new
keys), or, after a read that synced the traces, updates many held groups only (the main index does not grow, the
fresh dirty-key index must). The step's output, every later step's and the synced state equal a dict model of the
view and the run with totals per key off; the fallback ran (``PerKeyTotals.pk_fallbacks``) and the trace keeps its
totals in batches from then on. DBSP_PERKEY_SEED replays."""

from __future__ import annotations

import os
import random
import warnings
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.envvars import settings
from dbsp_core.operators.aggregate import _LinearState
from dbsp_core.trace.keyindex import PerKeyTotals

SEED = int(os.environ.get("DBSP_PERKEY_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("s", pa.string())])
GROUPS = 3000
BUDGET = settings().memory_limit is not None  # DBSP_MEMORY_LIMIT: every trace keeps its totals in batches


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("byk", t.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    c.output("bys", t.group_by("s").agg(n=dbsp.count()))
    return c


def _rows(rng: np.random.Generator, ks: np.ndarray) -> list:
    return [(int(k), int(rng.integers(-50, 50)), f"s{k}") for k in ks]


def _deltas(rng: np.random.Generator, scenario: str) -> list[Counter]:
    """A load; small steps; the big step (index 5: new and held groups, or held groups only); small steps."""
    bag: Counter = Counter()
    out = []
    for i in range(40):
        d: Counter = Counter()
        if i == 0:
            ks = np.arange(GROUPS)
        elif i == 5 and scenario == "store":  # held groups, then 2,000 new ones (the entries must grow)
            ks = np.concatenate([rng.integers(0, GROUPS, 300), GROUPS + 1000 * i + np.arange(2000)])
        elif i == 5:  # 1,500 held groups, none new (the dirty-key index must grow)
            ks = rng.permutation(GROUPS)[:1500]
        else:
            ks = rng.integers(0, GROUPS + 200, int(rng.integers(0, 40)))
        for r in _rows(rng, ks):
            d[r] += 1
        live = [r for r, w in bag.items() if w > 0]
        for j in rng.permutation(len(live))[:int(rng.integers(0, 30))]:  # deletions: some groups go to 0
            d[live[j]] -= bag[live[j]]
        d = Counter({r: w for r, w in d.items() if w})
        bag.update(d)
        bag = Counter({r: w for r, w in bag.items() if w})
        out.append(d)
    return out


def _model(bag: Counter) -> dict:
    """The views' rows (each with weight 1) from the bag of input rows: per k its count and sum, per s its count."""
    n, tot, ns = Counter(), Counter(), Counter()
    for (k, v, s), w in bag.items():
        n[k] += w
        tot[k] += w * v
        ns[s] += w
    return {"byk": {(k, n[k], tot[k]): 1 for k in n if n[k]}, "bys": {(s, ns[s]): 1 for s in ns if ns[s]}}


def _totals(p: dbsp.Pipeline) -> list:
    return [tr for name, tr in sorted(p.traces(0).items()) if name.endswith("partials")]


_store_totals = PerKeyTotals.store_totals


def _tight(store_totals):
    """``store_totals`` that first sets the key indexes' budget to the bytes they hold (the dirty-key index then
    cannot grow)."""
    def tight(self, batch, ix, probed=None, **kw):
        _zset.keyindex_budget(_zset.keyindex_total_bytes())
        return store_totals(self, batch, ix, probed, **kw)
    return tight


def _run(deltas: list, on: bool, scenario: str | None, monkeypatch) -> tuple:
    """Outputs step by step, the views integrated (checked against the model at every step), the traces' content."""
    monkeypatch.setattr(_LinearState, "PER_KEY", on)
    outs, views, bag = [], {"byk": Counter(), "bys": Counter()}, Counter()
    budget = _zset.keyindex_budget()
    fell0 = PerKeyTotals.pk_fallbacks
    dropped: list = []
    try:
        with dbsp.Pipeline(_circuit(), workers=1) as p:
            for i, d in enumerate(deltas):
                if scenario == "dirty" and i == 5:
                    for tr in _totals(p):
                        tr.check()  # a read: every trace synced, its dirty-key index gone
                if scenario is not None and i == 5:
                    assert all(tr.totals_per_key for tr in _totals(p)) == (not BUDGET)
                    if scenario == "store":  # any growth from now on is refused: the main index's store
                        _zset.keyindex_budget(_zset.keyindex_total_bytes())
                    else:  # refused from the trace's record of the step on, its index's store done
                        monkeypatch.setattr(PerKeyTotals, "store_totals", _tight(PerKeyTotals.store_totals))
                if d:
                    p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    out = p.step()
                dropped += [w for w in seen if issubclass(w.category, dbsp.IndexDroppedWarning)]
                if scenario is not None and i == 5:
                    _zset.keyindex_budget(budget)
                    monkeypatch.setattr(PerKeyTotals, "store_totals", _store_totals)
                    fell = PerKeyTotals.pk_fallbacks - fell0
                    if on and not BUDGET:  # both totals traces could not grow: synced, their indexes dropped
                        assert fell == 2 and not any(tr.totals_per_key for tr in _totals(p)), (fell, SEED)
                outs.append({n: z.to_dict() for n, z in out.items()})
                bag.update(d)
                bag = Counter({r: w for r, w in bag.items() if w})
                for n, z in out.items():
                    views[n].update(z.to_dict())
                got = {n: {r: w for r, w in c.items() if w} for n, c in views.items()}
                assert got == _model(bag), f"step {i}, on={on}, {scenario} (DBSP_PERKEY_SEED={SEED})"
            state = {}
            for tr in _totals(p):
                tr.check()  # batches consolidated, the key index (if kept) equal to their sums
                state[tr.key] = {r: w for r, w in tr.consolidated().zset.to_dict().items() if w}
            return outs, state, dropped
    finally:
        _zset.keyindex_budget(budget)


@pytest.mark.parametrize("scenario", ["store", "dirty"])
def test_an_index_that_cannot_grow_half_way_through_a_step_falls_back_to_batches(scenario: str, monkeypatch) -> None:
    rng = np.random.default_rng(SEED)
    deltas = _deltas(rng, scenario)
    off, state_off, _ = _run(deltas, False, None, monkeypatch)
    on, state_on, dropped = _run(deltas, True, scenario, monkeypatch)
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"step {i}, {scenario} (DBSP_PERKEY_SEED={SEED})"
    assert state_on == state_off
    if not BUDGET:
        assert len(dropped) >= 2 and all("dropped its key index" in str(w.message) for w in dropped)
