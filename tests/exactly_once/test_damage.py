"""Damaged logs at the pipeline level: a damaged input log is refused at open (file and offset named, nothing changed) and ``dbsp repair`` is the way forward (a copy of what it replaces, the lost pushes by name, a directory that opens); a damaged output log is rebuilt at open from the input when recovery computes its lost steps again, and refused otherwise; never is an intact record destroyed."""

from __future__ import annotations

import hashlib
import os
import random

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.__main__ import main as cli
from dbsp_core.errors import CorruptionError, RecoveryError
from dbsp_core.storage.repair import finish_repair, repair
from dbsp_core.storage.salvage import salvage

SEED = int(os.environ.get("DBSP_DAMAGE_SEED", random.randrange(10**6)))
print(f"\n[damage] DBSP_DAMAGE_SEED={SEED}")
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def circuit(by_reference: bool = True) -> dbsp.Circuit:
    """``raw`` is the input itself, logged as references to the pushes (outputlog.py invariant 7); without
    ``by_reference`` it is a projection of every column, logged with its rows."""
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("sums", t.group_by("k").agg(total=dbsp.sum("v")))
    c.output("raw", t if by_reference else t.select(k="k", v="v"))
    return c


def batch(producer: str, seq: int) -> pa.Table:
    rng = random.Random(f"{SEED}/{producer}/{seq}")
    n = rng.randint(1, 4)
    return pa.table({"k": [rng.randint(0, 3) for _ in range(n)], "v": [rng.randint(1, 99) for _ in range(n)]},
                    schema=SCHEMA)


def build(d: str, steps: int = 8, checkpoint_at: int = 3, segment_bytes: int = 4096,
          c: dbsp.Circuit | None = None) -> dict[tuple[str, int], int]:
    """A pipeline of ``steps`` steps (producers a and b, one push each per step), a checkpoint after step
    ``checkpoint_at - 1``, closed without a checkpoint; returns {(producer, seq): step}."""
    p = dbsp.Pipeline(c or circuit(), workers=2, storage=d, checkpoint_interval=None, segment_bytes=segment_bytes)
    where = {}
    for s in range(steps):
        for pr in ("a", "b"):
            p.push("t", batch(pr, s), producer=pr, seq=s)
            where[(pr, s)] = s
        p.step()
        if s == checkpoint_at - 1:
            p.checkpoint()
    p.close(checkpoint=False)
    return where


def files(d: str) -> dict[str, str]:
    out = {}
    for r, _, fs in os.walk(d):
        for f in fs:
            if f != "LOCK":
                with open(os.path.join(r, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(r, f), d)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def flip(d: str, part: str, pick) -> tuple[str, int]:
    """Flip one byte inside the payload of the first record ``pick(record)`` accepts; returns (file, offset)."""
    for r in salvage(os.path.join(d, part)).records:
        if pick(r):
            path = os.path.join(d, part, r.segment)
            off = r.offset + 24 + 24 + 4  # inside the body, past the frame and body headers
            with open(path, "r+b") as f:
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x40]))
            return path, r.offset
    raise AssertionError("no record picked")


def views(p: dbsp.Pipeline) -> dict[str, dict]:
    acc: dict[str, dict] = {}
    for name in ("sums", "raw"):
        a = acc.setdefault(name, {})
        for _, z in p.read_output(name, 0):
            for row, w in z.to_dict().items():
                a[row] = a.get(row, 0) + w
                if not a[row]:
                    del a[row]
    return acc


def model(pushes) -> dict[str, dict]:
    sums: dict = {}
    raw: dict = {}
    for pr, seq in pushes:
        t = batch(pr, seq)
        for k, v in zip(t.column("k").to_pylist(), t.column("v").to_pylist()):
            sums[k] = sums.get(k, 0) + v
            raw[(k, v)] = raw.get((k, v), 0) + 1
    return {"sums": {(k, v): 1 for k, v in sums.items()}, "raw": raw}


def test_a_damaged_input_record_is_refused_at_open_and_changes_nothing(tmp_path):
    d = str(tmp_path / "d")
    build(d)
    path, off = flip(d, "input", lambda r: r.producer == "a" and r.seq == 5)
    before = files(d)
    with pytest.raises(CorruptionError, match=rf"{os.path.basename(path)}.*offset {off}"):
        dbsp.Pipeline.open(d, circuit())
    assert files(d) == before


def test_dbsp_repair_names_the_lost_pushes_and_leaves_a_directory_that_opens(tmp_path, capsys):
    d = str(tmp_path / "d")
    where = build(d)
    flip(d, "input", lambda r: r.producer == "a" and r.seq == 5)
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert "lost         producer 'a' seq 5 (step 5)" in out and "1 pushes are lost by name" in out, out
    rep = [ln for ln in out.splitlines() if ln.startswith("result")][0]
    assert "output steps 5..7 are withdrawn" in rep or "output steps 4..7 are withdrawn" in rep, out
    backup = os.path.join(d, "repair-1")
    assert os.path.isdir(os.path.join(backup, "input")) and os.path.isdir(os.path.join(backup, "output"))
    assert any(n.endswith(".seg") for n in os.listdir(backup))  # the damaged segment, as it was
    p = dbsp.Pipeline.open(d, circuit())
    assert p.steps in (4, 5) and p.stats["recovered_pushes"] == 5 + 2 * (5 - p.steps)  # b5, a6, b6, a7, b7 ...
    assert not p.push("t", batch("a", 5), producer="a", seq=5).duplicate  # a lost push can be pushed again
    assert p.push("t", batch("a", 6), producer="a", seq=6).duplicate
    p.step()
    assert views(p) == model(where)
    p.close()
    assert repair(d)["result"].startswith("nothing to repair")


def test_damage_below_the_checkpoint_loses_nothing(tmp_path):
    d = str(tmp_path / "d")
    where = build(d, checkpoint_at=6, segment_bytes=1 << 20, c=circuit(by_reference=False))  # one segment
    flip(d, "input", lambda r: r.producer == "b" and r.seq == 1)  # step 1, below the checkpoint at 6
    rep = repair(d)
    assert rep["lost"] == [] and "no push is lost" in rep["result"], rep
    p = dbsp.Pipeline.open(d, circuit(by_reference=False))
    assert p.steps == 8 and views(p) == model(where)
    p.close()


def test_damage_below_the_checkpoint_to_a_push_a_reference_names_costs_that_output_step(tmp_path, capsys):
    """The view ``raw`` of step 1 is held only by the damaged push's record (outputlog.py invariant 7): repair
    counts that output step as lost (repair.py invariant 5b) and drops output history only with consent; the
    push itself is held by the state, so no push is lost and the views go on exactly."""
    d = str(tmp_path / "d")
    where = build(d, checkpoint_at=6, segment_bytes=1 << 20)
    flip(d, "input", lambda r: r.producer == "b" and r.seq == 1)  # step 1, below the checkpoint at 6
    before = files(d)
    assert cli(["repair", d]) == 1
    assert "--drop-output 0..1" in capsys.readouterr().err and files(d) == before  # refused: nothing changed
    rep = repair(d, drop_output=(0, 1))
    assert rep["lost"] == [] and rep["output_dropped"] == [0, 1] and rep["output_unnamed"] == [1], rep
    p = dbsp.Pipeline.open(d, circuit())
    assert p.steps == 8 and p.output_steps == range(2, 8)
    got = {s: z.to_dict() for s, z in p.read_output("raw", 2)}
    assert got == {s: model([("a", s), ("b", s)])["raw"] for s in range(2, 8)}
    assert p.push("t", batch("b", 1), producer="b", seq=1).duplicate  # held by the state: still counted once
    p.close()


def test_a_damaged_output_record_is_computed_again_from_the_input(tmp_path):
    """A damaged record of an output step the replay covers: open rebuilds the log (the old one kept in
    repair-1), computes the step again, verifies the intact records after it, and the output is as before."""
    d = str(tmp_path / "d")
    build(d)
    p = dbsp.Pipeline.open(d, circuit(), replay_check=True)
    want = {n: [(s, z.to_dict()) for s, z in p.read_output(n, 0)] for n in ("sums", "raw")}
    p.close(checkpoint=False)
    flip(d, "output", lambda r: r.step == 4)  # after the checkpoint at step 3: replayed on open
    p = dbsp.Pipeline.open(d, circuit())
    assert p.stats["output_rebuilt"]["missing"] == [4] and p.stats["output_rebuilt"]["kept"] == (0, 4)
    assert {n: [(s, z.to_dict()) for s, z in p.read_output(n, 0)] for n in ("sums", "raw")} == want
    assert os.path.isdir(os.path.join(d, "repair-1", "output"))
    p.close()


def test_a_damaged_output_record_below_the_checkpoint_is_refused(tmp_path):
    d = str(tmp_path / "d")
    build(d, checkpoint_at=6, segment_bytes=1 << 20)
    flip(d, "output", lambda r: r.step == 2)
    before = files(d)
    with pytest.raises((RecoveryError, CorruptionError), match="cannot be computed again|step 2"):
        dbsp.Pipeline.open(d, circuit())
    assert files(d) == before


def test_an_interrupted_repair_is_finished_by_open(tmp_path, monkeypatch):
    """A crash between the renames of the swap: open finishes it (the REPAIR record says what to swap)."""
    import dbsp_core.storage.repair as rmod

    d = str(tmp_path / "d")
    where = build(d)
    flip(d, "input", lambda r: r.producer == "b" and r.seq == 6)

    renames = []
    real = os.rename

    def rename(a: str, b: str) -> None:  # the second rename of the swap never happens: input/ is missing
        renames.append((a, b))
        if len(renames) == 2:
            raise KeyboardInterrupt("crash in the middle of the swap")
        real(a, b)
    monkeypatch.setattr(rmod.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        repair(d)
    monkeypatch.undo()
    assert os.path.exists(os.path.join(d, "REPAIR")) and os.path.isdir(os.path.join(d, "input.new"))
    assert not os.path.exists(os.path.join(d, "input"))
    os.unlink(os.path.join(d, "LOCK"))  # the interrupted process is gone with its lock
    p = dbsp.Pipeline.open(d, circuit())
    assert not os.path.exists(os.path.join(d, "REPAIR"))
    assert p.steps == 6
    p.push("t", batch("b", 6), producer="b", seq=6)
    p.step()
    assert views(p) == model(where)
    p.close()
    assert not finish_repair(d)


def test_damage_to_steps_the_state_holds_but_driver_db_does_not(tmp_path):
    """The staged executor commits its state with every job, driver.db only at checkpoints: a division and a
    push of such a step were damaged. Repair makes up the division (recovery keeps only the clock of it) and
    marks the push seen with a discard record: its effect is in the state, so it is not lost and stays a
    duplicate; the directory opens with every view right (``raw`` holds its rows: a reference to the damaged
    push would cost its output step, as the test above shows)."""
    from dbsp_core.runtime.staged import StagedExecutor

    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(by_reference=False), workers=2, storage=d, checkpoint_interval=None,
                      segment_bytes=1 << 20, executor=StagedExecutor())
    where = {}
    for s in range(6):
        for pr in ("a", "b"):
            p.push("t", batch(pr, s), producer=pr, seq=s)
            where[(pr, s)] = s
        p.step()
        if s == 1:
            p.checkpoint()
    p.close(checkpoint=False)
    flip(d, "input", lambda r: r.handle == "\x00division" and r.step == 3)
    flip(d, "input", lambda r: r.producer == "a" and r.seq == 4)
    rep = repair(d)
    assert rep["lost"] == [] and rep["made_up_divisions"] == [3], rep
    assert rep["held_by_the_state"] == [{"producer": "a", "seq": 4, "step": 4}], rep
    q = dbsp.Pipeline.open(d, circuit(by_reference=False), executor=StagedExecutor())
    assert q.steps == 6 and views(q) == model(where)
    assert q.push("t", batch("a", 4), producer="a", seq=4).duplicate
    q.close()
