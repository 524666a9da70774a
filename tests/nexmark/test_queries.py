"""Every Nexmark query checked against DuckDB on the same generated events, with a few earlier rows deleted in every later step (changes.py), after every step, at several step boundaries and worker counts; and the generator's proportions, id ranges, order and batch independence.

The events and deletions come from the run's seed (``DBSP_NEXMARK_SEED`` replays one; printed after the summary and in
every failure)."""

from __future__ import annotations

import datetime
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core as dbsp
from dbsp_core import nexmark
from changes import SEED, Retractions
from oracle import _diff, connect, normalize
from reference import SQL

EVENTS, RATE = 6000, 300  # 20 s of event time: two 10 s windows and auctions living up to about 11 s
SPLITS = [(6000, 1), (1700, 2), (450, 4)]  # (events per step, workers)
RATES = {"q11": 30}  # q11: 200 s of event time, so bidders pause more than 10 s and sessions split and grow
START_NS, STEP_NS = 1_700_000_003_000 * 10**6, 3_500 * 10**6  # the steps' clock (now), for q12


def _rows(table: pa.Table) -> dict:
    cols = [c.to_pylist() for c in table.columns]
    return normalize(dict(Counter(zip(*cols))))


def _duckdb(sql: str, tables: dict[str, pa.Table]) -> dict:
    con = connect()
    try:
        for name, t in tables.items():
            con.register(name, t)
        return _rows(con.sql(sql).to_arrow_table())
    finally:
        con.close()


def _keeps_less_state(c: dbsp.Circuit) -> bool:
    """Whether the append-only circuit has a state form of its own (a top-k keeping only its shown rows, over inserts
    or a growing count, a min/max only its totals)."""
    return any((getattr(op, "append_only", False) or getattr(op, "grows", False))
               and op.kind in ("top_k", "aggregate") for op in c.nodes)


@pytest.mark.parametrize("query", sorted(SQL, key=lambda q: int(q[1:])))
def test_query_matches_duckdb(query: str) -> None:
    # the one-step split has no deletions: it runs the circuit Nexmark declares (append-only inputs); the others
    # delete rows, so their inputs are declared without append_only; a query whose append-only form keeps less
    # state also runs it over inserts only in several steps
    splits = [(per_step, workers, per_step == EVENTS) for per_step, workers in SPLITS]
    if _keeps_less_state(nexmark.circuit(query)):
        splits.append((1700, 2, True))
    for per_step, workers, append_only in splits:
        c = nexmark.circuit(query, append_only=append_only)
        changes = Retractions(SEED + workers, fraction=0.0 if append_only else 0.05)
        view: dict = {}
        now = [START_NS]
        with dbsp.Pipeline(c, workers=workers, clock=lambda: now[0]) as p:
            if query == "q13":
                p.push("side_input", nexmark.side_input())
            events = nexmark.generate(EVENTS, seed=SEED, batch=per_step, rate=RATES.get(query, RATE))
            for step, batch in enumerate(events):
                now[0] += STEP_NS  # q12's processing time: a few steps per 10 s window
                # q12: the now of the step that brings the bid (PROCTIME()), a column of the reference's bids
                extra = {"bid": {"p_time": pa.array([now[0] // 10**6] * batch["bid"].num_rows, pa.timestamp("ms"))}}
                for name, t, weights in changes.step(batch, extra if query == "q12" else None):
                    p.push(name, t, weights)
                for row, w in p.step()[query].to_dict().items():
                    view[row] = view.get(row, 0) + w
                view = {r: w for r, w in view.items() if w}
                tables = changes.integrated()
                tables["side_input"] = nexmark.side_input()
                want = _duckdb(SQL[query], tables)
                got = normalize(view)
                assert query != "q12" or p.now_ns == now[0], "the step's now is not the test clock's"
                assert got == want, (f"{query} differs from DuckDB after step {step} ({per_step} events per step, "
                                     f"W={workers}, {changes.deleted} rows deleted so far; replay: "
                                     f"DBSP_NEXMARK_SEED={SEED})\n"
                                     f"only in circuit: {dict(list(_diff(got, want).items())[:5])}\n"
                                     f"only in DuckDB: {dict(list(_diff(want, got).items())[:5])}")
            assert sum(p.late_rows.values()) == 0
        assert append_only or changes.deleted > 0, "no row was deleted: the run checks inserts only"
    assert want or query in ("q2",), f"{query}: the reference is empty; the check proves nothing"


def test_every_query_is_built() -> None:
    assert sorted(nexmark.QUERIES, key=lambda q: int(q[1:])) == [f"q{i}" for i in range(23)]
    with pytest.raises(KeyError, match="q0..q22"):
        nexmark.circuit("q23")


def test_generator_proportions_ids_order_and_batch_independence() -> None:
    one = next(nexmark.generate(50_000, seed=3, batch=50_000))
    parts = list(nexmark.generate(50_000, seed=3, batch=7_001))
    for name, t in one.items():
        assert t.equals(pa.concat_tables([b[name] for b in parts])), name  # any batch size, same events
        assert t.schema == nexmark.SCHEMAS[name]
        ts = t.column("dateTime").cast(pa.int64()).to_numpy()
        assert (np.diff(ts) >= 0).all(), name  # event-time order
    n = {k: t.num_rows for k, t in one.items()}
    assert n == {"person": 1000, "auction": 3000, "bid": 46_000}
    assert one["person"].column("id").to_pylist() == list(range(1000, 2000))
    assert one["auction"].column("id").to_pylist() == list(range(1000, 4000))
    bids = one["bid"]
    auctions = bids.column("auction").to_numpy()
    assert auctions.min() >= 1000 and auctions.max() < 4000 + 10  # existing auctions, or the next 10
    hot = pc.sum(pc.equal(pc.subtract(bids.column("auction"), 1000), pc.multiply(
        pc.divide(pc.subtract(bids.column("auction"), 1000), 100), 100))).as_py()
    assert hot / bids.num_rows > 0.5  # half the bids go to a hot auction (plus a few others on a multiple of 100)
    channels = set(bids.column("channel").unique().to_pylist())
    assert {"Google", "Facebook", "Baidu", "Apple"} <= channels
    assert one["auction"].column("category").unique().to_pylist() != [] and \
        set(one["auction"].column("category").to_pylist()) == {10, 11, 12, 13, 14}


@pytest.mark.parametrize("append_only,workers", [(True, 1), (False, 2)])
def test_q17_days_across_midnight(append_only: bool, workers: int) -> None:
    # q17 groups by the bid's date and formats the day of its output rows only (queries.py): events from 10 s
    # before midnight to 10 s after, so an auction has bids on two days, each its own group, in steps that cross
    # midnight; deletions in the W=2 run
    base = datetime.datetime(2015, 7, 15, 23, 59, 50, tzinfo=datetime.timezone.utc)
    c = nexmark.circuit("q17", append_only=append_only)
    changes = Retractions(SEED + 17, fraction=0.0 if append_only else 0.05)
    view: dict = {}
    with dbsp.Pipeline(c, workers=workers) as p:
        for batch in nexmark.generate(EVENTS, seed=SEED, batch=1700, rate=RATE, base_time=base):
            for name, t, weights in changes.step(batch):
                p.push(name, t, weights)
            for row, w in p.step()["q17"].to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
        want = _duckdb(SQL["q17"], changes.integrated())
    got = normalize(view)
    assert len({r[1] for r in got}) == 2 and len({r[0] for r in got}) < len(got), "no auction on two days"
    assert got == want, (f"q17 differs from DuckDB across midnight (replay: DBSP_NEXMARK_SEED={SEED})\n"
                         f"only in circuit: {dict(list(_diff(got, want).items())[:5])}\n"
                         f"only in DuckDB: {dict(list(_diff(want, got).items())[:5])}")
