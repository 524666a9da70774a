"""Database: the two-version contract, ordered scans, overflow values, shards, and a Hypothesis model test."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis_profile import examples

from dbsp_core.errors import StorageError
from dbsp_core.storage import Database, shard_key, shard_of_key


def test_new_database_is_version_0_empty(tmp_path):
    with Database(tmp_path / "db") as db:
        assert db.versions() == range(0, 1)
        with db.open(0) as h:
            assert h.version == 1 and h.get_step() == 0
            assert h.get("t", b"k") is None and list(h.scan("t")) == [] and h.tables() == []


def test_version_contract(tmp_path):
    p = tmp_path / "db"
    with Database(p) as db:
        with db.open(0) as h:
            h.put("t", b"a", b"1")
            h.commit()
        assert db.versions() == range(0, 2)
        with db.open(1) as h:  # discards 0
            h.put("t", b"a", b"2")
            h.close()  # no commit: keeps 1 only
        assert db.versions() == range(1, 2)
        with pytest.raises(KeyError):
            db.open(0)
        with db.open(1) as h:
            assert h.get("t", b"a") == b"1"
            h.put("t", b"b", b"x")
            h.set_step(9)
            h.commit()
        assert db.versions() == range(1, 3)
        with db.open(1) as h:  # open the older one: discards 2
            assert h.get("t", b"b") is None and h.get_step() == 0
        assert db.versions() == range(1, 2)
    with Database(p) as db:
        assert db.versions() == range(1, 2)
        db.check()


def test_read_only_handle_discards_nothing_and_refuses_writes(tmp_path):
    p = tmp_path / "db"
    with Database(p) as db:
        with db.open(0) as h:
            h.put("t", b"a", b"1")
            h.set_step(4)
            h.commit()
        assert db.versions() == range(0, 2)
        for v, want, step in [(0, None, 0), (1, b"1", 4)]:  # each version as it is, the older one too
            with db.read(v) as r:
                assert r.readonly and r.version == v and r.get_step() == step
                assert r.get("t", b"a") == want
                assert list(r.scan("t")) == ([] if want is None else [(b"a", b"1")])
                for write in (lambda: r.put("t", b"b", b"2"), lambda: r.delete("t", b"a"),
                              lambda: r.set_step(9)):
                    with pytest.raises(StorageError, match="read-only"):
                        write()
            assert db.versions() == range(0, 2)  # reading version 0 did not discard version 1, nor 1 version 0
        r = db.read(0)
        with pytest.raises(StorageError, match="a handle is already open"):
            db.open(1)
        with pytest.raises(StorageError, match="read-only"):
            r.commit()
        with pytest.raises(KeyError, match="not readable"):
            db.read(7)
        with db.open(1) as h:  # the failed commit closed the read handle; writing works as before
            assert h.get("t", b"a") == b"1"
            h.commit()
        assert db.versions() == range(1, 3)
    with Database(p) as db:
        assert db.versions() == range(1, 3)


def test_one_handle_at_a_time_and_closed_handles(tmp_path):
    with Database(tmp_path / "db") as db:
        h = db.open(0)
        with pytest.raises(StorageError, match="already open"):
            db.open(0)
        h.commit()
        with pytest.raises(StorageError, match="closed"):
            h.put("t", b"k", b"v")
        h2 = db.open(1)
    with pytest.raises(StorageError):
        h2.get("t", b"k")


def test_scan_ranges_prefix_and_tables(tmp_path):
    with Database(tmp_path / "db") as db, db.open(0) as h:
        keys = sorted(os.urandom(8) for _ in range(3000))
        for k in keys:
            h.put("big", k, k[::-1])
        h.put("other", b"\xff\xff", b"x")
        assert [k for k, _ in h.scan("big")] == keys
        lo, hi = keys[100], keys[2000]
        assert [k for k, _ in h.scan("big", lo, hi)] == keys[100:2000]
        pre = keys[500][:1]
        assert [k for k, _ in h.scan("big", prefix=pre)] == [k for k in keys if k.startswith(pre)]
        assert [k for k, _ in h.scan("other", prefix=b"\xff")] == [b"\xff\xff"]
        assert sorted(h.tables()) == ["big", "other"]
        it = h.scan("big")
        next(it)
        h.put("big", b"new", b"v")
        with pytest.raises(StorageError, match="changed"):
            list(it)


def test_large_values_and_limits(tmp_path):
    p = tmp_path / "db"
    big = os.urandom(3 << 20)
    with Database(p) as db:
        with db.open(0) as h:
            h.put("batches", b"b1", big)
            h.put("batches", b"b2", b"")
            with pytest.raises(ValueError, match="key"):
                h.put("t", b"k" * 2000, b"v")
            h.commit()
        pages1 = db.stats()["pages"]
        with db.open(1) as h:
            assert h.get("batches", b"b1") == big and h.get("batches", b"b2") == b""
            h.put("batches", b"b1", big[:100])  # the old chain becomes free in version 2
            h.commit()
        with db.open(2) as h:  # now the pages of version 1's chain are reusable
            h.put("batches", b"b3", big)
            h.commit()
        assert db.stats()["pages"] < pages1 * 1.2  # reused instead of growing by another 3 MiB
        db.check()
    with Database(p) as db, db.open(3) as h:
        assert h.get("batches", b"b1") == big[:100] and h.get("batches", b"b3") == big


def test_shard_export_import(tmp_path):
    with Database(tmp_path / "a") as a, Database(tmp_path / "b") as b:
        with a.open(0) as h:
            for s in range(4):
                for i in range(50):
                    h.put("state", shard_key(s, b"%d" % i), b"s%d-%d" % (s, i))
                    h.put("index", shard_key(s, b"i%d" % i), b"")
            rows = h.export_shard(2)
            assert len(rows) == 100 and all(shard_of_key(k) == 2 for _, k, _ in rows)
            assert h.delete_shard(2) == 100
            assert h.export_shard(2) == []
            h.commit()
        with b.open(0) as g:
            assert g.import_shard(rows) == 100
            g.commit()
        with b.open(1) as g:
            assert sorted(g.export_shard(2)) == sorted(rows)


def test_reopen_after_many_commits_reuses_pages(tmp_path):
    p = tmp_path / "db"
    with Database(p) as db:
        for v in range(30):
            with db.open(v) as h:
                for i in range(200):
                    h.put("t", b"%05d" % ((v * 37 + i * 11) % 1000), os.urandom(100))
                h.commit()
        db.check()
        st = db.stats()
    assert st["pages"] < 200  # ~1000 keys of 100 bytes; copy-on-write garbage is recycled


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(["t", "u"]), st.binary(max_size=12), st.binary(max_size=2500)),
    st.tuples(st.just("del"), st.sampled_from(["t", "u"]), st.binary(max_size=12)),
    st.tuples(st.just("commit")),
    st.tuples(st.just("close")),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("open_older")),
    st.tuples(st.just("bulk"), st.integers(0, 2**16)),  # 400 random puts/deletes: node splits and removals
), max_size=60)


@settings(max_examples=examples(40))
@given(ops)
def test_matches_two_version_model(tmp_path_factory, script):
    """A dict-of-versions reference model: versions(), contents and steps agree after every operation."""
    p = tmp_path_factory.mktemp("m") / "db"
    model = {0: {}}  # version -> {(table, key): value}
    steps = {0: 0}
    db = Database(p, cache_pages=16)
    base = 0
    h = db.open(base)
    cur = dict(model[base])
    model = {base: model[base]}
    for i, op in enumerate(script):
        if op[0] == "put":
            h.put(op[1], op[2], op[3])
            cur[(op[1], op[2])] = op[3]
        elif op[0] == "del":
            assert h.delete(op[1], op[2]) == ((op[1], op[2]) in cur)
            cur.pop((op[1], op[2]), None)
        elif op[0] == "bulk":
            r = random.Random(op[1])
            for _ in range(400):
                t, k = r.choice("tu"), b"%05d" % r.randrange(2000)
                if r.random() < 0.7:
                    v = r.randbytes(r.choice([3, 200, 1500]))
                    h.put(t, k, v)
                    cur[(t, k)] = v
                else:
                    h.delete(t, k)
                    cur.pop((t, k), None)
        else:
            if op[0] == "commit":
                h.set_step(i)
                h.commit()
                model[base + 1] = cur
                steps[base + 1] = i
            else:
                h.close()
            if op[0] == "reopen":
                db.close()
                db = Database(p, cache_pages=16)
            assert db.versions() == range(min(model), max(model) + 1)
            base = min(model) if op[0] == "open_older" else max(model)
            h = db.open(base)
            model = {base: model[base]}
            cur = dict(model[base])
            assert h.get_step() == steps[base]
        got = {}
        for t in ("t", "u"):
            got.update({(t, k): v for k, v in h.scan(t)})
        assert got == cur
    h.close()
    db.check()
    db.close()


def test_missing_directory_is_a_storage_error(tmp_path):
    with pytest.raises(StorageError) as ei:
        Database(tmp_path / "no" / "such" / "db")
    assert ei.value.errno == 2 and "no/such" in str(ei.value)


def test_keys_and_values_must_be_bytes(tmp_path):
    """``put(table, 5, ...)`` stored the key ``bytes(5)`` (five zero bytes): non-bytes keys are refused."""
    with Database(str(tmp_path / "db")) as db, db.open(0) as h:
        for bad in (5, "k", None, 1.5):
            with pytest.raises(TypeError, match="key must be bytes"):
                h.put("t", bad, b"v")
            with pytest.raises(TypeError, match="key must be bytes"):
                h.get("t", bad)
            with pytest.raises(TypeError, match="key must be bytes"):
                h.delete("t", bad)
        with pytest.raises(TypeError, match="value must be bytes"):
            h.put("t", b"k", 5)
        h.put("t", bytearray(b"k"), memoryview(b"v"))
        assert list(h.scan("t")) == [(b"k", b"v")]


_CACHE_RSS = """
import ctypes, os, sys
from dbsp_core.storage import Database
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
libc = ctypes.CDLL("libc.so.6")
db = Database(os.path.join(sys.argv[1], "db"))
val = os.urandom(50_000)  # 13 pages: under the size a transaction writes as it puts (pagestore.c THROUGH_PAGES)
libc.malloc_trim(0)
before = anon()
for r in range(8):  # 8 commits of 25.6 MB of values: 205 MB written
    with db.open(db.versions()[-1]) as h:
        for i in range(512):
            h.put("t", r.to_bytes(2, "big") + i.to_bytes(4, "big"), val)
        h.commit()
libc.malloc_trim(0)  # what stays is what the database holds, not free heap
print(round(anon() - before))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and glibc's malloc_trim")
def test_a_transaction_holds_big_values_on_disk_not_in_memory(tmp_path):
    """A value of 16 pages or more goes to the file as it is put (pagestore.c overflow_write_through): a transaction
    that puts 64 MiB holds a few tree pages dirty, not the values' 16k pages until its commit (a stage task's commit of
    a job's new batches held them all: runtime/stage_task.py invariant 7). The values read back in the transaction,
    after the commit and after a reopen; one overwritten in the same transaction frees its pages into the free list
    (``check`` proves every page reached once or free once), and the next version reuses them."""
    rng = random.Random(11)
    vals = {b"k%02d" % i: rng.randbytes((2 << 20) + rng.randrange(5000)) for i in range(32)}
    p = tmp_path / "db"
    with Database(p) as db:
        with db.open(0) as h:
            for k, v in vals.items():
                h.put("t", k, v)
            dirty = db.stats()["dirty_pages"]
            assert dirty < 64, f"{dirty} dirty pages held by a transaction that put 64 MiB of big values"
            assert h.get("t", b"k03") == vals[b"k03"]
            h.put("t", b"k03", vals[b"k04"])  # its first chain is freed within the transaction
            vals[b"k03"] = vals[b"k04"]
            h.commit()
        assert db.stats()["last_commit_pages"] >= 32 * 513  # the pages written as they were put count as the commit's
        db.check()
        pages = db.stats()["pages"]
        with db.open(1) as h:
            assert {k: h.get("t", k) for k in vals} == vals
            h.put("t", b"new", vals[b"k05"])
            h.commit()
        assert db.stats()["pages"] < pages + 300  # the freed chain (513 pages) was reused, not appended
        db.check()
    with Database(p) as db, db.open(2) as h:
        assert {k: h.get("t", k) for k in vals} == vals and h.get("t", b"new") == vals[b"k05"]


def test_committed_pages_stay_cached_only_up_to_the_page_cache_bound(tmp_path):
    """A database keeps its committed pages cached as clean copies up to DBSP_PAGE_CACHE_MB (default 32 MiB); it
    was 256 MiB a database, which a pipeline's checkpoints filled (0.5 GiB of a W=2 pipeline's memory)."""
    def retained(env_mb: str | None, sub: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "DBSP_PAGE_CACHE_MB"}
        if env_mb is not None:
            env["DBSP_PAGE_CACHE_MB"] = env_mb
        d = tmp_path / sub
        d.mkdir()
        r = subprocess.run([sys.executable, "-c", _CACHE_RSS, str(d)], env=env, capture_output=True, text=True,
                           timeout=300, check=True)
        return int(r.stdout.split()[-1])

    default, big = retained(None, "default"), retained("256", "big")
    assert default < 96, f"{default} MiB held after writing 205 MB with the default 32 MiB page cache"
    assert big > 150, f"only {big} MiB held with a 256 MiB page cache: the setting is not in force"
