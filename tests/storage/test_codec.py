"""Tests of the framed encodings of dbsp_core.codec: the frame version written (2, CRC-32C), version 1 (zlib's CRC-32) still read, damage and unknown versions refused, and the Z-set body exactly Arrow's IPC stream."""

from __future__ import annotations

import struct
import zlib

import pyarrow as pa
import pytest

from dbsp_core._storage import crc32c_portable
from dbsp_core.codec import (FORMAT_VERSION, WEIGHT_COLUMN, decode_json, decode_zset, encode_json, encode_zset,
                             encode_zset_parts)
from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.storage.formats import ZSET_MAGIC
from dbsp_core.zset import ZSet

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("f", pa.float64())])
HEAD = struct.Struct("<4sBI")


def sample() -> ZSet:
    rows = [(i, None if i % 7 == 0 else "x" * (i % 13), i / 3) for i in range(1000)]
    return ZSet.from_rows(rows, SCHEMA, weights=[(i % 5) - 2 or 3 for i in range(1000)])


def multiset(z: ZSet) -> dict:
    return z.to_dict()  # rows -> summed weight: a multiset, not a set


def reference_body(z: ZSet) -> bytes:
    """Arrow's IPC stream of the columns and the weight, written through a growing BufferOutputStream."""
    t = z.data.append_column(pa.field(WEIGHT_COLUMN, pa.int64(), nullable=False), pa.array(z.weights, pa.int64()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


def test_a_zset_frame_is_version_2_with_the_crc32c_of_arrows_ipc_stream():
    z = sample()
    head, body = encode_zset_parts(z)
    magic, version, crc = HEAD.unpack(head)
    assert (magic, version, FORMAT_VERSION) == (ZSET_MAGIC, 2, 2)
    assert body.to_pybytes() == reference_body(z)  # the presized writer writes the same bytes
    assert crc == crc32c_portable(body)  # the table-driven CRC-32C: a reference for the instruction's
    assert encode_zset(z) == head + body.to_pybytes()
    assert multiset(decode_zset(encode_zset(z), SCHEMA, "t")) == multiset(z)


def test_version_1_frames_of_older_builds_are_still_read():
    z = sample()
    body = reference_body(z)
    v1 = HEAD.pack(ZSET_MAGIC, 1, zlib.crc32(body)) + body  # as builds before 2026-11-28 wrote input logs
    assert multiset(decode_zset(v1, SCHEMA, "old push")) == multiset(z)
    js = b'{"a":1}'
    assert decode_json(b"TEST", HEAD.pack(b"TEST", 1, zlib.crc32(js)) + js, "old record") == {"a": 1}


@pytest.mark.parametrize("version", [1, 2])
def test_a_damaged_body_is_refused_whichever_version_wrote_it(version):
    body = reference_body(sample())
    crc = zlib.crc32(body) if version == 1 else crc32c_portable(body)
    blob = bytearray(HEAD.pack(ZSET_MAGIC, version, crc) + body)
    blob[HEAD.size + len(body) // 2] ^= 0x10
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        decode_zset(bytes(blob), SCHEMA, "flipped")


def test_a_version_this_build_does_not_know_is_refused_by_name():
    blob = bytearray(encode_json(b"TEST", {"a": 1}))
    blob[4] = 3
    with pytest.raises(FormatVersionError, match=r"format version 3, this build reads \[1, 2\]"):
        decode_json(b"TEST", bytes(blob), "future record")
