"""Durable storage: the two-version per-worker ``Database`` and the write-ahead ``StepLog`` (C core in csrc/).

``Database`` keeps exactly the versions seed 000 allows: ``versions()`` is a range of length 1 or 2,
``open(v)`` writes version ``v + 1`` (a copy of ``v``) and discards every other version, ``commit()`` makes
``v`` and ``v + 1`` openable, and a crash at any point leaves ``v``, or ``v`` and ``v + 1``, never a mix.

``StepLog`` durably records input (step, input handle, producer id, sequence number, payload) before an
append returns; concurrent appenders share one fsync (group commit).

``FaultInjector`` controls the fault-injecting VFS that tests pass as ``vfs="fault"``.
"""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple, Optional, Union

from dbsp_core import _storage
from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError

__all__ = [
    "CorruptionError",
    "Database",
    "DatabaseHandle",
    "FaultInjector",
    "FormatVersionError",
    "LogRecord",
    "StepLog",
    "StorageError",
    "shard_key",
    "shard_of_key",
]

BytesLike = Union[bytes, bytearray, memoryview]
Name = Union[str, bytes]

SHARD_PREFIX_BYTES = 4
"""Sharded keys start with the shard number as 4 big-endian bytes, so a shard is one contiguous key range."""


def _name(x: Name) -> bytes:
    return x.encode("utf-8") if isinstance(x, str) else bytes(x)


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


class Database:
    """A per-worker key-value database that keeps one or two committed versions.

    Parameters
    ----------
    path
        The page file; created (at version 0, empty) if missing. Its directory must exist.
    cache_pages
        How many clean 4 KiB pages to keep cached in memory.
    vfs
        ``"posix"`` (default) or ``"fault"`` (the fault-injecting layer driven by :class:`FaultInjector`).

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

    def __init__(self, path: Union[str, os.PathLike], *, cache_pages: int = 65536, vfs: str = "posix") -> None:
        self.path = os.fspath(path)
        self._ps = _storage.PageStore(self.path, vfs, cache_pages)

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
        return DatabaseHandle(self, txn, version)

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

    def check(self) -> None:
        """Verifies every openable version (checksums, tree order, free-page accounting); raises CorruptionError."""
        self._ps.check()

    def stats(self) -> dict:
        """Page count and free-page count of the newest version, and pages written by the last commit."""
        pages, free, last = self._ps.stats()
        return {"pages": pages, "free_pages": free, "last_commit_pages": last}

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
    One process at a time may open a page file (there is no file lock).
    """

    def __init__(self, db: Database, txn: "_storage.Txn", base_version: int, readonly: bool = False) -> None:
        self._db = db
        self._txn = txn
        self.base_version = base_version
        self.readonly = readonly

    @property
    def version(self) -> int:
        """The version being written (``base_version + 1``), or the version read by a :meth:`Database.read` handle."""
        return self.base_version if self.readonly else self.base_version + 1

    @property
    def closed(self) -> bool:
        return self._txn.closed

    def get(self, table: Name, key: BytesLike) -> Optional[bytes]:
        """The value of ``key`` in ``table``, or None if either is absent."""
        return self._txn.get(_name(table), bytes(key))

    def put(self, table: Name, key: BytesLike, value: BytesLike) -> None:
        """Sets ``key`` to ``value`` in ``table`` (created if missing)."""
        self._txn.put(_name(table), bytes(key), value)

    def delete(self, table: Name, key: BytesLike) -> bool:
        """Removes ``key``; returns whether it was present."""
        return self._txn.delete(_name(table), bytes(key))

    def scan(self, table: Name, start: Optional[BytesLike] = None, end: Optional[BytesLike] = None, *,
             prefix: Optional[BytesLike] = None) -> Iterator[tuple[bytes, bytes]]:
        """Yields ``(key, value)`` in key order for keys in ``[start, end)`` or starting with ``prefix``.

        Modifying the handle while iterating raises StorageError.
        """
        if prefix is not None:
            if start is not None or end is not None:
                raise ValueError("scan: give either prefix or start/end, not both")
            start, end = bytes(prefix), _prefix_end(bytes(prefix))
        cur = self._txn.cursor(_name(table), None if start is None else bytes(start), None if end is None else bytes(end))
        while True:
            batch = cur.next_batch()
            if not batch:
                return
            yield from batch

    def tables(self) -> list[str]:
        """Names of the tables of this version (decoded as UTF-8 where possible)."""
        cur = self._txn.cursor(None)
        names = []
        while True:
            batch = cur.next_batch()
            if not batch:
                break
            for k, _ in batch:
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

    def commit(self) -> None:
        """Durably commits; afterwards ``versions() == range(base_version, base_version + 2)`` and the handle is closed.

        On an I/O error the Database must be closed and reopened; reopening shows a consistent state.
        """
        self._txn.commit()

    def close(self) -> None:
        """Closes without commit: the database keeps ``base_version`` only."""
        self._txn.abort()

    def __enter__(self) -> "DatabaseHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LogRecord(NamedTuple):
    """One input record of the step log."""

    step: int
    handle: str
    producer: str
    seq: int
    payload: bytes


def _record(r: tuple) -> LogRecord:
    step, handle, producer, seq, payload = r
    return LogRecord(step, handle.decode("utf-8", "surrogateescape"), producer.decode("utf-8", "surrogateescape"),
                     seq, payload)


class StepLog:
    """The durable input log: records (step, handle, producer, seq, payload), durable when append returns.

    Parameters
    ----------
    path
        A directory (created if missing) holding the ``LOG`` header and the ``*.seg`` segments.
    segment_bytes
        Size after which appends go to a new segment (whole segments are dropped by :meth:`truncate_below`).
    vfs
        ``"posix"`` or ``"fault"``.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with StepLog(os.path.join(d, "log")) as log:
    ...     log.append(0, "bids", b"batch-1", producer="gen-1", seq=1)
    ...     log.append(1, "bids", b"batch-2", producer="gen-1", seq=2)
    ...     print([r.payload for r in log.read(1)])
    [b'batch-2']
    """

    def __init__(self, path: Union[str, os.PathLike], *, segment_bytes: int = 64 << 20, vfs: str = "posix") -> None:
        self.path = os.fspath(path)
        self._log = _storage.Log(self.path, vfs, segment_bytes)

    def append(self, step: int, handle: Name, payload: BytesLike, *, producer: Name = "", seq: int = 0) -> None:
        """Appends one record and returns once it is durable. Steps must not decrease. Thread-safe; releases the GIL."""
        self._log.append(step, _name(handle), _name(producer), seq, payload)

    def enqueue(self, step: int, handle: Name, payload: BytesLike, *, producer: Name = "", seq: int = 0) -> int:
        """Places one record in the log's order without waiting for it; returns a ticket for :meth:`sync`.

        The record is durable (and visible to readers) only once a :meth:`sync` covering its ticket returned, or
        an :meth:`append` enqueued after it did; until then a crash may lose it. Steps must not decrease.

        >>> import tempfile, os
        >>> with StepLog(os.path.join(tempfile.mkdtemp(), "log")) as log:
        ...     t = log.enqueue(0, "bids", b"batch-1")
        ...     print(len(log)); log.sync(t); print(len(log))
        0
        1
        """
        return self._log.enqueue(step, _name(handle), _name(producer), seq, payload)

    def sync(self, ticket: int) -> None:
        """Returns once every record up to ``ticket`` (from :meth:`enqueue`) is durable; releases the GIL."""
        self._log.sync(ticket)

    def read(self, step: int) -> list[LogRecord]:
        """Every record of ``step``, in append order."""
        return list(self.iter_from(step, step))

    def iter_from(self, step: int, to_step: int = 2**63 - 1, *, chunk_bytes: int = 4 << 20) -> Iterator[LogRecord]:
        """Records with ``step <= record.step <= to_step``, in log order, read ``chunk_bytes`` at a time."""
        seg = off = 0
        while True:
            recs, seg, off = self._log.read(step, to_step, chunk_bytes, seg, off)
            for r in recs:
                yield _record(r)
            if not seg:
                return

    def truncate_below(self, step: int) -> int:
        """Drops whole segments whose records all have a smaller step (the low watermark); returns how many."""
        return self._log.truncate_below(step)

    def _info(self) -> tuple:
        return self._log.info()

    @property
    def first_step(self) -> Optional[int]:
        """The smallest step in the log, or None if it is empty."""
        has, first, _, _, _, _ = self._log.info()
        return first if has else None

    @property
    def last_step(self) -> Optional[int]:
        """The largest step in the log, or None if it is empty."""
        has, _, last, _, _, _ = self._log.info()
        return last if has else None

    @property
    def segments(self) -> int:
        return self._log.info()[4]

    @property
    def fsyncs(self) -> int:
        """Number of group-commit fsyncs since open (appends / fsyncs = the batching factor)."""
        return self._log.info()[5]

    def __len__(self) -> int:
        return self._log.info()[3]

    def close(self) -> None:
        """Closes the log; no append may be in progress."""
        self._log.close()

    @property
    def closed(self) -> bool:
        return self._log.closed

    def __enter__(self) -> "StepLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FaultInjector:
    """Process-wide control of the fault-injecting VFS (``vfs="fault"``), modelled on SQLite's test6.c.

    ``arm(crash_at=N, mode=...)`` makes the N-th I/O operation simulate a crash: unsynced writes are kept,
    dropped, torn, reordered or mixed (``mode`` in ``keep, drop, tear, reorder, chaos``) and every later
    operation fails. ``arm(error_at=N, error="EIO"|"ENOSPC")`` fails the N-th operation once.

    Examples
    --------
    >>> FaultInjector.arm()          # count operations, inject nothing
    >>> FaultInjector.ops()
    0
    """

    MODES = tuple(_storage.CRASH_MODES)

    @staticmethod
    def arm(crash_at: int = 0, mode: str = "drop", seed: int = 0, error_at: int = 0, error: str = "EIO") -> None:
        _storage.fault_arm(crash_at, mode, seed, error_at, error)

    @staticmethod
    def disarm() -> None:
        _storage.fault_arm()

    @staticmethod
    def ops() -> int:
        """I/O operations counted since the last :meth:`arm`."""
        return _storage.fault_ops()

    @staticmethod
    def crashed() -> bool:
        return _storage.fault_crashed()

    @staticmethod
    def crash_now(mode: str = "drop", seed: int = 0) -> None:
        _storage.fault_crash_now(mode, seed)
