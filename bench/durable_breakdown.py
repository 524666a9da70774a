"""Where the time of a durable Nexmark run goes (read, encode, log copy, write, fsync, engine, output log, checkpoint), per phase in wall and CPU seconds, beside the disk's measured sequential write bandwidth and the same query in memory.

How it measures:

- The events are generated once (bench/nexmark.py's ``write_events``: one parquet file per stream and step).
- Each run is a fresh child process running bench/nexmark.py's loop with W workers, in memory or durable
  (``storage=<dir>`` beside the events, default settings); runs alternate memory, durable, memory, durable ...
  so a load change on a shared machine hits both. ``--reader files`` (the default) reads the streams the query
  reads through one ``FileSource`` each, one file per step, in both modes; durable, the source declares its
  files immutable, so a push is logged by reference to its file (fileref.py), as Flink's durable runs log no
  input. ``--reader push``: read each step's files with pyarrow and push every stream with one ``push_many``
  (or with ``--one-by-one`` one push each): the rows are logged.
- In a durable child the phases are timed by wrapping the functions that do them (the wrappers cost a few
  microseconds per call): the push's encode (``codec.encode_zset_parts``), each log's ``enqueue`` (CRC-32C and
  the copy into the log's buffer), its write (``pwrite`` into the page cache) and its ``fsync`` (a ``sync`` is
  split into ``write`` then ``sync``, which then only fsyncs), the engine (``executor.run``), the output record's
  encode, and checkpoints (foreground capture and the background thread); with FileSources, the unit's read and
  decode (``read_unit``) and the reference (re-reading the unit's bytes for their CRC-32C). CPU is the calling thread's
  (``time.thread_time``); the engine's worker threads are counted in the process CPU only.
- ``--baseline DIR``: a third run per round, durable, of an older dbsp_core (one push per stream, as before
  ``push_many``), so the change is measured against it under the same load.
- The disk: ``--disk-mib`` MiB written in 4 MiB ``write`` calls into a file in the same directory, fsync'd every
  16 MiB (about what one step of q0 logs) and once at the end; MiB/s = size / wall time of the whole.

Run:  python bench/durable_breakdown.py --queries q0,q1,q2 --events 1000000 --runs 3 [--baseline DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("DBSP_BREAKDOWN_CODE"):  # a --baseline child: the older dbsp_core, imported before nexmark.py
    sys.path.insert(0, os.environ["DBSP_BREAKDOWN_CODE"])  # puts this tree first
    import dbsp_core  # noqa: E402,F401

import nexmark as bench_nexmark  # noqa: E402  (bench/nexmark.py, beside this file)


def disk_bandwidth(directory: str, mib: int, fsync_every_mib: int = 16) -> float:
    """MiB/s of writing ``mib`` MiB sequentially into a new file in ``directory`` (4 MiB writes, fsync every
    ``fsync_every_mib`` MiB and at the end)."""
    buf = os.urandom(4 << 20)
    path = os.path.join(directory, "disk-bandwidth.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for i in range(mib // 4):
            os.write(fd, buf)
            if (i + 1) * 4 % fsync_every_mib == 0:
                os.fsync(fd)
        os.fsync(fd)
        return mib / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)


class Phases:
    """Wall and thread-CPU seconds, calls and bytes per phase name (threads add to it concurrently)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t: dict = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])

    def add(self, name: str, wall: float, cpu: float) -> None:
        with self.lock:
            row = self.t[name]
            row[0] += 1
            row[1] += wall
            row[2] += cpu

    def timed(self, name: str, f, nbytes=None):
        def wrapper(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                thread = threading.current_thread().name
                where = ("checkpoint thread: " if thread.startswith("dbsp-checkpoint") else
                         "division sync thread: " if thread.startswith("dbsp-division") else
                         "read-ahead thread: " if thread.startswith("dbsp-files") else "")
                with self.lock:
                    row = self.t[where + name]
                    row[0] += 1
                    row[1] += wall
                    row[2] += cpu
                    row[3] += nbytes(*a, **k) if nbytes else 0
        return wrapper


class TimedLog:
    """A C step log whose enqueue, write (pwrite) and fsync are timed apart: ``sync`` = ``write`` then ``sync``."""

    def __init__(self, log, name: str, phases: Phases) -> None:
        self._log = log

        def size(step, handle, producer, seq, payload):
            parts = payload if isinstance(payload, (list, tuple)) else [payload]
            return sum(memoryview(p).nbytes for p in parts)

        self.enqueue = phases.timed(f"{name}: enqueue (CRC-32C, copy)", log.enqueue, size)
        self._write = phases.timed(f"{name}: write (pwrite)", log.write)
        self._sync = phases.timed(f"{name}: fsync", log.sync)
        self.write = self._write

    def sync(self, ticket: int) -> None:
        self._write(ticket)
        self._sync(ticket)

    def __getattr__(self, name: str):
        return getattr(self._log, name)


def child(a: dict) -> dict:
    """One run in this process: bench/nexmark.py's loop, with the phases of a durable run timed."""
    import pyarrow.parquet as pq

    import dbsp_core as dbsp
    from dbsp_core.connectors import files as file_source
    from dbsp_core.runtime import driver
    from dbsp_core.runtime.embedded import EmbeddedExecutor
    from dbsp_core.storage import outputlog

    root, query, mode, workers = a["root"], a["query"], a["mode"], a["workers"]
    files = json.load(open(os.path.join(root, "files.json")))
    ph = Phases()
    storage = tempfile.mkdtemp(prefix=f"breakdown-{query}-", dir=root) if mode == "durable" else None
    ex = EmbeddedExecutor(background_merge=False)
    if storage:
        for name in ("encode_zset_parts", "encode_zset"):  # the push's encode (older builds joined it: encode_zset)
            if hasattr(driver, name):
                setattr(driver, name, ph.timed("push: encode (Arrow IPC, frame checksum)", getattr(driver, name)))
        outputlog.OutputLog._encode = ph.timed("output: encode (Arrow IPC, frame checksum)",
                                               outputlog.OutputLog._encode)
        driver.Pipeline._checkpoint = ph.timed("checkpoint: capture (steps paused)", driver.Pipeline._checkpoint)
        driver.Pipeline._await_division = ph.timed("step: wait for the division record's fsync",
                                                   driver.Pipeline._await_division)
        driver.Pipeline._background = ph.timed("checkpoint: write and commit", driver.Pipeline._background)
        ex.run = ph.timed("engine (executor.run)", ex.run)
        if hasattr(file_source, "reference"):
            file_source.reference = ph.timed("push: reference (re-read the unit, CRC-32C)", file_source.reference)
    reader = a.get("reader", "push")
    source = a.get("source", "parquet")
    if reader == "files":  # in both modes: the read is part of the loop
        file_source.read_unit = ph.timed("FileSource: read and decode the unit", file_source.read_unit)
    p = dbsp.Pipeline(nexmark_circuit(query), workers=workers, storage=storage, executor=ex,
                      checkpoint_interval=a.get("checkpoint_s", 10.0)) if storage else \
        dbsp.Pipeline(nexmark_circuit(query), workers=workers, executor=ex)
    if storage:
        p._input._log = TimedLog(p._input._log, "input log", ph)
        p._output._log = TimedLog(p._output._log, "output log", ph)
    events, seconds, read_s = 0, 0.0, 0.0
    names = bench_nexmark.nexmark.SCHEMAS
    if reader == "files":
        names = bench_nexmark.flink_nexmark.READS.get(query, names)
        sources = bench_nexmark.file_sources(p, root, names, source)
    cpu0 = time.process_time()
    try:
        for step in files:
            t0 = time.perf_counter()
            if reader == "files":
                r0 = time.perf_counter()
                bench_nexmark.push_step(p, step, names, source, sources)
                read_s += time.perf_counter() - r0
            else:
                r0 = time.perf_counter()
                tables = [(name, pq.read_table(step[name])) for name in names]
                read_s += time.perf_counter() - r0
                if a.get("one_by_one"):
                    for name, t in tables:
                        p.push(name, t)
                else:  # as bench/nexmark.py: the step's pushes share one fsync
                    p.push_many(tables)
            events += sum(step["rows:" + name] for name in bench_nexmark.nexmark.SCHEMAS)
            s0, c0 = time.perf_counter(), time.thread_time()
            p.step()
            ph.add("step() on the calling thread", time.perf_counter() - s0, time.thread_time() - c0)
            seconds += time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        threads = thread_cpu()
        with ph.lock:  # the timed loop's phases (a background checkpoint still running adds to them: counted)
            phases = {k: list(v) for k, v in ph.t.items()}
        written = {}
        if storage:
            for sub in ("input", "output", "state"):
                d = os.path.join(storage, sub)
                written[sub] = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d) for f in fs)
    finally:
        c0 = time.perf_counter()
        p.close()
        close_s = time.perf_counter() - c0
        if storage:
            shutil.rmtree(storage, ignore_errors=True)
    return {"query": query, "mode": mode, "events": events, "seconds": seconds, "cpu": cpu, "read_s": read_s,
            "written": written, "phases": phases, "close_s": close_s, "threads": threads}


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, summed by thread name (Linux)."""
    out: dict[str, float] = collections.defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    named = {t.native_id: t.name for t in threading.enumerate()}  # the rest: Arrow's pools, C threads
    for tid in os.listdir("/proc/self/task"):
        try:
            name = named.get(int(tid)) or "other: " + open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[re.sub(r"[0-9_-]+$", "", name) or name] += (int(f[11]) + int(f[12])) / tick
    return dict(out)


def nexmark_circuit(query: str):
    return bench_nexmark.nexmark.circuit(query)


def run_child(a: dict, code: str | None = None) -> dict:
    """One run in a fresh process; ``code``: a directory holding the dbsp_core to import instead of this tree's."""
    env = dict(os.environ, DBSP_BREAKDOWN_CODE=code) if code else None
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(a)], capture_output=True,
                       text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"{a} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spread(xs: list[float]) -> str:
    m = sum(xs) / len(xs)
    return f"{m:,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", default="q0,q1,q2")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="memory/durable pairs per query, alternated")
    ap.add_argument("--disk-mib", type=int, default=512)
    ap.add_argument("--one-by-one", action="store_true",
                    help="push each stream with its own push (one fsync each), not one push_many per step")
    ap.add_argument("--baseline", help="a directory holding an older dbsp_core (e.g. `git archive COMMIT dbsp_core "
                    "| tar -x -C DIR`, with this tree's built extensions copied in): its durable run, pushing one by "
                    "one, alternates with this tree's in the same run")
    ap.add_argument("--reader", choices=["files", "push"], default="files",
                    help="files: a FileSource per stream the query reads (durable: pushes logged by reference); "
                    "push: pyarrow reads and push_many of every stream (rows logged)")
    ap.add_argument("--source", choices=["parquet", "csv"], default="parquet",
                    help="the files the FileSources read (csv: the files bench/nexmark.py --peers flink reads)")
    ap.add_argument("--old", help="a source tree (e.g. `git worktree add --detach /tmp/old main`, built): its "
                    "dbsp_core runs this script's loop, same reader and source, alternated with this tree's as mode "
                    "'old-durable' (and 'old-memory' with --old-memory)")
    ap.add_argument("--old-memory", action="store_true")
    ap.add_argument("--checkpoint-s", type=float, default=10.0,
                    help="the durable pipeline's checkpoint_interval (default 10 s, the Pipeline's default; bench/"
                    "nexmark.py's Flink checkpoints every 1 s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    root = tempfile.mkdtemp(prefix="durable-breakdown-")
    try:
        files, _ = bench_nexmark.write_events(root, args.events, args.batch, 0,
                                              bench_nexmark.nexmark.generator.DEFAULT_RATE, csv=args.source == "csv")
        json.dump(files, open(os.path.join(root, "files.json"), "w"))
        print(f"reader: {args.reader}; {args.events:,} events in {len(files)} steps, W={args.workers}, "
              f"{os.cpu_count()} cores, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, storage under {root}", flush=True)
        disk = []
        for q in args.queries.split(","):
            modes = (("memory", "durable") + (("baseline",) if args.baseline else ())
                     + (("old-memory",) if args.old and args.old_memory else ()) + (("old-durable",) if args.old else ()))
            rates: dict = {m: [] for m in modes}
            runs: dict = {m: [] for m in modes}
            for i in range(args.runs):
                disk.append(disk_bandwidth(root, args.disk_mib))
                for mode in modes:
                    base, old = mode == "baseline", mode.startswith("old-")
                    r = run_child({"root": root, "query": q,
                                   "mode": "durable" if base else mode[4:] if old else mode,
                                   "workers": args.workers, "one_by_one": args.one_by_one or base,
                                   "reader": "push" if base else args.reader, "source": args.source,
                                   "checkpoint_s": args.checkpoint_s},
                                  args.baseline if base else args.old if old else None)
                    rates[mode].append(r["events"] / r["seconds"])
                    runs[mode].append(r)
                    print(f"{q} {mode:>8} run {i + 1}: {r['events'] / r['seconds']:>12,.0f} events/s "
                          f"({r['seconds']:.2f} s, process CPU {r['cpu']:.2f} s)", flush=True)
            for mode in modes[1:]:
                report(q, mode, rates["memory"], rates[mode], runs[mode], disk)
            mem = runs["memory"]
            names = sorted({k for r in mem for k in r.get("threads", {})})
            print("memory runs: threads' CPU s (process lifetime): " + ", ".join(
                f"{k} {sum(r.get('threads', {}).get(k, 0.0) for r in mem) / len(mem):.2f}" for k in names))
            print("memory runs: " + ", ".join(
                f"{k} {sum(r['phases'].get(k, [0, 0.0])[1] for r in mem) / len(mem):.3f} s wall"
                for k in sorted({k for r in mem for k in r["phases"]})))
        print(f"\ndisk, sequential write + fsync every 16 MiB, {args.disk_mib} MiB in the bench's directory: "
              f"{spread(disk)} MiB/s over {len(disk)} measurements")
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average at the end: {load}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(q: str, mode: str, mem: list[float], dur: list[float], runs: list[dict], disk: list[float]) -> None:
    ratio = [d / m for d, m in zip(dur, mem)]
    # bytes appended to the logs (what enqueue copied), not the directories' size at the end: a checkpoint
    # during the run truncates the input log
    mib = [sum(v[3] for k, v in r["phases"].items() if k.endswith("enqueue (CRC-32C, copy)")) / 2**20 for r in runs]
    rate_mib = [m / r["seconds"] for m, r in zip(mib, runs)]
    print(f"\n{q}: memory {spread(mem)} events/s, {mode} {spread(dur)} events/s; {mode} / memory per pair "
          f"{', '.join(f'{x:.0%}' for x in ratio)}; durable logs {sum(mib) / len(mib):.0f} MiB "
          f"(on disk at the end: {', '.join(f'{k} {v / 2**20:.0f}' for k, v in runs[0]['written'].items())}) at "
          f"{spread(rate_mib)} MiB/s = {sum(rate_mib) / len(rate_mib) / (sum(disk) / len(disk)):.0%} of the disk")
    names = sorted({k for r in runs for k in r["phases"]})
    print(f"| phase ({mode}, mean of runs) | calls | wall s | CPU s | MiB |\n|---|---|---|---|---|")
    n = len(runs)
    print(f"| timed loop | - | {sum(r['seconds'] for r in runs) / n:.3f} | {sum(r['cpu'] for r in runs) / n:.3f} "
          f"(process) | - |")
    print(f"| read and push (the polls, or pyarrow and push_many) | - | {sum(r['read_s'] for r in runs) / n:.3f} | - "
          f"| - |")
    close = sum(r["close_s"] for r in runs) / n
    print(f"| close (final checkpoint; not in the timed loop) | 1 | {close:.3f} | - | - |")
    for k in names:
        rows = [r["phases"].get(k, [0, 0.0, 0.0, 0]) for r in runs]
        print(f"| {k} | {sum(x[0] for x in rows) / n:.0f} | {sum(x[1] for x in rows) / n:.3f} | "
              f"{sum(x[2] for x in rows) / n:.3f} | {sum(x[3] for x in rows) / n / 2**20:.0f} |")
    names = sorted({k for r in runs for k in r.get("threads", {})})
    print("threads' CPU s at the loop's end (process lifetime): " + ", ".join(
        f"{k} {sum(r.get('threads', {}).get(k, 0.0) for r in runs) / n:.2f}" for k in names))


if __name__ == "__main__":
    main()
