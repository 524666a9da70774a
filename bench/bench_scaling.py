"""Step latency against state size: 1k-row steps into group-by, join and distinct holding 1M to 100M rows of state, mean and p99 over consecutive steps (merges included).

Run from the repository root (the big sizes need memory: the join keeps every bid, about 50 bytes a row in its
trace and up to twice that while its largest merge runs, so 100M rows want ~10 GB; and they take minutes to load):

    python bench/bench_scaling.py                                  # every query at 1M:100k,10M:1M,50M:5M,100M:10M
    python bench/bench_scaling.py --sizes 1M:100k,10M:5M,20M:5M,50M:5M --queries group_by
    python bench/bench_scaling.py --sizes 200k:20k,1M:100k --steps 100 --quick   # a check that it runs

A size ``STATE:GROUPS`` loads STATE bids (auction, bidder, price) in ``--load-step``-row steps through the circuit
(vectorized numpy data, one push per step), over GROUPS auctions: the groups of the group-by, the auctions the
join probes (GROUPS rows on the other side) and the distinct (auction, bidder) pairs of the distinct. Then
``--warmup`` unmeasured steps and ``--steps`` measured ones, each ``--change`` rows: 90% new bids and 10%
deletions of loaded ones, pushed and stepped, timed with ``perf_counter`` around push and step. Each line
prints the step time's mean, p50, p99 and max, and the trace merge work of the measured steps (input rows
merged per step, counted by the traces: load-independent), and each size's mean and p99 as a ratio to the
first size's (the target: every size within 2x of the 1M figure). ``--queries join_group_by``: the join then
``GROUP BY category`` (count, sum of price) of bench_circuits (a), over the same auctions (1000 categories);
``group_by_min_max``: (a)'s ``GROUP BY auction`` MIN and MAX of price; ``group_by_avg``: its AVG of price;
``left_join``: its left join (one auction in ten missing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])
BIDDERS_PER_AUCTION = 10  # distinct: GROUPS pairs = GROUPS / 10 auctions x 10 bidders


def _count(s: str) -> int:
    """'100k' -> 100000, '1M' -> 1000000, '2.5M' -> 2500000."""
    s = s.strip()
    mult = {"k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def bids(rng: np.random.Generator, n: int, query: str, groups: int) -> pa.Table:
    """n random bids: auctions over the query's key domain (``groups`` keys)."""
    if query == "distinct":
        auction = rng.integers(0, max(groups // BIDDERS_PER_AUCTION, 1), n)
        bidder = rng.integers(0, BIDDERS_PER_AUCTION, n)
    else:
        auction, bidder = rng.integers(0, groups, n), rng.integers(0, 1000, n)
    return pa.table({"auction": auction, "bidder": bidder, "price": rng.integers(1, 10_000, n)}, schema=BIDS)


QUERIES = ("group_by", "join", "distinct", "join_group_by", "group_by_min_max", "group_by_avg", "passthrough",
           "left_join", "group_by_count", "group_by_sum")
JOINED = ("join", "join_group_by", "left_join")  # the queries that read auctions


def auctions(query: str, groups: int) -> pa.Table:
    """The auctions a joined query reads: every id below ``groups``, less one in ten for ``left_join`` (so a tenth
    of the bids have no partner, as in bench_circuits (a))."""
    ids = np.arange(groups)
    if query == "left_join":
        ids = ids[ids % 10 != 0]
    return pa.table({"id": ids, "category": ids % 1000}, schema=AUCTIONS)


def circuit(query: str) -> dbsp.Circuit:
    c = dbsp.Circuit()
    b, a = c.input("bids", BIDS), c.input("auctions", AUCTIONS)
    if query == "group_by":
        v = b.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price"))
    elif query == "join":
        v = b.join(a, left_on="auction", right_on="id")
    elif query == "group_by_count":  # bench_circuits (a)'s group-by count
        v = b.group_by("auction").agg(n=dbsp.count())
    elif query == "group_by_sum":  # bench_circuits (a)'s group-by sum
        v = b.group_by("auction").agg(total=dbsp.sum("price"))
    elif query == "group_by_avg":  # bench_circuits (a)'s group-by avg
        v = b.group_by("auction").agg(m=dbsp.avg("price"))
    elif query == "group_by_min_max":  # bench_circuits (a)'s group-by min+max
        v = b.group_by("auction").agg(lo=dbsp.min("price"), hi=dbsp.max("price"))
    elif query == "join_group_by":  # bench_circuits (a)'s join then group-by
        v = b.join(a, left_on="auction", right_on="id").group_by("category").agg(n=dbsp.count(),
                                                                                 total=dbsp.sum("price"))
    elif query == "left_join":  # bench_circuits (a)'s left join
        v = b.left_join(a, left_on="auction", right_on="id")
    elif query == "passthrough":  # bench_circuits (a)'s pass-through: the per-step floor
        v = b
    else:
        v = b.select(auction="auction", bidder="bidder").distinct()
    c.output("v", v)
    return c


def merged_rows(p: dbsp.Pipeline) -> int:
    return sum(t.merged_rows for w in range(p.workers) for t in p.traces(w).values())


def run(query: str, state: int, groups: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(7)
    bgm = {"auto": None, "on": True, "off": False}[args.background_merge]
    p = dbsp.Pipeline(circuit(query), workers=args.workers, executor=EmbeddedExecutor(background_merge=bgm))
    dels_per_step = args.change // 10
    t0 = time.perf_counter()
    if query in JOINED:
        p.push("auctions", auctions(query, groups))
    pool = None  # loaded bids kept for deletion (a prefix of the first load step)
    loaded = 0
    while loaded < state:
        n = min(args.load_step, state - loaded)
        t = bids(rng, n, query, groups)
        if pool is None:
            pool = t.slice(0, min(n, dels_per_step * (args.warmup + args.steps)))
        p.push("bids", t)
        p.step()
        loaded += n
    settle_s = 0.0
    if args.settle:  # the load's merges the merge thread has not finished yet: counted in the load time, and
        t1 = time.perf_counter()  # reported apart (with --no-settle they run during the measured steps)
        p.executor.settle_merges()
        settle_s = time.perf_counter() - t1
    load_s = time.perf_counter() - t0
    neg = np.full(dels_per_step, -1, dtype=np.int64)
    times, merges = [], []
    for i in range(args.warmup + args.steps):
        ins = bids(rng, args.change - dels_per_step, query, groups)
        dels = pool.slice(i * dels_per_step, dels_per_step)
        m0 = merged_rows(p)
        t0 = time.perf_counter()
        p.push("bids", ins)
        if dels.num_rows:
            p.push("bids", dels, weights=neg[:dels.num_rows])
        p.step()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
            merges.append(merged_rows(p) - m0)
    if args.verbose:
        for w in range(p.workers):
            for name, t in p.traces(w).items():
                print(f"    worker {w} {name}: {t}", flush=True)
    p.close()
    ms = np.array(times) * 1e3
    mg = np.array(merges)
    return {"query": query, "state": state, "groups": groups, "load_s": load_s, "settle_s": settle_s, "mean": ms.mean(),
            "p50": np.percentile(ms, 50), "p99": np.percentile(ms, 99), "max": ms.max(),
            "merged_mean": mg.mean(), "merged_max": int(mg.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--background-merge", choices=["auto", "on", "off"], default="auto",
                    help="merges on a merge thread (on), on the worker threads (off), or the default rule")
    ap.add_argument("--no-settle", dest="settle", action="store_false",
                    help="with a merge thread, start the measured steps while it still merges the load's batches")
    ap.add_argument("--sizes", default="1M:100k,10M:1M,50M:5M,100M:10M",
                    help="comma-separated STATE:GROUPS (k, M suffixes); ratios are to the first")
    ap.add_argument("--queries", default="group_by,join,distinct")
    ap.add_argument("--steps", type=int, default=100, help="measured steps (at least 100 for a p99)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--change", type=int, default=1000, help="rows per measured step (10%% deletions)")
    ap.add_argument("--load-step", type=_count, default=1_000_000, help="rows per loading step")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="allow fewer than 100 steps (a smoke run)")
    ap.add_argument("--verbose", action="store_true", help="print every trace's levels after the run")
    args = ap.parse_args()
    if args.steps < 100 and not args.quick:
        ap.error("--steps must be at least 100 for a p99 (or pass --quick)")
    sizes = []
    for part in args.sizes.split(","):
        s, g = part.split(":")
        sizes.append((_count(s), _count(g)))
    queries = [q.strip() for q in args.queries.split(",")]
    for q in queries:
        if q not in QUERIES:
            ap.error(f"unknown query {q!r}; choose from {', '.join(QUERIES)}")
    print(f"# dbsp_core {getattr(dbsp, '__version__', '?')}, W={args.workers}, {args.change}-row steps "
          f"(10% deletions), {args.warmup} warm-up + {args.steps} measured steps, loaded in "
          f"{args.load_step:,}-row steps; load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| query | state rows | groups | load s (merge thread settling) | mean ms | p50 ms | p99 ms | max ms | mean / first | "
          "p99 / first | merged rows/step mean | max |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for q in queries:
        first = None
        for state, groups in sizes:
            r = run(q, state, groups, args)
            first = first or r
            print(f"| {q} | {state:,} | {groups:,} | {r['load_s']:.1f} ({r['settle_s']:.1f}) | {r['mean']:.2f} | {r['p50']:.2f} | "
                  f"{r['p99']:.2f} | {r['max']:.2f} | {r['mean'] / first['mean']:.2f}x | "
                  f"{r['p99'] / first['p99']:.2f}x | {r['merged_mean']:,.0f} | {r['merged_max']:,} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
