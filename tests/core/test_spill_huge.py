"""A spilled file that reads of some keys use densely gets MADV_HUGEPAGE (dbsp_core/trace/spill.py invariant 12, "huge
faults"): its pages then come back in 2 MiB folios after any drop from the page cache, and the prefetch leaves it
alone; a file read sparsely keeps 4 KiB faults. The advice is read back in the mapping's VmFlags in /proc/self/smaps
("hg": VM_HUGEPAGE); the rows found are a dict model's (multisets), under a budget every trace spills under."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import ZSet
from dbsp_core.trace.spill import BatchStore, spilling
from tests.core.test_spill_flat import SCHEMA, _read, _smaps_values, _spilled_trace

# a test of format 1's mapped files, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _huge(m) -> bool:
    return "hg" in _smaps_values(m, "VmFlags:")


@FORMAT_1
@pytest.mark.parametrize("keys", [20_000, 1])
def test_a_file_read_densely_gets_huge_faults_and_no_prefetch(keys: int, monkeypatch) -> None:
    """Steps of ``keys`` lookups over a spilled batch of 1M rows (a 32 MiB file, 16 units of 2 MiB, under a 16 MiB
    budget). 20,000 random keys use pages in every unit: after the first enforce the file's mapping is MADV_HUGEPAGE
    (counted once in ``huge_files``), and a prefetch of keys in it (``PREFETCH`` "on") asks for no page. One key uses
    pages in a few units, under ``HUGE_SHARE`` (half) of them: the mapping never gets the advice and the prefetch asks
    for its pages. Every lookup finds the model's rows. Watched fail with ``_hot_files`` not called (the 20,000-key
    case: no "hg") and with the prefetch not skipping a huge file (pages asked for)."""
    monkeypatch.setattr(BatchStore, "HUGE_SHARE", 0.5)
    monkeypatch.setattr(BatchStore, "HUGE_MIN_UNITS", 1)
    monkeypatch.setattr(BatchStore, "PREFETCH", "on")
    rng = np.random.default_rng(SEED)
    with BatchStore(16 << 20) as store, spilling(store):
        t, model = _spilled_trace(store, 1_000_000, rng)
        b = t._levels()[0]
        f = store.file_of(b)
        assert not _huge(f.map)  # (opened without the advice)
        for _ in range(3):
            _read(t, rng.choice(1_000_000, keys, replace=False), model)
            store.enforce()
        dense = keys > 1
        assert _huge(f.map) == dense, (keys, SEED)
        assert store.stats.get("huge_files", 0) == (1 if dense else 0), store.stats
        ks = rng.choice(1_000_000, 50, replace=False)
        hashes = np.sort(ZSet.from_arrow(pa.table({"k": ks, "v": ks}, schema=SCHEMA)).hash(["k"]))
        store._resident.pop(id(b), None)  # the clock forgotten: every page counts as not held
        asked = store.prefetch(b, hashes)
        assert (asked == 0) == dense, (asked, keys, SEED)
        _read(t, ks, model)
