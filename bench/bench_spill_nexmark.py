"""Nexmark queries under a memory budget against the same engine without one: throughput ratio and peak RSS against the limit (issue 31's "Show").

Per query, two fresh child processes (each its own peak RSS), W=1, in memory (no storage), the events generated in
the child in ``--batch``-event steps (generation untimed; push + step timed):

1. "unlimited": no budget; after every step the bytes of every trace's batches (rows, weights, key hashes, row
   hashes: what a budget bounds, ``dbsp_core.trace.spill.batch_bytes``) are summed; the peak of that sum is the
   query's peak state.
2. "limited": ``memory_limit`` = ``--fraction`` (default 10%) of that peak state; the same events.

Printed and returned per run: events/s, peak RSS (ru_maxrss), the RSS before the first push (interpreter, imports,
the circuit: the baseline), the peak of the batches kept in memory plus the spilled files' fences and filters (the
budget's own accounting, sampled after each step), bytes on disk at the end, files written. The overhead stated
is peak RSS - limit: what the budget does not bound (baseline, the step's input and output batches, key indexes,
merge outputs being built, allocator slack).

Run:  python bench/bench_spill_nexmark.py --queries q4,q7,q9,q20 --events 5000000
      python bench/bench_spill_nexmark.py --queries q4 --events 200000   # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20


def child(query: str, events: int, batch: int, limit: int | None, seed: int) -> dict:
    import dbsp_core as dbsp
    from dbsp_core import nexmark
    from dbsp_core.metrics import rss_bytes
    from dbsp_core.runtime.embedded import EmbeddedExecutor
    from dbsp_core.trace.spill import batch_bytes

    next(nexmark.generate(1, seed=seed))  # the generator's string pools, drawn once per process
    ex = EmbeddedExecutor(background_merge=False)
    p = dbsp.Pipeline(nexmark.circuit(query), executor=ex, memory_limit=limit)
    base = rss_bytes() or 0
    seconds, peak_state, peak_budgeted, steps = 0.0, 0, 0, 0
    try:
        for b in nexmark.generate(events, seed=seed, batch=batch):
            t0 = time.perf_counter()
            for name, t in b.items():
                p.push(name, t)
            p.step()
            seconds += time.perf_counter() - t0
            steps += 1
            store = ex.batch_store
            if store is None:
                state = sum(batch_bytes(x) for t in ex._all_traces() for x in t._levels() + t.pending)
                peak_state = max(peak_state, state)
            else:
                mem, kept = store.memory()
                peak_budgeted = max(peak_budgeted, mem + kept)
        out = {"query": query, "events": events, "steps": steps, "seconds": seconds, "limit": limit,
               "base_rss": base, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "peak_state": peak_state, "peak_budgeted": peak_budgeted}
        store = ex.batch_store
        if store is not None:
            out.update(disk=store.disk_bytes(), files_written=store.stats["files_written"],
                       bytes_written=store.stats["bytes_written"], evictions=store.stats["evictions"])
    finally:
        p.close()
    return out


def run(query: str, events: int, batch: int, limit: int | None, seed: int) -> dict:
    arg = json.dumps({"query": query, "events": events, "batch": batch, "limit": limit, "seed": seed})
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arg], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{query} limit={limit} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", default="q4,q7,q9,q20")
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--batch", type=int, default=100_000, help="events per step")
    ap.add_argument("--fraction", type=float, default=0.10, help="memory_limit as a fraction of the peak state")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        a = json.loads(args.child)
        print(json.dumps(child(a["query"], a["events"], a["batch"], a["limit"], a["seed"])))
        return 0
    print(f"{args.events:,} events in steps of {args.batch:,}, W=1, limit {args.fraction:.0%} of the unlimited "
          f"run's peak state; load {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for q in args.queries.split(","):
        free = run(q, args.events, args.batch, None, args.seed)
        limit = max(1 * MIB, int(free["peak_state"] * args.fraction))
        lim = run(q, args.events, args.batch, limit, args.seed)
        r_free, r_lim = free["events"] / free["seconds"], lim["events"] / lim["seconds"]
        row = {"query": q, "free": free, "limited": lim}
        rows.append(row)
        print(f"{q}: unlimited {r_free:,.0f} ev/s, peak state {free['peak_state'] / MIB:,.0f} MiB, peak RSS "
              f"{free['peak_rss'] / MIB:,.0f} MiB (baseline {free['base_rss'] / MIB:,.0f}) | limit "
              f"{limit / MIB:,.1f} MiB: {r_lim:,.0f} ev/s = {r_lim / r_free:.2f}x, peak RSS "
              f"{lim['peak_rss'] / MIB:,.0f} MiB (baseline {lim['base_rss'] / MIB:,.0f}; over the limit "
              f"{(lim['peak_rss'] - limit) / MIB:,.0f}), budgeted peak {lim['peak_budgeted'] / MIB:,.1f} MiB, "
              f"on disk {lim.get('disk', 0) / MIB:,.0f} MiB, written {lim.get('bytes_written', 0) / MIB:,.0f} MiB "
              f"in {lim.get('files_written', 0)} files; load {os.getloadavg()[0]:.2f}", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
