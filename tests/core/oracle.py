"""The DuckDB reference for circuit tests: random changes over small domains, and the query recomputed by DuckDB over the integrated inputs after every step.

Bag semantics: a table with weight w for a row holds w copies of it; results compare as {row: multiplicity}.
Floats are drawn as multiples of 1/4 (sums are exact) and compared after rounding to 9 significant digits.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa

import dbsp_core as dbsp

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.utf8()), ("price", pa.int64()), ("f", pa.float64())])
AUCTIONS = pa.schema([("id", pa.int32()), ("category", pa.utf8()), ("reserve", pa.int64())])
SCHEMAS = {"bids": BIDS, "auctions": AUCTIONS}


def _value(rng: np.random.Generator, t: pa.DataType, null_rate: float = 0.15) -> object:
    if rng.random() < null_rate:
        return None
    if pa.types.is_integer(t):
        return int(rng.integers(0, 6))
    if pa.types.is_floating(t):
        return float(rng.integers(-20, 21)) / 4
    if pa.types.is_string(t):
        return str(rng.choice(["a", "b", "c", "dd", ""]))
    raise TypeError(t)


def random_row(rng: np.random.Generator, schema: pa.Schema) -> tuple:
    return tuple(_value(rng, f.type) for f in schema)


class ChangeGen:
    """Random valid changes to a bag: inserts (with duplicates and weights > 1) and deletions of present rows.
    A subclass draws its own rows (``row``) and duplicates more or less often (``dup``: 0.3 + the chance)."""

    dup = 0.45  # a roll below ``deletes`` deletes a present row; below this, duplicates one
    deletes = 0.3  # 0 for an append-only input (inserts only)

    def __init__(self, rng: np.random.Generator, schema: pa.Schema) -> None:
        self.rng = rng
        self.schema = schema
        self.bag: Counter = Counter()

    def row(self) -> tuple:
        """A new random row of the schema."""
        return random_row(self.rng, self.schema)

    def change(self, max_rows: int = 8) -> dict[tuple, int]:
        rng, delta = self.rng, Counter()
        for _ in range(int(rng.integers(0, max_rows + 1))):
            present = [r for r, w in (self.bag + delta).items() if w > 0]
            roll = rng.random()
            if present and roll < self.deletes:  # delete a present row
                delta[present[int(rng.integers(len(present)))]] -= 1
            elif present and roll < self.dup:  # duplicate a present row
                delta[present[int(rng.integers(len(present)))]] += 1
            else:
                delta[self.row()] += int(rng.choice([1, 1, 1, 2]))
        delta = Counter({r: w for r, w in delta.items() if w})
        self.bag.update(delta)
        self.bag = Counter({r: w for r, w in self.bag.items() if w})
        return dict(delta)


def to_zset(change: dict[tuple, int], schema: pa.Schema) -> dbsp.ZSet:
    rows = list(change)
    return dbsp.ZSet.from_rows(rows, schema, weights=[change[r] for r in rows])


def _norm(v: object) -> object:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return float(f"{v:.9g}") + 0.0
    return v


def normalize(rows: dict[tuple, int], norm: Callable[[object], object] = _norm) -> dict[tuple, int]:
    """``rows`` with every value passed through ``norm`` (rows that become equal add up; weight 0 dropped)."""
    out: Counter = Counter()
    for r, w in rows.items():
        out[tuple(norm(v) for v in r)] += w
    return {r: w for r, w in out.items() if w}


_DB = threading.local()


def connect() -> duckdb.DuckDBPyConnection:
    """A new DuckDB connection to this process's and thread's in-memory database: as clean as ``duckdb.connect()``
    for what a reference query makes (``register``'s views and ``CREATE TEMP VIEW``s belong to the connection and
    go when it closes; use temporary objects only), without starting a database per query (its thread pool and
    buffer manager: ~16 ms of CPU, several times that in wall on a loaded host, paid thousands of times a run)."""
    db = getattr(_DB, "db", None)
    if db is None or _DB.pid != os.getpid():  # a forked child makes its own
        _DB.db, _DB.pid = duckdb.connect(), os.getpid()
        db = _DB.db
    return db.cursor()


def register_bags(con: duckdb.DuckDBPyConnection, tables: dict[str, tuple[pa.Schema, dict[tuple, int]]]) -> None:
    """Make each bag (``{name: (schema, {row: multiplicity})}``) a view ``<name>`` of DuckDB connection ``con``
    with each row as many times as its multiplicity (none when it is not positive), and a table ``<name>_w`` of
    the rows once each with their weight in an extra ``__w`` column."""
    for name, (schema, bag) in tables.items():
        rows = [r for r, w in bag.items() if w]
        cols = {f.name: pa.array([r[i] for r in rows], type=f.type) for i, f in enumerate(schema)}
        cols["__w"] = pa.array([bag[r] for r in rows], type=pa.int64())
        con.register(f"{name}_w", pa.table(cols))
        con.execute(f"CREATE TEMP VIEW {name} AS SELECT * EXCLUDE (__w, __i) FROM "
                    f"(SELECT *, UNNEST(range(CASE WHEN __w > 0 THEN __w ELSE 0 END)) AS __i FROM {name}_w)")


def duckdb_query(sql: str, tables: dict[str, tuple[pa.Schema, dict[tuple, int]]]) -> dict[tuple, int]:
    """Run ``sql`` over bags (``{name: (schema, {row: multiplicity})}``); returns ``{row: multiplicity}``.

    Each bag is also visible weighted as ``<name>_w`` with an extra ``__w`` column (for linear queries whose
    integrated result may have negative weights).
    """
    con = connect()
    try:
        register_bags(con, tables)
        result = con.sql(sql).to_arrow_table()
    finally:
        con.close()
    names = result.column_names
    weighted = names and names[-1] == "__w"
    cols = [result.column(i).to_pylist() for i in range(result.num_columns)]
    rows = list(zip(*cols)) if cols else []
    out: Counter = Counter()
    for r in rows:
        if weighted:
            out[r[:-1]] += r[-1]
        else:
            out[r] += 1
    return normalize(dict(out))


def accumulate(acc: dict[tuple, int], z: dbsp.ZSet) -> None:
    for r, w in z.to_dict().items():
        acc[r] = acc.get(r, 0) + w
        if acc[r] == 0:
            del acc[r]


def run_against_duckdb(build: Callable[[dbsp.Circuit, dict[str, dbsp.Stream]], dict[str, dbsp.Stream]],
                       queries: dict[str, str], seed: int, workers: int, steps: int = 5,
                       inputs: tuple[str, ...] = ("bids", "auctions"), max_rows: int = 8,
                       after: Callable[[dbsp.Pipeline], None] | None = None, append_only: bool = False,
                       **pipeline: object) -> dict[str, dict]:
    """Build a circuit, feed random changes in ``steps`` steps, and after every step compare each output's
    integral with DuckDB's answer over the integrated inputs. Returns the final integrals. ``pipeline``: more
    arguments of the Pipeline (``memory_limit=``); ``after``: called with the pipeline after the last step;
    ``append_only``: the inputs are declared append-only and the changes only insert."""
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    streams = {name: c.input(name, SCHEMAS[name], append_only=append_only) for name in inputs}
    for name, s in build(c, streams).items():
        c.output(name, s)
    gens = {name: ChangeGen(rng, SCHEMAS[name]) for name in inputs}
    for g in gens.values() if append_only else ():
        g.deletes = 0.0
    views: dict[str, dict] = {name: {} for name in queries}
    with dbsp.Pipeline(c, workers=workers, **pipeline) as p:
        for step in range(steps):
            for name, g in gens.items():
                change = g.change(max_rows)
                rows = list(change)
                if rows and rng.random() < 0.4:  # some steps arrive in two pushes
                    cut = int(rng.integers(0, len(rows) + 1))
                    for part in (rows[:cut], rows[cut:]):
                        if part:
                            p.push(name, to_zset({r: change[r] for r in part}, SCHEMAS[name]))
                elif rows:
                    p.push(name, to_zset(change, SCHEMAS[name]))
            out = p.step()
            tables = {name: (SCHEMAS[name], dict(g.bag)) for name, g in gens.items()}
            for name, sql in queries.items():
                accumulate(views[name], out[name])
                want = duckdb_query(sql, tables)
                got = normalize(views[name])
                assert got == want, (f"output {name!r} differs from DuckDB after step {step} (W={workers}, "
                                     f"seed={seed})\nonly in circuit: {_diff(got, want)}\n"
                                     f"only in DuckDB: {_diff(want, got)}")
        if after is not None:
            after(p)
    return views


def _diff(a: dict, b: dict) -> dict:
    return {r: w - b.get(r, 0) for r, w in a.items() if b.get(r, 0) != w}
