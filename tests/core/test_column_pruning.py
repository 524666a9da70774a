"""Column pruning of stored state (runtime/prune.py, operators/pruned.py): joins and ``within_last`` windows keep only
the columns read after them. Pruned and unpruned pipelines give the same Z-set for every view after every step, at
W = 1 and W = 2, with deletions and rows that differ only in columns no view reads, and the integrals equal DuckDB's
answer; a user function after a join keeps every column; a directory written without pruning reopens (with it on)
unpruned, and one written with pruning reopens pruned whatever the setting. ``DBSP_PRUNE_SEED`` replays the data."""

from __future__ import annotations

import os
import tempfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.runtime import prune
from dbsp_core.errors import FormatVersionError
from dbsp_core.storage.directory import read_meta
from dbsp_core.storage.formats import DIRECTORY_FORMAT, PRUNED_FORMAT, RANGE_FORMAT

from oracle import AUCTIONS, BIDS, ChangeGen, duckdb_query, normalize, to_zset

SEED = int(os.environ.get("DBSP_PRUNE_SEED", "0")) or int(np.random.SeedSequence().entropy % 2**31)
EVENTS = pa.schema([("t", pa.int64()), ("k", pa.int64()), ("v", pa.int64()), ("junk", pa.utf8())])
NOW0 = 1_000  # seconds: the steps' now is NOW0 + step


class _Events(ChangeGen):
    """Events whose time is within a few seconds of the step's now (some already out of the window)."""

    step = 0

    def row(self) -> tuple:
        rng = self.rng
        return (NOW0 + self.step - int(rng.integers(-2, 8)), int(rng.integers(0, 4)),
                None if rng.random() < 0.1 else int(rng.integers(0, 9)), str(rng.choice(["x", "yy", "", "zzz"])))


def _circuit(user_fn: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    auctions = c.input("auctions", AUCTIONS)
    events = c.input("events", EVENTS)
    j = bids.join(auctions, left_on="auction", right_on="id")  # keeps auction, bidder, price | id, category
    c.output("by_cat", j.group_by("category").agg(n=dbsp.count(), total=dbsp.sum("price"), hi=dbsp.max("price"),
                                                 lo=dbsp.min("price")))
    c.output("pairs", j.select(category="category", price="price"))  # a bag: weights must add up
    c.output("distinct", j.select(category="category", bidder="bidder").distinct())
    c.output("filtered", j.filter(dbsp_expr_price_gt(2)).select(bidder="bidder"))
    recent = dbsp.within_last(events, "t", 4)  # keeps t, k, v (junk read by no view)
    c.output("recent", recent.group_by("k").agg(n=dbsp.count(), hi=dbsp.max("v")))
    ej = recent.join(auctions, left_on="k", right_on="id")  # keeps k, v | id, category
    c.output("recent_cat", ej.group_by("category").agg(total=dbsp.sum("v")))
    if user_fn:
        c.output("udf", bids.join(auctions, left_on="price", right_on="reserve")
                 .flat_map(lambda b: b.select([0]), pa.schema([("auction", pa.int64())])))
    return c


def dbsp_expr_price_gt(x: int):
    import pyarrow.compute as pc

    return pc.field("price") > x


QUERIES = {
    "by_cat": "SELECT category, count(*), sum(price), max(price), min(price) FROM bids JOIN auctions ON auction = id "
              "GROUP BY category",
    "pairs": "SELECT category, price, sum(bids_w.__w * auctions_w.__w) AS __w FROM bids_w JOIN auctions_w "
             "ON auction = id GROUP BY category, price",
    "distinct": "SELECT DISTINCT category, bidder FROM bids JOIN auctions ON auction = id",
    "filtered": "SELECT bidder, sum(bids_w.__w * auctions_w.__w) AS __w FROM bids_w JOIN auctions_w ON auction = id "
                "WHERE price > 2 GROUP BY bidder",
    "recent": "SELECT k, count(*), max(v) FROM events WHERE t BETWEEN {now} - 4 AND {now} GROUP BY k",
    "recent_cat": "SELECT category, sum(v) FROM events JOIN auctions ON k = id WHERE t BETWEEN {now} - 4 AND {now} "
                  "GROUP BY category HAVING count(*) > 0",
}


def _pipeline(c: dbsp.Circuit, workers: int, pruned: bool, monkeypatch, clock: list, **kw) -> dbsp.Pipeline:
    with monkeypatch.context() as m:
        m.setattr(prune, "enabled", lambda: pruned)
        return dbsp.Pipeline(c, workers=workers, clock=lambda: clock[0], **kw)


def _kept(p: dbsp.Pipeline) -> dict:
    """{node: [trace column names]} of the pipeline's first worker's join and window traces."""
    inst = p.executor._workers[0].instances
    return {i: [t.schema.names for t in s.traces().values()] for i, s in inst.items()
            if type(s).__name__ in ("_JoinState", "_WithinLastState")}


def _step_both(p: dbsp.Pipeline, q: dbsp.Pipeline, gens: dict, clock: list, step: int) -> dict:
    """Push one random change per input to ``p`` and ``q`` at the step's clock, step both and assert every output's
    change is the same Z-set in both; returns ``p``'s outputs."""
    clock[0] = (NOW0 + step) * 10**9
    gens["events"].step = step
    for name, g in gens.items():
        ch = g.change(10)
        if ch:
            for r in (p, q):
                r.push(name, to_zset(ch, g.schema))
    a, b = p.step(), q.step()
    for name in a:
        assert a[name].to_dict() == b[name].to_dict(), (name, step)
    return a


@pytest.mark.parametrize("workers", [1, 2])
def test_pruned_equals_unpruned_and_duckdb(workers: int, monkeypatch) -> None:
    print(f"DBSP_PRUNE_SEED={SEED}")
    rng = np.random.default_rng([SEED, workers])
    gens = {"bids": ChangeGen(rng, BIDS), "auctions": ChangeGen(rng, AUCTIONS), "events": _Events(rng, EVENTS)}
    clock = [NOW0 * 10**9]
    c = _circuit()
    on = _pipeline(c, workers, True, monkeypatch, clock)
    off = _pipeline(c, workers, False, monkeypatch, clock)  # the same circuit object: each keeps its own choice
    kept = _kept(on)
    assert sorted(map(tuple, sum(kept.values(), []))) == sorted([
        ("auction", "bidder", "price"), ("id", "category"), ("t", "k", "v", "__bucket"), ("k", "v"),
        ("id", "category")]), kept
    assert sorted(len(t) for t in sum(_kept(off).values(), [])) == [3, 3, 4, 4, 5]  # every column (+ __bucket)
    integral: dict[str, Counter] = {name: Counter() for name in c.outputs}
    for step in range(30):
        a = _step_both(on, off, gens, clock, step)
        for name in c.outputs:
            integral[name].update(a[name].to_dict())
        if step % 10 == 9 or step == 29:
            tables = {n: (g.schema, dict(g.bag)) for n, g in gens.items()}
            for name, q in QUERIES.items():
                got = normalize({r: w for r, w in integral[name].items() if w})
                assert got == duckdb_query(q.format(now=NOW0 + step), tables), (name, step)
    on.close()
    off.close()


def test_user_function_keeps_every_column(monkeypatch) -> None:
    c = _circuit(user_fn=True)
    cols = prune.stored_columns(c)
    udf_join = c.nodes[c.outputs["udf"]].inputs[0]
    assert str(udf_join) not in cols  # flat_map reads every column: the join before it keeps them all
    assert len(cols) == 3  # the other joins and the window are pruned


def test_a_read_column_is_kept() -> None:
    """Keys, a filter's column and a window's time column stay, though no view shows them."""
    cols = prune.stored_columns(_circuit())
    kept = sorted(tuple(map(tuple, v)) for v in cols.values())
    assert (("auction", "bidder", "price"), ("id", "category")) in kept  # price: the filter and the aggregates
    assert (("t", "k", "v"),) in kept


def _run_durable(root: str, c: dbsp.Circuit, pruned: bool, monkeypatch, steps: range, rng_seed: int,
                 reference: dbsp.Pipeline, clock: list, gens: dict) -> None:
    with monkeypatch.context() as m:
        m.setattr(prune, "enabled", lambda: pruned)
        kw = dict(clock=lambda: clock[0], checkpoint_interval=None)
        p = dbsp.Pipeline.open(root, c, **kw) if os.path.exists(os.path.join(root, "META")) else \
            dbsp.Pipeline(c, workers=2, storage=root, **kw)
    for step in steps:
        _step_both(p, reference, gens, clock, step)
    p.checkpoint()
    p.close()


@pytest.mark.parametrize("first,then", [(False, True), (True, False)])
def test_directory_keeps_its_state_schema(first: bool, then: bool, monkeypatch) -> None:
    """A directory created without pruning (the old code path) reopens unpruned with pruning on, and one created with
    pruning reopens pruned with it off: META's ``stored_columns`` is the state's schema (operators/pruned.py
    invariant 3); the views go on equal to an in-memory reference's."""
    rng = np.random.default_rng([SEED, int(first)])
    gens = {"bids": ChangeGen(rng, BIDS), "auctions": ChangeGen(rng, AUCTIONS), "events": _Events(rng, EVENTS)}
    clock = [NOW0 * 10**9]
    reference = _pipeline(_circuit(), 1, False, monkeypatch, clock)
    with tempfile.TemporaryDirectory() as root:
        _run_durable(root, _circuit(), first, monkeypatch, range(0, 8), SEED, reference, clock, gens)
        recorded = read_meta(root)["stored_columns"]
        assert bool(recorded) == first
        # an embedded directory is format 4 (its state may hold range values), which the releases before pruning
        # and before range values (readers of format 2, or 2 and 3) refuse instead of reading narrow traces with
        # full schemas; pruned or not is told by stored_columns alone (storage/formats.py)
        assert read_meta(root)["format"] == RANGE_FORMAT
        with pytest.raises(FormatVersionError, match="format 4"):
            read_meta(root, (DIRECTORY_FORMAT, PRUNED_FORMAT))
        _run_durable(root, _circuit(), then, monkeypatch, range(8, 16), SEED, reference, clock, gens)
        assert read_meta(root)["stored_columns"] == recorded
        assert read_meta(root)["format"] == RANGE_FORMAT
    reference.close()


def test_dbsp_sql_shows_kept_columns() -> None:
    """``dbsp sql`` (sql/explain.py invariant 5): a join under a subquery that selects a column no view reads keeps
    only the read ones, and the plan says so."""
    from dbsp_core import sql
    from dbsp_core.sql.explain import explain

    c = sql.compile("CREATE TABLE bids (auction BIGINT, bidder BIGINT, price BIGINT); "
                    "CREATE TABLE auctions (id BIGINT, category VARCHAR, reserve BIGINT); "
                    "CREATE VIEW top AS SELECT category, hi FROM (SELECT a.category, b.price AS hi, b.bidder "
                    "FROM bids b JOIN auctions a ON b.auction = a.id) WHERE hi > 10")
    text = explain(c)
    assert "kept columns left [auction, price], right [id, category]" in text, text
    assert "trace keyed by (auction) of (auction, price)" in text, text


def _change_circuit(extra: str | None) -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS, materialized=True)
    auctions = c.input("auctions", AUCTIONS, materialized=True)
    j = bids.join(auctions, left_on="auction", right_on="id")  # first program: (auction, price) | (id, category)
    c.output("by_cat", j.group_by("category").agg(hi=dbsp.max("price")))
    if extra == "kept":
        c.output("n_cat", j.group_by("category").agg(n=dbsp.count()))
    elif extra == "dropped":
        c.output("reserve", j.group_by("category").agg(r=dbsp.sum("reserve")))
    return c


def test_program_change_through_a_pruned_join(monkeypatch) -> None:
    """A changed program that reads through a kept pruned join only columns it kept opens, keeps the join's state and
    gives the reference's views; one that reads a column the join dropped is refused (its state cannot give it)."""
    from dbsp_core.errors import CircuitMismatchError

    rng = np.random.default_rng([SEED, 7])
    gens = {"bids": ChangeGen(rng, BIDS), "auctions": ChangeGen(rng, AUCTIONS)}
    with tempfile.TemporaryDirectory() as root:
        p = dbsp.Pipeline(_change_circuit(None), workers=2, storage=root, checkpoint_interval=None)
        for _ in range(5):
            for name, g in gens.items():
                ch = g.change(10)
                if ch:
                    p.push(name, to_zset(ch, g.schema))
            p.step()
        p.checkpoint()
        p.close()
        assert list(read_meta(root)["stored_columns"].values()) == [[["auction", "price"], ["id", "category"]]]
        with pytest.raises(CircuitMismatchError, match="reserve"):
            dbsp.Pipeline.open(root, _change_circuit("dropped"))
        p = dbsp.Pipeline.open(root, _change_circuit("kept"), checkpoint_interval=None)
        got = Counter()
        for _ in range(2):
            for name, g in gens.items():
                ch = g.change(10)
                if ch:
                    p.push(name, to_zset(ch, g.schema))
            got.update(p.step()["n_cat"].to_dict())
        p.close()
    tables = {n: (g.schema, dict(g.bag)) for n, g in gens.items()}
    want = duckdb_query("SELECT category, count(*) FROM bids JOIN auctions ON auction = id GROUP BY category", tables)
    assert normalize({r: w for r, w in got.items() if w}) == want


@pytest.mark.parametrize("workers", [1, 2])
def test_pruned_join_while_threads_push_step_checkpoint_and_read(tmp_path, workers: int) -> None:
    """A pruned join (its sides keep 2 of 3 columns) on a durable pipeline while four threads push (each its own
    producer), step, checkpoint and read metrics and traces at once: the summed outputs equal a dict model of
    every push, the join's state held the pruned columns only, checkpoints and steps ran during the pushes, and a
    reopen continues with the same kept columns."""
    import random
    import threading

    left = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("pad", pa.utf8())])
    right = pa.schema([("id", pa.int64()), ("g", pa.int64()), ("note", pa.utf8())])

    def circuit() -> dbsp.Circuit:
        c = dbsp.Circuit()
        a, b = c.input("a", left), c.input("b", right)
        c.output("s", a.join(b, left_on="k", right_on="id").group_by("g").agg(total=dbsp.sum("v"), n=dbsp.count()))
        return c

    def batch(t: int, i: int) -> tuple[str, pa.Table]:
        r = random.Random(f"{SEED}/{t}/{i}")
        n = r.randint(1, 6)
        if t % 2:
            return "b", pa.table({"id": [r.randrange(8) for _ in range(n)], "g": [r.randrange(3) for _ in range(n)],
                                  "note": [f"n{r.randrange(99)}" for _ in range(n)]}, schema=right)
        return "a", pa.table({"k": [r.randrange(8) for _ in range(n)], "v": [r.randrange(-5, 9) for _ in range(n)],
                              "pad": [f"p{r.randrange(99)}" for _ in range(n)]}, schema=left)

    root = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), workers=workers, storage=root, checkpoint_interval=None)
    assert read_meta(root)["stored_columns"], "the join was not pruned"
    outs: list = []
    counts: Counter = Counter()
    errors: list = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def run(t: int) -> None:
        r = random.Random(f"{SEED}/run/{t}")
        try:
            start.wait()
            for i in range(20):
                p.push(*batch(t, i), producer=f"p{t}", seq=i)
                roll = r.random()
                if roll < 0.3:
                    out = p.step()
                    with lock:
                        outs.append(out["s"])
                        counts["steps"] += 1
                elif roll < 0.4:
                    p.checkpoint()
                    with lock:
                        counts["checkpoints"] += 1
                elif roll < 0.5:
                    p.metrics()
                    p.traces(0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    outs.append(p.step()["s"])
    assert counts["steps"] >= 1 and counts["checkpoints"] >= 1, counts
    widths = {len(t.schema) for w in range(workers) for name, t in p.traces(w).items() if "join" in name}
    assert widths == {2}, widths  # join key + the one column read after it, on both sides
    rows: dict[str, list] = {"a": [], "b": []}
    for t in range(4):
        for i in range(20):
            h, tb = batch(t, i)
            rows[h] += tb.to_pylist()
    want: dict = {}
    for x in rows["a"]:
        for y in rows["b"]:
            if x["k"] == y["id"]:
                tot, n = want.get(y["g"], (0, 0))
                want[y["g"]] = (tot + x["v"], n + 1)
    acc: Counter = Counter()
    for z in outs:
        acc.update(z.to_dict())
    assert +acc == Counter({(g, tot, n): 1 for g, (tot, n) in want.items()}), SEED
    p.close()
    q = dbsp.Pipeline.open(root, circuit())
    try:
        assert {len(t.schema) for name, t in q.traces(0).items() if "join" in name} == {2}
    finally:
        q.close()
