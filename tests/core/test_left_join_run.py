"""A left join's step in one C call (operators/left_join.py invariant 5, csrc/joinrun.h invariant 4): ``JoinRun`` with a
pad gives the padded rows a dict model gives, and circuits whose left joins take it give the path before it's outputs,
DuckDB's and a dict model's over random splits into steps that change the left side, the right side or both, at
several worker counts; a failed step (a weight overflow) leaves the state as it was."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples
from test_join_run import L, R, R64, _multiset, _rows, check_views, random_steps, run_views

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.errors import StepError
from dbsp_core.operators.join import Join
from dbsp_core.operators.left_join import _LeftJoinState
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.zset import ZSet

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
BUDGET = bool(os.environ.get("DBSP_MEMORY_LIMIT"))  # a budget spills batches: the join's own step walks them


def _nulls(schema: pa.Schema) -> pa.Table:
    return pa.Table.from_arrays([pa.nulls(1, f.type) for f in schema], schema=schema)


@pytest.mark.parametrize("keys,R", [((["k"], ["id"]), R), ((["k", "s"], ["id", "x"]), R), ((["k"], ["id"]), R64)])
@pytest.mark.parametrize("nulls", [False, True])
def test_padded_part_is_the_rows_whose_right_weights_sum_to_at_most_zero(keys, R, nulls):
    """The pad's part against a model: the indexed change's rows whose key (never a null one) has right rows, over every
    batch, whose weights sum to more than 0 are left out, the others come with their weights and null right columns;
    right weights of both signs (a key's rows across batches cancelling), equal rows in the change; the inner parts
    are those of the call without a pad."""
    rng = np.random.default_rng(SEED)
    rcols = [1, 2] if keys[1] == ["id", "x"] else [0, 1, 2]
    schema = pa.schema(list(L) + [R.field(i) for i in rcols])
    op = Join(0, 1, L, R, keys[0], keys[1], False, "join")
    lk, rk = [L.get_field_index(k) for k in keys[0]], [R.get_field_index(k) for k in keys[1]]
    for trial in range(4):
        n = int(rng.integers(1, 300))
        change = _rows(rng, n, L, nulls)
        change = pa.concat_tables([change, change.slice(0, n // 3)])
        z = ZSet.from_arrow(change, rng.choice([1, 2, -1], change.num_rows).astype(np.int64))
        batches = [ZSet.from_arrow(_rows(rng, m, R, nulls), rng.choice([1, -1, 2], m).astype(np.int64))
                   .index_by(keys[1]) for m in (int(rng.integers(1, 60)), 0, int(rng.integers(1, 60)))]
        if trial == 3:  # every right row cancelled by the next batch: every key's sum is 0
            b = ZSet.from_arrow(_rows(rng, 40, R, nulls), np.ones(40, dtype=np.int64)).index_by(keys[1])
            batches = [b, ZSet._make(b.zset.data, -b.zset.weights).index_by(keys[1])]
        views = [b._view() for b in batches]
        padded = _zset.JoinRun(lk, rk, True, None, rcols, L, schema, _nulls(R)).step(z.data, z.weights, views)
        plain = _zset.JoinRun(lk, rk, True, None, rcols, L, schema).step(z.data, z.weights, views)
        ix = z.index_by(keys[0])
        if len(ix) == 0:
            assert padded is None and plain is None
            continue
        right: dict = {}
        for b in batches:
            for r, w in zip(b.zset.data.select(keys[1]).to_pylist(), b.zset.weights.tolist()):
                k = tuple(r.values())
                right[k] = right.get(k, 0) + w
        want: dict = {}
        for r, w in zip(ix.zset.data.to_pylist(), ix.zset.weights.tolist()):
            k = tuple(r[c] for c in keys[0])
            if any(v is None for v in k) or right.get(k, 0) <= 0:
                row = tuple(r.values()) + (None,) * len(rcols)
                want[row] = want.get(row, 0) + w
        nb = len(batches)
        got = [(k, t, w) for k, t, w in padded[4] if k == nb]
        assert _multiset(ZSet._make(got[0][1], got[0][2])) == want if want else not got
        inner = {k: _multiset(ZSet._make(t, w)) for k, t, w in padded[4] if k < nb}
        assert inner == {k: _multiset(ZSet._make(t, w)) for k, t, w in plain[4]}
        for k, b in enumerate(batches):  # and those are Join.pairs'
            p = op.pairs(ix, b, (list(range(len(L))), rcols, schema))
            assert inner.get(k, {}) == (_multiset(p) if p.num_rows else {})


def test_a_pad_is_refused_on_the_right_side() -> None:
    with pytest.raises(ValueError, match="pad"):
        _zset.JoinRun([0], [0], False, None, [0, 1, 2], R64, pa.schema(list(L) + list(R64)), _nulls(L))


def _model(t_rows: dict, u_rows: dict) -> dict:
    """t LEFT JOIN u ON k = id over {row: weight} (a key has u rows when their weights sum to more than 0)."""
    out: dict = {}
    count: dict = {}
    for (i, x, m), wu in u_rows.items():
        count[i] = count.get(i, 0) + wu
    for (k, s, v), wt in t_rows.items():
        for (i, x, m), wu in u_rows.items():
            if k is not None and k == i:
                r = (k, s, v, i, x, m)
                out[r] = out.get(r, 0) + wt * wu
        matched = k is not None and count.get(k, 0) > 0
        if not matched:
            r = (k, s, v, None, None, None)
            out[r] = out.get(r, 0) + wt
    return {r: w for r, w in out.items() if w}


def _states(p: dbsp.Pipeline) -> list:
    return [s for wk in p.executor._workers for s in wk.instances.values() if type(s) is _LeftJoinState]


def _run(steps: list, workers: int, c_step: bool) -> tuple[list[dict], int]:
    """Every step's view of ``t LEFT JOIN u ON k = id`` as {row: weight}, and the steps the C path served."""
    c = dbsp.Circuit()
    t, u = c.input("t", L), c.input("u", R64)
    c.output("j", t.left_join(u, left_on="k", right_on="id"))
    return run_views(c, steps, workers, _LeftJoinState, c_step, lambda p: sum(s.c_steps for s in _states(p)))


@settings(max_examples=examples(12), deadline=None)
@given(st.integers(0, 2**31 - 1), st.lists(st.sampled_from(["t", "u", "tu", "t", ""]), min_size=1, max_size=8),
       st.sampled_from([1, 2, 3]))
def test_left_join_steps_in_c_equal_the_path_before_duckdb_and_a_model(seed, sides, workers):
    """Random steps that change the left side, the right side, both or neither (deletions of rows there now, so a
    key's right side empties and fills again; nulls in keys and values), split at random: the view after every step
    equals the path before the C step's, DuckDB's recompute and the dict model's; the C path served every step that
    changed only the left side at a worker (at least one when such a step had rows)."""
    steps = random_steps(np.random.default_rng(seed), sides, {"t": L, "u": R64}, 40, 8, _model)
    got, served = _run([p for p, _ in steps], workers, True)
    before, none = _run([p for p, _ in steps], workers, False)
    assert none == 0
    check_views(steps, got, before, "BIGINT",
                "WITH rc AS (SELECT id, sum(w) AS n FROM u WHERE id IS NOT NULL GROUP BY id), "
                "v AS (SELECT k, s, v, id, x, m, t.w * u.w AS w FROM t JOIN u ON k = id "
                "UNION ALL SELECT k, s, v, NULL, NULL, NULL, t.w FROM t LEFT JOIN rc ON k = rc.id "
                "WHERE rc.n IS NULL OR rc.n <= 0) "
                "SELECT k, s, v, id, x, m, sum(w) FROM v GROUP BY ALL HAVING sum(w) != 0")
    left_only = sum(1 for pushes, _ in steps if [n for n, _, _ in pushes] == ["t"])
    if workers == 1 and not BUDGET:
        assert served == left_only
    elif left_only and not BUDGET:
        assert served > 0  # (at W > 1 a worker whose share of the left change is empty takes no step)


def test_an_overflowing_step_fails_and_leaves_the_state(monkeypatch) -> None:
    """A left-only step whose output weight overflows int64 fails in the C call (the path before is not run) as a
    StepError, and the pipeline's rollback leaves the state so that the next step, served by the C call too, gives
    the view before the failed step plus that step's change."""
    if BUDGET:
        pytest.skip("under a memory budget the right batches are spilled: the path before the C call serves the steps")
    c = dbsp.Circuit()
    t, u = c.input("t", L), c.input("u", R64)
    c.output("j", t.left_join(u, left_on="k", right_on="id"), materialized=True)
    with dbsp.Pipeline(c, workers=1, executor=EmbeddedExecutor()) as p:
        p.push("t", pa.table({"k": [1, 2], "s": ["a", "b"], "v": [1, 2]}, schema=L))
        p.push("u", pa.table({"id": [1], "x": ["x"], "m": [0.5]}, schema=R64), weights=[2**62])
        p.step()

        def before(*args: object) -> None:
            raise AssertionError("the path before the C call ran")
        monkeypatch.setattr(_LeftJoinState, "parts", before)
        p.push("t", pa.table({"k": [1], "s": ["c"], "v": [3]}, schema=L), weights=[4])
        with pytest.raises(StepError, match="overflow") as e:
            p.step()
        p.discard(*e.value.inputs[0][1:])  # the bad push dropped: the step runs again without it
        assert p.step()["j"].to_dict() == {}
        p.push("t", pa.table({"k": [2, 3], "s": ["d", "e"], "v": [4, 5]}, schema=L))
        out = p.step()["j"].to_dict()
        assert out == {(2, "d", 4, None, None, None): 1, (3, "e", 5, None, None, None): 1}
        assert sum(s.c_steps for s in _states(p)) >= 1
        got = p.view("j", weights=True).to_pylist()
        assert {tuple(r.values())[:6]: r["weight"] for r in got} == {
            (1, "a", 1, 1, "x", 0.5): 2**62, (2, "b", 2, None, None, None): 1, (2, "d", 4, None, None, None): 1,
            (3, "e", 5, None, None, None): 1}


def test_a_padded_row_equal_to_an_inner_row_is_summed_with_it() -> None:
    """``on=`` drops the right key, so a left row whose key's one right row (null in every other column) has weight -1
    pads to the same row as its pair with that right row: the output sums them (the C call's pad_met keeps the output
    from being flagged distinct), as the path before does."""
    A = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    B = pa.schema([("k", pa.int64()), ("y", pa.string())])
    outs = []
    for c_step in (True, False):
        c = dbsp.Circuit()
        a, b = c.input("a", A), c.input("b", B)
        c.output("j", a.left_join(b, on="k"))
        old = _LeftJoinState.C_STEP
        _LeftJoinState.C_STEP = c_step
        try:
            with dbsp.Pipeline(c, workers=1, executor=EmbeddedExecutor()) as p:
                p.push("b", pa.table({"k": [1], "y": [None]}, schema=B), weights=[-1])
                p.step()
                p.push("a", pa.table({"k": [1, 2], "v": [7, 8]}, schema=A))
                out = p.step()["j"]
                outs.append((out.to_dict(), out.consolidate().to_dict(), sum(s.c_steps for s in _states(p))))
        finally:
            _LeftJoinState.C_STEP = old
    # (1, 7, None) pairs with weight -1 and pads with weight +1 (its key's right weights sum to -1): they cancel
    assert outs[0][:2] == outs[1][:2] == ({(2, 8, None): 1}, {(2, 8, None): 1})
    assert outs[0][2] == (0 if BUDGET else 1) and outs[1][2] == 0  # (a budget spills the batches: the path before)
