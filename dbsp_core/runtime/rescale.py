"""Cold layout changes of a storage directory: move the shards whose owner changes between the state databases of the old and new workers, commit the change as one new checkpoint version everywhere, and finish or undo an interrupted change on the next open.

The protocol (seed 000 "cold" layout change, atomic across every database of every state group):

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
from dbsp_core.storage.shardmove import relayout_group

__all__ = ["cold_rescale", "resolve"]


def _worker_files(path: str) -> list[str]:
    """A worker database and the files a stage task keeps beside it."""
    return [path, path + ".lock", path[:-3] + ".result"]


def _remove_worker(path: str, vfs: str) -> None:
    for p in _worker_files(path):
        if os.path.exists(p):
            remove_record(p, vfs)


def cold_rescale(root: str, executor: Executor, old: Layout, new: Layout, version: int, step: int,
                 crashpoint: Callable[[str], None], vfs: str = "posix") -> dict:
    """Change the stored state of ``root`` from layout ``old`` to ``new`` (the protocol above); returns the report
    ``{from_workers, to_workers, from_shards, to_shards, moved_shards, moved_bytes, total_bytes, seconds}``."""
    t0 = time.perf_counter()
    groups = executor.groups(new)
    write_rescale(root, {"from": old.to_dict(), "to": new.to_dict(), "version": version, "step": step,
                         "committed": False}, vfs)
    crashpoint("rescale-intent")
    totals = {"moved_shards": len(old.moved_shards(new)), "moved_bytes": 0, "total_bytes": 0}
    for g in groups:
        rep = _relayout(g, old, new, version, step, crashpoint, vfs)
        totals["moved_bytes"] += rep["moved_bytes"]
        totals["total_bytes"] += rep["total_bytes"]
        crashpoint("rescale-group")
    report = {"from_workers": old.workers, "to_workers": new.workers, "from_shards": old.shards,
              "to_shards": new.shards, **totals, "seconds": round(time.perf_counter() - t0, 6),
              "kind": "cold", "step": step}
    write_rescale(root, {"from": old.to_dict(), "to": new.to_dict(), "version": version, "step": step,
                         "committed": True, "report": report}, vfs)
    crashpoint("rescale-committed")
    _finish(root, groups, old, new, report, crashpoint, vfs)
    return report


def _relayout(g: StateGroup, old: Layout, new: Layout, version: int, step: int,
              crashpoint: Callable[[str], None], vfs: str) -> dict:
    """Step 2 of the protocol for one state group."""
    n = max(old.workers, new.workers)
    dbs: dict[int, Database] = {}
    handles = {}
    try:
        for w in range(n):
            path = g.path_of(w)
            if w >= old.workers:
                _remove_worker(path, vfs)  # a leftover of an attempt that was rolled back
                os.makedirs(os.path.dirname(path), exist_ok=True)
                dbs[w] = Database.create(path, version, vfs=vfs)
            else:
                dbs[w] = Database(path, vfs=vfs)
            handles[w] = dbs[w].open(version)
        rep = relayout_group(handles, old, new, g.tables, f"{g.name}")
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
            crashpoint: Callable[[str], None], vfs: str) -> None:
    """Step 3: switch LAYOUT, delete the leaving workers' databases, remove RESCALE (idempotent)."""
    write_layout(root, new, report, vfs)
    crashpoint("rescale-layout")
    for g in groups:
        for w in range(new.workers, old.workers):
            _remove_worker(g.path_of(w), vfs)
    remove_rescale(root, vfs)


def resolve(root: str, executor: Executor, crashpoint: Callable[[str], None], vfs: str = "posix") -> str | None:
    """Finish or undo a layout change interrupted by a crash (invariant 1); returns ``"forward"``, ``"back"``
    or None when no change was in progress. Call it before the executor opens any state."""
    rec = read_rescale(root, vfs)
    if rec is None:
        return None
    try:
        old, new = Layout.from_dict(rec["from"], "RESCALE from"), Layout.from_dict(rec["to"], "RESCALE to")
        version = int(rec["version"])
    except (KeyError, TypeError, ValueError) as e:
        raise RecoveryError(f"{root}/RESCALE: unreadable layout change record ({e})") from None
    current, _ = read_layout(root, vfs)
    groups = executor.groups(new)
    if current.epoch == new.epoch:  # LAYOUT switched already: only the clean-up was interrupted
        _finish(root, groups, old, new, rec.get("report") or {}, crashpoint, vfs)
        return "forward"
    if current.epoch != old.epoch:
        raise RecoveryError(f"{root}: RESCALE changes layout epoch {old.epoch} to {new.epoch}, but LAYOUT is at "
                            f"epoch {current.epoch}")
    committed = bool(rec.get("committed")) or _all_hold(groups, max(old.workers, new.workers), version + 1, vfs)
    if committed:
        report = rec.get("report") or {"from_workers": old.workers, "to_workers": new.workers, "kind": "cold",
                                       "completed_by_recovery": True}
        _finish(root, groups, old, new, report, crashpoint, vfs)
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
    remove_rescale(root, vfs)
    return "back"


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
