"""The demo job behind ``python -m dbsp_core demo``: an auction circuit (join, group_by aggregates, distinct, left join) run on the embedded Pipeline with two workers over generated changes."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import dbsp_core as dbsp

AUCTIONS = pa.schema([("id", pa.int64()), ("seller", pa.utf8()), ("category", pa.utf8())])
BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.utf8()), ("price", pa.int64())])
CATEGORIES = np.array(["art", "books", "cars", "music", "toys"])


def build_circuit() -> dbsp.Circuit:
    """The auction circuit: per-category bid statistics, distinct bidders per auction, big bids, unsold auctions.

    >>> sorted(build_circuit().outputs)
    ['bidders', 'big_bids', 'by_category', 'no_bids']
    """
    c = dbsp.Circuit()
    auctions = c.input("auctions", AUCTIONS)
    bids = c.input("bids", BIDS)
    joined = bids.join(auctions, left_on="auction", right_on="id")
    c.output("by_category", joined.group_by("category").agg(
        n=dbsp.count(), total=dbsp.sum("price"), lo=dbsp.min("price"), hi=dbsp.max("price"),
        mean=dbsp.avg("price")))
    c.output("bidders", bids.select(auction="auction", bidder="bidder").distinct())
    c.output("big_bids", bids.filter(pc.field("price") > 900))
    unsold = auctions.left_join(bids, left_on="id", right_on="auction").filter(pc.is_null(pc.field("price")))
    c.output("no_bids", unsold.select(id="id", category="category"))
    return c


def _auctions(rng: np.random.Generator, start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n)
    return pa.table({"id": ids, "seller": [f"s{i % 97}" for i in ids],
                     "category": CATEGORIES[rng.integers(0, len(CATEGORIES), n)]}, schema=AUCTIONS)


def _bids(rng: np.random.Generator, max_auction: int, n: int) -> pa.Table:
    return pa.table({"auction": rng.integers(0, max_auction, n),
                     "bidder": pc.binary_join_element_wise("b", pa.array(rng.integers(0, 500, n).astype(str)), ""),
                     "price": rng.integers(1, 1000, n)}, schema=BIDS)


def run_demo(steps: int = 5, workers: int = 2, seed: int = 7) -> int:
    """Run the demo and print each step's view changes and the view sizes; returns the exit code 0.

    >>> run_demo(steps=1) # doctest: +ELLIPSIS
    dbsp demo: ...
    0
    """
    rng = np.random.default_rng(seed)
    c = build_circuit()
    views = {name: dbsp.ZSet.empty(c.nodes[i].schema) for name, i in c.outputs.items()}
    print(f"dbsp demo: auction circuit on the embedded pipeline, {workers} workers, {steps} steps")
    n_auctions = 0
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in range(steps):
            new_auctions = _auctions(rng, n_auctions, 2_000)
            n_auctions += 2_000
            bids = _bids(rng, n_auctions, 5_000)
            p.push("auctions", new_auctions)
            p.push("bids", bids)
            if step > 0:  # retract some earlier bids (deletions) by pushing them with weight -1
                p.push("bids", prev_bids.slice(0, 500), weights=np.full(500, -1))
            prev_bids = bids
            t0 = time.perf_counter()
            out = p.step()
            ms = (time.perf_counter() - t0) * 1e3
            for name, z in out.items():
                views[name] = views[name] + z
            changes = ", ".join(f"{name} {z.num_rows:+d}" for name, z in out.items())
            retracted = ", retracted 500 bids" if step else ""
            print(f"step {step}: pushed 2000 auctions, 5000 bids{retracted}; {ms:.0f} ms; changed rows: {changes}")
    sizes = ", ".join(f"{name}={len(z)}" for name, z in views.items())
    print(f"views after {steps} steps: {sizes}")
    top = views["by_category"].to_arrow().sort_by("category").drop_columns(["weight"])
    for row in top.to_pylist():
        print(f"  {row['category']:>6}: {row['n']} bids, total {row['total']}, "
              f"min {row['lo']}, max {row['hi']}, mean {row['mean']:.1f}")
    return 0
