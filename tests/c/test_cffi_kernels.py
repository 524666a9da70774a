"""The C core driven directly through cffi (no Cython, no Arrow): the DBSP hash of csrc/hash.h against a
pure-Python model of its written specification, shard partitioning against a NumPy stable sort, and CRC-32C
against a bitwise model. These pin the hash that decides shard placement to its spec, byte for byte, from
outside the bindings that the rest of the suite goes through."""

from __future__ import annotations

import math
import os
import shutil
import struct
import sys
import tempfile
import zlib  # noqa: F401  (CRC-32 is not CRC-32C; the model below is)

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")

CDEF = """
typedef struct DbspColumn { int32_t type; int64_t offset; const uint8_t *validity; const void *values;
                            const uint8_t *data; } DbspColumn;
typedef struct DbspBatch { int64_t nrows; int32_t ncols; const DbspColumn *cols; const int64_t *weights; } DbspBatch;
int dbsp_hash_columns(const DbspBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out);
uint64_t dbsp_hash_mix(uint64_t z);
int dbsp_partition(const uint64_t *khash, int64_t n, const int32_t *part_of_shard, int shard_bits,
                   int32_t nparts, int64_t *perm, int64_t *offsets);
uint32_t dbsp_crc32c(uint32_t crc, const void *data, size_t len);
uint32_t dbsp_crc32c_portable(uint32_t crc, const void *data, size_t len);
"""
INT64, FLOAT64, UTF8, BINARY = 5, 11, 14, 16  # DbspType values (csrc/column.h)


@pytest.fixture(scope="module")
def lib():
    """The kernels compiled by cffi into a module of their own (with asserts and invariant checks on)."""
    cffi = pytest.importorskip("cffi")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH (the C-level tests need cc)")
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("_dbsp_cffi_kernels", '#include "hash.h"\n#include "partition.h"\n#include "crc32c.h"\n',
                   sources=[os.path.join(CSRC, f) for f in ("hash.c", "partition.c", "crc32c.c")],
                   include_dirs=[CSRC], extra_compile_args=["-std=c11", "-D_GNU_SOURCE", "-O1", "-UNDEBUG",
                                                            "-DDBSP_CHECK_INVARIANTS=1"])
    d = tempfile.mkdtemp()
    ffi.compile(tmpdir=d, verbose=False)
    sys.path.insert(0, d)
    try:
        import _dbsp_cffi_kernels as mod
    finally:
        sys.path.remove(d)
    yield mod.ffi, mod.lib
    shutil.rmtree(d, ignore_errors=True)


# ---- the specification of csrc/hash.h, version 1, in Python ----

M64 = (1 << 64) - 1
NULL, S_INT, S_FLOAT, S_BYTES = 0x9AE16A3B2F90404F, 0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0
ROW_SEED, GOLD = 0x082EFA98EC4E6C89, 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def value_hash(x) -> int:
    if x is None:
        return mix(NULL)
    if isinstance(x, int):
        return mix((x & M64) ^ S_INT)
    if isinstance(x, float):
        x = 0.0 if x == 0 else x
        bits = 0x7FF8000000000000 if math.isnan(x) else struct.unpack("<Q", struct.pack("<d", x))[0]
        return mix(bits ^ S_FLOAT)
    b = x.encode() if isinstance(x, str) else x
    h = mix(len(b) ^ S_BYTES)
    for i in range(0, len(b), 8):
        w = int.from_bytes(b[i:i + 8].ljust(8, b"\0"), "little")
        h = (mix(h ^ w) * GOLD) & M64
    return mix(h)


def row_hash(values) -> int:
    h = ROW_SEED
    for v in values:
        h = mix((h * GOLD + value_hash(v)) & M64)
    return h


# ---- building C columns from Python lists ----

def _validity(ffi, vals, keep):
    if all(v is not None for v in vals):
        return ffi.NULL
    bits = bytearray((len(vals) + 7) // 8)
    for i, v in enumerate(vals):
        if v is not None:
            bits[i // 8] |= 1 << (i % 8)
    keep.append(ffi.new("uint8_t[]", bytes(bits)))
    return keep[-1]


def _column(ffi, kind: int, vals: list, keep: list):
    col = ffi.new("DbspColumn *")
    col.type, col.offset = kind, 0
    col.validity = _validity(ffi, vals, keep)
    if kind in (INT64, FLOAT64):
        arr = ffi.new("int64_t[]" if kind == INT64 else "double[]", [0 if v is None else v for v in vals])
        keep.append(arr)
        col.values = arr
    else:
        raw = [b"" if v is None else (v.encode() if isinstance(v, str) else v) for v in vals]
        offs = [0]
        for r in raw:
            offs.append(offs[-1] + len(r))
        o, data = ffi.new("int32_t[]", offs), ffi.new("uint8_t[]", b"".join(raw) or b"\0")
        keep += [o, data]
        col.values, col.data = o, data
    keep.append(col)
    return col[0]


rows_st = st.lists(st.tuples(st.none() | st.integers(-(1 << 63), (1 << 63) - 1),
                             st.none() | st.floats(allow_nan=True, allow_infinity=True),
                             st.none() | st.text(max_size=20), st.none() | st.binary(max_size=30)),
                   min_size=1, max_size=40)


@given(rows_st)
def test_row_hash_matches_the_written_spec(lib, rows) -> None:
    ffi, c = lib
    keep: list = []
    cols = ffi.new("DbspColumn[]", [_column(ffi, k, [r[i] for r in rows], keep)
                                    for i, k in enumerate((INT64, FLOAT64, UTF8, BINARY))])
    batch = ffi.new("DbspBatch *", {"nrows": len(rows), "ncols": 4, "cols": cols, "weights": ffi.NULL})
    out = ffi.new("uint64_t[]", len(rows))
    assert c.dbsp_hash_columns(batch, ffi.NULL, 4, out) == 0
    assert list(out) == [row_hash(r) for r in rows]
    key = ffi.new("int32_t[]", [2, 0])  # a key hash: the row hash over the key columns, in key order
    assert c.dbsp_hash_columns(batch, key, 2, out) == 0
    assert list(out) == [row_hash((r[2], r[0])) for r in rows]


def test_mix_and_equal_values_across_spellings(lib) -> None:
    ffi, c = lib
    for z in (0, 1, M64, 0x0123456789ABCDEF):
        assert c.dbsp_hash_mix(z) == mix(z)
    assert value_hash(-0.0) == value_hash(0.0) and value_hash(float("nan")) == value_hash(-float("nan"))


@given(st.lists(st.integers(0, M64), max_size=300), st.integers(0, 6), st.integers(1, 5), st.randoms())
def test_partition_is_a_stable_sort_by_owner(lib, hashes, bits, nparts, rnd) -> None:
    ffi, c = lib
    owners = [rnd.randrange(nparts) for _ in range(1 << bits)]
    n = len(hashes)
    perm, offs = ffi.new("int64_t[]", max(n, 1)), ffi.new("int64_t[]", nparts + 1)
    assert c.dbsp_partition(ffi.new("uint64_t[]", hashes or [0]), n, ffi.new("int32_t[]", owners), bits, nparts,
                            perm, offs) == 0
    part = np.array([owners[h >> (64 - bits) if bits else 0] for h in hashes], dtype=np.int64)
    want = np.argsort(part, kind="stable")
    assert list(perm)[:n] == want.tolist()
    assert list(offs) == [0] + np.cumsum(np.bincount(part, minlength=nparts)).tolist()
    bad = ffi.new("int32_t[]", [nparts] * (1 << bits))  # an owner outside 0..nparts-1
    assert c.dbsp_partition(ffi.new("uint64_t[]", [0]), 1, bad, bits, nparts, perm, offs) == 3  # DBSP_EINVAL


def crc32c_model(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@given(st.binary(max_size=600), st.integers(0, 0xFFFFFFFF))
def test_crc32c_both_paths_match_the_bitwise_model(lib, data, seed) -> None:
    ffi, c = lib
    assert c.dbsp_crc32c(seed, data, len(data)) == crc32c_model(data, seed)
    assert c.dbsp_crc32c_portable(seed, data, len(data)) == crc32c_model(data, seed)
