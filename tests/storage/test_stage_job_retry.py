"""A job of the staged executor with its state on moto's S3 server that the job runner aborts after a stage task committed and uploaded its delta but before the driver heard of it (as Spark aborts a job whose task lost its last attempt with a lost Spark executor): the driver runs the job again instead of marking the pipeline broken (staged.py invariant 5), and the outputs equal the embedded runtime's and DuckDB's."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

from staged_circuits import build, changes, check_duckdb, embedded, same_outputs  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.runtime.staged import LocalJobRunner  # noqa: E402

SEED = int(os.environ.get("DBSP_STAGE_STORE_SEED", np.random.SeedSequence().entropy % 10**6))


@pytest.mark.parametrize("point", ["after-commit", "before-commit"])
def test_an_aborted_job_runs_again(s3_server, tmp_path, point: str) -> None:
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    steps, bags = changes(SEED, 5)
    c, sql = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    runner = LocalJobRunner(cache_dirs=[str(tmp_path / f"exec-{i}") for i in range(2)], seed=SEED)
    p = dbsp.Pipeline(c, 2, 8, uri, executor=StagedExecutor(runner), cache_dir=str(tmp_path / "driver"),
                      checkpoint_interval=None)
    stateful = [k for k, s in enumerate(p.executor.plan.stateful) if s]
    outs = []
    for i, pushes in enumerate(steps):
        if i in (1, 3):  # the job of this step ends after one stateful task of it committed and uploaded
            runner.abort_first = {(stateful[(i // 2) % len(stateful)], point, i % 2)}
        for h, z in pushes:
            p.push(h, z)
        outs.append(p.step())
        assert not runner.abort_first, "the abort never fired: the test checked a run without one"
    retries = p.stats.get("job_retries", 0)
    p.close()
    assert retries == 2, retries
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
