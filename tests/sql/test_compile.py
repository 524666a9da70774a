"""dbsp_core.sql.compile: table definitions (types, primary keys, event time), errors that name the line, column and what is missing, and views that run on every runtime."""

from __future__ import annotations

import datetime
import os
import tempfile

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.runtime.staged import StagedExecutor
from dbsp_core.sql import SqlError

T = "CREATE TABLE t (a INT, b BIGINT, s VARCHAR, ts TIMESTAMP(3));\n"


def test_tables_become_inputs_with_their_types_keys_and_event_time() -> None:
    c = sql.compile("""
        CREATE TABLE Person (id BIGINT NOT NULL PRIMARY KEY, name VARCHAR, score DOUBLE, born DATE, ok BOOLEAN);
        CREATE TABLE bid (auction BIGINT, price BIGINT, dateTime TIMESTAMP(3),
                          WATERMARK FOR dateTime AS dateTime - INTERVAL '4' SECOND, PRIMARY KEY (auction, price));
        CREATE TABLE ev (k INT, t BIGINT LATENESS 10);
        CREATE TABLE ev2 (k INT, ts TIMESTAMP LATENESS INTERVAL 1 MINUTE);
        CREATE VIEW "Names" AS SELECT name FROM person;
    """)
    assert sorted(c.inputs) == ["bid", "ev", "ev2", "person"]
    assert list(c.outputs) == ["names"]  # DuckDB folds quoted names too
    person = c.nodes[c.inputs["person"]]
    assert person.schema.types == [pa.int64(), pa.string(), pa.float64(), pa.date32(), pa.bool_()]
    assert c.sql.tables["person"].primary_key == ("id",) and c.sql.tables["bid"].primary_key == ("auction", "price")
    bid = c.nodes[c.inputs["bid"]]
    assert (bid.event_time, bid.lateness) == ("datetime", 4000)
    assert bid.schema.field("datetime").type == pa.timestamp("ms")
    ev = c.nodes[c.inputs["ev"]]
    assert (ev.event_time, ev.lateness) == ("t", 10)
    ev2 = c.nodes[c.inputs["ev2"]]
    assert (ev2.event_time, ev2.lateness) == ("ts", 60_000_000)


def test_event_time_drops_late_rows_and_closed_windows() -> None:
    c = sql.compile("""
        CREATE TABLE bid (price BIGINT, t BIGINT LATENESS 5);
        CREATE VIEW w AS SELECT window_start, count(*) AS n, max(price) AS top
                         FROM TABLE(TUMBLE(TABLE bid, DESCRIPTOR(t), 10)) GROUP BY window_start;
    """)
    p = dbsp.Pipeline(c)
    p.push("bid", pa.table({"price": [5, 9, 7], "t": [1, 4, 12]}))
    assert p.step()["w"].to_dict() == {(0, 2, 9): 1, (10, 1, 7): 1}
    p.push("bid", pa.table({"price": [1], "t": [2]}))  # below the watermark 12 - 5: late
    assert p.step()["w"].to_dict() == {}
    assert p.late_rows == {"bid": 1}
    p.close()


ERRORS = [
    (T + "CREATE VIEW v AS SELECT a FROM t ORDER BY a LIMIT 2 OFFSET 1", 2, 60, "OFFSET is not supported"),
    (T + "CREATE VIEW v AS SELECT a FROM t LIMIT 3", 2, 40, "LIMIT needs ORDER BY"),
    (T + "CREATE VIEW v AS SELECT nope FROM t", 2, 25, "unknown column nope"),
    (T + "CREATE VIEW v AS SELECT a FROM missing", 2, 32, "unknown table or view 'missing'"),
    (T + "CREATE VIEW v AS SELECT a,\n  arg_min(b, a) FROM t", 3, 11, "aggregate ARG_MIN is not supported"),
    (T + "CREATE VIEW v AS SELECT a, sum(s) FROM t GROUP BY a", 2, 28, "SUM needs a numeric argument"),
    (T + "CREATE VIEW v AS SELECT a FROM t WHERE s + 1 > 2", 2, 40, "arithmetic needs numbers"),
    (T + "CREATE VIEW v AS SELECT a, lag(b) OVER (ORDER BY a) FROM t", 2, 28, "window functions"),
    (T + "CREATE VIEW v AS SELECT a FROM t POSITIONAL JOIN t AS x", 2, 50, "POSITIONAL JOIN is not supported"),
    (T + "CREATE VIEW v AS SELECT a FROM t EXCEPT ALL SELECT a FROM t", 2, 25, "EXCEPT ALL is not supported"),
    (T + "CREATE VIEW v AS SELECT CAST(b AS DECIMAL(20, 2)) FROM t", 2, 30, "the precision is 1 to 18"),
    (T + "CREATE VIEW v AS SELECT a FROM t WHERE a IN (SELECT sum(t.b) FROM t AS x WHERE x.b > t.a)", 2, 53,
     "an aggregate of only enclosing-query columns"),
    (T + "CREATE VIEW v AS WITH RECURSIVE r(x) AS (SELECT a FROM t UNION SELECT count(*) FROM r) SELECT * FROM r",
     2, 71, "aggregates and GROUP BY over recursive CTE 'r' cannot be maintained"),
    (T + "CREATE VIEW v AS WITH RECURSIVE r(x) AS (SELECT a FROM t UNION SELECT r.x FROM r JOIN r AS q ON r.x = q.x) "
         "SELECT * FROM r", 2, 87, "only linear recursion"),
    (T + "CREATE VIEW v AS SELECT a FROM t ORDER BY a NULLS FIRST LIMIT 1", 2, 43, "NULLS FIRST"),
    (T + "INSERT INTO t VALUES (1, 2, 'x', NULL)", 2, 13, "only CREATE TABLE and CREATE [MATERIALIZED] VIEW"),
    ("CREATE TABLE x (a DECIMAL(38, 2))", 1, 17, "DECIMAL(38, 2): the precision is 1 to 18"),
    ("CREATE TABLE x (a INT, ts TIMESTAMP,\n  WATERMARK FOR ts AS ts + 1)", 2, 23, "must read 'ts - <lateness>'"),
    (T + "CREATE VIEW v AS SELECT a FROM t WHERE", 2, 38, "syntax error"),
    (T + "CREATE VIEW v AS SELECT a, b FROM t GROUP BY a", 2, 28,
     "column b must appear in GROUP BY or be used in an aggregate function"),
]


@pytest.mark.parametrize("text,line,col,what", ERRORS, ids=[e[3][:30] for e in ERRORS])
def test_unsupported_sql_names_line_column_and_what(text: str, line: int, col: int, what: str) -> None:
    with pytest.raises(SqlError) as info:
        sql.compile(text)
    e = info.value
    assert what in str(e), str(e)
    assert (e.line, e.column) == (line, col), str(e)
    assert str(e).startswith(f"line {line}, column {col}: ")


VIEWS = """
CREATE TABLE bid (auction BIGINT, bidder BIGINT, price BIGINT);
CREATE TABLE e (src INT, dst INT);
CREATE VIEW big AS SELECT auction, count(*) AS n, sum(price) AS total FROM bid WHERE price > 5 GROUP BY auction;
CREATE VIEW best AS SELECT auction, bidder, price FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY auction
    ORDER BY price DESC, bidder) AS rn FROM bid) WHERE rn = 1;
CREATE VIEW reach AS WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e UNION SELECT r.a, e.dst FROM r JOIN e
    ON r.b = e.src) SELECT * FROM r;
CREATE VIEW lonely AS SELECT bidder FROM bid WHERE bidder NOT IN (SELECT auction FROM bid);
"""


def _feed(p: dbsp.Pipeline, step: int) -> dict:
    bid = pa.table({"auction": [1, 1, 2, step], "bidder": [7, 8, 9, 1], "price": [10 + step, 7, 3, 6]})
    p.push("bid", bid)
    p.push("e", pa.table({"src": pa.array([step, step + 1], pa.int32()), "dst": pa.array([step + 1, 0], pa.int32())}))
    if step == 2:
        p.push("bid", dbsp.ZSet.from_arrow(bid.slice(0, 2), weights=[-1, -1]))
    return {k: z.to_dict() for k, z in p.step().items()}


def test_compiled_views_run_embedded_durable_and_staged_alike() -> None:
    c = sql.compile(VIEWS)
    p = dbsp.Pipeline(c, workers=2)
    want = [_feed(p, s) for s in range(5)]
    p.close()
    d = tempfile.mkdtemp()
    p = dbsp.Pipeline(c, workers=3, storage=d)
    got = [_feed(p, s) for s in range(2)]
    p.checkpoint()
    p.close()
    p = dbsp.Pipeline.open(d, c, workers=2)
    got += [_feed(p, s) for s in range(2, 5)]
    p.close()
    assert got == want
    d = tempfile.mkdtemp()
    p = dbsp.Pipeline(c, workers=2, storage=d, executor=StagedExecutor())
    got = [_feed(p, s) for s in range(3)]
    p.close()
    p = dbsp.Pipeline.open(d, c, workers=3, executor=StagedExecutor())
    got += [_feed(p, s) for s in range(3, 5)]
    p.close()
    assert got == want


def test_cli_prints_the_plan_of_each_view(tmp_path, capsys) -> None:
    from dbsp_core.__main__ import main

    f = tmp_path / "v.sql"
    f.write_text(VIEWS)
    assert main(["sql", str(f), "--view", "reach", "--view", "big"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("view reach (a int32, b int32): ")
    assert "fixpoint#" in out and "shard by (__dbsp_global)" in out and "body:" in out
    assert "view big (auction int64, n int64, total int64): 5 operators, 1 exchanges, 1 traces" in out
    assert "state: trace: trace keyed by (auction)" in out
    f.write_text("CREATE TABLE t (a INT);\nCREATE VIEW v AS SELECT b FROM t")
    assert main(["sql", str(f)]) == 2
    assert capsys.readouterr().err.startswith(f"{f}:2:25: unknown column b")


APPEND_ONLY_SEED = int(os.environ.get("DBSP_APPEND_ONLY_SEED", "0"))  # drawn per run by tests/conftest.py


@pytest.mark.parametrize("workers", [1, 2])
def test_append_only_table_row_number_view_matches_duckdb(workers: int) -> None:
    """``WITH ('append_only' = 'true')``: the table refuses deletions, the ROW_NUMBER view's top-k keeps only its
    shown rows (operators/top_k.py invariant 5) and the view is DuckDB's over every row pushed."""
    import duckdb
    import numpy as np

    ddl = ("CREATE TABLE bid (auction BIGINT, bidder BIGINT, price BIGINT, url VARCHAR) "
           "WITH ('append_only' = 'true');\n")
    view = ("SELECT auction, bidder, price, url FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY bidder, auction "
            "ORDER BY price DESC, url) AS rn FROM bid) WHERE rn <= {k}")
    c = sql.compile(ddl + f"CREATE VIEW last1 AS {view.format(k=1)};\nCREATE VIEW last2 AS {view.format(k=2)};")
    rng = np.random.default_rng(APPEND_ONLY_SEED)
    pushed: list[pa.Table] = []
    got: dict[str, dict] = {"last1": {}, "last2": {}}
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in range(6):
            n = int(rng.integers(1, 40))
            t = pa.table({"auction": rng.integers(0, 4, n), "bidder": rng.integers(0, 5, n),
                          "price": rng.integers(0, 30, n), "url": [f"u{i}" for i in rng.integers(0, 3, n)]})
            p.push("bid", t)
            pushed.append(t)
            out = p.step()
            every = pa.concat_tables(pushed)  # noqa: F841 (read by DuckDB)
            for name, k in (("last1", 1), ("last2", 2)):
                for r, w in out[name].to_dict().items():
                    got[name][r] = got[name].get(r, 0) + w
                got[name] = {r: w for r, w in got[name].items() if w}
                want: dict = {}
                for r in duckdb.sql(view.format(k=k).replace("FROM bid", "FROM every")).fetchall():
                    want[r] = want.get(r, 0) + 1
                assert got[name] == want, (f"{name} after step {step} (W={workers}, "
                                           f"DBSP_APPEND_ONLY_SEED={APPEND_ONLY_SEED})")
        with pytest.raises(dbsp.AppendOnlyError, match="append-only"):
            p.push("bid", pa.table({"auction": [0], "bidder": [0], "price": [1], "url": ["u0"]}), weights=[-1])
        names = {name.split(".")[-1] for w in range(workers) for name in p.traces(w) if "top_k" in name}
        assert names == {"shown"}
    with pytest.raises(SqlError, match="option 'append_only' takes 'true' or 'false'"):
        sql.compile("CREATE TABLE t (a BIGINT) WITH ('append_only' = 'yes');")
