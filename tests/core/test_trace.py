"""The trace (dbsp_core/trace/) against a dict model: content and reads after any inserts, reads, settles and restores, batch counts, and merge work counted in rows."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.trace import MergeThread, Trace, level_of, merging

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


class SlowTrace(Trace):
    """Merges advance by a row per four inserted rows: they stay in progress across many inserts and reads."""

    FUEL = 0.25
    MAX_PENDING = 5


def _batch(seed: int, n: int, keys: int) -> tuple[dbsp.ZSet, dict]:
    rng = np.random.default_rng(seed)
    k, v = rng.integers(0, keys, n), rng.integers(0, 4, n)
    w = rng.choice(np.array([-2, -1, 1, 1, 2], dtype=np.int64), n)
    z = dbsp.ZSet.from_arrow(pa.table({"k": k, "v": v}, schema=SCHEMA), weights=w)
    return z, z.to_dict()


def _hashes(keys: list[int]) -> np.ndarray:
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    return np.sort(dbsp.ZSet.from_arrow(pa.table({"k": keys}, schema=pa.schema([("k", pa.int64())]))).hash(["k"]))


def _check_reads(t: Trace, model: dict, keys: list[int]) -> None:
    want = {r: w for r, w in model.items() if r[0] in keys}
    got: dict = {}
    for b in t.lookup(_hashes(keys)):
        for (k, v), w in b.zset.to_dict().items():
            if k in keys:
                got[(k, v)] = got.get((k, v), 0) + w
    assert {r: w for r, w in got.items() if w} == want
    probe = pa.table({"k": sorted(set(keys))}, schema=pa.schema([("k", pa.int64())]))
    kh = dbsp.ZSet.from_arrow(probe).hash(["k"])
    order = np.argsort(kh, kind="stable")
    sums = t.key_sums(probe, ["k"], kh[order], order, ["v"])
    for i, r in enumerate(order.tolist()):
        k = probe.column("k")[r].as_py()
        assert sums[i, 0] == sum(v * w for (kk, v), w in model.items() if kk == k)
    rows = [(k, v) for k in sorted(set(keys)) for v in range(4)]
    if rows:
        change = dbsp.ZSet.from_rows(rows, SCHEMA).index_by(["k"])
        data = change.zset.data
        got_w = dict(zip(zip(data.column("k").to_pylist(), data.column("v").to_pylist()),
                         t.match_weights(change).tolist()))
        assert got_w == {r: model.get(r, 0) for r in got_w}


def _batch_bound(t: Trace, per_level: int = 2) -> int:
    """O(log n) batches: two per level (three with a merge thread: a merge and two loose batches, trace
    invariant 10), levels up to ceil(log2(rows inserted))."""
    return per_level * (level_of(max(t.inserted_rows, 2)) + 1) + len(t.pending)


_MERGE_THREAD: MergeThread | None = None


def _merge_thread() -> MergeThread:
    """One merge thread for the tests of this module (a thread per example would be slow to start)."""
    global _MERGE_THREAD
    if _MERGE_THREAD is None:
        _MERGE_THREAD = MergeThread()
    return _MERGE_THREAD


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 2**31), st.sampled_from([10, 10, 10, 10, 1, 3, 40, 200])),
    st.tuples(st.just("read"), st.lists(st.integers(0, 60), max_size=6)),
    st.tuples(st.just("settle")),
    st.tuples(st.just("restore")),
    st.tuples(st.just("drop"), st.integers(0, 30)),
    st.tuples(st.just("idle")),
), max_size=60)


INDEXES = {None: None, "key": (("v",), "key"), "row": ((None,), "row")}


def _new(cls, index):
    t = cls(SCHEMA, ("k",))
    if index is not None:  # invariant 11: key_sums of "v" ("key") or match_weights ("row") read through the index
        assert t.keep_index(*INDEXES[index])
    return t


@settings(deadline=None)
@given(ops, st.sampled_from([Trace, SlowTrace]), st.booleans(), st.sampled_from(list(INDEXES)), st.sampled_from([0, 64]))
def test_any_inserts_reads_settles_and_restores_match_the_model(steps, cls, bg, index, inline):
    """Also with a merge thread (invariant 10): the same content and reads whatever the merge thread
    has done when they happen ("idle" waits until it has finished every merge handed to it), with every merge
    handed over or those of at most 64 rows kept inline (Trace.INLINE_MERGE); and with a key index (invariant
    11), which every step's check() compares with the batches."""
    saved = Trace.INLINE_MERGE
    Trace.INLINE_MERGE = inline
    try:
        with merging(_merge_thread() if bg else None):
            _run_ops(steps, cls, bg, index)
    finally:
        Trace.INLINE_MERGE = saved


def _run_ops(steps, cls, bg, index=None):
    t = _new(cls, index)
    model: dict = {}
    for op in steps:
        if op[0] == "insert":
            z, d = _batch(op[1], op[2], 60)
            t.insert(z.index_by(["k"]))
            for r, w in d.items():
                model[r] = model.get(r, 0) + w
            model = {r: w for r, w in model.items() if w}
        elif op[0] == "read":
            _check_reads(t, model, op[1])
        elif op[0] == "settle":
            t.settle()
        elif op[0] == "idle":
            assert _merge_thread().wait_idle(30)
        elif op[0] == "drop":  # invariant 8: forget keys below a bound, merges in progress included
            gone = sum(abs(w) for (k, _), w in model.items() if k < op[1])
            dropped = t.drop_below({"k": op[1]}, force=True)
            model = {r: w for r, w in model.items() if r[0] >= op[1]}
            assert dropped >= (1 if gone else 0)
        else:  # what a checkpoint restore does: insert parts() into a cleared trace, settling between them
            spine, pending = t.parts()
            t = _new(cls, index)
            t.clear()  # fresh, as a snapshot restore makes it
            for b in spine:
                t.insert(b)
            t.settle()
            for b in pending:
                t.insert(b)
            if len(spine) + len(pending) <= cls.MAX_PENDING:  # (more: the overflow inserts them, merging)
                assert [id(b) for b in t.parts()[0]] == [id(b) for b in spine]
                assert [id(b) for b in t.parts()[1]] == [id(b) for b in pending]
                assert t.merged_rows == 0
        batches = t.parts()[0] + t.parts()[1]
        assert all(len(b) for b in batches)
        assert dbsp.ZSet.concat([b.zset for b in batches] or [dbsp.ZSet.empty(SCHEMA)]).to_dict() == model
        assert len(t.parts()[0]) <= _batch_bound(t, 3 if bg else 2) or t.pending
        t.check()
    assert t.consolidated().zset.to_dict() == model


def test_reads_merge_nothing_and_parts_keeps_placement_order():
    t = SlowTrace(SCHEMA, ("k",))
    for i in range(40):
        t.insert(_batch(i, 30, 1000)[0].index_by(["k"]))
    assert any(m is not None for _, _, m in t.levels()), "a small FUEL leaves merges in progress"
    before, merged = t.parts(), t.merged_rows
    t.lookup(_hashes(list(range(50))))
    t.key_sums(pa.table({"k": [1]}), ["k"], _hashes([1]), np.zeros(1, dtype=np.int64), ["v"])
    t.consolidated()
    t.shard(2, 1)
    assert t.merged_rows == merged
    assert [id(b) for b in t.parts()[0]] == [id(b) for b in before[0]]


def _saturated_run(groups: int, keys_per_step: int, steps: int, seed: int = 1):
    """A linear aggregate's trace: one row per group, then each step retracts and replaces the rows of a few
    groups (2 rows per group): the key set never grows, so every merge above a few levels returns the same size."""
    rng = np.random.default_rng(seed)
    t = Trace(SCHEMA, ("k",))
    val = np.zeros(groups, dtype=np.int64)
    t.insert(dbsp.ZSet.from_arrow(pa.table({"k": np.arange(groups), "v": val}, schema=SCHEMA)).index_by(["k"]))
    per_step, rows = [], []
    for _ in range(steps):
        ks = rng.choice(groups, keys_per_step, replace=False)
        old = val[ks].copy()
        val[ks] += 1
        z = dbsp.ZSet.from_arrow(pa.table({"k": np.concatenate([ks, ks]), "v": np.concatenate([old, val[ks]])},
                                          schema=SCHEMA),
                                 weights=np.repeat(np.array([-1, 1], dtype=np.int64), keys_per_step))
        before = t.merged_rows
        t.key_sums(pa.table({"k": ks}), ["k"], *_probe(ks))  # a step reads, then inserts
        t.insert(z.index_by(["k"]))
        per_step.append(t.merged_rows - before)
        rows.append(2 * keys_per_step)
    return t, val, np.array(per_step), np.array(rows)


def _probe(ks: np.ndarray):
    kh = dbsp.ZSet.from_arrow(pa.table({"k": ks})).hash(["k"])
    order = np.argsort(kh, kind="stable")
    return kh[order], order, ["v"]


def test_merge_work_on_a_saturated_trace_stays_within_a_constant_factor_of_the_inserted_rows():
    groups, per, steps = 4096, 16, 3000
    t, val, merged, rows = _saturated_run(groups, per, steps)
    # content: one row per group with its current value
    assert t.consolidated().zset.to_dict() == {(k, int(v)): 1 for k, v in enumerate(val)}
    # amortized: each inserted row is merged about once per level between the step's size and the state's
    levels = math.log2(2 * groups / (2 * per)) + 3
    half = steps // 2
    first, second = merged[:half].sum() / rows[:half].sum(), merged[half:].sum() / rows[half:].sum()
    assert second <= levels, (first, second)
    assert second <= 1.25 * first + 1, (first, second)  # does not grow with the length of the run
    # per step: at most FUEL times the step's rows per level (no step pays for the whole state)
    assert merged.max() <= Trace.FUEL * rows.max() * (level_of(t.inserted_rows) + 1)
    assert merged.max() < groups
    assert len(t.batches) <= _batch_bound(t)
    t.check()


def test_a_shallow_copy_of_the_attributes_rolls_the_trace_back():
    """A failed step or staged attempt is rolled back by restoring a shallow copy of a trace's attributes
    (dbsp_core/runtime/rollback.py): later inserts, merges in progress and finished merges must not leak into it."""
    t = SlowTrace(SCHEMA, ("k",))
    model: dict = {}

    def insert(seed: int, n: int) -> None:
        z, d = _batch(seed, n, 60)
        t.insert(z.index_by(["k"]))
        for r, w in d.items():
            model[r] = model.get(r, 0) + w

    for i in range(12):
        insert(i, 10)
    saved_vars = {k: (list(v) if isinstance(v, list) else v) for k, v in vars(t).items()}
    saved_model = {r: w for r, w in model.items() if w}
    assert any(m is not None for _, _, m in t.levels())
    for i in range(12, 60):  # finishes the merges in progress at the capture and starts others
        insert(i, 40)
    vars(t).clear()
    vars(t).update({k: (list(x) if isinstance(x, list) else x) for k, x in saved_vars.items()})
    assert t.consolidated().zset.to_dict() == saved_model
    t.check()
    model = dict(saved_model)
    for i in range(100, 130):  # merges finished after the capture finish again, with the same outputs
        insert(i, 10)
        t.check()
    assert t.consolidated().zset.to_dict() == {r: w for r, w in model.items() if w}


def _fill(t: Trace, seeds, n: int, keys: int) -> dict:
    """Insert one random batch per seed into ``t``; returns the model of its content."""
    model: dict = {}
    for i in seeds:
        z, d = _batch(i, n, keys)
        t.insert(z.index_by(["k"]))
        for r, w in d.items():
            model[r] = model.get(r, 0) + w
    return {r: w for r, w in model.items() if w}


def test_a_rollback_leaves_the_key_index_stale_and_reads_rebuild_it():
    """Invariant 11: a rollback puts back the trace's attributes (its token among them) but not the index's own
    token, so an index that took inserts after the capture is never read; the next read rebuilds it."""
    for index in ("key", "row"):
        t = _new(SlowTrace, index)
        model = _fill(t, range(8), 10, 60)
        _check_reads(t, model, list(range(60)))
        ix = t._kix
        saved = {k: (list(v) if isinstance(v, list) else v) for k, v in vars(t).items()}
        for i in range(8, 20):  # the index takes these, then the rollback drops them from the batches
            t.insert(_batch(i, 40, 60)[0].index_by(["k"]))
        vars(t).clear()
        vars(t).update({k: (list(x) if isinstance(x, list) else x) for k, x in saved.items()})
        assert t._kix is ix and ix.token != t._token  # the same object, known stale
        _check_reads(t, model, list(range(60)))  # rebuilt from the batches: the model's sums, not the index's
        assert t._kix is not ix and t._kix.token == t._token
        t.check()


def test_a_restore_of_no_rows_serves_the_key_index_from_the_first_read():
    """Invariant 11: a clear (what a restore does first) leaves the index stale. Restored with no rows (a new
    durable pipeline's first load), the first read that wants it (an aggregate's step: index_for_update) builds it,
    reading nothing, and the inserts after it fold into it; restored with rows, the first two reads walk the
    batches and the third builds it."""
    for index in ("key", "row"):
        t = _new(Trace, index)
        spec = (index, tuple(INDEXES[index][0]))
        t.clear()
        assert t._kix is None
        ix = t.index_for_update(spec)
        assert ix is not None, index
        t.index_done(ix)
        assert t._kix is ix and ix.token == t._token, index
        model = _fill(t, range(6), 10, 30)
        _check_reads(t, model, list(range(30)))
        assert t._kix is ix and ix.token == t._token, index  # folded, not rebuilt
        t.clear()
        model = _fill(t, range(6, 9), 10, 30)
        for _ in range(2):
            _check_reads(t, model, list(range(30)))
            assert t._kix is None, index
        _check_reads(t, model, list(range(30)))
        assert t._kix is not None and t._kix.token == t._token, index
        t.check()


def test_an_index_that_overflows_is_dropped_and_reads_walk_the_batches():
    """Invariant 11: sums beyond int64 in the index turn it off; the walk over the batches then reports the
    overflow as it would without an index, and the content is untouched."""
    t = _new(Trace, "key")
    big = dbsp.ZSet.from_arrow(pa.table({"k": [1], "v": [2**62]}, schema=SCHEMA))
    t.insert(big.index_by(["k"]))
    with pytest.warns(dbsp.IndexDroppedWarning, match="leaves int64"):
        t.insert(dbsp.ZSet.from_arrow(pa.table({"k": [1], "v": [2**62 + 1]}, schema=SCHEMA)).index_by(["k"]))
    assert t._kix is None and t._kix_off
    probe = pa.table({"k": [1]}, schema=pa.schema([("k", pa.int64())]))
    kh = dbsp.ZSet.from_arrow(probe).hash(["k"])
    with pytest.raises(dbsp.WeightOverflowError):
        t.key_sums(probe, ["k"], kh, np.zeros(1, dtype=np.int64), ["v"])
    assert t.num_rows == 2


def test_indexes_past_the_process_budget_are_dropped_with_a_warning_and_reads_stay_exact():
    """csrc/keyindex.h invariant 6 through traces: under a budget that holds one trace's index, the second trace's
    index is dropped when its growth would pass it (one IndexDroppedWarning naming the budget), its reads walk the
    batches and match the model, and the first keeps its index."""
    import gc
    import warnings

    from dbsp_core import _zset

    gc.collect()
    saved = _zset.keyindex_budget()
    try:
        first = _new(Trace, "key")
        _zset.keyindex_budget(0)
        m1 = _fill(first, range(10), 200, 1_000)
        assert first._kix is not None and not first._kix_off
        _zset.keyindex_budget(_zset.keyindex_total_bytes() + 16 * 1024)  # room for a few small growths only
        second = _new(Trace, "key")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            m2 = _fill(second, range(10, 40), 200, 10_000)
        dropped = [w for w in seen if issubclass(w.category, dbsp.IndexDroppedWarning)]
        assert len(dropped) == 1 and "DBSP_KEY_INDEX_TOTAL_MB" in str(dropped[0].message), [str(w.message) for w in seen]
        assert second._kix is None and second._kix_off and first._kix is not None
        _check_reads(second, m2, list(range(0, 10_000, 97)))
        _check_reads(first, m1, list(range(0, 1_000, 7)))
        assert first._kix is not None  # still kept: its reads went through it
    finally:
        _zset.keyindex_budget(saved)


def test_the_key_index_limit_grows_with_memory_and_refuses_bad_settings():
    """trace.sizing.key_index_mb: DBSP_KEY_INDEX_MB when set; else an eighth of the memory (a 10M-group index of two sums,
    640 MiB, fits on a 24 GiB machine), never below 512 MiB; a setting that is not a positive number is refused with
    the variable's name instead of turning the indexes off or on silently."""
    from dbsp_core.trace.sizing import key_index_mb, memory_bytes

    assert key_index_mb(None, 24 * 2**30) == 3072.0
    assert key_index_mb("", 64 * 2**30) == 8192.0
    assert key_index_mb(None, 1 * 2**30) == 512.0 and key_index_mb(None, None) == 512.0
    assert key_index_mb(" 100.5 ", 64 * 2**30) == 100.5
    for bad in ("0", "-5", "lots", "nan", "inf"):
        with pytest.raises(ValueError, match="DBSP_KEY_INDEX_MB"):
            key_index_mb(bad, None)
    mem = memory_bytes()
    assert mem is None or mem > 2**26  # this process can use more than 64 MiB


def test_an_index_past_its_size_limit_is_dropped_before_it_grows(monkeypatch):
    """DBSP_KEY_INDEX_MB (trace.sizing.key_index_sizing().index_mb): the index refuses to grow past it (no transient table of twice the
    limit), the trace turns it off and its reads walk the batches, with the same results."""
    from dbsp_core.trace import sizing

    monkeypatch.setattr(sizing, "_sizing", sizing.key_index_sizing()._replace(index_mb=64 / 1024))  # 64 KiB: 2048
    # slots of 4 words
    t = _new(Trace, "key")
    with pytest.warns(dbsp.IndexDroppedWarning, match="DBSP_KEY_INDEX_MB"):
        model = _fill(t, range(40), 200, 10_000)
    assert t._kix is None and t._kix_off
    _check_reads(t, model, list(range(0, 10_000, 97)))


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from([1, 10, 40, 200])), min_size=1, max_size=12),
       st.sampled_from(list(INDEXES)[1:]), st.sampled_from([0.5, 1.0, 1e9]))
def test_a_key_index_larger_than_its_rows_is_dropped_and_reads_stay_exact(inserts, index, ratio):
    """Invariant 11's lean-state rule, with the floor at 0: an insert that changes a whole-row index's size keeps it
    only while its entries hold at most ``ratio`` times the bytes of the trace's rows, a dropped index stays
    dropped, a key index is never dropped by it, and reads (match_and_insert's old weights, key_sums, lookups)
    match a dict model either way."""
    saved = Trace.INDEX_FLOOR, Trace.INDEX_RATIO
    Trace.INDEX_FLOOR, Trace.INDEX_RATIO = 0, ratio
    try:
        t = _new(Trace, index)
        model: dict = {}
        dropped, size = False, t.index_bytes
        for seed, n in inserts:
            z, d = _batch(seed, n, 60)
            change = z.index_by(["k"])
            if index == "row":
                rows = list(zip(*(change.zset.data.column(c).to_pylist() for c in SCHEMA.names)))
                old = t.match_and_insert(change)
                assert old.tolist() == [model.get(r, 0) for r in rows]
            else:
                t.insert(change)
            for r, w in d.items():
                model[r] = model.get(r, 0) + w
            model = {r: w for r, w in model.items() if w}
            if t.index_spec is None:
                assert index == "row", "the rule dropped a key index"
                assert t.index_bytes == 0
                dropped = True
            else:
                assert not dropped, "a dropped index came back"
                if index == "row" and t.index_bytes != size:  # weighed: its entries at 3/4 full against the rows
                    ix = t._kix
                    assert len(ix) * (1 + ix.nkeys + ix.nvals) * 8 * 4 // 3 <= ratio * t.num_rows * t._row_bytes()
                size = t.index_bytes
            _check_reads(t, model, list(range(0, 60, 7)))
        if ratio == 0.5 and index == "row":
            assert dropped  # a whole-row entry (head, k, v, weight at 3/4 full: 42 B) passes half a row (32 B)
    finally:
        Trace.INDEX_FLOOR, Trace.INDEX_RATIO = saved
