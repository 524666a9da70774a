"""The budget bounds the pages of spilled files mapped into the process (dbsp_core/trace/spill.py invariant 12,
"mapped"): a read fault maps up to 2 MiB around the page it reads (its folio, or its fault-around window), so
steps that read a few pages in many places of a big file left most of it mapped, counted by no budget. Read back
in /proc/self/smaps, checked against a dict model (multisets)."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.trace.spill import BatchStore, spilling
from tests.core.test_spill_flat import SCHEMA, _read, _rss, _spilled_trace

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def test_steps_that_read_all_over_a_spilled_file_leave_at_most_the_budget_mapped() -> None:
    """Steps of 150 lookups each over a spilled batch of 1M rows (a 32 MiB file, twice the budget): each step reads
    ~750 pages (3 MiB, within what the cache's pages may hold, so the per-page clock evicts nothing), spread over every
    2 MiB of the file, and maps most of the file. After each enforce the file's Rss (smaps) is at most what the store
    counts as mapped (``mapped_bytes``), which is at most ``cache_cap`` (the budget less the fence and filter in
    memory): the bytes in memory plus the files' mapped pages fit the budget. The rows found are the model's."""
    rng = np.random.default_rng(SEED)
    limit = 16 << 20
    with BatchStore(limit) as store, spilling(store):
        t, model = _spilled_trace(store, 1_000_000, rng)
        f = store.file_of(t._levels()[0])
        assert f.size >= 2 * limit, (f.size, limit)
        assert _rss(f.map) == 0, _rss(f.map)  # what opening it read left with the switch
        peak = 0
        for _ in range(3):
            keys = rng.choice(1_000_000, 150, replace=False)
            _read(t, keys, model)
            peak = max(peak, _rss(f.map))
            store.enforce()
            mem, kept = store.memory()
            rss = _rss(f.map)
            assert store.cached_pages() * 4096 <= store.cache_cap(), SEED
            assert rss <= store.mapped_bytes() <= store.cache_cap(), (rss, store.mapped_bytes(), store.cache_cap(),
                                                                        SEED)
            assert mem + kept + rss <= limit, (mem, kept, rss, limit, SEED)
        assert peak > limit, (peak, limit)  # the steps did map more than the budget (else this checks nothing)
        assert store.stats["mapped_drops"] >= 1, store.stats
        assert store.stats["whole_evictions"] == 0, store.stats  # the cache's clock alone would have kept them


def test_a_join_reports_the_mapped_bytes_it_bounds() -> None:
    """``p.metrics()["spill"]["mapped_bytes"]`` (and per operator) is what the store counts as mapped at the last
    step's enforce: at least the batch files' Rss in /proc/self/smaps, and with the bytes in memory within the budget.
    An inner join whose right side (600k rows) is spilled under 4 MiB, probed by steps of 2,000 keys, whose walks
    read pages in every 2 MiB of its file; outputs as the same pipeline's in memory."""
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    rng = np.random.default_rng(SEED)
    c = dbsp.Circuit()
    left = c.input("l", pa.schema([("a", pa.int64()), ("x", pa.int64())]))
    right = c.input("r", pa.schema([("id", pa.int64()), ("y", pa.int64())]))
    c.output("v", left.join(right, left_on="a", right_on="id"))
    n = 600_000
    pipes = [dbsp.Pipeline(c, executor=EmbeddedExecutor(background_merge=False), memory_limit=lim)
             for lim in ("4MiB", None)]
    try:
        for p in pipes:
            p.push("r", pa.table({"id": np.arange(n), "y": np.arange(n) % 7}))
            p.step()
        store = pipes[0].executor.batch_store
        store.settle()
        store.enforce()
        store.settle()
        assert store.disk_bytes() > 4 * (4 << 20), store.disk_bytes()
        for _ in range(3):
            keys = rng.choice(2 * n, 2_000, replace=False)  # about half of them present
            outs = []
            for p in pipes:
                p.push("l", pa.table({"a": keys, "x": np.arange(len(keys))}))
                outs.append(p.step()["v"].to_dict())
            assert outs[0] == outs[1] and sum(outs[0].values()) == int((keys < n).sum()), SEED
            sp = pipes[0].metrics()["spill"]
            rss = sum(_rss(f.map) for f in list(store._files.values()))
            assert rss <= sp["mapped_bytes"] <= store.cache_cap(), (rss, sp["mapped_bytes"], store.cache_cap(), SEED)
            assert sp["memory_bytes"] + sp["filter_bytes"] + rss <= sp["limit"], (sp, rss, SEED)
            assert sum(o["mapped_bytes"] for o in sp["operators"].values()) <= sp["mapped_bytes"]
        st = store.stats  # the steps read the file and their mappings were dropped (else this checks nothing)
        assert st["cache_misses"] > 0 and st["mapped_drops"] + st["whole_evictions"] > 0, st
    finally:
        for p in pipes:
            p.close()
