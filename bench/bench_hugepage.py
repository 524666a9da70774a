"""Huge-page advice on or off (csrc/scratch.c design note 2, ``DBSP_HUGEPAGES``): per-call time of real kernels.

Each mode runs in a child process of its own (the C core reads ``DBSP_HUGEPAGES`` once), the modes alternated
round by round (order swapped every round); each child calls each kernel ``--calls`` times on the same input,
trimming the C caches to ``DBSP_CACHE_KEEP_MB`` after every call as the runtime does after a step
(runtime/embedded.py), so each call allocates its large buffers afresh as a step does. Per kernel and mode: wall
time per call (mean, p50, p99, max), CPU per call (``getrusage``, the process), and the /proc/vmstat deltas
``compact_stall``, ``thp_fault_alloc``, ``thp_fault_fallback`` over the kernel's calls (system-wide: other
processes' faults count too).

    python bench/bench_hugepage.py --rounds 3 --calls 50
    python bench/bench_hugepage.py --nexmark q4,q7 --rounds 4   # end to end: bench/nexmark.py's child run

With ``--nexmark``, the events are written once (bench/nexmark.py's defaults: 1M events, steps of 100k, seed 0,
its event rate) and each query runs in bench/nexmark.py's child process per mode, alternated: its steps' wall
time (what nexmark.py reports), the child's CPU (``RUSAGE_CHILDREN``: the whole process, reading the files
included) and the vmstat deltas over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

VMSTAT = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback")


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in VMSTAT:
                out[k] = int(v)
    return out


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rows(n: int, seed: int):
    """Nexmark-like rows: an auction-ish int key (n/8 distinct), a bidder, a price, a date-time and a url string."""
    import pyarrow as pa
    g = np.random.default_rng(seed)
    key = g.integers(0, max(n // 8, 1), n)
    return pa.table({"auction": key, "bidder": g.integers(0, 1 << 20, n), "price": g.integers(1, 10**6, n),
                     "ts": g.integers(0, 10**12, n),
                     "url": pa.array([f"https://www.nexmark.com/item/{k}" for k in key.tolist()])})


def child(calls: int, kernels: list[str]) -> dict:
    from dbsp_core import _zset
    from dbsp_core.envvars import settings
    from dbsp_core.zset import ZSet

    keep = settings().cache_keep_mb << 20
    z92 = ZSet.from_arrow(rows(92_000, 1))
    z1m = ZSet.from_arrow(rows(1_000_000, 2))
    z1m_b = ZSet.from_arrow(rows(1_000_000, 3))
    ix_a, ix_b = z1m.index_by(["auction"]), z1m_b.index_by(["auction"])
    perm = np.random.default_rng(4).permutation(1_000_000)
    work = {
        "index_by 92K": lambda: z92.index_by(["auction"]),
        "index_by 1M": lambda: z1m.index_by(["auction"]),
        "consolidate 1M": lambda: ZSet._make(z1m.data, z1m.weights, consolidated=False).consolidate(),
        "join 1M x 1M": lambda: ix_a.join(ix_b),
        "gather 1M": lambda: ix_a.take(perm),
    }
    out = {"hugepages": _zset.hugepages(), "kernels": {}}
    for name in kernels:
        fn = work[name]
        fn()  # warm: first-call costs (imports, lazy tables) are not the advice's
        _zset.trim_caches(keep)
        walls, cpus = [], []
        v0 = vmstat()
        for _ in range(calls):
            c0, t0 = cpu(), time.perf_counter()
            r = fn()
            t1, c1 = time.perf_counter(), cpu()
            del r
            _zset.trim_caches(keep)
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
        v1 = vmstat()
        out["kernels"][name] = {"wall": walls, "cpu": cpus, "vmstat": {k: v1[k] - v0[k] for k in VMSTAT}}
    return out


KERNELS = ["index_by 92K", "index_by 1M", "consolidate 1M", "join 1M x 1M", "gather 1M"]


def stats(xs: list[float]) -> str:
    a = np.array(xs) * 1e3
    return (f"mean {a.mean():6.2f}  p50 {np.percentile(a, 50):6.2f}  p99 {np.percentile(a, 99):6.2f}  "
            f"max {a.max():6.2f} ms")


def nexmark_pairs(queries: list[str], rounds: int, events: int, workers: int) -> None:
    import shutil
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import nexmark as bench_nexmark  # bench/nexmark.py

    root = tempfile.mkdtemp(prefix="hugepage-nexmark-")
    try:
        files, _ = bench_nexmark.write_events(root, events, 100_000, 0, bench_nexmark.nexmark.generator.DEFAULT_RATE)
        json.dump(files, open(os.path.join(root, "files.json"), "w"))
        for q in queries:
            got: dict[str, list[tuple[float, float, dict]]] = {"1": [], "0": []}
            for r in range(rounds):
                for mode in (("1", "0") if r % 2 == 0 else ("0", "1")):
                    arg = json.dumps({"query": q, "mode": "memory", "workers": workers, "root": root,
                                      "source": "parquet", "reader": "push"})
                    env = dict(os.environ, DBSP_HUGEPAGES=mode, PYTHONPATH=os.path.dirname(here))
                    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    v0 = vmstat()
                    p = subprocess.run([sys.executable, os.path.join(here, "nexmark.py"), "--child", arg], env=env,
                                       capture_output=True, text=True, check=True)
                    v1 = vmstat()
                    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    res = json.loads(p.stdout.strip().splitlines()[-1])
                    cpu_s = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
                    vm = {k: v1[k] - v0[k] for k in VMSTAT}
                    got[mode].append((res["seconds"], cpu_s, vm))
                    print(f"{q} W={workers} DBSP_HUGEPAGES={mode}: steps {res['seconds']:.3f} s wall "
                          f"({res['events'] / res['seconds']:,.0f} events/s), process cpu {cpu_s:.2f} s, "
                          + ", ".join(f"{k} {vm[k]}" for k in VMSTAT) + f"; load {os.getloadavg()[0]:.1f}",
                          flush=True)
            for mode in ("1", "0"):
                w = [x[0] for x in got[mode]]
                c = [x[1] for x in got[mode]]
                print(f"  {q} advice {'on ' if mode == '1' else 'off'}: steps wall {min(w):.3f}-{max(w):.3f} s "
                      f"(mean {np.mean(w):.3f}), process cpu {min(c):.2f}-{max(c):.2f} s (mean {np.mean(c):.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write every call's figures here")
    ap.add_argument("--nexmark", help="queries, e.g. q4,q7: bench/nexmark.py's runs instead of the kernels")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args()
    if a.nexmark:
        print(f"uptime: {os.getloadavg()}")
        nexmark_pairs(a.nexmark.split(","), a.rounds, a.events, a.workers)
        return
    kernels = a.kernels.split(",")
    if a.child:
        json.dump(child(a.calls, kernels), sys.stdout)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"uptime: {os.getloadavg()}; THP enabled/defrag: "
          + " / ".join(open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip() for f in ("enabled", "defrag")))
    runs: dict[str, list[dict]] = {"1": [], "0": []}
    for r in range(a.rounds):
        for mode in (("1", "0") if r % 2 == 0 else ("0", "1")):
            env = dict(os.environ, DBSP_HUGEPAGES=mode, PYTHONPATH=here)
            p = subprocess.run([sys.executable, __file__, "--child", "--calls", str(a.calls), "--kernels", a.kernels],
                               env=env, capture_output=True, text=True, check=True)
            res = json.loads(p.stdout)
            assert res["hugepages"] == (mode == "1"), res["hugepages"]
            runs[mode].append(res)
            print(f"round {r} DBSP_HUGEPAGES={mode} done, load {os.getloadavg()[0]:.1f}", flush=True)
    for name in kernels:
        print(f"\n{name}")
        for mode in ("1", "0"):
            walls = [w for res in runs[mode] for w in res["kernels"][name]["wall"]]
            cpus = [c for res in runs[mode] for c in res["kernels"][name]["cpu"]]
            per_run = [float(np.mean(res["kernels"][name]["wall"]) * 1e3) for res in runs[mode]]
            vm = {k: [res["kernels"][name]["vmstat"][k] for res in runs[mode]] for k in VMSTAT}
            print(f"  advice {'on ' if mode == '1' else 'off'}: wall {stats(walls)}; cpu mean "
                  f"{np.mean(cpus) * 1e3:6.2f} ms; run means {', '.join(f'{m:.2f}' for m in per_run)}; "
                  + "; ".join(f"{k} {vm[k]}" for k in VMSTAT))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
