"""Shared helpers of the output log tests: the deterministic per-step outputs, a parser of step-log segment frames, and directory snapshots."""

from __future__ import annotations

import functools
import json
import os
import struct
import zlib

import pyarrow as pa

from dbsp_core.codec import encode_zset
from dbsp_core.zset import ZSet

SCHEMAS = {"counts": pa.schema([("k", pa.int64()), ("n", pa.int64())]),
           "names": pa.schema([("s", pa.utf8())])}


@functools.lru_cache(maxsize=None)
def _outputs(step: int, rows: int | None) -> tuple[tuple[str, ZSet], ...]:
    n = rows if rows is not None else 1 + (step * 7) % 23
    counts = ZSet.from_rows([(step, i) for i in range(n)], SCHEMAS["counts"],
                            weights=[1 + (i % 3) for i in range(n)])
    names = ZSet.from_rows([(f"s{step}-{'x' * (step % 11)}",)], SCHEMAS["names"], weights=[-1 if step % 2 else 1])
    return (("counts", counts), ("names", names))


def outputs(step: int, rows: int | None = None) -> dict[str, ZSet]:
    """The outputs of ``step``: a pure function of it (sizes vary so records straddle segment boundaries). Made
    once per (step, rows) and process (ZSets are immutable; the crash tests ask for the same steps thousands of
    times), in a new dict at each call."""
    return dict(_outputs(step, rows))


@functools.lru_cache(maxsize=None)
def _output_dicts(step: int) -> tuple[tuple[str, dict], ...]:
    return tuple((n, z.to_dict()) for n, z in _outputs(step, None))


def big_rows(step: int) -> int | None:
    """Row counts of the reader-process test: every tenth step is large (a record of a few hundred KiB)."""
    return 6000 if step % 10 == 3 else None


def inputs(step: int) -> list[dict]:
    return [{"handle": "x", "producer": "p", "first_seq": step, "last_seq": step, "pushes": 1}]


def same_step(log, step: int) -> bool:
    """Whether the log holds exactly ``outputs(step)`` and ``inputs(step)`` for ``step``."""
    got, want = log.get(step), dict(_output_dicts(step))
    return all(got[n].to_dict() == want[n] for n in SCHEMAS) and log.inputs_of(step) == inputs(step)


def segments(path: str) -> list[str]:
    """The step log's segment files of a directory (20-digit names), oldest first."""
    return sorted(n for n in os.listdir(path) if len(n) == 24 and n.endswith(".seg") and n[:20].isdigit())


def frames(seg_path: str) -> list[dict]:
    """Every format-2 record frame of a segment, parsed with the byte layout of csrc/steplog.c (no checks)."""
    data = open(seg_path, "rb").read()
    assert data[:8] == b"DBSPSSEG" and struct.unpack_from("<I", data, 8)[0] == 2
    out, off = [], 32
    while off + 24 <= len(data):
        magic, length, mark = struct.unpack_from("<4sIQ", data, off)
        if magic != b"DSLR" or off + 24 + length > len(data):
            break
        (step,) = struct.unpack_from("<q", data, off + 24)
        out.append({"off": off, "end": off + 24 + length, "mark": mark, "step": step})
        off += 24 + length
    return out


def snapshot(path: str) -> dict[str, bytes]:
    """{file name: bytes} of every file of a directory."""
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def flip(path: str, offset: int, bit: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ bit]))


def body(step: int) -> bytes:
    """The record payload of ``step`` by the byte layout in outputlog.py's docstring (written independently)."""
    names = list(SCHEMAS)
    meta = json.dumps({"step": step, "outputs": names, "inputs": inputs(step)}).encode("utf-8")
    parts = [meta] + [encode_zset(outputs(step)[n].consolidate()) for n in names]
    return struct.pack("<I", len(parts)) + b"".join(struct.pack("<I", len(p)) + p for p in parts)


def write_format1(path: str, steps: range, per_segment: int) -> None:
    """A directory as the previous release's OutputLog left it: ``out-<first step>.seg`` files of DOUT records."""
    os.makedirs(path, exist_ok=True)
    for k in range(0, len(steps), per_segment):
        with open(os.path.join(path, f"out-{steps[k]:016d}.seg"), "wb") as f:
            for step in steps[k:k + per_segment]:
                b = body(step)
                crc = zlib.crc32(b, zlib.crc32(struct.pack("<Q", step)))
                f.write(struct.pack("<4sBIQI", b"DOUT", 1, crc, step, len(b)) + b)
