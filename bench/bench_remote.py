"""Benchmark of a durable pipeline whose storage is an object store (moto's S3 server on 127.0.0.1, tests/s3_server.py) against the same pipeline on a local directory: durable throughput, checkpoint time, bytes uploaded per checkpoint against the bytes of state changed, and a recovery into an empty cache with the bytes it downloads.

Run: python bench/bench_remote.py [--rows N] [--rounds K] [--change F] [--memory-limit SIZE]. Same data for both
storages, one run each: N rows of bids (default 1M) are pushed and checkpointed (the state's first upload), then
K rounds (default 8) each push F of N new rows (default 0.01), step and checkpoint. Prints one line per
measurement. The load's throughput includes shipping the input and output logs to the store as segment objects
(group commit, storage.logstore; bench_logstore.py measures that alone); the bytes per checkpoint are those of the
upload at the checkpoint (state deltas, batch files, manifest). moto keeps objects in its process's memory and answers over loopback HTTP: a real store adds network
latency and bandwidth, so the ratio here is the floor of what S3 costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import dbsp_core as dbsp  # noqa: E402
from s3_server import S3Server  # noqa: E402

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    c.output("per_auction", bids.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price")))
    c.output("bidders", bids.group_by("bidder").agg(n=dbsp.count()))
    return c


def data(seed: int, n: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"auction": rng.integers(0, n // 10 + 1, n), "bidder": rng.integers(0, 10**6, n),
                     "price": rng.integers(1, 1000, n)}, schema=BIDS)


def run(storage: str, rows: int, rounds: int, change: float, memory_limit: str | None) -> dict:
    kw = {"memory_limit": memory_limit} if memory_limit else {}
    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=None, **kw)
    res: dict = {"ckpt_s": [], "uploaded": [], "changed": [], "delta": [], "log": []}
    t0 = time.perf_counter()
    big = data(1, rows)
    for i in range(0, rows, 100_000):
        p.push("bids", big.slice(i, 100_000))
        p.step()
    res["load_s"] = time.perf_counter() - t0
    res["load_rows_per_s"] = rows / res["load_s"]
    t = time.perf_counter()
    p.checkpoint()
    res["first_ckpt_s"] = time.perf_counter() - t
    res["first"] = p.stats.get("remote")
    small = max(1, int(rows * change))
    for k in range(rounds):
        p.push("bids", data(100 + k, small))
        p.step()
        t = time.perf_counter()
        p.checkpoint()
        res["ckpt_s"].append(time.perf_counter() - t)
        r = p.stats.get("remote")
        if r:
            res["uploaded"].append(r["uploaded_bytes"])
            res["changed"].append(r["changed_bytes"])
            res["delta"].append(r["delta_bytes"] + r["base_bytes"] + r["spill_bytes"])
            res["log"].append(r["log_bytes"])
    res["state_disk_bytes"] = sum(p.disk_usage().values())
    p.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--change", type=float, default=0.01)
    ap.add_argument("--memory-limit", default=None)
    a = ap.parse_args()
    server = S3Server()
    local = tempfile.mkdtemp(prefix="bench-remote-")
    try:
        uri = server.uri(server.bucket(), "bench")
        print(f"rows {a.rows}, rounds {a.rounds} of {int(a.rows * a.change)} new rows, memory_limit {a.memory_limit}, "
              f"2 workers, load {os.getloadavg()[0]:.2f}")
        lo = run(os.path.join(local, "store"), a.rows, a.rounds, a.change, a.memory_limit)
        s3 = run(uri, a.rows, a.rounds, a.change, a.memory_limit)
        med = statistics.median
        print(f"load + step: local {lo['load_rows_per_s']:,.0f} rows/s, s3 {s3['load_rows_per_s']:,.0f} rows/s "
              f"(ratio {lo['load_rows_per_s'] / s3['load_rows_per_s']:.2f})")
        print(f"first checkpoint (the whole state): local {lo['first_ckpt_s']:.2f} s, s3 {s3['first_ckpt_s']:.2f} s "
              f"(ratio {s3['first_ckpt_s'] / lo['first_ckpt_s']:.2f}); uploaded {s3['first']['uploaded_bytes']:,} B "
              f"(state {s3['first']['delta_bytes'] + s3['first']['base_bytes'] + s3['first']['spill_bytes']:,} B, "
              f"logs at the checkpoint {s3['first']['log_bytes']:,} B)")
        print(f"checkpoint after {int(a.rows * a.change)} new rows (median of {a.rounds}): local "
              f"{med(lo['ckpt_s']):.3f} s, s3 {med(s3['ckpt_s']):.3f} s (ratio {med(s3['ckpt_s']) / med(lo['ckpt_s']):.2f})")
        for k, (u, c, d, lg) in enumerate(zip(s3["uploaded"], s3["changed"], s3["delta"], s3["log"])):
            print(f"  checkpoint {k + 1}: state changed {c:,} B, state uploaded {d:,} B, logs {lg:,} B, "
                  f"all uploaded {u:,} B")
        print(f"state on local disk at the end: {s3['state_disk_bytes']:,} B (local run {lo['state_disk_bytes']:,} B)")
        cache = tempfile.mkdtemp(prefix="bench-remote-cache-")
        t = time.perf_counter()
        q = dbsp.Pipeline.open(uri, circuit(), cache_dir=os.path.join(cache, "c"), checkpoint_interval=None)
        rec = time.perf_counter() - t
        got = q._remote.stats["get_bytes"]
        q.close(checkpoint=False)
        shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        q = dbsp.Pipeline.open(os.path.join(local, "store"), circuit(), checkpoint_interval=None)
        rec_local = time.perf_counter() - t
        q.close(checkpoint=False)
        print(f"recovery into an empty cache: {rec:.2f} s, {got:,} B downloaded (local directory: {rec_local:.2f} s)")
    finally:
        server.stop()
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
