"""An autoscaled SparkPipeline (local mode): the worker count (tasks per stage) follows the policy, up while steps miss the latency target and down to a new policy's bound, each a live rescale the autoscaler decided; the output stays equal to a dict model, and the decisions say that local mode has no Spark executors to ask for."""

from __future__ import annotations

import time
from collections import Counter

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

import dbsp_core as dbsp  # noqa: E402
from spark_glue import SparkPipeline  # noqa: E402

pytestmark = pytest.mark.spark
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _settled(p, deadline: float) -> dict:
    while True:
        a = p.metrics(state=False)["autoscale"]
        if not a["in_flight"] or time.monotonic() > deadline:
            return a
        time.sleep(0.05)


def test_worker_count_follows_the_policy(spark_local, tmp_path) -> None:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    # every Spark step takes far more than 1 ms: the target is missed, and without busy times the model counts the
    # whole step as parallel work, so the policy's cap (2) cuts it by more than 10%
    p = SparkPipeline(spark_local, c, workers=1, storage=str(tmp_path / "d"), checkpoint_interval=None,
                      autoscale=dbsp.Autoscale(1, 2, max_step_ms=1, min_steps=2, interval_s=0, window_s=60))
    fed: Counter = Counter()
    view: Counter = Counter()
    deadline = time.monotonic() + 120

    def step(i: int) -> None:
        rows = [(k % 7, i) for k in range(i, i + 20)]
        p.push("t", pa.table({"k": [r[0] for r in rows], "v": [r[1] for r in rows]}, schema=SCHEMA))
        fed.update(rows)
        view.update(p.step()["g"].to_dict())

    i = 0
    while p.workers == 1 and time.monotonic() < deadline:
        step(i)
        i += 1
    a = _settled(p, deadline)
    up = [x for x in a["changes"] if x["result"] == "done"]
    assert p.workers == 2 and up and up[0]["reason"] == "scale_up_cap", a
    assert up[0]["inputs"]["model"] == "step time" and "local mode" in up[0]["executors"]
    p.autoscale(dbsp.Autoscale(1, 1, max_step_ms=10_000))
    step(i)
    a = _settled(p, deadline)
    step(i + 1)
    assert p.workers == 1 and a["changes"][-1]["reason"] == "bounds" and a["changes"][-1]["result"] == "done", a
    n, s = Counter(), Counter()
    for (k, v), w in fed.items():
        n[k] += w
        s[k] += v * w
    assert Counter({r: w for r, w in view.items() if w}) == Counter({(k, n[k], s[k]): 1 for k in n})
    p.close()


def _wait_for(n: int, e, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while len(ids := e.executor_ids()) != n and time.monotonic() < deadline:
        time.sleep(0.5)
    return ids


@pytest.mark.slow
def test_spark_executors_follow_the_worker_count_on_local_cluster(spark_cluster) -> None:
    """On local-cluster (the standalone backend, dynamic allocation off) a smaller worker count releases a Spark
    executor through killExecutors (it goes) and a larger one asks for one through requestExecutors (the cluster
    manager takes the request). Whether the new executor then starts is the cluster's: on local-cluster here
    none had started 70 s after an accepted request (an open question, not checked below)."""
    from spark_glue.executors import SparkExecutors

    e = SparkExecutors(spark_cluster)
    spark_cluster.range(4).count()
    assert len(_wait_for(2, e, 60)) == 2
    msg = e.follow(1)
    assert msg.startswith("released Spark executors") and msg.endswith("accepted"), msg
    assert len(_wait_for(1, e, 60)) == 1
    msg = e.follow(2)
    assert msg.startswith("asked for 1 more Spark executors") and msg.endswith("accepted"), msg
