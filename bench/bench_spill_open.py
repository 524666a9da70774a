"""Pipeline.open of a spilled state: open time and RSS against the state's size (issue 31 item 4), and the first steps after it.

Per size, in a child process: a durable pipeline (W=1, ``memory_limit=--limit``) of the join of
bench/bench_scaling.py (bids joined with auctions on a key; the bids' trace holds every bid: three int64 columns)
loads ``--state`` bids in ``--load-step``-row steps, settles its merges, checkpoints and closes (its seconds, peak
RSS and storage directory's bytes reported); its traces' big batches are then batch files that the checkpoint names
(trace invariant 13). A second child process (its own RSS)
then measures:

- ``open``: the seconds of ``Pipeline.open`` and the RSS before and after it (``/proc/self/statm``);
- ``first``: the first 1k-row step after the open (900 new bids, 100 deletions), its seconds and the RSS after;
- ``next``: the mean of the next ``--steps`` such steps.

With ``--eager`` each state is opened a second time the way open worked before the lazy open (every byte of
every named batch file checked when it is opened), in another fresh child.

Run:  python bench/bench_spill_open.py --sizes 1M,10M
      python bench/bench_spill_open.py --sizes 100k --load-step 50k   # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_scaling import AUCTIONS, _count, bids, circuit  # noqa: E402

MIB = 2**20


def build(root: str, state: int, groups: int, load_step: int, limit: str, retention: int | None) -> dict:
    import dbsp_core as dbsp
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    rng = np.random.default_rng(7)
    t0 = time.perf_counter()
    p = dbsp.Pipeline(circuit("join"), storage=root, memory_limit=limit, output_retention=retention,
                      executor=EmbeddedExecutor(background_merge=True))
    p.push("auctions", pa.table({"id": np.arange(groups), "category": np.arange(groups) % 50}, schema=AUCTIONS))
    done = 0
    while done < state:
        n = min(load_step, state - done)
        p.push("bids", bids(rng, n, "join", groups))
        p.step()
        done += n
    p.executor.settle_merges()
    p.push("bids", bids(rng, 1, "join", groups))
    p.step()
    p.checkpoint()
    store = p.executor.batch_store
    out = {"load_s": time.perf_counter() - t0, "files": len(store._files), "disk": store.disk_bytes(),
           "spilled_rows": sum(f.rows for f in store._files.values()), "dir_bytes": _du(root),
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    p.close()
    return out


def _du(root: str) -> int:
    """Bytes of every file under ``root`` (the storage directory: logs, state databases, batch files)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def reopen(root: str, groups: int, steps: int, limit: str, eager: bool = False) -> dict:
    import dbsp_core as dbsp
    from dbsp_core import ZSet
    from dbsp_core.metrics import rss_bytes
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    if eager:  # what open did before the lazy open: every byte of every named file checked when opened
        import dbsp_core.trace.batchfile as bf

        whole = bf.open_batch
        bf.open_batch = lambda path, verify=False, advice=None, lazy=False: whole(path, verify=True, advice=advice)
    rng = np.random.default_rng(8)
    c = circuit("join")
    rss0 = rss_bytes() or 0
    t0 = time.perf_counter()
    p = dbsp.Pipeline.open(root, c, memory_limit=limit, executor=EmbeddedExecutor(background_merge=True))
    open_s = time.perf_counter() - t0
    rss1 = rss_bytes() or 0
    if steps < 0:  # open only
        p.close(checkpoint=False)
        return {"open_s": open_s, "rss_before": rss0, "rss_open": rss1}
    times = []
    for k in range(steps + 1):
        t0 = time.perf_counter()
        p.push("bids", bids(rng, 900, "join", groups))
        gone = bids(np.random.default_rng(7), 100, "join", groups)  # rows of the first loaded step
        p.push("bids", ZSet.from_arrow(gone, weights=np.full(100, -1, dtype=np.int64)))
        p.step()
        times.append(time.perf_counter() - t0)
        if k == 0:
            rss2 = rss_bytes() or 0
    m = p.metrics()["spill"]
    p.close(checkpoint=False)
    return {"open_s": open_s, "rss_before": rss0, "rss_open": rss1, "first_s": times[0], "rss_first": rss2,
            "next_mean_s": float(np.mean(times[1:])) if steps else 0.0, "disk": m["disk_bytes"],
            "cache": {k: v for k, v in m.items() if k.startswith("cache")}}


def child(kind: str, a: dict) -> dict:
    if kind == "build":
        return build(a["root"], a["state"], a["groups"], a["load_step"], a["limit"], a["retention"])
    return reopen(a["root"], a["groups"], a["steps"], a["limit"], a.get("eager", False))


def run(kind: str, a: dict) -> dict:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps([kind, a])],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{kind} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M")
    ap.add_argument("--groups", default="1M")
    ap.add_argument("--limit", default="64MiB")
    ap.add_argument("--load-step", type=_count, default=500_000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--keep-output", action="store_true",
                    help="keep every step's output in the output log (output_retention=None), which open scans; "
                         "default: output_retention=0, so open reads the state and little else")
    ap.add_argument("--eager", action="store_true",
                    help="also open each state checking every byte of its batch files at open (the code before)")
    ap.add_argument("--dir", default=None, help="where the storage directories go (default: a temporary one)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, a = json.loads(args.child)
        print(json.dumps(child(kind, a)))
        return 0
    top = tempfile.mkdtemp(prefix="dbsp-open-", dir=args.dir)
    groups = _count(args.groups)
    print(f"join state, {groups:,} keys, memory_limit {args.limit}, W=1; load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        for size in args.sizes.split(","):
            state = _count(size)
            root = os.path.join(top, size)
            b = run("build", {"root": root, "state": state, "groups": groups, "load_step": args.load_step,
                              "limit": args.limit, "retention": None if args.keep_output else 0})
            for eager in ([True, False] if args.eager else [False]):  # eager first: it opens and runs no step
                r = run("open", {"root": root, "groups": groups, "steps": -1 if eager else args.steps,
                                 "limit": args.limit, "eager": eager})
                report(size, b, r, eager, args)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


def report(size: str, b: dict, r: dict, eager: bool, args: argparse.Namespace) -> None:
    steps = "" if eager else (f" | first step {r['first_s'] * 1e3:,.0f} ms, RSS after {r['rss_first'] / MIB:,.0f} MiB | "
                              f"next {args.steps} steps mean {r['next_mean_s'] * 1e3:,.1f} ms | cache {r['cache']}")
    print(f"{size:>5} rows{' (eager check at open)' if eager else ''}: built in {b['load_s']:.1f} s (peak RSS "
          f"{b.get('peak_rss', 0) / MIB:,.0f} MiB, directory {b.get('dir_bytes', 0) / MIB:,.0f} MiB), {b['files']} "
          f"batch files, {b['disk'] / MIB:,.0f} MiB, {b['spilled_rows']:,} spilled rows | open "
          f"{r['open_s'] * 1e3:,.0f} ms, RSS {r['rss_before'] / MIB:,.0f} -> {r['rss_open'] / MIB:,.0f} MiB "
          f"(+{(r['rss_open'] - r['rss_before']) / MIB:,.1f}){steps}; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
