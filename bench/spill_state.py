"""A bench_spill.py state built once into a directory and measured later on a fresh copy of it opened with ``Pipeline.open``: the saved state is never written, so every run starts from the same state in seconds.

Run from the repository root:

    python bench/spill_state.py build /work/wt/state100/join-100M-f1 --query join --state 100M --groups 100M \\
        --limit 1GiB --load-step 1M --auctions-step 10M               # once: load, settle, checkpoint, close
    python bench/spill_state.py run /work/wt/state100/join-100M-f1 --steps 100 --warmup 10 --cold 3
    python bench/spill_state.py check /work/wt/state100/join-1M-f1 --steps 20    # reopened == freshly loaded

``build`` loads ``--state`` bids as bench_spill.py does (same generator seed, load steps and merges settled) into a
durable pipeline under ``<dir>/pipeline`` (``memory_limit=--limit``, or none with ``--limit none``: a state held in
memory, checkpointed whole into its state database), checkpoints it and closes it; beside it ``bench.json`` (the
arguments, the generator's state after the load, the load's time) and ``loaded.arrow`` (the loaded rows a step
deletes from), and ``SUMS.json``: every file's size and CRC-32.

``run`` and ``check`` work on a copy ``<dir>.run-<pid>`` (removed afterwards): the batch files under ``spill/`` are
hard links (immutable once written: a batch file is written under a temporary name and renamed when complete,
batchfile.py invariant 7, and never opened for writing again; a deleted one is truncated to give its blocks back
only when no other name links it, spill.py invariant 12, ``_delete``), every other file is copied, since these are
written in place: the state databases ``state/worker-<w>.db`` and ``driver.db`` (the page store writes the next
version into the same file), the input and output logs' segments under ``input/`` and ``output/`` (appended), META,
LAYOUT, METRICS, PROFILE and ``consumers/`` (rewritten), LOCK (locked). After the run the saved files' CRCs are
checked against ``SUMS.json`` (``--no-verify``: sizes and mtimes only).

``run`` measures as bench_spill.py's spilled (or memory) pipeline: ``--warmup`` + ``--steps`` steps of ``--change``
rows, ``--cold`` steps after the files' pages left the page cache, printed by bench_spill.show; and the time and
RSS of the open, the first step's time, and the driver's time a step in logging: the copy is durable, so each step
appends its pushes to the input log, fsyncs its division record and writes its output to the output log
(``output_sync`` off); the wall times include that, and "engine" is each step's time in the executor alone (the
driver's ``step_engine_s``), the figure comparable with bench_spill.py's pipelines without storage.

``probe`` tells how the page cache holds the saved batch files (resident MiB, pages a fault maps).

``check`` runs ``--steps`` steps on the reopened copy and on a state freshly loaded in this process without
storage (the same load), and compares each step's output as a multiset.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
import zlib

import numpy as np
import pyarrow as pa

if os.environ.get("BENCH_TREE"):  # another tree's engine (main's, alternated against a branch's on one saved state):
    sys.path.insert(0, os.environ["BENCH_TREE"])  # imported first, so that bench_spill's own path insert is moot
    import dbsp_core  # noqa: E402,F401
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spill  # noqa: E402
from bench_pread_micro import _smaps_of  # noqa: E402
from bench_scaling import _count, circuit  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.envvars import parse_memory_limit  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402
from dbsp_core.trace.spill import BatchStore  # noqa: E402

PIPELINE, META, LOADED, SUMS = "pipeline", "bench.json", "loaded.arrow", "SUMS.json"
SEGMENT = 4 << 20  # the logs' segments: small, so the checkpoint after the load drops nearly all of the load's logs
LINKED = "spill"  # the directory whose .batch files a copy links instead of copying


def _grouped(g: str) -> None:
    """``BatchStore.GROUPED_FROM`` from ``--grouped`` (off, a size, or ``-``: the environment's)."""
    if g != "-":
        BatchStore.GROUPED_FROM = None if g == "off" else parse_memory_limit(g)


def _limit(s: str) -> int | None:
    return None if s == "none" else parse_memory_limit(s)


def sums(root: str, crc: bool = True) -> dict[str, list[int]]:
    """Every file under ``root``: [size, mtime_ns, CRC-32 (0 without ``crc``)], by path relative to ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            path = os.path.join(d, n)
            st = os.stat(path)
            c = 0
            if crc:
                with open(path, "rb") as f:
                    while chunk := f.read(8 << 20):
                        c = zlib.crc32(chunk, c)
            out[os.path.relpath(path, root)] = [st.st_size, st.st_mtime_ns, c]
    return out


def build(args) -> int:
    """Load the state into ``<dir>/pipeline``, checkpoint, close; write bench.json, loaded.arrow and SUMS.json."""
    if os.path.exists(args.dir):
        raise SystemExit(f"build: {args.dir} exists; remove it first")
    os.makedirs(args.dir)
    _grouped(args.grouped)
    limit = _limit(args.limit)
    state, groups = _count(args.state), _count(args.groups)
    t0 = time.perf_counter()
    p, rng, loaded = bench_spill.load(args.query, state, groups, args, limit,
                                      storage=os.path.join(args.dir, PIPELINE), checkpoint_interval=args.checkpoint,
                                      output_retention=0, output_sync=False, segment_bytes=SEGMENT)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    p.checkpoint()
    ckpt_s = time.perf_counter() - t1
    store = p.executor.batch_store
    disk = store.disk_bytes() if store is not None else 0
    p.close()
    with pa.OSFile(os.path.join(args.dir, LOADED), "wb") as f, pa.ipc.new_file(f, loaded[0].schema) as w:
        for t in loaded:
            w.write_batch(t.combine_chunks().to_batches()[0])
    meta = dict(query=args.query, state=state, groups=groups, limit=args.limit, load_step=args.load_step,
                auctions_step=args.auctions_step, grouped=args.grouped, rng=rng.bit_generator.state,
                load_s=load_s, checkpoint_s=ckpt_s, disk_bytes=disk, built=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                           time.gmtime()),
                loadavg=os.getloadavg()[0])
    with open(os.path.join(args.dir, META), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    s = sums(os.path.join(args.dir, PIPELINE))
    with open(os.path.join(args.dir, SUMS), "w") as f:
        json.dump(s, f, indent=0, sort_keys=True)
    print(f"built {args.dir}: {args.query} {state:,} rows, limit {args.limit}, grouped {args.grouped}; load "
          f"{load_s:.0f} s, checkpoint {ckpt_s:.1f} s, {sum(v[0] for v in s.values()) / 2**20:.0f} MiB in {len(s)} "
          f"files", flush=True)
    return 0


def copy(src: str, dst: str) -> tuple[int, int]:
    """``src/pipeline`` into ``dst``: batch files hard-linked, everything else copied; returns (linked, copied)."""
    linked = copied = 0
    root = os.path.join(src, PIPELINE)
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for n in files:
            a, b = os.path.join(d, n), os.path.join(dst, rel, n)
            if rel == LINKED and n.endswith(".batch"):
                os.link(a, b)
                linked += 1
            else:
                shutil.copy2(a, b)
                copied += 1
    return linked, copied


def reopen(args, meta: dict) -> tuple[dbsp.Pipeline, str, dict]:
    """A fresh copy of the saved state opened; its directory and the open's figures."""
    work = f"{os.path.abspath(args.dir).rstrip('/')}.run-{os.getpid()}"
    t0 = time.perf_counter()
    linked, copied = copy(args.dir, work)
    copy_s = time.perf_counter() - t0
    _grouped(meta["grouped"])
    # a deleted file unlinked and closed at once, never truncated: the same as a reclaim that skips a linked inode
    # (spill.py ``_delete``), also on a tree without that check (main, alternated against a branch on one state)
    BatchStore.RECLAIM_FILES = 0
    rss0 = bench_spill._rss_file("VmRSS")
    t1 = time.perf_counter()
    p = dbsp.Pipeline.open(work, circuit(meta["query"]), executor=EmbeddedExecutor(background_merge=True),
                           memory_limit=_limit(meta["limit"]), checkpoint_interval=None, output_retention=0,
                           output_sync=False, segment_bytes=SEGMENT)
    info = dict(copy_s=copy_s, linked=linked, copied=copied, open_s=time.perf_counter() - t1,
                open_rss_mb=(bench_spill._rss_file("VmRSS") - rss0) / 2**20, check_s=0.0)
    store = p.executor.batch_store
    if store is not None and not getattr(args, "lazy", True):
        # every adopted file checked whole now (BatchStore.check: its page CRCs), as a freshly loaded state's files
        # need no check; else each step checks the pages it reads first (spill.py invariant 14): at 100M rows ~40 ms
        # of CRCs a step for the first hundreds of steps. Then the check's pages leave the process (not the page cache)
        t2 = time.perf_counter()
        for t in p.executor._all_traces():
            for b in t._levels():
                store.check(b)
        for f in list(store._files.values()):
            f.map.madvise(bench_spill.mmap.MADV_DONTNEED)
        info["check_s"] = time.perf_counter() - t2
    return p, work, info


def saved(args) -> tuple[dict, np.random.Generator, list]:
    with open(os.path.join(args.dir, META)) as f:
        meta = json.load(f)
    rng = np.random.default_rng()
    rng.bit_generator.state = meta["rng"]
    with pa.memory_map(os.path.join(args.dir, LOADED)) as m:
        r = pa.ipc.open_file(m)
        loaded = [pa.Table.from_batches([r.get_batch(i)]) for i in range(r.num_record_batches)]
    return meta, rng, loaded


def verify(args, crc: bool) -> None:
    """The saved state's files as SUMS.json says (sizes, mtimes, and CRCs with ``crc``)."""
    with open(os.path.join(args.dir, SUMS)) as f:
        want = json.load(f)
    got = sums(os.path.join(args.dir, PIPELINE), crc)
    bad = sorted(set(want) ^ set(got)) + sorted(n for n in set(want) & set(got)
                                                if want[n][:2] != got[n][:2] or (crc and want[n][2] != got[n][2]))
    if bad:
        raise SystemExit(f"the saved state {args.dir} changed: {bad[:10]} ({len(bad)} files)")
    print(f"saved state unchanged: {len(got)} files ({'CRC-32, ' if crc else ''}sizes and mtimes)", flush=True)


def _finish(args, p: dbsp.Pipeline, work: str) -> None:
    p.close(checkpoint=False)
    shutil.rmtree(work)
    verify(args, not args.no_verify)


def run(args) -> int:
    meta, rng, loaded = saved(args)
    bench_spill._watch_enforce()
    bench_spill._PEAK.update(load_file=0, load_anon=0)  # (no load in this process)
    BatchStore.PREFETCH = args.prefetch
    if args.no_huge:
        BatchStore.HUGE_SHARE = None
    if args.refold or args.drop:
        refold(args, drop_only=args.drop)
    p, work, info = reopen(args, meta)
    try:
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        first = bench_spill.one_step(p, rng, meta["query"], meta["groups"], args.change, loaded, 0)
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        if args.reclaim and p.executor.batch_store is not None:  # as the host's reclaim would, once steps ran
            bench_spill.drop_pages(p.executor.batch_store)
            print("the batch files' pages dropped after the first step (--reclaim)", flush=True)
        print(f"{meta['query']} {meta['state']:,} rows, limit {meta['limit']}, grouped {meta['grouped']}, load "
              f"{os.getloadavg()[0]:.2f}: copy {info['copy_s']:.1f} s ({info['linked']} files linked, "
              f"{info['copied']} copied), open {info['open_s']:.2f} s (+{info['open_rss_mb']:.0f} MiB RSS), files "
              f"checked whole {info['check_s']:.1f} s, first "
              f"step {first:.0f} ms (CPU {(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) * 1e3:.0f} ms, "
              f"{c1.ru_majflt - c0.ru_majflt} major faults)", flush=True)
        margs = argparse.Namespace(warmup=args.warmup, steps=args.steps, cold=args.cold if meta["limit"] != "none"
                                   else 0, change=args.change, profile=0)
        log0 = p.stats["step_log_s"]
        engine = _engine_times(p)
        r, _ = bench_spill.measure(p, rng, meta["query"], meta["groups"], margs, loaded, 1)
        log_ms = (p.stats["step_log_s"] - log0) * 1e3 / (args.warmup + args.steps + margs.cold)
        eng = engine[args.warmup:args.warmup + args.steps]
        r.update(engine_mean=float(np.mean(eng)), engine_p50=float(np.percentile(eng, 50)),
                 engine_p99=float(np.percentile(eng, 99)))
        r.update(load_s=meta["load_s"], prefetch="auto")
        tag = f"{meta['query']:9s} {meta['state'] // 10**6}M"
        if meta["limit"] == "none":
            print(f"{tag} memory : mean {r['mean']:.2f} ms p50 {r['p50']:.2f} p99 {r['p99']:.2f} max {r['max']:.2f}; "
                  f"CPU {r['user'] + r['sys']:.2f} ms (user {r['user']:.2f}, sys {r['sys']:.2f}); stepping thread "
                  f"CPU mean {r['cpu_mean']:.2f} p99 {r['cpu_p99']:.2f} ms; faults minor {r['minflt']:.0f} major "
                  f"{r['majflt']:.1f}", flush=True)
        else:
            bench_spill.show(f"{tag} {meta['grouped']}", r, None, margs)
        st = p.executor.batch_store.stats if p.executor.batch_store is not None else {}
        r.update(huge_files=st.get("huge_files", 0), overflows=st.get("overflows", 0))
        print(f"{tag} files made MADV_HUGEPAGE (spill.py _hot_files) {r['huge_files']}, enforces that overflowed "
              f"{r['overflows']}", flush=True)
        print(f"{tag} engine (the executor's step, no logging): mean {r['engine_mean']:.2f} ms p50 "
              f"{r['engine_p50']:.2f} p99 {r['engine_p99']:.2f}; logging (input log's fsync, output log) "
              f"{log_ms:.2f} ms a step of the wall times above; load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(r, **info, first_ms=first, log_ms=log_ms, query=meta["query"],
                                        state=meta["state"], limit=meta["limit"], grouped=meta["grouped"],
                                        loadavg=os.getloadavg()[0], at=time.time(),
                                        flags=" ".join(f"--{k.replace('_', '-')}" for k in ("refold", "drop", "reclaim",
                                                                                          "no_huge", "lazy")
                                                      if getattr(args, k)),
                                        tree=os.path.dirname(os.path.dirname(os.path.abspath(dbsp.__file__))))) + "\n")
    finally:
        _finish(args, p, work)
    return 0


def refold(args, drop_only: bool = False) -> None:
    """The saved batch files' pages out of the page cache, then read back in 2 MiB folios (a MADV_HUGEPAGE mapping
    touched once per 2 MiB: each fault reads its aligned 2 MiB as one folio), as a merge built on disk leaves
    them (batchfile.py invariant 6): a run starts from the folios the files were written in, whatever an earlier
    run's cold steps (their pages dropped, then faulted back a page at a time) or the host's reclaim left.
    ``drop_only``: the pages dropped, not read back (as the host's reclaim leaves a state it did not read since)."""
    import mmap

    t0 = time.perf_counter()
    spill = os.path.join(args.dir, PIPELINE, LINKED)
    total = 0
    for n in sorted(os.listdir(spill)) if os.path.isdir(spill) else []:  # (a state in memory spilled nothing)
        path = os.path.join(spill, n)
        if not n.endswith(".batch") or os.path.getsize(path) < bench_spill.PAGE:
            continue
        with open(path, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(m, dtype=np.uint8)
        if not drop_only:
            arr[::2 << 20].sum()  # a fault per 2 MiB
        total += len(m)
        del arr
        m.close()
    print(f"{'dropped' if drop_only else 'refolded'} {total / 2**20:.0f} MiB of batch files in {time.perf_counter() - t0:.1f} s", flush=True)


def _engine_times(p: dbsp.Pipeline) -> list[float]:
    """From now on, each bench_spill.one_step's time in the executor (ms, the driver's ``step_engine_s``: the wall
    time of the circuit's step without the push's and the step's logging), appended to the list returned."""
    times: list[float] = []
    step = bench_spill.one_step

    def timed(*a, **kw):  # type: ignore[no-untyped-def]
        e0 = p.stats["step_engine_s"]
        ms = step(*a, **kw)
        times.append((p.stats["step_engine_s"] - e0) * 1e3)
        return ms

    bench_spill.one_step = timed
    return times


def probe(args) -> int:
    """The saved batch files' pages in the page cache (mincore) and the folios serving them: a fresh MADV_RANDOM
    mapping of each file, up to ``--pages`` random resident pages touched (no page read from the disk), its faults
    and its smaps' Rss and FilePmdMapped (pages a fault: 512 when the page cache holds the file in 2 MiB folios)."""
    import mmap

    spill = os.path.join(args.dir, PIPELINE, LINKED)
    for n in sorted(os.listdir(spill)):
        path = os.path.join(spill, n)
        size = os.path.getsize(path)
        if not n.endswith(".batch") or size < bench_spill.PAGE:
            continue
        with open(path, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_RANDOM)
        arr = np.frombuffer(m, dtype=np.uint8)
        vec = (bench_spill.ctypes.c_ubyte * ((size + bench_spill.PAGE - 1) // bench_spill.PAGE))()
        bench_spill._libc.mincore(bench_spill.ctypes.c_void_p(arr.ctypes.data), bench_spill.ctypes.c_size_t(size), vec)
        resident = np.flatnonzero(np.frombuffer(vec, dtype=np.uint8) & 1)
        pick = np.sort(np.random.default_rng(1).choice(resident, min(args.pages, len(resident)), replace=False)) \
            if len(resident) else resident
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        total = 0
        for pg in pick.tolist():  # one touch at a time (a gather would fault them in any order: the same counts)
            total += int(arr[pg * bench_spill.PAGE])
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        smaps = _smaps_of(arr.ctypes.data)  # (bench_pread_micro.py's)
        flt = r1.ru_minflt - r0.ru_minflt
        print(f"{n}: {size / 2**20:.0f} MiB, {len(resident) * bench_spill.PAGE / 2**20:.0f} MiB in the page cache; "
              f"{len(pick)} resident pages touched: {flt} faults ({r1.ru_majflt - r0.ru_majflt} major), Rss "
              f"{smaps.get('Rss', 0) / 1024:.1f} MiB, FilePmdMapped {smaps.get('FilePmdMapped', 0) / 1024:.1f} MiB, "
              f"{smaps.get('Rss', 0) / 4 / max(1, flt):.0f} pages a fault, sys "
              f"{(r1.ru_stime - r0.ru_stime) * 1e6 / max(1, flt):.2f} us a fault", flush=True)
        del arr
        m.close()
    return 0


def _multiset(out: dict) -> dict:
    return {name: sorted(z.to_dict().items()) for name, z in out.items()}


def check(args) -> int:
    """The same steps' outputs on the reopened copy and on a freshly loaded state, as multisets."""
    meta, rng, loaded = saved(args)
    p, work, _ = reopen(args, meta)
    got: list = []
    try:
        for k in range(args.steps):
            bench_spill.one_step(p, rng, meta["query"], meta["groups"], args.change, loaded, k, got)
    finally:
        _finish(args, p, work)
    _grouped(meta["grouped"])
    fargs = argparse.Namespace(load_step=meta["load_step"], auctions_step=meta["auctions_step"])
    q, rng2, loaded2 = bench_spill.load(meta["query"], meta["state"], meta["groups"], fargs, _limit(meta["limit"]))
    want: list = []
    try:
        if rng2.bit_generator.state != meta["rng"]:
            raise SystemExit("check: the fresh load's generator differs from the saved one's")
        for k in range(args.steps):
            bench_spill.one_step(q, rng2, meta["query"], meta["groups"], args.change, loaded2, k, want)
    finally:
        q.close()
    bad = [k for k in range(args.steps) if _multiset(got[k]) != _multiset(want[k])]
    rows = sum(len(v) for o in want for v in _multiset(o).values())
    if bad:
        print(f"check FAILED: steps {bad} differ ({rows} output rows in all)", flush=True)
        return 1
    print(f"check: {args.steps} steps' outputs equal as multisets on the reopened and the freshly loaded state "
          f"({rows} distinct output rows)", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    b.add_argument("--query", default="join")
    b.add_argument("--state", default="1M")
    b.add_argument("--groups", default="1M")
    b.add_argument("--limit", default="1GiB", help="memory_limit, or none (the state in memory)")
    b.add_argument("--load-step", type=_count, default=1_000_000)
    b.add_argument("--auctions-step", type=_count, default=0)
    b.add_argument("--grouped", default="off", help="BatchStore.GROUPED_FROM: off (format 1) or a size (64MiB)")
    b.add_argument("--checkpoint", type=float, default=120.0, help="seconds between checkpoints during the load "
                   "(the logs before one are dropped)")
    for name in ("run", "check"):
        r = sub.add_parser(name)
        r.add_argument("dir")
        r.add_argument("--change", type=int, default=1000)
        r.add_argument("--steps", type=int, default=100)
        r.add_argument("--no-verify", action="store_true", help="after the run, the saved files' sizes and mtimes "
                       "only (no CRCs)")
        if name == "run":
            r.add_argument("--warmup", type=int, default=10)
            r.add_argument("--cold", type=int, default=3)
            r.add_argument("--json", default="", help="append the figures as a JSON line to this file")
            r.add_argument("--refold", action="store_true", help="first drop the saved batch files' pages from the "
                           "page cache and read them back in 2 MiB folios (the folios they were written in)")
            r.add_argument("--lazy", action="store_true", help="leave the adopted files' checks to the steps "
                           "(spill.py invariant 14: each step checks the pages it reads first); default: every file "
                           "checked whole after the open, as a freshly loaded state's need none")
            r.add_argument("--prefetch", default="auto", help="BatchStore.PREFETCH: auto, on or off")
            r.add_argument("--drop", action="store_true", help="first drop the saved batch files' pages from the "
                           "page cache (the warm-up steps fault them back)")
            r.add_argument("--reclaim", action="store_true", help="after the first step, every batch file's pages "
                           "out of the process and the page cache (bench_spill.drop_pages: a cold step's drop), as "
                           "the host's reclaim would take them; the warm-up steps fault them back")
            r.add_argument("--no-huge", action="store_true", help="BatchStore.HUGE_SHARE None (no file ever "
                           "MADV_HUGEPAGE: main's faults)")
    pr = sub.add_parser("probe")
    pr.add_argument("dir")
    pr.add_argument("--pages", type=int, default=2048)
    args = ap.parse_args()
    return {"build": build, "run": run, "check": check, "probe": probe}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
