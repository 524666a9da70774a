"""A drop of a spilled file's pages tells the page cache which pages reads used (dbsp_core/trace/spill.py invariant 12,
"recency"): the store maps batch files MADV_RANDOM (no read-around at a fault), and under that advice Linux neither
marks the folio of an unmapped page accessed nor scans the mapping for references (``vma_has_recency``), so the files a
step reads every time aged in the LRU like files never read (at 100M rows the hot files were reclaimed first and came
back a page at a time, in small folios: ~5x the kernel's cost a page; bench/history/RESULTS-2026-11-28-to-2026-12-02.md, branch r31-fault100). So every
drop happens with the mapping MADV_NORMAL, and the mapping is MADV_RANDOM again after it: read back in the mapping's
VmFlags in /proc/self/smaps ("rr": random read) at each drop. The rows found are a dict model's (multisets)."""

from __future__ import annotations

import mmap
import os
import random
from contextlib import contextmanager

import numpy as np
import pytest

from dbsp_core.trace import spill, spillread
from dbsp_core.trace.spill import BatchStore, spilling
from tests.core.test_spill import _drop_cached
from tests.core.test_spill_flat import _read, _rss, _smaps_values, _spilled_trace

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _vmflags(m) -> set[str]:
    """The VmFlags of mapping ``m`` in /proc/self/smaps."""
    return set(_smaps_values(m, "VmFlags:"))


@FORMAT_1
@pytest.mark.parametrize("recency", [True, False])
def test_a_drop_of_a_spilled_files_pages_is_made_with_recency(recency: bool, monkeypatch) -> None:
    """Steps of 150 lookups over a spilled batch of 1M rows (a 32 MiB file, twice the budget: every enforce drops the
    file's mapping, invariant 12 "mapped"). Each drop of the file's pages is made while its mapping is not random-read
    ("rr" absent from its VmFlags: the kernel marks the folios of the young pages it unmaps accessed), and the mapping
    is random-read again after every enforce (faults read no pages around them). With ``RECENCY`` off every drop is
    made random-read (the second case: the check can fail). The rows found are the model's; the budget holds."""
    monkeypatch.setattr(BatchStore, "RECENCY", recency)
    # the cache's drops through the reference path (spill.py _evict, a _recency a mapping: watched below); the native
    # one (one C call, spillread.evict) is test_a_native_drop_marks_the_pages_read_accessed's
    monkeypatch.setattr(spillread, "NATIVE", False)
    seen: list[bool] = []  # per drop of the file's mapping: "rr" in its VmFlags during it
    inner = spill._recency

    @contextmanager
    def watched(m):
        with inner(m):
            if m is target[0]:
                seen.append("rr" in _vmflags(m))
            yield

    target: list = [None]
    monkeypatch.setattr(spill, "_recency", watched)
    rng = np.random.default_rng(SEED)
    limit = 16 << 20
    with BatchStore(limit) as store, spilling(store):
        t, model = _spilled_trace(store, 1_000_000, rng)
        f = store.file_of(t._levels()[0])
        target[0] = f.map
        assert "rr" in _vmflags(f.map), _vmflags(f.map)  # opened random-read
        for _ in range(3):
            _read(t, rng.choice(1_000_000, 150, replace=False), model)
            store.enforce()
            rss = _rss(f.map)
            assert rss <= store.mapped_bytes() <= store.cache_cap(), (rss, store.mapped_bytes(), SEED)
            assert "rr" in _vmflags(f.map), SEED  # random-read again between steps
        assert store.stats["mapped_drops"] + store.stats["whole_evictions"] >= 3, store.stats
        assert len(seen) >= 3, seen
        if recency:
            assert not any(seen), (seen, SEED)
        else:
            assert all(seen), (seen, SEED)


@FORMAT_1
@pytest.mark.parametrize("recency", [True, False])
def test_a_batched_drop_of_a_spilled_files_pages_leaves_it_random_read(recency: bool, monkeypatch) -> None:
    """The same steps with the cache's drops batched in C (spillread.evict: every mapping's runs in one call, each
    mapping MADV_NORMAL around its drop with ``RECENCY``): after every enforce the file's Rss is within what the
    store counts mapped and the cap, its mapping is random-read again, the drops happened, and the rows found are
    the model's. (The mapping's flags during the C call are not observable from here; the order of the calls is
    spillread.pxi ``evict_mappings``'s.)"""
    monkeypatch.setattr(BatchStore, "RECENCY", recency)
    monkeypatch.setattr(spillread, "NATIVE", True)
    rng = np.random.default_rng(SEED)
    with BatchStore(16 << 20) as store, spilling(store):
        t, model = _spilled_trace(store, 1_000_000, rng)
        f = store.file_of(t._levels()[0])
        calls = store.stats["evict_calls"]
        for _ in range(3):
            _read(t, rng.choice(1_000_000, 150, replace=False), model)
            store.enforce()
            rss = _rss(f.map)
            assert rss <= store.mapped_bytes() <= store.cache_cap(), (rss, store.mapped_bytes(), SEED)
            assert "rr" in _vmflags(f.map), SEED
        assert store.stats["mapped_drops"] + store.stats["whole_evictions"] >= 3, store.stats
        assert store.stats["evict_calls"] > calls, store.stats


KPF_REFERENCED, KPF_ACTIVE = 1 << 2, 1 << 6  # /proc/kpageflags (Documentation/admin-guide/mm/pagemap.rst)


def _pfns(m) -> dict[int, int]:
    """Page number -> page frame of the pages of mapping ``m`` present in this process (/proc/self/pagemap: bit 63
    present, bits 0-54 the frame, shown to a process with CAP_SYS_ADMIN only, else 0)."""
    start = np.frombuffer(m, dtype=np.uint8).ctypes.data
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // page * 8)
        bits = np.frombuffer(f.read(-(-len(m) // page) * 8), dtype=np.uint64)
    present = np.flatnonzero(bits >> np.uint64(63))
    return dict(zip(present.tolist(), (bits[present] & np.uint64((1 << 55) - 1)).tolist()))


def _kpageflags(pfns: list[int]) -> list[int]:
    with open("/proc/kpageflags", "rb") as f:
        out = []
        for pfn in pfns:
            f.seek(pfn * 8)
            out.append(int.from_bytes(f.read(8), "little"))
        return out


@FORMAT_1
@pytest.mark.parametrize("recency", [True, False])
def test_a_native_drop_marks_the_pages_read_accessed(recency: bool, monkeypatch) -> None:
    """The native path (spillread.evict, one C call for an enforce's drops) gives the advice of invariant 12,
    "recency", seen by its effect on the page cache: the file's pages are put out of the page cache (fsync, then
    fadvise DONTNEED with the mapping dropped), a step's lookups fault some back (fresh folios, not referenced: a
    fault does not mark a folio accessed), and the enforce drops them from the process (the file is twice the budget).
    With ``RECENCY`` the kernel unmapped them from a mapping that has recency, so it marked their folios accessed
    (/proc/kpageflags REFERENCED or ACTIVE, read at the frames /proc/self/pagemap gave before the drop) - nearly all
    of the pages dropped; without it (the mapping MADV_RANDOM during the drop: the second case, where the check can
    fail) nearly none. Needs CAP_SYS_ADMIN for the frames (skipped without)."""
    if not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("/proc/kpageflags is not readable (needs CAP_SYS_ADMIN)")
    monkeypatch.setattr(BatchStore, "RECENCY", recency)
    monkeypatch.setattr(spillread, "NATIVE", True)
    monkeypatch.setattr(BatchStore, "PREFETCH", "off")  # (WILLNEED would read pages ahead of the faults)
    calls = {"native": 0}
    inner = spillread.evict

    def counted(runs, rec):
        calls["native"] += 1
        return inner(runs, rec)

    monkeypatch.setattr(spillread, "evict", counted)
    # 4 KiB folios, as the drops this measures were made on: a file these lookups read densely would get MADV_HUGEPAGE
    # (spill.py invariant 12, "huge faults") and come back in 2 MiB folios after each drop, where 0.73-0.88 of the
    # dropped pages read as referenced in 2 of 9 runs (not yet explained; bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-100)
    monkeypatch.setattr(BatchStore, "HUGE_SHARE", None)
    rng = np.random.default_rng(SEED)
    with BatchStore(16 << 20) as store, spilling(store):
        t, model = _spilled_trace(store, 1_000_000, rng)
        f = store.file_of(t._levels()[0])
        marked, dropped = [], 0
        for _ in range(3):
            _drop_cached(store)  # the files' pages out of the process and the page cache
            _read(t, rng.choice(1_000_000, 150, replace=False), model)
            before = _pfns(f.map)
            assert before and any(before.values()), "no page frame shown"
            store.enforce()
            after = _pfns(f.map)
            gone = [pfn for p, pfn in before.items() if p not in after]
            dropped += len(gone)
            marked += [bool(x & (KPF_REFERENCED | KPF_ACTIVE)) for x in _kpageflags(gone)]
        assert calls["native"] >= 3 and dropped >= 100, (calls, dropped, store.stats)
        share = sum(marked) / len(marked)
        if recency:
            assert share >= 0.9, (share, len(marked), SEED)
        else:
            assert share <= 0.1, (share, len(marked), SEED)
