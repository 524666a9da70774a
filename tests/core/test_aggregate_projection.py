"""min/max aggregates over inputs with columns they do not read (operators/aggregate.py invariant 9): the change is
projected onto the keys and the read columns before it is indexed, so rows that differ only in other columns
consolidate (an insertion and a deletion of two such rows cancel), limb columns (avg) are appended after the
indexing, a (key, value) projection is the value multiset's batch as it stands, and at W = 2 the exchange before
the aggregate projects on the sender (runtime/plan.py ``_ProjectedExchange``). Checked against a dict model
after every step, W in {1, 2}, with nulls in keys and values."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.operators.aggregate import _ExtremesState

from test_aggregate_extremes import _steps_against_model

SCHEMA = pa.schema([("x", pa.int64()), ("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64())])


def _model(bag: Counter) -> dict:
    groups: dict = {}
    for (_, k, _, v), w in bag.items():
        g = groups.setdefault(k, {"n": 0, "vs": [], "total": 0, "nv": 0})
        g["n"] += w
        if v is not None:
            g["vs"] += [v] * w
            g["total"] += v * w
            g["nv"] += w
    return {(k, g["n"], min(g["vs"], default=None), max(g["vs"], default=None),
             g["total"] / g["nv"] if g["nv"] else None): 1 for k, g in groups.items() if g["n"]}


@pytest.mark.parametrize("workers,seed,nulls", [(1, 11, 0.1), (2, 12, 0.1), (1, 13, 0.0), (2, 14, 0.0)])
def test_min_max_over_a_projection(workers: int, seed: int, nulls: float) -> None:
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v"), mean=dbsp.avg("v")))
    p = dbsp.Pipeline(c, workers=workers)
    states = [s for wk in p.executor._workers for s in wk.instances.values() if type(s) is _ExtremesState]
    assert states and all(s.projected == ["k", "v"] for s in states)

    def new_row(rng):  # few (k, v) pairs, many rows each: a step's rows often differ only in x and s
        k = None if rng.random() < 0.05 else int(rng.integers(0, 6))
        v = None if rng.random() < nulls else int(rng.integers(-8, 8))
        return (int(rng.integers(0, 3)), k, str(rng.choice(["a", "bb", ""])), v)

    workers_ = p.executor._workers
    _steps_against_model(p, rng, 120, (0, 14), new_row, 0.3, 0.15, SCHEMA, _model)
    assert sum(s.projected_steps for s in states) >= 100
    # at W = 2 the exchange before the aggregate projects on the sender (runtime/plan.py _ProjectedExchange)
    assert (sum(wk.plan.counts["projected"] for wk in workers_) >= 100) == (workers > 1)


OTHER = pa.schema([("id", pa.int64()), ("cat", pa.utf8()), ("junk", pa.utf8())])


@pytest.mark.parametrize("workers,seed", [(1, 15), (2, 16)])
def test_min_max_over_a_join_gathering_only_the_read_columns(workers: int, seed: int) -> None:
    """A join whose one consumer is the exchange before a projecting min/max aggregate: at W = 2 the join gathers
    only the (category, value) columns from its pairs (runtime/plan.py ``_JoinSlots``), left and right columns in
    the join's order, which the exchange and the aggregate put in the projection's order; deletions on both sides."""
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    o = c.input("o", OTHER)
    c.output("g", t.join(o, left_on="k", right_on="id").group_by("cat").agg(
        n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v"), mean=dbsp.avg("v")))
    p = dbsp.Pipeline(c, workers=workers)
    bag: Counter = Counter()
    others: Counter = Counter()
    view: Counter = Counter()
    for step in range(60):
        delta = Counter()
        for _ in range(int(rng.integers(0, 12))):
            present = [r for r, w in (bag + delta).items() if w > 0]
            if present and rng.random() < 0.4:
                delta[present[int(rng.integers(len(present)))]] -= 1
            else:
                v = None if rng.random() < 0.1 else int(rng.integers(-8, 8))
                delta[(int(rng.integers(0, 3)), int(rng.integers(0, 8)), "s", v)] += 1
        odelta = Counter()
        if rng.random() < 0.5:
            present = [r for r, w in others.items() if w > 0]
            if present and rng.random() < 0.4:
                odelta[present[int(rng.integers(len(present)))]] -= 1
            else:
                odelta[(int(rng.integers(0, 8)), str(rng.choice(["a", "b", "c"])), "j" * int(rng.integers(3)))] += 1
        delta = Counter({r: w for r, w in delta.items() if w})
        odelta = Counter({r: w for r, w in odelta.items() if w})
        bag.update(delta)
        others.update(odelta)
        if delta:
            p.push("t", dbsp.ZSet.from_rows(list(delta), SCHEMA, weights=list(delta.values())))
        if odelta:
            p.push("o", dbsp.ZSet.from_rows(list(odelta), OTHER, weights=list(odelta.values())))
        for r, w in p.step()["g"].to_dict().items():
            view[r] += w
        view = Counter({r: w for r, w in view.items() if w})
        joined = Counter()
        for (x, k, s, v), w in bag.items():
            for (i, cat, junk), w2 in others.items():
                if k is not None and k == i and w and w2:
                    joined[(x, cat, s, v)] += w * w2
        assert dict(view) == _model(joined), f"step {step}"
    counts = Counter()
    for wk in p.executor._workers:
        counts.update(wk.plan.counts)
    p.close()
    assert (counts["joined"] >= 30) == (workers > 1), counts
