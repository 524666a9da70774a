"""SparkPipeline with its storage on moto's S3 server and no path shared between the driver and the two executor JVMs of local-cluster[2,1,1024] (each keeps its tasks' stage state in its own Spark directory): steps against the embedded runtime and DuckDB (the first ones with a task attempt failing after its commit and upload, retried by Spark), a live rescale 2 -> 3 -> 2, and a driver restart from the store with the old driver's local cache deleted; the tasks that found their state missing from their executor's cache (fetched through the store) are counted and must be there."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("pyspark")

from spark_glue import SparkPipeline  # noqa: E402
from staged_circuits import build, changes, check_duckdb, embedded, same_outputs  # noqa: E402
from test_spark_pipeline import run  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # local-cluster JVMs: about a minute to start, the long suite
SEED = int(os.environ.get("DBSP_SPARK_STORE_SEED", np.random.SeedSequence().entropy % 10**6))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def store_cluster(s3_server, spark_session_factory):
    """local-cluster[2,1,1024] whose executors get the store's credentials from their environment (as on a real
    cluster) and keep nothing on a common path: their stage caches go to their own SPARK_EXECUTOR_DIRS."""
    from s3_server import CREDENTIALS

    pp = os.pathsep.join([REPO] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    conf = {"spark.executorEnv.PYTHONPATH": pp, "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.task.maxFailures": "4", "spark.executor.memory": "512m"}
    conf.update({f"spark.executorEnv.{k}": v for k, v in CREDENTIALS.items()})
    s = spark_session_factory("local-cluster[2,1,1024]", "dbsp-tests-store", **conf)
    yield s
    s.stop()


def _moved(p) -> tuple[int, list[str]]:
    return p.stats.get("state_fetches", 0), list(p.stats.get("state_cache_roots", []))


def test_store_cluster_steps_rescale_and_driver_restart(store_cluster, s3_server, tmp_path) -> None:
    print(f"DBSP_SPARK_STORE_SEED={SEED}")
    rng = np.random.default_rng(SEED)
    steps, bags = changes(SEED, 14)
    c, sql = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    driver = str(tmp_path / "driver")
    p = SparkPipeline(store_cluster, c, workers=2, storage=uri, cache_dir=driver, checkpoint_interval=None)
    p.runner.fault = (1, "after-commit", 1)  # each job's first attempt commits, uploads, then fails: Spark retries
    outs = run(p, steps[:4], rng)
    p.runner.fault = None
    p.rescale(3)
    outs += run(p, steps[4:7], rng)
    p.rescale(2)
    outs += run(p, steps[7:9], rng)
    p.checkpoint()
    outs += run(p, steps[9:11], rng)  # after the checkpoint: the restart replays them
    fetched, roots = _moved(p)
    tasks = p.stats.get("state_loads", 0) + p.stats.get("state_cache_hits", 0) + p.stats.get("state_partial_loads", 0)
    p.close(checkpoint=False)
    shutil.rmtree(driver)  # the new driver starts on an empty disk
    q = SparkPipeline.open(store_cluster, uri, c, cache_dir=driver, checkpoint_interval=None)
    assert q.steps == 11
    outs += run(q, steps[11:], rng)
    f2, r2 = _moved(q)
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
    roots = sorted(set(roots + r2))
    print(f"stateful tasks {tasks} before the restart; {fetched} (+{f2} after it) found their state missing from "
          f"their executor's cache and fetched it from the store; caches {roots}")
    assert len(roots) == 2, roots  # one per executor, none shared, none on the driver's disk
    assert all("/executor-" in r and not r.startswith(driver) for r in roots), roots
    assert fetched + f2 > 0, "no task ever moved to the other executor: state never went through the store"
