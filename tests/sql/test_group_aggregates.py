"""The whole-group aggregates of the SQL front end (issue 38): the variance family, STRING_AGG / LISTAGG /
GROUP_CONCAT and FIRST / LAST, checked against DuckDB after random steps with deletions at W in {1, 2, 4}.

Rows are compared as multisets (column order included). Floating results are compared as run_views compares them,
to 30 significant bits (``_norm`` below: a relative tolerance of 2^-30 ~ 1e-9), and that tolerance is enough: the inputs are quarters in
[-5, 5] and integers in [0, 5], at most ~40 rows per group, so every input and every sum of them is exact in
float64; what differs between DuckDB (Welford's streaming update) and the engine (two passes: the group's mean,
then the centred sums) is the rounding of a handful of divisions and products, a relative error below
n * 2^-52 * (mean^2 / variance) ~ 40 * 2.2e-16 * 100 < 1e-12, far inside 1e-9. A variance that is exactly zero
(all values equal) is exactly zero in both (the mean of equal exact values is exact), so CORR's NaN matches too.
Where the exact answer is zero but the values differ (a covariance of symmetric data), DuckDB's update leaves a
residue of a few ulps of the squared values (seen: -7.4e-17); any exact nonzero answer here is a rational with
a denominator at most 16 * 40^2, so at least 1e-5 in magnitude: values below 1e-9 are compared as 0.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import duckdb
import pyarrow as pa
import pytest

from dbsp_core import sql
from dbsp_core.sql import SqlError
from sql_oracle import SEED, _sql_norm, run_views

DDL = """
CREATE TABLE t (k INT, x INT, y DOUBLE, s VARCHAR);
CREATE TABLE u (k INT, b BIGINT, z DOUBLE);
"""
TABLES = {
    "t": pa.schema([("k", pa.int32()), ("x", pa.int32()), ("y", pa.float64()), ("s", pa.string())]),
    "u": pa.schema([("k", pa.int32()), ("b", pa.int64()), ("z", pa.float64())]),
}

VIEWS = [
    # the variance family, grouped and not, over integers and doubles, with nulls
    ("var_grouped", "SELECT k, var_samp(x) AS a, var_pop(x) AS b, variance(y) AS c, var_pop(y) AS d FROM t GROUP BY k"),
    ("stddev_grouped", "SELECT k, stddev(x) AS a, stddev_samp(y) AS b, stddev_pop(x) AS c, stddev_pop(y) AS d "
                       "FROM t GROUP BY k"),
    ("covar_grouped", "SELECT k, covar_pop(x, y) AS a, covar_samp(y, x) AS b, corr(x, y) AS c FROM t GROUP BY k"),
    ("stats_keyless", "SELECT var_samp(x) AS a, stddev_pop(y) AS b, covar_samp(x, y) AS c, corr(y, x) AS d FROM t"),
    ("stats_bigint", "SELECT k, var_pop(b) AS a, stddev_samp(b) AS b2, corr(b, z) AS c FROM u GROUP BY k"),
    ("stats_expr", "SELECT k % 2 AS p, var_samp(x * 2 + 1) AS a, covar_pop(x + y, y) AS b FROM t GROUP BY k % 2"),
    ("stats_filter", "SELECT k, var_pop(x) FILTER (WHERE y > 0) AS a, covar_pop(x, y) FILTER (WHERE s <> 'a') AS b "
                     "FROM t GROUP BY k"),
    ("stats_distinct", "SELECT k, var_pop(DISTINCT x) AS a, stddev_samp(DISTINCT y) AS b FROM t GROUP BY k"),
    ("stats_having", "SELECT k, count(*) AS n FROM t GROUP BY k HAVING stddev_pop(x) > 1"),
    ("stats_mixed", "SELECT k, count(*) AS n, sum(x) AS sx, min(s) AS m, var_pop(x) AS v, avg(y) AS ay "
                    "FROM t GROUP BY k"),
    # STRING_AGG / LISTAGG / GROUP_CONCAT, ORDER BY inside (ties broken so DuckDB's answer is determined)
    ("string_agg_order", "SELECT k, string_agg(s, ',' ORDER BY s) AS a, string_agg(s, ' | ' ORDER BY s DESC) AS b "
                         "FROM t GROUP BY k"),
    ("string_agg_by_other", "SELECT k, string_agg(s, ':' ORDER BY y NULLS FIRST, s) AS a, "
                            "listagg(s, '-' ORDER BY x DESC, s) AS b FROM t GROUP BY k"),
    ("group_concat", "SELECT k, group_concat(s, '' ORDER BY s) AS a, string_agg(x, ',' ORDER BY x) AS b "
                     "FROM t GROUP BY k"),
    ("string_agg_keyless", "SELECT string_agg(s, ',' ORDER BY s) AS a, listagg(DISTINCT s, '/' ORDER BY s) AS b "
                           "FROM t"),
    ("string_agg_filter", "SELECT k, string_agg(s, ',' ORDER BY s) FILTER (WHERE x > 2) AS a FROM t GROUP BY k"),
    # FIRST / LAST with ORDER BY (a total order on the value read, so DuckDB's answer is determined)
    ("first_last", "SELECT k, first(x ORDER BY y, x) AS a, last(x ORDER BY y, x) AS b, "
                   "first(s ORDER BY y DESC, s) AS c, last(s ORDER BY x NULLS FIRST, s) AS d FROM t GROUP BY k"),
    ("first_nulls", "SELECT k, first(y ORDER BY s NULLS FIRST, y) AS a, first(x ORDER BY s DESC NULLS FIRST, x) AS b "
                    "FROM t GROUP BY k"),
    ("first_keyless", "SELECT first(s ORDER BY x, s) AS a, last(y ORDER BY y) AS b FROM t"),
    ("first_filter", "SELECT k, first(x ORDER BY y, x) FILTER (WHERE s < 'c') AS a, "
                     "last(y ORDER BY x, y) FILTER (WHERE x > 1) AS b FROM t GROUP BY k"),
    # inside subqueries and joins
    ("correlated", "SELECT k, (SELECT string_agg(s, ',' ORDER BY s) FROM t AS t2 WHERE t2.k = u.k) AS a, "
                   "(SELECT var_pop(y) FROM t AS t2 WHERE t2.k < u.k) AS b FROM u"),
    ("joined", "SELECT t.k, covar_pop(t.x, u.z) AS a, first(u.b ORDER BY u.b, u.z) AS f FROM t JOIN u ON t.k = u.k "
               "GROUP BY t.k"),
]


def _norm(v: object) -> object:
    """A float rounded to 30 significant bits (a relative tolerance of 2^-30 ~ 1e-9; on a binary grid, since the
    exact answers here are often dyadic, which decimal rounding meets at its ties), below 1e-9 in magnitude taken
    as 0 (see the module's docstring); other values as _sql_norm has them."""
    if not isinstance(v, float) or math.isnan(v) or math.isinf(v):
        return _sql_norm(v)
    if abs(v) < 1e-9:
        return 0.0
    m, e = math.frexp(v)
    return math.ldexp(round(m * 2**30), e - 30) + 0.0


def _entries() -> list:
    return [SimpleNamespace(sql=f"CREATE VIEW {n} AS {q};", duck=None) for n, q in VIEWS]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_whole_group_aggregates_equal_duckdb(workers: int) -> None:
    # few groups (k in 0..5) of up to ~40 rows, many deletions: groups change, empty and refill
    run_views(DDL, TABLES, _entries(), SEED + 17 * workers, workers, steps=8, max_rows=10, label="group aggregates",
              norm=_norm)


def test_they_run_in_the_aggregate_operator() -> None:
    """The plan computes them in the aggregate operator's whole-group slots (not some rewrite around it)."""
    c = sql.compile(DDL + "CREATE VIEW v AS SELECT k, var_pop(x) AS a, string_agg(s ORDER BY y) AS b, "
                          "first(x ORDER BY y) AS f FROM t GROUP BY k;")
    extras = [repr(a) for op in c.nodes if type(op).__name__ == "Aggregate" for a in op.extras]
    assert len(extras) == 3 and extras[0].startswith("var_pop(") and extras[1].startswith("string_agg(")


def test_statistics_match_duckdb_on_awkward_data() -> None:
    """Large means and small spreads (where a one-pass sum of squares loses every digit), one row, all equal."""
    rows = [(1, 10**9 + i, 1e9 + i * 0.5, None) for i in range(5)] + [(2, 7, 3.5, None), (3, 4, 2.0, None),
                                                                       (3, 4, 2.0, None)]
    q = ("SELECT k, var_samp(x) AS a, var_pop(y) AS b, stddev_samp(y) AS c, covar_samp(x, y) AS d, corr(x, y) AS e "
         "FROM t GROUP BY k")
    import dbsp_core as dbsp

    c = sql.compile(DDL + f"CREATE VIEW v AS {q};")
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("t", dbsp.ZSet.from_rows(rows, TABLES["t"]))
        got = {r[0]: r[1:] for r in p.step()["v"].to_dict()}
    con = duckdb.connect()
    con.execute(DDL)
    con.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", rows)
    want = {r[0]: r[1:] for r in con.execute(q).fetchall()}
    assert got.keys() == want.keys() == {1, 2, 3}
    for k in want:
        for g, w in zip(got[k], want[k]):
            if w is None or g is None:
                assert g is w, (k, got[k], want[k])
            elif w != w:  # NaN (corr of a zero variance)
                assert g != g, (k, got[k], want[k])
            else:
                assert g == pytest.approx(w, rel=1e-9, abs=1e-12), (k, got[k], want[k])
    assert got[1][0] == 2.5 and got[3][1] == 0.0  # exact where the answer is


REFUSED = [
    ("SELECT first(x) FROM t", r"FIRST\(x\) needs an ORDER BY inside the call"),
    ("SELECT k, last(s) FROM t GROUP BY k", r"LAST\(x\) needs an ORDER BY"),
    ("SELECT var_pop(x ORDER BY y) FROM t", "VAR_POP takes no ORDER BY"),
    ("SELECT string_agg(s, s) FROM t", "separator of STRING_AGG must be a string literal"),
    ("SELECT string_agg(y, ',') FROM t", "STRING_AGG of double: cast the argument to VARCHAR"),
    ("SELECT string_agg(DISTINCT s ORDER BY y) FROM t", r"STRING_AGG\(DISTINCT ...\) is supported"),
    ("SELECT stddev(s) FROM t", "STDDEV_SAMP needs a numeric argument"),
    ("SELECT arg_min(x, y) FROM t", "aggregate ARG_MIN is not supported"),
]


@pytest.mark.parametrize("query,message", REFUSED)
def test_refused_with_the_reason(query: str, message: str) -> None:
    with pytest.raises(SqlError, match=message):
        sql.compile(DDL + f"CREATE VIEW v AS {query};")
