"""The small steps after a bulk load (EmbeddedExecutor._compact_after_load, trace invariants 15-16): a distinct under
a 100 MiB budget loads N random rows in 1M-row steps, then runs 1k-row steps; prints the load's time, the max, mean
and p99 of the first 10 small steps, the mean and p99 of the next 100, the small step at whose end the compaction
was installed (``installed at``: 0 when the first small step compacted it itself, as on main), the mean and p99 of
100 small steps after that, the wall and process CPU (every thread) of the small steps up to there and of the whole
run, the bytes the store wrote (load, then the small steps), and the stepping thread's CPU a small step (``*_cpu_*``:
``time.thread_time``; W=1 runs worker 0 there; the merge thread's work is not in it). Modes: ``auto`` (the engine's
own compaction), ``settle`` (settle_merges called after the load, as the benchmarks do), ``none`` (the hook off: the
tiered batches stay). ``--gap MS`` sleeps that long between small steps (a stream paced below the engine's speed).
``--workers W``, ``--merge on|off`` (the merge thread; default: the engine's choice), ``--reopen`` (the load is
checkpointed, closed and reopened before the small steps: the compaction a reopened state makes due). The
``*_pcpu_*`` figures are each small step's process CPU (every thread: W=2's workers, the merge thread), ms;
``upto_*`` cover the small steps up to the install; ``install_*`` is the install step's CPU, ``pre_*`` the steps before it
and ``post10_*`` the worst of the 10 after it; ``post10_cpus`` each of those 10, ``post10_reclaim_mib`` the MiB of deleted
files the store gave back in each (``bytes_reclaimed``, spill.py ``_reclaim_files``), ``install_reclaim_mib`` in the
install step.
``PYTHONPATH=. python bench/probe_compaction.py 20000000 auto`` (the tree's dbsp_core, not the editable install's);
works on trees before the background compaction too."""
import argparse
import json
import os
import resource
import shutil
import tempfile
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
ap.add_argument("--workers", type=int, default=1)
ap.add_argument("--merge", choices=("default", "on", "off"), default="default", help="the merge thread")
ap.add_argument("--reopen", action="store_true", help="checkpoint, close and reopen after the load")
ap.add_argument("--dump", help="write each small step's stepping-thread CPU (ms) to this JSON file")
ap.add_argument("--reclaim-mib", type=int, help="BatchStore.RECLAIM_BYTES in MiB (the bytes of deleted files an enforce "
                                                "gives back at most; trees that have it)")
ap.add_argument("--prefault-mib", type=int, help="dbsp_core.trace.prefault.AHEAD in MiB (0: off; trees that have it)")
args = ap.parse_args()
N, explicit = args.rows, args.mode == "settle"
if args.reclaim_mib is not None:
    from dbsp_core.trace.spill import BatchStore
    BatchStore.RECLAIM_BYTES = args.reclaim_mib << 20
try:
    from dbsp_core.trace import prefault
except ImportError:  # a tree before it
    prefault = None
if args.prefault_mib is not None and prefault is not None:
    prefault.AHEAD = args.prefault_mib << 20
# each compaction slice's (_Merge.step) thread CPU ms (thread_time), its user and sys ms (getrusage: tick-sampled
# on some kernels, so only their sums mean much), minor faults
slices: list[tuple[float, float, float, int]] = []
try:
    from dbsp_core.trace.levels import _Merge
    _mstep = _Merge.step

    def _timed_step(self, budget):
        if not self.compaction:
            return _mstep(self, budget)
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        try:
            return _mstep(self, budget)
        finally:
            t1, r1 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
            slices.append(((t1 - t0) * 1000, (r1.ru_utime - r0.ru_utime) * 1000, (r1.ru_stime - r0.ru_stime) * 1000,
                           r1.ru_minflt - r0.ru_minflt))
    _Merge.step = _timed_step
except (ImportError, AttributeError):
    pass
if args.mode == "none":
    EmbeddedExecutor._compact_after_load = lambda self, rows: None


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


S = pa.schema([("k", pa.int64()), ("v", pa.int64())])
c = dbsp.Circuit()
c.output("d", c.input("t", S).distinct())


def executor() -> dict:
    return {} if args.merge == "default" else {"executor": EmbeddedExecutor(background_merge=args.merge == "on")}


root = tempfile.mkdtemp(prefix="probe-compaction-", dir=os.environ.get("TMPDIR", "/tmp")) if args.reopen else None
kw = dict(storage=root, checkpoint_interval=None) if root else {}
p = dbsp.Pipeline(c, memory_limit="100MiB", workers=args.workers, **kw, **executor())
rng = np.random.default_rng(1)
w0, c0 = time.perf_counter(), cpu()
for _ in range(N // 1_000_000):
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 1_000_000), "v": rng.integers(0, 3, 1_000_000)}, schema=S))
    p.step()
load = time.perf_counter() - w0
reopen_s = 0.0
if root:
    p.close()
    t0 = time.perf_counter()
    p = dbsp.Pipeline.open(root, c, memory_limit="100MiB", workers=args.workers, **executor())
    reopen_s = time.perf_counter() - t0
store = p.executor.batch_store
written_load = store.stats["bytes_written"]
if explicit:
    t0 = time.perf_counter()
    p.executor.settle_merges()
    settle = time.perf_counter() - t0
else:
    settle = 0.0


cpus: list[float] = []  # each small step's CPU on the stepping thread (W=1: worker 0 runs there), ms
pcpus: list[float] = []  # each small step's process CPU (every thread), ms
reclaimed: list[int] = []  # bytes of deleted files the store gave back during each small step (0 where none is)
rcpu = [0.0]  # thread CPU in the store's _reclaim_files so far, s (trees that have it)
if hasattr(store, "_reclaim_files"):
    _rf = store._reclaim_files

    def _timed_reclaim(*a, **k):
        t = time.thread_time()
        try:
            return _rf(*a, **k)
        finally:
            rcpu[0] += time.thread_time() - t
    store._reclaim_files = _timed_reclaim
reclaim_ms: list[float] = []  # of it, in each small step, ms
walls: list[float] = []  # each small step's wall ms
pusr: list[float] = []  # each small step's process user CPU, ms
psys: list[float] = []  # ... system CPU, ms
minflt: list[int] = []  # each small step's minor faults (process)
pfcpu: list[float] = []  # of the process CPU, the prefault thread's (prefault.py; 0 on trees without it), ms


def ru() -> tuple[float, float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    pf = prefault.cpu_seconds() if prefault is not None else 0.0
    return r.ru_utime, r.ru_stime, pf, r.ru_minflt


def small() -> float:
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 1000), "v": rng.integers(0, 3, 1000)}, schema=S))
    r0, q0 = store.stats.get("bytes_reclaimed", 0), rcpu[0]
    t0, c0, p0, u0 = time.perf_counter(), time.thread_time(), cpu(), ru()
    p.step()
    u1 = ru()
    walls.append((time.perf_counter() - t0) * 1000)
    pusr.append((u1[0] - u0[0]) * 1000)
    psys.append((u1[1] - u0[1]) * 1000)
    pfcpu.append((u1[2] - u0[2]) * 1000)
    minflt.append(u1[3] - u0[3])
    cpus.append((time.thread_time() - c0) * 1000)
    pcpus.append((cpu() - p0) * 1000)
    reclaimed.append(store.stats.get("bytes_reclaimed", 0) - r0)
    reclaim_ms.append((rcpu[0] - q0) * 1000)
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
    "workers": args.workers, "merge_thread": p.executor._merge_thread is not None, "reopen_s": round(reopen_s, 2),
    "upto_cpu_max": round(max(cpus[:len(ts)]), 2), "upto_cpu_p99": round(float(np.percentile(cpus[:len(ts)], 99)), 2),
    "upto_cpu_mean": round(float(np.mean(cpus[:len(ts)])), 2),
    "first10_pcpu_max": round(max(pcpus[:10]), 2), "upto_pcpu_max": round(max(pcpus[:len(ts)]), 2),
    "upto_pcpu_p99": round(float(np.percentile(pcpus[:len(ts)], 99)), 2),
    "upto_pcpu_mean": round(float(np.mean(pcpus[:len(ts)])), 2),
    "after_pcpu_mean": round(float(np.mean(pcpus[-100:])), 2),
    "after_pcpu_p99": round(float(np.percentile(pcpus[-100:], 99)), 2),
}
if installed:  # the install step apart from the steps before it (the slices), and the 10 after it
    pre, pre_p = cpus[:installed - 1] or [0.0], pcpus[:installed - 1] or [0.0]
    out.update({
        **{f"pre_{name}_{stat}": round(float(f(np.array(xs[:installed - 1] or [0.0]))), 2)
           for name, xs in (("wall", walls), ("usr", pusr), ("sys", psys), ("prefault", pfcpu),
                            ("noprefault", [a + b - c for a, b, c in zip(pusr, psys, pfcpu)]))
           for stat, f in (("mean", np.mean), ("p99", lambda a: np.percentile(a, 99)), ("max", np.max))},
        "pre_sys_total": round(sum(psys[:installed - 1]), 1), "pre_usr_total": round(sum(pusr[:installed - 1]), 1),
        "pre_prefault_total": round(sum(pfcpu[:installed - 1]), 1),
        "install_wall": round(walls[installed - 1], 2), "install_usr": round(pusr[installed - 1], 2),
        "install_sys": round(psys[installed - 1], 2),
        "after_noprefault_mean": round(float(np.mean([a + b - c for a, b, c in
                                                      zip(pusr[-100:], psys[-100:], pfcpu[-100:])])), 2),
        "after_prefault_total": round(sum(pfcpu[-100:]), 1),
        "after_minflt_mean": round(float(np.mean(minflt[-100:])), 1),
        "after_usr_mean": round(float(np.mean(pusr[-100:])), 2),
        "after_sys_mean": round(float(np.mean(psys[-100:])), 2),
        "after_wall_mean": round(float(np.mean(walls[-100:])), 2),
        "after_wall_p99": round(float(np.percentile(walls[-100:], 99)), 2),
        "install_cpu": round(cpus[installed - 1], 2), "install_pcpu": round(pcpus[installed - 1], 2),
        "pre_cpu_mean": round(float(np.mean(pre)), 2), "pre_cpu_p99": round(float(np.percentile(pre, 99)), 2),
        "pre_cpu_max": round(max(pre), 2), "pre_pcpu_mean": round(float(np.mean(pre_p)), 2),
        "pre_pcpu_p99": round(float(np.percentile(pre_p, 99)), 2), "pre_pcpu_max": round(max(pre_p), 2),
        "post10_cpu_max": round(max(cpus[installed:installed + 10]), 2),
        "post10_pcpu_max": round(max(pcpus[installed:installed + 10]), 2),
        "post10_cpus": [round(x, 2) for x in cpus[installed:installed + 10]],
        "post10_pcpus": [round(x, 2) for x in pcpus[installed:installed + 10]],
        "install_reclaim_mib": reclaimed[installed - 1] >> 20,
        "post10_reclaim_mib": [r >> 20 for r in reclaimed[installed:installed + 10]],
        "post10_reclaim_ms": [round(x, 2) for x in reclaim_ms[installed:installed + 10]],
        "install_reclaim_ms": round(reclaim_ms[installed - 1], 2),
        "reclaim_steps": int(np.count_nonzero(reclaimed)), "reclaim_mib": sum(reclaimed) >> 20,
        "reclaim_ms_total": round(sum(reclaim_ms), 1), "reclaim_ms_max": round(max(reclaim_ms), 2),
        "reclaim_calls": sum(1 for x in reclaim_ms if x > 0)})
if prefault is not None:  # (prefault.py) bytes its thread populated, and the stepping threads themselves
    out.update({"prefault_mib": prefault.populated >> 20, "prefault_late_mib": getattr(prefault, "late", 0) >> 20})
if slices:
    tot, su, ss = (np.array([x[i] for x in slices]) for i in range(3))
    out.update({"slices": len(slices), "slice_cpu_mean": round(float(tot.mean()), 2),
                "slice_cpu_p99": round(float(np.percentile(tot, 99)), 2), "slice_cpu_max": round(float(tot.max()), 2),
                "slice_sys_mean": round(float(ss.mean()), 2), "slice_sys_p99": round(float(np.percentile(ss, 99)), 2),
                "slice_sys_total": round(float(ss.sum()), 1), "slice_usr_total": round(float(su.sum()), 1),
                "slices_over_10ms": int((tot > 10).sum()),
                "slice_minflt_mean": round(float(np.mean([x[3] for x in slices])), 1)})
print(json.dumps(out))
if args.dump:
    with open(args.dump, "w") as f:
        json.dump({"cpu_ms": cpus, "pcpu_ms": pcpus, "wall_ms": walls, "usr_ms": pusr, "sys_ms": psys,
                   "prefault_ms": pfcpu, "slices": slices, "reclaimed": reclaimed, "reclaim_ms": reclaim_ms,
                   "installed_at": out["installed_at"]}, f)
p.close()
if root:
    shutil.rmtree(root, ignore_errors=True)
