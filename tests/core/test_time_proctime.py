"""Processing-time tumbling windows (dbsp_core/operators/proctime.py) against DuckDB over a model of each row's copies and the step now they arrived in, after random steps with deletions at 1, 2 and 4 workers; deletions before insertions; late rows and the cleanup of rows below the watermark against the same model; and identical windows when a durable pipeline replays its steps."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from oracle import BIDS, ChangeGen, _diff, accumulate, duckdb_query, normalize, to_zset
from dbsp_core.trace import Trace
from time_oracle import EV, EventGen

SIZE_MS = 1000
SEEDS = st.integers(0, 2**31 - 1)
WORKERS = st.sampled_from([1, 2, 4])


class CopyModel:
    """Each row's copies by arrival window (ms), all of one sign; a change cancels opposite copies of the latest
    windows first, and the rest arrive in the step's window (proctime.py invariant 2)."""

    def __init__(self) -> None:
        self.copies: dict[tuple, Counter] = {}

    def apply(self, change: dict[tuple, int], window: int) -> None:
        for row, d in change.items():
            c = self.copies.setdefault(row, Counter())
            for w in sorted(c, reverse=True):
                if d == 0:
                    break
                if c[w] * d < 0:  # opposite sign: cancel
                    k = min(abs(c[w]), abs(d)) * (1 if d > 0 else -1)
                    c[w] += k
                    d -= k
            if d:
                c[window] += d
            self.copies[row] = Counter({w: n for w, n in c.items() if n})

    def bag(self) -> dict[tuple, int]:
        return {row + (w,): n for row, c in self.copies.items() for w, n in c.items()}


@settings(max_examples=8, deadline=None)
@given(seed=SEEDS, workers=WORKERS)
def test_proc_tumble_matches_duckdb(seed: int, workers: int) -> None:
    rng = np.random.default_rng(seed)
    nows = np.cumsum(rng.choice([0, 300, 700, 1500], 10)) * 10**6 + 5 * 10**12  # some steps share a window
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS)
    w = bids.proc_tumble(SIZE_MS)
    c.output("rows", w)
    c.output("counts", w.group_by("bidder", "window_start", "window_end").agg(n=dbsp.count(), p=dbsp.sum("price")))
    gen, model = ChangeGen(rng, BIDS), CopyModel()
    views: dict[str, dict] = {"rows": {}, "counts": {}}
    schema = pa.schema(list(BIDS) + [("ws", pa.int64())])
    sql = {"rows": f"SELECT auction, bidder, price, f, epoch_ms(ws), epoch_ms(ws + {SIZE_MS}) FROM b",
           "counts": f"SELECT bidder, epoch_ms(ws), epoch_ms(ws + {SIZE_MS}), count(*), CAST(sum(price) AS BIGINT) "
                     f"FROM b GROUP BY bidder, ws"}
    clock = iter(nows.tolist())
    with dbsp.Pipeline(c, workers=workers, clock=lambda: next(clock)) as p:
        for step, now in enumerate(nows.tolist()):
            change = gen.change(10)
            if change:
                p.push("bids", to_zset(change, BIDS))
            model.apply(change, now // 10**6 // SIZE_MS * SIZE_MS)
            out = p.step()
            for name, q in sql.items():
                accumulate(views[name], out[name])
                want = duckdb_query(q, {"b": (schema, model.bag())})
                got = normalize(views[name])
                assert got == want, (f"{name} differs from DuckDB after step {step} (W={workers}, seed={seed})\n"
                                     f"only in circuit: {_diff(got, want)}\nonly in DuckDB: {_diff(want, got)}")


def test_deletions_take_the_latest_copies_and_come_before_insertions() -> None:
    schema = pa.schema([("x", pa.utf8())])
    c = dbsp.Circuit()
    c.output("w", c.input("a", schema).proc_tumble(10, unit="s", start="s", end="e"))
    nows = iter(s * 10**9 for s in (5, 15, 25, 35, 45))
    view: dict = {}

    def step(p, change):
        p.push("a", to_zset(change, schema))
        accumulate(view, p.step()["w"])
        return {(x, s.second, n) for (x, s, e), n in view.items()}

    with dbsp.Pipeline(c, workers=2, clock=lambda: next(nows)) as p:
        assert step(p, {("a",): 2, (None,): 1}) == {("a", 0, 2), (None, 0, 1)}
        assert step(p, {("a",): 1, ("b",): -1}) == {("a", 0, 2), ("a", 10, 1), (None, 0, 1), ("b", 10, -1)}
        assert step(p, {("a",): -2, ("b",): 2}) == {("a", 0, 1), (None, 0, 1), ("b", 20, 1)}  # b: -1 cancelled first
        assert step(p, {("a",): -1, (None,): -1, ("b",): -1}) == set()
        assert step(p, {("a",): 1}) == {("a", 40, 1)}


@settings(max_examples=6, deadline=None)
@given(seed=SEEDS, workers=WORKERS)
def test_proc_tumble_with_event_time_cleanup_matches_duckdb(seed: int, workers: int) -> None:
    """Late rows dropped, deletions of accepted rows, and the copies of rows below the watermark dropped from the
    state at every step (proctime.py invariant 4): the view still equals the model's copies."""
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    w = c.input("a", EV, event_time="t", lateness=6).proc_tumble(SIZE_MS)
    c.output("rows", w)
    c.output("counts", w.group_by("k", "window_start").agg(n=dbsp.count(), s=dbsp.sum("v")))
    gen, model, view = EventGen(rng, 6), CopyModel(), {"rows": {}, "counts": {}}
    schema = pa.schema(list(EV) + [("ws", pa.int64())])
    sql = {"rows": f"SELECT k, v, t, epoch_ms(ws), epoch_ms(ws + {SIZE_MS}) FROM a",
           "counts": "SELECT k, epoch_ms(ws), count(*), CAST(sum(v) AS BIGINT) FROM a GROUP BY k, ws"}
    now, dropped = [5 * 10**12], []
    drop_below = Trace.drop_below

    def counted(trace, bounds, force=False):
        n = drop_below(trace, bounds, force)
        if n and trace.key == tuple(EV.names):  # a trace of proc_tumble (keyed by the whole row)
            dropped.append(n)
        return n

    with pytest.MonkeyPatch.context() as mp, \
            dbsp.Pipeline(c, workers=workers, clock=lambda: now[0]) as p:
        mp.setattr(Trace, "PRUNE_MIN", 1)  # scan once the rows inserted since the last scan reach those it kept
        mp.setattr(Trace, "drop_below", counted)
        for step in range(14):
            now[0] += int(rng.choice([0, 400, 900])) * 10**6
            before = Counter(gen.accepted)
            change = gen.step()
            if change:
                p.push("a", to_zset(change, EV))
            accepted = Counter(gen.accepted)
            accepted.subtract(before)
            model.apply({r: d for r, d in accepted.items() if d}, now[0] // 10**6 // SIZE_MS * SIZE_MS)
            out = p.step()
            for name, q in sql.items():
                accumulate(view[name], out[name])
                want = duckdb_query(q, {"a": (schema, model.bag())})
                got = normalize(view[name])
                assert got == want, (f"{name} differs from DuckDB after step {step} (W={workers}, seed={seed})\n"
                                     f"only in circuit: {_diff(got, want)}\nonly in DuckDB: {_diff(want, got)}")
        assert p.late_rows == {"a": gen.late}
    assert dropped, f"no copy left the state (seed={seed}, W={workers}): the cleanup went untested"


def test_proc_tumble_state_follows_event_time() -> None:
    c = dbsp.Circuit()
    a = c.input("a", EV, event_time="t", lateness=10)
    c.output("n", a.proc_tumble(100).group_by("k", "window_start").agg(n=dbsp.count()))
    rng = np.random.default_rng(2)
    clock = iter(range(10**9, 10**12, 37 * 10**6))
    sizes = []
    with dbsp.Pipeline(c, workers=2, clock=lambda: next(clock)) as p:
        for step in range(100):
            p.push("a", pa.table({"k": rng.integers(0, 20, 200), "v": rng.integers(0, 10**6, 200),
                                  "t": step * 20 + rng.integers(0, 20, 200)}, schema=EV))
            p.step()
            sizes.append(sum(tr.num_rows for tr in p.traces(0).values() if tr.key == tuple(EV.names)))
    assert max(sizes[50:]) < 1.3 * max(sizes[10:50]), sizes[::10]


def test_replayed_steps_get_the_same_windows(tmp_path) -> None:
    def circuit():
        c = dbsp.Circuit()
        a = c.input("a", EV)
        c.output("n", a.proc_tumble(50).group_by("window_start").agg(n=dbsp.count()))
        return c

    rng = np.random.default_rng(4)
    pushes = [pa.table({"k": rng.integers(0, 3, 5), "v": rng.integers(0, 9, 5), "t": rng.integers(0, 9, 5)},
                       schema=EV) for _ in range(8)]
    clock = iter(range(10**9, 10**12, 20 * 10**6))
    p = dbsp.Pipeline(circuit(), workers=2, storage=tmp_path, checkpoint_interval=None, clock=lambda: next(clock))
    outs = []
    for i, t in enumerate(pushes):
        p.push("a", t)
        outs.append(p.step()["n"])
        if i == 2:
            p.checkpoint()
    p.close(checkpoint=False)  # steps 3..7 replay on open, their output checked against the output log
    later = iter(range(10**13, 10**14, 10**9))  # another clock: the replay must use the logged nows
    q = dbsp.Pipeline.open(tmp_path, circuit(), clock=lambda: next(later))
    assert [z for _, z in q.read_output("n")] == outs
    for t in pushes:  # the replayed state holds every row in its original window: deleting all empties the view
        q.push("a", dbsp.ZSet.from_arrow(t, weights=-np.ones(t.num_rows, np.int64)))
    view: dict = {}
    for z in outs + [q.step()["n"]]:
        accumulate(view, z)
    assert view == {}
    q.close()


def test_proc_tumble_validation() -> None:
    import datetime

    s = dbsp.Circuit().input("a", EV)
    with pytest.raises(ValueError, match="size"):
        s.proc_tumble(0)
    with pytest.raises(ValueError, match="unit"):
        s.proc_tumble(5, unit="h")
    with pytest.raises(dbsp.SchemaError, match="clashes"):
        s.proc_tumble(5, start="k")
    assert s.proc_tumble(datetime.timedelta(seconds=2)).schema.field("window_end").type == pa.timestamp("ms")
    from dbsp_core.operators.proctime import proc_tumble

    with pytest.raises(ValueError, match="whole number"):
        proc_tumble(s, datetime.timedelta(microseconds=1500), unit="ms")
