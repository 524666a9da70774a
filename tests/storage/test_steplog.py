"""StepLog: framing, reads by step, segments and truncation, group commit, torn-tail recovery under crashes."""

from __future__ import annotations

import os
import random
import re
import shutil
import struct
import subprocess
import sys
import threading

import pytest
from hypothesis import example, given, strategies as st

from dbsp_core._storage import crc32c
from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError
from dbsp_core.storage import FaultInjector, LogRecord, StepLog


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(b"\x00" * 32) == 0x8A9136AA
    data = os.urandom(1000)
    assert crc32c(data[500:], crc32c(data[:500])) == crc32c(data)


def test_append_read_reopen(tmp_path):
    p = str(tmp_path / "log")
    with StepLog(p, segment_bytes=4096) as log:
        assert log.first_step is None and len(log) == 0
        for i in range(200):
            log.append(i // 7, "bids" if i % 2 else "auctions", b"x" * (i * 13 % 700), producer=f"p{i % 3}", seq=i)
        assert len(log) == 200 and log.segments > 5
        assert log.first_step == 0 and log.last_step == 199 // 7
        r = log.read(3)
        assert [x.seq for x in r] == list(range(21, 28))
        assert r[0] == LogRecord(3, "auctions" if 21 % 2 == 0 else "bids", f"p{21 % 3}", 21, b"x" * (21 * 13 % 700))
    with StepLog(p, segment_bytes=4096) as log:
        assert [x.seq for x in log.iter_from(0)] == list(range(200))
        assert [x.seq for x in log.iter_from(20, chunk_bytes=1)] == list(range(140, 200))
        assert log.read(1000) == []
        with pytest.raises(ValueError, match="below the last logged step"):
            log.append(5, "bids", b"late")


def test_truncate_below_drops_whole_segments(tmp_path):
    p = str(tmp_path / "log")
    with StepLog(p, segment_bytes=2048) as log:
        for i in range(100):
            log.append(i, "h", b"y" * 300, seq=i)
        segs = log.segments
        dropped = log.truncate_below(50)
        assert dropped > 0 and log.segments == segs - dropped
        first = log.first_step
        assert first <= 50  # nothing at or above the watermark is dropped
        assert [r.step for r in log.iter_from(0)] == list(range(first, 100))
        log.truncate_below(10**9)
        assert log.segments == 1  # the active segment always stays
    with StepLog(p, segment_bytes=2048) as log:
        log.append(100, "h", b"z")
        assert log.last_step == 100


def test_group_commit_threads(tmp_path):
    p = str(tmp_path / "log")
    n_threads, per = 8, 60
    with StepLog(p) as log:
        def work(t):
            for i in range(per):
                log.append(0, "h", b"%d:%d" % (t, i), producer=f"t{t}", seq=i)
        ths = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        recs = list(log.iter_from(0))
        fsyncs = log.fsyncs
    assert len(recs) == n_threads * per
    for t in range(n_threads):  # each producer's records are present once, in order
        assert [r.seq for r in recs if r.producer == f"t{t}"] == list(range(per))
    assert fsyncs <= len(recs)
    print(f"\n[steplog] {len(recs)} appends from {n_threads} threads used {fsyncs} fsyncs")


@given(st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=300)), max_size=40))
def test_log_matches_model(tmp_path_factory, ops):
    p = str(tmp_path_factory.mktemp("hyp") / "log")
    model, step = [], 0
    with StepLog(p, segment_bytes=1024) as log:
        for i, (inc, payload) in enumerate(ops):
            step += inc
            log.append(step, "h", payload, producer="p", seq=i)
            model.append((step, payload))
    with StepLog(p, segment_bytes=1024) as log:
        assert [(r.step, r.payload) for r in log.iter_from(0)] == model
        for s in {s for s, _ in model}:
            assert [r.payload for r in log.read(s)] == [pl for st_, pl in model if st_ == s]


def _segments(p):
    return sorted(f for f in os.listdir(p) if f.endswith(".seg"))


def test_torn_tail_is_truncated(tmp_path):
    p = str(tmp_path / "log")
    with StepLog(p) as log:
        for i in range(10):
            log.append(i, "h", b"p" * 100, seq=i)
    seg = os.path.join(p, _segments(p)[-1])
    size = os.path.getsize(seg)
    _as_after_a_crash(p)  # a torn write needs a crash: a clean close marks the log's end
    with open(seg, "r+b") as f:
        f.truncate(size - 30)  # tear the last record
    with StepLog(p) as log:
        assert [r.seq for r in log.iter_from(0)] == list(range(9))
        log.append(9, "h", b"again", seq=99)
        assert [r.seq for r in log.iter_from(0)][-1] == 99
    _as_after_a_crash(p)
    with open(seg, "ab") as f:
        f.write(os.urandom(50))  # garbage after the last record
    with StepLog(p) as log:
        assert [r.seq for r in log.iter_from(0)] == list(range(9)) + [99]


def _as_after_a_crash(p: str) -> None:
    """LOG as a crash leaves it: without the close mark a clean close writes (csrc/steplog.c invariant 10)."""
    os.truncate(os.path.join(p, "LOG"), 32)


def test_a_cut_after_a_clean_close_is_damage_not_a_torn_tail(tmp_path):
    """Nothing vouches for the newest write of a log, so its cut used to pass for a torn tail and lose records
    that had been acknowledged; a clean close marks the end, and a cut below it is refused, changing nothing."""
    p = str(tmp_path / "log")
    with StepLog(p) as log:
        for i in range(10):
            log.append(i, "h", b"p" * 100, seq=i)
    seg = os.path.join(p, _segments(p)[-1])
    size = os.path.getsize(seg)
    assert os.path.getsize(os.path.join(p, "LOG")) == 64  # header and close mark
    with open(seg, "r+b") as f:
        f.truncate(size - 30)
    with pytest.raises(CorruptionError, match="closed cleanly with %d bytes in it: its end was cut" % size):
        StepLog(p)
    assert os.path.getsize(seg) == size - 30
    with open(seg, "ab") as f:  # the same length again, but the last record is damaged
        f.write(b"\0" * 30)
    with pytest.raises(CorruptionError, match="before the end the log had at its clean close"):
        StepLog(p)
    with pytest.raises(CorruptionError, match="before the end the log had at its clean close"):
        StepLog(p, readonly=True)  # a reader too: no writer has the log open, so nothing is being written
    os.unlink(seg)
    with pytest.raises(CorruptionError, match="closed cleanly with segment .* as its newest, which is missing"):
        StepLog(p)


def test_corruption_in_sealed_segment_is_an_error(tmp_path):
    p = str(tmp_path / "log")
    with StepLog(p, segment_bytes=1024) as log:
        for i in range(30):
            log.append(i, "h", b"q" * 200, seq=i)
    first = os.path.join(p, _segments(p)[0])
    data = bytearray(open(first, "rb").read())
    data[100] ^= 0x10
    open(first, "wb").write(bytes(data))
    with pytest.raises(CorruptionError, match="sealed segment"):
        StepLog(p, segment_bytes=1024)


def test_headers_are_checked(tmp_path):
    p = str(tmp_path / "log")
    StepLog(p).close()
    hdr = bytearray(open(os.path.join(p, "LOG"), "rb").read())
    hdr[8:12] = struct.pack("<I", 99)
    hdr[28:32] = struct.pack("<I", crc32c(bytes(hdr[:28])))
    open(os.path.join(p, "LOG"), "wb").write(bytes(hdr))
    with pytest.raises(FormatVersionError):
        StepLog(p)
    hdr[0] ^= 1
    open(os.path.join(p, "LOG"), "wb").write(bytes(hdr))
    with pytest.raises(CorruptionError):
        StepLog(p)


@pytest.mark.parametrize("group", [1, 3])
def test_crash_at_every_operation_of_appends(tmp_path, group):
    """Crash (every damage mode) at every I/O operation of a run of appends across segment rotations:
    the reopened log holds every acknowledged record, in order, then at most the in-flight ones. With
    ``group`` > 1 the records are enqueued ``group`` at a time and acknowledged by one sync of the last."""
    base = str(tmp_path / "base")
    with StepLog(base, segment_bytes=1500) as log:
        for i in range(5):
            log.append(0, "h", b"base%d" % i, seq=i)
    FaultInjector.arm()
    work = str(tmp_path / "work")
    shutil.copytree(base, work)
    payloads = [b"r%03d" % i * (20 + 37 * i % 300) for i in range(25)]

    def session():
        acked = []
        try:
            with StepLog(work, segment_bytes=1500, vfs="fault") as log:
                for lo in range(0, len(payloads), group):
                    if group == 1:
                        log.append(1 + lo // 3, "h", payloads[lo], seq=100 + lo)
                    else:
                        tickets = [log.enqueue(1 + i // 3, "h", payloads[i], seq=100 + i)
                                   for i in range(lo, min(lo + group, len(payloads)))]
                        log.sync(tickets[-1])
                    acked.extend(100 + i for i in range(lo, min(lo + group, len(payloads))))
        except StorageError:
            pass
        return acked

    assert len(session()) == len(payloads)
    nops = FaultInjector.ops()
    tried = 0
    for n in range(1, nops + 1):
        for mode in FaultInjector.MODES:
            shutil.rmtree(work)
            shutil.copytree(base, work)
            FaultInjector.arm(crash_at=n, mode=mode, seed=n)
            acked = session()
            FaultInjector.disarm()
            with StepLog(work, segment_bytes=1500) as log:
                seqs = [r.seq for r in log.iter_from(0)]
                recs = {r.seq: r.payload for r in log.iter_from(0)}
            assert seqs[:5] == list(range(5)), f"op {n} {mode}: base records lost"
            rest = seqs[5:]
            assert rest[:len(acked)] == acked, f"op {n} {mode}: acknowledged record lost"
            assert rest == [100 + i for i in range(len(rest))] and len(rest) <= len(acked) + group, \
                f"op {n} {mode}: unexpected records {rest}"
            assert all(recs[s] == payloads[s - 100] for s in rest)
            tried += 1
    print(f"\n[steplog crash, groups of {group}] {nops} operations x {len(FaultInjector.MODES)} modes = {tried} crashes, 0 violations")


def test_enqueued_records_are_durable_and_visible_only_after_a_sync(tmp_path):
    p = str(tmp_path / "log")
    log = StepLog(p)
    log.append(0, "h", b"a", seq=1)
    log.enqueue(1, "h", b"b", seq=2)
    assert [r.seq for r in log.iter_from(0)] == [1] and len(log) == 1  # readers see durable records only
    with pytest.raises(ValueError, match="below the last logged step"):
        log.enqueue(0, "h", b"late")  # a record takes its place in the order when it is enqueued
    log.close()  # like a crash before any sync: the enqueued record is not in the log
    with StepLog(p) as log:
        assert [r.seq for r in log.iter_from(0)] == [1]
        t2 = log.enqueue(1, "h", b"b", seq=2)
        t3 = log.enqueue(1, "h", b"c", seq=3)
        f0 = log.fsyncs
        log.sync(t3)  # one write and fsync covers both
        assert log.fsyncs == f0 + 1 and [r.seq for r in log.iter_from(0)] == [1, 2, 3]
        log.sync(t2)  # already durable: nothing to do
        assert log.fsyncs == f0 + 1
        log.enqueue(2, "h", b"d", seq=4)
        log.append(2, "h", b"e", seq=5)  # an append makes every record enqueued before it durable too
        assert [r.seq for r in log.iter_from(0)] == [1, 2, 3, 4, 5] and log.fsyncs == f0 + 2
    with StepLog(p) as log:
        assert [(r.seq, r.payload) for r in log.iter_from(0)] == [(1, b"a"), (2, b"b"), (3, b"c"), (4, b"d"),
                                                                   (5, b"e")]


def test_sync_waits_for_a_leader_in_another_thread(tmp_path):
    """A sync whose records another thread is writing waits for that write instead of returning early."""
    with StepLog(str(tmp_path / "log")) as log:
        stop = threading.Event()

        def hammer():
            i = 0
            while not stop.is_set():
                log.append(0, "h", b"x" * 1000, producer="a", seq=i)
                i += 1

        th = threading.Thread(target=hammer)
        th.start()
        try:
            for k in range(200):
                t = log.enqueue(0, "h", b"mine", producer="b", seq=k)
                log.sync(t)
                assert any(r.producer == "b" and r.seq == k for r in log.iter_from(0)), k
        finally:
            stop.set()
            th.join()


@pytest.mark.parametrize("error", ["EIO", "ENOSPC"])
def test_error_at_every_operation_of_appends(tmp_path, error):
    base = str(tmp_path / "base")
    StepLog(base, segment_bytes=1500).close()
    FaultInjector.arm()
    work = str(tmp_path / "work")
    shutil.copytree(base, work)

    appended = [0]

    def session():
        acked, errs = [], []
        try:
            log = StepLog(work, segment_bytes=1500, vfs="fault")
        except StorageError as e:
            return acked, [e]
        with log:
            for i in range(15):
                try:
                    log.append(i, "h", b"e" * 400, seq=i)
                    acked.append(i)
                except StorageError as e:
                    errs.append(e)
            appended[0] = FaultInjector.ops()
        return acked, errs

    assert len(session()[0]) == 15
    nops, before_close = FaultInjector.ops(), appended[0]
    for n in range(1, nops + 1):
        shutil.rmtree(work)
        shutil.copytree(base, work)
        FaultInjector.arm(error_at=n, error=error)
        acked, errs = session()
        FaultInjector.disarm()
        if n > before_close:  # the close mark (csrc/steplog.c invariant 10): best effort, a failure leaves none
            assert acked == list(range(15)) and not errs
        else:
            assert errs, f"{error} at op {n} did not surface"
        if acked:  # after a failure the log refuses appends until reopened: acks are a prefix
            assert acked == list(range(len(acked)))
        with StepLog(work, segment_bytes=1500) as log:
            seqs = [r.seq for r in log.iter_from(0)]
        assert seqs[:len(acked)] == acked and len(seqs) <= len(acked) + 1, f"{error} at op {n}: {seqs} vs {acked}"
    print(f"\n[steplog errors] {error} at each of {nops} operations, 0 violations")


def _frames(seg):
    """(offset, end, mark) of every format-2 record of a segment (csrc/steplog.c byte layout)."""
    data = open(seg, "rb").read()
    out, off = [], 32
    while off + 24 <= len(data) and data[off:off + 4] == b"DSLR":
        length, mark = struct.unpack_from("<IQ", data, off + 4)
        out.append((off, off + 24 + length, mark))
        off += 24 + length
    return out


def _snapshot(p):
    return {n: open(os.path.join(p, n), "rb").read() for n in sorted(os.listdir(p))}


def test_mid_log_damage_is_refused_and_a_torn_tail_is_still_cut(tmp_path):
    """A byte flip in an acknowledged record that a later write follows raises CorruptionError naming the file and
    the offset, and changes nothing (writer or reader); a flip in the last write is cut like a torn tail."""
    p = str(tmp_path / "log")
    with StepLog(p, segment_bytes=1 << 20) as log:
        seq = 0
        for batch in range(6):  # single appends and groups of three sharing one write
            for _ in range(1 if batch % 2 == 0 else 3):
                seq += 1
                ticket = log.enqueue(batch, "h", b"v%d" % seq * (40 + seq), seq=seq)
            log.sync(ticket)
    _as_after_a_crash(p)  # the last write is cut like a torn tail only after a crash
    seg = os.path.join(p, _segments(p)[-1])
    recs = _frames(seg)
    last_write = recs[-1][2]
    pristine = str(tmp_path / "pristine")
    shutil.copytree(p, pristine)
    refused = cut = 0
    for off, end, mark in recs:
        for at in (off + 1, off + 12, off + 26, (off + end) // 2, end - 1):
            shutil.rmtree(p)
            shutil.copytree(pristine, p)
            data = bytearray(open(seg, "rb").read())
            data[at] ^= 0x04
            open(seg, "wb").write(bytes(data))
            damaged = _snapshot(p)
            if mark < last_write:  # a later write carries a mark above this record
                for ro in (True, False):
                    with pytest.raises(CorruptionError, match=rf"{re.escape(seg)}: damaged record at offset {off}\b"):
                        StepLog(p, readonly=ro)
                    assert _snapshot(p) == damaged
                refused += 1
            else:
                with StepLog(p) as log:
                    assert [r.seq for r in log.iter_from(0)] == list(range(1, 1 + recs.index((off, end, mark))))
                cut += 1
    assert refused and cut
    print(f"\n[steplog damage] {refused} flips in synced records refused with file and offset, {cut} in the last "
          f"write cut as a torn tail")


def test_reordered_unsynced_writes_are_a_torn_tail_not_damage(tmp_path):
    """Two writes without an fsync between them (dbsp_steplog_write) carry the same mark: if a crash keeps the
    later one and loses the earlier, open cuts both instead of calling it damage."""
    p = str(tmp_path / "log")
    with StepLog(p) as log:
        log.append(0, "h", b"synced", seq=1)
        t1 = log.enqueue(1, "h", b"a" * 300, seq=2)
        log._log.write(t1)
        t2 = log.enqueue(1, "h", b"b" * 300, seq=3)
        log._log.write(t2)
    seg = os.path.join(p, _segments(p)[-1])
    (o0, e0, m0), (o1, e1, m1), (o2, e2, m2) = _frames(seg)
    assert m1 == m2 == o1  # both written after the first record was fsynced, neither vouches for the other
    data = bytearray(open(seg, "rb").read())
    data[o1:e1] = bytes(e1 - o1)  # the earlier write never reached the disk, the later one did
    open(seg, "wb").write(bytes(data))
    with StepLog(p) as log:
        assert [r.seq for r in log.iter_from(0)] == [1]
    assert os.path.getsize(seg) == e0


def test_damaged_segment_header_with_records_is_refused(tmp_path):
    p = str(tmp_path / "log")
    with StepLog(p) as log:
        for i in range(3):
            log.append(i, "h", b"x" * 50, seq=i)
    seg = os.path.join(p, _segments(p)[-1])
    data = bytearray(open(seg, "rb").read())
    data[17] ^= 1
    open(seg, "wb").write(bytes(data))
    with pytest.raises(CorruptionError, match="damaged segment header at offset 0"):
        StepLog(p)
    assert open(seg, "rb").read() == bytes(data)
    _as_after_a_crash(p)
    os.truncate(seg, 20)  # a header torn while the segment was created, nothing after it: started again
    with StepLog(p) as log:
        assert len(log) == 0 and os.path.getsize(seg) == 32


def test_reader_sees_appends_and_truncation_and_changes_nothing(tmp_path):
    p = str(tmp_path / "log")
    with pytest.raises(FileNotFoundError):
        StepLog(p, readonly=True)
    w = StepLog(p, segment_bytes=1024)
    r = StepLog(p, readonly=True)
    assert len(r) == 0
    for i in range(20):
        w.append(i, "h", b"y" * 200, seq=i)
    assert len(r) == 0
    r.refresh()
    assert [x.seq for x in r.iter_from(0)] == list(range(20))
    with pytest.raises(ValueError, match="read-only"):
        r.append(20, "h", b"z")
    with pytest.raises(ValueError, match="read-only"):
        r.truncate_below(5)
    w.truncate_below(10)
    seg = os.path.join(p, _segments(p)[-1])
    with open(seg, "ab") as f:
        f.write(b"DSLR" + os.urandom(40))  # a record being written
    before = _snapshot(p)
    r.refresh()
    assert r.first_step == w.first_step and [x.seq for x in r.iter_from(0)][-1] == 19
    assert _snapshot(p) == before
    r.close()
    w.close()


def test_format1_fixture_input_opens_and_continues(tmp_path):
    """The previous release's input log (format 1) is read as it is, and appending starts a format-2 segment
    after LOG is rewritten to say 2; the format-1 segment is never written."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "format1-embedded",
                       "input")
    p = str(tmp_path / "input")
    shutil.copytree(src, p)
    old = open(os.path.join(p, _segments(p)[0]), "rb").read()
    with StepLog(p, readonly=True) as r:
        recs = list(r.iter_from(0))
    assert len(recs) == 29 and (recs[0].step, recs[-1].step) == (0, 9)
    assert _snapshot(p) == _snapshot(src)
    with StepLog(p) as log:
        assert list(log.iter_from(0)) == recs
        log.append(9, "bids", b"more", producer="gen-bids", seq=10)
        log.append(10, "bids", b"later", producer="gen-bids", seq=11)
        assert [seg[1] for seg in log._log.segments()] == [1, 2]  # (number, format, ...)
    assert open(os.path.join(p, _segments(p)[0]), "rb").read() == old
    assert struct.unpack_from("<I", open(os.path.join(p, "LOG"), "rb").read(), 8)[0] == 2
    with StepLog(p) as log:
        assert list(log.iter_from(0)) == recs + [LogRecord(9, "bids", "gen-bids", 10, b"more"),
                                                 LogRecord(10, "bids", "gen-bids", 11, b"later")]
        assert [r.payload for r in log.read(9)][-1] == b"more"


def test_truncation_makes_enqueued_records_durable_first(tmp_path):
    """Truncation syncs before it removes a segment, so a crash never leaves the log without both the dropped
    records and the (unsynced) ones that replaced them."""
    p = str(tmp_path / "log")
    with StepLog(p, segment_bytes=1024) as log:
        for i in range(10):
            log.append(i, "h", b"d" * 300, seq=i)
    FaultInjector.arm()
    with StepLog(p, segment_bytes=1024, vfs="fault") as log:
        ticket = log.enqueue(10, "h", b"d" * 300, seq=10)
        log._log.write(ticket)  # written, not synced
        f0 = log.fsyncs
        assert log.truncate_below(11) > 0 and log.fsyncs == f0 + 1
        FaultInjector.crash_now("drop")
    FaultInjector.disarm()
    with StepLog(p) as log:
        assert [r.seq for r in log.iter_from(0)] == [10]


def test_crash_at_every_operation_of_continuing_a_format1_log(tmp_path):
    """Appending to a format-1 log rewrites LOG and starts a format-2 segment; a crash at any operation of that
    (every damage mode) leaves every format-1 record and every acknowledged append, in order, and a log that opens."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "format1-embedded",
                       "input")
    base = str(tmp_path / "base")
    shutil.copytree(src, base)
    with StepLog(base, readonly=True) as r:
        old = list(r.iter_from(0))
    work = str(tmp_path / "work")

    def session():
        acked = []
        try:
            with StepLog(work, segment_bytes=2000, vfs="fault") as log:
                for i in range(8):
                    log.append(9 + i // 3, "h", b"n%d" % i * (50 + 40 * i), seq=1000 + i)
                    acked.append(1000 + i)
        except StorageError:
            pass
        return acked

    shutil.copytree(base, work)
    FaultInjector.arm()
    assert len(session()) == 8
    nops = FaultInjector.ops()
    FaultInjector.disarm()
    tried = 0
    for n in range(1, nops + 1):
        for mode in FaultInjector.MODES:
            shutil.rmtree(work)
            shutil.copytree(base, work)
            FaultInjector.arm(crash_at=n, mode=mode, seed=n)
            acked = session()
            FaultInjector.disarm()
            with StepLog(work) as log:
                recs = list(log.iter_from(0))
            assert recs[:len(old)] == old, f"op {n} {mode}: a format-1 record changed"
            new = [r.seq for r in recs[len(old):]]
            assert new == list(range(1000, 1000 + len(new))) and new[:len(acked)] == acked, f"op {n} {mode}: {new}"
            tried += 1
    print(f"\n[steplog crash] continuing a format-1 log: {nops} operations x {len(FaultInjector.MODES)} modes = "
          f"{tried} crashes, 0 violations")


# ---- segment files are opened on demand (steplog.c invariant 11) ----

OPEN_SEALED = 16  # steplog.c: sealed segments' files a log keeps open at most


def _fill(p, n, payload=300):
    """A log of about n segments (one record of `payload` bytes each at steps 0..n-1, synced one by one); returns
    the records' steps."""
    with StepLog(p, segment_bytes=256) as log:
        for i in range(n):
            log.append(i, "h", bytes([i % 251]) * payload, seq=i)
        assert log.segments >= n
    return list(range(n))


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to count open files")
def test_a_log_holds_a_bounded_number_of_files_open(tmp_path):
    p = str(tmp_path / "log")
    steps = _fill(p, 300)
    base = _open_fds()
    with StepLog(p, segment_bytes=256) as w, StepLog(p, readonly=True) as r:
        assert _open_fds() - base <= 2 * (OPEN_SEALED + 1) + 2  # + the writer's directory lock
        for log in (w, r):
            assert [x.step for x in log.iter_from(0)] == steps
            for s in (0, 299, 17, 150, 3, 298):  # hits and misses of the cache
                assert [x.payload for x in log.read(s)] == [bytes([s % 251]) * 300]
        w.append(300, "h", b"tail", seq=300)
        r.refresh()
        assert [x.payload for x in r.read(300)] == [b"tail"]
        assert _open_fds() - base <= 2 * (OPEN_SEALED + 1) + 2
        w.truncate_below(250)
        r.refresh()
        assert [x.step for x in r.iter_from(0)] == [x.step for x in w.iter_from(0)] == steps[r.first_step:] + [300]
    assert _open_fds() == base


_LOW_LIMIT_CHILD = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from dbsp_core.storage import StepLog
p, n = sys.argv[1], int(sys.argv[2])
with StepLog(p, segment_bytes=256) as w:
    assert [x.step for x in w.iter_from(0)] == list(range(n))
    w.append(n, "h", b"more", seq=n)
    with StepLog(p, readonly=True) as r:
        assert [x.step for x in r.iter_from(0)] == list(range(n + 1))
print("ok", n)
"""


def test_a_log_of_more_segments_than_the_descriptor_limit_opens(tmp_path):
    """A log used to hold every segment open: ~20k segments met `ulimit -n` and the log could not be reopened."""
    p = str(tmp_path / "log")
    _fill(p, 200)
    res = subprocess.run([sys.executable, "-c", _LOW_LIMIT_CHILD, p, "200"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok 200" in res.stdout, res.stderr


def test_threads_read_through_the_file_cache_while_the_writer_appends(tmp_path):
    p = str(tmp_path / "log")
    steps = _fill(p, 120)
    seed = random.randrange(1 << 30)
    print(f"\n[steplog] file cache threads, seed {seed}")
    errors = []
    with StepLog(p, segment_bytes=256) as w, StepLog(p, readonly=True) as r:
        stop = threading.Event()

        def reader(log, k):
            rng = random.Random(seed + k)
            try:
                for _ in range(300):
                    s = rng.randrange(len(steps))
                    got = [x.payload for x in log.read(s)]
                    assert got == [bytes([s % 251]) * 300], (k, s)
                    if rng.random() < 0.05:
                        lo = rng.randrange(len(steps) - 20)
                        assert [x.step for x in log.iter_from(lo, chunk_bytes=700)][:20] == steps[lo:lo + 20]
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        def writer():
            i = len(steps)
            while not stop.is_set():  # new segments: the sealed one joins the cache under the readers
                w.append(i, "h", bytes([i % 251]) * 300, seq=i)
                i += 1

        def refresher():
            while not stop.is_set():
                r.refresh()

        ths = [threading.Thread(target=reader, args=(log, k)) for k, log in enumerate((w, w, r, r))]
        bg = [threading.Thread(target=writer), threading.Thread(target=refresher)]
        for t in ths + bg:
            t.start()
        for t in ths:
            t.join()
        stop.set()
        for t in bg:
            t.join()
        assert not errors, errors[0]
        r.refresh()
        assert [x.step for x in r.iter_from(0)] == [x.step for x in w.iter_from(0)] == list(range(w.last_step + 1))


def test_a_reader_reading_a_segment_the_writer_removed_is_told_so(tmp_path):
    """A reader opens a sealed segment when it reads it; if the writer's truncation removed the file since the
    reader's last refresh, the read fails naming that (never a silent skip), and a refresh forgets the segment."""
    p = str(tmp_path / "log")
    steps = _fill(p, 60)
    with StepLog(p, segment_bytes=256) as w, StepLog(p, readonly=True) as r:
        w.truncate_below(30)
        with pytest.raises(StorageError, match="removed by the writer's truncation"):
            r.read(0)
        r.refresh()
        assert r.first_step == w.first_step and [x.step for x in r.iter_from(0)] == steps[w.first_step:]


_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 2), st.integers(1, 400)),  # step increment, payload bytes
    st.tuples(st.just("bulk"), st.integers(1, 40)),  # that many records, a step and a segment each
    st.tuples(st.just("read"), st.integers(0, 150)),
    st.tuples(st.just("reader_read"), st.integers(0, 150)),
    st.tuples(st.just("truncate"), st.integers(0, 150)),
    st.tuples(st.just("refresh")),
    st.tuples(st.just("reopen"))), min_size=1, max_size=120)


@given(_OPS)
@example([("bulk", 30), ("refresh",), ("truncate", 20), ("reader_read", 3), ("reader_read", 29), ("read", 25),
          ("refresh",), ("reader_read", 25)])  # a read of an evicted, removed segment; a cached one; a refresh
def test_log_with_more_segments_than_the_file_cache_matches_model(tmp_path_factory, ops):
    """A writer and a reader over a log of many tiny segments (more than the 16 files it keeps open) agree with a
    list model through appends, reads by step, truncation, refreshes and reopens (steplog.c invariant 11). A
    reader's read of a segment truncated since its last refresh either gives what it saw (its file still cached)
    or fails naming the truncation: never a record that was not written, and never a silent skip."""
    p = str(tmp_path_factory.mktemp("fdcache") / "log")
    model: list[tuple[int, bytes]] = []  # (step, payload) of every record written, in order
    w = StepLog(p, segment_bytes=256)
    r = StepLog(p, readonly=True)
    seen: list[tuple[int, bytes]] = []  # what the reader showed at its last refresh
    truncated = False  # the writer truncated since the reader's last refresh
    step, seq, low = 0, 0, 0  # low: the highest step truncated below so far

    def kept() -> list[tuple[int, bytes]]:  # truncation drops whole segments from the front: a suffix remains
        return model[len(model) - len(w):]

    def refreshed() -> list[tuple[int, bytes]]:
        got = [(x.step, x.payload) for x in r.iter_from(0)]
        assert got == kept()  # every append was synced: the reader sees all the writer keeps
        return got

    try:
        for op in ops:
            if op[0] in ("append", "bulk"):
                for inc, size in [op[1:]] if op[0] == "append" else [(1, 200)] * op[1]:
                    step += inc
                    payload = bytes([seq % 251]) * size
                    w.append(step, "h", payload, seq=seq)
                    model.append((step, payload))
                    seq += 1
            elif op[0] == "read":
                assert [x.payload for x in w.read(op[1])] == [pl for s, pl in kept() if s == op[1]]
            elif op[0] == "reader_read":
                want = [pl for s, pl in seen if s == op[1]]
                try:
                    got = [x.payload for x in r.read(op[1])]
                except StorageError as e:
                    assert truncated and "removed by the writer's truncation" in str(e), e
                else:
                    assert got == want
            elif op[0] == "truncate":
                before = len(w)
                w.truncate_below(op[1])
                truncated = truncated or len(w) < before
                low = max(low, op[1])
                # whole segments below the step only, never the newest record (invariant 4)
                assert all(s < low for s, _ in model[:len(model) - len(w)]) and (len(w) > 0) == (len(model) > 0)
                assert [(x.step, x.payload) for x in w.iter_from(0)] == kept()
            elif op[0] == "refresh":
                r.refresh()
                seen, truncated = refreshed(), False
            else:  # reopen both
                r.close()
                w.close()
                w = StepLog(p, segment_bytes=256)
                r = StepLog(p, readonly=True)
                seen, truncated = refreshed(), False
        assert [(x.step, x.payload) for x in w.iter_from(0)] == kept()
    finally:
        r.close()
        w.close()


def test_open_reads_large_segments_in_pieces_and_still_checks_every_record(tmp_path):
    """An open reads a segment through a reused 4 MiB window (csrc/steplog.c, seg_load) instead of the whole file:
    records that straddle the window's edges or outgrow it read back whole, and a flipped byte far past the first
    window is still refused in a sealed segment, refused in the last one when a later write vouches for it, and
    cut as a torn tail when it is in the last write."""
    rng = random.Random(7)
    p = str(tmp_path / "log")
    sizes = [rng.choice([90, 5_000, 700_000, 1_300_000, 5_000_000]) for _ in range(30)]
    payloads = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    with StepLog(p, segment_bytes=12 << 20) as log:
        for i, pl in enumerate(payloads):
            log.append(i, "h", pl, seq=i)
    segs = _segments(p)
    assert len(segs) >= 2
    for ro in (True, False):
        with StepLog(p, segment_bytes=12 << 20, readonly=ro) as log:
            assert [r.payload for r in log.iter_from(0)] == payloads
    _as_after_a_crash(p)
    pristine = str(tmp_path / "pristine")
    shutil.copytree(p, pristine)

    def damaged(seg_name, at):
        shutil.rmtree(p)
        shutil.copytree(pristine, p)
        seg = os.path.join(p, seg_name)
        with open(seg, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x20]))
        return seg

    # a sealed segment: a record beyond the first window
    first = _frames(os.path.join(pristine, segs[0]))
    off, end, _ = next(fr for fr in first if fr[0] > 4 << 20)
    damaged(segs[0], (off + end) // 2)
    with pytest.raises(CorruptionError, match=rf"invalid record at offset {off} of a sealed segment"):
        StepLog(p, segment_bytes=12 << 20)
    # the last segment: a synced record that later writes vouch for, then the last write
    last = _frames(os.path.join(pristine, segs[-1]))
    assert len(last) >= 2 and last[-1][1] > 4 << 20, "the last segment should hold records past the first window"
    off, end, _ = last[-2]
    seg = damaged(segs[-1], end - 1)
    with pytest.raises(CorruptionError, match=rf"{re.escape(seg)}: damaged record at offset {off}\b"):
        StepLog(p, segment_bytes=12 << 20)
    off, end, _ = last[-1]
    damaged(segs[-1], end - 1)
    with StepLog(p, segment_bytes=12 << 20) as log:
        assert [r.payload for r in log.iter_from(0)] == payloads[:-1]
