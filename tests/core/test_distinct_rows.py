"""The distinct check of a step's output in one C pass (csrc/zset.c design notes 4 and 5: ``_zset.hash_distinct``, rows hashed and probed a block at a time; ``_zset.distinct_rows``, the probe's own hash, no row hashes kept) against a dict model, and a pass-through pipeline, whose output a bag of equal rows makes not distinct, against a dict model over random steps (pushes in several parts, deletions, a poisoned step rolled back) at W = 1 and 2 and in pieces under a budget."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples
from test_run_alone import poisoned
from zset_model import POOLS, canon_dict, canon_row, model_of

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.errors import StepError
from dbsp_core.zset import ZSet

# every type class the probe hashes its own way or by the value hash (zset.c design note 5)
TYPES = [pa.int64(), pa.int32(), pa.date32(), pa.uint64(), pa.timestamp("us"), pa.int8(), pa.bool_(), pa.float64(),
         pa.string(), pa.binary()]
BLOCK = 512  # csrc/zset.c DISTINCT_BLOCK: rows hashed, then probed, at a time


def _table(rng: np.random.Generator, types: list, n: int, nulls: bool, pad: int) -> pa.Table:
    """``n`` rows drawn from small pools (rows repeat, far apart too), viewed at offset ``pad`` of a bigger table."""
    cols = []
    for t in types:
        pool = POOLS[t] + ([None] if nulls else [])
        cols.append(pa.array([pool[i] for i in rng.integers(0, len(pool), n + pad)], type=t))
    schema = pa.schema([(f"c{i}", t) for i, t in enumerate(types)])
    return pa.Table.from_arrays(cols, schema=schema).slice(pad, n)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3), st.sampled_from([0, 1, 7, BLOCK - 1, BLOCK,
       BLOCK + 1, 3 * BLOCK + 17]), st.booleans(), st.integers(0, 5), st.integers(0, 2**31))
def test_both_kernels_are_the_model(types: list, n: int, nulls: bool, pad: int, seed: int) -> None:
    """Over tables of every hashed type (nulls, -0.0 and NaN, strings), offsets, and more rows than a block (equal
    rows in different blocks): the kept rows and summed weights are the model's, each set of equal rows kept at its
    first row, in row order; None exactly when no two rows are equal and no weight is 0; hash_distinct's row hashes
    are hash_columns's."""
    rng = np.random.default_rng(seed)
    t = _table(rng, types, n, nulls, pad)
    w = rng.integers(-2, 3, n).astype(np.int64)
    model = model_of(t, w)
    rows = [canon_row(r) for r in zip(*[c.to_pylist() for c in t.columns])]
    nothing = len(model) == n and 0 not in w.tolist() and len(set(rows)) == n
    rh, kept_h = _zset.hash_distinct(t, w)
    assert np.array_equal(rh, _zset.hash_columns(t, list(range(t.num_columns))))
    for kept in (kept_h, _zset.distinct_rows(t, w)):
        assert (kept is None) == nothing
        idx, kw = (np.arange(n), w) if kept is None else kept
        got = {rows[i]: x for i, x in zip(idx.tolist(), kw.tolist())}
        assert got == model and len(idx) == len(model)
        assert idx.tolist() == sorted(idx.tolist()) and all(rows.index(rows[i]) == i for i in idx.tolist())


def test_every_row_one_probe_hash_still_tells_rows_apart() -> None:
    """Rows whose probe hashes meet (int64 columns whose xor-multiply folds collide: (a, b) and (a', b') with
    (s ^ a)K ^ b == (s ^ a')K ^ b') are told apart by the row comparison."""
    K = 0x9E3779B97F4A7C15
    seed = 0x082EFA98EC4E6C89
    m = (1 << 64) - 1
    a = np.arange(2000, dtype=np.uint64)
    b = np.array([(((seed ^ int(x)) * K) & m) ^ 12345 for x in a], dtype=np.uint64)  # every row's fold: 12345 * K
    t = pa.table({"a": a.astype(np.int64), "b": b.view(np.int64)})
    t = pa.concat_tables([t, t.slice(0, 700)]).combine_chunks()  # 700 rows twice
    w = np.ones(t.num_rows, dtype=np.int64)
    kept = _zset.distinct_rows(t, w)
    assert kept is not None
    idx, kw = kept
    assert idx.tolist() == list(range(2000)) and kw.tolist() == [2] * 700 + [1] * 1300


def test_rows_of_one_probe_hash_equal_in_a_column_are_told_apart() -> None:
    """csrc/zset.c design note 7's comparison goes past a column the rows share: rows (7, b, c) whose folds all meet
    ((s ^ 7)K ^ b)K ^ c == 99) differ in b and c only, every row's probe hash is the same, and none is merged with
    another; the same rows again are."""
    K, seed, m = 0x9E3779B97F4A7C15, 0x082EFA98EC4E6C89, (1 << 64) - 1
    b = np.arange(1500, dtype=np.uint64)
    c = np.array([((((seed ^ 7) * K) & m ^ int(x)) * K & m) ^ 99 for x in b], dtype=np.uint64)
    t = pa.table({"a": np.full(1500, 7), "b": b.astype(np.int64), "c": c.view(np.int64)})
    t = pa.concat_tables([t, t.slice(100, 300)]).combine_chunks()
    kept = _zset.distinct_rows(t, np.ones(t.num_rows, dtype=np.int64))
    assert kept is not None
    idx, kw = kept
    assert idx.tolist() == list(range(1500)) and kw.tolist() == [1] * 100 + [2] * 300 + [1] * 1100


@pytest.mark.parametrize("ncols", [1, 3, 8, 9])
@pytest.mark.parametrize("types", [(pa.int64(),), (pa.uint64(), pa.timestamp("us")), (pa.int64(), pa.int32())])
def test_integer_rows_fold_in_registers_and_a_zero_weight_still_drops(ncols: int, types: tuple) -> None:
    """csrc/zset.c design note 6 (8-byte integer columns, up to 8 of them: a row's probe hash folded in registers;
    9 columns, or an int32 among them: a pass per column) and the check without a compaction (no two rows equal):
    distinct rows with no zero weight are kept as they stand (None), one zero weight drops its row, and equal rows
    in different blocks are summed, against the dict model."""
    rng = np.random.default_rng(ncols)
    n = 3 * BLOCK + 5
    ts = [types[i % len(types)] for i in range(ncols)]
    cols = [pa.array(np.arange(n) * (i + 1) + i) for i in range(ncols)]
    t = pa.Table.from_arrays([c.cast(ty) for c, ty in zip(cols, ts)], names=[f"c{i}" for i in range(ncols)])
    w = rng.integers(1, 4, n).astype(np.int64)
    assert _zset.distinct_rows(t, w) is None  # every row its own group, no zero weight
    w0 = w.copy()
    w0[BLOCK + 3] = 0
    idx, kw = _zset.distinct_rows(t, w0)
    assert idx.tolist() == [i for i in range(n) if i != BLOCK + 3] and kw.tolist() == np.delete(w0, BLOCK + 3).tolist()
    t2 = pa.concat_tables([t, t.slice(7, 3)]).combine_chunks()  # rows 7..9 again, in the last block
    w2 = np.concatenate([w, [-1, 5, 1]]).astype(np.int64)
    kept = _zset.distinct_rows(t2, w2)
    rows = [canon_row(r) for r in zip(*[c.to_pylist() for c in t2.columns])]
    idx, kw = kept
    assert {rows[i]: x for i, x in zip(idx.tolist(), kw.tolist())} == model_of(t2, w2)


INT8 = [pa.int64(), pa.uint64(), pa.timestamp("us")]  # the 8-byte integers of csrc/zset.c design notes 6 and 7


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.sampled_from(INT8), min_size=1, max_size=9), st.sampled_from([1, 2, 5, BLOCK + 3, 3000, 17000]),
       st.integers(1, 40), st.integers(0, 3), st.booleans(), st.integers(0, 2**31))
def test_integer_rows_pass_is_the_model(types: list, n: int, pool: int, pad: int, big: bool, seed: int) -> None:
    """csrc/zset.c design note 7 (rows of at most 8 non-null 8-byte integer columns: a pass of their own, rows
    compared from the value pointers, a zero weight noted as its row is placed, the prefetch only past 2^18 bytes of
    table, i.e. past 16,384 rows) against the dict model and against hash_distinct (the row-hash pass, which shares
    none of it): values from a pool of ``pool`` (equal rows near and far, in other blocks), weights that cancel or
    are 0, a view at an offset, 9 columns (back to the general pass); weights near 2^63 whose sum overflows raise
    OverflowError only when a group's total does not fit."""
    rng = np.random.default_rng(seed)
    vals = rng.integers(-2**62, 2**62, pool)
    cols, plain = [], []  # the columns, and their values as int64 (the model's rows: equal exactly when they are)
    for t in types:
        v = vals[rng.integers(0, pool, n + pad)]
        cols.append(pa.array(v.view(np.uint64), type=t) if t == pa.uint64() else pa.array(v).cast(t))
        plain.append(pa.array(v))
    names = [f"c{i}" for i in range(len(types))]
    t = pa.Table.from_arrays(cols, names=names).slice(pad, n)
    ti = pa.Table.from_arrays(plain, names=names).slice(pad, n)
    w = rng.integers(-2, 3, n).astype(np.int64)
    if big:  # totals that overflow int64 (the carry) next to partial sums that do not
        w = np.where(rng.random(n) < 0.5, 2**62 + 7, -(2**62)).astype(np.int64)
    model = model_of(ti, w)
    rows = [canon_row(r) for r in zip(*[c.to_pylist() for c in ti.columns])]
    totals: dict = {}
    for r, x in zip(rows, w.tolist()):
        totals[r] = totals.get(r, 0) + x
    if any(not -2**63 <= x < 2**63 for x in totals.values()):
        for kernel in (lambda: _zset.distinct_rows(t, w), lambda: _zset.hash_distinct(t, w)):
            with pytest.raises(OverflowError):
                kernel()
        return
    kept = _zset.distinct_rows(t, w)
    _, kept_h = _zset.hash_distinct(t, w)
    nothing = len(set(rows)) == n and 0 not in w.tolist()
    assert (kept is None) == nothing == (kept_h is None)
    idx, kw = (np.arange(n), w) if kept is None else kept
    assert {rows[i]: x for i, x in zip(idx.tolist(), kw.tolist())} == model and len(idx) == len(model)
    assert idx.tolist() == sorted(idx.tolist()) and all(rows.index(rows[i]) == i for i in idx.tolist())
    if kept is not None:
        assert idx.tolist() == kept_h[0].tolist() and kw.tolist() == kept_h[1].tolist()


SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("s", pa.string())])


def _circuit() -> dbsp.Circuit:
    """A pass-through, and a node after it that fails on a row with v == 666 (a step that must roll back)."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("pass", t)

    c.output("x", t.filter(pc.field("v") >= 0).flat_map(poisoned, schema=SCHEMA))
    return c


@pytest.mark.parametrize("workers,budget", [(1, None), (2, None), (1, "64MiB"), (1, "pieces")])
@settings(max_examples=examples(15), deadline=None)
@given(steps=st.lists(st.tuples(st.lists(st.integers(0, 900), min_size=1, max_size=4), st.integers(0, 30),
                                st.booleans(), st.integers(0, 2**31)), min_size=1, max_size=6))
def test_a_pass_through_is_the_model(workers: int, budget: str | None, steps: list) -> None:
    """Each step pushes a bag in several parts (rows equal within a part, across parts and across 512-row blocks),
    deletes some rows pushed earlier, and sometimes a poisoned row (the step raises StepError, rolls back, the push is
    discarded, the step runs again): every step's output is the model's sum of its pushes, distinct (no two equal
    rows, no zero weight); on one worker running the step whole it holds no row hashes (the probe's own hash),
    and in pieces (a budget whose pieces hold a few rows each) the pieces' sum is made distinct all the same."""
    limit = None if budget is None else "64MiB"
    p = dbsp.Pipeline(_circuit(), workers=workers, memory_limit=limit)
    if budget == "pieces":
        p.executor.substep_bytes = 4096
    pushed: list[tuple] = []
    big = any(sum(sizes) >= 300 for sizes, _, _, _ in steps)  # a step of pieces of 4 KiB under the budget
    with p:
        for sizes, deletes, poison, seed in steps:
            rng = np.random.default_rng(seed)
            model: dict = {}
            for n in sizes:
                k, v = rng.integers(0, 40, n), rng.integers(0, 3, n)
                s = [None if x == 0 else f"s{x}" for x in rng.integers(0, 3, n)]
                part = pa.table({"k": k, "v": v, "s": s}, schema=SCHEMA)
                w = rng.integers(-1, 3, n).astype(np.int64)
                p.push("t", part, weights=w)
                for r, x in model_of(part, w).items():
                    model[r] = model.get(r, 0) + x
                pushed += [tuple(r) for r in zip(k.tolist(), v.tolist(), s)]
            if deletes and pushed:
                gone = [pushed[i] for i in rng.integers(0, len(pushed), deletes)]
                part = pa.table({"k": [r[0] for r in gone], "v": [r[1] for r in gone], "s": [r[2] for r in gone]},
                                schema=SCHEMA)
                p.push("t", part, weights=np.full(len(gone), -1, dtype=np.int64))
                for r, x in model_of(part, np.full(len(gone), -1)).items():
                    model[r] = model.get(r, 0) + x
            if poison:
                p.push("t", pa.table({"k": [1], "v": [666], "s": ["p"]}, schema=SCHEMA))
                with pytest.raises(StepError, match="poison") as info:
                    p.step()
                p.discard(*info.value.inputs[-1][1:])
            out = p.step()["pass"]
            assert canon_dict(out.to_dict()) == {r: x for r, x in model.items() if x}
            assert out._distinct and 0 not in out.weights.tolist()
            assert ZSet.from_arrow(out.data, out.weights).consolidate().num_rows == out.num_rows
            if workers == 1 and budget is None and out.num_rows:
                assert out._rhash is None  # one worker, the step whole: made distinct without row hashes
        if budget == "pieces" and big:
            assert p.executor.stats["substeps"]["split_steps"] > 0
