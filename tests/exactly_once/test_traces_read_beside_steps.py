"""Reading ``Pipeline.traces`` on one thread while another steps (driver.py invariant 11): the state, the output log and a reopen all equal a dict model of every push.

A read of a trace that keeps its totals per key writes it (its batches synced from the key index, trace invariant
19); done beside a step storing into that index, it lost or doubled totals, which the output then showed after a
rescale or a reopen read the state from the batches (test_rescale_race.py failed so, 1 round in ~250).

Seeds vary per run; ``DBSP_TRACE_READ_SEED`` replays one (printed in every assertion message).
"""

from __future__ import annotations

import os
import itertools
import random
import threading
from collections import Counter

import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.envvars import settings
from dbsp_core.trace.keyindex import PerKeyTotals

from test_rescale_race import KEYS, SCHEMA, circuit, integral, model, rows  # noqa: E402  (the same view and model)

BUDGET = settings().memory_limit is not None  # DBSP_MEMORY_LIMIT: every trace spills, its totals kept in batches
SEED = int(os.environ.get("DBSP_TRACE_READ_SEED", str(random.SystemRandom().randrange(2**31))))
ROUNDS, STEPS, INSIDE = 3, 60, 10


def state(p: dbsp.Pipeline) -> Counter:
    """The group-by's state, summed over the workers' traces: {(k, count, sum): weight} (the trace's hidden row
    count column dropped)."""
    acc: Counter = Counter()
    for w in range(p.layout.workers):
        for t in p.traces(w).values():
            for b in t.batches:
                for row, wt in b.zset.to_dict().items():
                    acc[row[:3]] += wt
    return Counter({r: w for r, w in acc.items() if w})


def read_all(p: dbsp.Pipeline, stats: Counter) -> None:
    for w in range(p.layout.workers):
        for t in p.traces(w).values():
            t.parts()  # a read that syncs totals kept per key (trace invariant 19)
            stats["reads"] += 1


def one_round(d: str, seed: int, stats: Counter, monkeypatch) -> None:
    """Steps with a reader thread running beside them, and every INSIDE-th store of totals per key starting a
    read on another thread from inside the step (between the key index's store and the trace's record of it), which
    waits up to 50 ms for it: unguarded, that read ran there; guarded, it waits for the step's end."""
    rng = random.Random(seed)
    acked: list[pa.Table] = []
    with dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None) as p:  # (shard_bits: the default)
        first = pa.table({"k": list(range(KEYS)), "v": [rng.randrange(-50, 50) for _ in range(KEYS)]}, schema=SCHEMA)
        p.push("t", first)
        acked.append(first)
        p.step()
        stop = threading.Event()
        errors: list[BaseException] = []
        steps_seen: set[int] = set()

        def reader() -> None:
            try:
                while not stop.is_set():
                    read_all(p, stats)
                    steps_seen.add(p.steps)
            except BaseException as e:  # reported below
                errors.append(e)

        def read_inside() -> None:
            try:
                read_all(p, stats)
            except BaseException as e:  # reported below
                errors.append(e)

        calls = itertools.count()
        inside: list[threading.Thread] = []
        store_totals = PerKeyTotals.store_totals

        def store_with_a_read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.totals_per_key and next(calls) % INSIDE == 0:
                th = threading.Thread(target=read_inside)
                th.start()
                th.join(timeout=0.05)
                inside.append(th)
                stats["reads_started_inside_a_step"] += 1
            return store_totals(self, *args, **kwargs)

        monkeypatch.setattr(PerKeyTotals, "store_totals", store_with_a_read)

        th = threading.Thread(target=reader)
        th.start()
        try:
            for _ in range(STEPS):
                t = rows(rng, 40)
                p.push("t", t)
                acked.append(t)
                p.step()
                stats["steps"] += 1
        finally:
            stop.set()
            th.join(timeout=120)
            for x in inside:
                x.join(timeout=120)
            monkeypatch.undo()
        assert not errors, f"seed {seed} (replay: DBSP_TRACE_READ_SEED={SEED}): {errors[0]!r}"
        stats["steps_seen_by_reads"] += len(steps_seen)
        want = model(acked)
        assert state(p) == want, f"seed {seed} (replay: DBSP_TRACE_READ_SEED={SEED}): the state differs from the model"
        assert integral(p) == want, f"seed {seed} (replay: DBSP_TRACE_READ_SEED={SEED}): the output log differs"
        p.checkpoint()
    with dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None) as q:  # the batches are what a reopen reads
        t = rows(rng, 40)
        q.push("t", t)
        acked.append(t)
        q.step()
        assert integral(q) == model(acked), (f"seed {seed} (replay: DBSP_TRACE_READ_SEED={SEED}): the output log "
                                             f"after a reopen differs from the model")


def test_traces_read_on_another_thread_beside_steps_keep_the_state(tmp_path, monkeypatch) -> None:
    stats: Counter = Counter()
    for r in range(ROUNDS):
        one_round(str(tmp_path / f"d{r}"), SEED + r, stats, monkeypatch)
    inside = 0 if BUDGET else ROUNDS * STEPS // INSIDE  # (under a budget no trace keeps its totals per key)
    assert stats["steps"] == ROUNDS * STEPS and stats["reads_started_inside_a_step"] >= inside, (
        f"seed {SEED}: {dict(stats)}")
    assert stats["reads"] > 0 and stats["steps_seen_by_reads"] >= 2 * ROUNDS, (
        f"seed {SEED}: the reads did not run between steps: {dict(stats)}")
