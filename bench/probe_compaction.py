"""The small steps after a bulk load (EmbeddedExecutor._compact_after_load, trace invariants 15-16): a distinct under
a 100 MiB budget loads N random rows in 1M-row steps, then runs 1k-row steps; prints the load's time, the max, mean
and p99 of the first 10 small steps, the mean and p99 of the next 100, the small step at whose end the compaction
was installed (``installed at``: 0 when the first small step compacted it itself, as on main), the mean and p99 of
100 small steps after that, the wall and process CPU (every thread) of the small steps up to there and of the whole
run, the bytes the store wrote (load, then the small steps), and the stepping thread's CPU a small step (``*_cpu_*``:
``time.thread_time``; W=1 runs worker 0 there; the merge thread's work is not in it). Modes: ``auto`` (the engine's
own compaction), ``settle`` (settle_merges called after the load, as the benchmarks do), ``none`` (the hook off: the
tiered batches stay). ``--gap MS`` sleeps that long between small steps (a stream paced below the engine's speed).
``python bench/probe_compaction.py 20000000 auto``; works on trees before the background compaction too."""
import argparse
import json
import resource
import time

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor

ap = argparse.ArgumentParser()
ap.add_argument("rows", type=int)
ap.add_argument("mode", choices=("auto", "settle", "none"))
ap.add_argument("--gap", type=float, default=0.0, help="ms slept between small steps")
ap.add_argument("--max-steps", type=int, default=20_000, help="small steps at most while waiting for the install")
args = ap.parse_args()
N, explicit = args.rows, args.mode == "settle"
if args.mode == "none":
    EmbeddedExecutor._compact_after_load = lambda self, rows: None


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


S = pa.schema([("k", pa.int64()), ("v", pa.int64())])
c = dbsp.Circuit()
c.output("d", c.input("t", S).distinct())
p = dbsp.Pipeline(c, memory_limit="100MiB")
rng = np.random.default_rng(1)
w0, c0 = time.perf_counter(), cpu()
for _ in range(N // 1_000_000):
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 1_000_000), "v": rng.integers(0, 3, 1_000_000)}, schema=S))
    p.step()
load = time.perf_counter() - w0
store = p.executor.batch_store
written_load = store.stats["bytes_written"]
if explicit:
    t0 = time.perf_counter()
    p.executor.settle_merges()
    settle = time.perf_counter() - t0
else:
    settle = 0.0


cpus: list[float] = []  # each small step's CPU on the stepping thread (W=1: worker 0 runs there), ms


def small() -> float:
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 1000), "v": rng.integers(0, 3, 1000)}, schema=S))
    t0, c0 = time.perf_counter(), time.thread_time()
    p.step()
    cpus.append((time.thread_time() - c0) * 1000)
    return (time.perf_counter() - t0) * 1000


def compacting() -> bool:
    return bool(getattr(p.executor, "_compacting", ()) or getattr(p.executor, "_compact_due", False))


ws, cs = time.perf_counter(), cpu()
ts, installed = [], None
while len(ts) < 110 or (installed is None and len(ts) < args.max_steps):
    ts.append(small())
    if installed is None and store.stats["compactions"] and not compacting():
        installed = len(ts)
    if args.gap:
        time.sleep(args.gap / 1000)
upto_wall, upto_cpu = time.perf_counter() - ws, cpu() - cs
after = np.array([small() for _ in range(100)])
total_wall, total_cpu = time.perf_counter() - w0, cpu() - c0
first, nxt = np.array(ts[:10]), np.array(ts[10:110])
out = {
    "rows": N, "mode": args.mode, "gap_ms": args.gap, "load_s": round(load, 2), "settle_s": round(settle, 2),
    "first10_max": round(first.max(), 2), "first10_mean": round(first.mean(), 2),
    "first10_p99": round(float(np.percentile(first, 99)), 2),
    "next100_mean": round(nxt.mean(), 2), "next100_p99": round(float(np.percentile(nxt, 99)), 2),
    "installed_at": (installed - 1) if installed else None, "small_steps": len(ts),
    "after_mean": round(after.mean(), 2), "after_p99": round(float(np.percentile(after, 99)), 2),
    "small_wall_s": round(upto_wall, 2), "small_cpu_s": round(upto_cpu, 2),
    "total_wall_s": round(total_wall, 1), "total_cpu_s": round(total_cpu, 1),
    "written_load_mib": written_load >> 20, "written_small_mib": (store.stats["bytes_written"] - written_load) >> 20,
    "compactions": store.stats["compactions"], "disk_mib": store.disk_bytes() >> 20,
    "first10_cpu_max": round(max(cpus[:10]), 2), "next100_cpu_mean": round(float(np.mean(cpus[10:110])), 2),
    "after_cpu_mean": round(float(np.mean(cpus[-100:])), 2),
}
print(json.dumps(out))
p.close()
