"""How a spilled step's pages are best read: through the mapping (page faults, fault-around, madvise DONTNEED
evictions: what the batch store does today, dbsp_core/trace/spill.py invariant 12) or by pread(2) into a buffer pool
the engine owns (no fault, no unmapping: an eviction frees a slot). Replays the pages a real spilled pipeline's 1k-row
steps used, step by step, against files of the same sizes, so only the kernel's side of a read differs.

Two phases (run from the repository root):

    python bench/bench_pread_micro.py record --query distinct --state 10M --groups 10M --limit 100MiB \
        --load-step 1M --steps 100 --out /tmp/pages-distinct.npz
    python bench/bench_pread_micro.py replay /tmp/pages-distinct.npz --rounds 3

``record`` loads the pipeline as bench/bench_spill.py does and, for ``--steps`` steps, keeps per step the pages of
each batch file its reads used (``BatchStore._pages_used``, what the cache counts) and the evictions that followed
(``spill._evict``: runs of pages, or a whole mapping). ``replay`` writes files of the recorded sizes (in the page
cache: warm steps, as the benchmark's), then replays the steps in each mode, alternated ``--rounds`` times, the
per-page loops in C (compiled here with cc), and prints CPU time (getrusage, user + system) and minor faults per step:

- ``mmap-random``: the store's path: mappings MADV_RANDOM (as batchfile.open_batch maps them), a byte read per page
  used (a fault when not mapped; the kernel maps the page-cache pages around it), the recorded evictions as
  madvise(MADV_DONTNEED) per run or over the whole mapping;
- ``mmap-normal``: the same with MADV_NORMAL (whether MADV_RANDOM stops fault-around: it does not, in Linux);
- ``mmap-keep``: no eviction (everything stays mapped: the floor the mapping can reach);
- ``pread``: a pool of 4 KiB slots the engine owns holding exactly the pages the cache holds: a page used and not
  held is read by pread(2) of its run of adjacent missing pages (one call per run), an eviction frees slots (no
  system call); ``pread-page``: one pread per page.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAGE = os.sysconf("SC_PAGE_SIZE")
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", 1)
MAP_UNIT = 2 << 20

C_SOURCE = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>

/* A byte read of each page of pages[0..n) of the mapping at base; returns their sum (kept live). */
uint64_t touch(const volatile unsigned char *base, const int64_t *pages, int64_t n, int64_t page) {
    uint64_t s = 0;
    for (int64_t i = 0; i < n; i++) s += base[pages[i] * page];
    return s;
}

/* madvise(advice) each run [first[i], first[i] + count[i]) of pages of the mapping at base. */
int64_t advise(unsigned char *base, const int64_t *first, const int64_t *count, int64_t n, int64_t page, int advice) {
    int64_t ok = 0;
    for (int64_t i = 0; i < n; i++) ok += madvise(base + first[i] * page, count[i] * page, advice) == 0;
    return ok;
}

/* process_madvise(advice) of the runs [first[i], first[i] + count[i]) of pages of the mapping at base, up to 1024 a
 * system call (as bindings/storage.pyx's dbsp_advise_runs); returns the calls, -1 when the kernel refuses. */
int64_t advise_batched(unsigned char *base, const int64_t *first, const int64_t *count, int64_t n, int64_t page,
                       int advice) {
    static int fd = -1;
    struct iovec iov[1024];
    int64_t calls = 0;
    if (fd < 0) fd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    for (int64_t i = 0; i < n; i += 1024) {
        int64_t k = n - i < 1024 ? n - i : 1024;
        for (int64_t j = 0; j < k; j++) {
            iov[j].iov_base = base + first[i + j] * page;
            iov[j].iov_len = count[i + j] * page;
        }
        if (syscall(SYS_process_madvise, fd, iov, (size_t)k, advice, 0u) < 0) return -1;
        calls++;
    }
    return calls;
}

/* pread the runs [first[i], first[i] + count[i]) of pages of fd into slots of the pool: run i's pages go to the
 * slots slot[i].. (consecutive); returns the system calls made, -1 on a short read. */
int64_t read_runs(int fd, unsigned char *pool, const int64_t *first, const int64_t *count, const int64_t *slot,
                  int64_t n, int64_t page) {
    for (int64_t i = 0; i < n; i++) {
        ssize_t got = pread(fd, pool + slot[i] * page, count[i] * page, first[i] * page);
        if (got <= 0) return -1;
    }
    return n;
}
"""


def _lib() -> ctypes.CDLL:
    d = tempfile.mkdtemp(prefix="pread-micro-")
    src, so = os.path.join(d, "m.c"), os.path.join(d, "m.so")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    subprocess.check_call(["cc", "-O2", "-shared", "-fPIC", "-o", so, src])
    lib = ctypes.CDLL(so)
    subprocess.call(["rm", "-rf", d])  # loaded: the mapping keeps the library
    P = ctypes.c_void_p
    lib.touch.argtypes = [P, P, ctypes.c_int64, ctypes.c_int64]
    lib.touch.restype = ctypes.c_uint64
    lib.advise.argtypes = [P, P, P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.advise.restype = ctypes.c_int64
    lib.advise_batched.argtypes = [P, P, P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.advise_batched.restype = ctypes.c_int64
    lib.read_runs.argtypes = [ctypes.c_int, P, P, P, P, ctypes.c_int64, ctypes.c_int64]
    lib.read_runs.restype = ctypes.c_int64
    return lib


# ---- record ----

def record(a: argparse.Namespace) -> None:
    import bench_spill
    from bench_scaling import _count

    from dbsp_core.trace import spill

    steps: list[dict] = []  # per step: {"used": [(path, pages)], "evict": [(path, pages or None)]}
    cur: dict = {"used": [], "evict": [], "gone": []}
    paths: dict[int, str] = {}  # id(mapping) -> its file's path
    sizes: dict[str, int] = {}
    orig_used, orig_evict = spill.BatchStore._pages_used, spill._evict

    def pages_used(self, b, f, hashes, rows):
        pages = orig_used(self, b, f, hashes, rows)
        paths[id(f.map)] = f.path
        sizes[f.path] = f.size
        cur["used"].append((f.path, np.asarray(pages, dtype=np.int64)))
        return pages

    def evict(ev):
        for m, pages in ev:
            p = paths.get(id(m))
            if p is not None:
                cur["evict"].append((p, None if pages is None else np.asarray(pages, dtype=np.int64)))
        return orig_evict(ev)

    orig_oldest = spill.BatchStore._evict_oldest

    def evict_oldest(self, cap):  # the pages the cache evicted (a whole-mapping drop's madvise names none of them)
        before = {k: c.copy() for k, c in self._resident.items()}
        out = orig_oldest(self, cap)
        for k, c in before.items():
            f = self._files.get(k)
            now = self._resident.get(k)
            if f is not None and now is not None:
                gone = np.flatnonzero((c != 0) & (now == 0))
                if len(gone):
                    cur["gone"].append((f.path, gone.astype(np.int64)))
        return out

    spill.BatchStore._pages_used = pages_used
    spill.BatchStore._evict_oldest = evict_oldest
    spill._evict = evict
    args = argparse.Namespace(load_step=_count(a.load_step), change=1000, auctions_step=_count(a.auctions_step))
    groups = _count(a.groups)
    p, rng, loaded = bench_spill.load(a.query, _count(a.state), groups, args, a.limit)
    store = p.executor.batch_store
    for f in store._files.values():
        sizes[f.path] = f.size
    for k in range(a.warmup + a.steps):
        cur["used"], cur["evict"], cur["gone"] = [], [], []
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        bench_spill.one_step(p, rng, a.query, groups, 1000, loaded, k)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        if k >= a.warmup:
            steps.append({"used": list(cur["used"]), "evict": list(cur["evict"]), "gone": list(cur["gone"]),
                          "cpu": (ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime) * 1e3,
                          "minflt": ru.ru_minflt - ru0.ru_minflt})
    cap = store.cache_cap() // PAGE
    real = {f.path: f for f in store._files.values()}
    _smaps_report(real)
    names = sorted(sizes)
    ix = {n: i for i, n in enumerate(names)}
    out: dict[str, np.ndarray] = {"sizes": np.array([sizes[n] for n in names], dtype=np.int64),
                                  "cap": np.array([cap]), "query": np.array([a.query]),
                                  "cpu": np.array([s["cpu"] for s in steps]),
                                  "minflt": np.array([s["minflt"] for s in steps])}
    for i, s in enumerate(steps):  # per step: used (file, page) pairs; evicted (file, page) pairs, page -1 = whole
        used = [np.stack([np.full(len(pg), ix[n]), pg]) for n, pg in s["used"]]
        out[f"u{i}"] = np.concatenate(used, axis=1) if used else np.zeros((2, 0), dtype=np.int64)
        ev = [np.stack([np.full(1 if pg is None else len(pg), ix[n]), np.array([-1]) if pg is None else pg])
              for n, pg in s["evict"]]
        out[f"e{i}"] = np.concatenate(ev, axis=1) if ev else np.zeros((2, 0), dtype=np.int64)
        g = [np.stack([np.full(len(pg), ix[n]), pg]) for n, pg in s["gone"]]
        out[f"g{i}"] = np.concatenate(g, axis=1) if g else np.zeros((2, 0), dtype=np.int64)
    np.savez_compressed(a.out, **out)
    u = [out[f"u{i}"].shape[1] for i in range(len(steps))]
    print(f"recorded {len(steps)} steps of {a.query}: {len(names)} files, {sum(sizes.values()) / 2**20:.0f} MiB; "
          f"pages used a step {np.mean(u):.0f}, the step's CPU {np.mean(out['cpu']):.2f} ms, minor faults "
          f"{np.mean(out['minflt']):.0f}; cache cap {cap * PAGE / 2**20:.0f} MiB", flush=True)
    if a.replay_rounds:  # the replay on the pipeline's own files (their page cache's folios as the store left them)
        live = [n for n in names if n in real and os.path.exists(n)]
        print(f"replay on the pipeline's own files ({len(live)} of {len(names)} still live)", flush=True)
        _replay(np.load(a.out), names, a.replay_rounds, a.replay_modes)
    p.close()


# ---- replay ----

def _runs(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first page, count) of each run of adjacent pages of sorted unique ``pages``."""
    if len(pages) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    first = pages[np.concatenate(([0], cut))]
    last = pages[np.append(cut - 1, len(pages) - 1)]
    return np.ascontiguousarray(first, dtype=np.int64), np.ascontiguousarray(last - first + 1, dtype=np.int64)


def _ptr(x: np.ndarray) -> int:
    return x.ctypes.data


def replay(a: argparse.Namespace) -> None:
    z = np.load(a.trace)
    sizes = z["sizes"]
    d = tempfile.mkdtemp(prefix="pread-micro-", dir=a.dir)
    paths = []
    block = os.urandom(8 << 20)
    used = set()
    for k in z.files:
        if k[0] in "ue" and k[1:].isdigit():
            used.update(int(f) for f in np.unique(z[k][0]))
    for i, n in enumerate(sizes):  # files of the recorded sizes, in the page cache (written, not dropped), written
        path = os.path.join(d, f"f{i}")  # in the pieces of --layout (the page cache's folios follow the writes)
        paths.append(path)
        if i not in used:  # no step reads it: not written (_replay skips a file that is not there)
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for at, ln in _pieces(int(n), a.layout):
                os.pwrite(fd, block[:ln], at)
        finally:
            os.close(fd)
    print(f"layout {a.layout}", flush=True)
    try:
        _replay(z, paths, a.rounds, a.modes)
    finally:
        subprocess.call(["rm", "-rf", d])


def _smaps_report(files: dict) -> None:
    """Per batch file mapped by the store: its mapping's Size, Rss and FilePmdMapped (/proc/self/smaps), its base's
    place in a 2 MiB unit; then a fresh mapping of each file probed: 256 random pages touched, one at a time (the
    faults and what they mapped: Rss / faults is the folio or fault-around size the page cache serves), dropped."""
    import mmap

    ent: dict[int, dict] = {}
    cur = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo = int(head[0].split("-")[0], 16)
                cur = ent.setdefault(lo, {})
            elif cur is not None and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                cur[head[0][:-1]] = int(head[1])
    lib = _lib()
    for path, f in sorted(files.items(), key=lambda kv: -kv[1].size):
        e = ent.get(f.base, {})
        fd = os.open(path, os.O_RDONLY)
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_RANDOM)
        base = np.frombuffer(m, dtype=np.uint8).ctypes.data
        npages = f.size // PAGE
        pages = np.sort(np.random.default_rng(1).choice(npages, min(2048, npages), replace=False)).astype(np.int64)
        ru0, t0 = resource.getrusage(RUSAGE_THREAD), time.perf_counter()
        lib.touch(base, _ptr(pages), len(pages), PAGE)
        ru1, t1 = resource.getrusage(RUSAGE_THREAD), time.perf_counter()
        e2 = _smaps_of(base)
        m.madvise(mmap.MADV_DONTNEED)
        ru2 = resource.getrusage(RUSAGE_THREAD)
        m.close()
        os.close(fd)
        flt = ru1.ru_minflt - ru0.ru_minflt
        print(f"  {os.path.basename(path)}: {f.size / 2**20:.0f} MiB, store's mapping at +{f.base % (2 << 20)} of a "
              f"2 MiB unit (fresh: +{base % (2 << 20)}), Rss {e.get('Rss', 0) / 1024:.1f} MiB, FilePmdMapped "
              f"{e.get('FilePmdMapped', 0) / 1024:.1f} MiB; probe: {len(pages)} pages, {flt} faults (major "
              f"{ru1.ru_majflt - ru0.ru_majflt}), mapped Rss {e2.get('Rss', 0) / 1024:.1f} MiB, PMD "
              f"{e2.get('FilePmdMapped', 0) / 1024:.1f} MiB ({e2.get('Rss', 0) / 4 / max(1, flt):.0f} pages a fault), "
              f"sys {(ru1.ru_stime - ru0.ru_stime) * 1e6 / max(1, flt):.2f} us a fault + user "
              f"{(ru1.ru_utime - ru0.ru_utime) * 1e6 / max(1, flt):.2f}, wall {(t1 - t0) * 1e6 / max(1, flt):.2f}, drop {(ru2.ru_stime - ru1.ru_stime) * 1e6:.0f} us",
              flush=True)


def _smaps_of(base: int) -> dict:
    out: dict = {}
    on = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                on = int(head[0].split("-")[0], 16) == base
            elif on and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                out[head[0][:-1]] = int(head[1])
    return out


def _replay(z, paths: list, rounds: int, modes_s: str) -> None:
    import mmap

    lib = _lib()
    sizes = z["sizes"]
    nsteps = sum(1 for k in z.files if k.startswith("u"))
    steps = []
    for i in range(nsteps):
        u, e, g = z[f"u{i}"], z[f"e{i}"], z[f"g{i}"]
        used = {int(f): np.unique(u[1, u[0] == f]) for f in np.unique(u[0])}
        ev = {int(f): (None if (e[1, e[0] == f] < 0).any() else np.unique(e[1, e[0] == f])) for f in np.unique(e[0])}
        gone = {int(f): np.unique(g[1, g[0] == f]) for f in np.unique(g[0])}
        steps.append((used, ev, gone))
    fds = [os.open(p, os.O_RDONLY) if os.path.exists(p) else -1 for p in paths]
    live = [i for i, fd in enumerate(fds) if fd >= 0]
    steps = [({f: p for f, p in u.items() if fds[f] >= 0}, {f: p for f, p in e.items() if fds[f] >= 0},
              {f: p for f, p in g.items() if fds[f] >= 0}) for u, e, g in steps]
    units = [sum(len(np.unique(p // (MAP_UNIT // PAGE))) for p in s[0].values()) for s in steps]
    npg = [sum(len(p) for p in s[0].values()) for s in steps]
    print(f"{z['query'][0]}: {nsteps} steps, {len(live)} files {sizes[live].sum() / 2**20:.0f} MiB, pages used a step "
          f"{np.mean(npg):.0f} in {np.mean(units):.0f} distinct 2 MiB units ({np.mean(npg) / max(1, np.mean(units)):.1f} "
          f"pages a unit), recorded step CPU {np.mean(z['cpu']):.2f} ms, minor faults {np.mean(z['minflt']):.0f}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    def open_maps(advice: int | None) -> list:
        out = []
        for i, fd in enumerate(fds):
            if fd < 0:
                out.append((None, 0))
                continue
            m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            if advice is not None:
                m.madvise(advice)
            out.append((m, np.frombuffer(m, dtype=np.uint8).ctypes.data))
        return out

    def run_mmap(advice: int | None, evict: bool, populate: bool = False, huge: int | None = None) -> tuple[float, ...]:
        ms = open_maps(advice)
        for m, _ in ms:  # a cold mapping, as a spilled batch's after a whole eviction
            if m is not None:
                if huge is not None:
                    m.madvise(huge)
                m.madvise(mmap.MADV_DONTNEED)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        ev_cpu = 0.0  # the evictions' share: CPU of this thread around them
        for used, ev, _gone in steps:
            for f, pages in used.items():
                if populate:  # map the step's pages in a system call per 1024 runs, before the reads
                    first, count = _runs(pages)
                    if lib.advise_batched(ms[f][1], _ptr(first), _ptr(count), len(first), PAGE, 22) < 0:
                        raise OSError("process_madvise(MADV_POPULATE_READ) refused")
                lib.touch(ms[f][1], _ptr(pages), len(pages), PAGE)
            e0 = resource.getrusage(RUSAGE_THREAD)
            if evict:
                for f, pages in ev.items():
                    if pages is None:
                        ms[f][0].madvise(mmap.MADV_DONTNEED)
                    else:
                        first, count = _runs(pages)
                        lib.advise(ms[f][1], _ptr(first), _ptr(count), len(first), PAGE, mmap.MADV_DONTNEED)
            e1 = resource.getrusage(RUSAGE_THREAD)
            ev_cpu += e1.ru_utime + e1.ru_stime - e0.ru_utime - e0.ru_stime
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        for m, _ in ms:
            if m is not None:
                m.close()
        return _per_step(ru0, ru, wall, nsteps) + (None, ev_cpu * 1e3 / nsteps)

    def run_pread(coalesce: bool) -> tuple[float, float, float]:
        # the pool: the pages the cache holds (per file, a slot per page held, -1 when not), slots from a free list;
        # sized for the cache's cap plus a step's pages (the store trims between steps)
        held = [np.full((int(n) + PAGE - 1) // PAGE, -1, dtype=np.int64) for n in sizes]
        nslots = int(z["cap"][0]) + 4 * max(sum(len(p) for p in s[0].values()) for s in steps)
        pool = np.zeros(nslots * PAGE, dtype=np.uint8)
        pool[::PAGE] = 1  # the pool's pages are the process's (touched once, as a long-lived pool's are)
        nxt = 0  # slots are taken round the pool (a run's pages take consecutive ones): which slot a page gets does
        syscalls = 0  # not change what a read costs, and the pool's pages are all resident
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for used, _ev, gone in steps:
            for f, pages in used.items():
                h = held[f]
                miss = pages[h[pages] < 0]
                if len(miss) == 0:
                    continue
                if coalesce:
                    first, count = _runs(miss)
                else:
                    first, count = np.ascontiguousarray(miss), np.ones(len(miss), dtype=np.int64)
                ends = np.cumsum(count)
                if nxt + int(ends[-1]) > nslots:
                    nxt = 0
                slots = np.ascontiguousarray(nxt + ends - count)
                nxt += int(ends[-1])
                got = lib.read_runs(fds[f], _ptr(pool), _ptr(first), _ptr(count), _ptr(slots), len(first), PAGE)
                if got < 0:
                    raise OSError("short read")
                syscalls += got
                h[miss] = 0
            for f, pages in gone.items():  # the pages the cache evicted free their slots: no system call
                held[f][pages] = -1
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        r = _per_step(ru0, ru, wall, nsteps)
        return r + (syscalls / nsteps,)

    modes = {"mmap-random": lambda: run_mmap(mmap.MADV_RANDOM, True),
             "mmap-normal": lambda: run_mmap(mmap.MADV_NORMAL, True),
             "mmap-keep": lambda: run_mmap(mmap.MADV_RANDOM, False),
             "populate": lambda: run_mmap(mmap.MADV_RANDOM, True, populate=True),
             "nohuge": lambda: run_mmap(mmap.MADV_RANDOM, True, huge=mmap.MADV_NOHUGEPAGE),
             "hugepage": lambda: run_mmap(mmap.MADV_RANDOM, True, huge=mmap.MADV_HUGEPAGE),
             "pread": lambda: run_pread(True),
             "pread-page": lambda: run_pread(False)}
    chosen = modes_s.split(",")
    res: dict[str, list] = {m: [] for m in chosen}
    for r in range(rounds):
        for m in chosen:
            x = modes[m]()
            res[m].append(x)
            extra = f", {x[4]:.0f} preads" if len(x) > 4 and x[4] is not None else ""
            extra += f", evictions {x[5]:.3f} ms" if len(x) > 5 else ""
            print(f"  round {r + 1} {m:12s}: CPU {x[0] + x[1]:.3f} ms a step (user {x[0]:.3f}, sys {x[1]:.3f}), "
                  f"wall {x[2]:.3f} ms, minor faults {x[3]:.0f}{extra}; load {os.getloadavg()[0]:.2f}", flush=True)
    for m in chosen:
        cpu = [x[0] + x[1] for x in res[m]]
        print(f"{m:12s}: CPU a step {min(cpu):.3f}-{max(cpu):.3f} ms over {rounds} rounds", flush=True)
    for fd in fds:
        if fd >= 0:
            os.close(fd)



def _pieces(n: int, layout: str) -> list[tuple[int, int]]:
    """(offset, length) of the writes that make a file of ``n`` bytes: "store" as batchfile.write_batch streams it
    (a 64-byte header, then pieces of STREAM_CHUNK from offset 64, then the header), "aligned" pieces of
    STREAM_CHUNK cut at multiples of 2 MiB of the file, "1m" 1 MiB writes from 0, "small" 16 KiB writes."""
    from dbsp_core.trace.batchfile import STREAM_CHUNK

    out = []
    if layout == "1m":
        return [(at, min(1 << 20, n - at)) for at in range(0, n, 1 << 20)]
    if layout == "small":  # 16 KiB writes: 16 KiB folios, as a file re-read a page at a time after reclaim
        return [(at, min(16384, n - at)) for at in range(0, n, 16384)]
    at = 64
    while at < n:
        ln = min(STREAM_CHUNK, n - at)
        if layout == "aligned":
            ln = min(ln, (at // (2 << 20) + 1) * (2 << 20) - at if at % (2 << 20) else ln)
        out.append((at, ln))
        at += ln
    return out + [(0, 64)]


def _per_step(ru0, ru, wall: float, n: int) -> tuple[float, float, float, float]:
    return ((ru.ru_utime - ru0.ru_utime) * 1e3 / n, (ru.ru_stime - ru0.ru_stime) * 1e3 / n, wall * 1e3 / n,
            (ru.ru_minflt - ru0.ru_minflt) / n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--query", default="distinct")
    r.add_argument("--state", default="10M")
    r.add_argument("--groups", default="10M")
    r.add_argument("--limit", default="100MiB")
    r.add_argument("--load-step", default="1M")
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--out", required=True)
    r.add_argument("--auctions-step", default="0")
    r.add_argument("--replay-rounds", type=int, default=0, help="then replay the steps on the pipeline's own files")
    r.add_argument("--replay-modes", default="mmap-random,mmap-keep,nohuge,populate,pread")
    p = sub.add_parser("replay")
    p.add_argument("trace")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="mmap-random,mmap-normal,mmap-keep,populate,pread,pread-page")
    p.add_argument("--layout", default="store", help="how the files are written (their page cache's folios): "
                   "store (4 MiB pieces from offset 64, as batchfile.write_batch), aligned (pieces cut at 2 MiB "
                   "multiples of the file), 1m (1 MiB writes), small (16 KiB writes)")
    p.add_argument("--dir", default=None, help="where the files go (default: the temporary directory)")
    a = ap.parse_args()
    record(a) if a.cmd == "record" else replay(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
