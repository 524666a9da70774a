"""Input-log records that name a unit of an immutable file (a Parquet row group, a whole CSV or JSON-lines file) instead of holding its rows, and the one function that turns any input-log push record back into its Z-set.

Invariants (enforced here):
  1. A reference record (``FILE_REF_MAGIC``, JSON body, ``FILE_REF_VERSION``) holds the file's absolute path, its
     format, the unit (row group index, 0 for a text file), its identity when the push was made (inode, size,
     modification time in ns) and the CRC-32C of the unit's bytes: for Parquet the byte range of the row
     group's column chunks followed by the footer (which decides how they decode), for a text file the whole
     file. It is small (a few hundred bytes) whatever the unit holds.
  2. A reference is made only from a file's bytes as they were read for the push: :func:`reference` takes the
     identity before the checksum and :func:`read_checked` compares it again after reading the rows, so a file
     that changed while it was read is refused (InputFileError) instead of logged by a checksum of other bytes.
  3. Reading a reference back (:func:`decode_push`: recovery, ``Pipeline.read_input``, an output step logged by
     reference to its pushes) reads the file again, and returns its rows only if the file is there, its size is
     the recorded one and the checksum of the unit's bytes matches; otherwise RecoveryError names the file, what
     differs and what to do. Inode and modification time are not required to match (a file copied back keeps
     its bytes, not its inode). Never other rows than those pushed.
  4. The rows are converted by :func:`unit_zset`, the same function the source used for the push: the Z-set
     read back is the one that was pushed (columns by name, cast safely, an integer ``weight`` column as the
     rows' weights).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from dbsp_core._storage import crc32c
from dbsp_core.codec import decode_json, decode_zset, encode_json
from dbsp_core.errors import InputFileError, RecoveryError
from dbsp_core.rows import conform
from dbsp_core.storage.formats import FILE_REF_MAGIC, FILE_REF_VERSION
from dbsp_core.zset import ZSet

__all__ = ["decode_push", "is_reference", "read_unit", "reference", "unit_zset"]

# bytes read per pread while checksumming, into one buffer reused for the whole unit: a fresh 4 MiB bytes object
# per pread cost its page faults and a copy besides the read (4-7 ms of CPU for a 12 MB CSV file, against 1.5 ms
# this way, of which the CRC-32C itself is 1.1 ms); 256 KiB stays in the L2 cache between the read and the CRC
_CHUNK = 256 << 10


def read_unit(source: Any, kind: str, unit: int, schema: pa.Schema) -> pa.Table:
    """The raw rows of one unit of a file: row group ``unit`` of a Parquet file (only the input's columns and
    ``weight``), or a whole CSV / JSON-lines file parsed with the input's types. ``source`` is a path, a
    ``pq.ParquetFile`` or an open pyarrow input file."""
    if kind == "parquet":
        f = source if isinstance(source, pq.ParquetFile) else pq.ParquetFile(source)
        cols = [n for n in f.schema_arrow.names if n in schema.names or n == "weight"]
        return f.read_row_group(unit, columns=cols)
    # text parses to decimal128 only: a decimal64 column is read as decimal128 and cast safely by unit_zset
    types = {n: pa.decimal128(t.precision, t.scale) if pa.types.is_decimal(t) else t
             for n, t in zip(schema.names, schema.types)}
    if kind == "csv":
        return pacsv.read_csv(source, convert_options=pacsv.ConvertOptions(column_types=types))
    return pajson.read_json(source, parse_options=pajson.ParseOptions(
        explicit_schema=pa.schema([pa.field(n, t) for n, t in types.items()])))


def convert(table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """A unit's rows as the input takes them: columns by name, cast safely, extra columns dropped, an integer
    ``weight`` column kept last (invariant 4)."""
    return conform(table, schema, what, weight="weight", extra=True)


def unit_zset(table: pa.Table, schema: pa.Schema, what: str) -> ZSet:
    """The Z-set a unit's rows push (invariant 4): converted, weights from the ``weight`` column or 1."""
    t = convert(table, schema, what)
    if t.num_columns > len(schema):
        w = t.column(len(schema)).to_numpy().astype(np.int64, copy=True)
        t = t.remove_column(len(schema))
    else:
        w = np.ones(t.num_rows, dtype=np.int64)
    if not t.schema.equals(schema):
        t = t.cast(schema)
    return ZSet._make(t, w)


def _identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _spans(path: str, kind: str, unit: int, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the bytes that make a unit (invariant 1)."""
    if kind != "parquet":
        return [(0, size)]
    md = pq.ParquetFile(path).metadata
    rg = md.row_group(unit)
    lo, hi = size, 0
    for j in range(rg.num_columns):
        c = rg.column(j)
        start = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
        lo, hi = min(lo, start), max(hi, start + c.total_compressed_size)
    with open(path, "rb") as f:
        f.seek(size - 8)
        tail = f.read(8)
    footer = int.from_bytes(tail[:4], "little") + 8
    return [(lo, max(0, hi - lo)), (size - footer, footer)]


def _checksum(path: str, spans: list[tuple[int, int]]) -> int:
    crc = 0
    buf = memoryview(bytearray(_CHUNK))
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in spans:
            end = off + n
            while off < end:
                got = os.preadv(fd, [buf[:min(_CHUNK, end - off)]], off)
                if not got:
                    raise EOFError(f"{path}: ends at byte {off}, before {end}")
                crc = crc32c(buf[:got], crc)
                off += got
    finally:
        os.close(fd)
    return crc


def reference(path: str, kind: str, unit: int) -> tuple[bytes, tuple[int, int, int]]:
    """The record naming ``unit`` of ``path`` as it is now (invariant 1), and the identity it was taken at."""
    path = os.path.realpath(path)
    ino, size, mtime = _identity(path)
    crc = _checksum(path, _spans(path, kind, unit, size))
    body = {"version": FILE_REF_VERSION, "path": path, "kind": kind, "unit": unit, "ino": ino, "size": size,
            "mtime_ns": mtime, "crc32c": crc}
    return encode_json(FILE_REF_MAGIC, body), (ino, size, mtime)


def read_checked(path: str, identity: tuple[int, int, int], what: str) -> None:
    """InputFileError if ``path`` changed since ``identity`` was taken (invariant 2)."""
    try:
        now = _identity(os.path.realpath(path))
    except FileNotFoundError:
        now = None
    if now != identity:
        raise InputFileError(f"{what}: {path} changed or vanished while it was read for a push logged by "
                             f"reference (a source that declares its files immutable must not change them)", path)


def is_reference(payload: Any) -> bool:
    """Whether an input-log push record is a file reference (not the rows themselves)."""
    return bytes(payload[:4]) == FILE_REF_MAGIC


def decode_push(payload: Any, schema: pa.Schema, where: str) -> ZSet:
    """The Z-set of an input-log push record: its rows, or the rows of the file unit it names, read again and
    checked (invariant 3)."""
    if not is_reference(payload):
        return decode_zset(payload, schema, where)
    ref = decode_json(FILE_REF_MAGIC, payload, where)
    if ref.get("version") != FILE_REF_VERSION:
        raise RecoveryError(f"{where}: a file reference of version {ref.get('version')}, this build reads version "
                            f"{FILE_REF_VERSION}: open the directory with the release that wrote it")
    path, kind, unit = ref["path"], ref["kind"], int(ref["unit"])
    fix = ("put the file back as it was when it was pushed (a source with immutable_files=True promises that its "
           "files stay unchanged until a checkpoint covers their steps) and open the pipeline again")
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise RecoveryError(f"{where}: the push logged by reference to {path} (unit {unit}) cannot be read: the file "
                            f"is gone; {fix}") from None
    if size != ref["size"]:
        raise RecoveryError(f"{where}: the push logged by reference to {path} (unit {unit}) cannot be read: the file "
                            f"has {size} bytes, it had {ref['size']} when pushed; {fix}")
    try:
        crc = _checksum(path, _spans(path, kind, unit, size))
        ok = crc == ref["crc32c"]
        table = read_unit(path, kind, unit, schema) if ok else None
    except (pa.ArrowException, OSError, IndexError, EOFError) as e:
        raise RecoveryError(f"{where}: the push logged by reference to {path} (unit {unit}) cannot be read "
                            f"({type(e).__name__}: {e}); {fix}") from e
    if table is None:
        raise RecoveryError(f"{where}: the push logged by reference to {path} (unit {unit}) cannot be read: its "
                            f"bytes changed since it was pushed (CRC-32C {crc:#010x}, recorded "
                            f"{ref['crc32c']:#010x}); {fix}")
    return unit_zset(table, schema, f"{where} (file {path})")
