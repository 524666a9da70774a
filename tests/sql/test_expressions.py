"""Random SQL expressions over columns with NULLs, as SELECT items and WHERE conditions, checked against DuckDB by Hypothesis.

The expressions combine arithmetic, comparisons, CASE, COALESCE, NULLIF, IN, BETWEEN, IS [NOT] DISTINCT FROM and
string functions, so SQL's three-valued NULL logic is checked in many combinations.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from corpus import DDL, RATES, TABLES, V
from sql_oracle import run_views

INT_LEAF = st.sampled_from(["k", "v", "id", "0", "1", "3", "-2", "NULL"])
BOOL_LEAF = st.sampled_from(["b", "TRUE", "FALSE", "NULL"])
STR_LEAF = st.sampled_from(["s", "'a'", "''", "'Ab'", "NULL"])


def _ints(depth: int) -> st.SearchStrategy[str]:
    if depth == 0:
        return INT_LEAF
    a = _ints(depth - 1)
    return st.one_of(
        INT_LEAF,
        st.builds(lambda x, op, y: f"({x} {op} {y})", a, st.sampled_from(["+", "-", "*"]), a),
        st.builds(lambda x, op: f"({x} {op} 3)", a, st.sampled_from(["//", "%"])),
        st.builds(lambda c, x, y: f"CASE WHEN {c} THEN {x} ELSE {y} END", _bools(depth - 1), a, a),
        st.builds(lambda c, x: f"CASE WHEN {c} THEN {x} END", _bools(depth - 1), a),
        st.builds(lambda f, x, y: f"{f}({x}, {y})", st.sampled_from(["coalesce", "nullif", "greatest", "least"]), a, a),
        st.builds(lambda x: f"abs({x})", a),
        st.builds(lambda x: f"length({x})", _strs(depth - 1)),
    )


def _bools(depth: int) -> st.SearchStrategy[str]:
    if depth == 0:
        return BOOL_LEAF
    p, a, s = _bools(depth - 1), _ints(depth - 1), _strs(depth - 1)
    return st.one_of(
        BOOL_LEAF,
        st.builds(lambda x, op, y: f"({x} {op} {y})", a, st.sampled_from(["=", "<>", "<", "<=", ">", ">="]), a),
        st.builds(lambda x, y: f"({x} = {y})", s, s),
        st.builds(lambda x, op, y: f"({x} {op} {y})", p, st.sampled_from(["AND", "OR"]), p),
        st.builds(lambda x: f"(NOT {x})", p),
        st.builds(lambda x, t: f"({x} {t})", st.one_of(a, p, s),
                  st.sampled_from(["IS NULL", "IS NOT NULL"])),
        st.builds(lambda x, t: f"({x} {t})", p, st.sampled_from(["IS TRUE", "IS NOT TRUE", "IS FALSE",
                                                                  "IS NOT FALSE"])),
        st.builds(lambda x, y, z, n: f"({x} {n}IN ({y}, {z}))", a, a, a, st.sampled_from(["", "NOT "])),
        st.builds(lambda x, y, z, n: f"({x} {n}BETWEEN {y} AND {z})", a, a, a, st.sampled_from(["", "NOT "])),
        st.builds(lambda x, y, n: f"({x} IS {n}DISTINCT FROM {y})", a, a, st.sampled_from(["", "NOT "])),
        st.builds(lambda x, pat: f"({x} LIKE '{pat}')", s, st.sampled_from(["a%", "%b", "_", "%"])),
    )


def _strs(depth: int) -> st.SearchStrategy[str]:
    if depth == 0:
        return STR_LEAF
    s = _strs(depth - 1)
    return st.one_of(
        STR_LEAF,
        st.builds(lambda x, y: f"({x} || {y})", s, s),
        st.builds(lambda f, x: f"{f}({x})", st.sampled_from(["upper", "lower", "trim"]), s),
        st.builds(lambda x, y: f"coalesce({x}, {y})", s, s),
        st.builds(lambda c, x, y: f"CASE WHEN {c} THEN {x} ELSE {y} END", _bools(depth - 1), s, s),
        st.builds(lambda x: f"substring({x}, 1, 1)", s),
    )


@settings(max_examples=40)
@given(i=_ints(2), p=_bools(2), q=_strs(2), w=_bools(2), workers=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31 - 1))
def test_random_expressions_match_duckdb(i: str, p: str, q: str, w: str, workers: int, seed: int) -> None:
    view = V(f"CREATE VIEW x AS SELECT id, {i} AS a, {p} AS p, {q} AS q FROM t WHERE {w};")
    run_views(DDL, TABLES, [view], seed, workers, steps=3, label="random expression", rates=RATES)
