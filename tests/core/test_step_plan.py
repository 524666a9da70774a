"""The step plan (dbsp_core/runtime/plan.py): random circuits over random splits into steps give the same output with the plan as without it, and the fused chains ran."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profile import examples

import dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor

SCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int64()), ("v", pa.int64()), ("s", pa.string())])

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
    c.output("rows", s)
    return c


shapes = st.fixed_dictionaries({
    "filter": st.one_of(st.none(), st.integers(0, 5)),
    "project": st.booleans(),
    "groups": st.lists(st.tuples(st.sampled_from([("k",), ("k", "j"), ("j",), ("s",)]),
                                 st.lists(st.sampled_from(sorted(AGGS)), min_size=1, max_size=3, unique=True)),
                       min_size=1, max_size=3),
    "keyless": st.booleans(),
    "v_nulls": st.booleans(),  # False: no null in v, so every step with a row reaches the fused path
})


def _run(c: dbsp.Circuit, steps: list, plan: bool, workers: int = 1, rescale_at: int | None = None
         ) -> tuple[list[dict], dict]:
    """Every step's outputs as multisets ({row: weight}), and the plan's counts summed over workers."""
    outs = []
    with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(step_plan=plan)) as p:
        for i, step in enumerate(steps):
            if i == rescale_at:
                p.rescale(workers=2 if workers == 1 else 1)
                # plan.py invariant 2: at W = 2 no chain fuses through an exchange (a plan lowered for W = 1 would
                # skip the exchange on one worker and leave the others waiting at its barrier)
                assert all(not wk.plan.fused_nodes for wk in p.executor._workers) or len(p.executor._workers) == 1
            if step:
                p.push("t", dbsp.ZSet.from_rows([r for r, _ in step], SCHEMA, weights=[w for _, w in step]))
            outs.append({name: z.to_dict() for name, z in p.step().items()})
        counts = {"fused": 0, "unfused": 0}
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
    planned, counts = _run(_circuit(shape), steps, plan=True)
    unplanned, off = _run(_circuit(shape), steps, plan=False)
    assert planned == unplanned
    assert off == {"fused": 0, "unfused": 0}  # without the plan no fused chain exists
    # a chain over integer keys (or none) of counts and int64 sums, a step with a row past the filter and no null
    # in v: the fused path served it (string keys take the trace's walk, so the chain runs unfused)
    fusable = shape["keyless"] or any(set(names) <= {"n", "total", "nv"} and "s" not in keys
                                      for keys, names in shape["groups"])
    reached = any(r[0] != shape["filter"] for step in steps for r, _ in step)
    if fusable and reached and not shape["v_nulls"]:
        assert counts["fused"] >= 1


@settings(max_examples=examples(8))
@given(step_lists, st.integers(0, 5))
def test_plan_is_lowered_again_when_a_live_rescale_changes_the_worker_count(drawn, at):
    """A W = 1 plan fuses through the identity exchange; after a live rescale to W = 2 the exchange is real and
    the plan must stop fusing (plan.py invariant 2), and fuse again back at W = 1."""
    shape = {"filter": None, "project": False, "groups": [(("k",), ["n", "total"])], "keyless": True}
    steps = _steps(drawn)
    for workers in (1, 2):
        planned, _ = _run(_circuit(shape), steps, plan=True, workers=workers, rescale_at=min(at, len(steps) - 1))
        unplanned, _ = _run(_circuit(shape), steps, plan=False, workers=workers, rescale_at=min(at, len(steps) - 1))
        assert planned == unplanned


def test_fused_chain_runs_and_counts_and_falls_back_on_nulls():
    """The fused path serves a step of counts and sums without nulls (counted "fused"), a step with a null in a summed
    column runs the chain's own steps (counted "unfused"); the outputs equal the unplanned path's and SQL's."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v"), nv=dbsp.count("v")))
    steps = [[((1, 0, 5, "a"), 1), ((1, 0, 6, "b"), 1), ((2, 0, 7, "a"), 1)],
             [((1, 0, 5, "a"), -1), ((3, 0, None, "a"), 1)],
             [((2, 0, 7, "a"), -1)]]
    planned, counts = _run(c, steps, plan=True)
    assert counts == {"fused": 2, "unfused": 1}
    assert planned == _run(c, steps, plan=False)[0]
    assert planned[0]["g"] == {(1, 2, 11, 2): 1, (2, 1, 7, 1): 1}
    assert planned[1]["g"] == {(1, 2, 11, 2): -1, (1, 1, 6, 1): 1, (3, 1, None, 0): 1}
    assert planned[2]["g"] == {(2, 1, 7, 1): -1}


def test_plan_fuses_nothing_at_two_workers_nor_when_off():
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count()))
    for workers, plan in ((2, True), (1, False)):
        with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(step_plan=plan)) as p:
            assert all(wk.plan.fused_nodes == [] for wk in p.executor._workers)
    with dbsp.Pipeline(c, workers=1, executor=EmbeddedExecutor(step_plan=True)) as p:
        assert p.executor._workers[0].plan.fused_nodes == [c.outputs["g"]]
        p.push("t", pa.table({"k": np.arange(5), "j": np.zeros(5, dtype=np.int64), "v": np.ones(5, dtype=np.int64),
                              "s": ["x"] * 5}, schema=SCHEMA))
        assert len(p.step()["g"].to_dict()) == 5
        assert p.executor._workers[0].plan.counts == {"fused": 1, "unfused": 0}
