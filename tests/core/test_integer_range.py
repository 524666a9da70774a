"""count, sum, min, max and avg over the full range of every integer type against DuckDB: random steps, deletions, W in {1, 2}.

The view's integral is compared after every step with DuckDB over the integrated rows. Where DuckDB's SUM (a
HUGEINT) leaves our result type (int64; uint64 for a uint64 column) the step must fail with a StepError that
names the aggregate's column, never give a wrong value. The seed is in the assertion message (pytest -q shows
it); replay with DBSP_HYPOTHESIS_SEED. More examples: DBSP_HYPOTHESIS_EXAMPLES.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import sql as dbsp_sql
from hypothesis_profile import examples
from oracle import connect  # tests/core: a cursor of the process's DuckDB database

INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
AGGS = {"n": dbsp.count(), "c": dbsp.count("v"), "s": dbsp.sum("v"), "a": dbsp.avg("v")}
EXTREMES = {"lo": dbsp.min("v"), "hi": dbsp.max("v")}


def bounds(t: pa.DataType) -> tuple[int, int]:
    bits = t.bit_width
    return (0, 2**bits - 1) if pa.types.is_unsigned_integer(t) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def sum_bounds(t: pa.DataType) -> tuple[int, int]:
    """The range of our SUM's result type (aggregates.py invariant 3)."""
    return (0, 2**64 - 1) if pa.types.is_uint64(t) else (-(2**63), 2**63 - 1)


def values(t: pa.DataType) -> st.SearchStrategy:
    lo, hi = bounds(t)
    edge = sorted({lo, lo + 1, lo + 2, hi, hi - 1, hi - 2, 0, 1, -1 if lo < 0 else 2, 2**53 + 1 if hi > 2**53 else hi,
                   -(2**53) - 1 if lo < -(2**53) else lo, hi // 2, lo // 2})
    return st.one_of(st.none(), st.sampled_from(edge), st.integers(lo, hi), st.integers(lo // 16, hi // 16))


def moves(t: pa.DataType) -> st.SearchStrategy:
    """Steps of (key, value, weight) moves; a negative weight deletes rows that are there (or is skipped)."""
    row = st.tuples(st.sampled_from([0, 1, 2]), values(t))
    return st.lists(st.lists(st.tuples(row, st.sampled_from([1, 1, 2, -1, -2])), max_size=8), min_size=1, max_size=5)


def expected(bag: dict, t: pa.DataType, keyed: bool, sql: bool = False) -> tuple[dict, list]:
    """DuckDB's answer over the rows of ``bag``: ({(key or None): (n, c, s, a, lo, hi)}, [groups whose sum leaves
    our result type]); over no rows, no group (a Z-set view), or SQL's one row when ``sql`` and not ``keyed``."""
    rows = [(k, v) for (k, v), m in bag.items() for _ in range(m)]
    table = pa.table({"k": pa.array([k for k, _ in rows], pa.int64()), "v": pa.array([v for _, v in rows], t)})
    con = connect()
    con.register("t", table)
    q = "SELECT {} count(*), count(v), sum(v), avg(v), min(v), max(v) FROM t {}"
    got = con.execute(q.format("k," if keyed else "", "GROUP BY k" if keyed else "")).fetchall() \
        if rows or (sql and not keyed) else []
    out = {}
    for r in got:
        key, vals = (r[0], r[1:]) if keyed else (None, r)
        out[key] = tuple(vals)
    lo, hi = sum_bounds(t)
    over = [key for key, vals in out.items() if vals[2] is not None and not lo <= int(vals[2]) <= hi]
    return out, over


def magnitude_bound_exceeded(bag: dict, step: list, t: pa.DataType, keyed: bool = True) -> bool:
    """Whether a group's sum of |value * weight| over its old rows and this step's moves leaves int64: the only case
    in which an int64 SUM may fail a step whose totals fit (the C kernels check partial sums; README). Without
    ``keyed`` every row is in the one group (it failed as if grouped by k: seed 3505256393, -2**62 then 3 and
    2**63 - 3 under keys 0 and 1)."""
    per: dict = {}
    for (k, v), m in list(bag.items()) + [(r, abs(w)) for r, w in step]:
        if v is not None:
            g = k if keyed else None
            per[g] = per.get(g, 0) + abs(v) * abs(m)
    return pa.types.is_int64(t) and any(x >= 2**63 for x in per.values())


SQL_TYPES = {"int8": "TINYINT", "int16": "SMALLINT", "int32": "INT", "int64": "BIGINT", "uint8": "UTINYINT",
             "uint16": "USMALLINT", "uint32": "UINT", "uint64": "UBIGINT"}


def circuit(t: pa.DataType, keyed: bool, extremes: bool, sql: bool) -> dbsp.Circuit:
    """Input "t" (k int64, v of type ``t``) and view "g": the aggregates, by the Python API or by SQL."""
    aggs = dict(AGGS, **(EXTREMES if extremes else {}))
    if sql:
        items = ", ".join(f"{a.kind}({'*' if a.column is None and a.kind == 'count' else a.column}) AS {name}"
                          for name, a in aggs.items())
        return dbsp_sql.compile(f"CREATE TABLE t (k BIGINT, v {SQL_TYPES[str(t)]});\n"
                                f"CREATE VIEW g AS SELECT {'k, ' if keyed else ''}{items} FROM t"
                                f"{' GROUP BY k' if keyed else ''};")
    c = dbsp.Circuit()
    src = c.input("t", pa.schema([("k", pa.int64()), ("v", t)]))
    c.output("g", (src.group_by("k") if keyed else src.group_by()).agg(**aggs))
    return c


def run(t: pa.DataType, steps: list, workers: int, keyed: bool, extremes: bool, seed: object, sql: bool = False
        ) -> int:
    """Steps ``steps`` through a group_by on ``t`` values (the Python API, or SQL), checked against DuckDB after
    each; returns the number of steps that ran."""
    c = circuit(t, keyed, extremes, sql)
    schema = pa.schema([("k", pa.int64()), ("v", t)])
    bag: dict = {}
    view: dict = {}
    ran = 0
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in steps:
            applied = []
            for r, w in step:
                if w < 0 and bag.get(r, 0) + sum(x for y, x in applied if y == r) < -w:
                    continue
                applied.append((r, w))
            if not applied:
                continue
            rows = [r for r, _ in applied]
            p.push("t", dbsp.ZSet.from_rows(rows, schema, weights=[w for _, w in applied]))
            after = dict(bag)
            for r, w in applied:
                after[r] = after.get(r, 0) + w
            after = {r: m for r, m in after.items() if m}
            want, over = expected(after, t, keyed, sql)
            ctx = f"seed {seed}, W={workers}, {t}, keyed={keyed}, extremes={extremes}, sql={sql}, step {ran}: {applied}"
            try:
                out = p.step()["g"]
            except dbsp.StepError as e:
                assert over or magnitude_bound_exceeded(bag, applied, t, keyed), f"{ctx}: unexpected {e}"
                assert "'v'" in str(e) and ("'s'" in str(e) or "'a'" in str(e)), f"{ctx}: {e} names no column"
                return ran
            assert not over, f"{ctx}: sums of groups {over} leave the result type, yet the step ran"
            bag = after
            ran += 1
            for row, w in out.to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
            assert all(w == 1 for w in view.values()), f"{ctx}: {view}"
            names = out.schema.names
            got = {}
            for row in view:
                d = dict(zip(names, row))
                got[d.get("k")] = (d["n"], d["c"], d["s"], d["a"]) + ((d["lo"], d["hi"]) if extremes else ())
            want = {k: v[:4] + (v[4:] if extremes else ()) for k, v in want.items()}
            assert set(got) == set(want), f"{ctx}: groups {sorted(got, key=str)} != {sorted(want, key=str)}"
            for k in want:
                g, w_ = got[k], want[k]
                assert g[:3] == tuple(None if x is None else int(x) for x in w_[:3]), f"{ctx}: group {k}: {g} != {w_}"
                assert g[4:] == w_[4:], f"{ctx}: group {k} min/max: {g} != {w_}"
                assert (g[3] is None) == (w_[3] is None), f"{ctx}: group {k} avg: {g[3]} != {w_[3]}"
                if g[3] is not None:  # ours is within an ulp of the exact mean; DuckDB's, of 64-bit sums, too
                    mean = int(w_[2]) / int(w_[1])  # Python: the exact quotient, correctly rounded
                    assert abs(g[3] - mean) <= abs(mean) * 2**-52, f"{ctx}: group {k} avg: {g[3]!r}, mean {mean!r}"
                    assert t.bit_width == 64 or g[3] == w_[3], f"{ctx}: group {k} avg: {g[3]!r} != {w_[3]!r}"
                    assert abs(g[3] - w_[3]) <= abs(w_[3]) * 2**-51, f"{ctx}: group {k} avg: {g[3]!r} != {w_[3]!r}"
    return ran


@pytest.mark.parametrize("t", INT_TYPES, ids=str)
@pytest.mark.parametrize("extremes", [False, True], ids=["linear", "extremes"])
def test_aggregates_over_the_full_integer_range_match_duckdb(request, t, extremes):
    seed = request.config.getoption("hypothesis_seed", None)

    @settings(max_examples=examples(8))
    @given(moves(t), st.sampled_from([1, 2]), st.booleans())
    def check(steps, workers, keyed):
        note(f"seed {seed}")
        run(t, steps, workers, keyed, extremes, seed)

    check()


@pytest.mark.parametrize("t", [pa.int64(), pa.uint64()], ids=str)
def test_avg_and_sum_of_values_above_2_53(t):
    """The issue's repro: avg of int64 values above 2^53 and sum of uint64 values at and above 2^63."""
    big = 2**63 + 5 if pa.types.is_uint64(t) else 2**53 + 1
    steps = [[((0, big), 1), ((1, big + 2), 1)], [((0, big), -1), ((0, big + 2), 1)],
             [((2, bounds(t)[1]), 1), ((3, bounds(t)[0]), 1), ((3, 3), 1)]]
    assert run(t, steps, 1, True, True, None) == 3


def test_int64_sum_overflow_is_a_step_error_naming_the_column():
    c = dbsp.Circuit()
    src = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("g", src.group_by("k").agg(s=dbsp.sum("v")))
    with dbsp.Pipeline(c) as p:
        p.push("t", pa.table({"k": [1, 1], "v": [2**62, 2**62]}))
        with pytest.raises(dbsp.StepError) as e:
            p.step()
    assert "sum('v')" in str(e.value) and "'s'" in str(e.value), str(e.value)
