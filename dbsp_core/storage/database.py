"""The two-version per-worker ``Database`` over the C page store, and the shard-grouped key helpers.

``Database`` keeps at most two versions, the committed one and the one being written: ``versions()`` is a range of length 1 or 2,
``open(v)`` writes version ``v + 1`` (a copy of ``v``) and discards every other version, ``commit()`` makes
``v`` and ``v + 1`` openable, and a crash at any point leaves ``v``, or ``v`` and ``v + 1``, never a mix.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Iterator, Optional, Union

from dbsp_core import _storage
from dbsp_core.envvars import settings

__all__ = ["Database", "DatabaseHandle", "Journal", "SHARD_PREFIX_BYTES", "shard_key", "shard_of_key", "journal_under",
           "end_journals", "journal_of"]

BytesLike = Union[bytes, bytearray, memoryview]
Name = Union[str, bytes]

SHARD_PREFIX_BYTES = 4
"""Sharded keys start with the shard number as 4 big-endian bytes, so a shard is one contiguous key range."""


def _name(x: Name) -> bytes:
    if isinstance(x, str):
        return x.encode("utf-8")
    return _bytes(x, "table name")


def _bytes(x: BytesLike, what: str) -> bytes:
    """``x`` as bytes; TypeError unless it is bytes-like (``bytes(5)`` would be five zero bytes, not a key)."""
    if not isinstance(x, (bytes, bytearray, memoryview)):
        raise TypeError(f"database {what} must be bytes, bytearray or memoryview, got {type(x).__name__} {x!r:.40}")
    return bytes(x)


def shard_key(shard: int, key: BytesLike) -> bytes:
    """The key ``key`` grouped under ``shard``: 4 big-endian shard bytes, then ``key``.

    Examples
    --------
    >>> shard_key(3, b"k")
    b'\\x00\\x00\\x00\\x03k'
    """
    if not 0 <= shard < 2**32:
        raise ValueError(f"shard {shard} is outside 0..2**32-1")
    return shard.to_bytes(SHARD_PREFIX_BYTES, "big") + bytes(key)


def shard_of_key(key: bytes) -> int:
    """The shard number of a key built by :func:`shard_key`."""
    if len(key) < SHARD_PREFIX_BYTES:
        raise ValueError(f"key {key!r} is shorter than the {SHARD_PREFIX_BYTES}-byte shard prefix")
    return int.from_bytes(key[:SHARD_PREFIX_BYTES], "big")


def _prefix_end(prefix: bytes) -> Optional[bytes]:
    """The smallest key greater than every key starting with prefix (None if there is none)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return None
    p[-1] += 1
    return bytes(p)


def default_cache_pages() -> int:
    """Clean 4 KiB pages a Database caches unless told: ``DBSP_PAGE_CACHE_MB`` MiB (a whole number >= 1, read
    when dbsp_core is imported: dbsp_core/envvars.py), else 32 MiB. (Up to 2026-11-27 the default was 256, which a
    pipeline's databases, one per worker and the driver's, each filled with the pages of their checkpoints, seldom
    read again: 0.5 GiB of a W=2 pipeline's 1.7 GiB resident memory after ten checkpoints of 15M rows of state.)

    >>> default_cache_pages() == settings().page_cache_mb * 256
    True
    """
    return settings().page_cache_mb * 256


_REC = struct.Struct("<BH")  # op, table length
_KEY = struct.Struct("<H")
_VAL = struct.Struct("<Q")
JOURNAL_PUT, JOURNAL_DELETE, JOURNAL_STEP = 1, 0, 2


class Journal:
    """The changes committed to one database file since they were last taken (:meth:`take`): every put (table,
    key, value), delete (table, key) and step of a committed handle, in order, appended to a local file as they are
    written (an aborted handle's records are cut off again), so an object store's checkpoint uploads what changed
    and not the page file (dbsp_core.storage.remote invariant 4). Records are ``op (u8) | table length (u16 LE) |
    table | key length (u16 LE) | key | value length (u64 LE) | value`` (a delete has no value; a step record's
    table and key are empty and its value is the step as 8 bytes LE), the ``DRDL`` body of formats.py.

    ``start`` is the version the records apply to (the file's newest version when journaling began, 0 for a
    file it created); ``version`` the newest version committed since. ``valid`` turns False when a handle opens
    another version than the newest committed one (a version is discarded): the records no longer lead from
    ``start`` to the file's content, and the next checkpoint uploads the page file instead."""

    def __init__(self, directory: str, name: str, start: int, fresh: bool) -> None:
        self.path = os.path.join(directory, name)
        self.start = self.version = start
        self.valid = True
        self.fresh = fresh  # the file was created empty at ``start`` under the journal: the records are all of it
        self._lock = threading.Lock()
        self._f = open(self.path, "wb")
        self._committed = 0
        self._seq = 0

    def opened(self, version: int) -> None:
        if version != self.version:
            self.valid = False

    def record(self, op: int, table: bytes, key: bytes, value: BytesLike | None = None) -> None:
        with self._lock:
            f = self._f
            f.write(_REC.pack(op, len(table)) + table + _KEY.pack(len(key)) + key)
            if value is not None:
                f.write(_VAL.pack(len(value)))
                f.write(value)

    def committed(self, version: int) -> None:
        with self._lock:
            self._f.flush()
            self._committed = self._f.tell()
            self.version = version

    def aborted(self) -> None:
        with self._lock:
            self._f.flush()
            self._f.seek(self._committed)
            self._f.truncate()

    def pending_bytes(self) -> int:
        """Bytes of committed records not yet taken."""
        return self._committed

    def take(self) -> tuple[str, int, int, bool, bool]:
        """Seal the committed records into a file of their own: returns its path (the caller owns it), the version
        they start at, the version they lead to, whether they are valid and whether they start from a new, empty
        file (``fresh``); journaling goes on from there."""
        with self._lock:
            self._f.flush()
            tail = b""
            end = self._f.seek(0, os.SEEK_END)
            if end > self._committed:  # a handle is writing: its records stay in the journal
                self._f.seek(self._committed)
                tail = self._f.read()
            self._f.truncate(self._committed)
            self._f.close()
            self._seq += 1
            sealed = f"{self.path}.{self._seq}"
            os.replace(self.path, sealed)
            self._f = open(self.path, "w+b")
            self._f.write(tail)
            out = (sealed, self.start, self.version, self.valid, self.fresh)
            self.start, self._committed, self.valid, self.fresh = self.version, 0, True, False
            return out

    def restart(self, version: int) -> None:
        """Forget the records: the caller uploaded the page file at ``version`` instead."""
        with self._lock:
            self._f.seek(self._committed)
            tail = self._f.read()
            self._f.seek(0)
            self._f.truncate()
            self._f.write(tail)
            self.start = self.version = version
            self._committed, self.valid, self.fresh = 0, True, False

    def close(self) -> None:
        with self._lock:
            self._f.close()


_journal_lock = threading.Lock()
_journal_roots: dict[str, str] = {}  # a directory whose databases are journaled -> where the journals go
_journals: dict[str, Journal] = {}  # database path -> its journal


def journal_under(root: str, directory: str) -> None:
    """Journal (:class:`Journal`) every database opened for writing under ``root`` from now on, into files in
    ``directory``, until :func:`end_journals`."""
    os.makedirs(directory, exist_ok=True)
    with _journal_lock:
        _journal_roots[os.path.abspath(root)] = directory


def end_journals(root: str) -> None:
    """Stop journaling the databases under ``root`` and close their journals."""
    root = os.path.abspath(root)
    with _journal_lock:
        _journal_roots.pop(root, None)
        for p in [p for p in _journals if p.startswith(root + os.sep)]:
            _journals.pop(p).close()


def journal_of(path: str) -> Journal | None:
    """The journal of the database at ``path``, if it is journaled."""
    with _journal_lock:
        return _journals.get(os.path.abspath(path))


def _journal_for(path: str, version: int, fresh: bool) -> Journal | None:
    path = os.path.abspath(path)
    with _journal_lock:
        j = _journals.get(path)
        if j is not None and not fresh:
            return j
        for root, directory in _journal_roots.items():
            if path.startswith(root + os.sep):
                if j is not None:  # the file was deleted and made again: a new history
                    j.close()
                name = os.path.relpath(path, root).replace(os.sep, "%")
                j = _journals[path] = Journal(directory, name, version, fresh)
                return j
    return None


class Database:
    """A per-worker key-value database that keeps one or two committed versions.

    Parameters
    ----------
    path
        The page file; created (at version 0, empty) if missing. Its directory must exist.
    cache_pages
        How many clean 4 KiB pages to keep cached in memory (None: ``DBSP_PAGE_CACHE_MB`` MiB, default 32; a
        committed page stays cached as a clean copy, so a pipeline's databases, one per worker and the driver's,
        each hold up to this much after their checkpoints).
    vfs
        ``"posix"`` (default) or ``"fault"`` (the fault-injecting layer driven by :class:`FaultInjector`).
    readonly
        Open an existing file for reading only (:meth:`read`, :meth:`versions`, :meth:`stats`, :meth:`check`):
        nothing is created or written, and :meth:`open` raises StorageError.

    One open Database writes a file at a time: opening takes an OS lock on it (exclusive; shared for
    ``readonly``) and raises InUseError while another open Database (in this process or another) holds a
    conflicting one (csrc/pagestore.c invariant 7), instead of letting two writers lose each other's commits.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with Database(os.path.join(d, "db")) as db:
    ...     print(db.versions())
    ...     with db.open(0) as h:
    ...         h.put("t", b"k", b"v")
    ...         h.set_step(5)
    ...         h.commit()
    ...     print(db.versions())
    ...     with db.open(1) as h:
    ...         print(h.get("t", b"k"), h.get_step())
    range(0, 1)
    range(0, 2)
    b'v' 5
    """

    def __init__(self, path: Union[str, os.PathLike], *, cache_pages: Optional[int] = None, vfs: str = "posix",
                 readonly: bool = False, _create_version: Optional[int] = None) -> None:
        if cache_pages is None:
            cache_pages = default_cache_pages()
        elif not isinstance(cache_pages, int) or isinstance(cache_pages, bool) or cache_pages < 1:
            raise ValueError(f"Database: cache_pages must be an int >= 1, got {cache_pages!r}")
        self.path = os.fspath(path)
        self.vfs = vfs
        self.readonly = readonly
        if readonly and not os.path.exists(self.path):
            raise FileNotFoundError(f"database {self.path}: no such file (a read-only open creates nothing)")
        journaled = not readonly and bool(_journal_roots)  # only an object store's cache is journaled
        fresh = journaled and not os.path.exists(self.path)
        self._ps = _storage.PageStore(self.path, vfs, cache_pages, _create_version, readonly)
        self._journal = _journal_for(self.path, self.versions().stop - 1, fresh) if journaled else None

    @classmethod
    def create(cls, path: Union[str, os.PathLike], version: int, *, cache_pages: Optional[int] = None,
               vfs: str = "posix") -> "Database":
        """A new, empty database whose only version is ``version`` (step 0); StorageError if ``path`` exists.

        A database that joins others at version ``v`` (the state of a worker added by a rescale) starts at
        ``v``, so the coordinator's "newest version every database holds" rule covers it from the start.

        >>> import tempfile, os
        >>> with Database.create(os.path.join(tempfile.mkdtemp(), "db"), 7) as db:
        ...     print(db.versions())
        range(7, 8)
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"Database.create: version must be a non-negative int, got {version!r}")
        return cls(path, cache_pages=cache_pages, vfs=vfs, _create_version=version)

    def versions(self) -> range:
        """The versions that :meth:`open` accepts: a range of length 1 or 2."""
        first, count = self._ps.versions()
        return range(first, first + count)

    def open(self, version: int) -> "DatabaseHandle":
        """Starts writing version ``version + 1`` as a copy of ``version`` and discards every other version.

        Raises
        ------
        KeyError
            If ``version`` is not in :meth:`versions`.
        """
        try:
            txn = self._ps.begin(version)
        except _storage.NotFound as e:
            raise KeyError(f"{self.path}: version {version} is not openable; versions() is {self.versions()}") from e
        if self._journal is not None:
            self._journal.opened(version)
        return DatabaseHandle(self, txn, version, journal=self._journal)

    def read(self, version: int) -> "DatabaseHandle":
        """A read-only handle on ``version`` as it is: unlike :meth:`open` it discards no version, and ``put``,
        ``delete``, ``set_step`` and ``commit`` raise StorageError. Close it (or leave its ``with`` block) before
        opening another handle.

        >>> import tempfile, os
        >>> db = Database(os.path.join(tempfile.mkdtemp(), "db"))
        >>> with db.open(0) as h:
        ...     h.put("t", b"k", b"v"); h.commit()
        >>> with db.read(0) as r:
        ...     print(r.get("t", b"k"), r.readonly)
        None True
        >>> with db.read(1) as r:
        ...     print(r.get("t", b"k"), r.version)
        b'v' 1
        >>> db.versions()
        range(0, 2)

        Raises
        ------
        KeyError
            If ``version`` is not in :meth:`versions`.
        """
        try:
            txn = self._ps.begin(version, True)
        except _storage.NotFound as e:
            raise KeyError(f"{self.path}: version {version} is not readable; versions() is {self.versions()}") from e
        return DatabaseHandle(self, txn, version, readonly=True)

    def check(self, version: Optional[int] = None) -> None:
        """Verifies every openable version, or only ``version`` (checksums of every page it reaches, tree order,
        free-page accounting); raises CorruptionError, and KeyError if ``version`` is not openable. Reads only:
        unlike :meth:`open` it discards no version, so a caller can tell whether the other one is intact."""
        if version is None:
            self._ps.check()
            return
        try:
            self._ps.check_version(version)
        except _storage.NotFound as e:
            raise KeyError(f"{self.path}: version {version} is not openable; versions() is {self.versions()}") from e

    def stats(self) -> dict:
        """Page count and free-page count of the newest version, pages written by the last commit (big values included,
        which an open transaction writes as they are put), and the pages the page cache holds now: all of them, and
        the dirty ones (written by the open transaction, held until its commit)."""
        pages, free, last, cached, dirty = self._ps.stats()
        return {"pages": pages, "free_pages": free, "last_commit_pages": last, "cached_pages": cached,
                "dirty_pages": dirty}

    def close(self) -> None:
        """Closes the file; an open handle is closed without commit (its base version is kept)."""
        self._ps.close()

    @property
    def closed(self) -> bool:
        return self._ps.closed

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Database({self.path!r})" if self.closed else f"Database({self.path!r}, versions={self.versions()})"


class DatabaseHandle:
    """Reads and writes version ``base_version + 1`` of a :class:`Database`; see :meth:`Database.open`.

    Leaving a ``with`` block without :meth:`commit` closes the handle and keeps ``base_version``.
    Table names are ``str`` or ``bytes`` (1..255 bytes); keys are at most 1024 bytes; values any size.
    A handle belongs to one thread at a time (calls release the GIL; a concurrent call raises StorageError).
    One open Database writes a page file at a time (an OS lock; see :class:`Database`).
    """

    def __init__(self, db: Database, txn: "_storage.Txn", base_version: int, readonly: bool = False,
                 journal: Journal | None = None) -> None:
        self._db = db
        self._txn = txn
        self.base_version = base_version
        self.readonly = readonly
        self._journal = journal

    @property
    def version(self) -> int:
        """The version being written (``base_version + 1``), or the version read by a :meth:`Database.read` handle."""
        return self.base_version if self.readonly else self.base_version + 1

    @property
    def closed(self) -> bool:
        return self._txn.closed

    def get(self, table: Name, key: BytesLike) -> Optional[bytes]:
        """The value of ``key`` in ``table``, or None if either is absent."""
        return self._txn.get(_name(table), _bytes(key, "key"))

    def put(self, table: Name, key: BytesLike, value: BytesLike) -> None:
        """Sets ``key`` to ``value`` in ``table`` (created if missing)."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"database value must be bytes, bytearray or memoryview, got {type(value).__name__}")
        t, k = _name(table), _bytes(key, "key")
        self._txn.put(t, k, value)
        if self._journal is not None:
            self._journal.record(JOURNAL_PUT, t, k, value)

    def delete(self, table: Name, key: BytesLike) -> bool:
        """Removes ``key``; returns whether it was present."""
        t, k = _name(table), _bytes(key, "key")
        found = self._txn.delete(t, k)
        if found and self._journal is not None:
            self._journal.record(JOURNAL_DELETE, t, k)
        return found

    def scan(self, table: Name, start: Optional[BytesLike] = None, end: Optional[BytesLike] = None, *,
             prefix: Optional[BytesLike] = None) -> Iterator[tuple[bytes, bytes]]:
        """Yields ``(key, value)`` in key order for keys in ``[start, end)`` or starting with ``prefix``.

        Modifying the handle while iterating raises StorageError.
        """
        if prefix is not None:
            if start is not None or end is not None:
                raise ValueError("scan: give either prefix or start/end, not both")
            start, end = _bytes(prefix, "prefix"), _prefix_end(_bytes(prefix, "prefix"))
        cur = self._txn.cursor(_name(table), None if start is None else _bytes(start, "scan start"),
                               None if end is None else _bytes(end, "scan end"))
        while True:
            entries = cur.next_batch()  # the next few (key, value) pairs the C cursor read
            if not entries:
                return
            yield from entries

    def tables(self) -> list[str]:
        """Names of the tables of this version (decoded as UTF-8 where possible)."""
        cur = self._txn.cursor(None)
        names = []
        while True:
            entries = cur.next_batch()
            if not entries:
                break
            for k, _ in entries:
                try:
                    names.append(k.decode("utf-8"))
                except UnicodeDecodeError:
                    names.append(k)
        return names

    def export_shard(self, shard: int, tables: Optional[list[Name]] = None) -> list[tuple[str, bytes, bytes]]:
        """Every ``(table, key, value)`` whose key starts with :func:`shard_key` ``(shard, b"")``.

        Examples
        --------
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> with Database(os.path.join(d, "a")) as a, Database(os.path.join(d, "b")) as b:
        ...     with a.open(0) as h:
        ...         h.put("t", shard_key(1, b"x"), b"1"); h.put("t", shard_key(2, b"y"), b"2")
        ...         rows = h.export_shard(1)
        ...     with b.open(0) as g:
        ...         n = g.import_shard(rows); print(n, list(g.scan("t")))
        1 [(b'\\x00\\x00\\x00\\x01x', b'1')]
        """
        prefix = shard_key(shard, b"")
        out = []
        for t in (self.tables() if tables is None else tables):
            out.extend((t, k, v) for k, v in self.scan(t, prefix=prefix))
        return out

    def import_shard(self, entries: list[tuple[Name, bytes, bytes]]) -> int:
        """Puts every ``(table, key, value)`` of an :meth:`export_shard` result; returns how many."""
        n = 0
        for t, k, v in entries:
            self.put(t, k, v)
            n += 1
        return n

    def delete_shard(self, shard: int) -> int:
        """Deletes every key of ``shard`` in every table (after it moved elsewhere); returns how many."""
        prefix = shard_key(shard, b"")
        n = 0
        for t in self.tables():
            for k in [k for k, _ in self.scan(t, prefix=prefix)]:
                n += self.delete(t, k)
        return n

    def get_step(self) -> int:
        """The step stored with this version (0 in a new database)."""
        return self._txn.get_step()

    def set_step(self, step: int) -> None:
        """Stores ``step`` with the version being written."""
        self._txn.set_step(step)
        if self._journal is not None:
            self._journal.record(JOURNAL_STEP, b"", b"", step.to_bytes(8, "little"))

    def commit(self) -> None:
        """Durably commits; afterwards ``versions() == range(base_version, base_version + 2)`` and the handle is closed.

        On an I/O error the Database must be closed and reopened; reopening shows a consistent state.
        """
        j = self._journal
        if j is None:
            self._txn.commit()
            return
        try:
            self._txn.commit()
        except BaseException:
            j.valid = False  # committed or not: the file tells, the journal cannot
            raise
        j.committed(self.version)

    def close(self) -> None:
        """Closes without commit: the database keeps ``base_version`` only."""
        if self._journal is not None and not self._txn.closed:
            self._journal.aborted()
        self._txn.abort()

    def __enter__(self) -> "DatabaseHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
