"""Benchmarks of the durable pipeline: throughput with storage against in memory, push latency, checkpoint time against state size and against a pushed-but-unstepped backlog, and recovery time against replay length.

Run: python bench/bench_durable.py [--quick] [--rounds N] [--only-throughput]. Prints one line per measurement
(copied into RESULTS.md). The throughput runs alternate in memory and durable (same data, same process), ROUNDS
times each (the order flips every round), and report medians, the per-round ratios and CPU seconds (process time:
every thread, including checkpoint and fsync threads), with the load average before and after.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    auctions = c.input("auctions", AUCTIONS)
    j = bids.join(auctions, left_on="auction", right_on="id")
    c.output("by_cat", j.group_by("category").agg(n=dbsp.count(), total=dbsp.sum("price")))
    c.output("per_auction", bids.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price")))
    return c


def bids(rng: np.random.Generator, n: int, auctions: int) -> pa.Table:
    return pa.table({"auction": rng.integers(0, auctions, n), "bidder": rng.integers(0, 10**6, n),
                     "price": rng.integers(1, 1000, n)}, schema=BIDS)


def run(p, steps: int, n: int, auctions: int, seed: int = 1) -> float:
    rng = np.random.default_rng(seed)
    p.push("auctions", pa.table({"id": np.arange(auctions), "category": np.arange(auctions) % 10}, schema=AUCTIONS))
    t0 = time.perf_counter()
    for _ in range(steps):
        p.push("bids", bids(rng, n, auctions))
        p.step()
    return time.perf_counter() - t0


def run_concurrent(p, steps: int, n: int, auctions: int, seed: int = 1) -> float:
    """A producer thread pushes ``steps`` batches while this thread steps; returns the time until all are processed."""
    import threading

    rng = np.random.default_rng(seed)
    batches = [bids(rng, n, auctions) for _ in range(steps)]
    p.push("auctions", pa.table({"id": np.arange(auctions), "category": np.arange(auctions) % 10}, schema=AUCTIONS))
    t0 = time.perf_counter()
    th = threading.Thread(target=lambda: [p.push("bids", b) for b in batches])
    th.start()
    while th.is_alive():
        p.step()
    th.join()
    p.step()
    return time.perf_counter() - t0


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def compare(label: str, runner, root: str, steps: int, n: int, auctions: int, rounds: int) -> None:
    """In memory and durable (checkpoint every 1 s) ``rounds`` times each, alternating; prints medians."""
    rows = steps * n
    res: dict[str, list[tuple[float, float]]] = {"mem": [], "dur": []}
    cks, nsteps = [], []
    before = load()
    for r in range(rounds):
        for mode in (("mem", "dur") if r % 2 == 0 else ("dur", "mem")):
            d = os.path.join(root, f"{label}-{r}")
            if mode == "mem":
                p = dbsp.Pipeline(circuit(), workers=2)
            else:
                p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=1.0)
            c0 = time.process_time()
            wall = runner(p, steps, n, auctions)
            cpu = time.process_time() - c0
            if mode == "dur":
                cks.append(p.stats["checkpoints"])
                nsteps.append(p.steps)
            p.close()
            shutil.rmtree(d, ignore_errors=True)
            res[mode].append((wall, cpu))
    mem = statistics.median(w for w, _ in res["mem"])
    dur = statistics.median(w for w, _ in res["dur"])
    ratios = sorted(m[0] / d[0] for m, d in zip(res["mem"], res["dur"]))
    cpu_m = statistics.median(c for _, c in res["mem"])
    cpu_d = statistics.median(c for _, c in res["dur"])
    print(f"throughput, {label}, {steps} x {n} bids, W=2, medians of {rounds} alternating rounds: in memory "
          f"{rows / mem:,.0f} rows/s, durable {rows / dur:,.0f} rows/s ({statistics.median(nsteps):.0f} steps, "
          f"{statistics.median(cks):.0f} checkpoints) = {mem / dur:.0%} of in memory (per round "
          f"{', '.join(f'{x:.0%}' for x in ratios)}); CPU {cpu_m:.2f} s vs {cpu_d:.2f} s "
          f"(+{cpu_d / cpu_m - 1:.0%}); load {before} -> {load()}")


def main() -> None:
    quick = "--quick" in sys.argv
    # 400 steps: a durable run lasts several seconds, so its timer checkpoints (one a second) are in the figure;
    # at 60 steps it had grown too fast to take any (0 checkpoints in 0.75 s on 2026-11-27)
    steps, n, auctions = (20, 10_000, 50_000) if quick else (400, 20_000, 200_000)
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else (3 if quick else 7)
    root = tempfile.mkdtemp(prefix="bench-durable-")
    try:
        # (1) throughput: in memory against durable with a checkpoint every second
        compare("push then step in one thread", run, root, steps, n, auctions, rounds)
        compare("a producer thread pushing while the pipeline steps", run_concurrent, root, steps, n, auctions,
                rounds)
        if "--only-throughput" in sys.argv:
            return

        # (2) durable push latency (one small push, fsync'd before it returns)
        p = dbsp.Pipeline(circuit(), workers=1, storage=os.path.join(root, "lat"), checkpoint_interval=None)
        one = bids(np.random.default_rng(2), 10, 100)
        lat = []
        for k in range(200):
            t0 = time.perf_counter()
            p.push("bids", one, producer="x", seq=k)
            lat.append(time.perf_counter() - t0)
        p.close()
        lat.sort()
        print(f"durable push of 10 rows: p50 {lat[100] * 1e3:.2f} ms, p99 {lat[197] * 1e3:.2f} ms")

        # (3) checkpoint time against state size, and (4) against an unstepped backlog
        for state in ([100_000, 400_000] if quick else [100_000, 400_000, 1_000_000]):
            d = os.path.join(root, f"ck{state}")
            p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
            run(p, state // 50_000, 50_000, state)
            t0 = time.perf_counter()
            p.checkpoint()
            first = time.perf_counter() - t0
            p.push("bids", bids(np.random.default_rng(3), 1000, state))
            p.step()
            t0 = time.perf_counter()
            p.checkpoint()
            again = time.perf_counter() - t0
            backlog = []
            for b in (0, 200_000, 1_000_000):
                left = b
                while left:
                    k = min(left, 100_000)
                    p.push("bids", bids(np.random.default_rng(left), k, state))
                    left -= k
                t0 = time.perf_counter()
                p.checkpoint()
                backlog.append((b, time.perf_counter() - t0))
                if b:
                    p.close(checkpoint=False)
                    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)  # drop the backlog from memory
                    p.step()
                    p.checkpoint()  # so the next measurement sees only its own backlog
            # (5) recovery time against replay length
            rec = []
            for k in (0, 5, 20):
                p.checkpoint()
                t0 = time.perf_counter()
                rng = np.random.default_rng(k)
                for _ in range(k):
                    p.push("bids", bids(rng, 20_000, state))
                    p.step()
                took = time.perf_counter() - t0
                p.close(checkpoint=False)
                t0 = time.perf_counter()
                p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
                rec.append((k, took, time.perf_counter() - t0))
            du = sum(p.disk_usage().values())
            p.close()
            print(f"state ~{state:,} bid rows: first checkpoint {first * 1e3:.0f} ms, next after a 1k-row step "
                  f"{again * 1e3:.0f} ms; with backlog " +
                  ", ".join(f"{b:,} rows {t * 1e3:.0f} ms" for b, t in backlog) +
                  "; recovery " + ", ".join(f"{k} steps replayed (ran in {r:.2f} s) {t:.2f} s" for k, r, t in rec) +
                  f"; disk {du / 1e6:.0f} MB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
