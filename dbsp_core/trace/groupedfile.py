"""Batch file format version 2 (``BATCH_FILE_GROUPED_VERSION``, dbsp_core/storage/formats.py): the rows in groups of
whole keys, one Arrow record batch a slot of ``G`` bytes aligned to ``G`` in the file, and a group index, so that a
key's rows are read by one pread(2) of its group's slots (the design and what it is for: dbsp_core/trace/batchfile.py,
"Format version 2"; measured first by bench/probe_groups.py). This module writes it and reads it; format 1 stays
batchfile.py's, and :func:`verify` here checks either (``dbsp inspect`` calls it).

Format, against version 1 (batchfile.py's docstring), all integers little-endian::

    [0, 64)          header (``HEADER2``): magic "DBSPBTCH" | version u32 = 2 | flags u32 (bit 0
                     ``FLAG_SECTION_CRCS``, bit 1 ``FLAG_GROUPED``: both set) | arrow offset u64 (= 64) | arrow length
                     u64 | rows u64 | CRC-32C of the page-CRC section u32 | CRC-32C of the group index and filter
                     sections u32 | slot size G u32 (a power of two, at least 4096) | groups N u64 | CRC-32C of bytes
                     0..59 u32
    [64, 64 + A)     an Arrow IPC file (version 1's schema and metadata) of N record batches, one a group, in index
                     order. A group is a run of whole keys (of whole key hashes: the rows of a key hash are never
                     split) whose record-batch message fits one G-byte slot; a key hash whose rows alone do not fit
                     takes a run of slots, alone. Each message starts on a slot boundary of the file (offset a
                     multiple of G); the gap to it is zeros. The Arrow footer's blocks say where each message is, so
                     any Arrow reader reads the groups (and skips the gaps)
    [.., +24N)       group index (where version 1 has its fence; the footer's fence offset and count name it): per
                     group its first key hash u64, first row u64, first slot u32 (file offset / G), slots u32
    [.., +8B)        Bloom filter, as version 1
    [.., +4P)        CRC-32C of each slot of the Arrow section (G bytes, where version 1 has one a 64 KiB ``PAGE``),
                     cut at multiples of G of the file (not of the Arrow section as in version 1): CRC page 0 is the
                     Arrow bytes [0, G - 64), page i the file's bytes [i G, (i + 1) G). So a group's first read checks
                     its own slots, not 64 KiB around them (with 64 KiB pages, measured: a 1k-key step of a 10M-row
                     file read and checked ~1,000 pages of 64 KiB the first time, 20-40 ms a step)
    [EOF-64, EOF)    footer: version 1's, version 2, its fence offset and count naming the group index

Invariants (besides batchfile.py's 1-4, which hold as they are: one streamed write through the VFS, temporary file,
fsync, rename, directory fsync; rows consolidated in index order; the filter holds every key hash; every byte under
a checksum):
  G1. The groups cover the rows in order, each a non-empty run of whole key hashes; group i's first row is the
      index's, its first key hash the row's; its message lies in its slots, and the next group's slots follow.
  G2. A reader checks header, footer, the page-CRC section and the index and filter sections on opening (they are
      read into memory: 24 + ~1.3 bytes a row), and every CRC page it reads before it decodes a byte of it: a
      damaged file raises CorruptionError naming the file, the part, and what to do (as version 1's).
  G3. A key hash's rows are all in the one group whose first key hash is the greatest not above it (G1: keys are
      whole in a group): :meth:`GroupedFile.lookup` reads those groups' slots in place from the file's mapping (G5),
      or by pread(2), adjacent ones in one call. The reads are decoded in C (csrc/groupdecode.c, ``DECODE_DEFAULT``): each slot read once
      (checked, if it is not yet, from the same bytes), each message's flatbuffer header, nodes and buffers checked
      against the slot and the writer's layout (a damaged one is CorruptionError, never a crash or other rows), the
      matching rows of all groups gathered into one record batch (each probed key hash found in its group by binary
      search; a group's key hashes checked ascending by the first lookup that reads it, flagged per group in
      ``GroupedFile.verified``, not again by later lookups); a schema or message the C decoder does not handle
      takes pyarrow's IPC reader (counted in ``DECODE_COUNTS``).
  G4. Only columns whose bytes a row's share can be bounded are grouped (fixed-width, boolean, string and binary):
      a batch with another column type is written as version 1 by :func:`dbsp_core.trace.batchfile.write_batch`.
  G5. Mapped reads (``READ_MAPPED``, ``DBSP_SPILL_GROUPED_MAP``): a lookup not told the file is cold (``advise``)
      reads its groups in place from one read-only MADV_RANDOM mapping of the whole file, opened by the first such
      lookup and kept until the file is closed (:meth:`GroupedFile.mapping`): no pread and no copy of a group, only
      its message's header, key hashes and the rows picked are read (and, the first time, its slots for their CRC,
      G2). Each group's bytes are checked to lie within the mapping before a byte is read, and the file's size
      against the mapping's before each lookup (a file cut under the mapping is CorruptionError, not a bus error);
      the mapping is registered as one of the file (batchfile.py invariant 9), so the batch store truncates the file
      only once it is gone. Each lookup flags the 2 MiB units of address space it read (:attr:`GroupedFile.units`),
      which the batch store takes at each enforce and counts and drops as format 1's (spill.py invariants 12 and
      18). The writer hands the file over in whole aligned 2 MiB (``GATHER``), so that its page cache is in 2 MiB
      folios a read fault maps with one PMD entry: a dropped mapping costs a 1k-key read ~280 faults (~0.4 ms of
      sys, against ~1.1 ms for its preads), where 1 MiB writes left folios of 4 KiB-1 MiB and ~750 faults
      (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-f2map). Whole reads (a merge's input, ``read_all``) read by pread.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from array import array
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.envvars import settings
from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError
from dbsp_core.storage.formats import BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_GROUPED_VERSION, BATCH_FILE_MAGIC
from dbsp_core.trace import batchfile

__all__ = ["write_grouped", "GroupedWriter", "open_grouped", "GroupedFile", "verify_grouped", "verify", "file_version",
           "groupable",
           "GROUP_SLOT", "HEADER2",
           "GROUP_INDEX", "FLAG_GROUPED", "open_rows", "WholeRows", "groupable_schema"]

GROUP_SLOT = 4096  # the slot size G by default (bench/history/RESULTS-2026-11-28-to-2026-12-02.md "Row-grouped batch files, measured before building")
HEADER2 = struct.Struct("<8sIIQQQIIIQI")  # 64 bytes
FLAG_GROUPED = 2  # header flags bit 1
GROUP_INDEX = np.dtype([("key_hash", "<u8"), ("row", "<u8"), ("slot", "<u4"), ("slots", "<u4")])
assert HEADER2.size == 64 and GROUP_INDEX.itemsize == 24


def _bf():
    return batchfile


# How a lookup's groups are decoded: "c" (bindings/storage.pyx grouped_gather over csrc/groupdecode.c: the slots read
# once, checked, parsed and their matching rows gathered into one set of buffers, no per-group Arrow object) or
# "arrow" (pyarrow's IPC stream reader over the concatenated messages, then combine and take: the reference path,
# which DBSP_SPILL_NATIVE=0 selects, as it does the spill store's; envvars.py). A file whose schema the C decoder
# does not handle, or a message it does not (a compressed body), takes the Arrow path whatever this says;
# DECODE_COUNTS counts the lookups and whole reads each path served ("fallback": the C path declined).
DECODE_DEFAULT = "c" if settings().spill_native else "arrow"
# How the C path's lookups read their groups (invariant G5): True (``DBSP_SPILL_GROUPED_MAP``, the default), in place
# from a mapping of the whole file kept between steps, but for a lookup told the file is cold (``advise``); False: by
# pread(2), the file never mapped. Whole reads (:meth:`GroupedFile.read_all`, ``_table``) read by pread either way.
READ_MAPPED = settings().spill_grouped_map
MAP_UNIT = 2 << 20  # the units of address space a mapped read flags (csrc/groupdecode.h DBSP_GDEC_UNIT_SHIFT)
DECODE_COUNTS = {"c": 0, "arrow": 0, "fallback": 0}
_GCOL_FIXED, _GCOL_BOOL, _GCOL_VAR32, _GCOL_VAR64 = 0, 1, 2, 3  # csrc/groupdecode.h DBSP_GCOL_*


def _gather_kinds(schema: pa.Schema) -> tuple[np.ndarray, np.ndarray] | None:
    """Each column's kind and value width for the C decoder (csrc/groupdecode.h), or None when a column's type is not
    one it handles: fixed-width (integers, floats, temporal, decimals, fixed-size binary), boolean, string and binary
    (32- and 64-bit offsets), none of them dictionary-encoded, nested or an extension."""
    kind, width = [], []
    for f in schema:
        t = f.type
        if pa.types.is_boolean(t):
            kind.append(_GCOL_BOOL)
            width.append(0)
        elif pa.types.is_string(t) or pa.types.is_binary(t):
            kind.append(_GCOL_VAR32)
            width.append(0)
        elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
            kind.append(_GCOL_VAR64)
            width.append(0)
        elif (not pa.types.is_dictionary(t) and not pa.types.is_nested(t) and not isinstance(t, pa.ExtensionType)
              and t.num_buffers == 2 and t.bit_width % 8 == 0 and t.bit_width > 0
              and (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_temporal(t)
                   or pa.types.is_decimal(t) or pa.types.is_fixed_size_binary(t))):
            kind.append(_GCOL_FIXED)
            width.append(t.bit_width // 8)
        else:
            return None
    return np.array(kind, dtype=np.int32), np.array(width, dtype=np.int32)


# ---- cutting the groups (invariant G1) ----

def _row_bits(arr: pa.Array) -> tuple[np.ndarray | int, int, int] | None:
    """What ``arr``'s rows take in a record batch message: (bits a row, an array or a constant; buffers; bytes a
    group adds at most besides, for padding, a bitmap's last byte and a variable-width column's last offset); None
    for a type this does not bound (invariant G4)."""
    t = arr.type
    nbuf = len(arr.buffers())
    extra = 8 * nbuf + 1  # each buffer padded to 8, a bitmap's partial byte
    if pa.types.is_boolean(t):
        return 2, nbuf, extra
    if len(arr.buffers()) == 2 and pa.types.is_primitive(t) and t.bit_width % 8 == 0:
        return t.bit_width + 1, nbuf, extra
    if pa.types.is_decimal(t) and t.bit_width % 8 == 0:
        return t.bit_width + 1, nbuf, extra
    wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    if wide or pa.types.is_string(t) or pa.types.is_binary(t):
        offs = np.frombuffer(arr.buffers()[1], dtype=np.int64 if wide else np.int32)
        offs = offs[arr.offset:arr.offset + len(arr) + 1]
        w = 64 if wide else 32
        return np.diff(offs).astype(np.int64) * 8 + (w + 1), nbuf, extra + w // 8 + 1
    return None


def groupable(batch: Any) -> bool:
    """Whether ``batch``'s data columns are all of types a group's size is bounded for (invariant G4)."""
    return all(_row_bits(_bf()._one_chunk(c)) is not None for c in batch.zset.data.combine_chunks().columns)


def groupable_schema(schema: pa.Schema) -> bool:
    """Whether every column of ``schema`` is of a type a group's size is bounded for (invariant G4; what
    :func:`groupable` says of a batch of this schema, without reading its rows)."""
    for f in schema:
        t = f.type
        if pa.types.is_boolean(t) or pa.types.is_string(t) or pa.types.is_binary(t) or \
                pa.types.is_large_string(t) or pa.types.is_large_binary(t):
            continue
        if pa.types.is_dictionary(t) or pa.types.is_nested(t) or isinstance(t, pa.ExtensionType):
            return False
        if not ((t.num_buffers == 2 and pa.types.is_primitive(t) and t.bit_width % 8 == 0)
                or (pa.types.is_decimal(t) and t.bit_width % 8 == 0)):
            return False
    return True


def _cut(rb: pa.RecordBatch, kh: np.ndarray, slot: int) -> np.ndarray | None:
    """The first row of each group of ``rb`` (key hashes ``kh``, ascending) and its row count last (an int64 array of
    groups + 1 bounds): greedy, each group the most whole key hashes whose message is at most ``slot`` bytes by an
    upper bound of its size (the message's metadata, measured on no rows, plus each buffer's bytes and padding), a
    key hash too big alone. None: a column of a type not bounded (invariant G4)."""
    n = rb.num_rows
    bits: np.ndarray | int = 0
    extra = 0
    for c in rb.columns:
        got = _row_bits(c)
        if got is None:
            return None
        b, _, e = got
        bits = bits + b
        extra += e
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    meta = pa.ipc.get_record_batch_size(rb.slice(0, 1))  # (a row's body too: an upper bound; a slice of no rows
    budget = 8 * (slot - meta - extra)  # is written with its whole buffers)
    if budget <= 0:
        raise ValueError(f"a slot of {slot} bytes holds no row of {rb.num_columns} columns; use a larger one")
    per = np.broadcast_to(np.asarray(bits, dtype=np.int64), (n,))
    cum = np.concatenate(([0], np.cumsum(per)))
    ks = np.concatenate(([0], np.flatnonzero(kh[1:] != kh[:-1]) + 1, [n])).astype(np.int64)  # key hash runs
    ck = cum[ks]
    # from each key hash run i, the run a group starting there ends before: the last whose start fits the budget
    # (one searchsorted for every run), at least the next (a key hash too big alone)
    nxt = np.maximum(np.searchsorted(ck, ck + budget, "right") - 1, np.arange(1, len(ks) + 1)).tolist()
    out = [0]
    i, last = 0, len(ks) - 1
    while i < last:  # a group at a time (~100 rows of 40 bytes): no Python per row
        i = nxt[i]
        out.append(i)
    return ks[out]


# ---- writing ----

GATHER = 4 << 20  # bytes of placed messages gathered before a write to the page sink (one pwrite and one CRC pass);
# the write hands over whole 2 MiB of the file (batchfile.FOLIO_ALIGN) and keeps the rest, so that the page cache holds
# the file in 2 MiB folios, which a mapped read faults in as one PMD entry (invariant G3); 1 MiB writes left it in
# folios of 4 KiB-1 MiB: ~750 faults a 1k-key step, 3.4 ms, where 2 MiB folios take ~290 (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-f2map)
_EOS = b"\xff\xff\xff\xff\0\0\0\0"  # the Arrow IPC end-of-stream marker, which the Arrow file writer puts before its footer


def _footer(template: bytes, blocks: np.ndarray) -> bytes:
    """An Arrow file footer flatbuffer (without its length and magic) naming the record batch ``blocks`` (int64 rows:
    offset, metadata length, body length), made from ``template``, the footer pyarrow's file writer wrote for the same
    schema: its version and schema kept (the template's bytes copied whole, 8-aligned, so its offsets, which are
    relative, still hold), and a new Footer table put before it, pointing to them, to no dictionary, and to a vector
    of these blocks after it. Raises ValueError when the template is not a footer."""
    bf = _bf()
    foot = bf._fb_table(template, bf._fb_deref(template, 0))
    vpos, spos = bf._fb_field(template, foot, 0), bf._fb_field(template, foot, 1)
    if spos is None:
        raise ValueError("the template footer has no schema")
    version = struct.unpack_from("<h", template, vpos)[0] if vpos is not None else 0
    # [0] root uoffset | [4] vtable: 12 bytes, table 20, version at 16, schema at 4, dictionaries at 8, batches at 12
    # [16] table: soffset 12, schema, dictionaries, batches (uoffsets), version (i16), 2 pad | [40] the template
    # | dictionaries: count 0, 4 pad | batches: count, then 24-byte blocks at a multiple of 8
    blob = 40
    dicts = blob + ((len(template) + 7) & ~7)
    vec = dicts + 8 + 4  # (the count at 4 mod 8, the blocks 8-aligned)
    out = bytearray(vec + 4 + 24 * len(blocks))
    struct.pack_into("<IHHHHHH", out, 0, 16, 12, 20, 16, 4, 8, 12)
    struct.pack_into("<iIIIh", out, 16, 12, blob + bf._fb_deref(template, spos) - 20, dicts - 24, vec - 28, version)
    out[blob:blob + len(template)] = template
    struct.pack_into("<I", out, vec, len(blocks))
    out[vec + 4:] = np.ascontiguousarray(blocks, dtype="<i8").tobytes()
    return bytes(out)


def write_grouped(path: str, batch: Any, vfs: str = "posix", sync: bool = True, drop: Any = None,
                  slot: int = GROUP_SLOT) -> int | None:
    """Write ``batch`` (an IndexedZSet, consolidated, in index order) as a format-2 batch file at ``path`` through the
    VFS ``vfs``, in groups of whole key hashes, a group's message at a slot of ``slot`` bytes (invariant G1); returns
    the file's size, or None when a column's type is not grouped (invariant G4: nothing is written, the caller writes
    format 1). The write is batchfile.py's (invariant 1): one streamed pass through a ``_storage.FileWriter`` (its
    pieces cut at 2 MiB of the file), the sections, the header, the footer with its whole-file CRC combined from the
    parts, fsync (``sync``), rename, directory fsync (``sync``); an error is a StorageError naming the file and what to
    do, and leaves no temporary file. Python runs a group at a time (pyarrow serializes each group's message), not a
    row at a time. One :class:`GroupedWriter` given the whole batch."""
    if not groupable(batch):
        return None
    w = GroupedWriter(path, len(batch), vfs=vfs, drop=drop, slot=slot)
    try:
        w.add(batch)
        return w.finish(sync)
    except BaseException:
        w.abort()
        raise


class GroupedWriter:
    """A format-2 batch file written a piece at a time (a streamed merge's output, groupedmerge.py): :meth:`add` the
    rows in index order, pieces that never split a key hash's rows (invariant G1: a group is cut within a piece),
    then :meth:`finish`. Each group's record batch message is pyarrow's (``RecordBatch.serialize``: the bytes its IPC
    file writer writes), placed at its slot by Python a group (no Python a write of the Arrow writer, no Python a
    row); the Arrow file's head is ``ARROW1`` and the schema message, its footer made at :meth:`finish` from the one
    pyarrow writes for the schema (:func:`_footer`). What it keeps between pieces is the file's metadata (group index,
    Bloom filter sized for ``expect_rows`` rows, an upper bound, the blocks and the page CRCs) and at most ``GATHER``
    bytes of rows not yet handed to the VFS, never the rows written. The write is :func:`write_grouped`'s (invariant
    1: temporary file, fsync, rename, directory fsync); an error is a StorageError naming the file, and leaves no
    temporary file."""

    def __init__(self, path: str, expect_rows: int, vfs: str = "posix", drop: Any = None,
                 slot: int = GROUP_SLOT) -> None:
        if slot < 4096 or slot & (slot - 1) or slot > 1 << 20:
            raise ValueError(f"slot {slot}: a power of two from 4096 to 1 MiB")
        self.path, self.vfs, self.drop, self.slot = path, vfs, drop, slot
        self.bloom = np.zeros(_bf().bloom_words(max(1, int(expect_rows))), dtype=np.uint64)
        self.schema: pa.Schema | None = None
        self.rows = 0
        self.out: Any = None
        self.sink: Any = None  # batchfile's page sink (pieces through the VFS, page CRCs, whole CRC)
        self.buf = bytearray()  # placed messages and gaps not handed to the sink yet
        self.blocks = array("q")  # per group: Arrow-section offset, metadata and body lengths (24 bytes a group)
        self.first_hash: list[np.ndarray] = []
        self.first_row: list[np.ndarray] = []
        self.last_hash = -1
        self.done = False

    def _fail(self, e: BaseException) -> StorageError:
        self.abort()
        if isinstance(e, ValueError):
            return StorageError(0, f"writing batch file {self.path}: {e}; a bug: report it")
        code = getattr(e, "errno", None) or 0
        where = os.path.dirname(self.path) or "."
        hint = (f"free space in {where} or give the pipeline a spill_dir with room" if code == errno.ENOSPC
                else f"check the disk of {where}")
        return StorageError(code, f"writing batch file {self.path}: {getattr(e, 'strerror', None) or e}; {hint}")

    def _drain(self, last: bool = False) -> None:
        """Hand what is gathered to the page sink (one write: its pieces, CRCs and pwrites): up to the last multiple of
        ``FOLIO_ALIGN`` of the file it reaches, all of it when ``last``."""
        if self.buf:
            n = len(self.buf)
            if not last:
                fa = _bf().FOLIO_ALIGN
                n = (64 + self.sink.pos + n) // fa * fa - 64 - self.sink.pos if fa else n
                if n <= 0:
                    return
            data, self.buf = self.buf[:n], self.buf[n:]  # (a failed write's traceback may hold a view of it)
            self.sink.write(data)

    def add(self, batch: Any) -> None:
        """Append ``batch``'s rows (an IndexedZSet, consolidated, in index order, its key hashes above the last
        piece's: a key hash's rows in one piece) as groups of the file."""
        from dbsp_core import _storage

        if not len(batch) and self.schema is not None:
            return
        bf = _bf()
        schema, rb = bf._record_batch(batch)
        kh = np.ascontiguousarray(batch.key_hash, dtype=np.uint64)
        try:
            if self.schema is None:
                self.schema = schema
                self.out = _storage.FileWriter(self.path, self.vfs)
                self.sink = bf._PageSink(self.out, self.drop)
                self.sink.pbase, self.sink.page = 64, self.slot  # format 2's CRC pages are the file's slots
                self.buf += b"ARROW1\0\0"
                self.buf += schema.serialize()
            elif not schema.equals(self.schema, check_metadata=True):
                raise ValueError(f"a piece of schema {schema} after pieces of {self.schema}")
            if len(kh) and int(kh[0]) <= self.last_hash:
                raise ValueError("a piece whose first key hash is not above the last piece's")
            cuts = _cut(rb, kh, self.slot)
            if cuts is None:
                raise ValueError(f"a piece of a schema format 2 does not group ({schema})")
            slot, blocks = self.slot, self.blocks
            c = cuts.tolist()
            for g in range(len(c) - 1):  # a group at a time (~100 rows), its message pyarrow's, placed at its slot
                msg = rb.slice(c[g], c[g + 1] - c[g]).serialize()
                at = self.sink.pos + len(self.buf)
                gap = -(64 + at) % slot
                if gap:
                    self.buf += bytes(gap)
                meta = 8 + int.from_bytes(msg[4:8], "little")  # (the continuation marker, the length, the metadata)
                blocks.extend((at + gap, meta, msg.size - meta))
                self.buf += msg
                if len(self.buf) >= GATHER:
                    self._drain()
            self.first_hash.append(kh[cuts[:-1]])
            self.first_row.append(cuts[:-1] + self.rows)
            bf._bloom_add(self.bloom, kh)
            self.rows += len(batch)
            self.last_hash = int(kh[-1]) if len(kh) else self.last_hash
        except (OSError, pa.ArrowException, ValueError) as e:
            raise self._fail(e) from e

    def finish(self, sync: bool = True) -> int:
        """Write the Arrow footer, the sections, header and footer, fsync (``sync``), rename; returns the file's size. A
        writer given no row writes nothing (ValueError: the caller keeps an empty batch in memory)."""
        from dbsp_core import _storage

        if self.schema is None:
            raise ValueError(f"{self.path}: a format-2 file of no rows is never written")
        bf = _bf()
        try:
            ngroups = sum(len(x) for x in self.first_hash)
            if len(self.blocks) != 3 * ngroups:
                raise ValueError(f"{len(self.blocks) // 3} groups placed of {ngroups}")
            tsink = pa.BufferOutputStream()  # the footer pyarrow writes for this schema: its version and schema
            pa.ipc.new_file(tsink, self.schema).close()
            tmpl = tsink.getvalue().to_pybytes()
            tlen = struct.unpack_from("<i", tmpl, len(tmpl) - 10)[0]
            blocks = np.frombuffer(self.blocks, dtype=np.int64).reshape(-1, 3) if self.blocks else \
                np.zeros((0, 3), dtype=np.int64)
            fb = _footer(tmpl[len(tmpl) - 10 - tlen:len(tmpl) - 10], blocks)
            self.buf += _EOS
            self.buf += fb
            self.buf += struct.pack("<i", len(fb)) + b"ARROW1"
            self._drain(last=True)
            sink = self.sink
            sink.close()
            alen = sink.pos
            index = np.zeros(ngroups, dtype=GROUP_INDEX)
            index["key_hash"] = np.concatenate(self.first_hash)
            index["row"] = np.concatenate(self.first_row)
            index["slot"] = (64 + blocks[:, 0]) // self.slot
            index["slots"] = -(-(blocks[:, 1] + blocks[:, 2]) // self.slot)
            bloom = self.bloom
            idx_off, bloom_off, crc_off, end, size = _places(ngroups, len(bloom), alen, self.slot)
            sections = index.tobytes() + bloom.tobytes()
            crcs = sink.page_crcs()
            tail = bytes(idx_off - 64 - alen) + sections + crcs + bytes(end - crc_off - len(crcs))
            out = self.out
            out.pwrite(tail, 64 + alen)
            fields = (BATCH_FILE_MAGIC, BATCH_FILE_GROUPED_VERSION, bf.FLAG_SECTION_CRCS | FLAG_GROUPED, 64, alen,
                      self.rows, bf._crc(crcs), bf._crc(sections), self.slot, ngroups)
            head = HEADER2.pack(*fields, bf._crc(HEADER2.pack(*fields, 0)[:60]))
            out.pwrite(head, 0)
            whole = bf._crc(tail, bf.crc_combine(bf._crc(head), sink.whole, alen))  # not read back
            foot = (BATCH_FILE_FOOTER_MAGIC, BATCH_FILE_GROUPED_VERSION, bf.BLOOM_K, idx_off, ngroups, bloom_off,
                    len(bloom), crc_off, whole)
            out.pwrite(bf.FOOTER.pack(*foot, bf._crc(bf.FOOTER.pack(*foot, 0)[:60])), end)
            out.commit(sync)
            self.done = True
            return size
        except (OSError, pa.ArrowException, ValueError, struct.error) as e:
            raise self._fail(e) from e

    def memory_bytes(self) -> int:
        """Bytes this writer holds: the filter, the group index and blocks so far, the rows gathered and not handed
        over, the page CRCs."""
        sink = self.sink
        return int(self.bloom.nbytes + 16 * sum(len(x) for x in self.first_hash) + 8 * len(self.blocks)
                   + len(self.buf) + (4 * (sink.pos // self.slot + 1) if sink is not None else 0))

    def abort(self) -> None:
        """Give up: the temporary file removed (a crash of the fault VFS leaves it to the next open's sweep)."""
        from dbsp_core import _storage

        if self.done:
            return
        self.done = True
        try:
            if self.out is not None and not self.out.done:
                self.out.abort()
            else:
                _storage.file_remove(self.path + ".tmp", self.vfs)
        except OSError:
            pass


def _npages(alen: int, slot: int) -> int:
    """CRC pages of an Arrow section of ``alen`` bytes at 64, cut at multiples of the slot size of the file."""
    return (64 + alen + slot - 1) // slot


def _places(ngroups: int, nbloom: int, alen: int, slot: int) -> tuple[int, int, int, int, int]:
    """(group index, filter, page CRCs, footer offsets, file size) of a format-2 file."""
    idx_off = (64 + alen + 7) & ~7
    bloom_off = idx_off + GROUP_INDEX.itemsize * ngroups
    crc_off = bloom_off + 8 * nbloom
    end = (crc_off + 4 * _npages(alen, slot) + 7) & ~7
    return idx_off, bloom_off, crc_off, end, end + 64


# ---- reading ----

def _bad(path: str, what: str) -> CorruptionError:
    return CorruptionError(f"{path}: batch file damaged: {what} (format 2, row groups); the file cannot be read: "
                           f"restore the pipeline from its last checkpoint or the file from a copy")


class GroupedFile:
    """An open format-2 batch file (invariant G2): its descriptor, header fields, group index, Bloom filter and page
    CRCs in memory, a flag per CRC page checked, and the Arrow schema. Rows are read by :meth:`lookup` (the groups
    of some key hashes: in place from the file's mapping, invariant G5, or by pread(2)) and :meth:`read_all` (every
    group, one contiguous batch: a copy, by pread)."""

    def __init__(self, path: str, fd: int, size: int, rows: int, alen: int, slot: int, index: np.ndarray,
                 bloom: np.ndarray, bloom_k: int, page_crcs: np.ndarray) -> None:
        self.path, self.fd, self.size, self.rows, self.alen, self.slot = path, fd, size, rows, alen, slot
        self.bloom, self.bloom_k, self.page_crcs = bloom, bloom_k, page_crcs
        # the group index, held once, as the C lookup takes it (one array a field: each group's first key hash,
        # first slot, slots and rows; the file's structured form is :attr:`index`, made when asked for)
        self.first_hash = np.ascontiguousarray(index["key_hash"], dtype=np.uint64)
        self.g_slot = np.ascontiguousarray(index["slot"], dtype=np.int64)
        self.g_slots = np.ascontiguousarray(index["slots"], dtype=np.int64)
        starts = index["row"].astype(np.int64)
        self.g_rows = np.ascontiguousarray(np.append(starts[1:], rows) - starts)
        # a group's pages on average: what a lookup reads a group it finds, at most (the batch store counts them as
        # pages its reads missed in the cache, spill.py invariant 18, for the prefetch rule's share)
        self.group_pages = max(1, -(-int(self.g_slots.sum()) * slot // (len(self.g_slots) * mmap.PAGESIZE))) \
            if len(self.g_slots) else 0
        self.checked = np.zeros(len(page_crcs), dtype=bool)
        self.verified = np.zeros(len(self.first_hash), dtype=np.uint8)  # per group: its key hashes' order checked by
        # a C lookup's read (invariant G3: later lookups of it binary-search its rows)
        self.schema: pa.Schema | None = None
        self.key: tuple = ()
        self.rh_mode = "0"
        self.ndata = 0
        self.schema_msg = b""  # the Arrow schema message (a stream's first), read on opening
        self.msg_len = np.zeros(0, dtype=np.int64)  # per group, its message's bytes (the Arrow footer's blocks)
        self.kinds: tuple[np.ndarray, np.ndarray] | None = None  # the C decoder's column kinds (None: Arrow's path)
        self.decode = DECODE_DEFAULT
        self._data_schema: pa.Schema | None = None  # the data columns' schema (made at the first direct lookup)
        self.last_groups_read = -1  # the groups the last lookup read (tests compare it with groups_of)
        self.read_mapped = READ_MAPPED
        self.map: mmap.mmap | None = None  # the file's mapping, opened by the first mapped lookup (invariant G5)
        self.units: np.ndarray | None = None  # with it, a flag a MAP_UNIT of its address space a lookup read
        self.base = 0  # the mapping's address
        self.mapped_groups = 0  # groups mapped lookups read since the last take_units
        self.last_units = self.last_groups = 0  # what the last take_units took: units flagged, groups read

    def mapping(self) -> mmap.mmap | None:
        """The file's mapping for mapped lookups (invariant G5), opened at the first call: the whole file, read-only,
        MADV_RANDOM, registered as a mapping of the file (batchfile.py invariant 9: the store truncates a deleted
        file only once none is alive), with :attr:`units` (zeroed) and :attr:`base`; None once closed."""
        if self.map is None and self.fd >= 0:
            m = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
            batchfile.note_mapping(m, batchfile.file_key(os.fstat(self.fd)))
            advice = getattr(mmap, "MADV_RANDOM", None)
            if advice is not None:
                m.madvise(advice)
            at = np.frombuffer(m, dtype=np.uint8, count=1)
            self.base = int(at.ctypes.data)
            del at
            self.units = np.zeros((self.base % MAP_UNIT + self.size + MAP_UNIT - 1) // MAP_UNIT, dtype=np.uint8)
            self.map = m
        return self.map

    def take_units(self) -> np.ndarray | None:
        """The flags of the ``MAP_UNIT``s mapped lookups read since the last call (bool, one a unit), cleared; None
        when they read none (invariant G5: the batch store's count of mapped units, spill.py invariant 18). Sets
        :attr:`last_units` and :attr:`last_groups` (the groups those lookups read) for the store's back-off."""
        u = self.units
        self.last_groups, self.mapped_groups = self.mapped_groups, 0
        if u is None or not u.any():
            self.last_units = 0
            return None
        got = u.astype(bool)
        u[:] = 0
        self.last_units = int(np.count_nonzero(got))
        return got

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()  # (a lookup on another thread still reading it: BufferError, left to the collector)
            except BufferError:
                pass
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "GroupedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass

    @property
    def groups(self) -> int:
        return len(self.first_hash)

    def row_starts(self) -> np.ndarray:
        """Each group's first row (int64; the group index's ``row``, from the groups' row counts)."""
        return np.concatenate(([0], np.cumsum(self.g_rows)[:-1])).astype(np.int64) if self.groups else \
            np.zeros(0, dtype=np.int64)

    @property
    def index(self) -> np.ndarray:
        """The group index as the file holds it (``GROUP_INDEX`` records), made from the arrays held (a copy)."""
        out = np.zeros(self.groups, dtype=GROUP_INDEX)
        out["key_hash"], out["row"], out["slot"], out["slots"] = (self.first_hash, self.row_starts(), self.g_slot,
                                                                  self.g_slots)
        return out

    def memory_bytes(self) -> int:
        """Bytes this open file keeps (group index, first key hashes, filter, page CRCs, flags)."""
        return int(self.first_hash.nbytes + self.bloom.nbytes + self.page_crcs.nbytes
                   + self.checked.nbytes + self.verified.nbytes + self.msg_len.nbytes + self.g_slot.nbytes + self.g_slots.nbytes
                   + self.g_rows.nbytes)

    def _read(self, lo: int, hi: int) -> memoryview:
        """The file's bytes [lo, hi) of the Arrow section, read by one pread(2) widened to whole CRC pages, each page
        not checked yet checked (invariant G2); returns the bytes asked for."""
        page = self.slot
        plo, phi = lo // page, (hi - 1) // page + 1  # CRC pages of the file
        alo, ahi = max(64, plo * page), min(64 + self.alen, phi * page)
        todo = ~self.checked[plo:phi]
        if todo.any():
            rlo, rhi = alo, ahi
        else:
            rlo, rhi = lo, hi
        buf = os.pread(self.fd, rhi - rlo, rlo)
        if len(buf) != rhi - rlo:
            raise _bad(self.path, f"{rhi - rlo} bytes at {rlo} asked, {len(buf)} read: the file is short")
        mv = memoryview(buf)
        if todo.any():
            for p in np.flatnonzero(todo).tolist():
                i = plo + p
                a, b = max(64, i * page), min(64 + self.alen, (i + 1) * page)
                if _bf()._crc(mv[a - rlo:b - rlo]) != int(self.page_crcs[i]):
                    raise _bad(self.path, f"CRC page {i} of the Arrow section fails its CRC-32C")
            self.checked[plo:phi] = True
        return mv[lo - rlo:hi - rlo]

    def _read_schema(self) -> None:
        """Read (checking their CRC pages) the Arrow schema message and the Arrow footer's blocks: each group's
        message length (its metadata and body), which must lie where the group index says (invariant G1)."""
        head = self._read(64, 64 + min(self.alen, 16))
        if bytes(head[:6]) != b"ARROW1":
            raise _bad(self.path, "the Arrow section does not start with ARROW1")
        cont, mlen = struct.unpack_from("<Ii", head, 8)
        if cont != 0xFFFFFFFF or mlen <= 0 or mlen % 8 or 16 + mlen > self.alen:
            raise _bad(self.path, "the Arrow schema message's length does not fit")
        self.schema_msg = bytes(self._read(64 + 8, 64 + 16 + mlen))
        self.schema = pa.ipc.read_schema(pa.py_buffer(self.schema_msg))
        meta = self.schema.metadata or {}
        self.key = tuple(json.loads(meta[b"dbsp.key"]))
        self.rh_mode = meta.get(b"dbsp.row_hash", b"0").decode()
        self.ndata = len(self.schema) - (3 if self.rh_mode == "1" else 2)
        end = 64 + self.alen
        tail = self._read(end - 10, end)
        flen = struct.unpack_from("<i", tail, 0)[0]
        if bytes(tail[4:]) != b"ARROW1" or flen <= 0 or flen > self.alen - 10:
            raise _bad(self.path, "the Arrow footer's length does not fit")
        footer = bytes(self._read(end - 10 - flen, end - 10))
        try:
            bf = _bf()
            foot = bf._fb_table(footer, bf._fb_deref(footer, 0))
            pos = bf._fb_field(footer, foot, 3)
            vec = bf._fb_deref(footer, pos) if pos is not None else -1
            count = struct.unpack_from("<I", footer, vec)[0] if pos is not None else 0
            blocks = np.frombuffer(footer, dtype="<i8", count=3 * count, offset=vec + 4).reshape(count, 3)
        except (struct.error, ValueError, TypeError) as e:
            raise _bad(self.path, f"the Arrow footer does not decode: {e}") from e
        if count != self.groups:
            raise _bad(self.path, f"the Arrow footer names {count} record batches, the group index {self.groups}")
        length = (blocks[:, 1] & 0xFFFFFFFF) + blocks[:, 2]
        at = 64 + blocks[:, 0]
        if count and ((at != self.g_slot * self.slot).any() or (length % 8).any()
                      or (length <= 0).any() or (length > self.g_slots * self.slot).any()
                      or (at + length > end).any()):
            raise _bad(self.path, "the Arrow footer's record batches are not where the group index says")
        self.msg_len = np.ascontiguousarray(length, dtype=np.int64)
        self.kinds = _gather_kinds(self.schema)

    def _check_pages(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Check the CRC pages holding the file's bytes [lo[i], hi[i]) not checked yet (invariant G2): each read
        whole once, by pread, then marked (the whole slots by one C call for all, their CRCs by another)."""
        page = self.slot
        if not len(lo):
            return
        first, last = lo // page, (hi - 1) // page
        pages = np.unique(np.concatenate([first, last]))
        if (last - first > 1).any():  # (a group longer than two pages: every page between too)
            pages = np.unique(np.concatenate([pages] + [np.arange(a, b + 1) for a, b in zip(first, last)
                                                        if b > a + 1]))
        todo = pages[~self.checked[pages]]
        whole = todo[(todo > 0) & ((todo + 1) * page <= 64 + self.alen)]  # pages of G bytes: read and checked in C
        if len(whole):
            from dbsp_core import _storage

            buf = bytearray(len(whole) * page)
            if _storage.pread_ranges(self.fd, np.ascontiguousarray(whole * page, dtype=np.int64),
                                     np.full(len(whole), page, dtype=np.int64),
                                     np.arange(len(whole), dtype=np.int64) * page, buf) >= 0:
                raise _bad(self.path, "a CRC page is cut short: the file is short")
            got = np.empty(len(whole), dtype=np.uint32)
            _storage.crc32c_pages(buf, page, got)
            bad = np.flatnonzero(got != self.page_crcs[whole])
            if len(bad):
                raise _bad(self.path, f"CRC page {int(whole[bad[0]])} of the Arrow section fails its CRC-32C")
            self.checked[whole] = True
        for i in todo[~self.checked[todo]].tolist():  # the first and the last, shorter
            a, b = max(64, i * page), min(64 + self.alen, (i + 1) * page)
            self._read(a, b)

    def _table(self, groups: np.ndarray) -> pa.Table:
        """The rows of ``groups`` (ascending group numbers) as one Arrow table: each group's message read by one
        pread(2) (``_storage.pread_ranges``) into an Arrow IPC stream after the schema message, decoded by one call
        (no Python per row or group, a pread a group: invariant G3); their CRC pages checked first. Checks each group holds the rows and first
        key hash its index entry names (invariant G1)."""
        if not len(groups):
            return self.schema.empty_table()
        length = self.msg_len[groups]
        at = self.g_slot[groups] * self.slot
        self._check_pages(at, at + length)
        head = len(self.schema_msg)
        dst = head + np.concatenate(([0], np.cumsum(length)))
        out = bytearray(int(dst[-1]) + 8)
        out[:head] = self.schema_msg
        out[-8:] = b"\xff\xff\xff\xff\0\0\0\0"  # end of stream
        from dbsp_core import _storage

        short = _storage.pread_ranges(self.fd, np.ascontiguousarray(at), np.ascontiguousarray(length),
                                      np.ascontiguousarray(dst[:-1]), out)  # (a pread a group, in C, no GIL)
        if short >= 0:
            raise _bad(self.path, f"group {int(groups[short])} is cut short: the file is short")
        try:
            t = pa.ipc.open_stream(pa.py_buffer(out)).read_all()
        except (pa.ArrowException, ValueError, OSError) as e:  # (an in-memory decode: Arrow's OSError is damage)
            raise _bad(self.path, f"its groups do not decode: {e}") from e
        counts = self.g_rows[groups]
        kh = np.asarray(t.column(self.ndata + 1).combine_chunks().to_numpy(zero_copy_only=False), dtype=np.uint64)
        begin = np.concatenate(([0], np.cumsum(counts)[:-1]))
        if t.num_rows != int(counts.sum()) or t.column(self.ndata + 1).num_chunks != len(groups) or \
                not np.array_equal(kh[begin], self.first_hash[groups]):
            raise _bad(self.path, "its groups do not hold the rows their index entries name")
        return t

    def _gather(self, groups: np.ndarray, hashes: np.ndarray | None) -> pa.RecordBatch | None:
        """The rows of ``groups`` (ascending group numbers) whose key hash is in ``hashes`` (uint64, ascending,
        unique; None: every row) as one Arrow record batch, read and decoded in C (``_storage.grouped_gather``: a
        pread a run of adjacent groups, each slot not checked yet CRC-checked from the same buffer (invariant G2),
        each message's flatbuffer header and buffers checked against its slot, each group's rows and first key hash
        against its index entry (G1), the rows gathered into one set of buffers, the GIL released); None when this
        file or a message takes Arrow's path (counted in DECODE_COUNTS)."""
        if self.decode != "c" or self.kinds is None:
            DECODE_COUNTS["fallback" if self.decode == "c" else "arrow"] += 1
            return None
        from dbsp_core import _storage

        g = np.ascontiguousarray(groups, dtype=np.int64)
        res = _storage.grouped_gather(
            self.fd, self.slot, 64 + self.alen, self.page_crcs, self.checked.view(np.uint8), self.kinds[0],
            self.kinds[1], self.ndata + 1, self.g_slot[g], self.g_slots[g], np.ascontiguousarray(self.msg_len[g]),
            self.g_rows[g], self.first_hash[g], hashes)
        return self._gathered(res, lambda i: int(g[i]) if 0 <= i < len(g) else -1)

    def _gathered(self, res: tuple, group_of: Any) -> pa.RecordBatch | None:
        """The record batch of a ``grouped_gather``/``grouped_lookup`` result, its failure raised (``group_of``: the
        file's group number of the result's failing group), or None when the C decoder declined (counted)."""
        from dbsp_core import _storage

        st = res[0]
        if st:
            bad_g = group_of(res[1])
            if st == _storage.GATHER_STATUS["unsupported"]:
                DECODE_COUNTS["fallback"] += 1
                return None
            if st == _storage.GATHER_STATUS["crc"]:
                raise _bad(self.path, f"CRC page {res[2]} of the Arrow section fails its CRC-32C")
            if st == _storage.GATHER_STATUS["short"]:
                raise _bad(self.path, f"group {bad_g} is cut short: the file is short")
            if st == _storage.GATHER_STATUS["ioerr"]:
                raise OSError(res[4], f"{os.strerror(res[4])}: reading {self.path}")
            if st == _storage.GATHER_STATUS["nomem"]:
                raise MemoryError(f"reading the groups of {self.path}")
            raise _bad(self.path, f"group {bad_g}: {res[3]}")
        DECODE_COUNTS["c"] += 1
        return pa.RecordBatch.from_arrays(self._arrays(res, len(self.schema)), schema=self.schema)

    def _arrays(self, res: tuple, upto: int) -> list:
        """The first ``upto`` columns of a successful gather result as Arrow arrays (its buffers wrapped, not
        copied)."""
        n, cols, nulls = res[1], res[2], res[3]
        arrays = []
        for field, (valid, data, vals), nn in zip(list(self.schema)[:upto], cols, nulls.tolist()):
            bufs = [None if valid is None else pa.py_buffer(valid), pa.py_buffer(data)]
            if vals is not None:
                bufs.append(pa.py_buffer(vals))
            arrays.append(pa.Array.from_buffers(field.type, n, bufs, null_count=nn))
        return arrays

    def _direct(self, res: tuple) -> Any:
        """The IndexedZSet of a successful gather result, made from its buffers (no table, no combine, no copy of
        the weights or hashes); None when a weight or hash column holds nulls (the table route names that)."""
        from dbsp_core.zset import IndexedZSet, ZSet

        nd = self.ndata
        if np.asarray(res[3])[nd:].any():
            return None
        if self._data_schema is None:
            self._data_schema = pa.schema(list(self.schema)[:nd])
        data = pa.Table.from_arrays(self._arrays(res, nd), schema=self._data_schema)
        cols = res[2]
        kh = cols[nd + 1][1].view(np.uint64)
        ix = IndexedZSet._make(ZSet._make(data, cols[nd][1].view(np.int64), chunked=res[1] > 0), self.key, kh)
        ix._rh = kh if self.rh_mode == "key" else (cols[nd + 2][1].view(np.uint64) if self.rh_mode == "1" else None)
        return ix

    def _batch(self, t: pa.Table, rows: np.ndarray | None = None) -> Any:
        """An IndexedZSet of table ``t`` (a file's columns; one contiguous copy), rows ``rows`` of it when given."""
        from dbsp_core.zset import IndexedZSet, ZSet

        if rows is not None:
            t = t.take(pa.array(rows))
        t = t.combine_chunks()
        nd = self.ndata
        data = pa.Table.from_arrays([_bf()._one_chunk(c) for c in t.columns[:nd]],
                                    schema=pa.schema(list(self.schema)[:nd]))
        col = lambda i: np.ascontiguousarray(_bf()._one_chunk(t.column(i)).to_numpy(zero_copy_only=False))  # noqa: E731
        w = col(nd).astype(np.int64, copy=False)
        kh = col(nd + 1).astype(np.uint64, copy=False)
        ix = IndexedZSet._make(ZSet._make(data, w), self.key, kh)
        ix._rh = kh if self.rh_mode == "key" else (col(nd + 2).astype(np.uint64, copy=False)
                                                   if self.rh_mode == "1" else None)
        return ix

    def read_all(self) -> Any:
        """The whole batch (an IndexedZSet, one contiguous copy), every group read and checked (invariants G1, G2):
        what a merge's input, a scan or ``verify`` reads."""
        every = np.arange(self.groups, dtype=np.int64)
        rb = self._gather(every, None)
        if rb is not None:
            return self._batch(pa.Table.from_batches([rb]))
        return self._batch(self._table(every))

    def groups_of(self, hashes: np.ndarray) -> np.ndarray:
        """The groups (ascending, unique) the key hashes ``hashes`` may lie in (invariant G3), those the Bloom
        filter rejects left out."""
        h = np.asarray(hashes, dtype=np.uint64)
        if len(h) == 0 or self.groups == 0:
            return np.zeros(0, dtype=np.int64)
        h = h[_bf().bloom_may_contain(self.bloom, h, self.bloom_k)]
        g = np.searchsorted(self.first_hash, h, "right") - 1
        return np.unique(g[g >= 0]).astype(np.int64)

    def lookup(self, hashes: np.ndarray, advise: bool = False) -> Any:
        """The rows of key hashes ``hashes`` (an IndexedZSet in index order: a consolidated batch), read from the
        groups they lie in (invariant G3): in place from the file's mapping (G5: :meth:`mapping`, the units read
        flagged) unless ``read_mapped`` is off or ``advise`` says the file is cold, else by pread. The C path is one
        call (``_storage.grouped_lookup``: the Bloom filter, the group search, the reads, checks, decode and gather,
        the GIL released); ``advise``: by pread, the groups' pages asked for (WILLNEED) before the first read, for a
        file whose pages are on the disk."""
        h = np.asarray(hashes, dtype=np.uint64)
        if self.decode == "c" and self.kinds is not None:
            from dbsp_core import _storage

            m = self.mapping() if self.read_mapped and not advise else None  # (a cold file: pread, invariant G5)
            if m is not None and os.fstat(self.fd).st_size < self.size:  # (a page past the end: a bus error)
                raise _bad(self.path, f"it is shorter than the {self.size} bytes it had when opened: cut under its "
                                      f"mapping")
            res = _storage.grouped_lookup(
                self.fd, self.slot, 64 + self.alen, self.page_crcs, self.checked.view(np.uint8), self.kinds[0],
                self.kinds[1], self.ndata + 1, self.bloom, self.bloom_k, self.first_hash, self.g_slot, self.g_slots,
                self.msg_len, self.g_rows, np.ascontiguousarray(h), advise, self.verified, m,
                self.units if m is not None else None)
            self.last_groups_read = res[5] if res[0] == 0 else -1
            if m is not None and res[0] == 0:
                self.mapped_groups += res[5]
            if res[0] == 0:  # (the batch made from the gathered buffers, :meth:`_direct`)
                DECODE_COUNTS["c"] += 1
                got = self._direct(res)
                if got is not None:
                    return got
                return self._batch(pa.Table.from_batches(
                    [pa.RecordBatch.from_arrays(self._arrays(res, len(self.schema)), schema=self.schema)]))
            rb = self._gathered(res, lambda i: int(i))
            if rb is not None:
                return self._batch(pa.Table.from_batches([rb]))
        else:
            DECODE_COUNTS["fallback" if self.decode == "c" else "arrow"] += 1
        h = np.unique(h)
        groups = self.groups_of(h)
        self.last_groups_read = len(groups)
        t = self._table(groups).combine_chunks()  # (a take over a chunk a group costs ~4 us a chunk)
        kh = _bf()._one_chunk(t.column(self.ndata + 1)).to_numpy(zero_copy_only=False)
        return self._batch(t, np.flatnonzero(np.isin(kh, h)))


def open_grouped(path: str, verify: bool = False) -> GroupedFile:
    """Open the format-2 batch file at ``path`` (invariant G2): header, footer, page-CRC section, group index and
    filter read and checked; its Arrow schema read (the CRC pages holding it checked). ``verify``: every CRC page and
    the whole-file CRC too (``dbsp inspect``, :func:`dbsp_core.trace.batchfile.verify`)."""
    bf = _bf()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size < 128:
            raise _bad(path, f"{size} bytes, shorter than a header and a footer")
        head = os.pread(fd, 64, 0)
        magic, version, flags, aoff, alen, rows, crc_sec, filt_sec, slot, ngroups, hcrc = HEADER2.unpack(head)
        if magic != BATCH_FILE_MAGIC:
            raise _bad(path, f"magic {magic!r}, not {BATCH_FILE_MAGIC!r}")
        if version != BATCH_FILE_GROUPED_VERSION:
            raise FormatVersionError(f"{path}: batch file format {version}, not {BATCH_FILE_GROUPED_VERSION}")
        if bf._crc(head[:60]) != hcrc:
            raise _bad(path, "the header fails its CRC-32C")
        end = size - 64
        foot = os.pread(fd, 64, end)
        fmagic, fversion, k, idx_off, nidx, bloom_off, nbloom, crc_off, whole, fcrc = bf.FOOTER.unpack(foot)
        if fmagic != BATCH_FILE_FOOTER_MAGIC or bf._crc(foot[:60]) != fcrc or fversion != version:
            raise _bad(path, "the footer fails its magic, version or CRC-32C")
        if flags != bf.FLAG_SECTION_CRCS | FLAG_GROUPED or aoff != 64 or nidx != ngroups or \
                slot < 4096 or slot & (slot - 1) or slot > 1 << 20:
            raise _bad(path, "its header's flags, slot size or group count are not format 2's")
        if (idx_off, bloom_off, crc_off, end, size) != _places(ngroups, nbloom, alen, slot) or nbloom & (nbloom - 1):
            raise _bad(path, "its section offsets do not fit the file")
        npages = _npages(alen, slot)
        crcs_b = os.pread(fd, 4 * npages, crc_off)
        if bf._crc(crcs_b) != crc_sec:
            raise _bad(path, "its page CRCs fail their CRC-32C")
        sec = os.pread(fd, crc_off - idx_off, idx_off)
        if bf._crc(sec) != filt_sec:
            raise _bad(path, "its group index and Bloom filter fail their CRC-32C")
        index = np.frombuffer(sec, dtype=GROUP_INDEX, count=ngroups).copy()
        bloom = np.frombuffer(sec, dtype="<u8", count=nbloom, offset=24 * ngroups).astype(np.uint64)
        crcs = np.frombuffer(crcs_b, dtype="<u4").copy()
        r = index["row"].astype(np.int64)
        s = index["slot"].astype(np.int64)
        n = index["slots"].astype(np.int64)
        if ngroups and (r[0] != 0 or (np.diff(r) <= 0).any() or r[-1] >= rows or (n <= 0).any()
                        or s[0] * slot < 64 or (s[1:] < s[:-1] + n[:-1]).any() or (s[-1] + n[-1]) * slot > 64 + alen
                        + slot or (np.diff(index["key_hash"].astype(np.uint64)) <= 0).any()) or (not ngroups and rows):
            raise _bad(path, "its group index does not fit its rows and slots")
        if verify:
            c = 0
            for lo in range(0, end, 1 << 24):
                c = bf._crc(os.pread(fd, min(1 << 24, end - lo), lo), c)
            if c != whole:
                raise _bad(path, "the whole-file CRC-32C does not match")
    except BaseException:
        os.close(fd)
        raise
    f = GroupedFile(path, fd, size, rows, alen, slot, index, bloom, k, crcs)
    if verify:
        for lo in range(64, 64 + alen, 1 << 24):  # every CRC page (invariant G2), 16 MiB at a time, checked in C
            f._check_pages(np.array([lo], dtype=np.int64), np.array([min(64 + alen, lo + (1 << 24))], dtype=np.int64))
    f._read_schema()
    return f


def verify_grouped(path: str) -> int:
    """Check every checksum of the format-2 batch file at ``path`` and that its groups hold the rows its index names;
    returns its rows, or raises CorruptionError naming what is damaged."""
    with open_grouped(path, verify=True) as f:
        if f._table(np.arange(f.groups, dtype=np.int64)).num_rows != f.rows:
            raise _bad(path, "its groups do not hold the rows its header names")
        return f.rows


def file_version(path: str) -> int | None:
    """The format version a batch file's header names (read unchecked: the reader of that version checks it), or
    None when it is not a batch file's header."""
    with open(path, "rb") as f:
        head = f.read(12)
    if len(head) < 12 or head[:8] != BATCH_FILE_MAGIC:
        return None
    return struct.unpack_from("<I", head, 8)[0]


class WholeRows:
    """A format-2 file's rows read whole into memory (a copy): for a reader that needs every row in place, where a
    format-1 file's mapped ``BatchFile`` serves (a shard move: dbsp_core/storage/shardmove.py)."""

    def __init__(self, path: str, batch: Any) -> None:
        self.path, self.batch, self.rows = path, batch, len(batch)

    def check_all(self) -> int:
        return 0


def open_rows(path: str) -> Any:
    """The batch file at ``path`` for a read of its rows in place: format 1 opened by
    :func:`dbsp_core.trace.batchfile.open_batch` (mapped), format 2 read whole (:class:`WholeRows`)."""
    if file_version(path) == BATCH_FILE_GROUPED_VERSION:
        with open_grouped(path) as f:
            return WholeRows(path, f.read_all())
    return batchfile.open_batch(path)


def verify(path: str) -> int:
    """Check every checksum of the batch file at ``path``, of format 1 (:func:`dbsp_core.trace.batchfile.verify`) or 2
    (:func:`verify_grouped`); returns its rows, or raises CorruptionError naming what is damaged."""
    if file_version(path) == BATCH_FILE_GROUPED_VERSION:
        return verify_grouped(path)
    return batchfile.verify(path)
