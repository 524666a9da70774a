"""Microbenchmarks of the C kernels through the Python API: consolidate, index, merge, hash and partition a Z-set of 1M bids, and a trace's insert and lookup at 1M rows of state."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import GROUPS, ROWS, SEED

import dbsp_core as dbsp
from dbsp_core.layout import Layout
from dbsp_core.trace import Trace

INTS = ["auction", "bidder", "price"]


def _fresh(table: pa.Table) -> tuple[tuple, dict]:
    """pedantic setup: a new unconsolidated Z-set each round (Z-sets cache their consolidated form)."""
    return (dbsp.ZSet.from_arrow(table),), {}


def test_consolidate_1m(benchmark, bids) -> None:
    """Whole-row consolidation (sort by row hash, sum equal rows) of 1M int64 rows."""
    t = bids.select(INTS)
    z = benchmark.pedantic(lambda z: z.consolidate(), setup=lambda: _fresh(t), rounds=10, warmup_rounds=1)
    assert len(z) == t.num_rows  # every (auction, bidder, price) row is distinct at this size: all kept


@pytest.mark.parametrize("key", ["auction", "category"])
def test_index_by_1m(benchmark, bids, key) -> None:
    """Indexing 1M rows by an int64 key (100k values) or a string key (20 values): what every keyed operator
    does to its change, and the largest share of the demo's step (bench/profile_demo.py)."""
    t = bids.select(INTS + ["category"])
    ix = benchmark.pedantic(lambda z: z.index_by([key]), setup=lambda: _fresh(t), rounds=10, warmup_rounds=1)
    assert len(ix) == t.num_rows


@pytest.mark.parametrize("rows", [1_000, 10_000, 100_000], ids=["1k", "10k", "100k"])
@pytest.mark.parametrize("key", ["int", "two", "str"])
def test_group_sum(benchmark, key, rows) -> None:
    """count and sum of a change grouped by one int64 key over 100k values (csrc/group_int.c), or by two int64
    keys or a string key (the general engine, csrc/group.c): an aggregate's change; at 10k rows nearly every
    row is a group of its own, so a partition's table grows while it folds."""
    from dbsp_core import _zset

    rng = np.random.default_rng(SEED)
    k = rng.integers(0, 100_000, rows)
    keys = {"int": {"k": k}, "two": {"k": k, "k2": k % 7}, "str": {"k": pa.array(k.astype(str))}}[key]
    t = pa.table({**keys, "c": np.ones(rows, dtype=np.int64), "s": rng.integers(1, 100, rows)})
    view = _zset.BatchView(t, np.where(rng.random(rows) < 0.9, 1, -1).astype(np.int64))
    nk = len(keys)
    out = benchmark(_zset.group_reduce, view, None, tuple(range(nk)), [("sum", nk), ("sum", nk + 1)], True)
    assert len(out[0]) <= rows


def test_hash_1m(benchmark, bids) -> None:
    """The DBSP key hash of 1M rows over two int64 columns."""
    z = dbsp.ZSet.from_arrow(bids.select(INTS))
    h = benchmark(z.hash, ["auction", "bidder"])
    assert len(h) == ROWS


def test_partition_1m(benchmark, bids) -> None:
    """An exchange's split of 1M rows to W=2 workers by the shard map of 256 shards (hash, partition, take)."""
    z = dbsp.ZSet.from_arrow(bids.select(INTS))
    pos = Layout.local(2, 8).shard_map.part_of_shard
    parts = benchmark(z.partition, ["auction"], pos, 2)
    assert sum(p.num_rows for p in parts) == ROWS


@pytest.mark.parametrize("small", [10_000, 1_000_000], ids=["1m+10k", "1m+1m"])
def test_merge(benchmark, bids, small) -> None:
    """The consolidated sum of two indexed batches: a trace merge of the 1M-row state with a small batch (the
    common case) and with a batch as large as itself (a level's merge)."""
    rng = np.random.default_rng(SEED + 1)
    a = dbsp.ZSet.from_arrow(bids.select(INTS)).index_by(["auction"])
    n = small
    other = pa.table({"auction": rng.integers(0, GROUPS, n), "bidder": rng.integers(0, 1000, n),
                      "price": rng.integers(1, 10_000, n)})
    b = dbsp.ZSet.from_arrow(other).index_by(["auction"])
    a._row_hashes(), b._row_hashes()  # traces keep row hashes with their batches (dbsp_core/trace/levels.py)
    m = benchmark(a.merge, b)
    assert len(m) >= len(a)  # 1M distinct rows plus the other batch's, less any that cancel (none here)


@pytest.fixture(scope="module")
def trace_1m(bids) -> Trace:
    """A trace of the 1M bids by auction, inserted as 1000 batches of 1k rows (levels as a running operator's)."""
    t = bids.select(INTS)
    tr = Trace(t.schema, ("auction",))
    for i in range(0, t.num_rows, 1000):
        tr.insert(dbsp.ZSet.from_arrow(t.slice(i, 1000)).index_by(["auction"]))
    return tr


def test_trace_insert_1k(benchmark, trace_1m) -> None:
    """Inserting a 1k-row batch into a 1M-row trace, with the merge work the insert pays (mean over rounds
    includes merges; the trace grows by 1k rows a round)."""
    rng = np.random.default_rng(SEED + 2)
    schema = trace_1m.schema

    def setup() -> tuple[tuple, dict]:
        t = pa.table({"auction": rng.integers(0, GROUPS, 1000), "bidder": rng.integers(0, 1000, 1000),
                      "price": rng.integers(1, 10_000, 1000)}, schema=schema)
        return (dbsp.ZSet.from_arrow(t).index_by(["auction"]),), {}

    benchmark.pedantic(trace_1m.insert, setup=setup, rounds=200, warmup_rounds=10)


def test_trace_lookup_1k(benchmark, trace_1m) -> None:
    """The rows of 1k random keys in a 1M-row trace (a galloping C walk per batch)."""
    rng = np.random.default_rng(SEED + 3)
    keys = pa.table({"auction": rng.integers(0, GROUPS, 1000)})
    hashes = np.sort(dbsp.ZSet.from_arrow(keys).hash(["auction"]))
    found = benchmark(trace_1m.lookup, hashes)
    assert sum(len(b) for b in found) >= 1000
