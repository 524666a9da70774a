"""Checkpoints save a trace's pending batches as they are (snapshot invariant 3): no merges the running pipeline would not do, and recovery restores the same spine and pending batches."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import envvars
from dbsp_core.storage.formats import state_db_path
from dbsp_core.errors import CorruptionError
from dbsp_core.storage.snapshot import WorkerSnapshot
from dbsp_core.storage import Database
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures"))
from auction import auction_circuit  # noqa: E402

BIDS = pa.schema([("auction", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])


def circuit() -> dbsp.Circuit:
    """A join whose bids side is written every step but read only when auctions change (a restored trace that
    is not read keeps its inserts pending: trace invariant 5)."""
    return auction_circuit(BIDS, AUCTIONS)[0]


def bids(k: int, n: int = 300) -> pa.Table:
    rng = np.random.default_rng(k)
    return pa.table({"auction": rng.integers(0, 50, n), "price": rng.integers(1, 100, n)}, schema=BIDS)


def traces(p) -> dict:
    """Every trace's (settled batch sizes, pending batch sizes, consolidated content) per worker and name."""
    out = {}
    for w in range(p.workers):
        for name, t in p.traces(w).items():
            spine, pending = t.parts()  # no settling: reading t.batches would merge
            parts = [b.zset for b in spine + pending]
            whole = dbsp.ZSet.concat(parts).to_dict() if parts else {}
            out[(w, name)] = ([len(b) for b in spine], [len(b) for b in pending], whole)
    return out


def batches(p, w: int = 0) -> list[IndexedZSet]:
    """Every batch of worker ``w``'s traces, settled then pending (read without settling)."""
    return [b for t in p.traces(w).values() for part in t.parts() for b in part]


def expected(k: int) -> dict:
    """by_cat's view after bids 0..k-1 and auctions 0..49 (category id % 5)."""
    acc: dict = {}
    for i in range(k):
        t = bids(i)
        for a, pr in zip(t.column("auction").to_pylist(), t.column("price").to_pylist()):
            n, s = acc.get(a % 5, (0, 0))
            acc[a % 5] = (n + 1, s + pr)
    return {(c, n, s): 1 for c, (n, s) in acc.items()}


def view(p) -> dict:
    acc: dict = {}
    for _, z in p.read_output("by_cat"):
        for row, w in z.to_dict().items():
            acc[row] = acc.get(row, 0) + w
    return {r: w for r, w in acc.items() if w}


def test_checkpoints_keep_pending_batches_pending_and_recovery_restores_them(tmp_path, monkeypatch):
    # without a budget (also under CI's DBSP_MEMORY_LIMIT=1): under one, the batch store places a restored trace's
    # pending batches once the budget is exceeded (trace/spill.py "What is not spilled"), which is not this test's
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
    p.push("bids", bids(0))
    p.step()
    p.checkpoint()
    p.close(checkpoint=False)
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)  # restored traces keep inserts pending
    for k in range(1, 6):  # no auctions yet: nothing reads the bids trace
        p.push("bids", bids(k))
        p.step()
    before = traces(p)
    merges = []
    real_merge = IndexedZSet.merge
    monkeypatch.setattr(IndexedZSet, "merge", lambda self, other: merges.append(1) or real_merge(self, other))
    merged = [t.merged_rows for w in range(p.workers) for t in p.traces(w).values()]
    p.checkpoint()
    assert merges == [], "the checkpoint merged trace batches"
    assert [t.merged_rows for w in range(p.workers) for t in p.traces(w).values()] == merged
    assert traces(p) == before
    bid_side = [v for (w, name), v in before.items() if "join" in name and len(v[1]) >= 5]
    assert len(bid_side) == 2, before  # each worker's bids trace: five batches still pending
    monkeypatch.setattr(IndexedZSet, "merge", real_merge)
    for k in range(6, 9):  # more pending batches after the checkpoint, saved by the next one
        p.push("bids", bids(k))
        p.step()
    p.checkpoint()
    before = traces(p)
    p.close(checkpoint=False)
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert p.stats["replayed_steps"] == 0
    assert traces(p) == before  # the same settled and pending batches, not merged on load
    p.close(checkpoint=False)  # the databases are locked while the pipeline has them open
    groups = _group_counts(d, 2)
    assert any(c >= 3 for c in groups.values()), groups  # the pending bids batches were saved as groups
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    p.push("auctions", pa.table({"id": np.append(np.arange(50), 1000), "category": np.append(np.arange(50) % 5, 0)},
                                schema=AUCTIONS))  # the join looks them up in the bids trace: the read inserts
    p.push("bids", bids(9))  # (and merges) its pending batches
    p.step()
    left = [pend for (w, name), (_, pend, _) in traces(p).items() if "join" in name and "left" in name]
    assert len(left) == 2 and min(len(pend) for pend in left) <= 1, left  # settled, then bids(9) inserted
    p.checkpoint()  # merged-away batches and broken groups are deleted, the merges and survivors saved
    before = traces(p)
    p.close(checkpoint=False)
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert traces(p) == before
    assert view(p) == expected(10)
    p.close()


def _group_counts(d: str, workers: int) -> dict:
    """{(worker, table): largest batch count of one stored group} of the newest version."""
    from dbsp_core.codec import decode_json

    out = {}
    for w in range(workers):
        with Database(state_db_path(d, None, w), readonly=True) as db, db.read(db.versions().stop - 1) as h:
            for k, v in h.scan("snapshot", prefix=b"order."):
                out[(w, k[6:].decode())] = max(decode_json(b"DORD", v, "t").get("counts", [1]))
    return out


class _Holder:
    def __init__(self) -> None:
        self.t = Trace(pa.schema([("k", pa.int64()), ("v", pa.int64())]), ("k",))


def _shape(t: Trace) -> tuple:
    spine, pending = t.parts()
    return ([b.zset.to_dict() for b in spine], [b.zset.to_dict() for b in pending])


@pytest.mark.parametrize("seed", range(8))
def test_saved_batches_and_groups_load_back_as_the_same_trace(tmp_path, seed):
    """Random inserts, reads (settles) and saves: after every save a fresh load has the same settled and pending
    batches, and a save after loading writes nothing new (a model test of snapshot invariants 3-5)."""
    import random

    rng = random.Random(seed)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    h, v = _Holder(), 0
    snap = WorkerSnapshot({1: h}, 3, group_pending=bool(seed % 4))
    with Database(str(tmp_path / "db")) as db:
        for rnd in range(14):
            for _ in range(rng.choice([0, 1, 1, 2, 4])):
                rows = [(rng.randrange(30), rng.randrange(4)) for _ in range(rng.randrange(1, 3 * (rnd + 2)))]
                z = dbsp.ZSet.from_rows(rows, schema, weights=[rng.choice([1, 1, -1]) for _ in rows])
                ix = z.index_by(["k"])
                if len(ix):
                    h.t.insert(ix)
            if rng.random() < 0.3:
                h.t.batches  # a read settles the pending batches
            with db.open(v) as txn:
                snap.save(txn)
                txn.commit()
            v += 1
            g = _Holder()
            again = WorkerSnapshot({1: g}, 3, group_pending=snap.group_pending)
            with db.open(v) as txn:
                again.load(txn, "test")
                assert _shape(g.t) == _shape(h.t), rnd
                assert [op for op in again.prepare() if op[0] in ("batch", "group", "delete")] == []
            if rng.random() < 0.3:  # go on from the loaded copy, as recovery does
                h, snap = g, again


def test_a_batch_order_record_that_does_not_match_the_table_is_corruption(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=1, storage=d, checkpoint_interval=None)
    p.push("auctions", pa.table({"id": np.arange(50), "category": np.arange(50) % 5}, schema=AUCTIONS))
    for k in range(3):
        p.push("bids", bids(k))
        p.step()
    p.close()
    from dbsp_core.codec import decode_json, encode_json

    with Database(state_db_path(d, None, 0)) as db:
        v = db.versions().stop - 1
        with db.open(v) as h:
            key, rec = next((k, v) for k, v in h.scan("snapshot", prefix=b"order.")
                            if len(decode_json(b"DORD", v, "t")["numbers"]) > 1)
            got = decode_json(b"DORD", rec, "t")
            h.put("snapshot", key, encode_json(b"DORD", {"numbers": got["numbers"][1:], "settled": 0}))
            h.commit()
    with pytest.raises(CorruptionError, match="recorded batch order"):
        dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert os.path.exists(d)


def test_batches_merged_away_after_a_checkpoint_are_freed_before_the_next(tmp_path):
    """The checkpoint's record of saved batches holds them weakly: a batch merged away is freed at once, not kept
    until the next checkpoint (which held up to a second copy of the trace); the next checkpoint deletes its
    values and a reopen restores exactly the live batches.

    With totals kept per key (trace invariant 19) a step inserts no batch: a read syncs one. The read of the
    batches after each step (``batches``, which syncs) makes every step leave its batch either way, so the
    checkpoint saves the same spine as without totals per key (not a single synced batch, which the later steps'
    smaller batches, merging among themselves, would not reach in 200 steps)."""
    import gc
    import weakref

    d = str(tmp_path / "d")
    c = dbsp.Circuit()
    b = c.input("bids", BIDS)
    c.output("per_auction", b.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price")))
    p = dbsp.Pipeline(c, workers=1, storage=d, checkpoint_interval=None)
    for k in range(6):
        p.push("bids", bids(k))
        p.step()
        batches(p)  # (a read: synced, with totals per key)
    p.checkpoint()
    saved = [weakref.ref(x) for x in batches(p)]
    assert saved
    def in_trace() -> set[int]:
        return {id(x) for x in batches(p)}

    k = 6
    while all(r() is not None and id(r()) in in_trace() for r in saved):  # steps until some batch saved then
        p.push("bids", bids(k))  # has been merged away
        p.step()
        p.executor.settle_merges()
        k += 1
        assert k < 200, "no saved batch was merged away"
    gone = sum(1 for r in saved if r() is None or id(r()) not in in_trace())
    gc.collect()
    live = in_trace()
    kept = [r() for r in saved if r() is not None and id(r()) not in live]
    assert gone and kept == [], f"{len(kept)} of {gone} batches merged away are still in memory"
    p.checkpoint()
    want = dbsp.ZSet.concat([x.zset for x in batches(p)])
    p.close(checkpoint=False)
    p = dbsp.Pipeline.open(d, c, checkpoint_interval=None)
    got = dbsp.ZSet.concat([x.zset for x in batches(p)])
    assert got.to_dict() == want.to_dict()
    p.close(checkpoint=False)


def test_the_record_of_saved_batches_never_loses_the_keys_of_a_batch_that_is_gone():
    """An id is unique only among live objects: when a batch that is gone left its entry under an id a new batch
    now has, recording the new batch keeps the old entry (under a key no batch has) so the next save deletes its
    keys; a purge turns the keys of gone batches into orphans, and a group any member of which is gone gives up
    its live members too (saved again)."""
    import gc
    import weakref

    def batch(k: int) -> IndexedZSet:
        return dbsp.ZSet.from_arrow(bids(k, 5)).index_by(["auction"])

    snap = WorkerSnapshot({}, 4)
    saved = snap._saved.setdefault("t", {})
    gone = batch(0)
    dead = weakref.ref(gone)
    del gone
    gc.collect()
    assert dead() is None
    b = batch(1)
    saved[id(b)] = (dead, [b"old"])  # what a gone batch leaves when its id is given to b
    snap._put(saved, b, [b"new"])
    assert saved[id(b)][0]() is b and saved[id(b)][1] == [b"new"]
    assert [v[1] for k, v in saved.items() if k != id(b)] == [[b"old"]], "the gone batch's keys were forgotten"
    g1, g2 = batch(2), batch(3)
    group = [b"g"]
    snap._put(saved, g1, group)
    snap._put(saved, g2, group)
    del g2
    gc.collect()
    snap._purge("t")
    assert sorted(snap._orphans["t"]) == [[b"g"], [b"old"]]
    assert list(saved) == [id(b)], "a live member of a group with a member gone kept its entry"
