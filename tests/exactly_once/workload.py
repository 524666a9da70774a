"""The exactly-once test workload: an auction circuit, deterministic per-(producer, seq) input batches, a DuckDB oracle and the output-log checks; its keyed form (``keyed=True``) makes auctions a table with a primary key whose rows are replaced and deleted by key, and materializes the views."""

from __future__ import annotations

import os
import random
import sys

import pyarrow as pa
import pyarrow.compute as pc

import dbsp_core as dbsp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures"))
from auction import auction_circuit, by_category  # noqa: E402

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.utf8())])
CATS = ["art", "books", "cars", "music", "toys"]
PRODUCERS = ("p0", "p1")


def build_circuit(keyed: bool = False, refs: bool = False) -> dbsp.Circuit:
    """Join + linear aggregate, a max (recomputed from a trace), a distinct and a filter; ``refs``: also the bids
    themselves (``all_bids``, an identity view the output log names by reference, outputlog.py invariant 7; the
    input log then keeps what the output log names, so it is not truncated); keyed: auctions with primary key
    ``id``, and the join + aggregate and the filter as materialized views."""
    if keyed:
        c = dbsp.Circuit()
        bids = c.input("bids", BIDS)
        auctions = c.input("auctions", AUCTIONS, primary_key=["id"])
        c.output("by_cat", by_category(bids, auctions), materialized=True)
        c.output("big", bids.filter(pc.field("price") > 500), materialized=True)
        return c
    c, bids, _ = auction_circuit(BIDS, AUCTIONS)
    c.output("maxp", bids.group_by("auction").agg(hi=dbsp.max("price")))
    c.output("bidders", bids.select(bidder=pc.field("bidder")).distinct())
    c.output("big", bids.filter(pc.field("price") > 500))
    if refs:
        c.output("all_bids", bids)  # the input itself
    return c


def with_refs(seed: int) -> bool:
    """Whether a kill test's seed runs the circuit with the identity view (a quarter of them)."""
    return seed % 4 == 3


def _bid_rows(seed: int, producer: str, seq: int) -> list[tuple[int, int, int]]:
    rng = random.Random(f"{seed}/{producer}/{seq}")
    return [(rng.randrange(40), rng.randrange(60), rng.randrange(1, 1000)) for _ in range(rng.randrange(1, 12))]


def batch(seed: int, producer: str, seq: int, keyed: bool = False) -> list[tuple[str, list[tuple], list[int]]]:
    """The pushes of one (producer, seq): [(handle, rows, weights)] — a pure function of its arguments.

    p0 pushes bids and sometimes retracts two bids of its previous seq; p1 pushes two new auctions and bids, or,
    keyed, two auctions among a few ids (replacing the held row of the id, or deleting it with weight -1).
    """
    rng = random.Random(f"{seed}/{producer}/{seq}/shape")
    out = []
    rows = _bid_rows(seed, producer, seq)
    weights = [1] * len(rows)
    if producer == "p0" and seq > 0 and rng.random() < 0.4:
        old = _bid_rows(seed, producer, seq - 1)[:2]
        rows += old
        weights += [-1] * len(old)
    out.append(("bids", rows, weights))
    if producer == "p1" and keyed:
        out.append(("auctions", [(rng.randrange(16), CATS[rng.randrange(len(CATS))]) for k in range(2)],
                    [1, -1 if rng.random() < 0.3 else 1]))
    elif producer == "p1":
        out.append(("auctions", [(2 * seq + k, CATS[rng.randrange(len(CATS))]) for k in range(2)], [1, 1]))
    return out


def to_table(handle: str, rows: list[tuple], weights: list[int]) -> pa.Table:
    schema = BIDS if handle == "bids" else AUCTIONS
    cols = list(zip(*rows))
    t = pa.table({f.name: pa.array(list(col), f.type) for f, col in zip(schema, cols)}, schema=schema)
    return t.append_column("weight", pa.array(weights, pa.int64()))


def push_batch(p, seed: int, producer: str, seq: int, keyed: bool = False) -> list:
    """Push one (producer, seq) as a single durable push (all handles of p1 under the same producer seq); seeds
    with ``seed % 3 == 1`` record a batch's parts with one ``push_many`` (one fsync), the others one push each."""
    parts = batch(seed, producer, seq, keyed)
    if seed % 3 == 1:
        return p.push_many([{"handle": handle, "data": to_table(handle, rows, weights), "producer": f"{producer}.{k}",
                             "seq": seq} for k, (handle, rows, weights) in enumerate(parts)])
    acks = []
    for k, (handle, rows, weights) in enumerate(parts):
        # one (producer, seq) per handle: the handle index is folded into the producer id
        acks.append(p.push(handle, to_table(handle, rows, weights), producer=f"{producer}.{k}", seq=seq))
    return acks


def oracle(seed: int, counts: dict[str, int], keyed: bool = False, refs: bool = False) -> dict[str, dict[tuple, int]]:
    """DuckDB's views over every batch (producer, seq < counts[producer]), as {row: weight}; keyed, the views of
    the keyed circuit and the table "auctions" made by INSERT OR REPLACE and DELETE by id in push order (only p1
    pushes auctions, one seq after the other)."""
    import duckdb  # only the parent needs it; children start faster without it

    brows, arows = [], []
    for producer, n in counts.items():
        for seq in range(n):
            for handle, rows, weights in batch(seed, producer, seq, keyed):
                target = brows if handle == "bids" else arows
                target.extend(r + (w,) for r, w in zip(rows, weights))
    con = duckdb.connect()
    con.execute("CREATE TABLE b(auction BIGINT, bidder BIGINT, price BIGINT, w BIGINT)")
    con.execute("CREATE TABLE a(id BIGINT, category VARCHAR, w BIGINT)")
    if brows:
        con.executemany("INSERT INTO b VALUES (?, ?, ?, ?)", brows)
    if arows:
        con.executemany("INSERT INTO a VALUES (?, ?, ?)", arows)
    con.execute("CREATE VIEW bc AS SELECT auction, bidder, price, SUM(w) AS w FROM b "
                "GROUP BY ALL HAVING SUM(w) <> 0")
    if keyed:
        con.execute("CREATE TABLE ak(id BIGINT PRIMARY KEY, category VARCHAR)")
        for i, cat, w in arows:  # in push order
            if w > 0:
                con.execute("INSERT OR REPLACE INTO ak VALUES (?, ?)", [i, cat])
            else:
                con.execute("DELETE FROM ak WHERE id = ?", [i])
        con.execute("CREATE VIEW ac AS SELECT id, category, 1 AS w FROM ak")
    else:
        con.execute("CREATE VIEW ac AS SELECT id, category, SUM(w) AS w FROM a GROUP BY ALL HAVING SUM(w) <> 0")
    res = {}
    q = {
        "by_cat": "SELECT category, SUM(bc.w * ac.w), SUM(price * bc.w * ac.w), 1 FROM bc JOIN ac ON auction = id "
                  "GROUP BY category HAVING SUM(bc.w * ac.w) <> 0",
        "maxp": "SELECT auction, MAX(price), 1 FROM bc WHERE w > 0 GROUP BY auction",
        "bidders": "SELECT DISTINCT bidder, 1 FROM bc WHERE w > 0",
        "big": "SELECT auction, bidder, price, w FROM bc WHERE price > 500",
    }
    if refs:
        q["all_bids"] = "SELECT auction, bidder, price, w FROM bc"
    if keyed:
        q = {"by_cat": q["by_cat"], "big": q["big"], "auctions": "SELECT id, category, w FROM ac"}
    for name, sql in q.items():
        res[name] = {tuple(r[:-1]): r[-1] for r in con.execute(sql).fetchall()}
    return res


def integral(p, name: str) -> tuple[dict[tuple, int], list[int]]:
    """The sum of every logged change of output ``name`` and the list of steps read."""
    acc: dict[tuple, int] = {}
    steps = []
    for step, z in p.read_output(name, 0):
        steps.append(step)
        integrate(acc, z)
    return acc, steps


def integrate(acc: dict, z) -> None:
    """Add a change (a ZSet) to an integral kept as ``{row: weight}`` (rows whose weight reaches 0 leave)."""
    for row, w in z.to_dict().items():
        v = acc.get(row, 0) + w
        if v:
            acc[row] = v
        else:
            acc.pop(row, None)
