"""Checkpoints that name spilled batch files instead of copying their rows: what they store, which files stay, recovery with and without a budget, and a crash at every I/O operation of a session that spills and checkpoints (through the fault VFS), after which the reopened pipeline's output is exactly the reference's."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.storage import Database, FaultInjector
from dbsp_core.storage.formats import BATCH_GROUP_MAGIC, BATCH_MAGIC, BATCH_REF_MAGIC, SPILL_DIR, state_db_paths

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v")))
    c.output("d", t.select(k="k").distinct())
    return c


def _pushes(n: int, rows: int = 40, seed: int = SEED) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    return [pa.table({"k": rng.integers(0, 60, rows), "v": rng.integers(0, 1000, rows)}, schema=SCHEMA)
            for _ in range(n)]


def _stored_values(root: str) -> dict[bytes, int]:
    """How many values of each magic the newest version of every state database holds in trace tables."""
    counts: dict[bytes, int] = {}
    for path in state_db_paths(root):
        with Database(path, readonly=True) as db, db.read(db.versions().stop - 1) as h:
            for table in h.tables():
                if table.startswith("s"):
                    for _, v in h.scan(table):
                        counts[v[:4]] = counts.get(v[:4], 0) + 1
    return counts


def _integral(p: dbsp.Pipeline, name: str) -> dict:
    acc: dict = {}
    for _, z in p.read_output(name, from_step=0):
        for r, w in z.to_dict().items():
            acc[r] = acc.get(r, 0) + w
            if acc[r] == 0:
                del acc[r]
    return acc


def _reference(pushes: list[pa.Table]) -> dict[str, dict]:
    with dbsp.Pipeline(_circuit()) as ref:
        acc: dict[str, dict] = {"g": {}, "d": {}}
        for x in pushes:
            ref.push("t", x)
            for name, z in ref.step().items():
                for r, w in z.to_dict().items():
                    acc[name][r] = acc[name].get(r, 0) + w
                    if acc[name][r] == 0:
                        del acc[name][r]
    return acc


def test_checkpoints_name_files_and_only_named_or_live_files_stay(tmp_path) -> None:
    d = str(tmp_path / "p")
    pushes = _pushes(30)
    with dbsp.Pipeline(_circuit(), workers=2, storage=d, memory_limit=1, checkpoint_interval=None) as p:
        for i, x in enumerate(pushes[:24]):
            p.push("t", x, producer="gen", seq=i)
            p.step()
            if i % 5 == 4:
                p.checkpoint()
                store = p.executor.batch_store
                on_disk = {n for n in os.listdir(store.directory)}
                assert on_disk <= store._pinned | set(store._owners), "a file neither named nor read stayed"
                named = p.executor._referenced()
                assert named and named <= on_disk, "a file the checkpoint names is gone"
        written = store.stats["files_written"]
    counts = _stored_values(d)
    assert counts.get(BATCH_REF_MAGIC, 0) > 0, counts  # spilled batches stored as references
    on_disk = set(os.listdir(os.path.join(d, SPILL_DIR)))
    assert written > len(on_disk) and store.stats["files_deleted"] > 0  # merged-away files went
    # reopened with a budget: the named files are read in place; every other file is swept
    (tmp_path / "p" / SPILL_DIR / "abc-000000000001.batch").write_bytes(b"stray")
    with dbsp.Pipeline.open(d, _circuit(), memory_limit=1) as q:
        st = q.executor.batch_store
        assert "abc-000000000001.batch" not in os.listdir(st.directory)
        restored = [b for w in range(2) for t in q.traces(w).values() for b in t.parts()[0]]
        assert any(st.is_spilled(b) for b in restored)
        for i, x in enumerate(pushes[24:27], start=24):
            q.push("t", x, producer="gen", seq=i)
            q.step()
    with dbsp.Pipeline.open(d, _circuit()) as r:  # no budget: reads the named files all the same
        for i, x in enumerate(pushes[27:], start=27):
            r.push("t", x, producer="gen", seq=i)
            r.step()
        want = _reference(pushes)
        assert _integral(r, "g") == want["g"] and _integral(r, "d") == want["d"]


def test_a_checkpoint_of_spilled_state_copies_no_rows(tmp_path, monkeypatch) -> None:
    """With every batch spilled, the state databases hold references, not rows: far fewer bytes than the rows."""
    from dbsp_core import envvars

    # the control run has no budget, also when DBSP_MEMORY_LIMIT gives every pipeline one (a CI setting)
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))
    pushes = _pushes(12, rows=2000)
    sizes = {}
    for label, limit in (("memory", None), ("spilled", 1)):
        d = str(tmp_path / label)
        with dbsp.Pipeline(_circuit(), storage=d, memory_limit=limit, checkpoint_interval=None) as p:
            for x in pushes:
                p.push("t", x)
                p.step()
        counts = _stored_values(d)
        sizes[label] = (sum(os.path.getsize(x) for x in state_db_paths(d)), counts)
    assert sizes["spilled"][1].get(BATCH_REF_MAGIC, 0) > 0
    assert sizes["memory"][1].get(BATCH_REF_MAGIC, 0) == 0
    rows_spilled = sizes["spilled"][1].get(BATCH_MAGIC, 0) + sizes["spilled"][1].get(BATCH_GROUP_MAGIC, 0)
    rows_memory = sizes["memory"][1].get(BATCH_MAGIC, 0) + sizes["memory"][1].get(BATCH_GROUP_MAGIC, 0)
    assert rows_spilled < rows_memory, (sizes["spilled"][1], sizes["memory"][1])


def _session(d: str, pushes: list[pa.Table], first: int, vfs: str) -> None:
    """Open ``d`` with a 1-byte budget through ``vfs``, push and step (every batch spills), checkpoint, close."""
    p = None
    try:
        p = dbsp.Pipeline.open(d, _circuit(), memory_limit=1, vfs=vfs, checkpoint_interval=None)
        for i, x in enumerate(pushes, start=first):
            p.push("t", x, producer="gen", seq=i)
            p.step()
        p.checkpoint()
    finally:
        if p is not None:
            try:
                p.close(checkpoint=False)
            except Exception:
                p._shutdown()


@pytest.mark.parametrize("modes, stride", [(("drop",), 9),
                                           pytest.param(("drop", "keep", "tear", "reorder", "chaos"), 1,
                                                        marks=pytest.mark.slow)])
def test_a_crash_at_every_io_operation_of_spills_and_a_checkpoint(tmp_path, modes, stride) -> None:
    """The session (open, two steps that spill every batch, a checkpoint naming the files) crashes at I/O operation
    n through the fault VFS; the reopened pipeline, fed the same pushes again (deduplicated), ends with exactly
    the reference's output. The long suite tries every operation with every damage mode; the default run every
    ``stride``-th operation from a seeded offset, with the files' own writes among them."""
    pushes = _pushes(7, rows=30)
    base = str(tmp_path / "base")
    with dbsp.Pipeline(_circuit(), storage=base, memory_limit=1, checkpoint_interval=None) as p:
        for i, x in enumerate(pushes[:4]):
            p.push("t", x, producer="gen", seq=i)
            p.step()
    assert _stored_values(base).get(BATCH_REF_MAGIC, 0) > 0  # the base checkpoint names files already
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    FaultInjector.arm()
    _session(probe, pushes[4:6], 4, "fault")
    nops = FaultInjector.ops()
    FaultInjector.disarm()
    assert nops > 20
    want = _reference(pushes)
    tried = crashed = 0
    points = range(1 + SEED % stride, nops + 1, stride)
    for n in points:
        for mode in modes:
            d = str(tmp_path / f"c{n}-{mode}")
            shutil.copytree(base, d)
            FaultInjector.arm(crash_at=n, mode=mode, seed=SEED + n)
            try:
                _session(d, pushes[4:6], 4, "fault")
            except (OSError, dbsp.DbspError):
                pass
            crashed += FaultInjector.crashed()
            FaultInjector.disarm()
            with dbsp.Pipeline.open(d, _circuit(), memory_limit=1, checkpoint_interval=None) as q:
                for i, x in enumerate(pushes[4:], start=4):  # a push recorded before the crash counts once
                    q.push("t", x, producer="gen", seq=i)
                    q.step()
                got = {"g": _integral(q, "g"), "d": _integral(q, "d")}
            assert got == want, f"crash at I/O operation {n} of {nops} ({mode}, seed {SEED}): state differs"
            tried += 1
            shutil.rmtree(d)
    assert crashed == tried == len(points) * len(modes) > 0
    print(f"\n[spill crash] {nops} I/O operations x {len(modes)} modes = {tried} crashes, 0 violations")
