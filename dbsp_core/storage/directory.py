"""The storage directory as a whole: its lock, and the small framed records at its root (META, LAYOUT, RESCALE, the staged executor's JOB) written atomically through the VFS.

Invariants (enforced here):
  1. A record file holds one framed record (dbsp_core.codec: magic, format version, CRC-32) and is replaced
     atomically (dbsp_core._storage.file_replace: temporary file, fsync, rename, fsync of the directory), so a
     reader finds the old record or the new one, never a mix; a torn or damaged record raises CorruptionError
     naming the file.
  2. One process owns a directory at a time: :func:`lock_dir` takes an exclusive ``flock`` on ``LOCK`` and a
     second opener (in this process or another) gets InUseError instead of sharing the files.
  3. META is written when the directory is created, and names the directory format; a directory of
     another format is refused with FormatVersionError before anything else is read. It is rewritten only to
     record a program change (keeping its format) and once to raise format 2 or 3 to 4 (``RANGE_FORMAT``,
     :func:`raise_to_ranges`) before the first range value can be written; format 4 is never lowered.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from dbsp_core import _storage
from dbsp_core.codec import decode_json, encode_json
from dbsp_core.errors import CorruptionError, FormatVersionError, InUseError
from dbsp_core.layout import Layout
from dbsp_core.storage.formats import (DIRECTORY_FORMAT, DIRECTORY_FORMATS, LAYOUT_FILE, LAYOUT_MAGIC, LOCK_FILE,
                                       META_FILE, META_MAGIC, PRUNED_FORMAT, RANGE_FORMAT, RESCALE_FILE,
                                       RESCALE_MAGIC)

__all__ = ["lock_dir", "unlock_dir", "read_record", "write_record", "remove_record", "read_meta", "write_meta",
           "raise_to_ranges",
           "read_layout", "write_layout", "read_rescale", "write_rescale", "remove_rescale", "fsync_dir",
           "tree_bytes"]


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a created, renamed or removed file's name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (a file: its size; missing: 0), counted while other threads of the
    pipeline may write, rename and delete files there (a background checkpoint's log truncation, a staged job's
    ``JOB.tmp`` renamed into place): a file gone between the listing and its ``stat`` counts 0, not an error."""
    def size(p: str) -> int:
        try:
            return os.path.getsize(p)
        except FileNotFoundError:
            return 0
    if os.path.isfile(path):
        return size(path)
    return sum(size(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def lock_dir(root: str) -> int:
    """An exclusive lock on ``root/LOCK`` held while a pipeline uses the directory (invariant 2)."""
    fd = os.open(os.path.join(root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InUseError(f"{root} is in use by another pipeline (LOCK is held): close it (or let its process "
                         "end) first; `dbsp inspect` reads a directory in use") from None
    return fd


def unlock_dir(fd: int) -> None:
    os.close(fd)  # releases the lock


def read_record(path: str, magic: bytes, vfs: str = "posix") -> Any | None:
    """The JSON object of the record file ``path``, or None if there is none (invariant 1).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "REC")
    >>> read_record(path, b"TEST") is None
    True
    >>> write_record(path, b"TEST", {"a": 1}); read_record(path, b"TEST")
    {'a': 1}
    >>> remove_record(path); os.path.exists(path)
    False
    """
    blob = _storage.file_read(path, vfs)
    if blob is None:
        return None
    return decode_json(magic, blob, path)


def write_record(path: str, magic: bytes, obj: Any, vfs: str = "posix") -> None:
    """Replace the record file ``path`` atomically and durably (invariant 1)."""
    _storage.file_replace(path, encode_json(magic, obj), vfs)


def remove_record(path: str, vfs: str = "posix") -> None:
    """Remove the record file ``path`` durably (a missing file is fine)."""
    _storage.file_remove(path, vfs)


def read_meta(root: str, formats: tuple[int, ...] = DIRECTORY_FORMATS) -> dict:
    """The META record of a storage directory; FileNotFoundError if there is none, FormatVersionError if it is
    of a directory format not in ``formats``, CorruptionError if it is damaged (invariant 3)."""
    path = os.path.join(root, META_FILE)
    meta = read_record(path, META_MAGIC)
    if meta is None:
        raise FileNotFoundError(path)
    fmt = meta.get("format")
    if fmt not in formats:
        hint = " (dbsp-core 0.1.0; Pipeline.open upgrades it)" if fmt == 1 else ""
        raise FormatVersionError(f"{root}: storage directory format {fmt!r}{hint}; this reader takes formats "
                                 f"{list(formats)}")
    return meta


def write_meta(root: str, meta: dict, vfs: str = "posix", ranges: bool = False) -> None:
    """Write META: format RANGE_FORMAT when the state may hold range values (``ranges``, or ``meta`` read from a
    directory of that format: it is never lowered, invariant 3), so a reader of formats 2 and 3 alone refuses it;
    else PRUNED_FORMAT when the directory's state keeps fewer columns (``stored_columns``), so a reader of
    DIRECTORY_FORMAT alone refuses it (storage/formats.py), else DIRECTORY_FORMAT."""
    if ranges or meta.get("format") == RANGE_FORMAT:
        fmt = RANGE_FORMAT
    else:
        fmt = PRUNED_FORMAT if meta.get("stored_columns") else DIRECTORY_FORMAT
    write_record(os.path.join(root, META_FILE), META_MAGIC, dict(meta, format=fmt), vfs)


def raise_to_ranges(root: str, meta: dict, vfs: str = "posix") -> dict:
    """``meta`` (read from ``root``) at RANGE_FORMAT: META rewritten (atomically, through ``vfs``) if it was of
    format 2 or 3, before anything that may write a range value runs (invariant 3)."""
    if meta.get("format") == RANGE_FORMAT:
        return meta
    write_meta(root, meta, vfs, ranges=True)
    return dict(meta, format=RANGE_FORMAT)


def read_layout(root: str, vfs: str = "posix") -> tuple[Layout, dict | None]:
    """The layout in force and the report of the last layout change (None if there was none)."""
    path = os.path.join(root, LAYOUT_FILE)
    rec = read_record(path, LAYOUT_MAGIC, vfs)
    if rec is None:
        raise CorruptionError(f"{path}: missing; the directory holds a pipeline (META) but no layout")
    try:
        return Layout.from_dict(rec["layout"], path), rec.get("last_rescale")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptionError(f"{path}: {e}") from None


def write_layout(root: str, layout: Layout, last_rescale: dict | None, vfs: str = "posix") -> None:
    write_record(os.path.join(root, LAYOUT_FILE), LAYOUT_MAGIC,
                 {"layout": layout.to_dict(), "last_rescale": last_rescale}, vfs)


def read_rescale(root: str, vfs: str = "posix") -> dict | None:
    """The record of a layout change in progress, or None."""
    return read_record(os.path.join(root, RESCALE_FILE), RESCALE_MAGIC, vfs)


def write_rescale(root: str, rec: dict, vfs: str = "posix") -> None:
    write_record(os.path.join(root, RESCALE_FILE), RESCALE_MAGIC, rec, vfs)


def remove_rescale(root: str, vfs: str = "posix") -> None:
    remove_record(os.path.join(root, RESCALE_FILE), vfs)
