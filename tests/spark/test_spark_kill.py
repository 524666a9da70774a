"""Kill tests on Spark: the driver process is killed with SIGKILL at random moments and recovered, and the output log is compared exactly with DuckDB over all acknowledged input.

Checked after every run:
  1. the integral of every output in the log equals DuckDB over all input that was acknowledged;
  2. the output log holds one step per micro-batch / pushed batch, each consumed exactly once (its
     producer range in the log), none doubled and none missing;
  3. no child failed other than by SIGKILL.

DBSP_SPARK_KILLS sets how many kills each test tries (default 2, for CI); the tried and effective kills are
printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("pyspark")

import dbsp_core as dbsp  # noqa: E402
import spark_glue  # noqa: E402
from stream_workload import build_circuit, duckdb_expected, integral, write_batches  # noqa: E402

pytestmark = pytest.mark.spark
KILLS = int(os.environ.get("DBSP_SPARK_KILLS", "2"))
REPO = os.path.dirname(os.path.dirname(HERE))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYSPARK_PYTHON"] = sys.executable
    env.pop("DBSP_CRASHPOINT", None)
    env.update(extra or {})
    return env


def run_killed(args: list[str], delay: float | None, log: str) -> str:
    """Run a child; with ``delay``, SIGKILL it that many seconds after it prints READY. Returns 'killed' or
    'done'; any other exit fails the test with the child's output."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, *args], env=child_env(), stdout=subprocess.PIPE, stderr=out)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if delay is not None and line.startswith(b"READY"):
            time.sleep(delay)
            if proc.poll() is None:
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


def steps_logged(storage: str) -> int | None:
    """How many steps the output log holds (read-only; None before the pipeline was first created)."""
    from dbsp_core.durable import open_output

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


def test_driver_kill_under_a_streaming_query(tmp_path):
    """foreach_batch over the durable embedded pipeline: the driver (Python + its Spark JVM) is killed at random
    moments while the query runs; each restart recovers the pipeline and restarts the query from its checkpoint."""
    data, storage, ckpt = str(tmp_path / "data"), str(tmp_path / "p"), str(tmp_path / "ck")
    batches = 12  # about 1 s each on this machine: the kills land while batches run
    write_batches(data, batches, 300, seed=5)
    rng = random.Random(int(os.environ.get("DBSP_SPARK_KILL_SEED", "6")))
    before = jvms()
    tried = killed = 0
    stats = str(tmp_path / "stats.json")
    args = [os.path.join(HERE, "stream_child.py"), data, storage, ckpt, stats]
    status, at = "killed", []
    while tried < KILLS:
        tried += 1
        status = run_killed(args, rng.uniform(0.3, 8.0), str(tmp_path / "child.log"))
        if status == "done":
            break
        killed += 1
        at.append(steps_logged(storage))
    if status != "done":
        assert run_killed(args, None, str(tmp_path / "child.log")) == "done"
    print(f"\ndriver kills under a streaming query: {tried} tried, {killed} landed before the query finished "
          f"(steps in the output log at each kill: {at})")
    time.sleep(1.0)
    assert jvms() <= before, "a killed driver left its Spark JVM running"
    st = json.loads(open(stats).read())
    p = dbsp.Pipeline.open(storage, build_circuit(), checkpoint_interval=None)
    try:
        assert list(p.output_steps) == list(range(batches))
        for s in range(batches):
            mine = [(r["first_seq"], r["last_seq"]) for r in p.output_inputs(s) if r["producer"] == st["producer"]]
            assert mine == [(s, s)], (s, mine)
        want = duckdb_expected(data)
        for name in ("agg", "big"):
            assert integral(p, name) == want[name], name
    finally:
        p.close()


RUNTIMES = os.environ.get("DBSP_SPARK_KILL_RUNTIMES", "spark").split(",")


def log_views(storage: str) -> tuple[dict[str, dict[tuple, int]], list[list[dict]]]:
    """The integral of every output in the output log and every step's input ranges (read-only)."""
    from dbsp_core.durable import open_output

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


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_driver_kill_and_open(tmp_path, runtime):
    """The driver process is killed at random moments while it pushes, steps and checkpoints; every restart
    recovers with ``open`` and resumes the producer after its last acknowledged batch."""
    from kill_workload import batch

    if runtime == "spark" and not hasattr(spark_glue, "SparkPipeline"):
        pytest.skip("spark_glue.SparkPipeline is not in this checkout yet")
    storage, seed, batches = str(tmp_path / "p"), 21, 14
    rng = random.Random(int(os.environ.get("DBSP_SPARK_KILL_SEED", "6")) + 1)
    args = [os.path.join(HERE, "kill_child.py"), "driver", runtime, storage, str(seed), str(batches), "2"]
    tried = killed = 0
    at = []
    status = "killed"
    while tried < KILLS:
        tried += 1
        status = run_killed(args, rng.uniform(0.2, 6.0), str(tmp_path / "child.log"))
        if status == "done":
            break
        killed += 1
        at.append(steps_logged(storage))
    if status != "done":
        assert run_killed(args, None, str(tmp_path / "child.log")) == "done"
    print(f"\ndriver kills of the {runtime} pipeline: {tried} tried, {killed} landed "
          f"(steps in the output log at each kill: {at})")
    acks = [int(x) for x in (tmp_path / "acks.txt").read_text().split()]
    assert acks == list(range(batches))
    data = tmp_path / "acked"
    data.mkdir()
    import pyarrow.parquet as pq

    for i in acks:
        pq.write_table(batch(seed, i), str(data / f"part-{i:05d}.parquet"))
    views, ranges = log_views(storage)
    want = duckdb_expected(str(data))
    assert views == {name: want[name] for name in views}
    counted = sorted(b for rs in ranges for r in rs if r["producer"] == "gen"
                     for b in range(r["first_seq"], r["last_seq"] + 1))
    assert counted == acks  # every acknowledged batch in exactly one step
