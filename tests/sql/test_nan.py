"""NaN, infinities, signed zeros and nulls through every SQL operator, checked against DuckDB after random steps with deletions.

DuckDB's rules (README "Semantics and formats"): NaN equals NaN and sorts above every number, +inf included; -0.0
equals 0.0. The seed varies per run, is in every failure message, and replays through ``DBSP_NAN_SEED``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core as dbsp
from corpus import V
from dbsp_core import sql
from oracle import _diff, _norm, accumulate, connect, duckdb_query, normalize, to_zset
from sql_oracle import Bag, _value, run_views

SEED = int(os.environ.get("DBSP_NAN_SEED", time.time_ns() % 2**31))
NAN = float("nan")
SPECIAL = [NAN, -NAN, float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.5, 2.5, 1e300]

DDL = """
CREATE TABLE fa (id INT, k INT, b DOUBLE, c REAL);
CREATE TABLE fb (id INT, b DOUBLE);
"""
TABLES = {
    "fa": pa.schema([("id", pa.int32()), ("k", pa.int32()), ("b", pa.float64()), ("c", pa.float32())]),
    "fb": pa.schema([("id", pa.int32()), ("b", pa.float64())]),
}


class FloatBag(Bag):
    """Random rows whose float columns draw from NaN (both signs), +-inf, +-0.0, a few numbers and nulls."""

    def row(self) -> tuple:
        out = []
        for f in self.schema:
            if not pa.types.is_floating(f.type):
                out.append(_value(self.rng, f.type, self.null_rate))
            elif self.rng.random() < self.null_rate:
                out.append(None)
            else:
                out.append(SPECIAL[int(self.rng.integers(len(SPECIAL)))])
        return tuple(out)


NANLIT = "CAST('NaN' AS DOUBLE)"
INF = "CAST('inf' AS DOUBLE)"

VIEWS = {
    "filter": [
        "SELECT id, b FROM fa WHERE b = b",
        "SELECT id, b FROM fa WHERE b > 0",
        "SELECT id, b, c FROM fa WHERE b < c OR c >= b",
        "SELECT id, b = c, b <> c, b < c, b <= c, b > c, b >= c FROM fa",
        "SELECT id, b < 1.0, 2.5 >= b, -1 < c, c <= -1.5, 1 <> b, b = 0, c = -0.0, k < b FROM fa",
        "SELECT id FROM fa WHERE b <> b OR NOT (b = b)",
        f"SELECT id, b FROM fa WHERE b >= {NANLIT}",
        f"SELECT id, b > {INF}, b < {NANLIT}, c = {NANLIT} FROM fa",
        f"SELECT id, b IN (1.0, {NANLIT}), b NOT IN (0.0, {INF}), c IN (b, -1.5) FROM fa",
        f"SELECT id, b BETWEEN 0 AND {INF}, b BETWEEN c AND {NANLIT}, c NOT BETWEEN -1 AND 1 FROM fa",
        f"SELECT id, CASE WHEN b > 1 THEN 'big' WHEN b = b THEN 'num' ELSE 'other' END, "
        f"CASE b WHEN {NANLIT} THEN 'nan' WHEN 0 THEN 'zero' ELSE 'x' END FROM fa",
        "SELECT id, b IS DISTINCT FROM c, b IS NOT DISTINCT FROM c, nullif(b, c) FROM fa",
        "SELECT id, greatest(b, c), least(b, c), greatest(b, 1.0), least(c, 1.0) FROM fa",
    ],
    "join": [
        "SELECT fa.id, fb.id FROM fa JOIN fb ON fa.b = fb.b",
        "SELECT fa.id, fb.id, fa.c FROM fa JOIN fb ON fa.b = fb.b AND fa.c <= fb.b",
        "SELECT fa.id, fb.id FROM fa JOIN fb ON fa.c = fb.b",
        "SELECT fa.id, fb.id FROM fa LEFT JOIN fb ON fa.b = fb.b",
        "SELECT id, b FROM fa WHERE b IN (SELECT b FROM fb)",
        "SELECT id, b FROM fb WHERE NOT EXISTS (SELECT 1 FROM fa WHERE fa.b = fb.b)",
        "SELECT id, b IN (SELECT b FROM fb) FROM fa",
        "SELECT id, b FROM fa WHERE b >= (SELECT max(b) FROM fb)",
    ],
    "group": [
        "SELECT b, count(*), count(c), min(c), max(c) FROM fa GROUP BY b",
        "SELECT k, min(b), max(b), min(c), max(c), count(*) FROM fa GROUP BY k",
        "SELECT min(b), max(b), min(c), max(c), count(*) FROM fa",
        "SELECT b, c, count(*) FROM fa GROUP BY b, c HAVING max(id) > 1",
        "SELECT DISTINCT b FROM fa",
        "SELECT DISTINCT b, c FROM fa",
        "SELECT k, count(DISTINCT b) FROM fa GROUP BY k",
        "SELECT k, sum(b), avg(c), count(b) FROM fa GROUP BY k",
        "SELECT sum(c), avg(b) FROM fa",
        "SELECT b FROM fa UNION SELECT b FROM fb",
        "SELECT b FROM fa EXCEPT SELECT b FROM fb",
    ],
    "topk": [
        "SELECT id, b FROM fa ORDER BY b DESC, id LIMIT 3",
        "SELECT id, b FROM fa ORDER BY b, id LIMIT 3",
        "SELECT id, b, c FROM fa ORDER BY c DESC, b DESC, id LIMIT 4",
        "SELECT id, b FROM fb ORDER BY b DESC, id LIMIT 1",
        "SELECT id, k, b FROM (SELECT id, k, b, ROW_NUMBER() OVER (PARTITION BY k ORDER BY b DESC, id) AS rn FROM fa) "
        "WHERE rn <= 2",
        "SELECT id, b, c FROM (SELECT id, b, c, ROW_NUMBER() OVER (PARTITION BY b ORDER BY c DESC, id) AS rn FROM fa) "
        "WHERE rn = 1",
        "SELECT k, b FROM (SELECT k, b, RANK() OVER (PARTITION BY k ORDER BY b DESC) AS r FROM fa) x WHERE r <= 1",
        "SELECT k, c FROM (SELECT k, c, RANK() OVER (PARTITION BY k ORDER BY c) AS r FROM fa) x WHERE r <= 1",
    ],
}


def _entries(kind: str) -> list[V]:
    return [V(f"CREATE VIEW {kind}{i} AS {q};") for i, q in enumerate(VIEWS[kind])]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", sorted(VIEWS))
def test_special_floats_match_duckdb(kind: str, workers: int) -> None:
    """Each operator family over floats with NaN, +-inf, +-0.0 and nulls, 8 random steps with deletions."""
    seed = SEED + workers + 10 * sorted(VIEWS).index(kind)
    run_views(DDL, TABLES, _entries(kind), seed, workers, steps=8, max_rows=7, null_rate=0.15,
              label=f"special floats ({kind}; DBSP_NAN_SEED={SEED})", gen=FloatBag)


def test_float_bag_draws_every_special_value() -> None:
    """The generator above reaches NaN of both signs, both infinities, both zeros and null (else the test above
    could pass without seeing them)."""
    bag = FloatBag(np.random.default_rng(SEED), TABLES["fa"], 0.15)
    seen = set()
    for _ in range(400):
        for v in bag.row()[2:]:
            seen.add("null" if v is None else "nan" if v != v else repr(v))
    assert {"nan", "inf", "-inf", "0.0", "-0.0", "null"} <= seen, (seen, SEED)


def _api_circuit() -> dbsp.Circuit:
    """The engine's own operators through the Python API, over the same tables: the rules hold there too."""
    c = dbsp.Circuit()
    fa, fb = c.input("fa", TABLES["fa"]), c.input("fb", TABLES["fb"])
    c.output("top", fa.group_by("k").top_k(2, [("b", "descending"), ("id", "ascending")]))
    c.output("argmax", fa.group_by("k").argmax("b"))
    c.output("argmin", fa.group_by("b").argmin("c"))
    c.output("dist", fa.select(b=pc.field("b")).distinct())
    c.output("agg", fa.group_by("b").agg(n=dbsp.count(), lo=dbsp.min("c"), hi=dbsp.max("c")))
    c.output("join", fa.join(fb, on="b"))
    c.output("ij", fa.interval_join(fb, "id", "id", -1, 1, on="b"))
    c.output("ieee", fa.filter(pc.field("b") == pc.field("b")))  # pyarrow's rule, not DuckDB's (README)
    return c


API_SQL = {
    "top": "SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY k ORDER BY b DESC NULLS LAST, id, c) AS rn "
           "FROM fa) WHERE rn <= 2",
    "argmax": "SELECT * FROM (SELECT *, RANK() OVER (PARTITION BY k ORDER BY b DESC NULLS LAST) AS r FROM fa) "
              "WHERE r = 1",
    "argmin": "SELECT * FROM (SELECT *, RANK() OVER (PARTITION BY b ORDER BY c NULLS LAST) AS r FROM fa) WHERE r = 1",
    "dist": "SELECT DISTINCT b FROM fa",
    "agg": "SELECT b, count(*), min(c), max(c) FROM fa GROUP BY b",
    "join": "SELECT fa.id, fa.k, fa.b, fa.c, fb.id FROM fa JOIN fb ON fa.b = fb.b",
    "ij": "SELECT fa.id, fa.k, fa.b, fa.c, fb.id FROM fa JOIN fb ON fa.b = fb.b AND fb.id - 1 <= fa.id "
          "AND fa.id <= fb.id + 1",
    "ieee": "SELECT * FROM fa WHERE b = b AND NOT isnan(b)",
}


@pytest.mark.parametrize("workers", [1, 2])
def test_python_api_operators_follow_the_rules(workers: int) -> None:
    """top_k / argmax / argmin (NaN first when descending), distinct, group_by min/max, join and interval_join on a
    float key (NaN matches NaN, -0.0 matches 0.0) against DuckDB; a filter by a pyarrow expression keeps pyarrow's
    IEEE rule (NaN == NaN is false), as the README says. 8 random steps with deletions."""
    seed = SEED + 100 + workers
    rng = np.random.default_rng(seed)
    gens = {name: FloatBag(rng, schema, 0.15) for name, schema in TABLES.items()}
    got: dict[str, dict] = {name: {} for name in API_SQL}
    with dbsp.Pipeline(_api_circuit(), workers=workers) as p:
        for step in range(8):
            for name, g in gens.items():
                change = g.change(7)
                if change:
                    p.push(name, to_zset(change, TABLES[name]))
            out = p.step()
            bags = {name: (TABLES[name], dict(g.bag)) for name, g in gens.items()}
            for name, query in API_SQL.items():
                accumulate(got[name], out[name])
                want = duckdb_query(f"SELECT * EXCLUDE (rn) FROM ({query})" if "rn <=" in query else
                                    f"SELECT * EXCLUDE (r) FROM ({query})" if "r = 1" in query else query, bags)
                assert normalize(got[name]) == want, (
                    f"output {name} differs from DuckDB after step {step} (seed={seed}, DBSP_NAN_SEED={SEED}, "
                    f"W={workers})\nonly in circuit: {_diff(normalize(got[name]), want)}\n"
                    f"only in DuckDB: {_diff(want, normalize(got[name]))}")


def test_every_pair_of_special_values_compares_as_duckdb() -> None:
    """Every comparison over every pair of NaN (both signs), +-inf, +-0.0, a number and NULL, as columns and against
    literals, next to DuckDB's answers (the random tests above may miss a pair)."""
    vals = [NAN, -NAN, float("inf"), float("-inf"), 0.0, -0.0, 1.0, None]
    pairs = [(x, y) for x in vals for y in vals]
    items = ("a = b, a <> b, a < b, a <= b, a > b, a >= b, a IS DISTINCT FROM b, a > 1.0, a >= 1, 1.0 < a, "
             "0 <= a, a = 0.0, a <> -0.0, greatest(a, b), least(a, b)")
    c = sql.compile(f"CREATE TABLE t (i INT, a DOUBLE, b DOUBLE); CREATE VIEW v AS SELECT i, {items} FROM t;")
    tab = pa.table({"i": pa.array(range(len(pairs)), pa.int32()), "a": [p[0] for p in pairs],
                    "b": [p[1] for p in pairs]})
    with dbsp.Pipeline(c) as p:
        p.push("t", tab)
        got = {r[0]: tuple(_norm(v) for v in r[1:]) for r in p.step()["v"].to_dict()}
    con = connect()
    con.register("t", tab)
    want = {r[0]: tuple(_norm(v) for v in r[1:]) for r in con.sql(f"SELECT i, {items} FROM t").fetchall()}
    bad = {pairs[i]: (got.get(i), w) for i, w in want.items() if got.get(i) != w}
    assert len(got) == len(pairs) and not bad, f"(a, b): (circuit, DuckDB) for {items}: {bad}"
