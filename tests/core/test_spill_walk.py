"""A step's walks over many spilled batches, batched (branch r31-walk): ``Trace.narrowed`` taking the change rows of
every spilled batch its Bloom tests pass in one take (the native path, ``spillread.NATIVE``) against a take a batch
(the reference path, which also tests the filters and locates pages a batch at a time in numpy),
and the cache's evictions of an enforce in one C call (``spillread.evict`` -> ``_storage.evict_mappings``) against
spill.py ``_evict`` (a madvise a run or mapping), page for page (/proc/self/pagemap's present bits)."""

from __future__ import annotations

import mmap
import os
import random
import tempfile

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet
from dbsp_core.trace import Trace, spill, spillread
from dbsp_core.trace.spill import BatchStore, spilling

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
PAGE = mmap.PAGESIZE


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _present(m: mmap.mmap) -> set[int]:
    """The pages of mapping ``m`` mapped in this process (/proc/self/pagemap bit 63)."""
    start = np.frombuffer(m, dtype=np.uint8).ctypes.data
    n = -(-len(m) // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // PAGE * 8)
        bits = np.frombuffer(f.read(n * 8), dtype=np.uint64)
    return set(np.flatnonzero(bits >> np.uint64(63)).tolist())


def _vmflags(m: mmap.mmap) -> set[str]:
    from tests.core.test_spill_flat import _smaps_values

    return set(_smaps_values(m, "VmFlags:"))


@pytest.mark.parametrize("recency", [True, False])
def test_evict_mappings_drops_the_pages_spill_evict_drops(recency: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random evictions of five file mappings (sizes not a whole number of pages; MADV_RANDOM, every page faulted
    in): whole mappings, runs of random pages (some past the mapping's end, some at its last partial page), several
    entries of one mapping, a mapping evicted whole and by runs, a closed mapping. The C call leaves exactly the
    pages the reference (``spill._evict``, with the same ``RECENCY``) leaves, which are the model's (every page but
    those evicted), and every mapping random-read after it."""
    monkeypatch.setattr(BatchStore, "RECENCY", recency)
    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory() as d:
        maps = []
        for i in range(5):
            size = int(rng.integers(40, 300)) * PAGE - int(rng.integers(1, PAGE))
            p = os.path.join(d, f"f{i}")
            with open(p, "wb") as f:
                f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
            fd = os.open(p, os.O_RDONLY)
            try:
                m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            m.madvise(mmap.MADV_RANDOM)
            maps.append(m)
        closed = mmap.mmap(-1, 4 * PAGE)
        closed.close()
        for _ in range(12):
            entries: list = []
            for m in maps:
                n = -(-len(m) // PAGE)
                for _ in range(int(rng.integers(0, 3))):
                    if rng.random() < 0.2:
                        entries.append((m, None))
                    else:
                        pages = rng.choice(n + 6, int(rng.integers(1, n)), replace=False)  # (some past the end)
                        if rng.random() < 0.3:
                            pages = np.append(pages, n - 1)  # its last, partial page
                        entries.append((m, np.unique(pages).astype(np.int64)))
            entries.append((closed, None))
            entries.append((closed, np.arange(2, dtype=np.int64)))
            rng.shuffle(entries)
            got = []
            for in_c in (False, True):
                for m in maps:
                    np.frombuffer(m, dtype=np.uint8)[::PAGE].sum()  # every page faulted in
                    assert len(_present(m)) == -(-len(m) // PAGE)
                if in_c:
                    calls = spillread.evict(entries, recency)
                    assert calls >= (1 if len(entries) > 2 else 0)
                else:
                    spill._evict(entries)
                got.append([_present(m) for m in maps])
                assert all("rr" in _vmflags(m) for m in maps)
            assert got[0] == got[1], SEED
            for m, present in zip(maps, got[1]):
                n = -(-len(m) // PAGE)
                mine = [p for x, p in entries if x is m]
                if any(p is None for p in mine):
                    dropped = set(range(n))
                else:
                    dropped = {int(q) for p in mine for q in p if q < n}
                assert present == set(range(n)) - dropped, SEED
        assert spillread.evict([], recency) == 0
        for m in maps:
            m.close()


SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])


def _part(rng: np.random.Generator, keys: np.ndarray) -> ZSet:
    """Rows of ``keys`` (a key may repeat: rows that differ in ``s``), strings and values with nulls."""
    n = len(keys)
    s = [None if x < 0.1 else f"s{int(x * 1000)}" for x in rng.random(n)]
    v = pa.array(rng.integers(-5, 5, n), mask=rng.random(n) < 0.1)
    return ZSet.from_arrow(pa.table({"k": keys, "s": s, "v": v}, schema=SCHEMA))


@FORMAT_1
@pytest.mark.parametrize("key", [("k",), ("k", "s", "v")])
def test_narrowed_together_is_a_take_per_batch(key: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace of six batches (four or more spilled: keys in ranges that overlap, repeated keys, strings and nulls)
    walked by changes of random keys (present, absent, repeated; one empty, one of absent keys only, one of a single
    row), as a join walks (``walked`` then ``narrowed`` a batch): per batch the same change rows (the rows, weights,
    key hashes and row numbers), the same keys sought and the same cache counts with the rows taken together
    (``spillread.NATIVE``) as with a take a batch (the reference path), and as with a take a batch for more than
    ``NARROW_TOGETHER_MAX`` rows; each change row a batch keeps is one whose key the batch's filter may hold and
    every row whose key the batch holds is kept (multisets of (key, batch))."""
    sizes = [60_000, 30_000, 20_000, 12_000, 6_000, 500]
    rng0 = np.random.default_rng(SEED)
    parts = [_part(rng0, rng0.integers(0, 150_000, n)) for n in sizes]
    keyed = list(key)

    def run(together: bool, most: int) -> list:
        monkeypatch.setattr(spillread, "NATIVE", together)
        monkeypatch.setattr(Trace, "NARROW_TOGETHER_MAX", most)
        rng = np.random.default_rng(SEED + 1)
        store = BatchStore(1 << 18)
        log: list = []
        try:
            with spilling(store):
                t = Trace(SCHEMA, key)
                for z in parts:
                    t.insert(z.index_by(keyed))
                    store.settle()
                    store.enforce()
                    store.settle()
                batches = t._levels()
                assert sum(store.is_spilled(b) for b in batches) >= 4
                def keys_of(z: ZSet) -> list:
                    return list(zip(*(z.data.column(c).to_pylist() for c in key)))

                held = [set(keys_of(b.zset)) for b in batches]
                for step in range(8):
                    if step == 0:
                        keys = np.zeros(0, dtype=np.int64)
                    elif step == 1:
                        keys = rng.integers(10**6, 2 * 10**6, 50)  # absent only
                    elif step == 2:
                        keys = rng.integers(0, 150_000, 1)
                    else:
                        keys = np.concatenate((rng.integers(0, 150_000, 300), rng.integers(10**6, 2 * 10**6, 300)))
                        keys = np.concatenate((keys, keys[:40]))  # repeated keys
                    change = _part(rng, keys).index_by(keyed)
                    seen = []
                    for b in t.walked(change.key_hash if len(change) else None):
                        d, rows = t.narrowed(b, change)
                        if d is None:
                            seen.append(None)
                            continue
                        seen.append((d.zset.data.to_pylist(), d.zset.weights.tolist(), d.key_hash.tolist(),
                                     None if rows is None else rows.tolist()))
                        if rows is not None:  # a narrowed change: the rows of those numbers
                            assert d.zset.data.to_pylist() == change.zset.data.take(rows).to_pylist()
                            assert np.array_equal(d.key_hash, change.key_hash[rows])
                        i = next(j for j, x in enumerate(batches) if x is b)
                        want = [k for k in keys_of(change.zset) if k in held[i]]
                        have = [k for k in keys_of(d.zset) if k in held[i]]
                        assert sorted(have) == sorted(want), (SEED, step, i)  # no row the batch matches is lost
                    store.enforce()
                    log.append((seen, store.stats["keys_sought"], store.stats["cache_hits"],
                                store.stats["cache_misses"], store.stats["evictions"], store.cached_pages()))
        finally:
            store.close()
        return log

    together = run(True, 1 << 16)
    per_batch = run(False, 1 << 16)
    assert together == per_batch, SEED
    assert run(True, 0) == per_batch, SEED
    narrowed = [x for step in together for x in step[0] if x is not None and x[3] is not None]
    assert narrowed, "no batch narrowed a change: the test tests nothing"


@FORMAT_1
def test_a_join_over_spilled_batches_is_the_same_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A join pipeline whose sides' states are spilled in several batches under a small budget (both sides' changes
    narrowed per spilled batch; no merge thread, so that the states are the same): the outputs of steps of random
    changes (inserts, deletions, repeated keys, null strings) with the rows taken together equal those with a take
    a batch and those of the same pipeline in memory (dict of row -> weight)."""
    import dbsp_core as dbsp
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    ls = pa.schema([("a", pa.int64()), ("x", pa.string())])
    rs = pa.schema([("id", pa.int64()), ("y", pa.int64())])

    def outputs(limit: int | None, together: bool) -> list:
        monkeypatch.setattr(spillread, "NATIVE", together)
        rng = np.random.default_rng(SEED + 2)
        c = dbsp.Circuit()
        left, right = c.input("l", ls), c.input("r", rs)
        c.output("v", left.join(right, left_on="a", right_on="id"))
        got = []
        p = dbsp.Pipeline(c, executor=EmbeddedExecutor(background_merge=False), memory_limit=limit)
        try:
            for step in range(14):
                n = 20_000 if step < 6 else 300
                ka = rng.integers(0, 40_000, n)
                xs = [None if k % 7 == 0 else f"x{k % 97}" for k in ka.tolist()]
                p.push("l", pa.table({"a": ka, "x": pa.array(xs, pa.string())}, schema=ls))
                p.push("r", pa.table({"id": rng.integers(0, 40_000, n), "y": rng.integers(0, 13, n)}, schema=rs))
                if step >= 6:  # deletions of rows pushed before (a Z-set of weight -1)
                    old = rng.integers(0, 40_000, 30)
                    p.push("r", ZSet.from_arrow(pa.table({"id": old, "y": old % 13}, schema=rs),
                                                np.full(30, -1, dtype=np.int64)))
                got.append(sorted(p.step()["v"].to_dict().items(), key=repr))
            if limit is not None:
                store = p.executor.batch_store
                assert store.stats["keys_sought"] > 0 and len(store._files) >= 2, store.stats
        finally:
            p.close()
        return got

    mem = outputs(None, True)
    assert outputs(1 << 20, True) == mem, SEED
    assert outputs(1 << 20, False) == mem, SEED
