"""Compile-time limits of the SQL front end: literal patterns (regular expressions, LIKE) are checked by the engine that runs them, long flat expressions (thousands of terms) compile and run, and absurd nesting is a SqlError with its line and column, never a RecursionError or a failure of every step.

Seeds vary between runs (``DBSP_SQL_LIMITS_SEED`` replays one; it is in every assertion message).
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter

import duckdb
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.sql import SqlError
from oracle import connect  # tests/core: a cursor of the process's DuckDB database

SEED = int(os.environ.get("DBSP_SQL_LIMITS_SEED", str(random.SystemRandom().randrange(2**31))))
T = "CREATE TABLE t (s VARCHAR, b BIGINT);\n"


def _rows(rng: random.Random, n: int) -> pa.Table:
    def word() -> str | None:
        return None if rng.random() < 0.1 else "".join(rng.choice("ab(x)[].") for _ in range(rng.randrange(6)))

    return pa.table({"s": [word() for _ in range(n)],
                     "b": [None if rng.random() < 0.1 else rng.randrange(-5, 6) for _ in range(n)]})


def _run(view: str, data: pa.Table) -> Counter:
    """The view's integral after one step over ``data`` (two workers: exchanges and all)."""
    p = dbsp.Pipeline(sql.compile(T + "CREATE VIEW v AS " + view), workers=2)
    try:
        p.push("t", data)
        return Counter({r: w for r, w in p.step()["v"].to_dict().items()})
    finally:
        p.close()


def _duckdb(view: str, data: pa.Table) -> Counter:
    con = connect()
    con.register("t", data)
    return Counter(tuple(r) for r in con.execute(view).fetchall())


# ---- literal patterns ----

BAD = [
    ("SELECT regexp_matches(s, '(') AS m FROM t", "'('"),
    ("SELECT regexp_like(s, 'a[b') AS m FROM t", "'a[b'"),
    ("SELECT s FROM t WHERE s ~ 'x{2,1}'", "'x{2,1}'"),
    ("SELECT s FROM t WHERE s RLIKE '(?P<n'", "'(?P<n'"),
    ("SELECT regexp_extract(s, 'a)', 0) AS m FROM t", "'a)'"),
    ("SELECT regexp_extract(s, '*', 0) AS m FROM t", "'*'"),
]


@pytest.mark.parametrize("view,literal", BAD, ids=[b[1] for b in BAD])
def test_a_bad_literal_regex_is_a_sql_error_at_the_literal(view: str, literal: str) -> None:
    text = T + "CREATE VIEW v AS\n    " + view
    with pytest.raises(SqlError) as info:
        sql.compile(text)
    e = info.value
    assert "regular expression" in str(e) and literal in str(e), str(e)
    assert (e.line, e.column) == (3, 4 + view.index(literal) + 1), str(e)  # the pattern literal itself
    with pytest.raises(duckdb.Error):  # DuckDB (RE2 as well) refuses it too: we refuse no pattern it runs
        _duckdb(view, _rows(random.Random(0), 3))


GOOD = [
    "SELECT s, regexp_matches(s, '^a+b') AS m FROM t",
    "SELECT s FROM t WHERE s ~ '\\(x\\)'",
    "SELECT s, regexp_extract(s, '([ab]+)(x?)', 2) AS m FROM t",
    "SELECT s FROM t WHERE s LIKE '%(%' OR s LIKE 'a_'",
]


@pytest.mark.parametrize("view", GOOD)
def test_good_literal_patterns_compile_and_match_duckdb(view: str) -> None:
    data = _rows(random.Random(SEED), 300)
    assert _run(view, data) == _duckdb(view, data), f"{view} (DBSP_SQL_LIMITS_SEED={SEED})"


# ---- expression size and nesting ----

N = 3000


def _data(rng: random.Random) -> tuple[pa.Table, list[tuple]]:
    rows = [(rng.choice("abc"), rng.randrange(-3, 4) if rng.random() > 0.1 else None) for _ in range(200)]
    return pa.table({"s": [r[0] for r in rows], "b": [r[1] for r in rows]}), rows


def test_a_flat_sum_of_3000_terms_compiles_and_runs() -> None:
    data, rows = _data(random.Random(SEED))
    got = _run("SELECT s, " + " + ".join(["b"] * N) + " AS x FROM t", data)
    want = Counter((s, None if b is None else N * b) for s, b in rows)
    assert got == want, f"DBSP_SQL_LIMITS_SEED={SEED}"


def test_long_or_and_and_chains_compile_and_run() -> None:
    rng = random.Random(SEED + 1)
    data, rows = _data(rng)
    picked = [rng.randrange(-3, 4) for _ in range(N)]
    got = _run("SELECT s, b FROM t WHERE " + " OR ".join(f"b = {v}" for v in picked), data)
    assert got == Counter(r for r in rows if r[1] is not None and r[1] in picked), f"DBSP_SQL_LIMITS_SEED={SEED}"
    avoid = [rng.randrange(-3, 4) for _ in range(N)]
    got = _run("SELECT s, b FROM t WHERE " + " AND ".join(f"b <> {v}" for v in avoid), data)
    assert got == Counter(r for r in rows if r[1] is not None and r[1] not in avoid), f"DBSP_SQL_LIMITS_SEED={SEED}"
    got = _run("SELECT " + " || ".join(["s"] * 1000) + " AS x FROM t", data)
    assert got == Counter((s * 1000,) for s, _ in rows), f"DBSP_SQL_LIMITS_SEED={SEED}"


def test_chains_up_to_the_limit_run_and_longer_ones_are_sql_errors() -> None:
    """A chain of MAX_CHAIN terms runs (in a filter too, which Acero flattens); one more term is a SqlError at the
    chain, not a segmentation fault (a left-deep tree of 10,000 levels overflows Arrow's stack)."""
    from dbsp_core.sql.expr import MAX_CHAIN

    data, rows = _data(random.Random(SEED + 2))
    half = MAX_CHAIN // 2
    got = _run("SELECT s, b FROM t WHERE " + " OR ".join(["b > 2"] * half + ["b < -2"] * (MAX_CHAIN - half)), data)
    assert got == Counter(r for r in rows if r[1] is not None and abs(r[1]) > 2), f"DBSP_SQL_LIMITS_SEED={SEED}"
    for op in ("+", "OR", "||"):
        with pytest.raises(SqlError) as info:
            sql.compile(T + "CREATE VIEW v AS SELECT " + f" {op} ".join(["b > 0" if op == "OR" else "b"] *
                                                                        (MAX_CHAIN + 1)) + " AS x FROM t")
        e = info.value
        assert f"a chain of {MAX_CHAIN + 1} terms" in str(e) and (e.line, e.column) == (2, 25), str(e)
    with pytest.raises(SqlError) as info:  # IN (list) is an OR of equalities: 10,000 values crashed the process
        sql.compile(T + "CREATE VIEW v AS SELECT s FROM t WHERE b IN (" + ", ".join(map(str, range(10000))) + ")")
    e = info.value
    assert "IN with 10000 values" in str(e) and (e.line, e.column) == (2, 40), str(e)


def _nth_open(expr: str, n: int) -> int:
    """The offset in ``expr`` of its n-th opening token (a parenthesis or CASE)."""
    seen = 0
    for i in range(len(expr)):
        if expr[i] == "(" or expr.startswith("CASE", i):
            seen += 1
            if seen == n:
                return i
    raise AssertionError(f"fewer than {n} opening tokens")


NESTED = [
    "(" * 2000 + "b" + ")" * 2000,
    "abs(" * 2000 + "b" + ")" * 2000,
    "CASE WHEN b > 0 THEN " * 1500 + "b" + " END" * 1500,
    "b + (" * 1000 + "b" + ")" * 1000,
    "(SELECT " * 200 + "1" + ")" * 200,
]


@pytest.mark.parametrize("expr", NESTED, ids=["parentheses", "calls", "case", "sum", "subqueries"])
def test_absurd_nesting_is_a_sql_error_at_the_first_level_too_many(expr: str) -> None:
    from dbsp_core.sql.parse import MAX_NESTING

    limit = sys.getrecursionlimit()
    with pytest.raises(SqlError) as info:
        sql.compile(T + "CREATE VIEW v AS SELECT " + expr + " AS x FROM t")
    e = info.value
    assert "nested more than" in str(e) and "levels" in str(e), str(e)
    assert (e.line, e.column) == (2, 25 + _nth_open(expr, MAX_NESTING + 1)), str(e)
    assert sys.getrecursionlimit() == limit  # nothing changed behind the caller's back
    data, rows = _data(random.Random(SEED))  # and the compiler still works
    assert _run("SELECT s, ((((b)))) + 1 AS x FROM t", data) == \
        Counter((s, None if b is None else b + 1) for s, b in rows)


def test_nesting_up_to_the_limit_compiles_and_runs() -> None:
    from dbsp_core.sql.parse import MAX_NESTING

    data, rows = _data(random.Random(SEED))
    k = MAX_NESTING - 2  # the view's own parentheses: none here; the limit counts every level of the statement
    got = _run("SELECT s, " + "abs(" * (k // 2) + "(" * (k - k // 2) + "b" + ")" * k + " AS x FROM t", data)
    assert got == Counter((s, None if b is None else abs(b)) for s, b in rows), f"DBSP_SQL_LIMITS_SEED={SEED}"


def test_a_unary_chain_that_exhausts_the_stack_is_a_sql_error_at_its_statement() -> None:
    """No parentheses to count: the parser's own recursion gives out, and that is a SqlError too."""
    with pytest.raises(SqlError) as info:
        sql.compile(T + "CREATE VIEW v AS SELECT s FROM t WHERE " + "NOT " * 3000 + "b > 0")
    e = info.value
    assert "nested too deeply" in str(e) and (e.line, e.column) == (2, 1), str(e)
    data, rows = _data(random.Random(SEED))
    assert _run("SELECT s, b FROM t WHERE NOT NOT b > 0", data) == \
        Counter(r for r in rows if r[1] is not None and r[1] > 0)
