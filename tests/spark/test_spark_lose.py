"""Losing one Spark executor while a SparkPipeline with its state on the S3 server runs (issue 33): a thread kills one executor JVM of local-cluster[2,1,1024] that holds state (SIGKILL, with its Python daemon and workers) at random moments while steps run and deletes its local directories, repeatedly; the master starts a replacement, the lost workers' next tasks rebuild their state from the chains in the store, and the other workers keep theirs.

Checked: every step's outputs equal the embedded runtime's (a never-killed run) and DuckDB's, and the output log
in the store holds each step once (0 lost, 0 doubled); the kills landed while steps ran (counted, with the steps
run after each); per (stage, worker), how often a task took its state from the store, and that no task that ran
again on the Spark executor that held its state reloaded it (the workers of the surviving executor kept their
state through every kill). The data, the job cuts and the kill moments come from a seed new per run, printed;
``DBSP_SPARK_LOSE_SEED`` replays one (the kill moments only roughly: they race with the steps);
``DBSP_SPARK_LOSE_KILLS`` sets the kills of the slow variant (default 6).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("pyspark")

from executor_kill import executor_dirs, executors, kill_executor  # noqa: E402
from spark_glue import SparkPipeline  # noqa: E402
from staged_circuits import (build, changes, check_duckdb, check_output_log, embedded, run_job,  # noqa: E402
                              same_outputs)

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # local-cluster JVMs and kills: 2-9 minutes, the long suite
SEED = int(os.environ.get("DBSP_SPARK_LOSE_SEED", random.SystemRandom().randrange(10**6)))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def lose_cluster(s3_server, spark_session_factory):
    """local-cluster[2,1,1024] as in test_spark_store.py (store credentials in the executors' environment, no
    shared path), with task attempts to spare: each kill fails the attempts running on the lost executor."""
    from s3_server import CREDENTIALS

    pp = os.pathsep.join([REPO] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    conf = {"spark.executorEnv.PYTHONPATH": pp, "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.task.maxFailures": "8", "spark.executor.memory": "512m", "spark.deploy.maxExecutorRetries": "-1"}
    conf.update({f"spark.executorEnv.{k}": v for k, v in CREDENTIALS.items()})
    s = spark_session_factory("local-cluster[2,1,1024]", "dbsp-tests-lose", **conf)
    yield s
    s.stop()


class Killer(threading.Thread):
    """Kills one live executor of ``app`` at a random moment while steps run, ``kills`` times: each kill waits for
    two live executors and for ``gap`` steps since the last kill, then lands 0-1.5 s later (mid-job, usually), on
    one whose directory held a task of the last job (Spark may have run every task on the other)."""

    def __init__(self, app: str, kills: int, rng: random.Random, progress, gap: int = 2) -> None:
        super().__init__(daemon=True)
        self.app, self.todo, self.rng, self.progress, self.gap = app, kills, rng, progress, gap
        self.landed: list[dict] = []  # per kill: executor id, pid, step reached when it landed, busy (a job ran)
        self.stop = threading.Event()

    def run(self) -> None:
        last = -self.gap
        while len(self.landed) < self.todo and not self.stop.is_set():
            live = executors(self.app)
            step, busy, _ = self.progress()
            if len(live) < 2 or step < last + self.gap:
                time.sleep(0.2)
                continue
            if self.stop.wait(self.rng.uniform(0, 1.5)):
                return
            live = executors(self.app)
            if len(live) < 2:
                continue
            step, busy, roots = self.progress()
            holding = [e for e in sorted(live) if any(r.startswith(d) for d in executor_dirs(live[e])[:1]
                                                      for r in roots)]
            eid = self.rng.choice(holding or sorted(live))  # one that holds state, if the last job left some
            dirs = kill_executor(live[eid])
            self.landed.append({"executor": eid, "pid": live[eid], "step": step, "busy": busy, "dirs": dirs})
            last = step


def _start(cluster, s3_server, tmp_path, nsteps: int, **opts):
    """The seed printed, the steps' changes, the circuit and a store pipeline at W=2 with ``opts``."""
    print(f"DBSP_SPARK_LOSE_SEED={SEED}")
    rng = np.random.default_rng(SEED)
    steps, bags = changes(SEED, nsteps)
    c, sql = build("carried")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = SparkPipeline(cluster, c, workers=2, storage=uri, cache_dir=str(tmp_path / "driver"),
                      checkpoint_interval=None, **opts)
    return rng, steps, bags, c, sql, uri, p


def _lose(cluster, s3_server, tmp_path, nsteps: int, kills: int) -> None:
    rng, steps, bags, c, sql, uri, p = _start(cluster, s3_server, tmp_path, nsteps)
    state = {"step": 0, "busy": False}
    killer = Killer(cluster.sparkContext.applicationId, kills, random.Random(SEED),
                    lambda: (state["step"], state["busy"], [r for _, r in p.stats.get("state_last_job", {}).values()]))
    outs: list[dict] = []
    jobs: list[tuple[int, int, int, dict]] = []  # (end step, kills landed before it began, before it ended, tasks)
    killer.start()
    try:
        i = 0
        while i < len(steps):
            k = min(int(rng.integers(1, 3)), len(steps) - i)
            began = len(killer.landed)
            state["busy"] = True
            outs.extend(run_job(p, steps[i:i + k], k > 1))
            state["busy"] = False
            i += k
            state["step"] = i
            jobs.append((i, began, len(killer.landed), dict(p.stats["state_last_job"])))
            if i == len(steps) and len(killer.landed) < kills and i < 4 * nsteps:
                steps_more, bags = changes(SEED, len(steps) + 4)  # kills still to land: a few more steps
                steps = steps_more
    finally:
        killer.stop.set()
        killer.join()
        fetched_by = dict(p.stats.get("state_fetches_by", {}))
        p.close(checkpoint=False)
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
    check_output_log(uri, outs)
    landed = killer.landed
    after = [jobs[-1][0] - kill["step"] for kill in landed]  # steps that ended after each kill
    # each (stage, worker) task against its previous one: on the same Spark executor directory with no kill of it
    # since the previous job began (kept: its state must have been a cache hit); on another one (moved, by a kill
    # or by Spark's placement: a stale cache is never trusted, so it must have fetched); or on the same directory
    # killed meanwhile (the standalone worker gives the replacement the directory of the Spark executor it
    # replaces, so which incarnation ran the previous task is not known: either, counted)
    kept, moved, reloaded, stale, lost, either = 0, 0, [], [], [], []
    for (_, began0, _, t0), (end1, _, n1, t1) in zip(jobs, jobs[1:]):
        killed = [k["dirs"][0] for k in landed[began0:n1] if k["dirs"]]
        for sw, (how, root) in t1.items():
            was = t0.get(sw, (None, None))[1]
            if was is None:
                continue
            hit = any(was.startswith(d) for d in killed)
            if was != root:
                moved += 1
                if how not in ("fetched", "rebuilt"):
                    stale.append((end1, sw, how, root))
                if hit:
                    lost.append(how)
            elif hit:
                either.append(how)
            else:
                kept += 1
                if how != "cache":
                    reloaded.append((end1, sw, how, root))
    print(f"{len(steps)} steps in {len(jobs)} jobs; {len(landed)} executor kills: "
          + "; ".join(f"executor {k['executor']} at step {k['step']} ({'mid-job' if k['busy'] else 'between jobs'}), "
                      f"{a} steps after it" for k, a in zip(landed, after)))
    print(f"tasks that took their state from the store, per (stage, worker): {sorted(fetched_by.items())}; "
          f"tasks that ran again on the Spark executor holding their state: {kept}, reloads among them "
          f"{len(reloaded)}; moved to another Spark executor: {moved} ({len(lost)} from a killed one: {lost}); on "
          f"the directory of a killed one: {either}")
    print(f"killed executors' directories {[k['dirs'] for k in landed]}; cache roots "
          f"{sorted({r for *_, t in jobs for _, r in t.values()})}")
    assert len(landed) == kills, f"only {len(landed)} of {kills} kills landed in {len(steps)} steps"
    assert any(k["busy"] for k in landed), "no kill landed while a job ran"
    assert all(a > 0 for a in after), f"steps after each kill: {after}"
    assert not reloaded, f"tasks that ran again where their state was cached reloaded it: {reloaded}"
    assert not stale, f"tasks that moved to another Spark executor trusted its cache: {stale}"
    took = len(lost) + sum(h in ("fetched", "rebuilt") for h in either)
    assert took > 0, "no worker of a killed Spark executor took its state from the store afterwards"
    assert sum(fetched_by.values()) >= moved + took - len(lost)




def test_lose_executors_short(lose_cluster, s3_server, tmp_path) -> None:
    _lose(lose_cluster, s3_server, tmp_path, 12, 2)


@pytest.mark.slow
def test_lose_executors_repeatedly(lose_cluster, s3_server, tmp_path) -> None:
    _lose(lose_cluster, s3_server, tmp_path, 40, int(os.environ.get("DBSP_SPARK_LOSE_KILLS", "6")))


def _lose_pipeline(cluster, s3_server, tmp_path, nsteps: int, kills: int, every: int = 4) -> None:
    """``worker_recovery="pipeline"`` (spark_glue/pipeline.py design note 9): the same kills, a checkpoint every
    ``every`` steps. Checked: outputs as above (embedded, DuckDB, the output log: 0 lost, 0 doubled); no job uploaded
    state (each checkpoint's flush did, one object per stateful (stage, worker)); the losses were recovered by the
    whole pipeline (counted: rollbacks, steps replayed from the input log)."""
    rng, steps, bags, c, sql, uri, p = _start(cluster, s3_server, tmp_path, nsteps, worker_recovery="pipeline")
    state = {"step": 0, "busy": False}

    def progress():
        return state["step"], state["busy"], [r for _, r in p.stats.get("state_last_job", {}).values()]

    killer = Killer(cluster.sparkContext.applicationId, kills, random.Random(SEED), progress)
    landed: list[dict] = []  # the kills of killers that finished
    outs: list[dict] = []
    checkpoints = 0
    killer.start()
    try:
        i = last = 0
        while i < len(steps):
            k = min(int(rng.integers(1, 3)), len(steps) - i)
            state["busy"] = True
            outs.extend(run_job(p, steps[i:i + k], k > 1))
            i += k
            if i - last >= every:
                p.checkpoint()
                checkpoints += 1
                last = i
            state["busy"] = False
            state["step"] = i
            # a kill that lands between a checkpoint and the next job finds no state pending, and there is nothing
            # to recover: kill again (one more killer) until a whole-pipeline recovery happened, bounded
            if not killer.is_alive() and not p.stats.get("lost_recoveries", 0) and i < 4 * nsteps:
                landed += killer.landed
                killer = Killer(cluster.sparkContext.applicationId, 1, random.Random(SEED + len(landed)), progress)
                killer.start()
            if i == len(steps) and (len(landed) + len(killer.landed) < kills or not p.stats.get("lost_recoveries", 0)) \
                    and i < 4 * nsteps:
                steps, bags = changes(SEED, len(steps) + 4)  # kills still to land: a few more steps
    finally:
        killer.stop.set()
        killer.join()
        landed += killer.landed
        st = dict(p.stats)
        p.close(checkpoint=False)
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)
    check_output_log(uri, outs)
    cells = 2 * sum(p.executor.plan.stateful)
    print(f"{len(steps)} steps, {checkpoints} checkpoints; {len(landed)} executor kills: "
          + "; ".join(f"executor {k['executor']} at step {k['step']} ({'mid-job' if k['busy'] else 'between jobs'})"
                      for k in landed)
          + f"; whole-pipeline recoveries {st.get('lost_recoveries', 0)}, steps replayed "
          f"{st.get('lost_replayed_steps', 0)}"
          f", {st.get('lost_recovery_s', 0.0):.1f} s; per-job uploads {st.get('state_job_uploads', 0)}, local commits "
          f"{st.get('state_local_commits', 0)}, flushes {st.get('state_flushes', 0)} "
          f"({st.get('state_flush_uploads', 0)}"
          f" objects); last loss: {st.get('last_state_lost')}")
    assert len(landed) >= kills, f"only {len(landed)} of {kills} kills landed in {len(steps)} steps"
    assert st.get("state_job_uploads", 0) == 0, "a job uploaded state in worker_recovery='pipeline'"
    assert st["state_local_commits"] > 0 and st["state_flush_uploads"] == cells * st["state_flushes"]
    assert st.get("lost_recoveries", 0) >= 1 and st["state_rollbacks"] == st["lost_recoveries"], st


@pytest.mark.slow
def test_lose_executors_pipeline_recovery(lose_cluster, s3_server, tmp_path) -> None:
    _lose_pipeline(lose_cluster, s3_server, tmp_path, 16, 2)
