"""A pipeline used from several threads at once: pushes run concurrently, steps (and checkpoints, traces, reads) are serialized, and the views equal a dict model of everything pushed, in memory and durable, at W=1 (the integrated view was corrupted) and W=2 (steps deadlocked at the exchange barrier); and the random-operations harness (ops_harness.py: every public operation from many threads, in memory, durable and staged, also under kill -9) with the defects it found.

Opt-in sizes: ``DBSP_CONCURRENCY_ROUNDS`` (harness rounds over the three modes, default 48; 1,000 is the long run),
``DBSP_CONCURRENCY_KILLS`` (kills that must land per mode, default 2), ``DBSP_CONCURRENCY_STORE_ROUNDS`` (rounds per
mode over an S3 prefix, default 2), ``DBSP_CONCURRENCY_BUDGET_ROUNDS`` (rounds per mode under ``memory_limit=1``,
default 2); ``DBSP_CONCURRENCY_SEED`` replays a run.
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


def _harness_rounds(mode: str, rounds: int, offset: int, where, memory_limit: int | None = None,
                    preload: int = 0) -> tuple:
    """Run ``rounds`` rounds of the ops harness in ``mode`` (round r's seed ``OPS_SEED * 1000 + offset + r``, its
    storage ``where(r)``, its pipelines' ``memory_limit``, ``preload`` rows pushed first: ``Round.preload``), each
    checked at once; returns (counts, refusals) summed over them; under a budget the counts include what the batch
    stores wrote and evicted, and the bytes of key indexes whose regions are files after the preload (embedded:
    ``spill_*``)."""
    from collections import Counter

    from ops_harness import Round

    totals: Counter = Counter()
    refusals: Counter = Counter()
    for r in range(rounds):
        rnd = Round(mode, OPS_SEED * 1000 + offset + r, where(r), memory_limit=memory_limit)
        p = rnd.open(workers=1 + r % 3)
        store = p.executor.batch_store  # embedded: the pipeline's (closed with it); staged: in the task processes
        if preload:
            rnd.preload(p, preload)
            if store is not None:
                totals["spill_index_file_bytes"] += sum(
                    n for w in range(p.layout.workers) for t in p.traces(w).values() if t.held_index is not None
                    for _, n in t.held_index.regions if t.held_index.nbytes >= store.INDEX_FILE_MIN)
        rnd.go(p)
        spilled = store.stats if store is not None else p.stats.get("task_spill", {})
        totals.update({f"spill_{k}": spilled.get(k, 0) for k in ("files_written", "evictions")})
        rnd.check(p)
        assert not rnd.failures, (f"{mode} round {r} on {where(r)} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}):\n"
                                  + "\n".join(rnd.failures))
        totals.update(rnd.counts)
        totals["rounds"] += 1
        refusals.update(rnd.refusals)
    return totals, refusals


@pytest.mark.parametrize("half", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["memory", "durable", "staged"])
def test_random_operations_from_many_threads_keep_every_acknowledged_push(tmp_path, mode, half) -> None:
    """``DBSP_CONCURRENCY_ROUNDS`` rounds over the three modes (default 48; 1,000 is the opt-in aim, replay one
    run with ``DBSP_CONCURRENCY_SEED``), a mode's first half of them in the README command and the second half
    (the rounds' next seeds) in the long suite: 3 threads issue 10 random public operations each (push, step,
    queue_step + run_queued, checkpoint, rescale, discard, read_output, metrics, view, query, profile, upsert and
    delete by key, pushes into an append-only input and retractions it refuses, close) on one
    pipeline; every
    operation completes or refuses with a typed error, none leaves the pipeline broken, and the integral of the
    output log after a reopen (in memory: of the steps returned) equals the model of the acknowledged pushes."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ops_harness import MODES, append_only_state, circuit

    assert append_only_state(circuit()) == ["top_k", "aggregate"]  # the inserts-only state is what runs
    all_rounds = OPS_ROUNDS // len(MODES) + (MODES.index(mode) < OPS_ROUNDS % len(MODES))
    first = (all_rounds + 1) // 2  # rounds of the first half: offsets 0 .. first - 1, the second half's after them
    rounds, offset = (first, 0) if half == 0 else (all_rounds - first, first)
    totals, refusals = _harness_rounds(mode, rounds, offset,
                                       lambda r: None if mode == "memory" else str(tmp_path / f"d{r}"))
    OPS_TOTALS[(mode, half)] = dict(totals)
    print("\n".join(f"  refused {n}x {what}" for what, n in refusals.most_common()))
    print(f"\n[ops harness] {mode} half {half} DBSP_CONCURRENCY_SEED={OPS_SEED}: {dict(totals)}")
    assert totals["rounds"] == rounds and (rounds == 0 or totals["ops"] > rounds * 10)
    if rounds >= 8:  # 288 draws or more: none is append_bad with p < 1e-6
        assert totals["append"] and totals["append_bad"], dict(totals)


OPS_BUDGET_ROUNDS = int(os.environ.get("DBSP_CONCURRENCY_BUDGET_ROUNDS", "2"))  # per mode
OPS_BUDGET_PRELOAD = 150_000  # rows of distinct keys pushed first: a group-by key index of ~8 MiB on one worker


@pytest.mark.parametrize("mode", ["memory", "durable", "staged"])
def test_random_operations_under_a_budget_that_spills_every_trace(tmp_path, mode) -> None:
    """The same harness with ``memory_limit=1`` (every trace's batches go to batch files after every step and the
    cache keeps no page: trace/spill.py invariant 12; the traces' key indexes join the store, invariant 17):
    embedded in memory (a temporary spill directory), durable (files under the storage directory, which
    checkpoints name, invariant 13, while other threads step, read, rescale and close) and staged (the budget is
    the task processes', stage_task.py invariant 7). Each round first pushes OPS_BUDGET_PRELOAD rows of keys of
    their own, so the group-by's key index keeps its regions in files of the spill directory (invariant 17) and
    the cache evicts it while the threads run. ``DBSP_CONCURRENCY_BUDGET_ROUNDS`` rounds per mode (default 2; the
    long run: hundreds), each checked against the model as above; batch files were written and (embedded) a key
    index lived in files."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    totals, refusals = _harness_rounds(mode, OPS_BUDGET_ROUNDS, 700,
                                       lambda r: None if mode == "memory" else str(tmp_path / f"d{r}"), memory_limit=1,
                                       preload=OPS_BUDGET_PRELOAD)
    print("\n".join(f"  refused {n}x {what}" for what, n in refusals.most_common()))
    print(f"\n[ops harness] budget {mode} DBSP_CONCURRENCY_SEED={OPS_SEED}: {dict(totals)}")
    assert totals["rounds"] == OPS_BUDGET_ROUNDS
    if OPS_BUDGET_ROUNDS:
        assert totals["ops"] > OPS_BUDGET_ROUNDS * 10
        assert totals["spill_files_written"] > 0, f"nothing was spilled: {dict(totals)}"
        if mode != "staged":  # round 0 runs on one worker: the preload's group-by index is ~8 MiB, in files
            assert totals["spill_index_file_bytes"] > 0, f"no key index lived in files: {dict(totals)}"


OPS_STORE_ROUNDS = int(os.environ.get("DBSP_CONCURRENCY_STORE_ROUNDS", "2"))


@pytest.mark.parametrize("mode", ["durable", "staged"])
def test_random_operations_on_a_store_pipeline_keep_every_acknowledged_push(s3_server, mode) -> None:
    """The same harness over a pipeline whose storage is an S3 prefix (moto's server through pyarrow's S3 client),
    embedded (``durable``: logs as segment objects, checkpoint uploads off the step, the writer's lease) and staged
    (stage state as chains of objects): ``DBSP_CONCURRENCY_STORE_ROUNDS`` rounds per mode (default 2), each on a new
    prefix, checked after a reopen from the store as the local modes are."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    bucket = s3_server.bucket()
    totals, _ = _harness_rounds(mode, OPS_STORE_ROUNDS, 500, lambda r: s3_server.uri(bucket, f"{mode}-{r}"))
    print(f"\n[ops harness] store {mode} DBSP_CONCURRENCY_SEED={OPS_SEED}: {dict(totals)}")
    assert totals["rounds"] == OPS_STORE_ROUNDS and (OPS_STORE_ROUNDS == 0 or totals["ops"] > OPS_STORE_ROUNDS * 10)


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

    from ops_harness import a_batch, apply_u, batch, circuit, differ, executor, log_integral, model, model_a, model_u

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
            elif p.endswith("a"):
                ack = q.push("a", a_batch(OPS_SEED, p, s), producer=p, seq=s)
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
        got, want = log_integral(q), model([(OPS_SEED, p, s) for p, s in kept if not p.endswith(("u", "a"))])
        assert got == want, (f"{mode} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}): the log's integral differs from "
                             f"the model of {len(kept)} pushes: {differ(got, want)}")
        got_u, want_u = log_integral(q, "uv"), model_u([(OPS_SEED, p, s) for p, s in kept if p.endswith("u")])
        assert got_u == want_u, (f"{mode} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}): table u's log differs from "
                                 f"the model of its operations: {differ(got_u, want_u)}")
        for name, want_a in zip(("atop", "amm"), model_a([(OPS_SEED, p, s) for p, s in kept if p.endswith("a")])):
            got_a = log_integral(q, name)
            assert got_a == want_a, (f"{mode} (replay: DBSP_CONCURRENCY_SEED={OPS_SEED}): the log of {name} (over the "
                                     f"append-only input) differs from the model: {differ(got_a, want_a)}")
    finally:
        q.close()
