"""Composed circuits (join then group_by, filter then distinct, a join of aggregates, left join with deletions) against DuckDB, and results independent of W and of the split into steps."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st
from oracle import AUCTIONS, BIDS, ChangeGen, run_against_duckdb, to_zset

import dbsp_core as dbsp

SEEDS = st.integers(0, 2**31 - 1)
WORKERS = st.sampled_from([1, 2, 4])
FEW = settings(max_examples=examples(8))


def _join_then_group(c: dbsp.Circuit, s: dict) -> dict:
    j = s["bids"].join(s["auctions"], left_on="auction", right_on="id")
    return {"by_cat": j.group_by("category").agg(n=dbsp.count(), total=dbsp.sum("price"), hi=dbsp.max("price"),
                                                 fmean=dbsp.avg("f")),
            "by_cat_lin": j.group_by("category", "reserve").agg(n=dbsp.count(), total=dbsp.sum("price"))}


JOIN_GROUP_SQL = {
    "by_cat": "SELECT a.category, COUNT(*), SUM(b.price), MAX(b.price), AVG(b.f) FROM bids b JOIN auctions a "
              "ON b.auction = a.id GROUP BY a.category",
    "by_cat_lin": "SELECT a.category, a.reserve, COUNT(*), SUM(b.price) FROM bids b JOIN auctions a "
                  "ON b.auction = a.id GROUP BY a.category, a.reserve",
}


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_join_then_group_by(seed: int, workers: int) -> None:
    run_against_duckdb(_join_then_group, JOIN_GROUP_SQL, seed, workers, steps=6)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_filter_then_distinct(seed: int, workers: int) -> None:
    run_against_duckdb(
        lambda c, s: {"v": s["bids"].filter(pc.field("price") >= 2).select(a="auction", b="bidder").distinct()},
        {"v": "SELECT DISTINCT auction, bidder FROM bids WHERE price >= 2"}, seed, workers, inputs=("bids",),
        steps=6)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_join_of_aggregates(seed: int, workers: int) -> None:
    def build(c: dbsp.Circuit, s: dict) -> dict:
        per_auction = s["bids"].group_by("auction").agg(n=dbsp.count(), hi=dbsp.max("price"))
        per_id = s["auctions"].group_by("id").agg(m=dbsp.count(), top=dbsp.max("reserve"))
        return {"v": per_auction.join(per_id, left_on="auction", right_on="id")}

    run_against_duckdb(build, {"v": "SELECT * FROM (SELECT auction, COUNT(*), MAX(price) FROM bids GROUP BY auction) x "
                                    "JOIN (SELECT id, COUNT(*), MAX(reserve) FROM auctions GROUP BY id) y "
                                    "ON x.auction = y.id"}, seed, workers, steps=6)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_left_join_then_group_by_with_deletions(seed: int, workers: int) -> None:
    def build(c: dbsp.Circuit, s: dict) -> dict:
        lj = s["bids"].left_join(s["auctions"], left_on="auction", right_on="id")
        return {"v": lj.group_by("category").agg(n=dbsp.count(), total=dbsp.sum("price"), r=dbsp.min("reserve"))}

    run_against_duckdb(build, {"v": "SELECT a.category, COUNT(*), SUM(b.price), MIN(a.reserve) FROM bids b "
                                    "LEFT JOIN auctions a ON b.auction = a.id GROUP BY a.category"},
                       seed, workers, steps=6, max_rows=10)


def _final_view(seed: int, workers: int, splits: list[int]) -> dict[str, dbsp.ZSet]:
    """Feed the same changes, regrouped into steps by ``splits``, and return each view's integral."""
    rng = np.random.default_rng(seed)
    gens = {"bids": ChangeGen(rng, BIDS), "auctions": ChangeGen(rng, AUCTIONS)}
    changes = [{name: to_zset(g.change(), g.schema) for name, g in gens.items()} for _ in range(8)]
    c = dbsp.Circuit()
    streams = {"bids": c.input("bids", BIDS), "auctions": c.input("auctions", AUCTIONS)}
    views = _join_then_group(c, streams)
    views["distinct"] = streams["bids"].select(a="auction", f="f").distinct()
    views["lj"] = streams["bids"].left_join(streams["auctions"], left_on="auction", right_on="id")
    views["aggf"] = streams["bids"].group_by("bidder").agg(s=dbsp.sum("f"), m=dbsp.avg("f"), lo=dbsp.min("f"))
    for name, v in views.items():
        c.output(name, v)
    totals = {name: dbsp.ZSet.empty(v.schema) for name, v in views.items()}
    with dbsp.Pipeline(c, workers=workers) as p:
        i = 0
        for size in splits:
            for ch in changes[i:i + size]:
                for name, z in ch.items():
                    p.push(name, z)
            i += size
            for name, z in p.step().items():
                totals[name] = totals[name] + z
    return totals


@settings(max_examples=examples(6))
@given(seed=SEEDS, workers=st.sampled_from([2, 4]),
       splits=st.lists(st.integers(1, 3), min_size=1, max_size=8).map(lambda xs: xs + [8]))
def test_results_identical_for_every_w_and_split(seed: int, workers: int, splits: list[int]) -> None:
    one = _final_view(seed, 1, [8])
    many = _final_view(seed, workers, splits)
    for name in one:  # exact equality, floats included
        assert one[name].to_arrow().equals(many[name].to_arrow()), name


def test_delete_current_extreme_and_group_vanishes() -> None:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("g", b.group_by("auction").agg(lo=dbsp.min("price"), hi=dbsp.max("price"), n=dbsp.count()))
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", to_zset({(1, "a", 5, 0.5): 1, (1, "b", 9, None): 1, (1, "c", 7, 1.0): 1}, BIDS))
        assert p.step()["g"].to_dict() == {(1, 5, 9, 3): 1}
        p.push("bids", to_zset({(1, "b", 9, None): -1}, BIDS))
        assert p.step()["g"].to_dict() == {(1, 5, 9, 3): -1, (1, 5, 7, 2): 1}
        p.push("bids", to_zset({(1, "a", 5, 0.5): -1, (1, "c", 7, 1.0): -1}, BIDS))
        assert p.step()["g"].to_dict() == {(1, 5, 7, 2): -1}
        assert p.step()["g"].to_dict() == {}


def test_left_join_padded_row_comes_and_goes() -> None:
    c = dbsp.Circuit()
    b, a = c.input("bids", BIDS), c.input("auctions", AUCTIONS)
    c.output("lj", b.left_join(a, left_on="auction", right_on="id").select(auction="auction", cat="category"))
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", to_zset({(1, "x", 3, None): 1, (None, "y", 4, None): 1}, BIDS))
        assert p.step()["lj"].to_dict() == {(1, None): 1, (None, None): 1}
        p.push("auctions", to_zset({(1, "car", 10): 1}, AUCTIONS))
        assert p.step()["lj"].to_dict() == {(1, None): -1, (1, "car"): 1}
        p.push("auctions", to_zset({(1, "car", 10): -1}, AUCTIONS))
        assert p.step()["lj"].to_dict() == {(1, None): 1, (1, "car"): -1}




@settings(max_examples=examples(3))
@given(seed=SEEDS, workers=WORKERS)
def test_long_run_with_deep_traces(seed: int, workers: int) -> None:
    # many steps, so every trace holds several spine batches and pending batches between reads
    def build(c: dbsp.Circuit, s: dict) -> dict:
        out = _join_then_group(c, s)
        out["d"] = s["bids"].select(a="auction", b="bidder").distinct()
        out["g"] = s["bids"].group_by("bidder").agg(lo=dbsp.min("price"), n=dbsp.count(), t=dbsp.sum("price"))
        return out

    run_against_duckdb(build, {**JOIN_GROUP_SQL,
                               "d": "SELECT DISTINCT auction, bidder FROM bids",
                               "g": "SELECT bidder, MIN(price), COUNT(*), SUM(price) FROM bids GROUP BY bidder"},
                       seed, workers, steps=25, max_rows=25)


@settings(max_examples=examples(6))
@given(seed=SEEDS, workers=st.sampled_from([2, 4]))
def test_pre_aggregation_grouped_path_matches_duckdb(seed: int, workers: int) -> None:
    # force the combiner to group even tiny changes, the path large changes take on W > 1
    from dbsp_core.operators.aggregate import PreAggregate

    old, PreAggregate.GROUP_ABOVE = PreAggregate.GROUP_ABOVE, 0
    try:
        run_against_duckdb(_join_then_group, JOIN_GROUP_SQL, seed, workers, steps=5)
        run_against_duckdb(
            lambda c, s: {"v": s["bids"].group_by("auction", "bidder").agg(n=dbsp.count(), t=dbsp.sum("price"),
                                                                          m=dbsp.avg("price"), k=dbsp.count("f"))},
            {"v": "SELECT auction, bidder, COUNT(*), SUM(price), AVG(price), COUNT(f) FROM bids GROUP BY ALL"},
            seed, workers, inputs=("bids",), steps=5)
        assert _final_view(seed, workers, [3, 5])["by_cat_lin"] == _final_view(seed, 1, [8])["by_cat_lin"]
    finally:
        PreAggregate.GROUP_ABOVE = old
