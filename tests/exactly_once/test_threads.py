"""A pipeline used from several threads at once: pushes run concurrently, steps (and checkpoints, traces, reads) are serialized, and the views equal a dict model of everything pushed, in memory and durable, at W=1 (the integrated view was corrupted) and W=2 (steps deadlocked at the exchange barrier); and the random-operations harness (ops_harness.py: every public operation from many threads, in memory, durable and staged, also under kill -9) with the defects it found.

Opt-in sizes: ``DBSP_CONCURRENCY_ROUNDS`` (harness rounds over the three modes, default 48; 1,000 is the long run),
``DBSP_CONCURRENCY_KILLS`` (kills that must land per mode, default 2); ``DBSP_CONCURRENCY_SEED`` replays a run.
"""

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


def test_metrics_while_another_thread_rescales_or_closes(tmp_path) -> None:
    """Found by the harness below: ``metrics()`` read the worker count, then each worker's traces, while a rescale
    on another thread changed the workers (ValueError: traces: worker 1 is outside 0..0), or a close emptied them
    (worker 0 is outside 0..-1). It must return a consistent dict, or refuse with DbspError once closed."""
    p = dbsp.Pipeline(circuit(), workers=2, storage=str(tmp_path / "d"), checkpoint_interval=None)
    p.push("t", batch(0, 0))
    p.step()
    stop = threading.Event()
    seen: list = []
    errors: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                m = p.metrics()
                seen.append((m["workers"], len(m["state_bytes"])))
            except dbsp.DbspError as e:  # closed: a clear refusal
                assert "closed" in str(e), e
                return
            except BaseException as e:  # reported below
                errors.append(e)
                return

    th = threading.Thread(target=poll)
    th.start()
    for w in (1, 3, 1, 2, 3, 1, 2) * 2:
        p.rescale(w, batch_shards=4)
    p.close()
    stop.set()
    th.join(timeout=60)
    assert not errors, errors[0]
    assert seen and all(w == n for w, n in seen), seen[:10]
    assert len({w for w, _ in seen}) > 1, f"metrics never saw a rescale happen: {set(seen)}"


def test_read_output_after_or_during_close_says_the_pipeline_is_closed(tmp_path) -> None:
    """Found by the harness below: a ``read_output`` racing ``close`` (an iterator still being read, or a call
    after it) raised ``StorageError: [Errno 5] steplog ...``, an I/O error naming a log file, as if the disk had
    failed. It must raise DbspError saying the pipeline is closed."""
    p = dbsp.Pipeline(circuit(), workers=2, storage=str(tmp_path / "d"), checkpoint_interval=None)
    for i in range(3):
        p.push("t", batch(0, i))
        p.step()
    it = p.read_output("sums")
    assert next(it)[0] == 0
    p.close()
    with pytest.raises(dbsp.DbspError, match="closed while its output was read") as err:
        next(it)
    assert not isinstance(err.value, dbsp.errors.StorageError)
    with pytest.raises(dbsp.DbspError, match="the pipeline is closed") as err:
        next(p.read_output("sums"))
    assert not isinstance(err.value, dbsp.errors.StorageError)


def test_a_push_discarded_before_its_step_is_divided_reopens(tmp_path) -> None:
    """Found by the harness's kill test: ``discard`` of a push still waiting in the open step, then ``step``, then a
    crash before a checkpoint: the division record counts the pushes left (2), the log holds 3 records of the
    step, and recovery refused the directory (CorruptionError: the division of step 0 names 2 pushes, the log
    holds 3). It must reopen, without the discarded push, and count it as seen."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
    for i in range(3):
        p.push("t", batch(1, i), producer="a", seq=i)
    assert p.discard("a", 1) == ("t", 0)
    first = p.step()["sums"].to_dict()
    p.push("t", batch(1, 3), producer="a", seq=3)  # acknowledged, not yet in a step
    p._shutdown()  # abandon the process after the step, before any checkpoint, as kill -9 would
    q = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    try:
        assert q.steps == 1 and dict(q.read_output("sums"))[0].to_dict() == first
        assert q.push("t", batch(1, 1), producer="a", seq=1).duplicate  # the discarded push stays seen
        q.step()
        want: dict = {}
        for i in (0, 2, 3):
            b = batch(1, i)
            for k, v in zip(b.column("k").to_pylist(), b.column("v").to_pylist()):
                tot, n = want.get(k, (0, 0))
                want[k] = (tot + v, n + 1)
        got: dict = {}
        for _, z in q.read_output("sums"):
            for row, w in z.to_dict().items():
                got[row] = got.get(row, 0) + w
        assert {r: w for r, w in got.items() if w} == {(k, t, n): 1 for k, (t, n) in want.items()}
    finally:
        q.close()


# ---- the random-operations harness (issue 29 item 2): tests/exactly_once/ops_harness.py ----

OPS_SEED = int(os.environ.get("DBSP_CONCURRENCY_SEED", random.randrange(10**6)))
OPS_ROUNDS = int(os.environ.get("DBSP_CONCURRENCY_ROUNDS", "48"))  # over the three modes
OPS_KILLS = int(os.environ.get("DBSP_CONCURRENCY_KILLS", "2"))
OPS_TOTALS: dict = {}


@pytest.mark.parametrize("mode", ["memory", "durable", "staged"])
def test_random_operations_from_many_threads_keep_every_acknowledged_push(tmp_path, mode) -> None:
    """``DBSP_CONCURRENCY_ROUNDS`` rounds over the three modes (default 48; 1,000 is the opt-in aim, replay one
    run with ``DBSP_CONCURRENCY_SEED``): 3 threads issue 10 random public operations each (push, step,
    queue_step + run_queued, checkpoint, rescale, discard, read_output, metrics, view, query, profile, upsert and
    delete by key, close) on one
    pipeline; every
    operation completes or refuses with a typed error, none leaves the pipeline broken, and the integral of the
    output log after a reopen (in memory: of the steps returned) equals the model of the acknowledged pushes."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from collections import Counter

    from ops_harness import MODES, Round

    totals: Counter = Counter()
    refusals: Counter = Counter()
    rounds = OPS_ROUNDS // len(MODES) + (MODES.index(mode) < OPS_ROUNDS % len(MODES))
    for r in range(rounds):
        seed = OPS_SEED * 1000 + r
        rnd = Round(mode, seed, None if mode == "memory" else str(tmp_path / f"d{r}"))
        p = rnd.open(workers=1 + r % 3)
        rnd.go(p)
        rnd.check(p)
        assert not rnd.failures, (f"{mode} round {r} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}):\n"
                                  + "\n".join(rnd.failures))
        totals.update(rnd.counts)
        totals["rounds"] += 1
        refusals.update(rnd.refusals)
    OPS_TOTALS[mode] = dict(totals)
    print("\n".join(f"  refused {n}x {what}" for what, n in refusals.most_common()))
    print(f"\n[ops harness] {mode} DBSP_CONCURRENCY_SEED={OPS_SEED}: {dict(totals)}")
    assert totals["rounds"] == rounds and (rounds == 0 or totals["ops"] > rounds * 10)


@pytest.mark.parametrize("mode", ["durable", "staged"])
def test_random_operations_killed_with_sigkill_keep_every_acknowledged_push(tmp_path, mode) -> None:
    """``DBSP_CONCURRENCY_KILLS`` kills per mode must land (default 2): a child process runs harness rounds on one
    directory and is killed with SIGKILL at a random moment; the parent reopens, pushes again every push the
    child tried and saw neither acknowledged nor refused (a duplicate if it was durable), steps, and checks that the output
    log's integral equals the model of every push minus the discarded ones, and that every such push is in the
    input of exactly one output step."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from collections import Counter

    from rescale_workload import run_child

    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops_kill_child.py")
    d = str(tmp_path / "d")
    rng = random.Random(f"{OPS_SEED}/{mode}/kill")
    stats: Counter = Counter()
    run = 0
    while stats["kills"] < OPS_KILLS and run < 4 * OPS_KILLS + 4:
        try:
            how, info = run_child([child, d, str(OPS_SEED), str(run), mode, "20"], None, rng.uniform(1.5, 6.0),
                                  300, "a concurrency-harness child")
            run += 1
            stats["kills" if how == "killed" else "finished"] += 1
            if info is not None:
                stats.update({k: v for k, v in info.items() if isinstance(v, int)})
            _check_after_kill(d, mode, stats)
        except (AssertionError, dbsp.DbspError) as e:
            raise AssertionError(f"{mode} run {run} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}): {e!r}") from e
    print(f"\n[ops kill] {mode} DBSP_CONCURRENCY_SEED={OPS_SEED}: {dict(stats)}")
    assert stats["kills"] >= OPS_KILLS, f"only {stats['kills']} of {OPS_KILLS} kills landed in {run} runs"


def _check_after_kill(d: str, mode: str, stats) -> None:
    from collections import Counter

    from ops_harness import apply_u, batch, circuit, differ, executor, log_integral, model, model_u

    log = os.path.join(os.path.dirname(d), "ops-log.txt")
    if not os.path.exists(os.path.join(d, "META")):
        return  # killed before the pipeline was created
    with open(log) if os.path.exists(log) else open(os.devnull) as f:
        lines = [x.split(" ", 2) for x in f.read().splitlines() if x]
    tried = {(p, int(s)) for w, p, s in (x for x in lines if x[0] == "try")}
    acked = {(p, int(s)) for w, p, s in (x for x in lines if x[0] == "ack")}
    refused = {(p, int(s)) for w, p, s in (x for x in lines if x[0] == "refused")}  # changed nothing
    tried -= refused
    dropped = {(p, int(s)) for w, p, s in (x for x in lines if x[0] == "discard-done")}
    maybe = {(p, int(s)) for w, p, s in (x for x in lines if x[0] == "discard-try")} - dropped
    stats["rounds_logged"] = sum(x[0] == "round" for x in lines)
    q = dbsp.Pipeline.open(d, circuit(), executor=executor(mode), checkpoint_interval=None)
    try:
        for p, s in sorted(tried - acked):  # in flight at the kill: durable or not, counted once now
            if p.endswith("u"):  # the last operation of its thread on table u: made again, it stays the last
                ack = apply_u(q, OPS_SEED, p, s, True)
            else:
                ack = q.push("t", batch(OPS_SEED, p, s), producer=p, seq=s)
            stats["unacked_in_child_found_durable" if ack.duplicate else "unacked_in_child_pushed_anew"] += 1
            with open(log, "a") as f:
                f.write(f"ack {p} {s}\n")
        q.step()
        counted: Counter = Counter()
        for step in q.output_steps:
            for r in q.output_inputs(step):
                if r["producer"]:
                    counted.update((r["producer"], x) for x in range(r["first_seq"], r["last_seq"] + 1))
        kept = {(p, s) for p, s in tried if (p, s) not in dropped and not ((p, s) in maybe and (p, s) not in counted)}
        assert not (dropped & set(counted)), f"discarded pushes were counted: {sorted(dropped & set(counted))[:5]}"
        assert counted == Counter(kept), (f"seed {OPS_SEED}: pushes counted other than once: "
                                          f"{sorted((Counter(kept) - counted) + (counted - Counter(kept)))[:10]}")
        got, want = log_integral(q), model([(OPS_SEED, p, s) for p, s in kept if not p.endswith("u")])
        assert got == want, (f"{mode} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}): the log's integral differs from "
                             f"the model of {len(kept)} pushes: {differ(got, want)}")
        got_u, want_u = log_integral(q, "uv"), model_u([(OPS_SEED, p, s) for p, s in kept if p.endswith("u")])
        assert got_u == want_u, (f"{mode} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}): table u's log differs from "
                                 f"the model of its operations: {differ(got_u, want_u)}")
    finally:
        q.close()
