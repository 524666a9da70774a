"""PostgresSource and PostgresSink against a real server: types through the snapshot and the change stream, the
row filter, each crash point of the source's protocol (intent written but batch not pushed; batch pushed but
slot not advanced) replayed without loss or repeat, a sink step that fails leaving nothing, and errors that name
the column or mask the password."""

from __future__ import annotations

import datetime
import math
from collections import Counter

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import PostgresSink, PostgresSource, postgres_schema, read_postgres_view
from dbsp_core.connectors.postgres import mask_dsn
from dbsp_core.errors import DbspError, SchemaError


def _exec(dsn: str, *sql: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        for s in sql:
            c.execute(s)


def _table(dsn: str, sql: str) -> Counter:
    import psycopg

    with psycopg.connect(dsn, options="-c TimeZone=UTC") as c:
        return Counter(tuple(_norm(v) for v in r) for r in c.execute(sql).fetchall())


def _norm(v):
    return "NaN" if isinstance(v, float) and math.isnan(v) else v


def _view(p: dbsp.Pipeline, name: str) -> Counter:
    out: Counter = Counter()
    for _, z in p.read_output(name):
        for row, w in z.to_dict().items():
            out[tuple(_norm(v) for v in row)] += w
    return +out


def _pipeline(tmp_path, schema: pa.Schema, sub: str = "pipe") -> dbsp.Pipeline:
    c = dbsp.Circuit()
    c.output("all", c.input("t", schema))
    return dbsp.Pipeline(c, storage=str(tmp_path / sub), checkpoint_interval=None)


TYPES = ("CREATE TABLE t (id int PRIMARY KEY, s smallint, big bigint, r real, d double precision, b bool, "
         "name text, v varchar(10), dt date, ts timestamp, tz timestamptz)")


def test_types_snapshot_and_changes_equal_the_table(pg_dsn, tmp_path) -> None:
    _exec(pg_dsn, TYPES,
          "INSERT INTO t VALUES (1, 1, 2, 0.1, 0.1, true, 'a', 'x', '2024-01-02', '2024-01-02 03:04:05.123456', "
          "'2024-01-02 03:04:05.5+02'), (2, NULL, NULL, 'NaN', 'Infinity', NULL, '', NULL, NULL, NULL, NULL), "
          "(3, -5, -9223372036854775808, '-Infinity', 'NaN', false, 'quote \" comma , newline \n end', 'y', "
          "'1970-01-01', '1999-12-31 23:59:59', '1999-12-31 23:59:59Z')")
    schema = postgres_schema(pg_dsn, "t")
    assert schema.field("tz").type == pa.timestamp("us", tz="UTC") and schema.field("s").type == pa.int16()
    p = _pipeline(tmp_path, schema)
    src = PostgresSource(p, "t", pg_dsn, "t")
    p.step()
    _exec(pg_dsn, "UPDATE t SET name = 'b', r = 'NaN' WHERE id = 1", "DELETE FROM t WHERE id = 2",
          "INSERT INTO t VALUES (4, 7, 8, 1.5, 'NaN', true, '', '', '2000-02-29', '2000-02-29 12:00', "
          "'2000-02-29 12:00-05:30')", "UPDATE t SET id = 5 WHERE id = 3")
    assert src.poll() == 1
    p.step()
    want = _table(pg_dsn, "SELECT * FROM t")
    assert _view(p, "all") == Counter({row: 1 for row in want})
    assert src.stats["snapshot_rows"] == 3 and src.stats["transactions"] == 4
    p.close()


def test_row_filter_turns_updates_into_inserts_and_deletes(pg_dsn, tmp_path) -> None:
    _exec(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, amount bigint)",
          "INSERT INTO t SELECT g, g FROM generate_series(1, 20) g")
    p = _pipeline(tmp_path, postgres_schema(pg_dsn, "t"))
    src = PostgresSource(p, "t", pg_dsn, "t", where="amount > 10")
    _exec(pg_dsn, "UPDATE t SET amount = 0 WHERE id IN (15, 16)", "UPDATE t SET amount = 100 WHERE id IN (1, 2)",
          "UPDATE t SET amount = amount + 1 WHERE id = 20", "DELETE FROM t WHERE id IN (3, 17)")
    src.poll()
    p.step()
    assert _view(p, "all") == Counter({r: 1 for r in _table(pg_dsn, "SELECT * FROM t WHERE amount > 10")})
    p.close()


def _source_and_changes(pg_dsn, tmp_path):
    _exec(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, amount bigint)",
          "INSERT INTO t SELECT g, g FROM generate_series(1, 5) g")
    p = _pipeline(tmp_path, postgres_schema(pg_dsn, "t"))
    src = PostgresSource(p, "t", pg_dsn, "t")
    _exec(pg_dsn, "UPDATE t SET amount = 50 WHERE id = 1", "INSERT INTO t VALUES (6, 6)")
    return p, src


def test_crash_after_the_intent_pushes_the_same_batch_again(pg_dsn, tmp_path, monkeypatch) -> None:
    p, src = _source_and_changes(pg_dsn, tmp_path)
    real = p.push

    def crash(*a, **k):
        raise KeyboardInterrupt("killed between the intent and the push")

    monkeypatch.setattr(p, "push", crash)
    with pytest.raises(KeyboardInterrupt):
        src.poll()
    monkeypatch.setattr(p, "push", real)
    src.close()
    _exec(pg_dsn, "INSERT INTO t VALUES (7, 7)")  # a later change: not part of the batch replayed
    again = PostgresSource(p, "t", pg_dsn, "t")
    assert again.stats["batches"] == 2  # the snapshot, then batch 1 pushed again on open (shared counters)
    assert p.acknowledged(again.name, 1) and not p.acknowledged(again.name, 2)
    assert again.poll() == 1  # batch 2: the later change
    p.step()
    assert _view(p, "all") == Counter({r: 1 for r in _table(pg_dsn, "SELECT * FROM t")})
    p.close()


def test_crash_before_the_slot_advances_repeats_nothing(pg_dsn, tmp_path, monkeypatch) -> None:
    p, src = _source_and_changes(pg_dsn, tmp_path)
    monkeypatch.setattr(src, "_advance", lambda upto: None)  # killed after the push, before the slot moved
    assert src.poll() == 1
    src.close()
    again = PostgresSource(p, "t", pg_dsn, "t")
    assert again.poll() == 0  # the slot is advanced on open; the batch is not read again
    assert again.stats["duplicates"] == 0
    p.step()
    assert _view(p, "all") == Counter({r: 1 for r in _table(pg_dsn, "SELECT * FROM t")})
    (pos,), = _table(pg_dsn, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                            "WHERE database = current_database()")
    assert pos == f"{again.position >> 32:X}/{again.position & 0xFFFFFFFF:X}"
    p.close()


def test_unacknowledged_snapshot_is_taken_again(pg_dsn, tmp_path, monkeypatch) -> None:
    _exec(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, amount bigint)", "INSERT INTO t VALUES (1, 1)")
    p = _pipeline(tmp_path, postgres_schema(pg_dsn, "t"))
    real = p.push
    monkeypatch.setattr(p, "push", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        PostgresSource(p, "t", pg_dsn, "t")
    monkeypatch.setattr(p, "push", real)
    _exec(pg_dsn, "INSERT INTO t VALUES (2, 2)")
    src = PostgresSource(p, "t", pg_dsn, "t")  # a new slot, a new snapshot with both rows
    assert src.poll() == 0
    p.step()
    assert _view(p, "all") == Counter({(1, 1): 1, (2, 2): 1})
    assert len(_table(pg_dsn, "SELECT slot_name FROM pg_replication_slots "
                                           "WHERE database = current_database()")) == 1
    p.close()


def test_older_pipeline_storage_is_refused(pg_dsn, tmp_path) -> None:
    p, src = _source_and_changes(pg_dsn, tmp_path)
    src.poll()
    src.poll()
    _exec(pg_dsn, "INSERT INTO t VALUES (8, 8)")
    src.poll()  # batch 2
    src.close()
    p.close()
    fresh = _pipeline(tmp_path, postgres_schema(pg_dsn, "t"), sub="other")  # knows nothing of batches 0, 1
    with pytest.raises(DbspError, match="older than the source's progress"):
        PostgresSource(fresh, "t", pg_dsn, "t")
    fresh.close()


def test_truncate_stops_the_source(pg_dsn, tmp_path) -> None:
    p, src = _source_and_changes(pg_dsn, tmp_path)
    src.poll()
    _exec(pg_dsn, "TRUNCATE t")
    with pytest.raises(DbspError, match="TRUNCATE"):
        src.poll()
    p.close()


def test_unsupported_type_names_the_column(pg_dsn, tmp_path) -> None:
    _exec(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY, price numeric(10, 2))")
    with pytest.raises(SchemaError, match="'price'.*numeric"):
        postgres_schema(pg_dsn, "t")
    p = _pipeline(tmp_path, pa.schema([("id", pa.int64()), ("price", pa.float64())]))
    with pytest.raises(SchemaError, match="'price'.*numeric"):
        PostgresSource(p, "t", pg_dsn, "t")
    p.close()


def test_password_is_masked_in_errors(pg_server, tmp_path, caplog) -> None:
    _exec(pg_server.dsn, "DROP ROLE IF EXISTS app", "CREATE ROLE app LOGIN PASSWORD 'hunter2-s3cret'")
    dsn = f"host=127.0.0.1 port={pg_server.port} user=app password=hunter2-s3cret dbname=nosuchdb"
    p = _pipeline(tmp_path, pa.schema([("id", pa.int64())]))
    for make in (lambda: PostgresSource(p, "t", dsn, "t"), lambda: PostgresSink(p, "all", dsn)):
        with pytest.raises(DbspError) as e:
            make()
        assert "hunter2" not in str(e.value) and "password=***" in str(e.value)
    assert "hunter2" not in caplog.text
    assert mask_dsn("postgresql://app:hunter2@h/db?sslmode=require") == "postgresql://app:***@h/db?sslmode=require"
    p.close()


def test_sink_step_fails_whole_and_is_applied_once(pg_dsn, tmp_path, monkeypatch) -> None:
    schema = pa.schema([("k", pa.int64()), ("s", pa.string()), ("x", pa.float64()), ("d", pa.date32()),
                        ("t", pa.timestamp("us", tz="UTC"))])
    p = _pipeline(tmp_path, schema)
    rows = pa.table({"k": [1, 2, 2, 3], "s": ["a", "", None, 'q"u,o\nte'], "x": [float("nan"), 1.5, None, -0.1],
                     "d": [datetime.date(2024, 1, 1), None, None, datetime.date(1970, 1, 1)],
                     "t": pa.array([datetime.datetime(2024, 1, 1, 1, 2, 3, 4)] * 4, pa.timestamp("us", tz="UTC"))})
    p.push("t", rows)
    p.step()
    p.push("t", rows.slice(0, 2), weights=[-1, 1])
    p.step()
    sink = PostgresSink(p, "all", pg_dsn, table="out")
    real = sink._merge
    sink._merge = real[:1] + ["SELECT 1/0"]  # fails inside the transaction of step 0
    with pytest.raises(DbspError, match="applying step 0 failed"):
        sink.poll()
    assert read_postgres_view(pg_dsn, "out", "postgres-out")[0] == -1  # no step applied
    assert _table(pg_dsn, "SELECT count(*) FROM out") == Counter({(0,): 1})
    sink._merge = real
    assert sink.poll() == 2
    sink.close()
    again = PostgresSink(p, "all", pg_dsn, table="out")
    assert again.poll() == 0 and again.next == 2
    step, table = read_postgres_view(pg_dsn, "out")
    assert step == 1
    got = Counter()
    for r in table.to_pylist():
        got[tuple(_norm(r[n]) for n in schema.names)] += r["weight"]
    assert got == _view(p, "all")
    assert _table(pg_dsn, "SELECT step FROM dbsp_sink_steps ORDER BY step") == Counter({(0,): 1, (1,): 1})
    again.close()
    p.close()


def test_readme_postgres_example(pg_dsn, monkeypatch) -> None:
    from test_readme import POSTGRES, _blocks, _run_checked

    blocks = [b for b in _blocks("python") if b.startswith(POSTGRES)]
    assert len(blocks) == 1
    monkeypatch.setenv("DBSP_PG_DSN", pg_dsn)
    _run_checked(blocks[0])


def test_sources_of_one_name_in_two_databases_keep_their_own_slots(pg_server, tmp_path) -> None:
    dsns = [pg_server.database("slot_a"), pg_server.database("slot_b")]
    pipes, sources = [], []
    for i, dsn in enumerate(dsns):
        _exec(dsn, "CREATE TABLE t (id bigint PRIMARY KEY, amount bigint)", f"INSERT INTO t VALUES ({i}, {i})")
        pipes.append(_pipeline(tmp_path, postgres_schema(dsn, "t"), sub=f"pipe{i}"))
        sources.append(PostgresSource(pipes[-1], "t", dsn, "t"))  # slot names are per server: one each
    for i, dsn in enumerate(dsns):
        _exec(dsn, f"INSERT INTO t VALUES ({10 + i}, 1)")
        assert sources[i].poll() == 1
        pipes[i].step()
        assert _view(pipes[i], "all") == Counter({(i, i): 1, (10 + i, 1): 1})
        pipes[i].close()


def test_mixed_case_schema_qualified_tables(pg_dsn, tmp_path) -> None:
    _exec(pg_dsn, 'CREATE SCHEMA app', 'CREATE TABLE app."Sales" (id bigint PRIMARY KEY, "Region" text)',
          "INSERT INTO app.\"Sales\" VALUES (1, 'n'), (2, 's')")
    schema = postgres_schema(pg_dsn, "app.Sales")
    assert schema.names == ["id", "Region"]
    p = _pipeline(tmp_path, schema)
    src = PostgresSource(p, "t", pg_dsn, "app.Sales")
    _exec(pg_dsn, "UPDATE app.\"Sales\" SET \"Region\" = 'e' WHERE id = 2")
    src.poll()
    p.step()
    sink = PostgresSink(p, "all", pg_dsn, table="app.Out")
    sink.poll()
    sink.close()
    again = PostgresSink(p, "all", pg_dsn, table="app.Out")  # finds the table it made
    assert again.next == 1  # one step: the snapshot and the update
    step, rows = read_postgres_view(pg_dsn, "app.Out")
    assert step == 0 and sorted((r["id"], r["Region"], r["weight"]) for r in rows.to_pylist()) == [
        (1, "n", 1), (2, "e", 1)]
    again.close()
    p.close()
