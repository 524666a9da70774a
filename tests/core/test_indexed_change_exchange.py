"""An exchange whose one consumer indexes its change by the exchange's key (runtime/plan.py design note 4,
``_IndexedChangeExchange`` / ``_MergedChange``): at W > 1 the sender indexes its change as a distinct (or a projecting
min/max, tests/core/test_aggregate_projection.py) would and sends runs of that index; the receiver merges the runs
(``merge_parts``) and steps from the merged index. Checked against a dict model after every step (W in {1, 2, 3},
with retractions, nulls and string columns), against the step plan turned off, and ``merge_parts`` against
``index_by`` of the concatenated parts (rows, order, weights, key and row hashes), for more parts than one k-way
merge takes. Seeds from ``DBSP_TEST_SEED`` (printed on failure)."""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.plan import MERGE_K, merge_parts
from dbsp_core.zset import ZSet

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64()), ("x", pa.int64())])


def _row(rng) -> tuple:
    k = None if rng.random() < 0.05 else int(rng.integers(0, 30))
    s = None if rng.random() < 0.05 else str(rng.choice(["a", "bb", "", "ccc"]))
    v = None if rng.random() < 0.05 else int(rng.integers(-20, 20))
    return (k, s, v, int(rng.integers(0, 4)))


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    pairs = t.select(k="k", s="s").distinct()  # exchanged by (k, s), its whole row: the fused exchange
    c.output("pairs", pairs)
    c.output("per_k", pairs.group_by("k").agg(n=dbsp.count()))
    c.output("ext", t.group_by("k").agg(lo=dbsp.min("v"), hi=dbsp.max("v"), n=dbsp.count()))  # projected (k, v)
    return c


def _model(bag: Counter) -> dict[str, dict]:
    pairs = {(k, s) for (k, s, _, _), w in bag.items() if w > 0}
    per_k = Counter(k for k, _ in pairs)
    groups: dict = {}
    for (k, _, v, _), w in bag.items():
        g = groups.setdefault(k, [0, []])
        g[0] += w
        if v is not None:
            g[1] += [v] * w
    return {"pairs": {p: 1 for p in pairs}, "per_k": {(k, n): 1 for k, n in per_k.items()},
            "ext": {(k, min(vs, default=None), max(vs, default=None), n): 1 for k, (n, vs) in groups.items() if n}}


def _run(workers: int, seed: int, steps: int, step_plan: bool = True) -> tuple[list[dict], dict[str, int]]:
    """Random steps (inserts, and retractions of rows pushed before) into the circuit, every other one large enough to
    be spread over the workers (so each receives runs from several senders); each step's outputs, checked against the
    model; the plan counts summed over the workers."""
    rng = np.random.default_rng(seed)
    p = dbsp.Pipeline(_circuit(), workers=workers, executor=EmbeddedExecutor(step_plan=step_plan))
    bag: Counter = Counter()
    views: dict[str, Counter] = {n: Counter() for n in ("pairs", "per_k", "ext")}
    outs = []
    for step in range(steps):
        delta: Counter = Counter()
        big = step % 2 == 1  # a push of >= 2,048 rows is spread over the workers (smaller ones go to one worker)
        for _ in range(int(rng.integers(2_100, 3_000) if big else rng.integers(0, 60))):
            delta[_row(rng)] += 1
        live = [r for r, w in bag.items() if w > 0]
        gone = int(rng.integers(0, 400 if big else 25))
        for i in rng.choice(len(live), size=min(len(live), gone), replace=False) if live else []:
            delta[live[int(i)]] -= 1
        delta = Counter({r: w for r, w in delta.items() if w})
        bag.update(delta)
        if delta:
            p.push("t", ZSet.from_rows(list(delta), SCHEMA, weights=list(delta.values())))
        got = p.step()
        outs.append({n: z.to_dict() for n, z in got.items()})
        for n, z in got.items():
            views[n].update(z.to_dict())
            views[n] = Counter({r: w for r, w in views[n].items() if w})
        want = _model(Counter({r: w for r, w in bag.items() if w}))
        for n in views:
            assert dict(views[n]) == want[n], f"seed {seed}, W={workers}, step {step}, view {n}"
    counts: Counter = Counter()
    for wk in p.executor._workers:
        counts.update(wk.plan.counts)
    p.close()
    return outs, dict(counts)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_distinct_and_projected_min_max_take_indexed_runs(workers: int) -> None:
    steps = 30
    outs, counts = _run(workers, SEED + workers, steps)
    if workers == 1:  # the exchange is the identity: nothing fused here
        assert counts.get("keyed", 0) == counts.get("changes_merged", 0) == 0, counts
    else:
        # every worker's distinct and min/max stepped from merged runs every step; senders with rows indexed them
        assert counts["changes_merged"] == 2 * steps * workers, counts
        assert counts["keyed"] >= steps // 2 and counts["projected"] >= steps // 2, counts
    # the same outputs, step by step, with the plan off (each output consolidated: compared as dicts)
    off, off_counts = _run(workers, SEED + workers, steps, step_plan=False)
    assert not any(off_counts.values())
    assert outs == off, f"seed {SEED + workers}"


def test_merge_parts_equals_index_by_of_the_concatenation() -> None:
    """More parts than one k-way merge takes (MERGE_K), of one schema and key, sliced from indexed batches by
    key-hash ranges as an exchange cuts runs, with rows of equal identity in several parts (weights summed, zero
    sums dropped)."""
    rng = np.random.default_rng(SEED)
    rows = [_row(rng) for _ in range(600)]
    parts, zsets = [], []
    for i in range(MERGE_K + 9):
        pick = rng.choice(len(rows), size=int(rng.integers(0, 40)))
        w = rng.choice([-1, 1, 2], size=len(pick)).tolist()
        z = ZSet.from_rows([rows[int(j)] for j in pick], SCHEMA, weights=w)
        ix = z.index_by(["k", "s"])
        cut = int(rng.integers(0, len(ix) + 1))  # two runs of one sender's index, as two parts
        parts += [ix._slice(0, cut), ix._slice(cut, len(ix))]
        zsets.append(z)
    assert len([p for p in parts if len(p)]) > MERGE_K
    got = merge_parts(parts)
    want = ZSet.concat(zsets).index_by(["k", "s"])
    assert got is not None and got.key == want.key, f"seed {SEED}"
    assert got.zset.data.equals(want.zset.data), f"seed {SEED}"
    assert np.array_equal(got.zset.weights, want.zset.weights) and np.array_equal(got.key_hash, want.key_hash)
    assert got._rh is not None and np.array_equal(got._rh, want._rh), f"seed {SEED}: row hashes"
    assert merge_parts([]) is None and merge_parts([parts[0]._slice(0, 0)]) is None
