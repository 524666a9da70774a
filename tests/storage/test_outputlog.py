"""OutputLog over the C step log: the write rules (discard, verify, append by step), sync and flush, torn tails cut, mid-log damage refused with the file and offset and nothing changed, a reader process while a writer appends, and format-1 directories (the previous release's DOUT segments) that open and continue."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from dbsp_core import _storage
from dbsp_core.storage.inspect import open_output
from dbsp_core.errors import CorruptionError, ReplayMismatchError
from dbsp_core.storage import FaultInjector, FaultVfs
from dbsp_core.storage.outputlog import OutputLog

from outputlog_helpers import (SCHEMAS, big_rows, flip, frames, inputs, outputs, same_step, segments, snapshot,
                               write_format1)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "fixtures")


def write_steps(log: OutputLog, steps) -> None:
    for step in steps:
        assert log.write(step, outputs(step), inputs(step)) == "appended"


def test_write_rules_reads_and_retention(tmp_path):
    p = str(tmp_path / "out")
    log = OutputLog(p, SCHEMAS, segment_bytes=4096)
    assert (log.first, log.last) == (0, 0)
    write_steps(log, range(20))
    assert (log.first, log.last) == (0, 20) and len(segments(p)) > 3
    assert log.write(3, outputs(3), inputs(3)) == "replayed"
    with pytest.raises(ReplayMismatchError, match="output 'counts'"):
        log.write(3, outputs(4), inputs(3))
    with pytest.raises(ValueError, match="next step is 20"):
        log.write(21, outputs(21), inputs(21))
    assert [s for s, _ in log.read("names", 17)] == [17, 18, 19]
    assert all(same_step(log, s) for s in range(20))
    with pytest.raises(KeyError):
        log.get(20)
    with pytest.raises(KeyError):
        next(log.read("nope"))
    dropped = log.truncate_below(10)
    assert dropped > 0 and 0 < log.first <= 10 and log.last == 20
    assert log.write(0, outputs(0), inputs(0)) == "discarded"
    with pytest.raises(LookupError):
        next(log.read("counts", 0))
    log.truncate_below(10**6)  # never the segment holding the newest step
    assert log.first <= 19 and same_step(log, 19) and log.disk_bytes() > 0
    log.close()
    log = OutputLog(p, SCHEMAS, segment_bytes=4096)
    assert log.last == 20 and log.first <= 19
    write_steps(log, [20])
    log.close()
    ro = OutputLog(p, SCHEMAS, readonly=True)
    assert ro.last == 21 and same_step(ro, 20)
    with pytest.raises(ValueError, match="read-only"):
        ro.write(21, outputs(21), inputs(21))
    with pytest.raises(ValueError, match="read-only"):
        ro.truncate_below(5)
    ro.close()
    with pytest.raises(FileNotFoundError):
        OutputLog(str(tmp_path / "missing"), SCHEMAS, readonly=True)


def test_sync_false_writes_now_and_flush_makes_durable(tmp_path):
    """sync=False: a write is visible at once (to a reader too) and durable only after flush; sync=True: at once."""
    p = str(tmp_path / "out")
    OutputLog(p, SCHEMAS).close()
    FaultInjector.arm()
    log = OutputLog(p, SCHEMAS, sync=False, vfs="fault")
    write_steps(log, range(3))
    reader = OutputLog(p, SCHEMAS, readonly=True)
    assert reader.last == 3 and same_step(reader, 2)  # written through, not held back
    log.flush()
    write_steps(log, range(3, 5))  # never flushed
    FaultInjector.crash_now("drop")
    FaultInjector.disarm()
    log._log.close()
    reader.close()
    log = OutputLog(p, SCHEMAS, sync=True, vfs="fault")
    assert log.last == 3, "unflushed steps survived a crash that drops unsynced writes"
    FaultInjector.arm()
    write_steps(log, range(3, 5))
    FaultInjector.crash_now("drop")
    FaultInjector.disarm()
    log._log.close()
    log = OutputLog(p, SCHEMAS)
    assert log.last == 5 and all(same_step(log, s) for s in range(5))
    log.close()


def test_deferred_writes_are_unread_until_one_flush_makes_them_durable(tmp_path):
    """defer=True (invariant 2): the records of several steps stay out of every reader's sight (this log's get, read,
    inputs_of and readable; a read-only log in the same or another process) until one flush writes and fsyncs them
    all; a crash before it loses them all and nothing else; after it they are all durable."""
    p = str(tmp_path / "out")
    log = OutputLog(p, SCHEMAS)
    write_steps(log, range(2))
    log.close()
    fv = FaultVfs()
    fv.arm()
    log = OutputLog(p, SCHEMAS, vfs=fv.name)
    reader = OutputLog(p, SCHEMAS, readonly=True)
    for step in range(2, 5):
        assert log.write(step, outputs(step), inputs(step), defer=True) == "appended"
    assert (log.last, log.readable) == (5, 2)
    with pytest.raises(KeyError, match="holds 0..2"):
        log.get(3)
    with pytest.raises(KeyError):
        log.inputs_of(2)
    assert [s for s, _ in log.read("counts", 0)] == [0, 1]
    reader.refresh()
    assert reader.last == 2, "a deferred record reached the files before the flush"
    ops = fv.ops()
    log.flush()
    assert fv.ops() - ops <= 3, f"one flush of three records took {fv.ops() - ops} operations (one write, one fsync)"
    assert log.readable == 5 and all(same_step(log, s) for s in range(5))
    reader.refresh()
    assert reader.last == 5 and same_step(reader, 4)
    reader.close()
    for step in range(5, 7):  # never flushed: a crash that drops unsynced writes loses exactly these
        log.write(step, outputs(step), inputs(step), defer=True)
    fv.crash_now("keep")  # even a crash that keeps every write: they were never written
    fv.disarm()
    log._log.close()
    log = OutputLog(p, SCHEMAS)
    assert log.last == 5 and all(same_step(log, s) for s in range(5)), "the flushed steps are not all durable"
    log.close()


def test_torn_tail_is_cut_and_a_reader_leaves_it(tmp_path):
    p = str(tmp_path / "out")
    log = OutputLog(p, SCHEMAS, segment_bytes=8192)
    write_steps(log, range(10))
    log.close()
    newest = os.path.join(p, segments(p)[-1])
    size = os.path.getsize(newest)
    os.truncate(newest, size - 7)  # a torn write of the last record
    before = snapshot(p)
    ro = OutputLog(p, SCHEMAS, readonly=True)
    assert ro.last == 9 and snapshot(p) == before  # a reader shows the valid prefix and cuts nothing
    ro.close()
    log = OutputLog(p, SCHEMAS, segment_bytes=8192)
    assert log.last == 9 and os.path.getsize(newest) < size - 7
    write_steps(log, [9])
    log.close()
    with open(newest, "ab") as f:
        f.write(os.urandom(100))  # garbage after the last record: no valid record follows, so a torn tail
    log = OutputLog(p, SCHEMAS, segment_bytes=8192)
    assert log.last == 10 and all(same_step(log, s) for s in range(10))
    log.close()


def test_mid_log_damage_is_refused_with_file_and_offset_and_changes_nothing(tmp_path):
    """A flip in any synced record that a later write follows is damage: CorruptionError naming the segment file
    and the record's offset, for a writer and for a reader, with every file byte-identical. A flip in the newest
    record is indistinguishable from a torn write and is cut (csrc/steplog.c invariant 6, limits)."""
    pristine = str(tmp_path / "pristine")
    log = OutputLog(pristine, SCHEMAS, segment_bytes=6000)
    write_steps(log, range(12))
    log.close()
    work = str(tmp_path / "work")
    tried = refused = cut = 0
    segs = segments(pristine)
    newest = (segs[-1], frames(os.path.join(pristine, segs[-1]))[-1]["off"])
    for name in segs:
        recs = frames(os.path.join(pristine, name))
        for rec in recs:
            span = rec["end"] - rec["off"]
            for at in sorted({0, 5, 9, 17, 22, 24, 30, span // 2, span - 1}):
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(pristine, work)
                flip(os.path.join(work, name), rec["off"] + at)
                damaged = snapshot(work)
                tried += 1
                if (name, rec["off"]) == newest:
                    log = OutputLog(work, SCHEMAS)
                    assert log.last == 11
                    log.close()
                    cut += 1
                    continue
                for readonly in (True, False):
                    with pytest.raises(CorruptionError) as e:
                        OutputLog(work, SCHEMAS, readonly=readonly)
                    assert os.path.join(work, name) in str(e.value), str(e.value)
                    assert re.search(rf"at offset {rec['off']}\b", str(e.value)), str(e.value)
                    assert snapshot(work) == damaged
                refused += 1
    # the active segment's header, with records after it
    shutil.rmtree(work)
    shutil.copytree(pristine, work)
    flip(os.path.join(work, segs[-1]), 20)
    damaged = snapshot(work)
    with pytest.raises(CorruptionError, match=re.escape(segs[-1]) + ".*damaged segment header at offset 0"):
        OutputLog(work, SCHEMAS)
    assert snapshot(work) == damaged
    print(f"\n[outputlog damage] {tried} byte flips: {refused} refused with file and offset, {cut} in the newest "
          f"record cut as a torn tail, 0 files changed")


def test_marks_follow_the_writes(tmp_path):
    """The byte layout of csrc/steplog.c: with sync=True each record's mark is its own offset (everything before
    it was fsynced); with sync=False records written between flushes share the mark of the last flush."""
    p = str(tmp_path / "out")
    log = OutputLog(p, SCHEMAS, segment_bytes=1 << 20)
    write_steps(log, range(3))
    log.close()
    log = OutputLog(p, SCHEMAS, sync=False, segment_bytes=1 << 20)
    write_steps(log, range(3, 6))
    log.flush()
    write_steps(log, range(6, 8))
    log.close()
    recs = frames(os.path.join(p, segments(p)[0]))
    assert [r["step"] for r in recs] == list(range(8))
    assert [r["mark"] for r in recs[:4]] == [r["off"] for r in recs[:4]]
    assert recs[4]["mark"] == recs[5]["mark"] == recs[3]["off"] and recs[6]["mark"] == recs[7]["mark"] == recs[6]["off"]


def test_a_reader_process_reads_while_a_writer_appends(tmp_path):
    """A read-only OutputLog in another process refreshes while this process appends (large records, sync on and
    off, segment rotations, retention behind the reader): it sees every step once, in order, each complete."""
    p = str(tmp_path / "out")
    progress = str(tmp_path / "progress")
    n = 120
    log = OutputLog(p, SCHEMAS, sync=False, segment_bytes=64 << 10)
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "outputlog_reader_child.py"), p, str(n), progress],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def seen() -> int:  # the next step the reader needs (-1 until it runs)
        try:
            return int(open(progress).read())
        except (FileNotFoundError, ValueError):
            return -1

    try:
        deadline = time.monotonic() + 240
        while seen() < 0 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for step in range(n):
            while step - seen() > 6 and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)  # stay a few steps ahead of the reader, so reads and writes interleave
            log.sync = step % 3 == 0
            assert log.write(step, outputs(step, big_rows(step)), inputs(step)) == "appended"
            if step % 10 == 9:
                log.flush()
                log.truncate_below(min(seen(), step) - 2)
        log.close()
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, err.decode()
    words = out.decode().split()
    assert words[0] == "OK" and int(words[1]) == n, out.decode()
    print(f"\n[outputlog reader process] {n} steps read while written, {words[2]} refreshes, "
          f"{words[3]} steps dropped by retention after they were read, {words[4]} refreshes met a record being "
          f"written")


def test_reader_refresh_forgets_dropped_segments(tmp_path):
    p = str(tmp_path / "out")
    log = OutputLog(p, SCHEMAS, segment_bytes=4096)
    write_steps(log, range(10))
    ro = OutputLog(p, SCHEMAS, readonly=True)
    assert (ro.first, ro.last) == (0, 10)
    log.truncate_below(8)
    write_steps(log, range(10, 14))
    assert same_step(ro, 0)  # files it opened stay readable until a refresh
    ro.refresh()
    assert ro.first == log.first > 0 and ro.last == 14 and same_step(ro, 13)
    with pytest.raises(LookupError):
        next(ro.read("counts", 0))
    ro.close()
    log.close()


def _fixture_output(tmp_path, kind: str) -> tuple[str, dict]:
    d = str(tmp_path / kind)
    shutil.copytree(os.path.join(FIXTURES, f"format1-{kind}"), d)
    ro = open_output(d)  # the previous release's directory, read-only, with the schemas from its META
    schemas = ro.schemas
    ro.close()
    return d, schemas


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_format1_fixture_output_opens_and_continues(tmp_path, kind):
    d, schemas = _fixture_output(tmp_path, kind)
    out = os.path.join(d, "output")
    legacy = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    ro = open_output(d)
    assert (ro.first, ro.last) == (0, 9)
    old = {s: ro.get(s) for s in range(9)}
    assert all(ro.inputs_of(s) for s in range(9))
    ro.close()
    log = OutputLog(out, schemas, segment_bytes=4096)
    assert (log.first, log.last) == (0, 9)
    assert log.write(8, old[8]) == "replayed"  # verified against the format-1 record
    for step in range(9, 14):  # appended to the step log
        assert log.write(step, old[step % 9], [{"handle": "bids", "producer": "p", "first_seq": step,
                                                "last_seq": step, "pushes": 1}]) == "appended"
    log.close()
    assert {n: open(os.path.join(out, n), "rb").read() for n in legacy} == legacy  # never written
    log = OutputLog(out, schemas, segment_bytes=4096)
    assert (log.first, log.last) == (0, 14)
    assert all(log.get(s)[n] == old[s % 9][n] for s in range(14) for n in schemas)
    assert log.inputs_of(12)[0]["first_seq"] == 12
    assert log.truncate_below(5) == 0  # the format-1 segment still holds steps >= 5
    assert log.truncate_below(9) == 1 and log.first == 9 and not any(n.startswith("out-") for n in os.listdir(out))
    log.close()
    ro = open_output(d)
    assert (ro.first, ro.last) == (9, 14)
    ro.close()


def test_format1_segments_tail_and_damage(tmp_path):
    """Format-1 segments are read in place: a torn tail of the newest is ignored (never cut), damage in an older
    one is refused, and retention drops them before any step-log segment."""
    p = str(tmp_path / "out")
    write_format1(p, range(9), per_segment=3)
    newest = os.path.join(p, "out-0000000000000006.seg")
    with open(newest, "ab") as f:
        f.write(b"DOUT\x01\x00\x00")
    before = snapshot(p)
    log = OutputLog(p, SCHEMAS, segment_bytes=4096)
    assert (log.first, log.last) == (0, 9) and all(same_step(log, s) for s in range(9))
    assert {n: b for n, b in snapshot(p).items() if n.startswith("out-")} == before
    write_steps(log, range(9, 16))
    assert log.truncate_below(7) == 2 and log.first == 6  # the format-1 segments of steps 0..5
    assert log.truncate_below(12) >= 1 and log.first > 6 and not any(n.startswith("out-") for n in os.listdir(p))
    log.close()
    write_format1(str(tmp_path / "bad"), range(9), per_segment=3)
    flip(str(tmp_path / "bad" / "out-0000000000000003.seg"), 40)
    with pytest.raises(CorruptionError, match="out-0000000000000003.seg: bad record at offset 0 of a sealed segment"):
        OutputLog(str(tmp_path / "bad"), SCHEMAS)


def test_a_gap_between_format1_and_step_log_is_corruption(tmp_path):
    p = str(tmp_path / "out")
    write_format1(p, range(6), per_segment=3)
    log = OutputLog(p, SCHEMAS)
    write_steps(log, range(6, 8))
    log.close()
    os.unlink(os.path.join(p, "out-0000000000000003.seg"))  # steps 3..5 are gone
    with pytest.raises(CorruptionError, match="end before step 3 but the step log starts at step 6"):
        OutputLog(p, SCHEMAS)


def test_payload_layout_is_the_documented_one(tmp_path):
    """The step-log payload of a step is byte for byte the layout in outputlog.py's docstring."""
    from outputlog_helpers import body

    p = str(tmp_path / "out")
    log = OutputLog(p, SCHEMAS)
    write_steps(log, range(3))
    log.close()
    raw = _storage.Log(p, "posix", 0, True, False)
    recs, _, _ = raw.read(0, 10, 1 << 20, 0, 0)
    raw.close()
    assert [(r[0], r[1], r[2], r[3]) for r in recs] == [(s, b"", b"", 0) for s in range(3)]
    assert [r[4] for r in recs] == [body(s) for s in range(3)]


def test_a_change_produced_distinct_is_stored_as_it_is_and_others_consolidated(tmp_path):
    """A step's output that its operators produced distinct (no equal rows, no zero weight) is written in its own
    order, not sorted first; any other change is consolidated; a replay in another order still matches."""
    import numpy as np
    import pyarrow as pa

    from dbsp_core.zset import ZSet

    log = OutputLog(str(tmp_path / "out"), SCHEMAS)
    keys = [9, 3, 7, 1, 5]  # not canonical order (key hashes decide that)
    distinct = ZSet._make(pa.table({"k": keys, "n": [1, 1, 1, 1, 1]}, schema=SCHEMAS["counts"]),
                          np.array([1, -1, 2, 1, -3], dtype=np.int64), distinct=True)
    names = ZSet.from_rows([("a",), ("a",), ("b",), ("c",)], SCHEMAS["names"], weights=[1, 1, 1, -1])  # "a" twice
    log.write(0, {"counts": distinct, "names": names}, inputs(0))
    got = log.get(0)
    assert got["counts"].data.column("k").to_pylist() == keys, "a distinct change was sorted before it was written"
    assert got["counts"].weights.tolist() == [1, -1, 2, 1, -3]
    assert got["names"].to_dict() == {("a",): 2, ("b",): 1, ("c",): -1} and len(got["names"].data) == 3
    shuffled = ZSet._make(distinct.data.take([4, 2, 0, 3, 1]), distinct.weights[[4, 2, 0, 3, 1]], distinct=True)
    assert log.write(0, {"counts": shuffled, "names": names}, inputs(0)) == "replayed"
    other = ZSet._make(distinct.data, distinct.weights * 2, distinct=True)
    with pytest.raises(ReplayMismatchError, match="output 'counts'"):
        log.write(0, {"counts": other, "names": names}, inputs(0))
    log.close()


@pytest.mark.parametrize("sync", [True, False])
def test_records_encoded_into_reused_buffers_hold_each_step_s_own_rows(tmp_path, sync):
    """Each output's change is encoded into a buffer the log reuses for it (codec.encode_zset_parts ``into``):
    records of growing and shrinking sizes, two outputs each, read back (by a fresh log too) as written, byte for
    byte what a fresh encode gives. (Watched fail with one buffer shared by both outputs: CorruptionError, the
    first output's bytes overwritten by the second's before the record was copied.)"""
    from dbsp_core.codec import encode_zset

    p = str(tmp_path / "out")
    sizes = [6000, 3, 6000, 50, 20000, 1, 7000, 2]
    log = OutputLog(p, SCHEMAS, sync=sync, segment_bytes=64 << 10)
    for step, n in enumerate(sizes):
        assert log.write(step, outputs(step, n), inputs(step)) == "appended"
    assert set(log._scratch) == set(SCHEMAS)  # the reused path ran
    log.close()
    again = OutputLog(p, SCHEMAS)
    for step, n in enumerate(sizes):
        got, want = again.get(step), outputs(step, n)
        for name in SCHEMAS:
            assert got[name].to_dict() == want[name].to_dict(), (step, name)
            assert encode_zset(got[name]._distinct_rows()) == encode_zset(want[name]._distinct_rows()), (step, name)
    again.close()
