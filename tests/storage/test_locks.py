"""OS locks: a second writer of a Database or a StepLog (in this process or another) gets InUseError instead of silently losing the first one's committed writes, while read-only openers read where that is safe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dbsp_core.errors import InUseError, StorageError
from dbsp_core.storage import Database, StepLog
from dbsp_core.storage.outputlog import OutputLog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _commit(db: Database, key: bytes) -> None:
    with db.open(db.versions().stop - 1) as h:
        h.put("t", key, b"v")
        h.commit()


def test_two_databases_on_one_path_exclude_each_other(tmp_path):
    """Two Database objects on one path each committed and the later commit silently dropped the earlier one's
    writes; the second open is now refused, and the path opens again once the first is closed."""
    path = str(tmp_path / "db")
    a = Database(path)
    _commit(a, b"a")
    with pytest.raises(InUseError, match=r"db is in use: another open pagestore holds its lock"):
        Database(path)
    with pytest.raises(InUseError):
        Database(path, readonly=True)  # a reader could see pages the writer is rewriting
    _commit(a, b"a2")
    a.close()
    with Database(path) as b, b.read(b.versions().stop - 1) as h:
        assert [k for k, _ in h.scan("t")] == [b"a", b"a2"]


def test_read_only_databases_share_and_write_nothing(tmp_path):
    path = str(tmp_path / "db")
    with Database(path) as db:
        _commit(db, b"k")
    before = os.stat(path).st_mtime_ns, os.path.getsize(path)
    r1, r2 = Database(path, readonly=True), Database(path, readonly=True)  # readers share
    with pytest.raises(InUseError):
        Database(path)  # a writer waits for the readers
    with r1.read(1) as h:
        assert h.get("t", b"k") == b"v"
    with pytest.raises(StorageError, match="read-only"):
        r2.open(1)
    r1.close()
    r2.close()
    assert (os.stat(path).st_mtime_ns, os.path.getsize(path)) == before
    with pytest.raises(FileNotFoundError):
        Database(str(tmp_path / "missing"), readonly=True)
    assert not os.path.exists(tmp_path / "missing")


def test_a_database_held_by_another_process_is_refused(tmp_path):
    path = str(tmp_path / "db")
    Database(path).close()
    code = textwrap.dedent(f"""
        import sys
        from dbsp_core.storage import Database
        db = Database({path!r})
        print("OPEN", flush=True)
        sys.stdin.readline()
        db.close()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert child.stdout.readline().strip() == "OPEN"
        with pytest.raises(InUseError):
            Database(path)
    finally:
        child.communicate("\n", timeout=60)
    Database(path).close()  # released when the other process closes it (or dies)


def test_two_step_log_writers_exclude_each_other_and_readers_read_beside(tmp_path):
    path = str(tmp_path / "log")
    w = StepLog(path)
    w.append(0, "t", b"one", producer="p", seq=0)
    with pytest.raises(InUseError, match="steplog .* is in use"):
        StepLog(path)
    with StepLog(path, readonly=True) as r:  # a reader beside the writer
        assert [x.payload for x in r.read(0)] == [b"one"]
    w.close()
    with StepLog(path) as w2:
        assert len(w2) == 1


def test_two_output_log_writers_exclude_each_other(tmp_path):
    import pyarrow as pa

    schemas = {"v": pa.schema([("x", pa.int64())])}
    a = OutputLog(str(tmp_path / "out"), schemas)
    with pytest.raises(InUseError):
        OutputLog(str(tmp_path / "out"), schemas)
    OutputLog(str(tmp_path / "out"), schemas, readonly=True).close()
    a.close()
    OutputLog(str(tmp_path / "out"), schemas).close()
