"""A Spark executor lost while tasks of a stage still wait for it (issue 33; spark_glue.placement design note 6): its workers' tasks must go to the Spark executor left at once, not after ``spark.locality.wait``.

On local-cluster[2,1,1024] with ``spark.locality.wait`` at 200 s, a SparkPipeline with its state on the S3 server,
W=4 (two workers a Spark executor once both are warm). Both cores are then taken by a sleeping Spark task each
(pinned by location), a step starts, so every task of its first stage is pending, two for each Spark executor, the
victim is killed (``SparkContext.killExecutor``, which also keeps the master from starting
a replacement, then SIGKILL with its Python processes and directories) and the survivor's sleeping task let go. In one task set of all four tasks the
survivor has tasks of its own pending, so PROCESS_LOCAL stays a valid level, and once it ran them, the lost
workers' tasks wait out the 200 s (``SparkJobRunner.job_per_executor = False`` fails here: the step does not end
within 100 s). With a Spark job per preferred Spark executor the lost one's task set has no live preference left
and runs on the survivor as soon as its core is free. The steps before and after are checked against the embedded
runtime and DuckDB. The data come from a fixed seed (printed).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

pytest.importorskip("pyspark")

from executor_kill import executors, kill_executor  # noqa: E402
from spark_glue import SparkPipeline  # noqa: E402
from spark_glue.placement import placed_rdd  # noqa: E402
from staged_circuits import build, changes, check_duckdb, embedded, run_job, same_outputs  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # local-cluster JVMs, a kill: 1-2 minutes, the long suite
SEED = 33
WAIT_S = 200  # spark.locality.wait
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def locality_cluster(s3_server, spark_session_factory):
    """local-cluster[2,1,1024] with the store's credentials in the executors' environment and a locality wait
    long enough that waiting it out cannot be mistaken for anything else."""
    from s3_server import CREDENTIALS

    pp = os.pathsep.join([REPO] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    conf = {"spark.executorEnv.PYTHONPATH": pp, "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.task.maxFailures": "8", "spark.executor.memory": "512m", "spark.locality.wait": f"{WAIT_S}s"}
    conf.update({f"spark.executorEnv.{k}": v for k, v in CREDENTIALS.items()})
    s = spark_session_factory("local-cluster[2,1,1024]", "dbsp-tests-locality", **conf)
    assert s.sparkContext.getConf().get("spark.locality.wait") == f"{WAIT_S}s", "a session of other settings is active"
    yield s
    s.stop()


def _sleep(until: str):
    """A Spark task's function that holds its core until the file ``until`` exists (local-cluster: one machine)."""

    def run(_index, items):
        from pyspark import TaskContext

        for _ in items:
            pass
        t = time.time()
        while TaskContext.get().attemptNumber() == 0 and not os.path.exists(until) and time.time() < t + 600:
            time.sleep(0.05)  # a retry (its Spark executor lost) ends at once
        yield 0

    return run


def _stages(sc) -> list[tuple]:
    st = sc.statusTracker()
    return [(s, info.numTasks, info.numActiveTasks, info.numCompletedTasks) for s in st.getActiveStageIds()
            if (info := st.getStageInfo(s)) is not None]


def _running_tasks(sc) -> int:
    st = sc.statusTracker()
    return sum(info.numActiveTasks for s in st.getActiveStageIds() if (info := st.getStageInfo(s)) is not None)


def test_a_lost_executors_tasks_do_not_wait_for_it(locality_cluster, s3_server, tmp_path) -> None:
    print(f"seed {SEED}")
    sc = locality_cluster.sparkContext
    steps, bags = changes(SEED, 8)
    c, sql = build("carried")
    p = SparkPipeline(locality_cluster, c, workers=4, storage=s3_server.uri(s3_server.bucket(), "locality"),
                      cache_dir=str(tmp_path / "driver"), checkpoint_interval=None)
    outs: list[dict] = []
    sleepers: list[threading.Thread] = []
    try:
        for s in steps[:4]:  # the first job warms both Spark executors, the next ones spread the workers
            outs += run_job(p, [s], False)
        pl = p.runner.placement
        live = executors(sc.applicationId)
        held = {e: sorted({w for (k, w), x in pl.last.items() if x == e}) for e in live}
        print(f"Spark executors {live}, warm {sorted(pl.warm)}, workers by (stage, Spark executor): {dict(pl.last)}")
        assert sorted(pl.warm) == sorted(live) and all(held.values()), "the workers did not spread over both"
        victim, survivor = sorted(live)
        free = str(tmp_path / "free")
        for e in (victim, survivor):  # one sleeping task on each core
            rdd = placed_rdd(sc, [pl.location(e)]).mapPartitionsWithIndex(_sleep(free))
            sleepers.append(threading.Thread(target=lambda r=rdd: _ignore(r.collect), daemon=True))
            sleepers[-1].start()
        deadline = time.time() + 60
        while _running_tasks(sc) < 2:
            assert time.time() < deadline, f"the sleeping tasks did not start: {_stages(sc)}"
            time.sleep(0.05)
        done: list[list[dict]] = []
        t0 = time.time()
        stepper = threading.Thread(target=lambda: done.append(run_job(p, [steps[4]], False)), daemon=True)
        stepper.start()
        while len(sc.statusTracker().getActiveJobsIds()) < 3:  # the step's first stage: its tasks all pending
            assert stepper.is_alive() and time.time() < deadline, f"the step's first stage did not start: {_stages(sc)}"
            time.sleep(0.05)
        time.sleep(0.5)
        sc._jsc.sc().killExecutor(victim)  # no replacement: the application now wants one Spark executor
        kill_executor(live[victim])
        killed = time.time() - t0
        time.sleep(1.0)
        with open(free, "w"):  # the survivor's core is free again: its own tasks, then the lost ones'
            pass
        stepper.join(WAIT_S / 2)
        took = time.time() - t0
        print(f"victim {victim} (workers {held[victim]}) killed {killed:.1f} s into the step; the step took "
              f"{took:.1f} s; placement {pl.stats}, ran {dict(pl.ran)}")
        assert not stepper.is_alive(), (f"the step did not end within {WAIT_S / 2:.0f} s of a {WAIT_S} s "
                                        "spark.locality.wait: the lost Spark executor's tasks waited for it")
        outs += done[0]
        assert all(e == survivor for e in pl.ran.values()), pl.ran
        for s in steps[5:]:
            outs += run_job(p, [s], False)
    finally:
        if "stepper" in locals() and stepper.is_alive():
            stepper.join(WAIT_S + 60)  # the failing case: let the step end before the pipeline closes
        p.close(checkpoint=False)
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the victim's sleeper fails with it (or its retry ends at once)
        pass
