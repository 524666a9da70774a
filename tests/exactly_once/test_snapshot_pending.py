"""Checkpoints save a trace's pending batches as they are (snapshot invariant 3): no merges the running pipeline would not do, and recovery restores the same spine and pending batches."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.coordinator import worker_db_path
from dbsp_core.errors import CorruptionError
from dbsp_core.storage import Database
from dbsp_core.zset import IndexedZSet

BIDS = pa.schema([("auction", pa.int64()), ("price", pa.int64())])
AUCTIONS = pa.schema([("id", pa.int64()), ("category", pa.int64())])


def circuit() -> dbsp.Circuit:
    """A join whose bids side is written every step but read only when auctions change."""
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    auctions = c.input("auctions", AUCTIONS)
    j = bids.join(auctions, left_on="auction", right_on="id")
    c.output("by_cat", j.group_by("category").agg(n=dbsp.count(), total=dbsp.sum("price")))
    return c


def bids(k: int, n: int = 300) -> pa.Table:
    rng = np.random.default_rng(k)
    return pa.table({"auction": rng.integers(0, 50, n), "price": rng.integers(1, 100, n)}, schema=BIDS)


def traces(p) -> dict:
    """Every trace's (settled batch sizes, pending batch sizes, consolidated content) per worker and name."""
    out = {}
    for w in range(p.workers):
        for name, t in p.traces(w).items():
            parts = [b.zset for b in t._spine + t.pending]  # no settling: reading t.batches would merge
            whole = dbsp.ZSet.concat(parts).to_dict() if parts else {}
            out[(w, name)] = ([len(b) for b in t._spine], [len(b) for b in t.pending], whole)
    return out


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
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
    p.push("auctions", pa.table({"id": np.arange(50), "category": np.arange(50) % 5}, schema=AUCTIONS))
    p.step()
    for k in range(6):
        p.push("bids", bids(k))
        p.step()
    before = traces(p)
    merges = []
    real_merge = IndexedZSet.merge
    monkeypatch.setattr(IndexedZSet, "merge", lambda self, other: merges.append(1) or real_merge(self, other))
    p.checkpoint()
    assert merges == [], "the checkpoint merged trace batches"
    assert traces(p) == before
    bid_side = [v for (w, name), v in before.items() if "join" in name and len(v[1]) >= 5]
    assert len(bid_side) == 2, before  # each worker's bids trace: six batches still pending
    monkeypatch.undo()
    for k in range(6, 9):  # more pending batches after the checkpoint, saved by the next one
        p.push("bids", bids(k))
        p.step()
    p.checkpoint()
    before = traces(p)
    p.close(checkpoint=False)
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert p.stats["replayed_steps"] == 0
    assert traces(p) == before  # the same settled and pending batches, not merged on load
    p.push("auctions", pa.table({"id": [7], "category": [7 % 5]}, schema=AUCTIONS).slice(0, 0))
    p.push("bids", bids(9))
    p.step()
    p.checkpoint()  # after reads settled the traces: merged-away batches are deleted, the merges saved
    before = traces(p)
    p.close(checkpoint=False)
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert traces(p) == before
    assert view(p) == expected(10)
    p.close()


def _drop_order_records(d: str, workers: int) -> None:
    """Rewrite every worker's newest version without the batch-order records (a checkpoint written before them)."""
    for w in range(workers):
        with Database(worker_db_path(d, w)) as db:
            v = db.versions().stop - 1
            with db.open(v) as h:
                for k, _ in list(h.scan("snapshot", prefix=b"order.")):
                    h.delete("snapshot", k)
                h.commit()


def test_checkpoints_without_batch_order_records_load_in_number_order(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
    p.push("auctions", pa.table({"id": np.arange(50), "category": np.arange(50) % 5}, schema=AUCTIONS))
    for k in range(5):
        p.push("bids", bids(k))
        p.step()
    p.close()  # checkpoints with pending batches
    _drop_order_records(d, 2)
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert all(not pend for _, pend, _ in traces(p).values())  # loaded as one settled spine, as before
    p.push("bids", bids(5))
    p.step()
    p.close()
    p = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    p.push("auctions", pa.table({"id": [0], "category": [0]}, schema=AUCTIONS).slice(0, 0))
    p.step()
    assert view(p) == expected(6)
    p.close()


def test_a_batch_order_record_that_does_not_match_the_table_is_corruption(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=1, storage=d, checkpoint_interval=None)
    p.push("auctions", pa.table({"id": np.arange(50), "category": np.arange(50) % 5}, schema=AUCTIONS))
    for k in range(3):
        p.push("bids", bids(k))
        p.step()
    p.close()
    from dbsp_core.codec import decode_json, encode_json

    with Database(worker_db_path(d, 0)) as db:
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
