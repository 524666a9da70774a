"""Both executors define every member of the Executor protocol (the driver probes none with getattr/hasattr), and what a durable pipeline wires into them is there."""

from __future__ import annotations

import inspect

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import DbspError
from dbsp_core.runtime.executor import Executor
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.staged import StagedExecutor


def _members() -> set[str]:
    """The names the protocol declares: its annotated attributes, methods and properties."""
    names = set(Executor.__annotations__)
    for name, value in vars(Executor).items():
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
            names.add(name)
    return names


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64())]))
    c.output("n", t.group_by("k").agg(n=dbsp.count()))
    return c


@pytest.mark.parametrize("make", [EmbeddedExecutor, StagedExecutor], ids=["embedded", "staged"])
def test_every_executor_defines_every_protocol_member(tmp_path, make) -> None:
    members = _members()
    # the members a live rescale and recovery need are declared, not probed
    assert {"state_in_memory", "output_steps", "version", "prepare_relayout", "abandon_relayout", "relayout",
            "resume", "state_bytes"} <= members
    p = dbsp.Pipeline(_circuit(), workers=2, storage=str(tmp_path / "d"), executor=make(), checkpoint_interval=None)
    try:
        p.push("t", pa.table({"k": [1, 2, 2]}))
        p.step()
        missing = sorted(m for m in members if not hasattr(p.executor, m))
        assert not missing, f"{type(p.executor).__name__} lacks protocol members {missing}"
        assert isinstance(p.executor.state_in_memory, bool)
        # the driver hands every executor its output log's end when it opens the log
        assert p.executor.output_steps() == p.output_steps.stop == 1
        assert p.executor.state_bytes() > 0
    finally:
        p.close()


def test_each_executor_refuses_the_other_kinds_way_of_moving_state(tmp_path) -> None:
    """State in memory moves with relayout, state on disk with resume after a cold change (rescale.py invariant
    4): each executor refuses the other way with DbspError and changes nothing."""
    c = _circuit()
    e = dbsp.Pipeline(c, workers=2)
    try:
        assert e.executor.state_in_memory
        with pytest.raises(DbspError, match="in memory"):
            e.executor.resume(0, 0)
        assert e.layout.workers == 2
    finally:
        e.close()
    s = dbsp.Pipeline(c, workers=2, storage=str(tmp_path / "s"), executor=StagedExecutor(), checkpoint_interval=None)
    try:
        assert not s.executor.state_in_memory
        before = s.layout
        with pytest.raises(DbspError, match="stage databases"):
            s.executor.relayout(before.rebalance(3))
        assert s.layout == before
        # its state is on disk: what it reports as its state's bytes is what its databases hold
        s.push("t", pa.table({"k": [1]}))
        s.step()
        assert s.executor.state_bytes() == s.executor.disk_bytes() > 0
    finally:
        s.close()


@pytest.mark.parametrize("make", [EmbeddedExecutor, StagedExecutor], ids=["embedded", "staged"])
def test_byte_counts_survive_a_file_that_vanishes_while_they_walk(tmp_path, monkeypatch, make) -> None:
    """The storage directory is written while the byte counts walk it (a staged job's ``JOB.tmp`` renamed into
    place, a background checkpoint truncating a log): a file listed and gone before its ``stat`` counts 0. CI
    once failed a rescale's report here with FileNotFoundError on ``state/JOB.tmp``; the walk below lists one
    such file in every directory."""
    import os

    from dbsp_core.storage.inspect import inspect_storage

    p = dbsp.Pipeline(_circuit(), workers=2, storage=str(tmp_path / "d"), executor=make(), checkpoint_interval=None)
    try:
        p.push("t", pa.table({"k": [1, 2, 3]}))
        p.step()
        p.checkpoint()
        before = (p.executor.disk_bytes(), p.disk_usage())
        assert before[1]["state"] > 0
        walk = os.walk

        def walk_with_a_vanished_file(top, *a, **kw):
            for d, dirs, files in walk(top, *a, **kw):
                yield d, dirs, files + ["JOB.tmp-gone"]
        monkeypatch.setattr(os, "walk", walk_with_a_vanished_file)
        assert (p.executor.disk_bytes(), p.disk_usage()) == before
        monkeypatch.setattr(os, "walk", walk)
    finally:
        p.close()
    sizes = inspect_storage(str(tmp_path / "d"))["bytes"]
    monkeypatch.setattr(os, "walk", walk_with_a_vanished_file)
    assert inspect_storage(str(tmp_path / "d"))["bytes"] == sizes


def test_batch_file_listing_survives_files_a_merge_deletes_while_it_lists(tmp_path, monkeypatch) -> None:
    """``dbsp inspect`` of a live pipeline lists its batch files while the pipeline's merges delete some: a file
    listed and gone at its ``stat`` is left out of the unnamed files, and a named one gone after its check is
    "missing", not an error (the listing once called ``getsize`` on every name it listed)."""
    import os

    from dbsp_core.storage import batchrefs
    from dbsp_core.storage.formats import BATCH_FILE_SUFFIX, SPILL_DIR

    d = tmp_path / SPILL_DIR
    d.mkdir()
    (d / ("kept" + BATCH_FILE_SUFFIX)).write_bytes(b"x" * 10)
    listdir, exists = os.listdir, os.path.exists
    monkeypatch.setattr(os, "listdir", lambda p: listdir(p) + ["merged-away" + BATCH_FILE_SUFFIX])
    monkeypatch.setattr(os.path, "exists", lambda p: True if str(p).endswith(BATCH_FILE_SUFFIX) else exists(p))
    named = {"gone" + BATCH_FILE_SUFFIX: {"t": 1}}
    for check in (False, True):
        found = batchrefs.check_batch_files(str(tmp_path), named, check)
        assert found["unnamed"] == [{"file": "kept" + BATCH_FILE_SUFFIX, "bytes": 10}]
        assert [(f["file"], f["bytes"], f["check"]) for f in found["files"]] == \
            [("gone" + BATCH_FILE_SUFFIX, None, "missing")]
        assert found["bad"] == ["gone" + BATCH_FILE_SUFFIX] and found["bytes"] == 0
