"""Microbenchmarks of the per-step path: one 1k-row step (push and step, 900 new bids and 100 deletions) of group-by, join and distinct on a 1M-row state, W=1, in memory (bench_scaling's workloads at 1M:100k)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from bench_scaling import AUCTIONS, bids, circuit
from conftest import GROUPS, ROWS, SEED

import dbsp_core as dbsp

CHANGE, DELS = 1000, 100
ROUNDS, WARMUP = 100, 10  # a mean over 100 consecutive steps takes in the merges they pay (dbsp_core/trace/levels.py)


@pytest.fixture(scope="module", params=["group_by", "join", "distinct"])
def loaded(request):
    """A pipeline holding 1M bids over 100k keys, loaded in 1M-row steps, and a pool of loaded bids to delete."""
    query = request.param
    rng = np.random.default_rng(SEED)
    p = dbsp.Pipeline(circuit(query), workers=1)
    if query == "join":
        ids = np.arange(GROUPS)
        p.push("auctions", pa.table({"id": ids, "category": ids % 1000}, schema=AUCTIONS))
    t = bids(rng, ROWS, query, GROUPS)
    p.push("bids", t)
    p.step()
    yield query, p, rng, t.slice(0, DELS * (ROUNDS + WARMUP + 1))
    p.close()


@pytest.mark.benchmark(group="step: 1k-row change, 1M-row state, W=1")
def test_step_1k_on_1m(benchmark, loaded) -> None:
    """Push a 1k-row change (data made in the untimed setup) and run the step; mean and max include merges."""
    query, p, rng, pool = loaded
    neg = np.full(DELS, -1, dtype=np.int64)
    made = iter(range(ROUNDS + WARMUP + 1))

    def setup() -> tuple[tuple, dict]:
        i = next(made)
        return (bids(rng, CHANGE - DELS, query, GROUPS), pool.slice(i * DELS, DELS)), {}

    def step(ins: pa.Table, dels: pa.Table) -> dict:
        p.push("bids", ins)
        p.push("bids", dels, weights=neg)
        return p.step()

    out = benchmark.pedantic(step, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP)
    assert set(out) == {"v"}  # distinct's view may not change in a step: every pair is already in the state
