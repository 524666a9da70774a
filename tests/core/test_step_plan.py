"""The step plan (dbsp_core/runtime/plan.py): random circuits over random splits into steps give the same output with the plan as without it, and the fused chains ran."""

from __future__ import annotations

import os
import random

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples

import dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.plan import _PartialsExchange

SCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int64()), ("v", pa.int64()), ("s", pa.string())])
USCHEMA = pa.schema([("id", pa.int64()), ("x", pa.string()), ("m", pa.int64())])  # the join's other side
SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))  # the join test's rows; replayable
COUNTS = ("fused", "cstep", "unfused", "sent", "grouped", "received", "indexed", "merged", "joined",
          "reduced", "sliced", "paired", "projected", "keyed", "changes_merged", "cjoin", "folded")  # StepPlan.counts' keys

rows = st.tuples(st.integers(0, 5), st.one_of(st.none(), st.integers(0, 2)),
                 st.one_of(st.none(), st.integers(-9, 9)), st.sampled_from(["a", "b", None]))

AGGS = {  # name: aggregate; the first three are the ones the plan fuses (counts and int64 sums)
    "n": lambda: dbsp.count(), "total": lambda: dbsp.sum("v"), "nv": lambda: dbsp.count("v"),
    "lo": lambda: dbsp.min("v"), "mean": lambda: dbsp.avg("v"),
}


def _circuit(shape: dict) -> dbsp.Circuit:
    """A circuit of the shape Hypothesis drew: an optional filter and projection, then group-bys over a choice of
    keys and aggregates, a keyless aggregate, and a pass-through view beside them."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    s = t
    if shape["filter"]:
        s = s.filter(pc.field("k") != shape["filter"])
    if shape["project"]:
        s = s.select(k="k", j="j", v=pc.field("v") * 2, s="s")
    for g, (keys, names) in enumerate(shape["groups"]):
        c.output(f"g{g}", s.group_by(*keys).agg(**{n: AGGS[n]() for n in names}))
    if shape["keyless"]:
        c.output("all", s.group_by().agg(n=dbsp.count(), total=dbsp.sum("v")))
    if shape.get("join"):  # an inner join (one key, or two with a string), its rows and a group-by over them
        u = c.input("u", USCHEMA)
        on = ([["k"], ["id"]], [["k", "s"], ["id", "x"]])[shape["join"] - 1]
        j = s.join(u, left_on=on[0], right_on=on[1])
        if not shape.get("join_only_g"):  # else the group-by is the join's one consumer: a fused chain
            c.output("join", j)
        c.output("join_g", j.group_by("j").agg(n=dbsp.count(), total=dbsp.sum("m")))
    if shape.get("hop"):  # a linear group-by over hopping windows of v (null v: no window), by slices when the
        # window is no view of its own (the plan's _HopSlices)
        w = s.hop("v", *HOPS[shape["hop"]][0])
        if shape.get("hop_view"):
            c.output("windows", w)
        c.output("hop_g", w.group_by(*HOPS[shape["hop"]][1]).agg(n=dbsp.count(), total=dbsp.sum("j")))
    if shape.get("distinct") == 1:  # count-distincts (their exchanges send summed pairs at W > 1), of an int column
        # with nulls and of a string column
        c.output("cd", s.group_by("k").agg(n=dbsp.count(), nd=dbsp.count_distinct("v")))
    elif shape.get("distinct") == 2:
        c.output("cd", s.group_by("j").agg(ns=dbsp.count_distinct("s"), total=dbsp.sum("k")))
    c.output("rows", s)
    return c


HOPS = {1: ((6, 2), ("k", "window_start")), 2: ((9, 3), ("window_end",)),  # (size, slide), the group keys
        3: ((4, 1), ("window_start", "s", "window_end"))}


shapes = st.fixed_dictionaries({
    "filter": st.one_of(st.none(), st.integers(0, 5)),
    "project": st.booleans(),
    "groups": st.lists(st.tuples(st.sampled_from([("k",), ("k", "j"), ("j",), ("s",)]),
                                 st.lists(st.sampled_from(sorted(AGGS)), min_size=1, max_size=3, unique=True)),
                       min_size=1, max_size=3),
    "keyless": st.booleans(),
    "v_nulls": st.booleans(),  # False: no null in v, so every step with a row reaches the fused path
    "join": st.sampled_from([0, 1, 2]),  # no join, a join on k, a join on (k, s)
    "join_only_g": st.booleans(),  # the join's rows are no view: its group-by gathers from its pairs
    "workers": st.sampled_from([1, 2, 3]),
    "group_rows": st.sampled_from([None, 0]),  # 0: the W > 1 sender groups every step, however small
    "hop": st.sampled_from([0, 1, 2, 3]),  # no hopping windows, or HOPS' circuit
    "hop_view": st.booleans(),  # the windows are a view too: not sliced
    "distinct": st.sampled_from([0, 1, 2]),  # no count-distinct, or one of two
})


def _run(c: dbsp.Circuit, steps: list, plan: bool, workers: int = 1, rescale_at: int | None = None,
         group_rows: int | None = None) -> tuple[list[dict], dict]:
    """Every step's outputs as multisets ({row: weight}), and the plan's counts summed over workers.
    ``group_rows``: the W > 1 group-by sender's grouping threshold for the run (None: its own)."""
    if group_rows is None:
        return _run_steps(c, steps, plan, workers, rescale_at)
    old = _PartialsExchange.GROUP_ROWS
    _PartialsExchange.GROUP_ROWS = group_rows
    try:
        return _run_steps(c, steps, plan, workers, rescale_at)
    finally:
        _PartialsExchange.GROUP_ROWS = old


def _run_steps(c: dbsp.Circuit, steps: list, plan: bool, workers: int, rescale_at: int | None
               ) -> tuple[list[dict], dict]:
    outs = []
    with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(step_plan=plan)) as p:
        for i, step in enumerate(steps):
            if i == rescale_at:
                p.rescale(workers=2 if workers == 1 else 1)
                # plan.py invariant 2: the plan is lowered for the new layout (a plan lowered for W = 1 would skip
                # the exchange on one worker and leave the others waiting at its barrier)
                assert [wk.plan.workers for wk in p.executor._workers] == [len(p.executor._workers)] * len(
                    p.executor._workers)
            if step:
                p.push("t", dbsp.ZSet.from_rows([r for r, _ in step], SCHEMA, weights=[w for _, w in step]))
                if "u" in c.inputs:  # the other side: a row per row of t, so keys meet (m from v, never null)
                    p.push("u", dbsp.ZSet.from_rows([(k, s, 0 if v is None else v) for (k, _, v, s), _ in step],
                                                    USCHEMA, weights=[w for _, w in step]))
            outs.append({name: z.to_dict() for name, z in p.step().items()})
        counts = dict.fromkeys(COUNTS, 0)
        for wk in p.executor._workers:
            for k, v in wk.plan.counts.items():
                counts[k] += v
    return outs, counts


def _steps(draw_steps: list) -> list:
    """Steps that delete only rows inserted before (a relation), so every aggregate stays defined."""
    bag: dict = {}
    out = []
    for step in draw_steps:
        kept = []
        for r, w in step:
            if w < 0 and bag.get(r, 0) < -w:
                continue
            bag[r] = bag.get(r, 0) + w
            kept.append((r, w))
        out.append(kept)
    return out


step_lists = st.lists(st.lists(st.tuples(rows, st.sampled_from([1, 1, 2, -1])), max_size=10), min_size=1,
                      max_size=6)


@settings(max_examples=examples(20))
@given(shapes, step_lists)
def test_plan_equals_unplanned_path_on_random_circuits_and_splits(shape, drawn):
    if not shape["v_nulls"]:
        drawn = [[((k, j, 0 if v is None else v, s), w) for (k, j, v, s), w in step] for step in drawn]
    steps = _steps(drawn)
    workers = shape["workers"]
    planned, counts = _run(_circuit(shape), steps, plan=True, workers=workers, group_rows=shape["group_rows"])
    unplanned, off = _run(_circuit(shape), steps, plan=False, workers=workers)
    assert planned == unplanned
    assert off == dict.fromkeys(COUNTS, 0)  # without the plan no fused chain exists
    if workers > 1:  # and the W > 1 plan agrees with W = 1 without it
        assert planned == _run(_circuit(shape), steps, plan=False)[0]
    # a row past the filter (a filter of 0 or None is no filter: _circuit tests it for truth)
    reached = any(not shape["filter"] or r[0] != shape["filter"] for step in steps for r, _ in step)
    # the join's call gathered the group-by's columns from its pairs every step, on every worker, or (W = 1) the
    # group-by's call folded the join's pairs into its totals (plan.py _JoinFolded)
    assert counts["joined"] + counts["folded"] == (len(steps) * workers if shape["join"] and shape["join_only_g"]
                                                   else 0)
    assert counts["folded"] <= (len(steps) if shape["join"] and shape["join_only_g"] and workers == 1 else 0)
    # at W = 1 the join ran every step in one C call (operators/join.py invariant 7), unless a budget spilled the
    # batches it walks (DBSP_MEMORY_LIMIT); at W > 1 its inputs come through fused exchanges, as runs of indexes
    want = len(steps) if shape["join"] and workers == 1 else 0
    assert counts["cjoin"] + counts["folded"] == want or (os.environ.get("DBSP_MEMORY_LIMIT")
                                                          and counts["cjoin"] + counts["folded"] <= want)
    # at W > 1 a count-distinct's exchange sent summed pairs whenever a worker had rows for it
    assert (counts["paired"] >= 1) == bool(workers > 1 and shape["distinct"] and reached)
    # the hopping windows' group-by summed slices every step, on every worker, unless the windows are a view
    assert counts["sliced"] == (len(steps) * workers if shape["hop"] and not shape["hop_view"] else 0)
    linear = [keys for keys, names in shape["groups"] if set(names) <= {"n", "total", "nv"}]
    if workers == 1:
        # a chain over keys (or none; string keys too: csrc/keyindex.h invariant 8) of counts and int64 sums, a step
        # with a row past the filter and no null in v: the fused path served it
        fusable = shape["keyless"] or bool(linear)
        if fusable and reached and not shape["v_nulls"]:
            assert counts["fused"] >= 1
        return
    # W > 1: a keyed linear group-by's exchange sent partial rows its grouping pass built (or, after a null, the
    # combiner's: "unfused"), and its aggregate ran over the received parts; a join's exchanges sent indexed runs
    if linear and reached:
        assert counts["sent"] + counts["unfused"] >= 1 and counts["received"] >= 1
        if not shape["v_nulls"]:
            assert counts["sent"] >= 1
            assert (counts["grouped"] >= 1) == (shape["group_rows"] == 0)  # the form the threshold chose
    if shape["join"] and steps and any(steps):  # u feeds only the join, so its side's exchange is always fused
        # (t's shares its exchange with a group-by by k that is not linear, when there is one, and is not)
        assert counts["indexed"] >= 1 and counts["merged"] >= 1


@settings(max_examples=examples(8))
@given(step_lists, st.integers(0, 5))
def test_plan_is_lowered_again_when_a_live_rescale_changes_the_worker_count(drawn, at):
    """A W = 1 plan fuses through the identity exchange; after a live rescale to W = 2 the exchange is real and
    the plan must be lowered again for it (plan.py invariant 2), and again back at W = 1."""
    shape = {"filter": None, "project": False, "groups": [(("k",), ["n", "total"])], "keyless": True, "join": 1}
    steps = _steps(drawn)
    for workers in (1, 2):
        planned, _ = _run(_circuit(shape), steps, plan=True, workers=workers, rescale_at=min(at, len(steps) - 1))
        unplanned, _ = _run(_circuit(shape), steps, plan=False, workers=workers, rescale_at=min(at, len(steps) - 1))
        assert planned == unplanned


@pytest.mark.parametrize("workers, group_rows", [(1, None), (2, None), (3, None), (2, 0), (3, 0)])
def test_fused_chain_runs_and_counts_and_falls_back_on_nulls(workers, group_rows):
    """The fused path serves a step of counts and sums without nulls (counted "fused" at W = 1, "sent" and
    "received" at W > 1), a step with a null in a summed column runs the combiner (counted "unfused"); the outputs
    equal the unplanned path's and SQL's."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v"), nv=dbsp.count("v")))
    steps = [[((1, 0, 5, "a"), 1), ((1, 0, 6, "b"), 1), ((2, 0, 7, "a"), 1)],
             [((1, 0, 5, "a"), -1), ((3, 0, None, "a"), 1)],
             [((2, 0, 7, "a"), -1)]]
    planned, counts = _run(c, steps, plan=True, workers=workers, group_rows=group_rows)
    if workers == 1:
        assert counts == {**dict.fromkeys(COUNTS, 0), "fused": 2, "cstep": 2, "unfused": 1}
    else:  # a worker given rows groups them ("sent"), or, with a null among them, the combiner does ("unfused");
        # every worker runs its aggregate over what it received once a step
        assert counts["sent"] >= 2 and counts["unfused"] >= 1 and counts["received"] == 3 * workers, counts
        assert (counts["grouped"] >= 1) == (group_rows == 0), counts  # a worker's first step with rows groups
        assert counts["fused"] == counts["indexed"] == counts["merged"] == 0
    assert planned == _run(c, steps, plan=False, workers=workers)[0]
    assert planned[0]["g"] == {(1, 2, 11, 2): 1, (2, 1, 7, 1): 1}
    assert planned[1]["g"] == {(1, 2, 11, 2): -1, (1, 1, 6, 1): 1, (3, 1, None, 0): 1}
    assert planned[2]["g"] == {(2, 1, 7, 1): -1}


@pytest.mark.parametrize("workers, group_rows", [(2, None), (3, None), (2, 0)])
def test_fused_join_exchange_sends_indexed_runs_and_matches_duckdb(workers, group_rows, monkeypatch):
    """At W > 1 a join's exchanges index the change and send runs of the index; the join merges what it received.
    Random rows on both sides (DBSP_TEST_SEED, printed by pytest -q) through join then group-by, steps with
    deletions: each step's view equals DuckDB's over the rows so far, and the fused exchanges ran."""
    seed = SEED + workers
    rng = np.random.default_rng(seed)
    if group_rows is not None:  # the group-by's sender groups every step (its other form)
        monkeypatch.setattr(_PartialsExchange, "GROUP_ROWS", group_rows)
    c = dbsp.Circuit()
    t, u = c.input("t", SCHEMA), c.input("u", USCHEMA)
    j = t.join(u, left_on="k", right_on="id")
    c.output("g", j.group_by("x").agg(n=dbsp.count(), total=dbsp.sum("v")))
    con = duckdb.connect()  # rows with their weights (w): the view is the weighted join's sums
    con.execute("CREATE TABLE t (k BIGINT, j BIGINT, v BIGINT, s VARCHAR, w BIGINT); "
                "CREATE TABLE u (id BIGINT, x VARCHAR, m BIGINT, w BIGINT)")
    with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(step_plan=True)) as p:
        view: dict = {}
        first = None
        for step in range(4):
            n = int(rng.integers(1, 3000))
            tt = pa.table({"k": rng.integers(0, 500, n), "j": rng.integers(0, 3, n), "v": rng.integers(-9, 9, n),
                           "s": rng.choice(["a", "b"], n)}, schema=SCHEMA)
            ut = pa.table({"id": rng.integers(0, 500, n // 4 + 1), "x": rng.choice(["p", "q", "r"], n // 4 + 1),
                           "m": rng.integers(0, 5, n // 4 + 1)}, schema=USCHEMA)
            first = tt if first is None else first
            p.push("t", tt)
            p.push("u", ut)
            con.execute("INSERT INTO t SELECT *, 1 FROM tt; INSERT INTO u SELECT *, 1 FROM ut")
            if step == 2:  # delete a tenth of the first step's rows
                gone = first.slice(0, first.num_rows // 10 + 1)
                p.push("t", dbsp.ZSet.from_arrow(gone, -np.ones(gone.num_rows, dtype=np.int64)))
                con.execute("INSERT INTO t SELECT *, -1 FROM gone")
            for row, w in p.step()["g"].to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
            want = con.execute("SELECT x, sum(t.w * u.w), sum(v * t.w * u.w) FROM t JOIN u ON k = id GROUP BY x "
                               "HAVING sum(t.w * u.w) != 0").fetchall()
            assert view == {tuple(r): 1 for r in want}, f"seed {seed}, step {step}"
        counts = dict.fromkeys(COUNTS, 0)
        for wk in p.executor._workers:
            for k, v in wk.plan.counts.items():
                counts[k] += v
    assert counts["indexed"] >= 4 and counts["merged"] == 2 * 4 * workers, counts  # both sides, every step
    assert counts["sent"] >= 4 and counts["received"] == 4 * workers, counts
    assert (counts["grouped"] >= 1) == (group_rows == 0), counts


def test_plan_fuses_through_the_exchange_at_two_workers_and_nothing_when_off():
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count()))
    with dbsp.Pipeline(c, workers=1, executor=EmbeddedExecutor(step_plan=False)) as p:
        assert p.executor._workers[0].plan.fused_nodes == []
    for workers in (1, 2):
        with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(step_plan=True)) as p:
            assert all(wk.plan.fused_nodes == [c.outputs["g"]] for wk in p.executor._workers)
            p.push("t", pa.table({"k": np.arange(5), "j": np.zeros(5, dtype=np.int64),
                                  "v": np.ones(5, dtype=np.int64), "s": ["x"] * 5}, schema=SCHEMA))
            assert len(p.step()["g"].to_dict()) == 5
            counts = [wk.plan.counts for wk in p.executor._workers]
            if workers == 1:
                assert counts == [{**dict.fromkeys(COUNTS, 0), "fused": 1, "cstep": 1}]
            else:  # each worker grouped its rows and sent them (one sent none), and ran its aggregate once
                assert sum(x["sent"] for x in counts) >= 1 and [x["received"] for x in counts] == [1, 1]


def _model_join_group(t_rows: dict, u_rows: dict, key: str) -> dict:
    """The dict model of a join then group-by of count(*) and sum(v), u's ``key`` the group key: per group, the
    sums over every pair of a t row and a u row with k = id of the product of their weights (times v), groups of
    count 0 left out; the view's rows as {(key, n, total): 1}."""
    groups: dict = {}
    for (k, _, v, _), wt in t_rows.items():
        for (uid, x, m), wu in u_rows.items():
            if k is None or k != uid:
                continue
            g = x if key == "x" else m
            n, total, seen = groups.get(g, (0, 0, False))
            groups[g] = (n + wt * wu, total + (0 if v is None else v * wt * wu), seen or v is not None)
    return {(g, n, total if seen else None): 1 for g, (n, total, seen) in groups.items() if n}


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("plan", [True, False])
@pytest.mark.parametrize("key", ["m", "x"])
def test_join_then_group_by_folds_the_pairs_and_matches_duckdb_and_a_model(workers, plan, key):
    """A join whose one consumer is a linear group-by gathers from its pairs only the columns the aggregate reads
    (counted "joined"; plan.py note 4). Random rows on both sides (DBSP_TEST_SEED, printed by pytest -q), with
    deletions on both sides, a null in the summed column now and then (the step then runs the combiner), the
    group key from the join's right side (an int64 the key index serves, or a string it does not): every step's
    view equals DuckDB's recompute and the dict model's, with the plan on and off, at W = 1, 2, 3."""
    seed = SEED + 7 * workers + (key == "x")
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    t, u = c.input("t", SCHEMA), c.input("u", USCHEMA)
    c.output("g", t.join(u, left_on="k", right_on="id").group_by(key).agg(n=dbsp.count(), total=dbsp.sum("v")))
    con = duckdb.connect()
    con.execute("CREATE TABLE t (k BIGINT, j BIGINT, v BIGINT, s VARCHAR, w BIGINT); "
                "CREATE TABLE u (id BIGINT, x VARCHAR, m BIGINT, w BIGINT)")
    t_rows: dict = {}
    u_rows: dict = {}

    def add(rows: dict, table: pa.Table, w: int) -> None:
        for r in zip(*(table.column(i).to_pylist() for i in range(table.num_columns))):
            rows[r] = rows.get(r, 0) + w
            if not rows[r]:
                del rows[r]

    with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(step_plan=plan)) as p:
        view: dict = {}
        for step in range(6):
            n = int(rng.integers(1, 400))
            v = rng.integers(-9, 9, n)
            tt = pa.table({"k": rng.integers(0, 60, n), "j": rng.integers(0, 3, n),
                           "v": pa.array(v, mask=(rng.random(n) < 0.05) if step == 3 else None),
                           "s": rng.choice(["a", "b"], n)}, schema=SCHEMA)
            nu = n // 8 + 1
            ut = pa.table({"id": rng.integers(0, 60, nu), "x": rng.choice(["p", "q", "r"], nu),
                           "m": rng.integers(0, 7, nu)}, schema=USCHEMA)
            pushes = [("t", tt, 1), ("u", ut, 1)]
            if step >= 2:  # delete some rows of each side that are there now
                for name, rows, schema in (("t", t_rows, SCHEMA), ("u", u_rows, USCHEMA)):
                    gone = [r for r, w in list(rows.items())[: len(rows) // 6] if w > 0]
                    if gone:
                        pushes.append((name, pa.Table.from_pylist([dict(zip(schema.names, r)) for r in gone],
                                                                  schema=schema), -1))
            for name, table, w in pushes:
                p.push(name, dbsp.ZSet.from_arrow(table, np.full(table.num_rows, w, dtype=np.int64)))
                con.register("chg", table)
                con.execute(f"INSERT INTO {name} SELECT *, {w} FROM chg")
                con.unregister("chg")
                add(t_rows if name == "t" else u_rows, table, w)
            for row, w in p.step()["g"].to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
            want = con.execute(f"SELECT {key}, sum(t.w * u.w), sum(v * t.w * u.w) FROM t JOIN u ON k = id "
                               f"GROUP BY {key} HAVING sum(t.w * u.w) != 0").fetchall()
            assert view == {tuple(r): 1 for r in want}, f"seed {seed}, step {step}"
            assert view == _model_join_group(t_rows, u_rows, key), f"seed {seed}, step {step}"
        counts = dict.fromkeys(COUNTS, 0)
        for wk in p.executor._workers:
            for k, x in wk.plan.counts.items():
                counts[k] += x
    if not plan:
        assert counts == dict.fromkeys(COUNTS, 0)
        return
    # the join's call gathered the aggregate's columns every step, or (W = 1, an int64 key) the aggregate's call
    # folded the join's pairs into its totals (plan.py _JoinFolded; a string key is not fixed-width)
    assert counts["joined"] + counts["folded"] == 6 * workers, counts
    assert (counts["folded"] >= 1) == (workers == 1 and key == "m"), counts
    if workers == 1:  # every step folds the gathered columns (an int64 or a string key through the key index, but
        # for steps whose pairs meet a null v) or runs the combiner over them (a null)
        assert counts["fused"] + counts["unfused"] == 6 and counts["fused"] >= 1, counts
    else:  # every worker's sender built partial rows from the gathered columns (or, after a null, the combiner)
        assert counts["sent"] + counts["unfused"] >= 6 and counts["received"] == 6 * workers, counts


@pytest.mark.parametrize("workers", [2, 3])
def test_count_distinct_exchange_sends_summed_pairs_and_matches_a_model(workers):
    """At W > 1 a count-distinct's exchange sends each sender's distinct (key, value) pairs with their summed
    weights (plan.py ``_PairsExchange``): random steps over few pairs (DBSP_TEST_SEED), with duplicates in a step,
    deletions that take a pair's multiplicity to 0 and back, and null values, against a dict model of
    count(DISTINCT v) and count(*) per k over the integrated input, and against the unplanned path at W = 1."""
    rng = np.random.default_rng(SEED)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("cd", t.group_by("k").agg(n=dbsp.count(), nd=dbsp.count_distinct("v"), ns=dbsp.count_distinct("s")))
    bag: dict = {}
    steps = []
    for i in range(9):
        if i % 3 == 2:  # every third step deletes every row of one value of v, or of s, in every group: those pairs'
            # multiplicities go to 0 (flips of -1) while their groups stay
            col, value = (2, i // 3) if i % 2 else (3, "ab"[i // 6])
            step = [(row, -w) for row, w in bag.items() if w > 0 and row[col] == value]
            for row, w in step:
                bag[row] += w
            steps.append(step)
            continue
        step = []
        for _ in range(int(rng.integers(20, 60))):
            row = (int(rng.integers(0, 3)), 0, None if rng.random() < 0.1 else int(rng.integers(0, 4)),
                   ["a", "b", None][int(rng.integers(0, 3))])
            w = int(rng.choice([1, 1, 2, -1, -2])) if bag.get(row, 0) > 0 else int(rng.integers(1, 3))
            w = max(w, -bag.get(row, 0))
            if w:
                bag[row] = bag.get(row, 0) + w
                step.append((row, w))
        steps.append(step)
    planned, counts = _run(c, steps, plan=True, workers=workers)
    assert counts["paired"] >= len(steps), counts  # some worker sent summed pairs every step
    assert planned == _run(c, steps, plan=False)[0], f"DBSP_TEST_SEED={SEED}"
    acc: dict = {}
    view: dict = {}
    for step, out in zip(steps, planned):
        for row, w in step:
            acc[row] = acc.get(row, 0) + w
        for row, w in out["cd"].items():
            view[row] = view.get(row, 0) + w
        view = {r: w for r, w in view.items() if w}
        want = {}
        for k in {r[0] for r, w in acc.items() if w}:
            rows = {r: w for r, w in acc.items() if w and r[0] == k}
            want[(k, sum(rows.values()), len({r[2] for r in rows if r[2] is not None}),
                  len({r[3] for r in rows if r[3] is not None}))] = 1
        assert view == want, f"DBSP_TEST_SEED={SEED}"
