"""The sinks on their own: SQLite rows with nulls, dates, strings and bags against the integral of the output
log; a Parquet replay that rewrites the same file; a replaced SQLite database refused; the doctests."""

from __future__ import annotations

import datetime
import doctest
import importlib
import os
import shutil

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import ParquetSink, SqliteSink, read_parquet_view, read_sqlite_view
from dbsp_core.errors import DbspError


def _pipeline(d) -> tuple[dbsp.Pipeline, pa.Schema]:
    schema = pa.schema([("name", pa.string()), ("day", pa.date32()), ("x", pa.float64()), ("b", pa.binary())])
    c = dbsp.Circuit()
    t = c.input("t", schema)
    c.output("rows", t)  # a bag: weights above 1, nulls in every column
    return dbsp.Pipeline(c, storage=d, checkpoint_interval=None), schema


def test_sqlite_rows_match_the_integral_with_nulls_and_bags(tmp_path) -> None:
    p, schema = _pipeline(tmp_path / "pipe")
    day = datetime.date(2024, 2, 29)
    rows = [("a", day, 1.5, b"\x00"), (None, None, None, None), ("a", day, 1.5, b"\x00"), ("b", None, 2.0, None)]
    p.push("t", dbsp.ZSet.from_rows(rows, schema))
    p.step()
    p.push("t", dbsp.ZSet.from_rows([(None, None, None, None), ("a", day, 1.5, b"\x00")], schema, weights=[-1, -1]))
    p.step()
    p.push("t", dbsp.ZSet.from_rows([(None, None, None, None)], schema, weights=[3]))
    p.step()
    sink = SqliteSink(p, "rows", tmp_path / "v.db")
    assert sink.poll() == 3
    step, table = read_sqlite_view(tmp_path / "v.db", "rows")
    got = {(r["name"], r["day"], r["x"], r["b"], r["weight"]) for r in table.to_pylist()}
    epoch_days = (day - datetime.date(1970, 1, 1)).days
    assert step == 2 and got == {("a", epoch_days, 1.5, b"\x00", 1), (None, None, None, None, 3),
                                 ("b", None, 2.0, None, 1)}
    sink.close()
    p.close()


def test_parquet_replay_rewrites_the_same_file(tmp_path) -> None:
    p, schema = _pipeline(tmp_path / "pipe")
    p.push("t", dbsp.ZSet.from_rows([("a", None, 1.0, None)], schema))
    p.step()
    sink = ParquetSink(p, "rows", tmp_path / "out")
    sink.poll()
    before = read_parquet_view(tmp_path / "out").to_dict()
    p.consumers.register("parquet-rows")  # (already registered: a no-op)
    sink2 = ParquetSink(p, "rows", tmp_path / "out", consumer="parquet-rows")
    assert sink2.next == 1 and sink2.poll() == 0
    # a sink whose acknowledgement was lost rewrites the same step under the same name
    sink3 = ParquetSink(p, "rows", tmp_path / "out", consumer="other")
    assert sink3.poll() == 1
    assert sorted(f for f in os.listdir(tmp_path / "out") if f.startswith("step-")) == [f"step-{0:020d}.parquet"]
    assert read_parquet_view(tmp_path / "out").to_dict() == before
    p.close()


def test_a_replaced_sqlite_database_is_refused(tmp_path) -> None:
    p, schema = _pipeline(tmp_path / "pipe")
    db = tmp_path / "v.db"
    sink = SqliteSink(p, "rows", db)
    sink.close()
    shutil.copy(db, tmp_path / "old.db")
    sink = SqliteSink(p, "rows", db)
    p.push("t", dbsp.ZSet.from_rows([("a", None, 1.0, None)], schema))
    p.step()
    sink.poll()
    sink.close()
    shutil.copy(tmp_path / "old.db", db)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(str(db) + suffix):
            os.remove(str(db) + suffix)
    with pytest.raises(DbspError, match="replaced by an older copy"):
        SqliteSink(p, "rows", db)
    p.close()


@pytest.mark.parametrize("name", ["dbsp_core.connectors.files", "dbsp_core.connectors.parquet_sink",
                                  "dbsp_core.connectors.sqlite_sink"])
def test_connector_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
