"""The fixpoint (Circuit.recursive) checked against DuckDB's recursive CTEs after random edge insertions and deletions.

At several worker counts, durable (checkpoint, reopen, rescale) and on the staged executor (with task retries).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.runtime.staged import StagedExecutor
from oracle import ChangeGen, _diff, accumulate, duckdb_query, normalize, to_zset

E = pa.schema([("src", pa.int64()), ("dst", pa.int64())])
SEEDS = st.integers(0, 2**31 - 1)
WORKERS = st.sampled_from([1, 2, 4])
FEW = settings(max_examples=6)


def _reach(r: dbsp.Stream, e: dbsp.Stream) -> dbsp.Stream:
    return e + r.join(e, left_on="dst", right_on="src").select(src="src", dst="dst_right")


def _square(r: dbsp.Stream, e: dbsp.Stream) -> dbsp.Stream:  # non-linear: R = E + R.R
    return e + r.join(r, left_on="dst", right_on="src").select(src="src", dst="dst_right")


def _paths(r: dbsp.Stream, e: dbsp.Stream) -> dbsp.Stream:  # bag of paths of a DAG (UNION ALL)
    return e + r.join(e, left_on="dst", right_on="src").select(src="src", dst="dst_right")


def build(c: dbsp.Circuit, e: dbsp.Stream) -> dict[str, dbsp.Stream]:
    dag = e.filter(pc.field("src") < pc.field("dst"))
    reach = c.recursive(_reach, [e])
    both = e + e.select(src="dst", dst="src")
    closure = c.recursive(_reach, [both])
    comp = closure.group_by("src").agg(comp=dbsp.min("dst"))
    return {"reach": reach, "square": c.recursive(_square, [e]), "paths": c.recursive(_paths, [dag], distinct=False),
            "from0": reach.filter(pc.field("src") == 0), "comp": comp}


CLOSURE = ("WITH RECURSIVE r(src, dst) AS (SELECT src, dst FROM e UNION SELECT r.src, e.dst FROM r JOIN e "
           "ON r.dst = e.src) ")
QUERIES = {
    "reach": CLOSURE + "SELECT * FROM r",
    "square": CLOSURE + "SELECT * FROM r",
    "paths": "WITH RECURSIVE r(src, dst) AS (SELECT src, dst FROM e WHERE src < dst UNION ALL SELECT r.src, e.dst "
             "FROM r JOIN e ON r.dst = e.src WHERE e.src < e.dst) SELECT * FROM r",
    "from0": CLOSURE + "SELECT * FROM r WHERE src = 0",
    "comp": "WITH RECURSIVE b(src, dst) AS (SELECT src, dst FROM e UNION ALL SELECT dst, src FROM e), "
            "r(src, dst) AS (SELECT src, dst FROM b UNION SELECT r.src, b.dst FROM r JOIN b ON r.dst = b.src) "
            "SELECT src, min(dst) FROM r GROUP BY src",
}


def _check(views: dict, gen: ChangeGen, step: int, label: str) -> None:
    tables = {"e": (E, dict(gen.bag))}
    answers: dict[str, dict] = {}  # reach and square have the same reference query: DuckDB runs it once
    for name, sql in QUERIES.items():
        if sql not in answers:
            answers[sql] = duckdb_query(sql, tables)
        want, got = answers[sql], normalize(views[name])
        assert got == want, (f"{name} differs from DuckDB after step {step} ({label})\n"
                             f"only in circuit: {_diff(got, want)}\nonly in DuckDB: {_diff(want, got)}")


def _pushes(rng: np.random.Generator, gen: ChangeGen) -> dbsp.ZSet | None:
    ch = gen.change(6)
    return to_zset(ch, E) if ch else None


def _run(seed: int, workers: int, steps: int, make_pipeline, reopen=None) -> None:
    rng = np.random.default_rng(seed)
    gen = ChangeGen(rng, E)
    c = dbsp.Circuit()
    e = c.input("e", E)
    for name, s in build(c, e).items():
        c.output(name, s)
    views: dict[str, dict] = {name: {} for name in QUERIES}
    p = make_pipeline(c, workers)
    try:
        for step in range(steps):
            z = _pushes(rng, gen)
            if z is not None:
                p.push("e", z)
            out = p.step()
            for name in QUERIES:
                accumulate(views[name], out[name])
            _check(views, gen, step, f"seed={seed} W={workers}")
            if reopen is not None and step % 3 == 2:
                p = reopen(p, c, step)
    finally:
        p.close()


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_recursive_matches_duckdb(seed: int, workers: int) -> None:
    _run(seed, workers, 8, lambda c, w: dbsp.Pipeline(c, workers=w))


@settings(max_examples=3)
@given(seed=SEEDS)
def test_recursive_durable_reopen_and_rescale(seed: int) -> None:
    d = tempfile.mkdtemp()
    counts = iter([3, 1, 2, 4, 2])

    def reopen(p, c, step):
        p.checkpoint()
        p.close()
        return dbsp.Pipeline.open(d, c, workers=next(counts))

    _run(seed, 2, 10, lambda c, w: dbsp.Pipeline(c, workers=w, storage=d), reopen)


@pytest.mark.parametrize("workers", [1, 2])
def test_recursive_on_the_staged_executor(workers: int) -> None:
    d = tempfile.mkdtemp()
    counts = iter([2, 1, 3, 2])

    def reopen(p, c, step):
        p.close()
        return dbsp.Pipeline.open(d, c, workers=next(counts), executor=StagedExecutor())

    _run(7 + workers, workers, 9, lambda c, w: dbsp.Pipeline(c, workers=w, storage=d, executor=StagedExecutor()),
         reopen)


def test_recursive_staged_task_retries_rebuild_the_cache() -> None:
    """A stage task that fails (before or after committing) and is retried leaves the fixpoint's cached traces
    behind the rolled-back mirrors: the retry must rebuild them, and the views stay exact."""
    from dbsp_core.runtime.staged import LocalJobRunner

    d = tempfile.mkdtemp()
    plan_stage = None

    def make(c, w):
        nonlocal plan_stage
        from dbsp_core.runtime.stage_plan import StagePlan

        plan = StagePlan(c)
        plan_stage = next(k for k in range(plan.num_stages)
                          if any(c.nodes[i].kind == "fixpoint" for i in plan.compute[k]))
        runner = LocalJobRunner(fail_first={(plan_stage, "before-commit", 0), (plan_stage, "after-commit", 1)})
        return dbsp.Pipeline(c, workers=w, storage=d, executor=StagedExecutor(runner))

    _run(5, 2, 6, make)


@settings(max_examples=3)
@given(seed=SEEDS)
def test_recursive_across_live_rescales(seed: int) -> None:
    """Steps run while p.rescale moves shards in batches: through layouts where a worker owns no shard yet, whose
    worker must still take part in every iteration's agreement (and receives nothing)."""
    import threading

    targets = iter([4, 1, 3])
    pending: list[threading.Thread] = []

    def reopen(p, c, step):
        for t in pending:
            t.join()
        pending.clear()
        t = threading.Thread(target=p.rescale, args=(next(targets, 2),), kwargs={"batch_shards": 8})
        t.start()
        pending.append(t)
        return p

    try:
        _run(seed, 2, 10, lambda c, w: dbsp.Pipeline(c, workers=w), reopen)
    finally:
        for t in pending:
            t.join()
