"""The one-call linear step's hashing pass (csrc/lingroup.h, csrc/linrun.h invariant 7) against a dict model.

``_zset.LinearRun`` over random changes into one key index, with keys of several fixed-width layouts (one int64,
int32, float64 with -0.0, 0.0 and NaNs, uint64, two columns), weights that cancel within a step, groups deleted to
zero and brought back, a sum that leaves int64 half way through a step (the hashing pass declines it and the general
engine, whose sums carry, serves it), and index tags cut to a few bits so that keys collide in them: the trace
batch, the output and the index equal the model's after every step, and the steps the pass should serve it served
(``LinearRun.fused_steps``). Then whole pipelines at W = 1 and 2 over such keys, with a step rolled back after the
aggregates stored their totals: the views equal the model, the traces' key indexes their batches, and the pass
served the steps (``_zset.lingroup_served``). DBSP_LINGROUP_SEED replays the random rows."""

from __future__ import annotations

import math
import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.errors import StepError, WeightOverflowError
from test_linear_run import _check_traces as check_traces, add_views, changed_rows

SEED = int(os.environ.get("DBSP_LINGROUP_SEED", random.randrange(2**31)))
BIG = 2**62
LAYOUTS = {  # name: key columns' types
    "int64": [pa.int64()],
    "int32": [pa.int32()],
    "float64": [pa.float64()],
    "uint64": [pa.uint64()],
    "two": [pa.int64(), pa.int16()],
}
FLOATS = [-0.0, 0.0, 1.5, -2.25, float("nan"), 3.0, 1e300, -7.0]


@pytest.fixture
def hash_bits():
    yield _zset.keyindex_test_hash_bits
    _zset.keyindex_test_hash_bits(0)


def _canon(x):
    """A key value as row identity sees it (column.h invariant 2): -0.0 is 0.0, every NaN alike."""
    if isinstance(x, float):
        return "nan" if math.isnan(x) else x + 0.0
    return x


def _keys(rng: np.random.Generator, layout: str, n: int) -> list[tuple]:
    if layout == "float64":
        return [(FLOATS[i],) for i in rng.integers(0, len(FLOATS), n)]
    if layout == "two":
        return list(zip(rng.integers(-3, 3, n).tolist(), rng.integers(0, 3, n).tolist()))
    lo = 0 if layout == "uint64" else -6
    return [(x,) for x in rng.integers(lo, lo + 12, n).tolist()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bits", [0, 2])
def test_hashing_pass_against_a_dict_model(layout: str, bits: int, hash_bits) -> None:
    """40 random steps per key layout (see the module's docstring), the index's tags cut to ``bits`` bits (0: all)."""
    hash_bits(bits)  # before the index is made (the hook's contract)
    rng = np.random.default_rng(SEED + 31 * len(layout) + bits)
    types = LAYOUTS[layout]
    nk = len(types)
    kfields = [(f"k{i}", t) for i, t in enumerate(types)]
    # slots: 0 the row count, 1 the sum of v, 2 and 3 the limbs of v, 4 the sum of c (int32)
    slots = [("count", None), ("sum", nk), ("sum_hi", nk), ("sum_lo", nk), ("sum", nk + 1)]
    bschema = pa.schema(kfields + [(f"p_{j}", pa.int64()) for j in range(len(slots))])
    oschema = pa.schema(kfields + [("n", pa.int64()), ("total", pa.int64())])
    run = _zset.LinearRun(list(range(nk)), slots, [0, 1], [-1, 0], True, bschema, oschema)
    ix = _zset.KeyIndex(types, len(slots))
    totals: dict[tuple, list[int]] = {}
    shown: dict[tuple, tuple] = {}  # a canonical key -> the key values of a row carrying it (for the probe)
    declined = 0
    for step in range(40):
        n = int(rng.integers(0, 50))
        keys = _keys(rng, layout, n)
        v = rng.integers(-2**40, 2**40, n).tolist()
        c = rng.integers(-9, 9, n).tolist()
        w = [int(x) or 1 for x in rng.integers(-2, 3, n)]
        if step % 9 == 4:  # rows that cancel within the step: no group changes
            keys, v, c, w = keys + keys, v + v, c + c, w + [-x for x in w]
        if step % 7 == 2 and totals:  # a key's count brought to zero: its group leaves (later rows bring it back)
            gone = list(totals)[int(rng.integers(len(totals)))]
            keys.append(shown[gone])
            v.append(int(rng.integers(-9, 9)))
            c.append(0)
            w.append(-totals[gone][0])
        if step % 10 == 6:  # a sum that leaves int64 half way (2^62 + 2^62 before the -2^62): declined, still exact
            odd = (FLOATS[2] + 1000.0,) if layout == "float64" else ((77, 1) if layout == "two" else (77,))
            keys += [odd] * 3
            v += [BIG, BIG, BIG]
            c += [0, 0, 0]
            w += [1, 1, -1]
            declined += 1
        if step % 10 == 7:  # the key of the step before removed again
            odd = (FLOATS[2] + 1000.0,) if layout == "float64" else ((77, 1) if layout == "two" else (77,))
            keys.append(odd)
            v.append(BIG)
            c.append(0)
            w.append(-1)
        cols = {f"k{i}": pa.array([k[i] for k in keys], t) for i, t in enumerate(types)}
        t = pa.table({**cols, "v": pa.array(v, pa.int64()), "c": pa.array(c, pa.int32())})
        old = {key: list(s) for key, s in totals.items()}
        for key, vv, cc, ww in zip(keys, v, c, w):
            ck = tuple(_canon(x) for x in key)
            shown.setdefault(ck, key)
            s = totals.setdefault(ck, [0, 0, 0, 0, 0])
            for j, x in enumerate((1, vv, vv >> 32, vv & 0xFFFFFFFF, cc)):
                s[j] += ww * x
        totals = {key: s for key, s in totals.items() if s[0]}  # a group whose count is 0 leaves the index
        batch, out, bw, kh, ordered, distinct = run.step(t, np.array(w, dtype=np.int64), ix)
        want = changed_rows(old, totals)
        if not want:
            assert batch is None and out is None, (step, SEED)
            continue
        rows: Counter = Counter()
        names = bschema.names
        for r, ww in zip(zip(*[batch.column(i).to_pylist() for i in range(len(names))]), bw.tolist()):
            rows[(tuple(_canon(x) for x in r[:nk]), *r[nk:])] += ww
        assert +rows == +want and -rows == -want, (step, SEED)
        outs: Counter = Counter()
        for r, ww in zip(zip(*[out.column(i).to_pylist() for i in range(nk + 2)]), bw.tolist()):
            outs[(tuple(_canon(x) for x in r[:nk]), *r[nk:])] += ww
        fin: Counter = Counter()
        for (key, s0, s1, *_), ww in want.items():
            fin[(key, s0, s1)] += ww
        assert +outs == +fin and -outs == -fin, (step, SEED)
        assert ordered or layout == "two", (step, SEED)  # one key column: its hash is a bijection, no ties
        khs = kh.tolist()
        assert khs == sorted(khs) and khs == _zset.hash_columns(batch, list(range(nk))).tolist(), (step, SEED)
        live = list(totals)
        if live:
            probe = pa.table({f"k{i}": pa.array([shown[key][i] for key in live], t) for i, t in enumerate(types)})
            got = np.zeros((len(live), len(slots)), dtype=np.int64)
            ix.get(probe, list(range(nk)), _zset.hash_columns(probe, list(range(nk))), got)
            assert got.tolist() == [totals[key] for key in live], (step, SEED)
        assert len(ix) == len(live), (step, SEED)
    assert run.steps == 40 and run.fused_steps == 40 - declined, (run.steps, run.fused_steps, declined)
    # a step's own sums past int64 (a count of weights 2^62 + 2^62, a sum of 2^62 + 2^62): the step fails, the index
    # as it was (declined by the hashing pass, whose wrapped sums would have looked fine)
    odd = (5.0,) if layout == "float64" else ((5, 1) if layout == "two" else (5,))
    for v2, w2 in (([0, 0], [2**62, 2**62]), ([BIG, BIG], [1, 1])):
        cols = {f"k{i}": pa.array([odd[i]] * 2, t) for i, t in enumerate(types)}
        t = pa.table({**cols, "v": pa.array(v2, pa.int64()), "c": pa.array([0, 0], pa.int32())})
        before = len(ix)
        with pytest.raises(WeightOverflowError):
            run.step(t, np.array(w2, dtype=np.int64), ix)
        assert len(ix) == before


SCHEMA = pa.schema([("f", pa.float64()), ("i", pa.int32()), ("v", pa.int64())])
VIEWS = {  # name: keys; each counts its rows and sums v
    "f": ("f",),
    "i": ("i",),
    "fi": ("f", "i"),
}


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    for name, keys in VIEWS.items():
        c.output(name, t.group_by(*keys).agg(n=dbsp.count(), total=dbsp.sum("v")))

    def boom(batch: pa.RecordBatch) -> pa.RecordBatch:  # after every aggregate stored its totals: a rollback
        if batch.num_rows and 666 in batch.column("v").to_pylist():
            raise ValueError("poison")
        return batch
    c.output("x", t.flat_map(boom, schema=SCHEMA))
    return c


def _model(bag: Counter) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, keys in VIEWS.items():
        groups: dict = {}
        for (f, i, v), w in bag.items():
            row = {"f": f, "i": i}
            g = groups.setdefault(tuple(row[k] for k in keys), [0, 0])
            g[0] += w
            g[1] += w * v
        out[name] = {key + (n, s): 1 for key, (n, s) in groups.items() if n}
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_hashing_pass_in_pipelines_with_a_rolled_back_step(workers: int) -> None:
    """40 steps of float64 (-0.0 and 0.0 as one key), int32 and two-column keys at W workers, twice a step that a
    later node fails on after the aggregates stored their totals (rolled back and discarded): the views equal the
    model of the rows kept, every trace's key index matches its batches, and the hashing pass served steps."""
    rng = np.random.default_rng(SEED + 5 + workers)
    bag, view = Counter(), {n: Counter() for n in VIEWS}
    served = _zset.lingroup_served()
    with dbsp.Pipeline(_circuit(), workers=workers) as p:
        for step in range(40):
            d: Counter = Counter()
            for _ in range(int(rng.integers(0, 30))):
                d[(float(rng.choice([-0.0, 0.0, 1.5, 2.5])), int(rng.integers(0, 4)),
                   int(rng.integers(-9, 9)))] += int(rng.integers(1, 3))
            live = [r for r, w in bag.items() if w > 0]
            for i in rng.permutation(len(live))[:int(rng.integers(0, 12))]:
                d[live[i]] -= int(rng.integers(1, bag[live[i]] + 1))
            d = Counter({r: w for r, w in d.items() if w})
            if d:
                p.push("t", dbsp.ZSet.from_rows(list(d), SCHEMA, weights=list(d.values())))
            if step in (9, 27):
                p.push("t", dbsp.ZSet.from_rows([(0.0, 1, 5), (-0.0, 2, 666), (1.5, 1, -4)], SCHEMA))
                with pytest.raises(StepError, match="poison") as info:
                    p.step()
                producer, seq = info.value.inputs[-1][1:]
                p.discard(producer, seq)
            got = {n: z.to_dict() for n, z in p.step().items()}
            bag.update(d)
            bag = Counter({r: w for r, w in bag.items() if w})
            add_views(view, got)
            assert {n: dict(v) for n, v in view.items()} == _model(bag), (step, SEED)
        check_traces(p)
    assert _zset.lingroup_served() - served >= 30 * len(VIEWS) // (1 if workers == 1 else 2)
