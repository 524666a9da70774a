"""A sink that keeps a view as a Postgres table: each step's change and the step number commit in one transaction, so after any crash the table holds exactly the steps below its recorded step, each applied once, and a reader always sees a consistent step.

Invariants (enforced here; the SQLite sink's, in Postgres):
  1. The table holds the view as rows with a multiplicity: the view's columns, ``weight`` (the row's count,
     never 0: a row whose weight reaches 0 is deleted) and ``_dbsp_hash`` (the row's DBSP hash, indexed, to
     find a row fast; rows match on every column with ``IS NOT DISTINCT FROM``, so null equals null as in the
     engine).
  2. Step ``s``'s change is applied in one transaction that also moves the sink's ``next_step`` in
     ``dbsp_sink`` from ``s`` to ``s + 1`` (a row lock on it serializes two writers; one that finds another
     step there fails) and, with ``history``, inserts ``(consumer, s)`` into ``dbsp_sink_steps``, whose
     primary key makes a second application of a step fail instead of counting twice. The change enters as
     CSV through ``COPY`` into a temporary table (no per-row statements); the commit is durable when it
     returns (``synchronous_commit`` is forced on for the sink's session).
  3. On (re)start the sink continues from its ``next_step``; it acknowledges a step to the output log's consumer
     registry only after the transaction holding it committed, so the registry's step never exceeds the
     table's. A registry step above the table's means the table was replaced by an older one: refused
     (step_sink invariants 1 and 2).
  4. :func:`read_postgres_view` reads the table and its step in one REPEATABLE READ transaction: the rows are
     exactly the view after that step (the last one applied, numbered as the output log numbers it).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from dbsp_core.connectors.output import OutputReader
from dbsp_core.connectors.postgres import (arrow_type, connect, csv_bytes, execute, mask_dsn, parse_csv,
                                           postgres_type, quote_ident, scrub, table_columns, table_sql)
from dbsp_core.connectors.step_sink import StepSink
from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.zset import ZSet

__all__ = ["PostgresSink", "read_postgres_view"]

SINK_TABLE = "dbsp_sink"
STEPS_TABLE = "dbsp_sink_steps"
HASH_COLUMN = "_dbsp_hash"
CHANGE_TABLE = "_dbsp_change"


class PostgresSink(StepSink):
    """Keeps view ``view`` of a durable pipeline as table ``table`` of the Postgres database ``dsn`` (module
    docstring).

    Parameters
    ----------
    source
        A durable Pipeline in this process, or its storage directory (the pipeline may run elsewhere).
    view
        The output name.
    dsn
        A libpq connection string or URI (never logged: errors show it with the password masked).
    table
        The table name, optionally schema-qualified (default: the view's name); created if missing.
    consumer
        The sink's consumer name (default ``postgres-<table>``); keep it stable across restarts.
    history
        Keep ``dbsp_sink_steps``: one row per applied step, whose primary key refuses a second application.
    """

    def __init__(self, source: Any, view: str, dsn: str, *, table: str | None = None, consumer: str | None = None,
                 history: bool = True) -> None:
        self.dsn = dsn
        self.table = table or view
        self.history = history
        self.reader = OutputReader(source, view, consumer or f"postgres-{self.table}")
        self.consumer = self.reader.consumer
        self.schema = self.reader.schema
        self.columns = list(self.schema.names)
        self.what = f"PostgresSink {self.consumer!r} ({mask_dsn(dsn)})"
        if "weight" in self.columns or HASH_COLUMN in self.columns:
            raise SchemaError(f"{self.what}: view {view!r} has a column named weight or {HASH_COLUMN}")
        self.types = [postgres_type(f.name, f.type, f"{self.what}: view {view!r}") for f in self.schema]
        self.conn = connect(dsn, self.what)
        try:
            self._sql("SET synchronous_commit = on")
            self._create()
            self._start(self._table_step(), f"table {self.table!r}")
        except BaseException:
            self.conn.close()
            raise
        self.stats = {"steps": 0, "rows": 0}

    def _sql(self, query: str, params: Any = None) -> list:
        return execute(self.conn, query, params, self.what, self.dsn)


    # ---- schema ----

    def _create(self) -> None:
        t = table_sql(self.table)
        want = self.columns + ["weight", HASH_COLUMN]
        if not self._sql("SELECT to_regclass(%s)", (table_sql(self.table),))[0][0]:
            cols = ", ".join(f"{quote_ident(n)} {ty}" for n, ty in zip(self.columns, self.types))
            self._sql(f"CREATE TABLE {t} ({cols}{', ' if cols else ''}weight bigint NOT NULL, "
                      f"{HASH_COLUMN} bigint NOT NULL)")
            self._sql(f"CREATE INDEX ON {t} ({HASH_COLUMN})")
        else:
            have = [c for c, _ in table_columns(self.conn, self.table, self.what)]
            if have != want:
                raise SchemaError(f"{self.what}: table {self.table!r} has columns {have}, the view needs {want}")
        self._sql(f"CREATE TABLE IF NOT EXISTS {SINK_TABLE} (consumer text PRIMARY KEY, table_name text NOT NULL, "
                  "next_step bigint NOT NULL)")
        if self.history:
            self._sql(f"CREATE TABLE IF NOT EXISTS {STEPS_TABLE} (consumer text, step bigint, rows bigint NOT NULL, "
                      "PRIMARY KEY (consumer, step))")
        self._sql(f"CREATE TEMP TABLE IF NOT EXISTS {CHANGE_TABLE} AS SELECT * FROM {t} WHERE false")
        match = " AND ".join([f"t.{HASH_COLUMN} = c.{HASH_COLUMN}"]
                             + [f"t.{quote_ident(n)} IS NOT DISTINCT FROM c.{quote_ident(n)}" for n in self.columns])
        cols = ", ".join(quote_ident(n) for n in want)
        self._merge = [
            f"UPDATE {t} AS t SET weight = t.weight + c.weight FROM {CHANGE_TABLE} AS c WHERE {match}",
            f"INSERT INTO {t} ({cols}) SELECT {cols} FROM {CHANGE_TABLE} AS c "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} AS t WHERE {match})",
            f"DELETE FROM {t} WHERE weight = 0 AND {HASH_COLUMN} IN (SELECT {HASH_COLUMN} FROM {CHANGE_TABLE})",
        ]

    def _table_step(self) -> int:
        rows = self._sql(f"SELECT next_step, table_name FROM {SINK_TABLE} WHERE consumer = %s", (self.consumer,))
        if not rows:
            self._sql(f"INSERT INTO {SINK_TABLE} VALUES (%s, %s, 0) ON CONFLICT DO NOTHING",
                      (self.consumer, self.table))
            return self._table_step()
        if rows[0][1] != self.table:
            raise DbspError(f"{self.what}: consumer {self.consumer!r} keeps table {rows[0][1]!r}, not {self.table!r}")
        return int(rows[0][0])

    # ---- apply ----

    def _apply(self, step: int, z: ZSet) -> None:
        """Invariant 2: the change of ``step`` and ``next_step = step + 1`` in one transaction."""
        import psycopg

        z = z.consolidate()
        rows = z.num_rows
        c = self.conn
        try:
            with c.transaction():
                cur = c.execute(f"SELECT next_step FROM {SINK_TABLE} WHERE consumer = %s FOR UPDATE",
                                (self.consumer,)).fetchone()
                if cur is None or cur[0] != step:
                    raise DbspError(f"{self.what}: table {self.table!r} is not at step {step} any more (it is at "
                                    f"{None if cur is None else cur[0]}: another writer?)")
                if rows:
                    data = z.data.append_column("weight", pa.array(z.weights, pa.int64())).append_column(
                        HASH_COLUMN, pa.array(z.hash(self.columns).view("int64"), pa.int64()))
                    c.execute(f"TRUNCATE {CHANGE_TABLE}")
                    with c.cursor().copy(f"COPY {CHANGE_TABLE} FROM STDIN WITH (FORMAT csv)") as cp:
                        cp.write(csv_bytes(data))
                    for sql in self._merge:
                        c.execute(sql)
                if self.history:
                    c.execute(f"INSERT INTO {STEPS_TABLE} VALUES (%s, %s, %s)", (self.consumer, step, rows))
                c.execute(f"UPDATE {SINK_TABLE} SET next_step = %s WHERE consumer = %s", (step + 1, self.consumer))
        except psycopg.Error as e:
            raise DbspError(f"{self.what}: applying step {step} failed (nothing of it was applied): "
                            f"{scrub(str(e), self.dsn)}") from None
        self.stats["steps"] += 1
        self.stats["rows"] += rows

    def close(self) -> None:
        super().close()
        self.conn.close()


def read_postgres_view(dsn: str, table: str, consumer: str | None = None) -> tuple[int, pa.Table]:
    """``(step, rows)``: table ``table`` and the last step it holds (the output log's step number, as
    ``read_output`` and ``dbsp read`` show it; -1 before any), read in one transaction (invariant 4): the rows are
    the view after that step, with its columns and ``weight``. ``consumer`` defaults to ``postgres-<table>``."""
    import psycopg

    what = f"read_postgres_view({table!r}, {mask_dsn(dsn)})"
    conn = connect(dsn, what, autocommit=False)
    try:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        row = conn.execute(f"SELECT next_step FROM {SINK_TABLE} WHERE consumer = %s",
                           (consumer or f"postgres-{table}",)).fetchone()
        cols = [(c, t) for c, t in table_columns(conn, table, what) if c != HASH_COLUMN]
        schema = pa.schema([(c, arrow_type(c, t, what)) for c, t in cols])
        tsql = table_sql(table)
        data = bytearray()
        with conn.cursor().copy(f"COPY (SELECT {', '.join(quote_ident(c) for c, _ in cols)} FROM {tsql}) TO STDOUT "
                                "WITH (FORMAT csv)") as cp:
            for chunk in cp:
                data += chunk
        conn.rollback()
    except psycopg.Error as e:
        raise DbspError(f"{what}: {scrub(str(e), dsn)}") from None
    finally:
        conn.close()
    return (-1 if row is None else int(row[0]) - 1), parse_csv(bytes(data), schema, what)
