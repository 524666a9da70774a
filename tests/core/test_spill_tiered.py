"""Tiered levels under a budget (trace invariant 15): the bytes a spilled trace writes per byte of its state, and its content, against a dict model."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa

from dbsp_core import ZSet
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore, spilling

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_a_growing_spilled_trace_writes_at_most_three_times_its_state() -> None:
    """64 steps of 2,000 new keys into a trace under a 256 KiB budget (a final state ~20x the budget), an enforce after
    each: the batch files written in all come to at most 3x the files the state ends in (measured 2.3x; 2.8x with
    FAN_IN 4; every level from the first 2,000-row batch up is spilled; two-way merges of the spilled levels wrote
    3.5x, each row rewritten once per level above the budget), and the trace holds the dict model's sum, in at most
    2 * FAN_IN loose batches and a merge of FAN_IN per level."""
    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t, model = Trace(schema, ("k",)), {}
    with BatchStore(256 << 10) as store, spilling(store):
        for _ in range(64):
            z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 1 << 40, 2000), "v": rng.integers(0, 3, 2000)}))
            z = z.consolidate()
            for r, w in z.to_dict().items():
                model[r] = model.get(r, 0) + w
            t.insert(z.index_by(["k"]))
            store.enforce()
            store.settle()
        written, disk = store.stats["bytes_written"], store.disk_bytes()
        assert disk > 10 * (256 << 10)  # the state is many times the budget: most levels are spilled
        assert written <= 3 * disk, (written, disk, written / disk, store.stats["merges_on_disk"], t.levels())
        for _lvl, loose, merge in t.levels():
            assert len(loose) <= 2 * Trace.FAN_IN and (merge is None or len(merge) <= Trace.FAN_IN), t.levels()
        t.check()
        assert t.consolidated().zset.to_dict() == {r: w for r, w in model.items() if w}


def test_compact_spilled_leaves_one_spilled_batch_and_the_content() -> None:
    """After a tiered load (several spilled batches, some at one level), ``compact_spilled`` (what settle_merges
    calls) merges them into one spilled batch, in place on disk: the content is the dict model's, invariants 1, 2
    and 5 hold, the merged-away files are deleted, and a second call finds nothing to merge."""
    import gc

    rng = np.random.default_rng(SEED)
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8()), ("v", pa.int64())])
    t, model = Trace(schema, ("k",)), {}
    with BatchStore(256 << 10) as store, spilling(store):
        for _ in range(24):
            k = rng.integers(0, 30_000, 3000)
            z = ZSet.from_arrow(pa.table({"k": k, "s": pa.array([None if x % 5 == 0 else str(x % 97) for x in k]),
                                          "v": rng.integers(0, 3, 3000)}), weights=rng.choice([1, 2, -1], 3000))
            z = z.consolidate()
            for r, w in z.to_dict().items():
                model[r] = model.get(r, 0) + w
            t.insert(z.index_by(["k"]))
            store.enforce()
            store.settle()
        spilled = [b for b in t.batches if store.is_spilled(b)]
        assert len(spilled) >= 3, t.levels()
        assert t.compact_spilled() >= 2
        loose = [e[1] for lv in t._by_level if lv.merge is None for e in lv.loose if store.is_spilled(e[1])]
        assert len(loose) == 1, t.levels()
        assert t.compact_spilled() == 0
        t.check()
        assert t.consolidated().zset.to_dict() == {r: w for r, w in model.items() if w}
        del spilled, loose
        gc.collect()
        assert len(store._files) == len([b for b in t.batches if store.is_spilled(b)])
