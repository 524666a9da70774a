"""The cost of a durable call that runs several queued steps (``queue_step`` K times, then one ``run_queued``): wall and CPU per step, and the output log's fsyncs per call, for K = 1, 8 and 32.

How it measures: one durable pipeline (bench/bench_durable.py's join + group-by circuit, W = 2, no timed
checkpoints) per K in this process; each round pushes K batches of ``--rows`` bids (and a few auctions), queues a
step after each (the division record fsynced: untimed), then times ``run_queued`` (the steps, their output records
and the output log's fsync: what changed on r37-durout, where the K records share one fsync). Mean and p99 of the
rounds' wall per step, the process CPU per step, and the output log's fsyncs per call (the C log's counter). Load:
``uptime`` before and after. Run it from each tree (e.g. main's worktree and a branch's), alternated.

Run:  python bench/bench_run_queued.py [--rounds 30] [--rows 1000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
import pyarrow as pa  # noqa: E402

from bench_durable import AUCTIONS, bids, circuit  # noqa: E402


def measure(k: int, rounds: int, rows: int) -> dict:
    d = tempfile.mkdtemp(prefix="bench-run-queued-")
    rng = np.random.default_rng(k)
    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
    try:
        p.push("auctions", pa.table({"id": np.arange(1000), "category": np.arange(1000) % 10}, schema=AUCTIONS))
        p.step()
        walls, cpus, fsyncs = [], [], []
        for r in range(rounds + 1):  # round 0 warms up
            for i in range(k):
                p.push("bids", bids(rng, rows, 1000))
                p.queue_step()
            f0 = p._output._log.info()[5]
            t0, c0 = time.perf_counter(), time.process_time()
            p.run_queued()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r:
                walls.append(wall / k)
                cpus.append(cpu / k)
                fsyncs.append(p._output._log.info()[5] - f0)
    finally:
        p.close()
        shutil.rmtree(d, ignore_errors=True)
    return {"k": k, "mean_ms": 1e3 * float(np.mean(walls)), "p99_ms": 1e3 * float(np.percentile(walls, 99)),
            "cpu_ms": 1e3 * sum(cpus) / len(cpus), "fsyncs": sum(fsyncs) / len(fsyncs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--rows", type=int, default=1000, help="bids a step")
    ap.add_argument("--ks", default="1,8,32")
    a = ap.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    print("| steps a call | wall ms a step, mean / p99 | CPU ms a step | output log fsyncs a call |\n|---|---|---|---|")
    for k in (int(x) for x in a.ks.split(",")):
        r = measure(k, a.rounds, a.rows)
        print(f"| {k} | {r['mean_ms']:.2f} / {r['p99_ms']:.2f} | {r['cpu_ms']:.2f} | {r['fsyncs']:.1f} |", flush=True)
    print(f"load after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
