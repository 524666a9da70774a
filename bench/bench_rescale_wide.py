"""Benchmark of rescaling a small pipeline to many workers: seconds of ``p.rescale(W)`` (in memory and durable) and of ``Pipeline.open(dir, c, workers=W)`` (cold) from 2 workers, for W = 8, 64, 300, each in a fresh process.

Run: python bench/bench_rescale_wide.py [--rows N] [--workers 8,64,300] [--modes memory,durable,cold]. The state
is a group-by (count, sum) over ``--rows`` distinct keys (default 1,000), stepped once at 2 workers. "live" times
the whole ``p.rescale(W)`` call (default batch_shards=16; durable: with the checkpoint that ends it); "cold" times
``Pipeline.open`` (move, commit, load) and also prints the move's own ``seconds`` from ``last_rescale``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time


def one(mode: str, workers: int, rows: int) -> str:
    import pyarrow as pa

    import dbsp_core as dbsp

    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    d = tempfile.mkdtemp(prefix="dbsp-bench-wide-") if mode != "memory" else None
    try:
        p = dbsp.Pipeline(c, workers=2, storage=d)
        p.push("t", pa.table({"k": list(range(rows)), "v": list(range(rows))}))
        p.step()
        if mode == "cold":
            p.close()
            t0 = time.perf_counter()
            q = dbsp.Pipeline.open(d, c, workers=workers)
            dt = time.perf_counter() - t0
            rep = q.last_rescale
            q.close()
            return (f"{mode:7s} W={workers:3d}: {dt:7.2f} s (the move itself {rep['seconds']:.2f} s; "
                    f"{rep['moved_shards']} of {rep['to_shards']} shards)")
        t0 = time.perf_counter()
        rep = p.rescale(workers)
        dt = time.perf_counter() - t0
        p.close()
        return (f"{mode:7s} W={workers:3d}: {dt:7.2f} s ({rep['batches']} batches, {rep['moved_shards']} of "
                f"{rep['to_shards']} shards)")
    finally:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--workers", default="8,64,300")
    ap.add_argument("--modes", default="memory,durable,cold")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "W"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(one(a.one[0], int(a.one[1]), a.rows), flush=True)
        return
    for mode in a.modes.split(","):
        for w in a.workers.split(","):
            subprocess.run([sys.executable, __file__, "--rows", str(a.rows), "--one", mode, w], check=True)


if __name__ == "__main__":
    main()
