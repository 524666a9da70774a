"""A layout change built one destination at a time (dbsp_core.storage.shardmove invariant 5, what a store pipeline's move tasks run) leaves every new database byte for byte as the all-at-once change (relayout_group) leaves it, growing and shrinking, on stage databases a staged pipeline wrote."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

from staged_circuits import build, changes, staged_pipeline  # noqa: E402

from dbsp_core.runtime.stage_store import MoveTask  # noqa: E402
from dbsp_core.storage.database import Database  # noqa: E402
from dbsp_core.storage.shardmove import build_target, moving_to, relayout_group  # noqa: E402

SEED = int(os.environ.get("DBSP_MOVE_TARGET_SEED", np.random.SeedSequence().entropy % 10**6))


def _contents(path: str) -> dict:
    """Every (table, key) -> value of a database's newest version."""
    with Database(path) as db, db.read(db.versions().stop - 1) as h:
        return {(t, k): v for t in h.tables() for k, v in h.scan(t)}


def _all_at_once(paths: dict[int, str], old, new, specs, version: int) -> None:
    dbs = {w: Database(p) if os.path.exists(p) else Database.create(p, version) for w, p in paths.items()}
    try:
        handles = {w: db.open(version) for w, db in dbs.items()}
        relayout_group(handles, old, new, specs, "test")
        for h in handles.values():
            h.commit()
            h.close()
    finally:
        for db in dbs.values():
            db.close()


def _one_target(src: dict[int, str], dst: str, w: int, old, new, specs, version: int) -> int:
    """What a move task does for worker ``w``: read what moves to it from each other source, change its own copy."""
    incoming, counts = [], {}
    for s in MoveTask.sources(old, new, w):
        if s == w:
            continue
        with Database(src[s]) as db, db.read(version) as h:
            got, cnt = moving_to(h, s, w, old, new, specs, "test")
        incoming += got
        counts.update(cnt)
    if w < old.workers:
        shutil.copyfile(src[w], dst)
        db = Database(dst)
    else:
        db = Database.create(dst, version)
    try:
        with db.open(version) as h:
            moved = build_target(h, w, old, new, specs, incoming, counts, "test")
            h.commit()
    finally:
        db.close()
    return moved


def one_target_equals_whole(tmp_path, old, groups, version_of) -> tuple[int, int]:
    """For a worker joining and one leaving (``old`` rebalanced to 3 and to 1 workers): each group's databases
    (``groups``, at ``version_of(group)``) changed one destination at a time (:func:`_one_target`) equal, entry by
    entry, the same change made all at once (:func:`_all_at_once`). Returns (databases compared, those a move
    wrote to)."""
    checked = moved = 0
    for new_workers in (3, 1):  # a worker joins; one leaves
        new = old.rebalance(new_workers)
        assert new.shard_bits == old.shard_bits
        for g in groups:
            version = version_of(g)
            n = max(old.workers, new.workers)
            whole = {w: str(tmp_path / f"whole-{new_workers}-{g.name}-{w}.db") for w in range(n)}
            for w in range(old.workers):
                shutil.copyfile(g.path_of(w), whole[w])
            src = {w: g.path_of(w) for w in range(old.workers)}
            _all_at_once(whole, old, new, g.tables, version)
            for w in range(new.workers):
                one = str(tmp_path / f"one-{new_workers}-{g.name}-{w}.db")
                moved += _one_target(src, one, w, old, new, g.tables, version) > 0
                got, want = _contents(one), _contents(whole[w])
                assert got == want, f"{g.name} worker {w} of {new_workers}: {len(got)} entries != {len(want)}"
                checked += 1
    return checked, moved


@pytest.mark.parametrize("name", ["join_agg", "carried"])
def test_one_target_at_a_time_equals_the_whole_change(tmp_path, name) -> None:
    print(f"DBSP_MOVE_TARGET_SEED={SEED}")
    steps, _ = changes(SEED, 5)
    c, _ = build(name)
    d = str(tmp_path / "pipe")
    p = staged_pipeline(c, 2, d, checkpoint_interval=None)
    for pushes in steps:
        for h, z in pushes:
            p.push(h, z)
        p.step()
    old, version = p.layout, p.executor.version
    groups = p.executor.groups(old)
    p.close()
    checked, moved_any = one_target_equals_whole(tmp_path, old, groups, lambda g: version)
    assert checked == len(groups) * 4 and moved_any > 0 and len(groups) > 0
