"""Where a spilled pipeline's anonymous memory goes (issue 31): load and step one query of bench/bench_spill.py
under a budget, sampling RssAnon every 20 ms, then attribute RssAnon after the load and after the steps.

    python bench/probe_anon.py --state 10M --groups 10M --limit 100MiB --load-step 1M --steps 100 --queries join

Where a load step's peak is: ``--where N`` (N frames of every thread and the store's bytes at each load step's RssAnon
and RssFile peaks), ``--timeline FILE`` (every 20 ms of load steps 1-3: RssAnon, malloc in use and free, Arrow, the
spill thread's backlog, the main thread's frames), ``--trace N --trace-first`` (tracemalloc at the peaks, load step 1
included).

Attribution: the store's batches in memory and fences+filters (BatchStore.memory), the Arrow pool's bytes and
its peak, the C caches of this thread (scratch) and the process (regions), then what RssAnon drops by when the
caches of this thread are trimmed with glibc's malloc_trim(0), and when the Arrow pool releases its free pages.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import threading
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spill  # noqa: E402
from bench_scaling import _count  # noqa: E402

import pyarrow as pa  # noqa: E402

from dbsp_core import _zset  # noqa: E402

MiB = 2**20
_PHASE = {"name": "start", "peak": {}}


def anon() -> int:
    return bench_spill._rss_file("RssAnon")


def sampler(stop: threading.Event) -> None:
    """Every 20 ms: RssAnon, and at each phase's peak also glibc's bytes in use and the Arrow pool's (the rest:
    mapped regions of the C core (merge outputs), mimalloc's free pages, Python's small-object arenas)."""
    while not stop.wait(0.02):
        a = anon()
        rf = bench_spill._rss_file("RssFile")
        fp = _PHASE.setdefault("file_peak", {})
        if rf > fp.get(_PHASE["name"], 0):
            fp[_PHASE["name"]] = rf
            if _PHASE.get("where"):
                _PHASE.setdefault("file_where", {})[_PHASE["name"]] = where()
        tl = _PHASE.get("timeline")
        if tl is not None and _PHASE["name"] in ("load step 1", "load step 2", "load step 3"):
            main = sys._current_frames().get(threading.main_thread().ident)
            top = []
            while main is not None and len(top) < 3:
                top.append(f"{os.path.basename(main.f_code.co_filename)}:{main.f_lineno}:{main.f_code.co_name}")
                main = main.f_back
            store = _PHASE.get("store")
            tl.write(f"{time.perf_counter():.3f}\t{_PHASE['name']}\t{a / MiB:.0f}\t{malloc_in_use() / MiB:.0f}\t"
                     f"{malloc_free() / MiB:.0f}\t{pa.total_allocated_bytes() / MiB:.0f}\t"
                     f"{(store._queued if store is not None else 0) / MiB:.0f}\t{' <- '.join(top)}\n")
        pk = _PHASE["peak"]
        if a > pk.get(_PHASE["name"], 0):
            pk[_PHASE["name"]] = a
            _PHASE.setdefault("at", {})[_PHASE["name"]] = (a, malloc_in_use(), pa.total_allocated_bytes(),
                                                           malloc_free())
            if _PHASE.get("where"):
                _PHASE.setdefault("where_at", {})[_PHASE["name"]] = where()
            if (tracemalloc.is_tracing() and (_PHASE["name"] != "load step 1" or _PHASE.get("trace_first"))
                    and a > _PHASE.get("snap_at", 0) + 32 * MiB):
                _PHASE["snap_at"], _PHASE["snap"] = a, tracemalloc.take_snapshot()


def where() -> str:
    """What runs at a peak (``--where``): the top frames of every thread but this one, the spill thread's backlog,
    the region cache and the store's bytes in memory (read without the step's lock: a probe's view)."""
    me = threading.get_ident()
    out = []
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, fr in sys._current_frames().items():
        if ident == me:
            continue
        frames = []
        while fr is not None and len(frames) < _PHASE["where"]:
            frames.append(f"{os.path.basename(fr.f_code.co_filename)}:{fr.f_lineno}:{fr.f_code.co_name}")
            fr = fr.f_back
        if frames and not frames[0].startswith("threading.py"):
            out.append(f"      [{names.get(ident, ident)}] " + " <- ".join(frames))
    store = _PHASE.get("store")
    if store is not None:
        try:
            mem, fences = store.memory()
        except Exception:  # a trace changed under the probe
            mem, fences = -1, -1
        out.append(f"      store: in memory {mem / MiB:,.0f} MiB (fences+filters {fences / MiB:,.0f}), queued for the "
                   f"spill thread {store._queued / MiB:,.0f}, regions cached {_zset.cached_bytes()[1] / MiB:,.0f}")
    return "\n".join(out)


def _cpu() -> float:
    """CPU seconds of this process so far, all threads (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def at_peak(name: str) -> str:
    a, m, ar, fr = _PHASE.get("at", {}).get(name, (0, 0, 0, 0))
    return (f"peak RssAnon {a / MiB:,.0f} MiB: malloc in use {m / MiB:,.0f} (free in its arenas {fr / MiB:,.0f}), "
            f"Arrow allocated {ar / MiB:,.0f}, rest (C regions, allocators' free pages, Python arenas) "
            f"{(a - m - ar) / MiB:,.0f}")


def attribute(tag: str, p) -> None:
    store = p.executor.batch_store
    mem, fences = store.memory() if store is not None else (0, 0)
    pool = pa.default_memory_pool()
    scratch, regions = _zset.cached_bytes()
    a0 = anon()
    print(f"{tag}: RssAnon {a0 / MiB:,.0f} MiB; store: batches in memory {mem / MiB:,.0f}, fences+filters "
          f"{fences / MiB:,.0f}; Arrow ({pool.backend_name}) allocated {pa.total_allocated_bytes() / MiB:,.0f} "
          f"(peak {pool.max_memory() / MiB:,.0f}); C caches: scratch (main thread) {scratch / MiB:,.0f}, regions "
          f"{regions / MiB:,.0f}", flush=True)
    _zset.trim_caches(0)
    a1 = anon()
    ctypes.CDLL(None).malloc_trim(0)
    a2 = anon()
    pool.release_unused()
    a3 = anon()
    print("  " + anon_maps() + f"; malloc in use {malloc_in_use() / MiB:,.0f} MiB", flush=True)
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        traced = sum(s.size for s in snap.statistics("filename"))
        print(f"  traced (numpy arrays and Python objects) {traced / MiB:,.0f} MiB; largest:", flush=True)
        for st in snap.statistics("traceback")[:8]:
            print(f"    {st.size / MiB:,.1f} MiB in {st.count} blocks: " + " <- ".join(
                f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in reversed(st.traceback)), flush=True)
    print(f"  drops: C caches of this thread -{(a0 - a1) / MiB:,.0f}, malloc_trim(0) -{(a1 - a2) / MiB:,.0f}, "
          f"Arrow release_unused -{(a2 - a3) / MiB:,.0f} -> RssAnon {a3 / MiB:,.0f} MiB", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queries", default="join")
    ap.add_argument("--state", default="10M")
    ap.add_argument("--groups", default="10M")
    ap.add_argument("--limit", default="100MiB")
    ap.add_argument("--load-step", type=_count, default=1_000_000)
    ap.add_argument("--change", type=int, default=1000)
    ap.add_argument("--auctions-step", type=_count, default=0, help="as bench_spill.py's")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--trace", type=int, default=0, help="tracemalloc frames (0: off): who holds numpy arrays")
    ap.add_argument("--where", type=int, default=0, help="at each load step's peak, this many frames of each "
                    "thread's stack and the store's bytes (0: off)")
    ap.add_argument("--timeline", default="", help="a file: every 20 ms of load steps 1-3, RssAnon, malloc in use "
                    "and free, Arrow, the spill thread's backlog (MiB) and the main thread's top frames")
    ap.add_argument("--trace-first", action="store_true", help="tracemalloc's snapshots in load step 1 too")
    ap.add_argument("--pages-chunk", type=_count, default=0, help="BatchFile.pages_read's piece (0: as is; 1G: "
                    "one pass, as before the pieces)")
    args = ap.parse_args()
    if args.pages_chunk:
        import dbsp_core.trace.batchfile as bf
        bf.PAGES_CHUNK = args.pages_chunk
    if args.trace:
        tracemalloc.start(args.trace)
    _PHASE["where"] = args.where
    if args.timeline:
        _PHASE["timeline"] = open(args.timeline, "w")
        _PHASE["timeline"].write("t\tphase\tanon\tmalloc\tfree\tarrow\tqueued\tmain\n")
    _PHASE["trace_first"] = args.trace_first
    print(f"RssAnon at the start (Python, numpy, Arrow, the extension imported) {anon() / MiB:,.0f} MiB", flush=True)
    step = bench_spill.dbsp.Pipeline.step

    def counted_step(self, *a, **k):  # per load step: the sampler's phase is the step
        if _PHASE["name"].startswith("load"):
            n = _PHASE["load_steps"] = _PHASE.get("load_steps", 0) + 1
            _PHASE["name"] = f"load step {n}"
        _PHASE["store"] = self.executor.batch_store
        return step(self, *a, **k)

    bench_spill.dbsp.Pipeline.step = counted_step
    stop = threading.Event()
    th = threading.Thread(target=sampler, args=(stop,), daemon=True)
    th.start()
    for q in args.queries.split(","):
        state, groups = _count(args.state), _count(args.groups)
        _PHASE["name"] = "load"
        _PHASE["load_steps"] = 0
        t0, c0 = time.perf_counter(), _cpu()
        p, rng, loaded = bench_spill.load(q, state, groups, args, args.limit)
        cpu = _cpu() - c0
        lp = {k: v for k, v in _PHASE["peak"].items() if k.startswith("load step")}
        top = max(lp, key=lp.get)
        print(f"{q}: loaded in {time.perf_counter() - t0:.0f} s, CPU {cpu:.1f} s; peak RssAnon of the load "
              f"{max(lp.values()) / MiB:,.0f} MiB; during the load: at {top} (of "
              f"{_PHASE['load_steps']}) {at_peak(top)}; peak RssAnon of the steps after the first "
              f"{max(v for k, v in lp.items() if k != 'load step 1') / MiB:,.0f} MiB", flush=True)
        st = p.executor.batch_store
        if st is not None:  # the load's batch files written against those its state ends in (write amplification)
            print(f"{q}: the load wrote {st.stats['bytes_written'] / MiB:,.0f} MiB of batch files in "
                  f"{st.stats['files_written']} files, {st.disk_bytes() / MiB:,.0f} MiB on disk after it", flush=True)
        fp = _PHASE.get("file_peak", {})
        print(f"{q}: peak RssFile of load step 1 {fp.get('load step 1', 0) / MiB:,.0f} MiB, of the load steps after "
              f"it {max((v for k, v in fp.items() if k.startswith('load step') and k != 'load step 1'), default=0) / MiB:,.0f}"
              f" (the libraries' ~65 included)", flush=True)
        for k, w in sorted(_PHASE.get("file_where", {}).items()):
            if k.startswith("load step") and int(k.split()[-1]) <= 3:
                print(f"    at {k}'s RssFile peak ({fp[k] / MiB:,.0f} MiB):\n{w}", flush=True)
        for k in sorted(lp, key=lambda k: int(k.split()[-1])):
            print(f"    {k}: {at_peak(k)}", flush=True)
            if k in _PHASE.get("where_at", {}):
                print(_PHASE["where_at"][k], flush=True)
        if "snap" in _PHASE:
            print(f"  traced at the load's peak after its first step ({_PHASE['snap_at'] / MiB:,.0f} MiB RssAnon):",
                  flush=True)
            snap = _PHASE.pop("snap")
            print(f"    traced in all {sum(s.size for s in snap.statistics('filename')) / MiB:,.0f} MiB", flush=True)
            for st in snap.statistics("traceback")[:14]:
                print(f"    {st.size / MiB:,.1f} MiB in {st.count} blocks: " + " <- ".join(
                    f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in reversed(st.traceback)), flush=True)
        _PHASE["name"] = f"{q} after load"
        attribute(f"{q} after the load", p)
        _PHASE["name"] = f"{q} steps"
        for k in range(args.steps):
            bench_spill.one_step(p, rng, q, groups, args.change, loaded, k)
        p.executor.settle_merges()
        print(f"{q}: during the steps {at_peak(f'{q} steps')}", flush=True)
        attribute(f"{q} after {args.steps} steps", p)
        p.close()
    stop.set()
    return 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (mallinfo2: uordblks + hblkhd)."""
    f = ctypes.CDLL(None).mallinfo2
    f.restype = _Mallinfo2
    m = f()
    return m.uordblks + m.hblkhd


def malloc_free() -> int:
    """Bytes glibc's malloc holds free in its arenas (mallinfo2: fordblks; resident or not)."""
    f = ctypes.CDLL(None).mallinfo2
    f.restype = _Mallinfo2
    return f().fordblks


def anon_maps(top: int = 12) -> str:
    """The largest anonymous mappings (Anonymous: kB of /proc/self/smaps) with their size and name."""
    rows, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = [hi - lo, parts[5] if len(parts) > 5 else "[anon]", 0]
                rows.append(cur)
            elif parts[0] == "Anonymous:":
                cur[2] = int(parts[1]) * 1024
    rows.sort(key=lambda r: -r[2])
    tot = sum(r[2] for r in rows)
    small = sum(r[2] for r in rows if r[0] < 2 * MiB)
    return (f"anon total {tot / MiB:,.0f} MiB in {len(rows)} maps ({small / MiB:,.0f} in maps < 2 MiB); largest: "
            + ", ".join(f"{r[1]} {r[2] / MiB:,.0f}/{r[0] / MiB:,.0f}" for r in rows[:top]))


if __name__ == "__main__":
    raise SystemExit(main())
