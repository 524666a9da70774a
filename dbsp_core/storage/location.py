"""Where files live: a local path, a URI that ``pyarrow.fs`` understands (``s3://``, ``gs://``, ``hdfs://``,
``file://``) or a path inside a ``pyarrow.fs.FileSystem`` object, resolved once into a :class:`Location`.

Rules (enforced here):
  1. A plain path (no ``scheme://``) is local and keeps the behaviour of a local directory (``os`` calls, fsync,
     atomic rename). A URI goes through ``pyarrow.fs.FileSystem.from_uri``; a FileSystem object (for fsspec
     stores, ``PyFileSystem(FSSpecHandler(...))``) comes with the path inside it. A ``LocalFileSystem`` object or a
     ``file://`` URI is local too.
  2. Credentials come from the environment, the usual way for each store (``AWS_ACCESS_KEY_ID`` ...), or from
     the URI. They never appear in what this module shows: :attr:`Location.shown` drops the user info and masks
     every query parameter whose name speaks of a key, secret, token, password, credential or signature, and
     :attr:`Location.name` (what goes into producer ids and consumer names, which are stored) carries the scheme,
     bucket and path only.
  3. Object stores have no directories and no atomic rename: writers that need "the whole file or nothing"
     write each object with one PUT (:meth:`Location.write_bytes`: S3 and GCS make an object visible whole or not
     at all), never by renaming.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["Location", "resolve", "mask_uri"]

_SECRET = re.compile(r"key|secret|token|password|passwd|credential|signature|sig$", re.I)


def mask_uri(uri: str) -> str:
    """``uri`` without the secrets it may carry (rule 2): user info dropped, secret query values as ``***``."""
    try:
        u = urllib.parse.urlsplit(uri)
    except ValueError:
        return "<a URI that does not parse>"
    netloc = u.netloc.rsplit("@", 1)[-1]
    query = urllib.parse.parse_qsl(u.query, keep_blank_values=True)
    shown = "&".join(f"{k}={'***' if _SECRET.search(k) else v}" for k, v in query)
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, shown, ""))


@dataclass(frozen=True)
class Location:
    """A directory (or a file) on a file system. ``path`` is what ``fs`` calls it; ``local`` says it is on this
    machine's file system, where ``path`` is an absolute OS path."""

    fs: pafs.FileSystem
    path: str
    local: bool
    shown: str  # for messages and logs: no secrets (rule 2)
    name: str  # stable and secret-free: what ids that are stored may contain (rule 2)

    def join(self, *parts: str) -> "Location":
        sep = os.sep if self.local else "/"
        path = sep.join([self.path.rstrip(sep)] + [p.strip(sep) for p in parts])
        shown = self.shown if not parts else _append(self.shown, "/".join(parts), self.local)
        name = self.name if not parts else _append(self.name, "/".join(parts), self.local)
        return Location(self.fs, path, self.local, shown, name)

    def relative(self, path: str) -> str:
        """``path`` (as ``fs`` names it, inside this location) relative to it, with ``/`` separators."""
        base = self.path.rstrip("/" if not self.local else os.sep)
        rel = path[len(base):].lstrip("/" if not self.local else os.sep)
        return rel.replace(os.sep, "/") if self.local else rel

    def info(self, path: str | None = None) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path if path is None else path)

    def files(self, recursive: bool) -> list[pafs.FileInfo]:
        """The files under this directory (none if it does not exist); with ``recursive`` the subdirectories' too."""
        sel = pafs.FileSelector(self.path, allow_not_found=True, recursive=recursive)
        return [i for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File]

    def open_input(self, path: str | None = None) -> Any:
        """A random-access file (what ``pq.ParquetFile`` reads); the caller closes it."""
        return self.fs.open_input_file(self.path if path is None else path)

    def write_bytes(self, data: bytes, path: str | None = None) -> None:
        """Writes one object whole (rule 3). Local writers use the storage layer's atomic replace instead."""
        with self.fs.open_output_stream(self.path if path is None else path) as f:
            f.write(data)

    def makedirs(self) -> None:
        self.fs.create_dir(self.path, recursive=True)


def _append(base: str, tail: str, local: bool) -> str:
    if local:
        return os.path.join(base, tail)
    u = urllib.parse.urlsplit(base)
    if u.scheme:
        return urllib.parse.urlunsplit((u.scheme, u.netloc, u.path.rstrip("/") + "/" + tail, u.query, ""))
    return base.rstrip("/") + "/" + tail


def resolve(where: str | os.PathLike | pafs.FileSystem, filesystem: pafs.FileSystem | None = None,
            what: str = "location") -> Location:
    """The :class:`Location` of ``where``: a local path, a URI, or (with ``filesystem``) a path inside a
    ``pyarrow.fs.FileSystem`` (rule 1). ``what`` names the argument in errors."""
    if isinstance(where, pafs.FileSystem):
        raise TypeError(f"{what}: give the path, and the FileSystem object as filesystem=")
    if not isinstance(where, (str, os.PathLike)):
        raise TypeError(f"{what}: a path, a URI or (with filesystem=) a path in it, not {type(where).__name__}")
    where = os.fspath(where)
    if not where:
        raise ValueError(f"{what}: an empty path")
    if filesystem is not None:
        if not isinstance(filesystem, pafs.FileSystem):
            raise TypeError(f"{what}: filesystem= is a pyarrow.fs.FileSystem, not {type(filesystem).__name__}")
        if isinstance(filesystem, pafs.LocalFileSystem):
            return _local(where)
        path = where.rstrip("/") or "/"
        name = f"{filesystem.type_name}://{path.lstrip('/')}"
        return Location(filesystem, path, False, name, name)
    if "://" not in where:
        return _local(where)
    shown = mask_uri(where)
    try:
        fs, path = pafs.FileSystem.from_uri(where)
    except (pa.ArrowException, OSError, ValueError) as e:
        msg = str(e).replace(where, shown)
        raise ValueError(f"{what}: cannot open {shown}: {msg}") from None
    if isinstance(fs, pafs.LocalFileSystem):
        return _local(path)
    u = urllib.parse.urlsplit(where)
    name = urllib.parse.urlunsplit((u.scheme, u.netloc.rsplit("@", 1)[-1], u.path.rstrip("/"), "", ""))
    return Location(fs, path.rstrip("/"), False, shown, name)


def _local(path: str) -> Location:
    real = os.path.realpath(path)
    return Location(pafs.LocalFileSystem(), os.path.abspath(path), True, path, real)

