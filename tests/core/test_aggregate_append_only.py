"""An append-only min/max (operators/aggregate.py invariants 7 and 8) against a dict model: the aggregates that reduce
their change (one min/max and row counts), whose step hands the kernel the change itself, every row, and groups it
once; and those over a string, which reduce their change before indexing it.

Random append-only steps, small ones and ones far above ``REDUCE_ROWS``, with repeated keys (bags: weight 2 too),
null values (groups whose values are all null), ties of the extreme, string, nullable and multi-column keys, W = 1
and 2; the view is checked after every step. Each step of the aggregate is watched: when the totals' key index
serves it, the kernel's view holds every row of the step's change (no reduction before it, so the key columns are
grouped once) and the aggregate reduced nothing itself; a string extreme's large changes are reduced (at W = 1 by
the aggregate); at W = 2 the exchange before the aggregate reduced on the senders.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.envvars import settings
from dbsp_core.operators.aggregate import Aggregate, _ExtremesState

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64()), ("t", pa.timestamp("ms")),
                    ("m", pa.utf8())])
WORDS = ["", "a", "ab", "ba", "x" * 17, "x" * 16 + "y", "2026-11-29"]
# (group keys, aggregates as (output name, kind, column)): a string key, a nullable multi-column key, an int key
SHAPES = {
    "string key, max": (("s",), (("hi", "max", "v"),)),
    "two keys, count and min": (("k", "s"), (("n", "count", None), ("lo", "min", "v"))),
    "int key, count and max of a timestamp": (("k",), (("n", "count", None), ("hi", "max", "t"))),
    # no key index holds a string extreme: the change is reduced, then indexed (q16's max of a minute string)
    "two keys, max of a string": (("k", "s"), (("hi", "max", "m"),)),
    "int key, count and min of a string": (("k",), (("n", "count", None), ("lo", "min", "m"))),
}
STRING_EXTREME = {"two keys, max of a string", "int key, count and min of a string"}


def _row(rng: np.random.Generator, groups: int) -> tuple:
    k = None if rng.random() < 0.05 else int(rng.integers(0, groups))
    s = None if rng.random() < 0.05 else WORDS[int(rng.integers(len(WORDS)))]
    all_null = k is not None and k % 7 == 3  # these groups' values are all null (a null extreme)
    v = None if all_null or rng.random() < 0.2 else int(rng.integers(-5, 6))  # few values: ties of the extreme
    t = None if all_null or rng.random() < 0.2 else int(rng.integers(0, 4)) * 1000
    m = None if all_null or rng.random() < 0.2 else WORDS[int(rng.integers(len(WORDS)))]
    return (k, s, v, t, m)


def _model(bag: Counter, keys: tuple, aggs: tuple) -> dict:
    """The view: per group (by its key columns) its row count and the extremes of its non-null values."""
    pos = {name: i for i, name in enumerate(SCHEMA.names)}
    groups: dict = {}
    for row, w in bag.items():
        g = groups.setdefault(tuple(row[pos[k]] for k in keys), [0, {}])
        g[0] += w
        for name, kind, col in aggs:
            if col is not None and row[pos[col]] is not None:
                g[1].setdefault(name, []).append(row[pos[col]])
    out = {}
    for key, (n, vals) in groups.items():
        cells = []
        for name, kind, col in aggs:
            if kind == "count":
                cells.append(n)
            else:
                vs = vals.get(name)
                x = None if not vs else (max(vs) if kind == "max" else min(vs))
                cells.append(x if x is None or col != "t" else _ts(x))
        out[key + tuple(cells)] = 1
    return out


def _ts(ms: int):
    return pa.scalar(ms, pa.timestamp("ms")).as_py()


def _build(keys: tuple, aggs: tuple, append_only: bool = True) -> dbsp.Circuit:
    c = dbsp.Circuit()
    src = c.input("t", SCHEMA, append_only=append_only)
    fns = {"count": lambda col: dbsp.count(), "min": dbsp.min, "max": dbsp.max}
    c.output("g", src.group_by(*keys).agg(**{name: fns[kind](col) for name, kind, col in aggs}))
    return c


class _Watch:
    """Per worker thread, what each step of an _ExtremesState did: its change's rows, the kernel's view (rows,
    unindexed) when the key index served, and whether the aggregate reduced its change itself."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.steps: list[dict] = []
        self.sent = 0
        self._cur = threading.local()
        step, through, reduced = _ExtremesState._step, _ExtremesState._through_index, _ExtremesState._reduced
        watch = self

        def _step(self, inputs, ctx):
            watch._cur.rec = rec = {"rows": inputs[0].num_rows, "probe": None, "reduced": False}
            watch.steps.append(rec)
            return step(self, inputs, ctx)

        def _through_index(self, view, ix, inserts=False):
            watch._cur.rec["probe"] = (view.num_rows, inserts)
            return through(self, view, ix, inserts=inserts)

        def _reduced(self, z, sender=False):
            out = reduced(self, z, sender=sender)
            if out is not z:
                if sender:
                    watch.sent += 1
                else:
                    watch._cur.rec["reduced"] = True
            return out

        mp.setattr(_ExtremesState, "_step", _step)
        mp.setattr(_ExtremesState, "_through_index", _through_index)
        mp.setattr(_ExtremesState, "_reduced", _reduced)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_append_only_min_max_groups_its_change_once(workers: int, shape: str) -> None:
    keys, aggs = SHAPES[shape]
    seed = [SEED, workers, list(SHAPES).index(shape)]
    print(f"DBSP_TEST_SEED={SEED}")
    rng = np.random.default_rng(seed)
    c = _build(keys, aggs)
    agg = next(op for op in c.nodes if isinstance(op, Aggregate))
    assert agg.append_only  # invariant 7: the circuit saw an inserts-only input
    bag: Counter = Counter()
    view: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        watch = _Watch(mp)
        with dbsp.Pipeline(c, workers=workers) as p:
            for step in range(10):
                big = step % 2 == 1
                n = int(rng.integers(1500, 4000)) if big else int(rng.integers(1, 30))
                rows = [_row(rng, 40 if big else 60) for _ in range(n)]
                w = rng.choice([1, 1, 2], n).tolist()
                for r, x in zip(rows, w):
                    bag[r] += x
                p.push("t", dbsp.ZSet.from_rows(rows, SCHEMA, weights=w))
                for r, x in p.step()["g"].to_dict().items():
                    view[r] += x
                view = Counter({r: x for r, x in view.items() if x})
                assert dict(view) == _model(bag, keys, aggs), f"step {step} (seed {seed})"
            for wk in range(workers):
                traces = p.traces(wk)
                assert all(".values" not in name for name in traces), list(traces)  # totals alone (invariant 7)
                for tr in traces.values():
                    tr.check()
    fused = workers > 1 and settings().step_plan  # the senders reduce in the step plan's fused exchange
    assert (watch.sent > 0) == fused, watch.sent
    if shape in STRING_EXTREME:  # no key index: a large change is reduced before it is indexed (invariant 8)
        assert all(s["probe"] is None for s in watch.steps)
        assert any(s["reduced"] for s in watch.steps) or workers > 1, "no change was reduced"
        return
    probed = [s for s in watch.steps if s["probe"] is not None]
    assert probed, "the totals' key index served no step"
    for s in probed:  # invariant 8: not reduced before the kernel, which groups every row of the change once
        assert s["probe"] == (s["rows"], True) and not s["reduced"], s
    big_steps = [s for s in probed if s["rows"] >= _ExtremesState.REDUCE_ROWS]
    assert big_steps or workers > 1, "no large change reached the kernel whole"


@pytest.mark.parametrize("rows", [5, 3000])
def test_append_only_min_max_refuses_a_retraction(rows: int) -> None:
    """Invariant 7: a retraction that reaches the totals-only state (the driver refuses them at the input; here the
    operator is marked append-only over an input that is not) fails the step, a small change or a large one."""
    c = _build(("s",), (("n", "count", None), ("hi", "max", "v")), append_only=False)
    agg = next(op for op in c.nodes if isinstance(op, Aggregate))
    agg.append_only = True
    with dbsp.Pipeline(c) as p:
        rng = np.random.default_rng([SEED, rows])
        good = [_row(rng, 40) for _ in range(rows)]
        p.push("t", dbsp.ZSet.from_rows(good, SCHEMA))
        p.step()
        gone = (999, "never pushed", 1, None, None)  # a row of no group: its -1 cannot cancel an insertion of this change
        p.push("t", dbsp.ZSet.from_rows(good[:rows // 2] + [gone], SCHEMA, weights=[1] * (rows // 2) + [-1]))
        with pytest.raises(dbsp.DbspError, match=r"aggregate#\d+: a retraction reached a min/max over an append-only"):
            p.step()
