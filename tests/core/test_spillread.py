"""The batched reads of spilled batches (trace/spillread.py, csrc/spillread.c): the Bloom tests of all of a read's
spilled batches in one call and the page accounting of all the batches a step read in one call, against Python
models (a loop per hash and byte range), against the numpy path they replace (batchfile.py ``bloom_may_contain``,
``BatchFile.pages_read``), and a trace's reads and cache counts the same either way."""

from __future__ import annotations

import mmap
import os
import random
import tempfile

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet, _storage
from dbsp_core.trace import spillread
from dbsp_core.trace.batchfile import bloom_build, bloom_may_contain, open_batch, write_batch
from dbsp_core.trace.spill import BatchStore
from dbsp_core.zset import FENCE_STEP

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
U64 = 1 << 64


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _bloom_model(words: list[int], k: int, h: int) -> bool:
    bits = len(words).bit_length() - 1
    mask = 0
    for j in range(k):
        mask |= 1 << ((h >> (6 * j)) & 63)
    w = words[h >> (64 - bits) if bits else 0]
    return w & mask == mask


def test_bloom_probe_of_several_filters_is_the_models() -> None:
    """One call tests the hashes against several filters (random words, 1 to 2**12 of them, k 1-10; built filters
    too) and counts each: per hash what a loop over the blocked filter's bits says and what the numpy
    ``bloom_may_contain`` says; no hashes gives empty rows."""
    rng = np.random.default_rng(SEED)
    for _ in range(30):
        nf = int(rng.integers(1, 6))
        filters, ks = [], []
        for _ in range(nf):
            words = 1 << int(rng.integers(0, 13))
            density = rng.random()
            f = np.zeros(words, dtype=np.uint64)
            for bit in range(64):
                f |= (rng.random(words) < density).astype(np.uint64) << np.uint64(bit)
            filters.append(f)
            ks.append(int(rng.integers(1, 11)))
        built = np.sort(rng.integers(0, 2**63, 500, dtype=np.int64).astype(np.uint64) * np.uint64(3))
        filters.append(bloom_build(built))
        ks.append(6)
        hashes = np.concatenate((rng.integers(0, 2**63, 300, dtype=np.int64).astype(np.uint64) * np.uint64(2),
                                 built[:100], np.array([0, U64 - 1], dtype=np.uint64)))
        keep, counts = _storage.bloom_probe(filters, ks, hashes)
        assert keep.dtype == np.bool_ and keep.shape == (len(filters), len(hashes))
        for i, (f, k) in enumerate(zip(filters, ks)):
            words = [int(x) for x in f]
            want = [_bloom_model(words, k, int(h)) for h in hashes]
            assert keep[i].tolist() == want, i
            assert np.array_equal(keep[i], bloom_may_contain(f, hashes, k))
            assert counts[i] == sum(want)
        assert keep[-1][len(hashes) - 102:len(hashes) - 2].all()  # no false negative
        empty, zero = _storage.bloom_probe(filters, ks, np.zeros(0, dtype=np.uint64))
        assert empty.shape == (len(filters), 0) and not zero.any()
    with pytest.raises(ValueError):
        _storage.bloom_probe([np.zeros(3, dtype=np.uint64)], [6], np.zeros(1, dtype=np.uint64))


def _floordiv(a: int, b: int) -> int:
    return a // b  # (Python's floor division: the C kernel's floordiv)


def _pages_model(fence: list[int], n: int, kh_off: int, hashes: list[int], rows: list[int] | None,
                 spans: list[tuple], mem: np.ndarray, values: bool, npages: int, page: int) -> list[int] | None:
    """The pages a fenced seek of each hash and a read of the rows found (None: of the rows the fence places each
    hash among) touch: batchfile.py ``BatchFile._pages_read`` written as loops; None when one is outside the map."""
    seen: set[int] = set()
    bad = False

    def mark(s: int, e: int) -> None:
        nonlocal bad
        if e <= s:
            return
        first, last = _floordiv(s, page), _floordiv(e - 1, page)
        if first < 0 or last >= npages:
            bad = True
            return
        seen.update(range(first, last + 1))

    def offs(kind_w: int, at: int, i: int) -> int:
        dt = np.int64 if kind_w == 8 else np.int32
        return int(mem[at:].view(np.uint8)[i * kind_w:(i + 1) * kind_w].view(dt)[0])

    def read(r: int, e: int) -> None:
        for kind, w, off, aoff, data in spans:
            pos, end = r + aoff, e + aoff
            if kind == spillread.FIXED:
                mark(off + pos * w, off + end * w)
            elif kind == spillread.BITS:
                mark(off + pos // 8, off + (end + 7) // 8)
            else:
                mark(off + pos * w, off + (end + 1) * w)
                if values:
                    mark(data + offs(w, off, pos), data + offs(w, off, end))

    for h in hashes:
        left = sum(1 for x in fence if x < h)  # searchsorted left
        right = sum(1 for x in fence if x <= h) * FENCE_STEP
        lo = max(left - 1, 0) * FENCE_STEP
        hi = min(right + FENCE_STEP + 2, n)
        mark(kh_off + lo * 8, kh_off + hi * 8)
        if rows is None:
            read(lo, min(right, n))
    for r in rows or []:
        read(r, r + 1)
    return None if bad else sorted(seen)


def test_pages_read_of_several_batches_is_the_models() -> None:
    """One call locates the pages of several reads (random fences with repeated entries, empty batches, hashes at,
    just below and above fence entries and at the ends of the hash space, with and without the rows found, spans of
    every kind with array offsets, 4- and 8-byte offsets of values read from the mapping, with and without values;
    pages of 8, 64 and 4096 bytes): the pages the loop model gives; a read a page of which lies outside the mapping
    gives None."""
    rng = np.random.default_rng(SEED)
    size = 256 * mmap.PAGESIZE
    mem = np.zeros(size, dtype=np.uint8)
    base = mem.ctypes.data
    for trial in range(40):
        page = 1 << int(rng.choice([3, 6, 12]))  # small pages too: a range a byte short or long shows
        entries, models = [], []
        bump = 0  # the next free byte for a VAR span's offsets (in the first quarter: no two overlap)
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.choice([0, 1, 63, 64, 65, 130, int(rng.integers(1, 3000))]))
            nf = -(-n // FENCE_STEP)
            fence = np.sort(rng.integers(0, 1 << 20, nf).astype(np.uint64) * np.uint64(rng.integers(1, 1 << 40)))
            if nf > 2:
                fence[1] = fence[2]  # a repeated entry (a key's rows across a fence block)
            cand = [0, U64 - 1] + [int(x) + d for x in fence for d in (-1, 0, 1) if 0 <= int(x) + d < U64]
            cand = np.array(cand, dtype=np.uint64)
            hashes = cand[rng.choice(len(cand), min(len(cand), int(rng.integers(0, 40))), replace=False)]
            rows = None if rng.random() < 0.5 or n == 0 else np.sort(rng.choice(n, int(rng.integers(0, min(n, 30) + 1)),
                                                                               replace=False)).astype(np.int64)
            spans = []
            for _ in range(int(rng.integers(1, 6))):
                kind = int(rng.integers(0, 3))
                aoff = int(rng.integers(0, 9))
                if kind == spillread.VAR and bump + (n + aoff + 1) * 8 > size // 4:
                    kind = spillread.FIXED  # (no room left for its offsets)
                if kind == spillread.FIXED:
                    spans.append((kind, int(rng.choice([1, 2, 4, 8, 16])), int(rng.integers(0, size // 2)), aoff, 0))
                elif kind == spillread.BITS:
                    spans.append((kind, 0, int(rng.integers(0, size // 2)), aoff, 0))
                else:
                    w = int(rng.choice([4, 8]))
                    cnt = n + aoff + 1
                    at, bump = bump, bump + (cnt * w + 7) // 8 * 8
                    o = np.cumsum(rng.integers(0, 40, cnt)).astype(np.int64 if w == 8 else np.int32)
                    mem[at:at + cnt * w] = o.view(np.uint8)
                    spans.append((kind, w, at, aoff, int(rng.integers(size // 2, size - 41 * cnt - 1))))
            values = bool(rng.random() < 0.7)
            kh_off = int(rng.integers(0, size // 2))
            npages = size // page
            if trial % 10 == 9:
                npages = int(rng.integers(1, 4))  # the map is smaller than what the spans reach: None
            sp = np.array(spans, dtype=np.int64).reshape(-1, 5)
            entries.append((fence, n, kh_off, hashes, rows, sp, base, values, npages))
            models.append((spans,))
        for i, (fence, n, kh_off, hashes, rows, sp, base, values, npages) in enumerate(entries):  # (after every
            models[i] = _pages_model([int(x) for x in fence], n, kh_off, [int(h) for h in hashes],  # write to mem)
                                     None if rows is None else rows.tolist(), models[i][0], mem, values, npages, page)
        got = _storage.pages_read(entries, FENCE_STEP.bit_length() - 1, page.bit_length() - 1)
        for g, want in zip(got, models):
            if want is None:
                assert g is None
            else:
                assert g is not None and g.dtype == np.int64 and g.tolist() == want


def test_pages_stamp_counts_the_pages_not_yet_stamped() -> None:
    """``pages_stamp`` sets each page's clock and returns how many were 0 (numpy's count of misses); a page past
    the clock raises."""
    rng = np.random.default_rng(SEED)
    for _ in range(20):
        clock = rng.choice([0, 0, 3, 7], 500).astype(np.int32)
        pages = np.unique(rng.integers(0, 500, int(rng.integers(0, 300)))).astype(np.int64)
        want_new = int(np.count_nonzero(clock[pages] == 0))
        want = clock.copy()
        want[pages] = 9
        assert _storage.pages_stamp(clock, pages, 9) == want_new and np.array_equal(clock, want)
    with pytest.raises(IndexError):
        _storage.pages_stamp(np.zeros(4, dtype=np.int32), np.array([4], dtype=np.int64), 1)


def _batch(rng: np.random.Generator, n: int, key=("k",)):
    k = rng.integers(0, max(1, n // 3), n)
    t = pa.table({"k": k, "s": pa.array([None if x % 5 == 0 else "x" * int(x % 9) for x in k], pa.utf8()),
                  "L": pa.array(["y" * int(x % 4) for x in k], pa.large_utf8()),
                  "f": pa.array(rng.random(n)), "b": pa.array(rng.random(n) < 0.5),
                  "i": pa.array([None if x % 3 == 0 else int(x) for x in k], pa.int32())})
    return ZSet.from_arrow(t, weights=rng.choice([1, 3, -2], n)).consolidate().index_by(list(key))


@pytest.mark.parametrize("n", [1, 64, 65, 700, 9000])
def test_pages_used_of_batch_files_is_pages_read(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``spillread.pages_used`` of several reads of batch files (string, large string, bool, nullable int32,
    float columns; hashes found, absent and at fence entries; the rows a lookup found or None; values and row
    hashes or not) gives ``BatchFile.pages_read``'s pages (its numpy path, ``spillread.NATIVE`` False, the same), None for a
    batch without a fence; the spans kept per batch are reused only for the same buffers."""
    rng = np.random.default_rng(SEED + n)
    d = tempfile.mkdtemp()
    files = []
    for j in range(3):
        b = _batch(rng, n + j, ("k", "s"))
        b._row_hashes()
        path = os.path.join(d, f"{j}.batch")
        write_batch(path, b)
        files.append(open_batch(path))
    cache: dict = {}
    for _ in range(4):
        reads, wants = [], []
        for f in files:
            got = f.batch
            kh = np.asarray(got.key_hash)
            fence = np.asarray(f.fence)
            hashes = np.unique(np.concatenate((rng.choice(kh, min(len(kh), 50)), fence, fence - np.uint64(1),
                                               rng.integers(0, 2**63, 20).astype(np.uint64))))
            rows = None if rng.random() < 0.5 else got.lookup(hashes)
            reads.append((got, f, hashes, rows))
        for values, rh in ((True, True), (False, False), (True, False)):
            got_pages = spillread.pages_used(reads, cache, values, rh)
            for (b, f, hashes, rows), g in zip(reads, got_pages):
                want = f.pages_read(b, hashes, rows, values, rh)
                if want is None:
                    assert g is None and b._fx is None
                else:
                    assert g is not None and np.array_equal(g, want), (len(g), len(want))
            monkeypatch.setattr(spillread, "NATIVE", False)
            py = spillread.pages_used(reads, None, values, rh)
            monkeypatch.setattr(spillread, "NATIVE", True)
            assert all((a is None and c is None) or np.array_equal(a, c) for a, c in zip(py, got_pages))
    assert all(v[0][2] == files[0].base or any(v[0][2] == f.base for f in files) for v in cache.values())


@FORMAT_1
@pytest.mark.parametrize("overflow", [False, True])
def test_a_traces_reads_and_cache_counts_are_the_same_batched(overflow: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two traces of five batches (three or more spilled), each under its own store, read step after step by
    match_weights (whole-row key), lookup and key_sums (each through the batched Bloom tests) and accounted by their
    store's cache (the batched page accounting): the same results, keys sought, cache hits and misses, evictions
    and cached pages as the numpy path per batch (``spillread.NATIVE`` False, the reference path), and results equal to the same traces in memory.
    Filters are held from the start (``LAZY_FILTERS`` off: which ones a read probes differs with ``FILTERS_MAX``,
    and the bytes held set the cache's cap); with ``overflow`` the cache empties when the reads overflow it (spill.py
    invariant 15, "overflow": every page a miss), else the per-page clock (hits counted)."""
    from dbsp_core.trace import Trace
    from dbsp_core.trace.spill import BatchStore, spilling

    monkeypatch.setattr(BatchStore, "LAZY_FILTERS", False)
    monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", overflow)

    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    sizes = [40_000, 20_000, 10_000, 5_000, 2_500]
    starts = np.cumsum([0] + sizes)
    parts = [ZSet.from_arrow(pa.table({"k": np.arange(lo, hi), "v": np.arange(lo, hi) % 11}, schema=schema))
             for lo, hi in zip(starts[:-1], starts[1:])]
    mem, whole_mem = Trace(schema, ("k",)), Trace(schema, ("k", "v"))
    for z in parts:
        mem.insert(z.index_by(["k"]))
        whole_mem.insert(z.index_by(["k", "v"]))

    def run(in_c: bool) -> list:
        monkeypatch.setattr(spillread, "NATIVE", in_c)
        rng = np.random.default_rng(SEED)
        disk, whole_disk = Trace(schema, ("k",)), Trace(schema, ("k", "v"))
        stores = [BatchStore(1 << 18), BatchStore(1 << 18)]
        log = []
        try:
            for t, store, key in ((disk, stores[0], ["k"]), (whole_disk, stores[1], ["k", "v"])):
                with spilling(store):
                    for z in parts:
                        t.insert(z.index_by(key))
                        store.settle()
                        store.enforce()
                        store.settle()
                assert sum(store.is_spilled(b) for b in t._levels()) >= 3  # (the smallest stay in memory)
            for s in range(6):
                keys = np.concatenate((rng.choice(int(starts[-1]), 40, replace=False),
                                       int(starts[-1]) + rng.choice(10**6, 300, replace=False)))
                probe = ZSet.from_arrow(pa.table({"k": keys, "v": keys % 11}, schema=schema))
                change = probe.index_by(["k", "v"])
                with spilling(stores[1]):
                    got = whole_disk.match_weights(change)
                    stores[1].enforce()
                assert np.array_equal(got, whole_mem.match_weights(change))
                hashes = np.sort(probe.hash(["k"]))
                asked = set(keys.tolist())
                ix = probe.index_by(["k"])
                rows = np.arange(len(ix), dtype=np.int64)
                with spilling(stores[0]):
                    found = sorted(r for b in disk.lookup(hashes) for r in zip(*b.zset.data.to_pydict().values())
                                   if r[0] in asked)
                    sums = disk.key_sums(ix.zset.data, ["k"], ix.key_hash, rows, ["v"])
                    stores[0].enforce()
                assert found == sorted(r for b in mem.lookup(hashes) for r in zip(*b.zset.data.to_pydict().values())
                                       if r[0] in asked)
                assert np.array_equal(sums, mem.key_sums(ix.zset.data, ["k"], ix.key_hash, rows, ["v"]))
                log.append((got.tolist(), found, sums.tolist())
                           + tuple((st.stats["keys_sought"], st.stats["cache_hits"], st.stats["cache_misses"],
                                    st.stats["evictions"], st.cached_pages()) for st in stores))
        finally:
            for st in stores:
                st.close()
        return log

    batched, per_batch = run(True), run(False)
    assert batched == per_batch
    monkeypatch.setattr(Trace, "FILTERS_MAX", 0)  # a big read: its filters tested per batch (C, one at a time)
    assert run(True) == batched
    if overflow:  # every enforce overflowed (units of 2 MiB against a cap of a few): misses only, nothing cached
        assert all(x[1] == 0 and x[2] > 0 and x[4] == 0 for x in batched[-1][3:]), batched[-1][3:]
    else:
        assert all(x[1] > 0 and x[2] > 0 for x in batched[-1][3:])  # each cache was used: hits and misses counted
