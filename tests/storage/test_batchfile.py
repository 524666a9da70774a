"""The batch file format: a round trip of batches of every column kind, the Bloom filter and fence kept beside the rows, and a damaged byte in any section refused by its checksum."""

from __future__ import annotations

import os
import random
import struct
import tempfile

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet, _zset
from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.trace.batchfile import FOOTER, HEADER, bloom_may_contain, open_batch, verify, write_batch

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _batch(rng: np.random.Generator, n: int, key=("k",)):
    k = rng.integers(0, max(1, n // 3), n)
    t = pa.table({"k": k, "s": pa.array([None if x % 5 == 0 else "x" * int(x % 9) for x in k], pa.utf8()),
                  "f": pa.array(rng.random(n)), "b": pa.array(rng.random(n) < 0.5),
                  "d": pa.array(k.astype("datetime64[us]"))})
    return ZSet.from_arrow(t, weights=rng.choice([1, 3, -2], n)).consolidate().index_by(list(key))


@pytest.mark.parametrize("n, key", [(1, ("k",)), (700, ("k",)), (9000, ("k", "s")), (5000, ("k", "s", "f", "b", "d"))])
def test_round_trip(n: int, key) -> None:
    rng = np.random.default_rng(SEED + n)
    b = _batch(rng, n, key)
    b._row_hashes()
    path = os.path.join(tempfile.mkdtemp(), "x.batch")
    size = write_batch(path, b)
    assert size == os.path.getsize(path) and size % 8 == 0
    f = open_batch(path, verify=True)
    got = f.batch
    assert got.key == b.key and got.schema.equals(b.schema) and f.rows == len(b)
    assert got.zset.to_dict() == b.zset.to_dict()
    assert np.array_equal(got.key_hash, b.key_hash) and np.array_equal(got._row_hashes(), b._row_hashes())
    assert np.array_equal(f.fence, _zset.fence(b.key_hash))  # csrc/lookup.h's fence, read without a scan
    assert bloom_may_contain(f.bloom, b.key_hash).all()  # no false negative (invariant 3)
    absent = np.arange(1, 2001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    absent = absent[~np.isin(absent, b.key_hash)]
    assert bloom_may_contain(f.bloom, absent).mean() < 0.05  # ~1% false positives at 10 bits per key
    # the Arrow section is a standard Arrow IPC file
    with open(path, "rb") as fh:
        raw = fh.read()
    _, _, _, aoff, alen, *_ = HEADER.unpack_from(raw, 0)
    rb = pa.ipc.open_file(pa.py_buffer(raw[aoff:aoff + alen])).get_batch(0)
    assert rb.num_rows == len(b) and rb.schema.names[:len(b.schema)] == b.schema.names


def _damage(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_every_section_is_checked() -> None:
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 20000)
    d = tempfile.mkdtemp()
    src = os.path.join(d, "good.batch")
    size = write_batch(src, b)
    with open(src, "rb") as fh:
        raw = fh.read()
    _, _, _, aoff, alen, *_ = HEADER.unpack_from(raw, 0)
    _, _, _, fence_off, nfence, bloom_off, nbloom, crc_off, _, _ = FOOTER.unpack_from(raw, size - FOOTER.size)
    places = {"header": 20, "arrow first page": aoff + 100, "arrow middle page": aoff + alen // 2,
              "arrow last page": aoff + alen - 3, "fence": fence_off + 8, "bloom": bloom_off + 8 * (nbloom // 2),
              "page crcs": crc_off + 1, "footer": size - 30}
    tried = 0
    for what, off in places.items():
        path = os.path.join(d, f"{what}.batch")
        with open(path, "wb") as fh:
            fh.write(raw)
        _damage(path, off)
        with pytest.raises(CorruptionError, match="batch file damaged"):
            verify(path)
        tried += 1
    assert tried == len(places)
    with open(src, "r+b") as fh:  # a newer format is refused by its version, not read
        head = bytearray(raw[:64])
        struct.pack_into("<I", head, 8, 2)
        fh.write(bytes(head))
    with pytest.raises((FormatVersionError, CorruptionError)):
        verify(src)


def test_a_short_file_is_refused() -> None:
    path = os.path.join(tempfile.mkdtemp(), "short.batch")
    with open(path, "wb") as fh:
        fh.write(b"DBSPBTCH" + b"\0" * 40)
    with pytest.raises(CorruptionError):
        open_batch(path)


def test_a_durable_batch_file_over_64_mib_is_written() -> None:
    """A durable store's batch files go through the VFS's atomic replace, which refused more than 64 MiB (the bound
    of a small file's read): a 10M-row join's first big merge output failed to spill."""
    from dbsp_core import ZSet

    n = 600_000  # k int64 + 100-byte strings + offsets + weight + key hash + row hash: about 80 MiB
    pad = pa.array(np.full(n, "x" * 100, dtype=object), pa.string())
    z = ZSet.from_arrow(pa.table({"k": np.arange(n, dtype=np.int64), "pad": pad}))
    b = z.index_by(["k"])
    b._row_hashes()
    path = os.path.join(tempfile.mkdtemp(), "big.batch")
    size = write_batch(path, b, sync=True)
    assert size > 64 << 20 and os.path.getsize(path) == size
    assert verify(path) == n
    os.unlink(path)
