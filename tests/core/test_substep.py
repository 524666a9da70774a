"""Steps run in pieces under a memory budget (dbsp_core/runtime/substep.py): with the piece size forced small, big pushes through joins, aggregates, distinct, min/max under deletion, top-k, a fixpoint and a SQL view give, step by step, the output of the same pipeline without a budget (a Z-set: multisets) and DuckDB's answer over the integrated inputs, at W=1 and W=2, and the pieces did run; circuits that must not be split run whole; a durable pipeline reopened after split steps (closed, or copied as a kill leaves it) goes on exactly."""

from __future__ import annotations

import logging
import os
import random
import shutil
from typing import Callable

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.substep import pieces
from oracle import AUCTIONS, BIDS, ChangeGen, _diff, accumulate, duckdb_query, normalize, to_zset
from test_circuit_composed import JOIN_GROUP_SQL, _join_then_group
from test_fixpoint import E as EDGES, QUERIES as FIXPOINT_SQL, build as fixpoint_build

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
PIECE = 256  # bytes of pushed Arrow data per piece: a few rows, so a step of tens of rows runs in many pieces
TINY = 1  # memory_limit: every batch spills


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


class _Edges(ChangeGen):
    def row(self) -> tuple:
        return (int(self.rng.integers(0, 9)), int(self.rng.integers(0, 9)))


def _split(p: dbsp.Pipeline) -> dict:
    return p.executor.stats.get("substeps", {})


def _distinct(z: dbsp.ZSet) -> bool:
    """No two equal rows, no zero weight (executor invariant 1)."""
    return z.num_rows == z.consolidate().num_rows and bool((z.weights != 0).all())


def _compare(build: Callable[[dbsp.Circuit, dict], dict], queries: dict[str, str], schemas: dict[str, pa.Schema],
             workers: int, steps: int = 4, rows: int = 60, gen: type = ChangeGen, sql: bool = False,
             seed: int = SEED, piece: int = PIECE) -> dict:
    """Push the same random changes (inserts, duplicates, deletions of present rows; ``rows`` at most a step, several
    pushes a step) to a pipeline whose steps run in pieces of PIECE bytes under a budget and to one without a budget:
    every step's output must be the same Z-set in both, distinct, and each view's integral DuckDB's answer. Returns
    the split pipeline's substep counters."""
    rng = np.random.default_rng(seed)

    def circuit() -> dbsp.Circuit:
        if sql:
            return dbsp.sql.compile(build(None, {}))  # type: ignore[arg-type]
        c = dbsp.Circuit()
        streams = {name: c.input(name, s) for name, s in schemas.items()}
        for name, s in build(c, streams).items():
            c.output(name, s)
        return c

    gens = {name: gen(rng, s) for name, s in schemas.items()}
    views: dict[str, dict] = {name: {} for name in queries}
    split = dbsp.Pipeline(circuit(), workers=workers, executor=EmbeddedExecutor(substep_bytes=piece),
                          memory_limit=TINY)
    whole = dbsp.Pipeline(circuit(), workers=workers)
    big = 0  # steps whose pushes hold more than a piece
    try:
        for step in range(steps):
            size = 0
            while True:  # the first step pushes until it holds more than two pieces: some seeds draw few rows
                for name, g in gens.items():
                    change = g.change(rows if step == 0 else rows // 2)
                    keys = list(change)
                    cut = int(rng.integers(0, len(keys) + 1))
                    for part in (keys[:cut], keys[cut:]):
                        if part:
                            z = to_zset({r: change[r] for r in part}, schemas[name])
                            split.push(name, z)
                            whole.push(name, z)
                            size += z.data.nbytes + z.weights.nbytes
                if step or size > 2 * piece:
                    break
            big += size > piece
            got, want = split.step(), whole.step()
            tables = {name: (schemas[name], dict(g.bag)) for name, g in gens.items()}
            for name, q in queries.items():
                assert _distinct(got[name]), f"{name}: step {step}'s output holds equal rows (seed {seed})"
                diff = _diff(got[name].to_dict(), want[name].to_dict())
                assert got[name] == want[name], f"{name}: step {step} in pieces differs (W={workers}, {seed}): {diff}"
                accumulate(views[name], got[name])
                ref = duckdb_query(q, tables)
                assert normalize(views[name]) == ref, (f"{name} differs from DuckDB after step {step} (W={workers}, "
                                                       f"seed {seed}): {_diff(normalize(views[name]), ref)}")
        counts = dict(_split(split))
        assert split.metrics()["spill"]["substeps"] == counts
    finally:
        split.close()
        whole.close()
    assert counts["off"] is None, counts
    assert big and counts["split_steps"] == big and counts["pieces"] >= 2 * big, (big, counts)
    return counts


TWO = {"bids": BIDS, "auctions": AUCTIONS}


@pytest.mark.parametrize("workers", [1, 2])
def test_join_then_group_by_in_pieces(workers: int) -> None:
    _compare(_join_then_group, JOIN_GROUP_SQL, TWO, workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_distinct_in_pieces(workers: int) -> None:
    _compare(lambda c, s: {"d": s["bids"].select(auction="auction", bidder="bidder").distinct()},
             {"d": "SELECT DISTINCT auction, bidder FROM bids"}, {"bids": BIDS}, workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_min_max_under_deletions_in_pieces(workers: int) -> None:
    _compare(lambda c, s: {"ext": s["bids"].group_by("auction").agg(lo=dbsp.min("price"), hi=dbsp.max("bidder"),
                                                                     n=dbsp.count())},
             {"ext": "SELECT auction, min(price), max(bidder), count(*) FROM bids GROUP BY auction"},
             {"bids": BIDS}, workers, steps=6)


@pytest.mark.parametrize("workers", [1, 2])
def test_top_k_in_pieces(workers: int) -> None:
    order = "ORDER BY price DESC NULLS LAST, bidder ASC NULLS LAST, f ASC NULLS LAST"
    _compare(lambda c, s: {"top": s["bids"].group_by("auction").top_k(2, ("price", "descending"))},
             {"top": f"SELECT auction, bidder, price, f FROM (SELECT *, row_number() OVER (PARTITION BY auction "
                     f"{order}) AS r FROM bids) WHERE r <= 2"}, {"bids": BIDS}, workers, steps=6)


@pytest.mark.parametrize("workers", [1, 2])
def test_fixpoint_in_pieces(workers: int) -> None:
    _compare(lambda c, s: fixpoint_build(c, s["e"]), FIXPOINT_SQL, {"e": EDGES}, workers, rows=30, gen=_Edges,
             piece=64)


SQL_TEXT = """
    CREATE TABLE bids (auction BIGINT, bidder VARCHAR, price BIGINT, f DOUBLE);
    CREATE TABLE auctions (id INTEGER, category VARCHAR, reserve BIGINT);
    CREATE VIEW v AS SELECT a.category, count(*) AS n, sum(b.price) AS total, count(DISTINCT b.bidder) AS nb
                     FROM bids b JOIN auctions a ON b.auction = a.id WHERE b.price > 1 GROUP BY a.category;
    CREATE VIEW w AS SELECT DISTINCT bidder FROM bids
                     WHERE auction NOT IN (SELECT id FROM auctions WHERE id IS NOT NULL);
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_sql_views_in_pieces(workers: int) -> None:
    queries = {"v": "SELECT a.category, count(*), sum(b.price), count(DISTINCT b.bidder) FROM bids b JOIN auctions a "
                    "ON b.auction = a.id WHERE b.price > 1 GROUP BY a.category",
               "w": "SELECT DISTINCT bidder FROM bids WHERE auction NOT IN (SELECT id FROM auctions WHERE id IS NOT "
                    "NULL)"}
    _compare(lambda c, s: SQL_TEXT, queries, TWO, workers, sql=True)


def test_pieces_cut_by_bytes_without_copying() -> None:
    """Slices of the pushes in order, zero-copy, about ``limit`` bytes each, every row exactly once."""
    rng = np.random.default_rng(SEED)
    pushes = []
    for n in rng.integers(0, 50, 7).tolist():
        t = pa.table({"x": rng.integers(0, 9, n), "s": pa.array([str(v) for v in rng.integers(0, 9, n)], pa.string())})
        pushes.append((f"h{len(pushes) % 2}", dbsp.ZSet.from_arrow(t, weights=rng.integers(-2, 3, n))))
    total = sum(z.data.nbytes + z.weights.nbytes for _, z in pushes)
    for limit in (1, 50, 333, total - 1, total):
        cut = pieces(pushes, limit)
        flat = [(h, z) for piece in cut for h, z in piece]
        assert len(cut) == 1 if limit >= total else len(cut) > 1, (limit, len(cut))
        for h in ("h0", "h1"):  # each handle's rows, in order, exactly once
            whole = [z for g, z in pushes if g == h and z.num_rows]
            parts = [z for g, z in flat if g == h]
            assert pa.concat_tables([z.data for z in parts]).equals(pa.concat_tables([z.data for z in whole]))
            assert np.array_equal(np.concatenate([z.weights for z in parts]),
                                  np.concatenate([z.weights for z in whole]))
        parents = {b.address for _, z in pushes for col in z.data.columns for ch in col.chunks for b in ch.buffers()
                   if b is not None}
        assert {b.address for _, z in flat for col in z.data.columns for ch in col.chunks for b in ch.buffers()
                if b is not None} <= parents  # views of the pushes' buffers: nothing copied
        if limit < total:
            sizes = [sum(z.data.nbytes + z.weights.nbytes for _, z in piece) for piece in cut]
            assert max(sizes) <= 2 * max(limit, 64), (limit, sizes)  # about a limit each (a row may overshoot)


S = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("t", pa.int64())])


def _whole_runs(c_of: Callable[[], dbsp.Circuit], why: str, pushes: list[list[tuple[str, pa.Table]]],
                caplog) -> None:
    """The circuit's steps run whole under a budget with pieces forced small, say why once, and give the output of the
    same pipeline without a budget."""
    clock = iter(range(10**9, 10**12, 10**9))
    split = dbsp.Pipeline(c_of(), executor=EmbeddedExecutor(substep_bytes=PIECE), memory_limit=TINY,
                          clock=lambda: next(clock))
    clock2 = iter(range(10**9, 10**12, 10**9))
    whole = dbsp.Pipeline(c_of(), clock=lambda: next(clock2))
    try:
        with caplog.at_level(logging.DEBUG, logger="dbsp_core.substep"):
            for step in pushes:
                for h, t in step:
                    split.push(h, t)
                    whole.push(h, t)
                got, want = split.step(), whole.step()
                for name in got:
                    assert got[name] == want[name], name
        counts = _split(split)
        assert counts["split_steps"] == 0 and counts["pieces"] == 0 and why in counts["off"], counts
        said = [r.getMessage() for r in caplog.records if r.name == "dbsp_core.substep"]
        assert len(said) == 1 and why in said[0], said
    finally:
        split.close()
        whole.close()


def _big(seed: int, n: int = 60) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"k": rng.integers(0, 9, n), "v": rng.integers(0, 99, n), "t": rng.integers(0, 50, n)}, schema=S)


def test_a_delay_runs_whole(caplog) -> None:
    def c_of() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", S)
        c.output("prev", t.group_by("k").agg(n=dbsp.count()).delay())
        return c
    _whole_runs(c_of, "delay", [[("t", _big(SEED + i))] for i in range(3)], caplog)


def test_a_processing_time_window_runs_whole(caplog) -> None:
    def c_of() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", S)
        c.output("w", t.proc_tumble(2000).group_by("window_start").agg(n=dbsp.count()))
        return c
    _whole_runs(c_of, "proc_tumble", [[("t", _big(SEED + i))] for i in range(3)], caplog)


def test_an_event_time_input_runs_whole(caplog) -> None:
    def c_of() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", S, event_time="t", lateness=5)
        c.output("w", t.tumble("t", 10).group_by("window_start").agg(n=dbsp.count()))
        return c
    _whole_runs(c_of, "event time", [[("t", _big(SEED + i))] for i in range(3)], caplog)


KEYED = pa.schema([("k", pa.int64()), ("v", pa.int64())])


@pytest.mark.parametrize("workers", [1, 2])
def test_an_upsert_input_splits_and_keeps_the_last_row_of_each_key(workers: int) -> None:
    """The driver keeps a step's last row per key before the pieces are cut (substep.py invariant 4): the same
    outputs, and the table holds the last pushed row of each key."""
    rng = np.random.default_rng(SEED)

    def c_of() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", KEYED, primary_key=["k"])
        c.output("t", t)
        c.output("g", t.group_by("v").agg(n=dbsp.count()))
        return c

    split = dbsp.Pipeline(c_of(), workers=workers, executor=EmbeddedExecutor(substep_bytes=PIECE), memory_limit=TINY)
    whole = dbsp.Pipeline(c_of(), workers=workers)
    table: dict[int, int] = {}
    acc: dict = {}
    try:
        for step in range(5):
            for _ in range(3):  # three pushes a step, keys repeating within and across them
                n = 40
                ks, vs = rng.integers(0, 30, n), rng.integers(0, 5, n)
                split.push("t", pa.table({"k": ks, "v": vs}, schema=KEYED))
                whole.push("t", pa.table({"k": ks, "v": vs}, schema=KEYED))
                table.update(zip(ks.tolist(), vs.tolist()))
            dels = rng.choice(30, 5, replace=False)
            split.delete("t", pa.table({"k": dels}))
            whole.delete("t", pa.table({"k": dels}))
            for k in dels.tolist():
                table.pop(k, None)
            got, want = split.step(), whole.step()
            for name in got:
                assert _distinct(got[name]) and got[name] == want[name], (name, step, SEED)
            accumulate(acc, got["t"])
            assert acc == {(k, v): 1 for k, v in table.items()}, (step, SEED)
        counts = _split(split)
        assert counts["off"] is None and counts["split_steps"] == 5 and counts["pieces"] > 10, counts
    finally:
        split.close()
        whole.close()


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", KEYED)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v"), hi=dbsp.max("v")))
    c.output("d", t.select(v="v").distinct())
    return c


def _change(rng: np.random.Generator, held: list, n: int) -> dbsp.ZSet:
    """``n`` new rows and the deletion of up to n/4 rows pushed before (``held``: the rows present)."""
    new = pa.table({"k": rng.integers(0, 40, n), "v": rng.integers(0, 500, n)}, schema=KEYED)
    gone = [held.pop(int(rng.integers(len(held)))) for _ in range(min(len(held), n // 4))]
    held.extend(zip(new.column("k").to_pylist(), new.column("v").to_pylist()))
    rows = list(zip(new.column("k").to_pylist(), new.column("v").to_pylist())) + gone
    return dbsp.ZSet.from_rows(rows, KEYED, weights=[1] * n + [-1] * len(gone))


def _integral(p: dbsp.Pipeline, name: str) -> dict:
    acc: dict = {}
    for _, z in p.read_output(name, from_step=0):
        accumulate(acc, z)
    return acc


@pytest.mark.parametrize("workers, kill", [(1, False), (2, True)])
def test_a_durable_pipeline_reopens_after_split_steps_and_goes_on_exactly(tmp_path, workers: int, kill: bool) -> None:
    """Steps 0-1 split and checkpointed, steps 2-3 split and not; then reopened (after a close, or from a copy of the
    directory taken while the pipeline was open: what a kill leaves) with another piece size, which replays steps 2-3
    in other pieces (the output log compares them as multisets) and goes on: every view's logged integral is the
    reference's (a pipeline without a budget over the same pushes) and DuckDB's."""
    rng = np.random.default_rng(SEED)
    held: list = []
    changes = [_change(rng, held, 80) for _ in range(6)]
    d = str(tmp_path / "p")
    p = dbsp.Pipeline(_circuit(), workers=workers, storage=d, memory_limit=TINY, checkpoint_interval=None,
                      executor=EmbeddedExecutor(substep_bytes=PIECE))
    for i, z in enumerate(changes[:4]):
        p.push("t", z, producer="gen", seq=i)
        p.step()
        if i == 1:
            p.checkpoint()
    assert _split(p)["split_steps"] == 4, _split(p)
    if kill:
        p.executor.settle_merges()  # no write in flight while the copy is taken
        shutil.copytree(d, str(tmp_path / "killed"))
        p.close()
        d = str(tmp_path / "killed")
    else:
        p.close()
    q = dbsp.Pipeline.open(d, _circuit(), memory_limit=TINY, executor=EmbeddedExecutor(substep_bytes=3 * PIECE))
    try:
        assert q.steps == 4
        for i, z in enumerate(changes[4:], start=4):
            q.push("t", z, producer="gen", seq=i)
            q.step()
        assert _split(q)["split_steps"] >= 2, _split(q)
        with dbsp.Pipeline(_circuit()) as ref:
            want = {"g": {}, "d": {}}
            for z in changes:
                ref.push("t", z)
                for name, out in ref.step().items():
                    accumulate(want[name], out)
        bag: dict = {}
        for z in changes:
            accumulate(bag, z)
        tables = {"t": (KEYED, bag)}
        assert want["g"] == duckdb_query("SELECT k, count(*), min(v), max(v) FROM t GROUP BY k", tables)
        assert want["d"] == duckdb_query("SELECT DISTINCT v FROM t", tables)
        for name in ("g", "d"):
            assert _integral(q, name) == want[name], (name, workers, kill, SEED)
    finally:
        q.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_piece_that_fails_on_its_data_puts_the_whole_step_back(workers: int) -> None:
    """A StepError in a later piece (the poisoned push is the step's last) undoes the pieces before it too
    (executor.py invariant 4): after the discard, every output is that of a pipeline that never saw the push."""
    from dbsp_core.errors import StepError

    def c_of() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", KEYED)
        c.output("d", t.select(k="k").distinct())
        c.output("s", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v"), hi=dbsp.max("v")))

        def boom(batch: pa.RecordBatch) -> pa.RecordBatch:  # runs after the stateful operators
            if batch.num_rows and 666 in batch.column("v").to_pylist():
                raise ValueError("poison")
            return batch
        c.output("x", t.flat_map(boom, schema=KEYED))
        return c

    rng = np.random.default_rng(SEED)
    steps = [pa.table({"k": rng.integers(0, 20, 40), "v": rng.integers(0, 50, 40)}, schema=KEYED) for _ in range(5)]
    poison = pa.table({"k": [1, 2, 3, 99], "v": [5, 6, 666, 7]}, schema=KEYED)
    split = dbsp.Pipeline(c_of(), workers=workers, executor=EmbeddedExecutor(substep_bytes=PIECE), memory_limit=TINY)
    ref = dbsp.Pipeline(c_of(), workers=workers)
    try:
        for i, data in enumerate(steps):
            split.push("t", data)
            ref.push("t", data)
            if i == 2:
                split.push("t", poison)
                before = _split(split)["pieces"]
                with pytest.raises(StepError) as info:
                    split.step()
                assert _split(split)["pieces"] > before + 1  # the step was cut, so earlier pieces ran
                split.discard(*info.value.inputs[-1][1:])
            got, want = split.step(), ref.step()
            for name in got:
                assert got[name] == want[name], (name, i, workers, SEED)
    finally:
        split.close()
        ref.close()


def test_split_steps_hold_while_other_threads_push_checkpoint_and_read(tmp_path) -> None:
    """While one thread runs steps that split into pieces (W=2, durable), others push (another producer),
    checkpoint, read metrics and read the output log, all at once: every call returns or fails cleanly, the steps
    did split, checkpoints ran during them, and at the end every view's logged integral equals the reference's
    (a pipeline without a budget over all pushes) and DuckDB's."""
    import threading

    rng = np.random.default_rng(SEED + 7)
    held_a: list = []
    held_b: list = []
    mine = [_change(rng, held_a, 80) for _ in range(8)]
    theirs = [_change(rng, held_b, 40) for _ in range(8)]  # a producer of its own (deletions of its own rows only)
    d = str(tmp_path / "p")
    p = dbsp.Pipeline(_circuit(), workers=2, storage=d, memory_limit=TINY, checkpoint_interval=None,
                      executor=EmbeddedExecutor(substep_bytes=PIECE))
    stop = threading.Event()
    errors: list[BaseException] = []
    done = {"checkpoints": 0, "metrics": 0, "reads": 0, "pushes": 0}

    def run(what: str, body: Callable[[], None]) -> threading.Thread:
        def loop() -> None:
            try:
                while not stop.is_set() and body() is not False:
                    done[what] += 1
                    stop.wait(0.02)  # a pace that lets the steps run between the calls
            except BaseException as e:  # noqa: BLE001  (reported below)
                errors.append(e)
        t = threading.Thread(target=loop, name=what)
        t.start()
        return t

    left = list(enumerate(theirs))

    def push_theirs() -> bool:
        if not left:
            return False
        i, z = left.pop(0)
        p.push("t", z, producer="other", seq=i)
        return True

    seen: list[int] = []  # split steps done when each checkpoint returned

    def checkpoint() -> None:
        p.checkpoint()
        seen.append(_split(p).get("split_steps", 0))

    threads = [run("checkpoints", checkpoint), run("metrics", p.metrics),
               run("reads", lambda: _integral(p, "g") and None), run("pushes", push_theirs)]
    try:
        for i, z in enumerate(mine):
            p.push("t", z, producer="gen", seq=i)
            p.step()
        while left:  # the other producer's last pushes, then a step that takes them
            threading.Event().wait(0.01)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        p.step()
        assert _split(p)["split_steps"] >= 4, _split(p)
        assert done["checkpoints"] >= 1 and done["metrics"] >= 1 and done["pushes"] == len(theirs), done
        assert any(0 < n < _split(p)["split_steps"] for n in seen), (seen, _split(p))  # checkpoints amid the split steps
        with dbsp.Pipeline(_circuit()) as ref:
            want = {"g": {}, "d": {}}
            for z in mine + theirs:
                ref.push("t", z)
            for name, out in ref.step().items():
                accumulate(want[name], out)
        bag: dict = {}
        for z in mine + theirs:
            accumulate(bag, z)
        tables = {"t": (KEYED, bag)}
        assert want["g"] == duckdb_query("SELECT k, count(*), min(v), max(v) FROM t GROUP BY k", tables)
        for name in ("g", "d"):
            assert _integral(p, name) == want[name], (name, SEED)
    finally:
        stop.set()
        p.close()
