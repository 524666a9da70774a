"""The key index over string and binary keys (csrc/keyindex.h invariant 8) against dict models, with key hashes that
collide on purpose: the index must tell keys apart by their bytes, never by their hash.

``_zset.keyindex_test_hash_bits(b)`` keeps only ``b`` bits of every key hash in the index's slot tags, so that in an
operator's state many distinct keys share a tag (a version of the index that trusted the hash merged them: wrong
totals). The kernel-level tests also hand the index key hashes cut to a few bits, or one hash for every row.
"""

from __future__ import annotations

import gc
import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import _zset
from tests.core.test_aggregate_extremes import _steps_against_model

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
# strings that share prefixes and lengths, an empty one (not null), long ones (several words of a record)
WORDS = ["", "a", "b", "ab", "ba", "2026-11-29", "2026-11-30", "x" * 17, "x" * 16 + "y", "\x00", "\x00\x00",
         "long shared prefix, then one", "long shared prefix, then two"]
KEY_TYPES = [pa.string(), pa.large_string(), pa.binary()]


@pytest.fixture
def hash_bits():
    """Set the key index's test hook (invariant 8) for one test; back to all 28 bits after."""
    def set_bits(bits: int) -> None:
        _zset.keyindex_test_hash_bits(bits)

    yield set_bits
    _zset.keyindex_test_hash_bits(0)


def _value(v, t):
    return v.encode() if v is not None and pa.types.is_binary(t) else v


def _hashes(t: pa.Table, nk: int, mode: str) -> np.ndarray:
    if not t.num_rows:
        return np.zeros(0, np.uint64)
    kh = _zset.hash_columns(t, list(range(nk)))
    return kh & np.uint64(3) if mode == "two bits" else np.zeros_like(kh) if mode == "one hash" else kh


@pytest.mark.parametrize("mode", ["real", "two bits", "one hash"])
@pytest.mark.parametrize("stype", KEY_TYPES, ids=str)
def test_string_keys_match_a_dict_model(mode: str, stype: pa.DataType) -> None:
    """Keys (int64, string-like, string-like) with nulls, empty strings and shared prefixes, through random adds and
    removals (weights of both signs, batches taken out again): after every batch the index is checked and every key
    seen (and some never seen) reads the dict model's sums. With the key hashes cut to two bits or one hash for every
    row, every probe meets slots of other keys with its own tag."""
    print(f"DBSP_TEST_SEED={SEED}")
    rng = np.random.default_rng([SEED, KEY_TYPES.index(stype), len(mode)])
    types = [pa.int64(), stype, stype]
    ix = _zset.KeyIndex(types, 2)
    model: dict = {}
    done: list = []
    for step in range(40):
        n = int(rng.integers(0, 60))
        cols = [[None if rng.random() < 0.1 else int(rng.integers(0, 4)) for _ in range(n)]]
        cols += [[None if rng.random() < 0.1 else WORDS[int(rng.integers(len(WORDS)))] for _ in range(n)]
                 for _ in range(2)]
        v = rng.integers(-5, 6, n)
        w = rng.choice([-1, 1, 1, 2], n).astype(np.int64)
        t = pa.Table.from_arrays([pa.array([_value(x, ty) for x in c], ty) for c, ty in zip(cols, types)]
                                 + [pa.array(v, pa.int64())], names=["k", "s", "u", "v"])
        sign = 1
        if done and rng.random() < 0.25:  # take an earlier batch out again
            t, w, cols, v = done.pop(int(rng.integers(len(done))))
            sign = -1
        else:
            done.append((t, w, cols, v))
        ix.add(t, w, [0, 1, 2], _hashes(t, 3, mode), [-1, 3], sign)
        for i in range(t.num_rows):
            key = (cols[0][i], cols[1][i], cols[2][i])
            old = model.get(key, (0, 0))
            new = (old[0] + sign * int(w[i]), old[1] + sign * int(w[i]) * int(v[i]))
            if new == (0, 0):
                model.pop(key, None)
            else:
                model[key] = new
        ix.check()
        assert len(ix) == len(model), f"step {step}: {len(ix)} keys for {len(model)} (keys merged or lost)"
        probes = list(model) + [(0, "never", None), (1, None, ""), (2, "", None)]
        p = pa.Table.from_arrays([pa.array([_value(k[j], types[j]) for k in probes], types[j]) for j in range(3)],
                                 names=["k", "s", "u"])
        acc = np.zeros((len(probes), 2), np.int64)
        ix.get(p, [0, 1, 2], _hashes(p, 3, mode), acc)
        assert [tuple(r) for r in acc.tolist()] == [model.get(k, (0, 0)) for k in probes], f"step {step}"


def test_removed_keys_bytes_are_reclaimed() -> None:
    """Invariant 8: a removed key's record is garbage, and the arena compacts instead of growing once half of it is,
    so a trace whose keys come and go (a sliding window of days) holds bytes for its live keys only: 30 rounds that
    each remove the oldest 3,000 of 6,000 keys of 60-byte strings and add 3,000 new ones (never few enough keys
    left for the table to shrink, which compacts too) keep the index's bytes within 1.5x of what it held after the
    first round (without reclaim the arena grows by ~200 KiB a round). Sums match a dict model throughout."""
    ix = _zset.KeyIndex([pa.string()], 1)
    model: dict = {}

    def add(lo: int, hi: int, sign: int) -> None:
        keys = [f"{i:08d}" + "-" * 52 for i in range(lo, hi)]
        t = pa.table({"s": keys})
        ix.add(t, None, [0], _zset.hash_columns(t, [0]), [-1], sign)
        for k in keys:
            model[k] = model.get(k, 0) + sign
            if not model[k]:
                del model[k]

    add(0, 6000, 1)
    first = ix.nbytes
    for r in range(1, 31):
        add((r - 1) * 3000, r * 3000, -1)
        add((r + 1) * 3000, (r + 2) * 3000, 1)
        ix.check()
        assert ix.nbytes <= 1.5 * first, (r, ix.nbytes, first)
    assert len(ix) == len(model) == 6000
    t = pa.table({"s": list(model)})
    acc = np.zeros((len(model), 1), np.int64)
    ix.get(t, [0], _zset.hash_columns(t, [0]), acc)
    assert acc[:, 0].tolist() == list(model.values())


def test_string_records_live_in_files_and_count_in_the_budget(tmp_path) -> None:
    """Invariants 6-8: the arena of a large index (8 MiB of keys) is a region of its own, counted in nbytes and in
    keyindex_total_bytes, moved into a file by set_dir and dropped with drop_pages (then read back from the page
    cache: the sums stay right); a budget that the arena's growth would pass breaks the index as a table's would."""
    gc.collect()
    base = _zset.keyindex_total_bytes()
    n = 100_000
    keys = [f"key number {i:012d} of many" for i in range(n)]  # 35 bytes: a length word and 5 words of bytes
    t = pa.table({"s": keys, "v": np.arange(n, dtype=np.int64)})
    kh = _zset.hash_columns(t, [0])
    ix = _zset.KeyIndex([pa.string()], 2)
    ix.add(t, None, [0], kh, [1, -1])
    assert ix.nbytes >= n * 6 * 8, "the arena is not counted in nbytes"
    assert _zset.keyindex_total_bytes() - base == ix.nbytes
    assert len(ix.regions) == 3  # slot table, entries, arena (each 2 MiB or more: mapped)
    ix.set_dir(str(tmp_path))
    assert ix.drop_pages() >= n * 6 * 8
    acc = np.zeros((n, 2), np.int64)
    ix.get(t, [0], kh, acc)
    assert (acc[:, 0] == np.arange(n)).all() and (acc[:, 1] == 1).all()
    ix.check()
    del ix
    gc.collect()
    assert _zset.keyindex_total_bytes() == base
    saved = _zset.keyindex_budget()
    try:  # a budget that holds the slot tables and entries of 100k keys but not their strings' records
        _zset.keyindex_budget(base + (1 << 18) * 8 * 2 + n * 2 * 8 * 2)
        small = _zset.KeyIndex([pa.string()], 1)
        with pytest.raises(ValueError):
            small.add(t, None, [0], kh, [-1])
        assert not small.broken and small.refusals == 1 and len(small) == 0  # taken back (invariant 4)
        small.check()
    finally:
        _zset.keyindex_budget(saved)


DAY_SCHEMA = pa.schema([("k", pa.int64()), ("day", pa.string()), ("v", pa.int64())])


def _day_row(rng) -> tuple:
    k = None if rng.random() < 0.05 else int(rng.integers(0, 6))
    day = None if rng.random() < 0.05 else str(rng.choice(["2026-11-28", "2026-11-29", "2026-11-30", "", "x"]))
    v = None if rng.random() < 0.1 else int(rng.integers(-40, 40))
    return (k, day, v)


def _q17_model(bag: Counter) -> dict:
    """q17's shape: per (k, day) the row count, the count and sum of v, its min and max."""
    groups: dict = {}
    for (k, day, v), w in bag.items():
        g = groups.setdefault((k, day), {"n": 0, "vs": [], "total": 0, "nv": 0})
        g["n"] += w
        if v is not None:
            g["vs"] += [v] * w
            g["total"] += v * w
            g["nv"] += w
    return {(k, day, g["n"], g["nv"], min(g["vs"], default=None), max(g["vs"], default=None),
             g["total"] if g["nv"] else None): 1 for (k, day), g in groups.items() if g["n"]}


def _linear_model(bag: Counter) -> dict:
    groups: dict = {}
    for (k, day, v), w in bag.items():
        g = groups.setdefault((day, k), [0, 0, 0])
        g[0] += w
        if v is not None:
            g[1] += v * w
            g[2] += w
    return {(day, k, n, s if nv else None): 1 for (day, k), (n, s, nv) in groups.items() if n}


@pytest.mark.parametrize("workers,seed,storage", [(1, 21, False), (2, 22, False), (2, 23, True)])
@pytest.mark.parametrize("shape", ["extremes", "linear"])
def test_string_keyed_group_by_through_the_key_index(hash_bits, tmp_path, workers: int, seed: int, storage: bool,
                                                     shape: str) -> None:
    """A group-by on (int, string) keys, q17's shape (count, count and sum of a column, min, max: the extremes
    strategy) and a linear one (count and sum: ``linear_step``), with the key index's tags cut to two hash bits
    (four tags for all groups: every probe meets other groups' slots). The view matches a dict model after every
    step of random inserts and deletes (extremes deleted often), the state's key index is in use and agrees with
    its batches (Trace.check), and with storage the pipeline reopens every 30 steps (the index rebuilt from the
    batches under the hook)."""
    hash_bits(2)
    rng = np.random.default_rng([SEED, seed])
    print(f"DBSP_TEST_SEED={SEED}")
    c = dbsp.Circuit()
    src = c.input("t", DAY_SCHEMA)
    if shape == "extremes":
        c.output("g", src.group_by("k", "day").agg(n=dbsp.count(), nv=dbsp.count("v"), lo=dbsp.min("v"),
                                                   hi=dbsp.max("v"), total=dbsp.sum("v")))
        model, name = _q17_model, "totals"
    else:
        c.output("g", src.group_by("day", "k").agg(n=dbsp.count(), total=dbsp.sum("v")))
        model, name = _linear_model, "partials"
    kw = {"storage": str(tmp_path / "s")} if storage else {}
    p = dbsp.Pipeline(c, workers=workers, **kw)
    used = []

    def after(step, p):
        for w in range(workers):
            for n, tr in p.traces(w).items():
                tr.check()
                if n.endswith(name):
                    assert tr.index_spec is not None, "the string-keyed state keeps no key index"
                    used.append(tr.index_bytes)
        if storage and step % 30 == 29:
            p.close()
            return dbsp.Pipeline.open(str(tmp_path / "s"), c)
        return None

    _steps_against_model(p, rng, 120, (0, 12), _day_row, 0.3, 0.15, DAY_SCHEMA, model, after=after)
    assert max(used) > 0, "no step went through the key index"


@pytest.mark.parametrize("workers,seed", [(1, 31), (2, 32)])
@pytest.mark.parametrize("bits", [2, 0])
def test_append_only_min_max_groups_the_change_by_hashing(hash_bits, workers: int, seed: int, bits: int) -> None:
    """q17's state: a min/max group-by over an append-only input keeps its totals alone (operators/aggregate.py
    invariant 7), and a step folds its change into them without indexing it (``extremes_probe_inserts``: the rows
    grouped by hashing, no sort). Against a dict model after every step, on (int, string) keys with the index's tags
    cut to two hash bits or kept whole, steps of a few rows and of a few thousand (with many rows per group, so a
    group's extreme comes from the old totals or from any row of the change)."""
    hash_bits(bits)
    rng = np.random.default_rng([SEED, seed, bits])
    print(f"DBSP_TEST_SEED={SEED}")
    c = dbsp.Circuit()
    src = c.input("t", DAY_SCHEMA, append_only=True)
    c.output("g", src.group_by("k", "day").agg(n=dbsp.count(), nv=dbsp.count("v"), lo=dbsp.min("v"),
                                               hi=dbsp.max("v"), total=dbsp.sum("v")))
    bag: Counter = Counter()
    view: Counter = Counter()
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in range(40):
            n = int(rng.integers(1, 8)) if step % 3 else int(rng.integers(500, 3000))
            rows = [_day_row(rng) for _ in range(n)]
            w = rng.choice([1, 1, 2], n)
            for r, x in zip(rows, w.tolist()):
                bag[r] += x
            p.push("t", dbsp.ZSet.from_rows(rows, DAY_SCHEMA, weights=w.tolist()))
            for r, x in p.step()["g"].to_dict().items():
                view[r] += x
            view = Counter({r: x for r, x in view.items() if x})
            assert dict(view) == _q17_model(bag), f"step {step}"
            for wk in range(workers):
                traces = p.traces(wk)
                assert all(".values" not in name for name in traces), list(traces)  # totals alone (invariant 7)
                for name, tr in traces.items():
                    tr.check()
                    if name.endswith(".totals") and tr.num_rows:
                        assert tr.index_bytes > 0, "the totals' key index was not used"
