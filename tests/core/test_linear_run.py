"""The linear group-by's step in one C call (csrc/linrun.h, ``_zset.LinearRun``; runtime/plan.py design notes 2 and 4).

Over random splits into steps, with deletions and groups that vanish and reappear, at W = 1 and 2, its
outputs equal a dict model's, the unplanned path's and the plan's Python path's (``_LinearGroupBy.C_STEP`` off); it
serves the steps it should (``StepPlan.counts["cstep"]``); across a checkpoint and reopen, and across a StepError
rolled back in the middle of a step after the aggregate stored its totals, the views stay the model's and the key
indexes match their batches (``Trace.check``). DBSP_LINRUN_SEED replays the random rows."""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.errors import StepError, WeightOverflowError
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.plan import _LinearGroupBy
from dbsp_core.trace import Trace

SEED = int(os.environ.get("DBSP_LINRUN_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int64()), ("v", pa.int64())])
VIEWS = {  # name: (keys, aggregates); all fused at W = 1 (counts, int64 sums and an avg)
    "g": (("k",), {"n": lambda: dbsp.count(), "total": lambda: dbsp.sum("v"), "nv": lambda: dbsp.count("v")}),
    "gj": (("k", "j"), {"n": lambda: dbsp.count()}),
    "s": (("j",), {"total": lambda: dbsp.sum("v")}),
    "c": (("j",), {"nv": lambda: dbsp.count("v")}),  # v counted, not summed: its nulls too send the step back
    "a": (("k",), {"m": lambda: dbsp.avg("v"), "n": lambda: dbsp.count()}),  # limb slots, a float64 result
}
W2_VIEWS = len(VIEWS) - 1  # the avg's chain is fused at W = 1 only (runtime/plan.py _CGroupBy)


def _circuit(poison: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    for name, (keys, aggs) in VIEWS.items():
        c.output(name, t.group_by(*keys).agg(**{a: f() for a, f in aggs.items()}))
    if poison:
        add_poison(c, t, SCHEMA)
    return c


def add_poison(c: dbsp.Circuit, t, schema: pa.Schema) -> None:
    """A later node of ``c`` over ``t`` that fails on a row with v == 666, after every aggregate stored its step's
    totals: a step that must roll back."""
    def boom(batch: pa.RecordBatch) -> pa.RecordBatch:
        if batch.num_rows and 666 in batch.column("v").to_pylist():
            raise ValueError("poison")
        return batch
    c.output("x", t.flat_map(boom, schema=schema))


def _model(bag: Counter) -> dict[str, dict]:
    """Each view's rows (weight 1) over the multiset ``bag`` of (k, j, v) rows; a group exists while it has rows."""
    out: dict[str, dict] = {}
    for name, (keys, aggs) in VIEWS.items():
        groups: dict = {}
        for (k, j, v), w in bag.items():
            g = groups.setdefault(tuple({"k": k, "j": j}[x] for x in keys), [0, 0, 0])
            g[0] += w
            if v is not None:
                g[1] += w * v
                g[2] += w
        rows = {}
        for key, (n, s, nv) in groups.items():
            if n:
                avg = float(np.longdouble(s) / np.longdouble(nv)) if nv else None  # as Aggregate.finalize divides
                vals = {"n": n, "total": s if nv else None, "nv": nv, "m": avg}
                rows[key + tuple(vals[a] for a in aggs)] = 1
        out[name] = rows
    return out


def _delta(rng: np.random.Generator, bag: Counter, nulls: bool) -> Counter:
    """A step's change: inserts (some of them rows already there), deletions of rows in the bag, and at times every
    row of one k deleted (its groups vanish; later inserts of that k bring them back)."""
    d: Counter = Counter()
    for _ in range(int(rng.integers(0, 40))):
        v = None if nulls and rng.random() < 0.1 else int(rng.integers(-20, 20))
        d[(int(rng.integers(0, 8)), int(rng.integers(0, 3)), v)] += int(rng.integers(1, 3))
    live = [r for r, w in bag.items() if w > 0]
    for i in rng.permutation(len(live))[:int(rng.integers(0, 15))]:
        d[live[i]] -= int(rng.integers(1, bag[live[i]] + 1))
    if live and rng.random() < 0.25:
        k = live[int(rng.integers(len(live)))][0]
        for r, w in bag.items():
            if r[0] == k:
                d[r] = -w
    return Counter({r: w for r, w in d.items() if w})


def _push(p: dbsp.Pipeline, d: Counter) -> None:
    if d:
        p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))


def _cstep(p: dbsp.Pipeline) -> int:
    return sum(wk.plan.counts["cstep"] for wk in p.executor._workers)


def _check_traces(p: dbsp.Pipeline) -> None:
    for w in range(p.workers):
        for tr in p.traces(w).values():
            tr.check()  # batches consolidated, the key index equal to the sums over them


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("nulls", [False, True])
def test_one_call_step_matches_model_unplanned_and_python_paths(workers: int, nulls: bool, monkeypatch) -> None:
    """Random splits into 60 steps: every step's output of each view equals the unplanned pipeline's and the plan's
    Python path's, and the integrated views equal the dict model; the C step served every step of the three
    views (W = 1; at W = 2, each worker's received partial rows), but steps with a null in v (they fall back)."""
    rng = np.random.default_rng(SEED + workers + 2 * nulls)
    deltas, bag = [], Counter()
    for _ in range(60):
        d = _delta(rng, bag, nulls)
        bag.update(d)
        bag = Counter({r: w for r, w in bag.items() if w})
        deltas.append(d)
    outs = {}
    for mode in ("c", "python", "unplanned"):
        monkeypatch.setattr(_LinearGroupBy, "C_STEP", mode == "c")
        view: dict[str, Counter] = {n: Counter() for n in VIEWS}
        steps, seen = [], Counter()
        with dbsp.Pipeline(_circuit(), workers=workers, executor=EmbeddedExecutor(step_plan=mode != "unplanned")
                           ) as p:
            for i, d in enumerate(deltas):
                _push(p, d)
                got = {n: z.to_dict() for n, z in p.step().items()}
                steps.append(got)
                seen.update(d)
                for n in VIEWS:
                    view[n].update(got[n])
                    view[n] = Counter({r: w for r, w in view[n].items() if w})
                assert {n: dict(v) for n, v in view.items()} == _model(+seen), f"{mode}, step {i} (seed {SEED})"
            _check_traces(p)
            served = _cstep(p)
        outs[mode] = steps
        with_rows = sum(1 for d in deltas if d)
        if mode != "c":
            assert served == 0
        elif workers == 1 and not nulls:
            assert served == len(VIEWS) * with_rows, (served, with_rows)
        elif workers == 1:  # every view but those whose step had a null in v: "gj" at least
            assert with_rows <= served < len(VIEWS) * with_rows, (served, with_rows)
        else:  # a worker's aggregate runs it over the partial rows it received, when it received any
            assert served >= W2_VIEWS * with_rows // 2, (served, with_rows)
    assert outs["c"] == outs["python"] == outs["unplanned"]


@pytest.mark.parametrize("workers", [1, 2])
def test_one_call_step_across_checkpoint_reopen_and_a_rolled_back_step(tmp_path, workers: int) -> None:
    """A durable pipeline: steps through the C path, a checkpoint and reopen every 15 steps (the key index is
    rebuilt from the batches; until then the step walks them), and twice a push that a later node fails on
    (StepError) after the aggregates stored their totals in their key indexes: rolled back and discarded, the views
    stay the model's of the rows kept, and every trace's key index matches its batches."""
    rng = np.random.default_rng(SEED + 10 + workers)
    path = str(tmp_path / "s")
    p = dbsp.Pipeline(_circuit(poison=True), workers=workers, storage=path)
    bag, view = Counter(), {n: Counter() for n in VIEWS}
    served = 0
    try:
        for i in range(50):
            d = _delta(rng, bag, False)
            _push(p, d)
            if i in (7, 33):  # a change whose rows reach every aggregate, then a node that fails on it
                p.push("t", dbsp.ZSet.from_rows([(1, 0, 5), (9, 2, 666), (3, 1, -4)], SCHEMA))
                with pytest.raises(StepError, match="poison") as info:
                    p.step()
                producer, seq = info.value.inputs[-1][1:]
                p.discard(producer, seq)
                _check_traces(p)
            got = {n: z.to_dict() for n, z in p.step().items()}
            bag.update(d)
            bag = Counter({r: w for r, w in bag.items() if w})
            add_views(view, got)
            assert {n: dict(v) for n, v in view.items()} == _model(bag), f"step {i} (seed {SEED})"
            if i % 15 == 14:
                served += _cstep(p)
                _check_traces(p)
                p.checkpoint()
                p.close()
                p = dbsp.Pipeline.open(path, _circuit(poison=True))
        served += _cstep(p)
    finally:
        p.close()
    assert served >= 30 * (len(VIEWS) if workers == 1 else W2_VIEWS / 2), served


def test_overflow_in_the_one_call_step_changes_nothing() -> None:
    """A sum that leaves int64 fails the step (DBSP_EOVERFLOW is found before anything is stored: csrc/linrun.h
    invariant 4) with the aggregate named; after the rollback the next steps go on through the C path."""
    c = dbsp.Circuit()
    c.output("g", c.input("t", SCHEMA).group_by("k").agg(total=dbsp.sum("v")))
    with dbsp.Pipeline(c, workers=1) as p:
        p.push("t", dbsp.ZSet.from_rows([(1, 0, 2**62), (2, 0, 5)], SCHEMA))
        assert p.step()["g"].to_dict() == {(1, 2**62): 1, (2, 5): 1}
        p.push("t", dbsp.ZSet.from_rows([(1, 0, 2**62), (2, 0, 1)], SCHEMA))
        with pytest.raises(StepError) as info:
            p.step()
        assert isinstance(info.value.__cause__, WeightOverflowError), info.value.__cause__
        producer, seq = info.value.inputs[-1][1:]
        p.discard(producer, seq)
        assert p.step()["g"].to_dict() == {}  # the step that waited, without the push discarded
        p.push("t", dbsp.ZSet.from_rows([(1, 0, -1), (2, 0, 1)], SCHEMA))
        assert p.step()["g"].to_dict() == {(1, 2**62): -1, (1, 2**62 - 1): 1, (2, 5): -1, (2, 6): 1}
        assert _cstep(p) == 2
        _check_traces(p)


def add_views(view: dict[str, Counter], got: dict[str, dict]) -> None:
    """Integrate a step's outputs ``got`` into ``view`` (per view, its rows' weights; rows at 0 dropped)."""
    for n, rows in got.items():
        if n in view:
            view[n].update(rows)
            view[n] = Counter({r: w for r, w in view[n].items() if w})


def changed_rows(old: dict, totals: dict) -> Counter:
    """A step's rows of old (-1) and new (+1) totals, ``(key, *slots)``, of the keys whose totals changed."""
    want: Counter = Counter()
    for key in set(old) | set(totals):
        if old.get(key) != totals.get(key):
            if key in old:
                want[(key, *old[key])] -= 1
            if key in totals:
                want[(key, *totals[key])] += 1
    return want


def test_linear_run_kernel_against_a_dict_model() -> None:
    """``_zset.LinearRun`` alone, over random batches with weights into one key index: per step, the trace batch
    holds each changed key's old (-1) and new (+1) totals, the output the same rows finalized (a sum null where its
    non-null count is 0: here a slot of 0 counted values), the index the running totals; a step that changes no
    group returns no rows; a null in a summed column returns None and leaves the index as it was; given a dirty-key
    index, the seventh item says per row of the trace batch whether its key is not in it."""
    rng = np.random.default_rng(SEED + 99)
    bschema = pa.schema([("k", pa.int64()), ("p_0", pa.int64()), ("p_1", pa.int64()), ("p_2", pa.int64())])
    oschema = pa.schema([("k", pa.int64()), ("n", pa.int64()), ("total", pa.int64())])
    # slots: 0 the row count, 1 the sum of v (column 1), 2 a count of weights over rows with c (column 2) odd
    run = _zset.LinearRun([0], [("count", None), ("sum", 1), ("sum", 2)], [0, 1], [-1, 2], True, bschema, oschema)
    ix = _zset.KeyIndex([pa.int64()], 3)
    totals: dict[int, list[int]] = {}
    for step in range(40):
        n = int(rng.integers(0, 60))
        k, v = rng.integers(0, 12, n), rng.integers(-5, 5, n)
        c = rng.integers(0, 2, n)
        w = rng.integers(-2, 3, n)
        w[w == 0] = 1
        if step % 7 == 3:  # weights that cancel: no group changes
            k, v, c = np.repeat(k, 2), np.repeat(v, 2), np.repeat(c, 2)
            w = np.tile([1, -1], n)
        t = pa.table({"k": k, "v": v, "c": c})
        old = {key: list(s) for key, s in totals.items()}
        for key, vv, cc, ww in zip(k.tolist(), v.tolist(), c.tolist(), w.tolist()):
            s = totals.setdefault(key, [0, 0, 0])
            s[0] += ww
            s[1] += ww * vv
            s[2] += ww * cc
        totals = {key: s for key, s in totals.items() if s[0]}
        dirty, dk = None, set()
        if step % 2:  # a totals trace's dirty keys (csrc/linrun.h invariant 5): per row, whether its key is not one
            dk = set(rng.integers(0, 12, 5).tolist())
            dirty = _zset.KeyIndex([pa.int64()], 1)
            kt = pa.table({"k": pa.array(sorted(dk), pa.int64())})
            dirty.add(kt, None, [0], _zset.hash_columns(kt, [0]), [-1])
        got = run.step(t, w, ix) if dirty is None else run.step(t, w, ix, dirty)
        batch, out, bw, kh, ordered, distinct = got[:6]
        if dirty is not None:
            want_fresh = None if batch is None else [key not in dk for key in batch.column(0).to_pylist()]
            assert (got[6] if got[6] is None else got[6].tolist()) == want_fresh, step
        want = changed_rows(old, totals)
        if not want:
            assert batch is None and out is None, step
            continue
        rows = Counter()
        for r, ww in zip(zip(*[batch.column(i).to_pylist() for i in range(4)]), bw.tolist()):
            rows[r] += ww
        assert +rows == +want and -rows == -want, step
        outs = Counter()
        for r, ww in zip(zip(*[out.column(i).to_pylist() for i in range(3)]), bw.tolist()):
            outs[r] += ww
        fin = Counter()
        for (key, s0, s1, s2), ww in want.items():
            fin[(key, s0, s1 if s2 else None)] += ww
        assert Counter({r: x for r, x in outs.items() if x}) == Counter({r: x for r, x in fin.items() if x}), step
        assert len(kh) == batch.num_rows and ordered and distinct in (True, False)
        if totals:
            got = np.zeros((len(totals), 3), dtype=np.int64)
            probe = pa.table({"k": pa.array(list(totals), pa.int64())})
            ix.get(probe, [0], _zset.hash_columns(probe, [0]), got)
            assert got.tolist() == [totals[key] for key in totals], step
        assert len(ix) == len(totals), step
    nulls = pa.table({"k": [1, 2], "v": pa.array([None, 3], pa.int64()), "c": [0, 1]})
    before = len(ix)
    assert run.step(nulls, np.ones(2, dtype=np.int64), ix) is None and len(ix) == before
    assert run.steps == 40


@pytest.mark.parametrize("workers", [1, 2])
def test_one_call_step_past_its_kept_scratch_and_with_most_sums_cancelling(workers: int, monkeypatch) -> None:
    """A first step of 100k groups (past the scratch a LinearRun keeps, csrc/linrun.h invariant 3: freed after it),
    then steps where most groups' rows cancel within the step (few output rows for many groups: the weights and key
    hashes are trimmed to them) and small steps: every output equals the plan's Python path's, the C step served
    them, and the key indexes match their batches."""
    rng = np.random.default_rng(SEED + 7 + workers)
    n = 100_000
    first = pa.table({"k": np.arange(n), "j": rng.integers(0, 3, n), "v": rng.integers(-9, 9, n)}, schema=SCHEMA)
    steps = [(first, np.ones(n, dtype=np.int64))]
    for _ in range(4):  # 20k keys: a row and its deletion each, and 100 of them a row more
        k = rng.integers(0, 2 * n, 20_000)
        v = rng.integers(-9, 9, 20_000)
        rows = pa.table({"k": np.concatenate([k, k, k[:100]]), "j": np.zeros(40_100, dtype=np.int64),
                         "v": np.concatenate([v, v, v[:100]])}, schema=SCHEMA)
        steps.append((rows, np.concatenate([np.ones(20_000), -np.ones(20_000), np.ones(100)]).astype(np.int64)))
    for _ in range(4):
        m = int(rng.integers(1, 50))
        steps.append((pa.table({"k": rng.integers(0, n, m), "j": rng.integers(0, 3, m), "v": rng.integers(-9, 9, m)},
                               schema=SCHEMA), rng.choice([-1, 1, 2], m).astype(np.int64)))
    outs = {}
    for mode in ("c", "python"):
        monkeypatch.setattr(_LinearGroupBy, "C_STEP", mode == "c")
        with dbsp.Pipeline(_circuit(), workers=workers) as p:
            got = []
            for t, w in steps:
                p.push("t", t, weights=w)
                got.append({name: z.to_dict() for name, z in p.step().items()})
            _check_traces(p)
            served = _cstep(p)
        outs[mode] = got
        assert served >= ((len(VIEWS) if workers == 1 else W2_VIEWS) * (len(steps) - 2) if mode == "c" else 0), served
    assert outs["c"] == outs["python"]


@pytest.mark.parametrize("mode", ["c", "python"])
def test_a_fresh_batch_of_the_group_by_pins_only_its_own_bytes(monkeypatch, mode) -> None:
    """A step of 5,000 new groups, through the one-call C step (``LinearRun``) and through ``linear_step``: the
    trace's fresh batch's weights and key hashes hold allocations of their own size (malloc_usable_size, glibc),
    no slice of a buffer sized for twice the groups, so the budget's count of a batch's bytes (spill.py
    ``batch_bytes``) is what it pins. Watched fail on the code before: C 80,008 usable bytes under 40,000 (the
    room kept while the rows filled half of it), Python a slice of a 560,000-byte buffer."""
    import ctypes

    usable = ctypes.CDLL(None).malloc_usable_size
    usable.restype, usable.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    monkeypatch.setattr(_LinearGroupBy, "C_STEP", mode == "c")
    from dbsp_core.operators.aggregate import _LinearState

    monkeypatch.setattr(_LinearState, "PER_KEY", False)  # the step's batch in the trace (not totals per key)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    n = 5_000
    with dbsp.Pipeline(c) as p:
        p.push("t", pa.table({"k": np.arange(n), "j": np.zeros(n, np.int64), "v": np.arange(n)}, schema=SCHEMA))
        p.step()
        assert (_cstep(p) > 0) == (mode == "c")
        (b,) = [b for tr in p.traces(0).values() for b in tr.batches if len(b)]
        assert len(b) == n
        for a in (b.zset.weights, b.key_hash):
            assert not isinstance(a.base, np.ndarray) or a.base.nbytes == a.nbytes, (a.base.nbytes, a.nbytes)
            assert usable(a.ctypes.data) < a.nbytes + 64, (usable(a.ctypes.data), a.nbytes)
