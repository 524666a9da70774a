"""Indexing by a key of few values (long runs of one key hash): csrc/group.c rec_sort_run (a counting pass on the row
hash inside a bucket of one key hash) and csrc/zset.c consolidate_small's srec_sort_run for batches of at most
DBSP_SMALL_ROWS rows. The result must be the canonical order (key hash, row hash, value; rows.h invariant 2) with
equal rows summed, as a dict model sums them, whatever path sorted it.

Seeds vary per run and are printed (replay: DBSP_TEST_SEED=...).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import _zset
from dbsp_core.zset import ZSet

SEED = int(os.environ.get("DBSP_TEST_SEED", np.random.SeedSequence().entropy % 2**32))


@pytest.fixture
def rng() -> np.random.Generator:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    return np.random.default_rng(SEED)


def _table(rng: np.random.Generator, n: int, keys: int) -> tuple[pa.Table, np.ndarray]:
    """n rows of (category, price, note) over `keys` categories (a string key, as the demo's), prices from a small
    range (equal rows to sum), a nullable string, weights of both signs (some rows cancel)."""
    cats = np.array([f"cat-{i:02d}" for i in range(keys)])
    note = rng.choice(["", "a", "bb"], n).astype(object)
    note[rng.random(n) < 0.1] = None
    t = pa.table({"category": pa.array(cats[rng.integers(0, keys, n)]),
                  "price": pa.array(rng.integers(1, 200, n), pa.int64()),
                  "note": pa.array(list(note), pa.utf8())})
    return t, rng.choice([-1, 1, 1, 2], n).astype(np.int64)


def _counter(t: pa.Table, w: np.ndarray) -> Counter:
    out: Counter = Counter()
    for row, x in zip(zip(*(c.to_pylist() for c in t.columns)), w.tolist()):
        out[row] += x
    return Counter({r: x for r, x in out.items() if x})


# n: consolidate_small (<= 4096 rows: 100, 3000) and the grouping engine (5000, 40000, whose partitions hold runs
# of one key of hundreds to thousands of rows); keys: one run, a few runs, the demo's 20 categories
@pytest.mark.parametrize("n", [100, 3000, 5000, 40000])
@pytest.mark.parametrize("keys", [1, 3, 20])
def test_index_by_few_keys_is_canonical(rng: np.random.Generator, n: int, keys: int) -> None:
    t, w = _table(rng, n, keys)
    ix = ZSet._make(t, w).index_by(["category"])
    z = ix.zset
    assert _zset.check_order(z.data, z.weights, ix.key_hash, [0]), "rows not in canonical order"
    assert np.array_equal(ix.key_hash, _zset.hash_columns(z.data, [0]))
    assert _counter(z.data, z.weights) == _counter(t, w)
    assert len(ix) == len(_counter(t, w)), "equal rows not summed into one"
    # the row hashes come with the batch from either path (small: its sort keys; grouping engine: its identity
    # hashes, group.h dbsp_group_ih), equal to hashing its rows: trace merges order meeting keys by them
    assert ix._rh is not None and np.array_equal(ix._rh, _zset.hash_columns(z.data, [0, 1, 2]))
    # the same rows as a whole-row index (no key), which sorts by row hash alone: one canonical content
    whole = ZSet._make(t, w).consolidate()
    assert _counter(whole.data, whole.weights) == _counter(z.data, z.weights)


@pytest.mark.parametrize("n", [70, 3000, 20000])
def test_grouping_by_few_keys_is_canonical(rng: np.random.Generator, n: int) -> None:
    """The grouping kernel by a key of few values over the identity of (category, price): the consolidate path that
    index_by takes for every size, called directly with and without the row hashes kept."""
    t, w = _table(rng, n, 4)
    t = t.select(["category", "price"])
    for row_hashes in (False, True):
        res = _zset.consolidate(t, w, [0], row_hashes)
        idx, cw, kh = res[0], res[1], res[2]
        got = t.take(pa.array(idx))
        assert _zset.check_order(got, cw, kh, [0]), (n, row_hashes)
        assert _counter(got, cw) == _counter(t, w)
        if row_hashes:
            assert res[3] is not None, "no row hashes handed over"
            assert np.array_equal(res[3], _zset.hash_columns(got, [0, 1]))


@pytest.mark.parametrize("n", [10, 5000, 60000])
def test_row_hashes_of_a_consolidation_that_shrinks(rng: np.random.Generator, n: int) -> None:
    """Most rows cancel (each inserted and retracted, a few kept): the row hashes handed over are the kept rows',
    one each (the grouping engine gives back the unused tail of its array), and a one-integer-column batch, which
    the engine groups without hashing its identity, hands none over."""
    keys = rng.integers(0, 50, n)
    vals = rng.integers(0, 10**6, n)
    t = pa.table({"k": pa.array(np.concatenate([keys, keys]), pa.int64()),
                  "v": pa.array(np.concatenate([vals, vals]), pa.int64())})
    w = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    w[rng.integers(0, n, max(1, n // 100))] = 2  # these rows survive (weight 2 - 1)
    idx, cw, kh, rh = _zset.consolidate(t, w, [0], True)
    got = t.take(pa.array(idx))
    assert _zset.check_order(got, cw, kh, [0])
    assert _counter(got, cw) == _counter(t, w)
    assert rh is not None and np.array_equal(rh, _zset.hash_columns(got, [0, 1]))
    one = t.select(["v"])
    idx1, cw1, kh1, rh1 = _zset.consolidate(one, w, [0], True)
    got1 = one.take(pa.array(idx1))
    assert _counter(got1, cw1) == _counter(one, w)
    if rh1 is not None:  # the small path (<= 4096 rows) sorts by row hash and hands them over
        assert np.array_equal(rh1, _zset.hash_columns(got1, [0]))


# a key of every column: in their order (a distinct's index) consolidate_small reuses the row hash as the key hash
# (csrc/zset.c); in another order the key hashes differ from the row hashes and must be computed
@pytest.mark.parametrize("n", [100, 3000, 5000])
@pytest.mark.parametrize("order", [("category", "price", "note"), ("price", "note", "category")])
def test_index_by_every_column_hashes_its_key(rng: np.random.Generator, n: int, order: tuple[str, ...]) -> None:
    t, w = _table(rng, n, 20)
    ix = ZSet._make(t, w).index_by(list(order))
    z = ix.zset
    pos = [t.schema.get_field_index(c) for c in order]
    assert np.array_equal(ix.key_hash, _zset.hash_columns(z.data, pos))
    assert _zset.check_order(z.data, z.weights, ix.key_hash, pos), "rows not in canonical order"
    assert ix._rh is not None and np.array_equal(ix._rh, _zset.hash_columns(z.data, [0, 1, 2]))
    assert _counter(z.data, z.weights) == _counter(t, w)
