"""Pipeline.metrics(), the Prometheus endpoint and the progress line: counts against what was pushed and
returned, state bytes that add up per shard, and the endpoint's text over HTTP on loopback."""

from __future__ import annotations

import io
import urllib.error
import urllib.request

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
import dbsp_core.metrics
from dbsp_core import _zset
from dbsp_core.progress import Progress


def _pipeline(**kw) -> tuple[dbsp.Pipeline, dbsp.Circuit]:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64()), ("ts", pa.int64())]), event_time="ts",
                lateness=0)
    c.output("sums", t.group_by("k").agg(s=dbsp.sum("v")))
    return dbsp.Pipeline(c, workers=2, **kw), c


def test_counts_match_what_was_pushed_and_returned(tmp_path) -> None:
    p, _ = _pipeline(storage=tmp_path, checkpoint_interval=None)
    rows_out = 0
    for i in range(12):
        p.push("t", pa.table({"k": [i % 5, i % 7, 100 + i], "v": [1, 2, 3], "ts": [i, i, i]}),
               producer="g", seq=i)
        p.push("t", pa.table({"k": [1], "v": [1], "ts": [i]}), producer="g", seq=i)  # a duplicate
        rows_out += p.step()["sums"].num_rows
    p.push("t", pa.table({"k": [1], "v": [1], "ts": [0]}))  # late: below the watermark 11
    p.step()
    p.checkpoint()
    m = p.metrics()
    assert m["steps"] == 13 and m["pushes"] == 13 and m["duplicate_pushes"] == 12
    assert m["rows_in"] == {"t": 37} and m["rows_out"]["sums"] == rows_out
    assert m["late_rows"] == {"t": 1}
    assert m["step_seconds"]["count"] == 13 and sum(m["step_seconds"]["counts"]) == 13
    assert m["step_seconds"]["p99"] >= m["step_seconds"]["p50"] > 0
    assert m["checkpoints"] == 1 and m["checkpoint_seconds"] > 0
    assert m["log_bytes"]["input"] > 0 and m["log_bytes"]["output"] > 0 and m["output_steps"] == [0, 13]
    assert set(m["state_bytes"]) == {0, 1}
    for w, v in m["state_bytes"].items():
        assert v["total"] > 0 and abs(sum(v["shards"].values()) - v["total"]) <= len(v["shards"])
        assert all(p.layout.owner(s) == w for s in v["shards"])
        assert v["key_index"] > 0  # the aggregate's key index (trace invariant 11), counted beside the state
    p.close()
    q, c = _pipeline(storage=tmp_path, checkpoint_interval=None)
    m = q.metrics()  # the counters go on from the last checkpoint: steps numbered as the output log numbers them
    assert m["steps"] == 13 == q.steps and m["pushes"] == 13 and m["duplicate_pushes"] == 12
    assert m["rows_in"] == {"t": 37} and m["rows_out"]["sums"] == rows_out and m["late_rows"] == {"t": 1}
    assert m["checkpoints"] == 2 and m["step_seconds"]["count"] == 13
    q.push("t", pa.table({"k": [1], "v": [1], "ts": [20]}))
    q.step()
    assert q.metrics()["steps"] == 14 and q.metrics()["pushes"] == 14
    q.close()


def test_prometheus_endpoint_serves_the_same_numbers() -> None:
    p, _ = _pipeline()
    p.push("t", pa.table({"k": [1, 2], "v": [1, 2], "ts": [0, 0]}))
    p.step()
    server, port = p.serve_metrics()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    for line in ("dbsp_steps_total 1.0", 'dbsp_rows_in_total{input="t"} 2.0', 'dbsp_rows_out_total{output="sums"} 2.0',
                 'dbsp_step_seconds_bucket{le="+Inf"} 1.0', "dbsp_workers 2.0", 'dbsp_late_rows_total{input="t"} 0.0'):
        assert line in text, line
    assert 'dbsp_state_bytes{worker="0"}' in text and "dbsp_state_shard_bytes{" in text
    assert 'dbsp_key_index_bytes{worker="0"}' in text
    p.close()


def test_progress_line_only_for_long_operations() -> None:
    out = io.StringIO()
    with Progress("replay", total=10, stream=out, delay=60, force=True) as pr:
        pr.update(10)
    assert out.getvalue() == ""  # shorter than the delay: nothing printed
    with Progress("replay", total=10, stream=out, delay=0, interval=0.01, force=True) as pr:
        pr.update(4)
    assert "replay 4/10 (40%)" in out.getvalue() and out.getvalue().endswith(" done\n")


def test_recovery_replay_draws_a_progress_line(tmp_path) -> None:
    """Pipeline.open replaying steps since the last checkpoint shows 'recovery replay n/n steps' on stderr."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import sys, pyarrow as pa, dbsp_core as dbsp\n"
        "c = dbsp.Circuit(); t = c.input('t', pa.schema([('k', pa.int64())]))\n"
        "c.output('n', t.group_by('k').agg(n=dbsp.count()))\n"
        "if sys.argv[2] == 'write':\n"
        "    p = dbsp.Pipeline(c, storage=sys.argv[1], checkpoint_interval=None)\n"
        "    for i in range(70):\n"
        "        p.push('t', pa.table({'k': [i % 7]})); p.step()\n"
        "    p.close(checkpoint=False)\n"
        "else:\n"
        "    dbsp.Pipeline.open(sys.argv[1], c).close()\n")
    env = dict(os.environ, PYTHONPATH=root, DBSP_PROGRESS="1", DBSP_PROGRESS_DELAY="0")
    for mode in ("write", "open"):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path), mode], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr
    assert "recovery replay 70/70 steps (100%)" in r.stderr and r.stderr.rstrip().endswith("done"), r.stderr


def _scrape(port: int) -> tuple[int, str]:
    """Status and body of GET /metrics on 127.0.0.1:port (an HTTP error status is returned, not raised)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_server_stops_when_the_pipeline_closes(tmp_path) -> None:
    """A scrape after p.close() got HTTP 500 and a traceback on stderr: close now stops the server (the port
    refuses connections), and a scrape that meets a closed pipeline (a server close did not stop: here one taken
    off the pipeline's list, as a scrape racing close would see it) gets 503 with one line saying why."""
    p, _ = _pipeline(storage=tmp_path, checkpoint_interval=None)
    p.push("t", pa.table({"k": [1], "v": [1], "ts": [0]}))
    p.step()
    _server, port = p.serve_metrics()
    status, text = _scrape(port)
    assert status == 200 and "dbsp_steps_total 1.0" in text
    racing, port2 = dbsp.metrics.serve(p)
    dbsp.metrics._attached(p).servers.remove(racing)
    p.close()
    with pytest.raises(urllib.error.URLError) as e:
        _scrape(port)
    assert isinstance(e.value.reason, ConnectionRefusedError), e.value
    try:
        status, text = _scrape(port2)
        assert status == 503 and text == "dbsp: no metrics: DbspError: the pipeline is closed\n", (status, text)
    finally:
        racing.shutdown()
        racing.server_close()


def test_backlog_bytes_of_fixed_width_and_string_pushes() -> None:
    """backlog_bytes: a push of fixed-width columns counts rows times the schema's row width (runtime/driver.py
    row_width, no walk of its buffers; a slice counts its rows only), a push with a string column Table.nbytes,
    both with their weights' 8 bytes a row; a step empties the backlog."""
    import numpy as np

    from dbsp_core.runtime.driver import row_width

    fixed = pa.schema([("k", pa.int64()), ("v", pa.int32()), ("t", pa.timestamp("us")), ("d", pa.date32())])
    strs = pa.schema([("k", pa.int64()), ("s", pa.string())])
    assert row_width(fixed) == 8 + 4 + 8 + 4 and row_width(strs) is None
    assert row_width(pa.schema([("b", pa.bool_())])) is None
    c = dbsp.Circuit()
    a, b = c.input("a", fixed), c.input("b", strs)
    c.output("a", a)
    c.output("b", b)
    with dbsp.Pipeline(c, workers=1) as p:
        n = 1000
        big = pa.table({"k": np.arange(n), "v": np.arange(n, dtype=np.int32),
                        "t": pa.array(np.arange(n), pa.timestamp("us")), "d": pa.array(np.arange(n), pa.int32())
                        .cast(pa.date32())}, schema=fixed)
        p.push("a", big.slice(100, 37))
        s = pa.table({"k": [1, 2, 3], "s": ["x", "yy", None]}, schema=strs)
        p.push("b", s)
        assert p.metrics(state=False)["backlog"]["bytes"] == 37 * (24 + 8) + s.nbytes + 3 * 8
        p.step()
        assert p.metrics(state=False)["backlog"]["bytes"] == 0


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_weight_sum_is_the_exact_sum(n: int) -> None:
    """``_zset.weight_sum`` (the steps' net_rows) is the exact sum as a Python int: negative and huge weights, sums
    beyond int64 (no wrap), and arrays that are not a contiguous int64 array (summed in Python)."""
    rng = np.random.default_rng(n)
    w = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    want = sum(int(x) for x in w)
    assert _zset.weight_sum(w) == want and type(_zset.weight_sum(w)) is int
    assert _zset.weight_sum(np.full(n, 2**63 - 1, dtype=np.int64)) == n * (2**63 - 1)
    assert _zset.weight_sum(np.full(n, -(2**63), dtype=np.int64)) == -n * 2**63
    assert _zset.weight_sum(w[::2]) == sum(int(x) for x in w[::2])
    assert _zset.weight_sum(w.astype(np.int32)) == sum(int(x) for x in w.astype(np.int32))
