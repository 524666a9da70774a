"""Where one Nexmark query's time goes in one process: CSV parsing, push and step (wall and the process's CPU seconds, which other load on the machine barely moves), the step's CPU split into its operators (by class), exchanges, merges, output and the executor's own work, the per-operator profile, and with --cprofile the hottest functions by CPU time.

Run:  python bench/nexmark_profile.py q17 --workers 2 [--events 1000000] [--cprofile] [--perf]
      python bench/nexmark_profile.py --queries all --workers 2     # one table, each query in a fresh process

The events come from the project's generator (seed 0, steps of --batch events), written to CSV in memory once
and parsed inside the timed loop as bench/nexmark.py does beside Flink; only the streams the query reads are
parsed (flink_nexmark.READS). The executor merges on the workers' threads, as in bench/nexmark.py.

How the split is measured (``Split``): the timed loop's three phases run one after the other (parse, then
``push_many``, then ``step``), so each phase's process CPU (``time.process_time``, every thread, Arrow's CSV
threads included) is its own. Inside a step, every call of each worker's step plan (one per live node: a fused
chain's last node carries the chain, its inner nodes pass their input through) is timed by its thread's CPU
clock (``time.thread_time``, ~1 us a call here), so a worker waiting at an exchange's barrier counts nothing;
merges (``Trace._work``) inside a call are taken out of it and counted apart, as are, outside the calls, the
workers' and the driver's making the output distinct (``ZSet._hashed_part``, ``ZSet._distinct_unsorted``, the
concatenation of the workers' parts), the rollback capture and the memory release after the step. What is left
of the step's process CPU is the driver's and executor's own: dividing the step, handing it to the pool,
waking threads at barriers, the timers. The wrappers are installed on this process's objects only (no library
code changes); they add a few microseconds per call (``timer`` in the JSON: the calls made).

With ``--perf`` the process also runs ``perf record`` on itself for the timed loop only and prints the samples
by thread kind and by shared object (CPU the timers above cannot see inside: the interpreter, Arrow, our
kernels, the C library, the kernel's page faults).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.csv as pa_csv

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dbsp_core as dbsp  # noqa: E402
import flink_nexmark  # noqa: E402  (bench/, beside this file)
from dbsp_core import nexmark  # noqa: E402
from dbsp_core.profile import format_table  # noqa: E402
from dbsp_core.runtime import embedded  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402
from dbsp_core.trace import levels  # noqa: E402
from dbsp_core.zset import ZSet  # noqa: E402

FLINK_QUERIES = ("q0", "q1", "q2", "q3", "q4", "q5", "q7", "q8", "q9", "q10", "q11", "q14", "q15", "q16", "q17",
                 "q18", "q19", "q20", "q21", "q22")  # every query with Flink SQL (bench/flink_nexmark.py)


class Split:
    """CPU seconds of a step by part (the module docstring): exclusive times of nested regions on each thread."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.calls = 0
        self.active = False
        self._tls = threading.local()
        self._lock = threading.Lock()

    def _state(self) -> Any:
        t = self._tls
        if not hasattr(t, "child"):
            t.child, t.ops = 0.0, 0
        return t

    def region(self, label: str, fn: Callable, args: tuple, kw: dict, op: bool = False) -> Any:
        """Run ``fn`` as a region ``label``: its thread CPU less its timed sub-regions'."""
        t = self._state()
        clock = time.thread_time
        t0 = clock()
        saved, t.child = t.child, 0.0
        if op:
            t.ops += 1
        try:
            return fn(*args, **kw)
        finally:
            dt = clock() - t0
            if op:
                t.ops -= 1
            own = dt - t.child
            t.child = saved + dt
            with self._lock:
                self.cpu[label] += own
                self.calls += 1

    def in_op(self) -> bool:
        return self._state().ops > 0

    def install(self, p: dbsp.Pipeline) -> None:
        """Wrap the workers' plan calls (per node, labelled by the node's class) and the step's other parts."""
        ex = p.executor
        nodes = ex.circuit.nodes
        for wk in ex._workers:
            calls = []
            for fn, inputs, i in wk._steps:
                node = nodes[i]
                label = "exchange" if node.kind == "exchange" else "op:" + type(node).__name__
                calls.append((self._op(fn, label), inputs, i))
            wk._steps = calls

        def outside(label: str, fn: Callable) -> Callable:  # timed only outside the operators' calls
            def call(*args: Any, **kw: Any) -> Any:
                if not self.active or self.in_op():
                    return fn(*args, **kw)
                return self.region(label, fn, args, kw)
            return call

        def anywhere(label: str, fn: Callable) -> Callable:
            def call(*args: Any, **kw: Any) -> Any:
                if not self.active:
                    return fn(*args, **kw)
                return self.region(label, fn, args, kw)
            return call

        levels.Trace._work = anywhere("merges", levels.Trace._work)
        ZSet._distinct_unsorted = outside("output", ZSet._distinct_unsorted)
        ZSet._hashed_part = outside("output", ZSet._hashed_part)
        embedded.concat = outside("output", embedded.concat)
        embedded.capture = outside("rollback capture", embedded.capture)
        embedded.release_memory = outside("release memory", embedded.release_memory)

    def _op(self, fn: Callable, label: str) -> Callable:
        def call(inputs: list, ctx: Any) -> Any:
            if not self.active:
                return fn(inputs, ctx)
            return self.region(label, fn, (inputs, ctx), {}, op=True)
        return call


class PerfRecorder:
    """``perf record`` of this process (every thread, user and kernel) between start() and stop(), its samples
    stamped with CLOCK_MONOTONIC so that each falls in a phase of the timed loop (``mark``)."""

    def __init__(self, freq: int = 999) -> None:
        self.path = tempfile.mktemp(prefix="nexmark-perf-", suffix=".data")
        self.freq = freq
        self.proc: subprocess.Popen | None = None
        self.phases: list[tuple[float, str]] = []  # (monotonic time a phase starts, phase)

    def start(self) -> None:
        self.proc = subprocess.Popen(["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", str(self.freq), "-p",
                                      str(os.getpid()), "-o", self.path],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches to the threads

    def mark(self, phase: str) -> None:
        self.phases.append((time.monotonic(), phase))

    def stop(self) -> None:
        assert self.proc is not None
        self.mark("after")
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait()

    def report(self, python_tids: dict[int, str]) -> dict:
        """CPU seconds (samples / frequency) by phase and shared object, by thread, and the top symbols;
        ``python_tids``: native thread id -> name of this process's Python threads (the rest are Arrow's)."""
        out = subprocess.run(["perf", "script", "-i", self.path, "-F", "tid,time,ip,sym,dso"],
                             capture_output=True, text=True).stdout
        os.unlink(self.path)
        starts = [t for t, _ in self.phases]
        names = [ph for _, ph in self.phases]
        import bisect
        by: dict[str, float] = collections.defaultdict(float)
        threads: dict[str, float] = collections.defaultdict(float)
        syms: dict[tuple, float] = collections.defaultdict(float)
        per = 1.0 / self.freq
        for line in out.splitlines():
            m = re.match(r"\s*(\d+)\s+([\d.]+):\s+\S+\s+(.*?)\s+\((.*)\)\s*$", line)
            if not m:
                continue
            tid, ts, sym, dso = int(m.group(1)), float(m.group(2)), m.group(3), m.group(4)
            k = bisect.bisect_right(starts, ts) - 1
            phase = names[k] if k >= 0 else "before"
            if phase in ("before", "after"):
                continue
            kind = _dso_kind(dso)
            sym = re.sub(r"\+0x[0-9a-f]+$", "", sym)
            by[phase + "|" + kind] += per
            threads[python_tids.get(tid, "Arrow threads")] += per
            syms[(phase, kind, sym[:90])] += per
        top = sorted(((v, *k) for k, v in syms.items()), reverse=True)[:20]
        return {"by": dict(by), "threads": dict(threads), "top": top}


def _dso_kind(dso: str) -> str:
    if dso.startswith("[kernel") or dso == "[k]":
        return "kernel"
    base = os.path.basename(dso)
    for key, kind in (("_zset", "dbsp C kernels"), ("_storage", "dbsp C kernels"), ("libarrow", "Arrow"),
                      ("libparquet", "Arrow"), ("pyarrow", "Arrow"), ("lib.cpython", "Arrow"),
                      ("libpython", "Python interpreter"), ("python3", "Python interpreter"),
                      ("libc.so", "libc (malloc/memcpy)"), ("libc-", "libc (malloc/memcpy)"),
                      ("numpy", "numpy"), ("_multiarray", "numpy"), ("libopenblas", "numpy"),
                      ("libm.so", "libm"), ("ld-linux", "libc (malloc/memcpy)"),
                      ("libstdc++", "C++ runtime"), ("libgcc", "C++ runtime"), ("libjemalloc", "Arrow")):
        if key in base:
            return kind
    return base or dso


def make_steps(events: int, batch: int) -> list[dict]:
    steps = []
    for b in nexmark.generate(events, seed=0, batch=batch):
        step = {}
        for name, t in b.items():
            buf = io.BytesIO()
            pa_csv.write_csv(t, buf, pa_csv.WriteOptions(include_header=False))
            step[name] = (buf.getvalue(), t.num_rows)
        steps.append(step)
    return steps


def parse(data: bytes, name: str) -> pa.Table:
    schema = nexmark.SCHEMAS[name]
    return pa_csv.read_csv(pa.BufferReader(data), read_options=pa_csv.ReadOptions(column_names=schema.names),
                           convert_options=pa_csv.ConvertOptions(column_types=schema, strings_can_be_null=False))


def run_query(query: str, workers: int, steps: list[dict], split: Split | None = None, cprofile: bool = False,
              perf: PerfRecorder | None = None) -> dict:
    """The timed loop over ``steps``; returns the measurements (and prints nothing)."""
    reads = flink_nexmark.READS.get(query, tuple(nexmark.SCHEMAS))
    p = dbsp.Pipeline(nexmark.circuit(query), workers=workers, executor=EmbeddedExecutor(background_merge=False))
    if query == "q13":
        p.push("side_input", nexmark.side_input())
    if split is not None:
        split.install(p)
    wall = dict.fromkeys(("read", "push", "step"), 0.0)
    cpu = dict.fromkeys(("read", "push", "step"), 0.0)
    sys_s = dict.fromkeys(("read", "push", "step"), 0.0)  # of cpu: system time (page faults mostly)
    minflt = dict.fromkeys(("read", "push", "step"), 0)
    events = 0
    prof = cProfile.Profile(time.process_time) if cprofile else None
    waited0 = 0.0
    if perf is not None:
        perf.start()
    cpu0 = time.process_time()
    if prof:
        prof.enable()
    mark = perf.mark if perf is not None else (lambda phase: None)
    for st in steps:
        mark("read")
        t0, c0, r0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        tables = [(name, parse(st[name][0], name)) for name in reads]
        mark("push")
        t1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        p.push_many(tables)
        mark("step")
        t2, c2, r2 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        if split is not None:
            split.active = True
        p.step()
        if split is not None:
            split.active = False
        t3, c3, r3 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        mark("between")
        for k, a, b in (("read", t0, t1), ("push", t1, t2), ("step", t2, t3)):
            wall[k] += b - a
        for k, a, b in (("read", c0, c1), ("push", c1, c2), ("step", c2, c3)):
            cpu[k] += b - a
        for k, a, b in (("read", r0, r1), ("push", r1, r2), ("step", r2, r3)):
            sys_s[k] += b.ru_stime - a.ru_stime
            minflt[k] += b.ru_minflt - a.ru_minflt
        waited0 += sum(p.executor._exchanger.waited) if p.executor._exchanger is not None else 0.0
        if p.executor._exchanger is not None:
            p.executor._exchanger.waited = [0.0] * len(p.executor._exchanger.waited)
        events += sum(n for _, n in st.values())
    if prof:
        prof.disable()
    total_cpu = time.process_time() - cpu0
    if perf is not None:
        perf.stop()
        tids = {t.native_id: ("driver + worker 0" if t is threading.main_thread() else "workers 1..W-1")
                for t in threading.enumerate() if t.native_id is not None}
    res = {"query": query, "workers": workers, "events": events, "events_s": events / sum(wall.values()),
           "wall": wall, "cpu": cpu, "sys": sys_s, "minflt": minflt, "cpu_total": total_cpu, "barrier_wait": waited0,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "arrow_pool": pa.default_memory_pool().backend_name,
           "load": os.getloadavg()[0], "profile": format_table(p.profile())}
    if split is not None:
        parts = dict(split.cpu)
        res["split"] = parts
        res["split_calls"] = split.calls
        res["executor"] = cpu["step"] - sum(parts.values())
    p.close()
    if prof:
        res["cprofile"] = prof
    if perf is not None:
        res["perf"] = perf.report(tids)
    return res


def summary_line(r: dict) -> str:
    w, c = r["wall"], r["cpu"]
    return (f"{r['query']} W={r['workers']}: {r['events_s']:,.0f} events/s; wall: parse {w['read']:.2f} s, push "
            f"{w['push']:.2f} s, step {w['step']:.2f} s; CPU {r['cpu_total']:.2f} s (parse {c['read']:.3f}, push "
            f"{c['push']:.3f}, step {c['step']:.3f}; of them system {sum(r['sys'].values()):.3f}, minor faults "
            f"{sum(r['minflt'].values()):,}); load average {r['load']:.1f}")


def split_lines(r: dict) -> list[str]:
    parts = r["split"]
    ops = sorted(((k[3:], v) for k, v in parts.items() if k.startswith("op:")), key=lambda kv: -kv[1])
    lines = [f"  step CPU {r['cpu']['step']:.3f} s = operators {sum(v for _, v in ops):.3f} ("
             + ", ".join(f"{k} {v:.3f}" for k, v in ops) + ")"]
    for k in ("exchange", "merges", "output", "rollback capture", "release memory"):
        lines.append(f"    + {k} {parts.get(k, 0.0):.3f}")
    lines.append(f"    + driver/executor (the rest) {r['executor']:.3f}   [{r['split_calls']} timed calls; "
                 f"barrier waits {r['barrier_wait']:.3f} s wall, all workers]")
    return lines


def perf_lines(rep: dict) -> list[str]:
    """perf's CPU seconds (samples / frequency) by thread, by phase and object, and the top symbols."""
    lines = ["  perf CPU s by thread: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                  sorted(rep["threads"].items(), key=lambda kv: -kv[1]))]
    for phase in ("read", "push", "step"):
        got = sorted(((k.split("|", 1)[1], v) for k, v in rep["by"].items() if k.startswith(phase + "|")),
                     key=lambda kv: -kv[1])
        lines.append(f"  perf CPU s in {phase} ({sum(v for _, v in got):.3f}): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in got if v >= 0.002))
    lines += [f"    {v:.3f} s  {phase:4s} {kind:22s} {sym}" for v, phase, kind, sym in rep["top"]]
    return lines


def table_rows(results: list[dict]) -> list[str]:
    """The markdown table of the split, one row per query (CPU seconds per 1M events, as measured)."""
    head = ("| query | events/s (wall) | CPU s | read (CSV parse) | push | operators (by class) | exchange | merges | "
            "output | driver/executor | step wall s, barrier waits s |")
    rows = [head, "|" + "---|" * head.count("|")[:-1] if False else "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in results:
        parts, c = r["split"], r["cpu"]
        ops = sorted(((k[3:], v) for k, v in parts.items() if k.startswith("op:") and v >= 0.0005),
                     key=lambda kv: -kv[1])
        opsum = sum(v for k, v in parts.items() if k.startswith("op:"))
        rest = r["executor"] + parts.get("rollback capture", 0.0) + parts.get("release memory", 0.0)
        rows.append(f"| {r['query']} | {r['events_s']:,.0f} | {r['cpu_total']:.2f} | {c['read']:.3f} | "
                    f"{c['push']:.3f} | {opsum:.3f}: " + ", ".join(f"{k} {v:.3f}" for k, v in ops[:5])
                    + (" ..." if len(ops) > 5 else "")
                    + f" | {parts.get('exchange', 0.0):.3f} | {parts.get('merges', 0.0):.3f} | "
                    f"{parts.get('output', 0.0):.3f} | {rest:.3f} | {r['wall']['step']:.2f}, "
                    f"{r['barrier_wait']:.2f} |")
    return rows


def perf_table_rows(results: list[dict]) -> list[str]:
    """The markdown table of perf's CPU seconds by phase and object, one row per query (``--perf``)."""
    rows = ["| query | read: all (Arrow / kernel) | push: all (kernel) | step: all | step: dbsp C kernels / Python "
            "interpreter / Arrow + numpy / libc / kernel | system CPU s, minor faults (getrusage) |",
            "|---|---|---|---|---|---|"]
    for r in results:
        by = r["perf"]["by"]

        def g(phase: str, kind: str | None = None) -> float:
            return sum(v for k, v in by.items() if k.startswith(phase + "|") and (kind is None or k.endswith("|" + kind)))
        rows.append(f"| {r['query']} | {g('read'):.3f} ({g('read', 'Arrow'):.3f} / {g('read', 'kernel'):.3f}) | "
                    f"{g('push'):.3f} ({g('push', 'kernel'):.3f}) | {g('step'):.3f} | {g('step', 'dbsp C kernels'):.3f} / "
                    f"{g('step', 'Python interpreter'):.3f} / {g('step', 'Arrow') + g('step', 'numpy'):.3f} / "
                    f"{g('step', 'libc (malloc/memcpy)'):.3f} / {g('step', 'kernel'):.3f} | "
                    f"{sum(r['sys'].values()):.3f}, {sum(r['minflt'].values()):,} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("query", nargs="?")
    ap.add_argument("--queries", help="comma-separated queries, or 'all' (every query with Flink SQL): one table, "
                                      "each query in a fresh child process")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--cprofile", action="store_true", help="also the 15 hottest functions by CPU time")
    ap.add_argument("--no-split", action="store_true", help="no per-part timers (the timed loop alone)")
    ap.add_argument("--perf", action="store_true", help="perf record of the timed loop: samples by object")
    ap.add_argument("--json", action="store_true", help="print one JSON line of the measurements")
    args = ap.parse_args()
    if args.queries:
        qs = FLINK_QUERIES if args.queries == "all" else tuple(args.queries.split(","))
        results = []
        for q in qs:
            cmd = [sys.executable, os.path.abspath(__file__), q, "--workers", str(args.workers), "--events",
                   str(args.events), "--batch", str(args.batch), "--json"] + (["--perf"] if args.perf else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results.append(r)
            print(summary_line(r), flush=True)
            for line in split_lines(r) + (perf_lines(r["perf"]) if "perf" in r else []):
                print(line, flush=True)
        print()
        print("\n".join(table_rows(results)))
        if args.perf:
            print()
            print("\n".join(perf_table_rows(results)))
        return
    if args.query not in nexmark.QUERIES:
        sys.exit(f"unknown query {args.query!r}: the queries are q0..q22")
    steps = make_steps(args.events, args.batch)
    split = None if args.no_split else Split()
    perf = PerfRecorder() if args.perf else None
    r = run_query(args.query, args.workers, steps, split, args.cprofile, perf)
    if args.json:
        r.pop("cprofile", None)
        print(json.dumps(r))
        return
    print(summary_line(r))
    if split is not None:
        print("\n".join(split_lines(r)))
    if perf is not None:
        print("\n".join(perf_lines(r["perf"])))
    print(r["profile"])
    if "cprofile" in r:
        pstats.Stats(r["cprofile"]).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
