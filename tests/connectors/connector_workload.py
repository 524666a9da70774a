"""The connector tests' workload: a sales circuit, input files of every kind (Parquet with several row groups,
CSV, JSON lines, some rows deleted again with weight -1) and the views recomputed by DuckDB over all of them, as
multisets (``{row: count}``)."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import dbsp_core as dbsp

SCHEMA = pa.schema([("region", pa.string()), ("item", pa.int64()), ("amount", pa.int64())])
REGIONS = ["north", "south", "east", "west", "center", "islands"]


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("sales", SCHEMA)
    c.output("by_region", s.group_by("region").agg(n=dbsp.count(), total=dbsp.sum("amount")))
    c.output("big", s.filter(pc.field("amount") > 50))
    return c


def make_files(staging: str, n: int, seed: int) -> list[str]:
    """``n`` input files in ``staging`` (named in the order they are to appear); returns their names."""
    rng = random.Random(seed)
    os.makedirs(staging, exist_ok=True)
    inserted: list[tuple[str, int, int]] = []
    names = []
    for i in range(n):
        rows = [(rng.choice(REGIONS), rng.randrange(20), rng.randrange(100)) for _ in range(rng.randrange(5, 60))]
        weights = [1] * len(rows)
        if inserted and rng.random() < 0.4:  # delete a few rows inserted by earlier files (each at most once)
            for _ in range(rng.randrange(1, 4)):
                if inserted:
                    rows.append(inserted.pop(rng.randrange(len(inserted))))
                    weights.append(-1)
        inserted.extend(r for r, w in zip(rows, weights) if w == 1)
        kind = rng.choice(["parquet", "parquet", "csv", "jsonl"])
        name = f"f{i:04d}.{kind}"
        path = os.path.join(staging, name)
        cols = {"region": [r[0] for r in rows], "item": [r[1] for r in rows], "amount": [r[2] for r in rows],
                "weight": weights}
        if kind == "parquet":
            pq.write_table(pa.table(cols), path, row_group_size=rng.choice([7, 16, 64]))
        elif kind == "csv":
            with open(path, "w") as f:
                f.write("region,item,amount,weight\n")
                f.writelines(f"{a},{b},{c},{w}\n" for (a, b, c), w in zip(rows, weights))
        else:
            with open(path, "w") as f:
                f.writelines(json.dumps({"region": a, "item": b, "amount": c, "weight": w}) + "\n"
                             for (a, b, c), w in zip(rows, weights))
        names.append(name)
    return names


def publish(staging: str, inbox: str, name: str) -> None:
    """Make a staged file appear in the watched directory the way a producer should: an atomic rename."""
    os.makedirs(inbox, exist_ok=True)
    os.replace(os.path.join(staging, name), os.path.join(inbox, name))


def reference(inbox: str) -> dict[str, Counter]:
    """Both views over every file in ``inbox``, by DuckDB, as multisets of rows (with the multiplicity last)."""
    import duckdb

    con = duckdb.connect()
    parts = []
    cols = "region::VARCHAR AS region, item::BIGINT AS item, amount::BIGINT AS amount, weight::BIGINT AS weight"
    if any(f.endswith(".parquet") for f in os.listdir(inbox)):
        parts.append(f"SELECT {cols} FROM read_parquet('{inbox}/*.parquet')")
    if any(f.endswith(".csv") for f in os.listdir(inbox)):
        parts.append(f"SELECT {cols} FROM read_csv('{inbox}/*.csv', header=true)")
    if any(f.endswith(".jsonl") for f in os.listdir(inbox)):
        parts.append(f"SELECT {cols} FROM read_json('{inbox}/*.jsonl', format='newline_delimited')")
    con.execute("CREATE TABLE sales AS " + " UNION ALL ".join(parts))
    by_region = con.execute("SELECT region, sum(weight), sum(amount * weight), 1 FROM sales GROUP BY region "
                            "HAVING sum(weight) <> 0").fetchall()
    big = con.execute("SELECT region, item, amount, sum(weight) AS w FROM sales WHERE amount > 50 "
                      "GROUP BY ALL HAVING w <> 0").fetchall()
    return {"by_region": Counter(tuple(r) for r in by_region), "big": Counter(tuple(r) for r in big)}
