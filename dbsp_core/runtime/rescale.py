"""Layout changes of a storage directory: move the shards whose owner changes between the state databases of the old and new workers, commit the change as one new checkpoint version everywhere, and finish or undo an interrupted change on the next open; a live change records its target so that a crash midway ends with the move finished.

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
  4. A live change (``Pipeline.rescale``) first records its target layout in RESCALE (``live`` with no change in
     progress). The staged executor then makes each wave (the shards moved together) a change of the protocol above (the
     record keeps the target while a wave is in progress and after it); the embedded executor moves waves in
     memory and makes only the target durable, by the checkpoint that ends the change, whose state commit is
     followed by LAYOUT before ``driver.db`` and the input log's truncation. So after a crash, recovery ends any
     wave in progress (invariant 1), reads the target from RESCALE, and finishes the move as a cold change from
     the layout in LAYOUT: the directory ends in the target layout, with its output exactly once (the steps since
     the checkpoint replay in the new layout, verified against the output log).
  5. A change moves state only from databases that hold it for the layout it moves from: every database of a
     worker of ``old`` records (dbsp_core.storage.shardmove.write_worker_layout) that worker of ``old``'s epoch
     at the base version, or holds no state yet. Otherwise (a checkpoint taken in the middle of a live change,
     by releases before this rule) the moved shards' state would be read from databases that no longer hold
     it and the move would "finish" with their groups empty: the change is refused with RecoveryError before
     anything is written, and recovery of a live change rolls back only to a version that holds LAYOUT's
     epoch in every database, refusing (changing nothing) when no version does.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from dbsp_core.errors import RecoveryError
from dbsp_core.layout import Layout
from dbsp_core.runtime.executor import Executor, StateGroup
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import (read_layout, read_rescale, remove_record, remove_rescale, write_layout,
                                         write_rescale)
from dbsp_core.storage.formats import worker_files
from dbsp_core.storage.shardmove import relayout_group

__all__ = ["begin_live", "cold_rescale", "end_live", "live_target", "remove_leaving", "resolve"]


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


def _check_sources(root: str, groups: list[StateGroup], old: Layout, version: int, vfs: str) -> None:
    """Invariant 5: every existing database of a worker of ``old`` holds that worker's state of ``old`` at
    ``version`` (or no state yet); else RecoveryError naming the database, and nothing changes."""
    from dbsp_core.storage.shardmove import read_worker_layout

    for g in groups:
        for w in range(old.workers):
            path = g.path_of(w)
            if not os.path.exists(path):
                continue
            with Database(path, vfs=vfs) as db:
                if version not in db.versions():
                    continue  # a database created for this change (or one a rolled-back attempt left): no state
                with db.read(version) as h:
                    rec = read_worker_layout(h, path)
            if rec is not None and (int(rec["epoch"]), int(rec["worker"])) != (old.epoch, w):
                raise RecoveryError(
                    f"{root}: moving state from layout epoch {old.epoch} (LAYOUT), but {path} version {version} "
                    f"holds the state of worker {rec['worker']} of layout epoch {rec['epoch']}: the shards it moved "
                    f"away would be read from a database that no longer holds them, and their groups would "
                    f"restart from empty. Nothing was changed. The directory was written mid-way through a live "
                    f"rescale (a checkpoint taken during the move); restore it from a copy taken before, or run "
                    f"`dbsp repair` to see what it can save")


def _relayout(g: StateGroup, old: Layout, new: Layout, version: int, step: int,
              crashpoint: Callable[[str], None], vfs: str, measure_total: bool = True) -> dict:
    """Step 2 of the protocol for one state group."""
    n = max(old.workers, new.workers)
    dbs: dict[int, Database] = {}
    handles = {}
    try:
        for w in range(n):
            path = g.path_of(w)
            if w >= old.workers or not os.path.exists(path):
                _remove_worker(path, vfs)  # a leftover of an attempt that was rolled back
                os.makedirs(os.path.dirname(path), exist_ok=True)
                dbs[w] = Database.create(path, version, vfs=vfs)
            else:
                dbs[w] = Database(path, vfs=vfs)
            handles[w] = dbs[w].open(version)
        rep = relayout_group(handles, old, new, g.tables, f"{g.name}", measure_total)
        for w in range(n):
            handles[w].set_step(step)  # a new worker's database starts at step 0
            handles[w].commit()
            crashpoint("rescale-commit")
        return rep
    finally:
        for h in handles.values():
            if not h.closed:
                h.close()
        for db in dbs.values():
            db.close()


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
        if getattr(executor, "state_in_memory", False):
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
