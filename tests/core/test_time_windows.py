"""Event time: the watermark function against a model, late rows, tumbling and hopping window aggregates, window and interval joins and top-k per window against DuckDB over the accepted rows, at several worker counts, and the state cleanup that keeps an endless windowed view in bounded memory."""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.operators.window import _window
from dbsp_core.time.watermark import NO_WATERMARK, EventTime, advance
from dbsp_core.trace import Trace
from time_oracle import EV, run_event_time

SEEDS = st.integers(0, 2**31 - 1)


def fl(col: str, n: int) -> str:
    """SQL for ``floor(col / n) * n`` (DuckDB's // truncates toward zero)."""
    return f"(CAST(floor({col} / {n}) AS BIGINT) * {n})"


WORKERS = st.sampled_from([1, 2, 4])
FEW = settings(max_examples=examples(6))


@given(st.lists(st.lists(st.lists(st.one_of(st.none(), st.integers(-50, 50)), max_size=5), max_size=3), max_size=6),
       st.integers(0, 10))
def test_watermark_function_matches_the_model(steps, lateness) -> None:
    specs = {"a": EventTime("t", lateness)}
    wm, model = {}, NO_WATERMARK
    for pushes in steps:
        tables = [("a", pa.table({"t": pa.array(p, pa.int64())})) for p in pushes]
        tables.append(("other", pa.table({"t": pa.array([10**9], pa.int64())})))  # ignored: not in specs
        wm, late = advance(specs, wm, tables)
        assert late == {"a": sum(1 for p in pushes for t in p if t is None or t < model)}
        times = [t for p in pushes for t in p if t is not None]
        if times:
            model = max(model, max(times) - lateness)
        assert wm == {"a": model}


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_tumbling_and_hopping_window_aggregates(seed: int, workers: int) -> None:
    run_event_time(lambda c, s: {
        "tum": s["a"].tumble("t", 10).group_by("k", "window_start", "window_end").agg(
            n=dbsp.count(), total=dbsp.sum("v"), hi=dbsp.max("v")),
        "hop": s["a"].hop("t", 10, 5).group_by("window_start").agg(n=dbsp.count(), nd=dbsp.count_distinct("k")),
        "all": s["a"].group_by().agg(n=dbsp.count()),
    }, {
        "tum": f"SELECT k, {fl('t', 10)} AS ws, {fl('t', 10)} + 10, count(*), CAST(sum(v) AS BIGINT), max(v) "
               f"FROM a GROUP BY k, ws",
        "hop": f"SELECT ws, count(*), count(DISTINCT k) FROM (SELECT *, {fl('t', 5)} - 5 * i AS ws FROM a, "
               f"range(2) r(i)) GROUP BY ws",
        "all": "SELECT count(*) FROM a HAVING count(*) > 0",
    }, seed, workers, steps=10)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_window_join_interval_join_and_top_k_per_window(seed: int, workers: int) -> None:
    def build(c, s):
        a, b = s["a"].tumble("t", 10), s["b"].tumble("t", 10)
        return {
            "wjoin": a.join(b, on=["k", "window_start"]).select(k="k", ws="window_start", va="v", vb="v_right"),
            "ijoin": s["a"].interval_join(s["b"], "t", "t", -4, 2, on="k"),
            "top": a.group_by("window_start").top_k(2, ("v", "descending")),
        }

    run_event_time(build, {
        "wjoin": f"SELECT a.k, {fl('a.t', 10)}, a.v, b.v FROM a JOIN b ON a.k = b.k AND {fl('a.t', 10)} = "
                 f"{fl('b.t', 10)}",
        "ijoin": "SELECT a.k, a.v, a.t, b.v, b.t FROM a JOIN b ON a.k = b.k AND a.t BETWEEN b.t - 4 AND b.t + 2",
        "top": f"SELECT k, v, t, ws, ws + 10 FROM (SELECT *, {fl('t', 10)} AS ws, row_number() OVER (PARTITION BY "
               f"{fl('t', 10)} ORDER BY v DESC, k, t) AS r FROM a) WHERE r <= 2",
    }, seed, workers, inputs=("a", "b"), steps=10)


@FEW
@given(seed=SEEDS, workers=WORKERS)
def test_points_window_and_a_join_on_it(seed: int, workers: int) -> None:
    # window.py invariant 4, q7's form: each row once per multiple p of 10 in [t + lo, t + hi] (none, one or two of
    # them), joined with a window aggregate on its window end; each side's state is dropped by the other's lineage
    pts = "(SELECT range * 10 AS p FROM range(-30, 60))"

    def build(c, s):
        two = _window(s["a"], "t", "points", 10, 0, -3, 12, "p", None, "test")
        few = _window(s["a"], "t", "points", 10, 0, 1, 4, "p", None, "test")
        hi = s["b"].tumble("t", 10).group_by("window_end").agg(hi=dbsp.max("v"))
        j = two.join(hi, left_on=["p"], right_on=["window_end"])
        return {"two": two, "few": few, "join": j.select(k="k", v="v", t="t", p="p", hi="hi")}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trace, "PRUNE_MIN", 1)  # prune at every step that inserted anything: a lineage too high fails
        run_event_time(build, {
            "two": f"SELECT a.k, a.v, a.t, r.p FROM a, {pts} r WHERE r.p BETWEEN a.t - 3 AND a.t + 12",
            "few": f"SELECT a.k, a.v, a.t, r.p FROM a, {pts} r WHERE r.p BETWEEN a.t + 1 AND a.t + 4",
            "join": f"SELECT a.k, a.v, a.t, r.p, m.hi FROM a, {pts} r, (SELECT {fl('t', 10)} + 10 AS we, max(v) AS "
                    f"hi FROM b GROUP BY we) m WHERE r.p BETWEEN a.t - 3 AND a.t + 12 AND m.we = r.p",
        }, seed, workers, inputs=("a", "b"), steps=12)


def test_endless_windowed_view_runs_in_bounded_memory() -> None:
    c = dbsp.Circuit()
    a = c.input("a", EV, event_time="t", lateness=20)
    b = c.input("b", EV, event_time="t", lateness=20)
    c.output("agg", a.tumble("t", 100).group_by("k", "window_start").agg(n=dbsp.count(), hi=dbsp.max("v")))
    c.output("top", a.tumble("t", 100).group_by("window_start").top_k(3, ("v", "descending")))
    c.output("join", a.interval_join(b, "t", "t", -10, 10, on="k"))
    c.output("nd", a.tumble("t", 100).group_by("window_start").agg(nd=dbsp.count_distinct("v")))
    rng = np.random.default_rng(7)
    sizes = []
    with dbsp.Pipeline(c, workers=2) as p:
        for step in range(120):
            for name in ("a", "b"):
                t = step * 50 + rng.integers(0, 50, 500)
                p.push(name, pa.table({"k": rng.integers(0, 50, 500), "v": rng.integers(0, 10**6, 500), "t": t},
                                      schema=EV))
            p.step()
            sizes.append(sum(tr.num_rows for w in range(2) for tr in p.traces(w).values()))
    # a window is 2 steps of input; the state holds a few windows (plus the amortized slack), whatever the length
    assert max(sizes[60:]) < 1.3 * max(sizes[20:60]), sizes[::10]
    assert max(sizes) < 60 * 1000, sizes[::10]


def test_timestamp_columns_and_timedelta_lateness() -> None:
    schema = pa.schema([("id", pa.int64()), ("dateTime", pa.timestamp("ms"))])
    c = dbsp.Circuit()
    bid = c.input("bid", schema, event_time="dateTime", lateness=datetime.timedelta(seconds=2))
    c.output("w", bid.tumble("dateTime", 10_000).group_by("window_start").agg(n=dbsp.count()))
    base = datetime.datetime(2024, 1, 1)
    with dbsp.Pipeline(c) as p:
        p.push("bid", pa.table({"id": [1], "dateTime": [base + datetime.timedelta(seconds=11)]}, schema=schema))
        p.step()
        p.push("bid", pa.table({"id": [2, 3], "dateTime": [base, base + datetime.timedelta(seconds=9)]}, schema=schema))
        out = p.step()["w"].to_dict()
        assert out == {(base, 1): 1}  # the first row is 11 s behind the watermark's source: late
        assert p.late_rows == {"bid": 1}
        assert p.watermarks["bid"] == int((base - datetime.datetime(1970, 1, 1)).total_seconds() * 1000) + 9000


def test_event_time_validation() -> None:
    c = dbsp.Circuit()
    with pytest.raises(dbsp.SchemaError, match="event_time"):
        c.input("a", EV, event_time="nope")
    with pytest.raises(TypeError, match="timedelta"):
        c.input("b", EV, event_time="t", lateness=datetime.timedelta(seconds=1))
    with pytest.raises(ValueError, match="lateness"):
        c.input("c", EV, event_time="t", lateness=-1)
    s = c.input("d", EV)
    with pytest.raises(ValueError, match="multiple"):
        s.hop("t", 10, 3)
    with pytest.raises(ValueError, match="lower"):
        s.interval_join(s, "t", "t", 3, 1, on="k")


@pytest.mark.parametrize("staged", [False, True])
def test_durable_pipeline_logs_watermarks_and_replays_them(tmp_path, staged: bool) -> None:
    from dbsp_core.codec import decode_json
    from dbsp_core.storage.formats import DIVISION_HANDLE
    from dbsp_core.storage import StepLog

    def circuit():
        c = dbsp.Circuit()
        a = c.input("a", EV, event_time="t", lateness=5)
        c.output("w", a.tumble("t", 10).group_by("window_start").agg(n=dbsp.count(), s=dbsp.sum("v")))
        return c

    rng = np.random.default_rng(3)
    pushes = [pa.table({"k": rng.integers(0, 3, 20), "v": rng.integers(0, 9, 20), "t": s * 7 + rng.integers(-9, 9, 20)},
                       schema=EV) for s in range(12)]
    from dbsp_core.runtime import StagedExecutor

    def ex():
        return StagedExecutor() if staged else None

    p = dbsp.Pipeline(circuit(), workers=2, storage=tmp_path, checkpoint_interval=None, executor=ex())
    outs, wms = [], []
    for i, t in enumerate(pushes):
        p.push("a", t)
        outs.append(p.step()["w"])
        wms.append(dict(p.watermarks))
        if i == 4:
            p.checkpoint()
    late = dict(p.late_rows)
    p.close()
    log = StepLog(str(tmp_path / "input"))
    logged = {r.step: decode_json(b"DDIV", r.payload, "test")["watermarks"] for r in log.iter_from(0)
              if r.handle == DIVISION_HANDLE}
    log.close()
    assert [logged[s] for s in sorted(logged)] == wms[-len(logged):]
    q = dbsp.Pipeline.open(tmp_path, circuit(), executor=ex())  # replays from the checkpoint (output verified)
    assert q.watermarks == wms[-1]
    assert [z for _, z in q.read_output("w")] == outs
    assert sum(late.values()) > 0
    q.close()


def test_pruned_state_checkpoints_and_recovers(tmp_path, monkeypatch) -> None:
    from dbsp_core.trace import Trace

    monkeypatch.setattr(Trace, "PRUNE_MIN", 1)  # prune at every step that inserted anything

    def circuit():
        c = dbsp.Circuit()
        a = c.input("a", EV, event_time="t", lateness=3)
        b = c.input("b", EV, event_time="t", lateness=3)
        w = a.tumble("t", 10)
        c.output("agg", w.group_by("k", "window_start").agg(n=dbsp.count(), hi=dbsp.max("v")))
        c.output("top", w.group_by("window_start").top_k(2, ("v", "descending")))
        c.output("join", a.interval_join(b, "t", "t", -4, 4, on="k"))
        sessions = b.group_by("k").session("t", 2)
        c.output("sessions", sessions.group_by("k", "session_start", "session_end").agg(n=dbsp.count()))
        c.output("proc", a.proc_tumble(30).group_by("k", "window_start").agg(n=dbsp.count()))
        return c

    rng = np.random.default_rng(5)
    pushes = [{n: pa.table({"k": rng.integers(0, 3, 15), "v": rng.integers(0, 50, 15),
                            "t": s * 6 + rng.integers(0, 6, 15)}, schema=EV) for n in ("a", "b")} for s in range(16)]
    outs, now = [], [0]
    clock = lambda: now[0]  # noqa: E731 - proc_tumble's now: 11 ms per step, the same in every pipeline
    with dbsp.Pipeline(circuit(), workers=2, clock=clock) as ref:
        for i, step in enumerate(pushes):
            now[0] = (i + 1) * 11 * 10**6
            for n, t in step.items():
                ref.push(n, t)
            outs.append(ref.step())
        pruned_rows = sum(tr.num_rows for w in range(2) for tr in ref.traces(w).values())
    p = dbsp.Pipeline(circuit(), workers=2, storage=tmp_path, checkpoint_interval=None, clock=clock)
    for i, step in enumerate(pushes[:10]):
        now[0] = (i + 1) * 11 * 10**6
        for n, t in step.items():
            p.push(n, t)
        assert p.step() == outs[i]
        if i in (4, 7):
            p.checkpoint()
    p.close()
    q = dbsp.Pipeline.open(tmp_path, circuit(), clock=clock)
    for i, step in enumerate(pushes[10:], start=10):
        now[0] = (i + 1) * 11 * 10**6
        for n, t in step.items():
            q.push(n, t)
        assert q.step() == outs[i], i
    assert sum(tr.num_rows for w in range(2) for tr in q.traces(w).values()) <= 2 * pruned_rows + 100
    q.close()
