"""The min/max step's second half in one C call (operators/aggregate.py invariant 10, csrc/extremes.h design note 4):
the totals batch (row hashes, canonical order), the finalized output and the key index's stores built by
``_zset.ExtremesEmit``. Checked against DuckDB after every step over random splits into steps (Hypothesis: every
integer width, nulls in keys and values, deletions of current extremes, W in {1, 2}), against the Python path it
replaces step by step (the same outputs, the same totals), across a rolled-back step (StepError after the aggregate
stored its totals) and a store refused half way (undone: the step walks the batches), by ``emitted_steps``, which
says the C path served the steps, and ``in_place``, which says its stores went where the probe found each group
(design note 5)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.errors import StepError
from dbsp_core.operators.aggregate import _ExtremesState
from hypothesis_profile import examples
from oracle import connect
from test_aggregate_extremes import INT_SCHEMA, _int_model, _steps_against_model, int_row
from tests.core.test_linear_run import add_poison

BUDGET = bool(os.environ.get("DBSP_MEMORY_LIMIT"))  # a budget spills batches and may drop indexes on its own
TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32()]


def _states(p: dbsp.Pipeline) -> list:
    return [s for wk in p.executor._workers for s in wk.instances.values() if type(s) is _ExtremesState]


def _circuit(t: pa.DataType) -> dbsp.Circuit:
    c = dbsp.Circuit()
    src = c.input("t", pa.schema([("k", pa.int64()), ("v", t)]))
    aggs = dict(n=dbsp.count(), c=dbsp.count("v"), lo=dbsp.min("v"), hi=dbsp.max("v"))
    if pa.types.is_signed_integer(t):
        aggs["s"] = dbsp.sum("v")
    c.output("g", src.group_by("k").agg(**aggs))
    return c


def _values(t: pa.DataType) -> st.SearchStrategy:
    bits = t.bit_width
    lo, hi = (0, 2**bits - 1) if pa.types.is_unsigned_integer(t) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if bits == 64:  # sums of a few rows stay within int64
        lo, hi = -(2**58), 2**58
    return st.one_of(st.none(), st.sampled_from([lo, hi, 0, 1, lo + 1, hi - 1]), st.integers(lo, hi),
                     st.integers(-3, 3).map(lambda x: min(max(x, lo), hi)))


def _duckdb(bag: dict, t: pa.DataType) -> dict:
    rows = [r for r, m in bag.items() for _ in range(m)]
    if not rows:
        return {}
    table = pa.table({"k": pa.array([k for k, _ in rows], pa.int64()), "v": pa.array([v for _, v in rows], t)})
    con = connect()
    con.register("t", table)
    got = con.execute("SELECT k, count(*), count(v), min(v), max(v), sum(v) FROM t GROUP BY k").fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4]) + ((None if r[5] is None else int(r[5]),)
                                              if pa.types.is_signed_integer(t) else ()) for r in got}


@settings(max_examples=examples(25), deadline=None)
@given(data=st.data())
def test_min_max_steps_match_duckdb(data) -> None:
    """Random steps of inserts and deletions (often of a group's current min or max) over three keys and a null key,
    every step's integral against DuckDB's GROUP BY over the rows; the C path served every step with a change."""
    t = data.draw(st.sampled_from(TYPES), label="type")
    workers = data.draw(st.sampled_from([1, 2]), label="workers")
    schema = pa.schema([("k", pa.int64()), ("v", t)])
    row = st.tuples(st.sampled_from([0, 1, 2, None]), _values(t))
    steps = data.draw(st.lists(st.lists(st.tuples(row, st.sampled_from([1, 1, 2, -1])), max_size=8), min_size=1,
                               max_size=6), label="steps")
    bag: Counter = Counter()
    view: Counter = Counter()
    changed = 0
    with dbsp.Pipeline(_circuit(t), workers=workers) as p:
        for i, step in enumerate(steps):
            delta: Counter = Counter()
            for r, w in step:
                if w < 0:  # a deletion of a present row: the group's current min or max when one is there
                    present = sorted((x for x, m in (bag + delta).items() if m > 0 and x[0] == r[0]),
                                     key=lambda x: (x[1] is None, x[1] if x[1] is not None else 0))
                    if not present:
                        continue
                    r = present[0] if r[1] is None or r[1] % 2 else present[-1]
                delta[r] += w
            delta = Counter({r: w for r, w in delta.items() if w})
            if delta:
                p.push("t", dbsp.ZSet.from_rows(list(delta), schema, weights=list(delta.values())))
                changed += 1
            bag.update(delta)
            bag = Counter({r: m for r, m in bag.items() if m > 0})
            for r, w in p.step()["g"].to_dict().items():
                view[r] += w
            view = Counter({r: w for r, w in view.items() if w})
            note(f"step {i}: {dict(delta)}")
            assert all(w == 1 for w in view.values()), view
            got = {r[0]: tuple(r[1:]) for r in view}
            assert got == _duckdb(dict(bag), t), f"step {i}, {t}, W={workers}"
        for w in range(workers):
            for tr in p.traces(w).values():
                tr.check()  # row hashes and canonical order of the batches the C path built
        served = sum(s.emitted_steps for s in _states(p))
        assert all(s.emit is not None for s in _states(p))
        assert served >= (1 if changed else 0), "the C path served no step"
        assert sum(s.emit.in_place for s in _states(p)) >= served  # each stored where its probe found it


def _python_path(monkeypatch) -> None:
    monkeypatch.setattr(_ExtremesState, "_emitter", lambda self: None)


@pytest.mark.parametrize("workers,seed", [(1, 21), (2, 22)])
def test_the_c_path_matches_the_python_path(monkeypatch, workers: int, seed: int) -> None:
    """Two pipelines in lockstep over the same steps (int32, timestamp, date32 extremes with nulls, an int64 sum,
    deletions of current extremes), one with the C path, one with the Python path it replaces: the same output
    rows and weights at every step, the same totals, and a poisoned push (a later node fails: StepError after the
    aggregate stored its totals) rolled back and discarded in both."""
    import datetime

    c_pipe = dbsp.Pipeline(_emit_circuit(), workers=workers)
    with monkeypatch.context() as m:
        _python_path(m)
        py_pipe = dbsp.Pipeline(_emit_circuit(), workers=workers)
    assert all(s.emit is not None for s in _states(c_pipe)) and all(s.emit is None for s in _states(py_pipe))
    rng = np.random.default_rng(seed)
    epoch = datetime.datetime(2026, 1, 1)
    bag: Counter = Counter()
    try:
        for step in range(120):
            delta: Counter = Counter()
            for _ in range(int(rng.integers(1, 12))):
                present = [r for r, w in (bag + delta).items() if w > 0]
                if present and rng.random() < 0.4:
                    k = present[int(rng.integers(len(present)))][0]
                    rows = sorted((r for r in present if r[0] == k and r[1] is not None), key=lambda r: r[1])
                    pick = rows[0 if rng.random() < 0.5 else -1] if rows else present[int(rng.integers(len(present)))]
                    delta[pick] -= 1
                else:
                    k = None if rng.random() < 0.05 else int(rng.integers(0, 15))
                    v = None if rng.random() < 0.1 else int(rng.integers(-30, 30))
                    ts = None if rng.random() < 0.1 else epoch + datetime.timedelta(seconds=int(rng.integers(0, 50)))
                    d = None if rng.random() < 0.1 else datetime.date(2026, 1, 1 + int(rng.integers(0, 20)))
                    delta[(k, v, ts, d)] += 1
            delta = Counter({r: w for r, w in delta.items() if w})
            bag.update(delta)
            bag = Counter({r: w for r, w in bag.items() if w})
            outs = []
            for p in (c_pipe, py_pipe):
                if step in (40, 90):  # rolled back after the aggregate stored its step's totals
                    p.push("t", dbsp.ZSet.from_rows([(1, 666, None, None), (3, 5, None, None)], INT_SCHEMA))
                    with pytest.raises(StepError, match="poison") as info:
                        p.step()
                    producer, seq = info.value.inputs[-1][1:]
                    p.discard(producer, seq)
                if delta:
                    p.push("t", dbsp.ZSet.from_rows(list(delta), INT_SCHEMA, weights=list(delta.values())))
                out = p.step()["g"]
                outs.append(sorted(zip(out.data.to_pylist(), out.weights.tolist()), key=repr))
            assert outs[0] == outs[1], f"step {step}"
            if step % 30 == 29:
                for p in (c_pipe, py_pipe):
                    for w in range(workers):
                        for tr in p.traces(w).values():
                            tr.check()
        totals = [sorted(map(repr, _totals(p))) for p in (c_pipe, py_pipe)]
        assert totals[0] == totals[1]
        assert sum(s.emitted_steps for s in _states(c_pipe)) >= 100
        assert sum(s.emit.in_place for s in _states(c_pipe)) >= 100  # stored in place, the rolled-back steps too
        assert sum(s.emitted_steps for s in _states(py_pipe)) == 0
    finally:
        c_pipe.close()
        py_pipe.close()


def _emit_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    src = c.input("t", INT_SCHEMA)
    c.output("g", src.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v"), last=dbsp.max("t"),
                                        first=dbsp.min("d"), total=dbsp.sum("v")))
    add_poison(c, src, INT_SCHEMA)
    return c


def _totals(p: dbsp.Pipeline) -> list:
    out = []
    for w in range(p.workers):
        for name, tr in p.traces(w).items():
            z = tr.consolidated().zset
            out += [(name, r, wt) for r, wt in zip(z.data.to_pylist(), z.weights.tolist())]
    return out


def test_the_long_run_with_extremes_of_every_width_is_served_by_the_c_path() -> None:
    """test_aggregate_extremes' key-index run (int32, timestamp, date32, nulls, groups that empty and come back)
    at W = 2: the model after every step, and the C path served the steps."""
    rng = np.random.default_rng(23)
    p = dbsp.Pipeline(_emit_circuit(), workers=2)
    states = _states(p)
    _steps_against_model(p, rng, 100, (0, 12), int_row, 0.3, 0.15, INT_SCHEMA, _int_model)
    assert sum(s.emitted_steps for s in states) >= 100


@pytest.mark.parametrize("workers", [1, 2])
def test_min_max_totals_hold_their_low_levels(monkeypatch, workers: int) -> None:
    """The min/max totals trace, read through its key index, merges its low levels many at a time (trace invariant
    18, ``DBSP_TOTALS_HOLD``): a pipeline with hold 16 and one with hold off, in lockstep over a load of 3000 groups
    and small steps deleting current extremes: the same outputs at every step and the same totals; held merges ran
    with hold on only (none under a memory budget: every trace then belongs to a batch store)."""
    from dbsp_core.envvars import settings
    from dbsp_core.operators.aggregate import _LinearState

    monkeypatch.setattr(_ExtremesState, "PER_KEY", False)  # held levels are of step batches (not totals per key)
    rng = np.random.default_rng(24)
    c = dbsp.Circuit()
    src = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("g", src.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v")))
    pipes = {}
    for hold in (16, 0):
        monkeypatch.setattr(_LinearState, "HOLD", hold)
        pipes[hold] = dbsp.Pipeline(c, workers=workers)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    load = [(int(k), int(v)) for k, v in zip(rng.integers(0, 3000, 6000), rng.integers(0, 1000, 6000))]
    bag = Counter(load)
    steps = [Counter(load)]
    for _ in range(150):
        d: Counter = Counter()
        for r in [load[int(i)] for i in rng.integers(0, len(load), 8)]:
            if bag[r] + d[r] > 0:
                d[r] -= 1
        for k, v in zip(rng.integers(0, 3000, 40), rng.integers(0, 1000, 40)):
            d[(int(k), int(v))] += 1
        bag.update(d)
        steps.append(Counter({r: w for r, w in d.items() if w}))
    try:
        for i, d in enumerate(steps):
            outs = []
            for p in pipes.values():
                p.push("t", dbsp.ZSet.from_rows(list(d), schema, weights=list(d.values())))
                outs.append(p.step()["g"].to_dict())
            assert outs[0] == outs[1], f"step {i}"
        state = []
        for hold, p in pipes.items():
            trs = [tr for w in range(workers) for name, tr in p.traces(w).items() if name.endswith("totals")]
            assert trs and all(tr.hold == hold for tr in trs)
            for tr in trs:
                tr.check()
            state.append(Counter(r for tr in trs for r in tr.consolidated().zset.to_dict().items()))
            held = sum(tr.held_merges for tr in trs)
            assert (held > 0) == (hold > 0 and settings().memory_limit is None), (hold, held)
        assert state[0] == state[1]
    finally:
        for p in pipes.values():
            p.close()


def test_a_step_that_changes_only_unshown_totals_outputs_nothing() -> None:
    """min alone (the row count is a slot the output does not show): a step inserting values above each group's
    min changes every group's totals, yet shows nothing (the C call's output has no row while its totals batch
    has two a group); then a new min, and the min deleted (a recompute from the values)."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    c.output("g", c.input("t", schema).group_by("k").agg(lo=dbsp.min("v")))
    with dbsp.Pipeline(c, workers=1) as p:
        steps = [([(1, 5), (2, 7)], None, {(1, 5): 1, (2, 7): 1}), ([(1, 9), (2, 8)], None, {}),
                 ([(1, 9), (2, 3)], None, {(2, 3): 1, (2, 7): -1}), ([(1, 5)], [-1], {(1, 5): -1, (1, 9): 1})]
        for rows, w, want in steps:
            p.push("t", dbsp.ZSet.from_rows(rows, schema, weights=w))
            out = p.step()["g"]
            assert out.to_dict() == want and out.num_rows == len(want)
        for tr in p.traces(0).values():
            tr.check()
        assert sum(s.emitted_steps for s in _states(p)) == 4


@pytest.mark.parametrize("workers", [1, 2])
def test_a_refused_store_is_undone_and_the_step_walks_the_batches(monkeypatch, workers: int) -> None:
    """The emit's stores in place (csrc/extremes.h design note 5) when the key index cannot grow: a step whose groups
    are held ones that change (written in place first: new extremes, deleted extremes, a group emptied) and thousands
    of new ones (whose puts need a larger table) under a budget of the bytes the indexes hold, set just before the
    emit (after the probe, which allocates nothing). The puts are refused, what was stored is undone (the index whole,
    not broken, a refusal counted, every group's totals as the probe read them, as many keys) and the trace drops the
    index (IndexDroppedWarning): the step runs on its batches, and every step's view equals the model's; before that
    step, the probe's slots served the stores (``in_place``)."""
    import warnings

    from dbsp_core import _zset

    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    c.output("g", c.input("t", schema).group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v")))
    rng = np.random.default_rng(25)
    bag: Counter = Counter((int(k), int(v)) for k, v in zip(rng.integers(0, 200, 600), rng.integers(0, 50, 600)))
    steps = [Counter(bag)]
    for i in range(6):
        d: Counter = Counter()
        for k in range(0, 200, 3):  # held groups: each group's min deleted, a new max, one group emptied
            rows = sorted(r for r in bag + d if r[0] == k and (bag + d)[r] > 0)
            if rows:
                d[rows[0]] -= 1
            d[(k, 60 + i)] += 1
        for r in [r for r in bag + d if r[0] == 199 + i]:
            d[r] -= (bag + d)[r]
        if i == 3:  # new groups: the index must grow
            for k in range(1000, 5000):
                d[(k, k % 7)] += 1
        d = Counter({r: w for r, w in d.items() if w})
        bag.update(d)
        bag = Counter({r: w for r, w in bag.items() if w > 0})
        steps.append(d)
    budget = _zset.keyindex_budget()
    emitted = _ExtremesState._emitted

    undone: list = []

    def tight(self, view, group_row, gkh, old, nw, ix):  # the index cannot grow: the puts of new groups are refused
        keys = len(ix)
        _zset.keyindex_budget(_zset.keyindex_total_bytes())
        try:
            return emitted(self, view, group_row, gkh, old, nw, ix)
        except (MemoryError, ValueError):
            now = ix.get(view, self.keypos, gkh, np.zeros_like(old), sel=group_row)
            undone.append((ix.broken, ix.refusals, len(ix) == keys, bool((now == old).all())))
            raise
    view: Counter = Counter()
    model: Counter = Counter()
    try:
        with dbsp.Pipeline(c, workers=workers) as p:
            for i, d in enumerate(steps):
                p.push("t", dbsp.ZSet.from_rows(list(d), schema, weights=list(d.values())))
                if i == 4:
                    monkeypatch.setattr(_ExtremesState, "_emitted", tight)
                    assert sum(s.emit.in_place for s in _states(p)) >= 3
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    out = p.step()["g"]
                _zset.keyindex_budget(budget)
                monkeypatch.setattr(_ExtremesState, "_emitted", emitted)
                if i == 4 and not BUDGET:
                    assert any(issubclass(w.category, dbsp.IndexDroppedWarning) for w in seen), [str(w) for w in seen]
                    assert undone and all(u == (False, 1, True, True) for u in undone), undone
                view.update(out.to_dict())
                view = Counter({r: w for r, w in view.items() if w})
                model.update(d)
                model = Counter({r: w for r, w in model.items() if w > 0})
                groups: dict = {}
                for (k, v), m in model.items():
                    n, lo, hi = groups.get(k, (0, v, v))
                    groups[k] = (n + m, min(lo, v), max(hi, v))
                assert dict(view) == {(k,) + g: 1 for k, g in groups.items()}, f"step {i}, W={workers}"
            for w in range(workers):
                for tr in p.traces(w).values():
                    tr.check()
    finally:
        _zset.keyindex_budget(budget)
