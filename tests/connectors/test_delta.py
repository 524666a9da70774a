"""DeltaSink: append and merge modes against a reference model of the view (random changes, seed printed and
replayable with ``DBSP_DELTA_SEED``), DuckDB reading the table through the files its Delta log lists, a restart
that commits nothing twice, the views merge mode refuses, and the docstring examples of the new connector
modules."""

from __future__ import annotations

import doctest
import importlib
import os
import random
from collections import Counter

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import DeltaSink, delta_steps
from dbsp_core.errors import DbspError, SchemaError

deltalake = pytest.importorskip("deltalake")

SEED = int(os.environ.get("DBSP_DELTA_SEED", str(random.SystemRandom().randrange(2**31))))
SCHEMA = pa.schema([("k", pa.int64()), ("name", pa.string()), ("v", pa.float64())])


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("rows", t)
    c.output("by_name", t.group_by("name").agg(n=dbsp.count(), total=dbsp.sum("v")))
    return c


def _drive(p: dbsp.Pipeline, rng: random.Random, steps: int) -> Counter:
    """Random inserts and deletes; returns the input's multiset (the reference model)."""
    model: Counter = Counter()
    for _ in range(steps):
        rows, weights = [], []
        for _ in range(rng.randrange(0, 12)):
            live = [r for r, n in model.items() if n > 0]
            if live and rng.random() < 0.3:
                rows.append(rng.choice(live))
                weights.append(-1)
            else:
                rows.append((rng.randrange(50), rng.choice(["a", "b", "", None]), rng.choice([0.5, -1.25, 3.0])))
                weights.append(1)
            model[rows[-1]] += weights[-1]
        if rows:
            p.push("t", pa.table({n: [r[i] for r in rows] for i, n in enumerate(SCHEMA.names)}, schema=SCHEMA),
                   weights=weights)
        p.step()
    return +model


def test_append_and_merge_equal_the_model(tmp_path) -> None:
    print(f"[delta] seed {SEED} (replay: DBSP_DELTA_SEED={SEED})")
    import duckdb
    from deltalake import DeltaTable

    p = dbsp.Pipeline(_circuit(), storage=str(tmp_path / "pipe"), checkpoint_interval=None)
    app = DeltaSink(p, "rows", tmp_path / "rows")
    mrg = DeltaSink(p, "by_name", tmp_path / "by_name", mode="merge", key=["name"])
    model = _drive(p, random.Random(SEED), 15)
    assert app.poll(limit=6) == 6 and app.poll() == 9 and mrg.poll() == 15
    assert delta_steps(tmp_path / "rows", "delta-rows") == list(range(15))
    assert delta_steps(tmp_path / "by_name", "delta-by_name") == list(range(15))
    con = duckdb.connect()
    files = DeltaTable(str(tmp_path / "rows")).file_uris()
    got = Counter({tuple(r[:3]): r[3] for r in con.execute(
        "SELECT k, name, v, sum(weight) w FROM read_parquet($f) GROUP BY ALL HAVING w <> 0", {"f": files}).fetchall()})
    assert got == model, f"replay: DBSP_DELTA_SEED={SEED}"
    want: dict = {}
    for (k, name, v), n in model.items():
        cnt, tot = want.get(name, (0, 0.0))
        want[name] = (cnt + n, tot + v * n)
    merged = DeltaTable(str(tmp_path / "by_name")).to_pyarrow_table().to_pylist()
    assert Counter((r["name"], r["n"], r["total"]) for r in merged) == Counter(
        (name, n, tot) for name, (n, tot) in want.items()), f"replay: DBSP_DELTA_SEED={SEED}"
    app.close()
    mrg.close()
    p.close()


def test_restart_continues_from_the_tables_txn_version(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), storage=str(tmp_path / "pipe"), checkpoint_interval=None)
    _drive(p, random.Random(SEED), 6)
    sink = DeltaSink(p, "rows", tmp_path / "rows")
    sink._apply(0, next(iter(p.read_output("rows", 0)))[1])  # committed, then "killed" before the acknowledgement
    sink.close()
    again = DeltaSink(p, "rows", tmp_path / "rows")
    assert again.next == 1  # from the table's txn version, not from the registry (which says 0)
    assert again.poll() == 5
    assert delta_steps(tmp_path / "rows", "delta-rows") == list(range(6))
    again.close()
    p.close()


def test_merge_refuses_a_view_not_keyed_by_its_key(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), storage=str(tmp_path / "pipe"), checkpoint_interval=None)
    p.push("t", pa.table({"k": [1, 2], "name": ["a", "a"], "v": [1.0, 2.0]}, schema=SCHEMA))
    p.step()
    sink = DeltaSink(p, "rows", tmp_path / "rows", mode="merge", key=["name"])
    with pytest.raises(DbspError, match="two rows with one key"):
        sink.poll()
    assert delta_steps(tmp_path / "rows", "delta-rows") == []  # nothing of the step was committed
    with pytest.raises(SchemaError, match="key="):
        DeltaSink(p, "rows", tmp_path / "other", mode="merge", key=["nope"])
    with pytest.raises(ValueError, match="mode="):
        DeltaSink(p, "rows", tmp_path / "other", mode="upsert")
    sink.close()
    p.close()


@pytest.mark.parametrize("name", ["dbsp_core.connectors.delta_sink", "dbsp_core.connectors.postgres"])
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
