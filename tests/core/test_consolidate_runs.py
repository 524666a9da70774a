"""The consolidation of rows already in key order (csrc/zset.h dbsp_zset_consolidate_runs, IndexedZSet._from_key_order)
against index_by and a dict model, and the min/max aggregate that indexes its value and totals batches with it.

Seeds vary per run and are printed (replay: DBSP_TEST_SEED=...).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.zset import IndexedZSet, ZSet

SEED = int(os.environ.get("DBSP_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
I64 = np.iinfo(np.int64)


@pytest.fixture
def rng() -> np.random.Generator:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    return np.random.default_rng(SEED)


def _change(rng: np.random.Generator, n: int, keys: int) -> ZSet:
    """n rows over few keys (long runs of one key), values with nulls, NaN, -0.0 and int64 extremes, weights of both
    signs (some rows cancel), and a column the projections leave out."""
    k = rng.integers(0, keys, n).astype(object)
    k[rng.random(n) < 0.05] = None
    k[rng.random(n) < 0.05] = int(I64.min)
    k[rng.random(n) < 0.05] = int(I64.max)
    f = rng.choice([0.0, -0.0, 1.5, np.nan, -np.inf, 2.0], n).astype(object)
    f[rng.random(n) < 0.1] = None
    i = rng.choice([int(I64.min), -1, 0, 7, int(I64.max)], n).astype(object)
    i[rng.random(n) < 0.1] = None
    s = rng.choice(["", "a", "zz", "a\x00b"], n).astype(object)
    s[rng.random(n) < 0.1] = None
    table = pa.table({"k": pa.array(list(k), pa.int64()), "f": pa.array(list(f), pa.float64()),
                      "i": pa.array(list(i), pa.int64()), "s": pa.array(list(s), pa.utf8()),
                      "x": pa.array(rng.integers(0, 3, n), pa.int64())})
    w = rng.choice([-2, -1, 1, 1, 2], n).astype(np.int64)
    return ZSet._make(table, w)


def _rows(z: ZSet) -> list:
    """A Z-set's rows in order, NaN made comparable."""
    return [tuple("NaN" if isinstance(v, float) and v != v else v for v in r.values()) for r in z.data.to_pylist()]


def _as_counter(z: ZSet) -> Counter:
    """The multiset of a Z-set's rows (NaN made comparable)."""
    out: Counter = Counter()
    for row, w in zip(z.data.to_pylist(), z.weights.tolist()):
        out[tuple("NaN" if isinstance(v, float) and v != v else v for v in row.values())] += w
    return Counter({r: w for r, w in out.items() if w})


@pytest.mark.parametrize("n,keys", [(1, 1), (40, 1), (300, 3), (2000, 60), (6000, 400)])
def test_projection_equals_index_by(rng: np.random.Generator, n: int, keys: int) -> None:
    """The change indexed by k, projected onto (k, value) for each value column, nulls of the value left out or
    not: the same batch as index_by of the projection (rows, weights, key hashes, in order), its row hashes those
    of its rows, and the multiset the dict model sums. Runs of one key reach hundreds of rows (the sorted path)."""
    dix = _change(rng, n, keys).index_by(["k"])
    data, w, kh = dix.zset.data, dix.zset.weights, dix.key_hash
    for col in ("f", "i", "s"):
        proj = data.select(["k", col])
        for drop_nulls in (False, True):
            rows = np.flatnonzero(proj.column(col).is_valid().to_numpy(zero_copy_only=False)) if drop_nulls else None
            got = IndexedZSet._from_key_order(ZSet._make(proj, w), ["k"], kh, rows)
            sel = proj if rows is None else proj.take(rows)
            sw = w if rows is None else w[rows]
            want = ZSet._make(sel, sw).index_by(["k"])
            # the same source rows (each group's first), weights and key hashes, in the same order
            idx, _, _, _ = _zset.consolidate_runs(proj, w, kh, rows)
            widx, _, _ = _zset.consolidate(sel, sw, [0])
            assert np.array_equal(idx, np.arange(n)[rows][widx] if rows is not None else widx), (col, drop_nulls)
            assert _rows(got.zset) == _rows(want.zset), (col, drop_nulls)
            assert np.array_equal(got.zset.weights, want.zset.weights)
            assert np.array_equal(got.key_hash, want.key_hash)
            assert np.array_equal(got._rh, _zset.hash_columns(got.zset.data, [0, 1]))
            assert _zset.check_order(got.zset.data, got.zset.weights, got.key_hash, [0])
            assert _as_counter(got.zset) == _as_counter(ZSet._make(sel, sw)), (col, drop_nulls)
            assert len(got) < len(sel) or n < 40, "nothing consolidated: the test did not exercise the sums"


@pytest.mark.parametrize("n", [2, 33, 500])
def test_one_run_of_colliding_key_hashes(rng: np.random.Generator, n: int) -> None:
    """Every row given the same key hash (distinct keys whose hashes collide): the whole selection is one run, which
    must come out in canonical order (row hash, then value) with equal rows summed, whatever the keys."""
    z = _change(rng, n, 5)
    proj = z.data.select(["k", "i"])
    kh = np.full(n, 12345, dtype=np.uint64)
    idx, w, kho, rh = _zset.consolidate_runs(proj, z.weights, kh)
    got = ZSet._make(proj.take(idx), w)
    assert _as_counter(got) == _as_counter(ZSet._make(proj, z.weights))
    assert np.all(kho == 12345)
    assert np.array_equal(rh, _zset.hash_columns(got.data, [0, 1]))
    assert bool(np.all(rh[1:] >= rh[:-1])), "rows of one key hash not ordered by row hash"
    assert len(set(_rows(got))) == len(idx) and bool(np.all(w != 0)), "not consolidated"


def test_rows_out_of_key_order_are_refused() -> None:
    table = pa.table({"k": [1, 2, 3]})
    with pytest.raises(ValueError, match="consolidate_runs"):
        _zset.consolidate_runs(table, np.ones(3, np.int64), np.array([5, 4, 9], np.uint64))
    with pytest.raises(ValueError, match="consolidate_runs"):
        _zset.consolidate_runs(table, np.ones(3, np.int64), np.array([1, 2, 3], np.uint64), np.array([0, 7]))
    with pytest.raises(ValueError, match="2 key hashes for 3 rows"):
        _zset.consolidate_runs(table, np.ones(3, np.int64), np.array([1, 2], np.uint64))
    with pytest.raises(dbsp.WeightOverflowError):
        _zset.consolidate_runs(table.take([0, 0]), np.array([I64.max, 1], np.int64), np.array([1, 1], np.uint64))


@pytest.mark.parametrize("workers,top", [(1, 2**60), (2, 2**60), (1, 2**63 - 1)])
def test_min_max_batches_against_model(rng: np.random.Generator, workers: int, top: int) -> None:
    """min/max over int64 values up to +-``top`` (the key-index step) and float values with NaN, -0.0 and nulls
    (the grouping step), keys with nulls and extremes, rows deleted often: the view equals the dict model after every
    step, and every trace batch the aggregate wrote (value multisets, totals) is consolidated in canonical order
    with the row hashes it keeps (Trace.check). At the int64 extremes Trace.check is left out: its rebuild of the
    totals' key index adds the batches' rows one by one and overflows on a partial sum (integ does the same)."""
    schema = pa.schema([("k", pa.int64()), ("i", pa.int64()), ("f", pa.float64())])
    c = dbsp.Circuit()
    t = c.input("t", schema)
    c.output("ints", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("i"), hi=dbsp.max("i")))
    c.output("floats", t.group_by("k").agg(lo=dbsp.min("f"), hi=dbsp.max("f")))
    p = dbsp.Pipeline(c, workers=workers)
    keys = [None, int(I64.min), int(I64.max), 0, 1, 2, 3]
    ints = [None, -top - (top == I64.max), -top + 1, -1, 0, top - 1, top]
    floats = [None, float("nan"), -0.0, 0.0, -1.5, float("inf"), 3.0]
    bag: Counter = Counter()
    views = {"ints": Counter(), "floats": Counter()}

    def key(v):
        return ("NaN",) if isinstance(v, float) and v != v else (v,)

    def model(bag: Counter, which: str) -> Counter:
        groups: dict = {}
        for (k, i, f), w in bag.items():
            g = groups.setdefault(k, {"n": 0, "i": Counter(), "f": Counter()})
            g["n"] += w
            if i is not None:
                g["i"][i] += w
            if f is not None:
                g["f"][key(f)] += w
        out: Counter = Counter()
        for k, g in groups.items():
            if g["n"] <= 0:
                continue
            if which == "ints":
                vs = [v for v, w in g["i"].items() if w > 0]
                out[(k, g["n"], min(vs, default=None), max(vs, default=None))] += 1
            else:  # NaN is the greatest float (column.h invariant 2)
                vs = [v for v, w in g["f"].items() if w > 0]
                order = sorted(vs, key=lambda v: (1, 0.0) if v == ("NaN",) else (0, v[0]))
                out[(k, order[0][0] if order else None, order[-1][0] if order else None)] += 1
        return out

    def canon(row):
        return tuple("NaN" if isinstance(v, float) and v != v else v for v in row)

    for step in range(60):
        delta: Counter = Counter()
        for _ in range(int(rng.integers(1, 25))):
            present = [r for r, w in (bag + delta).items() if w > 0]
            if present and rng.random() < 0.45:
                delta[present[int(rng.integers(len(present)))]] -= 1
            else:
                delta[(keys[rng.integers(len(keys))], ints[rng.integers(len(ints))],
                       floats[rng.integers(len(floats))])] += int(rng.choice([1, 2]))
        delta = Counter({r: w for r, w in delta.items() if w})
        bag = Counter({r: w for r, w in _sum(bag, delta).items() if w})
        if delta:
            p.push("t", dbsp.ZSet.from_rows(list(delta), schema, weights=list(delta.values())))
        out = p.step()
        for name in views:
            for r, w in out[name].to_dict().items():
                views[name][canon(r)] += w
            views[name] = Counter({r: w for r, w in views[name].items() if w})
            want = Counter({canon(r): w for r, w in model(bag, name).items()})
            assert views[name] == want, (name, step)
        for w in range(workers if top < I64.max else 0):
            for tr in p.traces(w).values():
                tr.check()
    p.close()


def _sum(a: Counter, b: Counter) -> Counter:
    out = Counter(a)
    for r, w in b.items():
        out[r] += w
    return out
