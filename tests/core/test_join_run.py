"""An inner join's step in one C call (operators/join.py invariant 7, csrc/joinrun.h): ``_zset.JoinRun`` builds exactly the
indexed change ``index_by`` builds and the pairs ``Join.pairs`` gathers, and circuits whose joins take it give the
path before it's outputs, DuckDB's and a dict model's over random splits into steps, at several worker counts."""

from __future__ import annotations

import os
import random
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.operators.join import Join
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.plan import _CJoin
from dbsp_core.zset import ZSet

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
BUDGET = bool(os.environ.get("DBSP_MEMORY_LIMIT"))  # a budget spills batches: the join's own step walks them

L = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])
R = pa.schema([("id", pa.int32()), ("x", pa.string()), ("m", pa.float64())])
R64 = pa.schema([("id", pa.int64()), ("x", pa.string()), ("m", pa.float64())])  # one int64 key: the kernel's fast path


def _rows(rng: np.random.Generator, n: int, schema: pa.Schema, nulls: bool) -> pa.Table:
    """n random rows of L or R: few keys (so they meet), nulls in every column when ``nulls``."""
    def mask() -> np.ndarray | None:
        return rng.random(n) < 0.15 if nulls else None
    if schema is L:
        cols = [pa.array(rng.integers(0, 12, n), pa.int64(), mask=mask()),
                pa.array(rng.choice(["a", "b", "cc"], n), pa.string(), mask=mask()),
                pa.array(rng.integers(-5, 5, n), pa.int64(), mask=mask())]
    else:
        t = schema.field(0).type
        cols = [pa.array(rng.integers(0, 12, n).astype(t.to_pandas_dtype()), t, mask=mask()),
                pa.array(rng.choice(["a", "b", "cc"], n), pa.string(), mask=mask()),
                pa.array(rng.integers(0, 4, n) * 0.5, pa.float64(), mask=mask())]
    return pa.Table.from_arrays(cols, schema=schema)


def _multiset(z: ZSet) -> dict:
    out: dict = {}
    for r, w in zip(zip(*(c.to_pylist() for c in z.data.columns)), z.weights.tolist()):
        out[r] = out.get(r, 0) + w
    return {r: w for r, w in out.items() if w}


@pytest.mark.parametrize("keys,R", [((["k"], ["id"]), R), ((["k", "s"], ["id", "x"]), R), ((["k"], ["id"]), R64)])
@pytest.mark.parametrize("nulls", [False, True])
@pytest.mark.parametrize("change_left", [True, False])
def test_join_run_equals_index_by_and_pairs(keys, R, nulls, change_left):
    """Against index_by and Join.pairs, for a change on either side, keys of one or two columns (int64 against
    int32 or int64, a string), nulls in keys (never matching) and values, weights of both signs, equal rows in the change
    (consolidated away or summed), several batches on the other side (one empty, one without a fence)."""
    rng = np.random.default_rng(SEED)
    op = Join(0, 1, L, R, keys[0], keys[1], False, "join")
    for trial in range(4):
        cs, bs = (L, R) if change_left else (R, L)
        ck, bk = (keys[0], keys[1]) if change_left else (keys[1], keys[0])
        n = int(rng.integers(1, 300))
        change = _rows(rng, n, cs, nulls)
        change = pa.concat_tables([change, change.slice(0, n // 3)])  # equal rows
        cw = rng.choice([1, 2, -1, -3], change.num_rows).astype(np.int64)
        if trial == 3:  # every row cancelled
            change = pa.concat_tables([change, change])
            cw = np.concatenate([cw, -cw])
        z = ZSet.from_arrow(change, cw)
        batches = [ZSet.from_arrow(_rows(rng, m, bs, nulls), rng.choice([1, -2, 3], m).astype(np.int64)).index_by(bk)
                   for m in (int(rng.integers(1, 500)), 0, 5000)]
        lcols = [0, 2] if trial == 1 else None  # the fused group-by's selections
        rcols = [2] if trial == 1 else [1, 2] if keys[1] == ["id", "x"] else [0, 1, 2]
        schema = (pa.schema([L.field(0), L.field(2), R.field(2)]) if trial == 1 else
                  pa.schema(list(L) + [R.field(i) for i in rcols]))
        run = _zset.JoinRun([cs.get_field_index(k) for k in ck], [bs.get_field_index(k) for k in bk], change_left,
                            lcols, rcols, cs, schema)
        got = run.step(z.data, z.weights, [b._view() for b in batches])
        assert run.steps == 1
        ix = z.index_by(ck)
        if len(ix) == 0:
            assert got is None
            continue
        table, w, kh, rh, parts, view = got
        assert table.equals(ix.zset.data)
        assert w.tolist() == ix.zset.weights.tolist() and kh.tolist() == ix.key_hash.tolist()
        assert rh.tolist() == ix._row_hashes().tolist()
        want = {}
        for k, b in enumerate(batches):
            left, right = (ix, b) if change_left else (b, ix)
            p = op.pairs(left, right, (lcols or list(range(len(L))), rcols, schema))
            if p.num_rows:
                want[k] = _multiset(p)
        assert {k: _multiset(ZSet._make(t, pw)) for k, t, pw in parts} == want


@pytest.mark.parametrize("hold", [0, 8])
@pytest.mark.parametrize("keys", [["k"], ["k", "s"], ["s"]])
def test_the_returned_view_serves_the_trace_merges(keys, hold):
    """joinrun.h invariant 5: the BatchView JoinRun.step returns reads the indexed change it returns (every row and
    value, nulls and strings, by a take through it), and a trace whose batches keep those views as their own
    (operators/join.py ``insert_indexed``) merges them, two at a time or held eight at a time (levels.py invariant
    18), to the dict model's sum of every change."""
    rng = np.random.default_rng(SEED)
    from dbsp_core.operators.join import insert_indexed
    from dbsp_core.trace import Trace
    ck = [L.get_field_index(k) for k in keys]
    run = _zset.JoinRun(ck, ck, True, None, None, L, L)
    tr = Trace(L, tuple(keys))
    tr.hold_unread = hold
    model: dict = {}
    for step in range(40):
        change = _rows(rng, int(rng.integers(1, 300)), L, nulls=True)
        w = rng.choice([1, 1, 2, -1], change.num_rows).astype(np.int64)
        have = [r for r, x in model.items() if x > 0]
        if have and step % 3:  # deletions of rows there now
            gone = [have[i] for i in rng.choice(len(have), min(len(have), 20), replace=False)]
            change = pa.concat_tables([change, pa.Table.from_pylist([dict(zip(L.names, r)) for r in gone], schema=L)])
            w = np.concatenate([w, -np.ones(len(gone), dtype=np.int64)])
        z = ZSet.from_arrow(change, w)
        for r, x in _multiset(z).items():
            model[r] = model.get(r, 0) + x
        got = run.step(z.data, z.weights, [])
        if got is None:
            continue
        table, cw, kh, rh, parts, view = got
        assert parts == [] and view.num_rows == table.num_rows
        assert _zset.take(view, np.arange(table.num_rows)).equals(table)
        ix = insert_indexed(tr, table, cw, kh, rh, view)
        assert ix._view() is view
    tr.check()
    assert _multiset(tr.consolidated().zset) == {r: x for r, x in model.items() if x}


def _model(t_rows: dict, u_rows: dict, one_key: bool) -> dict:
    out: dict = {}
    for (k, s, v), wt in t_rows.items():
        for (i, x, m), wu in u_rows.items():
            if k is not None and i is not None and k == i and (one_key or (s is not None and s == x)):
                r = (k, s, v, i, x, m)
                out[r] = out.get(r, 0) + wt * wu
    return {r: w for r, w in out.items() if w}


def random_steps(rng: np.random.Generator, sides: list, schemas: dict, most: int, dels: int, model: Any) -> list:
    """Steps of random pushes, each step changing the inputs its letters of ``sides`` name ("tu": both): up to ``most``
    rows of ``schemas[name]`` with nulls (:func:`_rows`, weights 1 or 2) and, often, up to ``dels`` deletions of rows
    there now; each step as ``(pushes, model(t, u))`` with pushes ``(name, table, weights)`` and the inputs' rows so
    far as {row: weight}."""
    rows: dict = {name: {} for name in schemas}
    steps = []
    for which in sides:
        pushes = []
        for name in which:
            schema = schemas[name]
            table = _rows(rng, int(rng.integers(1, most)), schema, nulls=True)
            w = rng.choice([1, 1, 2], table.num_rows)
            have = [r for r, x in rows[name].items() if x > 0]
            if have and rng.random() < 0.7:  # deletions of rows there now
                gone = [have[i] for i in rng.choice(len(have), min(len(have), dels), replace=False)]
                table = pa.concat_tables([table, pa.Table.from_pylist([dict(zip(schema.names, r)) for r in gone],
                                                                      schema=schema)])
                w = np.concatenate([w, -np.ones(len(gone), dtype=np.int64)])
            for r, x in zip(zip(*(c.to_pylist() for c in table.columns)), w.tolist()):
                rows[name][r] = rows[name].get(r, 0) + x
            pushes.append((name, table, w))
        steps.append((pushes, model(rows["t"], rows["u"])))
    return steps


def check_views(steps: list, got: list, before: list, id_type: str, sql: str) -> None:
    """Each step's output (``got``) equals the path before's (``before``), and the view integrated over the steps
    equals the model's (:func:`random_steps`) and DuckDB's ``sql`` over tables t and u (``u.id`` of ``id_type``)
    holding the pushes so far with their weights in a last column ``w`` (its rows: the view's columns, then the
    weight)."""
    view: dict = {}
    con = duckdb.connect()
    con.execute(f"CREATE TABLE t (k BIGINT, s VARCHAR, v BIGINT, w BIGINT); "
                f"CREATE TABLE u (id {id_type}, x VARCHAR, m DOUBLE, w BIGINT)")
    for i, ((pushes, model), out, ref) in enumerate(zip(steps, got, before)):
        assert out == ref, f"step {i}"
        for r, w in out.items():
            view[r] = view.get(r, 0) + w
        view = {r: w for r, w in view.items() if w}
        assert view == model, f"step {i}"
        for name, table, w in pushes:
            con.register("chg", table.append_column("w", pa.array(w, pa.int64())))
            con.execute(f"INSERT INTO {name} SELECT * FROM chg")
            con.unregister("chg")
        want = con.execute(sql).fetchall()
        assert view == {tuple(r[:6]): r[6] for r in want}, f"step {i}"


def _run(steps: list, workers: int, c_step: bool, one_key: bool) -> tuple[list[dict], int]:
    """Every step's view of ``t JOIN u ON k = id AND s = x`` (``one_key``: ``ON k = id``, two int64 columns) as
    {row: weight}, and the steps the C path served."""
    c = dbsp.Circuit()
    t, u = c.input("t", L), c.input("u", R64 if one_key else R)
    on = (["k"], ["id"]) if one_key else (["k", "s"], ["id", "x"])
    c.output("j", t.join(u, left_on=on[0], right_on=on[1]))
    return run_views(c, steps, workers, _CJoin, c_step,
                     lambda p: sum(wk.plan.counts["cjoin"] for wk in p.executor._workers))


def run_views(c: dbsp.Circuit, steps: list, workers: int, owner: Any, c_step: bool, served: Any
              ) -> tuple[list[dict], int]:
    """Every step's output ``j`` of ``c`` over ``steps`` (lists of pushes) as {row: weight}, with ``owner.C_STEP`` set
    to ``c_step`` meanwhile, and ``served(pipeline)`` after the last step."""
    old = owner.C_STEP
    owner.C_STEP = c_step
    try:
        outs = []
        with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor()) as p:
            for pushes in steps:
                for name, table, w in pushes:
                    p.push(name, ZSet.from_arrow(table, np.asarray(w, dtype=np.int64)))
                outs.append(p.step()["j"].to_dict())
            return outs, served(p)
    finally:
        owner.C_STEP = old


@settings(max_examples=examples(12), deadline=None)
@given(st.integers(0, 2**31 - 1), st.lists(st.sampled_from(["t", "u", "tu", ""]), min_size=1, max_size=7),
       st.sampled_from([1, 2, 3]), st.booleans())
def test_join_steps_in_c_equal_the_path_before_duckdb_and_a_model(seed, sides, workers, one_key):
    """Random steps that change the left side, the right side, both or neither (deletions of rows there now,
    nulls in keys), split at random: the view after every step equals the path before the C step's, DuckDB's
    recompute and the dict model's; at W = 1 the C path served every step (at W > 1 the join reads its fused
    exchanges' runs)."""
    steps = random_steps(np.random.default_rng(seed), sides, {"t": L, "u": R64 if one_key else R}, 60, 5,
                         lambda t, u: _model(t, u, one_key))
    got, served = _run([p for p, _ in steps], workers, True, one_key)
    before, none = _run([p for p, _ in steps], workers, False, one_key)
    assert none == 0
    check_views(steps, got, before, "BIGINT" if one_key else "INTEGER",
                f"SELECT k, s, v, id, x, m, sum(t.w * u.w) FROM t JOIN u ON k = id "
                f"{'' if one_key else 'AND s = x'} GROUP BY ALL HAVING sum(t.w * u.w) != 0")
    # without a budget (DBSP_MEMORY_LIMIT: its spilled batches send steps to the join's own step)
    assert served == (len(steps) if workers == 1 else 0) or (BUDGET and served <= len(steps))
