"""Benchmarks of the Z-set kernels against DuckDB (1 thread), pandas and numpy on the same data in the same run.

Usage: python bench/bench_zset.py [--scale 1.0] [--repeat 5] [--only consolidate_int64,...]

Prints one markdown table (median seconds, throughput in M rows/s, and the ratio of each peer's time to ours:
> 1 means we are faster), then the peak-memory and profile checks. Everything runs single-threaded.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa

pa.set_cpu_count(1)
pa.set_io_thread_count(1)

import duckdb  # noqa: E402
import pandas as pd  # noqa: E402

import dbsp_core as dbsp  # noqa: E402


def timeit(fn, repeat):
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def duck():
    con = duckdb.connect()
    con.execute("SET threads=1")
    return con


def case_consolidate_int64(n, repeat):
    rng = np.random.default_rng(1)
    k = rng.integers(0, n // 10, n)
    w = np.ones(n, np.int64)
    t = pa.table({"k": k})
    tw = pa.table({"k": k, "weight": w})
    con = duck()
    con.register("t", tw)
    df = tw.to_pandas()
    res = {
        "dbsp": timeit(lambda: dbsp.ZSet.from_arrow(t, weights=w).consolidate(), repeat),
        "duckdb": timeit(lambda: con.sql("SELECT k, SUM(weight) w FROM t GROUP BY k HAVING SUM(weight) <> 0").to_arrow_table(), repeat),
        "pandas": timeit(lambda: (lambda s: s[s != 0])(df.groupby("k", sort=False)["weight"].sum()), repeat),
        "numpy": timeit(lambda: (lambda u: np.bincount(u[1], weights=w))(np.unique(k, return_inverse=True)), repeat),
    }
    return f"consolidate {n/1e6:g}M rows, int64 key, {n//10/1e6:g}M distinct", n, res


def case_consolidate_str(n, repeat):
    rng = np.random.default_rng(2)
    k = rng.integers(0, n // 10, n)
    words = np.array([f"user-{i:05d}" for i in range(1000)], dtype=object)
    s = pa.array(words[rng.integers(0, 1000, n)], pa.string())
    w = np.ones(n, np.int64)
    t = pa.table({"k": k, "s": s})
    con = duck()
    con.register("t", t.append_column("weight", pa.array(w)))
    df = t.append_column("weight", pa.array(w)).to_pandas()
    res = {
        "dbsp": timeit(lambda: dbsp.ZSet.from_arrow(t, weights=w).consolidate(), repeat),
        "duckdb": timeit(lambda: con.sql("SELECT k, s, SUM(weight) w FROM t GROUP BY k, s HAVING SUM(weight) <> 0").to_arrow_table(), repeat),
        "pandas": timeit(lambda: (lambda r: r[r != 0])(df.groupby(["k", "s"], sort=False)["weight"].sum()), max(1, repeat // 2)),
    }
    return f"consolidate {n/1e6:g}M rows, (int64, utf8) key", n, res


def case_merge(n, repeat):
    rng = np.random.default_rng(3)
    half = n // 2
    a = dbsp.ZSet.from_arrow(pa.table({"k": rng.integers(0, n, half), "v": rng.integers(0, 100, half)})).consolidate()
    b = dbsp.ZSet.from_arrow(pa.table({"k": rng.integers(0, n, half), "v": rng.integers(0, 100, half)}),
                             weights=rng.choice([-1, 1], half)).consolidate()
    ta, tb = a.to_arrow(), b.to_arrow()
    con = duck()
    con.register("a", ta)
    con.register("b", tb)
    da, db_ = ta.to_pandas(), tb.to_pandas()
    ka, kb = (ta.column("k").to_numpy() * 128 + ta.column("v").to_numpy()), (tb.column("k").to_numpy() * 128 + tb.column("v").to_numpy())
    wa, wb = ta.column("weight").to_numpy(), tb.column("weight").to_numpy()

    def np_merge():
        keys = np.concatenate([ka, kb])
        u, inv = np.unique(keys, return_inverse=True)
        s = np.bincount(inv, weights=np.concatenate([wa, wb]))
        return u[s != 0]

    res = {
        "dbsp": timeit(lambda: a + b, repeat),
        "duckdb": timeit(lambda: con.sql("SELECT k, v, SUM(weight) w FROM (SELECT * FROM a UNION ALL SELECT * FROM b) "
                                         "GROUP BY k, v HAVING SUM(weight) <> 0").to_arrow_table(), repeat),
        "pandas": timeit(lambda: (lambda r: r[r != 0])(pd.concat([da, db_]).groupby(["k", "v"], sort=False)["weight"].sum()), repeat),
        "numpy": timeit(np_merge, repeat),
    }
    return (f"merge two consolidated {half/1e6:g}M-row batches (dbsp: the two sorted batches a trace keeps, merged; "
            f"peers: the union of the same rows regrouped)", n, res)


def case_merge_raw(n, repeat):
    """The merge row's equal-work twin: every side starts from the same raw rows (the union of the two batches,
    unsorted) and returns the consolidated sum."""
    rng = np.random.default_rng(3)
    half = n // 2
    ta = pa.table({"k": rng.integers(0, n, half), "v": rng.integers(0, 100, half)})
    tb = pa.table({"k": rng.integers(0, n, half), "v": rng.integers(0, 100, half)})
    wa, wb = np.ones(half, np.int64), rng.choice(np.array([-1, 1], np.int64), half)
    union = pa.concat_tables([ta, tb])
    w = np.concatenate([wa, wb])
    con = duck()
    con.register("u", union.append_column("weight", pa.array(w)))
    df = union.append_column("weight", pa.array(w)).to_pandas()
    key = union.column("k").to_numpy() * 128 + union.column("v").to_numpy()

    def np_merge():
        u, inv = np.unique(key, return_inverse=True)
        s = np.bincount(inv, weights=w)
        return u[s != 0]

    res = {
        "dbsp": timeit(lambda: dbsp.ZSet.from_arrow(union, weights=w).consolidate(), repeat),
        "duckdb": timeit(lambda: con.sql("SELECT k, v, SUM(weight) w FROM u GROUP BY k, v HAVING SUM(weight) <> 0")
                         .to_arrow_table(), repeat),
        "pandas": timeit(lambda: (lambda r: r[r != 0])(df.groupby(["k", "v"], sort=False)["weight"].sum()), repeat),
        "numpy": timeit(np_merge, repeat),
    }
    return f"consolidate the union of two {half/1e6:g}M-row batches from raw rows (equal work on every side)", n, res


def case_join(n, repeat):
    rng = np.random.default_rng(4)
    lt = pa.table({"k": rng.integers(0, n, n), "a": rng.integers(0, 1000, n)})
    rt = pa.table({"id": rng.integers(0, n, n), "b": rng.integers(0, 1000, n)})
    con = duck()
    con.register("l", lt)
    con.register("r", rt)
    dl, dr = lt.to_pandas(), rt.to_pandas()

    def ours():
        L = dbsp.ZSet.from_arrow(lt).index_by(["k"])
        R = dbsp.ZSet.from_arrow(rt).index_by(["id"])
        li, ri, w = L.join(R)
        out = pa.table({"k": L.zset.data.column("k").take(li), "a": L.zset.data.column("a").take(li),
                        "b": R.zset.data.column("b").take(ri)})
        return out, w

    L0 = dbsp.ZSet.from_arrow(lt).index_by(["k"])
    R0 = dbsp.ZSet.from_arrow(rt).index_by(["id"])

    def kernel_only():
        li, ri, w = L0.join(R0)
        return pa.table({"k": L0.zset.data.column("k").take(li), "a": L0.zset.data.column("a").take(li),
                         "b": R0.zset.data.column("b").take(ri)}), w

    nout = ours()[0].num_rows
    res = {
        "dbsp": timeit(ours, repeat),
        "duckdb": timeit(lambda: con.sql("SELECT l.k, l.a, r.b FROM l JOIN r ON l.k = r.id").to_arrow_table(), repeat),
        "pandas": timeit(lambda: dl.merge(dr, left_on="k", right_on="id"), repeat),
    }
    def hashed():
        zl, zr = dbsp.ZSet.from_arrow(lt), dbsp.ZSet.from_arrow(rt)
        li, ri, w = zl.join_rows(zr, ["k"], ["id"])
        return pa.table({"k": lt.column("k").take(li), "a": lt.column("a").take(li), "b": rt.column("b").take(ri)}), w

    res2 = dict(res, dbsp=timeit(kernel_only, repeat))
    res3 = dict(res, dbsp=timeit(hashed, repeat))
    return [(f"join {n/1e6:g}M x {n/1e6:g}M rows: index both + join + materialize {nout/1e6:.2f}M", 2 * n, res),
            (f"join {n/1e6:g}M x {n/1e6:g}M rows: join kernel on indexed inputs + materialize", 2 * n, res2),
            (f"join {n/1e6:g}M x {n/1e6:g}M rows: hash join of raw batches (join_rows) + materialize", 2 * n, res3)]


def case_group_sum(n, repeat):
    rng = np.random.default_rng(5)
    k = rng.integers(0, n // 10, n)
    v = rng.integers(0, 1000, n)
    t = pa.table({"k": k, "v": v})
    con = duck()
    con.register("t", t.append_column("weight", pa.array(np.ones(n, np.int64))))
    df = t.to_pandas()

    def ours():
        return dbsp.ZSet.from_arrow(t).aggregate(["k"], [("sum", "v")])

    def np_sum():
        u, inv = np.unique(k, return_inverse=True)
        return np.bincount(inv, weights=v)

    res = {
        "dbsp": timeit(ours, repeat),
        "duckdb": timeit(lambda: con.sql("SELECT k, SUM(v * weight) FROM t GROUP BY k").to_arrow_table(), repeat),
        "pandas": timeit(lambda: df.groupby("k", sort=False)["v"].sum(), repeat),
        "numpy": timeit(np_sum, repeat),
    }
    return f"group-sum {n/1e6:g}M rows, {n//10/1e6:g}M groups (hash aggregate)", n, res


CASES = {
    "consolidate_int64": (case_consolidate_int64, 10_000_000),
    "consolidate_str": (case_consolidate_str, 10_000_000),
    "merge": (case_merge, 10_000_000),
    "merge_raw": (case_merge_raw, 10_000_000),
    "join": (case_join, 1_000_000),
    "group_sum": (case_group_sum, 10_000_000),
}


_PEAK_CHILD = r"""
import sys, numpy as np, pyarrow as pa
pa.set_cpu_count(1)
import dbsp_core as dbsp
def rss(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
n = int(sys.argv[1])
k = np.random.default_rng(1).integers(0, n // 10, n)
w = np.ones(n, np.int64)
t = pa.table({'k': k})
z = dbsp.ZSet.from_arrow(t, weights=w)
base = rss('VmRSS')
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset VmHWM to the current RSS
c = z.consolidate()
print(rss('VmHWM') - base, k.nbytes + w.nbytes)
"""


def peak_memory(n):
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(n)], capture_output=True, text=True, check=True)
    extra, inp = map(int, out.stdout.split())
    return extra, inp


def profile_calls(n):
    """Python function calls made by one consolidate of n rows (constant in n means no per-row Python)."""
    t = pa.table({"k": np.random.default_rng(1).integers(0, max(1, n // 10), n)})
    z = dbsp.ZSet.from_arrow(t)
    pr = cProfile.Profile()
    pr.enable()
    z.consolidate()
    z.index_by(["k"]).reduce([("sum", "k"), ("min", "k")])
    pr.disable()
    return pstats.Stats(pr).total_calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every data size by this")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated case names: " + ",".join(CASES))
    args = ap.parse_args()
    names = [c for c in args.only.split(",") if c] or list(CASES)
    print(f"# dbsp_core {dbsp.__version__}, duckdb {duckdb.__version__}, pandas {pd.__version__}, "
          f"numpy {np.__version__}, pyarrow {pa.__version__}; {os.cpu_count()} cores, 1 thread each; "
          f"median of {args.repeat}")
    print()
    print("| case | dbsp s | dbsp M rows/s | DuckDB s | DuckDB/dbsp | pandas s | pandas/dbsp | numpy s | numpy/dbsp |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        fn, n = CASES[name]
        out = fn(int(n * args.scale), args.repeat)
        for label, nrows, res in (out if isinstance(out, list) else [out]):
            ours = res["dbsp"]
            cells = [label, f"{ours:.3f}", f"{nrows / ours / 1e6:.1f}"]
            for peer in ("duckdb", "pandas", "numpy"):
                if peer in res:
                    cells += [f"{res[peer]:.3f}", f"**{res[peer] / ours:.2f}x**"]
                else:
                    cells += ["-", "-"]
            print("| " + " | ".join(cells) + " |", flush=True)
    print()
    n = int(10_000_000 * args.scale)
    extra, inp = peak_memory(n)
    print(f"peak extra memory, consolidate {n/1e6:g}M int64 rows: {extra/2**20:.0f} MiB for {inp/2**20:.0f} MiB "
          f"of input (key + weights) = {extra/inp:.2f}x (target <= 3x)")
    small, big = profile_calls(100_000), profile_calls(1_000_000)
    print(f"python calls in consolidate + index + reduce: {small} at 100k rows, {big} at 1M rows "
          f"({'constant: no per-row Python' if abs(big - small) <= 5 else 'GROWS WITH ROWS'})")


if __name__ == "__main__":
    main()
