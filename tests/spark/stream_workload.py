"""The workload of the Structured Streaming tests: batches of (k, v) rows as parquet files, the circuit, and DuckDB's answer over all of them."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import dbsp_core as dbsp

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def spark_schema():
    from pyspark.sql.types import LongType, StructField, StructType

    return StructType([StructField("k", LongType(), True), StructField("v", LongType(), True)])


def build_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("s", SCHEMA)
    c.output("agg", s.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    c.output("big", s.filter(pc.field("v") >= 90).select(k=pc.field("k"), v=pc.field("v")))
    return c


def write_batches(d: str, batches: int, rows: int, seed: int, first: int = 0) -> list[str]:
    """Files ``part-<i>.parquet`` for i in [first, first + batches); some rows repeat (bags) and some v are null."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(first, first + batches):
        n = int(rng.integers(1, rows + 1))
        v = pa.array(rng.integers(0, 100, n), mask=rng.random(n) < 0.05)
        t = pa.table({"k": rng.integers(0, 50, n), "v": v}, schema=SCHEMA)
        path = os.path.join(d, f"part-{i:05d}.parquet")
        pq.write_table(t, path + ".tmp")
        os.replace(path + ".tmp", path)  # the file source must never see a half-written file
        out.append(path)
    return out


def duckdb_expected(d: str) -> dict[str, dict[tuple, int]]:
    """Each output's view over every file in ``d``, computed by DuckDB, as ``{row: multiplicity}``."""
    import duckdb

    con = duckdb.connect()
    src = f"read_parquet('{d}/*.parquet')"
    agg = con.execute(f"SELECT k, count(*), sum(v) FROM {src} GROUP BY k").fetchall()
    big = con.execute(f"SELECT k, v, count(*) FROM {src} WHERE v >= 90 GROUP BY k, v").fetchall()
    return {"agg": {r: 1 for r in agg}, "big": {(k, v): n for k, v, n in big}}


def integral(pipeline, name: str) -> dict[tuple, int]:
    """The sum of every logged change of output ``name``: the view, as ``{row: weight}``."""
    acc: dict[tuple, int] = {}
    for _, z in pipeline.read_output(name, 0):
        for row, w in z.to_dict().items():
            acc[row] = acc.get(row, 0) + w
            if acc[row] == 0:
                del acc[row]
    return acc
