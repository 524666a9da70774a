"""What a row-grouped batch file would save a 1k-row step on a spilled state (branch r31-groups, issue 31): measured
before it is built.

Loads as bench/bench_spill.py (the same arguments as bench/spill_budget.py: --state --groups --limit --load-step
--queries one query --no-compaction), then runs ``--steps`` 1k-row steps after ``--warmup``, with the store's page
accounting (``spillread.pages_used``, the pages each seek of some keys in a spilled batch touches: the same pages the
C lookups read) watched. Per step it prints the means of:

- keys sought in spilled batches (the hashes each read was given, after the Bloom filters) and rows found;
- 4 KiB pages touched (measured, the store's accounting), per key sought, and per buffer kind (weights, key hashes,
  row hashes, each column's values / validity);
- distinct 2 MiB units of the files those pages lie in (what a fault maps as one folio, and what the budget's drop
  of a mapping makes faulted again the next step);
- minor faults and user / sys CPU of the process (getrusage);
- the same pages and units recomputed for the rows the reads touch (the rows found, and for a key not found the
  row its seek lands on) in two models: the columnar layout of today (a check of the model against the measure) and
  a row-grouped one of group span G (each group's rows' buffers together in one G-aligned span of at most G bytes,
  ``--groups-of`` e.g. 4KiB,16KiB,64KiB), which is what format version 2 (batchfile.py) would give.

    python bench/probe_groups.py --state 10M --groups 10M --limit 100MiB --load-step 1M --queries join
"""
from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spill as bs  # noqa: E402
from dbsp_core.trace import spillread  # noqa: E402

PG, UNIT = 4096, 2 << 20
_READS: list = []  # per pages_used call's reads: (file id, buffers, hashes, rows, pages, arrow offset, rows in file)


def _buffers(b, f) -> list[tuple[str, int, int, int]]:
    """The buffers a seek reads of batch ``b`` in file ``f``: (name, start offset in the mapping, bytes per row
    (0: a validity bitmap, 1/8 byte a row), length in bytes)."""
    out = []
    for name, a in (("weight", b.zset.weights), ("key_hash", b.key_hash), ("row_hash", b._rh)):
        if a is not None:
            out.append((name, a.ctypes.data - f.base, a.itemsize, a.nbytes))
    for cname, col in zip(b.zset.data.column_names, b.zset.data.columns):
        arr = col.chunk(0)
        bufs = arr.buffers()
        if bufs[0] is not None:
            out.append((cname + ".validity", bufs[0].address - f.base, 0, bufs[0].size))
        if len(bufs) == 2 and pa.types.is_primitive(arr.type) and arr.type.bit_width % 8 == 0:
            out.append((cname, bufs[1].address - f.base, arr.type.bit_width // 8, bufs[1].size))
    return out


def _watch() -> None:
    orig = spillread.pages_used

    def watched(reads, cache=None, values=True, row_hashes=True):  # type: ignore[no-untyped-def]
        res = orig(reads, cache, values, row_hashes)
        for (b, f, hashes, rows), pages in zip(reads, res):
            if pages is None or b._fx is None:
                continue
            _READS.append((id(f), _buffers(b, f), np.asarray(hashes, dtype=np.uint64), rows, np.asarray(pages),
                           b.key_hash, (f.path, f.size)))
        return res

    spillread.pages_used = watched


def _rows_touched(kh: np.ndarray, hashes: np.ndarray, rows) -> tuple[np.ndarray, int]:
    """The rows a seek of ``hashes`` touches (found rows, or the landing row of a hash not found), and the keys found."""
    h = np.unique(hashes)
    lo = np.searchsorted(kh, h, "left")
    hi = np.searchsorted(kh, h, "right")
    found = hi > lo
    if rows is not None:
        r = np.asarray(rows, dtype=np.int64)
    else:
        cnt = hi[found] - lo[found]
        r = np.repeat(lo[found], cnt) + (np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    landing = np.minimum(lo[~found], len(kh) - 1)
    return np.unique(np.concatenate([r, landing])), int(found.sum())


def _model(bufs, r: np.ndarray, group: int | None, nrows: int) -> np.ndarray:
    """Byte offsets (in the mapping) of rows ``r`` in every buffer: columnar (``group`` None: each buffer where it
    lies), or row-grouped of span ``group`` (the group's buffers one after another from the group's aligned start;
    the groups after the first buffer's start)."""
    if group is None:
        return np.concatenate([s + (r * w if w else r // 8) for _, s, w, _ in bufs])
    row_bytes = sum(w if w else 1 / 8 for _, _, w, _ in bufs) + 8 * len(bufs) / 64  # + 8-byte padding, amortized
    per = max(1, int(group // row_bytes))
    base = -(-min(s for _, s, _, _ in bufs) // group) * group
    g, i = r // per, r % per
    out, off = [], 0
    for _, _, w, _ in bufs:
        out.append(base + g * group + off + (i * w if w else i // 8))
        off += -(-(per * w if w else -(-per // 8)) // 8) * 8
    return np.concatenate(out)


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser()
    for a, d in (("--queries", "join"), ("--state", "10M"), ("--groups", "10M"), ("--limit", "100MiB"),
                 ("--load-step", "1M"), ("--groups-of", "4KiB,16KiB,64KiB")):
        ap.add_argument(a, default=d)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--change", type=int, default=1000)
    ap.add_argument("--auctions-step", type=bs._count, default=0)
    ap.add_argument("--no-compaction", action="store_true")
    ap.add_argument("--replay-rounds", type=int, default=3)
    ap.add_argument("--replay-group", type=int, default=4096)
    args = ap.parse_args()
    args.load_step = bs._count(args.load_step)
    args.modes = "spilled"
    if args.no_compaction:
        bs.no_compaction()
    gs = [int(x.replace("KiB", "")) * 1024 for x in args.groups_of.split(",")]
    q = args.queries
    print(f"{q} state {args.state} groups {args.groups} limit {args.limit} load {os.getloadavg()[0]:.2f} "
          f"{time.strftime('%H:%M:%S', time.gmtime())}", flush=True)
    t0 = time.perf_counter()
    p, rng, loaded = bs.load(q, bs._count(args.state), bs._count(args.groups), args, args.limit)
    store = p.executor.batch_store
    print(f"loaded in {time.perf_counter() - t0:.0f} s; {len(store._files)} files, "
          f"{store.disk_bytes() / 2**20:.0f} MiB on disk", flush=True)
    _watch()
    acc: dict[str, list] = {}

    def add(k: str, v: float) -> None:
        acc.setdefault(k, []).append(v)

    steps: list = []
    for i in range(args.warmup + args.steps):
        _READS.clear()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        ms = bs.one_step(p, rng, q, bs._count(args.groups), args.change, loaded, i)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if i < args.warmup:
            continue
        add("wall ms", ms)
        add("user ms", (r1.ru_utime - r0.ru_utime) * 1e3)
        add("sys ms", (r1.ru_stime - r0.ru_stime) * 1e3)
        add("minflt", r1.ru_minflt - r0.ru_minflt)
        add("majflt", r1.ru_majflt - r0.ru_majflt)
        keys = found = pages = 0
        per_buf: dict[str, int] = {}
        units: set = set()
        model = {g: [0, set()] for g in [None] + gs}
        touched = []  # (file, columnar offsets, grouped offsets) for the replay
        for fid, bufs, hashes, rows, pg, kh, pf in _READS:
            keys += len(np.unique(hashes))
            pages += len(pg)
            units.update((fid, int(u)) for u in np.unique(pg * PG // UNIT))
            starts = np.array([s for _, s, _, _ in bufs])
            ends = np.array([s + n for _, s, _, n in bufs])
            at = pg * PG
            j = np.searchsorted(starts, at, "right") - 1
            for k, (name, s, w, n) in enumerate(bufs):
                # a page overlapping the buffer [s, s + n) (a page may hold the ends of two buffers)
                c = int(np.count_nonzero((at < ends[k]) & (at + PG > starts[k])))
                kind = name if name in ("weight", "key_hash", "row_hash") else ("validity" if name.endswith(
                    ".validity") else "column")
                per_buf[kind] = per_buf.get(kind, 0) + c
            del j
            r, nf = _rows_touched(kh, hashes, rows)
            found += nf
            touched.append((pf, _model(bufs, r, None, len(kh)), _model(bufs, r, args.replay_group, len(kh))))
            for g in model:
                off = _model(bufs, r, g, len(kh))
                model[g][0] += len(np.unique(off // PG))
                model[g][1].update((fid, int(u)) for u in np.unique(off // UNIT))
        steps.append(touched)
        add("reads", len(_READS))
        add("keys sought", keys)
        add("keys found", found)
        add("pages", pages)
        add("pages/key", pages / max(keys, 1))
        add("units", len(units))
        for kind, c in per_buf.items():
            add(f"pages in {kind}", c)
        for g, (pgs, us) in model.items():
            tag = "columnar model" if g is None else f"grouped {g // 1024}KiB model"
            add(f"{tag}: pages", pgs)
            add(f"{tag}: pages/key", pgs / max(keys, 1))
            add(f"{tag}: units", len(us))
    for k, v in acc.items():
        print(f"  {k:34s} mean {np.mean(v):9.2f}  p99 {np.percentile(v, 99):9.2f}", flush=True)
    print(f"  load {os.getloadavg()[0]:.2f} {time.strftime('%H:%M:%S', time.gmtime())}", flush=True)
    replay(steps, args.replay_rounds, args.replay_group)
    return 0


def replay(steps: list, rounds: int, group: int) -> None:
    """The measured steps' reads replayed on the store's own files (their page cache as the steps left it), alternated
    ``rounds`` times, each mode over every step three times (the loops in C: bench_pread_micro.py's):

    - ``columnar-mmap``: through a fresh MADV_RANDOM mapping of each file, a byte read in every 4 KiB page the step's
      rows touch where they lie (what the steps did), then every mapping dropped (MADV_DONTNEED: the budget's drop);
    - ``grouped-mmap``: the same at the pages the row-grouped layout (groups of ``group`` bytes) puts those rows in;
    - ``grouped-pread``: no mapping: one pread(2) of ``group`` bytes a group the step's rows lie in, into a buffer;
    - ``columnar-pread``: one pread of 4 KiB a page the columnar layout's rows lie in (r31-fault100's pread, per page).

    Only the offsets differ (the bytes are whatever lies there), so the differences are the kernel's: faults, drops,
    system calls and copies."""
    import ctypes
    import mmap

    from bench_pread_micro import _lib

    lib = _lib()
    maps: dict = {}
    for touched in steps:
        for (path, size), _, _ in touched:
            if path not in maps and os.path.exists(path):
                fd = os.open(path, os.O_RDONLY)
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                m.madvise(mmap.MADV_RANDOM)
                maps[path] = (m, np.frombuffer(m, dtype=np.uint8).ctypes.data, fd, size)
    plans = []  # per step: per file (path, columnar pages, grouped pages, grouped slots)
    for touched in steps:
        per = []
        for (path, _size), col, grp in touched:
            if path not in maps:
                continue
            size = maps[path][3]
            cp = np.unique(col[col < size] // PG).astype(np.int64)
            gp = np.unique(grp[grp < size] // PG).astype(np.int64)
            gs = np.unique(grp[grp < size] // group).astype(np.int64)
            per.append((path, cp, gp, gs))
        plans.append(per)
    most = max((max(len(cp), len(gs)) for per in plans for _, cp, _, gs in per), default=1)
    pool = np.zeros(most * max(group, PG) + PG, dtype=np.uint8)
    ones = np.ones(most, dtype=np.int64)
    slots = np.arange(most, dtype=np.int64)
    th = getattr(resource, "RUSAGE_THREAD", 1)
    for rnd in range(rounds):
        for name in ("columnar-mmap", "grouped-mmap", "grouped-pread", "columnar-pread"):
            for m, *_ in maps.values():
                m.madvise(mmap.MADV_DONTNEED)
            r0 = resource.getrusage(th)
            t0, c0 = time.perf_counter(), time.thread_time()
            calls = 0
            for per in plans * 3:
                for path, cp, gp, gs in per:
                    m, base, fd, _size = maps[path]
                    if name.endswith("mmap"):
                        pg = cp if name.startswith("columnar") else gp
                        lib.touch(base, pg.ctypes.data, len(pg), PG)
                    else:
                        first, unit = (gs, group) if name.startswith("grouped") else (cp, PG)
                        got = lib.read_runs(fd, pool.ctypes.data, first.ctypes.data, ones.ctypes.data,
                                            slots.ctypes.data, len(first), unit)
                        if got < 0:
                            raise OSError("short pread")
                        calls += got
                if name.endswith("mmap"):
                    for path, *_ in per:
                        maps[path][0].madvise(mmap.MADV_DONTNEED)
            cpu = time.thread_time() - c0
            r1 = resource.getrusage(th)
            n = 3 * len(plans)
            print(f"  replay round {rnd} {name:14s}: CPU {cpu * 1e3 / n:.3f} ms a step (user "
                  f"{(r1.ru_utime - r0.ru_utime) * 1e3 / n:.3f}, sys {(r1.ru_stime - r0.ru_stime) * 1e3 / n:.3f}), "
                  f"minflt {(r1.ru_minflt - r0.ru_minflt) / n:.1f}, preads {calls / n:.0f}, wall "
                  f"{(time.perf_counter() - t0) * 1e3 / n:.3f} ms (load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
