"""The linear aggregate's step (old totals read in place, trace batches built in index order) against a dict model."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import _zset

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])

rows = st.tuples(st.one_of(st.none(), st.integers(0, 6)), st.sampled_from(["a", "b", None]),
                 st.one_of(st.none(), st.integers(-5, 5)))


def _model(bag: dict) -> dict:
    """{(k, s): (count, sum or None, count(v))} over rows with non-zero multiplicity, as SQL GROUP BY does."""
    out: dict = {}
    for (k, s, v), m in bag.items():
        c, t, n = out.get((k, s), (0, 0, 0))
        out[(k, s)] = (c + m, t + (v or 0) * m, n + (m if v is not None else 0))
    return {key: (c, t if n else None, n) for key, (c, t, n) in out.items() if c != 0}


@given(st.lists(st.lists(st.tuples(rows, st.sampled_from([1, 1, 2, -1])), max_size=12), min_size=1, max_size=6),
       st.sampled_from([1, 2]))
def test_linear_aggregate_matches_model_and_keeps_trace_batches_in_index_order(steps, workers):
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k", "s").agg(n=dbsp.count(), total=dbsp.sum("v"), nv=dbsp.count("v")))
    def in_index_order(p):
        for wk in range(workers):
            for trace in p.traces(wk).values():
                for b in trace.batches:
                    keypos = [b.schema.get_field_index(k) for k in b.key]
                    assert _zset.check_order(b.zset.data, b.zset.weights, b.key_hash, keypos)

    with dbsp.Pipeline(c, workers=workers) as p:
        _steps_match_model(p, steps, SCHEMA, in_index_order)


def _steps_match_model(p, steps, schema, check) -> None:
    """Push each step's rows (deleting only rows that are there: a relation), step, and compare the integrated view
    of output "g" (key, key, n, total, nv) with :func:`_model` after every step; ``check(p)`` runs after each."""
    bag: dict = {}
    view: dict = {}
    for step in steps:
        for r, w in step:
            if w < 0 and bag.get(r, 0) <= 0:
                continue
            bag[r] = bag.get(r, 0) + w
            p.push("t", dbsp.ZSet.from_rows([r], schema, weights=[w]))
        for row, w in p.step()["g"].to_dict().items():
            view[row] = view.get(row, 0) + w
        view = {r: w for r, w in view.items() if w}
        assert all(w == 1 for w in view.values())
        assert {(a, b): (n, tot, nv) for (a, b, n, tot, nv) in view} == _model(bag)
        check(p)


def _fold_model(old, delta, khash):
    """The linear fold spelled out in numpy: changed groups' new (+1) and old (-1) rows, in group order."""
    import numpy as np

    new = old + delta
    out = []
    for g in np.flatnonzero((delta != 0).any(axis=1)):
        if new[g, 0] != 0:
            out.append((int(g), 1, tuple(new[g])))
        if old[g, 0] != 0:
            out.append((int(g), -1, tuple(old[g])))
    return out


@given(st.data())
def test_linear_fold_equals_model_and_orders_rows_canonically(data):
    """csrc/fold.c: the rows of a step equal the numpy model's, and when it says they are ordered, the table of
    (key, slots) rows is in canonical index order (key hash, then row hash: the key hash extended by the slots)."""
    import numpy as np

    keys = data.draw(st.lists(st.one_of(st.none(), st.integers(-3, 30)), min_size=0, max_size=12, unique=True))
    ns = data.draw(st.integers(1, 3))
    ng = len(keys)
    kt = pa.table({"k": pa.array(keys, pa.int64())})
    kh = _zset.hash_columns(kt, [0]) if ng else np.zeros(0, np.uint64)
    order = np.argsort(kh, kind="stable")
    kt, kh = kt.take(pa.array(order, pa.int64())), kh[order]
    vals = st.integers(-3, 3)
    old = np.array(data.draw(st.lists(st.lists(vals, min_size=ns, max_size=ns), min_size=ng, max_size=ng)),
                   np.int64).reshape(ng, ns)
    delta = np.array(data.draw(st.lists(st.lists(vals, min_size=ns, max_size=ns), min_size=ng, max_size=ng)),
                     np.int64).reshape(ng, ns)
    grp, w, okh, v, ordered = _zset.linear_fold(old, delta, kh)
    got = sorted((int(g), int(x), tuple(int(y) for y in v[:, i])) for i, (g, x) in enumerate(zip(grp, w)))
    assert got == sorted(_fold_model(old, delta, kh))
    assert (okh == kh[grp]).all()
    if ordered and len(grp):
        t = kt.take(pa.array(grp, pa.int64()))
        for j in range(ns):
            t = t.append_column(f"p{j}", pa.array(v[j]))
        assert _zset.check_order(t, w, okh, [0])


def test_linear_fold_overflow_emits_nothing():
    import numpy as np
    import pytest

    from dbsp_core.errors import WeightOverflowError

    old = np.array([[1, 2**63 - 1]], np.int64)
    with pytest.raises(WeightOverflowError):
        _zset.linear_fold(old, np.array([[1, 1]], np.int64), np.array([5], np.uint64))


INT_SCHEMA = pa.schema([("k", pa.int64()), ("j", pa.int32()), ("v", pa.int64())])
int_rows = st.tuples(st.one_of(st.none(), st.integers(0, 6)), st.integers(0, 2), st.one_of(st.none(), st.integers(-5, 5)))


@given(st.lists(st.lists(st.tuples(int_rows, st.sampled_from([1, 1, 2, -1])), max_size=12), min_size=1, max_size=6),
       st.sampled_from([1, 2]))
def test_linear_aggregate_through_the_key_index_matches_model(steps, workers):
    """Fixed-width keys: a step reads and stores totals through the key index in one call (_zset.linear_step);
    views match the model and every trace's batches and index agree (Trace.check)."""
    c = dbsp.Circuit()
    t = c.input("t", INT_SCHEMA)
    c.output("g", t.group_by("k", "j").agg(n=dbsp.count(), total=dbsp.sum("v"), nv=dbsp.count("v")))
    with dbsp.Pipeline(c, workers=workers) as p:
        kept = [tr for wk in range(workers) for tr in p.traces(wk).values() if tr.index_spec is not None]
        assert kept, "the aggregate's trace keeps no key index: the test would not exercise linear_step"
        _steps_match_model(p, steps, INT_SCHEMA, lambda p: [tr.check() for tr in kept])


@given(st.lists(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 40)), st.integers(-3, 3),
                                   st.sampled_from([1, 1, 2, -1, -2])), max_size=40), min_size=1, max_size=8))
def test_linear_step_equals_the_fold_over_a_separately_kept_index(steps):
    """_zset.linear_step (group, probe, fold, store in one call) gives linear_fold's rows for the old totals of an
    index kept by adding every emitted row, the row hashes of those rows, and leaves its index equal to that one."""
    import numpy as np

    schema = pa.schema([("k", pa.int64()), ("p_0", pa.int64()), ("p_1", pa.int64())])
    fused, kept = _zset.KeyIndex([pa.int64()], 2), _zset.KeyIndex([pa.int64()], 2)
    seen: set = set()
    for step in steps:
        if not step:
            continue
        t = pa.table({"k": pa.array([r[0] for r in step], pa.int64()), "p_0": pa.array([1] * len(step), pa.int64()),
                      "p_1": pa.array([r[1] for r in step], pa.int64())}, schema=schema)
        w = np.array([r[2] for r in step], np.int64)
        view = _zset.BatchView(t, w)
        rows, fw, fkh, rh, fvals, ordered = _zset.linear_step(view, (0,), (1, 2), fused)
        # the same step the long way: group, read the other index, fold
        group_row, khash, delta, _, _ = _zset.group_reduce(view, None, (0,), [("sum", 1), ("sum", 2)], True)
        old = np.zeros((len(group_row), 2), np.int64)
        if len(group_row):
            kept.get(view, [0], khash, old, sel=group_row)
        grp, w2, kh2, vals2, ordered2 = _zset.linear_fold(old, delta, khash)
        assert (rows == group_row[grp]).all() and (fw == w2).all() and (fkh == kh2).all()
        assert (fvals == vals2).all() and ordered == ordered2
        out = pa.table({"k": t.column("k").take(pa.array(rows, pa.int64())), "p_0": pa.array(fvals[0]),
                        "p_1": pa.array(fvals[1])}, schema=schema)
        if len(rows):
            assert (rh == _zset.hash_columns(out, [0, 1, 2])).all()
            kept.add(out, fw, [0], fkh, [1, 2])
        fused.check()
        seen.update(t.column("k").to_pylist())
        probe = pa.table({"k": pa.array(sorted(seen, key=lambda x: (x is None, x)), pa.int64())})
        ph = _zset.hash_columns(probe, [0])
        a, b = np.zeros((len(seen), 2), np.int64), np.zeros((len(seen), 2), np.int64)
        fused.get(probe, [0], ph, a)
        kept.get(probe, [0], ph, b)
        assert (a == b).all() and len(fused) == len(kept)


def test_linear_step_overflow_leaves_the_index_unchanged():
    import numpy as np
    import pytest

    from dbsp_core.errors import WeightOverflowError

    ix = _zset.KeyIndex([pa.int64()], 2)
    t = pa.table({"k": [1, 2], "p_0": [1, 1], "p_1": [5, 2**62]})
    _zset.linear_step(_zset.BatchView(t, np.ones(2, np.int64)), (0,), (1, 2), ix)
    big = pa.table({"k": [1, 2], "p_0": [1, 1], "p_1": [1, 2**62]})
    with pytest.raises(WeightOverflowError):  # key 2's total would pass int64; key 1's must not be stored either
        _zset.linear_step(_zset.BatchView(big, np.ones(2, np.int64)), (0,), (1, 2), ix)
    acc = np.zeros((2, 2), np.int64)
    ix.get(t, [0], _zset.hash_columns(t, [0]), acc)
    assert acc.tolist() == [[1, 5], [1, 2**62]] and not ix.broken


@given(st.lists(st.lists(st.tuples(st.integers(0, 4), st.integers(-2, 2), st.sampled_from([1, 1, -1])), max_size=8),
                min_size=1, max_size=6), st.sampled_from([1, 2, 3]))
def test_aggregate_output_is_distinct_without_a_sort(steps, workers):
    """A step's change of a sum-only view: a group whose sum did not change (a 0 added, or +x -x) has equal new and
    old rows, which cancel (zset.sum_adjacent); the output the pipeline hands over is distinct (no two equal rows, no
    zero weight) without being sorted, and its integral is the model's."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    c.output("g", c.input("t", schema).group_by("k").agg(total=dbsp.sum("v")))
    bag: dict = {}
    view: dict = {}
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in steps:
            for k, v, w in step:
                if w < 0 and bag.get((k, v), 0) <= 0:
                    continue
                bag[(k, v)] = bag.get((k, v), 0) + w
                p.push("t", dbsp.ZSet.from_rows([(k, v)], schema, weights=[w]))
            out = p.step()["g"]
            t = out.to_arrow()
            rows = list(zip(t.column("k").to_pylist(), t.column("total").to_pylist()))
            assert len(set(rows)) == len(rows) == len(out), "equal rows in a step's output"
            assert 0 not in t.column("weight").to_pylist()
            assert out.to_dict() == out.consolidate().to_dict()
            for row, w in out.to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
            model: dict = {}
            for (k, v), m in bag.items():
                if m:
                    model[k] = (model.get(k, (0, 0))[0] + m, model.get(k, (0, 0))[1] + v * m)
            assert view == {(k, tot): 1 for k, (n, tot) in model.items() if n}


def test_linear_step_rows_pin_only_their_own_bytes():
    """What linear_step hands back for the trace batch (weights, key hashes, row hashes, slot values) are arrays of
    their own size, whether its rows fill most of its buffer (a step of new groups: one row a group) or few of it
    (most groups' sums cancelled): a fresh batch pins no byte beyond its own, which the budget counts (spill.py
    ``batch_bytes``). Both equal linear_fold's rows for the same old totals. Watched fail on the code that returned
    slices of its one buffer when the rows filled half of it (the weights' base: 2 x 500 x 6 words for 500 rows)."""
    import numpy as np

    schema = pa.schema([("k", pa.int64()), ("p_0", pa.int64()), ("p_1", pa.int64())])
    ix, kept = _zset.KeyIndex([pa.int64()], 2), _zset.KeyIndex([pa.int64()], 2)
    n = 500
    new = pa.table({"k": np.arange(n), "p_0": np.ones(n, np.int64), "p_1": np.arange(n) * 3}, schema=schema)
    # step 2: every key +1 and -1 (its sums cancel) but for keys 0..9, which change
    keys = np.concatenate([np.arange(n), np.arange(n)])
    back = pa.table({"k": keys, "p_0": np.ones(2 * n, np.int64), "p_1": np.where(keys < 10, 7, 5)}, schema=schema)
    wb = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])

    def root(a: np.ndarray) -> np.ndarray:
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    for t, w in ((new, np.ones(n, np.int64)), (back, wb)):
        view = _zset.BatchView(t, w)
        rows, fw, fkh, rh, fvals, _ = _zset.linear_step(view, (0,), (1, 2), ix)
        group_row, khash, delta, _, _ = _zset.group_reduce(view, None, (0,), [("sum", 1), ("sum", 2)], True)
        old = np.zeros((len(group_row), 2), np.int64)
        kept.get(view, [0], khash, old, sel=group_row)
        grp, w2, kh2, vals2, _ = _zset.linear_fold(old, delta, khash)
        assert (rows == group_row[grp]).all() and (fw == w2).all() and (fkh == kh2).all() and (fvals == vals2).all()
        out = pa.table({"k": t.column("k").take(pa.array(rows, pa.int64())), "p_0": pa.array(fvals[0]),
                        "p_1": pa.array(fvals[1])}, schema=schema)
        assert (rh == _zset.hash_columns(out, [0, 1, 2])).all()
        kept.add(out, fw, [0], fkh, [1, 2])
        for a in (fw, fkh, rh, fvals):  # each pins its own bytes only
            assert root(a).nbytes == a.nbytes, (root(a).nbytes, a.nbytes, len(fw))


def test_fused_step_output_distinct_without_the_adjacent_pass():
    """The fused linear group-by (runtime/plan.py) skips sum_adjacent when no group's new and old rows finalize
    equal (Aggregate.ints_may_cancel) and flags its output distinct; a group whose shown columns did not change (a
    sum over a new row of v = 0, a group whose rows cancel within the step) must still output nothing, and the
    output holds no row twice, at W = 1 where the chain fuses (a step with a null v runs unfused: the first)."""
    import numpy as np

    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    t = c.input("t", schema)
    c.output("g", t.group_by("k").agg(total=dbsp.sum("v")))
    c.output("h", t.group_by("k").agg(n=dbsp.count("v"), total=dbsp.sum("v")))
    with dbsp.Pipeline(c, workers=1) as p:
        p.push("t", pa.table({"k": [1, 2, 3, 4], "v": [5, 6, None, 7]}, schema=schema))
        p.step()
        counts = p.executor._workers[0].plan.counts
        assert counts["fused"] == 0
        # k=1: +v=0 (g's total unchanged: nothing for it; h's count(v) changes); k=2: +v=3; k=5: a new group;
        # k=4: +7 and -7 in one step (no change)
        p.push("t", pa.table({"k": [1, 2, 5, 4], "v": [0, 3, 1, 7]}, schema=schema))
        p.push("t", pa.table({"k": [4], "v": [7]}, schema=schema), weights=np.array([-1]))
        out = p.step()
        assert counts["fused"] == 2  # both chains, the second step
        for name in ("g", "h"):
            rows = out[name].to_dict()
            assert all(w != 0 for w in rows.values())
            assert len(rows) == out[name].num_rows, f"{name}: a row twice in a distinct output"
        assert out["g"].to_dict() == {(2, 9): 1, (2, 6): -1, (5, 1): 1}
        assert out["h"].to_dict() == {(1, 2, 5): 1, (1, 1, 5): -1, (2, 2, 9): 1, (2, 1, 6): -1, (5, 1, 1): 1}
