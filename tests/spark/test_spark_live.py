"""SparkPipeline rescaled live on local-cluster[2,1,1024] while another thread steps: the number of tasks per stage changes between jobs, one executor JVM is killed (SIGKILL, with its Python workers) in the middle of the move and replaced by the cluster, and every step's output equals a never-rescaled run and DuckDB."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

pytest.importorskip("pyspark")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "exactly_once"))

from spark_glue import SparkPipeline  # noqa: E402
from rescale_workload import Workload, build_circuit, check_log_against_duckdb, reference  # noqa: E402

pytestmark = pytest.mark.spark


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        out.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return out


def executor_jvms() -> list[int]:
    """The executor JVMs of this test process's local cluster (children of its driver JVM, never another
    process's)."""
    me = os.getpid()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "java" in cmd and "CoarseGrainedExecutorBackend" in cmd and me in _ancestors(int(pid)):
            out.append(int(pid))
    return out


@pytest.mark.slow
def test_live_rescale_with_an_executor_killed_mid_move(spark_cluster, tmp_path) -> None:
    w = Workload(91, 20)
    ref = reference(w)
    cur = [0]
    d = str(tmp_path / "d")
    p = SparkPipeline(spark_cluster, build_circuit(), workers=2, storage=d, checkpoint_interval=None,
                      clock=lambda: w.clock(cur[0]))
    outs: list[dict] = []
    errors: list[BaseException] = []

    def run(upto: int) -> None:
        try:
            while len(outs) < upto:
                s = len(outs)
                cur[0] = s
                for name, z in w.pushes[s]:
                    p.push(name, z, producer=f"gen-{name}", seq=s)
                outs.append({k: v.to_dict() for k, v in p.step().items()})
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    run(3)
    killed: list[int] = []
    before = executor_jvms()
    assert len(before) == 2, f"expected the 2 executors of local-cluster[2,1,1024], found {before}"

    def kill_one() -> None:
        time.sleep(1.0)
        victim = executor_jvms()[0]
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)

    reps = []
    for target, upto in ((3, 9), (1, 14), (2, 20)):
        t = threading.Thread(target=run, args=(upto,))
        k = threading.Thread(target=kill_one) if target == 3 else None
        t.start()
        if k is not None:
            k.start()
        reps.append(p.rescale(target, batch_shards=16))
        t.join()
        if k is not None:
            k.join()
        assert not errors, errors
        assert p.layout.workers == target
    run(20)
    assert not errors, errors
    assert killed, "no executor was killed"
    deadline = time.monotonic() + 120
    while len(executor_jvms()) < 2 and time.monotonic() < deadline:  # the cluster replaces the lost executor
        time.sleep(1)
    after = executor_jvms()
    print(f"\n[spark live] killed executor JVM {killed[0]}; executors before {before}, after {after}; rescales "
          + "; ".join(f"{r['from_workers']}->{r['to_workers']} in {r['batches']} batches, longest pause "
                      f"{r['max_pause_ms']:.0f} ms" for r in reps))
    assert outs == ref
    check_log_against_duckdb(p, w, 19)
    p.close()
