"""The batch file's C helpers against their Python definitions: the Bloom filter built in one C pass (csrc/bloom.h) bit
for bit the numpy one, and the page CRCs with their combined whole CRC (csrc/crc32c.h) those of one CRC per page."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dbsp_core import _storage
from dbsp_core.trace import batchfile, spillread
from dbsp_core.trace.batchfile import PAGE, _crc, bloom_build

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 300_000])
def test_bloom_in_c_is_the_numpy_filter(n: int, monkeypatch) -> None:
    rng = np.random.default_rng(SEED + n)
    hashes = np.sort(rng.integers(0, 2**64 - 1, n, dtype=np.uint64))
    if n > 10:
        hashes[5:9] = hashes[5]  # equal key hashes (a key's rows)
        hashes[:2] = 0
    c = bloom_build(hashes)
    monkeypatch.setattr(spillread, "NATIVE", False)  # the reference path
    assert np.array_equal(c, bloom_build(hashes))
    if n > 10:
        with pytest.raises(ValueError, match="ascend"):
            _storage.bloom_build(np.ascontiguousarray(hashes[::-1]), np.zeros(len(c), dtype=np.uint64), 6)


@pytest.mark.parametrize("n", [0, 1, PAGE - 1, PAGE, 3 * PAGE + 17])
def test_page_crcs_in_one_pass(n: int, monkeypatch) -> None:
    data = np.random.default_rng(SEED + n).integers(0, 256, n, dtype=np.uint8).tobytes()
    out = np.empty(-(-n // PAGE), dtype=np.uint32)
    whole = _storage.crc32c_pages(data, PAGE, out, 0)
    assert whole == _crc(data)
    assert out.tolist() == [_crc(data[i:i + PAGE]) for i in range(0, n, PAGE)]
    assert _storage.crc32c_pages(data, PAGE, out, 12345) == _crc(data, 12345)
    a, b = data[:n // 3], data[n // 3:]
    monkeypatch.setattr(spillread, "NATIVE", False)  # the reference path
    assert batchfile.crc_combine(_crc(a), _crc(b), len(b)) == _storage.crc32c_combine(_crc(a), _crc(b), len(b)) \
        == _crc(data)
