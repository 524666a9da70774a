"""Spilled against in-memory state: 1k-row steps into distinct, join and group-by over a multi-million-row state held in memory, then with a memory budget that puts the state's big batches in batch files, with the pages a step reads from them.

Run from the repository root:

    python bench/bench_spill.py                                    # 2M rows, budget 16MiB, 200 steps per query
    python bench/bench_spill.py --state 5M --groups 500k --limit 32MiB --queries join
    python bench/bench_spill.py --state 200k --groups 20k --steps 20  # a check that it runs
    python bench/bench_spill.py --state 10M --groups 1M --limit 1GiB --runs 2   # the issue's budget, alternated

Per query, two pipelines (W=1, no storage) load ``--state`` bids in ``--load-step``-row steps (as
bench/bench_scaling.py: ``--groups`` keys), settle their merges and then run ``--warmup`` + ``--steps`` steps of
``--change`` rows (90% new bids, 10% deletions of loaded ones), timed with perf_counter around push and step:
"memory" without a budget, "spilled" with ``memory_limit=--limit``. For the spilled one, ``--cold`` more steps
each start with every batch file's pages out of the process and out of the page cache (madvise and fadvise
DONTNEED after a sync), and count after the step the pages of the files that are resident again (mincore(2)):
the pages the step read from disk (the mappings are MADV_RANDOM, so no read-ahead is counted). The key indexes
(trace invariant 11) answer distinct's and the group-by's lookups from memory; ``DBSP_KEY_INDEX=0`` in the
environment turns them off so those steps read the batches (what the Bloom filter and fences are for).
``--runs N`` alternates the two pipelines N times (memory, spilled, memory, ...) and prints each run and the
spread (lowest-highest) of the means and p99s; the spilled line also shows how many batches the store wrote off the
step (its spill thread) and how many of those were merged away before they were switched.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_scaling import AUCTIONS, _count, bids, circuit  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.envvars import settings  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(m: mmap.mmap) -> int:
    """Pages of the mapping ``m`` resident in memory (mincore(2): the page cache's view of the file)."""
    n = len(m)
    if n == 0:
        return 0
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    pages = (n + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum())


def drop_pages(store) -> None:
    """Every batch file's pages out of this process and out of the page cache (clean: synced first)."""
    os.sync()
    for f in list(store._files.values()):
        f.map.madvise(mmap.MADV_DONTNEED)
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(query: str, state: int, groups: int, args, limit) -> tuple[dbsp.Pipeline, np.random.Generator, list]:
    rng = np.random.default_rng(7)
    p = dbsp.Pipeline(circuit(query), executor=EmbeddedExecutor(background_merge=True), memory_limit=limit)
    if query == "join":
        import pyarrow as pa
        p.push("auctions", pa.table({"id": np.arange(groups), "category": np.arange(groups) % 50}, schema=AUCTIONS))
    loaded = []
    done = 0
    while done < state:
        n = min(args.load_step, state - done)
        t = bids(rng, n, query, groups)
        loaded.append(t.slice(0, min(n, 10_000)))
        p.push("bids", t)
        p.step()
        done += n
    p.executor.settle_merges()
    p.push("bids", bids(rng, 1, query, groups))
    p.step()  # installs the settled merges; the store (if any) spills the merged batches after it
    p.executor.settle_merges()  # and its spill thread has written them before the measured steps
    return p, rng, loaded


def one_step(p: dbsp.Pipeline, rng, query: str, groups: int, change: int, loaded: list, k: int) -> float:
    from dbsp_core import ZSet

    dels = change // 10
    src = loaded[k % len(loaded)]
    gone = src.slice((k * dels) % max(1, src.num_rows - dels), dels)
    t0 = time.perf_counter()
    p.push("bids", bids(rng, change - dels, query, groups))
    p.push("bids", ZSet.from_arrow(gone, weights=np.full(gone.num_rows, -1, dtype=np.int64)))
    p.step()
    return (time.perf_counter() - t0) * 1e3


def run(query: str, state: int, groups: int, args, limit) -> dict:
    t0 = time.perf_counter()
    p, rng, loaded = load(query, state, groups, args, limit)
    load_s = time.perf_counter() - t0
    ms = []
    for k in range(args.warmup + args.steps):
        x = one_step(p, rng, query, groups, args.change, loaded, k)
        if k >= args.warmup:
            ms.append(x)
    out = {"load_s": load_s, "mean": float(np.mean(ms)), "p50": float(np.percentile(ms, 50)),
           "p99": float(np.percentile(ms, 99)), "max": float(np.max(ms))}
    store = p.executor.batch_store
    if store is not None:
        mem, kept = store.memory()
        out.update(disk_mb=store.disk_bytes() / 2**20, mem_mb=mem / 2**20, kept_mb=kept / 2**20,
                   files=len(store._files), spilled_rows=sum(f.rows for f in store._files.values()),
                   background=store.stats.get("written_in_background", 0),
                   wasted=store.stats.get("written_for_nothing", 0),
                   written_mb=store.stats["bytes_written"] / 2**20)
        pages, cold, majflt = [], [], []
        for k in range(args.cold):
            drop_pages(store)
            files = list(store._files.values())
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            cold.append(one_step(p, rng, query, groups, args.change, loaded, args.warmup + args.steps + k))
            majflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0)
            pages.append(sum(resident_pages(f.map) for f in files))
        if pages:
            out.update(cold_mean=float(np.mean(cold)), cold_p99=float(np.percentile(cold, 99)),
                       pages=float(np.mean(pages)), pages_max=int(np.max(pages)), majflt=float(np.mean(majflt)))
    p.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queries", default="distinct,join,group_by")
    ap.add_argument("--state", default="2M")
    ap.add_argument("--groups", default="200k")
    ap.add_argument("--limit", default="16MiB", help="memory_limit of the spilled run")
    ap.add_argument("--load-step", type=_count, default=200_000)
    ap.add_argument("--change", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cold", type=int, default=20, help="steps measured with the files' pages dropped first")
    ap.add_argument("--runs", type=int, default=1, help="alternated memory/spilled runs per query")
    args = ap.parse_args()
    state, groups = _count(args.state), _count(args.groups)
    print(f"state {state:,} rows, {groups:,} keys, {args.change}-row steps, limit {args.limit}, "
          f"key indexes {'on' if settings().key_index else 'off'}, load {os.getloadavg()[0]:.2f}", flush=True)
    for q in args.queries.split(","):
        mems, sps = [], []
        for r in range(args.runs):
            mem = run(q, state, groups, args, None)
            sp = run(q, state, groups, args, args.limit)
            mems.append(mem)
            sps.append(sp)
            tag = f"{q:9s}" + (f" run {r + 1}" if args.runs > 1 else "")
            print(f"{tag} memory : mean {mem['mean']:.2f} ms p50 {mem['p50']:.2f} p99 {mem['p99']:.2f} "
                  f"max {mem['max']:.2f} (load {mem['load_s']:.1f} s)", flush=True)
            print(f"{tag} spilled: mean {sp['mean']:.2f} ms p50 {sp['p50']:.2f} p99 {sp['p99']:.2f} "
                  f"max {sp['max']:.2f} (load {sp['load_s']:.1f} s) = {sp['mean'] / mem['mean']:.2f}x mean, "
                  f"{sp['p99'] / mem['p99']:.2f}x p99; on disk {sp['disk_mb']:.1f} MiB in {sp['files']} files "
                  f"({sp['spilled_rows']:,} rows), batches in memory {sp['mem_mb']:.1f} MiB, fences+filters "
                  f"{sp['kept_mb']:.1f} MiB; written {sp['written_mb']:.0f} MiB, {sp['background']} files off the "
                  f"step ({sp['wasted']} more merged away first)", flush=True)
            if "pages" in sp:
                print(f"{tag} cold   : mean {sp['cold_mean']:.2f} ms p99 {sp['cold_p99']:.2f}; pages read per step "
                      f"{sp['pages']:.0f} (max {sp['pages_max']}) = {sp['pages'] * PAGE / 2**10:.0f} KiB, "
                      f"major faults {sp['majflt']:.0f}; {sp['pages'] / args.change:.2f} pages per changed row",
                      flush=True)
        if args.runs > 1:
            def spread(rs: list, k: str) -> str:
                return f"{min(x[k] for x in rs):.2f}-{max(x[k] for x in rs):.2f}"
            ratio_mean = [x["mean"] / m["mean"] for x, m in zip(sps, mems)]
            ratio_p99 = [x["p99"] / m["p99"] for x, m in zip(sps, mems)]
            print(f"{q:9s} over {args.runs} runs: memory mean {spread(mems, 'mean')} p99 {spread(mems, 'p99')} ms; "
                  f"spilled mean {spread(sps, 'mean')} p99 {spread(sps, 'p99')} ms; spilled/memory mean "
                  f"{min(ratio_mean):.2f}-{max(ratio_mean):.2f}x, p99 {min(ratio_p99):.2f}-{max(ratio_p99):.2f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
