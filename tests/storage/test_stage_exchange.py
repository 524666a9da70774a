"""The exchange between stages through an object store (runtime/stage_store.py write_exchange / read_exchange) on moto's S3 server: one object a sender, each receiver's part read by a ranged GET and checked against the job, stage, receiver and sender, against a split of the same blobs by hand."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core.errors import CorruptionError, DbspError
from dbsp_core.runtime import stage_store
from dbsp_core.runtime.stage_plan import BLOB_SCHEMA
from dbsp_core.storage.remote import Remote

SEED = int(os.environ.get("DBSP_STAGE_STORE_SEED", np.random.SeedSequence().entropy % 10**6))


def _blobs(rng: np.random.Generator, workers: int, n: int) -> pa.Table:
    """``n`` blobs to random receivers (some receivers may get none), each payload naming its row."""
    parts = rng.integers(0, workers, n).astype(np.int32)
    return pa.table({"part": parts, "src": np.zeros(n, np.int32), "node": rng.integers(0, 5, n).astype(np.int32),
                     "step": np.full(n, 7, np.int64),
                     "payload": [rng.bytes(int(rng.integers(0, 300))) + str(i).encode() for i in range(n)]},
                    schema=BLOB_SCHEMA)


def _rows(t: pa.Table) -> Counter:
    return Counter(zip(*(t.column(c).to_pylist() for c in t.column_names)))


def test_one_object_a_sender_each_receiver_reads_its_part(s3_server, tmp_path) -> None:
    print(f"DBSP_STAGE_STORE_SEED={SEED}")
    rng = np.random.default_rng(SEED)
    remote = Remote.of(s3_server.uri(s3_server.bucket(), "pipe"), str(tmp_path))
    workers, stage = int(rng.integers(2, 6)), 1
    job = {"run": "r", "version": 3, "steps": [[7, 0, 0]], "chains": {"1": {"0": [{"object": "x"}]}}}
    sent_blobs = [_blobs(rng, workers, int(rng.integers(0, 40))) for _ in range(workers)]
    puts = remote.stats["puts"]
    sent = [stage_store.write_exchange(remote, job, stage, src, b, workers) for src, b in enumerate(sent_blobs)]
    assert remote.stats["puts"] - puts == workers, "one PUT a sender, not one a (sender, receiver)"
    gets = remote.stats["gets"]
    for w in range(workers):
        got = stage_store.read_exchange(remote, job, stage, w, sent)
        want = pa.concat_tables([b.filter(pa.compute.equal(b.column("part"), w)) for b in sent_blobs])
        assert _rows(got) == _rows(want) and got.num_rows == want.num_rows
    assert remote.stats["gets"] - gets == workers * workers
    # another job's, stage's or receiver's reader refuses the parts
    with pytest.raises(CorruptionError, match="another job"):
        stage_store.read_exchange(remote, dict(job, version=4), stage, 0, sent)
    swapped = [dict(s, ranges=[s["ranges"][1], s["ranges"][0]] + s["ranges"][2:]) for s in sent]
    with pytest.raises(CorruptionError):
        stage_store.read_exchange(remote, job, stage, 0, swapped)
    # a zombie of another job overwrites sender 0's object: its parts no longer check out
    stage_store.write_exchange(remote, dict(job, version=2), stage, 0, sent_blobs[0], workers)
    with pytest.raises(CorruptionError):
        stage_store.read_exchange(remote, job, stage, 0, sent)


def test_a_blob_to_no_worker_is_refused(s3_server, tmp_path) -> None:
    remote = Remote.of(s3_server.uri(s3_server.bucket(), "pipe"), str(tmp_path))
    b = _blobs(np.random.default_rng(SEED), 4, 10)
    b = b.set_column(0, "part", pa.array([3] + [0] * 9, pa.int32()))
    with pytest.raises(DbspError, match="addressed to workers"):
        stage_store.write_exchange(remote, {"run": "r"}, 1, 0, b, 3)
    assert [t.num_rows for t in stage_store.by_receiver(b, 4, "here")] == [9, 0, 0, 1]
