"""The spill cache's page clock (dbsp_core/trace/spill.py invariants 12 and 17) keeps bookkeeping bounded by what the cache holds, however many steps read it."""

from __future__ import annotations

import gc
import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore, spilling

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _looked_up(t: Trace, keys: np.ndarray) -> Counter:
    """The rows of keys ``keys`` that ``Trace.lookup`` finds, with their weights: a multiset."""
    hashes = np.sort(ZSet.from_arrow(pa.table({"k": keys, "v": keys}, schema=SCHEMA)).hash(["k"]))
    asked, got = set(keys.tolist()), Counter()
    for b in t.lookup(hashes):
        data = b.zset.data.to_pydict()
        for k, v, w in zip(data["k"], data["v"], b.zset.weights.tolist()):
            if k in asked:
                got[(k, v)] += w
    return got


@FORMAT_1
def test_reads_under_the_cache_share_keep_a_bounded_clock() -> None:
    """Steps that look up a few keys of a spilled batch while the cache is under its share: every enforce stamped
    the pages read with a new round, and the queue of rounds (only shortened by evicting, which a cache under its
    share never does) grew by one per step for ever. It now holds about one round per page the cache holds; the
    lookups still find a dict model's rows (multisets) and hit the cache after the first step."""
    rng = np.random.default_rng(SEED)
    t = Trace(SCHEMA, ("k",))
    k = np.arange(20_000, dtype=np.int64)
    v = rng.integers(-5, 5, len(k))
    model = Counter(zip(k.tolist(), v.tolist()))
    with BatchStore(64 << 20) as store, spilling(store):  # a cache share of 16 MiB: never full here
        t.insert(ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=SCHEMA)).index_by(["k"]))
        store.BATCH_SHARE = 0.0  # spill it (this instance only)
        store.enforce()
        store.settle()
        store.BATCH_SHARE = BatchStore.BATCH_SHARE
        assert [store.is_spilled(b) for b in t._levels()] == [True]
        steps = 400
        sets = [rng.choice(len(k), 3, replace=False).astype(np.int64) for _ in range(4)]  # a step's working set
        for i in range(steps):
            keys = sets[i % len(sets)]
            asked = set(keys.tolist())
            assert _looked_up(t, keys) == Counter({r: c for r, c in model.items() if r[0] in asked})
            store.enforce()
        assert store.stats["evictions"] == 0 and store.stats["cache_hits"] > 0, store.stats
        held = store.cached_pages()
        assert 0 < held < 100, held  # the pages of 12 keys
        rounds = len(store._rounds)
        assert rounds <= 2 * held + 64, (rounds, held)


def test_an_index_the_trace_let_go_leaves_the_cache() -> None:
    """A trace's key index counts in the cache while it is used (invariant 17); once the trace holds it no more
    (here: the trace is gone), its pages were counted for ever, until an eviction passed them. Now the cache
    forgets it: what the cache holds is what is still there."""
    t = Trace(SCHEMA, ("k",))
    assert t.keep_index(("v",))
    with BatchStore(64 << 20) as store, spilling(store):
        saved = BatchStore.INDEX_FILE_MIN
        store.INDEX_FILE_MIN = 0  # count even a small index (this instance only)
        k = np.arange(5_000, dtype=np.int64)
        t.insert(ZSet.from_arrow(pa.table({"k": k, "v": k}, schema=SCHEMA)).index_by(["k"]))
        probe = pa.table({"k": k[:10]})
        kh = ZSet.from_arrow(probe).hash(["k"])
        order = np.argsort(kh)
        for _ in range(3):  # the third read builds the index (trace invariant 11)
            sums = t.key_sums(probe, ["k"], kh[order], order, ["v"])
        assert sorted(sums[:, 0].tolist()) == list(range(10))
        assert t.held_index is not None
        store.enforce()
        counted = store.cached_pages()
        assert counted > 0 and store._index_used, "the index was not counted"
        del t  # the trace, and so its index, goes
        gc.collect()
        for _ in range(300):
            store.enforce()
        assert store.cached_pages() == 0 and not store._index_used, (store.cached_pages(), store._index_used)
        rounds = len(store._rounds)
        assert rounds <= 64, rounds
        store.INDEX_FILE_MIN = saved


@FORMAT_1
def test_a_key_index_build_over_spilled_batches_leaves_their_pages_to_the_cache(monkeypatch) -> None:
    """A stale key index is rebuilt from every row of the trace (trace invariant 11), a read that does not go
    through ``Trace._read``: its pages were counted nowhere, so the whole spilled file stayed in the process
    (12 MiB of a 16 MiB file under a 4 MiB budget), step after step. The build now counts as a read of every page
    (spill.py invariant 12), and the next enforce evicts them down to the cache share; the sums read through the
    rebuilt index are a dict model's."""
    import mmap

    from test_spill import _rss_of

    monkeypatch.setattr(BatchStore, "INDEX_MAX_SHARE", None)  # kept however big (else dropped: invariant 17)
    t = Trace(SCHEMA, ("k",))
    assert t.keep_index(("v",))
    rng = np.random.default_rng(SEED)
    model: dict = {}
    with BatchStore(4 << 20) as store, spilling(store):  # a cache share of 1 MiB
        for lo in range(0, 400_000, 100_000):
            k = np.arange(lo, lo + 100_000, dtype=np.int64)
            v = rng.integers(-9, 10, len(k))
            t.insert(ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=SCHEMA)).index_by(["k"]))
            model.update(zip(k.tolist(), v.tolist()))
            store.enforce()
            store.settle()
        store.enforce()
        files = [store.file_of(b) for b in t._levels()]
        assert files and all(f is not None for f in files), "a batch stayed in memory"
        regions = [(np.frombuffer(f.map, dtype=np.uint8).ctypes.data, f.size) for f in files]
        assert sum(n for _, n in regions) > 8 * store.memory_limit * store.CACHE_SHARE
        t._stale_index()  # as a clear or a rollback leaves it: the third read rebuilds it
        keys = rng.choice(400_000, 50, replace=False).astype(np.int64)
        probe = pa.table({"k": keys})
        kh = ZSet.from_arrow(probe).hash(["k"])
        order = np.argsort(kh)
        for _ in range(3):
            sums = np.empty(len(keys), np.int64)
            sums[order] = t.key_sums(probe, ["k"], kh[order], order, ["v"])[:, 0]
            assert sums.tolist() == [model[k] for k in keys.tolist()]
            store.enforce()
        assert t.held_index is not None and t.held_index.token is not None, "the index was not rebuilt"
        cap = store.cache_cap()
        assert store.cached_pages() * mmap.PAGESIZE <= cap
        # the pages the cache holds, and what the kernel mapped around the faults of a few reads (up to 64 KiB each)
        assert _rss_of(regions) <= 2 * cap, (_rss_of(regions), cap)
