"""Batch file format 2 (row groups, dbsp_core/trace/groupedfile.py): a round trip against a dict model, the groups'
layout (whole key hashes, slot-aligned, a standard Arrow file), lookups by pread against the model, a damaged byte of
any part refused naming what to do, format 1 still read, and the write's every operation through the fault VFS
(crashed, failed, full disk)."""

from __future__ import annotations

import errno
import os
import random
import tempfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis_profile import examples
from test_batchfile import _damage  # the same byte flip as format 1's damage tests

from dbsp_core import ZSet
from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError
from dbsp_core.trace.batchfile import FOOTER, open_batch, write_batch
from dbsp_core.trace.groupedfile import DECODE_COUNTS, HEADER2, open_grouped, verify, write_grouped

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _model(rows: list[tuple]) -> dict:
    """The dict model of a consolidated Z-set: row -> weight, zeros dropped."""
    out: Counter = Counter()
    for *r, w in rows:
        out[tuple(r)] += w
    return {r: w for r, w in out.items() if w}


def _zset(rows: list[tuple], key=("k",)):
    k = [r[0] for r in rows]
    t = pa.table({"k": pa.array(k, pa.int64()), "s": pa.array([r[1] for r in rows], pa.utf8()),
                  "f": pa.array([r[2] for r in rows], pa.float64()), "b": pa.array([r[3] for r in rows], pa.bool_())})
    return ZSet.from_arrow(t, weights=np.array([r[4] for r in rows], dtype=np.int64)).consolidate().index_by(list(key))


def _as_model(b) -> dict:
    return {tuple(r): w for r, w in b.zset.to_dict().items()}


def _check_layout(path: str, b) -> None:
    """Invariant G1 read off the file: groups in order, whole key hashes, each message at its slot boundary, and the
    Arrow section a standard Arrow file of one record batch a group."""
    with open_grouped(path) as f:
        idx = f.index
        kh = np.asarray(b.key_hash)
        rows = idx["row"].astype(np.int64)
        if len(b) == 0:
            assert f.groups == 0 and f.read_all().zset.to_dict() == {}
            return
        assert rows[0] == 0 and (np.diff(rows) > 0).all()
        assert (kh[rows[1:]] != kh[rows[1:] - 1]).all()  # no key hash split between two groups
        assert np.array_equal(idx["key_hash"], kh[rows])
        with open(path, "rb") as fh:
            raw = fh.read()
        arrow = pa.ipc.open_file(pa.py_buffer(raw[64:64 + f.alen]))
        assert arrow.num_record_batches == f.groups
        for g in range(f.groups):
            at = int(idx["slot"][g]) * f.slot
            assert raw[at:at + 4] == b"\xff\xff\xff\xff"  # a message starts at its slot
            assert arrow.get_batch(g).num_rows == (rows[g + 1] if g + 1 < f.groups else len(b)) - rows[g]


row = st.tuples(st.integers(0, 40), st.one_of(st.none(), st.text(max_size=300)), st.floats(allow_nan=False),
                st.booleans(), st.sampled_from([1, -1, 2, -3]))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(row, max_size=400), st.sampled_from([4096, 8192]), st.sampled_from([("k",), ("k", "s")]))
def test_round_trip_and_lookups_match_a_dict_model(rows, slot, key) -> None:
    """Written as format 2 and read back (whole, by lookups of present and absent keys), the batch is the dict
    model's; a value longer than a slot (a string of 300 characters, many rows of one key) takes a run of slots."""
    b = _zset(rows, key)
    want = _model(rows)
    d = tempfile.mkdtemp()
    path = os.path.join(d, "g.batch")
    size = write_grouped(path, b, slot=slot)
    assert size == os.path.getsize(path) and size % 8 == 0
    assert verify(path) == len(b)
    _check_layout(path, b)
    for decode in ("c", "arrow"):  # the C decoder (csrc/groupdecode.c) and pyarrow's, each against the model
        before = DECODE_COUNTS[decode]
        with open_grouped(path) as f:
            f.decode = decode
            got = f.read_all()
            assert _as_model(got) == want and got.key == b.key
            assert np.array_equal(got.key_hash, b.key_hash)
            assert got.schema.equals(b.schema)
            kh = np.asarray(b.key_hash)
            pick = np.unique(kh[:: max(1, len(kh) // 7)]) if len(kh) else np.zeros(0, np.uint64)
            absent = np.array([1, 2**63 + 5], dtype=np.uint64)
            found = f.lookup(np.concatenate([absent, pick[::-1], pick]))  # (any order, repeats)
            assert np.isin(found.key_hash, pick).all() and len(found) == int(np.isin(kh, pick).sum())
            sel = np.isin(kh, pick)
            expect = {tuple(r.values()): int(w) for r, w in zip(b.zset.data.filter(pa.array(sel)).to_pylist(),
                                                               np.asarray(b.zset.weights)[sel])}
            assert _as_model(found) == expect
            assert np.all(np.diff(found.key_hash.astype(np.uint64)) >= 0)  # index order
        assert DECODE_COUNTS[decode] >= before + (2 if len(b) else 1), decode  # that path read them
    os.unlink(path)


def _batch(rng: np.random.Generator, n: int):
    k = rng.integers(0, max(1, n // 3), n)
    t = pa.table({"k": k, "s": pa.array([None if x % 5 == 0 else "x" * int(x % 9) for x in k], pa.utf8()),
                  "f": pa.array(rng.random(n)), "b": pa.array(rng.random(n) < 0.5),
                  "d": pa.array(k.astype("datetime64[us]"))})
    b = ZSet.from_arrow(t, weights=rng.choice([1, 3, -2], n)).consolidate().index_by(["k"])
    b._row_hashes()
    return b


def test_a_big_batch_round_trips_and_its_row_hashes_are_kept() -> None:
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 50_000)
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    write_grouped(path, b)
    _check_layout(path, b)
    with open_grouped(path) as f:
        footer = -(-f.groups * 24 // f.slot) + 2
        assert f.groups > 100 and f.checked.sum() <= 1 + footer  # opening read the schema and Arrow footer, no row
        got = f.read_all()
        assert got.zset.to_dict() == b.zset.to_dict()
        assert np.array_equal(got._row_hashes(), b._row_hashes())
        last = int(f.index["slot"][-1] + f.index["slots"][-1]) * f.slot  # (the Arrow footer after it: not read)
        assert f.checked[:(min(last, 64 + f.alen) - 1) // f.slot + 1].all()


def test_every_part_is_checked_and_damage_names_what_to_do() -> None:
    """A flipped byte in any part of a format-2 file (header, the Arrow section's first, middle and last CRC page,
    a gap between groups, the group index, the filter, the page CRCs, the footer) is refused by verify, and by a
    lookup or whole read of an unverified open when it lies in the rows: CorruptionError naming the file, the part
    and what to do."""
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 30_000)
    d = tempfile.mkdtemp()
    src = os.path.join(d, "good.batch")
    size = write_grouped(src, b)
    with open(src, "rb") as fh:
        raw = fh.read()
    alen = HEADER2.unpack_from(raw, 0)[4]
    _, _, _, idx_off, ngroups, bloom_off, nbloom, crc_off, _, _ = FOOTER.unpack_from(raw, size - FOOTER.size)
    with open_grouped(src) as f:
        slots = f.index["slot"].astype(np.int64) * f.slot
    gap = int(slots[1]) - 1  # the zeros before group 1's slot
    assert raw[gap] == 0
    places = {"header": 20, "arrow first page": 64 + 100, "arrow middle page": 64 + alen // 2,
              "arrow last page": 64 + alen - 3, "gap": gap, "group index": idx_off + 24 * (ngroups // 2) + 3,
              "bloom": bloom_off + 8 * (nbloom // 2), "page crcs": crc_off + 1, "footer": size - 30}
    for what, off in places.items():
        path = os.path.join(d, f"{what}.batch")
        with open(path, "wb") as fh:
            fh.write(raw)
        _damage(path, off)
        with pytest.raises(CorruptionError, match=r"batch file damaged.*restore the pipeline") as e:
            verify(path)
        assert path in str(e.value), what
        if what.startswith("arrow") and what != "arrow first page" or what == "gap":
            # opened unverified: the damaged page is refused when it is read (by the open when it holds the schema)
            g = min(max(int(np.searchsorted(slots, off, "right")) - 1, 0), len(slots) - 1)
            for read in (lambda f: f.read_all(), lambda f: f.lookup(f.first_hash[g:g + 1])):
                with pytest.raises(CorruptionError, match="CRC page"):
                    with open_grouped(path) as f:
                        read(f)
        os.unlink(path)
    assert verify(src) == len(b)


def _typed_batch(rng: np.random.Generator, n: int):
    """Every column kind the C decoder handles that a Z-set holds, with nulls: fixed widths of 1 to 8 bytes,
    booleans, 32- and 64-bit offsets."""
    k = rng.integers(0, max(1, n // 4), n)
    nul = rng.random(n) < 0.2
    t = pa.table({
        "k": k, "i8": pa.array(rng.integers(-100, 100, n).astype(np.int8), mask=nul),
        "u16": pa.array(rng.integers(0, 60000, n).astype(np.uint16)),
        "i32": pa.array(rng.integers(-9, 9, n).astype(np.int32), mask=~nul),
        "f32": pa.array(rng.random(n).astype(np.float32)),
        "ts": pa.array(k.astype("datetime64[ns]"), pa.timestamp("ns", tz="UTC")),
        "day": pa.array(k.astype(np.int32), pa.int32()).cast(pa.date32()),
        "ls": pa.array([None if x % 3 == 0 else "é" * int(x % 11) for x in k], pa.large_string()),
        "bin": pa.array([bytes([int(x) % 256]) * int(x % 5) for x in k], pa.binary()),
        "flag": pa.array(rng.random(n) < 0.5, mask=rng.random(n) < 0.1),
    })
    return ZSet.from_arrow(t, weights=rng.choice([1, -1, 4], n)).consolidate().index_by(["k"])


def test_the_c_decoder_reads_every_column_kind_as_arrow_does_and_a_type_it_lacks_falls_back_counted() -> None:
    rng = np.random.default_rng(SEED)
    b = _typed_batch(rng, 4000)
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    assert write_grouped(path, b) is not None
    kh = np.asarray(b.key_hash)
    probe = np.unique(kh[rng.integers(0, len(kh), 300)])
    got = {}
    for decode in ("c", "arrow", "fallback"):
        with open_grouped(path) as f:
            assert f.kinds is not None
            if decode == "fallback":  # as a file of a column type the C decoder does not know
                f.kinds = None
            else:
                f.decode = decode
            before = dict(DECODE_COUNTS)
            got[decode] = (f.read_all(), f.lookup(probe))
            assert DECODE_COUNTS[decode] == before[decode] + 2
    want = b.zset.to_dict()
    sel = np.isin(kh, probe)
    for decode, (whole, found) in got.items():
        assert whole.zset.to_dict() == want, decode
        assert whole.zset.data.equals(b.zset.data), decode  # types, nulls, values
        assert found.zset.data.equals(b.zset.data.filter(pa.array(sel))), decode
        assert np.array_equal(found.zset.weights, np.asarray(b.zset.weights)[sel]), decode


def _message_spans(f) -> list[tuple[int, int, int]]:
    """Per group: file offset of its message, of its body, of its end."""
    out = []
    with open(f.path, "rb") as fh:
        raw = fh.read()
    for g in range(f.groups):
        at = int(f.index["slot"][g]) * f.slot
        meta = int.from_bytes(raw[at + 4:at + 8], "little")
        out.append((at, at + 8 + meta, at + int(f.msg_len[g])))
    return out


def test_damaged_messages_give_the_damage_error_never_a_crash_or_wrong_rows() -> None:
    """Byte flips in the groups' Arrow messages, read by the C decoder: with the slot CRCs checked every flip is
    refused (CRC page); with the CRCs bypassed (the slots marked checked: a flip the CRC would miss) a flip in a
    message's metadata (flatbuffer header: lengths, offsets, node and buffer entries) is refused as damage or
    changes no row read, and a flip in a body neither crashes nor raises anything but the damage error."""
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 3000)
    d = tempfile.mkdtemp()
    good = os.path.join(d, "good.batch")
    path = os.path.join(d, "bad.batch")
    write_grouped(good, b)
    with open(good, "rb") as fh:
        raw = fh.read()
    with open(path, "wb") as fh:
        fh.write(raw)
    kh = np.asarray(b.key_hash)
    outcomes: Counter = Counter()
    with open_grouped(good) as ref, open_grouped(path) as f:
        spans = _message_spans(ref)
        starts = np.append(ref.index["row"].astype(np.int64), len(b))
        fd = os.open(path, os.O_RDWR)
        try:
            for trial in range(3300):
                g = int(rng.integers(0, f.groups))
                at, body, end = spans[g]
                crc_on = trial >= 3000
                off = int(rng.integers(at, body if trial < 2000 else end))
                byte = raw[off] ^ (1 << int(rng.integers(0, 8)) if rng.random() < 0.7 else int(rng.integers(1, 256)))
                os.pwrite(fd, bytes([byte]), off)
                f.checked[:] = not crc_on
                probe = np.unique(kh[starts[g]:starts[g + 1]])
                try:
                    found = f.lookup(probe)
                except CorruptionError as e:
                    assert "batch file damaged" in str(e) and "restore the pipeline" in str(e)
                    outcomes["crc" if "CRC page" in str(e) else "damaged"] += 1
                else:
                    assert not crc_on, "a flip the CRC check let through"
                    if trial < 2000:  # metadata: the rows read are the right ones
                        want = ref.lookup(probe)
                        assert found.zset.to_dict() == want.zset.to_dict(), (g, off - at)
                        outcomes["meta unchanged"] += 1
                    else:
                        outcomes["body read"] += 1
                os.pwrite(fd, raw[off:off + 1], off)
        finally:
            os.close(fd)
    assert outcomes["crc"] == 300 and outcomes["damaged"] > 1000, outcomes
    print(dict(outcomes))


def test_a_short_or_cut_file_is_refused() -> None:
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 2000)
    d = tempfile.mkdtemp()
    path = os.path.join(d, "g.batch")
    write_grouped(path, b)
    with open(path, "rb") as fh:
        raw = fh.read()
    for cut in (100, len(raw) // 2, len(raw) - 8):
        with open(path, "wb") as fh:
            fh.write(raw[:cut])
        with pytest.raises(CorruptionError, match="batch file damaged"):
            verify(path)


def test_format_1_stays_readable_and_the_mapped_reader_names_the_format_2_reader() -> None:
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 3000)
    d = tempfile.mkdtemp()
    one, two = os.path.join(d, "one.batch"), os.path.join(d, "two.batch")
    write_batch(one, b)
    write_grouped(two, b)
    assert open_batch(one).batch.zset.to_dict() == b.zset.to_dict() and verify(one) == len(b)
    assert verify(two) == len(b)
    with pytest.raises(FormatVersionError, match="open_grouped"):
        open_batch(two)
    with pytest.raises(FormatVersionError):
        open_grouped(one)


def test_a_key_bigger_than_a_slot_takes_a_run_of_slots_alone() -> None:
    n = 500
    t = pa.table({"k": np.r_[np.zeros(n, np.int64), np.arange(1, 200)], "v": np.arange(n + 199)})
    b = ZSet.from_arrow(t).consolidate().index_by(["k"])
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    write_grouped(path, b)
    _check_layout(path, b)
    with open_grouped(path) as f:
        big = int(np.argmax(f.index["slots"]))
        assert f.index["slots"][big] >= 2
        lo = int(f.index["row"][big])
        hi = int(f.index["row"][big + 1]) if big + 1 < f.groups else len(b)
        assert np.unique(np.asarray(b.key_hash)[lo:hi]).size == 1  # alone
        assert len(f.lookup(f.first_hash[big:big + 1])) == n
        assert f.read_all().zset.to_dict() == b.zset.to_dict()


def _wide_batch(n: int):
    pad = pa.array(np.full(n, "x" * 100, dtype=object), pa.string())
    b = ZSet.from_arrow(pa.table({"k": np.arange(n, dtype=np.int64), "pad": pad})).index_by(["k"])
    b._row_hashes()
    return b


def test_a_crash_at_every_io_operation_of_a_format_2_write_leaves_no_file_or_the_whole_file() -> None:
    """As format 1's (batchfile invariant 1): a crash at any operation of the write, its unsynced writes dropped
    or mixed, leaves no file under its name or the whole file, which verifies and reads back."""
    from dbsp_core.storage import FaultInjector

    b = _wide_batch(40_000)  # ~6 MiB: several pieces
    want = b.zset.to_dict()
    d = tempfile.mkdtemp()
    path = os.path.join(d, "x.batch")
    FaultInjector.arm()
    write_grouped(path, b, "fault", sync=True)
    n = FaultInjector.ops()
    FaultInjector.disarm()
    os.unlink(path)
    tried = whole = 0
    for i in range(1, n + 1):
        for mode in ("drop", "chaos"):
            FaultInjector.arm(crash_at=i, mode=mode, seed=SEED + i)
            with pytest.raises(StorageError, match="simulated crash"):
                write_grouped(path, b, "fault", sync=True)
            assert FaultInjector.crashed()
            FaultInjector.disarm()
            if os.path.exists(path):
                assert verify(path) == len(b), (i, mode, SEED)
                with open_grouped(path) as f:
                    assert f.read_all().zset.to_dict() == want, (i, mode, SEED)
                whole += 1
            assert set(os.listdir(d)) <= {"x.batch", "x.batch.tmp"}, os.listdir(d)
            for x in os.listdir(d):
                os.unlink(os.path.join(d, x))
            tried += 1
    assert n > 6 and tried == 2 * n
    print(f"\n[format-2 crash] {n} I/O operations x 2 modes = {tried} crashes, {whole} left the whole file, 0 a "
          f"partial one (DBSP_TEST_SEED={SEED})")


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
def test_an_error_at_any_operation_of_a_format_2_write_is_a_storage_error_leaving_no_temporary_file(error) -> None:
    from dbsp_core.storage import FaultInjector

    b = _wide_batch(30_000)
    d = tempfile.mkdtemp()
    path = os.path.join(d, "full.batch")
    FaultInjector.arm()
    write_grouped(path, b, "fault", sync=True)
    n = FaultInjector.ops()
    FaultInjector.disarm()
    os.unlink(path)
    for i in range(1, n + 1):
        FaultInjector.arm(error_at=i, error=error)
        try:
            with pytest.raises(StorageError, match="full.batch") as e:
                write_grouped(path, b, "fault", sync=True)
        finally:
            FaultInjector.disarm()
        assert e.value.errno == getattr(errno, error)
        if error == "ENOSPC":
            assert "spill_dir" in str(e.value)
        left = os.listdir(d)
        assert left in ([], ["full.batch"]), (i, left)  # after the rename (the directory's fsync failing): whole
        if left:
            assert verify(path) == len(b)
            os.unlink(path)


def test_crc_pages_are_the_slots_of_the_file() -> None:
    """Format 2's CRC pages are its slots, cut at multiples of the slot size of the file: the first covers the
    Arrow bytes [0, G - 64), so a group's first read checks its own slots."""
    b = _wide_batch(2000)
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    write_grouped(path, b)
    from dbsp_core.trace.batchfile import _crc

    with open(path, "rb") as fh:
        raw = fh.read()
    with open_grouped(path) as f:
        g = f.slot
        assert _crc(raw[64:g]) == int(f.page_crcs[0])
        assert _crc(raw[g:2 * g]) == int(f.page_crcs[1])
        assert len(f.page_crcs) == -(-(64 + f.alen) // g)
        f.lookup(f.first_hash[5:6])
        assert f.checked.sum() <= 6  # the schema's slot, the Arrow footer's (two), the group's


def test_the_c_lookup_reads_the_groups_the_filter_and_search_name_and_the_rows_of_the_dict_model() -> None:
    """One C call does a lookup's Bloom filter test, group search, reads and gather (``_storage.grouped_lookup``): it
    reads exactly the groups ``groups_of`` names (the same CRC pages checked as the Arrow path's reads), none for
    probes the filter rejects or below the first group, and returns the dict model's rows, for probes in any order
    with repeats, present, absent, below and above every key hash."""
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 6000)
    want = _model([(*r.values(), int(w)) for r, w in zip(b.zset.data.to_pylist(), np.asarray(b.zset.weights))])
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    write_grouped(path, b, slot=4096)
    kh = np.asarray(b.key_hash).astype(np.uint64)
    with open_grouped(path) as f:
        assert f.groups > 20
        below = np.arange(int(kh[0]) - 3, int(kh[0]), dtype=np.uint64) if kh[0] >= 3 else np.zeros(0, np.uint64)
        absent = rng.integers(0, 2**63, 3000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        absent = absent[~np.isin(absent, kh)]
        probes = [absent, below, np.array([2**64 - 1], dtype=np.uint64)]
        for n in (1, 17, 400):
            present = rng.choice(kh, n)
            probes.append(np.concatenate([present, absent[:n], present[::-1]]))
    rejected = 0
    for h in probes:
        u = np.unique(h)
        sel = np.isin(kh, u)
        expect = {}
        for r, w in zip(b.zset.data.filter(pa.array(sel)).to_pylist(), np.asarray(b.zset.weights)[sel]):
            expect[tuple(r.values())] = int(w)
        assert all(want[k] == w for k, w in expect.items())
        checked = {}
        for decode in ("c", "arrow"):
            with open_grouped(path) as f:
                f.decode = decode
                before = DECODE_COUNTS[decode]
                got = f.lookup(h)
                assert DECODE_COUNTS[decode] == before + 1
                assert _as_model(got) == expect, decode
                groups = f.groups_of(u)
                assert f.last_groups_read == len(groups), decode
                checked[decode] = f.checked.copy()
        assert np.array_equal(checked["c"], checked["arrow"])  # the same groups' slots read (and checked)
        # the filter's work: groups whose probes it rejects are not read (the search alone would read them)
        g_search = np.unique(np.searchsorted(kh[np.r_[0, np.flatnonzero(np.diff(kh)) + 1]], u, "right"))
        rejected += len(g_search) - len(groups)
    assert rejected > 0
    os.unlink(path)


def test_a_groups_order_is_checked_once_and_every_lookup_finds_the_model_rows_by_binary_search() -> None:
    """The C lookup flags each group whose key hashes it checked ascending (``GroupedFile.verified``): exactly the
    groups it read; a later lookup of those groups skips the check and finds the same rows, the dict model's, by
    binary search in each group, for probes that are every key hash of a group (many a group), absent ones between
    them, and repeats; the batch made from the gathered buffers (``_direct``) holds the weights, key and row hashes
    and columns of those rows."""
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 6000)
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    write_grouped(path, b, slot=4096)
    kh = np.asarray(b.key_hash).astype(np.uint64)
    with open_grouped(path) as f:
        assert f.groups > 20 and not f.verified.any()
        starts = f.row_starts()
        whole = np.unique(kh[starts[3]:starts[5]])  # every key hash of groups 3 and 4
        gaps = (whole[:-1] + (whole[1:] - whole[:-1]) // np.uint64(2))[::2]
        gaps = gaps[~np.isin(gaps, kh)]
        for probe in (np.concatenate([whole, gaps, whole[:5]]), rng.choice(kh, 300), kh[::-1]):
            u = np.unique(probe)
            sel = np.isin(kh, u)
            expect = {tuple(r.values()): int(w) for r, w in zip(b.zset.data.filter(pa.array(sel)).to_pylist(),
                                                                np.asarray(b.zset.weights)[sel])}
            before = f.verified.copy()
            first = f.lookup(probe)
            read = np.zeros(f.groups, dtype=bool)
            read[f.groups_of(u)] = True
            assert np.array_equal(f.verified.astype(bool), before.astype(bool) | read)  # flagged: the groups read
            again = f.lookup(probe)  # every group read flagged: no order check, the binary search alone
            for got in (first, again):  # rows, weights, key and row hashes in the file's order (index order)
                assert _as_model(got) == expect
                assert np.array_equal(got.key_hash, kh[sel]) and got.key == b.key
                assert np.array_equal(np.asarray(got.zset.weights), np.asarray(b.zset.weights)[sel])
                assert np.array_equal(got._rh, np.asarray(b._rh)[sel])
                assert got.zset.data.equals(b.zset.data.filter(pa.array(sel)))
        assert f.verified.all()  # (the last probe: every key hash)
    os.unlink(path)


def _units_read(f, groups: np.ndarray, checked: np.ndarray) -> np.ndarray:
    """The model of a mapped lookup's unit flags (invariant G5): per group read, the ``MAP_UNIT``s of address space
    its bytes lie in, its message's when every slot of it was checked before the read, else its whole slots (read for
    their CRC), cut at the Arrow section's end."""
    from dbsp_core.trace.groupedfile import MAP_UNIT

    want = np.zeros(len(f.units), dtype=bool)
    end = 64 + f.alen
    for g in groups.tolist():
        s, n = int(f.g_slot[g]), int(f.g_slots[g])
        lo = s * f.slot
        hi = min(end, (s + n) * f.slot)
        if checked[s:(hi + f.slot - 1) // f.slot].all():
            hi = lo + int(f.msg_len[g])
        want[(f.base + lo) // MAP_UNIT - f.base // MAP_UNIT:(f.base + hi - 1) // MAP_UNIT - f.base // MAP_UNIT + 1] = True
    return want


def test_mapped_lookups_read_the_model_rows_in_place_and_flag_the_units_of_the_groups_they_read() -> None:
    """A lookup through the file's mapping (invariant G5) returns what the pread lookup and the dict model do, for
    first reads (the slots' CRCs read from the mapping) and later ones, probes present, absent and repeated; it flags
    exactly the 2 MiB units the groups it read lie in (their whole slots on a first read, their messages after), which
    ``take_units`` hands over once and clears; a cold lookup (``advise``) and a file with mapped reads off read by
    pread and flag none."""
    rng = np.random.default_rng(SEED)
    b = _batch(rng, 300_000)
    path = os.path.join(tempfile.mkdtemp(), "g.batch")
    write_grouped(path, b)
    kh = np.asarray(b.key_hash).astype(np.uint64)
    with open_grouped(path) as f, open_grouped(path) as ref:
        f.read_mapped, ref.read_mapped = True, False
        assert f.size > 6 << 20 and f.map is None
        for trial in range(12):
            n = int(rng.choice([1, 30, 700]))
            h = np.concatenate([rng.choice(kh, n), rng.integers(0, 2**63, n // 3 + 1, dtype=np.uint64)])
            u = np.unique(h)
            sel = np.isin(kh, u)
            expect = {tuple(r.values()): int(w) for r, w in zip(b.zset.data.filter(pa.array(sel)).to_pylist(),
                                                                np.asarray(b.zset.weights)[sel])}
            advise = trial % 4 == 3
            checked = f.checked.copy()
            got = f.lookup(h, advise=advise)
            assert _as_model(got) == expect and _as_model(ref.lookup(h)) == expect, trial
            assert np.array_equal(got.key_hash, kh[sel]) and np.array_equal(got._rh, np.asarray(b._rh)[sel])
            assert f.map is not None and ref.map is None
            flagged = f.take_units()
            if advise:
                assert flagged is None, "a cold lookup read by pread"
                continue
            want = _units_read(f, f.groups_of(u), checked)
            assert np.array_equal(flagged if flagged is not None else np.zeros(len(want), bool), want), trial
            assert f.take_units() is None  # (cleared)
        assert f.checked.any() and np.array_equal(f.checked, ref.checked | f.checked)
    os.unlink(path)


def test_a_file_damaged_or_cut_under_its_mapping_is_the_damage_error_never_a_bus_error(tmp_path) -> None:
    """A mapped file (invariant G5) whose bytes change under the mapping after it was opened: a slot not read yet is
    refused by its CRC; a file cut short (another process truncating it) is refused before a byte past its new end is
    read (a bus error otherwise). In a child process, so that a bus error fails the test instead of the run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, numpy as np
        from dbsp_core.errors import CorruptionError
        from dbsp_core.trace.groupedfile import open_grouped, write_grouped
        from test_groupedfile import _batch
        b = _batch(np.random.default_rng({SEED}), 300_000)
        path = {str(tmp_path / "g.batch")!r}
        write_grouped(path, b)
        kh = np.asarray(b.key_hash).astype(np.uint64)
        f = open_grouped(path)
        f.read_mapped = True
        f.lookup(kh[:10])  # mapped, its first groups checked
        g = f.groups // 2
        assert not f.checked[int(f.g_slot[g])]
        probe = kh[f.row_starts()[g]:f.row_starts()[g] + 3]
        at = int(f.g_slot[g]) * f.slot + 20
        fd = os.open(path, os.O_RDWR)
        raw = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([raw[0] ^ 1]), at)  # a byte of a group not read yet
        try:
            f.lookup(probe)
        except CorruptionError as e:
            assert "CRC page" in str(e), e
            print("crc refused")
        os.pwrite(fd, raw, at)
        os.ftruncate(fd, int(f.g_slot[g]) * f.slot)  # (the group past the new end)
        os.close(fd)
        try:
            f.lookup(probe)
        except CorruptionError as e:
            assert "shorter" in str(e), e
            print("cut refused")
    """)
    here = os.path.dirname(os.path.abspath(__file__))  # test_groupedfile, and tests/ for its hypothesis_profile
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), here, os.path.dirname(here),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["crc", "refused", "cut", "refused"], r.stdout
