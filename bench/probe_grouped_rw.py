"""Batch file format 1 (mapped) against format 2 (row groups, read by pread: dbsp_core/trace/groupedfile.py) on one
file of N rows: the write (wall and CPU), the file's size, and 1k-key lookups (the rows of 1,000 random present keys,
a 1k-row step's read of one batch), alternated step by step, with the page cache warm or dropped before each step
(the file's pages evicted: a state beyond memory). Not the spill store's read path: format 2 is not wired into it.
Format 2 is read twice, by its C decoder ("v2c": csrc/groupdecode.c) and by pyarrow's IPC reader ("v2a"), each from
its own open of the file (its own CRC-checked flags); ``--no-arrow`` leaves the pyarrow reads out; ``--fadv-random``
adds "v2r", the C decoder from an open whose descriptor has POSIX_FADV_RANDOM (no readahead). Run it from the tree's
root with the tree on PYTHONPATH (``bench/`` is the script's path: without it the installed dbsp_core is imported).

    PYTHONPATH=. python bench/probe_grouped_rw.py --rows 10000000 --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import resource
import tempfile
import time

import numpy as np
import pyarrow as pa

from dbsp_core import ZSet
from dbsp_core.trace.batchfile import open_batch, write_batch
from dbsp_core.trace.groupedfile import open_grouped, write_grouped


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _io() -> int:
    """Blocks read from disk and major faults of this process so far (a warm step should add none)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_inblock + r.ru_majflt


def _drop(path: str, m: mmap.mmap | None = None) -> None:
    if m is not None:
        m.madvise(mmap.MADV_DONTNEED)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-arrow", action="store_true")
    ap.add_argument("--fadv-random", action="store_true",
                    help="also read format 2 by C from an open whose descriptor has POSIX_FADV_RANDOM (v2r)")
    a = ap.parse_args()
    rng = np.random.default_rng(7)
    n = a.rows
    k = rng.integers(0, n // 2, n)  # ~2 rows a key, as a join's state
    b = ZSet.from_arrow(pa.table({"k": k, "v": rng.integers(0, 1 << 40, n), "s": rng.integers(0, 1000, n)})
                        ).consolidate().index_by(["k"])
    d = a.dir or tempfile.mkdtemp(prefix="grouped-")
    os.makedirs(d, exist_ok=True)
    p1, p2 = os.path.join(d, "one.batch"), os.path.join(d, "two.batch")
    for name, fn in (("v1", lambda: write_batch(p1, b)), ("v2", lambda: write_grouped(p2, b))):
        t, c = time.perf_counter(), _cpu()
        size = fn()
        print(f"write {name}: {time.perf_counter() - t:.2f} s wall, {_cpu() - c:.2f} s CPU, {size / 2**20:.0f} MiB")
    f1 = open_batch(p1)
    f2 = open_grouped(p2)
    f2a = open_grouped(p2)
    f2r = open_grouped(p2)
    f2.decode, f2a.decode, f2r.decode = "c", "arrow", "c"
    os.posix_fadvise(f2r.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead on this descriptor
    names = ("v1", "v2c") if a.no_arrow else ("v1", "v2c", "v2a")
    names += ("v2r",) if a.fadv_random else ()
    print(f"v2: {f2.groups} groups, {n / f2.groups:.1f} rows a group, index+filter {f2.memory_bytes() / 2**20:.1f} "
          f"MiB; v1 fence+filter+crcs {f1.memory_bytes() / 2**20:.1f} MiB")
    orders = list(itertools.permutations(names))  # (a warm reader after another reads pages that one touched)
    kh = np.asarray(b.key_hash)
    del b
    ix = f1.batch
    for cold in (False, True):
        res: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        io = {name: 0 for name in names}
        for s in range(a.steps):
            h = np.unique(kh[rng.integers(0, n, a.keys)])
            order = orders[s % len(orders)]  # every order in turn: each reader before each other in half the steps
            want = int(np.isin(kh, h).sum())
            for name in order:
                if cold:
                    _drop(p1, f1.map) if name == "v1" else _drop(p2)
                    if name == "v2c":
                        f2.checked[:] = False  # (a cold page's CRC is checked again: it was read from disk)
                    elif name == "v2a":
                        f2a.checked[:] = False
                    elif name == "v2r":
                        f2r.checked[:] = False
                t, c, i0 = time.perf_counter(), time.thread_time(), _io()
                if name == "v1":
                    rows = ix.lookup(h)
                    got = ix.zset.data.take(pa.array(rows))  # the rows read, every column (as the step's walk)
                    w = ix.zset.weights[rows]
                    nr = len(got) + 0 * int(w.sum())
                else:
                    nr = len({"v2c": f2, "v2a": f2a, "v2r": f2r}[name].lookup(h))
                res[name].append((time.perf_counter() - t, time.thread_time() - c))
                io[name] += _io() - i0
                if nr != want:
                    raise SystemExit(f"{name} found {nr} rows, {want} expected")
        for name, xs in res.items():
            wall = np.array([x[0] for x in xs]) * 1e3
            cpu = np.array([x[1] for x in xs]) * 1e3
            print(f"{'cold' if cold else 'warm'} {name}: mean {wall.mean():.2f} ms, p99 {np.percentile(wall, 99):.2f} "
                  f"ms, CPU mean {cpu.mean():.2f} ms, p99 {np.percentile(cpu, 99):.2f} ms ({len(xs)} steps; blocks read + "
                  f"major faults {io[name] / len(xs):.0f} a step)")
    import dbsp_core

    print("load:", os.getloadavg(), "dbsp_core from", os.path.dirname(dbsp_core.__file__))


if __name__ == "__main__":
    main()
