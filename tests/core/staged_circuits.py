"""Circuits shared by the staged-runtime tests (tests/core/test_stages.py) and the Spark tests: each with the DuckDB query of every output, and seeded random changes split into steps."""

from __future__ import annotations

import os
import sys
from typing import Callable

import numpy as np
import pyarrow.compute as pc
from oracle import SCHEMAS, ChangeGen, accumulate, duckdb_query, normalize, to_zset

import dbsp_core as dbsp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures"))
from auction import by_category  # noqa: E402


def _group_agg(c: dbsp.Circuit, s: dict) -> dict:
    return {"g": s["bids"].group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price"), lo=dbsp.min("price"))}


def _join_agg(c: dbsp.Circuit, s: dict) -> dict:
    return {"j": by_category(s["bids"], s["auctions"])}


def _distinct(c: dbsp.Circuit, s: dict) -> dict:
    return {"d": s["bids"].filter(pc.field("price") >= 1).select(a="auction", b="bidder").distinct()}


def _left_join(c: dbsp.Circuit, s: dict) -> dict:
    return {"lj": s["bids"].left_join(s["auctions"], left_on="auction", right_on="id")}


def _carried(c: dbsp.Circuit, s: dict) -> dict:
    # auctions is exchanged into stage 1 and read in stage 2; a stage-0 value is carried into stage 2
    pairs = s["bids"].select(auction="auction", bidder="bidder").distinct()
    j = pairs.join(s["auctions"], left_on="auction", right_on="id")
    mix = j.select(a="auction") + s["bids"].select(a="auction")
    return {"mix": mix, "raw": s["bids"].filter(pc.field("price") > 3)}


CIRCUITS: dict[str, tuple[Callable, dict[str, str]]] = {
    "group_agg": (_group_agg, {"g": "SELECT auction, COUNT(*), SUM(price), MIN(price) FROM bids GROUP BY auction"}),
    "join_agg": (_join_agg, {"j": "SELECT a.category, COUNT(*), SUM(b.price) FROM bids b JOIN auctions a "
                                  "ON b.auction = a.id GROUP BY a.category"}),
    "distinct": (_distinct, {"d": "SELECT DISTINCT auction, bidder FROM bids WHERE price >= 1"}),
    "left_join": (_left_join, {"lj": "SELECT b.*, a.* FROM bids b LEFT JOIN auctions a ON b.auction = a.id"}),
    "carried": (_carried, {"mix": "SELECT p.auction FROM (SELECT DISTINCT auction, bidder FROM bids) p JOIN auctions a "
                                  "ON p.auction = a.id UNION ALL SELECT auction FROM bids",
                           "raw": "SELECT * FROM bids WHERE price > 3"}),
}


def build(name: str) -> tuple[dbsp.Circuit, dict[str, str]]:
    """The circuit ``name`` over inputs bids and auctions, and its outputs' SQL."""
    fn, sql = CIRCUITS[name]
    c = dbsp.Circuit()
    streams = {n: c.input(n, SCHEMAS[n]) for n in ("bids", "auctions")}
    for out, stream in fn(c, streams).items():
        c.output(out, stream)
    return c, sql


def changes(seed: int, steps: int, max_rows: int = 8) -> tuple[list[list[tuple[str, dbsp.ZSet]]], list[dict]]:
    """``steps`` steps of random pushes (a step's change to an input may arrive in two pushes) and the bags of
    each input after every step."""
    rng = np.random.default_rng(seed)
    gens = {n: ChangeGen(rng, SCHEMAS[n]) for n in ("bids", "auctions")}
    out, bags = [], []
    for _ in range(steps):
        pushes = []
        for n, g in gens.items():
            ch = g.change(max_rows)
            rows = list(ch)
            if rows and rng.random() < 0.4:
                cut = int(rng.integers(0, len(rows) + 1))
                pushes += [(n, to_zset({r: ch[r] for r in part}, SCHEMAS[n])) for part in (rows[:cut], rows[cut:])
                           if part]
            elif rows:
                pushes.append((n, to_zset(ch, SCHEMAS[n])))
        out.append(pushes)
        bags.append({n: (SCHEMAS[n], dict(g.bag)) for n, g in gens.items()})
    return out, bags


def run_job(p, job: list[list[tuple[str, dbsp.ZSet]]], queued: bool) -> list[dict]:
    """Push the steps of ``job`` and run them: as one ``step()`` (``queued`` false: a job of one step), or as queued
    steps that ``run_queued()`` runs together; returns each step's outputs."""
    if not queued:
        (pushes,) = job
        for h, z in pushes:
            p.push(h, z)
        return [p.step()]
    for pushes in job:
        for h, z in pushes:
            p.push(h, z)
        p.queue_step()
    return p.run_queued()


def run_random_jobs(p, steps: list[list[tuple[str, dbsp.ZSet]]], rng) -> list[dict]:
    """Feed ``steps``, cutting them into jobs at random: a job of 2-3 queued steps, or one step()."""
    outs: list[dict] = []
    i = 0
    while i < len(steps):
        k = int(rng.integers(1, 4))
        outs.extend(run_job(p, steps[i:i + k], k > 1))
        i += k
    return outs


def embedded(circuit: dbsp.Circuit, steps: list[list[tuple[str, dbsp.ZSet]]], workers: int = 1) -> list[dict]:
    """Every step's outputs from the embedded runtime (the reference)."""
    res = []
    with dbsp.Pipeline(circuit, workers=workers) as p:
        for pushes in steps:
            for h, z in pushes:
                p.push(h, z)
            res.append(p.step())
    return res


def check_duckdb(sql: dict[str, str], outs: list[dict], bags: list[dict], every: int = 1) -> None:
    """The integral of every output after each ``every``-th step (and the last) equals DuckDB over the bags."""
    views: dict[str, dict] = {n: {} for n in sql}
    for i, out in enumerate(outs):
        for n in sql:
            accumulate(views[n], out[n])
        if i % every == 0 or i == len(outs) - 1:
            for n, q in sql.items():
                assert normalize(views[n]) == duckdb_query(q, bags[i]), f"output {n} differs from DuckDB after step {i}"


def same_outputs(a: list[dict], b: list[dict]) -> None:
    """Step-by-step equality of two runs' outputs (consolidated Z-sets, exact)."""
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y)
        for n in x:
            assert x[n].consolidate() == y[n].consolidate(), \
                f"step {i} output {n}: {x[n].to_dict()} != {y[n].to_dict()}"


def staged_pipeline(c: dbsp.Circuit, workers: int = 1, storage=None, runner=None, shard_bits: int = 8,
                    max_steps_per_job: int = 64, **kwargs) -> dbsp.Pipeline:
    """A durable Pipeline over the staged executor (with ``runner``, default the in-process reference runner)."""
    from dbsp_core.runtime import StagedExecutor

    return dbsp.Pipeline(c, workers, shard_bits, storage,
                         executor=StagedExecutor(runner, max_steps_per_job=max_steps_per_job), **kwargs)


def open_staged(path, c: dbsp.Circuit, runner=None, workers=None, **kwargs) -> dbsp.Pipeline:
    """:meth:`dbsp.Pipeline.open` over the staged executor."""
    from dbsp_core.runtime import StagedExecutor

    return dbsp.Pipeline.open(path, c, workers, executor=StagedExecutor(runner), **kwargs)


def feed(p, steps: list[list[tuple[str, dbsp.ZSet]]]) -> list[dict]:
    """Each step's pushes, then the step: the outputs of the steps, in order."""
    outs = []
    for pushes in steps:
        for h, z in pushes:
            p.push(h, z)
        outs.append(p.step())
    return outs


def check_output_log(uri: str, outs: list[dict]) -> None:
    """The output log of the store pipeline at ``uri`` holds every step once, equal to what the steps returned."""
    from dbsp_core.runtime.remote_state import restored
    from dbsp_core.storage.inspect import open_output

    with restored(uri) as (path, *_):
        lg = open_output(path)
        try:
            assert (lg.first, lg.last) == (0, len(outs))
            for s, out in enumerate(outs):
                got = lg.get(s)
                assert set(got) == set(out)
                for n in out:
                    assert got[n].consolidate() == out[n].consolidate(), f"output log step {s} {n}"
        finally:
            lg.close()
