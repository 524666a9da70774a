"""Connectors that move data in and out of a pipeline exactly once: a directory of files or a Postgres table as a source, and sinks that keep a view as a Parquet directory, a SQLite or Postgres table, or a Delta table.

- ``files.FileSource``: new Parquet / CSV / JSON-lines files in a directory become pushes with
  ``(file, row group)`` as ``(producer, seq)``, so a restart neither skips nor repeats one.
- ``parquet_sink.ParquetSink``: each step's change of a view as ``step-<step>.parquet``, written with an atomic
  rename; a replay rewrites the same file.
- ``sqlite_sink.SqliteSink``: a view kept as a SQLite table (through sqlite-utils); each step's change and the
  step number commit in one transaction.
- ``postgres_source.PostgresSource``: a Postgres table as a snapshot, then its changes through logical
  replication (pgoutput), batch k pushed as ``(name, k)`` after a write-ahead intent in the source database;
  the slot advances only past acknowledged batches.
- ``postgres_sink.PostgresSink``: a view kept as a Postgres table, each step's change and number in one
  transaction (psycopg 3; ``postgres`` holds what both share).
- ``delta_sink.DeltaSink``: a view written to a Delta Lake table, one commit per step carrying the ``txn``
  action ``(app id, step)``, appending each change with its weight or merging by key.
- ``output.OutputReader``: what both sinks stand on: a view's changes by step from a running pipeline or from a
  storage directory in another process, as a registered consumer of the output log
  (dbsp_core.storage.consumers).

Kafka has no connector here: read it with Spark's Kafka source into ``spark_glue.foreach_batch`` (README).
"""

from __future__ import annotations

from dbsp_core.connectors.delta_sink import DeltaSink, delta_steps
from dbsp_core.connectors.files import FileSource
from dbsp_core.connectors.output import OutputReader
from dbsp_core.connectors.parquet_sink import ParquetSink, read_parquet_view
from dbsp_core.connectors.postgres_sink import PostgresSink, read_postgres_view
from dbsp_core.connectors.postgres_source import PostgresSource, postgres_schema
from dbsp_core.connectors.sqlite_sink import SqliteSink, read_sqlite_view

__all__ = ["DeltaSink", "FileSource", "OutputReader", "ParquetSink", "PostgresSink", "PostgresSource", "SqliteSink",
           "delta_steps", "postgres_schema", "read_parquet_view", "read_postgres_view", "read_sqlite_view"]
