"""Where a spilled pipeline's 1k-row step spends its time: per step, the time in the batch store's enforce (spills,
switches of files the spill thread wrote, cache trims), in Trace._work (merges the step pays), the bytes spilled,
files written and evictions, the slowest steps itemized, and with --prof a cProfile of the steps.

Run from the repository root (same workload as bench/bench_spill.py, one spilled pipeline):

    python bench/bench_spill_breakdown.py --query group_by --state 5M --groups 500k --limit 32MiB
    DBSP_KEY_INDEX=0 python bench/bench_spill_breakdown.py --query group_by --state 5M --groups 500k --prof
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_spill  # noqa: E402
from bench_scaling import _count  # noqa: E402

from dbsp_core.trace import levels, spill  # noqa: E402

TIMED = collections.defaultdict(float)  # seconds per wrapped function, this step


def _timed(cls: type, name: str) -> None:
    """Wrap ``cls.name`` to add its time to TIMED[name] (absent names are skipped: an older store)."""
    f = getattr(cls, name, None)
    if f is None:
        return

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            TIMED[name] += time.perf_counter() - t
    setattr(cls, name, g)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--query", default="group_by")
    ap.add_argument("--state", default="5M")
    ap.add_argument("--groups", default="500k")
    ap.add_argument("--limit", default="32MiB")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--slowest", type=int, default=8)
    ap.add_argument("--prof", action="store_true", help="cProfile the measured steps")
    a = ap.parse_args()
    for n in ("enforce", "_spill", "_switch_written", "_trim_cache"):
        _timed(spill.BatchStore, n)
    _timed(levels.Trace, "_work")
    args = argparse.Namespace(load_step=200_000, change=1000)
    groups = _count(a.groups)
    p, rng, loaded = bench_spill.load(a.query, _count(a.state), groups, args, a.limit)
    store = p.executor.batch_store
    mem, kept = store.memory()
    print(f"{a.query} {a.state} rows, {a.groups} keys, limit {a.limit}: {len(store._files)} files, "
          f"{store.disk_bytes() / 2**20:.1f} MiB on disk, {mem / 2**20:.1f} MiB of batches in memory, "
          f"load {os.getloadavg()[0]:.2f}")
    prof = cProfile.Profile() if a.prof else None
    rows = []
    for k in range(a.steps):
        TIMED.clear()
        before = dict(store.stats)
        if prof:
            prof.enable()
        ms = bench_spill.one_step(p, rng, a.query, groups, 1000, loaded, k)
        if prof:
            prof.disable()
        d = {n: store.stats.get(n, 0) - before.get(n, 0) for n in ("files_written", "bytes_written", "evictions")}
        rows.append((ms, {n: v * 1e3 for n, v in TIMED.items()}, d))
    ms = np.array([r[0] for r in rows])
    print(f"steps {len(ms)}: mean {ms.mean():.2f} ms p50 {np.percentile(ms, 50):.2f} p99 "
          f"{np.percentile(ms, 99):.2f} max {ms.max():.2f}; mean per step: "
          + ", ".join(f"{n} {np.mean([r[1].get(n, 0.0) for r in rows]):.2f} ms"
                      for n in ("enforce", "_spill", "_switch_written", "_trim_cache", "_work")))
    for i in np.argsort(-ms)[:a.slowest]:
        t, d = rows[i][1], rows[i][2]
        print(f"  step {i}: {ms[i]:.1f} ms = " + ", ".join(f"{n} {v:.1f} ms" for n, v in sorted(t.items()))
              + f"; files written {d['files_written']} ({d['bytes_written'] / 2**20:.1f} MiB), "
              f"evictions {d['evictions']}")
    print("store stats", store.stats)
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
