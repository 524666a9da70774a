"""SparkPipeline with a memory budget on a local[2,4] session (runtime/stage_task.py invariant 7): state many times the budget, every stateful stage's traces spilled by the Python workers (asserted through the metrics), every step equal to the embedded runtime and DuckDB across a retried task and a driver reopen."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("pyspark")

from dbsp_core.runtime import stage_task as stagetask  # noqa: E402
from spark_glue import SparkPipeline  # noqa: E402
from staged_circuits import (build, changes, check_duckdb, embedded, run_job, run_random_jobs,  # noqa: E402
                             same_outputs)

pytestmark = pytest.mark.spark

SEED = int(os.environ.get("DBSP_SPARK_SPILL_SEED", "1"))  # drawn per run by tests/conftest.py, printed after it
LIMIT = 2  # bytes per Spark executor: 1 per Python worker of local[2], so every loose batch spills


def _failed_tasks(sc, group: str) -> int:
    tracker = sc.statusTracker()
    failed = 0
    for job in tracker.getJobIdsForGroup(group):
        for stage in tracker.getJobInfo(job).stageIds:
            info = tracker.getStageInfo(stage)
            failed += info.numFailedTasks if info is not None else 0
    return failed


@pytest.mark.parametrize("n", [pytest.param(8, marks=pytest.mark.slow, id="long"), pytest.param(3, id="short")])
def test_budgeted_spark_pipeline_spills_every_stage_and_matches_across_a_retry_and_a_reopen(spark_local, tmp_path,
                                                                                          n: int) -> None:
    """``short`` (the default suite): one job before the reopen and one after; ``long``: several of each."""
    seed = SEED
    rng = np.random.default_rng(seed)
    steps, bags = changes(seed, n, max_rows=150)
    cut = (n + 1) // 2
    c, sql = build("join_agg")
    d = str(tmp_path / "pipe")
    p = SparkPipeline(spark_local, c, workers=2, storage=d, memory_limit=LIMIT, spill_dir=str(tmp_path / "local"))
    assert p.runner.task_slots == 2 and p.executor.memory_limit == LIMIT // 2
    p.runner.fault = (1, "before-commit", 1)  # the first attempt of stage 1 worker 1 fails in every job
    sc = spark_local.sparkContext
    sc.setJobGroup("spill-retry", "retried tasks under a budget")
    try:
        outs = run_random_jobs(p, steps[:cut], rng) if n > 3 else run_job(p, steps[:cut], True)
    finally:
        sc.setJobGroup("", "")
    assert _failed_tasks(sc, "spill-retry") >= p.executor.jobs, f"seed {seed}: Spark retried no task"
    m = p.metrics()["spill"]
    plan = p.executor.plan
    stateful = {k for k in range(plan.num_stages) if plan.stateful[k]}
    written = {int(sw.split(".")[0]) for sw, n in m["files_by_stage_worker"].items() if n > 0}
    assert written == stateful, f"seed {seed}: batch files written by stages {written} of {stateful} only"
    assert m["limit"] == LIMIT // 2 and m["disk_bytes"] > 1000 * LIMIT, f"seed {seed}: {m}"
    assert all(proc.split(":")[1] != str(os.getpid()) for proc in m["processes"])  # the Python workers spilled
    # their batch files are under spill_dir, one directory per Python worker
    assert os.listdir(tmp_path / "local" / stagetask.SPILL_SUBDIR)
    p.close()
    stagetask.drop_cache()
    q = SparkPipeline.open(spark_local, d, c, memory_limit=LIMIT, spill_dir=str(tmp_path / "local"))
    outs += run_random_jobs(q, steps[cut:], rng)
    assert q.stats["task_spill"]["files_written"] > 0  # the reopened run's tasks loaded their state and spilled it
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_memory_limit_is_checked_before_any_spark_work(spark_local) -> None:
    c, _ = build("group_agg")
    with pytest.raises(ValueError, match="memory_limit must be"):
        SparkPipeline(spark_local, c, workers=2, memory_limit="half the RAM")
