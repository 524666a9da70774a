"""Issue 33 on local-cluster: the cost of the per-job state upload (a SparkPipeline on the S3 server against one on a shared local directory, same data, alternated blocks of steps) and the recovery after one Spark executor is killed (SIGKILL, local directories deleted) in the middle of a step, against whole-pipeline recovery of the same failure (SparkPipeline.open on a new driver from the last checkpoint).

Run: python bench/bench_spark_lose.py [--keys 200000] [--rows 2000] [--workers 4] [--blocks 2] [--block 6]
Prints the measurements and a markdown table (copied into bench/RESULTS.md, issue 33 section).
"""

from __future__ import annotations

import argparse
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


def load(p, keys: int, chunk: int = 100_000) -> float:
    """The state: ``keys`` distinct keys, pushed in steps of ``chunk`` rows."""
    t0 = time.perf_counter()
    for lo in range(0, keys, chunk):
        k = np.arange(lo, min(keys, lo + chunk))
        p.push("s", pa.table({"k": k, "v": k % 1000}))
        p.step()
    return time.perf_counter() - t0


def ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--block", type=int, default=6)
    ap.add_argument("--since", type=int, default=3, help="steps between the checkpoint and the kill")
    ap.add_argument("--after", type=int, default=6, help="steps measured after the recovery")
    a = ap.parse_args()
    import pyspark
    from pyspark.sql import SparkSession

    from executor_kill import executors, kill_executor
    from s3_server import CREDENTIALS, S3Server
    from spark_glue import SparkPipeline

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    server = S3Server()
    pp = os.pathsep.join([os.path.dirname(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    b = (SparkSession.builder.master(a.master).appName("bench-spark-lose").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", str(a.workers))
         .config("spark.executorEnv.PYTHONPATH", pp).config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
         .config("spark.executor.memory", "768m").config("spark.task.maxFailures", "8")
         .config("spark.deploy.maxExecutorRetries", "-1"))
    for k, v in CREDENTIALS.items():
        b = b.config(f"spark.executorEnv.{k}", v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    app = spark.sparkContext.applicationId
    rng = np.random.default_rng(33)
    data = [pa.table({"k": rng.integers(0, a.keys, a.rows), "v": rng.integers(0, 1000, a.rows)})
            for _ in range(a.blocks * a.block + a.since + a.after + 2)]
    tmp = tempfile.mkdtemp(prefix="bench-spark-lose-")
    out: dict = {}
    try:
        uri = server.uri(server.bucket(), "pipe")
        kw = dict(workers=a.workers, checkpoint_interval=None)
        pl = SparkPipeline(spark, circuit(), storage=os.path.join(tmp, "local"), **kw)
        ps = SparkPipeline(spark, circuit(), storage=uri, cache_dir=os.path.join(tmp, "driver"), **kw)
        out["load_s"] = {"local": load(pl, a.keys), "store": load(ps, a.keys)}
        lat: dict[str, list[float]] = {"local": [], "store": []}
        for blk in range(a.blocks):  # alternated blocks, same data
            for name, p in (("local", pl), ("store", ps)) if blk % 2 == 0 else (("store", ps), ("local", pl)):
                lat[name] += [step(p, t) for t in data[blk * a.block:(blk + 1) * a.block]]
        out["lat"] = lat
        out["upload_bytes"] = ps.stats.get("state_upload_bytes", 0)
        out["jobs"] = ps.stats.get("state_loads", 0) + ps.stats.get("state_cache_hits", 0)
        pl.close(checkpoint=False)
        rest = data[a.blocks * a.block:]
        base = statistics.median(lat["store"])

        # one executor lost mid-step: the pipeline goes on
        ps.checkpoint()
        for t in rest[:a.since]:
            step(ps, t)
        reached = ps.steps
        f0 = dict(ps.stats.get("state_fetches_by", {}))
        killed: list = []

        def kill_soon() -> None:
            time.sleep(0.3 * base)
            live = executors(app)
            eid = sorted(live)[0]
            killed.append((eid, time.perf_counter()))
            kill_executor(live[eid])

        th = threading.Thread(target=kill_soon)
        th.start()
        t0 = time.perf_counter()
        hit = step(ps, rest[a.since])
        th.join()
        after = [step(ps, t) for t in rest[a.since + 1:a.since + 1 + a.after]]
        f1 = dict(ps.stats.get("state_fetches_by", {}))
        out["one"] = {"hit": hit, "after": after, "reached": reached,
                      "fetched": {k: f1.get(k, 0) - f0.get(k, 0) for k in f1 if f1.get(k, 0) != f0.get(k, 0)},
                      "back_s": time.perf_counter() - t0 - sum(after)}
        while len(executors(app)) < 2:  # the replacement, before the second failure
            time.sleep(0.5)
        ck = ps.steps
        ps.checkpoint()
        for t in rest[:a.since]:
            step(ps, t)
        reached = ps.steps

        # the same failure with whole-pipeline recovery: a new driver opens the store at the checkpoint, replays
        live = executors(app)
        t0 = time.perf_counter()
        kill_executor(live[sorted(live)[0]])
        ps.close(checkpoint=False)
        shutil.rmtree(os.path.join(tmp, "driver"))
        q = SparkPipeline.open(spark, uri, circuit(), cache_dir=os.path.join(tmp, "driver2"), checkpoint_interval=None)
        opened = time.perf_counter() - t0
        assert q.steps == reached, (q.steps, reached, ck)
        after2 = [step(q, t) for t in rest[a.since:a.since + 1 + a.after]]
        out["whole"] = {"open_s": opened, "after": after2, "replayed": reached - ck}
        q.close(checkpoint=False)
    finally:
        spark.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lat = out["lat"]
    n = len(lat["store"])
    print(f"\n{a.master}, W={a.workers}, group-by over a state of {a.keys:,} keys, steps of {a.rows:,} rows, "
          f"{a.blocks} alternated blocks of {a.block} steps each, load {os.getloadavg()[0]:.1f}\n")
    print("| storage | state load s | step p50 ms | step mean ms | rows/s (mean) |")
    print("|---|---|---|---|---|")
    for name in ("local", "store"):
        mean = statistics.fmean(lat[name])
        print(f"| {'shared local directory' if name == 'local' else 'S3 (moto, 127.0.0.1), per-job upload'} | "
              f"{out['load_s'][name]:.1f} | {ms(lat[name])} | {1000 * mean:.0f} | {a.rows / mean:,.0f} |")
    print(f"\nstate bytes uploaded by the store pipeline over its {n + a.keys // 100_000} jobs: "
          f"{out['upload_bytes']:,}")
    one, whole = out["one"], out["whole"]
    print("\n| recovery | back at the step reached s | step latencies after it ms |")
    print("|---|---|---|")
    print(f"| one executor lost mid-step, the job retried (this branch) | {one['back_s']:.1f} (the step in flight "
          f"took {1000 * one['hit']:.0f} ms) | {', '.join(f'{1000 * x:.0f}' for x in one['after'])} |")
    print(f"| whole pipeline: SparkPipeline.open on a new driver, {whole['replayed']} steps replayed | "
          f"{whole['open_s']:.1f} | {', '.join(f'{1000 * x:.0f}' for x in whole['after'])} |")
    print(f"\ntasks that fetched their state after the one-executor loss, per (stage, worker): {one['fetched']}")


if __name__ == "__main__":
    main()
