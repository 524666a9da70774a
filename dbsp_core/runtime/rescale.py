"""Layout changes: move the shards whose owner changes between the state databases of the old and new workers, commit the change as one new checkpoint version everywhere, and finish or undo an interrupted change on the next open; a live change (``Pipeline.rescale``) moves its shards in waves between steps and records its target so that a crash midway ends with the move finished.

The protocol (a "cold" layout change, made while no step runs, atomic across every database of every state group):

  1. ``RESCALE`` durably records the change: the old and new layouts, the base version ``v`` every state
     database is at (``open_state`` made it the only one) and its step. (crash point ``rescale-intent``)
  2. A database is created at version ``v`` for every worker only in the new layout. Every database of the
     old and new workers is opened at ``v`` (writing ``v + 1``), the moving shards' values are copied from
     their old owner to their new one and deleted there (dbsp_core.storage.shardmove), each version records
     its new layout and worker, and every database commits ``v + 1``. (``rescale-commit`` after each commit)
  3. ``RESCALE`` is rewritten with ``committed`` and the report (``rescale-committed``), ``LAYOUT`` is replaced
     by the new layout and the report (``rescale-layout``), the databases of workers that left are deleted,
     and ``RESCALE`` is removed.

Invariants (enforced here):
  1. Until every database of the change holds ``v + 1`` no reader sees the new layout: ``LAYOUT`` still names
     the old one, and recovery (:func:`resolve`) rolls back: it reopens every old database at ``v`` (which
     discards ``v + 1``) and deletes the databases of new workers. Once every database holds ``v + 1`` (or
     RESCALE says committed) recovery rolls forward: it writes ``LAYOUT`` and deletes the leaving workers'
     databases. Either way it removes RESCALE, so the directory ends in the old layout or the new one, never
     a mix, and a crash during recovery itself repeats the same decision.
  2. Nothing but state databases and the two records changes: the input log, the output log and ``driver.db``
     are the same in both layouts (results do not depend on the layout), so the steps after ``v``'s step
     replay identically in either.
  3. Only shards whose owner changes are copied between databases; the report says how many and how many
     bytes, against the bytes of all state (``moved_bytes / total_bytes`` is the fraction that moved).
  4. A live change (``Pipeline.rescale``, :class:`LiveRescale`) first records its target layout in RESCALE (``live``
     with no change in progress). An executor whose state is on disk (the staged one) then makes each wave of
     moved shards a change of the protocol above (the record keeps the target while a wave is in progress and
     after it); one whose state is in memory (``state_in_memory``: the embedded one) moves waves in memory and
     makes only the target durable, by the checkpoint that ends the change, whose state commit is followed by
     LAYOUT before ``driver.db`` and the input log's truncation. So after a crash, recovery ends any wave in
     progress (invariant 1), reads the target from RESCALE, and finishes the move as a cold change from the
     layout in LAYOUT: the directory ends in the target layout, with its output exactly once (the steps since
     the checkpoint replay in the new layout, verified against the output log).
  5. A change moves state only from databases that hold it for the layout it moves from: every database of a
     worker of ``old`` records (dbsp_core.storage.shardmove.write_worker_layout) that worker of ``old``'s epoch
     at the base version, or holds no state yet. Otherwise (a checkpoint taken in the middle of a live change,
     by releases before this rule) the moved shards' state would be read from databases that no longer hold
     it and the move would "finish" with their groups empty: the change is refused with RecoveryError before
     anything is written, and recovery of a live change rolls back only to a version that holds LAYOUT's
     epoch in every database, refusing (changing nothing) when no version does. A database of a worker of ``old``
     that is missing is damage, never a worker with no state: the state it held is in no other file
     (storage/statefiles.py invariant 2, which ``Pipeline.open`` checks first), so the change refuses it with
     CorruptionError naming the file and ``dbsp repair`` (:func:`_check_sources`, before anything is written, and
     step 2 again for any other caller), instead of making it empty and moving its shards' state as empty groups.
  6. A live change moves one wave per pause of the steps (under the driver's step lock, driver invariant 8) and
     lets a step that waits run between two waves. One that fails before or between its waves (not inside a
     wave's move, nor in the checkpoint that ends it) moves the moved shards back and removes what it created
     (:meth:`LiveRescale.undo`): the pipeline goes on at the old layout.
  7. A wave of an executor whose state is in memory defers the moved rows' merges and key-index folds (trace
     invariant 14), so its pause costs the cut and not the merging. After the last wave the change pays that
     work in pauses of its own, each at most PAY_ROWS rows of one trace (per level, for merges), letting a waiting
     step run between two, until nothing is owed (the state's bytes, ``total_bytes``, are measured before, as
     the waves left it); then it takes its final checkpoint.
     The report counts them (``settle_pauses``) among its pauses.
  8. An executor whose state is in an object store (``moves_by_tasks``: the staged one over ``storage="s3://..."``)
     keeps the protocol's records and crash points, but step 2 is its ``move_state``: a job of tasks, one per new
     (stage, worker), that build the new databases where the tasks run and upload them (runtime/stage_store.py
     invariant 6); the new state counts from when the executor records its chains, after every task's
     acknowledgement checked out. Before that, nothing durable changed (the chains, and what a checkpoint's
     manifest names, are the old ones); after it, only a checkpoint makes the new layout and chains durable, and
     a driver that dies before one recovers from the previous manifest (the old layout, its chains, the logs):
     either way, the steps replay exactly once. Only shards whose owner changes move (invariant 3).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Protocol

from dbsp_core.circuit import Circuit
from dbsp_core.errors import CorruptionError, RecoveryError
from dbsp_core.layout import Layout
from dbsp_core.runtime.executor import Executor, StateGroup
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import (read_layout, read_rescale, remove_record, remove_rescale, write_layout,
                                         write_rescale)
from dbsp_core.storage.formats import SPILL_DIR, STATE_DIR, worker_files
from dbsp_core.storage.shardmove import change_handles, check_source, relayout_group

__all__ = ["LiveHost", "LiveRescale", "begin_live", "cold_rescale", "end_live", "live_target", "remove_leaving",
           "resolve"]


def _remove_worker(path: str, vfs: str) -> None:
    for p in worker_files(path):
        if os.path.exists(p):
            remove_record(p, vfs)


def _record(old: Layout, new: Layout, version: int, step: int, committed: bool, target: Layout | None,
            report: dict | None = None) -> dict:
    rec = {"kind": "cold" if target is None else "live", "from": old.to_dict(), "to": new.to_dict(),
           "version": version, "step": step, "committed": committed}
    if target is not None:
        rec["target"] = target.to_dict()
    if report is not None:
        rec["report"] = report
    return rec


def begin_live(root: str, old: Layout, target: Layout, vfs: str = "posix") -> None:
    """Record the target of a live change before anything moves (invariant 4)."""
    write_rescale(root, {"kind": "live", "from": old.to_dict(), "target": target.to_dict()}, vfs)


def end_live(root: str, vfs: str = "posix") -> None:
    """The live change is complete (LAYOUT holds its target): forget it."""
    remove_rescale(root, vfs)


def live_target(root: str, vfs: str = "posix") -> Layout | None:
    """The target of a live change recorded in RESCALE (with no wave in progress), or None."""
    rec = read_rescale(root, vfs)
    if rec is None or rec.get("kind") != "live" or "to" in rec:
        return None
    return Layout.from_dict(rec["target"], f"{root}/RESCALE target")


def cold_rescale(root: str, executor: Executor, old: Layout, new: Layout, version: int, step: int,
                 crashpoint: Callable[[str], None], vfs: str = "posix", target: Layout | None = None,
                 measure_total: bool = True) -> dict:
    """Change the stored state of ``root`` from layout ``old`` to ``new`` (the protocol above); returns the report
    ``{from_workers, to_workers, from_shards, to_shards, moved_shards, moved_bytes, total_bytes, seconds}``.

    ``target``: ``new`` is one wave of a live change to ``target`` (invariant 4): RESCALE keeps the target after
    the change instead of being removed, unless ``new`` is the target."""
    t0 = time.perf_counter()
    if getattr(executor, "moves_by_tasks", False):  # invariant 8: the state is in an object store
        return _rescale_by_tasks(root, executor, old, new, version, step, crashpoint, vfs, target, measure_total, t0)
    groups = executor.groups(new)
    _check_sources(root, groups, old, version, vfs)  # invariant 5, before anything is written
    if target is not None and target == new:
        target = None  # the last wave: the protocol's end removes RESCALE
    write_rescale(root, _record(old, new, version, step, False, target), vfs)
    crashpoint("rescale-intent")
    totals = {"moved_shards": len(old.moved_shards(new)), "moved_bytes": 0, "total_bytes": 0}
    for g in groups:
        rep = _relayout(g, old, new, version, step, crashpoint, vfs, measure_total)
        totals["moved_bytes"] += rep["moved_bytes"]
        totals["total_bytes"] += rep["total_bytes"] or 0
        crashpoint("rescale-group")
    report = {"from_workers": old.workers, "to_workers": new.workers, "from_shards": old.shards,
              "to_shards": new.shards, **totals, "seconds": round(time.perf_counter() - t0, 6),
              "kind": "cold", "step": step}
    write_rescale(root, _record(old, new, version, step, True, target, report), vfs)
    crashpoint("rescale-committed")
    _finish(root, groups, old, new, report, crashpoint, vfs, target)
    return report


def _rescale_by_tasks(root: str, executor: Executor, old: Layout, new: Layout, version: int, step: int,
                      crashpoint: Callable[[str], None], vfs: str, target: Layout | None, measure_total: bool,
                      t0: float) -> dict:
    """:func:`cold_rescale` of an executor whose state is in an object store (invariant 8): the records as in the
    protocol, step 2 as the executor's job of tasks (``move_state``)."""
    if target is not None and target == new:
        target = None
    write_rescale(root, _record(old, new, version, step, False, target), vfs)
    crashpoint("rescale-intent")
    moved = executor.move_state(old, new, version, step, measure_total)  # type: ignore[attr-defined]
    crashpoint("rescale-commit")
    report = {"from_workers": old.workers, "to_workers": new.workers, "from_shards": old.shards,
              "to_shards": new.shards, "moved_shards": len(old.moved_shards(new)),
              "moved_bytes": moved["moved_bytes"], "total_bytes": moved["total_bytes"] or 0,
              "fetched_bytes": moved["fetched_bytes"], "seconds": round(time.perf_counter() - t0, 6),
              "kind": "cold", "step": step}
    write_rescale(root, _record(old, new, version, step, True, target, report), vfs)
    crashpoint("rescale-committed")
    _finish(root, executor.groups(new), old, new, report, crashpoint, vfs, target)
    return report


def _refuse_missing(root: str, g: StateGroup, old: Layout) -> None:
    """Invariant 5: CorruptionError naming every database of a worker of ``old`` in group ``g`` that is missing and
    ``dbsp repair``; returns quietly when all are there."""
    missing = [os.path.relpath(g.path_of(w), root) for w in range(old.workers) if not os.path.exists(g.path_of(w))]
    if missing:
        raise CorruptionError(
            f"{root}: the layout change from {old.workers} workers (layout epoch {old.epoch}) needs state database"
            f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}, missing: the state held there is in no other "
            f"file, and no database is made empty in its place. Run `dbsp repair {root}`: it says whether that "
            f"state can be computed again from the input log, or which file to restore from a backup")


def _check_sources(root: str, groups: list[StateGroup], old: Layout, version: int, vfs: str) -> None:
    """Invariant 5: every database of a worker of ``old`` is there (else CorruptionError) and holds that worker's
    state of ``old`` at ``version`` (or no state yet; else RecoveryError naming the database); nothing changes."""
    for g in groups:
        _refuse_missing(root, g, old)
        for w in range(old.workers):
            path = g.path_of(w)
            with Database(path, vfs=vfs) as db:
                if version not in db.versions():
                    continue  # a database created for this change (or one a rolled-back attempt left): no state
                with db.read(version) as h:
                    check_source(h, old, w, f"{path} version {version}", root)


def _relayout(g: StateGroup, old: Layout, new: Layout, version: int, step: int,
              crashpoint: Callable[[str], None], vfs: str, measure_total: bool = True) -> dict:
    """Step 2 of the protocol for one state group."""
    paths = {w: g.path_of(w) for w in range(max(old.workers, new.workers))}
    path0 = g.path_of(0)  # <root>/state/...: batch files that values name are in <root>/spill
    root = path0[:path0.rfind(os.sep + STATE_DIR + os.sep)]
    _refuse_missing(root, g, old)  # invariant 5: a missing old database is damage, not a new worker
    fresh = set(range(old.workers, new.workers))
    for w in fresh:
        _remove_worker(paths[w], vfs)  # a leftover of an attempt that was rolled back
    with change_handles(paths, version, fresh, vfs) as handles:
        rep = relayout_group(handles, old, new, g.tables, f"{g.name}", measure_total,
                             batch_dir=os.path.join(root, SPILL_DIR))
        for w in paths:
            handles[w].set_step(step)  # a new worker's database starts at step 0
            handles[w].commit()
            crashpoint("rescale-commit")
        return rep


def _finish(root: str, groups: list[StateGroup], old: Layout, new: Layout, report: dict,
            crashpoint: Callable[[str], None], vfs: str, target: Layout | None = None) -> None:
    """Step 3: switch LAYOUT, delete the leaving workers' databases, remove RESCALE or, inside a live change,
    leave only its target in it (idempotent)."""
    write_layout(root, new, report, vfs)
    crashpoint("rescale-layout")
    for g in groups:
        for w in range(new.workers, old.workers):
            _remove_worker(g.path_of(w), vfs)
    if target is not None and target != new:
        begin_live(root, old, target, vfs)
    else:
        remove_rescale(root, vfs)


def remove_leaving(root: str, groups: list[StateGroup], old: Layout, new: Layout, vfs: str = "posix") -> None:
    """Delete the databases of the workers of ``old`` that ``new`` does not have (after ``new`` is durable)."""
    for g in groups:
        for w in range(new.workers, max(old.workers, new.workers)):
            _remove_worker(g.path_of(w), vfs)


def resolve(root: str, executor: Executor, crashpoint: Callable[[str], None], vfs: str = "posix") -> str | None:
    """Finish or undo a layout change interrupted by a crash (invariant 1); returns ``"forward"``, ``"back"``
    or None when no change was in progress. Call it before the executor opens any state."""
    rec = read_rescale(root, vfs)
    if rec is None:
        return None
    if rec.get("kind") == "live" and "to" not in rec:  # only a live change's target: the driver finishes it
        if executor.state_in_memory:
            return _settle_live_memory(root, executor, Layout.from_dict(rec["target"], f"{root}/RESCALE"), vfs,
                                       Layout.from_dict(rec["from"], f"{root}/RESCALE") if "from" in rec else None)
        return None
    try:
        old, new = Layout.from_dict(rec["from"], "RESCALE from"), Layout.from_dict(rec["to"], "RESCALE to")
        version = int(rec["version"])
        target = Layout.from_dict(rec["target"], "RESCALE target") if "target" in rec else None
    except (KeyError, TypeError, ValueError) as e:
        raise RecoveryError(f"{root}/RESCALE: unreadable layout change record ({e})") from None
    current, _ = read_layout(root, vfs)
    groups = executor.groups(new)
    if current.epoch == new.epoch:  # LAYOUT switched already: only the clean-up was interrupted
        _finish(root, groups, old, new, rec.get("report") or {}, crashpoint, vfs, target)
        return "forward"
    if current.epoch != old.epoch:
        raise RecoveryError(f"{root}: RESCALE changes layout epoch {old.epoch} to {new.epoch}, but LAYOUT is at "
                            f"epoch {current.epoch}")
    committed = bool(rec.get("committed")) or _all_hold(groups, max(old.workers, new.workers), version + 1, vfs)
    if committed:
        report = rec.get("report") or {"from_workers": old.workers, "to_workers": new.workers, "kind": "cold",
                                       "completed_by_recovery": True}
        _finish(root, groups, old, new, report, crashpoint, vfs, target)
        return "forward"
    for g in groups:  # roll back: every old database at v again, the new workers' databases gone
        for w in range(old.workers):
            path = g.path_of(w)
            if not os.path.exists(path):
                continue
            with Database(path, vfs=vfs) as db:
                if version in db.versions() and db.versions().stop - 1 != version:
                    db.open(version).close()  # discards v + 1
        for w in range(old.workers, new.workers):
            _remove_worker(g.path_of(w), vfs)
    crashpoint("rescale-rollback")
    if target is not None:
        begin_live(root, old, target, vfs)  # the wave is undone; the live change's target stays
    else:
        remove_rescale(root, vfs)
    return "back"


def _settle_live_memory(root: str, executor: Executor, target: Layout, vfs: str, start: Layout | None = None
                        ) -> str | None:
    """A live change of an executor whose state is in memory (invariant 4) ends with a checkpoint that commits
    the target layout's workers, then switches LAYOUT, then deletes the leaving workers' databases. If every
    target worker committed it, only the switch or the clean-up was lost: do them (``"forward"``; ``start``, the
    layout the change began from, names the leaving workers when LAYOUT already holds the target). Otherwise
    put every database of the old and new workers back on their newest common version (the last checkpoint
    before the change: a partly committed final checkpoint is discarded), delete the joining workers' ones (the
    finishing change creates them afresh; also one an earlier crash left behind, older than every version
    LAYOUT's workers hold, which is no part of this change) and leave the finishing cold change to the driver
    (None)."""
    from dbsp_core.storage.shardmove import read_worker_layout

    current, _ = read_layout(root, vfs)
    union = max(current.workers, target.workers)
    groups = executor.groups(target)
    paths = [(w, g.path_of(w)) for g in groups for w in range(union)]
    present = [(w, p) for w, p in paths if os.path.exists(p)]
    if not present:
        return None
    dbs = [(w, Database(p, vfs=vfs)) for w, p in present]
    try:
        # every target worker committed the change's last checkpoint (its databases may have moved on to it only)
        tgt = [db for w, db in dbs if w < target.workers]
        done = False
        if len(tgt) == len(groups) * target.workers:
            tr = [db.versions() for db in tgt]
            lo, hi = max(r.start for r in tr), min(r.stop for r in tr)
            done = lo < hi and all(_epoch_at(db, hi - 1, read_worker_layout) == target.epoch for db in tgt)
        if not done:  # the newest version every database of the change holds: the checkpoint before it
            cur = [db.versions() for w, db in dbs if w < current.workers]
            if len(cur) != len(groups) * current.workers:
                raise RecoveryError(f"{root}: an unfinished live rescale left {len(cur)} of the "
                                    f"{len(groups) * current.workers} state databases of LAYOUT's workers")
            # a joining worker's database is created at a version LAYOUT's workers all hold and commits with them
            # from then on; one whose newest version is older than that is not this change's (an earlier crash
            # left it behind): it is deleted below with the joining ones, and ignored here
            floor = max(r.start for r in cur)
            part = [(w, db) for w, db in dbs if w < current.workers or db.versions().stop - 1 >= floor]
            ranges = [db.versions() for _, db in part]
            lo, hi = max(r.start for r in ranges), min(r.stop for r in ranges)
            if lo >= hi:
                raise RecoveryError(f"{root}: the state databases of an unfinished live rescale share no version: "
                                    f"{[(r.start, r.stop - 1) for r in ranges]}")
            # invariant 5: the newest common version that holds LAYOUT's state in every LAYOUT worker's database
            mine = [(w, db) for w, db in part if w < current.workers]
            held = {v: [(w, _epoch_at(db, v, read_worker_layout)) for w, db in mine] for v in range(lo, hi)}
            good = [v for v in range(lo, hi) if all(e in (None, current.epoch) for _, e in held[v])]
            if not good:
                raise RecoveryError(
                    f"{root}: an unfinished live rescale from layout epoch {current.epoch} (LAYOUT) left state "
                    f"databases whose versions {list(range(lo, hi))} hold layouts "
                    f"{ {v: sorted({e for _, e in held[v]}, key=str) for v in held} } (worker, epoch: "
                    f"{held[hi - 1]}), none of them LAYOUT's in every database: a checkpoint was taken in the "
                    f"middle of the move. Finishing the move from them would restart the moved shards' groups "
                    f"from empty; nothing was changed. Restore the directory from a copy taken before, or run "
                    f"`dbsp repair` to see what it can save")
            for _, db in part:
                if db.versions().stop - 1 != good[-1]:
                    db.open(good[-1]).close()  # discards the partly committed (or mid-move) version
    finally:
        for _, db in dbs:
            db.close()
    if done:
        old = current
        if current.epoch == target.epoch and start is not None:  # LAYOUT switched: the clean-up was lost
            old = start
        _finish(root, groups, old, target, {"kind": "live", "from_workers": old.workers,
                                                 "to_workers": target.workers, "completed_by_recovery": True},
                lambda _: None, vfs)
        return "forward"
    for g in groups:
        for w in range(current.workers, union):
            _remove_worker(g.path_of(w), vfs)  # the finishing cold change creates them again
    return None


def _epoch_at(db: Database, version: int, read: Callable) -> int | None:
    with db.read(version) as h:
        rec = read(h, db.path)
    return None if rec is None else int(rec["epoch"])


def _all_hold(groups: list[StateGroup], workers: int, version: int, vfs: str) -> bool:
    """Whether every database of every group (workers ``0..workers-1``) holds ``version``."""
    for g in groups:
        for w in range(workers):
            path = g.path_of(w)
            if not os.path.exists(path):
                return False
            with Database(path, vfs=vfs) as db:
                if version not in db.versions():
                    return False
    return True


# ---- live changes ----


class LiveHost(Protocol):
    """What a live change asks of the pipeline that runs it (dbsp_core.runtime.driver, invariant 8)."""

    steps: int  # steps run so far
    _waiting: int  # steps waiting for the step lock
    _step_lock: threading.RLock  # held by every step: a wave moves while it is held

    def _check_usable(self) -> None:
        """Raise if the pipeline is broken or closed."""

    def _checkpoint(self, wait: bool, after_state: Callable[[], None] | None = None) -> int:
        """Take a checkpoint; ``after_state`` runs between the state's commit and the driver's record."""

    def _join_checkpoint(self) -> None:
        """Wait for a background checkpoint; raise if it failed."""


class LiveRescale:
    """One live change of layout (invariants 4 and 6): from ``old`` to ``workers`` workers, ``wave_shards``
    shards a wave, each wave moved in one pause of the steps of the pipeline ``run`` is given; then, for an
    executor whose state is in memory, the checkpoint that makes the target durable. ``crashpoint`` is the
    driver's (tests arm it). The caller holds the step lock from :meth:`begin` until it has marked the change in
    progress (driver invariant 8), and undoes a failed change with :meth:`undo` when :attr:`undoable`.
    """

    PAY_ROWS = 2048  # rows of one trace's deferred work a pause after the waves pays (invariant 7): ~0.5-2 ms

    def __init__(self, executor: Executor, circuit: Circuit, root: str | None, old: Layout, workers: int,
                 wave_shards: int, crashpoint: Callable[[str], None], vfs: str, t0: float) -> None:
        self.executor, self.circuit, self.root, self.old = executor, circuit, root, old
        self._crashpoint, self._vfs, self._t0 = crashpoint, vfs, t0
        self.waves: list[Layout] = [] if workers == old.workers else old.steps_to(old.rebalance(workers),
                                                                                  wave_shards)
        self.final = self.waves[-1] if self.waves else old
        self.at = old  # the layout in force: the last wave moved
        self.moved = 0  # bytes moved
        self.total: int | None = 0 if not self.waves else None  # bytes of all state, once measured
        self.pauses: list[float] = []  # every hold of the step lock: one per wave, then the settling ones
        self.settles = 0  # pauses that paid deferred work after the waves (invariant 7)
        self.pause_cpu = 0.0  # the most CPU time the rescaling thread spent in one pause (wall time less waits)
        self.undoable = True  # false inside a wave's move and from the final checkpoint on (invariant 6)
        # what Pipeline.rescale_progress shows while the change runs (the keys predate the word "wave")
        self.progress = {"from_workers": old.workers, "to_workers": self.final.workers, "batches": len(self.waves),
                         "done": 0, "moved_shards": 0, "last_pause_ms": 0.0}

    def begin(self) -> None:
        """With storage, record the target (invariant 4): raises before anything changed, or it is durable."""
        if self.root is not None:
            begin_live(self.root, self.old, self.final, self._vfs)

    def report(self, step: int) -> dict:
        """``{from_workers, to_workers, from_shards, to_shards, moved_shards, moved_bytes, total_bytes, batches,
        settle_pauses, max_pause_ms, mean_pause_ms, p99_pause_ms, max_pause_cpu_ms, seconds, kind, step}``
        (``batches``: the waves; a pause is one hold of the step lock: a wave's, or a settling one's, invariant 7;
        ``max_pause_cpu_ms``: the most CPU time the rescaling thread spent in one, its work without the time the
        machine ran other threads)."""
        old, final = self.old, self.final
        ms = sorted(x * 1000 for x in self.pauses) or [0.0]
        return {"from_workers": old.workers, "to_workers": final.workers, "from_shards": old.shards,
                "to_shards": final.shards, "moved_shards": len(old.moved_shards(final)), "moved_bytes": self.moved,
                "total_bytes": self.total if self.total is not None else self.executor.disk_bytes(),
                "batches": len(self.waves), "settle_pauses": self.settles, "max_pause_ms": round(ms[-1], 3),
                "mean_pause_ms": round(sum(ms) / len(ms), 3),
                "p99_pause_ms": round(ms[-(-99 * len(ms) // 100) - 1], 3),  # nearest rank: ceil(0.99 n)
                "max_pause_cpu_ms": round(self.pause_cpu * 1000, 3),
                "seconds": round(time.perf_counter() - self._t0, 6), "kind": "live", "step": step}

    def run(self, host: LiveHost) -> None:
        """Move every wave, each in one pause of ``host``'s steps, then make the target durable."""
        ex, crashpoint, old, final = self.executor, self._crashpoint, self.old, self.final
        if self.root is not None:
            crashpoint("live-begin")
        ex.prepare_relayout(final)  # joining workers' databases and copies of the circuit, outside any pause
        for lay in self.waves:
            with host._step_lock:  # one pause: steps wait while this wave of shards moves
                p0 = time.perf_counter()
                host._check_usable()
                self.undoable = False
                c0 = time.thread_time()
                self.moved += self._move(self.at, lay, host.steps)
                self.at, self.undoable = lay, True
                self.pauses.append(time.perf_counter() - p0)
                self.pause_cpu = max(self.pause_cpu, time.thread_time() - c0)
                crashpoint("live-batch")
            self.progress.update(done=len(self.pauses), moved_shards=len(old.moved_shards(lay)),
                                 last_pause_ms=round(self.pauses[-1] * 1000, 2))
            self._let_steps_run(host)
        if ex.state_in_memory:
            with host._step_lock:  # the state the new layout holds (steps ran during the move: it grew), as the
                self.total = ex.state_bytes()  # waves left it: moved bytes count against the state as moved
        owed = ex.state_in_memory and bool(self.waves)
        while owed:  # invariant 7: the work the waves deferred, in pauses of its own
            with host._step_lock:
                p0 = time.perf_counter()
                host._check_usable()
                c0 = time.thread_time()
                owed = ex.pay_deferred(self.PAY_ROWS)
                self.pauses.append(time.perf_counter() - p0)
                self.pause_cpu = max(self.pause_cpu, time.thread_time() - c0)
                self.settles += 1
            self._let_steps_run(host)
        self.undoable = False
        if self.root is not None and ex.state_in_memory:
            root, groups, vfs = self.root, ex.groups(old), self._vfs

            def switch() -> None:  # the new layout's state is committed: LAYOUT follows, then the logs
                crashpoint("live-switch")
                report["seconds"] = round(time.perf_counter() - self._t0, 6)
                write_layout(root, final, report, vfs)
                crashpoint("live-layout")
                remove_leaving(root, groups, old, final, vfs)
                end_live(root, vfs)

            report = self.report(host.steps)
            host._checkpoint(False, switch)  # captured under the step lock, committed in the background
            host._join_checkpoint()  # steps go on meanwhile

    def finish(self, host: LiveHost) -> dict:
        """After :meth:`run` and the change marked ended: the report of the whole change, which, for an executor
        whose state is on disk, LAYOUT keeps (it holds the last wave's report)."""
        rep = self.report(host.steps)
        if self.root is not None and not self.executor.state_in_memory:
            with host._step_lock:
                write_layout(self.root, self.final, rep, self._vfs)
        return rep

    def undo(self, step: int) -> None:
        """A change that failed before or between waves, at layout :attr:`at` (invariant 6): move the shards back
        to the old layout's owners and remove what the change created. The caller holds the step lock."""
        ex, old, at, root = self.executor, self.old, self.at, self.root
        if ex.state_in_memory:
            if at != old:
                ex.relayout(old)
            ex.abandon_relayout()  # joining workers prepared and never attached
            if root is not None:
                remove_leaving(root, ex.groups(old), self.final, old, self._vfs)  # the joining workers' databases
                end_live(root, self._vfs)
        elif root is not None:  # state on disk: every wave is durable; one more goes back
            if at != old:
                back = Layout(old.shard_map, old.hosts, at.epoch + 1, old.min_shard_bits)
                self._move(at, back, step, back)
            else:
                end_live(root, self._vfs)

    def _move(self, prev: Layout, lay: Layout, step: int, final: Layout | None = None) -> int:
        """Move one wave of shards from layout ``prev`` to ``lay`` at ``step`` (the caller holds the step lock);
        returns the bytes moved. ``final``: the layout the change ends in (default: its target)."""
        ex = self.executor
        if ex.state_in_memory:
            return ex.relayout(lay)
        assert self.root is not None
        version = ex.version  # every stage database is at it (a job commits them all)
        rep = cold_rescale(self.root, ex, prev, lay, version, step, self._crashpoint, self._vfs,
                           target=final or self.final, measure_total=False)
        ex.start(self.circuit, lay, self.root)
        ex.resume(version + 1, step)
        return int(rep["moved_bytes"])

    @staticmethod
    def _let_steps_run(host: LiveHost, timeout: float = 0.05) -> None:
        """Between two waves: if a step waits for the lock, let it run first (a thread that releases a lock and
        takes it again at once would starve it)."""
        if not host._waiting:
            return
        steps, deadline = host.steps, time.monotonic() + timeout
        while host.steps == steps and host._waiting and time.monotonic() < deadline:
            time.sleep(0.0005)
