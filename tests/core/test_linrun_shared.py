"""The one-call linear group-by step's shared exports and key-hash order (csrc/linrun.h invariant 8, cdata.h invariant 5).

``_zset.LinearRun.step`` alone against a dict model over random changes with weights (deletions, rows cancelling in
a step, groups going to zero and coming back, two key columns, steps of a few and of thousands of groups, where the
key index's tags collide): with and without ``keyorder``, the trace batch holds each changed key's old and new
totals, the output the same rows finalized, the index the running totals; without it the batch is in canonical
order (csrc/rows.h invariant 2), with it in key-hash order with each group's new row first; the output's shown slot
columns are the trace batch's buffers, and either batch outlives the other. Then pipelines at W = 1 and 2 whose
totals are kept per key (the step asks for key-hash order) against the model, across a rolled-back poisoned step
and a step whose per-key record fails (its batch then inserted: put in canonical order first). DBSP_LINRUN_SEED
replays the random rows."""

from __future__ import annotations

import gc
import os
import random
import weakref
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.envvars import settings
from dbsp_core.errors import StepError
from dbsp_core.operators.aggregate import _LinearState
from dbsp_core.trace.keyindex import PerKeyTotals
from test_linear_run import SCHEMA, VIEWS, _circuit, _cstep, _delta, _model, _push, add_views, changed_rows

SEED = int(os.environ.get("DBSP_LINRUN_SEED", random.randrange(2**31)))
BUDGET = settings().memory_limit is not None  # DBSP_MEMORY_LIMIT: every trace keeps its totals in batches
BSCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int32()), ("p_0", pa.int64()), ("p_1", pa.int64()),
                     ("p_2", pa.int64())])
OSCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int32()), ("n", pa.int64()), ("total", pa.int64())])


def _change(rng: np.random.Generator, step: int) -> tuple[pa.Table, np.ndarray]:
    """A step's rows (k, j, v, c) and weights: mostly a few dozen rows over 40 keys, at times thousands over many
    keys (the index's tags collide), at times rows that cancel within the step."""
    n = int(rng.integers(2000, 6000)) if step % 9 == 4 else int(rng.integers(0, 60))
    kmax = 5000 if step % 9 == 4 else 20
    k, j = rng.integers(0, kmax, n), rng.integers(0, 2, n).astype(np.int32)
    v, c = rng.integers(-5, 5, n), rng.integers(0, 2, n)
    w = rng.choice([-2, -1, 1, 1, 2, 3], n)
    if step % 7 == 3:  # weights that cancel: no group changes
        k, j, v, c = np.repeat(k, 2), np.repeat(j, 2), np.repeat(v, 2), np.repeat(c, 2)
        w = np.tile([1, -1], n)
    return pa.table({"k": k, "j": j, "v": v, "c": c}), w


@pytest.mark.parametrize("keyorder", [False, True])
def test_linear_run_exports_and_order_against_a_dict_model(keyorder: bool) -> None:
    """Per step: the batch's rows are the model's changed totals (old -1, new +1), the output's those rows
    finalized (the sum null where its count of values, slot 2, is 0), the index the model's totals; the order is
    canonical (keyorder off) or key hashes ascending with a group's new row before its old one (on); the output's
    n and total columns are the batch's p_0 and p_1 buffers, and each batch reads the same after the other is
    released."""
    rng = np.random.default_rng(SEED + 31 + keyorder)
    run = _zset.LinearRun([0, 1], [("count", None), ("sum", 2), ("sum", 3)], [0, 1], [-1, 2], True, BSCHEMA, OSCHEMA)
    ix = _zset.KeyIndex([pa.int64(), pa.int32()], 3)
    totals: dict[tuple, list[int]] = {}
    big = 0
    for step in range(60):
        t, w = _change(rng, step)
        old = {key: list(s) for key, s in totals.items()}
        for k, j, v, c, ww in zip(*[t.column(i).to_pylist() for i in range(4)], w.tolist()):
            s = totals.setdefault((k, j), [0, 0, 0])
            s[0] += ww
            s[1] += ww * v
            s[2] += ww * c
        if step % 5 == 2 and totals:  # a group deleted whole (to zero; a later step brings it back)
            key = sorted(totals)[int(rng.integers(len(totals)))]
            s = totals[key]
            if s[0]:
                t = pa.concat_tables([t, pa.table({"k": [key[0]], "j": pa.array([key[1]], pa.int32()),
                                                   "v": [s[1]], "c": [s[2]]})])
                w = np.concatenate([w, [-1]])
                s[0] -= 1  # one row of count 1 carrying the group's sums: the group's totals go to 0
                s[1] = s[2] = 0
                totals[key] = [s[0], 0, 0] if s[0] else [0, 0, 0]
        totals = {key: s for key, s in totals.items() if s[0]}
        batch, out, bw, kh, ordered, distinct = run.step(t, w, ix, None, False, keyorder)  # no tuple kept: the
        # release below must drop the last reference
        want = changed_rows(old, totals)
        want = Counter({(k, j, *s): x for ((k, j), *s), x in want.items()})
        if not want:
            assert batch is None and out is None, step
            continue
        big += batch.num_rows > 1000
        rows = Counter()
        for r, ww in zip(zip(*[batch.column(i).to_pylist() for i in range(5)]), bw.tolist()):
            rows[r] += ww
        assert +rows == +want and -rows == -want, (step, SEED)
        fin = Counter()
        for (k, j, s0, s1, s2), ww in want.items():
            fin[(k, j, s0, s1 if s2 else None)] += ww
        outs = Counter()
        for r, ww in zip(zip(*[out.column(i).to_pylist() for i in range(4)]), bw.tolist()):
            outs[r] += ww
        assert +outs == +fin and -outs == -fin, (step, SEED)
        assert len(kh) == batch.num_rows == out.num_rows and ordered
        if keyorder:  # key-hash order: a group's rows adjacent, its new row (+1) before its old one (-1)
            assert np.all(kh[1:] >= kh[:-1]), (step, SEED)
            same = kh[1:] == kh[:-1]
            assert not np.any(same & ((bw[1:] > 0) | (bw[:-1] < 0))), (step, SEED)
        else:
            assert _zset.check_order(batch, bw, kh, [0, 1]), (step, SEED)
        # the output's shown slots are the batch's buffers (cdata.h invariant 5), and outlive it
        for o, slot in ((2, 2), (3, 3)):
            assert out.column(o).chunk(0).buffers()[1].address == batch.column(slot).chunk(0).buffers()[1].address
        assert out.column(0).chunk(0).buffers()[1].address == batch.column(0).chunk(0).buffers()[1].address
        kept = batch.to_pylist() if step % 2 else out.to_pylist()
        released = weakref.ref(out if step % 2 else batch)
        if step % 2:
            del out
        else:
            del batch
        if released() is not None:  # only a reference cycle keeps it: a full collection (~0.1-0.4 s in a test
            gc.collect()            # process of the suite) only then
        assert released() is None, (step, SEED)
        junk = [np.full(len(kh) * 8, -7, dtype=np.int64) for _ in range(8)]  # (reuse of freed memory shows)
        assert (batch.to_pylist() if step % 2 else out.to_pylist()) == kept, (step, SEED)
        del junk
        if totals:
            probe = pa.table({"k": pa.array([key[0] for key in totals], pa.int64()),
                              "j": pa.array([key[1] for key in totals], pa.int32())})
            acc = np.zeros((len(totals), 3), dtype=np.int64)
            ix.get(probe, [0, 1], _zset.hash_columns(probe, [0, 1]), acc)
            assert acc.tolist() == list(totals.values()), (step, SEED)
        assert len(ix) == len(totals), step
    assert big >= 4


@pytest.mark.filterwarnings("ignore::dbsp_core.errors.IndexDroppedWarning")  # (the failed record drops the index)
@pytest.mark.parametrize("workers", [1, 2])
def test_per_key_steps_in_key_order_across_a_rollback_and_a_failed_record(workers: int, monkeypatch) -> None:
    """Totals kept per key (the C step asks for key-hash order only): 40 random steps, at W = 1 and 2, every view
    equal to the model's after each; a poisoned push rolled back twice; at step 20 every per-key record fails
    (MemoryError: the trace falls back to batches, inserting the step's rows, which must be put in canonical order
    first), and every trace's batches stay consolidated in canonical order with their key index matching them
    (``Trace.check``). Under DBSP_MEMORY_LIMIT the totals stay in batches: the same checks, no record to fail."""
    monkeypatch.setattr(_LinearState, "PER_KEY", True)
    rng = np.random.default_rng(SEED + 57 + workers)
    record = PerKeyTotals._pk_record
    failing = [False]

    def pk_record(self, batch, dirty, fresh):  # type: ignore[no-untyped-def]
        if failing[0]:
            raise MemoryError("no room for the dirty keys (test)")
        return record(self, batch, dirty, fresh)

    monkeypatch.setattr(PerKeyTotals, "_pk_record", pk_record)
    bag, view = Counter(), {n: Counter() for n in VIEWS}
    fell = PerKeyTotals.pk_fallbacks
    steps0 = PerKeyTotals.pk_steps
    with dbsp.Pipeline(_circuit(poison=True), workers=workers) as p:
        for i in range(40):
            d = _delta(rng, bag, False)
            _push(p, d)
            if i in (9, 27):  # a change reaching every aggregate, then a node that fails on it: rolled back
                p.push("t", dbsp.ZSet.from_rows([(1, 0, 5), (9, 2, 666), (3, 1, -4)], SCHEMA))
                with pytest.raises(StepError, match="poison") as info:
                    p.step()
                producer, seq = info.value.inputs[-1][1:]
                p.discard(producer, seq)
            failing[0] = i == 20
            got = {n: z.to_dict() for n, z in p.step().items()}
            failing[0] = False
            bag.update(d)
            bag = Counter({r: w for r, w in bag.items() if w})
            add_views(view, got)
            assert {n: dict(v) for n, v in view.items()} == _model(bag), f"step {i} (seed {SEED})"
            if i in (19, 21, 39):
                for w in range(p.workers):
                    for tr in p.traces(w).values():
                        tr.check()
        served = _cstep(p)
    assert served > 0
    if not BUDGET:  # (under a budget the traces keep their totals in batches: canonical steps, no record)
        assert PerKeyTotals.pk_steps > steps0
        assert PerKeyTotals.pk_fallbacks > fell  # the failed record fell back to inserting the step's batch
