"""Shared helpers of the storage tests: the scripted workload, the version model and contents readers."""

from __future__ import annotations

import os
import random
import re
import shutil

import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.errors import StorageError
from dbsp_core.storage import Database, FaultInjector

TABLES = ("alpha", "beta")


def contents(h) -> dict:
    """Every (table, key) -> value of a handle, plus its step."""
    out = {("__step__", b""): h.get_step()}
    for t in h.tables():
        for k, v in h.scan(t):
            out[(t, k)] = v
    return out


def version_contents(path: str, version: int, tmpdir: str) -> dict:
    """Contents of one version, read from a copy so the original keeps both versions."""
    cp = os.path.join(tmpdir, f"copy-{version}")
    shutil.copyfile(path, cp)
    try:
        with Database(cp) as db, db.open(version) as h:
            return contents(h)
    finally:
        os.unlink(cp)


def observed(path: str, tmpdir: str) -> dict:
    """{version: contents} of every openable version of the page file at path."""
    with Database(path) as db:
        vs = db.versions()
        db.check()
    return {v: version_contents(path, v, tmpdir) for v in vs}


def apply_ops(h, model: dict, rng: random.Random, n: int) -> None:
    """n random puts/deletes (small, medium and overflow values) applied to the handle and the model."""
    for _ in range(n):
        t = rng.choice(TABLES)
        k = b"k%04d" % rng.randrange(400)
        if rng.random() < 0.75:
            v = rng.randbytes(rng.choice([1, 30, 300, 1500, 9000]))
            h.put(t, k, v)
            model[(t, k)] = v
        else:
            h.delete(t, k)
            model.pop((t, k), None)


def build_base(path: str, seed: int, versions: int = 2) -> tuple[dict, dict]:
    """Commits `versions` versions (1..versions) of random data; returns ({version: contents}, last model)."""
    rng = random.Random(seed)
    model = {("__step__", b""): 0}
    states = {}
    with Database(path) as db:
        states[0] = dict(model)
        for v in range(versions):
            with db.open(v) as h:
                apply_ops(h, model, rng, 300)
                h.set_step(100 + v)
                model[("__step__", b"")] = 100 + v
                h.commit()
            states[v + 1] = dict(model)
    return states, model


def run_session(path: str, base: int, model: dict, seed: int, vfs: str = "fault") -> tuple[dict, bool, BaseException | None]:
    """open(base) -> random ops -> commit on the given VFS; returns (new model, committed?, exception)."""
    rng = random.Random(seed)
    new = dict(model)
    committed = False
    err = None
    try:
        with Database(path, vfs=vfs, cache_pages=64) as db:
            with db.open(base) as h:
                apply_ops(h, new, rng, 120)
                for i in range(2):  # values the transaction writes to the file as it puts them (18 pages each,
                    k = b"big%d" % i  # pagestore.c overflow_write_through)
                    new[("alpha", k)] = v = rng.randbytes(70_000)
                    h.put("alpha", k, v)
                h.set_step(1000 + base)
                new[("__step__", b"")] = 1000 + base
                h.commit()
                committed = True
    except StorageError as e:
        err = e
    return new, committed, err


def dry_run_ops(path: str, base: int, model: dict, seed: int, tmpdir: str) -> int:
    """How many fault-VFS operations the session performs without faults."""
    cp = os.path.join(tmpdir, "dry")
    shutil.copyfile(path, cp)
    FaultInjector.arm()
    _, ok, err = run_session(cp, base, model, seed)
    n = FaultInjector.ops()
    FaultInjector.disarm()
    os.unlink(cp)
    assert ok and err is None
    return n


def same(a: dict, b: dict) -> bool:
    return a == b


SPILL_SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def count_sum_circuit() -> dbsp.Circuit:
    """The spill tests' view ``g``: per ``k`` of SPILL_SCHEMA rows, their count ``n`` and the sum ``s`` of ``v``."""
    c = dbsp.Circuit()
    t = c.input("t", SPILL_SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    return c


def view_integral(p: dbsp.Pipeline, name: str = "g") -> dict:
    """{row: weight} of view ``name``'s outputs summed from step 0 (rows of weight 0 dropped)."""
    acc: dict = {}
    for _, z in p.read_output(name, from_step=0):
        add_change(acc, z)
    return acc


def add_change(acc: dict, z) -> None:
    """Add Z-set ``z``'s {row: weight} to ``acc``, rows of weight 0 dropped (a view's integral, step by step)."""
    for r, w in z.to_dict().items():
        acc[r] = acc.get(r, 0) + w
        if acc[r] == 0:
            del acc[r]


def fault_op(exc: BaseException | None, n: int, pattern: "re.Pattern[str]") -> tuple[str, str] | None:
    """The operation (name, path) the fault VFS crashed or failed at as operation ``n``, as the error ``exc`` (or
    one in its chain of causes) names it through ``pattern`` (groups: name, path, operation number); None when
    nothing raised names it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for m in pattern.finditer(str(exc)):
            if int(m.group(3)) == n:
                return m.group(1), m.group(2)
        exc = exc.__cause__ or exc.__context__
    return None


def spill_left_over(d: str, store) -> list[str]:
    """Files of pipeline directory ``d``'s spill directory that are scratch files, temporary files, or batch files
    that neither a live batch of ``store`` reads nor the last checkpoint names (trace invariant 13)."""
    from dbsp_core.storage.formats import BATCH_FILE_SUFFIX, SPILL_DIR

    keep = set(store._owners) | store._pinned
    return sorted(n for n in os.listdir(os.path.join(d, SPILL_DIR))
                  if not (n.endswith(BATCH_FILE_SUFFIX) and n in keep))


def close_crashed(p: "dbsp.Pipeline | None") -> None:
    """Close a pipeline a fault may have left broken, without a checkpoint; one that cannot close is shut down."""
    if p is None:
        return
    try:
        p.close(checkpoint=False)
    except Exception:
        p._shutdown()
