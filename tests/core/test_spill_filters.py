"""A spilled batch's Bloom filter is in memory only once a read probed it (dbsp_core/trace/spill.py invariant 16,
``LAZY_FILTERS``; batchfile.py invariant 5): the store lets go of the copy its writer built, the first probe copies it
back from the file, checked against the fence and filter's section CRC. The rows found are a dict model's."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dbsp_core.errors import CorruptionError
from dbsp_core.trace import spillread
from dbsp_core.trace.spill import BatchStore, spilling
from tests.core.test_spill_flat import _read, _spilled_trace

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


@FORMAT_1
@pytest.mark.parametrize("native", [True, False])
def test_a_filter_is_held_from_its_first_probe(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two spilled traces of 200k rows: neither holds its filter after the spill (``memory()`` counts the fence and
    page CRCs only); lookups in one (native and reference probes) find the model's rows and make it hold its filter,
    the bytes the writer built (bit for bit), counted again in ``memory()``; the other still holds none."""
    monkeypatch.setattr(spillread, "NATIVE", native)
    rng = np.random.default_rng(SEED)
    with BatchStore(1 << 20) as store, spilling(store):
        a, model_a = _spilled_trace(store, 200_000, rng)
        b, _ = _spilled_trace(store, 200_000, rng)
        fa, fb = store.file_of(a._levels()[0]), store.file_of(b._levels()[0])
        assert not fa.filter_held() and not fb.filter_held()
        _, kept = store.memory()
        assert kept == sum(int(f.fence.nbytes + f.page_crcs.nbytes) for f in (fa, fb)), kept
        _read(a, rng.choice(300_000, 500, replace=False), model_a)  # (a third of them absent)
        fa = store.file_of(a._levels()[0])
        assert fa.filter_held() and not store.file_of(b._levels()[0]).filter_held()
        from dbsp_core.trace.batchfile import bloom_build

        assert np.array_equal(fa.bloom, bloom_build(a._levels()[0].key_hash))
        _, kept = store.memory()
        assert kept == fa.memory_bytes() + int(fb.fence.nbytes + fb.page_crcs.nbytes) > \
            sum(int(f.fence.nbytes + f.page_crcs.nbytes) for f in (fa, fb))


@FORMAT_1
def test_a_damaged_filter_is_refused_at_its_first_probe() -> None:
    """A byte of a let-go filter changed in the file (the fence and filter's section CRC no longer matches): the
    first probe raises CorruptionError naming the file, before any row is read, and holds no filter."""
    rng = np.random.default_rng(SEED)
    with BatchStore(1 << 20) as store, spilling(store):
        t, model = _spilled_trace(store, 200_000, rng)
        f = store.file_of(t._levels()[0])
        assert not f.filter_held()
        at = f.sections[0] + 8 * len(f.fence) + 8 * int(rng.integers(0, (f.sections[1] - f.sections[0]) // 8
                                                                        - len(f.fence)))
        fd = os.open(f.path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([old[0] ^ 0x10]), at)
        finally:
            os.close(fd)
        with pytest.raises(CorruptionError, match=os.path.basename(f.path)):
            _read(t, rng.choice(200_000, 50, replace=False), model)
        assert not f.filter_held()
