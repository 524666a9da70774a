"""The k-way merge cursor (csrc/merge.h invariant 4) against a dict model and against merging two at a time: random batches of every column type (nulls, strings), equal rows across inputs, weights that cancel."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.zset import IndexedZSet, merge_cursor, merged

from test_zset import _bits_table, zsets
from zset_model import add_models, canon_dict, model_of, schemas


def _same(got: dbsp.IndexedZSet, want: dbsp.IndexedZSet) -> None:
    """Rows, weights, key hashes, nulls and order identical (the two-way merge's output form)."""
    got.zset.data.validate(full=True)
    assert got.zset.data.equals(want.zset.data) or _bits_table(got.zset.data) == _bits_table(want.zset.data)
    assert np.array_equal(got.zset.weights, want.zset.weights)
    assert np.array_equal(got.key_hash, want.key_hash)
    assert [c.null_count for c in got.zset.data.columns] == [c.null_count for c in want.zset.data.columns]


@given(st.data())
def test_k_way_merge_matches_the_model_and_two_way_merges(data):
    """k in 3..6 inputs, some drawn as pieces of another input with weights negated or doubled (rows equal across
    inputs, weights that cancel to zero), advanced by random budgets: the output is the dict model's sum, row for row
    the index of the concatenation and the cascade of two-way merges, and carries the right row hashes."""
    _check_k_way(data, data.draw(st.integers(3, 6)))


@given(st.data())
def test_k_way_merge_of_many_inputs(data):
    """As above with 7 to 40 inputs (a scan of many heads, inputs running out of rows while others go on), fewer rows
    each."""
    _check_k_way(data, data.draw(st.integers(7, 40)), max_rows=12)


def _check_k_way(data, k: int, max_rows: int = 60) -> None:
    """The body of the k-way tests: k inputs drawn as the first test says, merged and checked against the model."""
    schema = data.draw(schemas())
    key = list(schema.names[:data.draw(st.integers(1, len(schema)))])
    parts = []
    for i in range(k):
        if parts and data.draw(st.booleans()):  # rows equal to another input's: cancel, or add up
            t, w = parts[data.draw(st.integers(0, len(parts) - 1))]
            keep = data.draw(st.lists(st.booleans(), min_size=t.num_rows, max_size=t.num_rows))
            idx = np.flatnonzero(np.array(keep, dtype=bool))
            f = data.draw(st.sampled_from([-1, 1, 2]))
            parts.append((t.take(pa.array(idx, pa.int64())), [f * int(w[j]) for j in idx]))
        else:
            parts.append(data.draw(zsets(schema=schema, max_rows=max_rows)))
    zs = [dbsp.ZSet.from_arrow(t, weights=w) for t, w in parts]
    ix = [z.index_by(key) for z in zs]
    ix = [x for x in ix if len(x)]
    if len(ix) < 2:
        return
    for x in ix:
        if data.draw(st.booleans()):
            x._row_hashes()  # inputs that keep their row hashes and inputs that do not, mixed
    keep = data.draw(st.booleans())
    m = merge_cursor(ix[0], *ix[1:], row_hashes=keep)
    assert m.inputs == len(ix) and m.remaining == sum(len(x) for x in ix)
    while not m.done:
        assert m.step(data.draw(st.integers(1, 13))) >= 1
    got = merged(ix[0], m)
    model: dict = {}
    for t, w in parts:
        model = add_models(model, model_of(t, w))
    assert canon_dict(got.zset.to_dict()) == model
    _same(got, dbsp.ZSet.concat(zs).index_by(key))
    pair = ix[0]
    for x in ix[1:]:
        pair = pair.merge(x)
    _same(got, pair)
    if keep and len(got):
        assert np.array_equal(got._row_hashes(), _zset.hash_columns(got.zset.data, list(range(len(schema)))))


@given(st.data())
def test_k_way_merge_where_every_key_hash_is_the_largest(data):
    """Inputs whose rows all carry the key hash 2**64 - 1 (given with the batches, each input in row-hash and value
    order, as a whole-row index orders it): every head ties at the largest key hash (the value a search for the least
    one may start from), so each row is picked by row hash and values among the live heads as inputs run out. The
    output is the dict model's sum, consolidated, in row-hash and value order, and row for row the cascade of two-way
    merges."""
    schema = data.draw(schemas(min_cols=2))  # (a key of one column of two or more: not the row, whose hash it is)
    key = list(schema.names[:1])
    k = data.draw(st.integers(2, 11))
    ix, model = [], {}
    for _ in range(k):
        t, w = data.draw(zsets(schema=schema, max_rows=data.draw(st.sampled_from([1, 5, 30]))))
        z = dbsp.ZSet.from_arrow(t, weights=w).consolidate()  # (row hash, value) order
        if not len(z):
            continue
        model = add_models(model, model_of(t, w))
        ix.append(IndexedZSet._make(z, tuple(key), np.full(len(z), 2**64 - 1, np.uint64)))
    if len(ix) < 2:
        return
    m = merge_cursor(ix[0], *ix[1:])
    while not m.done:
        assert m.step(data.draw(st.integers(1, 13))) >= 1
    got = merged(ix[0], m)
    assert canon_dict(got.zset.to_dict()) == model
    # consolidated, in row-hash and value order (every key hash equal); no zero weight
    assert _zset.check_order(got.zset.data, got.zset.weights, None, [])
    pair = ix[0]
    for x in ix[1:]:
        pair = pair.merge(x)
    _same(got, pair)


def test_k_way_merge_checks_its_inputs():
    """Too few inputs, or inputs whose column types differ, are refused with the reason."""
    a = dbsp.ZSet.from_arrow(pa.table({"k": [1, 2]})).index_by(["k"])
    b = dbsp.ZSet.from_arrow(pa.table({"k": ["x"]})).index_by(["k"])
    with pytest.raises(ValueError, match="2 to 64"):
        _zset.MergeCursor([a._view()], [0])
    with pytest.raises(dbsp.SchemaError if hasattr(dbsp, "SchemaError") else Exception, match="different types"):
        _zset.MergeCursor([a._view(), a._view(), b._view()], [0])


@given(st.data())
def test_k_way_merge_overflow_stands_before_the_equal_rows(data):
    """A row held by every input (int64 key and payload, k of 3 to 20 inputs, among other random rows) whose weights'
    running sum in input order leaves int64 at input j: the step raises WeightOverflowError and the cursor stands
    before that row in every input (the merge's tournament of losers, csrc/merge.c design note 4, gives back the
    inputs it had advanced past it), so exactly the rows before it in canonical order (key hash, row hash) were
    consumed."""
    k = data.draw(st.integers(3, 20))
    j = data.draw(st.integers(1, k - 1))  # the input whose weight makes the sum overflow
    # the running sum in input order reaches 2**63 - 1 after input j - 1, and one more at input j leaves int64
    ws = [2**63 - 1 - (j - 1) if x == 0 else 1 for x in range(k)]
    ix = []
    for x in range(k):
        n = data.draw(st.integers(0, 30))
        keys = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        t = pa.table({"k": pa.array([7] + keys, pa.int64()), "v": pa.array([3] + [1000 + x * 100 + i for i in range(n)],
                                                                                    pa.int64())})
        z = dbsp.ZSet.from_arrow(t, weights=[ws[x]] + [1] * n)
        i = z.index_by(["k"])
        i._row_hashes()
        ix.append(i)
    m = merge_cursor(ix[0], *ix[1:], row_hashes=True)
    total = m.remaining
    with pytest.raises(dbsp.WeightOverflowError):
        while not m.done:
            m.step(data.draw(st.integers(1, 40)))
    # every row before (7, 3) in canonical order was consumed, none at or after it
    row = dbsp.ZSet.from_arrow(pa.table({"k": pa.array([7], pa.int64()), "v": pa.array([3], pa.int64())})).index_by(["k"])
    rk, rr = int(row.key_hash[0]), int(row._row_hashes()[0])
    before = sum(int(np.sum((x.key_hash < rk) | ((x.key_hash == rk) & (x._row_hashes() < rr)))) for x in ix)
    assert total - m.remaining == before
