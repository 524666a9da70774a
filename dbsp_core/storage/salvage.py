"""What survives of a damaged step log: every valid record of every segment, read byte by byte in Python by the format of csrc/steplog.c, and the byte ranges between them that hold none (for ``dbsp repair`` and the rebuild of a damaged output log).

Invariants (enforced here):
  1. Nothing here writes: it reads the segment files of one directory.
  2. A record is taken only if it passes the validity rule of csrc/steplog.c (frame inside the file, body
     length in range, both checksums, handle and producer lengths inside the body, step not below the
     previous record's); after an invalid byte the scan looks for the next frame that passes it (format 2
     frames start with the magic ``DSLR`` and carry two CRC-32Cs, so a false match is never met in practice),
     so the records after damage survive.
  3. Every byte after a segment's header is either in a valid record or in one of ``damaged`` ranges; a
     range at the end of the newest segment with no valid record after it is a torn tail (``torn``), which
     the log's own recovery cuts, not damage.
  4. Segment numbers are consecutive (csrc/steplog.c invariant 4): a number missing between two segment files
     is a lost segment, listed in ``missing`` (its name); every one of its records is lost. Missing segments
     before the first file cannot be told apart from truncation and are not listed.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

from dbsp_core import _storage
from dbsp_core.storage.formats import STEPLOG_RECORD_MAGIC, STEPLOG_SEGMENT_MAGIC, is_segment_name, segment_name

__all__ = ["Record", "Salvaged", "salvage", "segment_files"]

_SEG_HDR = 32
_F1, _F2 = 8, 24
_BODY = 24
_MAX_BODY = _BODY + 2 * 65535 + _storage.MAX_PAYLOAD
_U32 = struct.Struct("<I")
_F2HEAD = struct.Struct("<4sIQII")  # magic, body length, mark, body crc, header crc
_BODYHEAD = struct.Struct("<qQHHI")  # step, seq, handle length, producer length, zero


class Record(NamedTuple):
    """One valid record, where it was found."""

    step: int
    handle: str
    producer: str
    seq: int
    payload: bytes
    segment: str  # file name
    offset: int


class Salvaged(NamedTuple):
    """The valid records of a log in log order, the damaged byte ranges and the torn tail (invariant 3)."""

    records: list[Record]
    damaged: list[tuple[str, int, int]]  # (segment file name, first byte, end byte)
    torn: tuple[str, int, int] | None
    segments: list[str]  # every segment file, oldest first
    missing: list[str] = []  # segment files missing between two that exist (invariant 4), oldest first


def segment_files(path: str) -> list[str]:
    """The segment file names of a step-log directory (20 digits and ``.seg``), oldest first."""
    names = [n for n in os.listdir(path) if is_segment_name(n)]
    return sorted(names)


def _frame(fmt: int, data: bytes, off: int) -> tuple[int, Record | None]:
    """(frame length, record) of a valid record at ``off``, or (0, None)."""
    n = len(data)
    if fmt == 1:
        if off + _F1 > n:
            return 0, None
        (blen,) = _U32.unpack_from(data, off)
        if not _BODY <= blen <= _MAX_BODY or off + _F1 + blen > n:
            return 0, None
        if _storage.crc32c(data[off + _F1:off + _F1 + blen], _storage.crc32c(data[off:off + 4])) != \
                _U32.unpack_from(data, off + 4)[0]:
            return 0, None
        hdr = _F1
    else:
        if off + _F2 > n:
            return 0, None
        magic, blen, mark, bcrc, hcrc = _F2HEAD.unpack_from(data, off)
        if magic != STEPLOG_RECORD_MAGIC or _storage.crc32c(data[off:off + 20]) != hcrc:
            return 0, None
        if not _BODY <= blen <= _MAX_BODY or off + _F2 + blen > n or not _SEG_HDR <= mark <= off:
            return 0, None
        if _storage.crc32c(data[off + _F2:off + _F2 + blen]) != bcrc:
            return 0, None
        hdr = _F2
    b = off + hdr
    step, seq, hl, pl, _ = _BODYHEAD.unpack_from(data, b)
    if hl + pl > blen - _BODY:
        return 0, None
    h = data[b + _BODY:b + _BODY + hl].decode("utf-8", "surrogateescape")
    p = data[b + _BODY + hl:b + _BODY + hl + pl].decode("utf-8", "surrogateescape")
    return hdr + blen, Record(step, h, p, seq, bytes(data[b + _BODY + hl + pl:b + blen]), "", off)


def _header_format(data: bytes, num: int) -> int | None:
    if len(data) < _SEG_HDR or data[:8] != STEPLOG_SEGMENT_MAGIC or _storage.crc32c(data[:28]) != _U32.unpack_from(data, 28)[0]:
        return None
    fmt, hlen, n = struct.unpack_from("<IIQ", data, 8)
    return fmt if fmt in (1, 2) and hlen == _SEG_HDR and n == num else None


def salvage(path: str) -> Salvaged:
    """Every valid record of the step log in directory ``path`` and the damaged ranges (invariants 1-3).

    >>> import tempfile, os
    >>> from dbsp_core.storage import StepLog
    >>> d = os.path.join(tempfile.mkdtemp(), "log")
    >>> with StepLog(d) as log:
    ...     for s in range(3): log.append(s, "t", b"x" * 40, producer="p", seq=s)
    >>> seg = os.path.join(d, segment_files(d)[0])
    >>> with open(seg, "r+b") as f: _ = f.seek(150); _ = f.write(b"!")  # inside the second record (122..212)
    >>> got = salvage(d)
    >>> [r.seq for r in got.records], [(a, b) for _, a, b in got.damaged], got.torn
    ([0, 2], [(122, 212)], None)
    """
    records: list[Record] = []
    damaged: list[tuple[str, int, int]] = []
    torn = None
    names = segment_files(path)
    floor = None
    for i, name in enumerate(names):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        fmt = _header_format(data, int(name[:20]))
        start = _SEG_HDR
        if fmt is None:  # a damaged header: the records after it are format 2 (what the writer appends)
            fmt = 2
            if len(data) > 0:
                damaged.append((name, 0, min(len(data), _SEG_HDR)))
        off, bad = start, None
        while off < len(data):
            n, rec = _frame(fmt, data, off)
            if rec is not None and (floor is None or rec.step >= floor):
                if bad is not None:
                    damaged.append((name, bad, off))
                    bad = None
                records.append(rec._replace(segment=name))
                floor = rec.step
                off += n
                continue
            if bad is None:
                bad = off
            if fmt == 2:
                nxt = data.find(STEPLOG_RECORD_MAGIC, off + 1)
                off = nxt if nxt >= 0 else len(data)
            else:
                off += 1
        if bad is not None:
            if i == len(names) - 1:
                torn = (name, bad, len(data))
            else:
                damaged.append((name, bad, len(data)))
    nums = [int(n[:20]) for n in names]
    missing = [segment_name(k) for a, b in zip(nums, nums[1:]) for k in range(a + 1, b)]
    return Salvaged(records, damaged, torn, names, missing)
