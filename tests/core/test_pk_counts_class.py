"""The per-key counters (``PerKeyTotals.pk_steps`` and the others) count without writing an attribute of the class:
a write to a class attribute invalidates the method cache of the class and of ``Trace`` (its subclass), which made
every trace method lookup of a group-by step walk the MRO again (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "The floor of a small step,
again"). The counters still read as class attributes and still count."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.trace.keyindex import PerKeyTotals
from dbsp_core.trace.levels import Trace


def test_counting_steps_writes_no_class_attribute(monkeypatch) -> None:
    import dbsp_core.runtime.driver as driver_module
    from dbsp_core.envvars import load

    # without a budget whatever the environment says: under one (CI's DBSP_MEMORY_LIMIT=1 pass) every trace keeps
    # its totals in batches and the per-key path, whose counters this checks, never runs
    monkeypatch.setattr(driver_module, "settings", lambda: load({}))
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    p = dbsp.Pipeline(c)
    rng = np.random.default_rng(0)
    before = {name: vars(PerKeyTotals)[name] for name in ("pk_steps", "pk_syncs", "pk_fallbacks",
                                                          "pk_found_dirty_steps")}
    trace_attrs = dict(vars(Trace))
    steps0 = PerKeyTotals.pk_steps
    with p:
        for _ in range(5):
            p.push("t", pa.table({"k": rng.integers(0, 50, 200), "v": rng.integers(0, 9, 200)}))
            p.step()
    assert PerKeyTotals.pk_steps > steps0  # the counter counted (the per-key path ran)
    assert {name: vars(PerKeyTotals)[name] for name in before} == before  # the class's own attributes: untouched
    assert all(vars(PerKeyTotals)[name] is before[name] for name in before)
    assert dict(vars(Trace)) == trace_attrs
