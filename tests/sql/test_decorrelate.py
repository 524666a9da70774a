"""Correlated subqueries of every shape with any correlation condition (issue 38, item 1), decorrelated through a domain of the enclosing columns, each view equal to DuckDB after random steps with deletions.

Views run through random steps with deletions (seed from DBSP_SQL_SEED, printed in the header), nulls and empty
inner sides included (small tables, 15% nulls); rows are compared as multisets. By default each third of the views
runs at one worker count in {1, 2, 4} drawn from the seed; ``-m slow`` runs every third at W = 1, 2 and 4.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from sql_oracle import SEED, run_views

DDL = """
CREATE TABLE t1 (a INT, b INT, c INT);
CREATE TABLE t2 (a INT, b INT, c INT);
CREATE TABLE s (v VARCHAR, n INT);
"""
TABLES = {
    "t1": pa.schema([("a", pa.int32()), ("b", pa.int32()), ("c", pa.int32())]),
    "t2": pa.schema([("a", pa.int32()), ("b", pa.int32()), ("c", pa.int32())]),
    "s": pa.schema([("v", pa.string()), ("n", pa.int32())]),
}

# (name, SELECT): each answered like DuckDB
VIEWS = [
    # scalar subqueries: COUNT over an empty group is 0, other aggregates NULL, a plain value NULL
    ("sc_count_lt", "SELECT a, b, (SELECT count(*) FROM t1 AS x WHERE x.b < t1.b) AS n FROM t1"),
    ("sc_count_two", "SELECT a, (SELECT count(*) FROM t1 AS x WHERE x.c > t1.c AND x.a < t1.a) AS n FROM t1"),
    ("sc_count_col", "SELECT a, (SELECT count(x.c) + 1 FROM t2 AS x WHERE x.b <> t1.b) AS n FROM t1"),
    ("sc_sum_mixed", "SELECT a, (SELECT sum(t2.c) FROM t2 WHERE t2.a = t1.a AND t2.b >= t1.b) AS s FROM t1"),
    ("sc_max_or", "SELECT a, (SELECT max(t2.c) FROM t2 WHERE t2.b < t1.b OR t2.a = t1.c) AS m FROM t1"),
    ("sc_avg_expr", "SELECT c, (SELECT avg(t2.a) FROM t2 WHERE t2.b + t1.a > t2.c) AS m FROM t1"),
    ("sc_in_where", "SELECT a, b FROM t1 WHERE c > (SELECT count(*) FROM t2 WHERE t2.b <= t1.b)"),
    ("sc_null_safe", "SELECT a, (SELECT count(*) FROM t2 WHERE t2.b < t1.b OR t1.b IS NULL) AS n FROM t1"),
    ("sc_coalesce", "SELECT a, (SELECT min(t2.c) FROM t2 WHERE t2.b > coalesce(t1.b, 2)) AS m FROM t1"),
    ("sc_max_const", "SELECT a, b, (SELECT max(x.a) FROM t1 AS x WHERE x.b < t1.b AND x.a = 3) AS m FROM t1"),
    ("sc_outer_item", "SELECT a, (SELECT count(*) + t1.c FROM t2 WHERE t2.b > t1.b) AS n FROM t1"),
    ("sc_outer_in_agg", "SELECT a, (SELECT sum(t2.c * t1.a) FROM t2 WHERE t2.b < t1.b) AS n FROM t1"),
    ("sc_case", "SELECT CASE WHEN c > (SELECT avg(c) FROM t1) THEN a * 2 ELSE b * 10 END AS x, "
                "(SELECT count(*) FROM t1 AS x WHERE x.b < t1.b) AS n FROM t1"),
    # EXISTS / NOT EXISTS
    ("ex_lt", "SELECT a, b FROM t1 WHERE EXISTS (SELECT 1 FROM t1 AS x WHERE x.b < t1.b)"),
    ("nex_lt", "SELECT a, b FROM t1 WHERE NOT EXISTS (SELECT 1 FROM t2 WHERE t2.b < t1.b AND t2.a = t1.a)"),
    ("ex_value", "SELECT a, EXISTS (SELECT 1 FROM t2 WHERE t2.c <> t1.c) AS e FROM t1"),
    ("ex_or", "SELECT a FROM t1 WHERE a > 2 OR EXISTS (SELECT * FROM t2 WHERE t2.b > t1.b)"),
    ("nex_null", "SELECT a, b FROM t1 WHERE NOT EXISTS (SELECT 1 FROM t2 WHERE t2.b = t1.b OR t1.b IS NULL)"),
    # IN / NOT IN: NULL rules per correlation value
    ("in_lt", "SELECT a, b FROM t1 WHERE a IN (SELECT t2.a FROM t2 WHERE t2.b < t1.b)"),
    ("nin_lt", "SELECT a, b FROM t1 WHERE a NOT IN (SELECT t2.a FROM t2 WHERE t2.b < t1.b)"),
    ("in_value", "SELECT a, b, a IN (SELECT t2.c FROM t2 WHERE t2.b >= t1.b) AS x, "
                 "a NOT IN (SELECT t2.c FROM t2 WHERE t2.b >= t1.b) AS y FROM t1"),
    ("in_outer_item", "SELECT a, b FROM t1 WHERE c IN (SELECT t2.a + t1.b FROM t2 WHERE t2.c < t1.c)"),
    ("in_mixed", "SELECT a FROM t1 WHERE b NOT IN (SELECT c FROM t2 WHERE t2.a = t1.a AND t2.b > t1.c)"),
    # ANY / ALL: TRUE, FALSE or NULL by the comparisons with q's rows; FALSE (ANY) or TRUE (ALL) over no rows
    ("any_where", "SELECT a, b FROM t1 WHERE a > ANY (SELECT b FROM t2)"),
    ("all_where", "SELECT a, b FROM t1 WHERE a >= ALL (SELECT b FROM t2 WHERE t2.c < t1.c)"),
    ("any_values", "SELECT a, a < ANY (SELECT b FROM t2) AS x, a <> ALL (SELECT b FROM t2) AS y, "
                   "a = SOME (SELECT b FROM t2 WHERE t2.c > t1.c) AS z FROM t1"),
    ("all_values", "SELECT a, b, b <= ALL (SELECT t2.a FROM t2 WHERE t2.b <> t1.b) AS x FROM t1"),
    ("all_not", "SELECT a FROM t1 WHERE NOT (a = ALL (SELECT c FROM t2 WHERE t2.a = t1.b))"),
    ("any_grouped", "SELECT a FROM t1 WHERE b > ANY (SELECT max(b) FROM t2 GROUP BY c)"),
    ("all_grouped", "SELECT a, c < ALL (SELECT count(*) FROM t2 GROUP BY a) AS x FROM t1"),
    ("all_distinct", "SELECT a, b >= ALL (SELECT DISTINCT c FROM t2 WHERE t2.b <> t1.a ORDER BY c) AS x FROM t1"),
    ("any_expr", "SELECT a, b FROM t1 WHERE a + b > ANY (SELECT c - t1.c FROM t2 WHERE t2.a <= t1.a)"),
    # a subquery aggregating without GROUP BY has one row for every enclosing row, even over no rows (EXISTS of
    # it was answered as EXISTS of its rows)
    ("ex_agg_eq", "SELECT a, b FROM t1 WHERE EXISTS (SELECT count(*) FROM t2 WHERE t2.b = t1.b)"),
    ("nex_agg_lt", "SELECT a, b FROM t1 WHERE NOT EXISTS (SELECT max(c) FROM t2 WHERE t2.b > t1.b)"),
    ("ex_agg_value", "SELECT a, EXISTS (SELECT count(*) FROM t2 WHERE t2.b = t1.b) AS e FROM t1"),
    ("in_agg", "SELECT a FROM t1 WHERE a IN (SELECT max(c) FROM t2 WHERE t2.b = t1.b)"),
    ("in_count", "SELECT a, b FROM t1 WHERE 0 IN (SELECT count(*) FROM t2 WHERE t2.b < t1.b)"),
    ("nin_agg_value", "SELECT a, 1 NOT IN (SELECT count(*) FROM t2 WHERE t2.b < t1.b) AS x, "
                      "a NOT IN (SELECT min(c) FROM t2 WHERE t2.b >= t1.b) AS y FROM t1"),
    # GROUP BY, HAVING and DISTINCT inside, per enclosing row
    ("grp_exists", "SELECT a, b FROM t1 WHERE EXISTS (SELECT c FROM t2 WHERE t2.b < t1.a GROUP BY c "
                   "HAVING count(*) > 1)"),
    ("grp_in", "SELECT a FROM t1 WHERE a IN (SELECT max(c) FROM t2 WHERE t2.b <= t1.b GROUP BY a)"),
    ("grp_nin_value", "SELECT a, b NOT IN (SELECT count(*) FROM t2 WHERE t2.a <> t1.a GROUP BY b) AS x FROM t1"),
    ("grp_scalar", "SELECT a, (SELECT count(*) FROM t2 WHERE t2.b = t1.b AND t2.c > t1.c GROUP BY b) AS n FROM t1"),
    ("distinct_scalar", "SELECT a, (SELECT DISTINCT t2.b FROM t2 WHERE t2.b = t1.b AND t2.c > t1.c) AS v FROM t1"),
    ("distinct_in", "SELECT a FROM t1 WHERE c IN (SELECT DISTINCT a FROM t2 WHERE t2.b > t1.b ORDER BY a)"),
    # ORDER BY ... LIMIT k inside: a top-k per enclosing row (nulls last); EXISTS ignores LIMIT
    ("top_scalar", "SELECT a, (SELECT c FROM t2 WHERE t2.b <= t1.b ORDER BY c DESC LIMIT 1) AS v FROM t1"),
    ("top_scalar_nulls", "SELECT a, (SELECT c FROM t2 WHERE t2.b IS NULL OR t2.b > t1.a ORDER BY c LIMIT 1) AS v "
                         "FROM t1"),
    ("top_in", "SELECT a, b FROM t1 WHERE a IN (SELECT c FROM t2 WHERE t2.b >= t1.b ORDER BY c LIMIT 2)"),
    ("top_alias", "SELECT a, (SELECT c + 1 AS x FROM t2 WHERE t2.b <> t1.a ORDER BY x DESC LIMIT 1) AS v FROM t1"),
    ("ex_limit", "SELECT a, b FROM t1 WHERE EXISTS (SELECT 1 FROM t2 WHERE t2.b < t1.b LIMIT 1)"),
    ("nex_limit", "SELECT a, b FROM t1 WHERE NOT EXISTS (SELECT 1 FROM t2 WHERE t2.b = t1.b LIMIT 2)"),
    # a subquery inside a subquery naming the outermost query's columns
    ("nest_exists", "SELECT a, b FROM t1 WHERE EXISTS (SELECT 1 FROM t2 WHERE t2.b < t1.b AND "
                    "EXISTS (SELECT 1 FROM t2 AS x WHERE x.c = t1.a))"),
    ("nest_count", "SELECT a, (SELECT count(*) FROM t2 WHERE EXISTS (SELECT 1 FROM t1 AS y WHERE y.a < t2.c AND "
                   "y.b > t1.a)) AS n FROM t1"),
    ("nest_not_in", "SELECT a FROM t1 WHERE EXISTS (SELECT 1 FROM t2 WHERE t2.b = t1.b AND t2.c NOT IN "
                    "(SELECT y.a FROM t1 AS y WHERE y.b <> t1.a))"),
    ("nest_scalar", "SELECT a, (SELECT max(c) FROM t2 WHERE c > (SELECT min(y.a) FROM t1 AS y WHERE y.b >= t1.b)) "
                    "AS m FROM t1"),
    # strings
    ("str_lt", "SELECT v, (SELECT count(*) FROM s AS x WHERE x.v < s.v) AS n FROM s"),
    ("str_in", "SELECT v, n FROM s WHERE n IN (SELECT x.n FROM s AS x WHERE x.v > s.v)"),
    # having
    ("having_corr", "SELECT a, count(*) AS n FROM t1 GROUP BY a "
                    "HAVING count(*) > (SELECT count(*) FROM t2 WHERE t2.a > t1.a)"),
]


PARTS = 3  # the views in this many pipelines; by default each at one worker count drawn from the seed
WORKERS = [int(w) for w in np.random.default_rng(SEED).choice([1, 2, 4], size=PARTS)]


def _entries(part: int) -> list:
    views = VIEWS[part::PARTS]
    return [SimpleNamespace(sql=f"CREATE VIEW {n} AS {q};", duck=None) for n, q in views]


@pytest.mark.parametrize("part", range(PARTS))
def test_correlated_views_equal_duckdb(part: int) -> None:
    w = WORKERS[part]
    run_views(DDL, TABLES, _entries(part), SEED + 10 * part + w, w, steps=6, max_rows=6, label="decorrelate")


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("part", range(PARTS))
def test_correlated_views_equal_duckdb_every_worker_count(part: int, workers: int) -> None:
    run_views(DDL, TABLES, _entries(part), SEED + 10 * part + workers, workers, steps=6, max_rows=6,
              label="decorrelate")
