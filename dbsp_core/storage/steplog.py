"""The write-ahead ``StepLog`` over the C log: records (step, handle, producer, seq, payload), durable when an append returns; concurrent appenders share one fsync (group commit)."""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple, Optional, Union

from dbsp_core import _storage
from dbsp_core.storage.logstore import LogShipper, ShippedLog

__all__ = ["LogRecord", "StepLog"]

BytesLike = Union[bytes, bytearray, memoryview]
Payload = Union[BytesLike, list]  # one bytes-like object, or a list of them gathered back to back
Name = Union[str, bytes]


def _name(x: Name) -> bytes:
    return x.encode("utf-8") if isinstance(x, str) else bytes(x)


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
    ship
        A :class:`~dbsp_core.storage.logstore.LogShipper` (from ``LogStore.restore``, which rebuilt ``path``): the
        log is kept in an object store too, and an append returns once the segment object holding it is durable
        there (the local files are written but not fsynced).
    readonly
        Open an existing log for reading only, possibly while a writer (in another process) appends: no file is
        created, written, cut or removed, a torn or half-written tail is not shown, and :meth:`refresh` shows
        what the writer appended (and forgets segments it dropped) since.

    A damaged record that a later write proves had been fsynced raises CorruptionError (naming the file and the
    offset) and changes nothing; a torn tail of unsynced writes is cut off (csrc/steplog.c, invariant 6). Logs
    of format 1 are read as they are; appending to one starts a segment of the current format (invariant 8).

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with StepLog(os.path.join(d, "log")) as log:
    ...     first = log.append(0, "bids", b"batch-1", producer="gen-1", seq=1)  # append returns the record's ticket
    ...     print(log.append(1, "bids", b"batch-2", producer="gen-1", seq=2) > first, [r.payload for r in log.read(1)])
    True [b'batch-2']
    """

    def __init__(self, path: Union[str, os.PathLike], *, segment_bytes: int = 64 << 20, vfs: str = "posix",
                 readonly: bool = False, ship: Optional[LogShipper] = None) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        if readonly and not os.path.isdir(self.path):
            raise FileNotFoundError(f"steplog {self.path}: no such directory")
        if readonly and ship is not None:
            raise ValueError(f"steplog {self.path}: a read-only log ships nothing; give ship= to the writer only")
        self._log = _storage.Log(self.path, vfs, segment_bytes, readonly)
        if ship is not None:
            self._log = ShippedLog(self._log, ship)

    def refresh(self) -> None:
        """A read-only log: show records the writer appended and forget segments it dropped since the last scan."""
        self._log.refresh()

    def append(self, step: int, handle: Name, payload: Payload, *, producer: Name = "", seq: int = 0) -> int:
        """Appends one record and returns once it is durable; returns its ticket (its place in the log's order, as
        :meth:`enqueue` does). ``payload`` is bytes-like or a list of bytes-like parts (Arrow buffers too), copied
        back to back into the record without being joined first. Steps must not decrease. Thread-safe; releases
        the GIL."""
        ticket = self._log.enqueue(step, _name(handle), _name(producer), seq, payload)
        self._log.sync(ticket)
        return ticket

    def enqueue(self, step: int, handle: Name, payload: Payload, *, producer: Name = "", seq: int = 0) -> int:
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
