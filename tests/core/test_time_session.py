"""Session windows (dbsp_core/operators/session.py) against DuckDB window functions over the accepted rows after random steps with late rows and deletions, at 1, 2 and 4 workers; the bounds and weights rules; and the cleanup of closed sessions that keeps an endless stream in bounded state."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.trace import Trace
from oracle import accumulate, to_zset
from time_oracle import EV, run_event_time

GAP = 5
SEEDS = st.integers(0, 2**31 - 1)
WORKERS = st.sampled_from([1, 2, 4])


def session_sql(table: str = "a", by: str = "k", gap: int = GAP) -> str:
    """Each row of ``table`` with its session bounds: sessions over the distinct (key, time) pairs by LAG, so
    rows with equal times (which window functions order arbitrarily) always share a session."""
    part = f"PARTITION BY {by}" if by else ""
    on = f"x.{by} = s.{by} AND " if by else ""
    keys = f"{by}, " if by else ""
    return (f"WITH d AS (SELECT DISTINCT {keys}t FROM {table}), "
            f"f AS (SELECT {keys}t, CASE WHEN t - lag(t) OVER ({part} ORDER BY t) <= {gap} THEN 0 ELSE 1 END AS n "
            f"FROM d), "
            f"g AS (SELECT {keys}t, sum(n) OVER ({part} ORDER BY t) AS sid FROM f), "
            f"s AS (SELECT {keys}t, min(t) OVER ({part}{',' if by else 'PARTITION BY'} sid) AS ss, "
            f"max(t) OVER ({part}{',' if by else 'PARTITION BY'} sid) + {gap} AS se FROM g) "
            f"SELECT x.*, s.ss, s.se FROM {table} x JOIN s ON {on}x.t = s.t")


@pytest.mark.parametrize("prune", [False, True], ids=["amortized", "prune-every-step"])
@settings(max_examples=8, deadline=None)
@given(seed=SEEDS, workers=WORKERS)
def test_sessions_match_duckdb(prune: bool, seed: int, workers: int) -> None:
    def build(c, s):
        per_key = s["a"].group_by("k").session("t", GAP)
        return {
            "rows": per_key,
            "counts": per_key.group_by("k", "session_start", "session_end").agg(n=dbsp.count(), total=dbsp.sum("v")),
            "all": s["a"].session("t", GAP, start="s0", end="s1"),
        }

    with pytest.MonkeyPatch.context() as mp:
        if prune:  # drop closed sessions at every step (session.py invariant 4), not once the trace has doubled
            mp.setattr(Trace, "PRUNE_MIN", 1)
        run_event_time(build, {
            "rows": session_sql(),
            "counts": f"SELECT k, ss, se, count(*), CAST(sum(v) AS BIGINT) FROM ({session_sql()}) GROUP BY k, ss, se",
            "all": session_sql(by=""),
        }, seed, workers, steps=14)


def test_session_bounds_weights_and_deletions() -> None:
    schema = pa.schema([("k", pa.utf8()), ("t", pa.int64())])
    c = dbsp.Circuit()
    a = c.input("a", schema)
    c.output("s", a.group_by("k").session("t", 10))
    view: dict = {}
    steps = [
        ({("x", 0): 1, ("x", 10): 1, ("x", 22): 2, (None, 3): 1, ("y", None): 1},
         {("x", 0, 0, 20): 1, ("x", 10, 0, 20): 1, ("x", 22, 22, 32): 2, (None, 3, 3, 13): 1}),
        ({("x", 10): -1, ("x", 15): -1}, {("x", 0, 0, 10): 1, ("x", 22, 22, 32): 2, (None, 3, 3, 13): 1}),
        ({("x", 15): 1, ("x", 10): 1, ("x", 16): 1},  # x@15 cancels its earlier deletion; 10 and 16 bridge 0 and 22
         {("x", 0, 0, 32): 1, ("x", 10, 0, 32): 1, ("x", 16, 0, 32): 1, ("x", 22, 0, 32): 2, (None, 3, 3, 13): 1}),
    ]
    with dbsp.Pipeline(c, workers=2) as p:
        for change, want in steps:
            p.push("a", to_zset(change, schema))
            accumulate(view, p.step()["s"])
            assert view == want


def test_session_validation() -> None:
    c = dbsp.Circuit()
    s = c.input("a", EV)
    with pytest.raises(ValueError, match="gap"):
        s.group_by("k").session("t", 0)
    with pytest.raises(dbsp.SchemaError, match="clashes"):
        s.group_by("k").session("t", 5, start="v")
    with pytest.raises(dbsp.SchemaError, match="time column"):
        s.group_by("k").session("nope", 5)
    with pytest.raises(dbsp.SchemaError, match="different names"):
        s.session("t", 5, start="x", end="x")
    assert s.session("t", 5, by="k").times == {}  # no event time: no lineage, no cleanup
    ev = c.input("b", EV, event_time="t", lateness=3).group_by("k").session("t", 5)
    assert ev.times == {"session_end": ("b", 0)}  # session.py invariant 5; k has no lineage of its own


def test_endless_sessions_keep_bounded_state() -> None:
    c = dbsp.Circuit()
    a = c.input("a", EV, event_time="t", lateness=20)
    s = a.group_by("k").session("t", 30)
    c.output("n", s.group_by("k", "session_start", "session_end").agg(n=dbsp.count()))
    rng = np.random.default_rng(11)
    sizes = []
    with dbsp.Pipeline(c, workers=2) as p:
        for step in range(120):
            # bursts per key with pauses longer than the gap, so sessions keep closing
            k = rng.integers(0, 40, 300)
            t = step * 50 + rng.integers(0, 50, 300)
            keep = (t // 100 + k) % 3 != 0
            p.push("a", pa.table({"k": k[keep], "v": rng.integers(0, 9, int(keep.sum())), "t": t[keep]}, schema=EV))
            p.step()
            sizes.append(sum(tr.num_rows for w in range(2) for tr in p.traces(w).values()))
    assert max(sizes[60:]) < 1.3 * max(sizes[20:60]), sizes[::10]
    assert max(sizes) < 40 * 300, sizes[::10]
