"""Nexmark queries under a memory budget against the same engine without one: throughput ratio and peak RSS against the limit (issue 31's "Show").

Per query, two fresh child processes (each its own peak RSS), W=1, in memory (no storage), the events generated in
the child in ``--batch``-event steps (generation untimed; push + step timed):

1. "unlimited": no budget; after every step the bytes of every trace's batches (rows, weights, key hashes, row
   hashes: what a budget bounds, ``dbsp_core.trace.spill.batch_bytes``) are summed; the peak of that sum is the
   query's peak state.
2. "limited": ``memory_limit`` = ``--fraction`` (default 10%) of that peak state; the same events.

Printed and returned per run: events/s, the CPU seconds of push + step (process_time: every thread, user and
system; on a loaded machine they move less than the wall time, so their ratio is printed too), peak RSS
(ru_maxrss), the bytes the process wrote for the disk and those cancelled before write-back (/proc/self/io
write_bytes, cancelled_write_bytes: files deleted before the kernel wrote them), the RSS before the first push (interpreter, imports, the circuit: the baseline), the peak of the batches kept in memory plus the spilled files' fences and filters (the
budget's own accounting, sampled after each step), bytes on disk at the end, files written. The overhead stated
is peak RSS - limit: what the budget does not bound (baseline, the step's input and output batches, key indexes,
merge outputs being built, allocator slack).

``--breakdown``: a sampler thread in each child reads /proc/self/status every 5 ms and, at the peak RSS, records where
it is (anonymous and file-backed RSS; batches in memory, merge inputs in memory and merge outputs written in memory;
the Arrow pool; glibc's heap in use and free and its mapped blocks; the C region cache; file-backed RSS split into
the store's batch files, merge scratch files, key index files and other files, from /proc/self/smaps) and the
Python stack of the step at that moment. Sampling slows the run: read the memory, not the rates, of such runs.

Run:  python bench/bench_spill_nexmark.py --queries q4,q7,q9,q20 --events 5000000
      python bench/bench_spill_nexmark.py --queries q4 --events 200000   # a check that it runs
      python bench/bench_spill_nexmark.py --queries q20 --events 2000000 --limit 27.3 --breakdown  # limited only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20


def _status() -> dict:
    """VmRSS, RssAnon and RssFile of this process (bytes)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssFile")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _mallinfo() -> tuple[int, int, int]:
    """glibc's (heap bytes in use, heap bytes free, bytes in mmapped blocks), or zeros without mallinfo2."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
        return m.uordblks, m.fordblks, m.hblkhd
    except (OSError, AttributeError):
        return 0, 0, 0


def _file_rss(directory: str | None) -> dict:
    """File-backed RSS by what the files are (/proc/self/smaps, bytes): the batch files of the store's directory, its
    merge scratch files, its other files (key indexes: unlinked temporary files), and every other file (libraries)."""
    out = {"rss_batch_files": 0, "rss_merge_scratch": 0, "rss_index_files": 0, "rss_other_files": 0}
    kind = None
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's header line
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
                if not path.startswith("/"):
                    kind = None  # anonymous, heap, stack: not file-backed
                elif directory and path.startswith(directory + "/"):
                    name = os.path.basename(path.replace(" (deleted)", ""))
                    kind = ("rss_batch_files" if name.endswith(".batch") else
                            "rss_merge_scratch" if name.startswith("merge-") else "rss_index_files")
                else:
                    kind = "rss_other_files"
            elif kind is not None and line.startswith("Rss:"):
                out[kind] += int(line.split()[1]) * 1024
    return out


class _Sampler:
    """The breakdown at the peak RSS of a run (``--breakdown``), sampled from a thread every 5 ms."""

    def __init__(self, ex) -> None:
        import threading

        self.ex, self.peak, self.stop, self.main = ex, {"VmRSS": 0}, False, threading.get_ident()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop:
            s = _status()
            if s["VmRSS"] > self.peak["VmRSS"]:
                try:
                    s.update(self._parts())
                except Exception as exc:  # the step changed the levels under the scan: take the next sample
                    s["error"] = repr(exc)
                self.peak = s
            time.sleep(0.005)

    def _parts(self) -> dict:
        import traceback

        import pyarrow as pa

        from dbsp_core import _zset
        from dbsp_core.trace.spill import batch_bytes, merge_bytes

        store = self.ex.batch_store
        mem = lambda b: 0 if store is not None and store.is_spilled(b) else batch_bytes(b)  # noqa: E731
        loose = merge_in = merge_out = kix = 0
        for t in self.ex._all_traces():
            kix += t.index_bytes
            for level in list(t._by_level):
                loose += sum(mem(e[1]) for e in level.loose)
                if level.merge is not None:
                    merge_in += sum(mem(e[1]) for e in level.merge.inputs)
                    merge_out += merge_bytes(level.merge)
            loose += sum(mem(b) for b in t.pending)
        heap, free, mapped = _mallinfo()
        frame = sys._current_frames().get(self.main)
        stack = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack(frame)][-6:]
        files = _file_rss(store.directory if store is not None else None)
        return {**files, "batches_in_memory": loose, "merge_inputs_in_memory": merge_in,
                "merge_outputs_in_memory": merge_out,
                "key_indexes": kix, "arrow_pool": pa.total_allocated_bytes(), "malloc_in_use": heap, "malloc_free": free,
                "malloc_mapped": mapped, "region_cache": _zset.cached_bytes()[1], "stack": stack}


def _io() -> dict:
    """This process's /proc/self/io counters (bytes it caused to be written to storage, and those cancelled by a
    truncate or unlink before write-back)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k] = int(v)
    except OSError:
        pass
    return out


def child(query: str, events: int, batch: int, limit: int | None, seed: int, breakdown: bool = False) -> dict:
    import dbsp_core as dbsp
    from dbsp_core import nexmark
    from dbsp_core.metrics import rss_bytes
    from dbsp_core.runtime.embedded import EmbeddedExecutor
    from dbsp_core.trace.spill import batch_bytes

    next(nexmark.generate(1, seed=seed))  # the generator's string pools, drawn once per process
    ex = EmbeddedExecutor(background_merge=False)
    p = dbsp.Pipeline(nexmark.circuit(query), executor=ex, memory_limit=limit)
    base = rss_bytes() or 0
    io0 = _io()
    sampler = _Sampler(ex) if breakdown else None
    seconds, cpu, peak_state, peak_budgeted, steps = 0.0, 0.0, 0, 0, 0
    try:
        for b in nexmark.generate(events, seed=seed, batch=batch):
            t0, c0 = time.perf_counter(), time.process_time()
            for name, t in b.items():
                p.push(name, t)
            p.step()
            seconds += time.perf_counter() - t0
            cpu += time.process_time() - c0
            steps += 1
            store = ex.batch_store
            if store is None:
                state = sum(batch_bytes(x) for t in ex._all_traces() for x in t._levels() + t.pending)
                peak_state = max(peak_state, state)
            else:
                mem, kept = store.memory()
                peak_budgeted = max(peak_budgeted, mem + kept)
        out = {"query": query, "events": events, "steps": steps, "seconds": seconds, "cpu_seconds": cpu, "limit": limit,
               "base_rss": base, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "peak_state": peak_state, "peak_budgeted": peak_budgeted}
        io1 = _io()
        out["io_write_bytes"] = io1.get("write_bytes", 0) - io0.get("write_bytes", 0)
        out["io_cancelled_bytes"] = io1.get("cancelled_write_bytes", 0) - io0.get("cancelled_write_bytes", 0)
        if sampler is not None:
            sampler.stop = True
            sampler.thread.join()
            out["breakdown"] = sampler.peak
        store = ex.batch_store
        if store is not None:
            out.update(disk=store.disk_bytes(), merges_on_disk=store.stats.get("merges_on_disk", 0), files_written=store.stats["files_written"],
                       bytes_written=store.stats["bytes_written"], evictions=store.stats["evictions"],
                       # of which merge outputs written on disk (in place, or copied), the rest batches spilled whole
                       bytes_in_place=store.stats.get("bytes_in_place", 0),
                       merge_inputs_on_disk=store.stats.get("merge_inputs_on_disk", 0))
    finally:
        p.close()
    return out


def run(query: str, events: int, batch: int, limit: int | None, seed: int, breakdown: bool = False) -> dict:
    arg = json.dumps({"query": query, "events": events, "batch": batch, "limit": limit, "seed": seed,
                      "breakdown": breakdown})
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arg], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{query} limit={limit} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", default="q4,q7,q9,q20")
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--batch", type=int, default=100_000, help="events per step")
    ap.add_argument("--fraction", type=float, default=0.10, help="memory_limit as a fraction of the peak state")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--breakdown", action="store_true", help="record what RSS holds at its peak (slows the run)")
    ap.add_argument("--limit", type=float, default=None,
                    help="MiB: run only the limited child at this memory_limit (no unlimited run, no ratio)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        a = json.loads(args.child)
        print(json.dumps(child(a["query"], a["events"], a["batch"], a["limit"], a["seed"], a["breakdown"])))
        return 0
    print(f"{args.events:,} events in steps of {args.batch:,}, W=1, limit {args.fraction:.0%} of the unlimited "
          f"run's peak state; load {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for q in args.queries.split(","):
        if args.limit is not None:  # the limited run alone, e.g. to read its breakdown again
            lim = run(q, args.events, args.batch, int(args.limit * MIB), args.seed, args.breakdown)
            rows.append({"query": q, "limited": lim})
            print(f"{q}: limit {args.limit:,.1f} MiB: {lim['events'] / lim['seconds']:,.0f} ev/s, peak RSS "
                  f"{lim['peak_rss'] / MIB:,.0f} MiB (baseline {lim['base_rss'] / MIB:,.0f}; over the limit "
                  f"{(lim['peak_rss'] - lim['limit']) / MIB:,.0f})", flush=True)
            _print_breakdown({"limited": lim})
            continue
        free = run(q, args.events, args.batch, None, args.seed, args.breakdown)
        limit = max(1 * MIB, int(free["peak_state"] * args.fraction))
        lim = run(q, args.events, args.batch, limit, args.seed, args.breakdown)
        r_free, r_lim = free["events"] / free["seconds"], lim["events"] / lim["seconds"]
        row = {"query": q, "free": free, "limited": lim}
        rows.append(row)
        print(f"{q}: unlimited {r_free:,.0f} ev/s, peak state {free['peak_state'] / MIB:,.0f} MiB, peak RSS "
              f"{free['peak_rss'] / MIB:,.0f} MiB (baseline {free['base_rss'] / MIB:,.0f}) | limit "
              f"{limit / MIB:,.1f} MiB: {r_lim:,.0f} ev/s = {r_lim / r_free:.2f}x (CPU seconds "
              f"{free['cpu_seconds']:,.1f} -> {lim['cpu_seconds']:,.1f}: "
              f"{free['cpu_seconds'] / lim['cpu_seconds']:.2f}x), peak RSS "
              f"{lim['peak_rss'] / MIB:,.0f} MiB (baseline {lim['base_rss'] / MIB:,.0f}; over the limit "
              f"{(lim['peak_rss'] - limit) / MIB:,.0f}), budgeted peak {lim['peak_budgeted'] / MIB:,.1f} MiB, "
              f"on disk {lim.get('disk', 0) / MIB:,.0f} MiB, written {lim.get('bytes_written', 0) / MIB:,.0f} MiB "
              f"in {lim.get('files_written', 0)} files ({lim.get('bytes_in_place', 0) / MIB:,.0f} MiB of it merge outputs "
              f"in place), {lim.get('merges_on_disk', 0)} merges on disk; process wrote "
              f"{lim.get('io_write_bytes', 0) / MIB:,.0f} MiB (cancelled {lim.get('io_cancelled_bytes', 0) / MIB:,.0f}); load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        _print_breakdown({"unlimited": free, "limited": lim})
    print(json.dumps(rows))
    return 0


def _print_breakdown(runs: dict) -> None:
    for name, r in runs.items():
        if "breakdown" in r:
            b = r["breakdown"]
            print(f"  {name} at peak RSS: " + ", ".join(
                f"{k} {v / MIB:,.0f}" for k, v in b.items() if isinstance(v, int)) + " MiB; in "
                + " > ".join(b.get("stack", [])), flush=True)


if __name__ == "__main__":
    sys.exit(main())
