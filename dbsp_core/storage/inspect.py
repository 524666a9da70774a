"""Reading a storage directory without running its circuit: a summary for ``dbsp inspect`` and the output log for consumers in other processes."""

from __future__ import annotations

import glob
import os
from typing import Any

import pyarrow as pa

from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import lock_dir, read_layout, read_meta, read_rescale, unlock_dir
from dbsp_core.storage.formats import DIVISION_HANDLE, DRIVER_DB, INPUT_DIR, OUTPUT_DIR, STATE_DIR
from dbsp_core.storage.outputlog import OutputLog
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
    meta = read_meta(root, formats=(1, 2))  # the output log of the previous release's directories reads the same
    schemas = {n: pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(h))) for n, h in meta["output_schemas"].items()}
    return OutputLog(os.path.join(root, OUTPUT_DIR), {n: schemas[n] for n in meta["outputs"]}, readonly=True)


def inspect_storage(path: str | os.PathLike) -> dict:
    """A summary of a storage directory without recovering it: layout, checkpoints, logs and sizes.

    Reads the state databases (read-only handles) and the logs (read-only: a torn tail is left as it is) and never
    runs the circuit.

    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> d = tempfile.mkdtemp(); p = dbsp.Pipeline(c, storage=d); _ = p.push("x", pa.table({"a": [1]})); _ = p.step()
    >>> p.close()
    >>> info = inspect_storage(d)
    >>> info["workers"], info["shards"], info["checkpoint_step"], info["output_steps"]
    (1, 256, 1, [0, 1])
    >>> info["divided_steps"]
    [0, 0]
    """
    root = os.fspath(path)
    meta = read_meta(root)
    fd = lock_dir(root)
    try:
        return _inspect(root, meta)
    finally:
        unlock_dir(fd)


def _inspect(root: str, meta: dict) -> dict:
    layout, last = read_layout(root)
    counts = [len(layout.shard_map.shards_of(w)) for w in range(layout.workers)]
    info: dict[str, Any] = {"path": root, "executor": meta.get("executor"), "workers": layout.workers,
                            "shards": layout.shards, "layout_epoch": layout.epoch, "shards_per_worker": counts,
                            "last_rescale": last, "rescale_in_progress": read_rescale(root) is not None,
                            "fingerprint": meta["fingerprint"][:16], "inputs": meta["inputs"],
                            "outputs": meta["outputs"], "versions": [], "db_pages": 0}
    paths = sorted(glob.glob(os.path.join(root, STATE_DIR, "worker-*.db"))
                   + glob.glob(os.path.join(root, STATE_DIR, "stage-*", "worker-*.db")))
    for p in paths:
        with Database(p) as db:
            vs = db.versions()
            info["versions"].append([vs.start, vs.stop - 1])
            info["db_pages"] += db.stats()["pages"]
    if paths:
        lo, hi = max(v[0] for v in info["versions"]), min(v[1] for v in info["versions"])
        info["checkpoint_version"] = hi if lo <= hi else None
        info["checkpoint_step"] = None
        if lo <= hi:
            with Database(paths[0]) as db, db.read(hi) as h:
                info["checkpoint_step"] = h.get_step()
    else:
        info["checkpoint_version"] = None
        info["checkpoint_step"] = None
    dpath = os.path.join(root, DRIVER_DB)
    if os.path.exists(dpath):
        with Database(dpath) as db:
            with db.read(db.versions().stop - 1) as h:
                info["driver_step"] = h.get_step()
                if not paths:
                    info["checkpoint_step"] = info["driver_step"]
    with StepLog(os.path.join(root, INPUT_DIR), readonly=True) as log:  # never cuts a torn tail
        info["input_steps"] = [log.first_step, log.last_step]
        info["input_records"] = len(log)
        info["input_segments"] = log.segments
        divisions = [r.step for r in log.iter_from(0) if r.handle == DIVISION_HANDLE]
    info["divided_steps"] = [divisions[0], divisions[-1]] if divisions else None
    odir = os.path.join(root, OUTPUT_DIR)
    out = OutputLog(odir, {n: pa.schema([]) for n in meta["outputs"]}, readonly=True)
    info["output_steps"] = [out.first, out.last]
    out.close()
    info["output_segments"] = len([n for n in os.listdir(odir) if n.endswith(".seg")])
    sizes = {}
    for part in (INPUT_DIR, OUTPUT_DIR, STATE_DIR):
        p = os.path.join(root, part)
        sizes[part] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
    info["bytes"] = sizes
    return info

