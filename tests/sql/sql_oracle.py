"""The DuckDB reference for SQL views: each view's integral, after every random step, against DuckDB's answer.

Steps change the corpus tables at random (inserts with duplicates, deletions, nulls); DuckDB runs the same CREATE
VIEW statements over the integrated tables.

The corpus runs: every view in every run, in groups of ``GROUP`` views compiled into one circuit and stepped by one
pipeline (one DuckDB connection per step for the group). Each group runs at one worker count drawn from the run's
seed (``DBSP_SQL_SEED`` replays one; by default a new one per run, printed in the header, after the summary and in
every failure), and its tables get their own random steps; ``DBSP_SQL_CORPUS=all`` runs every group at W = 1, 2
and 4.
"""

from __future__ import annotations

import datetime
import decimal
import os
import random
import re
from collections import Counter

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core import sql
from oracle import ChangeGen, _diff, _norm, connect, normalize, register_bags  # tests/core, on the path by conftest.py

BASE_TS = datetime.datetime(2024, 3, 1, 12, 0, 0)


def _value(rng: np.random.Generator, t: pa.DataType, null_rate: float) -> object:
    if rng.random() < null_rate:
        return None
    if pa.types.is_boolean(t):
        return bool(rng.integers(0, 2))
    if pa.types.is_integer(t):
        return int(rng.integers(0, 6))
    if pa.types.is_floating(t):
        return float(rng.integers(-20, 21)) / 4
    if pa.types.is_string(t):
        return str(rng.choice(["a", "b", "c", "dd", "", "Ab"]))
    if pa.types.is_date32(t):
        return datetime.date(2024, 1, 1) + datetime.timedelta(days=int(rng.integers(0, 70)))
    if pa.types.is_timestamp(t):
        return BASE_TS + datetime.timedelta(seconds=int(rng.integers(0, 240)),
                                            milliseconds=int(rng.integers(0, 4)) * 250)
    raise TypeError(t)


class Bag(ChangeGen):
    """oracle.ChangeGen over the SQL tables' types (with their null rate), duplicating a present row less often."""

    dup = 0.4

    def __init__(self, rng: np.random.Generator, schema: pa.Schema, null_rate: float = 0.15) -> None:
        super().__init__(rng, schema)
        self.null_rate = null_rate

    def row(self) -> tuple:
        return tuple(_value(self.rng, f.type, self.null_rate) for f in self.schema)


def _sql_norm(v: object) -> object:
    """oracle's value normalization after turning DuckDB's decimals into floats (a decimal literal is a float64 in
    the circuit: dbsp_core/sql/types.py invariant 2)."""
    return _norm(float(v) if isinstance(v, decimal.Decimal) else v)


def duckdb_views(ddl_tables: dict[str, pa.Schema], bags: dict[str, Counter], statements: str, views: list[str],
                 norm=None) -> dict[str, dict]:
    """Each view's rows (as ``{row: multiplicity}``) from DuckDB running ``statements`` over the bags."""
    con = connect()  # the process's database: every object made here must be temporary (it goes with con)
    try:
        # a Bag's weights are all > 0: each row stands in its view as many times as its weight
        register_bags(con, {name: (schema, bags[name]) for name, schema in ddl_tables.items()})
        for st in [s for s in statements.split(";") if s.strip()]:
            st = re.sub(r"CREATE\s+(?:MATERIALIZED\s+)?VIEW", "CREATE TEMP VIEW", st, flags=re.I)
            if re.search(r"\bCREATE\s+(?!TEMP\b)", st, flags=re.I):
                raise ValueError(f"duckdb_views makes views only (temporary, on a shared database): {st!r}")
            con.execute(st)
        out = {}
        for v in views:
            t = con.sql(f"SELECT * FROM {v}").to_arrow_table()
            cols = [c.to_pylist() for c in t.columns]
            out[v] = normalize(dict(Counter(zip(*cols))), norm or _sql_norm)
        return out
    finally:
        con.close()


def view_names(text: str) -> list[str]:
    return [m.lower() for m in re.findall(r"CREATE\s+(?:MATERIALIZED\s+)?VIEW\s+(\w+)", text, re.I)]


def run_views(ddl: str, tables: dict[str, pa.Schema], entries: list, seed: int, workers: int, steps: int = 6,
              max_rows: int = 6, null_rate: float = 0.15, label: str = "",
              rates: dict[str, tuple[int, float]] | None = None, gen: type[Bag] = Bag, norm=None) -> None:
    """Compile the entries' views, feed random steps, compare every view with DuckDB after every step.
    ``entries``: objects with ``sql`` (our CREATE VIEW statements) and ``duck`` (DuckDB's, or None); ``gen``: the
    change generator of every table; ``norm``: how values are normalized before the comparison (default
    ``_sql_norm``: floats to 9 significant digits)."""
    norm = norm or _sql_norm
    rng = np.random.default_rng(seed)
    text = ddl + "\n" + "\n".join(e.sql for e in entries)
    c = sql.compile(text)
    names = [v for e in entries for v in view_names(e.sql)]
    duck_text = "\n".join((e.duck or e.sql) for e in entries)
    rates = rates or {}
    bags = {name: gen(rng, schema, rates.get(name, (max_rows, null_rate))[1]) for name, schema in tables.items()}
    views: dict[str, dict] = {v: {} for v in names}
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in range(steps):
            for name, bag in bags.items():
                change = bag.change(rates.get(name, (max_rows, null_rate))[0])
                if change:
                    rows = list(change)
                    z = dbsp.ZSet.from_rows(rows, tables[name], weights=[change[r] for r in rows])
                    p.push(name, z)
            out = p.step()
            want = duckdb_views(tables, {n: b.bag for n, b in bags.items()}, duck_text, names, norm)
            for v in names:
                for r, w in out[v].to_dict().items():
                    views[v][r] = views[v].get(r, 0) + w
                views[v] = {r: w for r, w in views[v].items() if w}
                got = normalize(views[v], norm)
                if got != want[v]:
                    entry = next(e for e in entries if v in view_names(e.sql))
                    raise AssertionError(
                        f"view {v} differs from DuckDB after step {step} ({label} seed={seed} W={workers})\n"
                        f"{entry.sql}\nonly in circuit: {dict(list(_diff(got, want[v]).items())[:8])}\n"
                        f"only in DuckDB: {dict(list(_diff(want[v], got).items())[:8])}")


GROUP = 16  # views per pipeline: compiling and stepping one circuit of many views costs far less than many circuits
SEED = int(os.environ.get("DBSP_SQL_SEED", str(random.SystemRandom().randrange(2**31))))


def corpus_selection() -> tuple[int, int, int, str]:
    """(seed, views run, views in all, worker counts) of this run (see the module docstring)."""
    from corpus import CORPUS

    seed, groups = select(CORPUS)
    full = os.environ.get("DBSP_SQL_CORPUS", "") == "all"
    views = len({id(e) for _, entries, _ in groups for e in entries})
    return seed, views, len(CORPUS), "1, 2, 4 per group" if full else "one of 1, 2, 4 per group, from the seed"


def select(corpus: list) -> tuple[int, list[tuple[str, list, int]]]:
    """The ``(name, entries, workers)`` groups this run checks: every entry of ``corpus``, ``GROUP`` at a time in
    corpus order, each group at one worker count drawn from the seed (at 1, 2 and 4 with DBSP_SQL_CORPUS=all)."""
    chunks = [corpus[i:i + GROUP] for i in range(0, len(corpus), GROUP)]
    names = [f"{c[0].name}..{c[-1].name}" for c in chunks]
    if os.environ.get("DBSP_SQL_CORPUS", "") == "all":
        return SEED, [(n, c, w) for n, c in zip(names, chunks) for w in (1, 2, 4)]
    ws = np.random.default_rng(SEED).choice([1, 2, 4], size=len(chunks))
    return SEED, [(n, c, int(w)) for n, c, w in zip(names, chunks, ws)]
