"""The durable output log of a pipeline: one step-log record per step holding every output handle's change and the input (producer, seq) ranges that produced it.

Invariants (enforced here):
  1. The log holds the steps ``first..last`` contiguously, each exactly once. ``write(step, ...)`` is
     idempotent by step: ``step < first`` is discarded; ``first <= step < last`` is a replay: discarded, and with
     ``check=True`` (the default) compared with the stored record, raising ReplayMismatchError on any
     difference; ``step == last`` is appended and increments ``last``; ``step > last`` raises ValueError.
  2. An appended step is durable (fsynced) before ``write`` returns when ``sync=True``. With ``sync=False``
     it is written (visible to readers, here and in other processes) before ``write`` returns and durable
     after the next :meth:`OutputLog.flush` or :meth:`OutputLog.close` (group commit); a crash before then
     keeps a prefix of the appended steps. A write with ``defer=True`` (the writer's steps of one call, which
     it returns only after a flush) only queues the record in the log's memory: no file holds it and no reader
     sees it, here (``get``, ``read``, ``inputs_of`` and ``readable`` stop before it) or in another process,
     until the next flush (or a retention, or close) writes and fsyncs every queued record with one fsync and
     only then makes them readable; a crash before then loses the queued records, never a record a reader saw.
  3. Records live in the C step log (csrc/steplog.c, format 2, no LOG file) in the log's directory, so its
     recovery rules hold: a torn tail of unsynced writes is cut off on open, and a damaged record that a
     later write proves had been fsynced raises CorruptionError naming the file and offset and changes
     nothing. A directory written by format 1 of this log (``out-<first step>.seg`` files) is read in place
     (dbsp_core.storage.outputlog_format1); its steps come first and it is never written again.
  4. Retention first makes every appended step durable, then drops whole segments only, oldest first
     (format-1 ones before any step-log segment), and never the one holding the newest step, so ``first``
     and ``last`` are always known and no crash leaves the log without the steps that were kept.
  5. A record holds the outputs of the circuit that wrote it. After a program change (dbsp_core.runtime.change)
     ``since[name]`` is the first step of a view's current definition (its full contents at that step): the
     records before it hold the view's older definition or none, so :meth:`OutputLog.read` starts there, and
     a replayed step is verified for the outputs whose definition it ran (``since <= step``) only.
  6. ``readonly=True`` never changes a file and may run in another process while the writer appends: a
     record is shown only once it is complete, and :meth:`OutputLog.refresh` shows new steps and forgets
     dropped ones.
  7. An output whose change is exactly the sum of one input's pushes of the step (the view is the input
     itself; the writer decides, dbsp_core.runtime.driver) may be written as a *reference* to those pushes
     instead of a second copy of their rows: it names the input and the (producer, seq) of each push, whose
     records the input log (the directory ``input`` beside this one) holds under the same step. Reading it
     decodes those records, sums and consolidates them: every reader (``get``, ``read``, the replay check)
     sees the same rows as from a copy. The writer keeps the input log's records as long as the output steps
     that name them (Pipeline's checkpoint truncates the input log below the output log's first step);
     records it cannot find raise LookupError if the input log was truncated past them, else CorruptionError.

Byte layout of a record (step-log record: step = the step, empty handle and producer, seq 0; little-endian):
the payload is ``u32 n`` (the number of outputs + 1) | ``u32 m`` | ``m`` bytes of UTF-8 JSON
``{"step": s, "outputs": [names in order], "inputs": [{"handle", "producer", "first_seq", "last_seq",
"pushes"}]}`` | then per output, in the order named: ``u32 k`` | ``k`` bytes of
:func:`dbsp_core.codec.encode_zset` (header ``DZS1``, version, checksum, then an Arrow IPC stream of the
columns and ``__dbsp_weight``), or a reference (invariant 7): header ``DZS1`` with format version
``OUTPUT_REF_VERSION`` (3; older builds refuse it with FormatVersionError) and the CRC-32C of the body, then UTF-8
JSON ``{"input": handle, "pushes": [[producer, seq], ...]}`` (written since 2026-11-28). Without references this
is byte for byte the body of a format-1 record. Each output's rows are
consolidated (no two equal, no zero weight) but in no particular order: a change that a step's operators produced
distinct is written as it is (since 2026-11-27; earlier records are in canonical order), so a reader that needs
the order sorts.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Iterator

import pyarrow as pa

from dbsp_core import _storage
from dbsp_core._storage import crc32c
from dbsp_core.codec import decode_zset, encode_zset_parts
from dbsp_core.errors import CorruptionError, ReplayMismatchError
from dbsp_core.storage.fileref import decode_push
from dbsp_core.storage.formats import INPUT_DIR, OUTPUT_REF_VERSION, ZSET_MAGIC, segment_name
from dbsp_core.storage.logstore import LogShipper, ShippedLog
from dbsp_core.storage.outputlog_format1 import Format1Segments
from dbsp_core.storage.steplog import StepLog
from dbsp_core.zset import ZSet

__all__ = ["OutputLog"]

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<4sBI")  # the header of a part: magic, format version, CRC-32C of what follows (codec's)


def _ref_part(handle: str, pushes: list[tuple[str, int]]) -> bytes:
    """An output's part that names the pushes whose sum it is (invariant 7)."""
    body = json.dumps({"input": handle, "pushes": [list(p) for p in pushes]}).encode("utf-8")
    return _HEAD.pack(ZSET_MAGIC, OUTPUT_REF_VERSION, crc32c(body)) + body


def _is_ref(part: memoryview) -> bool:
    return len(part) >= _HEAD.size and part[4] == OUTPUT_REF_VERSION and bytes(part[:4]) == ZSET_MAGIC


def _parts(body: memoryview) -> list[memoryview]:
    """The parts of a record's payload (the byte layout above); struct.error or IndexError if malformed."""
    (count,), pos, parts = _U32.unpack_from(body), _U32.size, []
    for _ in range(count):
        (n,) = _U32.unpack_from(body, pos)
        if pos + 4 + n > len(body):
            raise struct.error("part runs past the record")
        parts.append(body[pos + 4:pos + 4 + n])
        pos += 4 + n
    return parts


def _ref_body(part: memoryview, where: str) -> dict:
    (crc,) = struct.unpack_from("<I", part, 5)
    body = part[_HEAD.size:]
    if crc32c(body) != crc:
        raise CorruptionError(f"{where}: checksum mismatch of the reference to the input log")
    try:
        ref = json.loads(bytes(body).decode("utf-8"))
        return {"input": str(ref["input"]), "pushes": [(str(p), int(q)) for p, q in ref["pushes"]]}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptionError(f"{where}: malformed reference to the input log ({e})") from e


def named_pushes(payload: bytes, where: str) -> list[tuple[str, str, int]]:
    """``(input, producer, seq)`` of every push a record's references name (invariant 7), read without decoding
    any rows (``dbsp repair`` checks them against what a damaged input log still holds); CorruptionError if the
    record is malformed."""
    try:
        parts = _parts(memoryview(payload))
    except (struct.error, IndexError) as e:
        raise CorruptionError(f"{where}: malformed output record ({e})") from e
    out = []
    for part in parts[1:]:
        if _is_ref(part):
            ref = _ref_body(part, where)
            out += [(ref["input"], p, q) for p, q in ref["pushes"]]
    return out


class OutputLog:
    """Step-numbered output of every output handle of one pipeline.

    Parameters
    ----------
    path
        Directory (created if missing) holding the step log's ``<segment number>.seg`` segments (and any
        format-1 ``out-<first step>.seg`` segments of an older release).
    schemas
        ``{output name: schema}``; records hold every output, in this order.
    check
        Verify replayed steps against the stored record (invariant 1).
    sync
        fsync each appended record before :meth:`write` returns; with False, :meth:`flush` makes them durable.
    segment_bytes
        Size after which a new segment starts (retention drops whole segments).
    readonly
        Only read, possibly while a writer in another process appends (invariant 5).
    vfs
        ``"posix"`` or ``"fault"`` (the fault-injecting I/O layer of the crash tests).
    ship
        A :class:`~dbsp_core.storage.logstore.LogShipper` (from ``LogStore.restore``, which rebuilt ``path``): the
        log is kept in an object store too, and a synced step is durable once the segment object holding it is there.
    expect
        ``{step: record payload}``: records of a damaged log kept by its rebuild (dbsp_core.storage.repair); an
        appended step found here is verified against it, as a replayed step is (invariant 1).
    since
        ``{output name: first step of its current definition}`` (invariant 5); an output not named: step 0.
    input_log
        The pipeline's input log (a writer passes its own), read to resolve references (invariant 7); None: the
        ``input`` directory beside ``path`` is opened read-only when the first reference is read.

    Examples
    --------
    >>> import tempfile, pyarrow as pa
    >>> s = pa.schema([("x", pa.int64())])
    >>> log = OutputLog(tempfile.mkdtemp(), {"v": s})
    >>> log.write(0, {"v": ZSet.from_rows([(1,)], s)})
    'appended'
    >>> log.write(0, {"v": ZSet.from_rows([(1,)], s)})
    'replayed'
    >>> [(step, z.to_dict()) for step, z in log.read("v", 0)]
    [(0, {(1,): 1})]
    >>> log.close()
    """

    def __init__(self, path: str, schemas: dict[str, pa.Schema], *, check: bool = True, sync: bool = True,
                 segment_bytes: int = 16 << 20, readonly: bool = False, vfs: str = "posix",
                 expect: dict[int, bytes] | None = None, since: dict[str, int] | None = None,
                 ship: LogShipper | None = None, input_log: StepLog | None = None) -> None:
        self.path = os.fspath(path)
        self._input_log, self._own_input = input_log, False  # invariant 7; opened on the first reference if None
        self.schemas = dict(schemas)
        self.since = dict(since or {})
        self.names = list(self.schemas)
        self.check = check
        self.sync = sync
        self.segment_bytes = segment_bytes
        self.readonly = readonly
        self._lock = threading.Lock()
        self._ticket = 0  # of the newest appended record (flush syncs up to it)
        self._queued = False  # records written with defer=True wait for the next sync (invariant 2)
        # per output, the buffer its change is encoded into, reused under _lock: the log's enqueue copies a record
        # before write returns (codec.encode_zset_parts ``into``)
        self._scratch: dict[str, pa.ResizableBuffer] = {}
        self._expect = dict(expect or {})
        self.first = self.last = 0
        if readonly:
            if ship is not None:
                raise ValueError(f"output log {self.path}: a read-only log ships nothing; give ship= to the writer")
            if not os.path.isdir(self.path):
                raise FileNotFoundError(f"output log {self.path}: no such directory")
            # the step log before the format-1 part: the writer drops format-1 segments before it drops any of
            # the step log's, so a format-1 part that still exists afterwards existed when the step log was read
            self._log = _storage.Log(self.path, vfs, segment_bytes, True, False)
            try:
                self._v1 = Format1Segments(self.path)
            except BaseException:
                self._log.close()
                raise
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._v1 = Format1Segments(self.path)  # read first: nothing below changes a file before it is checked
            self._log = _storage.Log(self.path, vfs, segment_bytes, False, False)  # creates the directory durably
            if ship is not None:
                self._log = ShippedLog(self._log, ship)
        try:
            self._load()
        except BaseException:
            self._log.close()
            raise

    # ---- open ----

    def _seg_path(self, num: int) -> str:
        return os.path.join(self.path, segment_name(num))

    def _step_log_range(self) -> tuple[int, int] | None:
        """(first, last + 1) of the step log's records, checking one record per consecutive step."""
        span = None
        for num, _fmt, _size, records, steps, lo, hi in self._log.segments():
            if not records:
                continue
            if records != steps or hi - lo + 1 != records or (span is not None and lo != span[1]):
                after = f" after step {span[1] - 1}" if span is not None else ""
                raise CorruptionError(f"{self._seg_path(num)}: {records} records of steps {lo}..{hi}{after}; the "
                                      f"output log holds one record per step, consecutively")
            span = (lo if span is None else span[0], hi + 1)
        return span

    def _load(self) -> None:
        span = self._step_log_range()
        v1 = self._v1
        if v1.segments:
            if span is not None and span[0] != v1.last:
                raise CorruptionError(f"{self.path}: the format-1 segments end before step {v1.last} but the step "
                                      f"log starts at step {span[0]}")
            self.first, self.last = v1.first, span[1] if span is not None else v1.last
        elif span is not None:
            self.first, self.last = span
        else:
            self.first = self.last = 0
        self.readable = self.last  # the end of what readers see (invariant 2): every step on disk

    def refresh(self) -> None:
        """A read-only log: pick up records appended (and segments dropped) by the writer since the last scan."""
        if not self.readonly:
            return  # a writer's view is always current
        with self._lock:
            self._log.refresh()
            self._v1.scan()
            self._load()

    # ---- write ----

    def _encode(self, step: int, outputs: dict[str, ZSet], inputs: list, refs: dict | None = None) -> list:
        """The payload of ``step``'s record as a list of buffers (gathered by the log, not joined here). Call under
        ``_lock`` and hand the list to the log at once: an output's buffer is reused by the next call."""
        meta = json.dumps({"step": step, "outputs": self.names, "inputs": inputs}).encode("utf-8")
        chunks: list = [_U32.pack(len(self.names) + 1), _U32.pack(len(meta)), meta]
        for n in self.names:
            if refs and n in refs:  # invariant 7: the pushes' records stand for the rows
                part = _ref_part(*refs[n])
                chunks += [_U32.pack(len(part)), part]
                continue
            # a change an operator produced distinct (no equal rows, no zero weight) is stored as it is: sorting it
            # into canonical order costs, and no reader needs it
            into = self._scratch.get(n)
            if into is None:
                into = self._scratch[n] = pa.allocate_buffer(0, resizable=True)
            head, blob = encode_zset_parts(outputs[n]._distinct_rows(), into=into)
            chunks += [_U32.pack(len(head) + blob.size), head, blob]
        return chunks

    def write(self, step: int, outputs: dict[str, ZSet], inputs: list | None = None,
              refs: dict[str, tuple[str, list[tuple[str, int]]]] | None = None, defer: bool = False) -> str:
        """Record ``outputs`` (``{name: change}``) of ``step``; returns 'discarded', 'replayed' or 'appended'.

        ``inputs`` describes the input that produced the step (see :meth:`inputs_of`). ``refs`` names outputs
        whose change is the sum of the pushes ``(producer, seq)`` of one input in this step, already durable in
        the input log: ``{output: (input, [(producer, seq), ...])}``; they are written as references (invariant 7).
        ``defer``: an appended record waits, unread and in memory, for the next :meth:`flush` (invariant 2).
        """
        if self.readonly:
            raise ValueError("output log: opened read-only")
        with self._lock:
            if step < self.first:
                return "discarded"
            if step < self.last:
                if self.check:
                    if step >= self.readable:
                        self._sync_locked()  # a queued record is read back from the file
                    old = self._read_locked(step)[1]
                    for n in old:  # the outputs whose current definition the record holds (invariant 5)
                        if not (old[n] == outputs[n]):
                            raise ReplayMismatchError(
                                f"replayed step {step} produced a different change of output {n!r} than the "
                                f"one in the output log ({len(outputs[n].consolidate())} vs {len(old[n])} rows)")
                return "replayed"
            if step > self.last:
                raise ValueError(f"output log: write of step {step} but the next step is {self.last}")
            kept = self._expect.pop(step, None)
            if kept is not None and self.check:  # a record a rebuild kept: the step computed again must match it
                old = self._decode(step, memoryview(kept), f"{self.path} (kept by the rebuild)")[1]
                for n in old:
                    if not (old[n] == outputs[n]):
                        raise ReplayMismatchError(
                            f"step {step} computed again after the output log's rebuild gave a different change of "
                            f"output {n!r} than the intact record the rebuild kept")
            ticket = self._log.enqueue(step, b"", b"", 0, self._encode(step, outputs, inputs or [], refs))
            self._ticket = ticket
            self.last = step + 1
            if defer:  # invariant 2: in memory only, unread, until the next sync
                self._queued = True
            elif self.sync:
                self._sync_locked()
            else:
                self._log.write(ticket)
                if not self._queued:
                    self.readable = self.last
            return "appended"

    def _sync_locked(self) -> None:
        """Write and fsync every appended record, then let readers see them (invariant 2). Call under ``_lock``."""
        if self._ticket:
            self._log.sync(self._ticket)
        self._queued = False
        self.readable = self.last

    def flush(self) -> None:
        """Make every appended step durable (and every step written with ``defer=True`` readable) with one fsync."""
        with self._lock:
            if not self.readonly:
                self._sync_locked()

    # ---- read ----

    def _read_locked(self, step: int) -> tuple[dict, dict[str, ZSet]]:
        if step in self._v1:
            body, where = self._v1.body(step)
        else:
            recs, _, _ = self._log.read(step, step, 0, 0, 0)
            if not recs:
                raise LookupError(f"output step {step} was dropped by retention")
            body, where = recs[0][4], self.path
        return self._decode(step, memoryview(body), where)

    def _decode(self, step: int, body: memoryview, where: str) -> tuple[dict, dict[str, ZSet]]:
        try:
            parts = _parts(body)
            meta = json.loads(bytes(parts[0]).decode("utf-8"))
        except (struct.error, IndexError, ValueError) as e:
            raise CorruptionError(f"{where}: record of output step {step} is malformed ({e})") from e
        if meta.get("step", step) != step:
            raise CorruptionError(f"{where}: the record of output step {step} names step {meta['step']}")
        current = [n for n in self.names if self.since.get(n, 0) <= step]  # invariant 5
        if not set(current) <= set(meta["outputs"]) or len(parts) != len(meta["outputs"]) + 1:
            raise CorruptionError(f"{where}: step {step} holds outputs {meta['outputs']}, expected {current}")
        zs = {n: self._resolve(step, p, self.schemas[n], f"{where} step {step} output {n}") if _is_ref(p) else
              decode_zset(bytes(p), self.schemas[n], f"{where} step {step} output {n}")
              for n, p in zip(meta["outputs"], parts[1:]) if n in self.schemas and self.since.get(n, 0) <= step}
        return meta, zs

    def _resolve(self, step: int, part: memoryview, schema: pa.Schema, where: str) -> ZSet:
        """The change a reference part names (invariant 7): the sum of its pushes' records in the input log."""
        ref = _ref_body(part, where)
        handle, want = ref["input"], set(ref["pushes"])
        if self._input_log is None:
            self._input_log = StepLog(os.path.join(os.path.dirname(os.path.abspath(self.path)), INPUT_DIR),
                                      readonly=True)
            self._own_input = True
        for attempt in range(2):  # a reader's view of the input log may predate the writer's last records
            found = [r for r in self._input_log.read(step) if r.handle == handle and (r.producer, r.seq) in want]
            if len(found) == len(want) and len({(r.producer, r.seq) for r in found}) == len(want):
                break
            if attempt == 0 and self._own_input:
                self._input_log.refresh()
        else:
            first = self._input_log.first_step
            missing = sorted(want - {(r.producer, r.seq) for r in found})[:5]
            if first is None or step < first:
                raise LookupError(f"{where}: the input log no longer holds step {step}, whose pushes this output "
                                  f"step names (the input log was truncated past the output log's first step)")
            raise CorruptionError(f"{where}: the input log holds {len(found)} of the {len(want)} pushes of input "
                                  f"{handle!r} this output step names (missing e.g. {missing})")
        zs = [decode_push(r.payload, schema, f"{where} (input {handle!r} push {r.producer!r}, {r.seq})")
              for r in found]
        return ZSet.concat(zs).consolidate() if zs else ZSet.empty(schema)

    def get(self, step: int) -> dict[str, ZSet]:
        """Every output's change of ``step`` (those whose current definition it ran, invariant 5); KeyError if the
        step is not (or no longer) in the log."""
        with self._lock:
            if not self.first <= step < self.readable:
                raise KeyError(f"output step {step} is not in the log (it holds {self.first}..{self.readable})")
            return self._read_locked(step)[1]

    def inputs_of(self, step: int) -> list[dict]:
        """The input that produced ``step``: ``[{"handle", "producer", "first_seq", "last_seq", "pushes"}]``."""
        with self._lock:
            if not self.first <= step < self.readable:
                raise KeyError(f"output step {step} is not in the log (it holds {self.first}..{self.readable})")
            return self._read_locked(step)[0]["inputs"]

    def read(self, name: str, from_step: int = 0) -> Iterator[tuple[int, ZSet]]:
        """Yields ``(step, change of output name)`` for every step from ``from_step`` (or from the first step of the
        output's current definition, invariant 5) to the current end, once each.

        Raises KeyError for an unknown output and LookupError if ``from_step`` was dropped by retention.
        """
        if name not in self.schemas:
            raise KeyError(f"unknown output {name!r}; outputs are {self.names}")
        if isinstance(from_step, bool) or not isinstance(from_step, int):
            raise TypeError(f"read of output {name!r}: from_step must be an int step number, got {from_step!r}")
        if from_step < 0:
            raise ValueError(f"read of output {name!r}: from_step must be >= 0 (steps count from 0), got {from_step}")
        if from_step < self.first:
            raise LookupError(f"output steps below {self.first} were dropped by retention; asked from {from_step}")
        step = max(from_step, self.since.get(name, 0))
        while True:
            with self._lock:
                if step >= self.readable:
                    return
                z = self._read_locked(step)[1][name]
            yield step, z
            step += 1

    def steps_by_reference(self) -> int:
        """How many steps of the log name pushes in the input log instead of holding a view's rows (invariant 7);
        reads every record (``dbsp inspect``)."""
        with self._lock:
            n, seg, off = 0, 0, 0
            while True:
                recs, seg, off = self._log.read(0, 2**63 - 1, 4 << 20, seg, off)
                for r in recs:
                    try:
                        n += any(_is_ref(p) for p in _parts(memoryview(r[4]))[1:])
                    except (struct.error, IndexError) as e:
                        raise CorruptionError(f"{self.path}: record of output step {r[0]} is malformed ({e})") from e
                if not seg:
                    return n

    # ---- retention ----

    def truncate_below(self, step: int) -> int:
        """Makes every appended step durable, then drops whole segments whose steps are all below ``step`` (never
        the newest); returns how many."""
        if self.readonly:
            raise ValueError("output log: opened read-only")
        with self._lock:
            self._sync_locked()  # invariant 4: what follows a dropped segment is durable before it goes
            span = self._step_log_range()
            dropped = self._v1.drop_below(step, span[0] if span is not None else None)
            if not self._v1.segments:  # invariant 4: the step log's segments only once the format-1 ones are gone
                dropped += self._log.truncate_below(step)
            if dropped:
                span = self._step_log_range()
                self.first = self._v1.first if self._v1.segments else span[0] if span is not None else self.last
        return dropped

    def disk_bytes(self) -> int:
        return self._v1.disk_bytes() + sum(seg[2] for seg in self._log.segments())

    def close(self) -> None:
        """Make every appended step durable (a writer) and release the files."""
        with self._lock:
            if self._log.closed:
                return
            try:
                if not self.readonly:
                    self._sync_locked()
            finally:
                self._log.close()
                if self._own_input:
                    self._input_log.close()
