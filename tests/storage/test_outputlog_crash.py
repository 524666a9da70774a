"""Crash tests of the output log through the fault VFS: a crash (every damage mode) at every I/O operation of a run of writes, of recovering a torn tail, and an EIO/ENOSPC at every operation.

After each simulated crash the directory is reopened through POSIX (recovery) and must hold exactly a prefix of
the written steps, each with its content, that includes every step whose write returned with ``sync=True`` or
that a returned flush covered; a crash is never reported as damage (CorruptionError), recovering twice
changes nothing the second time, and the log accepts the next step.
"""

from __future__ import annotations

import os
import shutil

import pytest

from dbsp_core.errors import CorruptionError, StorageError
from dbsp_core.storage import FaultInjector
from dbsp_core.storage.outputlog import OutputLog

from outputlog_helpers import SCHEMAS, inputs, outputs, same_step, segments, snapshot, write_format1

# (mode, seed) pairs tried at every operation: the random modes get several seeds (DBSP_CRASH_SEEDS, default 3).
SEEDS = int(os.environ.get("DBSP_CRASH_SEEDS", "3"))


def damage(seeds: range) -> list[tuple[str, int]]:
    """The (mode, seed) pairs of ``seeds``: the fixed modes with seed 0, each random mode with every seed."""
    return ([(m, 0) for m in ("keep", "drop")] if 0 in seeds else []) + [
        (m, s) for m in ("tear", "reorder", "chaos") for s in seeds]


DAMAGE = damage(range(SEEDS))
# The writes' test (the largest) tries seed 0 of each random mode in the quick suite, the other seeds in the long one
WRITE_PARTS = {"seed0": range(1), "more_seeds": range(1, SEEDS)}
SEG = 6000  # 3 to 5 records per segment: writes share segments and rotations happen
COUNTS = {"crash_points": 0, "error_points": 0, "violations": 0}

# name: (base, steps written, sync, flush every, truncate after write #, replay write #)
CONFIGS = {
    "sync": ("native", 16, True, None, None, 2),
    "group": ("native", 16, False, 3, None, 4),
    "retention": ("native", 16, True, None, 10, None),
    # retention while the newest segment holds only unsynced steps (steps 12..14 after the flush of 11)
    "group-retention": ("native", 16, False, 8, 10, None),
    "format1": ("format1", 12, False, 4, 6, 1),
    # retention while every step-log record is unsynced: it must sync them before dropping format-1 segments
    "format1-unflushed": ("format1", 8, False, 100, 3, None),
}


def build_base(path: str, kind: str) -> int:
    """A closed output log to start from; returns its next step."""
    if kind == "format1":  # steps 0..6 in three format-1 segments, the newest with a torn tail
        write_format1(path, range(7), per_segment=3)
        with open(os.path.join(path, "out-0000000000000006.seg"), "ab") as f:
            f.write(b"DOUT\x01" + b"\x00" * 20)
        return 7
    log = OutputLog(path, SCHEMAS, segment_bytes=SEG)
    for step in range(4):
        log.write(step, outputs(step), inputs(step))
    log.close()
    return 4


def session(work: str, first: int, cfg: tuple) -> tuple[list[int], list[int], int]:
    """Writes the configured steps through the fault VFS; returns (acknowledged steps, attempted steps, the
    lowest step a truncation may have dropped to)."""
    _, n, sync, flush_every, truncate_after, replay_at = cfg
    acked: list[int] = []
    attempted: list[int] = []
    floor = 0
    try:
        log = OutputLog(work, SCHEMAS, sync=sync, segment_bytes=SEG, vfs="fault")
    except StorageError:
        return acked, attempted, floor
    try:
        for i in range(n):
            step = first + i
            attempted.append(step)
            assert log.write(step, outputs(step), inputs(step)) == "appended"
            if sync:
                acked.append(step)
            elif (i + 1) % flush_every == 0:
                log.flush()
                acked = list(attempted)
            if replay_at == i:  # a replayed step is read back and compared, not written
                assert log.write(step - 1, outputs(step - 1), inputs(step - 1)) == "replayed"
            if truncate_after == i:
                floor = step - 2
                log.truncate_below(floor)
        log.close()
        acked = list(attempted)
    except StorageError:
        try:
            log.close()
        except StorageError:
            pass
    return acked, attempted, floor


def check_recovered(work: str, base_first: int, base_next: int, acked: list[int], attempted: list[int],
                    floor: int, where: str) -> None:
    """The reopened log holds a prefix of the written steps that includes every acknowledged one."""
    try:
        log = OutputLog(work, SCHEMAS, segment_bytes=SEG)
    except CorruptionError as e:
        COUNTS["violations"] += 1
        pytest.fail(f"{where}: a crash was reported as damage: {e}")
    try:
        must_end = max(acked) + 1 if acked else base_next
        may_end = max(attempted) + 1 if attempted else base_next
        ok = (log.first <= max(base_first, floor) and must_end <= log.last <= may_end and
              all(same_step(log, s) for s in range(log.first, log.last)))
        if not ok:
            COUNTS["violations"] += 1
            pytest.fail(f"{where}: log holds {log.first}..{log.last - 1}, acknowledged {acked}, attempted up to "
                        f"{may_end - 1}")
        last = log.last
    finally:
        log.close()
    before = snapshot(work)
    OutputLog(work, SCHEMAS, segment_bytes=SEG).close()
    assert snapshot(work) == before, f"{where}: a second recovery changed the files"
    log = OutputLog(work, SCHEMAS, segment_bytes=SEG)  # and the log continues
    assert log.write(last, outputs(last), inputs(last)) == "appended"
    log.close()
    log = OutputLog(work, SCHEMAS, segment_bytes=SEG, readonly=True)
    assert log.last == last + 1 and same_step(log, last)
    log.close()


def dry_run(tmp_path, base: str, first: int, cfg: tuple) -> int:
    work = str(tmp_path / "dry")
    shutil.copytree(base, work)
    FaultInjector.arm()
    acked, attempted, _ = session(work, first, cfg)
    n = FaultInjector.ops()
    FaultInjector.disarm()
    shutil.rmtree(work)
    assert acked == attempted and len(attempted) == cfg[1]
    return n


@pytest.mark.parametrize("part", ["seed0", pytest.param("more_seeds", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_crash_at_every_operation_of_writes(tmp_path, name, part):
    cfg = CONFIGS[name]
    modes = damage(WRITE_PARTS[part])
    if not modes:
        pytest.skip(f"DBSP_CRASH_SEEDS={SEEDS}: no seed beyond 0")
    base = str(tmp_path / "base")
    first = build_base(base, cfg[0])
    base_first = 0
    nops = dry_run(tmp_path, base, first, cfg)
    work = str(tmp_path / "work")
    tried = 0
    for n in range(1, nops + 1):
        for mode, seed in modes:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work)
            FaultInjector.arm(crash_at=n, mode=mode, seed=n * 1000 + seed)
            acked, attempted, floor = session(work, first, cfg)
            crashed = FaultInjector.crashed()
            FaultInjector.disarm()
            assert crashed, f"op {n} {mode}: no crash"
            check_recovered(work, base_first, first, acked, attempted, floor, f"{name}: crash at op {n} {mode}/{seed}")
            tried += 1
    COUNTS["crash_points"] += tried
    print(f"\n[outputlog crash] {name}: {nops} operations x {len(modes)} (mode, seed) = {tried} crashes, "
          f"0 violations")


def _tear_tail(path: str, how: str) -> None:
    """Leaves the state a crash can leave: half a record at the end, or a next segment whose header never made it."""
    segs = segments(path)
    last = os.path.join(path, segs[-1])
    if how == "half-record":
        data = open(last, "rb").read()
        with open(last, "ab") as f:
            f.write(data[32:32 + 300])  # the start of a copy of the first record: a valid-looking header, no body
    else:
        with open(os.path.join(path, f"{int(segs[-1][:20]) + 1:020d}.seg"), "wb") as f:
            f.write(b"DBSPSSEG\x02\x00")


@pytest.mark.parametrize("how", ["half-record", "short-header"])
def test_crash_at_every_operation_of_recovery(tmp_path, how):
    """A crash at every operation of an open that cuts a torn tail (or rewrites a torn segment header) and the
    writes after it: every base step survives, nothing torn ever shows up as a step."""
    cfg = ("native", 3, True, None, None, None)
    base = str(tmp_path / "base")
    first = build_base(base, "native")
    _tear_tail(base, how)
    nops = dry_run(tmp_path, base, first, cfg)
    work = str(tmp_path / "work")
    tried = 0
    for n in range(1, nops + 1):
        for mode, seed in DAMAGE:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work)
            FaultInjector.arm(crash_at=n, mode=mode, seed=n * 1000 + seed)
            acked, attempted, floor = session(work, first, cfg)
            FaultInjector.disarm()
            check_recovered(work, 0, first, acked, attempted, floor, f"recovery ({how}): crash at op {n} {mode}")
            tried += 1
    COUNTS["crash_points"] += tried
    print(f"\n[outputlog crash] recovery of a {how}: {nops} operations x {len(DAMAGE)} = {tried} crashes, "
          f"0 violations")


@pytest.mark.parametrize("error", ["EIO", "ENOSPC"])
def test_error_at_every_operation(tmp_path, error):
    """An I/O error at every operation surfaces as StorageError, no write reports success after it, and a reopen
    holds a prefix of the written steps with every acknowledged one."""
    cfg = CONFIGS["sync"]
    base = str(tmp_path / "base")
    first = build_base(base, "native")
    nops = dry_run(tmp_path, base, first, cfg)
    work = str(tmp_path / "work")
    for n in range(1, nops + 1):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        FaultInjector.arm(error_at=n, error=error)
        acked, attempted, floor = session(work, first, cfg)
        FaultInjector.disarm()
        assert len(acked) < cfg[1], f"{error} at op {n} did not surface"
        check_recovered(work, 0, first, acked, attempted, floor, f"{error} at op {n}")
    COUNTS["error_points"] += nops
    print(f"\n[outputlog errors] {error} injected at each of {nops} operations, 0 violations")


def test_crash_after_a_writer_died_without_syncing(tmp_path):
    """A writer dies with written but unsynced steps (kill -9: the page cache keeps them, a power loss would not);
    the next writer recovers, appends with sync=True, and the machine crashes at any operation. The next writer's
    open makes what it recovered durable before it writes, so its records never vouch for bytes that a crash
    can still take: a prefix of the steps survives with every acknowledged one, never an error."""
    base = str(tmp_path / "base")
    first = build_base(base, "native")
    cfg = ("native", 5, True, None, None, None)

    def die_unsynced(work: str) -> None:
        log = OutputLog(work, SCHEMAS, sync=False, segment_bytes=SEG, vfs="fault")
        for step in range(first, first + 4):
            log.write(step, outputs(step), inputs(step))
        log._log.close()  # no flush: the process is gone

    work = str(tmp_path / "work")
    shutil.copytree(base, work)
    FaultInjector.arm()
    die_unsynced(work)
    ops_a = FaultInjector.ops()
    acked, attempted, _ = session(work, first + 4, cfg)
    ops_b = FaultInjector.ops() - ops_a
    FaultInjector.disarm()
    assert len(acked) == cfg[1]
    tried = 0
    for n in range(ops_a + 1, ops_a + ops_b + 1):
        for mode, seed in DAMAGE:
            shutil.rmtree(work)
            shutil.copytree(base, work)
            FaultInjector.arm(crash_at=n, mode=mode, seed=n * 1000 + seed)
            die_unsynced(work)
            acked, attempted, floor = session(work, first + 4, cfg)
            FaultInjector.disarm()
            check_recovered(work, 0, first, acked, attempted or list(range(first, first + 4)), floor,
                            f"after an unsynced writer: crash at op {n} {mode}/{seed}")
            tried += 1
    COUNTS["crash_points"] += tried
    print(f"\n[outputlog crash] after a writer died unsynced: {ops_b} operations x {len(DAMAGE)} = {tried} crashes, "
          f"0 violations")
