"""The embedded runtime: push validation changes nothing on bad input, input spreads over workers, ShardMap slices, and traces stay per shard."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import BIDS, to_zset

import dbsp_core as dbsp
from dbsp_core import _zset as dbsp_zset
from dbsp_core.errors import DbspError, SchemaError, StepError
from dbsp_core.runtime.executor import spread
from dbsp_core.trace import Trace


def _pipeline(workers: int = 2) -> dbsp.Pipeline:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("all", b)
    c.output("g", b.group_by("auction").agg(n=dbsp.count()))
    return dbsp.Pipeline(c, workers=workers)


GOOD = pa.table({"auction": [1, 2], "bidder": ["a", None], "price": [3, 4], "f": [0.5, None]}, schema=BIDS)


@pytest.mark.parametrize("bad, exc", [
    (("nope", GOOD), KeyError),
    (("bids", 5), TypeError),
    (("bids", [(1, "a", 3)]), SchemaError),
    (("bids", GOOD.to_pandas().drop(columns=["f"])), SchemaError),
    (("bids", GOOD.drop_columns(["f"])), SchemaError),
    (("bids", GOOD.rename_columns(["a", "b", "c", "d"])), SchemaError),
    (("bids", GOOD.set_column(2, "price", pa.array(["3", "x"]))), SchemaError),  # "x" is no int64
    (("bids", dbsp.ZSet.from_arrow(GOOD.drop_columns(["f"]))), SchemaError),
    (("bids", GOOD.append_column("weight", pa.array([1.0, 2.0]))), TypeError),
])
def test_bad_push_raises_and_changes_nothing(bad, exc) -> None:
    with _pipeline() as p:
        p.push("bids", GOOD)
        with pytest.raises(exc):
            p.push(*bad)
        with pytest.raises(TypeError):
            p.push("bids", GOOD, weights=np.array([1.5, 2.0]))
        out = p.step()
        assert out["all"] == dbsp.ZSet.from_arrow(GOOD)
        assert p.step()["all"].to_dict() == {}


def test_push_forms_are_equivalent() -> None:
    z = dbsp.ZSet.from_arrow(GOOD, weights=[2, -1])
    for data, kw in [(z, {}), (GOOD, {"weights": [2, -1]}), (GOOD.to_batches()[0], {"weights": np.array([2, -1])}),
                     (z.to_arrow(), {})]:
        with _pipeline() as p:
            p.push("bids", data, **kw)
            assert p.step()["all"] == z


def test_push_spreads_rows_evenly_over_workers() -> None:
    pushes = [("bids", to_zset({(i, "a", i, None): 1 for i in range(10)}, BIDS)),
              ("bids", to_zset({(100, "b", 1, None): 1}, BIDS))]
    for cursor in range(4):
        per = spread(pushes, 4, cursor, min_rows=1)
        sizes = [sum(z.num_rows for z in pend.get("bids", [])) for pend in per]
        assert sorted(sizes) == [2, 3, 3, 3]


def test_spread_keeps_small_pushes_whole_and_slices_large_ones() -> None:
    """executor.spread: a push under two slices of ``min_rows`` goes whole to the cursor's worker, with the step's
    other small pushes, until that worker was handed ``min_rows`` rows (so the other workers' stateless operators
    stay idle on a small step, and many small pushes still spread); a larger push is cut in slices of at least
    ``min_rows`` rows, in order, over up to all the workers."""
    def z(n: int, base: int = 0) -> dbsp.ZSet:
        return to_zset({(base + i, "a", i, None): 1 for i in range(n)}, BIDS)

    def rows(per: list[dict]) -> list[int]:
        return [sum(p.num_rows for ps in pend.values() for p in ps) for pend in per]

    for cursor in range(3):
        small = spread([("bids", z(5)), ("other", z(3, 200)), ("bids", z(4, 100)), ("bids", z(2, 300))], 3, cursor,
                       min_rows=10)
        assert rows(small) == [{cursor: 12, (cursor + 1) % 3: 2}.get(w, 0) for w in range(3)]
        assert [p.num_rows for p in small[cursor]["bids"]] == [5, 4] and small[cursor]["other"][0].num_rows == 3
        # a push of 25 rows: two slices of at least 10, from the cursor on, in order
        big = spread([("bids", z(25))], 3, cursor, min_rows=10)
        assert rows(big) == [{cursor: 13, (cursor + 1) % 3: 12}.get(w, 0) for w in range(3)]
        got = dbsp.ZSet.concat([big[cursor]["bids"][0], big[(cursor + 1) % 3]["bids"][0]])
        assert got == z(25)
        # 8 pushes of 4 rows: a worker is handed 12 rows (past 10), then the next worker
        many = spread([("bids", z(4, 10 * k)) for k in range(8)], 3, cursor, min_rows=10)
        assert rows(many) == [{cursor: 12, (cursor + 1) % 3: 12, (cursor + 2) % 3: 8}[w] for w in range(3)]
        # at most one slice per worker
        assert rows(spread([("bids", z(100))], 3, cursor, min_rows=10)) == [34 if w == cursor else 33
                                                                            for w in range(3)]


def test_spread_over_one_worker_hands_every_push_whole() -> None:
    """executor.spread at W = 1 (its shortcut): every non-empty push whole, the same objects, in order, by handle,
    only the handles of ``keep``; whatever the cursor and ``min_rows``."""
    def z(n: int, base: int = 0) -> dbsp.ZSet:
        return to_zset({(base + i, "a", i, None): 1 for i in range(n)}, BIDS)

    pushes = [("bids", z(5)), ("other", z(0)), ("bids", z(3000)), ("other", z(3, 200)), ("bids", z(0))]
    for cursor, min_rows in ((0, 1), (7, 10), (1, 1024)):
        [one] = spread(pushes, 1, cursor, min_rows=min_rows)
        assert list(one) == ["bids", "other"]
        assert [id(p) for p in one["bids"]] == [id(pushes[0][1]), id(pushes[2][1])]
        assert [id(p) for p in one["other"]] == [id(pushes[3][1])]
        [kept] = spread(pushes, 1, cursor, keep={"other"}, min_rows=min_rows)
        assert list(kept) == ["other"] and kept["other"][0] is pushes[3][1]


def test_step_without_input_and_closed_pipeline() -> None:
    p = _pipeline()
    assert {k: v.to_dict() for k, v in p.step().items()} == {"all": {}, "g": {}}
    p.close()
    with pytest.raises(DbspError):
        p.step()


def test_a_step_failing_on_its_data_keeps_the_pipeline_and_other_failures_break_it() -> None:
    """A user function raising on the data: StepError, and the pipeline stays usable (the step waits); an I/O
    error (not the data's fault) still breaks the pipeline."""
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    fail = {"with": RuntimeError("boom")}

    def boom(batch: pa.RecordBatch) -> pa.RecordBatch:
        if fail["with"] is not None and batch.num_rows:
            raise fail["with"]
        return batch

    c.output("x", b.flat_map(boom, schema=BIDS).distinct())
    with dbsp.Pipeline(c, workers=2) as p:
        p.push("bids", GOOD)
        with pytest.raises(StepError, match="step 0 failed on its data in flat_map#1: RuntimeError: boom") as info:
            p.step()
        assert isinstance(info.value.__cause__, RuntimeError) and p.steps == 0
        p.push("bids", GOOD)
        fail["with"] = OSError(5, "disk gone")
        with pytest.raises(OSError):
            p.step()
        with pytest.raises(DbspError, match="broken"):
            p.push("bids", GOOD)


def test_shard_map_is_contiguous_slices() -> None:
    m = dbsp.ShardMap(workers=3, shard_bits=4)
    owners = m.part_of_shard.tolist()
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}
    assert [len(m.shards_of(w)) for w in range(3)] in ([6, 5, 5], [5, 6, 5], [5, 5, 6])
    assert m.shard_of_hash(np.array([0, 2**63, 2**64 - 1], dtype=np.uint64)).tolist() == [0, 8, 15]
    grown = dbsp.ShardMap(workers=4, shard_bits=4)
    assert 0 < len(m.moved_shards(grown)) < 16
    with pytest.raises(ValueError):
        dbsp.ShardMap(workers=5, shard_bits=2)
    lay = dbsp.Layout(m, hosts=("h1", "h1", "h2"))
    assert lay.workers_on("h1") == [0, 1]


def test_exchange_routes_rows_by_shard_owner() -> None:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("x", b._exchanged(("auction",)))
    with dbsp.Pipeline(c, workers=2, shard_bits=3) as p:
        z = to_zset({(i, "a", i, None): 1 for i in range(40)}, BIDS)
        for w, pend in enumerate(spread([("bids", z)], 2, 0, min_rows=1)):
            p.executor._workers[w].ctx.begin({"bids": dbsp.ZSet.concat(pend["bids"])}, None, None, None)
        import threading

        got = [None, None]
        ts = [threading.Thread(target=lambda w=w: got.__setitem__(w, p.executor._workers[w].step()["x"]))
              for w in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for w in range(2):
            shards = p.shard_map.shard_of_hash(got[w].hash(["auction"]))
            assert set(p.shard_map.part_of_shard[shards].tolist()) <= {w}
        assert dbsp.ZSet.concat(got) == z


def test_trace_spine_merges_and_extracts_shards() -> None:
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t = Trace(schema, ("k",))
    rng = np.random.default_rng(1)
    total = dbsp.ZSet.empty(schema)
    for _ in range(30):
        z = dbsp.ZSet.from_arrow(pa.table({"k": rng.integers(0, 50, 20), "v": rng.integers(0, 3, 20)}, schema=schema),
                                 weights=rng.choice([-1, 1, 2], 20))
        t.insert(z.index_by(["k"]))
        total = total + z
    assert len(t.batches) <= 8
    assert t.merged_rows > 0
    assert t.consolidated().zset == total
    parts = [t.shard(3, s).zset for s in range(8)]
    assert dbsp.ZSet.concat(parts) == total
    hs = np.unique(total.hash(["k"])[:5])
    looked = dbsp.ZSet.concat([b.zset for b in t.lookup(hs)] or [dbsp.ZSet.empty(schema)])
    keys = set(total.data.column("k").take(pa.array(np.flatnonzero(np.isin(total.hash(["k"]), hs)))).to_pylist())
    assert set(k for (k, _v) in looked.to_dict()) == keys




def test_keyed_state_lives_in_the_shards_of_its_worker() -> None:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("g", b.group_by("auction").agg(n=dbsp.count(), lo=dbsp.min("price")))
    c.output("d", b.distinct())
    with dbsp.Pipeline(c, workers=2, shard_bits=4) as p:
        p.push("bids", to_zset({(i, "a", i % 7, None): 1 for i in range(200)}, BIDS))
        p.step()
        total_rows = 0
        for w in range(2):
            for trace in p.traces(w).values():
                for s in range(16):
                    rows = len(trace.shard(4, s))
                    total_rows += rows
                    assert rows == 0 or p.shard_map.worker_of(s) == w
        # the aggregate keeps 200 group totals and 200 (auction, price) values for min; distinct keeps 200 rows
        assert total_rows == 600


def test_a_worker_failing_alone_reports_its_own_error() -> None:
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)

    def fail_on_two(batch: pa.RecordBatch) -> pa.RecordBatch:
        if 2 in batch.column(0).to_pylist():
            raise ValueError("row 2 is bad")
        return batch

    c.output("x", b.flat_map(fail_on_two, schema=BIDS).distinct())
    for workers in (2, 4):
        with dbsp.Pipeline(c, workers=workers) as p:
            p.push("bids", to_zset({(i, "a", i, None): 1 for i in range(8)}, BIDS))
            with pytest.raises(StepError, match="ValueError: row 2 is bad") as info:
                p.step()
            assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_step_leaves_no_trace_in_the_key_indexes(workers: int) -> None:
    """Trace invariant 11 under executor invariant 4: the distinct's and the aggregate's traces (and their key
    indexes) take the failing step's rows before a later operator raises; after the rollback and a discard, every
    step's output is what a pipeline that never saw the bad push gives, and the indexes match the batches."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])

    def circuit() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", schema)
        c.output("d", t.select(k="k").distinct())
        c.output("s", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))

        def boom(batch: pa.RecordBatch) -> pa.RecordBatch:  # fails after both stateful operators have run
            if batch.num_rows and 666 in batch.column("v").to_pylist():
                raise ValueError("poison")
            return batch
        c.output("x", t.flat_map(boom, schema=schema))  # a later node id: runs after distinct and group_by
        return c

    rng = np.random.default_rng(3)
    steps = [pa.table({"k": rng.integers(0, 20, 30), "v": rng.integers(0, 50, 30)}, schema=schema) for _ in range(6)]
    poison = pa.table({"k": [1, 2, 3, 99], "v": [5, 6, 666, 7]}, schema=schema)
    with dbsp.Pipeline(circuit(), workers=workers) as p, dbsp.Pipeline(circuit(), workers=workers) as ref:
        for i, data in enumerate(steps):
            p.push("t", data)
            ref.push("t", data)
            if i == 2:
                p.push("t", poison)
                with pytest.raises(StepError) as info:
                    p.step()
                producer, seq = info.value.inputs[-1][1:]
                p.discard(producer, seq)
            got, want = p.step(), ref.step()
            assert {n: z.to_dict() for n, z in got.items()} == {n: z.to_dict() for n, z in want.items()}
        for wk in p.executor._workers:
            for inst in wk.stateful().values():
                for tr in vars(inst).values():
                    if isinstance(tr, Trace):
                        tr.check()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_bag_handed_through_is_copied_once(workers: int, monkeypatch) -> None:
    """embedded.py invariant 3: a pushed bag with a few equal rows (some in one worker's slice, some in two),
    handed through to an output, is made distinct by one gather on the driver, not one per worker and then a
    copy to concatenate the workers' parts."""
    from dbsp_core import zset as zset_mod

    takes = []
    real = zset_mod._take
    monkeypatch.setattr(zset_mod, "_take", lambda t, idx, view=None: takes.append(len(idx)) or real(t, idx, view))
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8())])
    c = dbsp.Circuit()
    c.output("all", c.input("t", schema))
    n = 3000
    k = np.arange(n)
    k[[1, 2, n // 2 + 1, n - 1]] = [0, 0, n // 2, 1]  # equal rows inside the first slice, and across slices
    data = pa.table({"k": k, "s": pa.array([f"row {x}" for x in k])}, schema=schema)
    with dbsp.Pipeline(c, workers=workers) as p:
        for _ in range(2):
            p.push("t", data)
            takes.clear()
            z = p.step()["all"]
            assert len(takes) == 1, takes
            want: dict = {}
            for x in k.tolist():
                want[(x, f"row {x}")] = want.get((x, f"row {x}"), 0) + 1
            assert z.to_dict() == want and z._distinct and z.num_rows == len(want)


@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", None]), st.sampled_from([1, 1, 2, -1])),
                         max_size=12), min_size=1, max_size=4), st.sampled_from([1, 2, 3]))
def test_step_output_sums_equal_rows_across_workers_without_a_sort(steps, workers) -> None:
    """embedded.py invariant 3: a pass-through and a projection, whose equal rows land on different workers (the
    input is spread by position), hand over each step's change with equal rows summed and zero sums dropped (the
    model's multiset), distinct, unsorted (ZSet._distinct_unsorted), with the stored rows' row hashes when it holds
    any (on one worker running the step whole it holds none: no sum reads them, csrc/zset.c design note 5)."""
    schema = pa.schema([("k", pa.int64()), ("s", pa.utf8())])
    c = dbsp.Circuit()
    t = c.input("t", schema)
    c.output("all", t)
    c.output("keys", t.select(k="k"))
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in steps:
            if step:
                p.push("t", dbsp.ZSet.from_rows([(k, s) for k, s, _ in step], schema, weights=[w for *_, w in step]))
            out = p.step()
            for name, cols in (("all", (0, 1)), ("keys", (0,))):
                model: dict = {}
                for row in step:
                    key = tuple(row[i] for i in cols)
                    model[key] = model.get(key, 0) + row[2]
                z = out[name]
                got = z.to_dict()
                assert got == {r: w for r, w in model.items() if w}
                assert z._distinct and z.num_rows == len(got) and 0 not in z.weights.tolist()
                assert z._rhash is None or np.array_equal(z._rhash, dbsp_zset.hash_columns(
                    z.data, list(range(z.data.num_columns))))
                if workers > 1 and z.num_rows:  # a sum of the workers' parts: from their row hashes
                    assert z._rhash is not None
