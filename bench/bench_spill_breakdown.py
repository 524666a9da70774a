"""Where a spilled pipeline's 1k-row step spends its time: per step, the time in the batch store's enforce (spills,
switches of files the spill thread wrote, cache trims and their parts: locating the pages reads used, the evictions'
madvise calls), in the reads of some keys (Trace.lookup, key_sums, match_weights, narrowed, walked, prefetch), in
Trace._work (merges the step pays), the pages used, evicted and the madvise calls, the bytes spilled, files written,
the slowest steps itemized, and with --prof a cProfile of the steps.

Run from the repository root (same workload as bench/bench_spill.py, one spilled pipeline):

    python bench/bench_spill_breakdown.py --query group_by --state 5M --groups 500k --limit 32MiB
    DBSP_KEY_INDEX=0 python bench/bench_spill_breakdown.py --query group_by --state 5M --groups 500k --prof
    python bench/bench_spill_breakdown.py --query join --state 10M --groups 10M --limit 100MiB --load-step 1M --steps 100
    python bench/bench_spill_breakdown.py --query join --state 10M --groups 10M --limit 100MiB --load-step 1M \
        --steps 60 --advise one,batched,one,batched
"""

from __future__ import annotations

import argparse
import cProfile
import mmap
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

from dbsp_core import _storage  # noqa: E402
from dbsp_core.trace import levels, spill  # noqa: E402

TIMED = collections.defaultdict(float)  # seconds per wrapped function, this step
CALLS = collections.defaultdict(int)  # madvise calls (runs of pages) per advice, this step


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


def _count_advice() -> None:
    """Count the runs of pages (one madvise call each) ``spill._advise`` hands to C, per advice, in CALLS."""
    f = spill._advise

    def g(m, pages, advice):
        runs = f(m, pages, advice)
        CALLS["evict" if advice == mmap.MADV_DONTNEED else "prefetch"] += runs
        return runs
    spill._advise = g


def show(rows: list, advise: str, slowest: int) -> None:
    """Print one phase's step times, the timed functions' mean per step, the counts and the slowest steps."""
    ms = np.array([r[0] for r in rows])
    print(f"advise {advise}, steps {len(ms)}: mean {ms.mean():.2f} ms p50 {np.percentile(ms, 50):.2f} p99 "
          f"{np.percentile(ms, 99):.2f} max {ms.max():.2f}, load {os.getloadavg()[0]:.2f}; mean per step (nested: "
          "enforce > _trim_cache > _pages_used, _evict_oldest, _evict; reads > narrowed, walked > prefetch):\n  "
          + ", ".join(f"{n} {np.mean([r[1].get(n, 0.0) for r in rows]):.2f} ms"
                      for n in ("enforce", "_spill", "_switch_written", "_trim_cache", "_pages_used", "_evict_oldest",
                                "_evict", "_work", "lookup", "key_sums", "match_weights", "narrowed", "walked",
                                "prefetch")), flush=True)
    print("  per step: " + ", ".join(f"{n} {np.mean([r[2].get(n, 0) for r in rows]):.1f}"
                                     for n in ("cache_hits", "cache_misses", "evictions", "evict", "evict_calls",
                                               "prefetch", "pages_prefetched"))
          + " (pages used = hits + misses; evictions = reads evicted; evict/prefetch = runs of pages advised; "
          f"evict_calls = system calls), evicted {np.mean([r[2].get('bytes_evicted', 0) for r in rows]) / 2**10:.0f} "
          "KiB", flush=True)
    for i in np.argsort(-ms)[:slowest]:
        t, d = rows[i][1], rows[i][2]
        print(f"  step {i}: {ms[i]:.1f} ms = " + ", ".join(f"{n} {v:.1f} ms" for n, v in sorted(t.items()))
              + f"; files written {d['files_written']} ({d['bytes_written'] / 2**20:.1f} MiB), "
              f"evictions {d['evictions']}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--query", default="group_by")
    ap.add_argument("--state", default="5M")
    ap.add_argument("--groups", default="500k")
    ap.add_argument("--limit", default="32MiB")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--load-step", type=_count, default=200_000)
    ap.add_argument("--advise", default="-", help="phases over the same loaded state, alternated (one,batched,one,"
                    "batched): the evictions' runs of pages a madvise each, or up to 1024 a system call; - as built")
    ap.add_argument("--slowest", type=int, default=8)
    ap.add_argument("--prof", action="store_true", help="then cProfile --steps more steps (the timed ones run without it)")
    a = ap.parse_args()
    for n in ("enforce", "_spill", "_switch_written", "_trim_cache", "_pages_used", "_evict_oldest", "prefetch"):
        _timed(spill.BatchStore, n)
    for n in ("_work", "lookup", "key_sums", "match_weights", "narrowed", "walked"):
        _timed(levels.Trace, n)
    _timed(spill, "_evict")
    _count_advice()
    args = argparse.Namespace(load_step=a.load_step, change=1000)
    groups = _count(a.groups)
    p, rng, loaded = bench_spill.load(a.query, _count(a.state), groups, args, a.limit)
    store = p.executor.batch_store
    mem, kept = store.memory()
    print(f"{a.query} {a.state} rows, {a.groups} keys, limit {a.limit}: {len(store._files)} files, "
          f"{store.disk_bytes() / 2**20:.1f} MiB on disk, {mem / 2**20:.1f} MiB of batches in memory, "
          f"load {os.getloadavg()[0]:.2f}")
    prof = cProfile.Profile() if a.prof else None
    counted = ("files_written", "bytes_written", "evictions", "cache_hits", "cache_misses", "bytes_evicted",
               "pages_prefetched", "evict_calls")
    k = 0
    for advise in a.advise.split(","):
        if advise != "-":  # the evictions' runs: a madvise each, or up to 1024 a process_madvise call
            _storage.advise_calls(one_by_one=advise == "one")
        rows = []
        for i in range(a.warmup + a.steps):
            TIMED.clear()
            CALLS.clear()
            before = dict(store.stats)
            ms = bench_spill.one_step(p, rng, a.query, groups, 1000, loaded, k)
            k += 1
            d = {n: store.stats.get(n, 0) - before.get(n, 0) for n in counted}
            d.update(CALLS)
            if i >= a.warmup:
                rows.append((ms, {n: v * 1e3 for n, v in TIMED.items()}, d))
        show(rows, advise, a.slowest)
    _storage.advise_calls(one_by_one=False)
    print("store stats", store.stats)
    if prof:
        for i in range(a.steps):
            prof.enable()
            bench_spill.one_step(p, rng, a.query, groups, 1000, loaded, k + i)
            prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
