"""Misuse of a durable pipeline changes nothing: pushes over a limit are refused before anything is written, odd column names and bad arguments give clear errors, and the CLI prints what the log holds."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.__main__ import main as cli
from dbsp_core.errors import DbspError


def _circuit(col: str = "v") -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), (col, pa.int64())]))
    c.output("s", t.group_by("k").agg(total=dbsp.sum(col)))
    c.output("raw", t)
    return c


def _rows(n: int = 1, col: str = "v") -> pa.Table:
    return pa.table({"k": list(range(n)), col: [1] * n})


def _works(p: dbsp.Pipeline, step: int) -> None:
    """The pipeline still takes pushes, steps and checkpoints, at the step it was at."""
    assert p.steps == step
    p.push("t", _rows(), producer="good", seq=step)
    assert p.step()["raw"].to_dict() == {(0, 1): 1}
    p.checkpoint()


@pytest.mark.parametrize("producer, message", [
    ("x" * 1025, "producer id of 1025 bytes is longer than the limit of 1024"),
    ("é" * 513, "producer id of 1026 bytes is longer than the limit of 1024"),
    ("a\udc80b", "producer id must be valid UTF-8"),
    ("y" * 65536, "producer id of 65536 bytes is longer than the limit of 1024"),
    ("", "producer must be a non-empty str"),
])
def test_a_producer_id_over_a_limit_is_refused_before_it_is_logged(tmp_path, producer, message):
    """A 1025-byte producer id was logged and then failed every checkpoint; one with a lone surrogate or of 64 KiB
    was refused but left the pipeline broken. Each is refused before anything is written."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(), storage=d, checkpoint_interval=None)
    p.push("t", _rows(), producer="good", seq=100)
    p.step()
    records = len(p._input)
    with pytest.raises((ValueError, TypeError), match=message):
        p.push("t", _rows(), producer=producer, seq=0)
    assert len(p._input) == records  # nothing was logged
    _works(p, 1)
    p.close()
    q = dbsp.Pipeline.open(d, _circuit(), checkpoint_interval=None)  # and the directory opens
    assert q.steps == 2
    q.close()


def test_a_payload_over_the_log_limit_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    """A push whose encoded batch exceeds the step log's record limit (1 GiB) broke the pipeline; it is refused
    naming the limit. The limit is lowered here so the test needs no gigabyte of memory; the check is the one
    the driver makes for the real limit, before the C log (which would refuse it too) is called."""
    from dbsp_core.runtime import driver

    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(), storage=d, checkpoint_interval=None)
    p.push("t", _rows(), producer="good", seq=100)
    p.step()
    monkeypatch.setattr(driver, "MAX_PUSH_BYTES", 4096)
    records = len(p._input)
    with pytest.raises(ValueError, match=r"push\('t'\): the batch is \d+ bytes encoded, more than the limit of 4096"):
        p.push("t", _rows(2000), producer="big", seq=0)
    assert len(p._input) == records
    monkeypatch.undo()
    _works(p, 1)
    p.close()


def test_the_log_limit_is_the_c_logs_limit():
    from dbsp_core import _storage
    from dbsp_core.runtime import driver

    assert driver.MAX_PUSH_BYTES == _storage.MAX_PAYLOAD == 1 << 30


@pytest.mark.parametrize("bad, exc, message", [
    (-5, ValueError, "from_step must be >= 0"),
    (1.5, TypeError, "from_step must be an int step number, got 1.5"),
    ("0", TypeError, "from_step must be an int step number"),
    (True, TypeError, "from_step must be an int step number"),
])
def test_read_output_arguments_are_checked(tmp_path, bad, exc, message):
    """``read_output(-5)`` said "dropped by retention" and ``read_output(1.5)`` raised KeyError."""
    p = dbsp.Pipeline(_circuit(), storage=str(tmp_path / "d"), checkpoint_interval=None)
    p.push("t", _rows())
    p.step()
    with pytest.raises(exc, match=message):
        next(p.read_output("s", bad))
    assert [s for s, _ in p.read_output("s", 0)] == [0]
    p.close()


@pytest.mark.parametrize("col", ["weight", "__dbsp_weight", "__dbsp_weight__"])
def test_a_column_named_like_the_weight_works_everywhere(tmp_path, capsys, col):
    """A user column ``weight`` was shadowed: to_arrow() had two ``weight`` columns and ``dbsp read`` printed the
    weight as the column's value. Push (also in the to_arrow form), step, recovery, read_output and the CLI."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(col), workers=2, storage=d, checkpoint_interval=None)
    p.push("t", pa.table({"k": [1, 1, 2], col: [10, 10, 30]}))
    z = dbsp.ZSet.from_arrow(pa.table({"k": [2], col: [30]}), weights=[4])
    p.push("t", z.to_arrow())  # the to_arrow form: the data columns and the weight column
    out = p.step()
    assert out["raw"].to_dict() == {(1, 10): 2, (2, 30): 5}
    assert out["s"].to_dict() == {(1, 20): 1, (2, 150): 1}
    p.close(checkpoint=False)
    q = dbsp.Pipeline.open(d, _circuit(col))  # replays and verifies the step
    assert [z.to_dict() for _, z in q.read_output("raw")] == [{(1, 10): 2, (2, 30): 5}]
    q.close()
    assert cli(["read", d, "raw"]) == 0
    printed = capsys.readouterr().out
    assert f"'{col}': 30" in printed and f"'{col}': 10" in printed and "': 5}" in printed, printed


def test_dbsp_inspect_only_reads(tmp_path):
    """``dbsp inspect`` created files (it took the directory lock by creating LOCK) in the directory it inspects."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(), storage=d, checkpoint_interval=None)
    p.push("t", _rows())
    p.step()
    p.close()
    os.unlink(os.path.join(d, "LOCK"))
    before = {os.path.join(r, f): os.stat(os.path.join(r, f)).st_mtime_ns for r, _, fs in os.walk(d) for f in fs}
    assert cli(["inspect", d]) == 0
    after = {os.path.join(r, f): os.stat(os.path.join(r, f)).st_mtime_ns for r, _, fs in os.walk(d) for f in fs}
    assert after == before


def test_dbsp_inspect_reads_while_the_pipeline_runs(tmp_path, capsys):
    """The logs can be read beside a running pipeline; its databases are locked, and inspect says so."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(), storage=d, checkpoint_interval=None)
    p.push("t", _rows())
    p.step()
    assert cli(["inspect", d]) == 0
    out = capsys.readouterr().out
    assert "in use by a running pipeline" in out and "output log   steps 0..0" in out, out
    p.close()
    assert cli(["inspect", d]) == 0
    assert "checkpoint   through step 0" in capsys.readouterr().out


def test_a_pipeline_is_refused_while_another_one_holds_the_directory(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(), storage=d, checkpoint_interval=None)
    with pytest.raises(DbspError, match="in use"):
        dbsp.Pipeline.open(d, _circuit())
    p.close()
