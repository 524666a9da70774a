"""Versioned, checksummed byte encodings of Z-sets and small JSON records, shared by the input log, output log and checkpoints.

Invariants (enforced here):
  1. Every encoded blob starts with a 4-byte magic naming its kind, a 1-byte format version and a checksum of
     the body: version 2 (written since 2026-11-28) carries its CRC-32C (the SSE4.2 instruction, dbsp_core._storage),
     version 1 zlib's CRC-32, and both are read. Decoding checks all three and raises CorruptionError /
     FormatVersionError, never returns wrong data.
  2. A Z-set is encoded as one Arrow IPC stream of its data columns plus the int64 column ``__dbsp_weight``;
     decoding returns the same rows and weights (not necessarily consolidated).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core._storage import crc32c
from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.storage.formats import BATCH_GROUP_MAGIC, BATCH_MAGIC, ZSET_MAGIC
from dbsp_core.zset import ZSet

FORMAT_VERSION = 2  # what this build writes
# the checksum of each version this build reads: zlib's CRC-32 runs near 1.3 GB/s, CRC-32C near 8 GB/s, and every
# durable push and step output is checksummed on the step path (bench/RESULTS.md, "Durable Nexmark")
_CHECKSUMS = {1: zlib.crc32, 2: crc32c}
WEIGHT_COLUMN = "__dbsp_weight"
_HEAD = struct.Struct("<4sBI")  # magic, format version, checksum of the body


def frame_head(magic: bytes, *parts: Any) -> bytes:
    """The header :func:`frame` puts before the concatenation of ``parts`` (bytes or Arrow buffers), computed
    without joining them, for writers that write or gather the parts themselves.

    >>> frame_head(b"TEST", b"a", b"bc") + b"abc" == frame(b"TEST", b"abc")
    True
    """
    assert len(magic) == 4
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    return _HEAD.pack(magic, FORMAT_VERSION, crc)


def frame(magic: bytes, body: bytes) -> bytes:
    """``body`` behind a header of ``magic`` (4 bytes), the format version and the body's CRC-32.

    >>> unframe(b"TEST", frame(b"TEST", b"abc"), "x")
    b'abc'
    """
    return frame_head(magic, body) + body


def _head(magic: bytes, head: Any, where: str) -> tuple[Any, int]:
    """(the checksum function, the checksum) a frame's header says; CorruptionError or FormatVersionError naming
    ``where`` if it is bad."""
    n = memoryview(head).nbytes
    if n < _HEAD.size:
        raise CorruptionError(f"{where}: {n}-byte record is shorter than its header")
    m, version, crc = _HEAD.unpack_from(head)
    if m != magic:
        raise CorruptionError(f"{where}: bad magic {m!r}, expected {magic!r}")
    checksum = _CHECKSUMS.get(version)
    if checksum is None:
        raise FormatVersionError(f"{where}: format version {version}, this build reads {sorted(_CHECKSUMS)} (written "
                                 f"by another build, or that byte is damaged: `dbsp repair DIR` repairs what it can)")
    return checksum, crc


def unframe_view(magic: bytes, blob: Any, where: str) -> memoryview:
    """The body of a :func:`frame` blob (bytes or an Arrow buffer) as a view into it, not a copy; CorruptionError
    or FormatVersionError naming ``where`` if it is bad."""
    view = memoryview(blob)
    checksum, crc = _head(magic, view, where)
    body = view[_HEAD.size:]
    if checksum(body) != crc:
        raise CorruptionError(f"{where}: checksum mismatch")
    return body


def check_framed_file(magic: bytes, f: Any, where: str, chunk: int = 256 << 10) -> int:
    """Check a :func:`frame` blob held in the open binary file ``f`` (from its current position to its end) in
    ``chunk``-sized reads, never whole in memory; returns the body's length and leaves ``f`` at the body's start.
    CorruptionError or FormatVersionError naming ``where`` if it is bad (as :func:`unframe_view`)."""
    start = f.tell()
    checksum, crc = _head(magic, f.read(_HEAD.size), where)
    got, n = 0, 0
    while True:
        b = f.read(chunk)
        if not b:
            break
        got = checksum(b, got)
        n += len(b)
    if got != crc:
        raise CorruptionError(f"{where}: checksum mismatch")
    f.seek(start + _HEAD.size)
    return n


def unframe(magic: bytes, blob: bytes, where: str) -> bytes:
    """The body of a :func:`frame` blob; CorruptionError or FormatVersionError naming ``where`` if it is bad."""
    return bytes(unframe_view(magic, blob, where))


def encode_zset(z: ZSet, magic: bytes = ZSET_MAGIC) -> bytes:
    """Bytes of ``z`` (Arrow IPC + weights) behind a checksummed header.

    >>> import pyarrow as pa
    >>> z = ZSet.from_rows([(1,), (2,)], pa.schema([("x", pa.int64())]), weights=[3, -1])
    >>> decode_zset(encode_zset(z), z.schema, "t").to_dict() == z.to_dict()
    True
    """
    return b"".join(encode_zset_parts(z, magic))


REUSE_MAX = 64 << 20  # encode_zset_parts writes a body larger than this into a fresh buffer, not ``into``


def encode_zset_parts(z: ZSet, magic: bytes = ZSET_MAGIC,
                      into: pa.ResizableBuffer | None = None) -> tuple[bytes, pa.Buffer]:
    """:func:`encode_zset` as (header, body) without joining them (the body is Arrow's buffer, not copied), for
    writers that gather. ``into``: a resizable buffer (``pa.allocate_buffer(0, resizable=True)``) the body is
    written into and returned as (resized to the body, its capacity kept), so a writer that copies each body away
    before the next (a log's enqueue) reuses one buffer instead of faulting in a fresh one of the body's size
    every time; a body over REUSE_MAX goes to a fresh buffer (``into`` never holds more than that).

    >>> import pyarrow as pa
    >>> z = ZSet.from_rows([(1,)], pa.schema([("x", pa.int64())]))
    >>> b"".join(encode_zset_parts(z)) == encode_zset(z)
    True
    """
    table = z.data.append_column(pa.field(WEIGHT_COLUMN, pa.int64(), nullable=False),
                                 pa.array(np.asarray(z.weights, dtype=np.int64), pa.int64()))
    # sized first (no copy), then written once into a buffer of that size: a growing BufferOutputStream copies
    # the stream again at every doubling, 2-3x the cost of one copy for a large push or step output
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, table.schema) as w:
        w.write_table(table)
    if into is None or mock.size() > REUSE_MAX:
        body = pa.allocate_buffer(mock.size())
    else:
        into.resize(mock.size(), shrink_to_fit=False)  # keeps its capacity: no new memory once it is big enough
        body = into
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(body), table.schema) as w:
        w.write_table(table)
    return frame_head(magic, body), body


def decode_zset(blob: bytes, schema: pa.Schema, where: str, magic: bytes = ZSET_MAGIC) -> ZSet:
    """The Z-set of an :func:`encode_zset` blob, cast to ``schema``; CorruptionError if bytes or columns are bad."""
    body = unframe(magic, blob, where)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptionError(f"{where}: unreadable Arrow IPC body ({e})") from e
    last = table.num_columns - 1  # the weight is the last column, whatever the data columns are called
    if last < 0 or table.schema.names[last] != WEIGHT_COLUMN or table.schema.field(last).type != pa.int64():
        raise CorruptionError(f"{where}: no weight column")
    w = table.column(last).to_numpy().astype(np.int64, copy=True)
    data = table.remove_column(last)
    if data.schema.names != schema.names or not all(a.type.equals(b.type) for a, b in zip(data.schema, schema)):
        raise CorruptionError(f"{where}: stored columns {data.schema.names} do not match {schema.names}")
    data = data.cast(schema) if not data.schema.equals(schema) else data
    if data.num_rows == 0:
        return ZSet.empty(schema)
    return ZSet._make(data.combine_chunks(), w)


def encode_json(magic: bytes, obj: Any) -> bytes:
    """A JSON object behind a checksummed header.

    >>> decode_json(b"TEST", encode_json(b"TEST", {"a": 1}), "x")
    {'a': 1}
    """
    return frame(magic, json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def decode_json(magic: bytes, blob: bytes, where: str) -> Any:
    body = unframe(magic, blob, where)
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptionError(f"{where}: bad JSON body ({e})") from e


def zset_batch(z: ZSet) -> pa.RecordBatch:
    """One record batch of ``z``'s data columns plus ``__dbsp_weight``, for slicing and :func:`encode_batch`."""
    table = z.data.append_column(pa.field(WEIGHT_COLUMN, pa.int64(), nullable=False),
                                 pa.array(np.asarray(z.weights, dtype=np.int64), pa.int64()))
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def encode_batch(rb: pa.RecordBatch, magic: bytes = BATCH_MAGIC) -> bytes:
    """A record batch as one schema-less Arrow IPC message behind a checksummed header (cheap for many slices).

    >>> import pyarrow as pa
    >>> z = ZSet.from_rows([(1,), (2,)], pa.schema([("x", pa.int64())]), weights=[3, -1])
    >>> rb = zset_batch(z)
    >>> decode_batch(encode_batch(rb.slice(1, 1)), z.schema, "t").to_dict()
    {(2,): -1}
    """
    body = rb.serialize()  # joined with its header in one copy
    return b"".join((frame_head(magic, body), body))


_COUNT = struct.Struct("<I")


def encode_runs(rb: pa.RecordBatch, counts: list[int], magic: bytes = BATCH_GROUP_MAGIC) -> bytes:
    """Consecutive runs of rows (``counts[i]`` rows each, summing to ``rb.num_rows``) as one :func:`encode_batch`
    message behind the run count and lengths, so several small pieces cost one Arrow message.

    >>> import pyarrow as pa
    >>> z = ZSet.from_rows([(1,), (2,), (3,)], pa.schema([("x", pa.int64())]))
    >>> [p.to_dict() for p in decode_runs(encode_runs(zset_batch(z), [2, 0, 1]), z.schema, "t")]
    [{(1,): 1, (2,): 1}, {}, {(3,): 1}]
    """
    if sum(counts) != rb.num_rows:
        raise ValueError(f"encode_runs: runs of {sum(counts)} rows for a {rb.num_rows}-row record batch")
    head = _COUNT.pack(len(counts)) + struct.pack(f"<{len(counts)}I", *counts)
    body = rb.serialize()
    return b"".join((frame_head(magic, head, body), head, body))


def decode_runs(blob: bytes, schema: pa.Schema, where: str, magic: bytes = BATCH_GROUP_MAGIC) -> list[ZSet]:
    """The runs of an :func:`encode_runs` blob as Z-sets (empty runs included); CorruptionError if bad."""
    return _decode_runs_body(unframe(magic, blob, where), schema, where)


def encode_width_runs(rb: pa.RecordBatch, width: int, counts: list[int], magic: bytes) -> bytes:
    """:func:`encode_runs` behind a u32 ``width`` (the runs form ``width`` equal parts: a range of shards, each with
    the same number of batches), for :func:`decode_width_runs`.

    >>> import pyarrow as pa
    >>> z = ZSet.from_rows([(1,), (2,), (3,)], pa.schema([("x", pa.int64())]))
    >>> w, runs = decode_width_runs(encode_width_runs(zset_batch(z), 2, [2, 1], b"TEST"), z.schema, "t", b"TEST")
    >>> w, [r.to_dict() for r in runs]
    (2, [{(1,): 1, (2,): 1}, {(3,): 1}])
    """
    if width < 1 or len(counts) % width:
        raise ValueError(f"encode_width_runs: {len(counts)} runs do not make {width} equal parts")
    if sum(counts) != rb.num_rows:
        raise ValueError(f"encode_width_runs: runs of {sum(counts)} rows for a {rb.num_rows}-row record batch")
    head = struct.pack(f"<II{len(counts)}I", width, len(counts), *counts)
    body = rb.serialize()
    return b"".join((frame_head(magic, head, body), head, body))


def decode_width_runs(blob: bytes, schema: pa.Schema, where: str, magic: bytes) -> tuple[int, list[ZSet]]:
    """``(width, runs)`` of an :func:`encode_width_runs` blob; CorruptionError if bad (a run count that is not a
    multiple of the width included)."""
    body = unframe(magic, blob, where)
    if len(body) < 2 * _COUNT.size:
        raise CorruptionError(f"{where}: width header is cut short")
    (width,) = _COUNT.unpack_from(body)
    runs = _decode_runs_body(body[_COUNT.size:], schema, where)
    if width < 1 or len(runs) % width:
        raise CorruptionError(f"{where}: {len(runs)} runs do not make {width} equal parts")
    return width, runs


def width_runs_head(blob: bytes, where: str) -> tuple[int, list[int]]:
    """``(width, run lengths)`` of an :func:`encode_width_runs` blob read from its header alone, the body not
    checked (for routing and accounting; :func:`decode_width_runs` checks); CorruptionError if it is cut short.

    >>> import pyarrow as pa
    >>> z = ZSet.from_rows([(1,), (2,), (3,)], pa.schema([("x", pa.int64())]))
    >>> width_runs_head(encode_width_runs(zset_batch(z), 2, [2, 1], b"TEST"), "t")
    (2, [2, 1])
    """
    off = _HEAD.size
    if len(blob) < off + 2 * _COUNT.size:
        raise CorruptionError(f"{where}: width header is cut short")
    width, k = struct.unpack_from("<II", blob, off)
    if len(blob) < off + (2 + k) * _COUNT.size:
        raise CorruptionError(f"{where}: {k} run lengths do not fit in {len(blob)} bytes")
    return width, list(struct.unpack_from(f"<{k}I", blob, off + 2 * _COUNT.size))


def _decode_runs_body(body: bytes, schema: pa.Schema, where: str) -> list[ZSet]:
    if len(body) < _COUNT.size:
        raise CorruptionError(f"{where}: run header is cut short")
    (k,) = _COUNT.unpack_from(body)
    if len(body) < _COUNT.size * (k + 1):
        raise CorruptionError(f"{where}: {k} run lengths do not fit in {len(body)} bytes")
    counts = struct.unpack_from(f"<{k}I", body, _COUNT.size)
    z = _decode_message(body[_COUNT.size * (k + 1):], schema, where)
    if sum(counts) != z.num_rows:
        raise CorruptionError(f"{where}: runs of {sum(counts)} rows in a {z.num_rows}-row batch")
    out, lo = [], 0
    for n in counts:
        out.append(ZSet._make(z.data.slice(lo, n), z.weights[lo:lo + n]) if n else ZSet.empty(schema))
        lo += n
    return out


def decode_batch(blob: bytes, schema: pa.Schema, where: str, magic: bytes = BATCH_MAGIC) -> ZSet:
    """The Z-set of an :func:`encode_batch` blob whose data columns are ``schema``; CorruptionError if bad."""
    return _decode_message(unframe(magic, blob, where), schema, where)


def _decode_message(body: bytes, schema: pa.Schema, where: str) -> ZSet:
    full = pa.schema(list(schema) + [pa.field(WEIGHT_COLUMN, pa.int64(), nullable=False)])
    try:
        rb = pa.ipc.read_record_batch(pa.py_buffer(body), full)
        rb.validate(full=True)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptionError(f"{where}: unreadable Arrow IPC record batch ({e})") from e
    w = rb.column(rb.num_columns - 1).to_numpy(zero_copy_only=False).astype(np.int64, copy=True)
    data = pa.Table.from_batches([rb.select(list(range(rb.num_columns - 1)))])
    if data.num_rows == 0:
        return ZSet.empty(schema)
    return ZSet._make(data.combine_chunks(), w)
