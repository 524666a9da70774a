"""Where a spilled state's memory budget goes, step by step (branch r31-share, issue 31): after each 1k-row step's
enforce, the bytes the store counts in memory (batches kept in memory per level, pending batches, merges in flight,
fences and filters of spilled files), the key indexes the cache holds, the cache's cap and the pages it holds, the
2 MiB units of the files left mapped and those the step's reads marked (what ``_bound_mapped`` drops), with the CPU
and minor faults of the step. Loads as bench/bench_spill.py does (same arguments: --state --groups --limit
--load-step --queries one query --no-compaction), then ``--steps`` steps; ``--phases old,new,...`` alternates
``BatchStore`` settings given by ``--set`` (``NAME=old:new`` pairs, comma-separated) over the same loaded state.

    python bench/spill_budget.py --state 10M --groups 10M --limit 100MiB --load-step 1M --queries join --no-compaction
"""
from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spill as bs  # noqa: E402
from dbsp_core.trace.spill import BatchStore, MAP_UNIT, batch_bytes, merge_bytes  # noqa: E402

MiB = 2 ** 20
_SPENT = {"enforce": 0.0, "_trim_cache": 0.0}  # thread CPU seconds inside these BatchStore methods


def _timed(name: str) -> None:
    """Count the stepping thread's CPU time inside ``BatchStore.<name>`` in ``_SPENT`` (two thread_time calls)."""
    orig = getattr(BatchStore, name)

    def wrapped(self, *a, **kw):  # type: ignore[no-untyped-def]
        t0 = time.thread_time()
        try:
            return orig(self, *a, **kw)
        finally:
            _SPENT[name] += time.thread_time() - t0

    setattr(BatchStore, name, wrapped)


def parts(store) -> dict:
    """The bytes the store counts in memory, by kind, and the cache's view, now (after an enforce)."""
    loose, pending, merges, by_level = 0, 0, 0, {}
    for t in store.traces():
        for lvl, level in enumerate(t._by_level):
            for e in level.loose:
                if id(e[1]) not in store._files:
                    n = batch_bytes(e[1])
                    loose += n
                    by_level[lvl] = by_level.get(lvl, 0) + n
            if level.merge is not None:
                merges += merge_bytes(level.merge) + sum(batch_bytes(e[1]) for e in level.merge.inputs
                                                         if id(e[1]) not in store._files)
        pending += sum(batch_bytes(b) for b in t.pending if id(b) not in store._files)
    kept = sum(f.memory_bytes() for f in list(store._files.values()))
    index = sum(n for _r, n, _w in store._index_used.values()) * 4096
    units = sum(int(np.count_nonzero(m)) for m in store._mapped.values())
    return dict(loose=loose, pending=pending, merges=merges, kept=kept, in_memory=store._in_memory,
                cap=store.cache_cap(), cached=store._cached * 4096, index=index, mapped=store._mapped_bytes,
                units=units, levels=by_level, files=len(store._files))


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser()
    for a, d in (("--queries", "join"), ("--state", "10M"), ("--groups", "10M"), ("--limit", "100MiB"),
                 ("--load-step", "1M"), ("--phases", "-"), ("--set", "")):
        ap.add_argument(a, default=d)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--change", type=int, default=1000)
    ap.add_argument("--auctions-step", type=bs._count, default=0)
    ap.add_argument("--no-compaction", action="store_true")
    args = ap.parse_args()
    args.load_step = bs._count(args.load_step)
    args.modes = "spilled"
    if args.no_compaction:
        bs.no_compaction()
    settings = {}
    for pair in filter(None, args.set.split(",")):
        name, vals = pair.split("=")
        old, new = vals.split(":")
        settings[name] = (eval(old), eval(new))  # noqa: S307 (bench settings from the command line)
    for name in _SPENT:
        _timed(name)
    q = args.queries
    print(f"{q} state {args.state} groups {args.groups} limit {args.limit} load {os.getloadavg()[0]:.2f}", flush=True)
    p, rng, loaded = bs.load(q, bs._count(args.state), bs._count(args.groups), args, args.limit)
    store = p.executor.batch_store
    k = 0
    for phase in args.phases.split(","):
        for name, (old, new) in settings.items():
            setattr(BatchStore, name, old if phase == "old" else new)
        rows, ms, cpu, flt = [], [], [], []
        st0 = None
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                st0 = dict(store.stats)
                spent0 = dict(_SPENT)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            x = bs.one_step(p, rng, q, bs._count(args.groups), args.change, loaded, k)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            k += 1
            if i >= args.warmup:
                ms.append(x)
                cpu.append((r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1e3)
                flt.append(r1.ru_minflt - r0.ru_minflt)
                rows.append(parts(store))
        d = {n: store.stats.get(n, 0) - st0.get(n, 0) for n in ("cache_hits", "cache_misses", "mapped_drops",
                                                                 "mapped_bytes_dropped", "whole_evictions",
                                                                 "bytes_evicted")}
        mean = {n: float(np.mean([r[n] for r in rows])) / MiB for n in rows[0] if n not in ("levels", "units", "files")}
        lv = {}
        for r in rows:
            for a, b in r["levels"].items():
                lv[a] = lv.get(a, 0) + b / len(rows) / MiB
        s = args.steps
        print(f"{q} phase {phase}: wall mean {np.mean(ms):.2f} p99 {np.percentile(ms, 99):.2f} ms; CPU mean "
              f"{np.mean(cpu):.2f} p99 {np.percentile(cpu, 99):.2f} ms; minflt {np.mean(flt):.0f}; hits "
              f"{d['cache_hits'] / s:.0f} misses {d['cache_misses'] / s:.0f}; whole evictions "
              f"{d['whole_evictions'] / s:.1f}, mapped drops {d['mapped_drops'] / s:.1f} "
              f"({d['mapped_bytes_dropped'] / s / MiB:.1f} MiB), evicted {d['bytes_evicted'] / s / MiB:.1f} MiB a step; "
              f"thread CPU in enforce {(_SPENT['enforce'] - spent0['enforce']) * 1e3 / s:.2f} ms, of it _trim_cache "
              f"{(_SPENT['_trim_cache'] - spent0['_trim_cache']) * 1e3 / s:.2f}",
              flush=True)
        print(f"  budget (MiB, mean after the enforce): in memory {mean['in_memory']:.1f} = loose batches "
              f"{mean['loose']:.1f} (by level {', '.join(f'{a}: {b:.1f}' for a, b in sorted(lv.items()))}) + pending "
              f"{mean['pending']:.1f} + merges {mean['merges']:.1f} + fences/filters {mean['kept']:.1f}; cache cap "
              f"{mean['cap']:.1f}, cache holds {mean['cached']:.1f} (indexes {mean['index']:.1f}); mapped after "
              f"{mean['mapped']:.1f}; units marked {np.mean([r['units'] for r in rows]):.0f}; "
              f"files {rows[-1]['files']}",
              flush=True)
    for i, t in enumerate(p.executor._all_traces()):
        bsz = t._levels()
        print(f"  trace {i}: {len(bsz)} batches, {sum(1 for b in bsz if store.is_spilled(b))} spilled, sizes MiB "
              f"{[round(batch_bytes(b) / MiB, 1) for b in bsz]}; index "
              f"{(t.held_index.nbytes / MiB if t.held_index is not None else 0):.1f}", flush=True)
    fs = list(store._files.values())
    fence = sum(int(f.fence.nbytes) for f in fs)
    held = [getattr(f, "filt", None) or [f.bloom] for f in fs]  # the filters held (f.bloom would load one let go)
    bloom = sum(int(h[0].nbytes) for h in held if h[0] is not None)
    unheld = sum(1 for h in held if h[0] is None)
    crcs = sum(int(f.page_crcs.nbytes) for f in fs)
    rows = sum(f.rows for f in fs)
    print(f"  fences+filters of {len(fs)} files ({rows:,} rows): filters {bloom / MiB:.1f} MiB "
          f"({bloom * 8 / max(1, rows):.1f} bits a row), fences {fence / MiB:.1f} MiB, page CRCs {crcs / MiB:.1f} MiB; "
          f"{unheld} files' filters not held (never probed: spill.py invariant 16); "
          f"per file (rows, filter KiB held): {[(f.rows, int(h[0].nbytes) >> 10 if h[0] is not None else 0) for f, h in zip(fs, held)]}", flush=True)
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
