"""Galloping lookups (IndexedZSet.lookup, IndexedZSet.match_weights, Trace.match_weights) against the dict model."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.errors import SchemaError
from dbsp_core.trace import Trace

from zset_model import add_models, canon_row, canon_value, model_of, schemas, tables, weights_for


@st.composite
def indexed_pair(draw):
    """Two weighted tables of one schema and a key (a non-empty prefix of its columns)."""
    schema = draw(schemas())
    nkey = draw(st.integers(1, len(schema)))
    a, b = draw(tables(schema=schema)), draw(tables(schema=schema, max_rows=60))
    return schema, schema.names[:nkey], (a, weights_for(draw, a.num_rows)), (b, weights_for(draw, b.num_rows))


def _keys_of(table: pa.Table, key: list[str]) -> list[tuple]:
    cols = [table.column(k).to_pylist() for k in key]
    return [tuple(canon_value(v) for v in r) for r in zip(*cols)] if table.num_rows else []


@given(indexed_pair())
def test_lookup_finds_exactly_the_rows_of_the_wanted_keys(inp):
    schema, key, (ta, wa), (tb, wb) = inp
    change = dbsp.ZSet.from_arrow(ta, weights=wa)
    ix = dbsp.ZSet.from_arrow(tb, weights=wb).index_by(key)
    want = np.sort(change.hash(key))  # ascending, duplicates kept: the kernel skips them
    idx = ix.lookup(want)
    assert idx.dtype == np.int64 and (np.diff(idx) > 0).all()
    wanted = set(_keys_of(ta, key))
    all_keys = _keys_of(ix.zset.data, key)
    expect = [i for i, k in enumerate(all_keys) if k in wanted]
    # equal keys have equal hashes; the pools give no collisions between different keys
    assert idx.tolist() == expect


@given(indexed_pair())
def test_match_weights_is_the_models_weight_of_each_row(inp):
    schema, key, (ta, wa), (tb, wb) = inp
    a = dbsp.ZSet.from_arrow(ta, weights=wa).index_by(key)
    b = dbsp.ZSet.from_arrow(tb, weights=wb).index_by(key)
    model = model_of(tb, wb)
    rows = a.zset.data
    cols = [c.to_pylist() for c in rows.columns]
    expect = [model.get(canon_row(r), 0) for r in zip(*cols)] if rows.num_rows else []
    assert a.match_weights(b).tolist() == expect
    acc = np.full(len(a), 7, dtype=np.int64)
    assert a.match_weights(b, acc) is acc
    assert acc.tolist() == [7 + w for w in expect]


@given(st.data())
def test_trace_match_weights_sums_every_batch(data):
    schema = data.draw(schemas())
    key = tuple(schema.names)  # distinct's index: the whole row is the key
    tr = Trace(schema, key)
    total: dict = {}
    for _ in range(data.draw(st.integers(0, 5))):
        t = data.draw(tables(schema=schema, max_rows=20))
        w = weights_for(data.draw, t.num_rows)
        tr.insert(dbsp.ZSet.from_arrow(t, weights=w).index_by(list(key)))
        total = add_models(total, model_of(t, w))
    tc = data.draw(tables(schema=schema, max_rows=20))
    change = dbsp.ZSet.from_arrow(tc, weights=weights_for(data.draw, tc.num_rows)).index_by(list(key))
    cols = [c.to_pylist() for c in change.zset.data.columns]
    expect = [total.get(canon_row(r), 0) for r in zip(*cols)] if len(change) else []
    assert tr.match_weights(change).tolist() == expect


def test_match_weights_validates():
    a = dbsp.ZSet.from_arrow(pa.table({"k": [1, 2]})).index_by(["k"])
    b = dbsp.ZSet.from_arrow(pa.table({"k": ["x"]})).index_by(["k"])
    with pytest.raises(SchemaError):
        a.match_weights(b)
    with pytest.raises(ValueError, match="acc"):
        a.match_weights(a, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="acc"):
        a.match_weights(a, np.zeros(2, dtype=np.int32))


@given(st.data())
def test_key_sums_is_the_models_weighted_sum_per_key(data):
    kschema = data.draw(schemas(max_cols=2))
    schema = pa.schema(list(kschema) + [("v", pa.int64())])
    key = list(kschema.names)
    vals = st.one_of(st.none(), st.integers(-1000, 1000))
    tb = data.draw(tables(schema=kschema, max_rows=40))
    v = pa.array(data.draw(st.lists(vals, min_size=tb.num_rows, max_size=tb.num_rows)), pa.int64())
    tb = tb.append_column("v", v)
    wb = weights_for(data.draw, tb.num_rows)
    ix = dbsp.ZSet.from_arrow(tb, weights=wb).index_by(key)
    probe = data.draw(tables(schema=kschema, max_rows=20))
    # the probe's distinct keys, in key-hash order: the first row of each, ordered by its hash
    pz = dbsp.ZSet.from_arrow(probe)
    kh = pz.hash(key)
    seen, rows = set(), []
    for i, k in enumerate(_keys_of(probe, key)):
        if k not in seen:
            seen.add(k)
            rows.append(i)
    rows = np.array(sorted(rows, key=lambda i: int(kh[i])), dtype=np.int64)
    sums = ix.key_sums(probe, key, kh[rows], rows, ["v"])
    model: dict = {}
    for k, x, w in zip(_keys_of(tb, key), tb.column("v").to_pylist(), wb.tolist()):
        model[k] = model.get(k, 0) + (x or 0) * w
    pkeys = _keys_of(probe, key)
    assert sums[:, 0].tolist() == [model.get(pkeys[i], 0) for i in rows]
    # a trace sums over its batches
    tr = Trace(schema, tuple(key))
    half = tb.num_rows // 2
    tr.insert(dbsp.ZSet.from_arrow(tb.slice(0, half), weights=wb[:half]).index_by(key))
    tr.insert(dbsp.ZSet.from_arrow(tb.slice(half), weights=wb[half:]).index_by(key))
    assert tr.key_sums(probe, key, kh[rows], rows, ["v"]).tolist() == sums.tolist()


def test_key_sums_validates():
    ix = dbsp.ZSet.from_arrow(pa.table({"k": [1], "s": ["x"], "v": [3]})).index_by(["k"])
    probe = pa.table({"k": [1]})
    kh = dbsp.ZSet.from_arrow(probe).hash(["k"])
    with pytest.raises(SchemaError, match="not int64"):
        ix.key_sums(probe, ["k"], kh, np.array([0]), ["s"])
    with pytest.raises(SchemaError, match="probe key"):
        ix.key_sums(pa.table({"k": [1], "j": [2]}), ["k", "j"], kh, np.array([0]), ["v"])
    with pytest.raises(ValueError, match="acc"):
        ix.key_sums(probe, ["k"], kh, np.array([0]), ["v"], np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="out of range"):
        ix.key_sums(probe, ["k"], kh, np.array([5]), ["v"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fenced_seeks_equal_the_model_on_large_batches(seed):
    """Batches of FENCE_MIN rows and more are searched through a fence: same answers as the model."""
    from dbsp_core.zset import IndexedZSet

    rng = np.random.default_rng(seed)
    n = IndexedZSet.FENCE_MIN * 3 + int(rng.integers(0, 100))
    big_t = pa.table({"k": rng.integers(0, n // 3, n), "s": pa.array(rng.choice(["a", "bb", None], n))})
    big_w = rng.integers(-2, 3, n)
    big_w[big_w == 0] = 1
    big = dbsp.ZSet.from_arrow(big_t, weights=big_w).index_by(["k", "s"])
    assert big._fence() is not None
    ch_t = pa.table({"k": rng.integers(0, n // 3, 300), "s": pa.array(rng.choice(["a", "bb", None], 300))})
    change = dbsp.ZSet.from_arrow(ch_t).index_by(["k", "s"])
    model = model_of(big_t, big_w)
    cols = [c.to_pylist() for c in change.zset.data.columns]
    assert change.match_weights(big).tolist() == [model.get(canon_row(r), 0) for r in zip(*cols)]
    want = np.sort(change.key_hash)
    assert big.lookup(want).tolist() == np.flatnonzero(np.isin(big.key_hash, want)).tolist()
    # key_sums over a key prefix, and the join, through the fenced view of the large side
    by_k = dbsp.ZSet.from_arrow(big_t.append_column("v", pa.array(rng.integers(-5, 6, n))),
                                weights=big_w).index_by(["k"])
    probe = pa.table({"k": np.unique(rng.integers(0, n // 3, 200))})
    kh = dbsp.ZSet.from_arrow(probe).hash(["k"])
    order = np.argsort(kh, kind="stable")
    sums = by_k.key_sums(probe, ["k"], kh[order], order, ["v"])
    ks = by_k.zset.data.column("k").to_numpy()
    vs = by_k.zset.data.column("v").to_numpy() * by_k.zset.weights
    expect = [int(vs[ks == k].sum()) for k in probe.column("k").to_numpy()[order]]
    assert sums[:, 0].tolist() == expect
    small = dbsp.ZSet.from_arrow(probe).index_by(["k"])
    li, ri, w = small.join(by_k)
    pairs = sorted(zip(small.zset.data.column("k").take(li).to_pylist(), by_k.zset.data.column("k").take(ri).to_pylist()))
    assert all(a == b for a, b in pairs)
    assert len(pairs) == int(np.isin(ks, probe.column("k").to_numpy()).sum())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trace_match_weights_in_big_groups_equals_the_model(seed):
    """A few keys with thousands of rows each, over several trace batches (merged or not): the row-hash gallop
    inside a key's run (csrc/lookup.c dbsp_match_weights_rh) finds exactly the model's weight of every row."""
    rng = np.random.default_rng(seed)
    schema = pa.schema([("g", pa.int64()), ("v", pa.int64()), ("s", pa.string())])
    t = Trace(schema, ("g",))
    model: dict[tuple, int] = {}

    def batch(n: int) -> tuple[pa.Table, np.ndarray]:
        g, v = rng.integers(0, 3, n), rng.integers(0, 4000, n)
        tab = pa.table({"g": g, "v": v, "s": [f"x{x % 7}" for x in v]}, schema=schema)
        return tab, rng.choice(np.array([-2, -1, 1, 2, 3]), n)

    for _ in range(6):
        tab, w = batch(int(rng.integers(500, 3000)))
        t.insert(dbsp.ZSet.from_arrow(tab, weights=w).index_by(["g"]))
        for row, wt in zip(zip(*(tab.column(c).to_pylist() for c in schema.names)), w.tolist()):
            model[row] = model.get(row, 0) + wt
    tab, w = batch(2000)  # probes: some stored rows, some new
    change = dbsp.ZSet.from_arrow(tab, weights=w).index_by(["g"])
    got = t.match_weights(change)
    rows = list(zip(*(change.zset.data.column(c).to_pylist() for c in schema.names)))
    assert got.tolist() == [model.get(r, 0) for r in rows]
    assert len(t.parts()) >= 1
