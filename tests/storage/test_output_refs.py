"""Output-log references (outputlog.py invariant 7): a view that is an input itself is logged as the (producer, seq) of the step's pushes instead of a copy of their rows, and every reader sees the same rows as from a copy: read_output, a read-only reader in another process, replay after reopening, and after checkpoints that truncate the input log."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core as dbsp
from dbsp_core.codec import decode_zset
from dbsp_core.errors import FormatVersionError
from dbsp_core.storage.formats import INPUT_DIR, OUTPUT_DIR, OUTPUT_REF_VERSION
from dbsp_core.storage.inspect import open_output

SEED = int(os.environ.get("DBSP_OUTPUT_REFS_SEED", random.randrange(1 << 30)))
S = pa.schema([("k", pa.int64()), ("v", pa.utf8())])


def circuit(event_time: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.utf8()), ("ts", pa.int64())]), event_time="ts") \
        if event_time else c.input("t", S)
    c.output("same", t)  # the input itself: logged by reference
    c.output("big", t.filter(pc.field("k") > 2))  # a filter: logged with its rows
    return c


def rows(rng: random.Random, n: int) -> tuple[list[tuple], list[int]]:
    """Rows with repeats and retractions, so the step's sum needs consolidating (and may cancel to nothing)."""
    rs = [(rng.randrange(6), rng.choice("abc")) for _ in range(n)]
    return rs, [rng.choice([1, 1, 2, -1]) for _ in rs]


def parts(log_dir: str, step: int) -> list[bytes]:
    """The output parts of ``step``'s record, read from the segment files (the output log's byte layout)."""
    from dbsp_core.storage.steplog import StepLog

    with StepLog(log_dir, readonly=True) as log:
        (rec,) = log.read(step)
    body, pos, out = rec.payload, 4, []
    (count,) = struct.unpack_from("<I", body)
    for _ in range(count):
        (n,) = struct.unpack_from("<I", body, pos)
        out.append(bytes(body[pos + 4:pos + 4 + n]))
        pos += 4 + n
    meta = json.loads(out[0])
    return dict(zip(meta["outputs"], out[1:]))


def is_ref(part: bytes) -> bool:
    return part[:4] == b"DZS1" and part[4] == OUTPUT_REF_VERSION


def test_an_identity_view_is_logged_by_reference_and_read_back_the_same(tmp_path):
    print(f"DBSP_OUTPUT_REFS_SEED={SEED}")
    rng = random.Random(SEED)
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None)
    model: list[dict] = []
    for step in range(6):
        want: dict = {}
        pushes = []
        for k in range(rng.randrange(0, 4)):
            rs, ws = rows(rng, rng.randrange(0, 8))
            for r, w in zip(rs, ws):
                want[r] = want.get(r, 0) + w
            pushes.append({"handle": "t", "data": rs, "weights": ws} | ({"producer": "a", "seq": step * 10 + k}
                                                                        if k % 2 else {}))
        if pushes:
            p.push_many(pushes)
        got = p.step()["same"].to_dict()
        want = {r: w for r, w in want.items() if w}
        assert got == want
        model.append(want)
        if pushes:  # the view was logged as a reference (and the filter with its rows)
            ps = parts(os.path.join(d, OUTPUT_DIR), step)
            assert is_ref(ps["same"]) and not is_ref(ps["big"])
    assert [z.to_dict() for _, z in p.read_output("same")] == model
    # a read-only reader (as `dbsp read`, consumers and sinks open it) resolves the references itself
    reader = open_output(d)
    assert [z.to_dict() for _, z in reader.read("same")] == model
    p.push("t", [(9, "z")])
    p.step()
    reader.refresh()  # its input log view predates the new push: resolving it reads the input log again
    assert reader.get(6)["same"].to_dict() == {(9, "z"): 1}
    reader.close()
    p.close()
    # reopened: replay checks and reads go through the same resolution
    q = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert [z.to_dict() for _, z in q.read_output("same")] == model + [{(9, "z"): 1}]
    q.close()
    # dbsp inspect counts the steps logged by reference
    from dbsp_core.storage.inspect import inspect_storage

    assert inspect_storage(d)["output_by_reference"] == sum(1 for s in range(7) if is_ref(
        parts(os.path.join(d, OUTPUT_DIR), s)["same"])) > 0


@pytest.mark.parametrize("retention", [None, 8])
def test_checkpoints_keep_the_input_records_the_output_log_names(tmp_path, retention):
    """The input log is truncated at a checkpoint only below the output log's first step: every output step kept
    reads back (all of them without retention), and with retention both logs do shrink."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), storage=d, checkpoint_interval=None, segment_bytes=4096, output_retention=retention)
    for step in range(40):
        p.push("t", [(step, "x" * 200)])
        p.step()
        if step % 5 == 4:
            p.checkpoint()
    first = p.output_steps.start
    assert [z.to_dict() for _, z in p.read_output("same", first)] == [{(s, "x" * 200): 1} for s in range(first, 40)]
    if retention is None:
        assert first == 0 and p._input.first_step == 0
    else:
        assert first > 0 and 0 < p._input.first_step <= first  # truncated, never past the output log
    p.close()
    q = dbsp.Pipeline.open(d, circuit(), checkpoint_interval=None)
    assert [s for s, _ in q.read_output("same", first)] == list(range(first, 40))
    q.close()


def test_late_rows_make_the_view_a_copy(tmp_path):
    """With event time, the input operator drops late rows: such a step's view is not the pushes' sum and is
    written with its rows."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(event_time=True), storage=d, checkpoint_interval=None)
    p.push("t", [(1, "a", 100)])
    p.step()
    p.push("t", [(2, "b", 50), (3, "c", 200)])  # ts 50 is below the watermark (100): late
    assert p.step()["same"].to_dict() == {(3, "c", 200): 1}
    ps0, ps1 = parts(os.path.join(d, OUTPUT_DIR), 0), parts(os.path.join(d, OUTPUT_DIR), 1)
    assert is_ref(ps0["same"]) and not is_ref(ps1["same"])
    assert [z.to_dict() for _, z in p.read_output("same")] == [{(1, "a", 100): 1}, {(3, "c", 200): 1}]
    p.close()


def test_an_older_build_refuses_a_reference_with_a_format_version_error(tmp_path):
    """A build before references decodes every part as a Z-set: the part's version (3) makes it refuse the record
    with FormatVersionError instead of reading wrong rows."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), storage=d, checkpoint_interval=None)
    p.push("t", [(1, "a")])
    p.step()
    p.close()
    ref = parts(os.path.join(d, OUTPUT_DIR), 0)["same"]
    with pytest.raises(FormatVersionError, match="format version 3"):
        decode_zset(ref, S, "older build")


def test_a_missing_input_record_is_an_error_not_wrong_rows(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), storage=d, checkpoint_interval=None)
    p.push("t", [(1, "a")], producer="a", seq=0)
    p.step()
    p.close()
    # the input log rebuilt without the push (as a damaged log salvaged without it would be)
    src = subprocess.run([sys.executable, "-c", f"""
import shutil
from dbsp_core.storage.steplog import StepLog
recs = list(StepLog({os.path.join(d, INPUT_DIR)!r}, readonly=True).iter_from(0))
shutil.rmtree({os.path.join(d, INPUT_DIR)!r})
with StepLog({os.path.join(d, INPUT_DIR)!r}) as log:
    for r in recs:
        if r.producer != "a":
            log.append(r.step, r.handle, r.payload, producer=r.producer, seq=r.seq)
"""], capture_output=True, text=True)
    assert src.returncode == 0, src.stderr
    reader = open_output(d)
    with pytest.raises(dbsp.CorruptionError, match="holds 0 of the 1 pushes"):
        reader.get(0)
    reader.close()
