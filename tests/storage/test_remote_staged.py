"""The staged executor with its stage state in an object store (runtime/stage_store.py) on moto's S3 server, tasks run in this process by the reference runner with one stage cache per "process" in turn (no cache shared with the driver, none holding the previous job's state): steps against the embedded runtime and DuckDB, compaction, a live rescale 2 -> 3 -> 2, a cold rescale, and a driver restart on an empty disk."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

from staged_circuits import build, changes, check_duckdb, embedded, same_outputs  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.runtime.staged import LocalJobRunner  # noqa: E402
from dbsp_core.storage.formats import state_db_paths  # noqa: E402

SEED = int(os.environ.get("DBSP_STAGE_STORE_SEED", np.random.SeedSequence().entropy % 10**6))


def _pipe(c, uri, cache, caches, workers=2, runner=None, **kw):
    ex = StagedExecutor(runner or LocalJobRunner(cache_dirs=caches, seed=SEED),
                        max_steps_per_job=kw.pop("max_steps_per_job", 64))
    return dbsp.Pipeline(c, workers, 8, uri, executor=ex, cache_dir=cache, checkpoint_interval=None, **kw)


def _open(c, uri, cache, caches, workers=None):
    ex = StagedExecutor(LocalJobRunner(cache_dirs=caches, seed=SEED + 1))
    return dbsp.Pipeline.open(uri, c, workers, executor=ex, cache_dir=cache, checkpoint_interval=None)


def _feed(p, steps):
    outs = []
    for pushes in steps:
        for h, z in pushes:
            p.push(h, z)
        outs.append(p.step())
    return outs


def test_stage_state_moves_and_the_driver_restarts(s3_server, tmp_path) -> None:
    """The short variant: steps, a checkpoint, two more steps, and a new driver on an empty disk."""
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    steps, bags = changes(SEED, 6)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(2)]
    driver = str(tmp_path / "driver")
    p = _pipe(c, uri, driver, caches)
    outs = _feed(p, steps[:3])
    p.checkpoint()
    outs += _feed(p, steps[3:4])
    fetched = p.stats["state_fetches"]
    p._shutdown()
    shutil.rmtree(driver)
    q = _open(c, uri, driver, caches)
    outs += _feed(q, steps[4:])
    fetched += q.stats["state_fetches"]
    q.close()
    assert fetched > 0
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["carried", "join_agg"])
def test_stage_state_moves_through_the_store(s3_server, tmp_path, name) -> None:
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    steps, bags = changes(SEED, 12)
    c, sql = build(name)
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(3)]
    driver = str(tmp_path / "driver")
    p = _pipe(c, uri, driver, caches)
    outs = _feed(p, steps[:5])
    st = p.stats
    # three caches picked at random by each task: most tasks find their cache stale or empty
    assert st["state_fetches"] > 0 and st["state_fetch_bytes"] > 0, st
    assert len(st["state_cache_roots"]) == 3 and all(not r.startswith(driver) for r in st["state_cache_roots"])
    assert state_db_paths(driver) == [], "no stage database on the driver's disk"
    p.rescale(3)
    outs += _feed(p, steps[5:7])
    p.rescale(2)
    outs += _feed(p, steps[7:8])
    p.checkpoint()
    outs += _feed(p, steps[8:10])  # after the checkpoint: replayed by the restart
    p._shutdown()  # the driver dies without closing
    shutil.rmtree(driver)
    q = _open(c, uri, driver, caches[1:], workers=3)  # a cold rescale at open, on an empty driver disk
    assert q.steps == 10 and q.layout.workers == 3
    outs += _feed(q, steps[10:])
    q.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_chains_compact(s3_server, tmp_path, monkeypatch) -> None:
    from dbsp_core.runtime import stage_store

    monkeypatch.setattr(stage_store, "CHAIN_LIMIT", 4)
    steps, _ = changes(SEED + 1, 10, max_rows=3)
    c, _ = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = _pipe(c, uri, str(tmp_path / "driver"), [str(tmp_path / "a"), str(tmp_path / "b")])
    outs = _feed(p, steps)
    assert p.stats["state_compactions"] > 0
    assert max(len(ch) for ch in p.executor.chains.chains.values()) <= 4
    p.checkpoint()
    names = p._remote.list("stage")
    live = {link["object"] for ch in p.executor.chains.chains.values() for link in ch}
    assert live <= set(names) and len(names) == len(live), "retention leaves only the live chains"
    p.close()
    same_outputs(outs, embedded(c, steps))


def test_duplicates_and_retries_on_other_caches(s3_server, tmp_path) -> None:
    """Every task runs twice, on two different caches (a speculative duplicate on another Spark executor that
    commits and uploads too), and some first attempts fail before or after their commit and are retried: the
    driver keeps the acknowledged attempt's objects, a cache holding a duplicate's version discards it, and the
    outputs are exact."""
    steps, bags = changes(SEED + 2, 6)
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    caches = [str(tmp_path / f"exec-{i}") for i in range(3)]
    runner = LocalJobRunner({(1, "after-commit", 0), (2, "before-commit", 1)}, caches, SEED, duplicates=True)
    p = _pipe(c, uri, str(tmp_path / "driver"), caches, runner=runner)
    outs = _feed(p, steps)
    assert runner.retries == 2 and p.stats["state_fetches"] > 0
    names = set(p._remote.list("stage"))
    live = {link["object"] for ch in p.executor.chains.chains.values() for link in ch}
    assert live < names, "the duplicates uploaded objects of their own, and the chains name none of them"
    p.close()
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
