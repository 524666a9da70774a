"""The batch files a storage directory's checkpoints name (snapshot.py invariant 8) and their checks, read without opening the pipeline: what ``dbsp inspect`` lists and ``dbsp repair`` decides from.

A checkpoint (a version of every state database) names a spilled batch by ``DRBF`` values in its trace tables (one per
shard: file name and row range) and keeps the file under ``<storage>/spill``. :func:`referenced_files` lists the
names a version holds per state table; :func:`check_batch_files` checks each named file whole (every checksum of
batch file invariant 4) and lists the files of the directory no checkpoint names (a crash's leftovers, which the
next open sweeps). Only reads.
"""

from __future__ import annotations

import os
from typing import Any

from dbsp_core.codec import decode_json
from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.storage.database import Database
from dbsp_core.storage.formats import BATCH_FILE_SUFFIX, BATCH_REF_MAGIC, SPILL_DIR, is_state_table

__all__ = ["referenced_files", "check_batch_files"]


def referenced_files(db: Database, version: int) -> dict[str, dict[str, int]]:
    """``{file name: {state table: rows named}}`` of the batch files version ``version`` of ``db`` names."""
    out: dict[str, dict[str, int]] = {}
    with db.read(version) as h:
        for table in h.tables():
            if not (isinstance(table, str) and is_state_table(table) and table.startswith("s")):
                continue
            for k, v in h.scan(table):
                if v[:4] != BATCH_REF_MAGIC:
                    continue
                d = decode_json(BATCH_REF_MAGIC, v, f"{table} key {k.hex()}")
                per = out.setdefault(os.path.basename(str(d["file"])), {})
                per[table] = per.get(table, 0) + int(d["hi"]) - int(d["lo"])
    return out


def _check(path: str) -> tuple[str, int | None]:
    """("ok", rows), ("missing", None) or ("damaged: <what>", None) for the batch file at ``path``."""
    from dbsp_core.trace.groupedfile import verify  # (format 1 or 2)

    if not os.path.exists(path):
        return "missing", None
    try:
        return "ok", verify(path)
    except FileNotFoundError:  # deleted since the check above (a merge of the live pipeline)
        return "missing", None
    except (CorruptionError, FormatVersionError, OSError, ValueError) as exc:
        return "damaged: " + str(exc).split("; run `dbsp repair")[0], None


def _size(path: str) -> int | None:
    """The bytes of ``path``, None if it is not there: a live pipeline's merges delete batch files while ``dbsp
    inspect`` lists them, so a file listed (or checked for) may be gone at its ``stat``."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def check_batch_files(root: str, named: dict[str, dict[str, int]], check: bool = True) -> dict[str, Any]:
    """The batch files of ``root``: every file ``named`` (:func:`referenced_files` of the checkpoint) with its
    bytes, the tables naming it and, with ``check``, the result of checking every byte ("ok", "missing",
    "damaged: ..."); and the files in the directory nothing names. Returns ``{"files": [...], "unnamed": [...],
    "bytes": total bytes of the named files, "bad": names of the named files not "ok"}``."""
    d = os.path.join(root, SPILL_DIR)
    present = sorted(n for n in os.listdir(d) if n.endswith(BATCH_FILE_SUFFIX)) if os.path.isdir(d) else []
    files, bad, total = [], [], 0
    for name in sorted(named):
        path = os.path.join(d, name)
        size = _size(path)
        status, rows = _check(path) if check else (("present" if size is not None else "missing"), None)
        if status not in ("ok", "present"):
            bad.append(name)
        total += size or 0
        files.append({"file": name, "bytes": size, "rows": rows, "tables": named[name], "check": status})
    unnamed = [{"file": n, "bytes": size} for n in present
               if n not in named and (size := _size(os.path.join(d, n))) is not None]
    return {"files": files, "unnamed": unnamed, "bytes": total, "bad": bad}
