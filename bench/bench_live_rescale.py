"""Benchmark of a live rescale: step latency of 1k-row steps while a 1M-row state migrates between worker counts (2 -> 3 -> 2 by default; p.rescale while another thread steps), against the steady state before, and against the all-at-once alternative (checkpoint, cold rescale, reopen) in the same run.

Run: python bench/bench_live_rescale.py [--rows N] [--step-rows K] [--steady S] [--batch B] [--memory]
[--workers W0] [--targets W1,W2,...]. The pipeline is durable (checkpoints every second, output fsynced per step)
unless ``--memory``. Latency is the wall time of ``push + step`` on the stepping thread: mean, p50, p99 and max over
the steps before the move (steady) and over the steps that ran while it was in progress; a pause is the time the
rescale held the step lock: for one wave, or for one piece of the merge work the waves deferred (rescale.py
invariant 7); longest, mean and p99 over them all, from ``p.last_rescale``.
The all-at-once figure is the time from ``close()`` to a reopened pipeline at the new count: no step runs then.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    c.output("u", t.select(k="k").distinct())
    return c


def stats(xs: list[float]) -> str:
    if not xs:
        return "no steps"
    a = np.array(xs) * 1000
    return (f"mean {a.mean():.2f} ms, p50 {np.percentile(a, 50):.2f}, p99 {np.percentile(a, 99):.2f}, "
            f"max {a.max():.2f} over {len(a)} steps")


class Stepper:
    """Steps 1k-row changes on a thread, recording each step's latency with its start time."""

    def __init__(self, p: dbsp.Pipeline, rows: int, keys: int, seed: int) -> None:
        self.p, self.rows, self.keys = p, rows, keys
        self.rng = np.random.default_rng(seed)
        self.lat: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def one(self) -> None:
        t = pa.table({"k": self.rng.integers(0, self.keys, self.rows), "v": self.rng.integers(0, 100, self.rows)},
                     schema=SCHEMA)
        t0 = time.perf_counter()
        self.p.push("t", t)
        self.p.step()
        self.lat.append((t0, time.perf_counter() - t0))

    def run(self) -> None:
        while not self.stop.is_set():
            self.one()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--step-rows", type=int, default=1000)
    ap.add_argument("--steady", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--workers", type=int, default=2, help="the worker count the state is loaded at")
    ap.add_argument("--targets", default="3,2", help="the worker counts to rescale to live, in turn")
    a = ap.parse_args()
    targets = [int(x) for x in a.targets.split(",")]
    tmp = tempfile.mkdtemp(prefix="dbsp-bench-live-")
    d = None if a.memory else os.path.join(tmp, "d")
    p = dbsp.Pipeline(circuit(), a.workers, storage=d, checkpoint_interval=None if a.memory else 1.0)
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    for lo in range(0, a.rows, 250_000):
        n = min(250_000, a.rows - lo)
        p.push("t", pa.table({"k": rng.integers(0, a.rows, n), "v": rng.integers(0, 100, n)}, schema=SCHEMA))
        p.step()
    if d:
        p.checkpoint()
    print(f"# {a.rows:,} rows loaded at {a.workers} workers in {time.perf_counter() - t0:.1f} s; "
          f"{'in memory' if a.memory else 'durable'}; load {os.getloadavg()[0]:.2f}")
    st = Stepper(p, a.step_rows, a.rows, 2)
    for _ in range(a.steady):
        st.one()
    steady = [x for _, x in st.lat]
    print(f"steady at {a.workers} workers: {stats(steady)}")
    for target in targets:
        st.lat = []
        th = threading.Thread(target=st.run)
        th.start()
        time.sleep(0.2)
        t_start = time.perf_counter()
        rep = p.rescale(target, batch_shards=a.batch)
        t_end = time.perf_counter()
        time.sleep(0.2)
        st.stop.set()
        th.join()
        st.stop.clear()
        during = [x for t, x in st.lat if t_start <= t <= t_end]
        print(f"live {rep['from_workers']} -> {rep['to_workers']}: {rep['batches']} batches, {rep['moved_shards']} "
              f"shards, {rep['moved_bytes']:,} B moved of {rep['total_bytes']:,} B, longest pause "
              f"{rep['max_pause_ms']:.1f} ms (pauses: mean {rep['mean_pause_ms']:.1f} ms, p99 {rep['p99_pause_ms']:.1f} ms "
              f"over {rep['batches']} waves and {rep.get('settle_pauses', 0)} settling ones; most CPU in one "
              f"{rep.get('max_pause_cpu_ms', float('nan')):.1f} ms), {rep['seconds']:.2f} s "
              f"in all (incl. the closing checkpoint)")
        print(f"  steps during the move: {stats(during)}")
        after = []
        for _ in range(a.steady):
            st.one()
        after = [x for _, x in st.lat[-a.steady:]]
        print(f"  steady at {target} workers: {stats(after)}")
    if d:
        for target in targets:  # all at once: checkpoint, cold rescale, reopen
            t0 = time.perf_counter()
            p.close()
            p = dbsp.Pipeline.open(d, circuit(), target, checkpoint_interval=1.0)
            dt = time.perf_counter() - t0
            rep = p.last_rescale
            print(f"all at once -> {target}: no step runs for {dt * 1000:.0f} ms (close + cold rescale moving "
                  f"{rep['moved_bytes']:,} B + reopen)")
            st.p = p
            for _ in range(50):
                st.one()
    p.close()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
