"""Reading a storage directory without running its circuit: a summary for ``dbsp inspect`` (with the metrics of the last checkpoint, state bytes per worker and shard, and the output log's consumers) and the output log for consumers in other processes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.codec import width_runs_head
from dbsp_core.errors import InUseError
from dbsp_core.storage.consumers import ConsumerRegistry
from dbsp_core.storage.database import SHARD_PREFIX_BYTES, Database
from dbsp_core.storage.directory import read_layout, read_meta, read_record, read_rescale, tree_bytes
from dbsp_core.storage.formats import (BATCH_RANGE_MAGIC, DIRECTORY_FORMATS, DIVISION_HANDLE, DRIVER_DB, INPUT_DIR, METRICS_FILE, METRICS_MAGIC, OUTPUT_DIR,
                                       STATE_DIR, is_state_table, worker_of_db)
from dbsp_core.storage.outputlog import OutputLog
from dbsp_core.storage.statefiles import state_groups, survey
from dbsp_core.storage.steplog import StepLog

__all__ = ["inspect_storage", "open_output"]


def open_output(path: str | os.PathLike) -> OutputLog:
    """The output log of a storage directory, read-only, for consumers in other processes (no circuit needed).

    It may be read while the pipeline runs: :meth:`OutputLog.refresh` picks up new steps, a record being
    written is not shown until it is complete, and steps dropped by retention raise LookupError.

    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> d = tempfile.mkdtemp(); p = dbsp.Pipeline(c, storage=d); _ = p.push("x", pa.table({"a": [1]})); _ = p.step()
    >>> log = open_output(d)
    >>> [(step, z.to_dict()) for step, z in log.read("o", 0)]
    [(0, {(1,): 1})]
    >>> _ = p.push("x", pa.table({"a": [2]})); _ = p.step(); log.refresh()
    >>> range(log.first, log.last)
    range(0, 2)
    >>> p.close(); log.close()
    """
    root = os.fspath(path)
    meta = read_meta(root, formats=(1, *DIRECTORY_FORMATS))  # the output log of the previous release's directories reads the same
    schemas = {n: pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(h))) for n, h in meta["output_schemas"].items()}
    return OutputLog(os.path.join(root, OUTPUT_DIR), {n: schemas[n] for n in meta["outputs"]}, readonly=True,
                     since=meta.get("since"))


def inspect_storage(path: str | os.PathLike, check_files: bool = True) -> dict:
    """A summary of a storage directory without recovering it: layout, checkpoints, logs and sizes.

    Only reads: it creates, writes or locks no file of the directory (not even ``LOCK``), and never runs the
    circuit. The logs are read read-only (a torn tail is left as it is), so they can be read while a pipeline
    runs; the state databases are opened read-only, which their locks refuse while a pipeline has them open:
    ``info["in_use"]`` then lists them and the checkpoint fields are None. ``info["state_missing"]`` lists the
    state databases LAYOUT names that are not there (then no checkpoint is whole: the checkpoint fields are None)
    and ``info["state_unnamed"]`` those present it does not name, which are never read (storage/statefiles.py).

    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> d = tempfile.mkdtemp(); p = dbsp.Pipeline(c, storage=d); _ = p.push("x", pa.table({"a": [1]})); _ = p.step()
    >>> p.close()
    >>> info = inspect_storage(d)
    >>> info["workers"], info["shards"], info["checkpoint_step"], info["output_steps"]
    (1, 256, 1, [0, 1])
    >>> info["divided_steps"], info["consumers"], info["metrics"]["steps"], sum(info["state_bytes"]["0"].values()) > 0
    ([0, 0], {}, 1, True)
    """
    root = os.fspath(path)
    return _inspect(root, read_meta(root), check_files)


def _inspect(root: str, meta: dict, check_files: bool = True) -> dict:
    layout, last = read_layout(root)
    counts = [len(layout.shard_map.shards_of(w)) for w in range(layout.workers)]
    info: dict[str, Any] = {"path": root, "executor": meta.get("executor"), "format": meta.get("format"),
                            "workers": layout.workers,
                            "shards": layout.shards, "layout_epoch": layout.epoch, "shards_per_worker": counts,
                            "last_rescale": last, "rescale_in_progress": read_rescale(root) is not None,
                            "fingerprint": meta["fingerprint"][:16], "inputs": meta["inputs"],
                            "outputs": meta["outputs"], "versions": [], "db_pages": 0, "in_use": [],
                            "program_change": {k: v for k, v in meta["change"].items() if k != "nodes"}
                            if meta.get("change") else None}
    files = survey(root, state_groups(root, meta), layout.workers)  # the databases LAYOUT names (statefiles inv. 1)
    info["state_missing"] = [os.path.relpath(p, root) for p in files.missing]
    info["state_unnamed"] = [os.path.relpath(p, root) for p in files.unnamed]
    paths = [p for p in files.named if p not in files.missing]  # a database LAYOUT does not name is never read
    info["checkpoint_version"] = info["checkpoint_step"] = None
    try:
        for p in paths:
            with Database(p, readonly=True) as db:
                vs = db.versions()
                info["versions"].append([vs.start, vs.stop - 1])
                info["db_pages"] += db.stats()["pages"]
        if paths and not files.missing:  # with one missing, no checkpoint can be opened
            lo, hi = max(v[0] for v in info["versions"]), min(v[1] for v in info["versions"])
            info["checkpoint_version"] = hi if lo <= hi else None
            if lo <= hi:
                with Database(paths[0], readonly=True) as db, db.read(hi) as h:
                    info["checkpoint_step"] = h.get_step()
        info["state_bytes"] = _state_bytes(paths, layout)
        info["batch_files"] = _batch_files(root, paths, info["checkpoint_version"], check_files)
    except InUseError:  # a pipeline runs: its databases are being written
        info["in_use"].append(STATE_DIR)
        info["versions"], info["checkpoint_version"], info["checkpoint_step"] = [], None, None
        info["state_bytes"] = {}
        info["batch_files"] = None
    dpath = os.path.join(root, DRIVER_DB)
    if os.path.exists(dpath):
        try:
            with Database(dpath, readonly=True) as db:
                with db.read(db.versions().stop - 1) as h:
                    info["driver_step"] = h.get_step()
                    if not paths and not files.missing:
                        info["checkpoint_step"] = info["driver_step"]
        except InUseError:
            info["in_use"].append(DRIVER_DB)
    with StepLog(os.path.join(root, INPUT_DIR), readonly=True) as log:  # never cuts a torn tail
        info["input_steps"] = [log.first_step, log.last_step]
        info["input_records"] = len(log)
        info["input_segments"] = log.segments
        divisions = [r.step for r in log.iter_from(0) if r.handle == DIVISION_HANDLE]
    info["divided_steps"] = [divisions[0], divisions[-1]] if divisions else None
    odir = os.path.join(root, OUTPUT_DIR)
    out = OutputLog(odir, {n: pa.schema([]) for n in meta["outputs"]}, readonly=True)
    info["output_steps"] = [out.first, out.last]
    try:
        info["output_by_reference"] = out.steps_by_reference()  # outputlog.py invariant 7
    finally:
        out.close()
    info["output_segments"] = len([n for n in os.listdir(odir) if n.endswith(".seg")])
    sizes = {}
    for part in (INPUT_DIR, OUTPUT_DIR, STATE_DIR):
        p = os.path.join(root, part)
        sizes[part] = tree_bytes(p)
    info["bytes"] = sizes
    info["consumers"] = ConsumerRegistry(root).list()
    info["metrics"] = read_record(os.path.join(root, METRICS_FILE), METRICS_MAGIC)
    return info


def _state_bytes(paths: list[str], layout: Any) -> dict[str, dict[int, int]]:
    """Bytes of stored operator state (keys and values of the newest version) per worker and shard (a range value,
    several shards' rows of one block, snapshot.py invariant 11, shared among its shards by their rows)."""
    out: dict[str, dict[int, int]] = {}
    for p in paths:
        worker = worker_of_db(p)
        shards = out.setdefault(worker, {})
        with Database(p, readonly=True) as db, db.read(db.versions().stop - 1) as h:
            for table in h.tables():
                if isinstance(table, str) and is_state_table(table):
                    for k, v in h.scan(table):
                        s = int.from_bytes(k[:SHARD_PREFIX_BYTES], "big")
                        if v[:4] != BATCH_RANGE_MAGIC:
                            shards[s] = shards.get(s, 0) + len(k) + len(v)
                            continue
                        width, runs = width_runs_head(v, f"{p} {table}")
                        rows = np.asarray(runs, dtype=np.int64).reshape(width, -1).sum(axis=1)
                        share = (len(k) + len(v)) * rows // max(1, int(rows.sum()))
                        for i in np.flatnonzero(rows).tolist():
                            shards[s + i] = shards.get(s + i, 0) + int(share[i])
    return out


def _batch_files(root: str, paths: list[str], version: int | None, check: bool) -> dict | None:
    """The batch files the checkpoint (``version`` of every state database) names, each with its size, the state
    tables naming it and, with ``check``, the result of checking every byte of it (dbsp_core.storage.batchrefs)."""
    from dbsp_core.progress import progress
    from dbsp_core.storage.batchrefs import check_batch_files, referenced_files

    if version is None:
        return None
    named: dict[str, dict[str, int]] = {}
    for p in paths:
        with Database(p, readonly=True) as db:
            for name, per in referenced_files(db, version).items():
                named.setdefault(name, {}).update(per)
    with progress("checking batch files", total=len(named)):
        return check_batch_files(root, named, check)
