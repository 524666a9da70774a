"""Checkpoints that save a trace batch as one value per block of shards (snapshot.py invariant 11, shardmove.py
invariant 6): recovery after checkpoints with merges between them, at W=1 and W=2, gives the never-checkpointed run's
output step by step and DuckDB's answer, and a restored trace holds the content saved; a directory saved one value
per shard (main's form before it) opens and goes on; cold and live 2 -> 3 rescales of such state; a layout change
built one destination at a time equals the whole change; and a crash at I/O operations of such a checkpoint reopens
to the state of the checkpoint before it or of that one (every operation: the slow test).

Seeds vary between runs (``DBSP_RANGES_SEED`` replays one; the seed is printed).
"""

from __future__ import annotations

import os
import random
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "storage"))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core import envvars  # noqa: E402
from dbsp_core.errors import StorageError  # noqa: E402
from dbsp_core.storage import Database, FaultInjector  # noqa: E402
from dbsp_core.storage.formats import BATCH_RANGE_MAGIC, is_state_table  # noqa: E402
from dbsp_core.storage.snapshot import WorkerSnapshot  # noqa: E402
from rescale_workload import Workload, build_circuit, check_log_against_duckdb, reference  # noqa: E402
from test_move_target import one_target_equals_whole  # noqa: E402
from test_rescale import Run  # noqa: E402

SEED = int(os.environ.get("DBSP_RANGES_SEED", str(random.SystemRandom().randrange(2**31))))
MODES = [("tear", 1), ("reorder", 2)] + ([("drop", 0)] if os.environ.get("DBSP_RESCALE_CRASH_FULL") == "1" else [])


def test_seed_is_printed() -> None:
    print(f"\nDBSP_RANGES_SEED={SEED}")


@pytest.fixture(autouse=True)
def _no_budget(monkeypatch):
    # under a budget (CI's DBSP_MEMORY_LIMIT=1 run) settled batches are saved as file references, not ranges
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))


def per_shard(monkeypatch) -> None:
    """Save one value per shard, as the code before invariant 11 did (its plan ops, not ranges of width 1)."""
    init = WorkerSnapshot.__init__

    def no_ranges(self, *a, **kw):
        init(self, *a, **kw)
        self.shard_ranges = False

    monkeypatch.setattr(WorkerSnapshot, "__init__", no_ranges)


def range_values(d: str) -> int:
    """How many DRBR values the newest version of every state database of directory ``d`` holds."""
    n = 0
    for root, _, files in os.walk(os.path.join(d, "state")):
        for f in files:
            if f.endswith(".db"):
                with Database(os.path.join(root, f), readonly=True) as db, db.read(db.versions().stop - 1) as h:
                    n += sum(v[:4] == BATCH_RANGE_MAGIC for t in h.tables()
                             if isinstance(t, str) and is_state_table(t) for _, v in h.scan(t))
    return n


def contents(p: dbsp.Pipeline) -> dict:
    """Every trace's content (the sum of its batches, read without merging) per worker and name."""
    out = {}
    for w in range(p.workers):
        for name, t in p.traces(w).items():
            spine, pending = t.parts()
            parts = [b.zset for b in spine + pending]
            out[(w, name)] = dbsp.ZSet.concat(parts).to_dict() if parts else {}
    return out


def reopen(r: Run, workers: int | None, checkpoint: bool = True) -> None:
    """``Run.reopen`` without its check that every shard holds state (the workload deletes bulk rows as it goes)."""
    r.p.close(checkpoint=checkpoint)
    r.p = dbsp.Pipeline.open(r.d, build_circuit(), workers, checkpoint_interval=None, clock=r._clock)


def _run(tmp_path, name: str, workers: int, steps: int, seed: int, shard_bits: int = 8,
         vfs: str = "posix") -> tuple[Run, list]:
    w = Workload(seed, steps, max_rows=40, keys=1024)
    r = Run(str(tmp_path / name), w, "embedded", workers=workers, shard_bits=shard_bits, vfs=vfs)
    return r, reference(w)


@pytest.mark.parametrize("workers", [1, 2])
def test_recovery_after_checkpoints_of_range_values(tmp_path, workers: int) -> None:
    """Checkpoints every 3 steps, merges between them; a reopen at a checkpoint restores the saved traces exactly,
    one two steps past one replays, and the outputs are the reference run's and DuckDB's."""
    r, ref = _run(tmp_path, "d", workers, 40, SEED + workers)
    ranged = 0
    for step in range(40):
        r.continue_to(step + 1)
        if step % 3 == 2:
            r.p.checkpoint()
        if step in (17, 29):  # at a checkpoint: the restored state is the saved one
            before = contents(r.p)
            r.p.close(checkpoint=False)
            ranged = max(ranged, range_values(r.d))
            r.p = dbsp.Pipeline.open(r.d, build_circuit(), workers, checkpoint_interval=None, clock=r._clock)
            assert contents(r.p) == before, f"step {step}: the restored traces differ from the saved ones"
        if step == 34:  # two steps after one: replayed from the input log
            reopen(r, workers, checkpoint=False)
    assert ranged, "no checkpoint saved a range value: the test does not reach invariant 11"
    assert r.outs == ref
    check_log_against_duckdb(r.p, r.w, 39)
    r.p.close()


def test_a_directory_saved_one_value_per_shard_opens_and_goes_on(tmp_path, monkeypatch) -> None:
    """State saved one value per shard (the form before invariant 11) opens with ranges on, its next checkpoints
    replace those values with range values (deleting the old ones), and reopens give the reference's output."""
    with monkeypatch.context() as m:
        per_shard(m)
        r, ref = _run(tmp_path, "d", 2, 26, SEED + 10)
        for step in range(14):
            r.continue_to(step + 1)
            if step % 3 == 2:
                r.p.checkpoint()
        before = contents(r.p)
        r.p.close(checkpoint=False)
    assert range_values(r.d) == 0
    r.p = dbsp.Pipeline.open(r.d, build_circuit(), 2, checkpoint_interval=None, clock=r._clock)
    assert contents(r.p) == before
    for step in range(14, 26):
        r.continue_to(step + 1)
        if step % 3 == 2:
            r.p.checkpoint()
        if step == 20:
            before = contents(r.p)
            r.p.close(checkpoint=False)
            assert range_values(r.d) > 0
            r.p = dbsp.Pipeline.open(r.d, build_circuit(), 2, checkpoint_interval=None, clock=r._clock)
            assert contents(r.p) == before
    reopen(r, 2, checkpoint=False)
    r.continue_to(26)
    assert r.outs == ref
    check_log_against_duckdb(r.p, r.w, 25)
    r.p.close()


@pytest.mark.parametrize("live", [False, True])
def test_rescale_of_range_values(tmp_path, live: bool) -> None:
    """A 2 -> 3 rescale (cold: ``Pipeline.open(dir, c, 3)``, moving shards through the stored values; live:
    ``p.rescale(workers=3)``, cutting batches in memory and rebinding their stored values) of state saved as range
    values, and later 3 -> 2: the run goes on to the reference's output and DuckDB's answer, and a reopen after
    more checkpoints restores what was saved."""
    r, ref = _run(tmp_path, "d", 2, 30, SEED + 20 + live)
    for step in range(15):
        r.continue_to(step + 1)
        if step % 3 == 2:
            r.p.checkpoint()
    if live:
        assert sum(len(st.snapshot._ranged) for st in r.p.executor._coord.stores)
        r.p.rescale(workers=3)
    else:
        r.p.close(checkpoint=False)
        assert range_values(r.d)
        r.p = dbsp.Pipeline.open(r.d, build_circuit(), 3, checkpoint_interval=None, clock=r._clock)
    assert r.p.layout.workers == 3
    for step in range(15, 30):
        r.continue_to(step + 1)
        if step % 3 == 2:
            r.p.checkpoint()
        if step == 20:
            before = contents(r.p)
            reopen(r, 3, checkpoint=False)
            assert contents(r.p) == before
        if step == 22:  # and back to 2: the leaving worker's blocks go to both others, shard by shard
            if live:
                r.p.rescale(workers=2)
            else:
                reopen(r, 2)
    assert r.p.layout.workers == 2
    assert r.outs == ref
    check_log_against_duckdb(r.p, r.w, 29)
    r.p.close()


def test_one_target_at_a_time_equals_the_whole_change_of_range_values(tmp_path) -> None:
    """shardmove invariant 5 on an embedded pipeline's databases, which hold range values: a layout change built
    one destination at a time (the reads a move task makes, splitting range values a move cuts) leaves every new
    database byte for byte as the all-at-once change, growing and shrinking."""
    r, _ = _run(tmp_path, "pipe", 2, 8, SEED + 40)
    r.continue_to(8)
    old = r.p.layout
    groups = r.p.executor.groups(old)
    r.p.close()
    assert range_values(r.d)

    def version_of(g) -> int:
        with Database(g.path_of(0)) as db:
            return db.versions().stop - 1

    checked, moved = one_target_equals_whole(tmp_path, old, groups, version_of)
    assert checked == len(groups) * 4 and moved > 0


def _crash_runs(tmp_path, ops) -> None:
    """Crash at each of ``ops`` (I/O operation numbers of one checkpoint that saves range values; None: every one)
    in every mode; each reopen gives the state before or after that checkpoint and goes on to the reference's
    output and DuckDB's answer."""
    r, ref = _run(tmp_path, "base", 2, 16, SEED + 30, shard_bits=6, vfs="fault")
    for step in range(9):
        r.continue_to(step + 1)
        if step % 3 == 2:
            r.p.checkpoint()
    r.continue_to(11)
    r.p.close(checkpoint=False)
    base = r.d

    def opened(d: str, upto: int, vfs: str) -> Run:
        run = Run.__new__(Run)
        run.d, run.w, run.kind, run.cur, run.outs = d, r.w, "embedded", 0, list(ref[:upto])
        run.p = dbsp.Pipeline.open(d, build_circuit(), None, checkpoint_interval=None, clock=run._clock, vfs=vfs)
        return run

    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    run = opened(probe, 11, "fault")
    run.continue_to(13)
    FaultInjector.arm()
    run.p.checkpoint()  # the one whose operations are counted, or crashed in
    nops = FaultInjector.ops()
    FaultInjector.disarm()
    run.p.close(checkpoint=False)
    assert range_values(probe), "the counted checkpoint saves no range value"
    tried = done = 0
    for n in (range(1, nops + 1) if ops is None else [k for k in ops if k <= nops]):
        for mode, seed in MODES:
            d = str(tmp_path / "run")
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(base, d)
            run = None
            try:
                run = opened(d, 11, "fault")
                run.continue_to(13)
                FaultInjector.arm(crash_at=n, mode=mode, seed=n * 7 + seed)
                run.p.checkpoint()
            except StorageError:
                pass
            crashed = FaultInjector.crashed()
            FaultInjector.disarm()
            done += not crashed  # (the merge thread's timing moves a checkpoint's batches: it may end sooner)
            if run is not None and getattr(run, "p", None) is not None:
                try:
                    run.p.close(checkpoint=False)
                except Exception:  # a crashed VFS fails what it is asked after the crash
                    pass
            tried += 1
            after = opened(d, 13, "posix")
            after.continue_to(16)
            assert after.outs == ref, f"crash at op {n} ({mode}): the continued run differs"
            check_log_against_duckdb(after.p, r.w, 15)
            after.p.close()
    print(f"\n[shard ranges crash] {nops} operations, {tried} runs ({done} ended before their crash point), "
          f"0 wrong outputs")
    assert done < tried


def test_a_crash_in_a_checkpoint_of_range_values(tmp_path) -> None:
    """A few I/O operations of one checkpoint that saves range values, crashed at (every one: the slow test)."""
    _crash_runs(tmp_path, [3, 11, 29])


@pytest.mark.slow
def test_a_crash_at_every_io_operation_of_a_checkpoint_of_range_values(tmp_path) -> None:
    """Every I/O operation of one checkpoint that saves range values, crashed at (tear and reorder of unsynced
    writes; drop too with ``DBSP_RESCALE_CRASH_FULL=1``)."""
    _crash_runs(tmp_path, None)
