"""A sink that keeps a view as a SQLite table (through sqlite-utils): each step's change and the step number commit in one transaction, so after any crash the table holds exactly the steps below its recorded step, each applied once, and a reader always sees a consistent step.

Invariants (enforced here):
  1. The table holds the view as rows with a multiplicity: the view's columns, ``weight`` (the row's count,
     never 0: a row whose weight reaches 0 is deleted) and ``_dbsp_hash`` (the row's DBSP hash, indexed, to
     find a row fast; rows are matched on every column with ``IS``, so null equals null as in the engine).
  2. Step ``s``'s change is applied in one ``BEGIN IMMEDIATE`` transaction that also sets the sink's
     ``next_step`` to ``s + 1`` in ``_dbsp_sink`` (and, with ``history``, inserts ``(consumer, s)`` into
     ``_dbsp_steps``, whose primary key makes a second application of a step fail instead of counting
     twice). The database runs in WAL mode with ``synchronous=FULL``, so a commit is durable when it returns.
  3. On (re)start the sink continues from its ``next_step``; it acknowledges a step to the output log's consumer
     registry only after the transaction holding it committed, so the registry's step never exceeds the
     table's and the log keeps every step the table lacks. A registry step above the table's means the database
     was replaced by an older one: refused, naming both steps (step_sink invariants 1 and 2).
  4. :func:`read_sqlite_view` reads the table and its step in one read transaction (a WAL snapshot): the rows
     are exactly the view after that step (the last one applied, numbered as the output log numbers it).

Column types: integers and bool as INTEGER, floats as REAL, strings as TEXT, binary as BLOB, dates and times
as INTEGER (the Arrow value: days or units since the epoch). A float NaN is stored by SQLite as NULL.
Rows cross into SQLite as Python values (the sqlite3 module takes no Arrow buffers); the merge itself is three
set-based statements per step.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

import pyarrow as pa

from dbsp_core.connectors.output import OutputReader
from dbsp_core.connectors.step_sink import StepSink
from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.zset import ZSet

__all__ = ["SqliteSink", "read_sqlite_view"]

SINK_TABLE = "_dbsp_sink"
STEPS_TABLE = "_dbsp_steps"
HASH_COLUMN = "_dbsp_hash"


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _sqlite_type(t: pa.DataType) -> type:
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t):
        return int
    if pa.types.is_floating(t):
        return float
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_decimal(t):
        return str  # a DECIMAL as its exact text ('120.50'): SQLite has no exact decimal type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return bytes
    raise SchemaError(f"SqliteSink: no SQLite column type for Arrow type {t}")


def _values(col: pa.ChunkedArray) -> list:
    if pa.types.is_decimal(col.type):
        return [None if v is None else str(v) for v in col.to_pylist()]
    if pa.types.is_temporal(col.type):
        width = pa.int32() if col.type.bit_width == 32 else pa.int64()
        col = pa.chunked_array([c.view(width) for c in col.chunks], width)
    return col.to_pylist()


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


class SqliteSink(StepSink):
    """Keeps view ``view`` of a durable pipeline as table ``table`` of the SQLite database ``path`` (module
    docstring).

    Parameters
    ----------
    source
        A durable Pipeline in this process, or its storage directory (the pipeline may run elsewhere).
    view
        The output name.
    path
        The SQLite database file (created if missing).
    table
        The table name (default: the view's name).
    consumer
        The sink's consumer name (default ``sqlite-<table>``); keep it stable across restarts.
    history
        Keep ``_dbsp_steps``: one row per applied step, whose primary key refuses a second application.

    Examples
    --------
    >>> import os, tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> from dbsp_core.connectors import SqliteSink, read_sqlite_view
    >>> c = dbsp.Circuit(); t = c.input("t", pa.schema([("k", pa.int64())]))
    >>> c.output("n", t.group_by("k").agg(n=dbsp.count()))
    >>> p = dbsp.Pipeline(c, storage=tempfile.mkdtemp())
    >>> db = os.path.join(tempfile.mkdtemp(), "views.db"); sink = SqliteSink(p, "n", db)
    >>> _ = p.push("t", pa.table({"k": [1, 1, 2]})); _ = p.step(); _ = p.push("t", pa.table({"k": [2]})); _ = p.step()
    >>> sink.poll()
    2
    >>> step, rows = read_sqlite_view(db, "n"); step, sorted(rows.to_pylist(), key=lambda r: r["k"])
    (1, [{'k': 1, 'n': 2, 'weight': 1}, {'k': 2, 'n': 2, 'weight': 1}])
    >>> sink.close(); p.close()
    """

    def __init__(self, source: Any, view: str, path: str | os.PathLike, *, table: str | None = None,
                 consumer: str | None = None, history: bool = True) -> None:
        try:
            import sqlite_utils
        except ImportError:  # pragma: no cover - the dependency is declared; this names it if it is missing
            raise ImportError("SqliteSink needs sqlite-utils: pip install 'dbsp-core[sqlite]'") from None
        self.path = os.fspath(path)
        self.table = table or view
        self.history = history
        self.reader = OutputReader(source, view, consumer or f"sqlite-{self.table}")
        self.consumer = self.reader.consumer
        self.schema = self.reader.schema
        self.columns = list(self.schema.names)
        if "weight" in self.columns or HASH_COLUMN in self.columns:
            raise SchemaError(f"SqliteSink: view {view!r} has a column named weight or {HASH_COLUMN}")
        self.conn = _connect(self.path)
        self.db = sqlite_utils.Database(self.conn)
        self._create()
        self.what = f"SqliteSink {self.consumer!r}"
        self._start(self._table_step(), self.path)
        self.stats = {"steps": 0, "rows": 0}

    # ---- schema ----

    def _create(self) -> None:
        t = self.db[self.table]
        want = {n: _sqlite_type(f.type) for n, f in zip(self.columns, self.schema)}
        if not t.exists():
            t.create({**want, "weight": int, HASH_COLUMN: int}, not_null={"weight", HASH_COLUMN})
            t.create_index([HASH_COLUMN], index_name=f"{self.table}_{HASH_COLUMN}")
        else:
            have = [c.name for c in t.columns]
            if have != self.columns + ["weight", HASH_COLUMN]:
                raise SchemaError(f"SqliteSink: table {self.table!r} of {self.path} has columns {have}, the view "
                                  f"needs {self.columns + ['weight', HASH_COLUMN]}")
        if not self.db[SINK_TABLE].exists():
            self.db[SINK_TABLE].create({"consumer": str, "table_name": str, "next_step": int}, pk="consumer")
        if self.history and not self.db[STEPS_TABLE].exists():
            self.db[STEPS_TABLE].create({"consumer": str, "step": int, "rows": int}, pk=("consumer", "step"))
        cols = ", ".join(f"{_q(n)}" for n in self.columns + ["weight", HASH_COLUMN])
        self.conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS _dbsp_change AS SELECT {cols} FROM {_q(self.table)} "
                          f"WHERE 0")
        match = " AND ".join([f"t.{_q(HASH_COLUMN)} = c.{_q(HASH_COLUMN)}"]
                             + [f"t.{_q(n)} IS c.{_q(n)}" for n in self.columns])
        table = _q(self.table)
        self._sql = [
            f"UPDATE {table} AS t SET weight = t.weight + c.weight FROM temp._dbsp_change AS c WHERE {match}",
            f"INSERT INTO {table} ({cols}) SELECT {cols} FROM temp._dbsp_change AS c "
            f"WHERE NOT EXISTS (SELECT 1 FROM {table} AS t WHERE {match})",
            f"DELETE FROM {table} WHERE weight = 0 AND {_q(HASH_COLUMN)} IN "
            f"(SELECT {_q(HASH_COLUMN)} FROM temp._dbsp_change)",
        ]
        self._insert = f"INSERT INTO temp._dbsp_change VALUES ({', '.join('?' * (len(self.columns) + 2))})"

    def _table_step(self) -> int:
        row = self.conn.execute(f"SELECT next_step, table_name FROM {SINK_TABLE} WHERE consumer = ?",
                                (self.consumer,)).fetchone()
        if row is None:
            self.conn.execute(f"INSERT INTO {SINK_TABLE} VALUES (?, ?, 0)", (self.consumer, self.table))
            return 0
        if row[1] != self.table:
            raise DbspError(f"SqliteSink: consumer {self.consumer!r} keeps table {row[1]!r} in {self.path}, "
                            f"not {self.table!r}")
        return int(row[0])

    # ---- apply ----

    def _apply(self, step: int, z: ZSet) -> None:
        """Invariant 2: the change of ``step`` and ``next_step = step + 1`` in one transaction."""
        z = z.consolidate()
        data = z.data
        rows = list(zip(*[_values(data.column(i)) for i in range(data.num_columns)], z.weights.tolist(),
                        z.hash(self.columns).view("int64").tolist())) if z.num_rows else []
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            if rows:
                c.execute("DELETE FROM temp._dbsp_change")
                c.executemany(self._insert, rows)
                for sql in self._sql:
                    c.execute(sql)
            if self.history:
                c.execute(f"INSERT INTO {STEPS_TABLE} VALUES (?, ?, ?)", (self.consumer, step, len(rows)))
            # the store is at self.next: step itself, or the step a rebuilt view's output starts at (output.py inv. 3)
            cur = c.execute(f"UPDATE {SINK_TABLE} SET next_step = ? WHERE consumer = ? AND next_step = ?",
                            (step + 1, self.consumer, self.next))
            if cur.rowcount != 1:
                raise DbspError(f"SqliteSink {self.consumer!r}: {self.path} is not at step {self.next} any more "
                                f"(another writer?)")
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self.stats["steps"] += 1
        self.stats["rows"] += len(rows)

    def close(self) -> None:
        super().close()
        self.conn.close()


def read_sqlite_view(path: str | os.PathLike, table: str, consumer: str | None = None) -> tuple[int, pa.Table]:
    """``(step, rows)``: table ``table`` and the last step it holds (the output log's step number, as
    ``read_output`` and ``dbsp read`` show it; -1 before any), read in one transaction (invariant 4): the rows are
    the view after that step, with its columns and ``weight``. ``consumer`` defaults to ``sqlite-<table>``."""
    conn = sqlite3.connect(os.fspath(path), isolation_level=None)
    try:
        conn.execute("BEGIN")
        row = conn.execute(f"SELECT next_step FROM {SINK_TABLE} WHERE consumer = ?",
                           (consumer or f"sqlite-{table}",)).fetchone()
        cur = conn.execute(f"SELECT * FROM {_q(table)}")
        names = [d[0] for d in cur.description]
        data = cur.fetchall()
        conn.execute("COMMIT")
    finally:
        conn.close()
    cols = {n: [r[i] for r in data] for i, n in enumerate(names) if n != HASH_COLUMN}
    return (-1 if row is None else int(row[0]) - 1), pa.table(cols) if data else pa.table(
        {n: pa.array([], pa.null()) for n in cols})
