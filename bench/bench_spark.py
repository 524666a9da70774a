"""Benchmarks of dbsp-core against Spark Structured Streaming on the same pre-generated micro-batches, in one run.

Workloads (insert-only streams, the same parquet files feed both systems, one file = one micro-batch):

  (a) agg:  ``SELECT k, count(*), sum(v) FROM s GROUP BY k``; Spark in update mode with the RocksDB state store
  (b) join: ``orders JOIN payments USING (order_id)`` (stream-stream inner join); Spark in append mode, RocksDB
  (c) the cost of an empty Spark job and of a trivial 2-partition mapInArrow + shuffle job: the reference for
      the per-step overhead target, next to the cost of an empty step of our Spark runtime when it exists

How the comparison is kept fair (documented in bench/RESULTS.md):

- Spark reads the batches with the file source (``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``), so
  every trigger is one file; our runtimes read the same file with pyarrow and push it, so both pay the read.
- Spark writes to the ``noop`` sink, which runs the whole plan (state store reads and writes included) and
  throws the rows away; our step returns the output change fully materialized as a Z-set.
- Spark uses ``shuffle.partitions = workers = 2`` (the default 200 would just add task overhead on 2 cores)
  and ``local[2]``; ours uses W=2.
- Latency per batch: Spark's ``durationMs.triggerExecution`` from the query progress (plan + read + state
  + commit of the offset and commit logs); ours: read + push + step (+ the durable logs when ``storage=``).
  Throughput = rows of the measured batches / the sum of their latencies; the first ``--warmup`` batches of
  every run are excluded for both (JIT, caches).

Run: python bench/bench_spark.py [--quick] [--batches N] [--rows N] [--groups N] [--group 4,8] [--only agg,join,empty]
     [--state-store rocksdb|rocksdb-changelog|default]
Prints one line per measurement and a final markdown table (copied into RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dbsp_core as dbsp  # noqa: E402

AGG = pa.schema([("k", pa.int64()), ("v", pa.int64())])
ORDERS = pa.schema([("order_id", pa.int64()), ("customer", pa.int64())])
PAYMENTS = pa.schema([("order_id", pa.int64()), ("amount", pa.int64())])
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"  # Spark's default
STATE_STORES = {  # --state-store: the provider and its settings, and the label printed beside Spark's figures
    "rocksdb": ({"spark.sql.streaming.stateStore.providerClass": ROCKSDB}, "RocksDB"),
    "rocksdb-changelog": ({"spark.sql.streaming.stateStore.providerClass": ROCKSDB,
                           "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true"},
                          "RocksDB changelog"),
    "default": ({"spark.sql.streaming.stateStore.providerClass": HDFS}, "default HDFS-backed store"),
}


# ---- data: written once, read by both systems ----

def _one_core_each():
    """Merges on the workers' threads: Spark runs local[W], so W worker threads are all the cores dbsp may use."""
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    return EmbeddedExecutor(background_merge=False)


def write_agg_batches(root: str, batches: int, rows: int, groups: int, seed: int = 7) -> str:
    d = os.path.join(root, "agg")
    os.makedirs(d)
    rng = np.random.default_rng(seed)
    for i in range(batches):
        t = pa.table({"k": rng.integers(0, groups, rows), "v": rng.integers(1, 1000, rows)}, schema=AGG)
        pq.write_table(t, os.path.join(d, f"part-{i:05d}.parquet"))
    return d


def write_join_batches(root: str, batches: int, rows: int, seed: int = 11) -> tuple[str, str]:
    """Per batch: ``rows`` new orders, and ``rows`` payments for orders of this batch or the previous one (each
    order is paid once), so every payment joins exactly one order, in the same batch or across batches."""
    do, dp = os.path.join(root, "orders"), os.path.join(root, "payments")
    os.makedirs(do)
    os.makedirs(dp)
    rng = np.random.default_rng(seed)
    unpaid = np.empty(0, np.int64)
    for i in range(batches):
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        rng.shuffle(ids)
        pool = np.concatenate([unpaid, ids])
        pay = pool[:rows]
        unpaid = pool[rows:]
        o = pa.table({"order_id": ids, "customer": rng.integers(0, 10_000, rows)}, schema=ORDERS)
        p = pa.table({"order_id": pay, "amount": rng.integers(1, 1000, rows)}, schema=PAYMENTS)
        pq.write_table(o, os.path.join(do, f"part-{i:05d}.parquet"))
        pq.write_table(p, os.path.join(dp, f"part-{i:05d}.parquet"))
    return do, dp


def files(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".parquet"))


# ---- circuits ----

def agg_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("s", AGG)
    c.output("out", s.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    return c


def join_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    o = c.input("orders", ORDERS)
    p = c.input("payments", PAYMENTS)
    c.output("out", o.join(p, on="order_id"))
    return c


# ---- measurement helpers ----

def summary(lat_s: list[float], rows: list[int], warmup: int) -> dict[str, float]:
    lat, n = lat_s[warmup:], rows[warmup:]
    if not lat:
        raise SystemExit("not enough batches after the warm-up; raise --batches")
    return {"rows_s": sum(n) / sum(lat), "p50_ms": 1e3 * float(np.median(lat)),
            "p90_ms": 1e3 * float(np.percentile(lat, 90)), "batches": len(lat)}


def fmt(name: str, r: dict[str, float]) -> str:
    return (f"{name}: {r['rows_s']:,.0f} rows/s, batch latency p50 {r['p50_ms']:.0f} ms, p90 {r['p90_ms']:.0f} ms "
            f"({r['batches']} batches)")


def loadavg() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- Spark Structured Streaming ----

def spark_session(workers: int, store: str = "rocksdb"):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark executors' Python workers need our pyarrow
    b = SparkSession.builder
    for k, v in STATE_STORES[store][0].items():
        b = b.config(k, v)
    return (b.master(f"local[{workers}]").appName("bench-spark")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "3g")
            .config("spark.sql.shuffle.partitions", str(workers))
            .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
            .config("spark.sql.adaptive.enabled", "false")  # AQE does not apply to streaming plans anyway
            .getOrCreate())


def spark_stream(spark, query: Callable[[Any], Any], sources: list[tuple[str, pa.Schema]], mode: str,
                 ckpt: str, rows_per_batch: list[int], warmup: int, sink: Any = None) -> dict[str, float]:
    """Run ``query`` over file streams of ``sources`` to the noop sink (or ``foreachBatch(sink)``), one file per
    trigger, until all are read."""
    from pyspark.sql.types import LongType, StructField, StructType

    streams = []
    for d, schema in sources:
        st = StructType([StructField(f.name, LongType(), False) for f in schema])
        streams.append(spark.readStream.schema(st).option("maxFilesPerTrigger", 1).parquet(d))
    w = query(*streams).writeStream
    w = w.format("noop").outputMode(mode) if sink is None else w.foreachBatch(sink)
    q = w.option("checkpointLocation", ckpt).trigger(availableNow=True).start()
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(f"Spark query failed: {q.exception()}")
    progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
    if len(progress) != len(rows_per_batch):
        raise RuntimeError(f"Spark ran {len(progress)} non-empty batches, expected {len(rows_per_batch)} "
                           f"(recentProgress keeps 100; lower --batches)")
    lat = [p["durationMs"]["triggerExecution"] / 1e3 for p in progress]
    rows = [int(p["numInputRows"]) for p in progress]
    assert rows == rows_per_batch, (rows, rows_per_batch)
    return summary(lat, rows, warmup)


# ---- ours ----

def dbsp_run(make_pipeline: Callable[[], Any], inputs: list[tuple[str, list[str]]], warmup: int,
             read: Callable[[str], Any] = pq.read_table) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Per batch: read one file per input, push it, step. Returns the summary and every step's output."""
    p = make_pipeline()
    lat, rows, outs = [], [], []
    try:
        for i in range(len(inputs[0][1])):
            t0 = time.perf_counter()
            n = 0
            for handle, fs in inputs:
                t = read(fs[i])
                n += t.num_rows if hasattr(t, "num_rows") else t.count()
                p.push(handle, t)
            outs.append(p.step())
            lat.append(time.perf_counter() - t0)
            rows.append(n)
    finally:
        p.close()
    return summary(lat, rows, warmup), outs


def dbsp_run_grouped(make_pipeline: Callable[[], Any], inputs: list[tuple[str, list[str]]], warmup: int,
                     group: int) -> dict[str, float]:
    """Like dbsp_run, but ``group`` batches become ``group`` queued steps run as one Spark job; the latency
    reported is the job's (from its first read to its last step's output), the rows its ``group`` batches."""
    p = make_pipeline()
    lat, rows = [], []
    try:
        nb = len(inputs[0][1])
        for g in range(0, nb, group):
            t0 = time.perf_counter()
            n = 0
            for i in range(g, min(g + group, nb)):
                for handle, fs in inputs:
                    t = pq.read_table(fs[i])
                    n += t.num_rows
                    p.push(handle, t)
                p.queue_step()
            p.run_queued()
            lat.append(time.perf_counter() - t0)
            rows.append(n)
    finally:
        p.close()
    return summary(lat, rows, max(1, warmup // group))


def spark_pipeline_cls():
    """Our Spark runtime, when this checkout has it (it is built in parallel with this benchmark)."""
    try:
        import spark_glue

        return getattr(spark_glue, "SparkPipeline", None)
    except ImportError:
        return None


# ---- the empty-job reference ----

def empty_jobs(spark, reps: int) -> dict[str, float]:
    sc = spark.sparkContext
    schema = "id long"

    def ident(it):
        yield from it

    def med(f: Callable[[], Any]) -> float:
        f()
        f()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    return {
        "empty_ms": med(lambda: sc.parallelize([], 2).count()),
        "arrow_shuffle_ms": med(lambda: spark.range(0, 2, 1, 2).mapInArrow(ident, schema)
                                .repartition(2, "id").mapInArrow(ident, schema).collect()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--rows", type=int, default=100_000, help="rows per micro-batch (per side for the join)")
    ap.add_argument("--groups", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--group", default="4", help="steps per Spark job in the queued SparkPipeline runs (a list: 4,8)")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of the empty jobs")
    ap.add_argument("--only", default="agg,join,empty")
    ap.add_argument("--state-store", default="rocksdb", choices=sorted(STATE_STORES),
                    help="Spark's state store: rocksdb (default here), rocksdb-changelog, or Spark's default")
    ap.add_argument("--no-spark-pipeline", action="store_true", help="skip spark_glue.SparkPipeline")
    a = ap.parse_args()
    if a.quick:
        a.batches, a.rows, a.groups, a.reps = 5, 20_000, 20_000, 5
    only = set(a.only.split(","))
    groups = [int(g) for g in str(a.group).split(",")]
    W = a.workers
    root = tempfile.mkdtemp(prefix="bench-spark-")
    results: list[tuple[str, str, dict[str, float]]] = []
    spark = spark_session(W, a.state_store)
    spark.sparkContext.setLogLevel("ERROR")
    store = STATE_STORES[a.state_store][1]
    SP = None if a.no_spark_pipeline else spark_pipeline_cls()
    print(f"# W={W}, {a.batches} batches x {a.rows:,} rows, warm-up {a.warmup}; pyspark {spark.version}; "
          f"SparkPipeline {'present' if SP else 'absent'}; {loadavg()}", flush=True)

    def ours(label: str, wl: str, make: Callable[[], Any], inputs, read=pq.read_table) -> dict[str, Any]:
        r, outs = dbsp_run(make, inputs, a.warmup, read)
        print(fmt(f"  {label}", r) + f"; {loadavg()}", flush=True)
        results.append((wl, label, r))
        return {"outs": outs}

    try:
        if "agg" in only:
            d = write_agg_batches(root, a.batches, a.rows, a.groups)
            fs = files(d)
            print(f"(a) group-by count/sum, {a.groups:,} groups", flush=True)
            r = spark_stream(spark, lambda s: s.groupBy("k").agg({"*": "count", "v": "sum"}), [(d, AGG)],
                             "update", os.path.join(root, "ck-agg"), [a.rows] * a.batches, a.warmup)
            print(fmt(f"  Spark SS ({store}, update, noop sink)", r) + f"; {loadavg()}", flush=True)
            results.append(("agg", "Spark SS", r))
            mem = ours("dbsp in memory", "agg", lambda: dbsp.Pipeline(agg_circuit(), workers=W, executor=_one_core_each()), [("s", fs)])
            dur = ours("dbsp durable", "agg", lambda: dbsp.Pipeline(agg_circuit(), workers=W, executor=_one_core_each(), storage=os.path.join(root, "dur-agg"), checkpoint_interval=1.0),
                [("s", fs)])
            _check_agg(mem["outs"], dur["outs"], fs)
            from spark_glue.streaming import foreach_batch

            p = dbsp.Pipeline(agg_circuit(), workers=W, executor=_one_core_each(), storage=os.path.join(root, "fb-agg"), checkpoint_interval=1.0)
            r = spark_stream(spark, lambda s: s, [(d, AGG)], "append", os.path.join(root, "ck-fb-agg"),
                             [a.rows] * a.batches, a.warmup, sink=foreach_batch(p, "s"))
            assert p.output_steps == range(a.batches)
            p.close()
            print(fmt("  Spark SS source -> foreach_batch -> dbsp durable", r) + f"; {loadavg()}", flush=True)
            results.append(("agg", "Spark SS -> foreach_batch -> dbsp durable", r))
            if SP is not None:
                ours("SparkPipeline", "agg", lambda: SP(spark, agg_circuit(), workers=W,
                                                        storage=os.path.join(root, "sp-agg"), checkpoint_interval=1.0),
                     [("s", fs)])
                p = SP(spark, agg_circuit(), workers=W, storage=os.path.join(root, "fb-sp-agg"), checkpoint_interval=1.0)
                r = spark_stream(spark, lambda s: s, [(d, AGG)], "append", os.path.join(root, "ck-fb-sp-agg"),
                                 [a.rows] * a.batches, a.warmup, sink=foreach_batch(p, "s"))
                assert p.output_steps == range(a.batches)
                p.close()
                print(fmt("  Spark SS source -> foreach_batch -> SparkPipeline", r) + f"; {loadavg()}", flush=True)
                results.append(("agg", "Spark SS -> foreach_batch -> SparkPipeline", r))
                for g in groups:
                    r = dbsp_run_grouped(lambda: SP(spark, agg_circuit(), workers=W,
                                                    storage=os.path.join(root, f"spq{g}-agg"), checkpoint_interval=1.0),
                                         [("s", fs)], a.warmup, g)
                    print(fmt(f"  SparkPipeline, {g} steps per job (latency = job)", r) + f"; {loadavg()}",
                          flush=True)
                    results.append(("agg", f"SparkPipeline, {g} steps per job (latency = job)", r))
        if "join" in only:
            do, dp = write_join_batches(root, a.batches, a.rows)
            fo, fp = files(do), files(dp)
            print(f"(b) stream-stream inner join, {a.rows:,} orders + {a.rows:,} payments per batch", flush=True)
            r = spark_stream(spark, lambda o, p: o.join(p, "order_id"), [(do, ORDERS), (dp, PAYMENTS)], "append",
                             os.path.join(root, "ck-join"), [2 * a.rows] * a.batches, a.warmup)
            print(fmt(f"  Spark SS ({store}, append, noop sink)", r) + f"; {loadavg()}", flush=True)
            results.append(("join", "Spark SS", r))
            inputs = [("orders", fo), ("payments", fp)]
            mem = ours("dbsp in memory", "join", lambda: dbsp.Pipeline(join_circuit(), workers=W, executor=_one_core_each()), inputs)
            ours("dbsp durable", "join", lambda: dbsp.Pipeline(join_circuit(), workers=W, executor=_one_core_each(), storage=os.path.join(root, "dur-join"), checkpoint_interval=1.0), inputs)
            n_out = sum(len(o["out"]) for o in mem["outs"])
            assert n_out == a.rows * a.batches, (n_out, a.rows * a.batches)  # every payment joins one order
            if SP is not None:
                ours("SparkPipeline", "join", lambda: SP(spark, join_circuit(), workers=W,
                                                         storage=os.path.join(root, "sp-join"), checkpoint_interval=1.0),
                     inputs)
                for g in groups:
                    r = dbsp_run_grouped(lambda: SP(spark, join_circuit(), workers=W, checkpoint_interval=1.0,
                                                    storage=os.path.join(root, f"spq{g}-join")), inputs, a.warmup, g)
                    print(fmt(f"  SparkPipeline, {g} steps per job (latency = job)", r) + f"; {loadavg()}",
                          flush=True)
                    results.append(("join", f"SparkPipeline, {g} steps per job (latency = job)", r))
        if "empty" in only:
            e = empty_jobs(spark, a.reps)
            print(f"(c) empty Spark job (parallelize([], 2).count()): median {e['empty_ms']:.1f} ms; 2-partition "
                  f"mapInArrow + shuffle + collect: median {e['arrow_shuffle_ms']:.1f} ms; {loadavg()}", flush=True)
            results.append(("empty", "Spark empty job", {"p50_ms": e["empty_ms"]}))
            results.append(("empty", "Spark mapInArrow+shuffle job", {"p50_ms": e["arrow_shuffle_ms"]}))
            if SP is not None:
                q = 8
                e2 = empty_step_ms(spark, SP, W, root, a.reps, q)
                results.append(("empty", f"SparkPipeline empty step ({e2['stages']} stages, one job)",
                                {"p50_ms": e2["one_ms"]}))
                results.append(("empty", f"SparkPipeline empty step, {q} queued steps per job",
                                {"p50_ms": e2["queued_ms"]}))
                print(f"  SparkPipeline empty step, {e2['stages']} stages: median {e2['one_ms']:.1f} ms as one job, "
                      f"{e2['queued_ms']:.1f} ms per step with {q} steps per job; {loadavg()}", flush=True)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    print_table(results)


def empty_step_ms(spark, SP, W: int, root: str, reps: int, queued: int) -> dict[str, float]:
    """Median time of a SparkPipeline step with no input (one Spark job), and per step when ``queued`` empty
    steps run as one job (``queue_step`` then ``run_queued``)."""
    p = SP(spark, agg_circuit(), workers=W, storage=os.path.join(root, "sp-empty"), checkpoint_interval=None)
    try:
        p.push("s", pa.table({"k": [1], "v": [1]}, schema=AGG))
        p.step()
        p.step()
        one, many = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            p.step()
            one.append(time.perf_counter() - t0)
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            for _ in range(queued):
                p.queue_step()
            p.run_queued()
            many.append((time.perf_counter() - t0) / queued)
    finally:
        p.close()
    return {"one_ms": 1e3 * statistics.median(one), "queued_ms": 1e3 * statistics.median(many),
            "stages": p.executor.plan.num_stages}


def _check_agg(mem: list[dict], dur: list[dict], fs: list[str]) -> None:
    """The two runs of ours agree with each other and with a from-scratch aggregate of all input."""
    integ_m = sum((o["out"] for o in mem[1:]), mem[0]["out"])
    integ_d = sum((o["out"] for o in dur[1:]), dur[0]["out"])
    assert integ_m.to_dict() == integ_d.to_dict()
    t = pa.concat_tables([pq.read_table(f) for f in fs]).group_by("k").aggregate([("v", "count"), ("v", "sum")])
    assert len(integ_m) == t.num_rows, (len(integ_m), t.num_rows)


def print_table(results: list[tuple[str, str, dict[str, float]]]) -> None:
    print("\n| workload | system | rows/s | batch p50 ms | batch p90 ms | throughput vs Spark SS |")
    print("|---|---|---|---|---|---|")
    base = {wl: r["rows_s"] for wl, name, r in results if name == "Spark SS"}
    empty = next((r["p50_ms"] for wl, name, r in results if name == "Spark empty job"), None)
    for wl, name, r in results:
        if "rows_s" in r:
            ratio = f"{r['rows_s'] / base[wl]:.2f}x" if wl in base else "-"
            print(f"| {wl} | {name} | {r['rows_s']:,.0f} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | {ratio} |")
        else:
            ratio = f"{r['p50_ms'] / empty:.2f}x empty job" if empty else "-"
            print(f"| {wl} | {name} | - | {r['p50_ms']:.1f} | - | {ratio} |")


if __name__ == "__main__":
    main()
