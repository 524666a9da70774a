"""SparkPipeline on local-cluster[2,1,1024]: stage tasks in two executor JVMs with their own Python workers (state handed between processes only through the stage databases), a retried task, and a reopen, against the embedded runtime and DuckDB."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyspark")

from spark_glue import SparkPipeline  # noqa: E402
from staged_circuits import build, changes, check_duckdb, embedded, same_outputs  # noqa: E402
from test_spark_pipeline import run  # noqa: E402

pytestmark = pytest.mark.spark


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
