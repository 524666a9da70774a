"""Shard cuts of the level trace (dbsp_core/runtime/migrate.cut_trace on Trace.replace, what a live rescale does to
a source worker's state): against a dict model after any inserts, reads, restores and cuts, the cut merges nothing,
hashes nothing, copies no rows, keeps merges of untouched batches going and pending batches pending, and
Trace.check holds after the cut and after the inserts that follow, on the source and on the trace the moved
slices go to."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import _zset
from dbsp_core.runtime.migrate import cut_trace
from dbsp_core.trace import Trace, level_of

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
STR_SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string())])


class SlowTrace(Trace):
    """Merges stay in progress across many inserts; few pending batches before an insert spills (and merges); deferred
    work (trace invariant 14) is paid a few rows an insert, so a parked key index stays parked across inserts."""

    FUEL = 0.25
    MAX_PENDING = 5
    DEFER_RATE = 1


def _batch(seed: int, n: int, keys: int) -> tuple[dbsp.IndexedZSet, dict]:
    rng = np.random.default_rng(seed)
    k, v = rng.integers(0, keys, n), rng.integers(0, 4, n)
    w = rng.choice(np.array([-2, -1, 1, 1, 2], dtype=np.int64), n)
    z = dbsp.ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=SCHEMA), weights=w)
    return z.index_by(["k"]), z.to_dict()


def _shard_of(keys: list[int], bits: int) -> dict[int, int]:
    if not keys:
        return {}
    h = dbsp.ZSet.from_arrow(pa.table({"k": keys}, schema=pa.schema([("k", pa.int64())]))).hash(["k"])
    return dict(zip(keys, (np.asarray(h, dtype=np.uint64) >> np.uint64(64 - bits)).astype(np.int64).tolist()))


def _content(batches: list) -> dict:
    if not batches:
        return {}
    return dbsp.ZSet.concat([b.zset for b in batches]).to_dict()


def _add(model: dict, d: dict) -> dict:
    for r, w in d.items():
        model[r] = model.get(r, 0) + w
    return {r: w for r, w in model.items() if w}


class _CountHashing:
    """Counts the rows hashed through ``_zset.hash_columns`` (what a batch without kept row hashes costs)."""

    def __init__(self, monkeypatch) -> None:
        self.rows = 0
        orig = _zset.hash_columns

        def counting(data, cols):
            self.rows += data.num_rows
            return orig(data, cols)

        monkeypatch.setattr(_zset, "hash_columns", counting)


def _restore(cls, t: Trace) -> Trace:
    """What a checkpoint restore does: a fresh trace given parts(), settled between placed and pending."""
    spine, pending = t.parts()
    r = cls(t.schema, t.key)
    if t.index_spec is not None:  # the operator asks for its key index again (trace invariant 11)
        on, cols = t.index_spec
        r.keep_index(cols, on=on)
    r.clear()
    for b in spine:
        r.insert(b)
    r.settle()
    for b in pending:
        r.insert(b)
    return r


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 2**31), st.sampled_from([10, 10, 40, 1, 200])),
    st.tuples(st.just("read")),
    st.tuples(st.just("restore")),
    st.tuples(st.just("cut"), st.integers(0, 4), st.integers(0, 2**16 - 1)),
), max_size=50)


@settings(deadline=None, max_examples=150)
@given(ops, st.sampled_from([Trace, SlowTrace]), st.sampled_from([None, "key", "row"]))
def test_any_cuts_between_inserts_reads_and_restores_match_the_model(steps, cls, index):
    """With a key index (trace invariant 11), a cut parks it owing the moved rows' subtraction (invariant 14: no
    rebuild); later inserts pay it and it serves again; every step's check() compares it, with what it is owed,
    with the batches."""
    t = cls(SCHEMA, ("k",))
    dst = cls(SCHEMA, ("k",))  # where the moved slices go, as move_shards inserts them
    if index is not None:
        for x in (t, dst):
            assert x.keep_index(("v",) if index == "key" else (None,), on=index)
    model: dict = {}
    moved_model: dict = {}
    for op in steps:
        if op[0] == "insert":
            b, d = _batch(op[1], op[2], 60)
            t.insert(b)
            model = _add(model, d)
        elif op[0] == "read":
            t.batches
            if index is not None:  # reads that want the index (a stale one is rebuilt by the third)
                probe = pa.table({"k": [0, 1]}, schema=pa.schema([("k", pa.int64())]))
                kh = dbsp.ZSet.from_arrow(probe).hash(["k"])
                order = np.argsort(kh, kind="stable")
                if index == "key":
                    t.key_sums(probe, ["k"], kh[order], order, ["v"])
                else:
                    t.match_weights(dbsp.ZSet.from_rows([(0, 1)], SCHEMA).index_by(["k"]))
        elif op[0] == "restore":
            t = _restore(cls, t)
        else:
            bits, pick = op[1], op[2]
            mask = np.array([(pick >> s) & 1 for s in range(1 << bits)], dtype=bool)
            shard = _shard_of(sorted({k for k, _ in model} | {k for b in sum(t.parts(), []) for k in
                                                               b.zset.data.column("k").to_pylist()}), bits)
            before_parts = t.parts()
            merged, fresh, placed = t.merged_rows, t._fresh, t._placed
            current = t._kix is not None and t._kix.token == t._token
            moved, changed = cut_trace(t, mask, bits)
            assert t.merged_rows == merged, "a cut merged rows"
            assert t._fresh == fresh, "a cut changed the trace's freshness"
            # every batch is its old self or its kept slices, in place: placed stay placed, pending stay pending
            for old, new in zip(before_parts, t.parts()):
                want = []
                for b in old:
                    want += [id(k) for k, _, _ in changed[id(b)] if len(k)] if id(b) in changed else [id(b)]
                assert [id(b) for b in new] == want
            assert t._placed >= placed
            gone = {r: w for r, w in model.items() if mask[shard[r[0]]]}
            model = {r: w for r, w in model.items() if not mask[shard[r[0]]]}
            got_moved = _content(moved)
            assert {r: w for r, w in got_moved.items() if w} == {r: w for r, w in _add({}, gone).items()}
            for p in moved:
                assert len(p) and all(mask[shard[k]] for k in p.zset.data.column("k").to_pylist())
                dst.insert(p, defer=True)  # as move_shards does (trace invariant 14)
            moved_model = _add(moved_model, gone)
            if current and moved:  # trace invariant 14: parked owing the moved rows' subtraction, not dropped
                assert t._kix_parked is not None and t.deferred[1] == sum(len(p) for p in moved), \
                    "a cut dropped the key index or lost its owed folds"
            elif current:
                assert t._kix is not None and t._kix.token == t._token, "a cut left the key index stale"
        t.check()
        dst.check()
        assert _content(sum(t.parts(), [])) == model
    assert t.consolidated().zset.to_dict() == model
    assert dst.consolidated().zset.to_dict() == moved_model


def _big_trace(cls, n: int, steps: int, schema: pa.Schema = SCHEMA) -> Trace:
    rng = np.random.default_rng(7)
    t = cls(schema, ("k",))

    def rows(k: np.ndarray) -> pa.Table:
        if schema is SCHEMA:
            return pa.table({"k": k, "v": k % 7}, schema=schema)
        return pa.table({"k": k, "s": [f"row-{x}" for x in k.tolist()]}, schema=schema)

    t.insert(dbsp.ZSet.from_arrow(rows(np.arange(n))).index_by(["k"]))
    for _ in range(steps):
        t.insert(dbsp.ZSet.from_arrow(rows(rng.integers(0, n, 200))).index_by(["k"]))
    return t


def _buffer_range(b) -> tuple[int, int]:
    buf = b.zset.data.column("k").chunks[0].buffers()[1]
    return buf.address, buf.address + buf.size


def test_a_cut_merges_nothing_hashes_nothing_copies_nothing_and_keeps_merges_going(monkeypatch):
    t = _big_trace(SlowTrace, 20000, 60, STR_SCHEMA)  # strings: hashing rows again would be visible
    assert any(m is not None for _, _, m in t.levels()), "a small FUEL leaves merges in progress"
    t = _restore(SlowTrace, t)  # fresh: placed batches and (after these inserts) pending ones
    for i in range(3):
        t.insert(dbsp.ZSet.from_arrow(pa.table({"k": [i, 100 + i], "s": ["x", "y"]}, schema=STR_SCHEMA))
                 .index_by(["k"]))
    t.settle()
    t._fresh = False
    for i in range(40):  # merges in progress again, and more placed batches than MAX_PENDING
        t.insert(dbsp.ZSet.from_arrow(pa.table({"k": np.arange(i, 20000, 97), "s": ["z"] * len(range(i, 20000, 97))},
                                               schema=STR_SCHEMA)).index_by(["k"]))
    assert len(t.parts()[0]) > SlowTrace.MAX_PENDING
    merges_before = [lvl for lvl, _, m in t.levels() if m is not None]
    assert merges_before
    content = t.consolidated().zset.to_dict()
    bits = 6
    mask = np.zeros(1 << bits, dtype=bool)
    mask[[5, 6, 7, 40]] = True  # two runs: batches keep three slices each
    hashing = _CountHashing(monkeypatch)
    old = {id(b): b for b in sum(t.parts(), [])}
    merged = t.merged_rows
    moved, changed = cut_trace(t, mask, bits)
    assert t.merged_rows == merged, "the cut forced merges"
    assert hashing.rows == 0, "the cut hashed rows again (slices lost their batch's row hashes)"
    monkeypatch.undo()  # (the checks below hash to compare)
    assert moved and changed
    for oid, kept in changed.items():  # zero-copy: every kept slice is a view of its batch's buffers
        lo, hi = _buffer_range(old[oid])
        for k, _, _ in kept:
            a, b = _buffer_range(k)
            assert lo <= a and b <= hi
            if old[oid]._rh is not None:
                assert k._rh is not None and k._rh.base is not None
    t.check()
    # merges whose inputs the cut left alone go on (a small batch's merge may sit in shards that did not move)
    untouched = [lvl for lvl, _, m in t.levels() if m is not None]
    for lvl in untouched:
        assert lvl in merges_before
    # the rows: the trace lost exactly the moved shards' rows; the slices hold them
    shard = _shard_of(sorted({k for k, _ in content}), bits)
    assert t.consolidated().zset.to_dict() == {r: w for r, w in content.items() if not mask[shard[r[0]]]}
    assert _content(moved) == {r: w for r, w in content.items() if mask[shard[r[0]]]}
    # each kept slice sits at its batch's level or below (work capped at WORK_CAP times its rows)
    for lvl, loose, m in t.levels():
        assert lvl <= level_of(2 * 20000 + 40 * 300)
    # the new owner takes the moved slices with the row hashes they carry: nothing hashed there either
    dst = SlowTrace(STR_SCHEMA, ("k",))
    hashing = _CountHashing(monkeypatch)
    for p in moved:
        dst.insert(p)
    assert hashing.rows == 0, "moved slices lost their batch's row hashes"
    monkeypatch.undo()
    dst.check()
    # the trace goes on: inserts after the cut keep the invariants, and merge work stays fuel-bounded
    for i in range(30):
        before = t.merged_rows
        t.insert(dbsp.ZSet.from_arrow(pa.table({"k": [i], "s": ["after"]}, schema=STR_SCHEMA)).index_by(["k"]))
        assert t.merged_rows - before <= max(1, int(SlowTrace.FUEL)) * (len(t.levels()) + 40)
        t.check()


def test_a_cut_costs_what_moves_not_what_stays(monkeypatch):
    """Cutting one shard of 64 out of a 200k-row trace touches no row that stays: no merge, no hashing."""
    t = _big_trace(Trace, 200_000, 50)
    t.batches
    bits = 6
    mask = np.zeros(1 << bits, dtype=bool)
    mask[17] = True
    merged, batches = t.merged_rows, len(t.batches)
    hashing = _CountHashing(monkeypatch)
    moved, changed = cut_trace(t, mask, bits)
    assert t.merged_rows == merged
    assert hashing.rows == 0
    assert sum(len(p) for p in moved) < 200_000 / 32
    # a middle shard: each changed batch keeps two slices, nothing more
    assert len(t.batches) <= batches + len(changed)
    t.check()
