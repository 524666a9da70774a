"""Materialized views and ad-hoc queries (``Pipeline.view``, ``Pipeline.query``): after every step of random inserts and
deletes, each materialized view's contents equal DuckDB's answer over the integrated tables, at W in {1, 2, 4}, in
memory (with a live rescale), durable (with a cold rescale on reopen) and on the staged executor; queries over
views and tables equal DuckDB's over the same data; writes and unreadable names are refused."""

from __future__ import annotations

import os
from collections import Counter

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core as dbsp
from dbsp_core.runtime import StagedExecutor
from oracle import register_bags

SEED = int(os.environ.get("DBSP_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])

AGG = "SELECT auction, COUNT(*) AS n, SUM(price) AS total FROM bids GROUP BY auction"
SQL = {"bids": "SELECT * FROM bids", "auctions": "SELECT * FROM auctions",
       "big": "SELECT * FROM bids WHERE price > 50",
       "agg": AGG,
       "cat": "SELECT category, COUNT(*) AS n FROM bids JOIN auctions ON auction = id GROUP BY category",
       "pairs": "SELECT DISTINCT auction, bidder FROM bids"}
# an ad-hoc query over a view and a table, and what it means over the tables alone (DuckDB's answer)
QUERY = "SELECT category, SUM(total) AS s, COUNT(*) AS k FROM agg JOIN auctions ON agg.auction = auctions.id " \
        "GROUP BY category"
QUERY_ORACLE = QUERY.replace("FROM agg", f"FROM ({AGG}) agg")


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS, materialized=True)
    a = c.input("auctions", AUCTIONS, materialized=True)
    c.output("big", b.filter(pc.field("price") > 50), materialized=True)  # not partitioned: exchanged by its rows
    c.output("agg", b.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price")), materialized=True)
    c.output("cat", b.join(a, left_on="auction", right_on="id").group_by("category").agg(n=dbsp.count()),
             materialized=True)
    c.output("pairs", b.select(auction="auction", bidder="bidder").distinct(), materialized=True)
    c.output("plain", b.select(auction="auction"))  # not materialized
    return c


def rows(t: pa.Table) -> Counter:
    """A view read as rows: the multiset of its row tuples."""
    return Counter(zip(*[t.column(i).to_pylist() for i in range(t.num_columns)]))


class Model:
    """The integrated tables as multisets, and random changes that delete only rows they hold."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.bids: Counter = Counter()
        self.auctions: Counter = Counter()

    def _change(self, bag: Counter, new: list[tuple], schema: pa.Schema) -> dbsp.ZSet:
        held = sorted(bag.elements())
        gone = [held[i] for i in self.rng.choice(len(held), size=min(len(held), int(self.rng.integers(0, 6))),
                                                    replace=False)] if held else []
        change = Counter(new)
        change.subtract(gone)
        bag.update(change)
        for r in [r for r, w in bag.items() if w == 0]:
            del bag[r]
        assert all(w > 0 for w in bag.values())
        items = [(r, w) for r, w in change.items() if w]
        return dbsp.ZSet.from_rows([r for r, _ in items], schema, weights=[w for _, w in items])

    def step(self) -> dict[str, dbsp.ZSet]:
        r = self.rng
        bids = [(int(r.integers(0, 12)), int(r.integers(0, 4)), int(r.integers(0, 100)))
                for _ in range(int(r.integers(0, 12)))]
        auctions = [(int(r.integers(0, 12)), int(r.integers(0, 3))) for _ in range(int(r.integers(0, 3)))]
        return {"bids": self._change(self.bids, bids, BIDS), "auctions": self._change(self.auctions, auctions,
                                                                                      AUCTIONS)}

    def tables(self) -> dict:
        return {"bids": (BIDS, dict(self.bids)), "auctions": (AUCTIONS, dict(self.auctions))}


def check(p: dbsp.Pipeline, m: Model, where: str) -> None:
    con = duckdb.connect()
    try:
        register_bags(con, m.tables())
        for name, sql in SQL.items():
            got, want = rows(p.view(name)), rows(con.sql(sql).to_arrow_table())
            assert got == want, f"{where}: view {name!r} differs: only ours {got - want}, only DuckDB's {want - got}"
        got, want = rows(p.query(QUERY)), rows(con.sql(QUERY_ORACLE).to_arrow_table())
        assert got == want, f"{where}: the query differs: only ours {got - want}, only DuckDB's {want - got}"
    finally:
        con.close()


def run(p: dbsp.Pipeline, m: Model, steps: int, where: str) -> None:
    for s in range(steps):
        for handle, z in m.step().items():
            if z.num_rows:
                p.push(handle, z)
        p.step()
        check(p, m, f"{where} step {s}")


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_materialized_views_equal_duckdb_after_every_step_in_memory(workers) -> None:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    m = Model(np.random.default_rng([SEED, workers]))
    p = dbsp.Pipeline(circuit(), workers=workers, shard_bits=4)
    run(p, m, 12, f"W={workers}")
    p.rescale(3 if workers != 3 else 2, batch_shards=3)  # the materialized state moves by shard
    run(p, m, 6, f"W={workers} after a live rescale")
    assert sum(t.num_rows for w in range(p.workers) for n, t in p.traces(w).items()
               if n.startswith("materialize#")) > 0  # the contents are the executor's traces
    p.close()


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_materialized_views_survive_close_and_reopen_at_another_worker_count(tmp_path, kind) -> None:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    m = Model(np.random.default_rng([SEED, 7]))
    ex = (lambda: StagedExecutor()) if kind == "staged" else (lambda: None)
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=2, shard_bits=4, storage=d, executor=ex(), checkpoint_interval=None)
    run(p, m, 5, f"{kind} W=2")
    p.close()
    q = dbsp.Pipeline.open(d, circuit(), workers=4, executor=ex(), checkpoint_interval=None)  # a cold rescale
    assert q.last_rescale and q.last_rescale["to_workers"] == 4
    check(q, m, f"{kind} reopened at W=4")
    run(q, m, 4, f"{kind} W=4")
    q.close()


def test_view_refuses_what_is_not_readable_and_shows_weights_on_demand() -> None:
    c = circuit()
    b = c.nodes[c.inputs["bids"]]
    neg = -dbsp.Stream(c, c.readable["bids"] - 1)  # the exchange before the table's materialize node
    assert b.name == "bids"
    c.output("neg", neg, materialized=True)
    p = dbsp.Pipeline(c, workers=2)
    p.push("bids", pa.table({"auction": [1, 1], "bidder": [2, 2], "price": [60, 60]}))
    p.step()
    assert rows(p.view("big")) == Counter({(1, 2, 60): 2})  # each row as many times as its weight
    assert p.view("big", weights=True).to_pylist() == [{"auction": 1, "bidder": 2, "price": 60, "weight": 2}]
    assert p.view("agg").to_pandas().to_dict("records") == [{"auction": 1, "n": 2, "total": 120}]
    with pytest.raises(dbsp.DbspError, match="negative weight.*weights=True"):
        p.view("neg")
    assert p.view("neg", weights=True).column("weight").to_pylist() == [-2]
    with pytest.raises(KeyError, match="'plain' is not materialized.*CREATE MATERIALIZED VIEW"):
        p.view("plain")
    with pytest.raises(KeyError, match="no table or view 'nope'"):
        p.view("nope")
    with pytest.raises(ValueError, match="already a readable"):
        c.output("big2", neg, materialized=False) or c.output("bids", neg, materialized=True)
    p.close()


@pytest.mark.parametrize("sql,match", [
    ("DELETE FROM big", "DELETE statement"),
    ("INSERT INTO bids VALUES (1, 2, 3)", "INSERT statement"),
    ("UPDATE bids SET price = 0", "UPDATE statement"),
    ("CREATE TABLE x AS SELECT * FROM bids", "CREATE statement"),
    ("DROP VIEW big", "DROP statement"),
    ("COPY bids TO 'x.csv'", "COPY statement"),
    ("SELECT 1; SELECT 2", "one statement, got 2"),
    ("SELECT * FROM plain", "plain.*the tables and views it can read: "),
    ("SELECT * FROM read_csv('/etc/passwd')", "file system operations are disabled"),
    ("SELEC 1", "does not parse|syntax"),
])
def test_query_refuses_writes_and_what_it_cannot_read(sql, match) -> None:
    p = dbsp.Pipeline(circuit(), workers=2)
    p.push("bids", pa.table({"auction": [1], "bidder": [2], "price": [60]}))
    p.step()
    with pytest.raises(dbsp.QueryError, match=match):
        p.query(sql)
    assert rows(p.view("bids")) == Counter({(1, 2, 60): 1})  # nothing changed
    assert p.query("SELECT count(*) AS n FROM big").to_pydict() == {"n": [1]}
    p.close()
