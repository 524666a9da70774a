"""Per-step overhead of SparkPipeline against an empty Spark job: one step per job, and k queued steps per job.

Run: ``PYTHONPATH=. python bench/bench_spark_overhead.py [--reps 10] [--workers 2] [--rows 0]``

Prints medians: the empty job (``sc.parallelize([], W).count()``), a bare mapInArrow + shuffle + collect job,
and SparkPipeline's time per step for k = 1, 4, 16, 64 steps per job on a group-by circuit (two stages: input
side and aggregate), with ``--rows`` rows pushed per step (0 = empty steps), each as a ratio to the empty job.

Last run (2 shared cores, load average 4-4.6, local[2], W=2; medians):

    empty Spark job 176 ms; mapInArrow + shuffle + collect 456 ms
    empty steps:  1/job 423 ms per step (2.40x the empty job, 0.93x mapInArrow+shuffle)
                  4/job 112 ms (0.63x), 16/job 26 ms (0.15x), 64/job 7.4 ms (0.04x)
    10k rows/step (empty job 148 ms): 1/job 323 ms (2.19x), 4/job 84 ms (0.57x), 16/job 28 ms (0.19x)

So one step per job costs about one two-stage Python Spark job; the 1.2x target holds from 4 queued steps
per job on.
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

import dbsp_core as dbsp


def median_ms(f, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=0, help="rows pushed per step")
    ap.add_argument("--ks", default="1,4,16,64")
    ap.add_argument("--master", default="local[2]")
    a = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(a.master).config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    from spark_glue import SparkPipeline

    W = a.workers
    sc = spark.sparkContext

    def ident(it):
        yield from it

    empty = median_ms(lambda: sc.parallelize([], W).count(), a.reps)
    bare = median_ms(lambda: spark.range(0, W, 1, W).mapInArrow(ident, "id long").repartition(W, "id")
                     .mapInArrow(ident, "id long").toArrow(), a.reps)
    print(f"empty Spark job: {empty:.1f} ms; mapInArrow + shuffle + collect: {bare:.1f} ms "
          f"({bare / empty:.2f}x); load {os.getloadavg()[0]:.2f}", flush=True)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    s = c.input("s", schema)
    c.output("agg", s.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    rng = np.random.default_rng(0)
    root = tempfile.mkdtemp(prefix="bench-spark-overhead-")
    try:
        for k in [int(x) for x in a.ks.split(",")]:
            p = SparkPipeline(spark, c, workers=W, storage=os.path.join(root, f"k{k}"), checkpoint_interval=None,
                              max_steps_per_job=k)

            def job() -> None:
                for _ in range(k):
                    if a.rows:
                        p.push("s", pa.table({"k": rng.integers(0, 1000, a.rows), "v": rng.integers(0, 100, a.rows)},
                                             schema=schema))
                    p.queue_step()
                outs = p.run_queued()
                assert len(outs) == k

            ms = median_ms(job, max(3, a.reps * 4 // (k + 3)), warm=1) / k
            hits, part = p.stats.get("state_cache_hits", 0), p.stats.get("state_partial_loads", 0)
            full = p.stats.get("state_loads", 0)
            print(f"SparkPipeline, {k:>2} step(s) per job, {a.rows} rows/step: {ms:.1f} ms per step = "
                  f"{ms / empty:.2f}x the empty job ({ms / bare:.2f}x mapInArrow+shuffle); stateful tasks: "
                  f"{hits} cache hits, {part} partial and {full} full loads; load {os.getloadavg()[0]:.2f}",
                  flush=True)
            p.close()
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
