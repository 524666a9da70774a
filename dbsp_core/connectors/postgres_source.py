"""A source that loads a Postgres table as a snapshot and then follows its changes through logical replication (``pgoutput``, a replication slot), pushing them into a durable pipeline so that a restart neither skips nor repeats a change.

Invariants (enforced here; "batch k" is the source's push with ``(producer, seq) = (name, k)``):
  1. Batch 0 is the snapshot: the table's rows (``WHERE`` filtered) read in the transaction that creates the
     slot, with the slot's own snapshot (``CREATE_REPLICATION_SLOT ... (SNAPSHOT 'use')``), so every committed
     change is either in the snapshot or after the slot's consistent point, never both, never neither.
     Batch k >= 1 is the changes of the transactions whose commit ends in ``(C_k, U_k]``: an INSERT +1, a DELETE
     -1 of the old row, an UPDATE -1 of the old and +1 of the new (pgoutput invariant 2; the table is set to
     ``REPLICA IDENTITY FULL``). The publication carries the ``where`` filter, so a row updated into or out of
     it arrives as an insert or a delete.
  2. Before batch k is pushed, ``(k, C_k, U_k)`` is committed to the progress table (``dbsp_source_progress`` in
     the source database): a write-ahead intent. The slot's confirmed position advances to ``U_k`` only after the
     pipeline acknowledged batch k (its record is durable in the input log, so recovery replays it into a step:
     driver invariants 1 and 6). Changes are read with ``pg_logical_slot_peek_binary_changes`` (which consumes
     nothing) and the slot is moved with ``pg_replication_slot_advance``.
  3. On (re)start with intent ``(k, C, U)``: if the pipeline acknowledged batch k, the slot advances to ``U`` and
     reading goes on after it; if not, batch k is pushed again with exactly the transactions of ``(C, U]`` (the
     slot never passed ``C``, so they are all still there), under the same seq: the pipeline's dedup counts it
     once however often this repeats. An unacknowledged snapshot (k = 0) is dropped with its slot and taken
     again. A pipeline that lacks batch k - 1 (its storage is older than the source's progress) or a slot that
     vanished is refused: changes would be lost.
  4. Batches are pushed one at a time, in order, each after the previous one was acknowledged, so a step holds a
     prefix of the transactions in commit order and the view after it is the view of a committed state.
  5. A TRUNCATE of the table stops the source with DbspError (pgoutput invariant 3).

The pgoutput messages are split in Python (one loop over the changed rows); values convert to Arrow column by
column (postgres invariant 3). The snapshot is read into memory and pushed as one batch, so it is bounded by one
push (1 GiB encoded: the pipeline refuses a bigger one, and the source stops before pushing anything); a bigger
table loads through several sources with disjoint ``where`` filters. Only the source uses its slot: a second
process polling it raises, or waits while a killed predecessor's backend lets go of it.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import pyarrow as pa

from dbsp_core import metrics
from dbsp_core.connectors.inputs import source_input
from dbsp_core.connectors.pgoutput import Relation, decode
from dbsp_core.connectors.postgres import (arrow_type, connect, execute, mask_dsn, parse_csv, quote_ident,
                                           scrub, table_columns, table_sql, text_columns)
from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.zset import ZSet

__all__ = ["PostgresSource", "postgres_schema"]

PROGRESS_TABLE = "dbsp_source_progress"
SLOT_BUSY_WAIT = 30.0  # seconds to wait for a killed predecessor's backend to release the slot


def _lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def _lsn_text(v: int) -> str:
    return f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"


def _ident(name: str, prefix: str) -> str:
    """A slot or publication name for source ``name``: lower-case letters, digits and _, at most 63 bytes."""
    clean = re.sub(r"[^a-z0-9_]", "_", name.lower())[:40]
    return f"{prefix}_{clean}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def postgres_schema(dsn: str, table: str, columns: list[str] | None = None) -> pa.Schema:
    """The Arrow schema of ``table`` (its ``columns``, by default all) as :class:`PostgresSource` reads it: declare
    the pipeline's input with it."""
    conn = connect(dsn, f"postgres_schema({table!r})")
    try:
        cols = table_columns(conn, table, f"postgres_schema({table!r})")
    finally:
        conn.close()
    have = dict(cols)
    missing = [c for c in columns or [] if c not in have]
    if missing:
        raise SchemaError(f"postgres_schema: table {table!r} has no column {missing}; it has {[c for c, _ in cols]}")
    return pa.schema([(c, arrow_type(c, have[c], f"table {table!r}")) for c in columns or [c for c, _ in cols]])


class PostgresSource:
    """Pushes table ``table`` of the Postgres database ``dsn`` into input ``handle`` of a durable pipeline: a
    snapshot, then every committed change (module docstring).

    Parameters
    ----------
    pipeline
        A durable ``dbsp_core.Pipeline`` (``storage=``): exactly once rests on its ``(producer, seq)`` dedup.
    handle
        The input the rows go to; its columns are taken from the table by name (extra table columns are not
        read) and must have the Arrow types :func:`postgres_schema` gives them.
    dsn
        A libpq connection string or URI of a user who may create a publication and a replication slot, alter
        the table's replica identity and create the progress table (the table's owner with ``REPLICATION``).
        It is never logged: errors show it with the password masked.
    table
        The table (``name`` or ``schema.name``).
    where
        An optional SQL condition on the table's columns: the source reads the rows that satisfy it (the
        snapshot's ``WHERE`` and the publication's row filter, evaluated by Postgres on every change). It is
        fixed when the source is first made (the publication keeps it): another filter needs another ``name``.
    name
        The source's name, the producer id of its pushes and the key of its progress; keep it stable across
        restarts. By default ``pg:<handle>:<table>``.
    max_changes
        About how many changed rows one poll reads (whole transactions: a bigger one is read whole).

    Examples
    --------
    Against a running server (the tests start one; see README "Postgres and Delta Lake")::

        schema = postgres_schema(dsn, "orders")
        c = dbsp.Circuit(); o = c.input("orders", schema)
        c.output("by_customer", o.group_by("customer").agg(total=dbsp.sum("amount")))
        p = dbsp.Pipeline(c, storage="pipe")
        src = PostgresSource(p, "orders", dsn, "orders")
        while True:
            src.poll(); p.step()
    """

    def __init__(self, pipeline: Any, handle: str, dsn: str, table: str, *, where: str | None = None,
                 name: str | None = None, max_changes: int = 10_000) -> None:
        handle, schema = source_input("PostgresSource", pipeline, handle)
        if not isinstance(max_changes, int) or max_changes < 1:
            raise ValueError(f"PostgresSource: max_changes={max_changes!r}; it is an int >= 1")
        self.pipeline = pipeline
        self.handle = handle
        self.schema: pa.Schema = schema
        self.dsn = dsn
        self.table = table
        self.where = where
        self.name = name or f"pg:{handle}:{table}"
        self.publication = _ident(self.name, "dbsp_pub")
        self.max_changes = max_changes
        self.what = f"PostgresSource {self.name!r} ({mask_dsn(dsn)})"
        self.stats = {"batches": 0, "duplicates": 0, "rows": 0, "transactions": 0, "snapshot_rows": 0,
                      "advanced": 0}
        try:
            self.stats = metrics.attach_source(pipeline, self.name, handle, f"postgres table {table}", self.stats)
        except ValueError as e:
            raise ValueError(f"PostgresSource: {e}") from None
        self.conn = connect(dsn, self.what)
        self._relations: dict[int, Relation] = {}
        database = self.conn.info.dbname
        self.slot = _ident(f"{database}:{self.name}", "dbsp")  # slot names are per server, not per database
        try:
            self._columns = self._check_table()
            self._setup()
            self._resume()
        except BaseException:
            self.conn.close()
            raise

    # ---- setup ----

    def _sql(self, query: str, params: Any = None) -> list:
        return execute(self.conn, query, params, self.what, self.dsn)

    def _check_table(self) -> list[str]:
        cols = dict(table_columns(self.conn, self.table, self.what))
        missing = [n for n in self.schema.names if n not in cols]
        if missing:
            raise SchemaError(f"{self.what}: table {self.table!r} has no column {missing} of input {self.handle!r}; "
                              f"it has {list(cols)}")
        for f in self.schema:
            t = arrow_type(f.name, cols[f.name], f"{self.what}: table {self.table!r}")
            if t != f.type:
                raise SchemaError(f"{self.what}: column {f.name!r} of {self.table!r} reads as {t} ({cols[f.name]}), "
                                  f"input {self.handle!r} declares {f.type}; declare the input with "
                                  f"postgres_schema(dsn, {self.table!r})")
        return list(self.schema.names)

    def _setup(self) -> None:
        """The progress table, full replica identity and the publication (idempotent)."""
        self._sql(f"CREATE TABLE IF NOT EXISTS {PROGRESS_TABLE} (name text PRIMARY KEY, slot text NOT NULL, "
                  "seq bigint NOT NULL, from_lsn pg_lsn NOT NULL, upto_lsn pg_lsn NOT NULL, rows bigint NOT NULL)")
        ident = self._sql("SELECT relreplident FROM pg_class WHERE oid = %s::regclass",
                          (table_sql(self.table),))[0][0]
        if ident != "f":
            self._sql(f"ALTER TABLE {table_sql(self.table)} REPLICA IDENTITY FULL")
        if not self._sql("SELECT 1 FROM pg_publication WHERE pubname = %s", (self.publication,)):
            where = f" WHERE ({self.where})" if self.where else ""
            self._sql(f"CREATE PUBLICATION {quote_ident(self.publication)} FOR TABLE {table_sql(self.table)}{where}")


    def _progress(self) -> tuple[int, int, int] | None:
        rows = self._sql(f"SELECT seq, from_lsn::text, upto_lsn::text, slot FROM {PROGRESS_TABLE} WHERE name = %s",
                         (self.name,))
        if not rows:
            return None
        return int(rows[0][0]), _lsn(rows[0][1]), _lsn(rows[0][2])

    def _write_progress(self, seq: int, frm: int, upto: int, rows: int) -> None:
        """Invariant 2: the intent, committed (durable) before the push."""
        self._sql(f"INSERT INTO {PROGRESS_TABLE} VALUES (%s, %s, %s, %s::pg_lsn, %s::pg_lsn, %s) ON CONFLICT (name) "
                  "DO UPDATE SET slot = EXCLUDED.slot, seq = EXCLUDED.seq, from_lsn = EXCLUDED.from_lsn, "
                  "upto_lsn = EXCLUDED.upto_lsn, rows = EXCLUDED.rows",
                  (self.name, self.slot, seq, _lsn_text(frm), _lsn_text(upto), rows))

    def _slot_position(self) -> int | None:
        rows = self._sql("SELECT confirmed_flush_lsn::text, database = current_database() FROM pg_replication_slots "
                         "WHERE slot_name = %s", (self.slot,))
        if rows and not rows[0][1]:
            raise DbspError(f"{self.what}: replication slot {self.slot} belongs to another database; name the "
                            f"source differently")
        return _lsn(rows[0][0]) if rows else None

    def _resume(self) -> None:
        """Invariant 3."""
        p = self.pipeline
        prog = self._progress()
        if prog is not None and prog[0] > 0 and not p.acknowledged(self.name, prog[0] - 1):
            raise DbspError(f"{self.what}: the progress table says batch {prog[0]} was read, but the pipeline lacks "
                            f"batch {prog[0] - 1}: its storage is older than the source's progress, and the changes "
                            f"before the slot's position are gone. Restore the pipeline's storage, or start a new "
                            f"source (another name) with a new snapshot")
        if prog is not None and self._slot_position() is None:
            raise DbspError(f"{self.what}: the replication slot {self.slot} is gone, so the changes after batch "
                            f"{prog[0]} cannot be read; start a new source (another name) with a new snapshot")
        if prog is None or (prog[0] == 0 and not p.acknowledged(self.name, 0)):
            self._snapshot()
            return
        k, frm, upto = prog
        if not p.acknowledged(self.name, k):
            self._push(k, self._read(frm, upto), frm, upto, intent=False)
        self.seq = k
        self._advance(upto)
        self.position = max(upto, self._slot_position() or upto)

    def _snapshot(self) -> None:
        """Invariant 1: a new slot and the rows as of its consistent point; pushed as batch 0."""
        if self._slot_position() is not None:
            self._drop_slot()
        self._sql(f"DELETE FROM {PROGRESS_TABLE} WHERE name = %s", (self.name,))
        import psycopg

        rep = connect(self.dsn, self.what, replication=True)
        try:
            rep.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            row = rep.execute(f"CREATE_REPLICATION_SLOT {self.slot} LOGICAL pgoutput (SNAPSHOT 'use')").fetchone()
            start = _lsn(row[1])
            where = f" WHERE ({self.where})" if self.where else ""
            cols = ", ".join(quote_ident(c) for c in self._columns)
            data = bytearray()
            with rep.cursor().copy(f"COPY (SELECT {cols} FROM {table_sql(self.table)}{where}) TO STDOUT "
                                   "WITH (FORMAT csv)") as cp:
                for chunk in cp:
                    data += chunk
            rep.execute("COMMIT")
        except psycopg.Error as e:
            raise DbspError(f"{self.what}: taking the snapshot failed: {scrub(str(e), self.dsn)}") from None
        finally:
            rep.close()
        table = parse_csv(bytes(data), self.schema, f"{self.what}: snapshot of {self.table!r}")
        self.stats["snapshot_rows"] += table.num_rows
        self._push(0, ZSet.from_arrow(table), start, start)
        self.seq = 0
        self.position = start

    def _drop_slot(self) -> None:
        self._with_slot(lambda: self._sql("SELECT pg_drop_replication_slot(%s)", (self.slot,)))

    # ---- reading ----

    def _with_slot(self, fn: Any) -> Any:
        """``fn()``, retried while a killed predecessor's backend still holds the slot."""
        import psycopg

        deadline = time.monotonic() + SLOT_BUSY_WAIT
        while True:
            try:
                return fn()
            except DbspError as e:
                busy = isinstance(e.__context__, psycopg.errors.ObjectInUse) or "is active for PID" in str(e)
                if not busy or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _peek(self, upto: int | None, nchanges: int | None) -> list:
        def peek() -> list:
            return self._sql(
                "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, %s, 'proto_version', '1', "
                "'publication_names', %s)",
                (self.slot, None if upto is None else _lsn_text(upto), nchanges, self.publication))

        msgs = [bytes(r[0]) for r in self._with_slot(peek)]
        return decode(msgs, self._relations, self.what)

    def _read(self, frm: int, upto: int) -> ZSet:
        """The change of the transactions whose commit ends in ``(frm, upto]`` (invariant 3's replay)."""
        txns = [t for t in self._peek(upto, None) if frm < t.end_lsn <= upto]
        return self._zset(txns)

    def _zset(self, txns: list) -> ZSet:
        cols: list[list] = [[] for _ in self._columns]
        weights: list[int] = []
        index: dict[int, list[int]] = {}
        for t in txns:
            for relid, values, w in t.changes:
                pos = index.get(relid)
                if pos is None:
                    rel = self._relations[relid]
                    where = {c: i for i, c in enumerate(rel.columns)}
                    pos = index[relid] = [where[c] for c in self._columns]
                for c, i in zip(cols, pos):
                    c.append(values[i])
                weights.append(w)
        table = text_columns(cols, self.schema, f"{self.what}: a change of {self.table!r}")
        return ZSet.from_arrow(table, weights=pa.array(weights, pa.int64()).to_numpy())

    def _push(self, seq: int, z: ZSet, frm: int, upto: int, intent: bool = True) -> bool:
        if intent:
            self._write_progress(seq, frm, upto, len(z))
        ack = self.pipeline.push(self.handle, z, producer=self.name, seq=seq)
        if ack.duplicate:
            self.stats["duplicates"] += 1
            return False
        self.stats["batches"] += 1
        self.stats["rows"] += len(z)
        return True

    def _advance(self, upto: int) -> None:
        """Invariant 2: confirm ``upto`` (after the batch ending there was acknowledged)."""
        at = self._slot_position()
        if at is not None and at < upto:
            self._with_slot(lambda: self._sql("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                                              (self.slot, _lsn_text(upto))))
            self.stats["advanced"] += 1

    def poll(self) -> int:
        """Read the transactions committed since the last poll (about ``max_changes`` rows) and push them as one
        batch; returns 1 if a batch was newly recorded, else 0."""
        txns = [t for t in self._peek(None, self.max_changes) if t.end_lsn > self.position]
        if not txns:
            return 0
        upto = txns[-1].end_lsn
        self.stats["transactions"] += len(txns)
        z = self._zset(txns)
        new = 0
        if len(z):
            new = int(self._push(self.seq + 1, z, self.position, upto))
            self.seq += 1
        self._advance(upto)
        self.position = upto
        return new

    def pending(self) -> bool:
        """Whether committed changes wait to be read."""
        return any(t.end_lsn > self.position for t in self._peek(None, 1))

    def lag(self) -> int:
        """Bytes of WAL between the slot's confirmed position and the server's current one."""
        rows = self._sql("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint "
                         "FROM pg_replication_slots WHERE slot_name = %s", (self.slot,))
        return int(rows[0][0]) if rows else 0

    def drop(self) -> None:
        """Remove the slot, the publication and the progress row (the source will not be used again: a new one
        of this name starts with a new snapshot)."""
        self._drop_slot()
        self._sql(f"DROP PUBLICATION IF EXISTS {quote_ident(self.publication)}")
        self._sql(f"DELETE FROM {PROGRESS_TABLE} WHERE name = %s", (self.name,))

    def close(self) -> None:
        self.conn.close()
