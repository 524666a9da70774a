"""operators/top_k.py invariant 8: a top-1 without ties takes each group's first row by the C hash grouping
(csrc/top1.h), checked against a Python model of invariant 1's order and against the operator's sort, on seeded
random tables with many ties (small value ranges), nulls, NaN, -0.0 and strings sharing prefixes."""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import _zset
from dbsp_core.operators import top_k
from dbsp_core.operators.top_k import TopK, order_spec, top_rows
from dbsp_core.zset import ZSet

SCHEMA = pa.schema([("a", pa.int64()), ("b", pa.string()), ("t", pa.timestamp("ms")), ("x", pa.float64()),
                    ("s", pa.string()), ("i", pa.int32()), ("ok", pa.bool_())])


def _table(rng: random.Random, n: int) -> pa.Table:
    def maybe(v, p=0.1):
        return None if rng.random() < p else v
    cols = {
        "a": [maybe(rng.randrange(4)) for _ in range(n)],
        "b": [maybe(rng.choice(["", "p", "pq", "q"])) for _ in range(n)],
        "t": [maybe(rng.randrange(3)) for _ in range(n)],
        "x": [maybe(rng.choice([0.0, -0.0, 1.5, -2.0, math.nan, math.inf])) for _ in range(n)],
        "s": [maybe(rng.choice(["", "a", "ab", "abc", "b", "\u00e9"])) for _ in range(n)],
        "i": [maybe(rng.randrange(-2, 2)) for _ in range(n)],
        "ok": [maybe(rng.random() < 0.5) for _ in range(n)],
    }
    return pa.table(cols, schema=SCHEMA)


def _cmp_value(u, v, desc: bool) -> int:
    """invariant 1 on one column: nulls last either way; NaN above every number; -0.0 == 0.0; strings by UTF-8."""
    if u is None or v is None:
        return (u is None) - (v is None)
    if isinstance(u, str):
        u, v = u.encode(), v.encode()
    if isinstance(u, float):
        nu, nv = math.isnan(u), math.isnan(v)
        r = (nu - nv) if (nu or nv) else (u > v) - (u < v)
    else:
        r = (u > v) - (u < v)
    return -r if desc else r


def _model(table: pa.Table, keys: list[str], order: list[tuple[str, bool]]) -> set[int]:
    """The row index of each group's first row (a dict of groups, Python's stable min)."""
    rows = table.to_pylist()
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r[c] for c in keys), []).append(i)

    def cmp(i: int, j: int) -> int:
        for c, d in order:
            x = _cmp_value(rows[i][c], rows[j][c], d)
            if x:
                return x
        return 0
    return {min(ix, key=functools.cmp_to_key(cmp)) for ix in groups.values()}


CASES = [(["a"], [("t", "descending")]), (["a", "b"], [("t", "descending")]), (["b"], [("x", "descending")]),
         (["b"], [("x", "ascending")]), (["a"], [("s", "descending"), ("i", "ascending")]), (["i"], [("ok", "descending")]),
         (["ok", "i"], [("t", "ascending")])]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_top1_rows_against_a_dict_model(seed: int, case: int) -> None:
    keys, order = CASES[case]
    rng = random.Random(seed * 100 + case)
    t = _table(rng, rng.choice([1, 7, 60, 500]))
    z = ZSet._make(t, np.ones(t.num_rows, np.int64))
    ordered = set(keys) | {c for c, _ in order}
    full = [(c, d == "descending") for c, d in order] + [(c, False) for c in SCHEMA.names if c not in ordered]
    pos = SCHEMA.get_field_index
    got = _zset.top1_rows(t, z.hash(keys), [pos(c) for c in keys], [(pos(c), d) for c, d in full])
    assert got is not None
    assert len(got) == len(set(got.tolist()))
    assert set(got.tolist()) == _model(t, keys, full)


def _rows(z: ZSet) -> list:
    return sorted((repr(r), int(w)) for r, w in zip(z.data.to_pylist(), z.weights))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_top_rows_by_the_kernel_equal_the_sort(seed: int, case: int, monkeypatch) -> None:
    """The operator's top rows by the kernel (taken: counted) and by its sort (the kernel turned off) are equal,
    weights above 1 included."""
    keys, order = CASES[case]
    rng = random.Random(seed * 100 + case + 7)
    t = _table(rng, rng.choice([3, 40, 300]))
    z = ZSet._make(t, np.array([rng.randrange(1, 4) for _ in range(t.num_rows)], np.int64))
    op = TopK(0, SCHEMA, keys, order_spec(order, "test"), 1, False, "test")
    real = top_k._top1_rows
    taken = []

    def counted(op, z):
        out = real(op, z)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(top_k, "_top1_rows", counted)
    fast = top_rows(op, z)
    monkeypatch.setattr(top_k, "_top1_rows", lambda op, z: None)
    slow = top_rows(op, z)
    assert taken == [True]
    assert _rows(fast) == _rows(slow)


def test_a_shared_key_hash_leaves_the_step_to_the_sort() -> None:
    """Two different keys given one hash: the kernel says so (None) rather than merge their groups."""
    t = pa.table({"k": [1, 2, 1], "v": [5, 9, 7]})
    assert _zset.top1_rows(t, np.zeros(3, np.uint64), [0], [(1, True)]) is None
    assert sorted(_zset.top1_rows(t, np.array([1, 2, 1], np.uint64), [0], [(1, True)]).tolist()) == [1, 2]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_append_only_top1_steps_against_a_dict_model(case: int, workers: int, monkeypatch) -> None:
    """operators/top_k.py invariant 9: an append-only top-1 stepped over many small steps (rows equal to shown
    ones pushed again, ties on the order columns, nulls, NaN, -0.0, weights above 1) shows after every step the
    dict model's first row of each group of everything pushed so far, once each; the path is taken (counted) on
    every step with rows."""
    import dbsp_core as dbsp
    keys, order = CASES[case]
    rng = random.Random(case * 31 + workers)
    real = top_k._TopKState._step_top1_inserts
    taken = []

    def counted(self, change):
        out = real(self, change)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(top_k._TopKState, "_step_top1_inserts", counted)
    c = dbsp.Circuit()
    c.output("top", c.input("t", SCHEMA, append_only=True).group_by(*keys).top_k(1, order))
    ordered = set(keys) | {c_ for c_, _ in order}
    full = [(c_, d == "descending") for c_, d in order] + [(c_, False) for c_ in SCHEMA.names if c_ not in ordered]
    pushed = []
    with dbsp.Pipeline(c, workers=workers) as p:
        shown: dict = {}
        for _ in range(12):
            t = _table(rng, rng.choice([1, 5, 30]))
            if pushed and rng.random() < 0.5:  # rows pushed before, again (equal to shown rows, or not)
                t = pa.concat_tables([t, pushed[rng.randrange(len(pushed))]])
            pushed.append(t)
            w = np.array([rng.randrange(1, 3) for _ in range(t.num_rows)], np.int64)
            p.push("t", ZSet._make(t, w))
            out = p.step()["top"]
            for r, wt in zip(out.data.to_pylist(), out.weights):
                k = repr(r)
                shown[k] = shown.get(k, 0) + int(wt)
                if shown[k] == 0:
                    del shown[k]
            everything = pa.concat_tables(pushed)
            first = _model(everything, keys, full)
            model = sorted(repr(r) for i, r in enumerate(everything.to_pylist()) if i in first)
            assert sorted(shown.items()) == sorted((k, 1) for k in model)
    assert taken and all(taken)
