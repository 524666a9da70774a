"""Spilled against in-memory state: 1k-row steps into distinct, join and group-by over a multi-million-row state held in memory, then with a memory budget that puts the state's big batches in batch files, with the pages a step reads from them.

Run from the repository root:

    python bench/bench_spill.py                                    # 2M rows, budget 16MiB, 200 steps per query
    python bench/bench_spill.py --state 5M --groups 500k --limit 32MiB --queries join
    python bench/bench_spill.py --state 200k --groups 20k --steps 20  # a check that it runs
    python bench/bench_spill.py --state 10M --groups 1M --limit 1GiB --runs 2   # the issue's budget, alternated
    python bench/bench_spill.py --state 10M --groups 10M --limit 100MiB --load-step 1M --prefetch off,on,off,on

Per query, two pipelines (W=1, no storage) load ``--state`` bids in ``--load-step``-row steps (as
bench/bench_scaling.py: ``--groups`` keys), settle their merges and then run ``--warmup`` + ``--steps`` steps of
``--change`` rows (90% new bids, 10% deletions of loaded ones), timed with perf_counter around push and step:
"memory" without a budget, "spilled" with ``memory_limit=--limit``. For the spilled one, ``--cold`` more steps
each start with every batch file's pages out of the process and out of the page cache (madvise and fadvise
DONTNEED after a sync), and count after the step the pages of the files that are resident again (mincore(2)):
the pages the step read from disk (the mappings are MADV_RANDOM, so no read-ahead is counted). The key indexes
(trace invariant 11) answer distinct's and the group-by's lookups from memory; ``DBSP_KEY_INDEX=0`` in the
environment turns them off so those steps read the batches (what the Bloom filter and fences are for).
With a budget, ``--prefetch`` (auto, on, off, or alternated as ``off,on,off,on``) sets ``BatchStore.PREFETCH`` for
one phase of measured and cold steps each, over the same loaded state: whether a step first starts reading the pages
its keys will read of spilled batches (madvise WILLNEED; counted as pages prefetched and runs) or faults them one at a
time ("auto", the default: prefetch after a step that read pages from the disk), so the settings compare on the same
files; the cold steps' major faults are the pages the walks still waited for. ``--runs N`` alternates the two pipelines N times (memory, spilled, memory, ...) and prints each run and the
spread (lowest-highest) of the means and p99s; the spilled line also shows how many batches the store wrote off the
step (its spill thread) and how many of those were merged away before they were switched.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_scaling import AUCTIONS, _count, bids, circuit  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.envvars import settings  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402
from dbsp_core.trace.spill import BatchStore  # noqa: E402
from dbsp_core.trace import Trace, groupedbatch, spillread  # noqa: E402
from dbsp_core.envvars import parse_memory_limit  # noqa: E402

_COPIES0 = [0]  # groupedbatch.COPIES["reads"] when the spilled run started

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(m: mmap.mmap) -> int:
    """Pages of the mapping ``m`` resident in memory (mincore(2): the page cache's view of the file)."""
    n = len(m)
    if n == 0:
        return 0
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    pages = (n + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum())


def drop_pages(store) -> None:
    """Every batch file's pages out of this process and out of the page cache (clean: synced first)."""
    os.sync()
    for f in list(store._files.values()) + list(store._grouped.values()):  # (format 2: no mapping, invariant 18)
        if getattr(f, "map", None) is not None:
            f.map.madvise(mmap.MADV_DONTNEED)
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(query: str, state: int, groups: int, args, limit, **pipeline: object) -> tuple[dbsp.Pipeline, np.random.Generator, list]:
    """A pipeline of ``query`` with ``state`` bids loaded and its merges settled, the generator of the steps' rows
    after it and the loaded rows a step deletes from; ``pipeline``: more of the Pipeline's arguments (bench/
    spill_state.py's storage directory)."""
    rng = np.random.default_rng(7)
    _PEAK.update(load_file=0, load_anon=0)
    t0 = time.perf_counter()
    p = dbsp.Pipeline(circuit(query), executor=EmbeddedExecutor(background_merge=True), memory_limit=limit, **pipeline)
    if query == "join":
        import pyarrow as pa
        piece = getattr(args, "auctions_step", 0) or groups  # all in the first step, as before, unless in pieces
        for lo in range(0, groups, piece):
            ids = np.arange(lo, min(lo + piece, groups))
            p.push("auctions", pa.table({"id": ids, "category": ids % 50}, schema=AUCTIONS))
            del ids  # the pipeline holds the pushed table until its step; kept here, 8 B a loaded auction (763 MiB
            # at 100M) stayed in RssAnon through every load step after it
            if lo + piece < groups:
                p.step()
    loaded = []
    done = 0
    while done < state:
        n = min(args.load_step, state - done)
        t = bids(rng, n, query, groups)
        # a copy: a slice would keep the whole step's buffers (24 B a loaded row: 2.3 GiB of RssAnon at 100M rows)
        loaded.append(t.take(np.arange(min(n, 10_000))))
        p.push("bids", t)
        p.step()
        _PEAK["load_file"] = max(_PEAK.get("load_file", 0), _rss_file())
        _PEAK["load_anon"] = max(_PEAK.get("load_anon", 0), _rss_file("RssAnon"))
        done += n
        if done * 10 // state != (done - n) * 10 // state:  # a line per tenth of the load
            store = p.executor.batch_store
            disk = f", {store.disk_bytes() / 2**20:.0f} MiB on disk" if store is not None else ""
            print(f"  {query} {'spilled' if limit else 'memory'}: loaded {done:,} rows in "
                  f"{time.perf_counter() - t0:.0f} s{disk}", file=sys.stderr, flush=True)
    p.executor.settle_merges()
    p.push("bids", bids(rng, 1, query, groups))
    p.step()  # installs the settled merges; the store (if any) spills the merged batches after it
    p.executor.settle_merges()  # and its spill thread has written them before the measured steps
    return p, rng, loaded


def one_step(p: dbsp.Pipeline, rng, query: str, groups: int, change: int, loaded: list, k: int,
             outputs: list | None = None) -> float:
    """Step ``k``: ``change`` rows, 90% new bids and 10% deletions of ``loaded`` ones; its wall time in ms (its
    output appended to ``outputs`` when given, outside the time)."""
    from dbsp_core import ZSet

    dels = change // 10
    src = loaded[k % len(loaded)]
    gone = src.slice((k * dels) % max(1, src.num_rows - dels), dels)
    t0, c0 = time.perf_counter(), time.thread_time()
    p.push("bids", bids(rng, change - dels, query, groups))
    p.push("bids", ZSet.from_arrow(gone, weights=np.full(gone.num_rows, -1, dtype=np.int64)))
    out = p.step()
    _STEP_CPU.append((time.thread_time() - c0) * 1e3)
    ms = (time.perf_counter() - t0) * 1e3
    if outputs is not None:
        outputs.append(out)
    return ms


_STEP_CPU: list[float] = []  # the stepping thread's CPU per step, ms (thread_time: W=1 steps and enforces on it)


def run(query: str, state: int, groups: int, args, limit) -> list[dict] | None:
    """Load one pipeline and measure its steps: one phase in memory; with a budget, one phase per ``--prefetch``
    setting (alternated over the same loaded state: "off,on,off,on")."""
    if ("spilled" if limit else "memory") not in args.modes.split(","):
        return None
    t0 = time.perf_counter()
    p, rng, loaded = load(query, state, groups, args, limit)
    load_s = time.perf_counter() - t0
    store = p.executor.batch_store
    phases = args.prefetch.split(",") if store is not None else ["-"]
    out, k = [], 0
    walks = args.walk.split(",") if store is not None else ["-"]
    for prefetch in phases:
        for walk in walks:
            if store is not None:
                BatchStore.PREFETCH = prefetch
            if walk != "-":  # branch r31-walk's batched narrowed take and evictions (new) or a batch at a time (old)
                spillread.NATIVE = walk == "new"
            r, k = measure(p, rng, query, groups, args, loaded, k)
            r.update(load_s=load_s, prefetch=prefetch if walk == "-" else f"{prefetch} walk {walk}")
            out.append(r)
    if store is not None:
        for i, t in enumerate(p.executor._all_traces()):  # the files a lookup may touch: per trace, its batches and the spilled ones
            bs = t._levels()
            print(f"  {query} trace {i} (key {list(t.key)}): {len(bs)} batches ({sum(len(b) for b in bs):,} rows), "
                  f"{sum(1 for b in bs if store.is_spilled(b))} spilled, levels {[lv for lv, _, _ in t.levels()]}",
                  flush=True)
    p.close()
    return out


def _perf_ctl(cmd: str) -> None:
    """Tells a ``perf record --control fifo:CTL,ACK -D -1`` (or ``perf stat``) around this process to start or stop
    counting: BENCH_PERF_CTL=CTL,ACK, so a profile holds the measured steps only."""
    ctl = os.environ.get("BENCH_PERF_CTL")
    if not ctl:
        return
    c, a = ctl.split(",")
    with open(c, "w") as f:
        f.write(cmd + "\n")
    with open(a) as f:
        f.readline()


def measure(p: dbsp.Pipeline, rng, query: str, groups: int, args, loaded: list, k: int) -> tuple[dict, int]:
    """``--warmup`` then ``--steps`` measured steps, then ``--cold`` steps each after every file's pages left the page
    cache; returns the figures and the next step number."""
    ms = []
    store = p.executor.batch_store
    steady = 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # the measured steps' page faults, disk reads and cache counts
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            _STEP_CPU.clear()
            st0 = dict(store.stats) if store is not None else {}
            _PEAK["in_step"] = 0
            _perf_ctl("enable")
        x = one_step(p, rng, query, groups, args.change, loaded, k)
        k += 1
        if i >= args.warmup:
            ms.append(x)
            steady = max(steady, _rss_file())  # after the step (its enforce done): outside its time
    _perf_ctl("disable")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = _STEP_CPU[-args.steps:]
    out = {"cpu_mean": float(np.mean(cpu)), "cpu_p99": float(np.percentile(cpu, 99)), "mean": float(np.mean(ms)), "p50": float(np.percentile(ms, 50)),
           "p99": float(np.percentile(ms, 99)), "max": float(np.max(ms)),
           "majflt": (ru.ru_majflt - ru0.ru_majflt) / args.steps, "minflt": (ru.ru_minflt - ru0.ru_minflt) / args.steps,
           "read_kib": (ru.ru_inblock - ru0.ru_inblock) * 512 / 1024 / args.steps,  # from disk, not the page cache
           # CPU time of the process per measured step, every thread (the merge and spill threads too), user and
           # system (the kernel's faults and evictions): steadier than wall time on a loaded host
           "user": (ru.ru_utime - ru0.ru_utime) * 1e3 / args.steps,
           "sys": (ru.ru_stime - ru0.ru_stime) * 1e3 / args.steps}
    out["rss_file_mb"] = _rss_file() / 2**20  # the files' pages mapped now (and any other file's: the libraries')
    out.update(rss_file_steady_mb=steady / 2**20, rss_file_in_step_mb=_PEAK["in_step"] / 2**20,
               rss_anon_mb=_rss_file("RssAnon") / 2**20, load_file_mb=_PEAK["load_file"] / 2**20,
               load_anon_mb=_PEAK["load_anon"] / 2**20)
    if store is not None:
        d = {n: store.stats.get(n, 0) - st0.get(n, 0) for n in ("cache_hits", "cache_misses", "evictions",
                                                               "bytes_evicted", "pages_prefetched", "prefetch_runs",
                                                               "keys_sought", "grouped_lookups",
                                                               "grouped_prefetched", "grouped_map_backoffs")}
        out.update(hits=d["cache_hits"] / args.steps, misses=d["cache_misses"] / args.steps,
                   evicted_kib=d["bytes_evicted"] / 1024 / args.steps, cached_mb=store.cached_pages() * PAGE / 2**20,
                   prefetched=d["pages_prefetched"] / args.steps, runs=d["prefetch_runs"] / args.steps,
                   # format 2's (spill.py invariant 18): lookups, those made as cold (pread and fadvise, no mapping:
                   # the last step read from the disk) and mappings the bound dropped into back-off, a step
                   g_lookups=d["grouped_lookups"] / args.steps, g_cold=d["grouped_prefetched"] / args.steps,
                   g_backoffs=d["grouped_map_backoffs"] / args.steps)
        mem, kept = store.memory()
        out.update(disk_mb=store.disk_bytes() / 2**20, mem_mb=mem / 2**20, kept_mb=kept / 2**20,
                   files=len(store._files) + len(store._grouped),
                   grouped_files=len(store._grouped), copies=groupedbatch.COPIES["reads"] - _COPIES0[0],
                   spilled_rows=sum(f.rows for f in list(store._files.values()) + list(store._grouped.values())),
                   background=store.stats.get("written_in_background", 0),
                   wasted=store.stats.get("written_for_nothing", 0),
                   written_mb=store.stats["bytes_written"] / 2**20, sought=d["keys_sought"] / args.steps,
                   # a read of some keys asks each spilled batch's Bloom filter for every key: about (change keys) x
                   # (spilled batches of the traces the step reads) probes a step
                   spilled_batches=sum(1 for t in p.executor._all_traces() for b in t._levels() if store.is_spilled(b)))
        if args.profile:
            import cProfile
            import pstats
            pr = cProfile.Profile(time.thread_time)  # CPU of the stepping thread: a loaded host's preemption not counted
            pr.enable()
            for _ in range(args.profile):
                one_step(p, rng, query, groups, args.change, loaded, k)
                k += 1
            pr.disable()
            print(f"  {query} {'spilled' if store is not None else 'memory'}: cProfile of {args.profile} steps", flush=True)
            st = pstats.Stats(pr).sort_stats(os.environ.get("BENCH_PROFILE_SORT", "tottime"))
            st.print_stats(int(os.environ.get("BENCH_PROFILE_LINES", "22")))
            if os.environ.get("BENCH_PROFILE_CALLERS"):  # the callers of these functions (a regular expression)
                st.print_callers(os.environ["BENCH_PROFILE_CALLERS"])
        pages, cold, majflt, fetched = [], [], [], []
        for _ in range(args.cold):
            drop_pages(store)
            files = list(store._files.values())
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            p0 = store.stats.get("pages_prefetched", 0)
            cold.append(one_step(p, rng, query, groups, args.change, loaded, k))
            k += 1
            majflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0)
            fetched.append(store.stats.get("pages_prefetched", 0) - p0)
            pages.append(sum(resident_pages(f.map) for f in files))  # (format 1's only)
        if pages:
            out.update(cold_mean=float(np.mean(cold)), cold_p99=float(np.percentile(cold, 99)),
                       cold_max=float(np.max(cold)), pages=float(np.mean(pages)), pages_max=int(np.max(pages)),
                       cold_majflt=float(np.mean(majflt)), cold_prefetched=float(np.mean(fetched)))
    return out, k


def no_compaction() -> None:
    """The spilled levels' compaction off in this process (``Trace.start_compaction`` and ``compact_spilled`` do
    nothing): steps read every file of the tiered levels (``--no-compaction`` of the spill benchmarks)."""
    Trace.start_compaction = lambda self, thread=None: 0
    Trace.compact_spilled = lambda self, since=0: 0


def _rss_file(field: str = "RssFile") -> int:
    """Bytes of file-backed pages mapped into the process (``field`` of /proc/self/status, RssAnon for anonymous
    memory; 0 where absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_PEAK = {"in_step": 0}  # the highest RssFile at the start of an enforce (a step's reads done, before its evictions)


def _watch_enforce() -> None:
    """Sample RssFile as each ``BatchStore.enforce`` starts (a read of /proc/self/status, ~20 us, in the step's
    time): the peak within the steps, which the figures after each step do not see."""
    orig = BatchStore.enforce
    if getattr(orig, "_watched", False):
        return

    def enforce(self):  # type: ignore[no-untyped-def]
        _PEAK["in_step"] = max(_PEAK["in_step"], _rss_file())
        return orig(self)

    enforce._watched = True  # type: ignore[attr-defined]
    BatchStore.enforce = enforce  # type: ignore[method-assign]


def _watch_pieces() -> None:
    """Sample RssFile before each piece of a walk drops its batch's mapping (``BatchStore.walked_out``, where the
    tree has it): the peak within a step walked in pieces. A read of /proc/self/status per piece: the steps' time
    and CPU are not the figures to read in such a run."""
    orig = getattr(BatchStore, "walked_out", None)
    if orig is None:
        return

    def walked_out(self, b):  # type: ignore[no-untyped-def]
        _PEAK["in_step"] = max(_PEAK["in_step"], _rss_file())
        return orig(self, b)

    BatchStore.walked_out = walked_out  # type: ignore[method-assign]


def show(tag: str, sp: dict, mem: dict | None, args) -> None:
    """Print one spilled phase: its step times (and their ratio to the in-memory run's), files, cache and pages."""
    ratio = (f" = {sp['mean'] / mem['mean']:.2f}x mean, {sp['p99'] / mem['p99']:.2f}x p99, "
             f"{(sp['user'] + sp['sys']) / max(1e-9, mem['user'] + mem['sys']):.2f}x CPU") if mem is not None else ""
    print(f"{tag} spilled: mean {sp['mean']:.2f} ms p50 {sp['p50']:.2f} p99 {sp['p99']:.2f} "
          f"max {sp['max']:.2f} (load {sp['load_s']:.1f} s){ratio}; on disk "
          f"{sp['disk_mb']:.1f} MiB in {sp['files']} files ({sp['grouped_files']} of format 2; {sp['copies']} whole "
          f"reads of them since the load) ({sp['spilled_rows']:,} rows), batches in memory "
          f"{sp['mem_mb']:.1f} MiB, fences+filters {sp['kept_mb']:.1f} MiB; written {sp['written_mb']:.0f} MiB, "
          f"{sp['background']} files off the step ({sp['wasted']} more merged away first)", flush=True)
    print(f"{tag} per step: cache hits {sp['hits']:.0f} misses {sp['misses']:.0f} pages, evicted "
          f"{sp['evicted_kib']:.0f} KiB, cache {sp['cached_mb']:.1f} MiB; prefetched {sp['prefetched']:.0f} pages "
          f"in {sp['runs']:.0f} runs; format-2 lookups {sp['g_lookups']:.1f} ({sp['g_cold']:.1f} as cold, "
          f"{sp['g_backoffs']:.2f} mappings backed off); major faults {sp['majflt']:.1f}, minor {sp['minflt']:.0f}, read from disk "
          f"{sp['read_kib']:.0f} KiB; CPU {sp['user'] + sp['sys']:.2f} ms (user {sp['user']:.2f}, sys {sp['sys']:.2f}); "
          f"stepping thread CPU mean {sp['cpu_mean']:.2f} p99 {sp['cpu_p99']:.2f} ms; "
          f"RssFile after the steps {sp['rss_file_mb']:.0f} MiB; {sp['spilled_batches']} spilled batches, keys sought "
          f"in them after their filters {sp['sought']:.0f} a step", flush=True)
    print(f"{tag} RSS: RssFile after each step at most {sp['rss_file_steady_mb']:.0f} MiB, at an enforce's start (the "
          f"step's reads done) at most {sp['rss_file_in_step_mb']:.0f} MiB; RssAnon after the steps "
          f"{sp['rss_anon_mb']:.0f} MiB; during the load at most RssFile {sp['load_file_mb']:.0f} MiB, RssAnon "
          f"{sp['load_anon_mb']:.0f} MiB (after each load step)", flush=True)
    if "pages" in sp:
        print(f"{tag} cold   : mean {sp['cold_mean']:.2f} ms p99 {sp['cold_p99']:.2f} max {sp['cold_max']:.2f}; "
              f"pages read per step {sp['pages']:.0f} (max {sp['pages_max']}) = {sp['pages'] * PAGE / 2**10:.0f} KiB, "
              f"prefetched {sp['cold_prefetched']:.0f}, major faults {sp['cold_majflt']:.0f}; "
              f"{sp['pages'] / args.change:.2f} pages per changed row", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queries", default="distinct,join,group_by")
    ap.add_argument("--state", default="2M")
    ap.add_argument("--groups", default="200k")
    ap.add_argument("--limit", default="16MiB", help="memory_limit of the spilled run")
    ap.add_argument("--load-step", type=_count, default=200_000)
    ap.add_argument("--change", type=int, default=1000)
    ap.add_argument("--auctions-step", type=_count, default=0, help="a join's auctions pushed in steps of this many "
                    "rows (0: all with the first load step; a step's working memory follows its rows)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cold", type=int, default=20, help="steps measured with the files' pages dropped first")
    ap.add_argument("--runs", type=int, default=1, help="alternated memory/spilled runs per query")
    ap.add_argument("--walk", default="-", help="the spilled pipeline's phases (within each --prefetch phase) over "
                    "its loaded state, alternated as old,new,old,new: spillread.NATIVE (DBSP_SPILL_NATIVE) "
                    "off (old: the reference path, a take, a numpy Bloom test and a madvise or three a spilled batch) "
                    "or on (new); -: as it is")
    ap.add_argument("--prefetch", default="auto", help="the spilled pipeline's phases over its loaded state, each "
                    "with --steps and --cold steps: auto, on, off, or alternated (off,on,...): BatchStore.PREFETCH")
    ap.add_argument("--grouped", default="-", help="the spilled runs, alternated within each --runs round: "
                    "BatchStore.GROUPED_FROM (DBSP_SPILL_GROUPED) for each, e.g. off,1 (format 1 only, then every "
                    "spilled file in format 2) or off,64MiB; -: as the environment says")
    ap.add_argument("--modes", default="memory,spilled", help="which pipelines run (a state too big for memory: "
                    "spilled only)")
    ap.add_argument("--profile", type=int, default=0, help="after the measured steps, this many more under cProfile "
                    "(the stepping thread's CPU; its top functions by own time printed; the measured figures are taken before)")
    ap.add_argument("--watch-pieces", action="store_true", help="also sample RssFile before each piece of a walk "
                    "drops its mapping (the peak within a step; costs the steps a /proc read per piece)")
    ap.add_argument("--no-compaction", action="store_true", help="the spilled levels' compaction off (Trace."
                    "start_compaction and compact_spilled do nothing): the steps before a compaction installs, reading "
                    "every file of the tiered levels (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-open (c) and r31-batched)")
    args = ap.parse_args()
    if args.no_compaction:
        no_compaction()
    _watch_enforce()
    if args.watch_pieces:
        _watch_pieces()
    state, groups = _count(args.state), _count(args.groups)
    print(f"state {state:,} rows, {groups:,} keys, {args.change}-row steps, limit {args.limit}, "
          f"key indexes {'on' if settings().key_index else 'off'}, load {os.getloadavg()[0]:.2f}", flush=True)
    for q in args.queries.split(","):
        mems, sps = [], []
        for r in range(args.runs):
            mem = run(q, state, groups, args, None)
            phases = []
            for g in args.grouped.split(","):
                if g != "-":
                    BatchStore.GROUPED_FROM = None if g == "off" else _count(g) if g[-1:].isdigit() else \
                        parse_memory_limit(g)
                _COPIES0[0] = groupedbatch.COPIES["reads"]
                for sp in run(q, state, groups, args, args.limit) or []:
                    sp["prefetch"] += f" grouped {g}" if g != "-" else ""
                    phases.append(sp)
            mem = mem[0] if mem else None
            mems.append(mem)
            tag = f"{q:9s}" + (f" run {r + 1}" if args.runs > 1 else "")
            if mem is not None:
                print(f"{tag} memory : mean {mem['mean']:.2f} ms p50 {mem['p50']:.2f} p99 {mem['p99']:.2f} "
                      f"max {mem['max']:.2f} (load {mem['load_s']:.1f} s); CPU {mem['user'] + mem['sys']:.2f} ms "
                      f"(user {mem['user']:.2f}, sys {mem['sys']:.2f})", flush=True)
            for sp in phases:
                sps.append(sp)
                show(tag + f" prefetch {sp['prefetch']}", sp, mem, args)
        if args.runs > 1 or len(sps) > len(mems):
            def spread(rs: list, k: str) -> str:
                rs = [x for x in rs if x is not None]
                return f"{min(x[k] for x in rs):.2f}-{max(x[k] for x in rs):.2f}" if rs else "-"
            line = f"{q:9s} over {args.runs} runs: memory mean {spread(mems, 'mean')} p99 {spread(mems, 'p99')} ms"
            for pf in args.prefetch.split(","):
                if pf in {x["prefetch"] for x in sps} and pf not in line:
                    mine = [x for x in sps if x["prefetch"] == pf]
                    line += (f"; spilled, prefetch {pf}: mean {spread(mine, 'mean')} p99 {spread(mine, 'p99')} ms"
                             + (f", cold mean {spread(mine, 'cold_mean')} ms" if args.cold else ""))
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
