"""Where the demo's time goes: its data generator, its pushes, the engine's steps (per view and all five), and durability (input-log fsyncs, output-log writes, checkpoints), each timed alone on one thread.

Run from the repository root (takes about a minute at the demo's default size):

    python bench/profile_demo.py                       # 40 batches of 25,000 bids, W=2, like `dbsp demo`
    python bench/profile_demo.py --batches 20 --bids 10000 --workers 1

Nothing overlaps here (the demo runs its producer thread beside the steps): each phase is timed with
``perf_counter`` around the call that does it, over the same batches of ``dbsp_core.demo.Generator``, so the
sums say what each part would cost if it had the machine to itself. The last column is the process's CPU seconds
over the same calls (every thread: the workers, the merge thread, a checkpoint running beside them), steadier than
wall time on a loaded machine. Per-view rows run the circuit with only that
view as output (the nodes no output needs are not run), in memory. A last line gives the durable run's checkpoints:
the bytes of state values they wrote and their threads' CPU seconds (measured around the worker commits).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dbsp_core as dbsp  # noqa: E402
from dbsp_core.demo import HANDLE, Generator, build_circuit  # noqa: E402


def _batches(args: argparse.Namespace) -> tuple[list, float]:
    gen = Generator(args.seed, time.time_ns() // 10**6, args.bids)  # as the demo: bids within the last hour
    t0 = time.perf_counter()
    out = [gen.batch() for _ in range(args.batches)]
    return out, time.perf_counter() - t0


def _rows(batches: list) -> int:
    return sum(rows.num_rows for b in batches for rows, _ in b.values())


def _steps(p: dbsp.Pipeline, batches: list, durable: bool) -> dict[str, float]:
    """Push each batch and step once per batch; seconds spent pushing, in the executor, and in the rest of step."""
    run = p.executor.run
    spent = {"push": 0.0, "engine": 0.0, "step": 0.0}
    cpu = {"push": 0.0, "engine": 0.0, "step": 0.0}  # the process's CPU seconds (every thread: workers, merges,
    # a background checkpoint), which other load on the machine moves less than wall time

    def timed_run(steps):  # the executor's share of step(): the circuit itself, all workers
        t, c = time.perf_counter(), time.process_time()
        try:
            return run(steps)
        finally:
            spent["engine"] += time.perf_counter() - t
            cpu["engine"] += time.process_time() - c

    p.executor.run = timed_run
    for k, b in enumerate(batches):
        t, c = time.perf_counter(), time.process_time()
        for stream, (rows, w) in b.items():
            if durable:
                p.push(HANDLE[stream], rows, weights=w, producer=f"gen.{stream}", seq=k)
            else:
                p.push(HANDLE[stream], rows, weights=w)
        spent["push"] += time.perf_counter() - t
        cpu["push"] += time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        p.step()
        spent["step"] += time.perf_counter() - t
        cpu["step"] += time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    p.close()
    spent["close"] = time.perf_counter() - t
    cpu["close"] = time.process_time() - c
    spent["cpu"] = cpu  # type: ignore[assignment]
    return spent


class _CheckpointMeter:
    """The checkpoints' own cost, measured around the calls that make it (this script's instrumentation, nothing the
    pipeline keeps): per worker commit (runtime/coordinator.py ``WorkerStore.commit``, on the checkpoint thread) the
    thread's CPU seconds of encoding and putting the new state values (``WorkerSnapshot.apply``) and of the page
    store's commit, and the bytes of the values put."""

    def __init__(self) -> None:
        from dbsp_core.runtime.coordinator import WorkerStore
        from dbsp_core.storage.database import DatabaseHandle

        self.apply_s = self.commit_s = 0.0
        self.put_bytes = self.puts = 0
        meter = self
        put, commit = DatabaseHandle.put, WorkerStore.commit
        self._undo = [(DatabaseHandle, "put", put), (WorkerStore, "commit", commit)]

        def counted_put(h, table, key, value):
            meter.put_bytes += memoryview(value).nbytes
            meter.puts += 1
            return put(h, table, key, value)

        def timed_commit(store, step, captured):
            apply = type(store.snapshot).apply
            t = time.thread_time()
            try:
                type(store.snapshot).apply = staticmethod(lambda h, plan: meter._apply(apply, h, plan))
                return commit(store, step, captured)
            finally:
                type(store.snapshot).apply = staticmethod(apply)
                meter.commit_s += time.thread_time() - t

        DatabaseHandle.put = counted_put
        WorkerStore.commit = timed_commit

    def _apply(self, apply, h, plan):
        t = time.thread_time()
        try:
            return apply(h, plan)
        finally:
            self.apply_s += time.thread_time() - t

    def close(self) -> None:
        self.commit_s -= self.apply_s  # commit_s held both
        for cls, name, fn in self._undo:
            setattr(cls, name, fn)


def _one_view(name: str) -> dbsp.Circuit:
    c = build_circuit()
    for other in [o for o in c.outputs if o != name]:
        del c.outputs[other]
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--bids", type=int, default=25_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoint-interval", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    batches, gen_s = _batches(args)
    rows = _rows(batches)
    print(f"# {args.batches} batches of {args.bids:,} bids ({rows:,} rows), W={args.workers}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| phase | seconds | ms per batch | k rows/s | CPU seconds |")
    print("|---|---|---|---|---|")

    def line(what: str, s: float, c: float | None = None) -> None:
        cs = "" if c is None else f"{c:.2f}"
        print(f"| {what} | {s:.2f} | {s / args.batches * 1e3:.1f} | {rows / s / 1e3:,.0f} | {cs} |", flush=True)

    line("generate (Generator.batch)", gen_s)
    mem = _steps(dbsp.Pipeline(build_circuit(), workers=args.workers), batches, durable=False)
    line("in memory: push", mem["push"], mem["cpu"]["push"])
    line("in memory: step, five views", mem["step"], mem["cpu"]["step"])
    for name in build_circuit().outputs:
        one = _steps(dbsp.Pipeline(_one_view(name), workers=args.workers), batches, durable=False)
        line(f"in memory: step, {name} alone", one["step"], one["cpu"]["step"])
    with tempfile.TemporaryDirectory(prefix="dbsp-profile-") as d:
        p = dbsp.Pipeline(build_circuit(), workers=args.workers, storage=d,
                          checkpoint_interval=args.checkpoint_interval)
        meter = _CheckpointMeter()
        try:
            dur = _steps(p, batches, durable=True)
        finally:
            meter.close()
        ckpts = p.stats["checkpoints"]
    c = dur["cpu"]
    line("durable: push (encode, input log, fsync)", dur["push"], c["push"])
    line("durable: step, executor (the engine)", dur["engine"], c["engine"])
    line("durable: step, the rest (division, output log, checkpoint start)", dur["step"] - dur["engine"],
         c["step"] - c["engine"])
    line(f"durable: close (final checkpoint; {ckpts} in all)", dur["close"], c["close"])
    print(f"# checkpoints ({ckpts}, the final one included): {meter.put_bytes / 1e6:,.1f} MB in {meter.puts:,} state "
          f"values; the checkpoint threads' CPU {meter.apply_s:.2f} s encoding and putting them, "
          f"{meter.commit_s:.2f} s in the rest of the commits (page CRCs, writes, fsync)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
