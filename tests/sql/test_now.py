"""SQL ``now()`` and ``CURRENT_TIMESTAMP`` are the step's logged time: views match DuckDB evaluated at that time after random steps with deletions at W in {1, 2, 4}, and a replay after a crash, under another wall clock, gives the same output.

Seeds vary per run and are printed; replay one with ``DBSP_NOW_SEED``.
"""

from __future__ import annotations

import collections
import datetime
import os
import random

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from oracle import connect  # tests/core: a cursor of the process's DuckDB database

SEED = int(os.environ.get("DBSP_NOW_SEED") or random.SystemRandom().randrange(2**31))
HOUR = 3600 * 10**9
EPOCH = datetime.datetime(1970, 1, 1)
SCHEMA = pa.schema([("id", pa.int32()), ("ts", pa.timestamp("us"))])
VIEWS = {
    "recent": "SELECT id, ts FROM ev WHERE ts > now() - INTERVAL 1 HOUR AND id % 2 = 0",
    "due": "SELECT id FROM ev WHERE ts <= CURRENT_TIMESTAMP",
    "late_count": "SELECT count(*) AS n FROM ev WHERE ts < now() - INTERVAL 2 HOUR",
}
PROGRAM = "CREATE TABLE ev (id INT, ts TIMESTAMP);\n" + "".join(f"CREATE VIEW {v} AS {q};\n" for v, q in VIEWS.items())


def _ts(ns: int) -> datetime.datetime:
    return EPOCH + datetime.timedelta(microseconds=ns // 1000)


def _rows(rng: random.Random, now_ns: int, n: int) -> list[tuple]:
    return [(rng.randrange(1000), _ts(now_ns + rng.randrange(-4 * HOUR, 2 * HOUR))) for _ in range(n)]


def _duckdb(held: list[tuple], now_ns: int) -> dict[str, collections.Counter]:
    con = connect()
    con.register("ev", pa.table({"id": pa.array([r[0] for r in held], pa.int32()),
                                 "ts": pa.array([r[1] for r in held], pa.timestamp("us"))}))
    at = f"TIMESTAMP '{_ts(now_ns).isoformat(sep=' ')}'"
    return {v: collections.Counter(con.execute(q.replace("now()", at).replace("CURRENT_TIMESTAMP", at)).fetchall())
            for v, q in VIEWS.items()}


def _steps(p: dbsp.Pipeline, rng: random.Random, clock: list[int], n: int, held: list[tuple],
           views: dict[str, collections.Counter], check: bool = True) -> None:
    for _ in range(n):
        clock[0] += rng.randrange(0, HOUR)  # now moves on (or stays) between steps
        new = _rows(rng, clock[0], rng.randrange(0, 20))
        gone = rng.sample(held, min(len(held), rng.randrange(0, 5)))
        for r in gone:
            held.remove(r)
        held += new
        if new or gone:
            p.push("ev", pa.table({"id": pa.array([r[0] for r in new + gone], pa.int32()),
                                   "ts": pa.array([r[1] for r in new + gone], pa.timestamp("us"))}),
                   weights=[1] * len(new) + [-1] * len(gone))
        for v, z in p.step().items():
            for row, w in z.to_dict().items():
                views[v][row] += w
        assert p.now_ns == clock[0]  # the step logged the clock's now
        if check:
            want = _duckdb(held, p.now_ns)
            for v in VIEWS:
                assert +views[v] == want[v], (v, f"seed {SEED} (replay: DBSP_NOW_SEED={SEED})")


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_now_is_the_steps_logged_time(tmp_path, workers: int) -> None:
    rng = random.Random(SEED * 10 + workers)
    print(f"seed {SEED} (replay: DBSP_NOW_SEED={SEED})")
    clock = [100 * HOUR]
    p = dbsp.Pipeline(sql.compile(PROGRAM), workers=workers, storage=str(tmp_path), clock=lambda: clock[0])
    views: dict[str, collections.Counter] = {v: collections.Counter() for v in VIEWS}
    _steps(p, rng, clock, rng.randrange(5, 9), [], views)
    p.close()


def test_replay_after_a_crash_gives_the_same_answers_under_another_clock(tmp_path) -> None:
    rng = random.Random(SEED)
    clock = [100 * HOUR]
    c = sql.compile(PROGRAM)
    p = dbsp.Pipeline(c, workers=2, storage=str(tmp_path), clock=lambda: clock[0], checkpoint_interval=None)
    views: dict[str, collections.Counter] = {v: collections.Counter() for v in VIEWS}
    held: list[tuple] = []
    _steps(p, rng, clock, 3, held, views)
    p.checkpoint()
    _steps(p, rng, clock, 4, held, views)  # after the checkpoint: replayed on recovery
    before = {v: [(s, z.to_dict()) for s, z in p.read_output(v)] for v in VIEWS}
    p.close(checkpoint=False)  # a crash: the state is the checkpoint's, the steps after it are in the logs
    # recovery replays the 4 steps under a wall clock 1000 hours later; replay_check (on by default) fails the open
    # if a replayed step's output differs from the logged one
    offset = [1000 * HOUR]
    q = dbsp.Pipeline.open(str(tmp_path), c, clock=lambda: clock[0] + offset[0])
    assert q.stats["replayed_steps"] == 4
    offset[0] = 0
    assert {v: [(s, z.to_dict()) for s, z in q.read_output(v)] for v in VIEWS} == before
    _steps(q, rng, clock, 2, held, views, check=False)  # and it runs on from the recovered state
    want = _duckdb(held, q.now_ns)
    assert all(+views[v] == want[v] for v in VIEWS), f"seed {SEED} (replay: DBSP_NOW_SEED={SEED})"
    q.close()


def test_now_outside_a_condition_is_refused_at_its_position() -> None:
    with pytest.raises(sql.SqlError, match=r"line 1, column 51: NOW\(\) is supported in WHERE and HAVING"):
        sql.compile("CREATE TABLE ev (id INT); CREATE VIEW v AS SELECT now() AS t FROM ev")
