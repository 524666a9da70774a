"""SparkPipeline with and without a memory budget (runtime/stage_task.py invariant 7) on the same group-by: peak RSS of the Spark executor's Python workers and load throughput, each run in a fresh process and Spark session so that every run's Python workers start empty.

The workload: ``SELECT k, count(*), sum(v) FROM s GROUP BY k`` (``--with-min``: and ``min(v)``, whose state under
deletion is every input row) over ``--rows`` rows with ``--rows / --dup`` keys,
pushed in ``--steps`` steps (one Spark job each), then ``--small`` steps of 1k rows. Peak RSS is each Python
worker's ``VmHWM`` (/proc, Linux) read after the last step: the Python workers are the processes below this one
whose command line names pyspark (local mode: the daemon's forked workers); the daemon is left out. Modes alternate
(none, budget, none, budget, ... with ``--repeat``).

Run: python bench/bench_spark_spill.py [--master local[2]] [--rows 3000000] [--steps 6] [--limit 128MiB] [--repeat 1]
     [--with-min]
Prints one line per run and a markdown table (copied into bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def python_workers_rss() -> list[dict[str, int]]:
    """Peak and current resident bytes (``VmHWM``, ``RssAnon``, ``RssFile``) of every pyspark worker process below this
    one (not the daemon, which forks them)."""
    kids, out, todo = _children(), [], list(_children().get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if "pyspark" not in cmd or kids.get(pid):  # the daemon is the parent of the workers
            continue
        out.append({k: int(status[k].split()[0]) * 1024 for k in ("VmHWM", "RssAnon", "RssFile")})
    return out


def one_run(a: argparse.Namespace, limit: str | None) -> dict:
    import numpy as np
    import pyarrow as pa
    from pyspark.sql import SparkSession

    import dbsp_core as dbsp
    from spark_glue import SparkPipeline

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    peak_dir = None
    if a.breakdown:  # every forked Python worker samples itself (bench/task_peak/sitecustomize.py)
        peak_dir = tempfile.mkdtemp(prefix="bench-task-peak-")
        os.environ["BENCH_TASK_PEAK_DIR"] = peak_dir
        os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "task_peak")] + [
            x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    spark = (SparkSession.builder.master(a.master).appName("bench-spark-spill")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    c = dbsp.Circuit()
    s = c.input("s", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    aggs = {"n": dbsp.count(), "total": dbsp.sum("v")}
    if a.with_min:  # min under deletion keeps every input row in a trace: state grows with the rows, not the keys
        aggs["lo"] = dbsp.min("v")
    c.output("agg", s.group_by("k").agg(**aggs))
    root = tempfile.mkdtemp(prefix="bench-spark-spill-")
    kw = {} if limit is None else {"memory_limit": limit, "spill_dir": os.path.join(root, "local")}
    p = SparkPipeline(spark, c, workers=a.workers, storage=os.path.join(root, "pipe"), checkpoint_interval=None, **kw)
    rng = np.random.default_rng(7)
    keys = max(1, a.rows // a.dup)
    per = a.rows // a.steps
    t0 = time.perf_counter()
    for _ in range(a.steps):
        p.push("s", pa.table({"k": rng.integers(0, keys, per), "v": rng.integers(0, 100, per)}))
        p.step()
    load_s = time.perf_counter() - t0
    small = []
    for _ in range(a.small):
        p.push("s", pa.table({"k": rng.integers(0, keys, 1000), "v": rng.integers(0, 100, 1000)}))
        t1 = time.perf_counter()
        p.step()
        small.append(time.perf_counter() - t1)
    procs = python_workers_rss()
    rss = [r["VmHWM"] for r in procs]
    spill = p.stats.get("task_spill", {})
    peaks: dict[str, list] = {"all": [], "commit": []}
    if peak_dir is not None:
        for name in os.listdir(peak_dir):
            if name.endswith(".json"):
                with open(os.path.join(peak_dir, name)) as f:
                    peaks["commit" if name.endswith(".commit.json") else "all"].append(json.load(f))
    p.close()
    spark.stop()
    return {"mode": limit or "none", "rows": per * a.steps, "load_s": load_s, "rows_per_s": per * a.steps / load_s,
            "small_ms": 1000 * sorted(small)[len(small) // 2] if small else None,
            "worker_peak_rss_max": max(rss, default=0), "worker_peak_rss_sum": sum(rss), "workers": len(rss),
            "worker_anon_end_max": max((r["RssAnon"] for r in procs), default=0),
            "worker_file_end_max": max((r["RssFile"] for r in procs), default=0),
            "bytes_written": spill.get("bytes_written", 0), "files_written": spill.get("files_written", 0),
            "limit_per_worker": spill.get("limit"),
            "breakdown": max(peaks["all"], key=lambda r: r["VmRSS"]) if peaks["all"] else None,
            "commit_breakdown": max(peaks["commit"], key=lambda r: r["VmRSS"]) if peaks["commit"] else None,
            "commit_held_max": spill.get("commit_held_max")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=3_000_000)
    ap.add_argument("--dup", type=int, default=2, help="rows per key on average")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--small", type=int, default=5, help="1k-row steps after the load (median latency)")
    ap.add_argument("--limit", default="128MiB", help="memory_limit per Spark executor of the budgeted runs")
    ap.add_argument("--with-min", action="store_true", help="add min(v): the group-by keeps every input row")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--modes", default="none,limit", help="which modes run, in this order (limit: --limit)")
    ap.add_argument("--breakdown", action="store_true",
                    help="record what the Python worker with the highest RSS held at its peak, and its stack")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this mode, print JSON
    a = ap.parse_args()
    if a.one is not None:
        print("RESULT " + json.dumps(one_run(a, None if a.one == "none" else a.one)), flush=True)
        return
    runs = []
    for _ in range(a.repeat):
        for mode in [a.limit if m == "limit" else m for m in a.modes.split(",")]:
            flags = [f"--{k.replace('_', '-')}" for k in ("with_min", "breakdown") if getattr(a, k)]
            args = [sys.executable, __file__, "--one", mode] + [
                x for k, v in vars(a).items() if k not in ("one", "with_min", "breakdown", "modes")
                for x in (f"--{k}", str(v))] + flags
            out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
            r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs.append(r)
            print(f"{r['mode']:>8}: {r['rows']:,} rows in {r['load_s']:.1f} s ({r['rows_per_s']:,.0f} rows/s), "
                  f"1k-row step p50 {r['small_ms']:.0f} ms, Python workers' peak RSS max "
                  f"{r['worker_peak_rss_max'] / 2**20:.0f} MiB sum {r['worker_peak_rss_sum'] / 2**20:.0f} MiB "
                  f"({r['workers']} workers; at the end anon max {r['worker_anon_end_max'] / 2**20:.0f} MiB, file "
                  f"{r['worker_file_end_max'] / 2**20:.0f} MiB), spilled {r['bytes_written'] / 2**20:.0f} MiB in {r['files_written']} "
                  f"files", flush=True)
            if r.get("breakdown"):
                print("    at the peak: " + json.dumps(r["breakdown"]), flush=True)
            if r.get("commit_breakdown"):
                print("    at the peak during a commit: " + json.dumps(r["commit_breakdown"]), flush=True)
            if r.get("commit_held_max") is not None:
                print(f"    most bytes a commit held: {r['commit_held_max'] / 2**20:.1f} MiB", flush=True)
    base = [r for r in runs if r["mode"] == "none"] or runs
    print("\n| memory_limit (per Spark executor) | rows/s | ratio | 1k-row step p50 | worker peak RSS max | sum |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        ratio = r["rows_per_s"] / (sum(b["rows_per_s"] for b in base) / len(base))
        print(f"| {r['mode']} | {r['rows_per_s']:,.0f} | {ratio:.2f} | {r['small_ms']:.0f} ms | "
              f"{r['worker_peak_rss_max'] / 2**20:.0f} MiB | {r['worker_peak_rss_sum'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
