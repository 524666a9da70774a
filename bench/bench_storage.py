"""Storage benchmarks: StepLog durable appends vs SQLite WAL, and Database gets/commits vs LMDB and SQLite.

Every peer runs on the same data in the same process and directory, with the same durability:
  - StepLog: an append returns after fsync; SQLite: journal_mode=WAL, synchronous=FULL, one transaction per
    append (autocommit INSERT); 8 producers = 8 threads (SQLite: one connection per thread, busy_timeout).
  - Database: commit fsyncs data then the meta slot; LMDB: default sync=True, metasync=True; SQLite: WAL,
    synchronous=FULL, one transaction.
Each measurement is repeated (--repeat, default 3) and the median is reported, with ratios ours / peer
(throughput: higher is better; commit time: lower is better).

Usage: python bench/bench_storage.py [--dir DIR] [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import types

import lmdb

# Load dbsp_core.storage without the package __init__ (which imports the whole engine and pyarrow).
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "dbsp_core" not in sys.modules:
    _pkg = types.ModuleType("dbsp_core")
    _pkg.__path__ = [os.path.join(_root, "dbsp_core")]
    sys.modules["dbsp_core"] = _pkg
from dbsp_core.storage import Database, StepLog  # noqa: E402


def median_of(fn, repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


# ---------------------------------------------------------------- step log appends

def run_threads(n: int, fn) -> float:
    ths = [threading.Thread(target=fn, args=(t,)) for t in range(n)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return time.perf_counter() - t0


def steplog_appends(d: str, size: int, producers: int, per: int) -> float:
    """Appends per second."""
    p = os.path.join(d, "steplog")
    shutil.rmtree(p, ignore_errors=True)
    payload = os.urandom(size)
    with StepLog(p) as log:
        def work(t):
            for i in range(per):
                log.append(0, "in", payload, producer=f"p{t}", seq=i)
        el = run_threads(producers, work)
    shutil.rmtree(p, ignore_errors=True)
    return producers * per / el


def sqlite_appends(d: str, size: int, producers: int, per: int) -> float:
    p = os.path.join(d, "log.sqlite")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(p + suffix):
            os.unlink(p + suffix)
    c = sqlite3.connect(p)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("CREATE TABLE log (step INTEGER, handle TEXT, producer TEXT, seq INTEGER, payload BLOB)")
    c.commit()
    c.close()
    payload = os.urandom(size)

    def work(t):
        conn = sqlite3.connect(p, timeout=60, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous=FULL")
        for i in range(per):
            conn.execute("INSERT INTO log VALUES (?, ?, ?, ?, ?)", (0, "in", f"p{t}", i, payload))
        conn.close()

    el = run_threads(producers, work)
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(p + suffix):
            os.unlink(p + suffix)
    return producers * per / el


# ---------------------------------------------------------------- page store

def keys_of(n: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def load_all(d: str, keys: list[bytes], vsize: int):
    vals = [os.urandom(vsize) for _ in range(min(len(keys), 1000))]
    dbp = os.path.join(d, "db.dbsp")
    for f in (dbp,):
        if os.path.exists(f):
            os.unlink(f)
    db = Database(dbp, cache_pages=1 << 20)
    with db.open(0) as h:
        for i, k in enumerate(keys):
            h.put("t", k, vals[i % len(vals)])
        h.commit()
    lp = os.path.join(d, "db.lmdb")
    shutil.rmtree(lp, ignore_errors=True)
    env = lmdb.open(lp, map_size=4 << 30)
    with env.begin(write=True) as txn:
        for i, k in enumerate(keys):
            txn.put(k, vals[i % len(vals)])
    sp = os.path.join(d, "db.sqlite")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(sp + suffix):
            os.unlink(sp + suffix)
    sq = sqlite3.connect(sp, isolation_level=None)
    sq.execute("PRAGMA journal_mode=WAL")
    sq.execute("PRAGMA synchronous=FULL")
    sq.execute("PRAGMA cache_size=-1000000")
    sq.execute("CREATE TABLE t (k BLOB PRIMARY KEY, v BLOB) WITHOUT ROWID")
    sq.execute("BEGIN")
    sq.executemany("INSERT INTO t VALUES (?, ?)", ((k, vals[i % len(vals)]) for i, k in enumerate(keys)))
    sq.execute("COMMIT")
    return db, env, sq


def bench_gets(db, env, sq, keys: list[bytes], n: int, repeat: int) -> dict:
    rng = random.Random(7)
    probe = [rng.choice(keys) for _ in range(n)]
    h = db.open(max(db.versions()))

    def ours():
        get = h.get  # DatabaseHandle.get: Python wrapper -> Cython -> C, value copied into a new bytes
        t0 = time.perf_counter()
        for k in probe:
            get("t", k)
        return n / (time.perf_counter() - t0)

    def lm():
        with env.begin() as txn:
            get = txn.get
            t0 = time.perf_counter()
            for k in probe:
                get(k)
            return n / (time.perf_counter() - t0)

    def sl():
        cur = sq.cursor()
        t0 = time.perf_counter()
        for k in probe:
            cur.execute("SELECT v FROM t WHERE k=?", (k,)).fetchone()
        return n / (time.perf_counter() - t0)

    for f in (ours, lm, sl):  # warm caches
        f()
    res = {"ours": median_of(ours, repeat), "lmdb": median_of(lm, repeat), "sqlite": median_of(sl, repeat)}
    h.close()
    return res


def bench_commit(db, env, sq, keys: list[bytes], nupd: int, vsize: int, repeat: int) -> dict:
    """Median seconds of the commit call after updating nupd random keys (puts not timed); ours also reports pages."""
    rng = random.Random(11)
    out = {"ours": [], "lmdb": [], "sqlite": [], "pages": []}
    for r in range(repeat):
        upd = [(rng.choice(keys), os.urandom(vsize)) for _ in range(nupd)]
        v = max(db.versions())
        h = db.open(v)
        for k, val in upd:
            h.put("t", k, val)
        t0 = time.perf_counter()
        h.commit()
        out["ours"].append(time.perf_counter() - t0)
        out["pages"].append(db.stats()["last_commit_pages"])
        txn = env.begin(write=True)
        for k, val in upd:
            txn.put(k, val)
        t0 = time.perf_counter()
        txn.commit()
        out["lmdb"].append(time.perf_counter() - t0)
        sq.execute("BEGIN")
        sq.executemany("INSERT OR REPLACE INTO t VALUES (?, ?)", upd)
        t0 = time.perf_counter()
        sq.execute("COMMIT")
        out["sqlite"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir next to the repo)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    a = ap.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="bench_storage_", dir=_root)
    os.makedirs(d, exist_ok=True)
    q = 4 if a.quick else 1
    rows = []

    print(f"# Storage benchmarks ({os.cpu_count()} cores, dir {d}, repeat {a.repeat}, median)")
    print("\n## StepLog appends, durable on ack (appends/s; ratio = ours / SQLite WAL synchronous=FULL)")
    for size, per1 in ((1024, 1500 // q), (65536, 400 // q)):
        for producers in (1, 8):
            per = per1 if producers == 1 else max(per1 // 4, 10)
            o, s_ = [], []
            for _ in range(a.repeat):  # interleaved, so both see the same disk and load
                o.append(steplog_appends(d, size, producers, per))
                s_.append(sqlite_appends(d, size, producers, per))
            ours, peer = statistics.median(o), statistics.median(s_)
            line = (f"| append {size // 1024} KB | {producers} producer{'s' if producers > 1 else ''} | "
                    f"{ours:,.0f}/s | SQLite {peer:,.0f}/s | {ours / peer:.2f}x |")
            print(line)
            rows.append(line)

    n = 200_000 // q
    print(f"\n## Database: {n:,} keys (16 B keys, 100 B values), random gets from Python (gets/s)")
    keys = keys_of(n)
    db, env, sq = load_all(d, keys, 100)
    g = bench_gets(db, env, sq, keys, 200_000 // q, a.repeat)
    for peer in ("lmdb", "sqlite"):
        line = f"| random get | {n:,} keys | {g['ours']:,.0f}/s | {peer} {g[peer]:,.0f}/s | {g['ours'] / g[peer]:.2f}x |"
        print(line)
        rows.append(line)

    print("\n## Database commit after updating N random keys (commit call only; ms; ratio = peer time / ours)")
    for nupd, vsize in ((10_000 // q, 3000), (2_000 // q, 100)):
        c = bench_commit(db, env, sq, keys, nupd, vsize, a.repeat)
        for peer in ("lmdb", "sqlite"):
            line = (f"| commit {nupd:,} updates ({vsize} B values, {c['pages']:,.0f} dirty pages) | {n:,} keys | "
                    f"{c['ours'] * 1e3:.1f} ms | {peer} {c[peer] * 1e3:.1f} ms | {c[peer] / c['ours']:.2f}x |")
            print(line)
            rows.append(line)
    db.close()
    env.close()
    sq.close()

    print(f"\n## Commit cost vs database size (same {2_000 // q:,} x 100 B updates)")
    for size in (20_000 // q, 400_000 // q):
        ks = keys_of(size, seed=size)
        db, env, sq = load_all(d, ks, 100)
        c = bench_commit(db, env, sq, ks, 2_000 // q, 100, a.repeat)
        line = (f"| commit {2_000 // q:,} updates | {size:,} keys | {c['ours'] * 1e3:.1f} ms | "
                f"{c['pages']:,.0f} dirty pages | lmdb {c['lmdb'] * 1e3:.1f} ms, sqlite {c['sqlite'] * 1e3:.1f} ms |")
        print(line)
        rows.append(line)
        db.close()
        env.close()
        sq.close()
    if not a.dir:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
