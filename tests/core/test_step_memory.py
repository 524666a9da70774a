"""What a step returns to the system when it ends (csrc/scratch.c design note 6, runtime/embedded.py
release_memory): the C scratch and region caches trimmed to DBSP_CACHE_KEEP_MB, and results unchanged."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.envvars import settings
from dbsp_core.runtime import embedded

SCHEMA = pa.schema([("k", pa.int64()), ("a", pa.int64())])


def _run(keep_mb: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, tuple[int, int]]:
    """A 300k-row step of a group-by and a distinct (kernels that take scratch buffers of MiBs, and merges), W=1
    (worker 0 runs on this thread, so this thread's scratch cache is the step's), with the caches kept to keep_mb."""
    monkeypatch.setattr(embedded, "settings", lambda: settings()._replace(cache_keep_mb=keep_mb))
    rng = np.random.default_rng(5)
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("a")))
    c.output("d", t.distinct())
    p = dbsp.Pipeline(c, workers=1)
    out = {}
    for _ in range(2):
        p.push("t", pa.table({"k": rng.integers(0, 50_000, 300_000), "a": rng.integers(0, 9, 300_000)},
                             schema=SCHEMA))
        got = p.step()
        cached = _zset.cached_bytes()  # before the sums below, which use the kernels on this thread too
        for name, z in got.items():
            out[name] = out.get(name, dbsp.ZSet.from_rows([], z.schema)) + z
    p.close()
    return {k: v.to_dict() for k, v in out.items()}, cached


def test_a_step_trims_the_caches_to_the_size_kept_and_results_do_not_change(monkeypatch):
    import dbsp_core.runtime.driver as driver_module
    from dbsp_core.envvars import load

    # as without DBSP_MEMORY_LIMIT (CI's second run sets it: a budget keeps the caches at its shares, which
    # test_substep_memory checks), and with the caches' limits a process starts with (a budgeted store another
    # test left open in this process would hold them at its shares: spill.py _SharedLimit), put back after
    monkeypatch.setattr(driver_module, "settings", lambda: load({}))
    found = (_zset.region_cache_limit(256 << 20), _zset.scratch_cache_limit(512 << 20))
    try:
        big, kept = _run(1 << 20, monkeypatch)  # keep everything: the step leaves buffers in the caches
    finally:
        _zset.region_cache_limit(found[0])
        _zset.scratch_cache_limit(found[1])
    assert sum(kept) > 0, "the step cached nothing: the test would not see a trim"
    small, trimmed = _run(0, monkeypatch)
    assert trimmed == (0, 0)
    assert small == big  # every view's integral, as a multiset of rows


def test_trim_caches_refuses_a_bad_size():
    with pytest.raises(ValueError, match="keep must be an int >= 0"):
        _zset.trim_caches(-1)
    assert _zset.trim_caches(1 << 40) == 0  # nothing cached above a huge size: nothing released
