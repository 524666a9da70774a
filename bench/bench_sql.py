"""SQL views against the same views built by hand with the Python API: the step time of each compiled view over the hand-built one's, on the same changes, in the same run (the target: at most 1.1x).

Run from the repository root:  python bench/bench_sql.py  (``--quick`` for a small smoke run that checks the
ratios too: it exits 1 when a view is more than ``--limit`` times slower than its hand-built twin).
Both pipelines take every change; their steps alternate (which one goes first flips every step) so drift in
the machine's load hits both alike. Times are CPU time of the stepping thread with one worker (the whole step runs
on it, so other processes' load counts less), wall time with more. A view's ratio is the median over the steps of
the compiled step's time over the hand-built step's on the same change (paired, so the steps' sizes cancel out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dbsp_core as dbsp  # noqa: E402
from dbsp_core import nexmark, sql  # noqa: E402

F = pc.field
BID = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTION = pa.schema([("id", pa.int64()), ("category", pa.int64())])
EDGE = pa.schema([("src", pa.int64()), ("dst", pa.int64())])
DDL = """CREATE TABLE bid (auction BIGINT, bidder BIGINT, price BIGINT);
CREATE TABLE auction (id BIGINT, category BIGINT);
CREATE TABLE e (src BIGINT, dst BIGINT);
"""


def _hand(build: Callable) -> dbsp.Circuit:
    c = dbsp.Circuit()
    b, a, e = c.input("bid", BID), c.input("auction", AUCTION), c.input("e", EDGE)
    c.output("v", build(c, b, a, e))
    return c


def _reach(c: dbsp.Circuit, b, a, e) -> dbsp.Stream:
    step = lambda r, e: e + r.join(e, left_on="dst", right_on="src").select(src="src", dst="dst_right")  # noqa: E731
    return c.recursive(step, [e])


VIEWS = {
    "filter+group_by": (
        "SELECT auction, count(*) AS n, sum(price) AS total FROM bid WHERE price > 100 GROUP BY auction",
        lambda c, b, a, e: b.filter(F("price") > 100).group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price"))),
    "join+project": (
        "SELECT bid.auction, bid.price, auction.category FROM bid JOIN auction ON bid.auction = auction.id",
        lambda c, b, a, e: b.join(a, left_on="auction", right_on="id").select(auction="auction", price="price",
                                                                               category="category")),
    "group_by max/min": (
        "SELECT bidder, max(price) AS hi, min(price) AS lo FROM bid GROUP BY bidder",
        lambda c, b, a, e: b.group_by("bidder").agg(hi=dbsp.max("price"), lo=dbsp.min("price"))),
    "distinct": (
        "SELECT DISTINCT auction, bidder FROM bid",
        lambda c, b, a, e: b.select(auction="auction", bidder="bidder").distinct()),
    "top-3 per auction": (
        "SELECT auction, bidder, price FROM (SELECT auction, bidder, price, ROW_NUMBER() OVER (PARTITION BY auction "
        "ORDER BY price DESC) AS rn FROM bid) WHERE rn <= 3",
        lambda c, b, a, e: b.group_by("auction").top_k(3, ("price", "descending"))),
    "recursive reach": (
        "WITH RECURSIVE r(src, dst) AS (SELECT src, dst FROM e UNION SELECT r.src, e.dst FROM r JOIN e "
        "ON r.dst = e.src) SELECT src, dst FROM r",
        _reach),
}


def changes(rng: np.random.Generator, rows: int, steps: int, change: int, n_auctions: int, nodes: int
            ) -> tuple[dict, list[dict]]:
    def bids(n: int) -> pa.Table:
        return pa.table({"auction": rng.integers(0, n_auctions, n), "bidder": rng.integers(0, n_auctions // 2, n),
                         "price": rng.integers(1, 10_000, n)}, schema=BID)

    def edges(n: int) -> pa.Table:  # a forest-like DAG: each edge goes up, so reach sets stay small
        dst = rng.integers(1, nodes, n)
        return pa.table({"src": dst, "dst": (dst * rng.random(n)).astype(np.int64)}, schema=EDGE)

    base_bids, base_edges = bids(rows), edges(nodes)
    ids = np.arange(n_auctions)
    base = {"bid": dbsp.ZSet.from_arrow(base_bids), "e": dbsp.ZSet.from_arrow(base_edges),
            "auction": dbsp.ZSet.from_arrow(pa.table({"id": ids, "category": ids % 50}, schema=AUCTION))}
    out = []
    for i in range(steps):
        ins, k = bids(change - change // 10), change // 10
        dels = base_bids.slice(i * k, k)
        e_ins = edges(max(1, change // 100))
        e_del = base_edges.slice(i, 1)
        out.append({"bid": dbsp.ZSet.from_arrow(pa.concat_tables([ins, dels]),
                                                weights=np.r_[np.ones(ins.num_rows), -np.ones(k)].astype(np.int64)),
                    "e": dbsp.ZSet.from_arrow(pa.concat_tables([e_ins, e_del]),
                                              weights=np.r_[np.ones(e_ins.num_rows), -1].astype(np.int64))})
    return base, out


def measure(a: dbsp.Circuit, b: dbsp.Circuit, oa: str, ob: str, base: dict, steps: list[dict], workers: int
            ) -> tuple[list[float], list[float]]:
    """Step seconds of circuits ``a`` and ``b`` (outputs ``oa``, ``ob``) on the same changes."""
    pa_, pb = dbsp.Pipeline(a, workers=workers), dbsp.Pipeline(b, workers=workers)
    clock = time.thread_time if workers == 1 else time.perf_counter
    ta, tb = [], []
    try:
        for p in (pa_, pb):
            for name, z in base.items():
                if name in p.circuit.inputs:
                    p.push(name, z)
            p.step()
        for i, ch in enumerate(steps):
            order = [(pa_, ta, oa), (pb, tb, ob)] if i % 2 == 0 else [(pb, tb, ob), (pa_, ta, oa)]
            results = []
            for p, times, out in order:
                for name, z in ch.items():
                    if name in p.circuit.inputs:
                        p.push(name, z)
                t0 = clock()
                results.append(p.step()[out])
                times.append(clock() - t0)
            x, y = results
            if x.to_arrow().drop_columns(["weight"]).num_rows != y.to_arrow().drop_columns(["weight"]).num_rows:
                raise AssertionError("the compiled and the hand-built view disagree")
    finally:
        pa_.close()
        pb.close()
    return ta, tb


def _line(name: str, ta: list[float], tb: list[float]) -> tuple[str, float, float, float]:
    s, h = statistics.median(ta), statistics.median(tb)
    r = statistics.median(x / y for x, y in zip(ta, tb) if y > 0)
    print(f"{name:20s} compiled {s * 1e3:8.3f} ms  hand-built {h * 1e3:8.3f} ms  (medians)  ratio {r:5.2f}",
          flush=True)
    return name, s, h, r


def run(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    rng = np.random.default_rng(args.seed)
    base, steps = changes(rng, args.rows, args.steps, args.change, max(100, args.rows // 20), args.nodes)
    rows = []
    for name, (query, build) in VIEWS.items():
        compiled = sql.compile(DDL + f"CREATE VIEW v AS {query};")
        hand = _hand(build)
        rows.append(_line(name, *measure(compiled, hand, "v", "v", base, steps, args.workers)))
    events = args.rows * 2
    for q in args.nexmark:
        batches = list(nexmark.generate(events, seed=args.seed, batch=max(1, events // (args.steps + 1)), rate=10_000))
        nbase = {k: dbsp.ZSet.from_arrow(t) for k, t in batches[0].items()}
        nsteps = [{k: dbsp.ZSet.from_arrow(t) for k, t in b.items()} for b in batches[1:]]
        rows.append(_line(f"nexmark {q}", *measure(nexmark.sql_circuit(q), nexmark.circuit(q), q, q, nbase, nsteps,
                                                    args.workers)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of state before the measured steps")
    ap.add_argument("--change", type=int, default=10_000, help="rows per measured step (10%% deletions)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=20_000, help="nodes of the graph of the recursive view")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--nexmark", default="q4,q7,q9", help="Nexmark queries compared SQL vs hand-built")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=float, default=1.1, help="the largest compiled/hand-built ratio accepted")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = ap.parse_args()
    args.nexmark = [q for q in args.nexmark.split(",") if q]
    if args.quick:
        args.rows, args.change, args.steps, args.nodes = 20_000, 1_000, 100, 2_000
    rows = run(args)
    worst = max(r for *_, r in rows)
    print(f"worst ratio {worst:.2f} (limit {args.limit})")
    return 0 if worst <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())
