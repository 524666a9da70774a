"""A sink that writes each step's change of a view as one Parquet file named by its step, with an atomic rename, so a replay after a crash rewrites the same file and a reader never sees a partial one.

Invariants (enforced here):
  1. Step ``s`` is the file ``step-<s, 20 digits>.parquet`` in the sink's directory: the change's columns and
     an int64 ``weight`` column (the form ``ZSet.to_arrow`` returns). It is written by the storage layer's
     atomic replace (csrc/smallfile.c: a temporary file, fsync, rename over the name, fsync of the directory),
     so the name holds the whole file or nothing. A step is written at most once per name, whatever the crashes: a replay writes the same
     bytes' worth of rows again under the same name.
  2. The sink acknowledges ``next`` to the output log's consumer registry only after the files of every step
     below it are durable (connectors.output invariant 2), so the log keeps every step the sink may still
     have to write; on restart it starts from its acknowledged step, rewriting at most the files written
     after its last acknowledgement.
  3. With ``skip_empty`` a step whose change is empty writes no file; the ``_next`` file (a plain decimal
     step, replaced atomically like a data file, written before each acknowledgement) tells readers how far the
     directory is complete, so "no file" and "not written yet" stay apart.
  4. The directory may be on an object store (a URI, or a path with ``filesystem=``: dbsp_core.storage.location):
     each file is then one PUT, which S3 and GCS make visible whole or not at all, in place of the rename.

The view is the sum of the files' rows by weight: :func:`read_parquet_view`, or in DuckDB
``SELECT cols, sum(weight) FROM read_parquet('dir/step-*.parquet') GROUP BY ALL HAVING sum(weight) <> 0``.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dbsp_core._storage import file_replace
from dbsp_core.connectors.output import OutputReader
from dbsp_core.storage.location import Location, resolve
from dbsp_core.zset import ZSet

__all__ = ["ParquetSink", "read_parquet_view", "step_file"]


def step_file(directory: str, step: int) -> str:
    """The file of ``step`` (invariant 1)."""
    return os.path.join(directory, f"step-{step:020d}.parquet")


def _parquet_bytes(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue()


class ParquetSink:
    """Keeps view ``view`` of a durable pipeline as a directory of per-step change files (module docstring).

    Parameters
    ----------
    source
        A durable Pipeline in this process, or its storage directory (the pipeline may run elsewhere).
    view
        The output name.
    directory
        Where the files go (created if missing): a local path, a URI (``s3://bucket/prefix?...``) or a path in
        ``filesystem`` (invariant 4).
    consumer
        The sink's consumer name (default ``parquet-<view>``); keep it stable across restarts.
    skip_empty
        Write no file for a step with an empty change (invariant 3).
    filesystem
        A ``pyarrow.fs.FileSystem`` that ``directory`` is a path in.

    Examples
    --------
    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> from dbsp_core.connectors import ParquetSink, read_parquet_view
    >>> c = dbsp.Circuit(); t = c.input("t", pa.schema([("k", pa.int64())]))
    >>> c.output("n", t.group_by("k").agg(n=dbsp.count()))
    >>> p = dbsp.Pipeline(c, storage=tempfile.mkdtemp())
    >>> out = tempfile.mkdtemp(); sink = ParquetSink(p, "n", out)
    >>> _ = p.push("t", pa.table({"k": [1, 1, 2]})); _ = p.step(); _ = p.push("t", pa.table({"k": [2]})); _ = p.step()
    >>> sink.poll()
    2
    >>> sorted(read_parquet_view(out).to_dict().items())
    [((1, 2), 1), ((2, 2), 1)]
    >>> p.close()
    """

    def __init__(self, source: Any, view: str, directory: str | os.PathLike, *, consumer: str | None = None,
                 skip_empty: bool = False, filesystem: pafs.FileSystem | None = None) -> None:
        self.where = resolve(directory, filesystem, "ParquetSink directory")
        self.directory = os.fspath(directory) if self.where.local else self.where.path
        self.reader = OutputReader(source, view, consumer or f"parquet-{view}")
        self.skip_empty = skip_empty
        if self.where.local:
            os.makedirs(self.directory, exist_ok=True)
        else:
            self.where.makedirs()
        self.next = self.reader.register(0)
        self.stats = {"steps": 0, "files": 0, "rows": 0}

    def poll(self, limit: int | None = None) -> int:
        """Write the files of the logged steps not written yet (at most ``limit``); returns how many steps."""
        start, applied = self.next, 0
        for step, z in self.reader.changes(start, limit):
            applied += 1
            if z.num_rows or not self.skip_empty:
                table = z.to_arrow()
                self._write(step_file(self.directory, step), _parquet_bytes(table))  # invariants 1, 4
                self.stats["files"] += 1
                self.stats["rows"] += table.num_rows
            self.next = step + 1
            self.stats["steps"] += 1
        if self.next > start:
            self._write(os.path.join(self.directory, "_next"), f"{self.next}\n".encode("ascii"))
            self.reader.ack(self.next)  # invariant 2: every file below is durable
        return applied

    def _write(self, path: str, data: bytes | pa.Buffer) -> None:
        if self.where.local:
            file_replace(path, data)
        else:
            self.where.write_bytes(data, path)

    def close(self) -> None:
        self.reader.close()


def read_parquet_view(directory: str | os.PathLike, schema: pa.Schema | None = None,
                      filesystem: pafs.FileSystem | None = None) -> ZSet:
    """The view a :class:`ParquetSink` directory holds: the sum of every step file's rows by weight. ``directory``
    and ``filesystem`` as for the sink."""
    where: Location = resolve(directory, filesystem, "read_parquet_view directory")
    files = sorted(i.path for i in where.files(recursive=False)
                   if os.path.basename(i.path).startswith("step-") and i.path.endswith(".parquet"))
    if not files:
        if schema is None:
            raise FileNotFoundError(f"{directory}: no step files and no schema to make an empty view of")
        return ZSet.empty(schema)
    parts = []
    for f in files:
        t = pq.read_table(f, filesystem=where.fs)
        w = t.column("weight").to_numpy()
        parts.append(ZSet.from_arrow(t.drop_columns(["weight"]), weights=w))
    return ZSet.concat(parts).consolidate()
