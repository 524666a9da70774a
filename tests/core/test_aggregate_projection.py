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
