"""Directory format 4 (storage/formats.py ``RANGE_FORMAT``): a directory whose state may hold range values (``DRBR``,
snapshot.py invariant 11) says so in META, so an older build (a reader of formats 2 and 3) refuses it up front with
FormatVersionError instead of meeting the first range value and calling the data damaged (CorruptionError); the
embedded executor writes it on create and raises a format-2/3 directory to it when it opens one (directory.py
invariant 3), before its first checkpoint can write a range value; a crash at any I/O operation of that open and
first checkpoint leaves a directory this build opens, and never range values under a META of format 2 or 3.

The tests against an older build run it in a subprocess from ``DBSP_OLD_BUILD`` (a source tree of an earlier
build with its compiled modules, e.g. ``git worktree add --detach /tmp/fmt-old main`` and main's ``dbsp_core/*.so``
copied in); without it they are skipped. The format-2 directory the others open is tests/fixtures/format2-embedded
(written by an earlier build, see make_format2.py).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "fixtures")
sys.path.insert(0, HERE)
sys.path.insert(0, FIXTURES)

import dbsp_core as dbsp  # noqa: E402
import upgrade_workload as w  # noqa: E402
from dbsp_core.errors import FormatVersionError, StorageError  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.storage import FaultInjector  # noqa: E402
from dbsp_core.runtime import recovery  # noqa: E402
from dbsp_core.storage.directory import raise_to_ranges, read_meta  # noqa: E402
from dbsp_core.storage.formats import DIRECTORY_FORMAT, PRUNED_FORMAT, RANGE_FORMAT  # noqa: E402
from test_shard_ranges import _no_budget, range_values  # noqa: E402,F401 (_no_budget: autouse, range values need no budget)

OLD = os.environ.get("DBSP_OLD_BUILD")
LAST = 13  # the fixture's steps 0..8, its acknowledged pushes (step 9), then new ones up to 12
needs_old = pytest.mark.skipif(not OLD, reason="DBSP_OLD_BUILD (an earlier build's source tree) is not set")

# run by an older build in a subprocess (cwd: its tree): "open" a directory, or "write" one (as make_format2.py)
OLD_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "fixtures"))
import dbsp_core as dbsp
import upgrade_workload as w
assert os.path.abspath(dbsp.__file__).startswith(os.getcwd()), dbsp.__file__
d, action = sys.argv[1], sys.argv[2]
if action == "open":
    try:
        p = dbsp.Pipeline.open(d, w.build_circuit(), checkpoint_interval=None)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
    else:
        p.close(checkpoint=False)
        print(json.dumps({"error": None}))
else:
    p = dbsp.Pipeline(w.build_circuit(), workers=2, storage=d, checkpoint_interval=None)
    for step in range(w.PENDING_STEP + 1):
        for name, t in w.changes(step).items():
            p.push(name, t, producer=f"gen-{name}", seq=step)
        if step == w.PENDING_STEP:
            break
        p.step()
        if step == w.STEPS_BEFORE_CHECKPOINT - 1:
            p.checkpoint()
    p.close(checkpoint=False)
    print(json.dumps({"error": None}))
"""


def _old(d: str, action: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DBSP_MEMORY_LIMIT"}  # (under a budget: file references)
    env["PYTHONPATH"] = OLD
    r = subprocess.run([sys.executable, "-c", OLD_SCRIPT, d, action], cwd=OLD, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"the older build failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _push(p, step: int) -> None:
    for name, t in w.changes(step).items():
        p.push(name, t, producer=f"gen-{name}", seq=step)


@functools.lru_cache(maxsize=1)
def _reference() -> dict:
    """Every output's change of steps 0..LAST-1, from an in-memory run of the workload."""
    m = dbsp.Pipeline(w.build_circuit(), workers=2)
    got: dict = {}
    for step in range(LAST):
        for name, t in w.changes(step).items():
            m.push(name, t)
        for name, z in m.step().items():
            got.setdefault(name, {})[step] = z
    m.close()
    return got


def _go_on(d: str, vfs: str = "posix") -> None:
    """Open ``d`` (the fixture's steps, or fewer/more after a crash), run to step LAST-1 with checkpoints, reopen,
    and compare every step's output with the in-memory run's."""
    p = dbsp.Pipeline.open(d, w.build_circuit(), checkpoint_interval=None, vfs=vfs)
    while p.steps < LAST:
        if p.steps > w.PENDING_STEP:
            _push(p, p.steps)
        p.step()
        if p.steps % 2 == 0:
            p.checkpoint()
    p.close()
    q = dbsp.Pipeline.open(d, w.build_circuit(), checkpoint_interval=None)
    try:
        got = {name: dict(q.read_output(name, 0)) for name in w.build_circuit().outputs}
    finally:
        q.close()
    for name, steps in _reference().items():
        for step, z in steps.items():
            assert got[name][step] == z, f"output {name} of step {step} differs from the in-memory run"


def _fixture(tmp_path, name: str = "d") -> str:
    d = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURES, "format2-embedded"), d)
    assert read_meta(d)["format"] == DIRECTORY_FORMAT
    return d


def test_a_new_embedded_directory_is_format_4_a_staged_one_keeps_2_or_3(tmp_path) -> None:
    """The embedded executor's directory is format 4 from its creation and holds range values after a checkpoint;
    a reader of formats 2 and 3 alone refuses it naming format 4; the staged executor's stays 2 or 3."""
    for kind in ("embedded", "staged"):
        d = str(tmp_path / kind)
        p = dbsp.Pipeline(w.build_circuit(), workers=2, storage=d, checkpoint_interval=None,
                          executor=StagedExecutor() if kind == "staged" else None)
        for step in range(4):
            _push(p, step)
            p.step()
        p.checkpoint()
        p.close(checkpoint=False)
        meta = read_meta(d)
        if kind == "staged":
            assert meta["format"] == (PRUNED_FORMAT if meta.get("stored_columns") else DIRECTORY_FORMAT)
            assert range_values(d) == 0
            continue
        assert meta["format"] == RANGE_FORMAT
        assert range_values(d), "the checkpoint saved no range value: the test does not reach the case"
        with pytest.raises(FormatVersionError, match="format 4"):
            read_meta(d, (DIRECTORY_FORMAT, PRUNED_FORMAT))


@needs_old
def test_an_older_build_refuses_a_directory_with_range_values(tmp_path) -> None:
    """An older build opening a directory this build wrote (range values in its state) is refused by META with
    FormatVersionError naming format 4, not CorruptionError at the first range value."""
    d = _fixture(tmp_path)
    _go_on(d)
    assert range_values(d) and read_meta(d)["format"] == RANGE_FORMAT
    got = _old(d, "open")
    assert got["error"] == "FormatVersionError" and "format 4" in got["message"], got


@needs_old
def test_a_directory_an_older_build_wrote_opens_and_is_raised_to_format_4(tmp_path) -> None:
    """A directory the older build wrote (format 2 or 3) opens here, takes checkpoints (range values), gives the
    in-memory run's outputs, and its META says format 4 afterwards."""
    d = str(tmp_path / "old")
    _old(d, "write")
    assert read_meta(d)["format"] in (DIRECTORY_FORMAT, PRUNED_FORMAT) and range_values(d) == 0
    _go_on(d)
    assert read_meta(d)["format"] == RANGE_FORMAT and range_values(d)


def test_a_format2_directory_is_raised_to_format_4(tmp_path) -> None:
    """The format-2 fixture (an earlier build's) opens, takes checkpoints that save range values, and is format 4
    afterwards (the same as the test above, without an older build at hand)."""
    d = _fixture(tmp_path)
    _go_on(d)
    assert read_meta(d)["format"] == RANGE_FORMAT and range_values(d)


def _crash_runs(tmp_path, monkeypatch, every: int) -> None:
    """Crash at every ``every``-th I/O operation (1: each) of the open of the format-2 fixture, its replay and its
    first checkpoint, at each operation of the META rewrite and the one after it, and at every 6th of the last 32
    (tearing unsynced writes; reordering them too, but at the rewrite's): after each, META is of format 2 with no range value, or of format 4, and
    the directory opens and goes on to the in-memory run's outputs."""
    probe = _fixture(tmp_path, "probe")
    rewrite = []

    def counted(*a, **kw):
        rewrite.append(FaultInjector.ops())
        try:
            return raise_to_ranges(*a, **kw)
        finally:
            rewrite.append(FaultInjector.ops())

    with monkeypatch.context() as m:
        m.setattr(recovery, "raise_to_ranges", counted)
        FaultInjector.arm()
        p = dbsp.Pipeline.open(probe, w.build_circuit(), checkpoint_interval=None, vfs="fault")
        p.step()
        p.checkpoint()
        nops = FaultInjector.ops()
        FaultInjector.disarm()
    p.close(checkpoint=False)
    assert range_values(probe) and read_meta(probe)["format"] == RANGE_FORMAT
    tried = crashed_in = 0
    seen = set()
    around = range(rewrite[0] + 1, rewrite[1] + 2) if rewrite else range(0)  # (none: the code without the rewrite)
    ending = range(max(1, nops - 31), nops + 1, 6)  # the checkpoint's commit is among its last operations
    for n in sorted(set(range(1, nops + 1, every)) | set(around) | set(ending)):
        for mode, seed in (("tear", 1), ("reorder", 2)) if every == 1 or n not in around else (("tear", 1),):
            d = str(tmp_path / "run")
            shutil.rmtree(d, ignore_errors=True)
            d = _fixture(tmp_path, "run")
            p = None
            FaultInjector.arm(crash_at=n, mode=mode, seed=n * 7 + seed)
            try:
                p = dbsp.Pipeline.open(d, w.build_circuit(), checkpoint_interval=None, vfs="fault")
                p.step()
                p.checkpoint()
            except StorageError:
                pass
            crashed_in += FaultInjector.crashed()
            FaultInjector.disarm()
            if p is not None:
                try:
                    p.close(checkpoint=False)
                except Exception:  # a crashed VFS fails what it is asked after the crash
                    pass
            tried += 1
            fmt = read_meta(d)["format"]
            seen.add(fmt)
            assert fmt == RANGE_FORMAT or range_values(d) == 0, \
                f"crash at op {n} ({mode}): range values under a META of format {fmt}"
            _go_on(d)
    print(f"\n[range format crash] {nops} operations (the META rewrite: {rewrite}), {tried} runs ({crashed_in} "
          f"crashed), formats after: {sorted(seen)}")
    assert crashed_in and seen == {DIRECTORY_FORMAT, RANGE_FORMAT}


def test_a_crash_in_the_open_and_first_checkpoint_of_a_format2_directory(tmp_path, monkeypatch) -> None:
    """The META rewrite's I/O operations, every 50th of the open of a format-2 directory and its first checkpoint,
    and some of the checkpoint's last (each: the slow test)."""
    _crash_runs(tmp_path, monkeypatch, 50)


@pytest.mark.slow
def test_a_crash_at_every_io_operation_of_the_open_and_first_checkpoint(tmp_path, monkeypatch) -> None:
    """Every I/O operation of the open of a format-2 directory and its first checkpoint, crashed at."""
    _crash_runs(tmp_path, monkeypatch, 1)
