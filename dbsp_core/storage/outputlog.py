"""The durable output log of a pipeline: one checksummed record per step holding every output handle's change and the input (producer, seq) ranges that produced it.

Invariants (enforced here):
  1. The log holds the steps ``first..last`` contiguously, each exactly once. ``write(step, ...)`` follows
     seed 000: ``step < first`` is discarded; ``first <= step < last`` is a replay: discarded, and with
     ``check=True`` (the default) compared with the stored record, raising ReplayMismatchError on any
     difference; ``step == last`` is appended (fsync'd before ``write`` returns when ``sync=True``) and
     increments ``last``; ``step > last`` raises ValueError.
  2. Every record is framed as magic ``DOUT``, format version, CRC-32, step and length. On open, a bad or
     short frame at the end of the newest segment is a torn write from a crash and is cut off; a bad frame
     anywhere else raises CorruptionError. Reads re-check the CRC.
  3. Retention drops whole segments only, never the newest one, so ``first`` is always known.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from typing import Iterator

import pyarrow as pa

from dbsp_core.codec import decode_zset, encode_zset_parts
from dbsp_core.errors import CorruptionError, FormatVersionError, ReplayMismatchError
from dbsp_core.zset import ZSet

FORMAT_VERSION = 1
_MAGIC = b"DOUT"
_HEAD = struct.Struct("<4sBIQI")  # magic, version, crc32(step bytes + body), step, body length
_U32 = struct.Struct("<I")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, chunks: list, length: int) -> None:
    """Append ``chunks`` (``length`` bytes in all) with one gathered write (and more if it comes up short)."""
    if len(chunks) > 512:  # IOV_MAX is 1024 on Linux
        chunks = [b"".join(chunks)]
    done = os.writev(fd, chunks)
    if done < length:
        rest = memoryview(b"".join(bytes(c) if not isinstance(c, bytes) else c for c in chunks))[done:]
        while len(rest):
            rest = rest[os.write(fd, rest):]


def _seg_name(first_step: int) -> str:
    return f"out-{first_step:016d}.seg"


class OutputLog:
    """Step-numbered output of every output handle of one pipeline.

    Parameters
    ----------
    path
        Directory (created if missing) holding ``out-<first step>.seg`` segments.
    schemas
        ``{output name: schema}``; records hold every output, in this order.
    check
        Verify replayed steps against the stored record (invariant 1).
    sync
        fsync each appended record before :meth:`write` returns.
    segment_bytes
        Size after which a new segment starts (retention drops whole segments).

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
                 segment_bytes: int = 16 << 20, readonly: bool = False) -> None:
        self.path = os.fspath(path)
        self.schemas = dict(schemas)
        self.names = list(self.schemas)
        self.check = check
        self.sync = sync
        self.segment_bytes = segment_bytes
        self.readonly = readonly
        self._lock = threading.Lock()
        if not readonly:
            os.makedirs(self.path, exist_ok=True)
        self._index: dict[int, tuple[str, int, int]] = {}  # step -> (segment file, offset, frame length)
        self._segments: list[tuple[int, str]] = []  # (first step, file name), ascending
        self.first = 0
        self.last = 0
        self._fd: int | None = None
        self._size = 0
        self._scan()

    # ---- open ----

    def _scan(self) -> None:
        self._index, self._segments = {}, []
        names = sorted(n for n in os.listdir(self.path) if n.startswith("out-") and n.endswith(".seg"))
        expect = None
        for k, name in enumerate(names):
            newest = k == len(names) - 1
            fpath = os.path.join(self.path, name)
            with open(fpath, "rb") as f:
                data = f.read()
            off = 0
            seg_first = int(name[4:-4])
            if expect is not None and seg_first != expect:
                raise CorruptionError(f"{fpath}: segment starts at step {seg_first}, expected {expect}")
            while off < len(data):
                rec = self._parse(data, off, fpath)
                if rec is None:
                    if not newest:
                        raise CorruptionError(f"{fpath}: bad record at offset {off} of a sealed segment")
                    if self.readonly:  # a record being written (or a torn one the writer will cut off)
                        break
                    os.truncate(fpath, off)  # torn tail of the newest segment (invariant 2)
                    data = data[:off]
                    break
                step, length = rec
                want = seg_first if expect is None else expect
                if step != want:
                    raise CorruptionError(f"{fpath}: record for step {step} at offset {off}, expected {want}")
                self._index[step] = (name, off, length)
                expect = step + 1
                off += length
            if expect is None:
                expect = seg_first
            self._segments.append((seg_first, name))
        if self._segments:
            self.first = self._segments[0][0]
            self.last = expect if expect is not None else self.first
            if not self.readonly:
                self._open_tail(self._segments[-1][1])
        elif self.readonly:
            self.first = self.last = 0
        else:
            self._new_segment(0)

    def refresh(self) -> None:
        """A read-only log: pick up records appended (and segments dropped) by the writer since the last scan."""
        with self._lock:
            self._scan()

    def _parse(self, data: bytes, off: int, where: str) -> tuple[int, int] | None:
        if len(data) - off < _HEAD.size:
            return None
        magic, version, crc, step, n = _HEAD.unpack_from(data, off)
        if magic != _MAGIC:
            return None
        if version != FORMAT_VERSION:
            raise FormatVersionError(f"{where}: output record format version {version}, this build reads "
                                     f"{FORMAT_VERSION}")
        end = off + _HEAD.size + n
        if end > len(data):
            return None
        if zlib.crc32(data[off + _HEAD.size:end], zlib.crc32(struct.pack("<Q", step))) != crc:
            return None
        return step, _HEAD.size + n

    def _open_tail(self, name: str) -> None:
        fpath = os.path.join(self.path, name)
        self._fd = os.open(fpath, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size

    def _new_segment(self, first_step: int) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
        name = _seg_name(first_step)
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.fsync(fd)
        _fsync_dir(self.path)
        self._fd, self._size = fd, 0
        self._segments.append((first_step, name))
        if len(self._segments) == 1:
            self.first = self.last = first_step

    # ---- write ----

    def _encode(self, step: int, outputs: dict[str, ZSet], inputs: list) -> list:
        """The record of ``step`` as a list of buffers to write back to back (gathered, not joined: the outputs
        are not copied again after Arrow wrote them)."""
        meta = json.dumps({"step": step, "outputs": self.names, "inputs": inputs}).encode("utf-8")
        chunks: list = [_U32.pack(len(self.names) + 1), _U32.pack(len(meta)), meta]
        for n in self.names:
            head, blob = encode_zset_parts(outputs[n].consolidate())
            chunks += [_U32.pack(len(head) + blob.size), head, blob]
        crc, size = zlib.crc32(struct.pack("<Q", step)), 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
            size += len(c) if isinstance(c, bytes) else c.size
        return [_HEAD.pack(_MAGIC, FORMAT_VERSION, crc, step, size)] + chunks

    def write(self, step: int, outputs: dict[str, ZSet], inputs: list | None = None) -> str:
        """Record ``outputs`` (``{name: change}``) of ``step``; returns 'discarded', 'replayed' or 'appended'.

        ``inputs`` describes the input that produced the step (see :meth:`inputs_of`).
        """
        if self.readonly:
            raise ValueError("output log: opened read-only")
        with self._lock:
            if step < self.first:
                return "discarded"
            if step < self.last:
                if self.check:
                    old = self._read_locked(step)[1]
                    for n in self.names:
                        if not (old[n] == outputs[n]):
                            raise ReplayMismatchError(
                                f"replayed step {step} produced a different change of output {n!r} than the "
                                f"one in the output log ({len(outputs[n].consolidate())} vs {len(old[n])} rows)")
                return "replayed"
            if step > self.last:
                raise ValueError(f"output log: write of step {step} but the next step is {self.last}")
            rec = self._encode(step, outputs, inputs or [])
            length = _HEAD.size + _HEAD.unpack_from(rec[0])[4]
            if self._size >= self.segment_bytes:
                self._new_segment(step)
            name = self._segments[-1][1]
            _write_all(self._fd, rec, length)
            if self.sync:
                os.fsync(self._fd)
            self._index[step] = (name, self._size, length)
            self._size += length
            self.last = step + 1
            return "appended"

    def flush(self) -> None:
        """fsync the newest segment (a no-op for durability when ``sync=True``)."""
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    # ---- read ----

    def _read_locked(self, step: int) -> tuple[dict, dict[str, ZSet]]:
        name, off, length = self._index[step]
        fpath = os.path.join(self.path, name)
        try:
            with open(fpath, "rb") as f:
                f.seek(off)
                data = f.read(length)
        except FileNotFoundError:
            raise LookupError(f"output step {step} was dropped by retention") from None
        rec = self._parse(data, 0, fpath)
        if rec is None or rec[0] != step:
            raise CorruptionError(f"{fpath}: record of step {step} at offset {off} fails its checksum")
        body = data[_HEAD.size:]
        (count,), pos, parts = _U32.unpack_from(body), _U32.size, []
        for _ in range(count):
            (n,) = _U32.unpack_from(body, pos)
            parts.append(body[pos + 4:pos + 4 + n])
            pos += 4 + n
        meta = json.loads(parts[0].decode("utf-8"))
        if sorted(meta["outputs"]) != sorted(self.names) or len(parts) != len(self.names) + 1:
            raise CorruptionError(f"{fpath}: step {step} holds outputs {meta['outputs']}, expected {self.names}")
        zs = {n: decode_zset(p, self.schemas[n], f"{fpath} step {step} output {n}")
              for n, p in zip(meta["outputs"], parts[1:])}
        return meta, zs

    def get(self, step: int) -> dict[str, ZSet]:
        """Every output's change of ``step``; KeyError if the step is not (or no longer) in the log."""
        with self._lock:
            if not self.first <= step < self.last:
                raise KeyError(f"output step {step} is not in the log (it holds {self.first}..{self.last})")
            return self._read_locked(step)[1]

    def inputs_of(self, step: int) -> list[dict]:
        """The input that produced ``step``: ``[{"handle", "producer", "first_seq", "last_seq", "pushes"}]``."""
        with self._lock:
            if not self.first <= step < self.last:
                raise KeyError(f"output step {step} is not in the log (it holds {self.first}..{self.last})")
            return self._read_locked(step)[0]["inputs"]

    def read(self, name: str, from_step: int = 0) -> Iterator[tuple[int, ZSet]]:
        """Yields ``(step, change of output name)`` for every step from ``from_step`` to the current end, once each.

        Raises KeyError for an unknown output and LookupError if ``from_step`` was dropped by retention.
        """
        if name not in self.schemas:
            raise KeyError(f"unknown output {name!r}; outputs are {self.names}")
        if from_step < self.first:
            raise LookupError(f"output steps below {self.first} were dropped by retention; asked from {from_step}")
        step = from_step
        while True:
            with self._lock:
                if step >= self.last:
                    return
                z = self._read_locked(step)[1][name]
            yield step, z
            step += 1

    # ---- retention ----

    def truncate_below(self, step: int) -> int:
        """Drops whole segments whose steps are all below ``step`` (never the newest); returns how many."""
        dropped = 0
        with self._lock:
            while len(self._segments) > 1 and self._segments[1][0] <= step:
                _, name = self._segments.pop(0)
                os.unlink(os.path.join(self.path, name))
                for s in [s for s, v in self._index.items() if v[0] == name]:
                    del self._index[s]
                dropped += 1
            if dropped:
                _fsync_dir(self.path)
                self.first = self._segments[0][0]
        return dropped

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, n)) for _, n in self._segments)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
