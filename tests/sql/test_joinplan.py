"""The join planner (dbsp_core/sql/joinplan.py): multi-way joins with pushed filters, outer joins mixed with inner
ones, self-joins under aliases and pruned join inputs, each checked against DuckDB after random steps with deletions at
W = 1, 2 and 4 (seed: DBSP_SQL_SEED, printed with the corpus seed); the plans themselves (filters at the inputs, keys
instead of cross products, the kept columns, ``dbsp sql``'s text); and an 8-table join of 10 rows per table, timed."""

from __future__ import annotations

import time
from collections import Counter

import duckdb
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.sql import SqlError
from dbsp_core.sql.explain import explain
from corpus import V
from sql_oracle import SEED, run_views

N = 4
DDL = "".join(f"CREATE TABLE t{i} (a{i} INT, b{i} INT, x{i} VARCHAR, y{i} BIGINT);\n" for i in range(1, N + 1))
TABLES = {f"t{i}": pa.schema([(f"a{i}", pa.int32()), (f"b{i}", pa.int32()), (f"x{i}", pa.string()),
                              (f"y{i}", pa.int64())]) for i in range(1, N + 1)}

QUERIES = [
    # comma joins, keys and filters in WHERE, in an order that is not the FROM order
    "SELECT x1, x2, x3, x4 FROM t3, t1, t4, t2 WHERE a1 = b3 AND a2 = 4 AND a2 = b1 AND b4 = a3",
    "SELECT x1, y2, x3 FROM t1, t2, t3 WHERE a1 = a2 AND b2 = b3 AND a1 IN (1, 2, 3) AND x3 <> 'a'",
    "SELECT a1, b2, b3 FROM t1, t2, t3 WHERE a1 = a2 AND a1 = b2 AND a3 = a1 AND y1 > 1",
    # INNER JOIN ... ON with single-table conditions in the ON
    "SELECT x1, x2, x3 FROM t1 JOIN t2 ON a1 = a2 AND b2 > 2 JOIN t3 ON b3 = b1 AND x3 <> 'b'",
    "SELECT x1, x2 FROM t1 INNER JOIN t2 ON a1 + 1 = b2 OR x1 = x2 WHERE y2 < 4",
    # components no condition connects: a cross product only between them; a residual across components
    "SELECT x1, x2, x3 FROM t1, t2, t3 WHERE a1 = a2 AND b3 < 2",
    "SELECT a1, a2, a3 FROM t1, t2, t3 WHERE a1 = a2 AND b1 < b3 AND 1 = 1",
    "SELECT a1, b2, a3 FROM t1, t2, t3 WHERE a1 + a2 = a3 AND a1 = b2",
    "SELECT count(*) FROM t1, t2",
    # outer joins mixed with inner joins; WHERE conditions over the null-producing side
    "SELECT x1, x2, x3 FROM t1 LEFT JOIN t2 ON a1 = a2 AND b2 > 1, t3 WHERE a3 = a1 AND b2 IS NULL",
    "SELECT x1, x2, x3 FROM t1 JOIN t2 ON a1 = a2 LEFT JOIN t3 ON b2 = b3 WHERE b1 > 1 AND x3 IS NULL",
    "SELECT x1, x2, a3 FROM t1 RIGHT JOIN t2 ON a1 = a2, t3 WHERE b1 IS NULL AND a3 = a2",
    "SELECT x1, x2, a3 FROM t1 RIGHT JOIN t2 ON a1 = a2 JOIN t3 ON a3 = b2 WHERE coalesce(b1, 0) = 0",
    "SELECT a1, a2, a3, a4 FROM t1 JOIN t2 ON a1 = a2 FULL JOIN t3 ON b2 = b3 JOIN t4 ON a4 = b1 WHERE y1 > 0",
    "SELECT a1, a2, a3 FROM t1 FULL JOIN t2 ON a1 = a2 JOIN t3 ON b3 = b2 WHERE a1 IS NULL OR a3 < 3",
    "SELECT a1, a2, a3, b4 FROM t1 LEFT JOIN t2 ON a1 = a2 LEFT JOIN t3 ON a3 = a2 AND y3 > 2, t4 "
    "WHERE b4 = b1 AND a1 < 4",
    # ON conjuncts of one side: the null-producing side's filter it first, the kept side's must pad instead
    "SELECT x1, x2, b2 FROM t1 LEFT JOIN t2 ON a1 = a2 AND b2 > 1 AND x2 <> 'a'",
    "SELECT x1, x2, b1 FROM t1 LEFT JOIN t2 ON a1 = a2 AND b1 > 1",
    "SELECT x1, x2 FROM t1 RIGHT JOIN t2 ON a1 = a2 AND y1 < 3 AND b2 <> 0",
    "SELECT a1, a2 FROM t1 FULL JOIN t2 ON a1 = a2 AND b1 > 1 AND b2 > 1",
    "SELECT a1, a2, a3 FROM t1 LEFT JOIN t2 ON a1 = a2 AND 1 = 0 LEFT JOIN t3 ON b3 = b1 AND b3 IS NOT NULL",
    # an outer join in parentheses after a comma, and without them (the comma binds loosest: the same join)
    "SELECT a1, a2, a3 FROM t1, (t2 FULL JOIN t3 ON a2 = a3) WHERE b1 < 3",
    "SELECT a1, a2, a3 FROM t2 RIGHT JOIN t3 ON a2 = a3, t1 WHERE a1 = b3",
    "SELECT a1, a2, a3 FROM t1, t2 FULL JOIN t3 ON a2 = a3 WHERE b1 < 3",
    "SELECT a1, a2, a3, a4 FROM t1, t2 JOIN t4 ON a2 = a4 RIGHT JOIN t3 ON b2 = b3 WHERE b1 = 1 OR a1 IS NULL",
    "SELECT a1, a2, a3, t4.a4 FROM t1, t2 FULL JOIN t3 ON t2.a2 = t3.a3 JOIN t4 ON t4.a4 = t3.b3, t4 AS q "
    "WHERE q.b4 = t1.b1",
    "SELECT p.a1, t2.a2, t3.a3 FROM t1 AS p, t2 LEFT JOIN t1 ON t1.a1 = t2.b2 FULL JOIN t3 ON t3.b3 = t2.a2 "
    "WHERE p.b1 = t3.a3 OR t3.a3 IS NULL",
    # self-joins under aliases
    "SELECT p.a1, q.a1, r.x1 FROM t1 p, t1 q, t1 r WHERE p.a1 = q.b1 AND q.a1 = r.b1 AND p.b1 = 2",
    "SELECT p.x1, q.x1 FROM t1 p JOIN t1 q ON p.a1 = q.a1 AND p.y1 < q.y1 LEFT JOIN t2 ON a2 = q.b1",
    # pruning around stars, aggregates and subqueries that read columns of the joined inputs
    "SELECT t2.*, x1 FROM t1, t2 WHERE a1 = a2 AND b1 = 3",
    "SELECT * FROM t1, t2 WHERE a1 = b2 AND y2 IS NOT NULL",
    "SELECT x1, count(*), sum(b3) FROM t1, t2, t3 WHERE a1 = a2 AND a2 = a3 GROUP BY x1",
    "SELECT x1 FROM t1, t2 WHERE a1 = a2 AND EXISTS (SELECT 1 FROM t3 WHERE a3 = b1)",
    "SELECT s.a1, s.n, x2 FROM (SELECT a1, count(*) AS n FROM t1 GROUP BY a1) s, t2 WHERE s.a1 = a2 AND n > 1",
    "SELECT x1 FROM t1 WHERE b1 IN (SELECT a2 FROM t2, t3 WHERE b2 = b3 AND y3 = t1.y1)",
]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_join_plans_match_duckdb(workers: int) -> None:
    entries = [V(f"CREATE VIEW jp{i} AS {q};") for i, q in enumerate(QUERIES)]
    run_views(DDL, TABLES, entries, SEED + workers, workers, steps=6, max_rows=8,
              label=f"join planner views; replay: DBSP_SQL_SEED={SEED}")


def _ops(c, kind: str) -> list:
    return [op for op in c.nodes if op.kind == kind]


def _input_below(c, op) -> str | None:
    """The table a chain of linear operators (select, filter, exchange) above ``op`` reads, if any."""
    while op.kind in ("select", "filter", "exchange"):
        op = c.nodes[op.inputs[0]]
    return op.name if op.kind == "input" else None


def _cross_joins(c) -> list:
    """The joins whose key is no column of a table (the constant key of a cross product)."""
    names = {f for i in c.inputs.values() for f in c.nodes[i].schema.names}
    return [j for j in _ops(c, "join") if not set(j.left_on) <= names]


def test_filters_move_to_their_inputs_and_equalities_become_keys() -> None:
    """select5's shape: the constant filter is at t2's input, every join has a key of two tables' columns (no
    constant cross-join key), and the join order starts at the filtered table."""
    c = sql.compile(DDL + f"CREATE VIEW v AS {QUERIES[0]};")
    filters = _ops(c, "filter")
    assert [_input_below(c, f) for f in filters] == ["t2"], [f.predicate for f in filters]
    assert len(_ops(c, "join")) == 3 and not _cross_joins(c)
    text = explain(c)
    plan = text[text.index("join plan"):].splitlines()
    assert plan[1].split() == ["t2", "filter", "a2", "=", "4"], text
    assert "CROSS" not in text


def test_cross_product_only_between_unconnected_components() -> None:
    c = sql.compile(DDL + "CREATE VIEW v AS SELECT x1, x2, x3, x4 FROM t1, t3, t2, t4 "
                          "WHERE a1 = a2 AND b3 = b4 AND y4 = 7;")
    text = explain(c)
    assert text.count("CROSS (no condition connects them)") == 1, text
    assert len(_ops(c, "join")) == 3 and len(_cross_joins(c)) == 1


def test_join_inputs_keep_only_the_columns_read_after_them() -> None:
    c = sql.compile(DDL + "CREATE VIEW v AS SELECT x1, x3 FROM t1, t2, t3 WHERE a1 = a2 AND b2 = b3;")
    kept = set()
    for j in _ops(c, "join"):
        for side in j.inputs:
            kept |= set(c.nodes[side].schema.names)
    assert kept <= {"a1", "x1", "a2", "b2", "b3", "x3"}, kept  # no y, no b1, no x2, no a3
    assert {"x1", "x3", "b3"} <= kept
    text = explain(c)
    assert "keeps (a2, b2) of 4 fields" in text, text
    c = sql.compile(DDL + "CREATE VIEW n AS SELECT count(*) FROM t1, t2 WHERE a1 = a2 "
                          "AND EXISTS (SELECT * FROM t3 WHERE a3 = b2);")
    (j,) = _ops(c, "join")
    assert [c.nodes[i].schema.names for i in j.inputs] == [["a1"], ["a2", "b2"]]


def test_dbsp_sql_prints_the_join_plan(tmp_path, capsys) -> None:
    from dbsp_core.__main__ import main

    f = tmp_path / "q.sql"
    f.write_text(DDL + f"CREATE VIEW v AS {QUERIES[10]};")
    assert main(["sql", str(f)]) == 0
    out = capsys.readouterr().out
    assert "join plan (FROM t1, t2, t3):" in out, out
    assert "filter b1 > 1" in out and "LEFT JOIN t3 ON b2 = b3 (in the written order)" in out, out
    assert "ON a1 = a2" in out and "keeps" in out, out


def test_a_left_joins_on_filters_the_right_side_first() -> None:
    """``b2 > 1`` reads only the null-producing side: it filters t2 before a keyed left join (no general outer join
    by an anti join); ``b1 > 1`` reads the kept side and stays in the ON."""
    c = sql.compile(DDL + "CREATE VIEW v AS SELECT x1, x2 FROM t1 LEFT JOIN t2 ON a1 = a2 AND b2 > 1;"
                          "CREATE VIEW w AS SELECT x1, x2 FROM t1 LEFT JOIN t2 ON a1 = a2 AND b1 > 1;")
    (f,) = [f for f in _ops(c, "filter") if "b2" in str(f.predicate)]
    assert _input_below(c, f) == "t2"
    kinds = Counter(op.kind for op in c.nodes)
    assert kinds["left_join"] == 1 and kinds["anti_join"] == 1  # v: the keyed left join; w: the general one


def test_a_right_or_full_join_after_a_comma_joins_what_follows_the_comma() -> None:
    """``FROM t1, t2 FULL JOIN t3`` is ``t1 x (t2 FULL JOIN t3)`` in SQL, not ``(t1 x t2) FULL JOIN t3`` (which pads t3's
    unmatched rows once instead of once per t1 row): planned as the parenthesised form (the views above check the
    answers against DuckDB); an ON naming t1 there is DuckDB's lateral join, refused."""
    c = sql.compile(DDL + "CREATE VIEW v AS SELECT a1, a2, a3 FROM t1, t2 FULL JOIN t3 ON a2 = a3;")
    p = dbsp.Pipeline(c)
    one = pa.table({"a1": pa.array([1], pa.int32()), "b1": pa.array([1], pa.int32()), "x1": ["x"],
                    "y1": pa.array([1], pa.int64())})
    p.push("t1", pa.concat_tables([one, one.set_column(0, "a1", pa.array([2], pa.int32()))]))
    p.push("t3", one.rename_columns(["a3", "b3", "x3", "y3"]))
    assert p.step()["v"].to_dict() == {(1, None, 1): 1, (2, None, 1): 1}  # t3's row padded once per t1 row
    p.close()
    with pytest.raises(SqlError, match="names 't1', which stands before the comma: DuckDB joins that part once per "
                                       "row of 't1' \\(a lateral join\\)"):
        sql.compile(DDL + "CREATE VIEW v AS SELECT a1 FROM t1, t2 FULL JOIN t3 ON t1.a1 = t3.a3;")


def test_a_where_condition_stays_above_a_right_join() -> None:
    """``b1 IS NULL`` reads t1, the null-producing side of a RIGHT JOIN: it must filter after the join (below it, it
    would keep t1's null rows and pad the others)."""
    c = sql.compile(DDL + f"CREATE VIEW v AS {QUERIES[11]};")
    for f in _ops(c, "filter"):
        if "is_null(b1)" in str(f.predicate):
            assert _input_below(c, f) is None
            break
    else:
        raise AssertionError("no filter is_null(b1)")


def test_eight_tables_of_ten_rows_compile_and_step_fast() -> None:
    """An 8-table select5-style join over 10 rows per table (filters, and keys in WHERE chaining the tables in an
    order FROM does not follow, so joining in FROM order builds cross products): the time to compile and to run the
    first step is printed (not asserted); the answer equals DuckDB's."""
    n = 8
    ddl = "".join(f"CREATE TABLE t{i} (a{i} INT, b{i} INT, x{i} VARCHAR);\n" for i in range(1, n + 1))
    chain = [5, 2, 8, 1, 7, 3, 6, 4]
    where = " AND ".join([f"a{chain[i]} = b{chain[i + 1]}" for i in range(n - 1)]
                         + ["a5 < 6", "b7 IN (1, 2, 3, 4, 5, 6, 7)"])
    view = (f"SELECT {', '.join(f'x{i}' for i in range(1, n + 1))} FROM {', '.join(f't{i}' for i in range(1, n + 1))} "
            f"WHERE {where}")
    tables = {f"t{i}": pa.table({f"a{i}": pa.array(list(range(10)), pa.int32()),
                                 f"b{i}": pa.array([(r * 3 + i) % 10 for r in range(10)], pa.int32()),
                                 f"x{i}": [f"t{i} row {r}" for r in range(10)]}) for i in range(1, n + 1)}
    t0 = time.perf_counter()
    c = sql.compile(ddl + f"CREATE VIEW v AS {view};")
    t1 = time.perf_counter()
    with dbsp.Pipeline(c, workers=1) as p:
        for name, t in tables.items():
            p.push(name, t)
        out = p.step()["v"]
        t2 = time.perf_counter()
    print(f"\n8 tables x 10 rows: compile {1000 * (t1 - t0):.0f} ms, first step {1000 * (t2 - t1):.0f} ms, "
          f"{len(out.to_dict())} distinct result rows")
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    want = Counter(con.execute(view).fetchall())
    got = Counter()
    for r, w in out.to_dict().items():
        got[r] += w
    assert got == want
    assert sum(want.values()) > 0  # the keys match some rows: the check compares something
    assert len(_ops(c, "join")) == n - 1 and not _cross_joins(c)
