"""Reads, in place and read-only, the output segments that format 1 of the output log wrote (``out-<first step>.seg``, records framed by magic ``DOUT``), so a directory written by that release opens and continues.

Invariants (enforced here):
  1. Nothing here writes, cuts or creates a file; only :meth:`Format1Segments.drop_below` removes whole
     segments (retention), oldest first.
  2. The segments hold consecutive steps, one record each, from the first segment's name on; a bad frame in
     any segment but the newest raises CorruptionError. In the newest, a bad frame ends the readable part:
     format 1 cut such a torn tail on open, and since format 2 never appends here the bytes after it are never
     read again (format 1 had no way to tell a torn write from damage there either).

Byte layout of a format-1 segment (little-endian): records back to back, each ``"DOUT"`` | u8 version (1) |
u32 CRC-32 (zlib) over the 8 step bytes and the body | u64 step | u32 body length | body. The body is the one
dbsp_core/storage/outputlog.py still writes (see there).
"""

from __future__ import annotations

import os
import struct
import zlib

from dbsp_core.errors import CorruptionError, FormatVersionError
from dbsp_core.storage.directory import fsync_dir
from dbsp_core.storage.formats import FORMAT1_OUTPUT_MAGIC as MAGIC

__all__ = ["Format1Segments", "is_format1_segment"]

VERSION = 1
_HEAD = struct.Struct("<4sBIQI")  # magic, version, crc32(step bytes + body), step, body length


def is_format1_segment(name: str) -> bool:
    """Whether a file name is a format-1 output segment: ``out-`` + 16 digits (its first step) + ``.seg``."""
    return len(name) == 24 and name.startswith("out-") and name.endswith(".seg") and name[4:20].isdigit()


class Format1Segments:
    """The format-1 segments of an output directory: steps ``first..last`` (``first == last`` when there are none).

    >>> import tempfile
    >>> Format1Segments(tempfile.mkdtemp()).segments
    []
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.segments: list[tuple[int, str]] = []  # (first step, file name), ascending
        self._index: dict[int, tuple[str, int, int]] = {}  # step -> (file name, offset, frame length)
        self.first = self.last = 0
        self.scan()

    def scan(self) -> None:
        """Read every format-1 segment of the directory (again)."""
        index: dict[int, tuple[str, int, int]] = {}
        segments: list[tuple[int, str]] = []
        try:
            names = sorted(n for n in os.listdir(self.path) if is_format1_segment(n))
        except FileNotFoundError:  # a new log: its directory is created by the step log
            names = []
        expect = None
        for k, name in enumerate(names):
            fpath = os.path.join(self.path, name)
            try:
                with open(fpath, "rb") as f:
                    data = f.read()
            except FileNotFoundError:  # dropped by retention while we listed: it was older than what follows
                index, segments, expect = {}, [], None
                continue
            seg_first = int(name[4:20])
            if expect is not None and seg_first != expect:
                raise CorruptionError(f"{fpath}: segment starts at step {seg_first}, expected {expect}")
            off = 0
            while off < len(data):
                rec = parse(data, off, fpath)
                if rec is None:
                    if k != len(names) - 1:
                        raise CorruptionError(f"{fpath}: bad record at offset {off} of a sealed segment")
                    break  # invariant 2: the torn tail of the newest format-1 segment
                step, length = rec
                want = seg_first if expect is None else expect
                if step != want:
                    raise CorruptionError(f"{fpath}: record for step {step} at offset {off}, expected {want}")
                index[step] = (name, off, length)
                expect = step + 1
                off += length
            if expect is None:
                expect = seg_first
            segments.append((seg_first, name))
        self._index, self.segments = index, segments
        self.first = segments[0][0] if segments else 0
        self.last = expect if expect is not None else self.first

    def __contains__(self, step: int) -> bool:
        return step in self._index

    def body(self, step: int) -> tuple[bytes, str]:
        """The body of ``step``'s record and the file it came from; LookupError if its segment was dropped."""
        name, off, length = self._index[step]
        fpath = os.path.join(self.path, name)
        try:
            with open(fpath, "rb") as f:
                f.seek(off)
                data = f.read(length)
        except FileNotFoundError:
            raise LookupError(f"output step {step} was dropped by retention") from None
        rec = parse(data, 0, fpath)
        if rec is None or rec[0] != step:
            raise CorruptionError(f"{fpath}: record of step {step} at offset {off} fails its checksum")
        return data[_HEAD.size:], fpath

    def drop_below(self, step: int, next_first: int | None) -> int:
        """Removes whole segments whose steps all lie below ``step``; ``next_first`` is the first step after the
        newest segment (None if nothing follows it, which keeps that one). Returns how many were removed."""
        dropped = 0
        while self.segments:
            following = self.segments[1][0] if len(self.segments) > 1 else next_first
            if following is None or following > step:
                break
            _, name = self.segments.pop(0)
            os.unlink(os.path.join(self.path, name))
            for s in [s for s, v in self._index.items() if v[0] == name]:
                del self._index[s]
            dropped += 1
        if dropped:
            fsync_dir(self.path)
            self.first = self.segments[0][0] if self.segments else self.last
        return dropped

    def disk_bytes(self) -> int:
        total = 0
        for _, name in self.segments:
            try:
                total += os.path.getsize(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
        return total


def parse(data: bytes, off: int, where: str) -> tuple[int, int] | None:
    """(step, frame length) of the valid record at ``data[off:]``, or None if it is short or bad."""
    if len(data) - off < _HEAD.size:
        return None
    magic, version, crc, step, n = _HEAD.unpack_from(data, off)
    if magic != MAGIC:
        return None
    if version != VERSION:
        raise FormatVersionError(f"{where}: output record format version {version}, this build reads {VERSION}")
    end = off + _HEAD.size + n
    if end > len(data):
        return None
    if zlib.crc32(data[off + _HEAD.size:end], zlib.crc32(struct.pack("<Q", step))) != crc:
        return None
    return step, _HEAD.size + n
