"""Kill tests on Spark: the driver process is killed with SIGKILL at random moments and recovered, and the output log is compared exactly with DuckDB over all acknowledged input.

Checked after every run:
  1. the integral of every output in the log equals DuckDB over all input that was acknowledged;
  2. the output log holds one step per micro-batch / pushed batch, each consumed exactly once (its
     producer range in the log), none doubled and none missing;
  3. no child failed other than by SIGKILL.

DBSP_SPARK_KILLS sets how many kills must land in each driver-kill test (default 3, for CI: runs go on until that
many landed, and a run that finishes first fails the test); the runs and landed kills are printed (run with -rA
to see them). A kill waits for READY and for the output log to grow by 0-1 steps, then lands 0-1 s later, so
every restart makes progress and kills fall at random moments inside steps. The data and the kill moments come
from a seed new per run, printed (with -rA and in every failure); DBSP_SPARK_KILL_SEED replays one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("pyspark")

import dbsp_core as dbsp  # noqa: E402
from stream_workload import duckdb_expected, write_batches  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow,  # kill -9 loops of drivers and executors: the long suite
              pytest.mark.skipif(shutil.which("java") is None, reason="Java is not installed (needed by pyspark)")]
KILLS = int(os.environ.get("DBSP_SPARK_KILLS", "3"))
SEED = int(os.environ.get("DBSP_SPARK_KILL_SEED", str(random.SystemRandom().randrange(2**31))))
REPO = os.path.dirname(os.path.dirname(HERE))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYSPARK_PYTHON"] = sys.executable
    env.pop("DBSP_CRASHPOINT", None)
    env.update(extra or {})
    return env


def kill_until(args: list[str], rng: random.Random, log: str, storage: str,
               steps: int | None = None, kills: int = KILLS, tree: bool = False) -> tuple[int, int, list]:
    """Run the child, killing it at a random moment (:func:`run_killed`, ``tree`` as there), until ``kills`` kills
    landed (at most 4x as many runs), then once more to the end. Returns (runs, kills landed, steps logged at each
    kill); fails if the child finished before ``kills`` kills landed (the test would check fewer kills than it says).

    Without ``steps`` a kill lands 0-1 s after the log grew by 0-1 steps (children whose every step takes about a
    second). With ``steps`` (how many steps the child logs in all) the kills are spread over the steps still to
    come: each waits for the log to grow by a random share of them and lands 0-0.3 s later, so a fast machine
    cannot finish the child before every kill landed."""
    runs = killed = 0
    at: list = []
    while killed < kills and runs < 4 * kills:
        runs += 1
        if steps is None:
            delay, after = rng.uniform(0.0, 1.0), rng.randint(0, 1)
        else:
            share = (steps - (steps_logged(storage) or 0)) // (kills - killed + 1)
            delay, after = rng.uniform(0.0, 0.3), rng.randint(0, max(0, share - 1))
        if run_killed(args, delay, log, storage, after, tree) == "done":
            break
        killed += 1
        at.append(steps_logged(storage))
    assert killed >= kills, (f"only {killed} of {kills} kills landed in {runs} runs: the child finished first "
                             f"(replay: DBSP_SPARK_KILL_SEED={SEED})")
    assert run_killed(args, None, log) == "done"
    return runs + 1, killed, at


def run_killed(args: list[str], delay: float | None, log: str, storage: str | None = None, after_steps: int = 0,
               tree: bool = False) -> str:
    """Run a child; with ``delay``, SIGKILL it ``delay`` seconds after it printed READY and the output log in
    ``storage`` grew by ``after_steps`` steps (so every kill lands after some progress, at a random moment of a
    step). With ``tree`` (a driver of local-cluster) its Spark JVM is killed with it (the driver is both) and the
    executor JVMs it started are waited for until they leave (:func:`kill_driver`). Returns 'killed' or 'done';
    any other exit fails the test with the child's output."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, *args], env=child_env(), stdout=subprocess.PIPE, stderr=out)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if delay is not None and line.startswith(b"READY"):
            goal = (steps_logged(storage) or 0) + after_steps if storage else 0
            while storage and proc.poll() is None and (steps_logged(storage) or 0) < goal:
                time.sleep(0.1)
            time.sleep(delay)
            if proc.poll() is None:
                if tree:
                    kill_driver(proc.pid)
                else:
                    os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
        rc = proc.wait(timeout=600)
    if rc == -signal.SIGKILL:
        return "killed"
    if rc == 0 and b"DONE" in line + rest:
        return "done"
    with open(log, "rb") as f:
        err = f.read()[-4000:].decode(errors="replace")
    raise AssertionError(f"child {args[0]} exited {rc}:\n{err}")


def kill_driver(pid: int, wait_s: float = 90.0) -> None:
    """SIGKILL driver ``pid`` (Python) and its Spark JVM at once, then wait for the rest of its process tree (the
    executor JVMs of local-cluster and their Python workers) to leave, as they do when their driver is gone;
    whatever is left after ``wait_s`` is killed, so the next run starts on a machine without them."""
    from executor_kill import _descendants

    procs = _descendants(pid)
    jvm = [p for p in procs if p != pid and "SparkSubmit" in cmdline(p)]
    for p in [pid] + jvm:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def steps_logged(storage: str) -> int | None:
    """How many steps the output log holds (read-only; None before the pipeline was first created)."""
    from dbsp_core.storage.inspect import open_output

    try:
        log = open_output(storage)
    except (FileNotFoundError, dbsp.DbspError):
        return None
    try:
        return log.last
    finally:
        log.close()


def jvms() -> set[int]:
    """Pids of the JVMs Spark started (drivers and executors), to check a killed driver leaves none behind."""
    r = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
    return {int(ln.split()[0]) for ln in r.stdout.splitlines()[1:]
            if "java" in ln and ("SparkSubmit" in ln or "CoarseGrainedExecutorBackend" in ln)}


RUNTIMES = os.environ.get("DBSP_SPARK_KILL_RUNTIMES", "spark").split(",")


def log_views(storage: str) -> tuple[dict[str, dict[tuple, int]], list[list[dict]]]:
    """The integral of every output in the output log and every step's input ranges (read-only)."""
    from dbsp_core.storage.inspect import open_output

    log = open_output(storage)
    try:
        views = {}
        for name in ("agg", "big"):
            acc: dict[tuple, int] = {}
            for _, z in log.read(name, 0):
                for row, w in z.to_dict().items():
                    acc[row] = acc.get(row, 0) + w
                    if acc[row] == 0:
                        del acc[row]
            views[name] = acc
        return views, [log.inputs_of(s) for s in range(log.first, log.last)]
    finally:
        log.close()


@pytest.mark.parametrize("runtime", ["embedded", "spark"])
def test_driver_kill_under_a_streaming_query(tmp_path, runtime):
    """foreach_batch over the durable embedded pipeline or SparkPipeline: the driver (Python + its Spark JVM) is
    killed at random moments while the query runs; each restart recovers the pipeline (``open``) and restarts
    the query from its checkpoint."""
    data, storage, ckpt = str(tmp_path / "data"), str(tmp_path / "p"), str(tmp_path / "ck")
    batches = 12  # about 1 s each on this machine: the kills land while batches run
    print(f"\n[spark kill] seed {SEED} (replay: DBSP_SPARK_KILL_SEED={SEED})")
    write_batches(data, batches, 300, seed=SEED)
    rng = random.Random(SEED + 1)
    before = jvms()
    stats = str(tmp_path / "stats.json")
    args = [os.path.join(HERE, "stream_child.py"), data, storage, ckpt, stats, runtime]
    runs, killed, at = kill_until(args, rng, str(tmp_path / "child.log"), storage)
    print(f"driver kills under a streaming query into the {runtime} pipeline: {killed} landed in {runs} runs "
          f"(steps in the output log at each kill: {at})")
    time.sleep(1.0)
    assert jvms() <= before, "a killed driver left its Spark JVM running"
    st = json.loads(open(stats).read())
    views, ranges = log_views(storage)
    # one step per micro-batch: usually one per file, but a query killed after its file source logged the next
    # files and before it logged the batch's offsets plans that batch again over all of them on restart
    micro_batches = len([n for n in os.listdir(os.path.join(ckpt, "commits")) if n.isdigit()])
    assert len(ranges) == micro_batches and micro_batches <= batches
    for s, rs in enumerate(ranges):
        mine = [(r["first_seq"], r["last_seq"]) for r in rs if r["producer"] == st["producer"]]
        assert mine == [(s, s)], (s, mine)
    want = duckdb_expected(data)
    assert views == {name: want[name] for name in views}, f"the log differs from DuckDB (seed {SEED})"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_driver_kill_and_open(tmp_path, runtime):
    """The driver process is killed at random moments while it pushes, steps and checkpoints; every restart
    recovers with ``open`` and resumes the producer after its last acknowledged batch."""
    storage, seed, batches = str(tmp_path / "p"), SEED % 10_000, 6 * KILLS + 2
    print(f"\n[spark kill] seed {SEED} (replay: DBSP_SPARK_KILL_SEED={SEED})")
    rng = random.Random(SEED + 2)
    args = [os.path.join(HERE, "kill_child.py"), "driver", runtime, storage, str(seed), str(batches), "2"]
    runs, killed, at = kill_until(args, rng, str(tmp_path / "child.log"), storage, steps=batches)
    print(f"driver kills of the {runtime} pipeline: {killed} landed in {runs} runs "
          f"(steps in the output log at each kill: {at})")
    check_acked(tmp_path, seed, batches, storage)


def check_acked(tmp_path, seed: int, batches: int, root: str) -> None:
    """Every batch was acknowledged, and the output log in ``root`` holds each in exactly one step (0 lost, 0
    doubled), its integral equal to DuckDB over them."""
    import pyarrow.parquet as pq
    from kill_workload import batch

    acks = [int(x) for x in (tmp_path / "acks.txt").read_text().split()]
    assert acks == list(range(batches))
    data = tmp_path / "acked"
    data.mkdir()
    for i in acks:
        pq.write_table(batch(seed, i), str(data / f"part-{i:05d}.parquet"))
    views, ranges = log_views(root)
    want = duckdb_expected(str(data))
    assert views == {name: want[name] for name in views}, f"the log differs from DuckDB (seed {SEED})"
    counted = sorted(b for rs in ranges for r in rs if r["producer"] == "gen"
                     for b in range(r["first_seq"], r["last_seq"] + 1))
    assert counted == acks  # every acknowledged batch in exactly one step


def test_driver_kill_and_open_from_the_store(tmp_path, s3_server):
    """As :func:`test_driver_kill_and_open` with ``storage="s3://..."`` (moto's server): every restart deletes the
    driver's local cache first and recovers from the store alone (its Spark tasks' caches are new too), and the
    output log read back from the store equals DuckDB over every acknowledged batch, each in exactly one step."""
    from dbsp_core.runtime.remote_state import restored

    uri = s3_server.uri(s3_server.bucket(), "pipe")
    cache, seed, batches = str(tmp_path / "p"), SEED % 10_000, 6 * KILLS + 2
    print(f"\n[spark kill, store] seed {SEED} (replay: DBSP_SPARK_KILL_SEED={SEED})")
    rng = random.Random(SEED + 3)
    os.environ["DBSP_KILL_STORE_URI"] = uri  # the children's environment (child_env copies it)
    try:
        args = [os.path.join(HERE, "kill_child.py"), "driver", "spark-store", cache, str(seed), str(batches), "2"]
        runs, killed, at = kill_until(args, rng, str(tmp_path / "child.log"), cache, steps=batches)
    finally:
        del os.environ["DBSP_KILL_STORE_URI"]
    print(f"driver kills of the SparkPipeline on the store: {killed} landed in {runs} runs "
          f"(steps in the output log at each kill: {at})")
    shutil.rmtree(cache)
    with restored(uri) as (root, _, _):  # the store alone, read into a new directory
        check_acked(tmp_path, seed, batches, root)


CLUSTER_KILLS = int(os.environ.get("DBSP_SPARK_CLUSTER_KILLS", "2"))


def test_driver_kill_on_a_cluster_from_the_store(tmp_path, s3_server):
    """As :func:`test_driver_kill_and_open_from_the_store` on local-cluster[2,1,1024] (two executor JVMs, the store's
    credentials in their environment): each kill takes the driver (Python and its JVM) at a random moment and its
    executors leave with it; every restart is a new driver process whose local disk starts empty: its cache and
    the Spark local directories of the killed run (under which each executor kept its tasks' stage caches) are
    deleted first, so the state comes back from the store alone. DBSP_SPARK_CLUSTER_KILLS kills land (default 2:
    each run starts its JVMs anew, about a minute here); the output log in the store holds every acknowledged batch
    in exactly one step, its integral equal to DuckDB, and the last run's tasks fetched their state from the store
    into the new run's local directories."""
    from dbsp_core.runtime.remote_state import restored

    uri = s3_server.uri(s3_server.bucket(), "pipe")
    cache, disks, seed, batches = str(tmp_path / "p"), str(tmp_path / "disks"), SEED % 10_000, 4 * CLUSTER_KILLS + 4
    print(f"\n[spark kill, store, local-cluster] seed {SEED} (replay: DBSP_SPARK_KILL_SEED={SEED})")
    rng = random.Random(SEED + 4)
    os.environ.update(DBSP_KILL_STORE_URI=uri, DBSP_KILL_LOCAL_DIRS=disks)  # the children's environment
    try:
        args = [os.path.join(HERE, "kill_child.py"), "driver", "spark-store", cache, str(seed), str(batches), "2",
                "local-cluster[2,1,1024]"]
        runs, killed, at = kill_until(args, rng, str(tmp_path / "child.log"), cache, steps=batches,
                                      kills=CLUSTER_KILLS, tree=True)
    finally:
        del os.environ["DBSP_KILL_STORE_URI"], os.environ["DBSP_KILL_LOCAL_DIRS"]
    st = json.loads((tmp_path / "stats.json").read_text())  # the last run's, written before it closed
    print(f"driver kills of the SparkPipeline on local-cluster and the store: {killed} landed in {runs} runs "
          f"(steps in the output log at each kill: {at}); the last run's tasks fetched state {st['fetches']} times "
          f"({st['fetch_bytes']:,} B) into {st['roots']}")
    assert killed == CLUSTER_KILLS and runs == st["run"], (killed, runs, st)
    # a last run that recovered from the first manifest (the kills landed before any checkpoint committed: the child
    # checkpoints after every third push) replays from no state, so it has nothing to fetch (seen once:
    # DBSP_SPARK_KILL_SEED=297592486, kills at steps 2 and 3)
    if st["opened_at"] > 0:
        assert st["fetches"] > 0 and st["roots"], f"the last run found its state in no local cache: {st}"
    else:
        print("the last run recovered from step 0 (no checkpoint committed before the kills): nothing to fetch")
    assert st["roots"], st
    assert all(r.startswith(os.path.join(disks, f"run-{runs}") + os.sep) for r in st["roots"]), st["roots"]
    assert os.listdir(disks) == [f"run-{runs}"], "each restart deleted the local directories of the runs before"
    shutil.rmtree(cache)
    with restored(uri) as (root, _, _):  # the store alone, read into a new directory
        check_acked(tmp_path, seed, batches, root)


def ancestors(pid: int) -> list[int]:
    """``pid`` and its parents up to init."""
    out = []
    while pid > 1:
        out.append(pid)
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def kill_executor_of(worker_pid: int) -> list[int]:
    """SIGKILL the executor JVM that runs Python worker ``worker_pid``, with its Python daemon and workers (what a
    lost node or a killed container does). Returns the pids killed, the JVM first."""
    chain = ancestors(worker_pid)
    jvm = next((p for p in chain if "CoarseGrainedExecutorBackend" in cmdline(p)), None)
    assert jvm is not None, f"no executor JVM above Python worker {worker_pid}: {[cmdline(p)[:80] for p in chain]}"
    victims = [jvm] + chain[:chain.index(jvm)][::-1]
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


TASK_KILLS = [("worker", "local[2,4]"), ("executor", "local-cluster[2,1,1024]")]


@pytest.mark.parametrize("mode, master", TASK_KILLS, ids=[m for m, _ in TASK_KILLS])
def test_task_kill_mid_step(tmp_path, mode, master):
    """A Python worker (os._exit inside its task) or an executor JVM (SIGKILL from here while its task runs) dies in
    the middle of step TARGET, on the first attempt only; Spark retries the task. Every step completes once: its
    output, returned by ``step`` and in the output log, equals the embedded runtime's, and no step is doubled."""
    _task_kill(tmp_path, mode, master, None)


def test_executor_kill_mid_step_with_the_store(tmp_path, s3_server):
    """As the executor case of :func:`test_task_kill_mid_step` with ``storage="s3://..."``: the killed executor's
    cache is gone with it, and the retried tasks take their state from the store (exactly once)."""
    _task_kill(tmp_path, "executor", "local-cluster[2,1,1024]", s3_server.uri(s3_server.bucket(), "pipe"))


def _task_kill(tmp_path, mode: str, master: str, uri: str | None) -> None:
    import pickle

    from kill_workload import batch, build_circuit as kill_circuit

    storage, marker, out = str(tmp_path / "p"), tmp_path / "marker", str(tmp_path / "out.pkl")
    marker.mkdir()
    seed, batches, target = 31, 5, 2
    args = [os.path.join(HERE, "kill_child.py"), "task", mode, storage, str(seed), str(batches), "2", str(marker),
            master, str(target), out]
    log = str(tmp_path / "child.log")
    with open(log, "ab") as err:
        env = child_env({"DBSP_KILL_STORE_URI": uri} if uri else None)
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=err)
        killed: list[int] = []
        if mode == "executor":
            deadline = time.monotonic() + 400
            pidfile = marker / "executor.pid"
            while not pidfile.exists() or not pidfile.read_text().endswith("\n"):
                assert proc.poll() is None and time.monotonic() < deadline, "the trap never fired"
                time.sleep(0.1)
            killed = kill_executor_of(int(pidfile.read_text().split()[0]))
        stdout, _ = proc.communicate(timeout=900)
    if proc.returncode != 0 or b"DONE" not in stdout:
        raise AssertionError(f"child exited {proc.returncode}:\n{open(log).read()[-5000:]}")
    assert (marker / f"{mode}.pid").exists(), f"the {mode} kill never fired: the test checked a run without one"
    fired = (marker / f"{mode}.pid").read_text().split()
    print(f"\n{mode} kill on {master}: the task of stage {fired[1]}, worker {fired[2]} (attempt {fired[3]}) in step "
          f"{target} died" + (f"; SIGKILL to executor JVM {killed[0]} and its Python processes {killed[1:]}"
                               if killed else " by os._exit"))
    got = pickle.load(open(out, "rb"))
    ref = dbsp.Pipeline(kill_circuit(), workers=2)
    want = []
    for i in range(batches):
        ref.push("s", batch(seed, i, poison=i == target))
        want.append({name: sorted(z.to_dict().items()) for name, z in ref.step().items()})
    ref.close()
    assert got == want
    from dbsp_core.runtime.remote_state import restored
    from dbsp_core.storage.inspect import open_output

    with contextlib.ExitStack() as stack:
        if uri is not None:  # the output log as the store holds it, read into a new directory
            storage = stack.enter_context(restored(uri))[0]
        lg = open_output(storage)
        try:
            assert (lg.first, lg.last) == (0, batches)
            assert [{name: sorted(z.to_dict().items()) for name, z in lg.get(s).items()}
                    for s in range(batches)] == want
        finally:
            lg.close()
