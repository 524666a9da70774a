"""What a warm spilled step costs the kernel (dbsp_core/trace/spill.py invariants 12 and 17): evictions of many runs
drop a file's mapping in one call, the cache takes the budget the batches leave, and a key index too big to cache
is not kept under a budget. Each checked against a dict model (multisets)."""

from __future__ import annotations

import pytest
import mmap
import os
import random
import warnings
from collections import Counter

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core import ZSet
from dbsp_core.errors import IndexDroppedWarning
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore, spilling

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _smaps_values(m: mmap.mmap, field: str) -> list[str]:
    """The values of line ``field`` (e.g. ``"Rss:"``, ``"VmFlags:"``) of mapping ``m`` in /proc/self/smaps."""
    start = np.frombuffer(m, dtype=np.uint8).ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == start
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError("mapping not found in /proc/self/smaps")


def _rss(m: mmap.mmap) -> int:
    """Bytes of mapping ``m`` resident in this process (its Rss in /proc/self/smaps)."""
    return int(_smaps_values(m, "Rss:")[0]) * 1024


def _spilled_trace(store: BatchStore, n: int, rng: np.random.Generator) -> tuple[Trace, Counter]:
    """A trace of ``n`` rows (k, v), k = 0..n, in one batch spilled to a file of ``store``; and its dict model."""
    t = Trace(SCHEMA, ("k",))
    k, v = np.arange(n, dtype=np.int64), rng.integers(0, 1000, n)
    t.insert(ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=SCHEMA)).index_by(["k"]))
    store.settle()
    store.enforce()
    store.settle()
    (b,) = t._levels()
    assert store.file_of(b) is not None, "the batch was not spilled"
    return t, Counter(zip(k.tolist(), v.tolist()))


def _read(t: Trace, keys: np.ndarray, model: Counter) -> None:
    """``t.lookup`` of ``keys`` finds the model's rows of those keys (multisets)."""
    hashes = np.sort(ZSet.from_arrow(pa.table({"k": keys, "v": keys}, schema=SCHEMA)).hash(["k"]))
    asked = set(keys.tolist())
    got = Counter(r for x in t.lookup(hashes) for r in zip(x.zset.data.column("k").to_pylist(),
                                                           x.zset.data.column("v").to_pylist()) if r[0] in asked)
    assert got == Counter({r: c for r, c in model.items() if r[0] in asked}), SEED


def _read_weighted(t: Trace, keys: np.ndarray, model: dict) -> None:
    """:func:`_read` with the rows' weights (a trace holding deletions: a deleted row's +1 and -1 cancel), against a
    model of each key's one row (k -> v)."""
    hashes = np.sort(ZSet.from_arrow(pa.table({"k": keys, "v": keys}, schema=SCHEMA)).hash(["k"]))
    asked = set(keys.tolist())
    got: Counter = Counter()
    for x in t.lookup(hashes):
        w = x.zset.weights.tolist() if x.zset.weights is not None else [1] * len(x)
        for r, c in zip(zip(x.zset.data.column("k").to_pylist(), x.zset.data.column("v").to_pylist()), w):
            if r[0] in asked:
                got[r] += c
    assert +got == Counter({(k, model[k]): 1 for k in asked if k in model}), SEED


@FORMAT_1
def test_an_eviction_of_many_runs_drops_the_whole_mapping_and_keeps_the_accounting(monkeypatch) -> None:
    """An eviction of a file's pages in WHOLE_RUNS runs or more is one madvise over the file's whole mapping
    (invariant 12): after the enforce that made it, the file holds no page in the process (a madvise per run left
    the pages the cache holds, and the 64 KiB around each fault, mapped), while the cache's accounting is the
    per-page clock's as before: at most :meth:`BatchStore.cache_cap` bytes, and the pages of the newest read still
    held, so reading its keys again counts hits only (they fault back from the page cache)."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", False)  # the per-page clock (spill.py invariant 15)
    rng = np.random.default_rng(SEED)
    with BatchStore(4 << 20) as store, spilling(store):
        t, model = _spilled_trace(store, 300_000, rng)
        f = store.file_of(t._levels()[0])
        assert f.size > 2 * store.cache_cap(), (f.size, store.cache_cap())
        whole = 0
        for _ in range(24):  # 50 keys a step: ~200 pages, in ~50 runs; the cache fills in a few steps
            keys = rng.choice(300_000, 50, replace=False)
            _read(t, keys, model)
            before = (store.stats["whole_evictions"], store.stats["evictions"])
            store.enforce()
            assert store.cached_pages() * mmap.PAGESIZE <= store.cache_cap()
            if store.stats["whole_evictions"] == before[0]:  # none, or a few pages (what the cache was over by)
                continue
            assert _rss(f.map) == 0, (_rss(f.map), SEED)  # the whole mapping left, held pages included
            whole += 1
            hits, misses = store.stats["cache_hits"], store.stats["cache_misses"]
            _read(t, keys, model)  # the newest read's pages: still the cache's
            store.enforce()
            assert store.stats["cache_misses"] == misses and store.stats["cache_hits"] > hits, SEED
        assert whole >= 2, (whole, store.stats, SEED)


@FORMAT_1
def test_the_cache_takes_the_budget_the_batches_leave(monkeypatch) -> None:
    """With every batch spilled, the cache may hold what the budget has left beside the bytes in memory (fences,
    filters), not only ``CACHE_SHARE`` of it (invariant 12, :meth:`BatchStore.cache_cap`): a working set of about
    twice the share, read step after step, misses in the first step only (with the cache held to its share, every
    step evicted part of it and missed again). Rows as the model's."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", False)  # the per-page clock (spill.py invariant 15)
    rng = np.random.default_rng(SEED)
    limit = 4 << 20
    with BatchStore(limit) as store, spilling(store):
        t, model = _spilled_trace(store, 300_000, rng)
        share = limit * BatchStore.CACHE_SHARE
        assert store.cache_cap() >= 2 * share, (store.cache_cap(), share)
        keys = rng.choice(300_000, 160, replace=False)
        _read(t, keys, model)
        store.enforce()
        held = store.cached_pages() * mmap.PAGESIZE
        assert share < held <= store.cache_cap(), (held, share, store.cache_cap())
        for _ in range(3):
            misses = store.stats["cache_misses"]
            _read(t, keys, model)
            store.enforce()
            assert store.stats["cache_misses"] == misses, (store.stats, SEED)


def test_a_group_by_under_a_budget_drops_a_key_index_too_big_to_cache(monkeypatch) -> None:
    """A linear aggregate's key index past ``INDEX_MAX_SHARE`` times the cache share under a budget is dropped for
    good, quietly (invariant 17: its probes write pages all over it, so evicted at every enforce it cost every
    step a write fault per page probed); the aggregate then reads its old totals from its spilled batches through
    their filters and fences (``keys_sought``). Its outputs stay a dict model's."""
    rng = np.random.default_rng(SEED)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(s=dbsp.sum("v"), n=dbsp.count()))
    # the rule past INDEX_KEEP_BYTES (16 MiB: an index a real budget's cache cannot hold is hundreds of MiB) at a
    # size a test builds in a second: a cache share of 1 MiB, an index of ~8 MiB, a floor of 2 MiB
    monkeypatch.setattr(BatchStore, "INDEX_KEEP_BYTES", 2 << 20)
    p = dbsp.Pipeline(c, memory_limit="4MiB")
    try:
        n = 150_000
        k = rng.permutation(np.arange(n, dtype=np.int64))
        v = rng.integers(-9, 10, n)
        model = {int(a): [int(b), 1] for a, b in zip(k, v)}
        with warnings.catch_warnings():
            warnings.simplefilter("error", IndexDroppedWarning)  # a choice, not a failure: no warning
            p.push("t", pa.table({"k": k, "v": v}, schema=SCHEMA))
            p.step()
            store = p.executor.batch_store
            store.settle()  # the load's batch, handed to the spill thread, is switched to its file
            store.enforce()
            store.settle()
            (trace,) = p.traces(0).values()
            assert trace.held_index is None and trace.index_spec is None, trace.held_index
            checked = 0
            for i in range(4):
                keys = rng.choice(n, 50, replace=False).astype(np.int64)
                sought = store.stats["keys_sought"]
                spilled = any(store.is_spilled(b) for b in trace._levels())
                p.push("t", pa.table({"k": keys, "v": np.full(50, i + 1)}, schema=SCHEMA))
                out = p.step()["g"].to_dict()
                want = Counter()
                for a in keys.tolist():
                    old = model[a]
                    model[a] = [old[0] + i + 1, old[1] + 1]
                    want[(a, *old)] -= 1
                    want[(a, *model[a])] += 1
                assert Counter(out) == want, SEED
                if spilled:
                    assert store.stats["keys_sought"] > sought, "the step did not seek the spilled batches"
                    checked += 1
            assert checked, "no step read a spilled batch"
    finally:
        p.close()


@FORMAT_1
def test_an_overflowing_step_empties_the_cache_and_counts_every_page_a_miss(monkeypatch) -> None:
    """Steps of 300 lookups over a spilled batch of 300k rows under 4 MiB (the ~300 pages they read lie in more
    2 MiB units than the cap: spill.py invariant 15, "overflow"), run twice from the same seed: with the per-page
    clock (``OVERFLOW_EMPTIES`` off, the reference) and with the overflow path. Per step the pages counted
    (hits + misses) are the same; with the overflow path every one is a miss, the cache holds no page after the
    enforce and the file's mapping holds none (Rss 0, ``mapped_bytes`` 0), each enforce is counted in
    ``overflows``; the rows found are the model's both ways."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_KEEP", False)  # every mapping dropped whole (the next test keeps some)

    def run(empties: bool) -> list:
        monkeypatch.setattr(BatchStore, "OVERFLOW_EMPTIES", empties)
        rng = np.random.default_rng(SEED)
        out = []
        with BatchStore(4 << 20) as store, spilling(store):
            t, model = _spilled_trace(store, 300_000, rng)
            f = store.file_of(t._levels()[0])
            for _ in range(6):
                h0, m0 = store.stats["cache_hits"], store.stats["cache_misses"]
                _read(t, rng.choice(300_000, 300, replace=False), model)
                store.enforce()
                h, m = store.stats["cache_hits"] - h0, store.stats["cache_misses"] - m0
                out.append((h, m))
                if empties:
                    assert h == 0 and m > 0 and store.cached_pages() == 0, (h, m, store.cached_pages(), SEED)
                    assert _rss(f.map) == 0 and store.mapped_bytes() == 0, (_rss(f.map), SEED)
            assert (store.stats["overflows"] == 6) == empties, store.stats["overflows"]
        return out

    clock, empty = run(False), run(True)
    assert [h + m for h, m in clock] == [m for _, m in empty], (clock, empty, SEED)
    assert sum(h for h, _ in clock) > 0, clock  # (the clock counted hits: the two ways differ in what they count)


@FORMAT_1
def test_an_overflowing_step_keeps_the_hot_units_mapped_within_the_cap(monkeypatch) -> None:
    """With ``OVERFLOW_KEEP`` (spill.py invariant 15, "overflow"), an enforce whose reads marked more units than the
    cap keeps mapped the units reads used most over the last enforces, at most :meth:`BatchStore.cache_cap` of them,
    and drops the others: a key read every step (beside 3 keys at random, whose pages lie in more units than the cap
    of a 2M-row file under 24 MiB) has every unit of its pages still mapped after each enforce from the fifth on
    (``_mapped``: its units' heat is above any unit read in fewer of the last five enforces), the file's Rss is at
    most ``mapped_bytes()`` <= the cap after each, and the cache holds no page (every page a miss, as without the
    keep). Each step also deletes 50 rows and adds 50; every lookup finds the dict model's rows (multisets, with
    weights)."""
    monkeypatch.setattr(BatchStore, "OVERFLOW_KEEP", True)
    from dbsp_core.trace import spillread
    from dbsp_core.trace.spill import MAP_UNIT, _unit_of
    rng = np.random.default_rng(SEED)
    n = 2_000_000
    with BatchStore(24 << 20) as store, spilling(store):
        t, model = _spilled_trace(store, n, rng)
        big = t._levels()[0]
        f = store.file_of(big)
        byk = {k: v for (k, v) in model}  # the model: k -> v (each k once, weight 1)
        hot = np.array([int(rng.integers(n))], dtype=np.int64)
        hot_hashes = np.sort(ZSet.from_arrow(pa.table({"k": hot, "v": hot}, schema=SCHEMA)).hash(["k"]))
        (hot_pages,) = spillread.pages_used([(big, f, hot_hashes, None)])
        hot_units = np.unique(_unit_of(f.base, hot_pages))
        assert 2 * len(hot_units) * MAP_UNIT <= store.cache_cap(), (len(hot_units), store.cache_cap())
        def units_of(keys: np.ndarray) -> int:  # the MAP_UNITs reads of ``keys`` in the big file mark
            hashes = np.sort(ZSet.from_arrow(pa.table({"k": keys, "v": keys}, schema=SCHEMA)).hash(["k"]))
            (pages,) = spillread.pages_used([(big, f, hashes, None)])
            return len(np.unique(_unit_of(f.base, pages)))

        changed: list[int] = []
        for step in range(8):
            # 3 keys at random beside the hot one, drawn again while their units in the big file alone (a lower
            # bound of what the step marks) fit the cap: 3 keys can land in units the hot key's share
            # (DBSP_TEST_SEED=793333954 drew 8 units against a cap of 9 at step 4, and its enforce did not overflow)
            for _ in range(100):
                keys = np.concatenate([hot, rng.choice(n, 3, replace=False)])
                if units_of(keys) * MAP_UNIT > store.cache_cap():
                    break
            else:
                raise AssertionError(f"no 3 keys mark more units than the cap (DBSP_TEST_SEED={SEED})")
            _read_weighted(t, keys, byk)
            h0, o0 = store.stats["cache_hits"], store.stats["overflows"]
            store.enforce()
            assert store.stats["overflows"] == o0 + 1, (store.stats, SEED)
            assert store.stats["cache_hits"] == h0 and store.cached_pages() == 0, SEED
            assert _rss(f.map) <= store.mapped_bytes() <= store.cache_cap(), \
                (_rss(f.map), store.mapped_bytes(), store.cache_cap(), SEED)
            if step >= 4:
                marks = store._mapped.get(id(big))
                assert marks is not None and marks[hot_units].all(), (hot_units, marks, SEED)
            # deletions of old rows and new rows, in a small batch (the model's rows change with it)
            gone = [k for k in rng.choice(n, 50, replace=False).tolist() if k != int(hot[0]) and k in byk]
            new = list(range(n + 50 * step, n + 50 * step + 50))
            ks = np.array(gone + new, dtype=np.int64)
            vs = np.array([byk[k] for k in gone] + [k % 1000 for k in new], dtype=np.int64)
            t.insert(ZSet.from_arrow(pa.table({"k": ks, "v": vs}, schema=SCHEMA),
                                     weights=[-1] * len(gone) + [1] * len(new)).index_by(["k"]))
            for k in gone:
                del byk[k]
            byk.update((k, k % 1000) for k in new)
            changed += gone + new
        _read_weighted(t, np.array(changed, dtype=np.int64), byk)  # every deletion and new row as the model's
        store.enforce()
        assert _rss(f.map) <= store.mapped_bytes() <= store.cache_cap(), SEED
