"""SparkPipeline with its storage on an object store (moto's S3 server, tests/s3_server.py) against a shared local directory, same data, one Spark session: step latency (a job of one step: the stage tasks upload their deltas before they commit, runtime/stage_store.py) and checkpoint time.

Run: python bench/bench_spark_store.py [--master local[2]] [--steps 30] [--rows 5000] [--keys 50000] [--workers 2]
[--store-only]; the store's run also counts the S3 server's requests per measured step (from its log).
Prints one line per configuration and a markdown table (copied into bench/RESULTS.md, object-storage section).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import dbsp_core as dbsp  # noqa: E402


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("s", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("agg", s.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    return c


def batches(steps: int, rows: int, keys: int, seed: int = 7) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    return [pa.table({"k": rng.integers(0, keys, rows), "v": rng.integers(0, 1000, rows)}) for _ in range(steps)]


def measure(spark, storage, data: list[pa.Table], warmup: int, workers: int = 2, server=None, **kw) -> dict:
    """Step latencies after ``warmup`` steps, checkpoint times, state traffic; with ``server`` (the S3 server), its
    requests over the measured steps."""
    from spark_glue import SparkPipeline

    p = SparkPipeline(spark, circuit(), workers=workers, storage=storage, checkpoint_interval=None, **kw)
    lat = []
    req0 = up0 = None
    for i, t in enumerate(data):
        if i == warmup:
            req0, up0 = (server.requests() if server else {}), p.stats.get("state_upload_bytes", 0)
        t0 = time.perf_counter()
        p.push("s", t)
        p.step()
        if i >= warmup:
            lat.append(time.perf_counter() - t0)
    req = {k: v - (req0 or {}).get(k, 0) for k, v in (server.requests() if server else {}).items()}
    steps_up = p.stats.get("state_upload_bytes", 0) - (up0 or 0)
    ck, up = [], []
    for _ in range(3):
        p.push("s", data[0])
        p.step()
        t0 = time.perf_counter()
        p.checkpoint()
        ck.append(time.perf_counter() - t0)
        up.append(p.stats.get("remote", {}).get("upload_s", 0.0))  # the store: uploads and manifest, no retention
    st = dict(p.stats)
    p.close(checkpoint=False)
    lat.sort()
    return {"p50_ms": 1000 * statistics.median(lat), "p90_ms": 1000 * lat[int(0.9 * (len(lat) - 1))],
            "mean_ms": 1000 * statistics.fmean(lat), "ckpt_ms": 1000 * statistics.median(ck),
            "commit_ms": 1000 * statistics.median(up),
            "upload_bytes": st.get("state_upload_bytes", 0), "fetches": st.get("state_fetches", 0),
            "fetch_bytes": st.get("state_fetch_bytes", 0), "steps_upload_bytes": steps_up,
            "requests": {k: v / max(len(lat), 1) for k, v in sorted(req.items())}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--keys", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--store-only", action="store_true", help="no shared-directory run")
    a = ap.parse_args()
    import pyspark
    from pyspark.sql import SparkSession
    from s3_server import CREDENTIALS, S3Server

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    server = S3Server()
    pp = os.pathsep.join([os.path.dirname(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    b = (SparkSession.builder.master(a.master).appName("bench-spark-store").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", str(a.workers))
         .config("spark.executorEnv.PYTHONPATH", pp).config("spark.executorEnv.PYSPARK_PYTHON", sys.executable))
    for k, v in CREDENTIALS.items():
        b = b.config(f"spark.executorEnv.{k}", v)
    if a.master.startswith("local-cluster"):
        b = b.config("spark.executor.memory", "768m")
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    data = batches(a.steps, a.rows, a.keys)
    rows = []
    try:
        if not a.store_only:
            d = tempfile.mkdtemp(prefix="bench-spark-local-")
            rows.append(("shared local directory", measure(spark, d, data, a.warmup, a.workers)))
            shutil.rmtree(d, ignore_errors=True)
        uri = server.uri(server.bucket(), "pipe")
        rows.append(("S3 (moto, 127.0.0.1)", measure(spark, uri, data, a.warmup, a.workers, server)))
    finally:
        spark.stop()
        server.stop()
    print(f"\n{a.master}, W={a.workers}, group-by of {a.rows} rows per step over {a.keys} keys, {a.steps} steps "
          f"({a.warmup} warm-up), one run, load {os.getloadavg()[0]:.1f}\n")
    print("| storage | step p50 ms | step p90 ms | step mean ms | checkpoint ms (of which upload + manifest) | "
          "state bytes uploaded | tasks that fetched | bytes fetched |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | {r['mean_ms']:.0f} | {r['ckpt_ms']:.0f} "
              f"({r['commit_ms']:.0f}) | "
              f"{r['upload_bytes']:,} | {r['fetches']} | {r['fetch_bytes']:,} |")
    st = rows[-1][1]
    print(f"\nstore, per measured step: {st['steps_upload_bytes'] / (a.steps - a.warmup):,.0f} state bytes uploaded; "
          f"S3 requests {', '.join(f'{k} {v:.1f}' for k, v in st['requests'].items())}")
    if len(rows) == 2:
        base = rows[0][1]
        print(f"\nstore / local: step p50 {st['p50_ms'] / base['p50_ms']:.2f}x, checkpoint "
              f"{st['ckpt_ms'] / base['ckpt_ms']:.2f}x")


if __name__ == "__main__":
    main()
