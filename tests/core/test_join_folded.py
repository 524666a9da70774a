"""A join folded into its linear group-by's totals in one C call (csrc/joinlin.h, ``_zset.JoinLinearRun``; operators/join.py
invariant 8, runtime/plan.py ``_JoinFolded``), against DuckDB and the chain it replaces.

Random steps with inserts and deletions on both sides, duplicate rows, keys with no match, nulls in the join keys,
the group keys and (some steps) the summed values, group keys from either side: every step's output equals the
unfolded chain's (``_JoinFolded.C_STEP`` off) and the integrated view equals DuckDB's recompute over the
consolidated inputs, at W = 1 (where the folded step serves every step without a null value: ``counts["folded"]``)
and W = 2 (where it does not apply). A StepError after the folded step stored its totals rolls back exactly; a sum
past int64 fails the step naming the aggregate and changes nothing; a join weight past int64 falls back to the
join's own step, which names the join. DBSP_TEST_SEED replays the random rows."""

from __future__ import annotations

import os
import random
from collections import Counter

import duckdb
import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import StepError, WeightOverflowError
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.plan import _JoinFolded

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
# under a memory budget every trace spills, and a step whose walk would read a spilled batch is not folded
# (operators/join.py invariant 8): the counts of folded steps are asserted without one
SPILLED = bool(os.environ.get("DBSP_MEMORY_LIMIT"))
T = pa.schema([("k", pa.int64()), ("j", pa.int64()), ("v", pa.int64())])
U = pa.schema([("id", pa.int64()), ("g", pa.int32()), ("m", pa.int64())])
VIEWS = {  # name: (group key, SQL of the view over the consolidated inputs tc, uc with weights tw, uw)
    # the group key from the right side, a count and a sum of a left column (nulls in v some steps)
    "r": ("g", "SELECT g, sum(tw * uw), sum(v * tw * uw), sum(CASE WHEN v IS NULL THEN 0 ELSE tw * uw END) "
               "FROM tc JOIN uc ON k = id GROUP BY g HAVING sum(tw * uw) != 0"),
    # the group key from the left side, a sum of a right column (never null)
    "l": ("j", "SELECT j, sum(tw * uw), sum(m * tw * uw) FROM tc JOIN uc ON k = id GROUP BY j "
               "HAVING sum(tw * uw) != 0"),
}


def _circuit(poison: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t, u = c.input("t", T), c.input("u", U)
    c.output("r", t.join(u, left_on="k", right_on="id").group_by("g").agg(
        n=dbsp.count(), total=dbsp.sum("v"), nv=dbsp.count("v")))
    c.output("l", t.join(u, left_on="k", right_on="id").group_by("j").agg(n=dbsp.count(), total=dbsp.sum("m")))
    if poison:  # a later node that fails on a row with v == 666, after both folded steps stored their totals
        def boom(batch: pa.RecordBatch) -> pa.RecordBatch:
            if batch.num_rows and 666 in batch.column("v").to_pylist():
                raise ValueError("poison")
            return batch
        c.output("x", t.flat_map(boom, schema=T))
    return c


def _delta(rng: np.random.Generator, bag: Counter, row, n: int) -> Counter:
    """A step's change of one side: ``n`` draws of ``row()`` (duplicates among them and of rows there), and
    deletions of rows in ``bag`` (part of a row's multiplicity, or all of it)."""
    d: Counter = Counter()
    for _ in range(n):
        d[row()] += int(rng.integers(1, 3))
    live = [r for r, w in bag.items() if w > 0]
    for i in rng.permutation(len(live))[:int(rng.integers(0, n // 2 + 2))]:
        d[live[i]] -= int(rng.integers(1, bag[live[i]] + 1))
    return Counter({r: w for r, w in d.items() if w})


def _maybe(rng: np.random.Generator, x: int, p: float) -> int | None:
    return None if rng.random() < p else x


def _deltas(rng: np.random.Generator, steps: int) -> list[tuple[Counter, Counter]]:
    """Both sides' changes per step: keys 0..24 on t, 0..29 on u (some of each match nothing), nulls in the join
    keys and the group keys, nulls in v on every fifth step only (so the other steps fold)."""
    tb: Counter = Counter()
    ub: Counter = Counter()
    out = []
    for s in range(steps):
        pv = 0.2 if s % 5 == 4 else 0.0
        dt = _delta(rng, tb, lambda: (_maybe(rng, int(rng.integers(0, 25)), 0.05), _maybe(rng, int(rng.integers(0, 4)),
                    0.1), _maybe(rng, int(rng.integers(-50, 50)), pv)), int(rng.integers(0, 60)))
        du = _delta(rng, ub, lambda: (_maybe(rng, int(rng.integers(5, 35)), 0.05), _maybe(rng, int(rng.integers(0, 6)),
                    0.1), int(rng.integers(-9, 9))), int(rng.integers(0, 12)) if s % 3 else 0)
        tb.update(dt)
        ub.update(du)
        tb = Counter({r: w for r, w in tb.items() if w})
        ub = Counter({r: w for r, w in ub.items() if w})
        out.append((dt, du))
    return out


def _push(p: dbsp.Pipeline, dt: Counter, du: Counter) -> None:
    if dt:
        p.push("t", dbsp.ZSet.from_rows(list(dt), T, weights=list(dt.values())))
    if du:
        p.push("u", dbsp.ZSet.from_rows(list(du), U, weights=list(du.values())))


def _duckdb(con: duckdb.DuckDBPyConnection, tb: Counter, ub: Counter) -> dict[str, dict]:
    """Each view's rows over the multisets: DuckDB's recompute over the consolidated inputs (weights tw, uw)."""
    con.execute("DELETE FROM tc; DELETE FROM uc")
    for name, bag, schema in (("tc", tb, T), ("uc", ub, U)):
        if bag:
            rows = pa.Table.from_pylist([dict(zip(schema.names, r)) for r in bag], schema=schema)
            con.register("chg", rows.append_column("w", pa.array(list(bag.values()), pa.int64())))
            con.execute(f"INSERT INTO {name} SELECT * FROM chg")
            con.unregister("chg")
    out = {}
    for name, (_, sql) in VIEWS.items():
        rows = con.execute(sql).fetchall()
        if name == "r":  # (g, n, total, nv): the sum null where no value counted (Aggregate.finalize_ints)
            rows = [(g, n, s if nv else None, nv) for g, n, s, nv in rows]
        out[name] = {tuple(r): 1 for r in rows}
    return out


def _con() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("CREATE TABLE tc (k BIGINT, j BIGINT, v BIGINT, tw BIGINT); "
                "CREATE TABLE uc (id BIGINT, g INTEGER, m BIGINT, uw BIGINT)")
    return con


def _counts(p: dbsp.Pipeline, name: str) -> int:
    return sum(wk.plan.counts[name] for wk in p.executor._workers)


def _run(deltas: list, workers: int, folded: bool, monkeypatch) -> tuple[list, int]:
    """Every step's outputs, and the steps the folded path served."""
    monkeypatch.setattr(_JoinFolded, "C_STEP", folded)
    outs = []
    with dbsp.Pipeline(_circuit(), workers=workers, executor=EmbeddedExecutor(step_plan=True)) as p:
        for dt, du in deltas:
            _push(p, dt, du)
            outs.append({n: z.to_dict() for n, z in p.step().items()})
        for w in range(p.workers):
            for tr in p.traces(w).values():
                tr.check()  # batches consolidated, key indexes equal to the sums over them
        return outs, _counts(p, "folded")


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", range(3))
def test_folded_join_group_by_matches_duckdb_and_the_unfolded_chain(workers: int, case: int, monkeypatch) -> None:
    rng = np.random.default_rng(SEED + 31 * case + workers)
    deltas = _deltas(rng, 50)
    folded, served = _run(deltas, workers, True, monkeypatch)
    unfolded, off = _run(deltas, workers, False, monkeypatch)
    assert off == 0
    assert folded == unfolded, f"seed {SEED}"  # step by step, the same changes
    con = _con()
    tb: Counter = Counter()
    ub: Counter = Counter()
    view = {n: Counter() for n in VIEWS}
    for i, ((dt, du), got) in enumerate(zip(deltas, folded)):
        tb.update(dt)
        ub.update(du)
        tb = Counter({r: w for r, w in tb.items() if w})
        ub = Counter({r: w for r, w in ub.items() if w})
        for n in VIEWS:
            view[n].update(got[n])
            view[n] = Counter({r: w for r, w in view[n].items() if w})
        assert {n: dict(v) for n, v in view.items()} == _duckdb(con, tb, ub), f"step {i} (seed {SEED})"
    changed = sum(1 for dt, du in deltas if dt or du)
    if workers > 1:  # at W > 1 the join's inputs are received runs of indexes: the chain of _JoinSlots serves it
        assert served == 0
    elif not SPILLED:  # view "l" (no null summed) folds every step with a change; "r" the steps whose pairs meet
        # no null v (before the first null step, at least)
        assert changed < served <= 2 * changed, (served, changed)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_rolled_back_step_after_the_folded_step_leaves_state_exact(workers: int) -> None:
    """A push that a later node fails on (StepError) after both folded steps stored their totals and inserted the
    join's changes: rolled back and discarded, the next steps' views stay DuckDB's over the rows kept."""
    rng = np.random.default_rng(SEED + 7 + workers)
    deltas = _deltas(rng, 16)
    con = _con()
    tb: Counter = Counter()
    ub: Counter = Counter()
    view = {n: Counter() for n in VIEWS}
    with dbsp.Pipeline(_circuit(poison=True), workers=workers) as p:
        for i, (dt, du) in enumerate(deltas):
            if i in (3, 11):  # rows that meet u's rows (a change of both sides), then the node that fails
                p.push("t", dbsp.ZSet.from_rows([(k, 1, 666) for k in range(5, 25)], T))
                p.push("u", dbsp.ZSet.from_rows([(k, 2, 1) for k in range(5, 25)], U))
                before = _counts(p, "folded")
                with pytest.raises(StepError, match="poison") as info:
                    p.step()
                # the folded steps ran (view "l"'s at least: "r"'s pairs may meet a null v), then were undone
                assert workers > 1 or SPILLED or _counts(p, "folded") >= before + 1
                for _, producer, seq in info.value.inputs:
                    p.discard(producer, seq)
                assert all(not z.to_dict() for z in p.step().values())  # the step that waited, without them
            _push(p, dt, du)
            got = p.step()
            tb.update(dt)
            ub.update(du)
            tb = Counter({r: w for r, w in tb.items() if w})
            ub = Counter({r: w for r, w in ub.items() if w})
            for n in VIEWS:
                view[n].update(got[n].to_dict())
                view[n] = Counter({r: w for r, w in view[n].items() if w})
            assert {n: dict(v) for n, v in view.items()} == _duckdb(con, tb, ub), f"step {i} (seed {SEED})"
        for w in range(p.workers):
            for tr in p.traces(w).values():
                tr.check()


def test_overflows_in_the_folded_step() -> None:
    """A sum past int64 fails the step with the aggregate named and changes nothing (csrc/joinlin.h invariant 4):
    after the discard the next steps fold on. A join weight past int64 is not served: the join's own step raises
    it, naming the join."""
    c = dbsp.Circuit()
    t, u = c.input("t", T), c.input("u", U)
    c.output("s", t.join(u, left_on="k", right_on="id").group_by("g").agg(total=dbsp.sum("v")))
    with dbsp.Pipeline(c, workers=1) as p:
        p.push("u", dbsp.ZSet.from_rows([(1, 7, 0), (2, 8, 0)], U))
        p.push("t", dbsp.ZSet.from_rows([(1, 0, 2**62), (2, 0, 5)], T))
        assert p.step()["s"].to_dict() == {(7, 2**62): 1, (8, 5): 1}
        p.push("t", dbsp.ZSet.from_rows([(1, 1, 2**62), (2, 1, 1)], T))
        with pytest.raises(StepError) as info:
            p.step()
        assert isinstance(info.value.__cause__, WeightOverflowError), info.value.__cause__
        assert "aggregate" in str(info.value.__cause__) or "sum" in str(info.value.__cause__)
        p.discard(*info.value.inputs[-1][1:])
        assert p.step()["s"].to_dict() == {}
        p.push("t", dbsp.ZSet.from_rows([(1, 0, -1), (2, 0, 1)], T))
        assert p.step()["s"].to_dict() == {(7, 2**62): -1, (7, 2**62 - 1): 1, (8, 5): -1, (8, 6): 1}
        folded = _counts(p, "folded")
        assert folded == 2 or SPILLED
        p.push("t", dbsp.ZSet.from_rows([(2, 5, 0)], T, weights=[2**40]))
        p.push("u", dbsp.ZSet.from_rows([(2, 9, 0)], U, weights=[2**40]))
        with pytest.raises(StepError) as info:
            p.step()
        assert isinstance(info.value.__cause__, WeightOverflowError), info.value.__cause__
        assert "join" in str(info.value.__cause__)
        assert _counts(p, "folded") == folded  # not served: the join's own step raised it
        for _, producer, seq in info.value.inputs:
            p.discard(producer, seq)
        assert p.step()["s"].to_dict() == {}  # the step that waited, without the pushes discarded
        p.push("t", dbsp.ZSet.from_rows([(2, 2, 3)], T))
        assert p.step()["s"].to_dict() == {(8, 6): -1, (8, 9): 1}
        assert _counts(p, "folded") == folded + 1 or SPILLED


def test_sql_view_of_a_join_then_group_by_is_folded() -> None:
    """The SQL front end's join then group-by lowers to the chain the plan folds."""
    from dbsp_core import sql  # noqa: PLC0415 (the SQL front end, only here)

    c = sql.compile("CREATE TABLE bids (auction BIGINT, price BIGINT); CREATE TABLE auctions (id BIGINT, "
                    "category BIGINT); CREATE VIEW v AS SELECT category, count(*) AS n, sum(price) AS total FROM bids "
                    "JOIN auctions ON bids.auction = auctions.id GROUP BY category")
    with dbsp.Pipeline(c, workers=1) as p:
        p.push("auctions", pa.table({"id": [1, 2, 3], "category": [10, 10, 20]}))
        p.push("bids", pa.table({"auction": [1, 2, 3, 4], "price": [5, 6, 7, 8]}))
        assert p.step()["v"].to_dict() == {(10, 2, 11): 1, (20, 1, 7): 1}
        assert _counts(p, "folded") == 1 or SPILLED


@pytest.mark.parametrize("workers", [1, 2])
def test_folded_steps_between_reads_keep_the_totals_traces_exact(workers: int, monkeypatch) -> None:
    """Reads between steps (each a sync of the totals kept per key, after which the key index holds clean keys
    again): the folded steps that follow, told when every key is dirty (``pk_found_dirty``, csrc/linrun.h invariant
    6) and asking for their totals batch in key-hash order (invariant 8), record each clean key they touch, so every
    read's traces equal a lockstep pipeline's running the unfolded chain, every step's outputs equal its, and the
    integrated views equal DuckDB's recompute. The step after a read touches one group of each view, so the next
    finds dirty and clean keys both; new keys come late (groups the index never held)."""
    from dbsp_core.trace.keyindex import PerKeyTotals  # noqa: PLC0415

    rng = np.random.default_rng(SEED + 101 + workers)
    deltas = _deltas(rng, 40)
    late = [(k, 7 + k % 3, 1) for k in range(5, 25)]  # group keys j = 7..9 (view "l"), never seen before step 30
    deltas[30] = (deltas[30][0] + Counter(late), deltas[30][1])
    for i in range(6, 40, 6):  # the step after a read touches one group of each view: the step after it finds
        deltas[i] = (Counter({(5 + i % 20, i % 4, 1): 1}), Counter())  # the other keys clean, some keys dirty
    pipes = {}
    for on in (True, False):
        monkeypatch.setattr(_JoinFolded, "C_STEP", on)
        pipes[on] = dbsp.Pipeline(_circuit(), workers=workers, executor=EmbeddedExecutor(step_plan=True))
    ran = PerKeyTotals.pk_found_dirty_steps
    con = _con()
    tb: Counter = Counter()
    ub: Counter = Counter()
    view = {n: Counter() for n in VIEWS}
    try:
        for i, (dt, du) in enumerate(deltas):
            outs = {}
            for on, p in pipes.items():
                _push(p, dt, du)
                outs[on] = {n: z.to_dict() for n, z in p.step().items()}
            assert outs[True] == outs[False], f"step {i} (seed {SEED})"
            tb.update(dt)
            ub.update(du)
            tb = Counter({r: w for r, w in tb.items() if w})
            ub = Counter({r: w for r, w in ub.items() if w})
            for n in VIEWS:
                view[n].update(outs[True][n])
                view[n] = Counter({r: w for r, w in view[n].items() if w})
            assert {n: dict(v) for n, v in view.items()} == _duckdb(con, tb, ub), f"step {i} (seed {SEED})"
            if i % 6 == 5:  # a read: every trace synced (the totals' from their indexes) and checked
                states = {}
                for on, p in pipes.items():
                    states[on] = []
                    for w in range(p.workers):
                        for name, tr in sorted(p.traces(w).items()):
                            tr.check()
                            states[on].append((name, tr.consolidated().zset.to_dict()))
                assert states[True] == states[False], f"step {i} (seed {SEED})"
        folded = _counts(pipes[True], "folded")
    finally:
        for p in pipes.values():
            p.close()
    if workers == 1 and not SPILLED:
        assert folded > 0
        assert PerKeyTotals.pk_found_dirty_steps > ran, "the found-dirty path never ran"
