"""Exactly once into Delta Lake under kill -9: the process running two DeltaSinks (one appending the ``big`` view's
changes, one merging ``by_region`` by key; tests/connectors/delta_child.py) over a pipeline's storage directory is
killed at random moments, mostly in the middle of its commits, while the pipeline goes on stepping. At the end
the Delta log holds each step's ``txn`` exactly once, each step's appended rows equal that step's change, and
both tables equal DuckDB's recomputation over every input pushed, as multisets (DuckDB reads the Parquet files
the Delta log lists).

``DBSP_DELTA_KILLS`` sets the kills of the long variant (default 20; the short one makes 2). The data and the
kill moments come from a seed new per run, printed; ``DBSP_DELTA_SEED`` replays one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import delta_steps

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from connector_workload import REGIONS, SCHEMA, circuit  # noqa: E402

pytest.importorskip("deltalake")

CHILD = os.path.join(HERE, "delta_child.py")
SEED = int(os.environ.get("DBSP_DELTA_SEED", str(random.SystemRandom().randrange(2**31))))


def _launch(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _batch(rng: random.Random, live: list) -> tuple[pa.Table, list[int]]:
    rows = [(rng.choice(REGIONS), rng.randrange(20), rng.randrange(100)) for _ in range(rng.randrange(1, 30))]
    weights = [1] * len(rows)
    for _ in range(rng.randrange(0, 4)):
        if live:
            rows.append(live.pop(rng.randrange(len(live))))
            weights.append(-1)
    live.extend(r for r, w in zip(rows, weights) if w == 1)
    return pa.table({n: [r[i] for r in rows] for i, n in enumerate(SCHEMA.names)}, schema=SCHEMA), weights


def run_kills(tmp_path, kills: int, capsys) -> None:
    import duckdb
    from deltalake import DeltaTable

    print(f"[delta kill] seed {SEED} (replay: DBSP_DELTA_SEED={SEED})")
    rng = random.Random(SEED)
    storage, app, mrg = str(tmp_path / "pipe"), str(tmp_path / "big"), str(tmp_path / "by_region")
    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=None, segment_bytes=4096)
    live: list = []
    pushed: list[tuple[tuple, int]] = []
    changes: dict[str, dict[int, dbsp.ZSet]] = {"big": {}, "by_region": {}}
    done = working = rounds = 0

    def steps(n: int) -> None:
        for _ in range(n):
            t, w = _batch(rng, live)
            p.push("sales", t, weights=w)
            pushed.extend(zip(zip(*[t.column(i).to_pylist() for i in range(3)]), w))
            step = p.steps
            for name, z in p.step().items():
                changes[name][step] = z

    steps(10)
    while done < kills:
        steps(rng.randrange(3, 12))
        p.checkpoint()
        rounds += 1
        proc = _launch(storage, app, mrg, str(p.steps))
        seen = proc.stdout.readline() if rng.random() < 0.8 else ""
        time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            done += 1
            working += "START" in seen
        proc.communicate()
    steps(5)
    p.checkpoint()
    rounds += 1
    proc = _launch(storage, app, mrg, str(p.steps))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "DONE" in out, out + err
    n = p.steps
    p.close()

    assert delta_steps(app, "delta-big") == list(range(n)), f"replay: DBSP_DELTA_SEED={SEED}"
    assert delta_steps(mrg, "delta-by_region") == list(range(n)), f"replay: DBSP_DELTA_SEED={SEED}"
    dt = DeltaTable(app)
    con = duckdb.connect()
    files = dt.file_uris()
    con.execute("CREATE TABLE big AS SELECT * FROM read_parquet($files)", {"files": files})
    per_step: dict[int, Counter] = {}
    for region, item, amount, weight, step in con.execute("SELECT region, item, amount, weight, step FROM big"
                                                          ).fetchall():
        per_step.setdefault(step, Counter())[(region, item, amount)] += weight
    for step, z in changes["big"].items():  # each step's rows once: a step committed twice would double them
        assert per_step.get(step, Counter()) == Counter(z.to_dict()), f"step {step} (replay: DBSP_DELTA_SEED={SEED})"
    con.execute("CREATE TABLE sales (region VARCHAR, item BIGINT, amount BIGINT, weight BIGINT)")
    con.executemany("INSERT INTO sales VALUES (?, ?, ?, ?)", [r + (w,) for r, w in pushed])
    want_big = Counter({tuple(r[:3]): r[3] for r in con.execute(
        "SELECT region, item, amount, sum(weight) w FROM sales WHERE amount > 50 GROUP BY ALL HAVING w <> 0"
    ).fetchall()})
    got_big = Counter({tuple(r[:3]): r[3] for r in con.execute(
        "SELECT region, item, amount, sum(weight) w FROM big GROUP BY ALL HAVING w <> 0").fetchall()})
    assert got_big == want_big, f"the appended table differs from DuckDB (replay: DBSP_DELTA_SEED={SEED})"
    want = Counter(tuple(r) for r in con.execute(
        "SELECT region, sum(weight), sum(amount * weight) FROM sales GROUP BY region HAVING sum(weight) <> 0"
    ).fetchall())
    con.execute("CREATE TABLE merged AS SELECT * FROM read_parquet($files)", {"files": DeltaTable(mrg).file_uris()})
    got = Counter(tuple(r) for r in con.execute("SELECT region, n, total FROM merged").fetchall())
    assert got == want, f"the merged table differs from DuckDB (replay: DBSP_DELTA_SEED={SEED})"
    assert done >= kills
    orphans = sum(1 for f in os.listdir(app) if f.endswith(".parquet")) - len(files)  # appends remove no file
    with capsys.disabled():
        print(f"\ndelta sinks: {done} kill -9s ({working} while committing) in {rounds} runs, {n} steps; each "
              f"step's txn once in both logs, {orphans} appended data files left by commits cut short; both "
              f"tables equal DuckDB (seed {SEED})")


def test_kill_delta_sinks_short(tmp_path, capsys) -> None:
    run_kills(tmp_path, 2, capsys)


@pytest.mark.slow
def test_kill_delta_sinks_long(tmp_path, capsys) -> None:
    run_kills(tmp_path, int(os.environ.get("DBSP_DELTA_KILLS", "20")), capsys)
