"""The SQL people write (issue 38, item 3): statements once answered wrongly, refused or failing, each checked against DuckDB on the same data, or refused where DuckDB refuses too (or where the engine cannot honour the clause).

Views run through random steps with deletions at W in {1, 2, 4} (seed from DBSP_SQL_SEED, printed in the header);
rows are compared as multisets, column order included (a row is a tuple in its view's column order).
"""

from __future__ import annotations

from types import SimpleNamespace

import duckdb
import pyarrow as pa
import pytest

from dbsp_core import sql
from dbsp_core.sql import SqlError
from sql_oracle import SEED, run_views

DDL = """
CREATE TABLE t1 (a INT, b INT);
CREATE TABLE t2 (b INT, c INT);
CREATE TABLE t3 (c INT, d INT);
CREATE TABLE tab0 (col0 INT, col1 INT, col2 INT);
CREATE TABLE strings (v VARCHAR);
CREATE TABLE integer (i INT);
"""
TABLES = {
    "t1": pa.schema([("a", pa.int32()), ("b", pa.int32())]),
    "t2": pa.schema([("b", pa.int32()), ("c", pa.int32())]),
    "t3": pa.schema([("c", pa.int32()), ("d", pa.int32())]),
    "tab0": pa.schema([("col0", pa.int32()), ("col1", pa.int32()), ("col2", pa.int32())]),
    "strings": pa.schema([("v", pa.string())]),
    "integer": pa.schema([("i", pa.int32())]),
}

# (name, SELECT): each answered like DuckDB, columns in DuckDB's order
VIEWS = [
    # USING columns stand where the left side has them (they were put first: c, b, a, d)
    ("using_chain", "SELECT * FROM t1 JOIN t2 USING (b) JOIN t3 USING (c)"),
    ("using_left", "SELECT * FROM t2 LEFT JOIN t1 USING (b)"),
    ("using_right", "SELECT * FROM t2 RIGHT JOIN t1 USING (b)"),
    ("using_full", "SELECT * FROM t2 FULL JOIN t1 USING (b)"),
    ("using_twice", "SELECT * FROM t1 JOIN t2 USING (b) JOIN t2 AS x USING (b, c)"),
    ("using_full_twice", "SELECT * FROM t1 FULL JOIN t2 USING (b) FULL JOIN t1 AS x USING (b)"),
    ("using_left_then", "SELECT * FROM t1 LEFT JOIN t2 USING (b) JOIN t3 USING (c)"),
    ("using_stars", "SELECT t1.*, t2.* FROM t1 JOIN t2 USING (b)"),
    ("using_qualified", "SELECT t1.b, t2.b AS b2, b, c FROM t1 JOIN t2 USING (b)"),
    # parenthesised joins
    ("paren_cross", "SELECT * FROM ( tab0 AS cor0 CROSS JOIN tab0 cor1 ) WHERE cor0.col0 < cor1.col1"),
    ("paren_table", "SELECT * FROM (tab0)"),
    ("paren_join", "SELECT cor0.col0, cor1.col2 FROM (tab0 AS cor0 JOIN tab0 AS cor1 ON cor0.col1 = cor1.col0), t1 "
                   "WHERE t1.a = cor0.col2"),
    ("paren_nested", "SELECT * FROM ((t1 JOIN t2 USING (b)) JOIN t3 ON t3.c = t2.c)"),
    # GROUP BY qualified by an alias, with SELECT *
    ("group_alias", "SELECT * FROM tab0 AS cor0 GROUP BY cor0.col1, cor0.col2, cor0.col0"),
    ("group_alias_count", "SELECT cor0.col1, count(*) AS n FROM tab0 AS cor0 GROUP BY cor0.col1"),
    # x'..' is a BLOB literal
    ("blob", "SELECT x'303132' AS x, col0 FROM tab0"),
    # a correlated IN whose value and correlation key are the same column (an IndexError in the left join)
    ("in_same_key", "SELECT v, 'a' IN (SELECT * FROM strings WHERE v = s1.v) AS x FROM strings AS s1"),
    ("in_same_key_where", "SELECT v FROM strings AS s1 WHERE 'a' IN (SELECT * FROM strings WHERE v = s1.v)"),
    ("not_in_same_key", "SELECT v FROM strings AS s1 WHERE 'a' NOT IN (SELECT * FROM strings WHERE v = s1.v)"),
    # IN () is false, NULL for a NULL operand
    ("in_empty", "SELECT a, a IN () AS x, a NOT IN () AS y FROM t1"),
    ("in_empty_where", "SELECT a FROM t1 WHERE b NOT IN ()"),
    # a string literal against a number is cast to the number's type
    ("cast_eq", "SELECT a, b FROM t1 WHERE a = '1' OR ' 3 ' > b"),
    ("cast_in_list", "SELECT a FROM t1 WHERE a IN ('1', 2, '+4')"),
    ("cast_in_subquery", "SELECT b, '1' IN (SELECT a FROM t1) AS x FROM t2"),
    ("cast_in_where", "SELECT b FROM t2 WHERE '2' IN (SELECT a FROM t1 WHERE t1.b = t2.b)"),
    # HAVING names an output alias
    ("having_alias", "SELECT a AS k, count(*) AS n FROM t1 GROUP BY a HAVING count(*) NOT IN (k)"),
    ("having_alias_agg", "SELECT a AS k, sum(b) AS s FROM t1 GROUP BY a HAVING s > 3"),
    # SEMI / ANTI JOIN: the left rows with (without) a match, only the left columns visible
    ("semi_on", "SELECT * FROM t1 SEMI JOIN t2 ON t1.b = t2.b"),
    ("anti_on", "SELECT * FROM t1 ANTI JOIN t2 ON t1.b = t2.b"),
    ("semi_lt", "SELECT * FROM t1 SEMI JOIN t2 ON t1.b < t2.c"),
    ("anti_or", "SELECT * FROM t1 ANTI JOIN t2 ON t1.b < t2.c OR t2.b IS NULL"),
    ("anti_using", "SELECT * FROM t1 ANTI JOIN t2 USING (b)"),
    ("semi_then_join", "SELECT * FROM t1 SEMI JOIN t2 USING (b) JOIN t3 ON t3.c = t1.a"),
    # NATURAL JOIN: USING the names both sides show
    ("natural_inner", "SELECT * FROM t1 NATURAL JOIN t2"),
    ("natural_left", "SELECT * FROM t2 NATURAL LEFT JOIN t3"),
    ("natural_full", "SELECT * FROM t1 NATURAL FULL JOIN t2"),
    ("natural_anti", "SELECT * FROM t1 NATURAL ANTI JOIN t2"),
    ("natural_narrow", "SELECT t1.a FROM t1 NATURAL JOIN t2 NATURAL LEFT JOIN t3"),
    ("natural_renamed", "SELECT * FROM t2 AS q(x, c) NATURAL JOIN t3"),
    # a table named like a type
    ("table_integer", "SELECT i, count(*) AS n FROM integer GROUP BY i"),
    # a number as a condition is true when nonzero (WHERE 0)
    ("where_zero", "SELECT a FROM t1 WHERE 0"),
    ("where_int", "SELECT a FROM t1 WHERE b OR a"),
    ("case_int", "SELECT CASE WHEN a THEN 1 ELSE 2 END AS x, NOT b AS y FROM t1"),
    # the enclosing query's alias inside a subquery without FROM
    ("outer_alias", "SELECT a, (SELECT i1.a) AS x FROM t1 AS i1"),
    ("outer_alias_where", "SELECT a FROM t1 AS i1 WHERE b = (SELECT i1.b + 0 WHERE i1.a > 1)"),
]


def _entries() -> list:
    return [SimpleNamespace(sql=f"CREATE VIEW {n} AS {q};", duck=None) for n, q in VIEWS]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_dialect_views_equal_duckdb(workers: int) -> None:
    run_views(DDL, TABLES, _entries(), SEED + workers, workers, steps=6, max_rows=6, label="dialect")


def test_using_columns_keep_duckdb_order() -> None:
    """The column names too, not only the values' order."""
    c = sql.compile(DDL + "CREATE VIEW v AS SELECT * FROM t1 JOIN t2 USING (b) JOIN t3 USING (c);")
    con = duckdb.connect()
    con.execute(DDL)
    want = [d[0] for d in con.execute("SELECT * FROM t1 JOIN t2 USING (b) JOIN t3 USING (c)").description]
    assert c.nodes[c.outputs["v"]].schema.names == want == ["a", "b", "c", "d"]


# (SQL, what our message says): DuckDB refuses these too
REFUSED_BY_BOTH = [
    ("SELECT * FROM t1 JOIN t2 USING (t1.b)", "USING .* takes column names"),
    ("SELECT max() FROM t1", r"MAX\(\) needs an argument"),
    ("SELECT a FROM t1 WHERE a = 'hello'", "cannot compare int32 with 'hello'"),
    ("SELECT a FROM t1 WHERE 'hello' IN (SELECT a FROM t1)", "cannot compare int32 with 'hello'"),
    ("SELECT a + '1' FROM t1", "arithmetic needs numbers"),  # only comparisons cast a string literal
    ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3 ORDER BY n) SELECT * FROM r",
     "ORDER BY is not allowed on the UNION of recursive CTE 'r'"),
    ("SELECT * FROM t1 NATURAL JOIN t3", "NATURAL JOIN: the two sides have no column name in common"),
    ("SELECT * FROM t1 LEFT SEMI JOIN t2 USING (b)", "LEFT SEMI JOIN is not DuckDB SQL"),
    ("SELECT t2.c FROM t1 SEMI JOIN t2 USING (b)", "unknown column t2.c"),
    ("SELECT * FROM t1 SEMI JOIN t2 ON b = c", "column 'b' is ambiguous"),
]


@pytest.mark.parametrize("query,message", REFUSED_BY_BOTH)
def test_refused_like_duckdb(query: str, message: str) -> None:
    con = duckdb.connect()
    con.execute(DDL + "INSERT INTO t1 VALUES (1, 2); INSERT INTO t2 VALUES (2, 3);")
    with pytest.raises(duckdb.Error):
        con.execute(query).fetchall()
    with pytest.raises(SqlError, match=message):
        sql.compile(DDL + f"CREATE VIEW v AS {query};")


# Accepted by DuckDB, but the engine cannot honour them: refused, never accepted and ignored
REFUSED = [
    # DuckDB runs LIMIT once per iteration of the recursion; the engine's fixed point has no iterations
    ("CREATE VIEW v AS WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL (SELECT n + 1 FROM r WHERE n < 3 LIMIT 1)) "
     "SELECT * FROM r;", "ORDER BY, LIMIT and OFFSET cannot be maintained inside the recursive query"),
    ("CREATE TABLE s (v VARCHAR COLLATE NOCASE);", "COLLATE is not supported"),
    # nested and interval columns: the engine's rows are flat columns (its traces, hashes and comparisons in C
    # read fixed-width, string and binary columns only)
    ("CREATE TABLE s (v STRUCT(i INT, j VARCHAR));", r"type STRUCT<i INT, j TEXT> is not supported"),
    ("CREATE TABLE s (v INT[]);", "type ARRAY<INT> is not supported"),
    ("CREATE TABLE s (v MAP(INT, INT));", "type MAP<INT, INT> is not supported"),
    ("CREATE TABLE s (v INTERVAL);", "type INTERVAL is not supported"),
    ("CREATE VIEW v AS SELECT {'a': a} AS s FROM t1;", "is not supported"),
    ("CREATE VIEW v AS SELECT [a, b] AS l FROM t1;", "is not supported"),
    ("CREATE VIEW v AS SELECT INTERVAL 1 DAY AS i FROM t1;", "an INTERVAL can only be added to or subtracted from"),
    ("CREATE VIEW v AS SELECT v FROM strings WHERE v = 'A' COLLATE NOCASE;", "COLLATE is not supported"),
]


@pytest.mark.parametrize("text,message", REFUSED)
def test_refused_not_ignored(text: str, message: str) -> None:
    with pytest.raises(SqlError, match=message):
        sql.compile(DDL + text)


def test_missing_semicolon_is_named() -> None:
    with pytest.raises(SqlError, match=r"missing ';' before line 3, column 1") as e:
        sql.compile("CREATE TABLE t (a INT);\nCREATE TABLE u (b INT)\nCREATE VIEW v AS SELECT a FROM t;")
    assert (e.value.line, e.value.column) == (3, 1)


def test_bad_blob_literal_is_named() -> None:
    with pytest.raises(SqlError, match="BLOB literal"):
        sql.compile(DDL + "CREATE VIEW v AS SELECT x'303' AS x FROM t1;")
