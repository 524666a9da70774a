"""Crash test (c): bit flips, zeroed pages and truncation of the page file are detected.

Every damaged file must give a typed error (CorruptionError / FormatVersionError, both StorageError) or a
fallback to an intact version whose contents equal the model exactly; never wrong data.
"""

from __future__ import annotations

import os
import random
import shutil
import struct

import pytest

from dbsp_core._storage import crc32c
from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError
from dbsp_core.storage import Database

from storage_helpers import build_base, contents

PAGE = 4096


def read_all_versions(path: str, tmpdir: str) -> dict:
    """{version: contents} read independently from copies, or raises a StorageError."""
    with Database(path) as db:
        vs = list(db.versions())
    out = {}
    for v in vs:
        cp = os.path.join(tmpdir, "c")
        shutil.copyfile(path, cp)
        with Database(cp) as db, db.open(v) as h:
            out[v] = contents(h)
        os.unlink(cp)
    return out


def outcome(path: str, states: dict, tmpdir: str) -> str:
    try:
        got = read_all_versions(path, tmpdir)
    except (CorruptionError, FormatVersionError):
        return "detected"
    except StorageError as e:
        pytest.fail(f"untyped storage error: {e!r}")
    for v, c in got.items():
        assert c == states[v], f"version {v} returned wrong data"
    return "fallback" if len(got) < 2 else "intact"


@pytest.fixture
def damaged(tmp_path):
    path = str(tmp_path / "db")
    states, _ = build_base(path, seed=21, versions=3)  # versions 2 and 3 openable
    pristine = (tmp_path / "pristine")
    shutil.copyfile(path, pristine)
    return path, str(pristine), {v: states[v] for v in (2, 3)}, str(tmp_path)


def test_bit_flips(damaged):
    path, pristine, states, tmp = damaged
    size = os.path.getsize(pristine)
    rng = random.Random(1)
    counts = {}
    offsets = [rng.randrange(size) for _ in range(300)] + [rng.randrange(128) for _ in range(40)] + \
              [PAGE + rng.randrange(128) for _ in range(40)]
    for off in offsets:
        shutil.copyfile(pristine, path)
        with open(path, "r+b") as f:
            f.seek(off)
            b = f.read(1)[0]
            f.seek(off)
            f.write(bytes([b ^ (1 << rng.randrange(8))]))
        r = outcome(path, states, tmp)
        counts[r] = counts.get(r, 0) + 1
    print(f"\n[storage corruption (c)] {len(offsets)} bit flips: {counts}, 0 wrong answers")
    assert counts.get("detected", 0) > 0 and counts.get("fallback", 0) > 0


def test_zeroed_pages(damaged):
    path, pristine, states, tmp = damaged
    npages = os.path.getsize(pristine) // PAGE
    counts = {}
    for pg in range(npages):
        shutil.copyfile(pristine, path)
        with open(path, "r+b") as f:
            f.seek(pg * PAGE)
            f.write(b"\0" * PAGE)
        r = outcome(path, states, tmp)
        counts[r] = counts.get(r, 0) + 1
    print(f"\n[storage corruption (c)] {npages} zeroed pages: {counts}, 0 wrong answers")


def test_truncation(damaged):
    path, pristine, states, tmp = damaged
    size = os.path.getsize(pristine)
    rng = random.Random(2)
    cuts = sorted({0, 100, PAGE, PAGE + 64, 2 * PAGE, size - 1} | {rng.randrange(size) for _ in range(60)})
    counts = {}
    for cut in cuts:
        shutil.copyfile(pristine, path)
        os.truncate(path, cut)
        if cut == 0:
            with pytest.raises(CorruptionError):
                Database(path)
            counts["detected"] = counts.get("detected", 0) + 1
            continue
        r = outcome(path, states, tmp)
        counts[r] = counts.get(r, 0) + 1
    print(f"\n[storage corruption (c)] {len(cuts)} truncations: {counts}, 0 wrong answers")


def test_format_version_is_checked(damaged):
    path, pristine, states, tmp = damaged
    for slot in (0, 1):
        with open(path, "r+b") as f:
            f.seek(slot * PAGE)
            meta = bytearray(f.read(128))
            meta[8:12] = struct.pack("<I", 7)
            meta[124:128] = struct.pack("<I", crc32c(bytes(meta[:124])))
            f.seek(slot * PAGE)
            f.write(meta)
    with pytest.raises(FormatVersionError, match="format version 7"):
        Database(path)


def test_not_a_page_store(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(os.urandom(3 * PAGE))
    with pytest.raises(CorruptionError, match="no valid meta slot"):
        Database(p)
