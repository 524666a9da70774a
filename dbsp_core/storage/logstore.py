"""The input and output logs as segment objects in an object store: records shipped in group-committed PUTs (a record
is durable, and its push acknowledged, once the object holding it is in the store), local logs rebuilt from the
objects, and retention of the objects no checkpoint or consumer needs.

The local step logs (csrc/steplog.c, :class:`~dbsp_core.storage.steplog.StepLog` and
:class:`~dbsp_core.storage.outputlog.OutputLog`) stay what the driver reads and writes; with a :class:`LogStore`
each is wrapped in a :class:`ShippedLog`, whose ``sync`` waits for the store instead of an fsync: the local copy is
a cache, rebuilt from the store whenever the log is opened (:meth:`LogStore.restore`).

Invariants (enforced here):
  1. Every record gets a log sequence number (LSN) one above the previous one's, in the order of the local log
     (the local enqueue and the LSN are taken under one lock). A segment object holds the records of LSNs
     ``first..last`` whole, in order, and is written with one PUT (the object appears whole or not at all), under a
     name that says ``first``, ``last``, the writer's generation and the records' step range
     (:func:`segment_object_name`); its bytes are framed with a magic, a format version and a CRC-32 of the body
     (formats.py ``DLSG``), checked on every read: a partial or damaged segment is never read as records.
  2. One uploader thread per log PUTs its segments one after another: segment ``k + 1`` is only written after
     segment ``k`` is durable, so the objects of a writer always cover a contiguous run of LSNs. ``wait(lsn)``
     returns only once the segment holding ``lsn`` is durable. A PUT that fails is retried under the retry policy
     with the same name and the same bytes (storage/retry.py rule 3), so a PUT that failed after its object landed
     is harmless; when the retries run out the log fails: every waiting and later ``wait`` raises
     StoreUnavailableError and nothing after the failed segment is acknowledged or written.
  2b. With a ``fence`` (a writer's lease check, storage.remote invariant 6) a segment's records are acknowledged
     only after its PUT returned and a check that started after that passed: a newer writer lists the log after
     its lease landed, so either the older writer's check sees that lease (StoreFencedError: the records are not
     acknowledged, every waiting and later ``wait`` raises it, and no PUT starts after it), or the check ran
     before the lease landed, so the PUT did too and the newer writer's listing holds the segment. An older
     writer never acknowledges a record the newer writer's history lacks. The checks (a LIST and a GET each) run
     on a thread of their own beside the PUTs, one check covering every segment whose PUT returned before it
     started: a push waits for one PUT and one check, and the PUTs go on back to back (invariant 2 orders them
     by their PUTs, not by their checks).
  3. Group commit: records submitted while a PUT is in flight, or within ``group_commit_s`` of the first record
     waiting, go into one segment (up to ``segment_bytes``).
  4. Opening a log (:meth:`LogStore.restore`) lists the objects and follows the chain from the oldest: at each LSN
     the segment of the highest generation starting there is taken (a PUT of an earlier writer that landed after a
     later writer listed the store is superseded), the next link starts at its ``last + 1``; a gap raises
     CorruptionError. The local log is deleted and rebuilt from the chain's segments whose steps reach
     ``from_step``; the new writer takes the next generation and continues at the chain's end.
  5. Retention (:meth:`LogStore.retain`) deletes, oldest first, the chain's segments whose records all have steps
     below the bound, never the newest segment (its ``last`` is where the next writer continues), and first the
     superseded segments below the first one kept, so an interrupted retention leaves a chain that still starts at
     its oldest segment.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import pyarrow.fs as pafs

from dbsp_core import _storage
from dbsp_core.codec import frame_head, unframe_view
from dbsp_core.errors import CorruptionError, StoreFencedError, StoreUnavailableError
from dbsp_core.storage import retry
from dbsp_core.storage.formats import LOG_SEGMENT_MAGIC, LOG_SEGMENT_SUFFIX
from dbsp_core.storage.location import Location

__all__ = ["LogStore", "LogShipper", "ShippedLog", "SegmentObject", "segment_object_name", "parse_segment_name",
           "KINDS"]

KINDS = ("input", "output")
_REC = struct.Struct("<qQIIQ")  # step, seq, handle length, producer length, payload length
_U32 = struct.Struct("<I")


class SegmentObject(NamedTuple):
    """What a segment object's name says (invariant 1)."""

    first: int  # LSN of its first record
    last: int  # LSN of its last record
    gen: int  # the generation of the writer
    lo_step: int  # the smallest step of its records
    hi_step: int  # the largest
    path: str  # as the store's filesystem names it


def segment_object_name(first: int, last: int, gen: int, lo_step: int, hi_step: int) -> str:
    """The object name of a segment (invariant 1): LSNs, generation and step range, zero-padded so names sort by LSN.

    >>> segment_object_name(1, 3, 2, 0, 1)
    '00000000000000000001-00000000000000000003-g0000000002-s00000000000000000000-00000000000000000001.dlsg'
    """
    return f"{first:020d}-{last:020d}-g{gen:010d}-s{lo_step:020d}-{hi_step:020d}{LOG_SEGMENT_SUFFIX}"


def parse_segment_name(path: str) -> SegmentObject | None:
    """The fields of a segment object's name, None for another name."""
    base = path.rsplit("/", 1)[-1]
    if not base.endswith(LOG_SEGMENT_SUFFIX):
        return None
    parts = base[:-len(LOG_SEGMENT_SUFFIX)].split("-")
    try:
        first, last, gen, lo, hi = parts
        if gen[0] != "g" or lo[0] != "s":
            return None
        return SegmentObject(int(first), int(last), int(gen[1:]), int(lo[1:]), int(hi), path)
    except (ValueError, IndexError):
        return None


def encode_segment(kind: str, first: int, gen: int, records: Sequence[tuple]) -> tuple[str, list]:
    """(object name, parts of its bytes) of a segment holding ``records`` ``(step, handle, producer, seq, payload)``
    from LSN ``first`` on. Byte layout (formats.py ``DLSG``): the frame header over the body, which is ``u32 n`` |
    ``n`` bytes of UTF-8 JSON ``{"kind", "first", "last", "gen", "steps": [lo, hi], "records"}`` | per record:
    ``i64 step`` ``u64 seq`` ``u32 handle length`` ``u32 producer length`` ``u64 payload length`` (little-endian),
    the handle, the producer, the payload."""
    last = first + len(records) - 1
    lo, hi = records[0][0], records[-1][0]
    head = json.dumps({"kind": kind, "first": first, "last": last, "gen": gen, "steps": [lo, hi],
                       "records": len(records)}, sort_keys=True).encode("utf-8")
    body: list = [_U32.pack(len(head)), head]
    for step, handle, producer, seq, payload in records:
        body += [_REC.pack(step, seq, len(handle), len(producer), len(payload)), handle, producer, payload]
    return segment_object_name(first, last, gen, lo, hi), [frame_head(LOG_SEGMENT_MAGIC, *body)] + body


def decode_segment(blob: bytes, seg: SegmentObject, kind: str, where: str) -> list[tuple]:
    """The records ``(step, handle, producer, seq, payload)`` of a segment object's bytes; CorruptionError naming
    ``where`` if the frame, the header or a record disagrees with itself or with the name (invariant 1)."""
    body = unframe_view(LOG_SEGMENT_MAGIC, blob, where)
    try:
        (n,) = _U32.unpack_from(body)
        head = json.loads(bytes(body[4:4 + n]).decode("utf-8"))
        pos, out = 4 + n, []
        for _ in range(head["records"]):
            step, seq, hl, pl, ln = _REC.unpack_from(body, pos)
            pos += _REC.size
            handle, producer = bytes(body[pos:pos + hl]), bytes(body[pos + hl:pos + hl + pl])
            pos += hl + pl
            if pos + ln > len(body):
                raise struct.error("a record runs past the segment")
            out.append((step, handle, producer, seq, bytes(body[pos:pos + ln])))
            pos += ln
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptionError(f"{where}: malformed log segment ({e})") from None
    said = (head.get("kind"), head.get("first"), head.get("last"), head.get("gen"), head.get("steps"))
    if pos != len(body) or said != (kind, seg.first, seg.last, seg.gen, [seg.lo_step, seg.hi_step]) \
            or len(out) != seg.last - seg.first + 1 or not out or (out[0][0], out[-1][0]) != (seg.lo_step, seg.hi_step):
        raise CorruptionError(f"{where}: the segment's header {said} or its records disagree with its name")
    return out


@dataclass
class ShipStats:
    """What a :class:`LogShipper` did: records and segments made durable, bytes PUT, seconds spent in PUTs."""

    records: int = 0
    segments: int = 0
    bytes: int = 0
    put_s: float = 0.0
    checks: int = 0  # lease checks made (invariant 2b), each covering the segments that landed before it
    fence_s: float = 0.0  # seconds they took


class LogShipper:
    """Ships the records of one log to ``location`` (a directory of segment objects) from LSN ``next_lsn`` on, as
    writer generation ``gen``: :meth:`submit` queues a record, :meth:`wait` returns once it is durable in the store
    (invariants 1-3); ``fence(what)``, if given, raises StoreFencedError once a newer writer holds the prefix and
    runs after each PUT, before its records are acknowledged (invariant 2b)."""

    def __init__(self, location: Location, kind: str, *, gen: int, next_lsn: int, group_commit_s: float = 0.002,
                 segment_bytes: int = 16 << 20, policy: retry.RetryPolicy = retry.DEFAULT_POLICY,
                 fence: Callable[[str], None] | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"log kind {kind!r}: one of {KINDS}")
        if group_commit_s < 0:
            raise ValueError(f"group_commit_s must be >= 0, got {group_commit_s!r}")
        self.location, self.kind, self.gen = location, kind, gen
        self.group_commit_s, self.segment_bytes, self.policy = group_commit_s, segment_bytes, policy
        self.fence = fence
        self.stats = ShipStats()
        self._cond = threading.Condition()
        self._pending: list[tuple] = []  # records submitted, not yet in a segment being written
        self._pending_bytes = 0
        self._since = 0.0  # when the oldest pending record came (monotonic)
        self._next = next_lsn  # the LSN of the next record submitted
        self._landed = next_lsn - 1  # every LSN up to it is in a segment whose PUT returned
        self._durable = next_lsn - 1  # every LSN up to it is acknowledged: landed, and fenced (invariant 2b)
        self._failed: BaseException | None = None
        self._stop = False
        self._uploaded = False  # the uploader thread is done
        if location.local:
            os.makedirs(location.path, exist_ok=True)
        self._fencer = None if fence is None else \
            threading.Thread(target=self._fence, name=f"dbsp-{kind}-log-fence", daemon=True)
        self._thread = threading.Thread(target=self._upload, name=f"dbsp-{kind}-log-shipper", daemon=True)
        self._thread.start()
        if self._fencer is not None:
            self._fencer.start()

    @property
    def next_lsn(self) -> int:
        return self._next

    @property
    def durable_lsn(self) -> int:
        return self._durable

    def _error(self) -> StoreUnavailableError | StoreFencedError:
        exc = self._failed
        if isinstance(exc, StoreFencedError):  # invariant 2b: as raised, its type kept
            return StoreFencedError(f"the {self.kind} log acknowledges nothing more: {exc}")
        if isinstance(exc, StoreUnavailableError):
            return StoreUnavailableError(f"the {self.kind} log cannot make records durable in the store: {exc}")
        return StoreUnavailableError(f"the {self.kind} log on {self.location.shown} stopped: {exc!r}; nothing after "
                                     f"its last durable segment is acknowledged; reopen the pipeline")

    def submit(self, step: int, handle: bytes, producer: bytes, seq: int, payload: bytes) -> int:
        """Queues one record for the store; returns its LSN (the caller keeps records in LSN order)."""
        with self._cond:
            if self._failed is not None:
                raise self._error()
            if self._stop:
                raise ValueError(f"the {self.kind} log shipper is closed")
            if not self._pending:
                self._since = time.monotonic()
            self._pending.append((step, handle, producer, seq, payload))
            self._pending_bytes += len(payload) + len(handle) + len(producer) + _REC.size
            lsn, self._next = self._next, self._next + 1
            self._cond.notify_all()
            return lsn

    def wait(self, lsn: int) -> None:
        """Returns once the record of ``lsn`` is durable in the store; StoreUnavailableError if the log failed."""
        with self._cond:
            while self._durable < lsn:
                if self._failed is not None:
                    raise self._error()
                self._cond.wait()

    def flush(self) -> None:
        """Returns once every record submitted so far is durable."""
        self.wait(self._next - 1)

    def _take(self) -> tuple[int, list[tuple]] | None:
        """(first LSN, records) of the next segment, waiting for records and the group-commit window; None to stop.
        Call with ``_cond``."""
        while True:
            if self._pending:
                due = self._since + self.group_commit_s
                now = time.monotonic()
                if now >= due or self._stop or self._pending_bytes >= self.segment_bytes:
                    break
                self._cond.wait(due - now)
            elif self._stop:
                return None
            else:
                self._cond.wait()
        take, size = 0, 0
        for r in self._pending:
            if take and size + len(r[4]) > self.segment_bytes:
                break
            take, size = take + 1, size + len(r[4]) + len(r[1]) + len(r[2]) + _REC.size
        records, self._pending = self._pending[:take], self._pending[take:]
        self._pending_bytes -= size
        self._since = time.monotonic()
        return self._landed + 1, records

    def _upload(self) -> None:
        try:
            self._upload_all()
        finally:
            with self._cond:
                self._uploaded = True
                self._cond.notify_all()

    def _upload_all(self) -> None:
        while True:
            with self._cond:
                got = self._take() if self._failed is None else None
            if got is None:
                return
            first, records = got
            t0 = time.perf_counter()
            try:
                name, parts = encode_segment(self.kind, first, self.gen, records)
                path = self.location.join(name).path
                data = b"".join(parts)
                retry.call(lambda: _put(self.location, path, data), f"PUT {self.kind} log segment {name}",
                           self.location, self.policy)
            except BaseException as exc:  # waiters must not wait for a thread that is gone
                with self._cond:
                    self._failed = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._landed = first + len(records) - 1
                if self._fencer is None:
                    self._durable = self._landed
                self.stats.records += len(records)
                self.stats.segments += 1
                self.stats.bytes += len(data)
                self.stats.put_s += time.perf_counter() - t0
                self._cond.notify_all()

    def _fence(self) -> None:
        """Invariant 2b: acknowledges what landed once a lease check that started after it passed."""
        assert self.fence is not None
        while True:
            with self._cond:
                while self._landed <= self._durable and self._failed is None and not self._uploaded:
                    self._cond.wait()
                if self._failed is not None or self._landed <= self._durable:
                    return
                first, last = self._durable + 1, self._landed
            t0 = time.perf_counter()
            try:
                self.fence(f"acknowledge the {self.kind} log's records {first}..{last}")
            except BaseException as exc:
                with self._cond:
                    self._failed = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._durable = last
                self.stats.checks += 1
                self.stats.fence_s += time.perf_counter() - t0
                self._cond.notify_all()

    def close(self) -> None:
        """Ships what was submitted (raising StoreUnavailableError if the store will not take it) and stops."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        if self._fencer is not None:
            self._fencer.join()
        if self._failed is not None and self._durable < self._next - 1:
            raise self._error()


class ShippedLog:
    """A local step log (``dbsp_core._storage.Log``) whose records also go to the store through ``shipper``:
    ``sync`` (and ``append``) return once the records are durable in the store; the local copy is written but not
    fsynced (it is rebuilt from the store on open, invariant 4). Offers the local log's methods."""

    def __init__(self, log: Any, shipper: LogShipper) -> None:
        self._log, self.shipper = log, shipper
        self._lock = threading.Lock()
        self._offset: int | None = None  # LSN - ticket (both count records one by one: invariant 1)

    def enqueue(self, step: int, handle: bytes, producer: bytes, seq: int, payload: Any) -> int:
        data = bytes(payload) if not isinstance(payload, list) else b"".join(payload)
        with self._lock:
            ticket = self._log.enqueue(step, handle, producer, seq, data)
            lsn = self.shipper.submit(step, handle, producer, seq, data)
            if self._offset is None:
                self._offset = lsn - ticket
            assert lsn - ticket == self._offset, "the local log and the shipper number records differently"
        return ticket

    def append(self, step: int, handle: bytes, producer: bytes, seq: int, payload: Any) -> int:
        ticket = self.enqueue(step, handle, producer, seq, payload)
        self.sync(ticket)
        return ticket

    def write(self, ticket: int) -> None:
        self._log.write(ticket)

    def sync(self, ticket: int) -> None:
        self._log.write(ticket)  # visible to local readers; durability is the store's
        if self._offset is not None:
            self.shipper.wait(ticket + self._offset)

    def read(self, *args: Any) -> Any:
        return self._log.read(*args)

    def info(self) -> Any:
        return self._log.info()

    def segments(self) -> Any:
        return self._log.segments()

    def truncate_below(self, step: int) -> int:
        return self._log.truncate_below(step)

    def refresh(self) -> None:
        self._log.refresh()

    @property
    def closed(self) -> bool:
        return self._log.closed

    def close(self) -> None:
        """Ships what was appended, then closes the local log (also when the store refuses it)."""
        try:
            if not self._log.closed:
                self.shipper.close()
        finally:
            self._log.close()


class LogStore:
    """The log segment objects of one pipeline under ``location`` (``<location>/input/``, ``<location>/output/``).

    Examples
    --------
    >>> import tempfile, os
    >>> from dbsp_core.storage.location import resolve
    >>> from dbsp_core.storage.steplog import StepLog
    >>> d = tempfile.mkdtemp()
    >>> store = LogStore(resolve("file://" + os.path.join(d, "store")), group_commit_s=0)
    >>> log = StepLog(os.path.join(d, "input"), ship=store.restore("input", os.path.join(d, "input")))
    >>> _ = log.append(0, "t", b"row")  # returns once the segment object holding it is in the store
    >>> log.close()
    >>> log = StepLog(os.path.join(d, "input2"), ship=store.restore("input", os.path.join(d, "input2")))
    >>> [r.payload for r in log.read(0)]
    [b'row']
    >>> log.close()
    """

    def __init__(self, location: Location, *, group_commit_s: float = 0.002, segment_bytes: int = 16 << 20,
                 policy: retry.RetryPolicy = retry.DEFAULT_POLICY) -> None:
        self.location = location
        self.group_commit_s, self.segment_bytes, self.policy = group_commit_s, segment_bytes, policy
        self.stats = {"gets": 0, "get_bytes": 0}  # segments read by restore

    def dir(self, kind: str) -> Location:
        if kind not in KINDS:
            raise ValueError(f"log kind {kind!r}: one of {KINDS}")
        return self.location.join(kind)

    def _call(self, fn: Any, what: str) -> Any:
        return retry.call(fn, what, self.location, self.policy)

    def listing(self, kind: str) -> tuple[list[SegmentObject], list[SegmentObject]]:
        """(the chain, oldest first; the segments off it) of ``kind``'s objects (invariant 4)."""
        where = self.dir(kind)
        infos = self._call(lambda: where.files(recursive=False), f"LIST {kind} log segments")
        segs = sorted((s for s in (parse_segment_name(i.path) for i in infos) if s is not None),
                      key=lambda s: (s.first, -s.gen))
        chain: list[SegmentObject] = []
        off: list[SegmentObject] = []
        for s in segs:
            if not chain:
                chain.append(s)
            elif s.first == chain[-1].last + 1:
                chain.append(s)
            elif s.first <= chain[-1].last:
                off.append(s)  # superseded by a segment of a later writer (or below the chain's position)
            else:
                raise CorruptionError(f"{where.shown}: the {kind} log's segments jump from LSN {chain[-1].last} to "
                                      f"{s.first} ({s.path.rsplit('/', 1)[-1]}): a segment is missing")
        return chain, off

    def restore(self, kind: str, local_dir: str | os.PathLike, from_step: int = 0,
                local_segment_bytes: int = 64 << 20, fence: Callable[[str], None] | None = None) -> LogShipper:
        """Rebuilds the local log ``local_dir`` from the store (deleting what it held) with every segment whose steps
        reach ``from_step``, and returns the shipper that continues the log (invariant 4), with ``fence``
        (invariant 2b). Open the local log with ``ship=`` it."""
        local_dir = os.fspath(local_dir)
        chain, off = self.listing(kind)
        if os.path.lexists(local_dir):
            shutil.rmtree(local_dir)
        os.makedirs(os.path.dirname(os.path.abspath(local_dir)), exist_ok=True)
        log = _storage.Log(local_dir, "posix", local_segment_bytes, False, kind == "input")
        try:
            ticket = 0
            for seg in chain:
                if seg.hi_step < from_step:
                    continue
                blob = self._call(lambda: self._get(seg.path), f"GET {kind} log segment")
                self.stats["gets"] += 1
                self.stats["get_bytes"] += len(blob)
                for step, handle, producer, seq, payload in decode_segment(blob, seg, kind,
                                                                           self.location.shown + "/" + kind):
                    ticket = log.enqueue(step, handle, producer, seq, payload)
                if ticket:  # written out segment by segment: enqueued records wait in memory until a write
                    log.write(ticket)
            if ticket:
                log.sync(ticket)
        finally:
            log.close()
        gen = max((s.gen for s in chain + off), default=0) + 1
        next_lsn = chain[-1].last + 1 if chain else 1
        return LogShipper(self.dir(kind), kind, gen=gen, next_lsn=next_lsn, group_commit_s=self.group_commit_s,
                          segment_bytes=self.segment_bytes, policy=self.policy, fence=fence)

    def _get(self, path: str) -> bytes:
        with self.location.fs.open_input_stream(path) as f:
            return f.read()

    def retain(self, kind: str, below_step: int) -> int:
        """Deletes the segments whose records all have steps below ``below_step`` (never the newest one), and the
        superseded ones below the first kept (invariant 5); returns how many. Call it with the step of the oldest
        checkpoint that may still be opened (input) or the first output step a consumer or that checkpoint needs
        (output)."""
        chain, off = self.listing(kind)
        drop = [s for s in chain[:-1] if s.hi_step < below_step]
        if not drop:
            return 0
        kept_from = chain[len(drop)].first
        doomed = [s for s in off if s.first < kept_from] + drop
        for s in doomed:
            self._call(lambda: _delete(self.location.fs, s.path), f"DELETE {kind} log segment")
        return len(doomed)


def _put(location: Location, path: str, data: bytes) -> None:
    """Writes one segment object whole: one PUT in an object store; on a local filesystem an atomic, durable replace
    (a local file written in place could be seen half-written)."""
    if location.local:
        _storage.file_replace(path, data, "posix")
    else:
        location.write_bytes(data, path)


def _delete(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass  # a retried DELETE whose first attempt went through
