"""The state databases a storage directory's LAYOUT names, checked against the files present: a missing one is damage once any record says the state got past step 0, and one LAYOUT does not name is a leftover no reader opens.

Invariants (enforced here):
  1. LAYOUT names, in every state group (the embedded executor's ``state/``, each stateful stage's
     ``state/stage-<k>/``), ``worker-<w>.db`` for every worker ``w`` of its layout, and recovery reads no other
     database. A layout change keeps this true at every point (runtime/rescale.py): a joining worker's database
     is created before LAYOUT names it, a leaving worker's is deleted only after LAYOUT stops naming it. META's
     ``state_groups`` lists the groups (written when the directory is made); for a directory made before it,
     readers without the circuit (``dbsp inspect``, ``dbsp repair``) take ``state/`` for the embedded executor and
     the stage directories present for the staged one, and miss a stage whose whole directory is gone (opening
     the pipeline, which knows the stages, does not).
  2. A database LAYOUT names that is missing held state no other file holds, unless nothing says the state got
     past step 0: driver.db's newest version and every version of every database present are at step 0 (a new
     pipeline, or one whose creation a crash cut between two databases; the state at step 0 is empty, and the
     executor creates the missing ones). Otherwise :func:`check_named` raises CorruptionError naming every missing
     file and ``dbsp repair``, and ``Pipeline.open`` calls it before it creates or changes anything: no database is
     ever created empty in place of one that held state (the staged executor's open would create it, and the
     embedded one's a whole missing set, and recovery would then fail deep in, or replay on an empty state).
  3. A database present that LAYOUT does not name (outside a layout change: ``RESCALE`` absent) is no part of the
     state: recovery never opens it, and a later layout change that adds its worker deletes it first.
"""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

from dbsp_core.errors import CorruptionError, StorageError
from dbsp_core.storage.database import Database
from dbsp_core.storage.formats import DRIVER_DB, STAGE_DIR_PREFIX, STATE_DIR, state_db_paths, worker_db_name

__all__ = ["StateFiles", "check_named", "group_dir", "named_paths", "state_groups", "state_step", "survey"]


def group_dir(root: str, group: str) -> str:
    """The directory of state group ``group`` (an executor's ``StateGroup.name``: ``state`` or ``stage-<k>``)."""
    return os.path.join(root, STATE_DIR) if group == STATE_DIR else os.path.join(root, STATE_DIR, group)


def state_groups(root: str, meta: dict) -> list[str]:
    """The state groups of the directory (invariant 1): META's record, else what the executor kind and the
    stage directories present say."""
    groups = meta.get("state_groups")
    if isinstance(groups, list):
        return [str(g) for g in groups]
    if meta.get("executor") == "staged":
        dirs = glob.glob(os.path.join(root, STATE_DIR, f"{STAGE_DIR_PREFIX}*"))
        return sorted((os.path.basename(d) for d in dirs if os.path.isdir(d)),
                      key=lambda n: int(n[len(STAGE_DIR_PREFIX):]) if n[len(STAGE_DIR_PREFIX):].isdigit() else -1)
    return [STATE_DIR]


def named_paths(root: str, groups: list[str], workers: int) -> list[str]:
    """The databases LAYOUT (of ``workers`` workers) names in ``groups`` (invariant 1)."""
    return [os.path.join(group_dir(root, g), worker_db_name(w)) for g in groups for w in range(workers)]


def state_step(root: str, present: list[str]) -> tuple[int | None, str] | None:
    """What says the state got past step 0 (invariant 2): ``(step, file)`` of the first record that does
    (driver.db's newest version, then any version of each database of ``present``; step None for a database that
    cannot be read, which may hold state), or None when every one is at step 0."""
    dpath = os.path.join(root, DRIVER_DB)
    for p in [dpath] + list(present):
        if not os.path.exists(p):
            continue
        try:
            with Database(p, readonly=True) as db:
                versions = [db.versions().stop - 1] if p == dpath else list(db.versions())
                for v in versions:
                    with db.read(v) as h:
                        step = h.get_step()
                    if step > 0:
                        return step, p
        except (CorruptionError, StorageError, KeyError):
            return None, p
    return None


class StateFiles(NamedTuple):
    """The databases LAYOUT names (``named``), those of them missing, and those present it does not name."""

    named: list[str]
    missing: list[str]
    unnamed: list[str]


def survey(root: str, groups: list[str], workers: int) -> StateFiles:
    """The databases LAYOUT names in ``groups`` against those under ``state/`` (invariants 1 and 3)."""
    named = named_paths(root, groups, workers)
    present = state_db_paths(root)
    return StateFiles(named, [p for p in named if not os.path.exists(p)], [p for p in present if p not in named])


def check_named(root: str, named: list[str], workers: int, epoch: int) -> None:
    """Invariant 2: CorruptionError (nothing changed) if a database of ``named`` is missing while a record says
    the state got past step 0; returns quietly otherwise."""
    missing = [p for p in named if not os.path.exists(p)]
    if not missing:
        return
    said = state_step(root, [p for p in named if p not in missing])
    if said is None:
        return
    step, where = said
    rel = [os.path.relpath(p, root) for p in missing]
    how = f"is at step {step}" if step is not None else "cannot be read (it may hold state)"
    raise CorruptionError(
        f"{root}: LAYOUT ({workers} workers, layout epoch {epoch}) names state database"
        f"{'s' if len(rel) > 1 else ''} {', '.join(rel)}, missing, while {os.path.relpath(where, root)} {how}: "
        f"the state {'they' if len(rel) > 1 else 'it'} held is in no other file. Nothing was changed (no database "
        f"is made empty in place of a missing one). Run `dbsp repair {root}`: it says whether that state can be "
        f"computed again from the input log, or which file to restore from a backup")
