"""A join seeks its change's keys in a large batch of the other side through the batch's directory of key hashes
(csrc/lookup.h DbspDir, built at a batch view's first seek: ``BatchView.seek_dir``): the directory's seek equals a search
of the key hashes, and joins whose other sides hold batches past DBSP_DIR_MIN rows (inner on one int64 key and on two
keys, left, and a join then group-by folded into one call) give, after every step of random changes with deletions and
a step rolled back, what the paths before the one-call steps give (they seek through fences) and DuckDB's recompute,
at W = 1, 2, 3 (under ``DBSP_MEMORY_LIMIT`` spilled batches go to the join's own step, and batches read back build a
directory again). DBSP_TEST_SEED replays."""

from __future__ import annotations

import os
import random

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from test_linear_run import add_poison
from test_totals_hold import poisoned_step

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.operators.left_join import _LeftJoinState
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.plan import _CJoin, _JoinFolded
from dbsp_core.zset import ZSet

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
DIR_MIN = 4096  # csrc/lookup.h DBSP_DIR_MIN

T = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])
U = pa.schema([("id", pa.int64()), ("x", pa.string()), ("m", pa.int64())])
KEYS = 3000  # keys of both sides: a few rows each, so the directory's buckets hold several keys and a few runs


def _hashes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n ascending key hashes: spread, clustered (empty buckets around them), runs of one hash, the extremes."""
    parts = [rng.integers(0, 2**64 - 1, n // 2, dtype=np.uint64, endpoint=True),
             (np.uint64(2**63) + rng.integers(0, 2**40, n // 4, dtype=np.uint64)),  # a cluster: one bucket or two
             np.full(n // 8, rng.integers(0, 2**64 - 1, dtype=np.uint64), dtype=np.uint64),  # a long run
             np.array([0, 0, 2**64 - 1, 2**64 - 1], dtype=np.uint64)]
    kh = np.sort(np.concatenate(parts))
    return kh[:n] if len(kh) >= n else np.sort(np.concatenate([kh, np.full(n - len(kh), kh[-1], np.uint64)]))


@pytest.mark.parametrize("n", [DIR_MIN, DIR_MIN + 1, 9001, 70_000])
def test_directory_seek_equals_a_search_of_the_key_hashes(n):
    """dir_seek(h) is the first row whose key hash is >= h (np.searchsorted), for hashes present, absent, between
    buckets, in runs, 0 and 2^64 - 1; the directory costs at most a byte a row."""
    rng = np.random.default_rng(SEED)
    kh = _hashes(rng, n)
    v = _zset.BatchView(pa.table({"a": np.arange(n)}), None, kh)
    want = np.concatenate([kh[::3], kh[::5] + np.uint64(1), kh[::7] - np.uint64(1),
                           rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True),
                           np.array([0, 1, 2**63, 2**64 - 2, 2**64 - 1], dtype=np.uint64)])
    got = np.array([v.dir_seek(int(h)) for h in want])
    assert got.tolist() == np.searchsorted(kh, want, side="left").tolist()
    assert 0 < v.dir_bytes <= n + 4


def test_no_directory_below_its_rows_nor_over_unsorted_hashes():
    """A view under DIR_MIN rows keeps none (its seeks gallop); key hashes out of order are refused."""
    small = _zset.BatchView(pa.table({"a": np.arange(DIR_MIN - 1)}), None, np.arange(DIR_MIN - 1, dtype=np.uint64))
    with pytest.raises(ValueError, match="no directory"):
        small.dir_seek(5)
    assert small.dir_bytes == 0
    kh = np.arange(DIR_MIN, dtype=np.uint64)
    kh[100], kh[101] = kh[101], kh[100]
    with pytest.raises(ValueError, match="not ascending"):
        _zset.BatchView(pa.table({"a": np.arange(DIR_MIN)}), None, kh).dir_seek(5)


def _table(rng: np.random.Generator, n: int, schema: pa.Schema, nulls: bool) -> pa.Table:
    """n random rows of T or U over KEYS keys (with ``nulls``, a few null keys, which never match: a key column
    without nulls on both sides takes the kernel's inline int64 loop), strings of three values."""
    k = pa.array(rng.integers(0, KEYS, n), pa.int64(), mask=rng.random(n) < 0.02 if nulls else None)
    s = pa.array(rng.choice(["a", "b", "cc"], n), pa.string())
    v = pa.array(rng.integers(0, 100, n), pa.int64())
    return pa.Table.from_arrays([k, s, v], schema=schema)


def _steps(rng: np.random.Generator, nsteps: int) -> list:
    """A load of both sides (past DIR_MIN rows each), then steps of up to 300 new rows of t (and of u one step in
    four; null keys one step in three) with deletions of rows there now (weights 1 or 2 in, -1 out)."""
    have: dict = {"t": [], "u": []}
    steps = []
    for i in range(nsteps):
        pushes = []
        for name, schema in (("t", T), ("u", U)):
            if i and name == "u" and i % 4:
                continue
            table = _table(rng, 16_000 if i == 0 else int(rng.integers(1, 300)), schema, i % 3 == 2)
            w = rng.choice([1, 1, 2], table.num_rows).astype(np.int64)
            if i and have[name]:
                rows = have[name]
                gone = [rows[j] for j in rng.choice(len(rows), min(len(rows), 40), replace=False)]
                table = pa.concat_tables([table, pa.Table.from_pylist(gone, schema=schema)])
                w = np.concatenate([w, -np.ones(len(gone), dtype=np.int64)])
                for r in gone:
                    rows.remove(r)
            have[name].extend(r for r, x in zip(table.slice(0, len(w)).to_pylist(), w.tolist()) if x > 0)
            pushes.append((name, table, w))
        steps.append(pushes)
    return steps


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t, u = c.input("t", T), c.input("u", U)
    c.output("j1", t.join(u, left_on="k", right_on="id"))
    c.output("j2", t.join(u, left_on=["k", "s"], right_on=["id", "x"]))
    c.output("lj", t.left_join(u, left_on="k", right_on="id"))
    c.output("jg", t.join(u, left_on="k", right_on="id").group_by("s").agg(n=dbsp.count(), total=dbsp.sum("m")))
    add_poison(c, t, T)
    return c


SQL = {
    "j1": "SELECT k, s, v, id, x, m, sum(t.w * u.w) FROM t JOIN u ON k = id GROUP BY ALL HAVING sum(t.w * u.w) != 0",
    "j2": "SELECT k, s, v, id, x, m, sum(t.w * u.w) FROM t JOIN u ON k = id AND s = x GROUP BY ALL "
          "HAVING sum(t.w * u.w) != 0",
}


DIRS: list[int] = []  # per step of the last _run: directory bytes its traces' batches held (the seeks took them)


def _run(steps: list, workers: int, c_step: bool) -> list[dict]:
    """Every step's outputs as {view: {row: weight}}, with the one-call steps on (``c_step``: through the directories)
    or off (the paths before them: pairs of each batch through its fence); a poisoned step rolled back after step 5."""
    old = _CJoin.C_STEP, _JoinFolded.C_STEP, _LeftJoinState.C_STEP
    _CJoin.C_STEP = _JoinFolded.C_STEP = _LeftJoinState.C_STEP = c_step
    try:
        outs = []
        with dbsp.Pipeline(_circuit(), workers=workers, executor=EmbeddedExecutor()) as p:
            for i, pushes in enumerate(steps):
                if i == 5:
                    poisoned_step(p, [(1, "a", 5), (9, "b", 666)], T)
                for name, table, w in pushes:
                    p.push(name, ZSet.from_arrow(table, w))
                out = p.step()
                outs.append({v: out[v].to_dict() for v in ("j1", "j2", "lj", "jg")})
                if getattr(p.executor, "batch_store", None) is None:  # (under a budget the batches spill: no one-call
                    DIRS.append(sum(b._cv.dir_bytes for t in p.executor._all_traces() for b in t._levels()  # step)
                                    if getattr(b, "_cv", None) is not None))  # (cached views only: none built here)
        return outs
    finally:
        _CJoin.C_STEP, _JoinFolded.C_STEP, _LeftJoinState.C_STEP = old


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_joins_over_large_sides_through_directories_equal_the_paths_before_and_duckdb(workers):
    """Each step's outputs of the four joins equal the run without the one-call steps; the inner joins' views
    integrated over the steps equal DuckDB's recompute at the last step."""
    steps = _steps(np.random.default_rng(SEED + workers), 14)
    DIRS.clear()
    got = _run(steps, workers, True)
    assert not DIRS or max(DIRS) > 0, "no join seek went through a directory"
    DIRS.clear()
    before = _run(steps, workers, False)
    assert not DIRS or max(DIRS) == 0, "the paths before the one-call steps built a directory"
    views: dict = {v: {} for v in SQL}
    for i, (a, b) in enumerate(zip(got, before)):
        assert a == b, f"step {i} (DBSP_TEST_SEED={SEED})"
        for v in SQL:
            for r, w in a[v].items():
                views[v][r] = views[v].get(r, 0) + w
    con = duckdb.connect()
    for name, schema in (("t", T), ("u", U)):
        tables = [tb.append_column("w", pa.array(w, pa.int64())) for p in steps for n, tb, w in p if n == name]
        con.register(f"{name}_all", pa.concat_tables(tables))
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_all")
    for v, sql in SQL.items():
        want = {tuple(r[:-1]): r[-1] for r in con.execute(sql).fetchall()}
        assert {r: w for r, w in views[v].items() if w} == want, f"{v} (DBSP_TEST_SEED={SEED})"
