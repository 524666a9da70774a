"""The recovery policy of a store pipeline (issue 33, deliver 3; spark_glue/pipeline.py design note 9): with
``worker_recovery="pipeline"`` the staged executor's jobs upload nothing (stage_store invariant 8), a checkpoint
uploads what changed since the last one, and a worker whose cached state is lost makes the driver recover the whole
pipeline in place from the last durable point, replaying the input log (driver invariant 10). The reference runner
runs the tasks in this process on one task cache, on moto's S3 server; "losing an executor" deletes one worker's
cached databases and pending records.

Checked: per-job uploads counted in each mode ("alone": one per stateful (stage, worker) a job; "pipeline": none,
and one flush a checkpoint); after a loss, outputs equal the embedded runtime's and DuckDB's and the output log in
the store holds each step once (0 lost, 0 doubled), and the recovery was the whole pipeline's (counted: one rollback,
the steps since the checkpoint replayed). The data come from a seed new per run, printed; ``DBSP_WORKER_RECOVERY_SEED``
replays one.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

from staged_circuits import (build, changes, check_duckdb, check_output_log, embedded, feed,  # noqa: E402
                              same_outputs)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.errors import RecoveryError  # noqa: E402
from dbsp_core.runtime import StagedExecutor, stage_task  # noqa: E402
from dbsp_core.runtime.staged import LocalJobRunner  # noqa: E402

SEED = int(os.environ.get("DBSP_WORKER_RECOVERY_SEED", np.random.SeedSequence().entropy % 10**6))


def _pipe(c, uri, tmp_path, mode: str, workers: int = 2):
    ex = StagedExecutor(LocalJobRunner(), task_cache_dir=str(tmp_path / "tasks"), worker_recovery=mode)
    return dbsp.Pipeline(c, workers, 8, uri, executor=ex, cache_dir=str(tmp_path / "driver"),
                         checkpoint_interval=None)




def _lose(tmp_path, worker: int) -> list[str]:
    """Lose the Spark executor holding ``worker``: its cached databases, sidecars and pending records are gone, and
    the instances this process cached (as a new Python worker would start)."""
    gone = []
    cache = tmp_path / "tasks" / "dbsp-stage-cache"
    for path in glob.glob(str(cache / "*" / "state" / "stage-*" / f"worker-{worker}.*")):
        gone.append(path)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    stage_task.drop_cache()
    return gone




def test_the_option_is_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="worker_recovery must be one of 'alone', 'pipeline'"):
        StagedExecutor(worker_recovery="standby")
    spark_pipeline = pytest.importorskip("spark_glue.pipeline")
    spark_pipeline.check_worker_recovery("alone", None)
    spark_pipeline.check_worker_recovery("pipeline", "s3://bucket/pipe")
    with pytest.raises(ValueError, match="needs storage='s3://...'"):
        spark_pipeline.check_worker_recovery("pipeline", str(tmp_path))
    with pytest.raises(ValueError, match="worker_recovery must be one of"):
        spark_pipeline.check_worker_recovery(True, "s3://bucket/pipe")


@pytest.mark.parametrize("mode", ["alone", "pipeline"])
def test_uploads_per_job_by_mode(s3_server, tmp_path, mode) -> None:
    """"alone": every job uploads one object per stateful (stage, worker); "pipeline": none until the checkpoint,
    which uploads one per (stage, worker) and leaves the chains durable (a new driver opens them)."""
    print(f"DBSP_WORKER_RECOVERY_SEED={SEED}")
    steps, bags = changes(SEED, 6)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = _pipe(c, uri, tmp_path, mode)
    outs = feed(p, steps[:4])
    cells = sum(p.executor.plan.stateful) * 2
    st = p.stats
    if mode == "alone":
        assert st["state_job_uploads"] == 4 * cells and st.get("state_local_commits", 0) == 0, st
    else:
        assert st.get("state_job_uploads", 0) == 0 and st["state_local_commits"] == 4 * cells, st
        assert st.get("state_upload_bytes", 0) == 0
        assert not any(n.startswith("stage/") for n in p._remote.list("stage")), "a job uploaded state"
    p.checkpoint()
    if mode == "pipeline":
        assert st["state_flushes"] == 1 and st["state_flush_uploads"] == cells and st["state_upload_bytes"] > 0
        assert not any(p.executor.chains.pending.values())
        assert all(ch[-1]["to"] == p.executor.version for ch in p.executor.chains.chains.values())
    outs += feed(p, steps[4:])
    p._shutdown()  # the driver dies: the steps after the checkpoint are replayed by the next one
    shutil.rmtree(tmp_path / "driver")
    q = dbsp.Pipeline.open(uri, c, executor=StagedExecutor(LocalJobRunner(), task_cache_dir=str(tmp_path / "tasks"),
                                                           worker_recovery=mode),
                           cache_dir=str(tmp_path / "driver"), checkpoint_interval=None)
    assert q.steps == 6 and q.stats["replayed_steps"] == 2
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_a_lost_worker_recovers_the_whole_pipeline(s3_server, tmp_path) -> None:
    """"pipeline": a checkpoint, three steps, worker 1's cache lost; the next step finds its state gone and the
    driver recovers every worker from the checkpoint (one rollback, three steps replayed and checked against the
    output log), then goes on; a loss right after a checkpoint needs no replay; a loss found by the checkpoint's
    flush recovers too."""
    print(f"DBSP_WORKER_RECOVERY_SEED={SEED}")
    steps, bags = changes(SEED + 1, 14)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = _pipe(c, uri, tmp_path, "pipeline")
    outs = feed(p, steps[:3])
    p.checkpoint()
    outs += feed(p, steps[3:6])
    assert _lose(tmp_path, 1)
    outs += feed(p, steps[6:8])
    st = p.stats
    assert st["lost_recoveries"] == 1 and st["lost_replayed_steps"] == 3 and st["state_rollbacks"] == 1, st
    assert "worker-1.db" in st["last_state_lost"]
    p.checkpoint()
    assert _lose(tmp_path, 0)  # right after a checkpoint: the chains are durable, worker 0 is rebuilt alone
    outs += feed(p, steps[8:10])
    assert st["lost_recoveries"] == 1, st
    outs += feed(p, steps[10:12])
    assert _lose(tmp_path, 0)
    p.checkpoint()  # the flush finds worker 0's state gone: recovered from step 8, then flushed
    assert st["lost_recoveries"] == 2 and st["lost_replayed_steps"] == 3 + 4, st
    outs += feed(p, steps[12:])
    assert _lose(tmp_path, 1)
    assert p.traces(1)  # the driver's read flushes first: the loss it finds is recovered, then read
    assert st["lost_recoveries"] == 3 and st["lost_replayed_steps"] == 3 + 4 + 2, st
    p.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
    check_output_log(uri, outs)


def test_capture_refuses_local_links(s3_server, tmp_path) -> None:
    """A manifest never names a local link: capturing the chains with local links left fails."""
    steps, _ = changes(SEED + 2, 2)
    c, _ = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = _pipe(c, uri, tmp_path, "pipeline")
    feed(p, steps)
    with pytest.raises(RecoveryError, match="flush first"):
        p.executor.chains.capture()
    p.close()


@pytest.mark.slow  # 10-20 s: a live rescale's waves and a whole-pipeline recovery
def test_a_rescale_flushes_first(s3_server, tmp_path) -> None:
    """"pipeline": a live rescale 2 -> 3 reads the durable chains, so it flushes first (no checkpoint before it);
    a loss after it is recovered from the rescale's state, not from before it."""
    steps, bags = changes(SEED + 3, 8)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = _pipe(c, uri, tmp_path, "pipeline")
    outs = feed(p, steps[:3])
    assert any(p.executor.chains.pending.values())
    p.rescale(3)
    assert p.stats["state_flushes"] >= 1 and p.layout.workers == 3
    outs += feed(p, steps[3:6])
    assert _lose(tmp_path, 2)
    outs += feed(p, steps[6:])
    assert p.stats["lost_recoveries"] == 1 and p.stats["lost_replayed_steps"] <= 3, p.stats
    p.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
    check_output_log(uri, outs)
