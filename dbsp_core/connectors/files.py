"""A source that turns new Parquet, CSV and JSON-lines files in a directory into pushes, with ``(file, row group)`` as ``(producer, seq)``, so a restart neither skips nor repeats a file.

Invariants (enforced here):
  1. Each file is producer ``<name>:<path relative to the directory>``; a Parquet file pushes one batch per row
     group with ``seq`` = the row group's index (0, 1, ...); a CSV or JSON-lines file pushes itself whole as
     ``seq`` 0. The pipeline's dedup (driver invariant 2) counts each ``(producer, seq)`` once, so a restart
     that pushes a file again (all of it, or the row groups after a crash mid-file) changes nothing it had
     recorded, and a row group is skipped without reading once the pipeline acknowledges it.
  2. Files are taken in name order, and only complete ones: a file appears by an atomic rename into the
     directory; names starting with ``.`` or ``_`` (temporary files, markers) are never read. A file must
     not change once it has appeared (its row groups are its identity).
  3. Rows are taken by the input's column names (extra columns are ignored) and cast safely to the input's
     types; an integer ``weight`` column, if present, gives the rows' weights (-1 deletes). A file that does
     not fit raises SchemaError naming it, and nothing of it that is not already recorded is pushed.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from dbsp_core.errors import SchemaError

__all__ = ["FileSource"]

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl",
           ".ndjson": "jsonl"}


class FileSource:
    """Pushes the files of ``directory`` into input ``handle`` of a durable pipeline (module docstring).

    Parameters
    ----------
    pipeline
        A durable ``dbsp_core.Pipeline`` (``storage=``): exactly once rests on its ``(producer, seq)`` dedup.
    handle
        The input the rows go to.
    directory
        The directory to watch (files directly in it; subdirectories too with ``recursive``).
    name
        The source's name, the prefix of every producer id; keep it stable across restarts.
    formats
        Extensions to read, from ``.parquet``/``.pq``, ``.csv``, ``.jsonl``/``.json``/``.ndjson``.

    Examples
    --------
    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq, dbsp_core as dbsp
    >>> from dbsp_core.connectors import FileSource
    >>> c = dbsp.Circuit(); t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    >>> c.output("s", t.group_by("k").agg(s=dbsp.sum("v")))
    >>> p = dbsp.Pipeline(c, storage=tempfile.mkdtemp()); d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"k": [1, 2, 1], "v": [1, 2, 3]}), os.path.join(d, "a.parquet"), row_group_size=2)
    >>> with open(os.path.join(d, "b.csv"), "w") as f: _ = f.write("k,v\\n2,5\\n")
    >>> src = FileSource(p, "t", d)
    >>> src.poll(), src.poll()     # two row groups of a.parquet and b.csv; then nothing new
    (3, 0)
    >>> sorted(p.step()["s"].to_dict().items())
    [((1, 4), 1), ((2, 7), 1)]
    >>> p.close()
    """

    def __init__(self, pipeline: Any, handle: str, directory: str | os.PathLike, *, name: str = "files",
                 formats: tuple[str, ...] = tuple(FORMATS), recursive: bool = False) -> None:
        if getattr(pipeline, "storage", None) is None:
            raise ValueError("FileSource needs a durable pipeline (storage=<dir>): exactly once rests on its dedup")
        schemas = {n: pipeline.circuit.nodes[i].schema for n, i in pipeline.circuit.inputs.items()}
        if handle not in schemas:
            raise KeyError(f"FileSource: unknown input handle {handle!r}; inputs are {sorted(schemas)}")
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"FileSource: unknown formats {unknown}; known: {sorted(FORMATS)}")
        self.pipeline = pipeline
        self.handle = handle
        self.schema: pa.Schema = schemas[handle]
        self.directory = os.fspath(directory)
        self.name = name
        self.formats = tuple(formats)
        self.recursive = recursive
        self._done: set[str] = set()  # files fully pushed (in this process)
        self.stats = {"files": 0, "pushes": 0, "duplicates": 0, "skipped": 0, "rows": 0}

    def pending(self) -> list[str]:
        """Relative paths of the files not yet known to be fully pushed, in name order (invariant 2)."""
        out = []
        for root, dirs, files in os.walk(self.directory):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_"))) if self.recursive else []
            for f in files:
                if f.startswith((".", "_")) or os.path.splitext(f)[1].lower() not in self.formats:
                    continue
                rel = os.path.relpath(os.path.join(root, f), self.directory)
                if rel not in self._done:
                    out.append(rel)
        return sorted(out)

    def poll(self, max_files: int | None = None) -> int:
        """Push every new file (at most ``max_files`` of them); returns the number of pushes newly recorded."""
        new = 0
        for rel in self.pending()[:max_files]:
            new += self._push_file(rel)
            self._done.add(rel)
            self.stats["files"] += 1
        return new

    def _push_file(self, rel: str) -> int:
        path = os.path.join(self.directory, rel)
        producer = f"{self.name}:{rel}"
        kind = FORMATS[os.path.splitext(rel)[1].lower()]
        p = self.pipeline
        new = 0
        if kind == "parquet":
            f = pq.ParquetFile(path)
            cols = [n for n in f.schema_arrow.names if n in self.schema.names or n == "weight"]
            for rg in range(f.num_row_groups):
                if p.acknowledged(producer, rg):
                    self.stats["skipped"] += 1
                    continue
                new += self._push(producer, rg, f.read_row_group(rg, columns=cols), path)
            return new
        if p.acknowledged(producer, 0):
            self.stats["skipped"] += 1
            return 0
        types = {n: t for n, t in zip(self.schema.names, self.schema.types)}
        if kind == "csv":
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=types))
        else:
            table = pajson.read_json(path, parse_options=pajson.ParseOptions(
                explicit_schema=pa.schema([pa.field(n, t) for n, t in types.items()])))
        return self._push(producer, 0, table, path)

    def _push(self, producer: str, seq: int, table: pa.Table, where: str) -> int:
        missing = [n for n in self.schema.names if n not in table.column_names]
        if missing:
            raise SchemaError(f"FileSource {where}: no column {missing} (the input {self.handle!r} has "
                              f"{self.schema.names})")
        names = list(self.schema.names)
        fields = list(self.schema)
        if "weight" in table.column_names and "weight" not in names:
            names.append("weight")
            fields.append(pa.field("weight", pa.int64()))
        try:
            table = table.select(names).cast(pa.schema(fields), safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise SchemaError(f"FileSource {where}: columns {table.schema} do not cast to the input's "
                              f"{self.schema}: {e}") from None
        ack = self.pipeline.push(self.handle, table, producer=producer, seq=seq)
        if ack.duplicate:
            self.stats["duplicates"] += 1
            return 0
        self.stats["pushes"] += 1
        self.stats["rows"] += table.num_rows
        return 1
