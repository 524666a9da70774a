"""Benchmark of what shipping the input log to an object store costs a push: acknowledgement latency and push
throughput of a durable pipeline on moto's S3 server (tests/s3_server.py; every push acknowledged once the segment
object holding it is in the store, group commit) against the same pipeline on a local directory (the local-disk
log: acknowledged once fsynced).

Run: python bench/bench_logstore.py [--pushes N] [--rows R] [--threads T ...]. For each storage and
each thread count, T threads push N pushes of R rows each (producer ids and seqs, no steps: only the log is
measured) and the script prints the latency of one push (median, p90, p99) and pushes and rows per second, and
for the store the PUTs made (pushes / PUTs = how many pushes one PUT carried) and the time of the writer's lease
checks that acknowledge them (storage.logstore invariant 2b; ``--no-fence`` ships without them, as the code before
those checks did, to alternate the two). moto answers over loopback HTTP from its process's memory: a real store adds
10-50 ms per PUT, so the latency here is the floor of S3's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import dbsp_core as dbsp  # noqa: E402
from s3_server import S3Server  # noqa: E402

from dbsp_core.storage.logstore import LogStore  # noqa: E402

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("s", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    return c


def run(storage, cache: str | None, pushes: int, rows: int, threads: int, fence: bool = True) -> dict:
    rng = np.random.default_rng(1)
    batch = pa.table({"k": rng.integers(0, 1000, rows), "v": rng.integers(0, 100, rows)}, schema=SCHEMA)
    kw = {"cache_dir": cache} if cache else {}
    restore = LogStore.restore
    if not fence:  # the shippers made without the writer's lease check, as before logstore invariant 2b
        LogStore.restore = lambda self, *a, fence=None, **k: restore(self, *a, **k)  # type: ignore[method-assign]
    try:
        p = dbsp.Pipeline(circuit(), storage=storage, checkpoint_interval=None, **kw)
    finally:
        LogStore.restore = restore  # type: ignore[method-assign]
    lat: list[float] = []
    lock = threading.Lock()

    def pusher(t: int) -> None:
        mine = []
        for i in range(pushes // threads):
            t0 = time.perf_counter()
            p.push("t", batch, producer=f"p{t}", seq=i)
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    shipper = p._input._log.shipper if cache else None  # noqa: SLF001 - the bench reads the shipper's counters
    puts0 = shipper.stats.segments if shipper else 0
    fence0 = (shipper.stats.fence_s, shipper.stats.checks) if shipper else (0.0, 0)
    ths = [threading.Thread(target=pusher, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    wall = time.perf_counter() - t0
    puts = shipper.stats.segments - puts0 if shipper else None
    checks = shipper.stats.checks - fence0[1] if shipper else None
    fence_ms = 1000 * (shipper.stats.fence_s - fence0[0]) / max(1, checks) if shipper else None
    p.close(checkpoint=False)
    lat.sort()
    n = len(lat)
    return {"pushes": n, "median_ms": 1000 * statistics.median(lat), "p90_ms": 1000 * lat[int(0.9 * (n - 1))],
            "p99_ms": 1000 * lat[int(0.99 * (n - 1))], "pushes_s": n / wall, "rows_s": n * rows / wall, "puts": puts,
            "checks": checks, "fence_ms": fence_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=400)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-fence", action="store_true",
                    help="the store's log acknowledges after the PUT alone, without the lease check after it")
    a = ap.parse_args()
    server = S3Server()
    tmp = tempfile.mkdtemp(prefix="bench-logstore-")
    try:
        for threads in a.threads:
            res = {}
            for kind in ("local", "s3"):
                if kind == "local":
                    res[kind] = run(os.path.join(tmp, f"local-{threads}"), None, a.pushes, a.rows, threads)
                else:
                    uri = server.uri(server.bucket(), "pipe")
                    res[kind] = run(uri, os.path.join(tmp, f"cache-{threads}"), a.pushes, a.rows, threads,
                                    fence=not a.no_fence)
                r = res[kind]
                extra = f", {r['puts']} PUTs ({r['pushes'] / max(1, r['puts']):.1f} pushes per PUT); {r['checks']} " \
                        f"lease checks of {r['fence_ms']:.2f} ms" if r["puts"] is not None else ""
                print(f"{kind:5s} threads={threads}: ack latency median {r['median_ms']:.2f} ms, p90 "
                      f"{r['p90_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; {r['pushes_s']:.0f} pushes/s, "
                      f"{r['rows_s']:.0f} rows/s{extra}", flush=True)
            print(f"      threads={threads}: store / local: latency x{res['s3']['median_ms'] / res['local']['median_ms']:.1f}"
                  f" (median), throughput x{res['s3']['pushes_s'] / res['local']['pushes_s']:.2f}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
