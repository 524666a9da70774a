"""Exactly once from Postgres to Postgres under kill -9: a writer updates table ``sales`` (inserts, updates,
deletes in small transactions) while the pipeline process (PostgresSource -> pipeline -> two PostgresSinks,
tests/connectors/pg_child.py) is killed at random moments. At the end the mirrored table equals the source
table and the totals equal Postgres' own GROUP BY over it, as multisets; every step was applied once; the slot's
confirmed position followed the changes (the WAL it holds stays bounded).

``DBSP_PG_KILLS`` sets the kills of the long variant (default 20; the short one makes 2). The writer's choices
and the kill moments come from a seed new per run, printed; ``DBSP_PG_SEED`` replays one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from dbsp_core.connectors import read_postgres_view

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(HERE, "pg_child.py")
SEED = int(os.environ.get("DBSP_PG_SEED", str(random.SystemRandom().randrange(2**31))))
REGIONS = ["north", "south", "east", "west", "center"]


class Writer(threading.Thread):
    """Random small transactions on ``sales`` until stopped; samples the slot's confirmed position meanwhile."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.next_id = 0
        self.txns = 0
        self.confirmed: list[str] = []
        self.error: BaseException | None = None

    def one(self) -> None:
        rng, c = self.rng, self.conn
        with c.transaction():
            for _ in range(rng.randrange(1, 6)):
                op = rng.random()
                if op < 0.5 or self.next_id < 5:
                    c.execute("INSERT INTO sales VALUES (%s, %s, %s)",
                              (self.next_id, rng.choice(REGIONS), rng.randrange(100)))
                    self.next_id += 1
                elif op < 0.8:
                    c.execute("UPDATE sales SET amount = amount + %s, region = %s WHERE id = %s",
                              (rng.randrange(1, 10), rng.choice(REGIONS), rng.randrange(self.next_id)))
                else:
                    c.execute("DELETE FROM sales WHERE id = %s", (rng.randrange(self.next_id),))
        self.txns += 1

    def insert_one(self) -> None:
        """One transaction that surely changes the table (an UPDATE or DELETE of a deleted id changes nothing, and
        such a transaction leaves no commit in the WAL for the slot to confirm past)."""
        self.conn.execute("INSERT INTO sales VALUES (%s, %s, %s)", (self.next_id, self.rng.choice(REGIONS), 1))
        self.next_id += 1
        self.txns += 1

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.one()
                if self.txns % 20 == 0:
                    row = self.conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                             "WHERE database = current_database()").fetchone()
                    if row:
                        self.confirmed.append(row[0])
                time.sleep(self.rng.uniform(0, 0.01))
        except BaseException as e:  # reported by the test
            self.error = e


def _launch(storage: str, mode: str, src: str, sink: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PG_SOURCE_DSN=src,
               PG_SINK_DSN=sink)
    return subprocess.Popen([sys.executable, CHILD, storage, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _kill_at_random(proc: subprocess.Popen, rng: random.Random) -> tuple[int, int]:
    """SIGKILL ``proc``: three times in four a random delay after it recovered (START), otherwise while it starts
    or recovers. Returns (killed, killed while working)."""
    seen = ""
    if rng.random() < 0.75:
        seen = proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 1.0))
    else:
        time.sleep(rng.uniform(0.2, 1.2))
    if proc.poll() is not None:
        out, err = proc.communicate()
        raise AssertionError(f"the pipeline process ended by itself ({proc.returncode}): {seen}{out}{err}")
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    return 1, int("START" in seen + out)


def _rows(dsn: str, sql: str) -> list[tuple]:
    import psycopg

    with psycopg.connect(dsn) as c:
        return [tuple(r) for r in c.execute(sql).fetchall()]


def run_kills(pg_server, tmp_path, kills: int, capsys) -> None:
    import psycopg

    print(f"[postgres kill] seed {SEED} (replay: DBSP_PG_SEED={SEED})")
    rng = random.Random(SEED)
    src = pg_server.database("kill_src")
    sink = pg_server.database("kill_sink")
    with psycopg.connect(src, autocommit=True) as c:
        c.execute("CREATE TABLE sales (id bigint PRIMARY KEY, region text NOT NULL, amount bigint NOT NULL)")
    storage = str(tmp_path / "pipe")
    writer = Writer(src, SEED + 1)
    for _ in range(20):
        writer.one()  # rows for the snapshot
    writer.start()
    done = working = rounds = 0
    try:
        # at least ``kills`` kills, and on until the slot was seen at two positions while the writer ran: kills
        # that land before the pipeline made its slot, or right after, leave nothing to sample (DBSP_PG_SEED=
        # 587655051: one kill while starting, one 11 ms after START, no sample at all); bounded, then reported
        while done < kills or (len(set(writer.confirmed)) < 2 and rounds < 40):
            rounds += 1
            k, w = _kill_at_random(_launch(storage, "run", src, sink), rng)
            done, working = done + k, working + w
            assert writer.error is None, writer.error
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None, writer.error
    before_last = _rows(src, "SELECT pg_current_wal_lsn()::text")[0][0]
    writer.insert_one()  # not one(): a transaction of no-op updates/deletes would leave no WAL past before_last
    proc = _launch(storage, "finish", src, sink)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "DONE" in out, out + err
    steps = int(out.split("DONE")[1].split()[0])

    table = Counter(_rows(src, "SELECT id, region, amount FROM sales"))
    step, mirror = read_postgres_view(sink, "mirror")
    assert step == steps - 1
    got = Counter()
    for r in mirror.to_pylist():
        got[(r["id"], r["region"], r["amount"])] += r["weight"]
    assert got == table, f"the mirror differs from the source table (replay: DBSP_PG_SEED={SEED})"
    step, totals = read_postgres_view(sink, "by_region")
    assert step == steps - 1
    want = Counter(_rows(src, "SELECT region, count(*), sum(amount)::bigint, 1::bigint FROM sales GROUP BY region"))
    assert Counter((r["region"], r["n"], r["total"], r["weight"]) for r in totals.to_pylist()) == want, \
        f"the totals differ from Postgres' GROUP BY (replay: DBSP_PG_SEED={SEED})"
    for consumer in ("postgres-mirror", "postgres-by_region"):  # each step applied once, none skipped
        applied = [s for (s,) in _rows(sink, f"SELECT step FROM dbsp_sink_steps WHERE consumer = '{consumer}' "
                                             "ORDER BY step")]
        assert applied == list(range(steps))
    # the slot followed the changes: it confirmed past the writer's last transaction, and it moved during the run
    (confirmed, retained), = _rows(src, "SELECT confirmed_flush_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), "
                                        "restart_lsn)::bigint FROM pg_replication_slots "
                                        "WHERE database = current_database()")
    assert _rows(src, f"SELECT '{confirmed}'::pg_lsn > '{before_last}'::pg_lsn")[0][0]
    assert len(set(writer.confirmed)) >= 2, f"the slot was sampled at {writer.confirmed} in {rounds} runs"
    assert retained < 64 << 20, f"the slot holds {retained} bytes of WAL"
    assert done >= kills
    with capsys.disabled():
        print(f"\npostgres source -> pipeline -> postgres sinks: {done} kill -9s ({working} while working) in "
              f"{rounds} runs, {writer.txns} writer transactions, {steps} steps, {len(table)} rows; the slot moved "
              f"{len(set(writer.confirmed))} times while sampled and holds {retained} bytes of WAL at the end; "
              f"mirror and totals equal Postgres, every step applied once (seed {SEED})")


def test_kill_pipeline_short(pg_server, tmp_path, capsys) -> None:
    run_kills(pg_server, tmp_path, 2, capsys)


@pytest.mark.slow
def test_kill_pipeline_long(pg_server, tmp_path, capsys) -> None:
    run_kills(pg_server, tmp_path, int(os.environ.get("DBSP_PG_KILLS", "20")), capsys)
