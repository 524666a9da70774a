"""``dbsp repair`` finishes or says exactly why not (issue 29, defect 3): a missing input segment, damaged output history below the checkpoint (``--drop-output``), damaged state databases, LAYOUT and META; every CorruptionError names ``dbsp repair``."""

from __future__ import annotations

import os
import random
import shutil
import sys

import pytest

import dbsp_core as dbsp
from dbsp_core.__main__ import main as cli
from dbsp_core.errors import CorruptionError, DbspError
from dbsp_core.storage.repair import repair
from dbsp_core.storage.salvage import salvage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_damage import batch, build, circuit, flip, model, views  # noqa: E402

SEED = int(os.environ.get("DBSP_REPAIR_SEED", random.randrange(10**6)))
print(f"\n[repair] DBSP_REPAIR_SEED={SEED}")


def _segments(d: str, part: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(d, part)) if n.endswith(".seg"))


def _pushes_in(d: str, part: str, segment: str) -> set[tuple[str, int]]:
    return {(r.producer, r.seq) for r in salvage(os.path.join(d, part)).records
            if r.segment == segment and r.producer and not r.handle.startswith("\x00")}


def test_a_missing_middle_input_segment_names_every_lost_push_and_opens(tmp_path, capsys):
    """Before the fix repair reported a 0-byte damaged range in another segment and "0 pushes are lost", and
    the directory did not open; now every push the missing segment held is named and the directory opens with
    the views of every other acknowledged push."""
    d = str(tmp_path / "d")
    where = build(d, steps=14, checkpoint_at=3, segment_bytes=4096)
    segs = _segments(d, "input")
    assert len(segs) >= 4, segs
    rng = random.Random(SEED)
    gone = segs[rng.randrange(1, len(segs) - 1)]  # a middle one: neither the oldest nor the newest
    held = _pushes_in(d, "input", gone)
    assert held, f"segment {gone} holds no push (seed {SEED})"
    os.unlink(os.path.join(d, "input", gone))
    with pytest.raises(CorruptionError, match="dbsp repair"):
        dbsp.Pipeline.open(d, circuit())
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert f"missing      input/{gone}" in out, out
    lost = {(ln.split("'")[1], int(ln.split("seq ")[1].split()[0])) for ln in out.splitlines()
            if ln.startswith("lost         producer")}
    assert lost == held, (f"seed {SEED}: lost {sorted(lost)} != held by {gone} {sorted(held)}", out)
    p = dbsp.Pipeline.open(d, circuit())
    p.step()  # the valid pushes of the withdrawn steps, logged again
    assert views(p) == model(sorted(set(where) - lost)), f"seed {SEED}"
    for pr, q in sorted(lost):  # a lost push can be pushed again, once
        assert not p.push("t", batch(pr, q), producer=pr, seq=q).duplicate
    p.step()
    assert views(p) == model(sorted(where)), f"seed {SEED}"
    p.close()
    assert repair(d)["result"].startswith("nothing to repair")
