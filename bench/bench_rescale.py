"""Benchmark of a cold rescale: reopening a 1M-row state at 2 -> 3 workers (Pipeline.open(dir, c, workers=3)) against a plain reopen at the same count (Pipeline.open(dir, c)), and the bytes moved against the ideal (state bytes x the fraction of shards that must change owner).

Run: python bench/bench_rescale.py [--rows N] [--rounds R] [--from W] [--to W2]. Both sides start from copies of
the same checkpointed directory (copied before timing) and load every worker's state into memory; the rescale
also reads every stored value, moves the shards that change owner and commits a new version of every state
database. The runs alternate (rescale, reopen, reopen, rescale, ...); medians and the spread are printed with the
load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def circuit() -> dbsp.Circuit:
    """Keyed state of three kinds: a linear aggregate, a distinct and a join side."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    d = c.input("d", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    c.output("u", t.select(k="k").distinct())
    c.output("j", t.join(d, on="k").group_by("v").agg(n=dbsp.count()))
    return c


def build(path: str, rows: int, workers: int) -> None:
    rng = np.random.default_rng(1)
    p = dbsp.Pipeline(circuit(), workers, storage=path, checkpoint_interval=None)
    step = 250_000
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        p.push("t", pa.table({"k": rng.integers(0, rows, n), "v": rng.integers(0, 100, n)}, schema=SCHEMA))
        p.step()
    p.push("d", pa.table({"k": np.arange(1000), "v": np.arange(1000) % 7}, schema=SCHEMA))
    p.step()
    p.close()


def timed(path: str, workers: int | None) -> tuple[float, dict | None]:
    t0 = time.perf_counter()
    p = dbsp.Pipeline.open(path, circuit(), workers, checkpoint_interval=None)
    dt = time.perf_counter() - t0
    rep = p.last_rescale if workers is not None else None
    p.close(checkpoint=False)
    return dt, rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--from", dest="frm", type=int, default=2)
    ap.add_argument("--to", type=int, default=3)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dbsp-bench-rescale-")
    base = os.path.join(tmp, "base")
    t0 = time.perf_counter()
    build(base, a.rows, a.frm)
    print(f"# state: {a.rows:,} input rows at {a.frm} workers, built in {time.perf_counter() - t0:.1f} s; "
          f"load {os.getloadavg()[0]:.2f}")
    resc, reopen, reps = [], [], []
    for r in range(a.rounds):
        order = ["rescale", "reopen"] if r % 2 == 0 else ["reopen", "rescale"]
        for what in order:
            d = os.path.join(tmp, f"{what}-{r}")
            shutil.copytree(base, d)
            if what == "rescale":
                dt, rep = timed(d, a.to)
                resc.append(dt)
                reps.append(rep)
            else:
                dt, _ = timed(d, None)
                reopen.append(dt)
            shutil.rmtree(d)
    rep = reps[-1]
    S = max(rep["from_shards"], rep["to_shards"])
    ideal = rep["total_bytes"] * rep["moved_shards"] / S
    med_r, med_o = statistics.median(resc), statistics.median(reopen)
    print(f"cold rescale {a.frm} -> {a.to}: median {med_r:.3f} s (min {min(resc):.3f}, max {max(resc):.3f}); "
          f"plain reopen at {a.frm}: median {med_o:.3f} s (min {min(reopen):.3f}, max {max(reopen):.3f}); "
          f"ratio {med_r / med_o:.2f}x over {a.rounds} alternating rounds")
    print(f"moved {rep['moved_shards']} of {S} shards, {rep['moved_bytes']:,} of {rep['total_bytes']:,} state bytes "
          f"({rep['moved_bytes'] / rep['total_bytes']:.1%}); ideal {ideal:,.0f} B; moved / ideal = "
          f"{rep['moved_bytes'] / ideal:.3f}; the rescale itself (move + commit) {rep['seconds']:.3f} s")
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
