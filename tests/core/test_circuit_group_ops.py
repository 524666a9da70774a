"""Keyless aggregates, count_distinct and top-k per group, checked against DuckDB recomputing the query over the integrated input after random steps with deletions, at several worker counts (Hypothesis; seeds print on failure)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.circuit import circuit_fingerprint
from dbsp_core.operators.aggregate import _ExtremesState
import numpy as np

from oracle import BIDS, ChangeGen, accumulate, duckdb_query, normalize, run_against_duckdb, to_zset

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


@FEW
@given(seed=SEEDS, workers=WORKERS, append_only=st.booleans())
def test_argmax_over_an_integer_column_without_nulls(seed: int, workers: int, append_only: bool) -> None:
    """operators/top_k.py invariant 6: argmax/argmin with ties over a non-null integer column (q5's form) take the
    hash grouping, not the sort (counted), and give DuckDB's rows, with deletions and null group keys."""
    from dbsp_core.operators import top_k

    taken = []
    real = top_k._argmax_rows

    def counted(op, z):
        out = real(op, z)
        taken.append(out is not None)
        return out

    top_k._argmax_rows = counted
    try:
        run_against_duckdb(lambda c, s: {
            "max": s["bids"].filter(pc.field("price").is_valid()).group_by("bidder").argmax("price"),
            "min": s["bids"].filter(pc.field("price").is_valid()).group_by("auction", "bidder").argmin("price"),
        }, {
            "max": "SELECT auction, bidder, price, f FROM (SELECT *, rank() OVER (PARTITION BY bidder ORDER BY price "
                   "DESC) AS r FROM bids WHERE price IS NOT NULL) WHERE r <= 1",
            "min": "SELECT auction, bidder, price, f FROM (SELECT *, rank() OVER (PARTITION BY auction, bidder ORDER "
                   "BY price ASC) AS r FROM bids WHERE price IS NOT NULL) WHERE r <= 1",
        }, seed, workers, inputs=("bids",), steps=7, max_rows=20, append_only=append_only)
    finally:
        top_k._argmax_rows = real
    assert taken and all(taken), "the argmax did not take the hash grouping"


@FEW
@given(seed=SEEDS, workers=WORKERS, k=st.sampled_from([1, 2]), ties=st.booleans())
def test_top_k_over_a_growing_count_keeps_only_its_shown_rows(seed: int, workers: int, k: int, ties: bool) -> None:
    """operators/top_k.py invariant 7 (q5's form): the top groups by row count over append-only inputs keep only the
    shown rows, and give DuckDB's rows after every step (counts grow across steps, groups tie)."""
    def traces(p: dbsp.Pipeline) -> None:
        assert _top_k_traces(p) == ["shown"]

    rank = "rank" if ties else "row_number"
    run_against_duckdb(lambda c, s: {
        "top": s["bids"].group_by("auction", "bidder").agg(n=dbsp.count(), hi=dbsp.max("price"))
        .group_by("auction").top_k(k, [("n", "descending"), "bidder"], with_ties=ties),
    }, {
        "top": f"SELECT auction, bidder, n, hi FROM (SELECT *, {rank}() OVER (PARTITION BY auction ORDER BY n DESC, "
               f"bidder ASC NULLS LAST) AS r FROM (SELECT auction, bidder, count(*) AS n, max(price) AS hi FROM bids "
               f"GROUP BY auction, bidder)) WHERE r <= {k}",
    }, seed, workers, inputs=("bids",), steps=7, max_rows=20, append_only=True, after=traces)


TOP_BIDDER_SQL = ("SELECT auction, bidder, n FROM (SELECT *, row_number() OVER (PARTITION BY auction ORDER BY n DESC, "
                  "bidder ASC NULLS LAST) AS r FROM (SELECT auction, bidder, count(*) AS n FROM bids GROUP BY "
                  "auction, bidder)) WHERE r <= 1")  # what _top_bidder_circuit's view holds, for DuckDB


def _top_bidder_circuit(general: bool) -> dbsp.Circuit:
    """``top``: each auction's bidder with the most bids, a top-k over an append-only count (the growing form of
    operators/top_k.py invariant 7); ``general``: the operator as the code before invariant 7 built it."""
    c = dbsp.Circuit()
    t = c.input("bids", BIDS, append_only=True)
    out = t.group_by("auction", "bidder").agg(n=dbsp.count()).group_by("auction").top_k(
        1, [("n", "descending"), "bidder"])
    c.output("top", out)
    if general:
        vars(c.nodes[out.node_id]).pop("grows")
    return c


@pytest.mark.parametrize("workers", [1, 2])
def test_a_directory_of_the_general_top_k_reopens_with_the_growing_form(tmp_path, workers: int) -> None:
    """A directory written before operators/top_k.py invariant 7 (the general form: input and shown traces) opens
    with the same circuit under the growing form (``grows`` is not part of the fingerprint: the same rows are shown,
    only the state kept differs), and its results go on to equal DuckDB's; the growing form runs only on its shown
    trace. (An engine upgrade must not turn an unchanged program into a changed one.)"""
    rng = np.random.default_rng(workers)

    assert circuit_fingerprint(_top_bidder_circuit(False)) == circuit_fingerprint(_top_bidder_circuit(True))
    g = ChangeGen(rng, BIDS)
    g.deletes = 0.0
    view: dict = {}
    sql = TOP_BIDDER_SQL
    storage = str(tmp_path / "p")
    for general, steps in ((True, 4), (False, 4)):
        p = (dbsp.Pipeline(_top_bidder_circuit(general), workers=workers, storage=storage) if general
             else dbsp.Pipeline.open(storage, _top_bidder_circuit(general)))
        try:
            assert _top_k_traces(p) == (["input", "shown"] if general else ["shown"])
            for _ in range(steps):
                p.push("bids", to_zset(g.change(20), BIDS))
                accumulate(view, p.step()["top"])
                assert normalize(view) == duckdb_query(sql, {"bids": (BIDS, dict(g.bag))}), (workers, general)
            p.checkpoint()
        finally:
            p.close()


def test_an_upgraded_directory_drops_the_general_top_ks_input_table_at_its_next_checkpoint(tmp_path) -> None:
    """storage/snapshot.py invariant 10: a directory of the general top-k, written under a 1-byte budget (its traces
    spilled, the checkpoint naming their batch files), reopened by the growing form (operators/top_k.py invariant
    7), which reads no ``input`` table: the table, its order record and the files only it names stay until a
    checkpoint, so a reopen after a crash before one finds them; the first checkpoint deletes them; every reopen's
    results equal DuckDB's. Watched fail on the code that left the table unread forever (still stored after the
    checkpoint)."""
    import os

    from dbsp_core.codec import decode_json
    from dbsp_core.storage import Database
    from dbsp_core.storage.formats import BATCH_REF_MAGIC, SPILL_DIR, state_db_path

    rng = np.random.default_rng(7)

    def stored(d: str) -> tuple[set[str], set[str]]:
        """The input tables (values or order record) of the last checkpoint, and the files their values name."""
        with Database(state_db_path(d, None, 0), readonly=True) as db, db.read(db.versions().stop - 1) as h:
            tables = {t for t in h.tables() if t.endswith(".input") and next(iter(h.scan(t)), None)}
            tables |= {k[len(b"order."):].decode() for k, _ in h.scan("snapshot", prefix=b"order.")
                       if k.endswith(b".input")}
            files = {str(decode_json(BATCH_REF_MAGIC, v, t)["file"]) for t in tables for _, v in h.scan(t)
                     if v[:4] == BATCH_REF_MAGIC}
        return tables, files

    g = ChangeGen(rng, BIDS)
    g.deletes = 0.0
    view: dict = {}
    sql = TOP_BIDDER_SQL
    d = str(tmp_path / "p")

    def steps(p: dbsp.Pipeline, n: int) -> None:
        for _ in range(n):
            p.push("bids", to_zset(g.change(40), BIDS))
            accumulate(view, p.step()["top"])
            assert normalize(view) == duckdb_query(sql, {"bids": (BIDS, dict(g.bag))})

    with dbsp.Pipeline(_top_bidder_circuit(True), storage=d, memory_limit=1) as p:
        steps(p, 4)
        p.checkpoint()
    tables, files = stored(d)
    assert len(tables) == 1 and files, (tables, files)  # the general form's input table names spilled files
    on_disk = lambda: set(os.listdir(os.path.join(d, SPILL_DIR)))  # noqa: E731
    assert files <= on_disk()
    p = dbsp.Pipeline.open(d, _top_bidder_circuit(False), memory_limit=1)
    steps(p, 2)
    p.close(checkpoint=False)  # a crash before the next checkpoint (its steps replay from the input log at reopen)
    assert stored(d)[0] == tables and files <= on_disk()  # the table and its files are still there
    p = dbsp.Pipeline.open(d, _top_bidder_circuit(False), memory_limit=1)
    steps(p, 2)
    p.checkpoint()
    assert not files & on_disk(), sorted(files & on_disk())  # the files only the table named are gone
    steps(p, 1)
    p.close(checkpoint=False)
    assert stored(d) == (set(), set()), stored(d)  # and so are the table and its order record
    with dbsp.Pipeline.open(d, _top_bidder_circuit(False), memory_limit=1) as p:
        steps(p, 2)


def test_top_k_over_a_count_grows_only_where_it_must() -> None:
    """operators/top_k.py invariant 7 holds only for a row count, descending, of an aggregate over inserts only
    grouping by the top-k's keys: any other form keeps the general state."""
    def top(append_only: bool, **kw: object) -> bool:
        c = dbsp.Circuit()
        t = c.input("bids", BIDS, append_only=append_only)
        g = t.group_by("auction", "bidder").agg(n=dbsp.count(), nf=dbsp.count("f"), s=dbsp.sum("price"),
                                                 **kw.pop("more", {}))
        out = g.group_by(kw.pop("keys", "auction")).top_k(1, (kw.pop("col", "n"), kw.pop("dir", "descending")))
        return c.nodes[out.node_id].grows

    assert top(True)
    assert not top(False)  # the count may fall
    assert not top(True, dir="ascending")
    assert not top(True, col="nf") and not top(True, col="s")  # a count of non-nulls or a sum may stay put
    assert not top(True, keys="n")  # a group's new row lands in another top-k group
    assert not top(True, more={"d": dbsp.count_distinct("price")})


JOIN_REST = ("auction", "bidder", "f", "id", "reserve")  # the tie-breaking columns, in the joined schema's order


def _top_k_traces(p: dbsp.Pipeline) -> list[str]:
    return sorted({name.split(".")[-1] for w in range(p.workers) for name in p.traces(w) if "top_k" in name})


@FEW
@given(seed=SEEDS, workers=WORKERS, k=st.sampled_from([1, 2, 3]))
def test_top_k_over_append_only_inputs_keeps_only_its_shown_rows(seed: int, workers: int, k: int) -> None:
    """operators/top_k.py invariant 5: over inserts only (append-only inputs, through a filter and an inner join)
    each top-k keeps its shown trace alone and its results are DuckDB's."""
    def after(p: dbsp.Pipeline) -> None:
        assert _top_k_traces(p) == ["shown"]  # the input trace of the general form is not kept

    run_against_duckdb(lambda c, s: {
        "top": s["bids"].group_by("auction").top_k(k, ("price", "descending")),
        "ties": s["bids"].filter(pc.field("price") > 1).group_by("auction").top_k(k, ("price", "descending"),
                                                                                  with_ties=True),
        "all": s["bids"].group_by().top_k(k, [("price", "descending"), "bidder", "f"]),
        "join": s["bids"].join(s["auctions"], left_on="auction", right_on="id").group_by("category").top_k(
            k, ("price", "descending")),
    }, {
        "top": f"SELECT auction, bidder, price, f FROM (SELECT *, row_number() OVER (PARTITION BY auction {ORDER}) "
               f"AS r FROM bids) WHERE r <= {k}",
        "ties": f"SELECT auction, bidder, price, f FROM (SELECT *, rank() OVER (PARTITION BY auction ORDER BY price "
                f"DESC NULLS LAST) AS r FROM bids WHERE price > 1) WHERE r <= {k}",
        "all": f"SELECT auction, bidder, price, f FROM (SELECT *, row_number() OVER ({ORDER}, auction ASC NULLS "
               f"LAST) AS r FROM bids) WHERE r <= {k}",
        "join": f"SELECT auction, bidder, price, f, id, category, reserve FROM (SELECT *, row_number() OVER ("
                f"PARTITION BY category ORDER BY price DESC NULLS LAST, {', '.join(c + ' NULLS LAST' for c in JOIN_REST)}) AS r "
                f"FROM bids JOIN auctions ON auction = id) WHERE r <= {k}",
    }, seed, workers, steps=7, append_only=True, after=after)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_min_max_over_append_only_inputs_keep_only_their_totals(seed: int, workers: int) -> None:
    """operators/aggregate.py invariant 7: over inserts only, min/max keep their totals alone (no value multisets)
    and their results are DuckDB's, through a filter, a keyless group and an inner join."""
    def after(p: dbsp.Pipeline) -> None:
        names = {name.split(".", 1)[-1] for w in range(p.workers) for name in p.traces(w) if "aggregate" in name}
        assert names == {"totals"}, names

    run_against_duckdb(lambda c, s: {
        "g": s["bids"].group_by("auction").agg(n=dbsp.count(), lo=dbsp.min("price"), hi=dbsp.max("bidder"),
                                               t=dbsp.sum("price")),
        "flt": s["bids"].filter(pc.field("price") > 1).group_by().agg(lo=dbsp.min("f"), hi=dbsp.max("price")),
        "join": s["bids"].join(s["auctions"], left_on="auction", right_on="id").group_by("category").agg(
            hi=dbsp.max("price"), lo=dbsp.min("reserve"), n=dbsp.count()),
        "win": s["bids"].hop("auction", 4, 2).group_by("window_start").agg(hi=dbsp.max("price")),
    }, {
        "g": "SELECT auction, count(*), min(price), max(bidder), sum(price) FROM bids GROUP BY auction",
        "flt": "SELECT min(f), max(price) FROM bids WHERE price > 1 HAVING count(*) > 0",
        "join": "SELECT category, max(price), min(reserve), count(*) FROM bids JOIN auctions ON auction = id "
                "GROUP BY category",
        "win": "SELECT s, max(price) FROM (SELECT price, unnest([auction - auction % 2, auction - auction % 2 - 2]) "
               "AS s FROM bids WHERE auction IS NOT NULL) GROUP BY s",
    }, seed, workers, steps=7, append_only=True, after=after)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_min_max_over_append_only_inputs_reduce_large_changes(seed: int, workers: int) -> None:
    """operators/aggregate.py invariant 8: a change reduced to one row per group (its extreme's row, weighted by the
    group's count; here from any size on) gives DuckDB's results, with bags, null keys and null values; at W > 1
    the exchange before the aggregate reduces it on the sender (runtime/plan.py, ``_ReducedExchange``). At W = 1
    the aggregate reduces only a change it indexes (the totals' key index not serving): the kernel's grouping is the
    reduction otherwise (tests/core/test_aggregate_append_only.py checks that path)."""
    calls: list[bool] = []
    reduced = _ExtremesState._reduced

    def counting(self, z, **kw):
        out = reduced(self, z, **kw)
        calls.append(out is not z)
        return out

    def after(p: dbsp.Pipeline) -> None:
        sent = sum(wk.plan.counts["reduced"] for wk in p.executor._workers)
        assert (sent > 0) == (workers > 1), sent

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_ExtremesState, "REDUCE_ROWS", 1)
        mp.setattr(_ExtremesState, "_reduced", counting)
        run_against_duckdb(lambda c, s: {
            "hi": s["bids"].group_by("auction").agg(hi=dbsp.max("price")),
            "lo": s["bids"].group_by("auction", "bidder").agg(n=dbsp.count(), lo=dbsp.min("price")),
            "join": s["bids"].join(s["auctions"], left_on="auction", right_on="id").group_by("category").agg(
                hi=dbsp.max("reserve"), n=dbsp.count()),
        }, {
            "hi": "SELECT auction, max(price) FROM bids GROUP BY auction",
            "lo": "SELECT auction, bidder, count(*), min(price) FROM bids GROUP BY auction, bidder",
            "join": "SELECT category, max(reserve), count(*) FROM bids JOIN auctions ON auction = id GROUP BY category",
        }, seed, workers, steps=6, max_rows=30, append_only=True, after=after)
    assert any(calls) or workers == 1


def test_append_only_input_refuses_a_retraction_and_records_nothing() -> None:
    c = dbsp.Circuit()
    t = c.input("bids", BIDS, append_only=True)
    c.output("top", t.group_by("auction").top_k(1, ("price", "descending")))
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", to_zset({(1, "a", 5, 1.0): 2}, BIDS))
        assert p.step()["top"].to_dict() == {(1, "a", 5, 1.0): 1}
        with pytest.raises(dbsp.AppendOnlyError, match=r"push\('bids'\).*append-only.*row 1 has weight -1"):
            p.push("bids", to_zset({(1, "b", 9, 1.0): 1, (1, "a", 5, 1.0): -1}, BIDS))
        assert p.step()["top"].to_dict() == {}  # nothing of the refused push was recorded
        assert _top_k_traces(p) == ["shown"]
    with pytest.raises(dbsp.SchemaError, match="append_only=True excludes primary_key"):
        dbsp.Circuit().input("t", BIDS, append_only=True, primary_key=["auction"])


def test_top_k_over_a_stream_that_retracts_keeps_the_general_state() -> None:
    """A minus of append-only streams may retract: the top-k keeps its input trace and serves the deletion."""
    c = dbsp.Circuit()
    t = c.input("bids", BIDS, append_only=True)
    u = c.input("gone", BIDS, append_only=True)
    s = t - u
    assert c.inserts_only(t.node_id) and not c.inserts_only(s.node_id)
    c.output("top", s.group_by("auction").top_k(1, ("price", "descending")))
    c.output("hi", s.group_by("auction").agg(hi=dbsp.max("price")))
    with dbsp.Pipeline(c, workers=1) as p:
        p.push("bids", to_zset({(1, "a", 5, 1.0): 1, (1, "b", 9, 1.0): 1}, BIDS))
        out = p.step()
        assert out["top"].to_dict() == {(1, "b", 9, 1.0): 1} and out["hi"].to_dict() == {(1, 9): 1}
        p.push("gone", to_zset({(1, "b", 9, 1.0): 1}, BIDS))
        out = p.step()
        assert out["top"].to_dict() == {(1, "b", 9, 1.0): -1, (1, "a", 5, 1.0): 1}
        assert out["hi"].to_dict() == {(1, 9): -1, (1, 5): 1}  # re-reduced from the value multiset
        assert _top_k_traces(p) == ["input", "shown"]


def test_append_only_top_k_fed_a_retraction_raises() -> None:
    """operators/top_k.py invariant 5: the shown-rows-only state cannot serve a deletion, and says so."""
    from dbsp_core.operators.top_k import TopK

    c = dbsp.Circuit()
    t = c.input("bids", BIDS)
    src = t._exchanged(("auction",))
    c.output("top", c.add_operator(TopK(src.node_id, BIDS, ("auction",), (("price", "descending"),), 1, False,
                                        "top_k", append_only=True)))
    with dbsp.Pipeline(c) as p:
        p.push("bids", to_zset({(1, "a", 5, 1.0): -1}, BIDS))
        with pytest.raises(dbsp.DbspError, match=r"top_k#\d+: a retraction reached a top-k over an append-only"):
            p.step()


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
                if "top_k" in name:
                    assert trace.key == ("auction",), name
                if "count_distinct" in name:  # operators/count_distinct.py invariant 1: the (group, value) pair
                    assert trace.key == ("auction", "bidder"), name


def test_count_distinct_of_one_group_spreads_over_the_workers() -> None:
    """A count distinct whose group is one key (Nexmark q15's day) keeps its (group, value) pairs on every
    worker, not all on the one that owns the group, and sums their counts exactly."""
    c = dbsp.Circuit()
    t = c.input("bids", BIDS)
    c.output("nd", t.group_by("bidder").agg(nd=dbsp.count_distinct("auction"), n=dbsp.count()))
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", to_zset({(a, "day", a % 7, 0.5): 1 for a in range(400)}, BIDS))
        assert p.step()["nd"].to_dict() == {("day", 400, 400): 1}
        held = [sum(len(b) for b in tr.batches) for w in range(2) for name, tr in p.traces(w).items()
                if "count_distinct" in name]
        assert len(held) == 2 and all(100 < n < 300 for n in held), held
        p.push("bids", to_zset({(a, "day", a % 7, 0.5): -1 for a in range(0, 400, 2)}, BIDS))
        assert p.step()["nd"].to_dict() == {("day", 400, 400): -1, ("day", 200, 200): 1}


@settings(max_examples=examples(3))
@pytest.mark.parametrize("workers", [1, 2, 3])
@given(seed=SEEDS)
def test_count_distinct_of_few_groups(seed: int, workers: int) -> None:
    """q15/q16's shape: few groups (a string key) each with many distinct values, counted where each (group,
    value) pair lives and summed per group (operators/count_distinct.py), under retractions, at W = 1, 2, 3."""
    run_against_duckdb(lambda c, s: {
        "g": s["bids"].group_by("bidder").agg(n=dbsp.count(), na=dbsp.count_distinct("auction"),
                                              nf=dbsp.count_distinct("f"), nb=dbsp.count_distinct("bidder")),
        "k": s["bids"].group_by().agg(nf=dbsp.count_distinct("f")),
    }, {
        "g": "SELECT bidder, count(*), count(DISTINCT auction), count(DISTINCT f), count(DISTINCT bidder) "
             "FROM bids GROUP BY bidder",
        "k": "SELECT count(DISTINCT f) FROM bids HAVING count(*) > 0",
    }, seed, workers, inputs=("bids",), steps=6, max_rows=30)


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


def test_top_k_with_ties_ordered_by_its_group_key() -> None:
    """An order column that is also a group key: every row of a group ties (the run columns name it once)."""
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("a", pa.int64()), ("b", pa.int64())]))
    c.output("o", t.group_by("a").top_k(1, ("a", "descending"), with_ties=True))
    with dbsp.Pipeline(c) as p:
        p.push("t", pa.table({"a": [1, 1, 2], "b": [3, 4, 5]}))
        assert p.step()["o"].to_dict() == {(1, 3): 1, (1, 4): 1, (2, 5): 1}
