"""min/max aggregates (the extremes strategy) against a dict model over long runs of small steps.

Long runs matter: the traces then hold many spine batches of different sizes, so lookups hand back whole
small batches with partial histories of keys not asked for, and deletions of a group's current extreme
force re-reductions from the value multisets. Checked after every step, W in {1, 2}, with nulls in values
and keys, duplicates, and groups that empty and come back.
"""

from __future__ import annotations

import datetime
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("s", pa.utf8())])


def _model(bag: Counter) -> dict:
    groups: dict = {}
    for (k, v, s), w in bag.items():
        g = groups.setdefault(k, {"n": 0, "vs": [], "ss": [], "total": 0, "nv": 0})
        g["n"] += w
        if v is not None:
            g["vs"] += [v] * w
            g["total"] += v * w
            g["nv"] += w
        if s is not None:
            g["ss"] += [s] * w
    out = {}
    for k, g in groups.items():
        if g["n"]:
            out[(k, g["n"], min(g["vs"], default=None), max(g["vs"], default=None), min(g["ss"], default=None),
                 g["total"] if g["nv"] else None)] = 1
    return out


def _random_delta(rng, bag: Counter, moves: int, new_row, extreme: float, max_below: float) -> Counter:
    """A step's change of ``moves`` moves over the rows ``bag`` holds: a deletion of a present row (for a roll below
    ``extreme``, a group's current max of column 1 below ``max_below``, else its min), or an insertion of
    ``new_row(rng)`` with weight 1 or 2; zero weights dropped."""
    delta: Counter = Counter()
    for _ in range(moves):
        present = [r for r, w in (bag + delta).items() if w > 0]
        roll = rng.random()
        if present and roll < 0.45:  # delete, often a group's current extreme
            if roll < extreme:
                k = present[int(rng.integers(len(present)))][0]
                rows = [r for r in present if r[0] == k and r[1] is not None]
                if rows:
                    delta[max(rows, key=lambda r: r[1]) if roll < max_below else min(rows, key=lambda r: r[1])] -= 1
                    continue
            delta[present[int(rng.integers(len(present)))]] -= 1
        else:
            delta[new_row(rng)] += int(rng.choice([1, 1, 2]))
    return Counter({r: w for r, w in delta.items() if w})


def _steps_against_model(p, rng, steps: int, moves: tuple[int, int], new_row, extreme: float, max_below: float,
                         schema: pa.Schema, model, after=None) -> Counter:
    """``steps`` steps of random changes (:func:`_random_delta`, a number of moves drawn from ``moves``) pushed to
    input "t" of ``p``; after each, the integrated view "g" equals ``model(bag)``; ``after(step, p)`` (which may
    return a pipeline to go on with) runs after each check. Closes the pipeline; returns the bag of rows pushed."""
    bag: Counter = Counter()
    view: Counter = Counter()
    for step in range(steps):
        delta = _random_delta(rng, bag, int(rng.integers(*moves)), new_row, extreme, max_below)
        bag.update(delta)
        bag = Counter({r: w for r, w in bag.items() if w})
        if delta:
            p.push("t", dbsp.ZSet.from_rows(list(delta), schema, weights=list(delta.values())))
        for r, w in p.step()["g"].to_dict().items():
            view[r] += w
        view = Counter({r: w for r, w in view.items() if w})
        assert dict(view) == model(bag), f"step {step}"
        if after is not None:
            p = after(step, p) or p
    p.close()
    return bag


@pytest.mark.parametrize("workers,seed", [(1, 1), (2, 2), (2, 3)])
def test_min_max_long_run(workers: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v"), first=dbsp.min("s"),
                                      total=dbsp.sum("v")))
    p = dbsp.Pipeline(c, workers=workers)
    def new_row(rng):
        k = None if rng.random() < 0.05 else int(rng.integers(0, 25))
        v = None if rng.random() < 0.1 else int(rng.integers(-50, 50))
        s = None if rng.random() < 0.1 else str(rng.choice(["a", "b", "zz", ""]))
        return (k, v, s)

    _steps_against_model(p, rng, 150, (0, 10), new_row, 0.25, 0.12, SCHEMA, _model)


INT_SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int32()), ("t", pa.timestamp("ms")), ("d", pa.date32())])
_EPOCH = datetime.datetime(2026, 1, 1)


def int_row(rng) -> tuple:
    """A random row of INT_SCHEMA: 20 keys, small values, each column null now and then."""
    k = None if rng.random() < 0.05 else int(rng.integers(0, 20))
    v = None if rng.random() < 0.1 else int(rng.integers(-30, 30))
    t = None if rng.random() < 0.1 else _EPOCH + datetime.timedelta(seconds=int(rng.integers(0, 50)))
    d = None if rng.random() < 0.1 else datetime.date(2026, 1, 1 + int(rng.integers(0, 20)))
    return (k, v, t, d)


def _int_model(bag: Counter) -> dict:
    groups: dict = {}
    for (k, v, t, d), w in bag.items():
        g = groups.setdefault(k, {"n": 0, "v": [], "t": [], "d": [], "total": 0, "nv": 0})
        g["n"] += w
        for name, x in (("v", v), ("t", t), ("d", d)):
            if x is not None:
                g[name] += [x] * w
        if v is not None:
            g["total"] += v * w
            g["nv"] += w
    return {(k, g["n"], min(g["v"], default=None), max(g["v"], default=None), max(g["t"], default=None),
             min(g["d"], default=None), g["total"] if g["nv"] else None): 1 for k, g in groups.items() if g["n"]}


@pytest.mark.parametrize("workers,seed,storage", [(1, 4, False), (2, 5, False), (1, 6, True), (2, 7, True)])
def test_min_max_through_the_key_index_long_run(tmp_path, workers: int, seed: int, storage: bool) -> None:
    """Extremes of integer-like columns only (int32, timestamp, date32): a step folds each group's totals through
    the key index of the totals trace (csrc/extremes.h) and recomputes only extremes that a deleted value reached.
    Views match the model after every step; the totals' index agrees with their batches (Trace.check); with
    storage, the pipeline is reopened from its checkpoint every 40 steps (the index is then rebuilt from the
    batches, its "not null" flags included)."""
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    src = c.input("t", INT_SCHEMA)
    c.output("g", src.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v"), last=dbsp.max("t"),
                                        first=dbsp.min("d"), total=dbsp.sum("v")))
    kw = {"storage": str(tmp_path / "s")} if storage else {}
    p = dbsp.Pipeline(c, workers=workers, **kw)
    indexed = [tr for w in range(workers) for name, tr in p.traces(w).items() if name.endswith("totals")]
    assert indexed and all(tr.index_spec is not None for tr in indexed), "the totals keep no key index"

    def after(step, p):
        for w in range(workers):
            for tr in p.traces(w).values():
                tr.check()
        if storage and step % 40 == 39:
            p.close()
            return dbsp.Pipeline.open(str(tmp_path / "s"), c)
        return None

    _steps_against_model(p, rng, 160, (0, 12), int_row, 0.3, 0.15, INT_SCHEMA, _int_model, after=after)


@pytest.mark.parametrize("workers,seed", [(1, 8), (2, 9)])
def test_min_max_of_large_groups(workers: int, seed: int) -> None:
    """Few groups holding hundreds of distinct values each, their extremes deleted often: the recomputation of a
    group's extremes (csrc/extremes.c, dbsp_extremes_scan) then sorts a long run of values, gathered from several
    spine batches with weights that cancel across them."""
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    src = c.input("t", INT_SCHEMA)
    c.output("g", src.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v"), last=dbsp.max("t"),
                                        first=dbsp.min("d"), total=dbsp.sum("v")))
    p = dbsp.Pipeline(c, workers=workers)
    def new_row(rng):
        return (int(rng.integers(0, 3)), int(rng.integers(-1000, 1000)), None, None)

    bag = _steps_against_model(p, rng, 80, (5, 40), new_row, 0.35, 0.2, INT_SCHEMA, _int_model)
    assert max(Counter(k for k, *_ in bag).values()) > 100, "the groups stayed small"


@pytest.mark.parametrize("nkeys,ascending", [(5, True), (200, True), (200, False), (3000, True), (3000, False)])
def test_extremes_scan_seeks_against_a_reference(nkeys: int, ascending: bool) -> None:
    """``_zset.extremes_scan`` (csrc/extremes.h design note 6) against a dict over the same value batches: batches of
    50 to 40k rows (those of 4096 rows and more with a fence of their key hashes), keys sought in chunks of more than one (``SCAN_CHUNK``), ascending or not (the per-key seeks), present in some
    batches, in none, with values whose weights cancel across batches or are null."""
    from dbsp_core import _zset
    from dbsp_core.zset import ZSet

    rng = np.random.default_rng(nkeys + ascending)
    vschema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    total: Counter = Counter()
    views = []
    for size in (40_000, 9_000, 5_000, 700, 50):
        ks = rng.integers(0, 6000, size)
        vs = [None if rng.random() < 0.02 else int(x) for x in rng.integers(-50, 50, size)]
        ws = rng.choice([-1, 1, 2], size)
        z = ZSet.from_rows(list(zip(ks.tolist(), vs)), vschema, weights=ws.tolist()).consolidate()
        for row, w in z.to_dict().items():
            total[row] += w
        b = z.index_by(["k"])
        views.append(b._view())
    assert views[0].num_rows > 4096
    want = rng.choice(7000, nkeys, replace=False)  # (keys 6000 and up are in no batch)
    change = ZSet.from_rows([(int(k),) for k in want], pa.schema([("k", pa.int64())])).index_by(["k"])
    rows, kh = np.arange(nkeys), change.key_hash
    if not ascending:
        perm = rng.permutation(nkeys)
        rows, kh = rows[perm], kh[perm]
    has, mn, mx = _zset.extremes_scan(change._view(), [0], rows, kh, views, [0], 1)
    keys = change.zset.data.column("k").to_pylist()
    per_key: dict = {}
    for (k, v), w in total.items():
        if v is not None and w > 0:
            per_key.setdefault(k, []).append(v)
    for i, r in enumerate(rows):
        vals = per_key.get(keys[r], [])
        assert bool(has[i]) == bool(vals), (keys[r], vals)
        if vals:
            assert (mn[i], mx[i]) == (min(vals), max(vals)), keys[r]
    assert has.any() and (nkeys < 200 or not has.all())
