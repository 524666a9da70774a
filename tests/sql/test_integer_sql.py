"""SQL arithmetic, math functions and aggregates over the full range of every integer type, against DuckDB.

Aggregates run incrementally (random steps with deletions, W in {1, 2}); an expression's rows run in one step,
half of them are deleted in a second, and each row DuckDB refuses (overflow, division by zero) must fail our
step alone, never give a value. The seed is in the assertion messages (pytest -q shows them); replay with
DBSP_HYPOTHESIS_SEED. More examples: DBSP_HYPOTHESIS_EXAMPLES.
"""

from __future__ import annotations

import math
from collections import Counter

import duckdb
import pyarrow as pa
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import sql
from hypothesis_profile import examples
from oracle import connect  # tests/core
from test_integer_range import INT_TYPES, SQL_TYPES, bounds, moves, run, values  # tests/core

# (expression over columns a and b, how to compare): "exact" values, or "double" (DuckDB's result is a double,
# ours may be the exact integer: compared as the double nearest to ours)
EXPRESSIONS = [
    ("a + b", "exact"), ("a - b", "exact"), ("a * b", "exact"), ("-a", "exact"), ("a + 1", "exact"),
    ("a - 1", "exact"), ("a * 2", "exact"), ("a // 7", "exact"), ("a % 7", "exact"), ("a // b", "exact"),
    ("a % b", "exact"), ("abs(a)", "exact"), ("sign(a)", "exact"), ("round(a)", "exact"), ("a / 3", "double"),
    ("a / b", "double"), ("sqrt(a)", "double"), ("ln(a)", "double"), ("log10(a)", "double"), ("log(a)", "double"),
    ("log(2, a)", "double"), ("exp(a)", "double"),
    ("power(a, 2)", "double"), ("CAST(a AS DOUBLE)", "double"), ("CAST(a AS BIGINT)", "exact"),
    ("CAST(a AS INT)", "exact"), ("greatest(a, b)", "exact"), ("least(a, b)", "exact"), ("a < b", "exact"),
    ("a = b", "exact"), ("a >= 3", "exact"), ("floor(a)", "double"), ("ceil(a)", "double"),
]


def _norm(v: object, how: str) -> object:
    if v is None or isinstance(v, bool):
        return v
    if how == "double":
        v = float(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else v
    return int(v)  # DuckDB's HUGEINT and DECIMAL results: compared by value


def duck(expr: str, t: pa.DataType, rows: list) -> tuple[list, list]:
    """(the rows DuckDB evaluates ``expr`` over, with their results; the rows on which it raises)."""
    con = connect()
    con.register("src", pa.table({"a": pa.array([a for a, _ in rows], t), "b": pa.array([b for _, b in rows], t)}))
    ok, bad = [], []
    for a, b in rows:  # one row at a time: a row DuckDB refuses must fail our step, and only such a row
        try:
            got = con.execute(f"SELECT {expr} FROM src WHERE a IS NOT DISTINCT FROM ? AND b IS NOT DISTINCT FROM ? "
                              f"LIMIT 1", [a, b]).fetchall()
            ok.append(((a, b), got[0][0]))
        except duckdb.Error:
            bad.append((a, b))
    return ok, bad


@pytest.mark.parametrize("t", INT_TYPES, ids=str)
@pytest.mark.parametrize("expr,how", EXPRESSIONS, ids=[e for e, _ in EXPRESSIONS])
def test_expression_over_the_full_integer_range_matches_duckdb(request, t, expr, how):
    seed = request.config.getoption("hypothesis_seed", None)
    name = SQL_TYPES[str(t)]
    c = sql.compile(f"CREATE TABLE src (a {name}, b {name});\nCREATE VIEW e AS SELECT a, b, {expr} AS x FROM src;")

    @settings(max_examples=examples(4))
    @given(st.lists(st.tuples(values(t), values(t)), min_size=1, max_size=12, unique=True), st.sampled_from([1, 2]))
    def check(rows, workers):
        note(f"seed {seed}")
        ok, bad = duck(expr, t, rows)
        ctx = f"seed {seed}, W={workers}, {t}: {expr}"
        schema = pa.schema([("a", t), ("b", t)])
        with dbsp.Pipeline(c, workers=workers) as p:
            good = [r for r, _ in ok]
            if good:  # the rows DuckDB evaluates, in one step, and half of them deleted in a second one
                p.push("src", dbsp.ZSet.from_rows(good, schema))
                got = Counter({(a, b, _norm(x, how)): w for (a, b, x), w in p.step()["e"].to_dict().items()})
                want = Counter((a, b, _norm(x, how)) for (a, b), x in ok)
                assert got == want, f"{ctx}: only ours {got - want}, only DuckDB's {want - got}"
                gone = good[::2]
                p.push("src", dbsp.ZSet.from_rows(gone, schema, weights=[-1] * len(gone)))
                out = p.step()["e"].to_dict()
                assert Counter((a, b) for (a, b, _), w in out.items() if w == -1) == Counter(gone), ctx
            for r in bad[:3]:  # each row DuckDB refuses fails our step, which then waits to be discarded
                p.push("src", dbsp.ZSet.from_rows([r], schema))
                with pytest.raises(dbsp.StepError) as e:
                    p.step()
                assert len(e.value.inputs) == 1, f"{ctx}: {r}: {e.value}"
                _, producer, seq = e.value.inputs[0]
                p.discard(producer, seq)
                assert p.step()["e"].num_rows == 0, f"{ctx}: {r}"

    check()


@pytest.mark.parametrize("t", INT_TYPES, ids=str)
@pytest.mark.parametrize("extremes", [False, True], ids=["linear", "extremes"])
def test_sql_aggregates_over_the_full_integer_range_match_duckdb(request, t, extremes):
    """COUNT, SUM, AVG (and MIN, MAX) by SQL, with and without GROUP BY, against DuckDB after every step."""
    seed = request.config.getoption("hypothesis_seed", None)

    @settings(max_examples=examples(8))
    @given(moves(t), st.sampled_from([1, 2]), st.booleans())
    def check(steps, workers, keyed):
        note(f"seed {seed}")
        run(t, steps, workers, keyed, extremes, seed, sql=True)

    check()


@pytest.mark.parametrize("expr", ["NULLIF(93, -a) + 68", "NULLIF(+93, -a) * 2", "NULLIF(100, a) + 100",
                                  "NULLIF(a, 93) + 100", "COALESCE(NULLIF(120, a), 0) + 120"])
def test_nullif_of_an_integer_literal_has_the_literal_type(expr: str) -> None:
    """NULLIF's result has its first argument's type: an integer literal's is INT (int32), so arithmetic on it does
    not overflow a narrower type (it was int8: ``NULLIF(93, -col1) + 68`` failed every step; sqllogictest's
    random/groupby found it). Checked against DuckDB on rows that make NULLIF both NULL and not."""
    c = sql.compile(f"CREATE TABLE t (a INT); CREATE VIEW v AS SELECT {expr} AS x FROM t")
    assert sql.schema_of(c, "v").field("x").type == pa.int32()
    rows = pa.table({"a": pa.array([1, -93, 93, 100, 120, None], pa.int32())})
    with dbsp.Pipeline(c) as p:
        p.push("t", rows)
        got = Counter(p.step()["v"].to_dict())
    con = connect()
    con.register("t", rows)
    want = Counter(r for r in con.execute(f"SELECT {expr} AS x FROM t").fetchall())
    assert got == want, f"{expr}: ours {got}, DuckDB {want}"
