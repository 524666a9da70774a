"""A pipeline used from several threads at once: pushes run concurrently, steps (and checkpoints, traces, reads) are serialized, and the views equal a dict model of everything pushed, in memory and durable, at W=1 (the integrated view was corrupted) and W=2 (steps deadlocked at the exchange barrier)."""

from __future__ import annotations

import os
import random
import threading

import pyarrow as pa
import pytest

import dbsp_core as dbsp

SEED = int(os.environ.get("DBSP_THREADS_SEED", random.randrange(10**6)))
print(f"\n[threads] DBSP_THREADS_SEED={SEED}")
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
THREADS, PUSHES = 4, 25


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("sums", t.group_by("k").agg(total=dbsp.sum("v"), n=dbsp.count()))
    c.output("all", t.integrate())
    return c


def batch(thread: int, i: int) -> pa.Table:
    rng = random.Random(f"{SEED}/{thread}/{i}")
    n = rng.randint(1, 5)
    return pa.table({"k": [rng.randint(0, 9) for _ in range(n)], "v": [rng.randint(-9, 9) for _ in range(n)]},
                    schema=SCHEMA)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("durable", [False, True])
def test_threads_push_and_step_at_once(tmp_path, workers, durable):
    """THREADS threads each push PUSHES batches and step after every few of them (so steps race each other
    and the pushes); a last step takes what is left. Every step's output is collected; their sum, and the
    integrated view of the last step, must equal the model of all batches."""
    p = dbsp.Pipeline(circuit(), workers=workers, storage=str(tmp_path / "d") if durable else None,
                      checkpoint_interval=0.01 if durable else None)
    outs: list[dict] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def run(t: int) -> None:
        rng = random.Random(f"{SEED}/run/{t}")
        try:
            start.wait()
            for i in range(PUSHES):
                if durable:
                    p.push("t", batch(t, i), producer=f"p{t}", seq=i)
                else:
                    p.push("t", batch(t, i))
                if rng.random() < 0.3:
                    out = p.step()
                    with lock:
                        outs.append(out)
                if rng.random() < 0.1:
                    p.traces(0)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hangs (deadlock)"
    assert not errors, errors
    last = p.step()
    outs.append(last)
    want_sums: dict = {}
    want_rows: dict = {}
    for t in range(THREADS):
        for i in range(PUSHES):
            b = batch(t, i)
            for k, v in zip(b.column("k").to_pylist(), b.column("v").to_pylist()):
                tot, n = want_sums.get(k, (0, 0))
                want_sums[k] = (tot + v, n + 1)
                want_rows[(k, v)] = want_rows.get((k, v), 0) + 1
    acc: dict = {}
    for o in outs:
        for row, w in o["sums"].to_dict().items():
            acc[row] = acc.get(row, 0) + w
            if not acc[row]:
                del acc[row]
    assert acc == {(k, tot, n): 1 for k, (tot, n) in want_sums.items()}
    assert last["all"].to_dict() == want_rows  # integrate() outputs the whole integral at every step
    assert p.steps == len(outs)
    if durable:
        p.close()
        q = dbsp.Pipeline.open(str(tmp_path / "d"), circuit())
        logged: dict = {}
        for _, z in q.read_output("sums"):
            for row, w in z.to_dict().items():
                logged[row] = logged.get(row, 0) + w
                if not logged[row]:
                    del logged[row]
        assert logged == acc
        q.close()
    else:
        p.close()
