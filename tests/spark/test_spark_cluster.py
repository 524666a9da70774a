"""SparkPipeline on local-cluster[2,1,1024]: stage tasks in two executor JVMs with their own Python workers (state handed between processes only through the stage databases), a retried task, and a reopen, against the embedded runtime and DuckDB."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyspark")

from spark_glue import SparkPipeline  # noqa: E402
from staged_circuits import build, changes, check_duckdb, embedded, same_outputs  # noqa: E402
from test_spark_pipeline import run  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # local-cluster JVMs: about a minute to start, the long suite


def test_cluster_matches_embedded_with_a_retry_and_a_reopen(spark_cluster, tmp_path) -> None:
    steps, bags = changes(13, 6)
    c, sql = build("carried")
    p = SparkPipeline(spark_cluster, c, workers=3, storage=str(tmp_path))
    p.runner.fault = (1, "before-commit", 2)
    outs = run(p, steps[:3], np.random.default_rng(4))
    p.close()
    q = SparkPipeline.open(spark_cluster, str(tmp_path), c)
    q.runner.fault = (2, "after-commit", 0)
    outs += run(q, steps[3:], np.random.default_rng(6))
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_cluster_cold_rescales_match_a_never_rescaled_run(spark_cluster, tmp_path) -> None:
    """SparkPipeline.open(..., workers=N) through 1 -> 2 -> 3 -> 8 -> 2 -> 1 workers (the number of tasks per
    stage changes between jobs) gives the never-rescaled run's output at every step, and DuckDB's answer."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "exactly_once"))
    from rescale_workload import Workload, build_circuit, check_log_against_duckdb, reference

    w = Workload(77, 12)
    ref = reference(w)
    cur = [0]
    d = str(tmp_path / "d")
    p = SparkPipeline(spark_cluster, build_circuit(), workers=1, storage=d, checkpoint_interval=None,
                      clock=lambda: w.clock(cur[0]))
    outs = []
    plan = {2: 2, 4: 3, 5: 8, 7: 2, 9: 1}
    for s in range(12):
        if s in plan:
            p.close(checkpoint=s % 2 == 0)  # odd steps: the new layout replays the steps since the checkpoint
            p = SparkPipeline.open(spark_cluster, d, build_circuit(), workers=plan[s], checkpoint_interval=None,
                                   clock=lambda: w.clock(cur[0]))
            assert p.layout.workers == plan[s] and p.last_rescale["to_workers"] == plan[s]
        cur[0] = s
        for name, z in w.pushes[s]:
            p.push(name, z, producer=f"gen-{name}", seq=s)
        outs.append({k: v.to_dict() for k, v in p.step().items()})
    assert outs == ref
    check_log_against_duckdb(p, w, 11)
    p.close()
