"""Storage directories of earlier releases open with this release and continue: tests/fixtures/format1-* (the previous release: format-1 input log and DOUT output segments; replayed, verified, upgraded) and format2-* (written by this release and kept as written, so every later release is held to opening them), with every step's output equal to an in-memory run of the same workload."""

from __future__ import annotations

import os
import shutil
import struct
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "fixtures")
sys.path.insert(0, FIXTURES)

import dbsp_core as dbsp  # noqa: E402
import upgrade_workload as w  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402

LAST = 13  # steps 0..12: 0..8 from the fixture, 9 (its acknowledged pushes), 10..12 new


def _push(p, step: int, durable: bool = True) -> None:
    for name, t in w.changes(step).items():
        if durable:
            p.push(name, t, producer=f"gen-{name}", seq=step)
        else:
            p.push(name, t)


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_format1_directory_opens_and_continues(tmp_path, kind):
    d = str(tmp_path / kind)
    shutil.copytree(os.path.join(FIXTURES, f"format1-{kind}"), d)
    legacy = open(os.path.join(d, "output", "out-0000000000000000.seg"), "rb").read()
    def open_(path, c, **kw):
        return dbsp.Pipeline.open(path, c, executor=StagedExecutor() if kind == "staged" else None, **kw)

    p = open_(d, w.build_circuit(), checkpoint_interval=None)  # replays with checking on: format-1 records verify
    assert p.output_steps == range(0, w.PENDING_STEP)
    p.step()  # the pushes acknowledged before the fixture was closed
    for step in range(w.PENDING_STEP + 1, LAST):
        _push(p, step)
        p.step()
    p.checkpoint()
    p.close()
    assert open(os.path.join(d, "output", "out-0000000000000000.seg"), "rb").read() == legacy
    out_files = sorted(os.listdir(os.path.join(d, "output")))
    assert out_files == ["00000000000000000001.seg", "out-0000000000000000.seg"], out_files
    log_format = struct.unpack_from("<I", open(os.path.join(d, "input", "LOG"), "rb").read(), 8)[0]
    assert log_format == 2  # the input log continued in a format-2 segment

    q = open_(d, w.build_circuit(), checkpoint_interval=None)
    try:
        assert q.output_steps == range(0, LAST) and q.stats["replayed_steps"] == 0
        got = {name: dict(q.read_output(name, 0)) for name in w.build_circuit().outputs}
        assert q.output_inputs(LAST - 1) == [
            {"handle": h, "producer": f"gen-{h}", "first_seq": LAST - 1, "last_seq": LAST - 1, "pushes": 1}
            for h in ("auctions", "bids")]
    finally:
        q.close()
    m = dbsp.Pipeline(w.build_circuit(), workers=2)
    for step in range(LAST):
        _push(m, step, durable=False)
        want = m.step()
        for name, z in want.items():
            assert got[name][step] == z, f"{kind}: output {name} of step {step} differs from the in-memory run"
    m.close()


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_an_interrupted_upgrade_leaves_format1_and_a_wrong_circuit_changes_nothing(tmp_path, monkeypatch, kind):
    import dbsp_core.runtime.upgrade as upgrade
    from dbsp_core.errors import CircuitMismatchError

    d = str(tmp_path / kind)
    shutil.copytree(os.path.join(FIXTURES, f"format1-{kind}"), d)
    before = {os.path.relpath(os.path.join(a, f), d): open(os.path.join(a, f), "rb").read()
              for a, _, fs in os.walk(d) for f in fs}
    ex = (lambda: StagedExecutor()) if kind == "staged" else (lambda: None)
    other = w.build_circuit()
    other.output("extra", dbsp.circuit.Stream(other, other.inputs["bids"]))  # another circuit
    with pytest.raises(CircuitMismatchError):
        dbsp.Pipeline.open(d, other, executor=ex(), checkpoint_interval=None)

    def crash(*a, **k):
        raise OSError("killed before META switched")

    monkeypatch.setattr(upgrade, "write_meta", crash)
    with pytest.raises(OSError, match="before META"):
        dbsp.Pipeline.open(d, w.build_circuit(), executor=ex(), checkpoint_interval=None)
    monkeypatch.undo()
    after = {os.path.relpath(os.path.join(a, f), d): open(os.path.join(a, f), "rb").read()
             for a, _, fs in os.walk(d) for f in fs}
    # every format-1 file the previous release reads is as it was (new files may have appeared beside them)
    assert {k: v for k, v in after.items() if k in before and k != "driver.db"} == \
        {k: v for k, v in before.items() if k != "driver.db"}
    p = dbsp.Pipeline.open(d, w.build_circuit(), 3, executor=ex(), checkpoint_interval=None)  # upgrade + rescale
    assert p.stats.get("upgraded_from_format") == 1 and p.layout.workers == 3
    p.step()
    for step in range(w.PENDING_STEP + 1, LAST):
        _push(p, step)
        p.step()
    got = {name: dict(p.read_output(name, 0)) for name in w.build_circuit().outputs}
    p.close()
    assert not os.path.exists(os.path.join(d, "worker-0.db")) and not os.path.exists(os.path.join(d, "stages"))
    m = dbsp.Pipeline(w.build_circuit(), workers=1)
    for step in range(LAST):
        _push(m, step, durable=False)
        for name, z in m.step().items():
            assert got[name][step] == z, f"{kind}: output {name} of step {step} differs after upgrade + rescale"
    m.close()


@pytest.mark.parametrize("kind", ["embedded", "staged"])
@pytest.mark.parametrize("workers", [None, 3])
def test_format2_directory_opens_and_continues(tmp_path, kind, workers):
    """The directories this release writes (tests/fixtures/format2-*, see make_format2.py) are kept as written:
    every later release must open them (with a replay of the steps after the checkpoint and the pushes that
    were acknowledged but never stepped), also at another worker count, and continue exactly once."""
    d = str(tmp_path / kind)
    shutil.copytree(os.path.join(FIXTURES, f"format2-{kind}"), d)

    def open_(path, c, **kw):
        return dbsp.Pipeline.open(path, c, executor=StagedExecutor() if kind == "staged" else None, **kw)

    p = open_(d, w.build_circuit(), checkpoint_interval=None, workers=workers)
    assert p.output_steps == range(0, w.PENDING_STEP)
    assert p.workers == (workers or 2)
    p.step()  # the pushes acknowledged before the fixture was closed
    for step in range(w.PENDING_STEP + 1, LAST):
        _push(p, step)
        p.step()
    _push(p, LAST - 1)  # a producer's retry after the crash is a duplicate: no second copy
    p.close()
    q = open_(d, w.build_circuit(), checkpoint_interval=None)
    try:
        assert q.output_steps == range(0, LAST) and q.stats["replayed_steps"] == 0
        got = {name: dict(q.read_output(name, 0)) for name in w.build_circuit().outputs}
    finally:
        q.close()
    m = dbsp.Pipeline(w.build_circuit(), workers=2)
    for step in range(LAST):
        _push(m, step, durable=False)
        want = m.step()
        for name, z in want.items():
            assert got[name][step] == z, f"{kind}: output {name} of step {step} differs from the in-memory run"
    m.close()
