"""Opening a storage directory written by the previous release (directory format 1): its state databases are converted into format 2 copies, and META switches format last, so a crash at any point leaves a directory the previous release or this one opens.

Format 1 (dbsp-core 0.1.0) kept the worker count and shard bits in META (shards in contiguous slices: the
layout ``Layout.local(W, shard_bits)`` of format 2), the embedded workers' databases at ``worker-<w>.db`` in the
root (worker 0 also held the dedup set in table ``dedup`` and the clock floor under key ``now`` of table
``dedup.clock``), the staged executor's databases under ``stages/stage-<k>/`` with ``stages/JOB``, and the staged
driver's ``driver.db`` with the same two tables. State values were keyed by shard and number as in format 2,
except that a Z-set attribute was one value under key ``all``. The input and output logs of format 1 are read
in place by the storage layer (dbsp_core.storage.steplog, dbsp_core.storage.outputlog_format1).

Invariants (enforced here):
  1. Nothing the previous release reads is changed before META names format 2: the state databases are
     converted in copies under ``state/`` (each at the version recovery would choose, committed as the next
     version), ``driver.db`` is written anew beside the old one's content, then LAYOUT, then META. A crash
     before META's replacement leaves format 1 (the copies are discarded on the next attempt); after it, the
     directory is format 2 and the old files are only removed.
  2. The converted state is the same state: every trace value keeps its bytes, shard and number; a Z-set
     attribute is split into one value per shard as format 2 groups it; the dedup set and the clock floor move
     to ``driver.db`` at the checkpoint's step.
  3. A directory is upgraded only with the circuit that wrote it (same fingerprint) and the executor kind that
     wrote it (embedded or staged); otherwise it is refused and left unchanged.
"""

from __future__ import annotations

import os
import shutil

from dbsp_core.codec import decode_json, decode_zset, encode_json, encode_zset
from dbsp_core.errors import CircuitMismatchError, RecoveryError
from dbsp_core.layout import HASH_VERSION, Layout
from dbsp_core.runtime.coordinator import choose_version
from dbsp_core.runtime.executor import Executor, StateGroup
from dbsp_core.storage.database import Database, shard_key
from dbsp_core.storage.directory import fsync_dir, read_record, write_layout, write_meta
from dbsp_core.storage.formats import (CLOCK_KEY, CLOCK_MAGIC, CLOCK_TABLE, DEDUP_TABLE, DRIVER_DB, FORMAT1_STAGES_DIR,
                                       JOB_FILE, JOB_MAGIC, META_FILE, META_MAGIC, OUTPUT_DIR, STATE_DIR, ZSET_MAGIC,
                                       is_state_table, result_path, worker_db_name, worker_files)
from dbsp_core.storage.outputlog import OutputLog
from dbsp_core.storage.shardmove import write_worker_layout
from dbsp_core.storage.snapshot import TableSpec, read_next, read_order, write_next, write_order, zset_pieces

__all__ = ["upgrade_format1"]

_OLD_CLOCK_TABLE = "dedup.clock"


def _old_paths(root: str, group: StateGroup, staged: bool, workers: int) -> list[str]:
    if not staged:
        return [os.path.join(root, worker_db_name(w)) for w in range(workers)]
    return [os.path.join(root, FORMAT1_STAGES_DIR, group.name, worker_db_name(w)) for w in range(workers)]


def upgrade_format1(root: str, meta: dict, executor: Executor, fingerprint: str, vfs: str = "posix") -> None:
    """Convert the format-1 directory ``root`` (its META record ``meta``) to format 2 (invariants 1-3).

    ``executor`` must be started on the circuit (its state groups name the tables to convert)."""
    if meta.get("fingerprint") != fingerprint:
        raise CircuitMismatchError(f"{root} was written by a pipeline with a different circuit "
                                   f"({meta.get('fingerprint')!r} != {fingerprint!r}); open it with the same circuit")
    staged = os.path.isdir(os.path.join(root, FORMAT1_STAGES_DIR))
    kind = "staged" if staged else "embedded"
    if executor.kind != kind:
        raise CircuitMismatchError(f"{root} was written by the {kind} executor of the previous release; open it "
                                   f"with that executor (this pipeline has the {executor.kind} one)")
    try:
        workers, bits = int(meta["workers"]), int(meta["shard_bits"])
        layout = Layout.local(workers, bits)
    except (KeyError, TypeError, ValueError) as e:
        raise RecoveryError(f"{root}/META: format-1 record without a valid scale ({e})") from None
    state = os.path.join(root, STATE_DIR)
    shutil.rmtree(state, ignore_errors=True)  # an earlier attempt that did not reach META (invariant 1)
    groups = executor.groups(layout)
    old = {g.name: _old_paths(root, g, staged, workers) for g in groups}
    missing = [p for ps in old.values() for p in ps if not os.path.exists(p)]
    if missing:
        raise RecoveryError(f"{root}: format-1 state databases are missing: {missing[:4]}")
    at_most = None
    job = read_record(os.path.join(root, FORMAT1_STAGES_DIR, JOB_FILE), JOB_MAGIC) if staged else None
    if job is not None:
        out = OutputLog(os.path.join(root, OUTPUT_DIR), {}, readonly=True)
        try:
            if job["end"] > out.last:
                at_most = int(job["version"])  # that job's output is not all logged: it runs again from its base
        finally:
            out.close()
    paths = [p for ps in old.values() for p in ps]
    step = _convert_state(root, groups, old, layout, at_most, vfs) if paths else None
    _convert_driver(root, staged, step, vfs)
    fsync_dir(root)
    write_layout(root, layout, {"kind": "upgrade", "from_format": 1, "to_workers": workers,
                                "from_workers": workers, "moved_shards": 0, "moved_bytes": 0}, vfs)
    write_meta(root, {"fingerprint": fingerprint, "executor": kind, "inputs": meta["inputs"],
                      "outputs": meta["outputs"], "output_schemas": meta["output_schemas"],
                      "hash_version": HASH_VERSION, "upgraded_from": 1}, vfs)
    for p in paths:  # invariant 1: format 2 from here on; the old files are only removed
        for f in worker_files(p):
            if os.path.exists(f):
                os.unlink(f)
    shutil.rmtree(os.path.join(root, FORMAT1_STAGES_DIR), ignore_errors=True)
    fsync_dir(root)


def _convert_state(root: str, groups: list[StateGroup], old: dict[str, list[str]], layout: Layout,
                   at_most: int | None, vfs: str) -> int:
    """Copy and convert every state database; returns the step they are at."""
    all_old = [p for ps in old.values() for p in ps]
    dbs = [Database(p, vfs=vfs) for p in all_old]
    try:
        ranges = [db.versions() for db in dbs]
        v = choose_version(ranges, root)
        if at_most is not None:
            v = min(v, at_most)
            if v < max(r.start for r in ranges):
                raise RecoveryError(f"{root}: the format-1 state databases share no version at or below {at_most}")
        steps = set()
        for db in dbs:
            with db.read(v) as h:
                steps.add(h.get_step())
    finally:
        for db in dbs:
            db.close()
    if len(steps) != 1:
        raise RecoveryError(f"{root}: the format-1 state databases disagree on the step of version {v}")
    step = steps.pop()
    for g in groups:
        for w, src in enumerate(old[g.name]):
            dst = g.path_of(w)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
            with open(dst, "rb+") as f:
                os.fsync(f.fileno())
            if os.path.exists(result_path(src)):
                shutil.copyfile(result_path(src), result_path(dst))
            with Database(dst, vfs=vfs) as db, db.open(v) as h:  # discards any other version of the copy
                _convert_db(h, g.tables, layout, w, f"{src} v{v}")
                h.commit()
        fsync_dir(os.path.dirname(g.path_of(0)))
    return step


def _convert_db(h, tables: dict[str, TableSpec], layout: Layout, worker: int, where: str) -> None:
    """Invariant 2 inside one database version."""
    nxt = read_next(h)
    for t in [t for t in h.tables() if isinstance(t, str) and is_state_table(t)]:
        spec = tables.get(t)
        if spec is None:
            raise RecoveryError(f"{where}: state table {t!r} belongs to no operator of this circuit")
        if spec.kind == "zset":
            blob = h.get(t, b"all")
            for k in [k for k, _ in h.scan(t)]:
                h.delete(t, k)
            if blob is not None:
                z = decode_zset(blob, spec.schema, f"{where} {t}", ZSET_MAGIC)
                for shard, piece in zset_pieces(z, spec.key, layout.shard_bits):
                    h.put(t, shard_key(shard, nxt.to_bytes(8, "big")), encode_zset(piece, ZSET_MAGIC))
                nxt += 1
        elif read_order(h, t, where) is None:  # written before order records: number order, all settled
            numbers = sorted({int.from_bytes(k[4:], "big") for k, _ in h.scan(t)})
            write_order(h, t, numbers, [1] * len(numbers), len(numbers))
    for t in (DEDUP_TABLE, _OLD_CLOCK_TABLE):  # embedded worker 0 kept the driver's record: driver.db has it now
        for k in [k for k, _ in h.scan(t)]:
            h.delete(t, k)
    write_next(h, nxt)
    write_worker_layout(h, layout, worker)


def _convert_driver(root: str, staged: bool, step: int | None, vfs: str) -> None:
    """Write driver.db's format-2 record: the dedup set and the clock, at the checkpoint's step."""
    path = os.path.join(root, DRIVER_DB)
    if staged:
        src = Database(path, vfs=vfs)  # format 1 had driver.db already; its record moves to the format-2 tables
    else:
        src = Database(os.path.join(root, worker_db_name(0)), vfs=vfs)
    try:
        vs = src.versions()
        if staged:
            version = vs.stop - 1
        else:
            version = choose_version([vs], root)
        with src.read(version) as h:
            dedup = list(h.scan(DEDUP_TABLE))
            clock = h.get(_OLD_CLOCK_TABLE, CLOCK_KEY) or h.get(CLOCK_TABLE, CLOCK_KEY)
            d_step = h.get_step()
    finally:
        src.close()
    if not staged:
        d_step = step if step is not None else d_step
    floor = 0 if clock is None else int(decode_json(CLOCK_MAGIC, clock, f"{path} clock")["now_ns"])
    if not staged and os.path.exists(path):
        os.unlink(path)  # a leftover of an attempt that did not reach META
    with Database(path, vfs=vfs) as db, db.open(db.versions().stop - 1) as h:
        # the staged driver.db keeps its format-1 tables too (the previous release reads them until META switches)
        for k, v in dedup:
            h.put(DEDUP_TABLE, k, v)
        h.put(CLOCK_TABLE, CLOCK_KEY, encode_json(CLOCK_MAGIC, {"now_ns": floor, "prev_now_ns": None}))
        h.set_step(d_step)
        h.commit()


def is_format1(root: str) -> dict | None:
    """The META record of ``root`` if it is a format-1 directory, else None."""
    rec = read_record(os.path.join(root, META_FILE), META_MAGIC)
    if rec is not None and rec.get("format") == 1:
        return rec
    return None

