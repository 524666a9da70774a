"""An autoscaled embedded pipeline under a load swing: it scales up while big steps miss the latency target and back down once small ones meet it, each a live rescale the autoscaler decided, while its output stays equal to a dict model; the decisions show in metrics(), the Prometheus text and ``dbsp inspect``.

The swing's step cost is a per-row sleep on each worker's rows, so which side of the latency target a step falls
does not depend on the machine's load.

``DBSP_AUTOSCALE_SEED`` replays the data (the seed is printed).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp

SEED = int(os.environ.get("DBSP_AUTOSCALE_SEED", str(random.SystemRandom().randrange(2**31))))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


# The load swing's cost: every row costs COST_S of sleep in a flat_map that runs on each worker's rows, so a step's
# critical path is rows / workers * COST_S however loaded the machine is (sleep is a lower bound that releases the
# GIL: two worker threads halve it). A big step (BIG rows) takes at least 450 ms at one worker, above the 250 ms
# target under any load; a 10-row step's cost is 0.3 ms, so the small steps meet the target unless the machine
# stalls them for ~100 ms in every 2 s window (a step measured 24 ms p99 at load 33 on 2 cores).
COST_S = 30e-6
BIG = 15_000
TARGET_MS = 250.0


def _costly(b: pa.RecordBatch) -> pa.RecordBatch:
    time.sleep(b.num_rows * COST_S)
    return b


def _circuit(cost: bool = False) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    if cost:
        t = t.flat_map(_costly, schema=SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    return c


def _model(rows: Counter) -> Counter:
    n: Counter = Counter()
    s: Counter = Counter()
    for (k, v), w in rows.items():
        n[k] += w
        s[k] += v * w
    return Counter({(k, n[k], s[k]): 1 for k in n if n[k]})


@pytest.mark.slow  # about 6 s quiet, 40-50 s at load 18 (beside 2 CPU burners): the long suite
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="worker threads stop at the cores: one core cannot rescale")
def test_a_load_swing_rescales_up_and_down_and_the_output_stays_right() -> None:
    print(f"\n[autoscale pipeline] seed {SEED} (replay: DBSP_AUTOSCALE_SEED={SEED})")
    rng = np.random.default_rng(SEED)
    p = dbsp.Pipeline(_circuit(cost=True), workers=1)
    fed: Counter = Counter()
    view: Counter = Counter()

    def step(rows: int) -> None:
        k = rng.integers(0, 50_000, rows)
        v = rng.integers(0, 100, rows)
        p.push("t", pa.table({"k": k, "v": v}, schema=SCHEMA))
        fed.update(zip(k.tolist(), v.tolist()))
        view.update(p.step()["g"].to_dict())

    def changes(reason: str) -> list[dict]:
        return [c for c in p.metrics(state=False)["autoscale"]["changes"] if c["reason"].startswith(reason)
                and c["result"] == "done"]

    policy = dbsp.Autoscale(1, 4, max_step_ms=TARGET_MS, window_s=2, interval_s=0, min_steps=3,
                            scale_down_window_s=1.0)
    p.autoscale(policy)
    assert p.workers == 1 and not changes("")
    deadline = time.monotonic() + 120  # a bound for a stuck policy, not a timing the test measures
    while not changes("scale_up") and time.monotonic() < deadline:  # big steps: at least 1.8x the target at one worker
        step(BIG)
    up = changes("scale_up")
    assert up, f"no scale-up under big steps: {p.autoscale_decisions[-3:]}"
    assert up[0]["workers"] == 1 and up[0]["target"] == 2  # worker threads stop at the cores (2 here)
    assert up[0]["inputs"]["step_ms_p99"] > TARGET_MS and p.workers == 2
    while not changes("scale_down") and time.monotonic() < deadline:  # small steps meet the target at once
        step(10)
        time.sleep(0.02)
    down = changes("scale_down")
    assert down, f"no scale-down under small steps: {p.autoscale_decisions[-3:]}"
    assert down[0]["target"] == 1 and down[0]["reason"] == "scale_down"
    p.autoscale(None)  # waits for a rescale in flight
    step(10)
    assert p.workers == 1
    got = Counter({r: w for r, w in view.items() if w})
    assert got == _model(fed)  # multisets: every row of the integral once

    m = p.metrics(state=False)
    assert "autoscale" not in m and m["backlog"] == {"rows": 0, "bytes": 0, "age_s": 0.0}
    p.autoscale(policy)
    step(10)
    from dbsp_core.metrics import prometheus_text

    text = prometheus_text(p)
    assert 'dbsp_autoscale_decisions_total{reason="measuring"}' in text and "dbsp_backlog_rows 0.0" in text
    assert "dbsp_autoscale_max_workers 2.0" in text
    p.close()


def test_a_policy_bound_rescales_a_durable_pipeline_and_inspect_shows_it(tmp_path) -> None:
    """A policy whose bounds exclude the size brings it inside after the next step (the decision ``bounds``); the
    checkpoint's METRICS keeps the decisions for ``dbsp inspect``; the next open goes on at the new size."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_circuit(), workers=2, storage=d, checkpoint_interval=None)
    p.push("t", pa.table({"k": [1, 2], "v": [3, 4]}, schema=SCHEMA))
    p.step()
    p.autoscale(dbsp.Autoscale(1, 1, max_step_ms=1000))
    p.push("t", pa.table({"k": [1], "v": [5]}, schema=SCHEMA))
    assert p.step()["g"].to_dict() == {(1, 1, 3): -1, (1, 2, 8): 1}
    deadline = time.monotonic() + 30
    while p.metrics(state=False)["autoscale"]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.workers == 1 and p.last_rescale["to_workers"] == 1
    p.close()  # checkpoints: METRICS holds the autoscaler's snapshot
    out = subprocess.run([sys.executable, "-m", "dbsp_core", "inspect", d], capture_output=True, text=True,
                         check=True).stdout
    assert "autoscale    1..1 workers; 1 rescales (0 failed)" in out and "bounds 2 -> 1 (done)" in out, out
    q = dbsp.Pipeline.open(d, _circuit(), autoscale=dbsp.Autoscale(1, 2, max_step_ms=1000))
    assert q.workers == 1 and q.metrics(state=False)["autoscale"]["cap"] == min(2, os.cpu_count() or 1)
    q.close()
