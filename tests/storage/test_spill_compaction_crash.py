"""The background compaction after a bulk load (trace invariant 16: the merge thread merges the spilled loose batches
and writes the output's batch file in place) under the fault-injecting VFS: a crash, and separately an I/O error, at
every I/O operation of the compaction (its files' truncates, holes, writes, fsyncs, renames, directory fsyncs, on the
merge thread), and at sampled operations of the step that installs it and of the checkpoint that names its files.
After each, the reopened pipeline (recovery), fed the same pushes again (deduplicated), ends with exactly the
unbudgeted twin's output (multisets); after an error the session itself goes on (the compaction is abandoned, its
batches stay) and its output equals the twin's too. W=1 and W=2 (one merge thread for both workers).

Watched fail: with the executor's start of the compaction removed (no compaction: the setup's check), and with an
abandoned compaction's inputs not put back (``Trace._unpick`` emptied: the EIO runs' sessions lose rows, "replayed
step 7 produced a different change of output 'g' than the one in the output log").

The compaction's operations are numbered alone: on the merge thread, its first cursor step (levels.py ``_Merge.step``:
a streamed merge of format-2 files opens and writes its output as it merges, before its seal) waits at a gate until
the test, between steps, has armed the fault VFS, and the test waits for the merge thread to be idle before the next
step."""

from __future__ import annotations

import os
import random
import shutil
import threading

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
import dbsp_core.runtime.embedded as embedded
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.storage import FaultInjector
from dbsp_core.trace import Trace, levels
from dbsp_core.trace.spill import BatchStore
from storage_helpers import add_change, close_crashed, spill_left_over
from storage_helpers import count_sum_circuit as _circuit
from storage_helpers import view_integral as _integral

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")


SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
BIG, SMALL = 3000, 50  # rows of a load's push (BIG_STEP_ROWS lowered to BIG) and of a small one
BASE_LOADS = 2  # big pushes before the session (checkpointed)
SESSION = ("big", "big", "big", "small", "small", "small")  # the session's pushes: its loads write more than half the files
# (the compaction's rule), the compaction starts at the first small step's end, is armed and released before the
# second, which installs it; a checkpoint comes before the third
FIRST_SMALL = SESSION.index("small")
QUIET = "fault"  # the VFS of the base, the recoveries and the reads: the fault VFS, disarmed


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _pushes() -> list[pa.Table]:
    rng = np.random.default_rng(SEED)
    sizes = [BIG] * BASE_LOADS + [BIG if s == "big" else SMALL for s in SESSION]
    return [pa.table({"k": rng.integers(0, 20_000, n), "v": rng.integers(0, 1000, n)}, schema=SCHEMA) for n in sizes]


def _pipeline(d: str, vfs: str, workers: int, create: bool = False, background: bool = True) -> dbsp.Pipeline:
    kw = dict(memory_limit=1, vfs=vfs, executor=EmbeddedExecutor(vfs=vfs, background_merge=background),
              checkpoint_interval=None)
    if create:
        return dbsp.Pipeline(_circuit(), workers=workers, storage=d, **kw)
    return dbsp.Pipeline.open(d, _circuit(), **kw)


def _reference(pushes: list) -> dict:
    with dbsp.Pipeline(_circuit(), executor=EmbeddedExecutor(background_merge=False)) as ref:
        acc: dict = {}
        for x in pushes:
            ref.push("t", x)
            add_change(acc, ref.step()["g"])
    return acc


class _Gate:
    """Holds every compaction on the merge thread, before its first cursor step, until :meth:`open` (a streamed merge,
    format 2, opens and writes its output file as it merges, groupedmerge.py S3: before its seal; gated at the seal
    only, the first compaction's open and truncate ran before or after the test armed the VFS, as the threads raced,
    and the probe's count was 2 off the run's in about 1 run in 3 with DBSP_SPILL_GROUPED=1); records the fault
    VFS's operation counter around each seal (the writing of its file, or its end)."""

    def __init__(self, monkeypatch) -> None:
        self.event = threading.Event()
        self.seals: list[tuple[int, int, str]] = []
        real_step, real = levels._Merge.step, levels._Merge.seal
        gate = self

        def held(m) -> bool:  # noqa: ANN001
            return (m.compaction and m.store is not None and m.store.vfs == QUIET  # (not the reference's, under
                    and threading.current_thread().name.startswith("dbsp-merge-thread"))  # DBSP_MEMORY_LIMIT paid
            # in slices by its steps, trace invariant 17; nor a recovery's, which has no merge thread)

        def step(m, budget):  # noqa: ANN001
            if held(m):
                assert gate.event.wait(60), "the gate was never opened"
            return real_step(m, budget)

        def seal(m, budget=None):  # noqa: ANN001
            if not (m.compaction and m.cursor.done and not m.sealed) or m.store.vfs != QUIET:
                return real(m, budget)
            assert gate.event.wait(60), "the gate was never opened"
            before = FaultInjector.ops()
            try:
                return real(m, budget)
            finally:
                gate.seals.append((before, FaultInjector.ops(), threading.current_thread().name))

        monkeypatch.setattr(levels._Merge, "step", step)
        monkeypatch.setattr(levels._Merge, "seal", seal)

    def close(self) -> None:
        self.event.clear()

    def open(self) -> None:
        self.event.set()


def _session(d: str, pushes: list, workers: int, gate: _Gate, arm: dict) -> dict:
    """Open ``d`` (the fault VFS, disarmed), push the session's big step and wait for its merges, then its first small
    step (whose end starts the compaction, held at the gate), arm the fault VFS (``arm``; operations counted from
    here), release the compaction and wait for it; push the second small step (installs it), checkpoint, push the
    third. Returns the session's facts; raises what the fault raised."""
    p = None
    facts: dict = {}
    try:
        FaultInjector.arm()
        gate.close()
        p = _pipeline(d, QUIET, workers)
        ex = p.executor
        first = BASE_LOADS
        for i, kind in enumerate(SESSION):
            if i == FIRST_SMALL + 2:  # (after the install)
                facts["checkpoint"] = [FaultInjector.ops()]
                p.checkpoint()
                facts["checkpoint"].append(FaultInjector.ops())
            p.push("t", pushes[first + i], producer="gen", seq=first + i)
            p.step()
            if kind == "big":
                assert ex._merge_thread.wait_idle(60)
            if i == FIRST_SMALL:
                facts["started"] = list(ex._compacting)
                FaultInjector.arm(**arm)
                gate.open()
                assert ex._merge_thread.wait_idle(60)
                facts["compaction"] = FaultInjector.ops()
        facts["end"] = FaultInjector.ops()
        facts["abandoned"] = ex.batch_store.stats["compactions_abandoned"]
        facts["installed"] = not ex._compacting
        facts["output"] = _integral(p)
        return facts
    finally:
        gate.open()
        close_crashed(p)


def _recover_and_check(d: str, pushes: list, want: dict, what: str) -> None:
    """Reopen ``d`` (no merge thread: the compaction, if due again, runs at the step), push every session push
    again (a push recorded before the fault counts once), compare with the twin; checkpoint; nothing left over."""
    with _pipeline(d, QUIET, 0, background=False) as q:
        for i in range(BASE_LOADS, len(pushes)):
            q.push("t", pushes[i], producer="gen", seq=i)
            q.step()
        assert _integral(q) == want, f"{what}: state differs from the unbudgeted twin"
        q.checkpoint()
        live = {os.path.basename(m.cursor.scratch_path) for t in q.executor._all_traces() for lv in t._by_level
                if (m := lv.merge) is not None and getattr(m.cursor, "scratch_path", None)}
        left = [n for n in spill_left_over(d, q.executor.batch_store) if n not in live]  # (a merge in progress's
        # scratch file is not left over: the recovery's steps may end with one, the sliced session's often do)
        assert not left, f"{what}: left over after a checkpoint: {left}"


@pytest.fixture()
def setup(case, tmp_path, monkeypatch):
    """The base (loads, checkpointed), a probe of the session (its compaction's operations) and the twin's output."""
    workers = case[0]
    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", BIG)
    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)  # every merge built on disk, the compaction's in place
    monkeypatch.setattr(Trace, "FAN_IN", 3)
    FaultInjector.disarm()
    gate = _Gate(monkeypatch)
    gate.open()
    pushes = _pushes()
    base = str(tmp_path / "base")
    with _pipeline(base, QUIET, workers, create=True) as p:
        for i in range(BASE_LOADS):
            p.push("t", pushes[i], producer="gen", seq=i)
            p.step()
            assert p.executor._merge_thread.wait_idle(60)
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    gate.seals.clear()
    facts = _session(probe, pushes, workers, gate, {})
    FaultInjector.disarm()
    want = _reference(pushes)
    assert facts["started"], "the session's first small step started no compaction"
    assert len(gate.seals) == len(facts["started"]) and all(n.startswith("dbsp-merge-thread") for *_x, n in gate.seals)
    assert facts["installed"] and facts["abandoned"] == 0 and facts["output"] == want, facts
    nops = facts["compaction"]
    assert nops > 0 and all(a <= nops for _b, a, _n in gate.seals), (nops, gate.seals)
    return dict(pushes=pushes, base=base, nops=nops, facts=facts, want=want, tmp=tmp_path, gate=gate,
                workers=workers)


def _run(s: dict, points: list[int], error: str | None) -> dict:
    where = {"compaction": 0, "later": 0, "abandoned": 0, "runs": 0}
    for n in points:
        d = str(s["tmp"] / f"c{n}")
        shutil.copytree(s["base"], d)
        arm = dict(error_at=n, error=error) if error else dict(crash_at=n, mode="drop", seed=SEED + n)
        raised, facts = None, None
        try:
            facts = _session(d, s["pushes"], s["workers"], s["gate"], arm)
        except (OSError, dbsp.DbspError) as e:
            raised = e
        crashed, reached = FaultInjector.crashed(), FaultInjector.ops() >= n
        FaultInjector.disarm()
        what = f"{error or 'crash'} at I/O operation {n} (W={s['workers']}, DBSP_TEST_SEED={SEED})"
        assert crashed if error is None else reached, f"{what}: the session did not reach it"
        if n <= s["nops"]:  # an operation of the compaction, on the merge thread: abandoned, never a failed step
            where["compaction"] += 1
            if error is not None:
                assert raised is None and facts is not None, (what, raised)
                assert facts["abandoned"] >= 1 and facts["output"] == s["want"], (what, facts)
                where["abandoned"] += 1
        else:
            where["later"] += 1
        _recover_and_check(d, s["pushes"], s["want"], what)
        where["runs"] += 1
        shutil.rmtree(d)
    return where


def _points(s: dict, stride: int, later: int) -> list[int]:
    """Every operation of the compaction and ``later`` after it, every ``stride``-th from a seeded offset."""
    end = min(s["nops"] + later, s["facts"]["end"])
    return list(range(1, s["nops"] + 1)) + list(range(s["nops"] + 1 + SEED % stride, end + 1, stride))


@pytest.fixture(params=[pytest.param((1, None), id="W1-crash"), pytest.param((2, "EIO"), id="W2-EIO"),
                        pytest.param((1, "EIO"), id="W1-EIO", marks=pytest.mark.slow),
                        pytest.param((2, None), id="W2-crash", marks=pytest.mark.slow)])
def case(request):
    return request.param


def test_a_fault_at_every_io_operation_of_a_background_compaction(case, setup) -> None:
    """A crash (unsynced writes dropped) or an injected EIO at each I/O operation of the background compaction, and
    at every 7th of the 60 operations after it (the step that installs it, the checkpoint naming its files): an
    error in the compaction abandons it (the session's output still equals the twin's), and after every fault the
    reopened pipeline equals the twin, with no file left over once it checkpointed."""
    s, error = setup, case[1]
    where = _run(s, _points(s, 7, 60), error)
    assert where["compaction"] == s["nops"] > 0, where
    if error is not None:
        assert where["abandoned"] == s["nops"], where
    print(f"\n[background compaction, W={s['workers']}, {error or 'crash'}] {s['nops']} operations in the "
          f"compaction ({len(s['facts']['started'])} traces), {where}")


# ---- the same compaction without a merge thread, paid in slices by the steps (trace invariant 17) ----

SLICED_SMALLS = 40  # small pushes generated for the sliced session (it uses as many as its compaction takes, plus one)


def _sliced_pushes() -> list[pa.Table]:
    rng = np.random.default_rng(SEED + 1)
    sizes = [BIG] * (BASE_LOADS + 3) + [SMALL] * SLICED_SMALLS
    return [pa.table({"k": rng.integers(0, 20_000, n), "v": rng.integers(0, 1000, n)}, schema=SCHEMA) for n in sizes]


def _sliced_session(d: str, pushes: list, workers: int, arm: dict, slices: list, smalls: int | None = None) -> dict:
    """Open ``d`` (no merge thread), push three big steps, arm the fault VFS (operations counted from here), then small
    steps: until the compaction they make due is installed (``smalls`` None: the probe), or ``smalls`` of them;
    checkpoint, push one more. ``slices`` gets the (first, last) operation of each ``advance_compaction`` that did
    I/O. Returns the session's facts; raises what the fault raised."""
    p = None
    facts: dict = {}
    try:
        FaultInjector.arm()
        p = _pipeline(d, QUIET, workers, background=False)
        ex = p.executor
        i = BASE_LOADS
        for _ in range(3):
            p.push("t", pushes[i], producer="gen", seq=i)
            p.step()
            i += 1
        FaultInjector.arm(**arm)
        started = False
        while (i - BASE_LOADS - 3 < smalls) if smalls is not None else (not started or ex._compacting):
            p.push("t", pushes[i], producer="gen", seq=i)
            p.step()
            started = started or ex.batch_store.stats["compactions"] > 0
            i += 1
            assert i < len(pushes), "the sliced compaction took more small steps than generated"
        facts["smalls"] = i - BASE_LOADS - 3
        facts["compactions"] = ex.batch_store.stats["compactions"]
        facts["abandoned"] = ex.batch_store.stats["compactions_abandoned"]
        facts["installed"] = not ex._compacting
        p.checkpoint()
        p.push("t", pushes[i], producer="gen", seq=i)
        p.step()
        facts["pushed"] = i + 1
        facts["end"] = FaultInjector.ops()
        facts["output"] = _integral(p)
        return facts
    finally:
        close_crashed(p)


@pytest.fixture()
def sliced(request, tmp_path, monkeypatch):
    """The base (loads, checkpointed), a probe of the sliced session (its slices' operations) and the twin's output."""
    workers = request.param
    monkeypatch.setattr(embedded, "BIG_STEP_ROWS", BIG)
    monkeypatch.setattr(BatchStore, "FILE_MERGE_MIN", 0)  # every merge built on disk, the compaction's in place
    monkeypatch.setattr(Trace, "FAN_IN", 3)
    monkeypatch.setattr(Trace, "COMPACT_SLICE", 1500)
    monkeypatch.setattr(Trace, "COMPACT_FUEL", 4)
    monkeypatch.setattr(Trace, "SEAL_FUEL", 4, raising=False)  # its file's write in several slices too (batchfile.py invariant 8)
    slices: list = []
    writers: set = set()  # the traces whose slices did I/O
    paid: list = []  # compaction rows of each advance_compaction
    real = Trace.advance_compaction

    def advance(t, rows):  # noqa: ANN001
        before = FaultInjector.ops()
        try:
            used = real(t, rows)
            paid.append(used)
            return used
        finally:
            if FaultInjector.ops() > before:
                slices.append((before + 1, FaultInjector.ops()))
                writers.add(id(t))

    monkeypatch.setattr(Trace, "advance_compaction", advance)
    FaultInjector.disarm()
    pushes = _sliced_pushes()
    base = str(tmp_path / "base")
    with _pipeline(base, QUIET, workers, create=True, background=False) as p:
        for i in range(BASE_LOADS):
            p.push("t", pushes[i], producer="gen", seq=i)
            p.step()
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    facts = _sliced_session(probe, pushes, workers, {}, slices)
    FaultInjector.disarm()
    pushes = pushes[:facts["pushed"]]
    want = _reference(pushes)
    assert facts["compactions"] == 1 and facts["installed"] and facts["abandoned"] == 0, facts
    assert sum(1 for n in paid if n) > workers, f"the compaction was not sliced: {paid}"
    assert len(slices) >= 2 * len(writers), f"its file was written in one slice: {slices}"  # (open ... commit)
    assert facts["output"] == want, "the sliced session differs from the unbudgeted twin"
    ops = sorted({n for a, b in slices for n in range(a, b + 1)})
    paid.clear()
    assert ops, "the slices did no I/O"
    return dict(pushes=pushes, base=base, ops=ops, facts=facts, want=want, tmp=tmp_path, workers=workers)


def _sliced_run(s: dict, points: list[int]) -> int:
    runs = 0
    for n in points:
        d = str(s["tmp"] / f"c{n}")
        shutil.copytree(s["base"], d)
        try:
            _sliced_session(d, s["pushes"], s["workers"], dict(crash_at=n, mode="drop", seed=SEED + n), [],
                            smalls=s["facts"]["smalls"])
        except (OSError, dbsp.DbspError):
            pass
        crashed = FaultInjector.crashed()
        FaultInjector.disarm()
        what = f"crash at I/O operation {n} of a sliced compaction (W={s['workers']}, DBSP_TEST_SEED={SEED})"
        assert crashed, f"{what}: the session did not reach it"
        _recover_and_check(d, s["pushes"], s["want"], what)
        runs += 1
        shutil.rmtree(d)
    return runs


@FORMAT_1
@pytest.mark.parametrize("sliced", [1, 2], indirect=True, ids=["W1", "W2"])
def test_a_crash_in_a_sliced_compaction(sliced) -> None:
    """A crash (unsynced writes dropped) at I/O operations of a compaction paid in slices by the steps (no merge
    thread, trace invariant 17; COMPACT_SLICE and SEAL_FUEL lowered so that its merge and its file's write, in place
    and in pieces, take several small steps), every 5th from a seeded offset (the slow variant below: every one):
    the reopened pipeline, fed the same pushes again, equals the unbudgeted twin, with no file left over once it
    checkpointed (a merge in progress's scratch aside). Watched fail with the slice removed (``advance_compaction``
    merging all: 'the compaction was not sliced', W=1 and W=2), and on main, whose install slice writes the file
    whole ('its file was written in one slice')."""
    s = sliced
    runs = _sliced_run(s, s["ops"][SEED % 5::5])
    print(f"\n[sliced compaction, W={s['workers']}] {len(s['ops'])} operations in {s['facts']['smalls']} steps' "
          f"slices, {runs} crashes")


@pytest.mark.slow
@pytest.mark.parametrize("sliced", [1, 2], indirect=True, ids=["W1", "W2"])
def test_a_crash_at_every_io_operation_of_a_sliced_compaction(sliced) -> None:
    """As above, at every I/O operation of the slices."""
    s = sliced
    assert _sliced_run(s, s["ops"]) == len(s["ops"])
