"""Benchmark of a durable pipeline whose storage is an object store (moto's S3 server on 127.0.0.1, tests/s3_server.py) against the same pipeline on a local directory: durable throughput, checkpoint time, bytes uploaded per checkpoint against the bytes of state changed, and a recovery into an empty cache with the bytes it downloads.

Run: python bench/bench_remote.py [--rows N] [--rounds K] [--change F] [--memory-limit SIZE]. Same data for both
storages, one run each: N rows of bids (default 1M) are pushed and checkpointed (the state's first upload), then
K rounds (default 8) each push F of N new rows (default 0.01), step and checkpoint. Prints one line per
measurement. The load's throughput includes shipping the input and output logs to the store as segment objects
(group commit, storage.logstore; bench_logstore.py measures that alone); the bytes per checkpoint are those of the
upload at the checkpoint (state deltas, batch files, manifest). moto keeps objects in its process's memory and answers over loopback HTTP: a real store adds network
latency and bandwidth, so the ratio here is the floor of what S3 costs.

``--latency-rows N`` (``--latency-only`` skips the rest): the step latency around checkpoints (p50, p99, max) of
1,000-row steps on an N-row state while another thread checkpoints every second, on each storage.

``--recovery-rows N`` (e.g. 10000000; ``--recovery-only`` skips the rest): an N-row state is built at 2 workers
on the local S3 server and on a local directory and checkpointed, then each is opened by a new process (an empty
cache for the store): a driver recovery at 2 workers and a cold rescale to 3. Each open prints its time (and the
part spent restoring the cache from the store), its peak RSS above the process's RSS before the open (VmHWM reset
through /proc/self/clear_refs) and the bytes it downloaded (state objects, log segments); the restore of the state
objects alone is measured too (``--baseline-tree DIR``: also with the dbsp_core of another built checkout).

``--stage-rescale-rows N`` (``--stage-rescale-only`` skips the rest): the staged executor over the store (the
reference job runner, each task on one of two stage caches of its own, none the driver's) builds an N-row state
at 2 workers, checkpoints, and rescales live 2 -> 3 -> 2; for each change it prints the time, the bytes the
driver's process moved to and from the store meanwhile (its Remote's GETs and PUTs) and the bytes the tasks
fetched and uploaded (runtime/stage_store.py invariant 6). With ``--baseline-tree DIR`` the same runs on another
built checkout's dbsp_core first (a new process each, same data, another prefix on the same server).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def open_child(storage: str, workers: int, cache: str | None) -> None:
    """In a new process: ``Pipeline.open`` of ``storage`` at ``workers`` (into the empty ``cache`` for a store);
    prints one JSON line with its time, peak RSS above the RSS before it, and what it downloaded."""
    base = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS: the peak measured is the open's
    except OSError:
        pass
    kw = {"cache_dir": cache} if cache else {}
    t = time.perf_counter()
    q = dbsp.Pipeline.open(storage, circuit(), workers=workers, checkpoint_interval=None, **kw)
    secs = time.perf_counter() - t
    out = {"open_s": secs, "restore_s": q.stats.get("restore_s", 0.0), "recovery_s": q.stats["recovery_s"],
           "peak_rss": _status("VmHWM") - base, "base_rss": base, "workers": q.layout.workers,
           "state_bytes": sum(q.disk_usage().values())}
    if q._remote is not None:
        out["state_get_bytes"] = q._remote.stats["get_bytes"]
        out["log_get_bytes"] = q._remote_logs.store.stats["get_bytes"] if q._remote_logs is not None else 0
        out["gets"] = q._remote.stats["gets"]
    q.close(checkpoint=False)
    print(json.dumps(out), flush=True)


def restore_child(storage: str, cache: str) -> None:
    """In a new process: only the restore of the state objects into the empty ``cache`` (no logs, no state load);
    prints one JSON line with its time and peak RSS above the RSS before it."""
    from dbsp_core.runtime.remote_state import prepare_cache, restore
    from dbsp_core.storage.remote import Remote
    from dbsp_core.storage.remote_log import RemoteLogs

    base = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    prepare_cache(cache)
    r = Remote.of(storage, cache)
    t = time.perf_counter()
    restore(r, cache, RemoteLogs(r))
    print(json.dumps({"restore_s": time.perf_counter() - t, "peak_rss": _status("VmHWM") - base,
                      "get_bytes": r.stats["get_bytes"], "largest": max(r.list("db").values())}), flush=True)


def _open_in_child(storage: str, workers: int, cache: str | None, restore_only: bool = False,
                   tree: str | None = None) -> dict:
    """``open_child`` (or ``restore_child``) in a new process; ``tree``: the checkout whose dbsp_core it imports."""
    cmd = [sys.executable, os.path.abspath(__file__), "--open-child", storage, "--workers", str(workers)]
    if cache:
        cmd += ["--cache", cache]
    if restore_only:
        cmd += ["--restore-only"]
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode:
        raise RuntimeError(f"open child failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def build(storage: str, rows: int) -> float:
    """An N-row state at 2 workers on ``storage``, checkpointed and closed; returns the seconds it took."""
    t = time.perf_counter()
    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=None)
    chunk = 250_000
    for i in range(0, rows, chunk):
        p.push("bids", data(1000 + i, min(chunk, rows - i)))
        p.step()
    p.close()  # checkpoints
    return time.perf_counter() - t


def recovery(server: "S3Server", rows: int, baseline: str | None = None) -> None:
    """Driver recovery and cold rescale of an N-row state from the store and from a local directory."""
    MB = 1 << 20
    local = tempfile.mkdtemp(prefix="bench-remote-rec-")
    try:
        uri = server.uri(server.bucket(), "rec")
        b_local = build(os.path.join(local, "store"), rows)
        b_s3 = build(uri, rows)
        print(f"recovery of a {rows:,}-row state built at 2 workers (build + checkpoint: local {b_local:.1f} s, "
              f"s3 {b_s3:.1f} s), load {os.getloadavg()[0]:.2f}")
        for tree, label in ((None, "this checkout"),) + (((baseline, f"baseline {baseline}"),) if baseline else ()):
            cache = tempfile.mkdtemp(prefix="bench-remote-cache-")
            try:
                ro = _open_in_child(uri, 2, os.path.join(cache, "c"), restore_only=True, tree=tree)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            print(f"restore of the state objects alone ({label}): {ro['restore_s']:.2f} s, peak RSS "
                  f"+{ro['peak_rss'] / MB:.0f} MiB, {ro['get_bytes'] / MB:.1f} MiB downloaded, largest object "
                  f"{ro['largest'] / MB:.1f} MiB")
        for workers, what in ((2, "driver recovery"), (3, "cold rescale 2 -> 3")):
            cache = tempfile.mkdtemp(prefix="bench-remote-cache-")
            try:
                s3 = _open_in_child(uri, workers, os.path.join(cache, "c"))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            copy = os.path.join(local, f"copy{workers}")  # the open of a cold rescale rewrites the directory
            shutil.copytree(os.path.join(local, "store"), copy)
            lo = _open_in_child(copy, workers, None)
            shutil.rmtree(copy, ignore_errors=True)
            print(f"{what}: s3 {s3['open_s']:.2f} s (state objects into the empty cache {s3['restore_s']:.2f} s, then logs "
                  f"rebuilt from segments, state load and replay {s3['open_s'] - s3['restore_s']:.2f} s), peak RSS +{s3['peak_rss'] / MB:.0f} MiB, downloaded "
                  f"{s3['state_get_bytes'] / MB:.1f} MiB of state in {s3['gets']} GETs + "
                  f"{s3['log_get_bytes'] / MB:.1f} MiB of log segments | local directory {lo['open_s']:.2f} s "
                  f"(state load {lo['recovery_s']:.2f} s), peak RSS +{lo['peak_rss'] / MB:.0f} MiB | state on disk "
                  f"{s3['state_bytes'] / MB:.0f} MiB | ratio {s3['open_s'] / lo['open_s']:.1f}")
    finally:
        shutil.rmtree(local, ignore_errors=True)


def stage_rescale_child(storage: str, rows: int) -> None:
    """In a new process: the staged executor over ``storage`` builds a ``rows``-row state at 2 workers, checkpoints,
    and rescales live 2 -> 3 -> 2; prints one JSON line per change (seconds, the driver's bytes through the store,
    the tasks')."""
    from dbsp_core.runtime import StagedExecutor
    from dbsp_core.runtime.staged import LocalJobRunner

    work = tempfile.mkdtemp(prefix="bench-stage-rescale-")
    try:
        runner = LocalJobRunner(cache_dirs=[os.path.join(work, "exec-0"), os.path.join(work, "exec-1")], seed=0)
        p = dbsp.Pipeline(circuit(), 2, 8, storage, executor=StagedExecutor(runner),
                          cache_dir=os.path.join(work, "driver"), checkpoint_interval=None)
        big = data(1, rows)
        for i in range(0, rows, 100_000):
            p.push("bids", big.slice(i, 100_000))
            p.step()
        p.checkpoint()
        for workers in (3, 2):
            r0, s0 = dict(p._remote.stats), dict(p.stats)
            t = time.perf_counter()
            rep = p.rescale(workers)
            secs = time.perf_counter() - t
            r1, s1 = p._remote.stats, p.stats
            print(json.dumps({"to": workers, "seconds": secs, "driver_get_bytes": r1["get_bytes"] - r0["get_bytes"],
                              "driver_gets": r1["gets"] - r0["gets"],
                              "driver_put_bytes": r1["put_bytes"] - r0["put_bytes"],
                              "task_fetch_bytes": s1.get("state_fetch_bytes", 0) - s0.get("state_fetch_bytes", 0),
                              "task_upload_bytes": (s1.get("state_upload_bytes", 0)
                                                    - s0.get("state_upload_bytes", 0)),
                              "moved_bytes": rep["moved_bytes"], "waves": rep["batches"],
                              "state_bytes": p.executor.disk_bytes()}), flush=True)
        p.close(checkpoint=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stage_rescale(server: "S3Server", rows: int, baseline: str | None) -> None:
    """:func:`stage_rescale_child` for the baseline checkout (if any), then this one, each in a new process."""
    MB = 1 << 20
    print(f"staged executor over the store, {rows:,}-row state, live rescale 2 -> 3 -> 2, load {os.getloadavg()[0]:.2f}")
    for tree, label in (((baseline, f"baseline {baseline}"),) if baseline else ()) + ((None, "this checkout"),):
        cmd = [sys.executable, os.path.abspath(__file__), "--stage-rescale-child",
               server.uri(server.bucket(), "stage-rescale"), "--rows", str(rows)]
        env = dict(os.environ, PYTHONPATH=tree) if tree else None
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if r.returncode:
            raise RuntimeError(f"stage rescale child failed: {r.stderr[-3000:]}")
        for line in r.stdout.strip().splitlines():
            x = json.loads(line)
            print(f"  {label}: -> {x['to']} workers in {x['seconds']:.2f} s ({x['waves']} waves), through the driver "
                  f"{x['driver_get_bytes'] / MB:.1f} MiB down ({x['driver_gets']} GETs) + "
                  f"{x['driver_put_bytes'] / MB:.1f} MiB up; tasks fetched {x['task_fetch_bytes'] / MB:.1f} MiB, "
                  f"uploaded {x['task_upload_bytes'] / MB:.1f} MiB; moved {x['moved_bytes'] / MB:.1f} MiB of a "
                  f"{x['state_bytes'] / MB:.1f} MiB state in the store", flush=True)


def step_latency(storage: str, rows: int, seconds: float, every: float) -> dict:
    """Step latency around checkpoints: an N-row state at 2 workers, then steps of 1,000 new rows in a loop for
    ``seconds`` while another thread calls ``checkpoint()`` every ``every`` seconds (and the timer is off)."""
    import threading

    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=None)
    for i in range(0, rows, 250_000):
        p.push("bids", data(2000 + i, min(250_000, rows - i)))
        p.step()
    p.checkpoint()
    small = [data(5000 + k, 1000) for k in range(64)]
    stop = threading.Event()
    ckpts: list[float] = []

    def checkpointer() -> None:
        while not stop.wait(every):
            t = time.perf_counter()
            p.checkpoint()
            ckpts.append(time.perf_counter() - t)

    th = threading.Thread(target=checkpointer)
    lat: list[float] = []
    th.start()
    t_end = time.perf_counter() + seconds
    k = 0
    while time.perf_counter() < t_end:
        p.push("bids", small[k % len(small)])
        t = time.perf_counter()
        p.step()
        lat.append(time.perf_counter() - t)
        k += 1
    stop.set()
    th.join()
    p.close()
    q = np.quantile(np.array(lat) * 1000, [0.5, 0.99, 1.0])
    return {"steps": len(lat), "p50": q[0], "p99": q[1], "max": q[2], "checkpoints": len(ckpts),
            "ckpt_s": statistics.median(ckpts) if ckpts else 0.0}


def main() -> None:
    if "--stage-rescale-child" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--stage-rescale-child", required=True)
        ap.add_argument("--rows", type=int, required=True)
        a = ap.parse_args()
        stage_rescale_child(a.stage_rescale_child, a.rows)
        return
    if "--open-child" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--open-child", required=True)
        ap.add_argument("--workers", type=int, required=True)
        ap.add_argument("--cache", default=None)
        ap.add_argument("--restore-only", action="store_true")
        a = ap.parse_args()
        if a.restore_only:
            restore_child(a.open_child, a.cache)
        else:
            open_child(a.open_child, a.workers, a.cache)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--change", type=float, default=0.01)
    ap.add_argument("--memory-limit", default=None)
    ap.add_argument("--recovery-rows", type=int, default=0)
    ap.add_argument("--recovery-only", action="store_true")
    ap.add_argument("--baseline-tree", default=None,
                    help="a checkout of another commit (built): its restore is measured beside this one's")
    ap.add_argument("--latency-rows", type=int, default=0)
    ap.add_argument("--latency-only", action="store_true")
    ap.add_argument("--stage-rescale-rows", type=int, default=0)
    ap.add_argument("--stage-rescale-only", action="store_true")
    a = ap.parse_args()
    server = S3Server()
    local = tempfile.mkdtemp(prefix="bench-remote-")
    try:
        if a.latency_rows:
            for name, where in (("local", os.path.join(local, "lat")), ("s3", server.uri(server.bucket(), "lat"))):
                r = step_latency(where, a.latency_rows, 20.0, 1.0)
                print(f"step latency, {a.latency_rows:,}-row state, 1,000-row steps for 20 s, checkpoint() every 1 s "
                      f"from another thread, {name}: {r['steps']} steps, p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, "
                      f"max {r['max']:.1f} ms; {r['checkpoints']} checkpoints of median {r['ckpt_s']:.2f} s")
            shutil.rmtree(os.path.join(local, "lat"), ignore_errors=True)
        if a.latency_only:
            return
        if a.stage_rescale_rows:
            stage_rescale(server, a.stage_rescale_rows, a.baseline_tree)
        if a.stage_rescale_only:
            return
        if a.recovery_rows:
            recovery(server, a.recovery_rows, a.baseline_tree)
        if a.recovery_only:
            return
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
