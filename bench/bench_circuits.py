"""Circuit benchmarks: (a) 1k-row changes against 1M-row state vs DuckDB recompute, (b) 10M rows in 100k-row steps through join then aggregate vs DuckDB and pandas, (c) W=2 vs W=1.

Run from the repository root:  python bench/bench_circuits.py  (``--quick`` for a smaller smoke run).
Every number comes from the same data in the same run; medians of repeated measurements are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])


def bids_table(rng: np.random.Generator, n: int, n_auctions: int) -> pa.Table:
    return pa.table({"auction": rng.integers(0, n_auctions, n), "bidder": rng.integers(0, 1000, n),
                     "price": rng.integers(1, 10_000, n)}, schema=BIDS)


def auctions_table(n: int, n_categories: int) -> pa.Table:
    ids = np.arange(n)
    return pa.table({"id": ids, "category": ids % n_categories}, schema=AUCTIONS)


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def p99_ms(xs: list[float]) -> float:
    """The 99th percentile (nearest rank) in ms: with 100 steps, the second largest."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, -(-99 * len(ys) // 100) - 1))] * 1e3


# ---------------------------------------------------------------- (a)

QUERIES_A = {  # name: (circuit, DuckDB query); every bid's auction exists except in left_join's data (below)
    # no operator: the input straight to the output, i.e. what a step costs before any operator runs (the pushes,
    # their concatenation, the consolidated output); DuckDB copies the table
    "passthrough": (lambda b, a: b, "SELECT * FROM bids"),
    "group_by-count": (lambda b, a: b.group_by("auction").agg(n=dbsp.count()),
                       "SELECT auction, COUNT(*) AS n FROM bids GROUP BY auction"),
    "group_by-sum": (lambda b, a: b.group_by("auction").agg(total=dbsp.sum("price")),
                     "SELECT auction, SUM(price) AS total FROM bids GROUP BY auction"),
    "group_by-avg": (lambda b, a: b.group_by("auction").agg(m=dbsp.avg("price")),
                     "SELECT auction, AVG(price) AS m FROM bids GROUP BY auction"),
    "group_by-min-max": (lambda b, a: b.group_by("auction").agg(lo=dbsp.min("price"), hi=dbsp.max("price")),
                         "SELECT auction, MIN(price) AS lo, MAX(price) AS hi FROM bids GROUP BY auction"),
    "join": (lambda b, a: b.join(a, left_on="auction", right_on="id"),
             "SELECT * FROM bids JOIN auctions ON bids.auction = auctions.id"),
    "left_join": (lambda b, a: b.left_join(a, left_on="auction", right_on="id"),
                  "SELECT * FROM bids LEFT JOIN auctions ON bids.auction = auctions.id"),
    "distinct": (lambda b, a: b.select(auction="auction", bidder="bidder").distinct(),
                 "SELECT DISTINCT auction, bidder FROM bids"),
    "join-group_by": (lambda b, a: b.join(a, left_on="auction", right_on="id").group_by("category").agg(
                          n=dbsp.count(), total=dbsp.sum("price")),
                      "SELECT category, COUNT(*) AS n, SUM(price) AS total FROM bids JOIN auctions "
                      "ON bids.auction = auctions.id GROUP BY category"),
}
SPARSE_AUCTIONS = {"left_join"}  # one auction in ten is missing, so a tenth of the bids have no partner


def bench_a(state_rows: int, change_rows: int, steps: int, workers: int = 1, only: set[str] | None = None,
            background_merge: bool | None = None) -> list[dict]:
    """Per-step latency of a ``change_rows`` change (90% inserts, 10% deletions of existing rows) against
    ``state_rows`` rows of state, then DuckDB recomputing the view over the same data after each change."""
    results = []
    n_auctions = state_rows // 10
    for name, (build, sql) in QUERIES_A.items():
        if only and name not in only:
            continue
        rng = np.random.default_rng(1)
        base = bids_table(rng, state_rows, n_auctions)
        auctions = auctions_table(n_auctions, 1000)
        if name in SPARSE_AUCTIONS:
            auctions = auctions.filter(pa.array(np.arange(n_auctions) % 10 != 0))
        changes = []
        for i in range(steps):
            ins = bids_table(rng, change_rows - change_rows // 10, n_auctions)
            dels = base.slice(i * (change_rows // 10), change_rows // 10)
            changes.append((ins, dels))
        c = dbsp.Circuit()
        b, a = c.input("bids", BIDS), c.input("auctions", AUCTIONS)
        c.output("v", build(b, a))
        ours, ours_cpu, ours_thr = [], [], []  # wall; CPU of the process (the step's thread and the merge thread);
        # CPU of the step's thread alone (W = 1: the worker runs on it), which the merge thread's work does not move
        with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(background_merge=background_merge)) as p:
            p.push("bids", base)
            p.push("auctions", auctions)
            t0 = time.perf_counter()
            p.step()
            load_s = time.perf_counter() - t0
            for ins, dels in changes:
                c0, h0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                p.push("bids", ins)
                p.push("bids", dels, weights=np.full(dels.num_rows, -1))
                p.step()
                ours.append(time.perf_counter() - t0)
                ours_cpu.append(time.process_time() - c0)
                ours_thr.append(time.thread_time() - h0)
        con = duckdb.connect()
        con.execute("CREATE TABLE bids AS SELECT * FROM base")
        con.execute("CREATE TABLE auctions AS SELECT * FROM auctions")
        theirs = []
        for i, (ins, dels) in enumerate(changes):  # apply the same change, then time the recompute
            con.execute("INSERT INTO bids SELECT * FROM ins")
            con.execute(f"DELETE FROM bids WHERE rowid >= {i * (change_rows // 10)} "
                        f"AND rowid < {(i + 1) * (change_rows // 10)}")
            t0 = time.perf_counter()
            con.execute(f"CREATE OR REPLACE TABLE v AS {sql}")
            theirs.append(time.perf_counter() - t0)
        con.close()
        results.append({"query": name, "ours_ms": median_ms(ours), "duckdb_ms": median_ms(theirs),
                        "speedup": statistics.median(theirs) / statistics.median(ours), "load_s": load_s,
                        "ours_mean_ms": statistics.fmean(ours) * 1e3, "ours_p99_ms": p99_ms(ours),
                        "ours_max_ms": max(ours) * 1e3, "ours_cpu_mean_ms": statistics.fmean(ours_cpu) * 1e3,
                        "ours_thread_cpu_mean_ms": statistics.fmean(ours_thr) * 1e3,
                        "duckdb_mean_ms": statistics.fmean(theirs) * 1e3,
                        "speedup_mean": statistics.fmean(theirs) / statistics.fmean(ours)})
        r = results[-1]
        print(f"(a) {name:>13}: step {r['ours_ms']:8.2f} ms | DuckDB recompute {r['duckdb_ms']:8.2f} ms | "
              f"{r['speedup']:7.1f}x  (initial load of {state_rows} rows: {load_s:.2f} s)", flush=True)
        print(f"    {'':>13}  over {len(ours)} steps: mean {r['ours_mean_ms']:.2f} ms, p99 {r['ours_p99_ms']:.2f} ms, "
              f"max {r['ours_max_ms']:.2f} ms, CPU mean {r['ours_cpu_mean_ms']:.2f} ms (step thread "
              f"{r['ours_thread_cpu_mean_ms']:.2f}) | "
              f"DuckDB mean {r['duckdb_mean_ms']:.2f} ms | by means {r['speedup_mean']:.1f}x", flush=True)
    return results


# ---------------------------------------------------------------- (b), (c)

def join_agg_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    b, a = c.input("bids", BIDS), c.input("auctions", AUCTIONS)
    j = b.join(a, left_on="auction", right_on="id")
    c.output("v", j.group_by("category").agg(n=dbsp.count(), total=dbsp.sum("price")))
    return c


def group_by_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("v", b.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price")))
    return c


C_CIRCUITS = {"join-group_by": join_agg_circuit, "group_by": group_by_circuit}  # (c)'s circuits, by name


JOIN_AGG_SQL = ("SELECT category, COUNT(*) AS n, SUM(price) AS total FROM bids JOIN auctions "
                "ON bids.auction = auctions.id GROUP BY category")


def make_stream(total_rows: int, step_rows: int, n_auctions: int) -> list[pa.Table]:
    rng = np.random.default_rng(2)
    return [bids_table(rng, step_rows, n_auctions) for _ in range(total_rows // step_rows)]


def run_ours(batches: list[pa.Table], auctions: pa.Table, workers: int, background_merge: bool | None = False,
             circuit: str = "join-group_by") -> tuple[float, list[float], float, list[float]]:
    """Wall time, per-step times, process CPU time and per-worker CPU time of the run of ``circuit`` (a name of
    C_CIRCUITS; the join-aggregate by default). Merges run on the workers' threads unless ``background_merge``
    (None: the default rule, a merge thread while the workers leave a core free), so that W workers use W cores
    and (c) compares like with like."""
    c = C_CIRCUITS[circuit]()
    with dbsp.Pipeline(c, workers=workers, executor=EmbeddedExecutor(background_merge=background_merge)) as p:
        p.executor.measure_cpu = True  # per-worker CPU time for (c); 2 clock reads per worker and 100k-row step
        if "auctions" in c.inputs:
            p.push("auctions", auctions)
        p.step()
        per_step = []
        cpu0 = time.process_time()
        worker0 = list(p.executor.worker_cpu_seconds)
        t_start = time.perf_counter()
        for bt in batches:
            t0 = time.perf_counter()
            p.push("bids", bt)
            p.step()
            per_step.append(time.perf_counter() - t0)
        p.executor.settle_merges()  # merges handed to the merge thread and not done yet are work of this run
        wall = time.perf_counter() - t_start
        return wall, per_step, time.process_time() - cpu0, [b - a for a, b in zip(worker0, p.executor.worker_cpu_seconds)]


def parallel_control(rows: int = 1_000_000, reps: int = 3) -> float:
    """Speedup of two threads over one on a pure GIL-free kernel (index_by): what this machine offers right now."""
    import threading

    rng = np.random.default_rng(3)
    zs = [dbsp.ZSet.from_arrow(pa.table({"a": rng.integers(0, rows, rows), "b": rng.integers(0, 9, rows)}))
          for _ in range(2)]

    def work(z: dbsp.ZSet) -> None:
        for _ in range(reps):
            z.index_by(["a"])

    t0 = time.perf_counter()
    for z in zs:
        work(z)
    seq = time.perf_counter() - t0
    threads = [threading.Thread(target=work, args=(z,)) for z in zs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seq / (time.perf_counter() - t0)


def sampled_recompute(batches: list[pa.Table], auctions: pa.Table, samples: int | None
                      ) -> tuple[float, float, float]:
    """Total time to recompute the view after every step, for DuckDB and pandas: measured at every step
    (``samples`` None), or estimated from ``samples`` evenly spaced steps (time per step is linear in the rows
    so far); also pandas on all rows once."""
    n = len(batches)
    at = list(range(n)) if samples is None else sorted(set(np.linspace(0, n - 1, samples).astype(int).tolist()))
    con = duckdb.connect()
    con.execute("CREATE TABLE auctions AS SELECT * FROM auctions")
    con.execute("CREATE TABLE bids (auction BIGINT, bidder BIGINT, price BIGINT)")
    adf = auctions.to_pandas()
    duck, pand = [], []
    frames = []
    for i, bt in enumerate(batches):
        con.execute("INSERT INTO bids SELECT * FROM bt")
        frames.append(bt)
        if i in at:
            t0 = time.perf_counter()
            con.execute(f"CREATE OR REPLACE TABLE v AS {JOIN_AGG_SQL}")
            duck.append(time.perf_counter() - t0)
            df = pa.concat_tables(frames).to_pandas()
            t0 = time.perf_counter()
            df.merge(adf, left_on="auction", right_on="id").groupby("category").agg(
                n=("price", "size"), total=("price", "sum"))
            pand.append(time.perf_counter() - t0)
    con.close()
    # sum the per-step times over all steps, interpolating linearly between the sampled steps
    steps = np.arange(n)
    duck_total = float(np.interp(steps, at, duck).sum())
    pand_total = float(np.interp(steps, at, pand).sum())
    return duck_total, pand_total, pand[-1]


def bench_b_c(total_rows: int, step_rows: int, samples: int) -> dict:
    n_auctions = 100_000
    auctions = auctions_table(n_auctions, 1000)
    batches = make_stream(total_rows, step_rows, n_auctions)
    res = {}
    run_ours(batches[:len(batches) // 3], auctions, 1)  # untimed warm-up: the first run in a process pays for
    # growing the heap (page faults), 30-45% of a W=1 run's time, which made (c) look better than it is
    for w, bgm in ((1, False), (2, False), ("1+merge thread", True)):
        total, per_step, cpu, wcpu = run_ours(batches, auctions, 1 if w == "1+merge thread" else w, bgm)
        res[w] = (total, per_step, cpu, wcpu)
        cores = 2 if w == 2 else 1
        print(f"(b) W={w}: {total_rows} rows in {len(batches)} steps: {total:.2f} s, "
              f"{total_rows / total / 1e6:.2f} M rows/s, {total_rows / total / cores / 1e6:.2f} M rows/s/worker, "
              f"median step {median_ms(per_step):.1f} ms, CPU {cpu:.2f} s"
              + ("  (merges on a merge thread: the default while a core is free)" if bgm else ""), flush=True)
    duck_total, pand_total, pand_once = sampled_recompute(batches, auctions, samples)
    ours1 = res[1][0]
    how = "measured at every step" if samples is None else f"est. from {samples} samples"
    print(f"(b) DuckDB recompute after every step ({how}): {duck_total:.1f} s total, "
          f"{total_rows / duck_total / 1e6:.3f} M rows/s; ours W=1 is {duck_total / ours1:.1f}x faster", flush=True)
    print(f"(b) pandas recompute after every step ({how}): {pand_total:.1f} s total, "
          f"{total_rows / pand_total / 1e6:.3f} M rows/s; ours W=1 is {pand_total / ours1:.1f}x faster", flush=True)
    print(f"(b) pandas once over all {total_rows} rows: {pand_once:.2f} s = {total_rows / pand_once / 1e6:.2f} M rows/s "
          f"(not incremental; for scale)", flush=True)
    speedup = res[1][0] / res[2][0]
    control = parallel_control()
    bound = sum(res[1][3]) / max(res[2][3])
    print(f"(c) W=2 vs W=1 throughput (merges on the workers' threads in both): {speedup:.2f}x; CPU seconds W=2/W=1: {res[2][2] / res[1][2]:.2f}; "
          f"worker CPU seconds W=1 {['%.2f' % x for x in res[1][3]]}, W=2 {['%.2f' % x for x in res[2][3]]} "
          f"-> at most {bound:.2f}x on two idle cores; control (2 threads of a GIL-free kernel vs 1, same moment): "
          f"{control:.2f}x", flush=True)
    return {"ours": {w: r[0] for w, r in res.items()}, "duckdb": duck_total, "pandas": pand_total,
            "pandas_once": pand_once, "w2_speedup": speedup, "control": control, "idle_bound": bound}


def bench_c_alternating(total_rows: int, step_rows: int, rounds: int, circuit: str = "join-group_by") -> list[float]:
    """(c) alone: W=1 and W=2 (merges on the workers' threads) alternated ``rounds`` times over the same stream
    in one process after a warm-up; prints each round's ratio, median step times, the control and the median."""
    n_auctions = 100_000
    auctions = auctions_table(n_auctions, 1000)
    batches = make_stream(total_rows, step_rows, n_auctions)
    run_ours(batches[:len(batches) // 3], auctions, 1, circuit=circuit)  # warm-up (see bench_b_c)
    ratios = []
    print(f"(c) {circuit}: {total_rows} rows in steps of {step_rows}", flush=True)
    for r in range(rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        res = {w: run_ours(batches, auctions, w, circuit=circuit) for w in order}
        t = {w: v[0] for w, v in res.items()}
        control = parallel_control()
        ratios.append(t[1] / t[2])
        print(f"(c) round {r + 1}: W=1 {t[1]:.2f} s (median step {median_ms(res[1][1]):.1f} ms), W=2 {t[2]:.2f} s "
              f"(median step {median_ms(res[2][1]):.1f} ms) -> {ratios[-1]:.2f}x (control {control:.2f}x, "
              f"load {os.getloadavg()[0]:.2f}); worker CPU s W=1 {['%.2f' % x for x in res[1][3]]}, "
              f"W=2 {['%.2f' % x for x in res[2][3]]}", flush=True)
    print(f"(c) W=2 / W=1 over {rounds} alternating rounds: median {statistics.median(ratios):.2f}x, "
          f"range {min(ratios):.2f}x-{max(ratios):.2f}x", flush=True)
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--only", choices=["a", "bc", "c"], default=None,
                    help="c: only (c), W=1 and W=2 alternated --rounds times (no peers)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --only c")
    ap.add_argument("--circuit", choices=list(C_CIRCUITS), default="join-group_by", help="the circuit of --only c")
    ap.add_argument("--step-rows", type=int, default=None, help="rows per step of (b) and (c) (default 100,000)")
    ap.add_argument("--total-rows", type=int, default=None, help="rows of (b) and (c) (default 10M, quick 1M)")
    ap.add_argument("--queries", default=None, help=f"comma-separated subset of (a): {','.join(QUERIES_A)}")
    ap.add_argument("--background-merge", choices=["auto", "on", "off"], default="auto",
                    help="(a): merges on a merge thread (on), on the worker's thread (off), or the default rule")
    ap.add_argument("--steps", type=int, default=None, help="steps of (a) per query (default 200, quick 20)")
    ap.add_argument("--state-rows", type=int, default=None,
                    help="rows of state of (a) (default 1,000,000, quick 100,000; auctions are a tenth of it)")
    args = ap.parse_args(argv)
    state, change, steps_a = (100_000, 1_000, 20) if args.quick else (1_000_000, 1_000, 200)
    if args.state_rows is not None:
        need = (args.steps or steps_a) * (change // 10)  # every step deletes a tenth of its change from the load
        if args.state_rows < need:
            ap.error(f"--state-rows must be at least {need}: each step deletes {change // 10} loaded rows")
        state = args.state_rows
    total, step_rows, samples = (1_000_000, 100_000, None) if args.quick else (10_000_000, 100_000, None)
    total, step_rows = args.total_rows or total, args.step_rows or step_rows
    threads = duckdb.execute("SELECT current_setting('threads')").fetchone()[0]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; dbsp_core "
          f"{dbsp.__version__}; duckdb {duckdb.__version__} ({threads} threads); pandas {pd.__version__}; "
          f"pyarrow {pa.__version__}", flush=True)
    if args.only in (None, "a"):
        only = set(args.queries.split(",")) if args.queries else None
        unknown = sorted((only or set()) - set(QUERIES_A))
        if unknown:
            ap.error(f"unknown --queries {unknown}; known: {list(QUERIES_A)}")
        bench_a(state, change, args.steps or steps_a, only=only,
                background_merge={"auto": None, "on": True, "off": False}[args.background_merge])
    if args.only in (None, "bc"):
        bench_b_c(total, step_rows, samples)
    if args.only == "c":
        bench_c_alternating(total, step_rows, args.rounds, args.circuit)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
