"""A durable pipeline with its storage on an S3 prefix (moto's server, tests/s3_server.py, through pyarrow's S3 client): outputs equal to the same pipeline on a local directory and to DuckDB, recovery into an empty cache, uploads that follow the change, retention, the newest complete manifest, compaction, and no credential in the store. Seeds: ``DBSP_REMOTE_SEED``."""

from __future__ import annotations

import os
import random
import sys
import tracemalloc

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core as dbsp
from dbsp_core import envvars
from dbsp_core.errors import CorruptionError, DbspError, RecoveryError
from dbsp_core.storage.formats import REMOTE_MANIFEST_DIR
from dbsp_core.storage import remote as remote_mod
from dbsp_core.runtime.remote_state import DOWNLOAD_THREADS, prepare_cache, restore
from dbsp_core.storage.remote import Remote, manifest_name
from dbsp_core.storage.remote_log import RemoteLogs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "exactly_once"))
from workload import integrate  # noqa: E402  (the integral helper the kill tests use)

SEED = int(os.environ.get("DBSP_REMOTE_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("s", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    c.output("d", t.select(k=pc.field("k")).distinct())
    return c


def _pushes(seed: int, n: int, rows: int = 50) -> list[pa.Table]:
    rng = random.Random(seed)
    return [pa.table({"k": [rng.randrange(40) for _ in range(rows)], "v": [rng.randrange(100) for _ in range(rows)]},
                     schema=SCHEMA) for _ in range(n)]


def _duckdb(tables: list[pa.Table]) -> dict:
    allrows = pa.concat_tables(tables)  # noqa: F841 - read by DuckDB
    return {tuple(r): 1 for r in duckdb.sql("SELECT k, count(*), sum(v) FROM allrows GROUP BY k").fetchall()}


def _run(storage, pushes: list[pa.Table], reopen_at: int, **kw) -> tuple[list[dict], dict]:
    """Push, step, checkpoint every third step; close and reopen at step ``reopen_at``; returns every step's
    output of "s" and the integral of "s"."""
    c = _circuit()
    p = dbsp.Pipeline(c, workers=2, storage=storage, checkpoint_interval=None, **kw)
    outs, acc = [], {}
    for i, t in enumerate(pushes):
        if i == reopen_at:
            p.close()
            p = dbsp.Pipeline.open(storage, c, checkpoint_interval=None, **kw)
            assert p.steps == i
        p.push("t", t, producer="gen", seq=i)
        out = p.step()["s"]
        outs.append(out.to_dict())
        integrate(acc, out)
        if i % 3 == 2:
            p.checkpoint()
    p.close()
    return outs, acc


def test_s3_outputs_equal_local_and_duckdb(s3_server, tmp_path):
    print(f"remote pipeline: seed {SEED} (replay: DBSP_REMOTE_SEED={SEED})")
    pushes = _pushes(SEED, 12)
    local, acc_local = _run(str(tmp_path / "local"), pushes, reopen_at=7)
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    # memory_limit=1: every trace spills, so checkpoints name batch files the store must hold
    remote, acc_remote = _run(uri, pushes, reopen_at=7, memory_limit=1)
    assert remote == local
    assert acc_remote == acc_local == _duckdb(pushes)
    # a new machine: an empty cache, everything from the store; the recovered state reads as DuckDB says
    p = dbsp.Pipeline.open(uri, _circuit(), cache_dir=str(tmp_path / "cache"), checkpoint_interval=None)
    try:
        acc: dict = {}
        for _, z in p.read_output("s"):
            integrate(acc, z)
        assert acc == _duckdb(pushes)
        assert sorted(os.listdir(tmp_path / "cache" / "spill")), "the state names batch files: restored from the store"
        p.push("t", pushes[0], producer="gen", seq=0)  # seen before the crash: the dedup set came from the store
        assert p.step()["s"].to_dict() == {}
    finally:
        p.close(checkpoint=False)


def test_uploads_follow_the_change_not_the_state(s3_server):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("s", t.group_by("k").agg(n=dbsp.count()))
    p = dbsp.Pipeline(c, workers=2, storage=uri, checkpoint_interval=None)
    try:
        rng = random.Random(SEED)
        big = pa.table({"k": list(range(200_000)), "v": [rng.randrange(9) for _ in range(200_000)]}, schema=SCHEMA)
        p.push("t", big)
        p.step()
        p.checkpoint()
        first = p.stats["remote"]
        small = []
        for i in range(3):
            p.push("t", pa.table({"k": [i], "v": [1]}, schema=SCHEMA))
            p.step()
            p.checkpoint()
            small.append(p.stats["remote"])
        print(f"state checkpoint: {first['delta_bytes']} delta bytes ({first['changed_bytes']} changed); small "
              f"ones: {[(s['delta_bytes'] + s['base_bytes'], s['changed_bytes']) for s in small]}")
        def sent(s: dict) -> int:  # state bytes: deltas, page files, and batch files (DBSP_MEMORY_LIMIT spills all)
            return s["delta_bytes"] + s["base_bytes"] + s["spill_bytes"]

        assert sent(first) > 2_000_000  # the state itself went up once
        for s in small:
            assert s["base_bytes"] == 0 and s["deltas"] >= 1
            assert sent(s) < sent(first) / 50, s
    finally:
        p.close()


def test_retention_keeps_two_manifests_and_what_they_name(s3_server):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    pushes = _pushes(SEED + 1, 8)
    _run(uri, pushes, reopen_at=5, memory_limit=1)
    r = Remote.of(uri, "/nonexistent")
    versions = r.manifest_versions()
    assert len(versions) == 2 and versions[1] == versions[0] + 1
    live = [r.read_manifest(v) for v in versions]
    held = set(r.list("db")) | set(r.list("spill"))
    assert held == r.live_names(live), "every object of db/ and spill/ is named by a live manifest, and only those"
    assert any(n.startswith("spill/") for n in held)


def test_newest_complete_manifest_wins_and_is_never_overwritten(s3_server, tmp_path):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    pushes = _pushes(SEED + 2, 6)
    c = _circuit()
    p = dbsp.Pipeline(c, workers=2, storage=uri, checkpoint_interval=None)
    for i, t in enumerate(pushes):
        p.push("t", t, producer="gen", seq=i)
        p.step()
        if i in (2, 4):
            p.checkpoint()
    p.close(checkpoint=False)
    r = Remote.of(uri, "/nonexistent")
    newest = r.manifest_versions()[-1]
    assert r.read_manifest(newest)["step"] == 5 and r.read_manifest(newest - 1)["step"] == 3
    r.put(manifest_name(newest), b"DRMF\x01torn")  # a damaged newest manifest: the previous one is in force
    p = dbsp.Pipeline.open(uri, c, checkpoint_interval=None)
    try:
        assert p._remote_state.previous["version"] == newest - 1  # restored: the damaged newest one skipped
        claim = p._remote_state.manifest  # the new writer's claim (storage.remote invariant 6): one version skipped
        assert claim["version"] == newest + 2 and claim["step"] == 3
        assert claim["writer"] == p._remote_state.lease["generation"] == 2
        # recovery from the checkpoint at step 3 replays steps 3..5 from the input log's segments: nothing
        # acknowledged is lost
        assert p.steps == 6 and p.stats["replayed_steps"] == 3
        acc: dict = {}
        for _, z in p.read_output("s"):
            integrate(acc, z)
        assert acc == _duckdb(pushes)
        p.checkpoint()
        assert p._remote_state.manifest["version"] == newest + 3  # the damaged version is not written over
    finally:
        p.close(checkpoint=False)
    assert r.read_manifest(newest + 3)["step"] == 6
    with pytest.raises((CorruptionError, FileNotFoundError)):  # damaged, then retired: never a manifest again
        r.read_manifest(newest)


def test_long_chain_is_compacted_into_the_page_file(s3_server):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    c = _circuit()
    p = dbsp.Pipeline(c, workers=1, storage=uri, checkpoint_interval=None)
    p._remote_state.chain_limit = 3
    pushes = _pushes(SEED + 3, 8)
    try:
        for i, t in enumerate(pushes):
            p.push("t", t)
            p.step()
            p.checkpoint()
        chains = p._remote_state.manifest["databases"]
        kinds = [link["kind"] for link in chains["state/worker-0.db"]["chain"]]
        assert kinds[0] == "file" and len(kinds) <= 3, kinds  # compacted at least once within 8 checkpoints
    finally:
        p.close()
    q = dbsp.Pipeline.open(uri, c, checkpoint_interval=None)
    try:
        acc: dict = {}
        for _, z in q.read_output("s"):
            integrate(acc, z)
        assert acc == _duckdb(pushes)
        q.push("t", pushes[0])
        acc2 = dict(acc)
        integrate(acc2, q.step()["s"])
        assert acc2 == _duckdb(pushes + pushes[:1])
    finally:
        q.close()


def test_cache_dir_and_store_are_checked(s3_server, tmp_path):
    uri = s3_server.uri(s3_server.bucket(), "nothing")
    with pytest.raises(RecoveryError, match="holds no pipeline"):
        dbsp.Pipeline.open(uri, _circuit())
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("user data")
    with pytest.raises(DbspError, match="neither empty nor a dbsp cache"):
        dbsp.Pipeline(_circuit(), storage=uri, cache_dir=str(busy))
    assert (busy / "mine.txt").read_text() == "user data"
    with pytest.raises(ValueError, match="cache_dir is the local cache of an object store"):
        dbsp.Pipeline(_circuit(), storage=str(tmp_path / "d"), cache_dir=str(busy))
    with pytest.raises(TypeError, match="storage must be"):
        dbsp.Pipeline(_circuit(), storage=42)


def test_no_credential_in_the_store_or_the_cache(s3_server, tmp_path):
    from s3_server import CREDENTIALS

    key, secret = CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    bucket = s3_server.bucket()
    uri = s3_server.uri(bucket, "pipe").replace("s3://", f"s3://{key}:{secret}@")  # credentials in the URI's user info
    cache = tmp_path / "cache"
    p = dbsp.Pipeline(_circuit(), storage=uri, cache_dir=str(cache), checkpoint_interval=None)
    p.push("t", _pushes(SEED, 1)[0])
    p.step()
    p.checkpoint()
    assert secret not in repr(p) and secret not in p.storage_uri
    p.close()
    r = Remote.of(s3_server.uri(bucket, "pipe"), "/nonexistent")
    names = r.list("")
    assert any(n.startswith(REMOTE_MANIFEST_DIR) for n in names)
    for name in names:
        data = r.get(name)
        assert secret.encode() not in data and key.encode() not in data, name
    for d, _, files in os.walk(cache):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                assert secret.encode() not in fh.read(), f


def test_cli_inspects_and_reads_a_store(s3_server):
    import subprocess
    import sys

    from s3_server import CREDENTIALS

    uri = s3_server.uri(s3_server.bucket(), "pipe")
    pushes = _pushes(SEED + 4, 3)
    _run(uri, pushes, reopen_at=99)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ins = subprocess.run([sys.executable, "-m", "dbsp_core", "inspect", uri], capture_output=True, text=True, env=env,
                         timeout=120)
    assert ins.returncode == 0, ins.stderr
    assert "store        manifest" in ins.stdout and "checkpoint   through step 2" in ins.stdout, ins.stdout
    rd = subprocess.run([sys.executable, "-m", "dbsp_core", "read", uri, "s", "--limit", "1000"], capture_output=True,
                        text=True, env=env, timeout=120)
    assert rd.returncode == 0, rd.stderr
    rows = [eval(x.strip()) for x in rd.stdout.splitlines() if x.startswith("  ")]  # noqa: S307 - our own output
    acc: dict = {}
    for r in rows:
        key = (r["k"], r["n"], r["s"])
        acc[key] = acc.get(key, 0) + r["weight"]
    assert {k: w for k, w in acc.items() if w} == _duckdb(pushes)
    for out in (ins.stdout, ins.stderr, rd.stdout, rd.stderr):
        assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in out


def test_rescale_cold_and_live_on_a_store(s3_server):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    pushes = _pushes(SEED + 5, 9)
    c = _circuit()
    acc: dict = {}
    p = dbsp.Pipeline(c, workers=2, storage=uri, checkpoint_interval=None)
    for i in range(3):
        p.push("t", pushes[i], producer="gen", seq=i)
        integrate(acc, p.step()["s"])
    p.close()
    p = dbsp.Pipeline.open(uri, c, workers=3, checkpoint_interval=None)  # cold: new worker databases, journaled
    assert p.layout.workers == 3 and p.last_rescale["from_workers"] == 2
    for i in range(3, 6):
        p.push("t", pushes[i], producer="gen", seq=i)
        integrate(acc, p.step()["s"])
    p.rescale(1)  # live: shards move into worker 0, the others' databases go
    for i in range(6, 9):
        p.push("t", pushes[i], producer="gen", seq=i)
        integrate(acc, p.step()["s"])
    p.close()
    assert acc == _duckdb(pushes)
    q = dbsp.Pipeline.open(uri, c, checkpoint_interval=None)
    try:
        assert q.layout.workers == 1 and sorted(q._remote_state.manifest["databases"]) == ["driver.db",
                                                                                             "state/worker-0.db"]
        got: dict = {}
        for _, z in q.read_output("s"):
            integrate(got, z)
        assert got == acc
        q.push("t", pushes[0], producer="gen", seq=0)  # a duplicate: the seen set came back through every change
        q.push("t", pushes[1], producer="other", seq=0)
        integrate(got, q.step()["s"])
        assert got == _duckdb(pushes + pushes[1:2])
    finally:
        q.close()


def test_journal_keeps_committed_changes_only(tmp_path):
    from dbsp_core.runtime.remote_state import _records
    from dbsp_core.storage.database import Database, end_journals, journal_of, journal_under

    root = str(tmp_path / "root")
    os.makedirs(root)
    journal_under(root, str(tmp_path / "journals"))
    try:
        path = os.path.join(root, "w.db")
        with Database(path) as db:
            with db.open(0) as h:
                h.put("t", b"a", b"1")
                h.put("t", b"b", b"2")
                h.set_step(4)
                h.commit()
            with db.open(1) as h:  # left without commit: its records are cut off again
                h.put("t", b"c", b"3")
            with db.open(1) as h:
                h.delete("t", b"a")
                h.commit()
            sealed, start, to, valid, fresh = journal_of(path).take()
            with open(sealed, "rb") as f:
                recs = list(_records(f, os.path.getsize(sealed)))
            assert (start, to, valid, fresh) == (0, 2, True, True)
            assert recs == [(1, b"t", b"a", b"1"), (1, b"t", b"b", b"2"), (2, b"", b"", (4).to_bytes(8, "little")),
                            (0, b"t", b"a", None)]
            with db.open(2) as h:  # after take: the next records start from version 2
                h.put("t", b"d", b"4")
                h.commit()
            assert journal_of(path).take()[1:3] == (2, 3)
            assert db.versions() == range(2, 4)
            with db.open(2):  # opening an older version discards the newest: the records no longer lead to it
                pass
            assert journal_of(path).take()[3] is False
    finally:
        end_journals(root)


def test_restore_memory_does_not_grow_with_an_object(s3_server, tmp_path, monkeypatch):
    """Restore streams every state object through bounded reads (remote_state invariant 4): the Python memory it
    allocates at its peak (tracemalloc) stays under a few reads while the largest object is many times larger."""
    # the state in the databases' delta objects, not in batch files: no budget, also when DBSP_MEMORY_LIMIT gives
    # every pipeline one (a CI setting)
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    c = _circuit()
    rng = random.Random(SEED + 7)
    big = pa.table({"k": list(range(200_000)), "v": [rng.randrange(9) for _ in range(200_000)]}, schema=SCHEMA)
    p = dbsp.Pipeline(c, workers=2, storage=uri, checkpoint_interval=None)
    p.push("t", big)
    want = p.step()["s"].to_dict()
    p.close()  # the state's first checkpoint: one delta per database holding all of it
    chunk = 64 << 10
    monkeypatch.setattr(remote_mod, "GET_CHUNK", chunk)
    r = Remote.of(uri, str(tmp_path / "c"))
    largest = max(r.list("db").values())
    cache = tmp_path / "c"
    prepare_cache(str(cache))
    tracemalloc.start()
    try:
        restore(r, str(cache), RemoteLogs(r))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"largest state object {largest} B, restore's peak Python memory {peak} B")
    bound = 2 * DOWNLOAD_THREADS * chunk + (1 << 20)  # the reads in flight, one record, the file buffers
    assert largest > 2 * bound, "the test needs an object larger than what restore may hold"
    assert peak < bound
    q = dbsp.Pipeline.open(uri, c, checkpoint_interval=None)  # and what it restored is the state
    try:
        got: dict = {}
        for _, z in q.read_output("s"):
            integrate(got, z)
        assert got == want
        q.push("t", pa.table({"k": [1], "v": [5]}, schema=SCHEMA))
        assert q.step()["s"].to_dict() == {(1, 1, want_s(want, 1)): -1, (1, 2, want_s(want, 1) + 5): 1}
    finally:
        q.close()


def want_s(out: dict, k: int) -> int:
    """The sum of group ``k`` in an output of "s" holding one row per group."""
    return next(row[2] for row in out if row[0] == k)


def test_a_damaged_delta_object_fails_the_open_and_applies_nothing(s3_server, tmp_path):
    """A delta object whose bytes were damaged in the store is refused whole (its CRC, checked from the downloaded
    file before any record is applied): CorruptionError naming the object; the store is left as it was."""
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    _run(uri, _pushes(SEED + 9, 4), reopen_at=99)
    r = Remote.of(uri, "/nonexistent")
    deltas = sorted(n for n in r.list("db") if n.endswith(".delta") and "worker-0" in n)
    name = deltas[-1]
    data = bytearray(r.get(name))
    data[len(data) // 2] ^= 0x40
    r.put(name, bytes(data))
    with pytest.raises(CorruptionError, match=name.replace(".", r"\.")):
        dbsp.Pipeline.open(uri, _circuit(), cache_dir=str(tmp_path / "c"), checkpoint_interval=None)
    assert r.get(name) == bytes(data)


def _integrated_output(q) -> dict:
    """The output ``s`` of pipeline ``q`` integrated over its log (a multiset of rows)."""
    acc: dict = {}
    for _, z in q.read_output("s"):
        integrate(acc, z)
    return acc


def test_a_consumer_unregistered_while_a_checkpoint_is_captured_is_left_out(s3_server, tmp_path, monkeypatch):
    """A consumer (another thread, or a reader in another process) unregisters between the checkpoint's look at
    its record in ``consumers/`` and its read of it: the checkpoint leaves it out. Before, the read raised
    FileNotFoundError and broke the pipeline."""
    store = s3_server.uri(s3_server.bucket(), "pipe")
    p = dbsp.Pipeline(_circuit(), storage=store, cache_dir=str(tmp_path / "cache"), checkpoint_interval=None)
    try:
        for name in ("gone", "kept"):
            p.consumers.register(name)
        pushes = _pushes(SEED, 2)
        p.push("t", pushes[0], producer="gen", seq=0)
        p.step()
        real = os.path.isfile
        raced = []

        def isfile(path):  # the race, made certain: "gone" unregisters right after the capture looked at its file
            there = real(path)
            if sys._getframe(1).f_code.co_name == "capture" and os.path.basename(path) == "gone" and not raced:
                raced.append(there)
                p.consumers.unregister("gone")
            return there

        monkeypatch.setattr(os.path, "isfile", isfile)
        p.checkpoint()
        monkeypatch.undo()
        assert raced == [True], "the checkpoint saw the record before the unregistering"
        p.push("t", pushes[1], producer="gen", seq=1)
        p.step()
    finally:
        p.close()
    q = dbsp.Pipeline.open(store, _circuit(), cache_dir=str(tmp_path / "cache2"), checkpoint_interval=None)
    try:
        assert q.consumers.list() == {"kept": 0}
        assert _integrated_output(q) == _duckdb(pushes)
    finally:
        q.close(checkpoint=False)


def test_a_state_database_deleted_from_the_cache_fails_the_checkpoint_before_any_upload(s3_server, tmp_path):
    """``state/worker-1.db`` deleted from the cache while the pipeline runs (W=2): the next checkpoint raises
    CorruptionError naming it and uploads nothing, so the store keeps its last good manifest (remote_state
    invariant 6); reopening from the store gives that checkpoint's state and replaying the input log gives exactly
    DuckDB's rows. Before, the manifest listed the databases present, so it silently omitted worker-1's state."""
    store = s3_server.uri(s3_server.bucket(), "pipe")
    cache = str(tmp_path / "cache")
    pushes = _pushes(SEED + 11, 5)
    r = Remote.of(store, "/nonexistent")
    p = dbsp.Pipeline(_circuit(), workers=2, storage=store, cache_dir=cache, checkpoint_interval=None)
    try:
        for i in range(3):
            p.push("t", pushes[i], producer="gen", seq=i)
            p.step()
        p.checkpoint()
        good = r.newest_manifest()
        assert good["step"] == 3 and {"state/worker-0.db", "state/worker-1.db"} <= set(good["databases"])
        gone = os.path.join(cache, "state", "worker-1.db")
        os.remove(gone)
        for i in range(3, 5):
            p.push("t", pushes[i], producer="gen", seq=i)
            p.step()
        with pytest.raises(CorruptionError, match=r"state/worker-1\.db.*missing") as e:
            p.checkpoint()
        assert "reopen" in str(e.value) and "step 3" in str(e.value), e.value
        after = r.newest_manifest()
        assert after["version"] == good["version"] and after["databases"] == good["databases"], \
            "a checkpoint uploaded a manifest without a state database LAYOUT names"
    finally:
        p.close()
    q = dbsp.Pipeline.open(store, _circuit(), cache_dir=str(tmp_path / "cache2"), checkpoint_interval=None)
    try:
        assert q.steps == 5
        assert _integrated_output(q) == _duckdb(pushes)
    finally:
        q.close(checkpoint=False)
