"""ZSet and IndexedZSet against the dict reference model (tests/core/zset_model.py), with Hypothesis."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from collections import defaultdict
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.errors import SchemaError, WeightOverflowError

from zset_model import (
    ALL_TYPES,
    POOLS,
    add_models,
    canon_dict,
    canon_row,
    canon_value,
    model_of,
    schemas,
    tables,
    weights_for,
)


@st.composite
def zsets(draw, schema=None, max_rows=40):
    t = draw(tables(schema=schema, max_rows=max_rows))
    w = weights_for(draw, t.num_rows)
    return t, w


def is_canonical(z: dbsp.ZSet) -> bool:
    return _zset.check_order(z.data, z.weights, z._rhash, [])


# ---- consolidation and the group operations ----

@given(zsets())
def test_consolidate_matches_model(tw):
    t, w = tw
    z = dbsp.ZSet.from_arrow(t, weights=w)
    c = z.consolidate()
    assert canon_dict(c.to_dict()) == model_of(t, w)
    assert len(z) == len(model_of(t, w))
    assert is_canonical(c)
    assert c.consolidate() is c


@given(zsets(max_rows=60), st.booleans())
def test_distinct_unsorted_matches_model(tw, collide):
    """Equal rows summed without a sort (csrc/zset.c dbsp_zset_distinct): the model's Z-set, no two equal rows, no
    zero weight, each kept row where its first copy was, with its row hash; rows only move when some are equal.
    ``collide`` hands the kernel one hash for every row, so every probe meets other rows and only the row
    comparison tells them apart."""
    t, w = tw
    w = np.asarray(w, dtype=np.int64)
    z = dbsp.ZSet.from_arrow(t, weights=w)
    d = z._distinct_unsorted()
    model = model_of(t, w)
    assert canon_dict(d.to_dict()) == model and d.num_rows == len(model)
    assert d._distinct and 0 not in d.weights.tolist()
    assert d.consolidate().num_rows == d.num_rows  # no two stored rows are equal
    assert d._rhash is None  # (no row hashes to start from: the probe's own hash, zset.c design note 5)
    h = z._hashed_part(0.0)  # the same, with the row hashes a sum's part keeps (design note 4)
    assert canon_dict(h.to_dict()) == model and h._distinct and h.num_rows == d.num_rows
    assert np.array_equal(h._rhash, _zset.hash_columns(h.data, list(range(t.num_columns))))
    rows = [canon_row(r) for r in zip(*[c.to_pylist() for c in t.columns])] if t.num_columns else []
    firsts = [rows.index(canon_row(r)) for r in zip(*[c.to_pylist() for c in d.data.columns])]
    assert firsts == sorted(firsts)  # first-occurrence order
    if len(model) == t.num_rows > 0:  # nothing to sum: the data is handed over, not gathered
        assert [b.address for c in d.data.columns for b in c.chunk(0).buffers() if b is not None] == \
            [b.address for c in z.data.columns for b in c.chunk(0).buffers() if b is not None]
    rh = np.zeros(t.num_rows, np.uint64) if collide else _zset.hash_columns(t, list(range(t.num_columns)))
    kept = _zset.distinct(t, w, rh)
    if kept is None:
        assert len(model) == t.num_rows
    else:
        idx, kw = kept
        got = defaultdict(int)
        for i, x in zip(idx.tolist(), kw.tolist()):
            got[rows[i]] += x
        assert dict(got) == model and len(idx) == len(model)


@given(st.data())
def test_small_batch_path_equals_grouping_engine(data):
    """Batches up to _zset.small_rows() rows are consolidated by sorting; the result (representative rows, weights,
    key hashes, order) is the grouping engine's, bit for bit, for every type, key and weight pattern."""
    t, w = data.draw(zsets(max_rows=60))
    keys = data.draw(st.lists(st.integers(0, t.num_columns - 1), max_size=t.num_columns, unique=True))
    w = np.asarray(w, dtype=np.int64)
    old = _zset.small_rows()
    try:
        _zset.small_rows(1 << 30)
        small = _zset.consolidate(t, w, keys)
        _zset.small_rows(0)
        big = _zset.consolidate(t, w, keys)
    finally:
        _zset.small_rows(old)
    for a, b in zip(small, big):
        assert np.array_equal(a, b)


@given(st.data())
def test_small_path_row_hashes_continue_from_a_key_prefix(data):
    """The small-batch path with row hashes (csrc/zset.c small-batch note 3): a key of the batch's first columns gives
    the key hashes, which the row hashes continue over the other columns. Whatever the key (a prefix, every column, or
    any other list), the kept rows and weights are the dict model's, each row's key and row hash are hash_columns' over
    the key and over every column, in canonical order; wide rows (more than 8 columns after the key) too."""
    t, w = data.draw(zsets(max_rows=60))
    if data.draw(st.booleans()):  # a wide row: the columns repeated, ten or more of them
        n = t.num_columns
        t = pa.table({f"w{i}": t.column(i % n) for i in range(10 * n)})
    ncols = t.num_columns
    nk = data.draw(st.integers(1, ncols))
    keys = list(range(nk)) if data.draw(st.booleans()) else data.draw(
        st.lists(st.integers(0, ncols - 1), min_size=1, max_size=ncols, unique=True))
    w = np.asarray(w, dtype=np.int64)
    old = _zset.small_rows()
    try:
        _zset.small_rows(1 << 30)
        idx, kw, kh, rh = _zset.consolidate(t, w, keys, row_hashes=True)
    finally:
        _zset.small_rows(old)
    rows = [canon_row(r) for r in zip(*[c.to_pylist() for c in t.columns])]
    got = defaultdict(int)
    for i, x in zip(idx.tolist(), kw.tolist()):
        got[rows[i]] += x
    assert dict(got) == model_of(t, w) and len(idx) == len(got) and 0 not in kw.tolist()
    assert np.array_equal(kh, _zset.hash_columns(t, keys)[idx])
    if len(idx):
        assert rh is not None and np.array_equal(rh, _zset.hash_columns(t, list(range(ncols)))[idx])
    assert _zset.check_order(t.take(pa.array(idx, pa.int64())), kw, kh, keys)


@given(st.data())
def test_add_sub_neg_match_model(data):
    schema = data.draw(schemas())
    (ta, wa), (tb, wb) = data.draw(zsets(schema=schema)), data.draw(zsets(schema=schema))
    a, b = dbsp.ZSet.from_arrow(ta, weights=wa), dbsp.ZSet.from_arrow(tb, weights=wb)
    ma, mb = model_of(ta, wa), model_of(tb, wb)
    s = a + b
    assert canon_dict(s.to_dict()) == add_models(ma, mb)
    assert is_canonical(s)
    assert canon_dict((a - b).to_dict()) == add_models(ma, mb, -1)
    assert canon_dict((-a).to_dict()) == {k: -v for k, v in ma.items()}
    assert (a - a).to_dict() == {}
    assert a + b == b + a
    assert (a + b) - b == a
    # merging two consolidated batches equals consolidating their concatenation
    assert a.consolidate() + b.consolidate() == dbsp.ZSet.concat([a, b]).consolidate()


@given(zsets())
def test_to_arrow_is_consolidated_with_weight_column(tw):
    t, w = tw
    out = dbsp.ZSet.from_arrow(t, weights=w).to_arrow()
    assert out.schema.names[-1] == "weight" and out.schema.field("weight").type == pa.int64()
    assert 0 not in out.column("weight").to_pylist()
    assert out.num_rows == len(model_of(t, w))
    rows = canon_dict({tuple(r[:-1]): r[-1] for r in zip(*[c.to_pylist() for c in out.columns])})
    assert rows == model_of(t, w)


def test_row_identity_follows_spark():
    t = pa.table({"f": [0.0, -0.0, math.nan, float("nan"), None, None], "s": ["a", "a", "b", "b", None, None]})
    z = dbsp.ZSet.from_arrow(t)
    assert canon_dict(z.to_dict()) == {canon_row((0.0, "a")): 2, canon_row((math.nan, "b")): 2, canon_row((None, None)): 2}


def test_empty_batches():
    s = pa.schema([("a", pa.int64()), ("b", pa.string())])
    e = dbsp.ZSet.empty(s)
    assert len(e) == 0 and e.to_dict() == {} and e.to_arrow().num_rows == 0
    z = dbsp.ZSet.from_rows([(1, "x")], s)
    assert (e + z) == z and (z + e) == z and (e - e) == e
    assert len(dbsp.ZSet.from_arrow(s.empty_table())) == 0
    assert len(e.index_by(["a"])) == 0
    assert e.index_by(["a"]).reduce([("count", None)]).num_rows == 0


@pytest.mark.parametrize("typ", ALL_TYPES, ids=str)
def test_every_type_round_trips(typ):
    vals = POOLS[typ] + [None]
    t = pa.table({"x": pa.array(vals + vals, type=typ)})
    z = dbsp.ZSet.from_arrow(t, weights=[1] * len(vals) + [2] * len(vals))
    assert canon_dict(z.to_dict()) == model_of(t, [1] * len(vals) + [2] * len(vals))
    assert z.to_arrow().schema.field("x").type == typ


# ---- hashing ----

GOLDEN = {
    # DBSP hash v1 of single values; these must never change within hash version 1 (they place shards)
    "int64 0": ("x", pa.array([0], pa.int64())),
    "int64 -1": ("x", pa.array([-1], pa.int64())),
    "utf8 hello": ("x", pa.array(["hello"])),
    "float 1.5": ("x", pa.array([1.5])),
    "null": ("x", pa.array([None], pa.int64())),
}
GOLDEN_VALUES = {}


def _golden_hashes():
    out = {}
    for name, (col, arr) in GOLDEN.items():
        out[name] = int(dbsp.ZSet.from_arrow(pa.table({col: arr})).hash([col])[0])
    return out


def test_hash_is_deterministic_across_processes():
    here = _golden_hashes()
    code = ("import pyarrow as pa, dbsp_core as d;"
            "print(int(d.ZSet.from_arrow(pa.table({'x': ['hello']})).hash(['x'])[0]))")
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}, cwd=None)
        assert int(out.stdout) == here["utf8 hello"]
    assert dbsp.HASH_VERSION == 1


def test_hash_v1_known_answers():
    # computed from the specification in csrc/hash.h; a change here is a new hash version
    mix = _mix
    def int_hash(v):
        return mix((0x082EFA98EC4E6C89 * 0x9E3779B97F4A7C15 + mix((v & (2**64 - 1)) ^ 0x243F6A8885A308D3)) % 2**64)
    got = _golden_hashes()
    assert got["int64 0"] == int_hash(0)
    assert got["int64 -1"] == int_hash(-1)
    assert got["null"] == mix((0x082EFA98EC4E6C89 * 0x9E3779B97F4A7C15 + mix(0x9AE16A3B2F90404F)) % 2**64)
    bits = int.from_bytes(np.float64(1.5).tobytes(), "little")
    assert got["float 1.5"] == mix((0x082EFA98EC4E6C89 * 0x9E3779B97F4A7C15 + mix(bits ^ 0x13198A2E03707344)) % 2**64)
    h = mix(5 ^ 0xA4093822299F31D0)
    h = (mix(h ^ int.from_bytes(b"hello", "little")) * 0x9E3779B97F4A7C15) % 2**64
    assert got["utf8 hello"] == mix((0x082EFA98EC4E6C89 * 0x9E3779B97F4A7C15 + mix(h)) % 2**64)


def _bytes_row_hash(v: bytes) -> int:
    """The version-1 row hash of a one-column row holding byte string ``v``, from the specification (csrc/hash.h)."""
    k, m = 0x9E3779B97F4A7C15, 2**64 - 1
    h = _mix(len(v) ^ 0xA4093822299F31D0)
    for i in range(0, len(v), 8):  # full words, then the partial one zero-padded
        h = (_mix(h ^ int.from_bytes(v[i:i + 8].ljust(8, b"\0"), "little")) * k) & m
    return _mix((0x082EFA98EC4E6C89 * k + _mix(h)) & m)


@pytest.mark.parametrize("offset", [0, 3])
def test_hash_v1_of_strings_of_every_length(offset: int) -> None:
    """Strings of every length 0..40 (every partial word, one to five full words), in runs of 1..9 rows (the
    kernel hashes four and two values at once, then one at a time), against the specification; also a slice."""
    rng = np.random.default_rng(7)
    values = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in range(41) for _ in range(3)]
    rng.shuffle(values)
    for rows in range(1, 10):
        for start in range(0, len(values) - rows, 17):
            vals = values[start:start + rows]
            arr = pa.array([b"x" * offset] * offset + vals, pa.binary()).slice(offset)
            z = dbsp.ZSet.from_arrow(pa.table({"b": arr}))
            got = [int(x) for x in z.hash(["b"])]
            assert got == [_bytes_row_hash(v) for v in vals], (rows, start)
    text = ["", "a", "héllo wörld", "x" * 23]
    z = dbsp.ZSet.from_arrow(pa.table({"s": pa.array(text, pa.string())}))
    assert [int(x) for x in z.hash(["s"])] == [_bytes_row_hash(t.encode()) for t in text]


def _mix(z):
    m = 2**64 - 1
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & m
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return z


def test_hash_is_width_independent_for_integers_and_strings():
    a = dbsp.ZSet.from_arrow(pa.table({"k": pa.array([1, -7, None], pa.int8())}))
    b = dbsp.ZSet.from_arrow(pa.table({"k": pa.array([1, -7, None], pa.int64())}))
    assert (a.hash(["k"]) == b.hash(["k"])).all()
    s = dbsp.ZSet.from_arrow(pa.table({"k": pa.array(["x", ""], pa.string())}))
    ls = dbsp.ZSet.from_arrow(pa.table({"k": pa.array(["x", ""], pa.large_string())}))
    assert (s.hash(["k"]) == ls.hash(["k"])).all()


@given(zsets())
def test_equal_rows_hash_equal(tw):
    t, w = tw
    z = dbsp.ZSet.from_arrow(t, weights=w)
    h = z.hash(t.schema.names)
    seen = {}
    for r, hv in zip(zip(*[c.to_pylist() for c in z.data.columns]), h.tolist()):
        k = canon_row(r)
        assert seen.setdefault(k, hv) == hv


# ---- index, partition, join, reduce ----

@given(st.data())
def test_index_by_orders_by_key_hash(data):
    t, w = data.draw(zsets())
    keys = data.draw(st.lists(st.sampled_from(t.schema.names), min_size=1, max_size=len(t.schema), unique=True))
    ix = dbsp.ZSet.from_arrow(t, weights=w).index_by(keys)
    assert canon_dict(ix.zset.to_dict()) == model_of(t, w)
    assert np.all(np.diff(ix.key_hash.astype(np.float64)) >= 0) or len(ix) < 2
    assert (ix.key_hash == ix.zset.hash(keys)).all()
    kpos = [t.schema.get_field_index(k) for k in keys]
    assert _zset.check_order(ix.zset.data, ix.zset.weights, ix.key_hash, kpos)
    bounds = ix.shard_bounds(3)
    assert bounds[0] == 0 and bounds[-1] == len(ix) and np.all(np.diff(bounds) >= 0)
    shard = (ix.key_hash >> np.uint64(61)).astype(np.int64)
    for s in range(8):
        assert (shard[bounds[s]:bounds[s + 1]] == s).all()


@given(st.data())
def test_indexed_merge_matches_model(data):
    schema = data.draw(schemas())
    (ta, wa), (tb, wb) = data.draw(zsets(schema=schema)), data.draw(zsets(schema=schema))
    key = [schema.names[0]]
    a = dbsp.ZSet.from_arrow(ta, weights=wa).index_by(key)
    b = dbsp.ZSet.from_arrow(tb, weights=wb).index_by(key)
    m = a.merge(b)
    assert canon_dict(m.zset.to_dict()) == add_models(model_of(ta, wa), model_of(tb, wb))
    assert _zset.check_order(m.zset.data, m.zset.weights, m.key_hash, [0])


@given(st.data())
def test_merge_on_a_whole_row_key_equals_indexing_the_sum(data):
    """With every column as the key (distinct's traces), merge reuses key hashes as row hashes: the result is
    exactly the index of the concatenation (rows, weights, key hashes, order)."""
    schema = data.draw(schemas())
    (ta, wa), (tb, wb) = data.draw(zsets(schema=schema)), data.draw(zsets(schema=schema))
    key = list(schema.names)
    za, zb = dbsp.ZSet.from_arrow(ta, weights=wa), dbsp.ZSet.from_arrow(tb, weights=wb)
    m = za.index_by(key).merge(zb.index_by(key))
    want = dbsp.ZSet.concat([za, zb]).index_by(key)
    assert m.zset.data.equals(want.zset.data) or _bits_table(m.zset.data) == _bits_table(want.zset.data)
    assert np.array_equal(m.zset.weights, want.zset.weights) and np.array_equal(m.key_hash, want.key_hash)


@given(st.data())
def test_merge_in_steps_equals_indexing_the_sum(data):
    """The resumable merge (csrc/merge.h) advanced by random budgets, with reads of its inputs between steps,
    gives exactly the index of the sum (rows, weights, key hashes, order) for any key and column types."""
    from dbsp_core.zset import merged, merge_cursor

    schema = data.draw(schemas())
    key = list(schema.names[:data.draw(st.integers(1, len(schema)))])
    (ta, wa), (tb, wb) = data.draw(zsets(schema=schema, max_rows=80)), data.draw(zsets(schema=schema, max_rows=80))
    za, zb = dbsp.ZSet.from_arrow(ta, weights=wa), dbsp.ZSet.from_arrow(tb, weights=wb)
    a, b = za.index_by(key), zb.index_by(key)
    if len(a) == 0 or len(b) == 0:
        return
    if data.draw(st.booleans()):
        a._row_hashes()  # a side that keeps its row hashes: meeting keys are ordered without hashing
    keep = data.draw(st.booleans())
    m = merge_cursor(a, b, row_hashes=keep)
    assert m.step(0) == 0 and m.remaining == len(a) + len(b)
    while not m.done:
        used = m.step(data.draw(st.integers(1, 9)))
        assert used >= 1
    got, want = merged(a, m), dbsp.ZSet.concat([za, zb]).index_by(key)
    got.zset.data.validate(full=True)
    assert got.zset.data.equals(want.zset.data) or _bits_table(got.zset.data) == _bits_table(want.zset.data)
    assert np.array_equal(got.zset.weights, want.zset.weights) and np.array_equal(got.key_hash, want.key_hash)
    assert [c.null_count for c in got.zset.data.columns] == [c.null_count for c in want.zset.data.columns]
    if keep:
        assert np.array_equal(got._row_hashes(), _zset.hash_columns(got.zset.data, list(range(len(schema)))))
    with pytest.raises(ValueError):
        m.result()  # taken once


def _bits_table(t: pa.Table) -> list:
    """Values by their bits, except -0.0 as 0.0: equal rows may keep either zero (row identity, column.h)."""
    return [[struct.pack("<d", v + 0.0) if isinstance(v, float) else v for v in c.to_pylist()] for c in t.columns]


@given(st.data())
def test_partition_keeps_rows_and_routes_by_shard(data):
    t, w = data.draw(zsets())
    bits = data.draw(st.integers(0, 4))
    nparts = data.draw(st.integers(1, 5))
    pos = np.array(data.draw(st.lists(st.integers(0, nparts - 1), min_size=2**bits, max_size=2**bits)), np.int32)
    z = dbsp.ZSet.from_arrow(t, weights=w)
    key = [t.schema.names[0]]
    parts = z.partition(key, pos, nparts)
    assert len(parts) == nparts
    assert sum(p.num_rows for p in parts) == z.num_rows
    assert canon_dict(dbsp.ZSet.concat(parts).to_dict()) == model_of(t, w)
    for p, part in enumerate(parts):
        shards = (part.hash(key) >> np.uint64(64 - bits)).astype(np.int64) if bits else np.zeros(part.num_rows, int)
        assert (pos[shards] == p).all()


def test_partition_is_stable_and_validates():
    z = dbsp.ZSet.from_arrow(pa.table({"k": list(range(100)), "i": list(range(100))}))
    parts = z.partition(["k"], np.array([0, 1], np.int32), 2)
    for p in parts:
        assert p.data.column("i").to_pylist() == sorted(p.data.column("i").to_pylist())
    with pytest.raises(ValueError, match="power-of-two"):
        z.partition(["k"], np.array([0, 1, 0], np.int32), 2)
    with pytest.raises(ValueError):
        z.partition(["k"], np.array([0, 5], np.int32), 2)
    with pytest.raises(SchemaError, match="nope"):
        z.partition(["nope"], np.array([0], np.int32), 1)


KEY_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint16(), pa.string(), pa.float64(), pa.bool_()]


@st.composite
def join_inputs(draw):
    kt = draw(st.sampled_from(KEY_TYPES))
    # the right key may have another integer width
    rt = draw(st.sampled_from([pa.int16(), pa.int64()])) if pa.types.is_signed_integer(kt) else kt
    lt = draw(tables(schema=pa.schema([("k", kt), ("a", pa.string())]), max_rows=25))
    rtb = draw(tables(schema=pa.schema([("id", rt), ("b", pa.int32())]), max_rows=25))
    return lt, weights_for(draw, lt.num_rows), rtb, weights_for(draw, rtb.num_rows)


def _norm_key(v):
    return canon_value(v)


@given(join_inputs(), st.booleans())
def test_join_matches_nested_loop_model(inp, left_outer):
    lt, lw, rt, rw = inp
    L = dbsp.ZSet.from_arrow(lt, weights=lw).index_by(["k"])
    R = dbsp.ZSet.from_arrow(rt, weights=rw).index_by(["id"])
    li, ri, w = L.join(R, left_outer=left_outer)
    got: dict = defaultdict(int)
    lrows = list(zip(*[c.to_pylist() for c in L.zset.data.columns]))
    rrows = list(zip(*[c.to_pylist() for c in R.zset.data.columns]))
    for x, y, ww in zip(li.tolist(), ri.tolist(), w.tolist()):
        got[canon_row(lrows[x] + (rrows[y] if y >= 0 else (None, None)))] += ww
    want: dict = defaultdict(int)
    lm, rm = model_of(L.zset.data, L.zset.weights), model_of(R.zset.data, R.zset.weights)
    for lk, lwt in lm.items():
        matched = False
        for rk, rwt in rm.items():
            if lk[0] != ("null",) and lk[0] == rk[0]:
                want[lk + rk] += lwt * rwt
                matched = True
        if left_outer and not matched:
            want[lk + (("null",), ("null",))] += lwt
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
    if not left_outer:
        assert (ri >= 0).all()


@given(join_inputs(), st.booleans())
def test_hash_join_equals_indexed_join(inp, left_outer):
    lt, lw, rt, rw = inp
    zl, zr = dbsp.ZSet.from_arrow(lt, weights=lw), dbsp.ZSet.from_arrow(rt, weights=rw)

    def pairs(left, right, li, ri, w):
        lrows = list(zip(*[c.to_pylist() for c in left.data.columns]))
        rrows = list(zip(*[c.to_pylist() for c in right.data.columns]))
        acc: dict = defaultdict(int)
        for x, y, ww in zip(li.tolist(), ri.tolist(), w.tolist()):
            acc[canon_row(lrows[x] + (rrows[y] if y >= 0 else (None, None)))] += ww
        return {k: v for k, v in acc.items() if v}

    hashed = pairs(zl, zr, *zl.join_rows(zr, ["k"], ["id"], left_outer=left_outer))
    L, R = zl.index_by(["k"]), zr.index_by(["id"])
    indexed = pairs(L.zset, R.zset, *L.join(R, left_outer=left_outer))
    if left_outer:  # right rows index the consolidated right side
        hashed = pairs(zl, zr.consolidate(), *zl.join_rows(zr, ["k"], ["id"], left_outer=True))
    assert hashed == indexed


def test_join_small_against_large_does_not_scan():
    big = dbsp.ZSet.from_arrow(pa.table({"id": np.arange(200_000), "v": np.arange(200_000)})).index_by(["id"])
    small = dbsp.ZSet.from_arrow(pa.table({"k": [5, 199_999, -1]})).index_by(["k"])
    li, ri, w = small.join(big)
    assert sorted(big.zset.data.column("v").take(pa.array(ri)).to_pylist()) == [5, 199_999]


def test_join_rejects_incompatible_keys():
    a = dbsp.ZSet.from_arrow(pa.table({"k": [1]})).index_by(["k"])
    b = dbsp.ZSet.from_arrow(pa.table({"k": ["1"]})).index_by(["k"])
    with pytest.raises(SchemaError, match="cannot match"):
        a.join(b)


@st.composite
def reduce_inputs(draw):
    vt = draw(st.sampled_from([pa.int64(), pa.int16(), pa.uint8(), pa.float64(), pa.float32(), pa.string(),
                               pa.bool_(), pa.date32()]))
    kt = draw(st.sampled_from([pa.int64(), pa.string()]))
    t = draw(tables(schema=pa.schema([("k", kt), ("v", vt)]), max_rows=40))
    fin = [f for f in (POOLS[vt]) if not (isinstance(f, float) and not math.isfinite(f))]
    # finite, modest values keep float sums exact enough to compare
    t = t.set_column(1, "v", pa.array([x if (x is None or not isinstance(x, float) or math.isfinite(x)) and
                                       not (isinstance(x, float) and abs(x) > 1e9) else fin[0]
                                       for x in t.column(1).to_pylist()], type=vt))
    w = weights_for(draw, t.num_rows, 1, 3) if draw(st.booleans()) else weights_for(draw, t.num_rows)
    return t, w


@given(reduce_inputs())
def test_reduce_matches_model(tw):
    t, w = tw
    ix = dbsp.ZSet.from_arrow(t, weights=w).index_by(["k"])
    vt = t.schema.field("v").type
    numeric = pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_boolean(vt)
    aggs = [("count", None), ("count_col", "v"), ("min", "v"), ("max", "v")] + ([("sum", "v")] if numeric else [])
    if pa.types.is_unsigned_integer(vt) or vt == pa.int64():
        t = t  # sums of the pooled extremes may overflow; covered by test_reduce_sum_overflow
        aggs = aggs[:4]
    res = ix.reduce(aggs)
    groups: dict = defaultdict(list)
    for (k, v), wt in zip(zip(*[c.to_pylist() for c in ix.zset.data.columns]), ix.zset.weights.tolist()):
        groups[canon_value(k)].append((v, wt))
    assert res.num_rows == len(groups)
    for row in res.to_pylist():
        g = groups[canon_value(row["k"])]
        assert row["agg_0"] == sum(wt for _, wt in g)
        assert row["agg_1"] == sum(wt for v, wt in g if v is not None)
        pos = [v for v, wt in g if v is not None and wt > 0]
        key = (lambda x: (x != x, x)) if pa.types.is_floating(vt) else (lambda x: x)
        assert canon_value(row["agg_2"]) == canon_value(min(pos, key=key) if pos else None)
        assert canon_value(row["agg_3"]) == canon_value(max(pos, key=key) if pos else None)
        if len(aggs) > 4:
            nn = [(v, wt) for v, wt in g if v is not None]
            want = sum(float(v) * wt for v, wt in nn) if nn else None
            got = row["agg_4"]
            if want is None:
                assert got is None
            else:
                assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_reduce_sum_overflow_and_types():
    ix = dbsp.ZSet.from_arrow(pa.table({"k": [1, 1], "v": [2**62, 2**62]})).index_by(["k"])
    with pytest.raises(WeightOverflowError):
        ix.reduce([("sum", "v")])
    s = dbsp.ZSet.from_arrow(pa.table({"k": [1], "v": ["a"]})).index_by(["k"])
    with pytest.raises(SchemaError, match="non-numeric"):
        s.reduce([("sum", "v")])
    with pytest.raises(ValueError, match="unknown aggregate"):
        s.reduce([("median", "v")])


def test_min_max_ignore_deleted_rows():
    ix = dbsp.ZSet.from_arrow(pa.table({"k": [1, 1, 1], "v": [1, 5, 9]}), weights=[-1, 1, -2]).index_by(["k"])
    r = ix.reduce([("min", "v"), ("max", "v")]).to_pylist()
    assert r == [{"k": 1, "agg_0": 5, "agg_1": 5}]


# ---- validation and overflow ----

def test_weight_overflow_raises():
    t = pa.table({"x": [1, 1]})
    with pytest.raises(WeightOverflowError):
        dbsp.ZSet.from_arrow(t, weights=[2**63 - 1, 1]).consolidate()
    with pytest.raises(WeightOverflowError):
        -dbsp.ZSet.from_arrow(pa.table({"x": [1]}), weights=[-(2**63)])
    a = dbsp.ZSet.from_arrow(pa.table({"x": [1]}), weights=[2**63 - 1])
    with pytest.raises(WeightOverflowError):
        a + a
    j = dbsp.ZSet.from_arrow(pa.table({"x": [1]}), weights=[2**62]).index_by(["x"])
    with pytest.raises(WeightOverflowError):
        j.join(j)


_EXTREMES = [2**63 - 1, -(2**63), 2**62, -(2**62), 1, -1, -2, 2]


@st.composite
def extreme_weights(draw):
    """Rows of few distinct values (so many rows merge) with weights near the int64 limits, and a permutation."""
    n = draw(st.integers(1, 12))
    keys = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    w = draw(st.lists(st.sampled_from(_EXTREMES), min_size=n, max_size=n))
    perm = draw(st.permutations(list(range(n))))
    big = draw(st.booleans())  # past the small-batch path: the grouping engine (csrc/group.c)
    return keys, w, perm, big


@given(extreme_weights())
def test_weight_overflow_does_not_depend_on_row_order(case):
    """A weight sum overflows iff the exact sum of a row's weights leaves int64, in every row order: [M, 1, -2]
    and [-2, 1, M] both give M - 1, [M, 1] raises in both orders (consolidate, count and sum)."""
    keys, w, perm, big = case
    pad = 5000 if big else 0  # distinct filler rows with weight 1
    exact: dict = defaultdict(int)
    for k, x in zip(keys, w):
        exact[k] += x
    fits = all(-_I64 <= s < _I64 for s in exact.values())
    for order in (list(range(len(keys))), perm):
        ks = [keys[i] for i in order] + list(range(100, 100 + pad))
        ws = [w[i] for i in order] + [1] * pad
        z = dbsp.ZSet.from_arrow(pa.table({"k": pa.array(ks, pa.int64()), "s": pa.array([str(k) for k in ks])}),
                                 weights=np.array(ws, dtype=np.int64))
        one = dbsp.ZSet.from_arrow(pa.table({"k": pa.array(ks, pa.int64())}), weights=np.array(ws, dtype=np.int64))
        ones = dbsp.ZSet.from_arrow(pa.table({"k": pa.array(ks, pa.int64()), "u": pa.array([1] * len(ks))}),
                                    weights=np.array(ws, dtype=np.int64))
        if not fits:
            for run in (z.consolidate, one.consolidate, z._distinct_unsorted, lambda: z.aggregate(["s"], [("count", None)]),
                        lambda: one.aggregate(["k"], [("count", None)]),
                        lambda: ones.aggregate(["k"], [("sum", "u")])):
                with pytest.raises(WeightOverflowError):
                    run()
            continue
        want = {(k,): s for k, s in exact.items() if s != 0}
        got = {r: x for r, x in one.consolidate().to_dict().items() if r[0] < 100}
        assert got == want
        got2 = {(k,): x for (k, _), x in z.consolidate().to_dict().items() if k < 100}
        assert got2 == want
        agg = ones.aggregate(["k"], [("count", None), ("sum", "u")]).to_pylist()
        assert {(r["k"],): r["agg_0"] for r in agg if r["k"] < 100 and r["agg_0"]} == want
        assert {(r["k"],): r["agg_1"] for r in agg if r["k"] < 100 and r["agg_1"]} == want


def test_bad_input_is_named():
    s = pa.schema([("a", pa.int64())])
    with pytest.raises(SchemaError, match="schemas differ"):
        dbsp.ZSet.from_rows([(1,)], s) + dbsp.ZSet.from_rows([("x",)], pa.schema([("a", pa.string())]))
    with pytest.raises(TypeError, match="weights must be integers"):
        dbsp.ZSet.from_arrow(pa.table({"a": [1]}), weights=[1.5])
    with pytest.raises(ValueError, match="2 weights for 1 rows"):
        dbsp.ZSet.from_arrow(pa.table({"a": [1]}), weights=[1, 2])
    with pytest.raises(SchemaError, match="column 'd' has unsupported type decimal"):
        dbsp.ZSet.from_arrow(pa.table({"d": pa.array([1], pa.decimal128(5, 2))}))
    with pytest.raises(ValueError, match="row 1 has 2 values but the schema has 1"):
        dbsp.ZSet.from_rows([(1,), (1, 2)], s)
    with pytest.raises(TypeError, match="pyarrow Table or RecordBatch"):
        dbsp.ZSet.from_arrow({"a": [1]})
    with pytest.raises(TypeError, match="column 'a'"):
        dbsp.ZSet.from_rows([("x",)], s)
    with pytest.raises(TypeError):
        dbsp.ZSet()


def test_from_record_batch_and_pandas():
    rb = pa.record_batch({"a": [1, 2, 2]})
    z = dbsp.ZSet.from_arrow(rb, weights=pa.array([1, 1, 1], pa.int32()))
    df = z.to_pandas()
    assert sorted(zip(df["a"], df["weight"])) == [(1, 1), (2, 2)]


def test_large_batch_consolidates_across_partitions():
    rng = np.random.default_rng(7)
    k = rng.integers(0, 5000, 300_000)
    z = dbsp.ZSet.from_arrow(pa.table({"k": k, "s": pa.array((k % 7).astype(str))}),
                             weights=rng.integers(-2, 3, k.shape[0]))
    c = z.consolidate()
    uniq, inv = np.unique(k, return_inverse=True)
    sums = np.bincount(inv, weights=z.weights).astype(np.int64)
    want = {(int(u), str(int(u) % 7)): int(s) for u, s in zip(uniq, sums) if s}
    assert c.to_dict() == want
    assert is_canonical(c)


@given(reduce_inputs())
def test_hash_aggregate_equals_indexed_reduce(tw):
    t, w = tw
    z = dbsp.ZSet.from_arrow(t, weights=w)
    vt = t.schema.field("v").type
    numeric = pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_boolean(vt)
    aggs = [("count", None), ("count_col", "v"), ("min", "v"), ("max", "v")]
    if numeric and not (pa.types.is_unsigned_integer(vt) or vt == pa.int64()):
        aggs.append(("sum", "v"))
    direct = z.aggregate(["k"], aggs)
    indexed = z.index_by(["k"]).reduce(aggs)
    # the indexed reduce keeps groups whose count is 0 (rows that cancel in count only); aggregate drops them
    indexed = indexed.filter(pa.compute.not_equal(indexed.column("agg_0"), 0))

    def rows(tab):
        return sorted((tuple(canon_value(v) for v in r.values()) for r in tab.to_pylist()), key=repr)
    if len(aggs) > 4:  # float sums may differ in the last bits by summation order
        direct, indexed = direct.drop_columns(["agg_4"]), indexed.drop_columns(["agg_4"])
    assert rows(direct) == rows(indexed)


def test_aggregate_drops_empty_groups_and_validates():
    z = dbsp.ZSet.from_arrow(pa.table({"k": [1, 1, 2], "v": [5, 5, 7]}), weights=[1, -1, 1])
    assert z.aggregate(["k"], [("sum", "v")]).to_pylist() == [{"k": 2, "agg_0": 7}]
    with pytest.raises(SchemaError, match="unknown column 'x'"):
        z.aggregate(["x"], [("count", None)])
    with pytest.raises(ValueError, match="at least one key"):
        z.aggregate([], [("count", None)])


def test_read_only_arrays_and_unverified_consolidation_claims():
    w = np.array([1, 2, 3], np.int64)
    w.setflags(write=False)
    z = dbsp.ZSet.from_arrow(pa.table({"k": [1, 1, 2]}), weights=w)
    assert z.to_dict() == {(1,): 3, (2,): 3}
    pos = np.array([0, 1], np.int32)
    pos.setflags(write=False)
    assert sum(p.num_rows for p in z.partition(["k"], pos, 2)) == 3
    # a claim of consolidation without row hashes is checked: rows out of canonical order are not trusted
    c = dbsp.ZSet._make(pa.table({"k": [2, 1]}), np.array([1, 1], np.int64), consolidated=True)
    assert (c + z).to_dict() == {(1,): 4, (2,): 4}


# ---- one non-null integer key: the grouping fast path (csrc/group_int.c) ----

_I64 = 2**63


@st.composite
def int_key_inputs(draw):
    kt = draw(st.sampled_from([pa.int64(), pa.uint64(), pa.timestamp("us")]))
    n = draw(st.integers(0, 60))
    kpool = POOLS[kt] if kt in POOLS else [0, 1, -1, 7]
    keys = draw(st.lists(st.sampled_from(kpool) if draw(st.booleans()) else st.integers(0, 2**40), min_size=n, max_size=n))
    vals = draw(st.lists(st.sampled_from([0, 1, -1, 1000, 2**62, -(2**62), 2**63 - 1, -(2**63)])
                         if draw(st.booleans()) else st.integers(-1000, 1000), min_size=n, max_size=n))
    big = draw(st.booleans())
    w = [draw(st.sampled_from([-(2**40), 2**31, 2**62]) if big and draw(st.booleans()) else st.integers(-3, 3))
         for _ in range(n)]
    return pa.table({"k": pa.array(keys, kt), "v": pa.array(vals, pa.int64())}), np.array(w, dtype=np.int64)


def _int_key_model(t: pa.Table, w: np.ndarray):
    """{key: (weight sum, sum of v * w)} for groups with a non-zero weight sum; None if an int64 product
    overflows, a group's (exact) weight sum does not fit in int64, or a kept group's (exact) sum of v * w does not,
    whatever the row order. A group whose weights sum to 0 has no row, so its sum is never asked (``aggregate``
    leaves such groups out: a sum that would not fit is not an error there)."""
    groups: dict = {}
    for k, v, wt in zip(t.column("k").cast(pa.int64()).to_pylist() if t.schema.field("k").type != pa.uint64()
                        else t.column("k").to_pylist(), t.column("v").to_pylist(), w.tolist()):
        g = groups.setdefault(k, [0, 0])
        g[0] += wt
        g[1] += v * wt
        if not -_I64 <= v * wt < _I64:
            return None
    if any(not (-_I64 <= ws < _I64 and (ws == 0 or -_I64 <= s < _I64)) for ws, s in groups.values()):
        return None
    return {k: (ws, s) for k, (ws, s) in groups.items() if ws != 0}


@given(int_key_inputs())
@example((pa.table({"k": pa.array([0] * 7, pa.int64()), "v": pa.array([0, 0, 0, 0, 0, 1, 2**62], pa.int64())}),
          np.array([0, 0, 0, 0, 3, -1, -2], dtype=np.int64)))  # weights sum to 0, v * w to -2**63 - 1: no row, no error
def test_int_key_aggregate_and_consolidate_match_model(tw):
    t, w = tw
    z = dbsp.ZSet.from_arrow(t, weights=w)
    want = _int_key_model(t, w)
    if want is None:
        with pytest.raises(WeightOverflowError):
            z.aggregate(["k"], [("sum", "v"), ("count", None)])
    else:
        res = z.aggregate(["k"], [("sum", "v"), ("count", None)])
        keys = res.column("k").cast(pa.int64()).to_pylist() if res.schema.field("k").type != pa.uint64() \
            else res.column("k").to_pylist()
        assert {k: (c, s) for k, s, c in zip(keys, res.column("agg_0").to_pylist(), res.column("agg_1").to_pylist())} == want
        kh = dbsp.ZSet.from_arrow(res.select(["k"])).hash(["k"])
        assert (np.diff(kh.astype(np.uint64)) > 0).all()  # groups in key-hash order (one hash per value)
    # consolidating the key column alone: weight sums only, an overflow when a sum does not fit
    one = dbsp.ZSet.from_arrow(t.select(["k"]), weights=w)
    wsum: dict = defaultdict(int)
    for k, wt in zip(t.column("k").to_pylist(), w.tolist()):
        wsum[k] += wt
    if any(not -_I64 <= ws < _I64 for ws in wsum.values()):
        with pytest.raises(WeightOverflowError):
            one.consolidate()
        return
    c = one.consolidate()
    assert canon_dict(c.to_dict()) == model_of(t.select(["k"]), w)
    assert is_canonical(c)

def _sum_count_model(k: np.ndarray, v: np.ndarray, w: np.ndarray) -> dict:
    """{key: (sum of v * w, weight sum)} by numpy, for the groups whose weight sum is not 0."""
    uniq, inv = np.unique(k, return_inverse=True)
    cnt = np.bincount(inv, weights=w).astype(np.int64)
    sums = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(sums, inv, v * w)
    return {int(u): (int(s), int(c)) for u, s, c in zip(uniq, sums, cnt) if c}


def _sum_count_of(res: pa.Table) -> dict:
    """{k: (agg_0, agg_1)} of an aggregate's result table (sum then count)."""
    return dict(zip(res.column("k").to_pylist(), zip(res.column("agg_0").to_pylist(), res.column("agg_1").to_pylist())))


def test_int_key_aggregate_across_partitions():
    rng = np.random.default_rng(11)
    n = 200_000  # several radix partitions, tables that grow
    k = rng.integers(0, 30_000, n)
    v = rng.integers(-10**6, 10**6, n)
    w = rng.integers(-1, 3, n)
    z = dbsp.ZSet.from_arrow(pa.table({"k": k, "v": v}), weights=w)
    res = z.aggregate(["k"], [("sum", "v"), ("count", None)])
    want = _sum_count_model(k, v, w)
    assert _sum_count_of(res) == want
    c = dbsp.ZSet.from_arrow(pa.table({"k": k}), weights=w).consolidate()
    assert is_canonical(c)
    assert c.to_dict() == {(u,): c_ for u, (_, c_) in want.items()}


@pytest.mark.parametrize("key", ["int", "two", "str"])
@pytest.mark.parametrize("shape", ["few_then_many", "many_then_few", "all_distinct", "blocks", "twice"])
@pytest.mark.parametrize("n", [5_000, 20_000, 70_000])
def test_aggregate_when_the_group_rate_changes(key, shape, n):
    """A partition's table grows to the groups its rows so far project (csrc/group_int.c note 4 for one int64
    key, csrc/group.c for two keys or a string): a rate of new groups that changes along the rows makes it grow
    again, or leaves it too large; the groups stay exact."""
    rng = np.random.default_rng(n)
    h = n // 2
    k = {"few_then_many": np.concatenate([rng.integers(0, 50, h), rng.integers(0, 10**9, n - h)]),
         "many_then_few": np.concatenate([rng.permutation(10**6)[:h], rng.integers(0, 50, n - h)]),
         "all_distinct": rng.permutation(10**7)[:n],
         "blocks": np.repeat(rng.permutation(10**6)[: n // 7 + 1], 7)[:n],
         "twice": np.concatenate([d := rng.permutation(10**6)[:h], rng.permutation(d)])[:n]}[shape]  # every
    # group is met again after the table's last growth
    v = rng.integers(-10**6, 10**6, n)
    w = rng.integers(-1, 3, n)
    cols = {"k": k, "v": v}
    if key != "int":  # the general engine; the model groups by k alone, which determines the other key
        cols = {"k": k, "k2": pa.array(k.astype(str)) if key == "str" else k % 7, "v": v}
    res = dbsp.ZSet.from_arrow(pa.table(cols), weights=w).aggregate(["k"] if key == "int" else ["k", "k2"],
                                                                     [("sum", "v"), ("count", None)])
    want = _sum_count_model(k, v, w)
    assert _sum_count_of(res) == want and res.num_rows == len(want)  # one row per group
    kcols = ["k"] if key == "int" else ["k", "k2"]
    kh = dbsp.ZSet.from_arrow(res.select(kcols)).hash(kcols)
    assert (np.diff(kh.astype(np.uint64)) > 0).all()


# ---- the prefetching gather behind large takes (csrc/gather.c) ----

def _bits(col: pa.ChunkedArray) -> list:
    """Values with floats as their exact bits (so -0.0, NaN payloads and 0.0 stay distinct), None for nulls."""
    return [struct.pack("<d", v) if isinstance(v, float) else v for v in col.to_pylist()]


@pytest.mark.parametrize("gather", [_zset.gather, _zset.take], ids=["gather", "take"])
@given(t=tables(max_rows=60), data=st.data())
def test_gather_equals_arrow_take(gather, t, data):
    """Both C gathers (_zset.gather for large takes, _zset.take: one call, buffers handed over through the C data
    interface, for small ones) equal Arrow's take bit for bit, on sliced tables too."""
    lo = data.draw(st.integers(0, t.num_rows))
    t = t.slice(lo, data.draw(st.integers(0, t.num_rows - lo)))
    n = t.num_rows
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=90)) if n else [], dtype=np.int64)
    got = gather(t, idx)
    want = t.take(pa.array(idx, pa.int64()))
    assert got.schema == t.schema and got.num_rows == len(idx)
    for g, w in zip(got.columns, want.columns):
        assert g.num_chunks == 1 and g.null_count == w.null_count
        assert _bits(g) == _bits(w)
    if n:
        with pytest.raises(IndexError):
            gather(t, np.array([0, n], dtype=np.int64))
        with pytest.raises(IndexError):
            gather(t, np.array([-1], dtype=np.int64))


@given(t=tables(max_rows=60), data=st.data())
def test_gather_parts_equals_arrow_takes_concatenated(t, data):
    """One gather from several tables (an exchange's receiver, zset.py ZSet._gather_parts) equals Arrow's takes of
    each, concatenated, bit for bit: slices of the table at any offset (validity and bool bits written from an
    unaligned row), parts with and without nulls, empty parts, and out-of-range indices refused."""
    parts, idxs = [], []
    for _ in range(data.draw(st.integers(1, 4))):
        lo = data.draw(st.integers(0, t.num_rows))
        p = t.slice(lo, data.draw(st.integers(0, t.num_rows - lo)))
        n = p.num_rows
        parts.append(p)
        idxs.append(np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=40)) if n else [], dtype=np.int64))
    got = _zset.gather_parts(parts, idxs)
    want = pa.concat_tables([p.take(pa.array(i, pa.int64())) for p, i in zip(parts, idxs)])
    assert got.schema == t.schema and got.num_rows == want.num_rows
    got.validate(full=True)
    for g, w in zip(got.columns, want.columns):
        assert g.num_chunks == 1 and g.null_count == w.null_count
        assert _bits(g) == _bits(w)
    if parts[-1].num_rows:
        with pytest.raises(IndexError):
            _zset.gather_parts(parts, idxs[:-1] + [np.array([parts[-1].num_rows], dtype=np.int64)])


def test_exchange_receiver_gathers_from_every_sender():
    """zset.py ZSet._gather_parts: the rows of each (zset, indices) in turn with their weights and row hashes, as
    the takes of each concatenated; below the gather's size and above it."""
    from dbsp_core.zset import _GATHER_MIN, ZSet as Z
    rng = np.random.default_rng(5)
    for n in (50, 3 * _GATHER_MIN):
        zs = [Z.from_arrow(pa.table({"k": rng.integers(0, 9, n), "s": [("x" * int(i % 5)) if i % 3 else None
                                                                       for i in range(n)]}),
                           weights=rng.integers(1, 4, n)).consolidate() for _ in range(2)]
        idx = [rng.integers(0, z.num_rows, n // 2) for z in zs]
        got = Z._gather_parts(list(zip(zs, idx)), zs[0].schema)
        assert got.data.equals(pa.concat_tables([z.data.take(pa.array(i)) for z, i in zip(zs, idx)]))
        assert got.weights.tolist() == [int(x) for z, i in zip(zs, idx) for x in z.weights[i]]
        assert got._rhash.tolist() == [int(x) for z, i in zip(zs, idx) for x in z._rhash[i]]
    assert Z._gather_parts([(zs[0], np.zeros(0, np.int64))], zs[0].schema).num_rows == 0


def test_large_take_uses_gather_and_matches_arrow():
    from dbsp_core.zset import _GATHER_MIN, _take
    rng = np.random.default_rng(3)
    n = 4 * _GATHER_MIN
    t = pa.table({"k": pa.array(rng.integers(0, 9, n), mask=rng.random(n) < 0.1),
                  "s": pa.array([("v" * int(i % 23)) if i % 7 else None for i in range(n)], pa.large_string()),
                  "b": pa.array(rng.random(n) < 0.5), "f": pa.array(rng.random(n).astype(np.float32))}).slice(5)
    idx = rng.integers(0, t.num_rows, _GATHER_MIN + 1)
    got = _take(t, idx)
    assert got.equals(t.take(pa.array(idx)))
    assert all(c.num_chunks == 1 for c in got.columns)


@given(st.data())
def test_take_pairs_equals_two_arrow_takes(data):
    """A join's output rows gathered in one C call: the left table's columns (all, or the chosen ones: the columns a
    fused aggregate reads) at the left rows, then the chosen right columns at the right rows, bit for bit Arrow's
    takes; a schema with other types is refused (TypeError), as are indices or columns out of range."""
    lt, rt = data.draw(tables(max_rows=30)), data.draw(tables(max_rows=30))
    lt = lt.rename_columns([f"l{i}" for i in range(lt.num_columns)])
    rt = rt.rename_columns([f"r{i}" for i in range(rt.num_columns)])
    rcols = data.draw(st.lists(st.integers(0, rt.num_columns - 1), max_size=rt.num_columns, unique=True))
    lcols = data.draw(st.one_of(st.none(), st.lists(st.integers(0, lt.num_columns - 1), max_size=lt.num_columns,
                                                    unique=True)))
    m = data.draw(st.integers(0, 40)) if lt.num_rows and rt.num_rows else 0
    li = np.array(data.draw(st.lists(st.integers(0, lt.num_rows - 1), min_size=m, max_size=m)) if m else [], np.int64)
    ri = np.array(data.draw(st.lists(st.integers(0, rt.num_rows - 1), min_size=m, max_size=m)) if m else [], np.int64)
    lpos = range(lt.num_columns) if lcols is None else lcols
    schema = pa.schema([lt.schema.field(c) for c in lpos] + [rt.schema.field(c) for c in rcols])
    got = _zset.take_pairs(lt, li, rt, ri, rcols, schema, lcols)
    want = [lt.column(c).take(pa.array(li, pa.int64())) for c in lpos] + \
        [rt.column(c).take(pa.array(ri, pa.int64())) for c in rcols]
    assert got.schema == schema and got.num_rows == m
    for g, w in zip(got.columns, want):
        assert g.num_chunks == 1 and g.null_count == w.null_count and _bits(g) == _bits(w)
    other = pa.schema([pa.field(f.name, pa.binary() if f.type != pa.binary() else pa.int8()) for f in schema])
    if len(schema):
        with pytest.raises(TypeError):
            _zset.take_pairs(lt, li, rt, ri, rcols, other, lcols)
    if lt.num_columns:
        # the left table's own schema with every type swapped (``other`` follows the chosen columns, which may be
        # none or a subset of the left table's)
        with pytest.raises(TypeError):
            _zset.take(lt, li, pa.schema([pa.field(f.name, pa.binary() if f.type != pa.binary() else pa.int8())
                                          for f in lt.schema]))
    if m:
        with pytest.raises(IndexError):
            _zset.take_pairs(lt, li, rt, np.full(m, rt.num_rows, np.int64), rcols, schema, lcols)
    with pytest.raises(IndexError):
        _zset.take_pairs(lt, li, rt, ri, rcols + [rt.num_columns], schema, lcols)
    with pytest.raises(IndexError):
        _zset.take_pairs(lt, li, rt, ri, rcols, schema, list(lpos) + [lt.num_columns])


# ---- boundaries (zero columns, the weight column's name, the caller's arrays) ----

def test_zero_column_zsets_are_refused_at_the_boundary():
    """A Z-set without columns lost its rows (len() 0, to_arrow raised): it is refused where it would be built."""
    t = pa.table({"a": [1, 2]}).drop_columns(["a"])
    with pytest.raises(SchemaError, match="at least one column"):
        dbsp.ZSet.from_arrow(t)
    with pytest.raises(SchemaError, match="at least one column"):
        dbsp.ZSet.from_rows([(), ()], pa.schema([]))
    with pytest.raises(SchemaError, match="at least one column"):
        dbsp.ZSet.empty(pa.schema([]))
    with pytest.raises(SchemaError, match="input 'e': a Z-set needs at least one column"):
        dbsp.Circuit().input("e", pa.schema([]))


@pytest.mark.parametrize("name", ["weight", "_weight", "__dbsp_weight", "__dbsp_weight__", "w"])
def test_a_data_column_may_have_any_name(name):
    """A column called ``weight`` was shadowed by the weight column of to_arrow (two ``weight`` columns)."""
    schema = pa.schema([(name, pa.int64()), ("x", pa.utf8())])
    z = dbsp.ZSet.from_rows([(7, "a"), (8, "b"), (7, "a")], schema, weights=[2, -1, 3])
    t = z.to_arrow()
    assert len(set(t.column_names)) == 3 and t.column_names[:2] == [name, "x"]
    wname = dbsp.zset.weight_column(schema)
    assert wname not in schema.names and t.column_names[2] == wname
    assert sorted(t.to_pylist(), key=lambda r: r[name]) == [{name: 7, "x": "a", wname: 5}, {name: 8, "x": "b", wname: -1}]
    from dbsp_core.codec import decode_zset, encode_zset
    assert decode_zset(encode_zset(z), schema, "test") == z


def test_concat_looks_for_slices_of_one_table_from_rejoin_min_rows():
    """ZSet.concat of contiguous slices of one table views the table from _REJOIN_MIN_ROWS rows on, and below it
    copies them (the look costs more than the copy); both are the sum of the parts, with their weights and
    row hashes, and one chunk per column."""
    n = dbsp.zset._REJOIN_MIN_ROWS
    for rows, shared in ((n, True), (n - 1, False), (1000, False)):
        t = pa.table({"a": np.arange(rows, dtype=np.int64), "s": pa.array([str(i % 7) for i in range(rows)])})
        z = dbsp.ZSet.from_arrow(t, weights=np.arange(rows, dtype=np.int64) % 3 + 1)._hashed_part(0.0)
        cut = rows // 3
        parts = [dbsp.ZSet._make(z.data.slice(cut), z.weights[cut:], rhash=z._rhash[cut:]),
                 dbsp.ZSet._make(z.data.slice(0, cut), z.weights[:cut], rhash=z._rhash[:cut])]
        c = dbsp.ZSet.concat(parts)
        assert c.to_dict() == z.to_dict()
        assert all(col.num_chunks == 1 for col in c.data.columns)
        assert np.array_equal(c._rhash, _zset.hash_columns(c.data, [0, 1]))
        same = c.data.column(0).chunk(0).buffers()[1].address == z.data.column(0).chunk(0).buffers()[1].address
        assert same == shared, rows


def test_from_arrow_copies_the_callers_weights():
    """ZSet.from_arrow kept the caller's array: changing it later changed a Z-set (and pushed data)."""
    w = np.array([1, 2], dtype=np.int64)
    z = dbsp.ZSet.from_arrow(pa.table({"a": [1, 2]}), weights=w)
    w[0] = 99
    assert z.to_dict() == {(1,): 1, (2,): 2}


@given(zsets(max_rows=30), st.lists(st.integers(0, 30), max_size=4), st.randoms(use_true_random=False),
       st.booleans())
def test_concat_rejoins_slices_of_one_table_without_copying(tw, cuts, rnd, gap):
    """ZSet.concat of slices of one table that cover a contiguous range, in any order, views the table's buffers
    (no copy) and is the sum of the parts, with the weights (and row hashes) of its rows; a gap, an overlap or
    another table's part makes it copy, with the same sum."""
    t, w = tw
    z = dbsp.ZSet.from_arrow(t, weights=np.asarray(w, dtype=np.int64))._hashed_part(0.0)  # rows with hashes
    n = z.num_rows
    bounds = sorted({0, n, *[c for c in cuts if c <= n]})
    parts = [dbsp.ZSet._make(z.data.slice(s, e - s), z.weights[s:e], rhash=z._rhash[s:e])
             for s, e in zip(bounds, bounds[1:])]
    if gap and len(parts) > 2:
        parts.pop(1)
    rnd.shuffle(parts)
    if not parts:
        return
    with mock.patch.object(dbsp.zset, "_REJOIN_MIN_ROWS", 0):  # (the look is skipped below it: next test)
        c = dbsp.ZSet.concat(parts)
    want: dict = defaultdict(int)
    for p in parts:
        for r, x in p.to_dict().items():
            want[canon_row(r)] += x
    assert canon_dict(c.to_dict()) == {r: x for r, x in want.items() if x}
    assert np.array_equal(c._rhash, _zset.hash_columns(c.data, list(range(t.num_columns))))
    shared = [b.address for col in c.data.columns for b in col.chunk(0).buffers() if b is not None] == \
        [b.address for col in z.data.columns for b in col.chunk(0).buffers() if b is not None]
    if len(parts) > 1:  # a single part is handed back as it is
        assert shared == (not (gap and len(bounds) > 3))  # rejoined without a copy iff the slices are contiguous
