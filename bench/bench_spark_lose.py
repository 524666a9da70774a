"""Issue 33 on local-cluster: the cost of the per-job state upload (a SparkPipeline on the S3 server against one on a shared local directory, same data, alternated blocks of steps), then steps arriving at a fixed rate while one Spark executor is killed (SIGKILL, local directories deleted) a set time after a checkpoint: the time until the pipeline is back at the current step and the step latencies meanwhile, against whole-pipeline recovery of the same failure (SparkPipeline.open on a new driver from the checkpoint) in the same run; the Spark event log of the step in flight timed apart (bench/spark_timeline.py), with how long each task retried after the loss waited while no task ran (the locality wait). The alternated blocks also run the store pipeline's steps with one Spark job a stage (``SparkJobRunner.job_per_executor = False``, the placement before design note 6 of spark_glue.placement) for that choice's per-step cost.

Run: python bench/bench_spark_lose.py [--keys 1000000] [--rows 2000] [--workers 4] [--period 0 (auto)] [--kill-after 30]
Prints the measurements and markdown tables (copied into bench/RESULTS.md, issue 33 section).

``--policy`` measures the recovery policy instead (spark_glue/pipeline.py design note 9): two store pipelines on the
same data, ``worker_recovery="alone"`` (every job uploads its delta) and ``"pipeline"`` (nothing uploaded between
checkpoints), their steps in alternated blocks (latency, the driver's CPU, bytes and requests to the store), the
checkpoint after the blocks (the flush of "pipeline"), then in each mode in turn one Spark executor killed
``--kill-after`` s after a checkpoint while steps arrive every period: the time until back at the current step, the
step latencies meanwhile, and for "pipeline" the whole-pipeline recovery's rollbacks and replayed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "spark"))

from bench_spark_store import circuit  # noqa: E402


def step(p, t: pa.Table) -> float:
    t0 = time.perf_counter()
    p.push("s", t)
    p.step()
    return time.perf_counter() - t0


def load(p, keys: int, chunk: int = 1_000_000) -> float:
    """The state: ``keys`` distinct keys, pushed in steps of ``chunk`` rows."""
    t0 = time.perf_counter()
    for lo in range(0, keys, chunk):
        k = np.arange(lo, min(keys, lo + chunk))
        p.push("s", pa.table({"k": k, "v": k % 1000}))
        p.step()
    return time.perf_counter() - t0


def ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.0f}"


class Driven:
    """Steps arriving at a fixed rate: step ``i`` (of ``rows`` rows from ``feed``) arrives ``i * period`` s after
    ``t0``; each job runs every step that has arrived and not run (queued, one Spark job). ``jobs`` records
    (start, end, [(step, arrival)]) in wall-clock seconds."""

    def __init__(self, feed: list[pa.Table], period: float, t0: float) -> None:
        self.feed, self.period, self.t0 = feed, period, t0
        self.done = 0
        self.jobs: list[tuple[float, float, list[tuple[int, float]]]] = []
        self.running_since: float | None = None  # when the job running now started

    def due(self, t: float) -> int:
        return int((t - self.t0) // self.period) + 1

    def run(self, p, until: float, stop_at: float | None = None) -> None:
        """Drive ``p`` until wall time ``until`` (or until a job ends past ``stop_at``)."""
        while time.time() < until:
            now = time.time()
            n = self.due(now)
            if n <= self.done:
                time.sleep(min(self.t0 + self.done * self.period - now, until - now) + 0.001)
                continue
            for i in range(self.done, n):
                p.push("s", self.feed[i % len(self.feed)])
                p.queue_step()
            self.running_since = now
            p.run_queued()
            self.running_since = None
            end = time.time()
            self.jobs.append((now, end, [(i, self.t0 + i * self.period) for i in range(self.done, n)]))
            self.done = n
            if stop_at is not None and end >= stop_at:
                return

    def back(self, since: float) -> tuple[float, list[tuple[int, float]]]:
        """When the pipeline is back at the current step after an event at ``since``: the end of the first job
        started after it with no more steps waiting than any job before it had (the steady state's backlog; 1 when
        each step ran alone). Also the latencies (s) of the steps that ran from ``since`` until then."""
        usual = max((len(steps) for _, end, steps in self.jobs if end < since), default=1)
        lat = []
        for start, end, steps in self.jobs:
            if end < since:
                continue
            lat += [(i, end - arr) for i, arr in steps]
            if start > since and len(steps) <= usual:
                return end, lat
        return float("nan"), lat


def kill_when_busy(spark, app: str, d: "Driven", t: float, killed: list) -> None:
    """At ``t`` or just after, while the step running then has Spark tasks running (mid-step): kill the Spark
    executor of the lowest id (SIGKILL, its directories deleted); appends ``(id, time)`` to ``killed``."""
    from executor_kill import executors, kill_executor

    time.sleep(max(0.0, t - time.time()))
    st = spark.sparkContext.statusTracker()
    while not (d.running_since is not None and any(
            (info := st.getStageInfo(s)) is not None and info.numActiveTasks > 0 for s in st.getActiveStageIds())):
        time.sleep(0.02)
    live = executors(app)
    eid = sorted(live)[0]
    killed.append((eid, time.time()))
    kill_executor(live[eid])


POLICY_STATS = ("state_upload_bytes", "state_job_uploads", "state_local_commits", "state_flushes",
                "state_flush_uploads", "state_flush_compactions", "state_flush_bytes", "state_flush_s", "state_fetches",
                "state_fetch_bytes",
                "state_fetch_s", "state_load_s", "lost_recoveries", "lost_replayed_steps", "lost_recovery_s",
                "state_rollbacks")


def policy(a, spark, server, tmp: str, app: str) -> None:
    """``--policy``: the per-step cost of the per-job upload and one Spark executor's loss, "alone" against
    "pipeline" (see the module docstring)."""
    from executor_kill import executors
    from spark_glue import SparkPipeline

    modes = ("alone", "pipeline")
    rng = np.random.default_rng(33)
    data = [pa.table({"k": rng.integers(0, a.keys, a.rows), "v": rng.integers(0, 1000, a.rows)}) for _ in range(64)]
    out: dict = {"load_s": {}, "ckpt_s": {}, "lat": {m: [] for m in modes}, "cpu": {m: [] for m in modes},
                 "up": dict.fromkeys(modes, 0), "req": {m: {} for m in modes}, "n": dict.fromkeys(modes, 0)}
    pipes = {}
    for m in modes:
        uri = server.uri(server.bucket(), f"pipe-{m}")
        pipes[m] = SparkPipeline(spark, circuit(), workers=a.workers, storage=uri,
                                 cache_dir=os.path.join(tmp, f"driver-{m}"), checkpoint_interval=None,
                                 worker_recovery=m)
        out["load_s"][m] = load(pipes[m], a.keys)
        t0 = time.perf_counter()
        pipes[m].checkpoint()
        out["ckpt_s"][f"{m} after load"] = time.perf_counter() - t0
        print(f"{m}: loaded {a.keys:,} keys in {out['load_s'][m]:.1f} s, checkpoint "
              f"{out['ckpt_s'][f'{m} after load']:.1f} s", flush=True)
    for blk in range(a.blocks):  # alternated blocks, same data
        for m in modes if blk % 2 == 0 else modes[::-1]:
            p = pipes[m]
            u, r = p.stats.get("state_upload_bytes", 0), server.requests()
            for t in data[blk * a.block:(blk + 1) * a.block]:
                c0 = time.process_time()
                out["lat"][m].append(step(p, t))
                out["cpu"][m].append(time.process_time() - c0)
            out["up"][m] += p.stats.get("state_upload_bytes", 0) - u
            out["n"][m] += a.block
            for k, v in server.requests().items():
                out["req"][m][k] = out["req"][m].get(k, 0) + v - r.get(k, 0)
    for m in modes:  # the checkpoint after the blocks: "pipeline" uploads what its steps changed here
        p = pipes[m]
        u, r = p.stats.get("state_upload_bytes", 0), server.requests()
        t0 = time.perf_counter()
        p.checkpoint()
        out["ckpt_s"][f"{m} after the blocks"] = time.perf_counter() - t0
        out[f"ckpt_up_{m}"] = p.stats.get("state_upload_bytes", 0) - u
        out[f"ckpt_stats_{m}"] = {k: p.stats.get(k, 0) for k in POLICY_STATS}
        print(f"{m}: checkpoint after the blocks {out['ckpt_s'][f'{m} after the blocks']:.1f} s, "
              f"{out[f'ckpt_up_{m}']:,} bytes uploaded; totals {out[f'ckpt_stats_{m}']}", flush=True)
        out[f"ckpt_req_{m}"] = {k: v - r.get(k, 0) for k, v in server.requests().items() if v - r.get(k, 0)}
    period = a.period or round(2 * max(statistics.median(out["lat"][m]) for m in modes), 1)
    p50s = ", ".join(f"{m} {ms(out['lat'][m])} ms" for m in modes)
    print(f"step p50 {p50s}; period {period} s", flush=True)
    for m in modes:
        p = pipes[m]
        while len(executors(app)) < 2:  # the replacement of the last kill, before this one
            time.sleep(0.5)
        p.checkpoint()
        d = Driven(data, period, time.time())
        killed: list = []
        th = threading.Thread(target=kill_when_busy, args=(spark, app, d, d.t0 + a.kill_after, killed))
        th.start()
        f0 = {k: p.stats.get(k, 0) for k in POLICY_STATS}
        d.run(p, d.t0 + a.kill_after + a.run_after)
        th.join()
        tk = killed[0][1]
        while True:
            back, lat = d.back(tk)
            if back == back or time.time() > tk + 600:
                break
            d.run(p, time.time() + 10)
        out[f"kill_{m}"] = {"back_s": back - tk, "lat": lat,
                            "steps_before": sum(len(x) for _, e, x in d.jobs if e < tk),
                            "before": [e - s for s, e, _ in d.jobs if e < tk][-5:],
                            "delta": {k: p.stats.get(k, 0) - f0[k] for k in POLICY_STATS}}
        print(f"{m}: one Spark executor lost: {json.dumps(out[f'kill_{m}'], default=str)}", flush=True)
    for p in pipes.values():
        p.close(checkpoint=False)
    keep = os.path.join(os.getcwd(), f"bench-spark-policy-{app}")
    os.makedirs(keep, exist_ok=True)
    with open(os.path.join(keep, "out.json"), "w") as f:
        json.dump({"args": vars(a), "period": period, **out}, f, default=str)
    print(f"\n{a.master}, W={a.workers}, group-by over a state of {a.keys:,} keys, steps of {a.rows:,} rows, "
          f"{a.blocks} alternated blocks of {a.block} steps each, load {os.getloadavg()[0]:.1f}\n")
    print("| worker_recovery | step p50 ms | step mean ms | rows/s (mean) | driver CPU ms a step "
          "| state bytes uploaded "
          "a step | store requests a step | checkpoint after the blocks s (bytes uploaded) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in modes:
        n, lat = out["n"][m], out["lat"][m]
        mean = statistics.fmean(lat)
        req = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(out["req"][m].items()) if v)
        print(f"| {m} | {ms(lat)} | {1000 * mean:.0f} | {a.rows / mean:,.0f} | "
              f"{1000 * statistics.fmean(out['cpu'][m]):.0f} | {out['up'][m] / n:,.0f} | {req} | "
              f"{out['ckpt_s'][f'{m} after the blocks']:.1f} ({out[f'ckpt_up_{m}']:,}) |")
    print(f"\nsteps arrive every {period} s; the kill lands in the first step running {a.kill_after} s after a "
          f"checkpoint, while its Spark tasks run\n")
    print("| worker_recovery | back at the current step s | latency of each step from the kill until then, s | jobs "
          "before the kill s | steps since the checkpoint | recovery |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        k = out[f"kill_{m}"]
        dl = k["delta"]
        how = (f"{dl['lost_recoveries']} whole-pipeline recoveries, {dl['lost_replayed_steps']} steps replayed, "
               f"{dl['lost_recovery_s']:.1f} s" if m == "pipeline" else "")
        how += f"; {dl['state_fetches']} state fetches, {dl['state_fetch_bytes']:,} bytes, {dl['state_fetch_s']:.1f} s"
        print(f"| {m} | {k['back_s']:.1f} | {_fmt(k['lat'])} | {', '.join(f'{x:.1f}' for x in k['before'])} | "
              f"{k['steps_before']} | {how} |")


def _fmt(lat: list[tuple[int, float]]) -> str:
    return ", ".join(f"{x:.1f}" for _, x in lat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--period", type=float, default=0.0, help="s between step arrivals (0: twice the step p50)")
    ap.add_argument("--kill-after", type=float, default=30.0, help="s between the checkpoint and the kill")
    ap.add_argument("--run-after", type=float, default=60.0, help="s driven after the kill (at least)")
    ap.add_argument("--conf", action="append", default=[], help="an extra Spark setting k=v (repeatable)")
    ap.add_argument("--policy", action="store_true", help="worker_recovery 'alone' against 'pipeline' (docstring)")
    a = ap.parse_args()
    import pyspark
    from pyspark.sql import SparkSession

    from executor_kill import executors, kill_executor
    from s3_server import CREDENTIALS, S3Server
    from spark_glue import SparkPipeline
    from spark_timeline import read_events, render, summary, window

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    server = S3Server()
    tmp = tempfile.mkdtemp(prefix="bench-spark-lose-")
    evdir = os.path.join(tmp, "events")
    os.makedirs(evdir)
    pp = os.pathsep.join([os.path.dirname(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    b = (SparkSession.builder.master(a.master).appName("bench-spark-lose").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", str(a.workers))
         .config("spark.executorEnv.PYTHONPATH", pp).config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
         .config("spark.executor.memory", "768m").config("spark.task.maxFailures", "8")
         .config("spark.deploy.maxExecutorRetries", "-1").config("spark.eventLog.enabled", "true")
         .config("spark.eventLog.dir", "file://" + evdir).config("spark.eventLog.compress", "false"))
    for kv in a.conf:
        k, v = kv.split("=", 1)
        b = b.config(k, v)
    for k, v in CREDENTIALS.items():
        b = b.config(f"spark.executorEnv.{k}", v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    app = spark.sparkContext.applicationId
    if a.policy:
        try:
            policy(a, spark, server, tmp, app)
        finally:
            spark.stop()
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        return
    rng = np.random.default_rng(33)
    data = [pa.table({"k": rng.integers(0, a.keys, a.rows), "v": rng.integers(0, 1000, a.rows)}) for _ in range(64)]
    out: dict = {}
    try:
        uri = server.uri(server.bucket(), "pipe")
        kw = dict(workers=a.workers, checkpoint_interval=None)
        pl = SparkPipeline(spark, circuit(), storage=os.path.join(tmp, "local"), **kw) if a.blocks else None
        ps = SparkPipeline(spark, circuit(), storage=uri, cache_dir=os.path.join(tmp, "driver"), **kw)
        out["load_s"] = {"local": load(pl, a.keys) if pl else float("nan"), "store": load(ps, a.keys),
                         "store1": float("nan")}  # the store pipeline's state, loaded once
        print(f"loaded {a.keys:,} keys: {out['load_s']}", flush=True)
        lat: dict[str, list[float]] = {"local": [], "store": [], "store1": []}
        cpu: dict[str, list[float]] = {"local": [], "store": [], "store1": []}  # the driver's CPU s a step
        up0, req0 = ps.stats.get("state_upload_bytes", 0), server.requests()
        up1 = req1 = None  # the same for the store's steps with one Spark job a stage (counted apart)
        for blk in range(a.blocks):  # alternated blocks, same data
            order = [("local", pl), ("store", ps), ("store1", ps)]
            for name, p in order if blk % 2 == 0 else order[::-1]:
                ps.runner.job_per_executor = name != "store1"  # store1: one Spark job a stage (placement note 6)
                u, r = ps.stats.get("state_upload_bytes", 0), server.requests()
                for t in data[blk * a.block:(blk + 1) * a.block]:
                    c0 = time.process_time()
                    lat[name].append(step(p, t))
                    cpu[name].append(time.process_time() - c0)
                if name == "store1":  # not the store's steps of the upload cost below
                    up1 = (up1 or 0) + ps.stats.get("state_upload_bytes", 0) - u
                    r1 = server.requests()
                    req1 = {k: (req1 or {}).get(k, 0) + v - r.get(k, 0) for k, v in r1.items()}
                    up0 += ps.stats.get("state_upload_bytes", 0) - u
                    req0 = {k: req0.get(k, 0) + v - r.get(k, 0) for k, v in r1.items()}
        ps.runner.job_per_executor = True
        if pl is None:  # --blocks 0: no upload-cost comparison, a few steps to set the period
            lat["store"] = [step(ps, t) for t in data[:a.block]]
            lat["local"] = lat["store1"] = [float("nan")]
        out["lat"], out["cpu"] = lat, cpu
        out["store1"] = {"upload_bytes": up1, "requests": req1}
        out["upload_bytes"] = ps.stats.get("state_upload_bytes", 0) - up0
        out["requests"] = {k: v - req0.get(k, 0) for k, v in sorted(server.requests().items())}  # the store's steps only
        if pl is not None:
            pl.close(checkpoint=False)
        base = statistics.median(lat["store"])
        period = a.period or round(2 * base, 1)
        print(f"step p50 local {ms(lat['local'])} ms, store {ms(lat['store'])} ms; period {period} s", flush=True)

        # (1) one Spark executor lost kill_after s after a checkpoint; steps go on arriving every period s
        ps.checkpoint()
        d1 = Driven(data, period, time.time())
        killed: list = []

        def kill_at(t: float) -> None:
            """At ``t`` or just after: while the first step running then has Spark tasks running (mid-step)."""
            time.sleep(max(0.0, t - time.time()))
            st = spark.sparkContext.statusTracker()
            while not (d1.running_since is not None and any(
                    (info := st.getStageInfo(s)) is not None and info.numActiveTasks > 0
                    for s in st.getActiveStageIds())):
                time.sleep(0.02)
            live = executors(app)
            eid = sorted(live)[0]
            killed.append((eid, time.time()))
            kill_executor(live[eid])

        th = threading.Thread(target=kill_at, args=(d1.t0 + a.kill_after,))
        th.start()
        f0 = {k: dict(v) if isinstance(v, dict) else v for k, v in ps.stats.items()}  # nested counts copied too
        d1.run(ps, d1.t0 + a.kill_after + a.run_after)
        th.join()
        tk = killed[0][1]
        while True:  # at least until the pipeline is back at the current step
            back, lat1 = d1.back(tk)
            if back == back or time.time() > tk + 600:
                break
            d1.run(ps, time.time() + 10)
        f1 = dict(ps.stats)
        inflight = next(j for j in d1.jobs if j[1] >= tk)
        out["one"] = {"back_s": back - tk, "lat": lat1, "inflight": (inflight[0] - tk, inflight[1] - tk),
                      "before": [e - s for s, e, st in d1.jobs if e < tk][-5:],
                      "delta": {k: f1.get(k, 0) - f0.get(k, 0) for k in ("state_fetches", "state_fetch_bytes",
                                                                         "state_fetch_s", "state_load_s",
                                                                         "state_loads", "state_cache_hits")},
                      "fetched_by": {f"{k[0]}/{k[1]}": n - f0.get("state_fetches_by", {}).get(k, 0)
                                     for k, n in f1.get("state_fetches_by", {}).items()},
                      "placement": dict(getattr(getattr(ps.runner, "placement", None), "stats", {}))}
        print(f"one Spark executor lost: {json.dumps(out['one'], default=str)}", flush=True)  # kept if cut short
        while len(executors(app)) < 2:  # the replacement, before the second failure
            time.sleep(0.5)

        # (2) the same failure with whole-pipeline recovery: at kill_after s after a checkpoint, an executor killed
        # and the driver lost; a new driver opens the store at the checkpoint and replays, the steps keep arriving
        ps.checkpoint()
        d2 = Driven(data, period, time.time())
        d2.done = 0
        d2.run(ps, d2.t0 + a.kill_after, stop_at=d2.t0 + a.kill_after)
        live = executors(app)
        tk2 = time.time()
        kill_executor(live[sorted(live)[0]])
        steps_at = ps.steps
        ps.close(checkpoint=False)
        shutil.rmtree(os.path.join(tmp, "driver"))
        q = SparkPipeline.open(spark, uri, circuit(), cache_dir=os.path.join(tmp, "driver2"), checkpoint_interval=None)
        opened = time.time() - tk2
        assert q.steps == steps_at, (q.steps, steps_at)
        d2.run(q, tk2 + a.run_after)
        while True:
            back2, lat2 = d2.back(tk2)
            if back2 == back2 or time.time() > tk2 + 600:
                break
            d2.run(q, time.time() + 10)
        out["whole"] = {"back_s": back2 - tk2, "open_s": opened, "lat": lat2,
                        "before": [e - s for s, e, st in d2.jobs if e < tk2][-5:]}
        q.close(checkpoint=False)
    finally:
        spark.stop()
        server.stop()
    keep = os.path.join(os.getcwd(), f"bench-spark-lose-{app}")  # the event log and the numbers, to read again
    shutil.copytree(evdir, os.path.join(keep, "events"))
    with open(os.path.join(keep, "out.json"), "w") as f:
        json.dump({"args": vars(a), "period": period, "kill": tk, "kill2": tk2, **out}, f, default=str)
    print(f"event log and numbers kept in {keep}")
    ev = read_events(evdir)
    shutil.rmtree(tmp, ignore_errors=True)
    lat = out["lat"]
    n = len(lat["store"])
    print(f"\n{a.master}, W={a.workers}, group-by over a state of {a.keys:,} keys, steps of {a.rows:,} rows, "
          f"{a.blocks} alternated blocks of {a.block} steps each, load {os.getloadavg()[0]:.1f}, "
          f"Spark settings {a.conf or 'as set here'}\n")
    print("| storage | state load s | step p50 ms | step mean ms | rows/s (mean) | driver CPU ms a step (mean) |")
    print("|---|---|---|---|---|---|")
    names = {"local": "shared local directory", "store": "S3 (moto, 127.0.0.1), per-job upload",
             "store1": "... the same, one Spark job a stage (`job_per_executor = False`)"}
    for name in ("local", "store", "store1"):
        mean = statistics.fmean(lat[name])
        cmean = statistics.fmean(out["cpu"][name]) if out["cpu"][name] else float("nan")
        print(f"| {names[name]} | {out['load_s'][name]:.1f} | {ms(lat[name])} | "
              f"{1000 * mean:.0f} | {a.rows / mean:,.0f} | {1000 * cmean:.0f} |")
    print(f"\nstate bytes uploaded by the store pipeline over its {n} steps: {out['upload_bytes']:,} "
          f"({out['upload_bytes'] / n:,.0f} per step); S3 requests per step: "
          f"{', '.join(f'{k} {v / n:.1f}' for k, v in out['requests'].items())}")
    one, whole = out["one"], out["whole"]
    print(f"\nsteps arrive every {period} s; the kill lands in the first step running {a.kill_after} s after a "
          f"checkpoint, while its Spark tasks run\n")
    print("| recovery | back at the current step s | latency of each step from the kill until then, s "
          "| jobs before the kill s |")
    print("|---|---|---|---|")
    print(f"| one Spark executor lost, the others keep their state | {one['back_s']:.1f} | {_fmt(one['lat'])} | "
          f"{', '.join(f'{x:.1f}' for x in one['before'])} |")
    print(f"| whole pipeline: new driver, SparkPipeline.open (open {whole['open_s']:.1f} s) | {whole['back_s']:.1f} | "
          f"{_fmt(whole['lat'])} | {', '.join(f'{x:.1f}' for x in whole['before'])} |")
    print(f"\none-executor loss, task-side: {one['delta']}; fetches per (stage, worker): "
          f"{ {k: v for k, v in one['fetched_by'].items() if v} }; task placement by cache: {one['placement']}")
    s0, s1 = one["inflight"]
    w = window(ev, tk, tk + s1)
    print(f"\nthe job in flight at the kill: started {s0:.1f} s before it, ended {s1:.1f} s after; its Spark timeline "
          f"from the kill (s):\n{render(w)}\n{summary(w)}")
    back = one["back_s"] if one["back_s"] == one["back_s"] else s1  # never back (nan): up to the job in flight's end
    w = window(ev, tk, tk + back)
    print(f"\nfrom the kill until back at the current step (or the job in flight's end): {summary(w)}")


if __name__ == "__main__":
    main()
