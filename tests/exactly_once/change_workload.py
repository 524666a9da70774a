"""The workload of the program-change tests: two SQL programs over keyed tables (the second keeps one view, changes one, drops one and adds one), each step's upserts and deletes drawn from a seed, a dict model of the tables and DuckDB over it as the oracle of every view."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa
from workload import integrate  # noqa: F401 - the test modules of program changes import it from here

TABLES = ("CREATE TABLE orders (id INT PRIMARY KEY, cust INT, amt INT);\n"
          "CREATE TABLE cust (id INT PRIMARY KEY, region INT);\n")
BY_CUST = "SELECT cust, count(*) AS n, sum(amt) AS s FROM orders GROUP BY cust"
BIG_OLD = "SELECT id, cust, amt FROM orders WHERE amt > 50"
BIG_NEW = "SELECT id, cust, amt FROM orders WHERE amt > 30"
REGIONS = "SELECT region, count(*) AS n FROM cust GROUP BY region"
BY_REGION = ("SELECT c.region, sum(o.amt) AS s, count(*) AS n FROM orders AS o JOIN cust AS c ON o.cust = c.id "
             "GROUP BY c.region")

# the views of each program: name -> (query, materialized)
OLD = {"by_cust": (BY_CUST, False), "big": (BIG_OLD, True), "regions": (REGIONS, False)}
# by_region first: every node of the kept view gets another number than the one its state was stored under
NEW = {"by_region": (BY_REGION, True), "by_cust": (BY_CUST, False), "big": (BIG_NEW, True)}
KEPT, REBUILT, DROPPED = ["by_cust"], ["big", "by_region"], ["regions"]


def program(views: dict[str, tuple[str, bool]]) -> str:
    """The SQL text of a program with the tables and ``views``."""
    return TABLES + "".join(f"CREATE {'MATERIALIZED ' if m else ''}VIEW {n} AS {q};\n" for n, (q, m) in views.items())


ORDER_KEYS, CUST_KEYS = 60, 12


def step_data(seed: int, step: int) -> dict[str, tuple[list[tuple], list[int]]]:
    """Step ``step``'s changes: ``{table: (rows upserted, keys deleted)}``, the keys of one table distinct."""
    rng = random.Random(f"{seed}/{step}")
    out = {}
    for table, keys in (("orders", ORDER_KEYS), ("cust", CUST_KEYS)):
        touched = rng.sample(range(keys), rng.randint(1, keys // 3))
        cut = rng.randint(0, len(touched) // 2) if step > 0 else 0
        deleted, upserted = touched[:cut], touched[cut:]
        if table == "orders":
            rows = [(k, rng.randrange(CUST_KEYS + 2), rng.randrange(100)) for k in upserted]
        else:
            rows = [(k, rng.randrange(4)) for k in upserted]
        out[table] = (rows, deleted)
    return out


def apply(model: dict[str, dict], data: dict[str, tuple[list[tuple], list[int]]]) -> None:
    """INSERT OR REPLACE the rows, then DELETE the keys, into the dict model (``{table: {key: row}}``)."""
    for table, (rows, deleted) in data.items():
        t = model.setdefault(table, {})
        for r in rows:
            t[r[0]] = r
        for k in deleted:
            t.pop(k, None)


def push(p, data: dict[str, tuple[list[tuple], list[int]]], step: int | None = None) -> None:
    """Push one step's changes (idempotently under ``("gen", seq)`` when ``step`` is given)."""
    for i, (table, (rows, deleted)) in enumerate(sorted(data.items())):
        names = ["id", "cust", "amt"] if table == "orders" else ["id", "region"]
        kw = {} if step is None else {"producer": "gen", "seq": 4 * step + 2 * i}
        if rows:
            p.push(table, {n: [r[j] for r in rows] for j, n in enumerate(names)}, **kw)
        if deleted:
            kw = {} if step is None else {"producer": "gen", "seq": 4 * step + 2 * i + 1}
            p.delete(table, deleted, **kw)


def oracle(model: dict[str, dict], query: str) -> Counter:
    """DuckDB's answer to ``query`` over the model's tables, as a multiset of rows."""
    import os
    import sys

    core = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")
    if core not in sys.path:
        sys.path.insert(0, core)
    from oracle import connect  # tests/core: a cursor of the process's DuckDB database (only the parent asks)

    con = connect()
    orders = pa.table({"id": pa.array([r[0] for r in model.get("orders", {}).values()], pa.int32()),
                       "cust": pa.array([r[1] for r in model.get("orders", {}).values()], pa.int32()),
                       "amt": pa.array([r[2] for r in model.get("orders", {}).values()], pa.int32())})
    cust = pa.table({"id": pa.array([r[0] for r in model.get("cust", {}).values()], pa.int32()),
                     "region": pa.array([r[1] for r in model.get("cust", {}).values()], pa.int32())})
    con.register("orders", orders)
    con.register("cust", cust)
    return Counter(tuple(int(v) if v is not None else None for v in row) for row in con.execute(query).fetchall())




def as_bag(acc: dict) -> Counter:
    """An integral as a multiset of rows (a negative weight, which no bag has, stays: it then differs from any)."""
    return Counter(acc)
