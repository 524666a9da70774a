"""Background merging (trace invariant 10, ``EmbeddedExecutor(background_merge=...)``): a pipeline whose trace merges run
on a merge thread gives, step by step, the same outputs as one that merges on its workers' threads, and DuckDB's
answer over the integrated input; a trace keeps its content through a rollback and reports a merge thread's failure."""

from __future__ import annotations

import os

import duckdb
import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.trace import MergeThread, Trace, merging

BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])
SEED = int(os.environ.get("DBSP_TEST_SEED", np.random.SeedSequence().entropy % 2**32))


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    b, a = c.input("bids", BIDS), c.input("auctions", AUCTIONS)
    c.output("agg", b.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price"), hi=dbsp.max("price")))
    c.output("cat", b.join(a, left_on="auction", right_on="id").group_by("category").agg(n=dbsp.count()))
    c.output("pairs", b.select(auction="auction", bidder="bidder").distinct())
    return c


SQL = {"agg": "SELECT auction, COUNT(*), SUM(price), MAX(price) FROM bids GROUP BY auction",
       "cat": "SELECT category, COUNT(*) FROM bids JOIN auctions ON auction = id GROUP BY category",
       "pairs": "SELECT DISTINCT auction, bidder FROM bids"}


@pytest.mark.parametrize("workers", [1, 2])
def test_background_merging_gives_the_same_outputs_step_by_step_and_duckdbs_answer(workers):
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    rng = np.random.default_rng(SEED)
    n_auctions = 500
    auctions = pa.table({"id": np.arange(n_auctions), "category": np.arange(n_auctions) % 7}, schema=AUCTIONS)
    live: list[pa.Table] = []
    steps = []
    for _ in range(60):  # inserts and deletions of earlier rows, in steps of varied size
        n = int(rng.choice([5, 50, 400, 3000]))
        ins = pa.table({"auction": rng.integers(0, n_auctions, n), "bidder": rng.integers(0, 30, n),
                        "price": rng.integers(1, 1000, n)}, schema=BIDS)
        dels = None
        if live and rng.random() < 0.5:
            src = live.pop(int(rng.integers(0, len(live))))
            dels = src.slice(0, int(rng.integers(1, src.num_rows + 1)))
            if dels.num_rows < src.num_rows:
                live.append(src.slice(dels.num_rows))
        live.append(ins)
        steps.append((ins, dels))
    outs = {}
    for bg in (False, True):
        ex = EmbeddedExecutor(background_merge=bg)
        got = []
        with dbsp.Pipeline(_circuit(), workers=workers, executor=ex) as p:
            p.push("auctions", auctions)
            for ins, dels in steps:
                p.push("bids", ins)
                if dels is not None:
                    p.push("bids", dels, weights=np.full(dels.num_rows, -1))
                got.append({k: z.to_dict() for k, z in p.step().items()})
            if bg:
                assert ex._merge_thread is not None and ex._merge_thread.merged_rows > 0, "the merge thread merged nothing"
        outs[bg] = got
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):
        assert a == b, f"step {i}: outputs differ with background merging (W={workers}, seed={SEED})"
    bids = pa.concat_tables(live)
    con = duckdb.connect()
    con.register("bids", bids)
    con.register("auctions", auctions)
    for name, sql in SQL.items():
        want = {tuple(r): 1 for r in con.execute(sql).fetchall()}
        acc: dict = {}
        for step in outs[True]:
            for r, w in step[name].items():
                acc[r] = acc.get(r, 0) + w
        assert {r: w for r, w in acc.items() if w} == want, f"{name} differs from DuckDB (seed={SEED})"


S = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _z(seed: int, n: int) -> dbsp.ZSet:
    rng = np.random.default_rng(seed)
    return dbsp.ZSet.from_arrow(pa.table({"k": rng.integers(0, 5000, n), "v": rng.integers(0, 3, n)}, schema=S))


@pytest.fixture
def hand_over_all(monkeypatch):
    """Every merge handed to the merge thread, however small (Trace.INLINE_MERGE keeps small ones inline)."""
    monkeypatch.setattr(Trace, "INLINE_MERGE", 0)


def test_a_rollback_under_a_merger_keeps_the_content_it_captured(hand_over_all):
    with MergeThread() as bg, merging(bg):
        t = Trace(S, ("k",))
        model = dbsp.ZSet.empty(S)
        for i in range(40):
            z = _z(i, 500)
            t.insert(z.index_by(["k"]))
            model = dbsp.ZSet.concat([model, z])
        saved = {k: (list(v) if isinstance(v, list) else v) for k, v in vars(t).items()}
        want = model.to_dict()
        for i in range(40, 80):  # merges in progress at the capture go on, on both threads
            t.insert(_z(i, 500).index_by(["k"]))
        bg.wait_idle(30)
        vars(t).clear()
        vars(t).update({k: (list(x) if isinstance(x, list) else x) for k, x in saved.items()})
        assert t.consolidated().zset.to_dict() == want
        t.check()
        t.insert(_z(999, 500).index_by(["k"]))
        assert t.consolidated().zset.to_dict() == dbsp.ZSet.concat([model, _z(999, 500)]).to_dict()


def test_a_merge_that_failed_on_the_merger_thread_fails_the_insert_that_needs_it(hand_over_all):
    with MergeThread() as bg:
        bg.close()  # a stopped merge thread: handed merges stay where they are, so the test controls them
        with merging(bg):
            t = Trace(S, ("k",))
            t.insert(_z(1, 300).index_by(["k"]))
            t.insert(_z(2, 300).index_by(["k"]))  # two loose batches at one level: a merge starts, handed over
            m = next(lv.merge for lv in t._by_level if lv.merge is not None)
            assert m.shared is not None and not m.cursor.done
            m.shared.error = MemoryError("merge buffers")
            with pytest.raises(MemoryError, match="merge buffers"):
                for i in range(3, 50):  # soon the merge is due and the inserting thread needs it
                    t.insert(_z(i, 300).index_by(["k"]))


def test_settle_merges_leaves_no_merge_in_flight_and_the_state_unchanged(hand_over_all):
    ex = EmbeddedExecutor(background_merge=True)
    c = dbsp.Circuit()
    t = c.input("t", S)
    c.output("n", t.group_by("k").agg(n=dbsp.count()))
    with dbsp.Pipeline(c, workers=1, executor=ex) as p:
        for i in range(30):
            p.push("t", _z(i, 4000).data)
            p.step()
        content = {k: tr.consolidated().zset.to_dict() for k, tr in ex.traces(0).items()}
        ex.settle_merges()
        assert ex._merge_thread.wait_idle(0)
        for name, tr in ex.traces(0).items():
            for _, _, m in tr.levels():
                assert m is None, f"{name}: a merge still in progress after settle_merges: {tr}"
            assert tr.consolidated().zset.to_dict() == content[name]
            tr.check()


def test_small_merges_stay_on_the_inserting_thread_and_large_ones_are_handed_over():
    """Trace.INLINE_MERGE: a merge of at most that many rows of work advances by fuel on the inserting thread (a
    hand-over costs more than the merge), so a merge thread serving small steps merges nothing; a larger one goes to the
    merge thread. The content is the same either way."""
    with MergeThread() as bg, merging(bg):
        t = Trace(S, ("k",))
        model = dbsp.ZSet.empty(S)
        for i in range(16):  # 16 x 200 rows: every merge's work is at most 3,200 rows
            z = _z(i, 200)
            t.insert(z.index_by(["k"]))
            model = dbsp.ZSet.concat([model, z])
        assert bg.wait_idle(30) and bg.merged_rows == 0 and t.merged_rows > 0
        for i in range(16, 20):  # two 5,000-row batches make a merge of 10,000 rows: handed over
            z = _z(i, 5000)
            t.insert(z.index_by(["k"]))
            model = dbsp.ZSet.concat([model, z])
        assert bg.wait_idle(30) and bg.merged_rows > 0
        assert t.consolidated().zset.to_dict() == model.to_dict()
        t.check()


def test_the_merge_thread_trims_its_scratch_cache_when_it_runs_out_of_merges(hand_over_all, monkeypatch):
    """csrc/scratch.c's scratch cache is per thread and a step's end trims only the stepping thread's: the merge
    thread, once its queue is empty after merging, trims its own to DBSP_CACHE_KEEP_MB (buffers a large merge left
    stayed resident beside the state). Fails without the trim in ``MergeThread._loop`` (no call on that thread)."""
    import threading
    import time

    from dbsp_core import _zset
    from dbsp_core.envvars import settings

    real, seen = _zset.trim_caches, []

    def trim(keep, all_threads_memory=False):
        out = real(keep, all_threads_memory)
        seen.append((threading.current_thread().name, keep, _zset.cached_bytes()[0]))
        return out

    monkeypatch.setattr(_zset, "trim_caches", trim)
    with MergeThread() as bg, merging(bg):
        t = Trace(S, ("k",))
        for i in range(30):
            t.insert(_z(i, 3000).index_by(["k"]))
        bg.wait_idle(30)
        deadline = time.monotonic() + 10
        while not any(n == "dbsp-merge-thread" for n, _, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.01)
    mine = [(keep, left) for n, keep, left in seen if n == "dbsp-merge-thread"]
    assert mine and all(keep == settings().cache_keep_mb << 20 and left <= keep for keep, left in mine), seen


def test_a_merge_thread_that_stops_on_an_unexpected_error_leaves_no_waiter_hanging(hand_over_all, monkeypatch):
    """An error outside a merge's own step (here the queue scan, ``MergeThread._pick``) stops the thread as closed:
    ``wait_idle`` and ``settle_merges`` return instead of waiting for a thread that is gone (before: a pipeline's
    settle hung for ever), ``failed`` says so, and the traces finish their merges on the inserting thread with the
    content unchanged. Watched hang (wait_idle False after 5 s) with the loop's guard removed."""
    def broken(self, queued):  # noqa: ANN001
        raise TypeError("a bug in the queue scan")

    monkeypatch.setattr(MergeThread, "_pick", broken)
    from dbsp_core.operators.aggregate import _LinearState

    monkeypatch.setattr(_LinearState, "PER_KEY", False)  # the group-by's totals in step batches: merges to hand over
    ex = EmbeddedExecutor(background_merge=True)
    c = dbsp.Circuit()
    c.output("n", c.input("t", S).group_by("k").agg(n=dbsp.count()))
    twin_c = dbsp.Circuit()
    twin_c.output("n", twin_c.input("t", S).group_by("k").agg(n=dbsp.count()))
    with dbsp.Pipeline(c, workers=1, executor=ex) as p, dbsp.Pipeline(twin_c, workers=1) as twin:
        for i in range(30):
            p.push("t", _z(i, 4000).data)
            twin.push("t", _z(i, 4000).data)
            assert sorted(p.step()["n"].to_dict().items()) == sorted(twin.step()["n"].to_dict().items())
        assert ex._merge_thread.wait_idle(5), "a waiter hangs on a merge thread that stopped"
        assert ex._merge_thread.failed
        ex.settle_merges()
        for name, tr in ex.traces(0).items():
            assert tr.consolidated().zset.to_dict() == twin.executor.traces(0)[name].consolidated().zset.to_dict()
            tr.check()
