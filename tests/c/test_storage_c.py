"""C-level checks of the storage core (run again in CI against a DBSP_DEBUG=1 build, where every commit and
open also runs the page store's invariant checker): CRC32C vectors, B+tree splits and collapses, the fault VFS."""

from __future__ import annotations

import os
import random

import pytest

from dbsp_core._storage import PageStore, crc32c, crc32c_portable, fault_arm, fault_crashed, fault_ops
from dbsp_core.errors import StorageError


def test_crc32c_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    data = os.urandom(4099)
    for cut in (0, 1, 7, 8, 9, 4098):  # slicing-by-8 alignment paths agree with the byte path
        assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


def test_crc32c_hardware_and_portable_paths_agree():
    rng = random.Random(7)
    buf = rng.randbytes(70_000)
    assert crc32c_portable(b"123456789") == 0xE3069283
    for _ in range(400):  # every alignment and tail length, chained and not
        lo = rng.randrange(0, 64)
        n = rng.choice([0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 4096, rng.randrange(70_000 - 64)])
        seed = rng.choice([0, rng.getrandbits(32)])
        view = memoryview(buf)[lo:lo + n]
        assert crc32c(view, seed) == crc32c_portable(view, seed), (lo, n, seed)


def test_crc32c_three_chains_agree_at_their_block_edges():
    """csrc/crc32c.c design note 1: inputs of three 8 KiB or 256-byte blocks are checksummed as three interleaved
    chains and combined; every length around those edges, at every alignment, chained from a seed or not, gives the
    one-chain checksum (slicing-by-8)."""
    rng = random.Random(11)
    buf = rng.randbytes(4 * 24_576 + 2_000)
    lengths = {0, 8, 767, 768, 769, 1535, 1536, 24_575, 24_576, 24_577, 24_576 + 768, 24_576 + 767,
               2 * 24_576 + 5 * 768 + 13, 4 * 24_576}
    for n in sorted(lengths):
        for lo in (0, 1, 3, 7, 8):
            seed = rng.getrandbits(32)
            view = memoryview(buf)[lo:lo + n]
            assert crc32c(view) == crc32c_portable(view), (lo, n)
            assert crc32c(view, seed) == crc32c_portable(view, seed), (lo, n, seed)
            cut = n // 3
            assert crc32c(view[cut:], crc32c(view[:cut], seed)) == crc32c_portable(view, seed), (lo, n, cut)


def scan(txn, table):
    cur = txn.cursor(table)
    out = []
    while True:
        b = cur.next_batch(1000)
        if not b:
            return out
        out.extend(b)


def test_btree_grow_and_shrink_with_invariants(tmp_path):
    ps = PageStore(str(tmp_path / "db"), "posix", 32)  # tiny cache: exercises eviction
    rng = random.Random(5)
    model = {}
    v = 0
    keys = [rng.randbytes(rng.choice([1, 8, 40, 300, 1024])) for _ in range(3000)]
    for rnd in range(8):
        t = ps.begin(v)
        for k in keys[rnd * 375:(rnd + 1) * 375]:
            val = rng.randbytes(rng.choice([0, 5, 900, 1100, 6000]))
            t.put(b"t", k, val)
            model[k] = val
        if rnd >= 4:
            for k in rng.sample(sorted(model), len(model) // 2):
                assert t.delete(b"t", k)
                del model[k]
        assert scan(t, b"t") == sorted(model.items())
        t.commit()
        v += 1
        ps.check()
    t = ps.begin(v)
    for k in list(model):
        assert t.delete(b"t", k)
    assert scan(t, b"t") == []
    t.commit()
    ps.check()
    pages, free = ps.stats()[:2]
    assert free > pages // 2  # emptied tree: its pages went back to the free list
    ps.close()


def test_freeing_values_read_from_the_file_keeps_checks_and_free_pages(tmp_path):
    """pagestore.c overflow_free: a deleted value whose overflow pages are not in the cache (a reopened file) is
    freed from pages read and verified one at a time, not cached: its pages go back to the free list (a value put
    again reuses them), the file still checks, and a damaged page of a value being deleted is still refused."""
    rng = random.Random(3)
    path = str(tmp_path / "db")
    vals = {b"big": rng.randbytes(70_000), b"mid": rng.randbytes(9_000), b"small": rng.randbytes(50),
            b"keep": rng.randbytes(20_000)}
    ps = PageStore(path, "posix", 16)
    t = ps.begin(0)
    for k, v in vals.items():
        t.put(b"t", k, v)
    t.commit()
    ps.close()
    ps = PageStore(path, "posix", 16)  # cold: no page of the values is cached
    t = ps.begin(1)
    for k in (b"big", b"mid", b"small"):
        assert t.delete(b"t", k)
    assert scan(t, b"t") == [(b"keep", vals[b"keep"])]
    t.commit()
    ps.check()
    pages = ps.stats()[0]
    ps.close()
    ps = PageStore(path, "posix", 16)
    t = ps.begin(2)  # the freed pages are free once version 2 is the only one before it
    t.commit()
    t = ps.begin(3)
    for k in (b"big", b"mid"):
        t.put(b"t", k, vals[k])
    assert scan(t, b"t") == sorted((k, vals[k]) for k in (b"big", b"mid", b"keep"))
    t.commit()
    ps.check()
    assert ps.stats()[0] <= pages + 2  # built from the freed pages, not new ones at the end of the file
    ps.close()

    # a damaged overflow page of the value being deleted: found by its checksum, the delete refused
    with open(path, "r+b") as f:
        data = f.read()
        mid = vals[b"mid"]
        at = next(o for o in range(2 * 4096, len(data), 4096) if data[o + 4] == 3 and data[o + 40:o + 72] == mid[:32])
        f.seek(at + 1000)
        f.write(bytes([data[at + 1000] ^ 0xFF]))
    with pytest.raises(Exception, match="checksum mismatch"):
        ps = PageStore(path, "posix", 16)  # a debug build (DBSP_CHECK_INVARIANTS) checks every page here already
        try:
            first, count = ps.versions()
            t = ps.begin(first + count - 1)
            t.delete(b"t", b"mid")
        finally:
            ps.close()


def test_fault_vfs_crash_surfaces(tmp_path):
    fault_arm()
    ps = PageStore(str(tmp_path / "db"), "fault", 16)
    n0 = fault_ops()
    assert n0 > 0  # create: open, truncate, pwrite, fsync, rename, fsync dir, open, size, preads
    t = ps.begin(0)
    t.put(b"t", b"k", b"v")
    t.commit()
    assert fault_ops() > n0
    fault_arm(crash_at=1, mode="drop")  # begin(1) first discards version 0: that write crashes
    with pytest.raises(StorageError, match="simulated crash"):
        ps.begin(1)
    assert fault_crashed()
    fault_arm()
    ps.close()
    ps = PageStore(str(tmp_path / "db"), "posix", 16)
    assert ps.versions() == (0, 2)
    ps.close()


# the step log's file cache (steplog.c invariant 11) under the debug build's invariant checker
from tests.storage.test_steplog import (  # noqa: E402,F401
    test_a_log_holds_a_bounded_number_of_files_open,
    test_a_reader_reading_a_segment_the_writer_removed_is_told_so,
    test_log_with_more_segments_than_the_file_cache_matches_model,
    test_threads_read_through_the_file_cache_while_the_writer_appends,
    test_truncate_below_drops_whole_segments,
    test_reader_sees_appends_and_truncation_and_changes_nothing,
)
