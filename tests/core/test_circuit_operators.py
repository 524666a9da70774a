"""Every operator of the Circuit API checked against DuckDB recomputing the query over the integrated input."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st

import dbsp_core as dbsp
from oracle import run_against_duckdb

SEEDS = st.integers(0, 2**31 - 1)
WORKERS = st.sampled_from([1, 2, 4])
FEW = settings(max_examples=examples(8))


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_filter(seed: int, workers: int) -> None:
    run_against_duckdb(lambda c, s: {"v": s["bids"].filter((pc.field("price") > 2) | pc.is_null(pc.field("f")))},
                       {"v": "SELECT * FROM bids WHERE price > 2 OR f IS NULL"}, seed, workers, inputs=("bids",))


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_select(seed: int, workers: int) -> None:
    run_against_duckdb(
        lambda c, s: {"v": s["bids"].select(a="auction", p2=pc.field("price") * 2 + 1, half=pc.field("f") / 2)},
        {"v": "SELECT auction, price * 2 + 1, f / 2 FROM bids"}, seed, workers, inputs=("bids",))


def _dup_pricey(batch: pa.RecordBatch) -> pa.RecordBatch:
    t = pa.Table.from_batches([batch])
    both = pa.concat_tables([t, t.filter(pc.field("price") > 3)]).combine_chunks()
    return both.to_batches()[0] if both.num_rows else batch


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_flat_map(seed: int, workers: int) -> None:
    run_against_duckdb(lambda c, s: {"v": s["bids"].flat_map(_dup_pricey, schema=s["bids"].schema)},
                       {"v": "SELECT * FROM bids UNION ALL SELECT * FROM bids WHERE price > 3"},
                       seed, workers, inputs=("bids",))


def _two_bids(c: dbsp.Circuit, s: dict) -> tuple[dbsp.Stream, dbsp.Stream]:
    a = s["bids"]
    b = s["auctions"].select(auction=pc.field("id").cast(pa.int64()), bidder="category", price="reserve",
                             f=pc.field("reserve").cast(pa.float64()))
    return a, b


B_AS_BIDS = "SELECT CAST(id AS BIGINT), category, reserve, CAST(reserve AS DOUBLE), __w FROM auctions_w"


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_plus_minus_negate(seed: int, workers: int) -> None:
    def build(c: dbsp.Circuit, s: dict) -> dict:
        a, b = _two_bids(c, s)
        return {"plus": a + b, "minus": a - b, "neg": -a}

    a = "SELECT auction, bidder, price, f, __w FROM bids_w"
    run_against_duckdb(build, {
        "plus": f"SELECT auction, bidder, price, f, SUM(__w) AS __w FROM ({a} UNION ALL {B_AS_BIDS}) GROUP BY ALL",
        "minus": f"SELECT auction, bidder, price, f, SUM(__w) AS __w FROM ({a} UNION ALL "
                 f"SELECT * EXCLUDE (__w), -__w FROM ({B_AS_BIDS})) GROUP BY ALL",
        "neg": "SELECT auction, bidder, price, f, -__w AS __w FROM bids_w",
    }, seed, workers)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_distinct(seed: int, workers: int) -> None:
    run_against_duckdb(lambda c, s: {"all": s["bids"].distinct(),
                                     "proj": s["bids"].select(auction="auction", bidder="bidder").distinct()},
                       {"all": "SELECT DISTINCT * FROM bids",
                        "proj": "SELECT DISTINCT auction, bidder FROM bids"}, seed, workers, inputs=("bids",))


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_join(seed: int, workers: int) -> None:
    def build(c: dbsp.Circuit, s: dict) -> dict:
        b, a = s["bids"], s["auctions"]
        keyed = a.select(auction=pc.field("id").cast(pa.int64()), bidder="category", x="reserve")
        return {"lr": b.join(a, left_on="auction", right_on="id"),
                "on": b.join(keyed, on=["auction", "bidder"])}

    run_against_duckdb(build, {
        "lr": "SELECT b.*, a.* FROM bids b JOIN auctions a ON b.auction = a.id",
        "on": "SELECT b.*, a.reserve FROM bids b JOIN auctions a ON b.auction = a.id AND b.bidder = a.category",
    }, seed, workers)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_left_join_with_deletions(seed: int, workers: int) -> None:
    def build(c: dbsp.Circuit, s: dict) -> dict:
        b, a = s["bids"], s["auctions"]
        return {"lj": b.left_join(a, left_on="auction", right_on="id"),
                "on": a.left_join(a.select(id="id", c2="category"), on="id"),
                "multi": a.left_join(b, left_on=["id", "category"], right_on=["auction", "bidder"])}

    run_against_duckdb(build, {
        "lj": "SELECT b.*, a.* FROM bids b LEFT JOIN auctions a ON b.auction = a.id",
        "on": "SELECT a.*, x.category FROM auctions a LEFT JOIN auctions x ON a.id = x.id",
        "multi": "SELECT a.*, b.* FROM auctions a LEFT JOIN bids b ON a.id = b.auction AND a.category = b.bidder",
    }, seed, workers, steps=8, max_rows=12)


AGG_SQL = ("SELECT auction, COUNT(*), SUM(price), MIN(price), MAX(price), AVG(price), MIN(bidder), MAX(bidder), "
           "SUM(f), AVG(f), COUNT(price) FROM bids GROUP BY auction")


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_group_by_all_aggregates(seed: int, workers: int) -> None:
    def build(c: dbsp.Circuit, s: dict) -> dict:
        g = s["bids"].group_by("auction")
        return {"full": g.agg(n=dbsp.count(), total=dbsp.sum("price"), lo=dbsp.min("price"), hi=dbsp.max("price"),
                              mean=dbsp.avg("price"), first=dbsp.min("bidder"), last=dbsp.max("bidder"),
                              fs=dbsp.sum("f"), fa=dbsp.avg("f"), nprice=dbsp.count("price")),
                "linear": s["bids"].group_by("auction", "bidder").agg(n=dbsp.count(), total=dbsp.sum("price"),
                                                                      mean=dbsp.avg("price"))}

    run_against_duckdb(build, {
        "full": AGG_SQL,
        "linear": "SELECT auction, bidder, COUNT(*), SUM(price), AVG(price) FROM bids GROUP BY auction, bidder",
    }, seed, workers, inputs=("bids",), steps=6)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_integrate_differentiate_delay(seed: int, workers: int) -> None:
    # integrate's output at each step is the whole view; differentiate(integrate(s)) is s again; the delayed
    # stream's integral lags one step behind.
    import numpy as np

    from oracle import BIDS, ChangeGen, to_zset

    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("i", b.integrate())
    c.output("di", b.integrate().differentiate())
    c.output("d", b.delay())
    c.output("id", b.delay().integrate())
    gen = ChangeGen(rng, BIDS)
    prev_change = dbsp.ZSet.empty(BIDS)
    prev_bag = dbsp.ZSet.empty(BIDS)
    with dbsp.Pipeline(c, workers=workers) as p:
        for _ in range(5):
            change = to_zset(gen.change(), BIDS)
            p.push("bids", change)
            out = p.step()
            assert out["i"] == to_zset(dict(gen.bag), BIDS)
            assert out["di"] == change
            assert out["d"] == prev_change
            assert out["id"] == prev_bag
            prev_change, prev_bag = change, to_zset(dict(gen.bag), BIDS)
