"""FileSource with ``immutable_files=True``: pushes logged as references to their file units (storage/fileref.py), read again from the files by recovery and checked, a changed or vanished file refused with a RecoveryError naming it, and exactly once through a crash at I/O operations of the fault VFS; outputs are compared as multisets with a plain-Python model of the files.

Seeds vary per run and are printed in every assertion message; ``DBSP_FILES_SEED`` replays one.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import FileSource
from dbsp_core.connectors import files as files_module
from dbsp_core.errors import InputFileError, RecoveryError
from dbsp_core.storage import FaultInjector
from dbsp_core.storage.formats import FILE_REF_MAGIC, ZSET_MAGIC

from test_file_source import HERE, ROOT, SEED, WHY, _input_records, _integral, _rows, _write, circuit

FILES = ["a.parquet", "b.csv", "c.jsonl", "d.parquet", "e.parquet"]


def _inbox(d, rng: random.Random, names=FILES) -> collections.Counter:
    """Files of every format (Parquet with several row groups: 8 rows or more in groups of 2 or 5, so a file is
    several units) in ``d``; returns their rows as a multiset. (Groups of 100 were drawn too: with all three
    Parquet files one group each, DBSP_FILES_SEED=923632958, the test's count of units per file could not hold.)"""
    d.mkdir(exist_ok=True)
    model: collections.Counter = collections.Counter()
    for name in names:
        rows = _rows(rng, rng.randrange(8, 40))
        _write(str(d / name), rows, rng, row_groups=(2, 5))
        model.update(rows)
    return model


def _open(path: str, **kw) -> dbsp.Pipeline:
    return dbsp.Pipeline.open(path, circuit(), checkpoint_interval=None, **kw)


def test_pushes_are_logged_by_reference_and_replayed_from_the_files(tmp_path) -> None:
    rng = random.Random(SEED)
    inbox = tmp_path / "in"
    model = _inbox(inbox, rng)
    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None)
    src = FileSource(p, "t", inbox, immutable_files=True)
    n = src.poll(max_files=2)
    p.step()
    n += src.poll()
    p.step()
    first = p.read_input(0)["t"].to_dict()
    p.close(checkpoint=False)  # no checkpoint: the reopen replays both steps from the files
    logged = _input_records(str(tmp_path / "pipe"))
    assert logged == {FILE_REF_MAGIC: n} and n > len(FILES), f"{WHY}: {logged}"
    q = _open(str(tmp_path / "pipe"))
    assert q.stats["replayed_steps"] == 2, WHY
    assert q.read_input(0)["t"].to_dict() == first, WHY
    assert _integral(q) == model, WHY
    again = FileSource(q, "t", inbox, immutable_files=True)
    assert again.poll() == 0 and again.stats["skipped"] == n, WHY  # every unit recorded once
    q.close()


def test_the_default_logs_rows_and_the_files_may_go_once_pushed(tmp_path) -> None:
    rng = random.Random(SEED + 1)
    inbox = tmp_path / "in"
    model = _inbox(inbox, rng)
    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None)
    n = FileSource(p, "t", inbox).poll()
    p.step()
    p.close(checkpoint=False)
    assert _input_records(str(tmp_path / "pipe")) == {ZSET_MAGIC: n}, WHY
    shutil.rmtree(inbox)
    q = _open(str(tmp_path / "pipe"))
    assert _integral(q) == model, WHY
    q.close()


def _flip_inside(path: str, rng: random.Random) -> None:
    """Change one byte of a file's content, keeping its size (so only the checksum can tell)."""
    data = bytearray(open(path, "rb").read())
    if path.endswith(".parquet"):  # a byte of the first row group's column chunks
        c = pq.ParquetFile(path).metadata.row_group(0).column(0)
        off = c.data_page_offset + c.total_compressed_size - 1
    else:
        off = len(data) - 2  # the last value's last digit
    data[off] = (data[off] + 1 - 48) % 10 + 48 if path.endswith((".csv", ".jsonl")) else data[off] ^ 0x55
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("damage", ["deleted", "truncated", "same size, other bytes"])
@pytest.mark.parametrize("name", ["a.parquet", "b.csv"])
def test_a_changed_or_vanished_file_is_a_recovery_error_naming_it(tmp_path, damage, name) -> None:
    rng = random.Random(SEED + 2)
    inbox = tmp_path / "in"
    model = _inbox(inbox, rng)
    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None)
    FileSource(p, "t", inbox, immutable_files=True).poll()
    p.step()
    p.close(checkpoint=False)
    path = str(inbox / name)
    kept = open(path, "rb").read()
    if damage == "deleted":
        os.unlink(path)
    elif damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(len(kept) - 3)
    else:
        _flip_inside(path, rng)
    with pytest.raises(RecoveryError) as e:
        _open(str(tmp_path / "pipe"))
    assert os.path.realpath(path) in str(e.value) and "put the file back" in str(e.value), f"{WHY}: {e.value}"
    with open(path, "wb") as f:  # what the error says to do: the file back as it was
        f.write(kept)
    q = _open(str(tmp_path / "pipe"))
    assert _integral(q) == model, WHY
    q.close()


def test_after_a_checkpoint_the_files_may_go(tmp_path) -> None:
    rng = random.Random(SEED + 3)
    inbox = tmp_path / "in"
    model = _inbox(inbox, rng)
    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None, segment_bytes=4096)
    FileSource(p, "t", inbox, immutable_files=True).poll()
    p.step()
    p.checkpoint()
    p.close(checkpoint=False)
    shutil.rmtree(inbox)
    q = _open(str(tmp_path / "pipe"))
    assert q.stats["replayed_steps"] == 0 and _integral(q) == model, WHY
    q.close()


def test_a_file_that_changes_while_it_is_read_is_refused_not_logged(tmp_path, monkeypatch) -> None:
    """The file is rewritten (same rows, a new inode) between the source's read of its rows and the checksum
    of its bytes: the push is refused as an InputFileError naming the file, and nothing of it is recorded."""
    rng = random.Random(SEED + 4)
    inbox = tmp_path / "in"
    _inbox(inbox, rng, ["a.csv"])
    real = files_module.reference

    def rewritten_then_referenced(path, kind, unit):
        data = open(path, "rb").read()
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(data)
        return real(path, kind, unit)

    monkeypatch.setattr(files_module, "reference", rewritten_then_referenced)
    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None)
    with pytest.raises(InputFileError, match="a.csv"):
        FileSource(p, "t", inbox, immutable_files=True).poll()
    p.step()
    assert _integral(p) == collections.Counter() and p.stats["pushes"] == 0, WHY
    p.close()


def test_immutable_files_needs_a_local_directory(tmp_path) -> None:
    import pyarrow.fs as pafs

    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None)
    (tmp_path / "in").mkdir()
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    with pytest.raises(ValueError, match="immutable_files=True needs a local directory"):
        FileSource(p, "t", "in", filesystem=fs, immutable_files=True)
    with pytest.raises(TypeError, match="immutable_files"):
        FileSource(p, "t", tmp_path / "in", immutable_files="yes")
    p.close()


KILLED_AFTER_COMMIT = """
import sys
sys.path.insert(0, sys.argv[3])
import dbsp_core as dbsp
from dbsp_core.connectors import FileSource
from dbsp_core.runtime.crashpoints import arm_crashpoint
from file_source_child import circuit
p = dbsp.Pipeline.open(sys.argv[1], circuit(), checkpoint_interval=None)
fsyncs = p._input.fsyncs
n = FileSource(p, "t", sys.argv[2], immutable_files=True).poll()
print(n, p._input.fsyncs - fsyncs, flush=True)
arm_crashpoint("checkpoint-gc:1")  # kill -9 once driver.db holds the checkpoint's seen set
p.checkpoint()
"""


def test_reference_pushes_are_acknowledged_before_their_fsync_and_a_checkpoint_syncs_them(tmp_path) -> None:
    """A push logged by reference is acknowledged once it has its place in the log (driver invariant 1), so a
    poll costs no fsync; a checkpoint that saves a seen set naming such pushes syncs the log up to them first:
    after a kill -9 right after the checkpoint committed driver.db (before anything else wrote the log), the
    source made again finds each unit recorded exactly once. Without the sync the saved seen set names pushes
    the killed process never wrote, and the source would skip their rows."""
    rng = random.Random(SEED + 6)
    inbox = tmp_path / "in"
    model = _inbox(inbox, rng)
    d = str(tmp_path / "pipe")
    dbsp.Pipeline(circuit(), storage=d, checkpoint_interval=None).close()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_COMMIT, d, str(inbox), HERE], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    n, fsyncs = map(int, proc.stdout.split())
    assert n > len(FILES) and fsyncs == 0, f"{WHY}: {proc.stdout}"  # acknowledged without an fsync
    with _open(d) as q:
        again = FileSource(q, "t", inbox, immutable_files=True)
        again.poll()
        assert again.stats["skipped"] + again.stats["pushes"] == n, WHY
        q.step()
        assert _integral(q) == model, WHY


def _session(d: str, inbox: str, vfs: str) -> None:
    """Open ``d`` through ``vfs``, push two files by reference, step, checkpoint, push the rest, step twice and
    close without a checkpoint (so the steps after it are replayed from the files by the next open)."""
    p = dbsp.Pipeline.open(d, circuit(), vfs=vfs, checkpoint_interval=None)  # a crash in open leaves nothing open
    try:
        src = FileSource(p, "t", inbox, immutable_files=True)
        src.poll(max_files=2)
        p.step()
        p.checkpoint()
        src.poll()
        p.step()
        p.step()
        p.close(checkpoint=False)
    except BaseException:  # the crash: release the directory (its lock, the log threads) for the reopen
        p._shutdown()
        raise


def _crash_at(n: int, mode: str, session) -> bool:
    """Run ``session`` with the fault VFS crashing at its I/O operation ``n``; whether the crash happened."""
    FaultInjector.arm(crash_at=n, mode=mode, seed=SEED + n)
    try:
        session()
    except (OSError, dbsp.DbspError):
        pass
    finally:
        hit = FaultInjector.crashed()
        FaultInjector.disarm()
    return hit


@pytest.mark.parametrize("modes, stride", [(("drop", "tear"), 8),
                                           pytest.param(("drop", "keep", "tear", "reorder", "chaos"), 1,
                                                        marks=pytest.mark.slow)])
def test_a_crash_at_io_operations_pushes_each_unit_once(tmp_path, modes, stride) -> None:
    """The session crashes at I/O operation n through the fault VFS; the reopened pipeline (recovery reads the
    logged references from the files) and a source made again end with every file's rows exactly once. The
    default run tries every ``stride``-th operation from a seeded offset; the long suite every operation with
    every damage mode."""
    rng = random.Random(SEED + 5)
    inbox = tmp_path / "in"
    model = _inbox(inbox, rng)
    base = str(tmp_path / "base")
    dbsp.Pipeline(circuit(), storage=base, checkpoint_interval=None).close()
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    FaultInjector.arm()
    _session(probe, str(inbox), "fault")
    nops = FaultInjector.ops()
    FaultInjector.disarm()
    assert nops > 20
    tried = crashed = replayed = 0
    cases = [(n, mode) for n in range(1 + SEED % stride, nops + 1, stride) for mode in modes]
    for n, mode in cases:
        d = str(tmp_path / f"c{n}-{mode}")
        shutil.copytree(base, d)
        crashed += _crash_at(n, mode, lambda: _session(d, str(inbox), "fault"))
        with _open(d) as q:
            replayed += q.stats["replayed_steps"]
            FileSource(q, "t", inbox, immutable_files=True).poll()  # a unit recorded before the crash: once
            q.step()
            got = _integral(q)
        assert got == model, f"crash at I/O operation {n} of {nops} ({mode}): {WHY}"
        tried += 1
        shutil.rmtree(d)
    assert crashed == tried == len(cases) > 0
    assert replayed > 0, f"no crash left a step to replay from the files ({WHY})"
    print(f"\n[file refs crash] {nops} I/O operations x {len(modes)} modes = {tried} crashes, {replayed} steps "
          f"replayed from files, 0 violations ({WHY})")
