"""Keyless aggregates, count_distinct and top-k per group, checked against DuckDB recomputing the query over the integrated input after random steps with deletions, at several worker counts (Hypothesis; seeds print on failure)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st

import dbsp_core as dbsp
from oracle import BIDS, run_against_duckdb, to_zset

SEEDS = st.integers(0, 2**31 - 1)
WORKERS = st.sampled_from([1, 2, 4])
FEW = settings(max_examples=examples(8))
ORDER = "ORDER BY price DESC NULLS LAST, bidder ASC NULLS LAST, f ASC NULLS LAST"


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_keyless_aggregates(seed: int, workers: int) -> None:
    run_against_duckdb(lambda c, s: {
        "lin": s["bids"].group_by().agg(n=dbsp.count(), total=dbsp.sum("price"), nd=dbsp.count_distinct("bidder")),
        "ext": s["bids"].group_by().agg(lo=dbsp.min("price"), hi=dbsp.max("bidder"), n=dbsp.count("f")),
        "flt": s["bids"].group_by().agg(mean=dbsp.avg("f"), n=dbsp.count()),
    }, {
        "lin": "SELECT count(*), sum(price), count(DISTINCT bidder) FROM bids HAVING count(*) > 0",
        "ext": "SELECT min(price), max(bidder), count(f) FROM bids HAVING count(*) > 0",
        "flt": "SELECT avg(f), count(*) FROM bids HAVING count(*) > 0",
    }, seed, workers, inputs=("bids",), steps=6)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_count_distinct_per_group(seed: int, workers: int) -> None:
    run_against_duckdb(lambda c, s: {
        "g": s["bids"].group_by("auction").agg(n=dbsp.count(), nd=dbsp.count_distinct("bidder"),
                                               np=dbsp.count_distinct("price"), s=dbsp.sum("price")),
        "two": s["bids"].group_by("auction", "bidder").agg(nd=dbsp.count_distinct("f")),
    }, {
        "g": "SELECT auction, count(*), count(DISTINCT bidder), count(DISTINCT price), sum(price) FROM bids "
             "GROUP BY auction",
        "two": "SELECT auction, bidder, count(DISTINCT f) FROM bids GROUP BY auction, bidder",
    }, seed, workers, inputs=("bids",), steps=6)


@FEW
@given(seed=SEEDS, workers=WORKERS, k=st.sampled_from([1, 2, 3]))
def test_top_k_per_group(seed: int, workers: int, k: int) -> None:
    run_against_duckdb(lambda c, s: {
        "top": s["bids"].group_by("auction").top_k(k, ("price", "descending")),
        "ties": s["bids"].group_by("auction").top_k(k, ("price", "descending"), with_ties=True),
        "all": s["bids"].group_by().top_k(k, [("price", "descending"), "bidder", "f"]),
        "argmin": s["bids"].group_by("bidder").argmin("f"),
    }, {
        "top": f"SELECT auction, bidder, price, f FROM (SELECT *, row_number() OVER (PARTITION BY auction {ORDER}) "
               f"AS r FROM bids) WHERE r <= {k}",
        "ties": f"SELECT auction, bidder, price, f FROM (SELECT *, rank() OVER (PARTITION BY auction ORDER BY price "
                f"DESC NULLS LAST) AS r FROM bids) WHERE r <= {k}",
        "all": f"SELECT auction, bidder, price, f FROM (SELECT *, row_number() OVER ({ORDER}, auction ASC NULLS "
               f"LAST) AS r FROM bids) WHERE r <= {k}",
        "argmin": "SELECT auction, bidder, price, f FROM (SELECT *, rank() OVER (PARTITION BY bidder ORDER BY f ASC "
                  "NULLS LAST) AS r FROM bids) WHERE r <= 1",
    }, seed, workers, inputs=("bids",), steps=7)


def test_keyless_aggregate_of_an_emptied_stream_has_no_row() -> None:
    c = dbsp.Circuit()
    t = c.input("bids", BIDS)
    c.output("g", t.group_by().agg(n=dbsp.count(), s=dbsp.sum("price")))
    rows = {(1, "a", 5, 1.0): 1, (2, "b", 7, None): 2}
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", to_zset(rows, BIDS))
        assert p.step()["g"].to_dict() == {(3, 19): 1}
        p.push("bids", to_zset({r: -w for r, w in rows.items()}, BIDS))
        assert p.step()["g"].to_dict() == {(3, 19): -1}  # no row once every row is deleted


def test_top_k_and_count_distinct_state_is_keyed_by_the_exchange_key() -> None:
    c = dbsp.Circuit()
    t = c.input("bids", BIDS)
    c.output("top", t.group_by("auction").top_k(2, ("price", "descending")))
    c.output("nd", t.group_by("auction").agg(nd=dbsp.count_distinct("bidder")))
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", to_zset({(a, str(a % 3), a * 7 % 11, 0.5): 1 for a in range(40)}, BIDS))
        p.step()
        for w in range(2):
            for name, trace in p.traces(w).items():
                if "top_k" in name or "count_distinct" in name:
                    assert trace.key == ("auction",), name


def test_group_op_validation() -> None:
    c = dbsp.Circuit()
    t = c.input("bids", BIDS)
    n = len(c.nodes)
    with pytest.raises(dbsp.SchemaError, match="count_distinct"):
        t.group_by("auction").agg(lo=dbsp.min("price"), nd=dbsp.count_distinct("bidder"))
    with pytest.raises(dbsp.SchemaError, match="nope"):
        t.group_by("auction").top_k(1, "nope")
    with pytest.raises(ValueError, match="k must"):
        t.group_by("auction").top_k(0, "price")
    with pytest.raises(dbsp.SchemaError, match="order_by"):
        t.group_by().top_k(1, ("price", "down"))
    assert len(c.nodes) == n  # a rejected operator adds no node
    assert t.filter(pc.field("price") > 1).group_by().agg(n=dbsp.count()).schema == pa.schema([("n", pa.int64())])
