"""Pipeline.profile(), `dbsp profile DIR` and the profile's Prometheus series: each operator's rows agree with its neighbours', the sums over steps with the totals, and the views' figures with their actual output and a dict model, for the embedded executor (W=1, W=2) and the staged one."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
import dbsp_core.metrics
from dbsp_core.__main__ import main
from dbsp_core.profile import operator_profile
from dbsp_core.runtime.staged import StagedExecutor

SEED = int(os.environ.get("DBSP_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("sums", t.group_by("k").agg(s=dbsp.sum("v")))
    c.output("d", t.distinct())
    return c


def _rows_out_of(by_node: dict, circuit: dbsp.Circuit, j: int) -> int:
    """Rows node ``j`` handed its consumers: its own count, or (an exchange the staged executor turns into a
    stage boundary, counted by no stage) its input's, as an exchange moves rows and never makes or drops one."""
    r = by_node[j]["rows_out"]
    return r if r is not None else _rows_out_of(by_node, circuit, circuit.nodes[j].inputs[0])


@pytest.mark.parametrize("kind,workers", [("embedded", 1), ("embedded", 2), ("staged", 2)])
def test_profile_figures_agree_with_each_other_and_the_output(tmp_path, kind, workers) -> None:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    rng = np.random.default_rng(SEED)
    c = _circuit()
    ex = StagedExecutor() if kind == "staged" else None
    p = dbsp.Pipeline(c, workers=workers, storage=str(tmp_path / "d"), executor=ex, checkpoint_interval=None)
    pushed, steps, out_rows = 0, 9, collections.Counter()
    model: collections.Counter = collections.Counter()  # the reference: every row pushed, with its weight
    try:
        for _ in range(steps):
            n = int(rng.integers(1, 40))
            tb = pa.table({"k": rng.integers(0, 8, n), "v": rng.integers(0, 5, n)}, schema=SCHEMA)
            p.push("t", tb)
            pushed += n
            model.update(zip(tb.column("k").to_pylist(), tb.column("v").to_pylist()))
            for name, z in p.step().items():
                out_rows[name] += z.num_rows
        prof = p.profile()
        ops = {r["node"]: r for r in prof["operators"]}
        # every live node is profiled (the staged executor's exchanges carry bytes only)
        assert set(ops) == set(c.live_nodes())
        for i, r in ops.items():
            node = c.nodes[i]
            if r["steps"] is not None:
                assert r["steps"] == steps, r
                assert r["mean_ms"] is not None and r["p99_ms"] >= r["mean_ms"] - 1e-9, r  # window < 100: p99 is max
            if node.inputs and r["rows_in"] is not None:  # rows out of an operator equal rows in of the next
                assert r["rows_in"] == sum(_rows_out_of(ops, c, j) for j in node.inputs), (r, node.inputs)
            if node.kind == "input":  # the sum over steps equals the total pushed
                assert r["rows_in"] is None and r["rows_out"] == pushed
            if node.kind == "exchange":  # bytes move between workers only when there are several
                assert (r["exchange_bytes"] or 0) > 0 if workers > 1 else r["exchange_bytes"] is None, r
            if node.kind in ("distinct", "aggregate"):
                assert r["state_rows"] > 0 and r["state_bytes"] > 0, r
        views = {v["view"]: v for v in prof["views"]}
        m = p.metrics()
        for name in c.outputs:  # a view's rows are its actual output's; its net rows the model's
            assert views[name]["rows_out"] == out_rows[name] == m["rows_out"][name]
        assert views["d"]["net_rows"] == len(+model)  # distinct rows pushed
        assert views["sums"]["net_rows"] == len({k for k, _ in +model})  # one row per group
        if workers == 1:  # one worker's output node returns the view's change itself
            assert ops[c.outputs["d"]]["rows_out"] == out_rows["d"]
        assert m["profile"]["operators"] == prof["operators"]
        text = dbsp_core.metrics.prometheus_text(p)
        d = ops[c.outputs["d"]]
        assert f'dbsp_operator_rows_out_total{{kind="distinct",operator="{d["operator"]}"}} {float(d["rows_out"])}' \
            in text
        assert "dbsp_process_resident_bytes" in text and m["rss_bytes"] > 0
        before = p.profile(state=False)
    finally:
        p.close()
    # `dbsp profile DIR` prints the last checkpoint's profile (close takes one): the same figures
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["profile", str(tmp_path / "d"), "--json"]) == 0
    saved = json.loads(buf.getvalue())
    assert saved["step"] == steps and saved["workers"] == workers
    assert [(r["operator"], r["rows_in"], r["rows_out"]) for r in saved["operators"]] == \
        [(r["operator"], r["rows_in"], r["rows_out"]) for r in before["operators"]]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["profile", str(tmp_path / "d")]) == 0
    assert d["operator"] in buf.getvalue() and "upstream_seconds" in buf.getvalue()


def test_profile_table_and_missing_profile(tmp_path, capsys) -> None:
    c = _circuit()
    p = dbsp.Pipeline(c, workers=2)
    p.push("t", pa.table({"k": [1, 1, 2], "v": [1, 1, 3]}, schema=SCHEMA))
    p.step()
    prof = p.profile()
    t = prof.table()
    assert t.num_rows == len(prof["operators"]) and "p99_ms" in t.column_names
    assert prof.table("views").column("view").to_pylist() == ["sums", "d"]
    with pytest.raises(ValueError, match="operators"):
        prof.table("nodes")
    assert "distinct" in str(prof)
    p.close()
    # a storage directory without a profile (as one written before profiles were): said so, exit status 1
    q = dbsp.Pipeline(c, storage=str(tmp_path / "e"), checkpoint_interval=None)
    (tmp_path / "e" / "PROFILE").unlink(missing_ok=True)
    assert main(["profile", str(tmp_path / "e")]) == 1
    assert "holds no profile" in capsys.readouterr().err
    q.close()


def test_nodes_no_timer_ran_have_state_and_no_made_up_figures() -> None:
    """What the driver of a pipeline whose stage tasks ran on Spark executors sees: no timers in this process,
    so every live node has a record with its state and None (not 0) for what was not measured."""
    c = _circuit()
    p = dbsp.Pipeline(c, workers=2)
    try:
        p.push("t", pa.table({"k": [1, 2, 2], "v": [5, 5, 6]}, schema=SCHEMA))
        p.step()
        prof = operator_profile(c, [], {}, [p.executor.traces(w) for w in range(2)])
    finally:
        p.close()
    assert [r["node"] for r in prof["operators"]] == c.live_nodes()
    for r in prof["operators"]:
        assert r["steps"] is r["seconds"] is r["rows_out"] is r["exchange_bytes"] is r["mean_ms"] is None, r
    assert sum(r["state_rows"] for r in prof["operators"]) > 0
    assert {v["view"]: v["upstream_seconds"] for v in prof["views"]} == {"sums": None, "d": None}


def test_a_fixpoint_counts_its_inner_exchanges() -> None:
    """A recursive view's inner exchanges are named (fixpoint node, iteration, inner node); their bytes count for
    the fixpoint node (they were once dropped, and before that made the profile raise)."""
    c = dbsp.Circuit()
    e = c.input("e", pa.schema([("src", pa.int64()), ("dst", pa.int64())]))
    c.output("reach", c.recursive(
        lambda r, e: e + r.join(e, left_on="dst", right_on="src").select(src="src", dst="dst_right"), [e]))
    p = dbsp.Pipeline(c, workers=2)
    try:
        p.push("e", pa.table({"src": [1, 2, 3], "dst": [2, 3, 4]}))
        reach = p.step()["reach"]
        prof = p.profile()
    finally:
        p.close()
    fix = [r for r in prof["operators"] if r["exchange_bytes"] and r["kind"] != "exchange"]
    assert len(fix) == 1 and fix[0]["rows_out"] == reach.num_rows == 6, prof["operators"]
