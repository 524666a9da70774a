"""Reading ``Pipeline.traces`` on one thread while another steps (driver.py invariant 11): the state, the output log and a reopen all equal a dict model of every push.

A read of a trace that keeps its totals per key writes it (its batches synced from the key index, trace invariant
19); done beside a step storing into that index, it lost or doubled totals, which the output then showed after a
rescale or a reopen read the state from the batches (test_rescale_race.py failed so, 1 round in ~250).

Seeds vary per run; ``DBSP_TRACE_READ_SEED`` replays one (printed in every assertion message).
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter

import pyarrow as pa

import dbsp_core as dbsp

from test_rescale_race import KEYS, SCHEMA, circuit, integral, model, rows  # noqa: E402  (the same view and model)

SEED = int(os.environ.get("DBSP_TRACE_READ_SEED", str(random.SystemRandom().randrange(2**31))))
ROUNDS, STEPS = 3, 60


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


def one_round(d: str, seed: int, stats: Counter) -> None:
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
                    for w in range(p.layout.workers):
                        for t in p.traces(w).values():
                            t.parts()  # a read that syncs totals kept per key (trace invariant 19)
                            stats["reads"] += 1
                    steps_seen.add(p.steps)
            except BaseException as e:  # reported below
                errors.append(e)

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


def test_traces_read_on_another_thread_beside_steps_keep_the_state(tmp_path) -> None:
    stats: Counter = Counter()
    for r in range(ROUNDS):
        one_round(str(tmp_path / f"d{r}"), SEED + r, stats)
    assert stats["steps"] == ROUNDS * STEPS
    assert stats["reads"] > 0 and stats["steps_seen_by_reads"] >= 2 * ROUNDS, (
        f"seed {SEED}: the reads did not run between steps: {dict(stats)}")
