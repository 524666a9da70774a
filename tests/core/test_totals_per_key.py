"""A linear aggregate's totals kept per key (dbsp_core/trace/levels.py invariant 19, ``DBSP_TOTALS_PER_KEY``;
runtime/plan.py design note 5): its steps store the totals in the key index only, and the totals trace's batches are
brought up to date from it when something reads them.

Over random group-by circuits (keys of ints and strings, counts, int64 sums, counts of a column with nulls, avgs) and
random splits into steps after a load, at W = 1 and 2, plan on and off: with totals per key on, every step's output
equals the run with it off, and the synced traces' content (consolidated) equals it too, their batches and key
indexes passing ``Trace.check``; steps did store per key (``PerKeyTotals.pk_steps``). The same across checkpoints and
reopens, steps rolled back (StepError: the undo log of the index's changes in place, rollback.py invariant 3), live
rescales, and under a memory budget (the traces then keep their totals in batches). DBSP_PERKEY_SEED replays."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import StepError
from dbsp_core.operators.aggregate import _LinearState
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.trace.keyindex import PerKeyTotals
# the same circuits, steps and state reads as the held merges' tests
from tests.core.test_totals_hold import (BUDGET, SCHEMA, _circuit, _deltas, _push, _random_case, _state,
                                         _totals)

SEED = int(os.environ.get("DBSP_PERKEY_SEED", random.randrange(2**31)))


def _per_key(p: dbsp.Pipeline) -> int:
    return sum(tr.totals_per_key for _, tr in _totals(p))


def _run(views: list, deltas: list, on: bool, workers: int, monkeypatch, plan: bool = True, read_every: int = 0,
         **kw) -> tuple:
    monkeypatch.setattr(_LinearState, "PER_KEY", on)
    outs = []
    steps0 = PerKeyTotals.pk_steps
    with dbsp.Pipeline(_circuit(views), workers=workers, executor=EmbeddedExecutor(step_plan=plan), **kw) as p:
        for i, d in enumerate(deltas):
            _push(p, d)
            outs.append({n: z.to_dict() for n, z in p.step().items()})
            if read_every and i % read_every == read_every - 1:
                outs.append(_state(p))  # a read between steps: the traces synced, and stepping on from there
        return outs, _state(p), PerKeyTotals.pk_steps - steps0, _per_key(p)


@pytest.mark.parametrize("case", range(6))
def test_totals_per_key_give_the_outputs_and_state_of_batches(case: int, monkeypatch) -> None:
    """Random circuits over random splits: totals per key against batches, step by step, and the synced state."""
    rng = np.random.default_rng(SEED + case)
    views, workers, nulls = _random_case(rng, case)
    deltas = _deltas(rng, 120, nulls)
    read_every = (0, 7, 30)[case % 3]
    for plan in (True, False):
        off, state_off, steps_off, _ = _run(views, deltas, False, workers, monkeypatch, plan, read_every)
        on, state_on, steps_on, kept = _run(views, deltas, True, workers, monkeypatch, plan, read_every)
        for i, (a, b) in enumerate(zip(on, off)):
            assert a == b, f"plan {plan}, step {i}, views {views}, W={workers} (DBSP_PERKEY_SEED={SEED})"
        assert len(on) == len(off) and state_on == state_off, f"plan {plan} (DBSP_PERKEY_SEED={SEED})"
        assert steps_off == 0
        if BUDGET:  # DBSP_MEMORY_LIMIT: every trace has a batch store and keeps its totals in batches
            assert steps_on == 0 and kept == 0
        else:
            assert steps_on >= len(deltas) // 2 and kept == len(views) * workers, (steps_on, kept)  # (empty steps store nothing)


def test_totals_per_key_across_checkpoint_reopen_rollback_and_live_rescale(tmp_path, monkeypatch) -> None:
    """A durable pipeline stepping with totals per key and one without, in lockstep: a checkpoint and reopen every
    40 steps, pushes a later node fails on (StepError) after the aggregates stored their totals, discarded (the
    index's changes undone), live rescales 1 -> 2 -> 1 workers. Outputs step by step and the totals equal."""
    rng = np.random.default_rng(SEED + 100)
    views = [(("k",), ["n", "total"]), (("s",), ["n", "nv"]), (("k", "j"), ["m"])]
    deltas = _deltas(rng, 150, False)
    pipes = {}
    steps0 = PerKeyTotals.pk_steps
    for on in (True, False):
        monkeypatch.setattr(_LinearState, "PER_KEY", on)
        pipes[on] = dbsp.Pipeline(_circuit(views, poison=True), workers=1, storage=str(tmp_path / f"p{on}"))
    poisoned = set(int(x) for x in rng.choice(range(5, 150), 12, replace=False))
    try:
        for i, d in enumerate(deltas):
            outs = {}
            for on in (True, False):
                monkeypatch.setattr(_LinearState, "PER_KEY", on)
                p = pipes[on]
                if i in (50, 110):
                    p.rescale(workers=2 if p.workers == 1 else 1)
                _push(p, d)
                if i in poisoned:
                    p.push("t", dbsp.ZSet.from_rows([(1, 0, 5, "s1"), (9, 2, 666, "s9")], SCHEMA))
                    with pytest.raises(StepError, match="poison") as info:
                        p.step()
                    producer, seq = info.value.inputs[-1][1:]
                    p.discard(producer, seq)
                outs[on] = {n: z.to_dict() for n, z in p.step().items()}
                if i % 40 == 39:
                    p.checkpoint()
                    p.close()
                    pipes[on] = p = dbsp.Pipeline.open(str(tmp_path / f"p{on}"), _circuit(views, poison=True))
            assert outs[True] == outs[False], f"step {i} (DBSP_PERKEY_SEED={SEED})"
            if i % 25 == 24:
                assert _state(pipes[True]) == _state(pipes[False]), f"step {i} (DBSP_PERKEY_SEED={SEED})"
        assert _state(pipes[True]) == _state(pipes[False])
        assert BUDGET or PerKeyTotals.pk_steps - steps0 >= len(deltas)
    finally:
        for p in pipes.values():
            p.close()


def test_totals_per_key_under_a_memory_budget_keep_batches(tmp_path, monkeypatch) -> None:
    """With every batch spilled (memory_limit of a byte) a totals trace belongs to a batch store and keeps its totals
    in batches: outputs and state equal the run without, and no step stored per key."""
    rng = np.random.default_rng(SEED + 200)
    views = [(("k",), ["n", "total"]), (("s",), ["nv"])]
    deltas = _deltas(rng, 80, False)
    off, state_off, _, _ = _run(views, deltas, False, 1, monkeypatch)
    on, state_on, steps, kept = _run(views, deltas, True, 1, monkeypatch, memory_limit=1, spill_dir=str(tmp_path))
    assert on == off and state_on == state_off
    assert steps == 0 and kept == 0


def test_size_figures_count_the_unsynced_totals_without_a_sync(monkeypatch) -> None:
    """Metrics (state bytes, per shard) and the profile (state rows and bytes) of aggregates keeping totals per key
    count the totals the batches lack yet (``Trace.unsynced_size``) and sync nothing. Insert-only steps of counts
    and sums change every dirty key's totals, so the rows the next sync inserts are exactly the estimate: its rows,
    bytes and bytes per shard are checked against the batch the sync then inserts. (Before the fix: the figures
    read the batches only, 0 rows for an aggregate never synced.)"""
    if BUDGET:
        pytest.skip("under a memory budget the totals are kept in batches (nothing unsynced to count)")
    monkeypatch.setattr(_LinearState, "PER_KEY", True)
    rng = np.random.default_rng(SEED + 300)
    views = [(("k",), ["n", "total"]), (("s",), ["n"])]
    with dbsp.Pipeline(_circuit(views), workers=2) as p:
        bits = p.layout.shard_bits
        for i in range(12):
            rows = [(int(k), int(rng.integers(0, 3)), int(rng.integers(-50, 50)), f"s{int(k) % 40}")
                    for k in rng.integers(0, 300, int(rng.integers(20, 120)))]
            p.push("t", dbsp.ZSet.from_rows(rows, SCHEMA))
            p.step()
            if i == 5:
                _state(p)  # synced half way: later steps record keys the batches hold a row for (a -1 and a +1)
        syncs0 = PerKeyTotals.pk_syncs
        prof = {r["operator"]: r for r in p.profile()["operators"]}
        m = p.metrics()
        assert PerKeyTotals.pk_syncs == syncs0, "a size figure synced"
        per_op: dict = {}
        for w in range(p.workers):
            want_total, want_shards = 0, np.zeros(1 << bits)
            for name, tr in p.executor.traces(w).items():  # the live traces: this test patches one
                placed, pending = tr.parts(sync=False)
                brows = sum(len(b) for b in placed + pending)
                bbytes = sum(int(b.zset.data.nbytes) + int(b.zset.weights.nbytes) + int(b.key_hash.nbytes)
                             for b in placed + pending)
                for b in placed + pending:
                    if len(b):
                        want_shards += np.diff(b.shard_bounds(bits, near=True)) * ((
                            int(b.zset.data.nbytes) + int(b.zset.weights.nbytes) + int(b.key_hash.nbytes)) / len(b))
                urows, ubytes, _ = tr.unsynced_size()
                if tr.totals_per_key:
                    assert urows > 0, name
                    got: list = []
                    monkeypatch.setattr(tr, "insert", lambda b, _tr=tr, **kw: (got.append(b), type(_tr).insert(_tr, b, **kw))[1],
                                        raising=False)
                    tr._pk_sync()  # the sync the figures did not do: exactly the rows counted
                    monkeypatch.delattr(tr, "insert")
                    (b,) = got
                    assert len(b) == urows, (name, len(b), urows)
                    sbytes = int(b.zset.data.nbytes) + int(b.zset.weights.nbytes) + int(b.key_hash.nbytes)
                    assert abs(sbytes - ubytes) <= 0.01 * sbytes, (name, sbytes, ubytes)
                    want_shards += np.diff(b.shard_bounds(bits)) * (sbytes / len(b))
                else:
                    assert urows == ubytes == 0, name
                want_total += bbytes + ubytes
                acc = per_op.setdefault(name.rsplit(".", 1)[0], [0, 0])
                acc[0] += brows + urows
                acc[1] += bbytes + ubytes
            sb = m["state_bytes"][w]
            assert sb["total"] == want_total, (w, sb["total"], want_total)
            shards = np.zeros(1 << bits)
            for s, n in sb["shards"].items():
                shards[s] = n
            assert np.allclose(shards, want_shards, rtol=0.02, atol=64), (w, sb["shards"])
        aggs = [op for op in per_op if op.startswith("aggregate")]
        assert len(aggs) == len(views)
        for op, (rows, nbytes) in per_op.items():
            assert prof[op]["state_rows"] == rows and prof[op]["state_bytes"] == nbytes, (op, prof[op], rows, nbytes)
            if op in aggs:
                assert rows > 0



def test_dbsp_totals_per_key_turns_the_switch_on_and_off(monkeypatch) -> None:
    """``DBSP_TOTALS_PER_KEY=1`` (and unset, the default): totals per key; ``0``: the step batches' path (each step
    inserts its batch, no step stored per key). Through the environment setting itself (``_LinearState.PER_KEY``
    left at None, as in a pipeline): outputs and state equal either way."""
    from dbsp_core import envvars

    assert envvars.load({}).totals_per_key is True
    assert envvars.load({"DBSP_TOTALS_PER_KEY": ""}).totals_per_key is True  # blank counts as unset
    assert envvars.load({"DBSP_TOTALS_PER_KEY": "0"}).totals_per_key is False
    assert envvars.load({"DBSP_TOTALS_PER_KEY": "1"}).totals_per_key is True
    monkeypatch.setattr(_LinearState, "PER_KEY", None)
    rng = np.random.default_rng(SEED + 400)
    views = [(("k",), ["n", "total"]), (("s",), ["nv", "m"])]
    deltas = _deltas(rng, 40, True)
    got = {}
    for value in ("1", "0", None):  # None: unset, the default (on)
        env = {k: v for k, v in os.environ.items() if k != "DBSP_TOTALS_PER_KEY"}
        if value is not None:
            env["DBSP_TOTALS_PER_KEY"] = value
        monkeypatch.setattr(envvars, "_current", envvars.load(env))
        outs = []
        steps0 = PerKeyTotals.pk_steps
        with dbsp.Pipeline(_circuit(views), workers=2) as p:
            for d in deltas:
                _push(p, d)
                outs.append({n: z.to_dict() for n, z in p.step().items()})
            kept, stored = _per_key(p), PerKeyTotals.pk_steps - steps0
            got[value] = outs, _state(p)
        if value == "0" or BUDGET:  # (under a memory budget the totals are in batches either way)
            assert kept == 0 and stored == 0, (value, kept, stored)
        else:
            assert kept == len(views) * 2 and stored >= len(deltas), (kept, stored)
    assert got["1"] == got["0"] == got[None]


def test_a_step_whose_sum_overflows_is_rolled_back_with_totals_per_key(monkeypatch) -> None:
    """At W=2 a key's sum overflowing int64 fails the step (a StepError naming the aggregate) on one worker while the
    other stored its keys' totals into its key index: the rollback takes them back (``KeyIndex.take_back``), which
    must subtract what the step added (a sum of INT64_MIN: negating the weight first overflowed, and the rollback
    itself failed), and the view after it is DuckDB's (tests/core/test_integer_range.py's check). The case of a key
    whose rows overflow one at a time: test_totals_per_key_rollback.py."""
    import pyarrow as pa

    from tests.core.test_integer_range import run

    monkeypatch.setattr(_LinearState, "PER_KEY", True)
    low = -(2**63)
    for workers in (1, 2):
        assert run(pa.int64(), [[((0, low), 1), ((0, low), 1), ((1, low), 1)]], workers, True, False, "fixed") >= 0
