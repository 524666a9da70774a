"""DECIMAL(p, s) end to end: Arrow decimal128 input, exact arithmetic, comparisons, casts, joins and SUM/AVG/MIN/MAX, after random steps with deletions at W in {1, 2, 4}, checked against DuckDB (AVG against DuckDB's exact SUM and COUNT, by decimal.py invariant 3's rule).

Seeds vary per run and are printed; replay one with ``DBSP_DECIMAL_SEED``.
"""

from __future__ import annotations

import collections
import os
import random
from decimal import ROUND_HALF_UP, Decimal, localcontext

import duckdb
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.errors import StepError
from oracle import connect  # tests/core: a cursor of the process's DuckDB database

SEED = int(os.environ.get("DBSP_DECIMAL_SEED") or random.SystemRandom().randrange(2**31))
T = pa.schema([("k", pa.int32()), ("d", pa.decimal128(10, 2)), ("e", pa.decimal128(6, 3)), ("i", pa.int64())])
U = pa.schema([("d", pa.decimal128(10, 2)), ("name", pa.string())])
VIEWS = {
    "arith": "SELECT k, d + e AS a, d - e AS b, d * e AS m, -d AS n, d * 3 AS d3, d + 1.5 AS dl, d + i AS di, "
             "CAST(d AS INT) AS ci, CAST(d AS DECIMAL(8, 1)) AS c1, CAST(e AS DECIMAL(10, 2)) AS c2, "
             "CAST(i AS DECIMAL(12, 1)) AS c3, coalesce(d, i) AS co, "
             "d > e AS gt, d = e AS eq, d <= 12.34 AS le FROM t",
    "agg": "SELECT k, sum(d) AS s, min(d) AS lo, max(e) AS hi, count(d) AS n, sum(d * e) AS sm FROM t GROUP BY k",
    "avg": "SELECT k, avg(d) AS ad, avg(e) AS ae FROM t GROUP BY k",
    "keyless": "SELECT sum(d) AS s, avg(d) AS a, count(*) AS n FROM t",
    "filtered": "SELECT k, d FROM t WHERE d > 12.34 AND e < 0",
    "joined": "SELECT u.name, sum(t.e) AS s, count(*) AS n FROM t JOIN u ON t.d = u.d GROUP BY u.name",
}
PROGRAM = ("CREATE TABLE t (k INT, d DECIMAL(10, 2), e DECIMAL(6, 3), i BIGINT);\n"
           "CREATE TABLE u (d DECIMAL(10, 2), name VARCHAR);\n"
           + "".join(f"CREATE VIEW {v} AS {q};\n" for v, q in VIEWS.items()))


def _dec(rng: random.Random, digits: int, scale: int) -> Decimal | None:
    if rng.random() < 0.1:
        return None
    return Decimal(rng.randrange(-10**digits + 1, 10**digits)).scaleb(-scale)


def _rows(rng: random.Random, n: int) -> list[tuple]:
    # d from a small set so that joins and equal values happen; e anywhere in DECIMAL(6, 3)
    pool = [Decimal(v).scaleb(-2) for v in (-1234, -5, 0, 5, 1234, 99999, 1250)]
    return [(rng.randrange(4), rng.choice(pool) if rng.random() < 0.5 else _dec(rng, 6, 2), _dec(rng, 5, 3),
             rng.randrange(-1000, 1000)) for _ in range(n)]


def _table(rows: list[tuple], schema: pa.Schema) -> pa.Table:
    return pa.table([pa.array([r[i] for r in rows], f.type) for i, f in enumerate(schema)], schema=schema)


def _avg(total: Decimal | None, count: int, p: int, s: int) -> Decimal | None:
    """decimal.py invariant 3: scale max(s, min(6, 18 - (p - s))), half away from zero (ROUND_HALF_UP), from the
    quotient to 80 digits (no tie can appear or vanish there)."""
    if total is None or count == 0:
        return None
    scale = max(s, min(6, 18 - (p - s)))
    with localcontext() as ctx:
        ctx.prec = 80
        return (Decimal(total) / count).quantize(Decimal(1).scaleb(-scale), rounding=ROUND_HALF_UP)


def _expected(con: duckdb.DuckDBPyConnection) -> dict[str, collections.Counter]:
    out = {v: collections.Counter(con.execute(q).fetchall()) for v, q in VIEWS.items() if v not in ("avg", "keyless")}
    out["avg"] = collections.Counter(
        (k, _avg(sd, nd, 10, 2), _avg(se, ne, 6, 3))
        for k, sd, nd, se, ne in con.execute("SELECT k, sum(d), count(d), sum(e), count(e) FROM t GROUP BY k"
                                             ).fetchall())
    out["keyless"] = collections.Counter(
        (s, _avg(s, n, 10, 2), c) for s, n, c in con.execute("SELECT sum(d), count(d), count(*) FROM t").fetchall())
    return out


def _norm(row: tuple) -> tuple:
    return tuple(float(x) if isinstance(x, float) else x for x in row)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_decimal_views_match_duckdb_after_random_steps_with_deletions(workers: int) -> None:
    rng = random.Random(SEED * 10 + workers)
    print(f"seed {SEED} (replay: DBSP_DECIMAL_SEED={SEED})")
    p = dbsp.Pipeline(sql.compile(PROGRAM), workers=workers)
    held: list[tuple] = []  # the integrated t, as a bag
    u_rows = [(Decimal(v).scaleb(-2), f"n{v % 3}") for v in (-1234, -5, 0, 5, 1234, 1250, 1250)]
    p.push("u", _table(u_rows, U))
    views: dict[str, collections.Counter] = {v: collections.Counter() for v in VIEWS}
    for step in range(rng.randrange(4, 8)):
        new = _rows(rng, rng.randrange(1, 40))
        gone = rng.sample(held, min(len(held), rng.randrange(0, 12))) if step else []
        for r in gone:
            held.remove(r)
        held += new
        p.push("t", _table(new + gone, T), weights=[1] * len(new) + [-1] * len(gone))
        for v, z in p.step().items():
            for row, w in z.to_dict().items():
                views[v][_norm(row)] += w
        con = connect()
        con.register("t", _table(held, T))
        con.register("u", _table(u_rows, U))
        want = _expected(con)
        for v in VIEWS:
            got = +views[v]
            assert got == want[v], (v, step, f"seed {SEED} (replay: DBSP_DECIMAL_SEED={SEED})")
    p.close()


def test_decimal_types_are_duckdbs_and_inputs_cast_safely() -> None:
    c = sql.compile(PROGRAM)
    arith = c.nodes[c.outputs["arith"]].schema
    assert [str(arith.field(n).type) for n in ("a", "b", "m", "n", "dl", "ci", "c1")] == [
        "decimal64(12, 3)", "decimal64(12, 3)", "decimal64(16, 5)", "decimal64(10, 2)", "decimal64(11, 2)", "int32",
        "decimal64(8, 1)"]
    con = duckdb.connect()
    con.register("t", pa.table({"d": pa.array([Decimal("1.00")], pa.decimal128(10, 2)),
                                "e": pa.array([Decimal("1.000")], pa.decimal128(6, 3))}))
    assert con.execute("SELECT typeof(d + e), typeof(d - e), typeof(d * e), typeof(-d), typeof(d + 1.5) FROM t"
                       ).fetchone() == ("DECIMAL(12,3)", "DECIMAL(12,3)", "DECIMAL(16,5)", "DECIMAL(10,2)",
                                        "DECIMAL(11,2)")
    agg = c.nodes[c.outputs["avg"]].schema
    assert (str(agg.field("ad").type), str(agg.field("ae").type)) == ("decimal64(18, 6)", "decimal64(18, 6)")
    p = dbsp.Pipeline(c)
    with pytest.raises(dbsp.SchemaError, match="'d'"):  # 1.234 does not fit DECIMAL(10, 2): refused, not rounded
        p.push("t", pa.table({"k": [1], "d": pa.array([Decimal("1.234")], pa.decimal128(10, 3)),
                              "e": pa.array([None], pa.decimal128(6, 3)), "i": [1]}))
    p.close()


def test_decimal_sum_overflow_fails_the_step_never_wraps() -> None:
    c = sql.compile("CREATE TABLE t (d DECIMAL(18, 0)); CREATE VIEW v AS SELECT sum(d) AS s FROM t;")
    p = dbsp.Pipeline(c)
    p.push("t", pa.table({"d": pa.array([Decimal(9 * 10**17)] * 2, pa.decimal128(18, 0))}))
    with pytest.raises(StepError):
        p.step()
    p.close()
