"""The min/max step's kernels of csrc/extremes.h design notes 8 and 9 against dict models: the probe's fold slot by slot
(a min and a max of one column folded in one pass, int64 columns without nulls read directly, narrower or nullable ones
through their validity), the recompute's seeks in stages across every value batch, and ``_zset.extremes_recompute``
(the scan and the fill-in of the new extremes in one call).

The circuit test runs random steps (Hypothesis: the split into steps, inserts, deletions of random rows and of groups'
current extremes) over a load of two fenced batches (``IndexedZSet.FENCE_MIN`` rows and more), at W = 1 and 2, and
checks the integrated view after every step against the model; the kernel test checks the fill-in against a dict over
the same value batches, for sought groups in ascending and in any order, and that it writes nothing else."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.operators.aggregate import _ExtremesState
from dbsp_core.zset import IndexedZSet, ZSet

SCHEMA = pa.schema([("k", pa.int64()), ("a", pa.int32()), ("b", pa.int64()), ("c", pa.int64())])
GROUPS = 300
FEW = settings(max_examples=examples(10), deadline=None)


def _circuit() -> dbsp.Circuit:
    """Pairs over a nullable int32 column (min first) and a non-null int64 one (max first), a lone min, a count."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo_a=dbsp.min("a"), hi_a=dbsp.max("a"), hi_b=dbsp.max("b"),
                                      lo_b=dbsp.min("b"), lo_c=dbsp.min("c")))
    return c


def _model(bag: Counter) -> dict:
    groups: dict = {}
    for (k, a, b, c), w in bag.items():
        g = groups.setdefault(k, [0, [], [], []])
        g[0] += w
        for vals, v in zip(g[1:], (a, b, c)):
            if v is not None:
                vals += [v] * w
    return {(k, n, min(a, default=None), max(a, default=None), max(b, default=None), min(b, default=None),
             min(c, default=None)): 1 for k, (n, a, b, c) in groups.items() if n}


def _row(rng: np.random.Generator) -> tuple:
    k = None if rng.random() < 0.01 else int(rng.integers(0, GROUPS))
    a = None if rng.random() < 0.05 else int(rng.integers(-1000, 1000))
    c = None if rng.random() < 0.3 else int(rng.integers(-50, 50))
    return (k, a, int(rng.integers(-10**12, 10**12)), c)


def _states(p: dbsp.Pipeline) -> list:
    return [s for wk in p.executor._workers for s in wk.instances.values() if type(s) is _ExtremesState]


# a step: (seed of its random rows, inserts, random deletions, deletions of a group's current extremes of a or b)
STEP = st.tuples(st.integers(0, 2**31), st.integers(0, 40), st.integers(0, 15), st.integers(0, 15))


@pytest.mark.parametrize("workers", [1, 2])
@FEW
@given(seed=st.integers(0, 2**31), steps=st.lists(STEP, min_size=1, max_size=25))
def test_min_max_fold_and_recompute_against_a_model(workers: int, seed: int, steps: list) -> None:
    rng = np.random.default_rng(seed)
    bag: Counter = Counter()
    view: Counter = Counter()
    recomputed = 0
    with dbsp.Pipeline(_circuit(), workers=workers) as p:

        def apply(i: int, d: Counter) -> None:
            nonlocal bag, view
            d = Counter({row: w for row, w in d.items() if w})
            bag.update(d)
            bag = Counter({row: w for row, w in bag.items() if w})
            if d:
                p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))
            for row, w in p.step()["g"].to_dict().items():
                view[row] += w
            view = Counter({row: w for row, w in view.items() if w})
            assert dict(view) == _model(bag), f"step {i}, W={workers}"

        for i in range(2):  # two loads: two fenced value batches
            apply(i, Counter(_row(rng) for _ in range(5000)))
        for i, (s, ins, dels, extremes) in enumerate(steps):
            r = np.random.default_rng(s)
            d: Counter = Counter(_row(r) for _ in range(ins))
            present = sorted(bag, key=repr)  # (every row of the bag has a positive weight)
            for _ in range(dels):
                row = present[int(r.integers(len(present)))]
                if bag[row] + d[row] > 0:
                    d[row] -= 1
            for _ in range(extremes):  # a group's current max (or min) of a or b
                k = present[int(r.integers(len(present)))][0]
                col = 1 + int(r.integers(2))
                rows = [row for row in present if row[0] == k and row[col] is not None and bag[row] + d[row] > 0]
                if rows:  # its max, its min, or both: a group's deleted values' min and max then differ
                    roll = r.random()
                    for pick in (max, min) if roll < 0.3 else (max,) if roll < 0.65 else (min,):
                        row = pick(rows, key=lambda row: row[col])
                        if bag[row] + d[row] > 0:
                            d[row] -= 1
            apply(2 + i, d)
        states = _states(p)
        recomputed = sum(s.recomputed for s in states)
        assert all(s.emit is not None for s in states)  # (the one-call path of invariant 10)
    assert recomputed or not any(e for *_, e in steps)


def _batches(rng: np.random.Generator) -> tuple[list, Counter]:
    vschema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    total: Counter = Counter()
    views = []
    for size in (30_000, 6_000, 900, 40):
        ks = rng.integers(0, 3000, size)
        vs = [None if rng.random() < 0.02 else int(x) for x in rng.integers(-60, 60, size)]
        ws = rng.choice([-1, 1, 2], size)
        z = ZSet.from_rows(list(zip(ks.tolist(), vs)), vschema, weights=ws.tolist()).consolidate()
        for row, w in z.to_dict().items():
            total[row] += w
        views.append(z.index_by(["k"])._view())
    assert views[0].num_rows >= IndexedZSet.FENCE_MIN and views[1].num_rows >= IndexedZSet.FENCE_MIN
    return views, total


@pytest.mark.parametrize("ascending", [True, False])
@FEW
@given(seed=st.integers(0, 2**31), nkeys=st.integers(1, 300), frac=st.floats(0.0, 1.0))
def test_extremes_recompute_fills_against_a_dict(seed: int, nkeys: int, frac: float, ascending: bool) -> None:
    rng = np.random.default_rng(seed)
    views, total = _batches(rng)
    want = rng.choice(3500, nkeys, replace=False)  # (keys 3000 and up are in no batch)
    change = ZSet.from_rows([(int(k),) for k in want], pa.schema([("k", pa.int64())])).index_by(["k"])
    group_row, gkh = np.arange(nkeys, dtype=np.int64), change.key_hash
    need = np.flatnonzero(rng.random(nkeys) < frac).astype(np.int64)
    if not ascending:
        need = rng.permutation(need)
    nw = rng.integers(-9, 9, (nkeys, 6)).astype(np.int64)
    before = nw.copy()
    # slots: 1 a max (flag 5), 3 a min (flag 4); the other values are not the fill's
    _zset.extremes_recompute(change._view(), [0], group_row, gkh, need, nw, views, [0], 1, [(3, True, 4), (1, False, 5)])
    per_key: dict = {}
    for (k, v), w in total.items():
        if v is not None and w > 0:
            per_key.setdefault(k, []).append(v)
    keys = change.zset.data.column("k").to_pylist()
    expect = before.copy()
    for g in need:
        vals = per_key.get(keys[g], [])
        expect[g, 3], expect[g, 4] = (min(vals), 1) if vals else (0, 0)
        expect[g, 1], expect[g, 5] = (max(vals), 1) if vals else (0, 0)
    assert np.array_equal(nw, expect)
