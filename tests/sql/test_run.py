"""``dbsp run``: a pipeline defined in SQL alone, stopped by SIGINT at random moments and run again, gives what DuckDB computes over all its input, nothing doubled; its SQL and connector errors name the file's line.

Seeds vary per run and are printed; replay one with ``DBSP_RUN_SEED``.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dbsp_core.connectors import read_parquet_view, read_sqlite_view
from dbsp_core.connectors.parquet_sink import step_file
from oracle import connect  # tests/core: a cursor of the process's DuckDB database

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = int(os.environ.get("DBSP_RUN_SEED") or random.SystemRandom().randrange(2**31))

PIPELINE = """
CREATE TABLE customers (id INT, region VARCHAR)
    WITH ('connector' = 'files', 'path' = 'in/customers', 'format' = 'parquet');
CREATE TABLE orders (id BIGINT, cust INT, amount BIGINT)
    WITH ('connector' = 'files', 'path' = 'in/orders', 'format' = 'parquet');
CREATE VIEW by_region WITH ('connector' = 'parquet', 'path' = 'out/by_region') AS
    SELECT c.region, count(*) AS n, sum(o.amount) AS total
    FROM orders o JOIN customers c ON o.cust = c.id GROUP BY c.region;
CREATE VIEW big WITH ('connector' = 'sqlite', 'path' = 'out/big.db') AS
    SELECT id, amount FROM orders WHERE amount > 50;
"""
QUERIES = {
    "by_region": "SELECT c.region, count(*) AS n, sum(o.amount) AS total FROM orders o JOIN customers c "
                 "ON o.cust = c.id GROUP BY c.region",
    "big": "SELECT id, amount FROM orders WHERE amount > 50",
}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["DBSP_PROGRESS"] = "0"
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dbsp_core", "run", *args]


class Input:
    """The files written so far and the orders they leave (ids unique; a deletion removes one order once)."""

    def __init__(self, root: str, rng: random.Random) -> None:
        self.root, self.rng = root, rng
        self.live: dict[int, tuple] = {}
        self.next_id = 0
        self.files = 0
        for d in ("customers", "orders"):
            os.makedirs(os.path.join(root, "in", d), exist_ok=True)
        pq.write_table(pa.table({"id": pa.array(range(8), pa.int32()),
                                 "region": [f"r{i % 3}" for i in range(8)]}),
                       os.path.join(root, "in", "customers", "c.parquet"))

    def add(self, n_files: int) -> None:
        """``n_files`` order files, each inserting rows and deleting some live ones (a ``weight`` of -1)."""
        for _ in range(n_files):
            rows, weights = [], []
            for _ in range(self.rng.randrange(20, 60)):
                row = (self.next_id, self.rng.randrange(10), self.rng.randrange(100))  # cust 8, 9: no customer
                self.next_id += 1
                rows.append(row)
                weights.append(1)
            for oid in self.rng.sample(sorted(self.live), min(len(self.live), self.rng.randrange(0, 15))):
                rows.append(self.live.pop(oid))
                weights.append(-1)
            for r, w in zip(rows, weights):
                if w > 0:
                    self.live[r[0]] = r
            t = pa.table({"id": pa.array([r[0] for r in rows], pa.int64()),
                          "cust": pa.array([r[1] for r in rows], pa.int32()),
                          "amount": pa.array([r[2] for r in rows], pa.int64()),
                          "weight": pa.array(weights, pa.int64())})
            tmp = os.path.join(self.root, "in", "orders", f".f{self.files:05d}.parquet")
            pq.write_table(t, tmp)
            os.rename(tmp, os.path.join(self.root, "in", "orders", f"f{self.files:05d}.parquet"))  # whole or not at all
            self.files += 1

    def expected(self) -> dict[str, collections.Counter]:
        orders = pa.table({"id": pa.array([r[0] for r in self.live.values()], pa.int64()),
                           "cust": pa.array([r[1] for r in self.live.values()], pa.int32()),
                           "amount": pa.array([r[2] for r in self.live.values()], pa.int64())})
        customers = pq.read_table(os.path.join(self.root, "in", "customers", "c.parquet"))
        con = connect()
        con.register("orders", orders)
        con.register("customers", customers)
        return {v: collections.Counter(con.execute(q).fetchall()) for v, q in QUERIES.items()}


def _got(root: str) -> dict[str, collections.Counter]:
    z = read_parquet_view(os.path.join(root, "out", "by_region"))
    by_region = collections.Counter()
    for row, w in z.to_dict().items():
        assert w > 0, (row, w)
        by_region[row] += w
    _, big = read_sqlite_view(os.path.join(root, "out", "big.db"), "big")
    rows = collections.Counter()
    for r in big.to_pylist():
        assert r["weight"] > 0, r
        rows[(r["id"], r["amount"])] += r["weight"]
    return {"by_region": by_region, "big": rows}


def _interrupted_run(root: str, workers: int, rng: random.Random, how: str = "sigint") -> str:
    """A run stopped at a random moment after it started, by ``how``: "sigint" (a clean stop, checked), "sigint2"
    (Ctrl-C twice: it stops at once) or "kill" (SIGKILL); returns its output."""
    proc = subprocess.Popen(_cmd("pipeline.sql", "--storage", "state", "--workers", str(workers),
                                 "--files-per-step", "1", "--poll", "0.05"),
                            cwd=root, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # the header: the signal handler is in place
    assert first.startswith("dbsp run pipeline.sql"), (first, proc.stderr.read() if proc.poll() is not None else "")
    time.sleep(rng.uniform(0.0, 1.5))
    if how == "kill":
        proc.kill()
    else:
        proc.send_signal(signal.SIGINT)
        if how == "sigint2":
            time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if how == "sigint":
        assert proc.returncode == 0, (proc.returncode, out, err)
        assert "stopped at step" in out, out  # the stop was clean: the step finished, the pipeline checkpointed
    return first + out


def _final_run(root: str, data: Input, stopped: list[int]) -> None:
    """A run to idle at W=2, then the sinks equal DuckDB over all the input and hold each step once."""
    done = subprocess.run(_cmd("pipeline.sql", "--storage", "state", "--workers", "2", "--until-idle"),
                          cwd=root, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "idle: every source read" in done.stdout
    assert _got(root) == data.expected(), f"seed {SEED} (replay: DBSP_RUN_SEED={SEED})"
    # every step once: one change file per step, 0..N-1, and the sink's mark at N
    steps = int(open(os.path.join(root, "out", "by_region", "_next")).read())
    assert steps >= max(stopped, default=0)
    for s in range(steps):
        assert os.path.exists(step_file(os.path.join(root, "out", "by_region"), s)), s
    assert len([f for f in os.listdir(os.path.join(root, "out", "by_region")) if f.startswith("step-")]) == steps


def _setup(tmp_path, rng: random.Random) -> tuple[str, Input]:
    root = str(tmp_path)
    with open(os.path.join(root, "pipeline.sql"), "w") as f:
        f.write(PIPELINE)
    data = Input(root, rng)
    data.add(rng.randrange(10, 18))
    return root, data


def test_sigint_at_random_moments_then_rerun_matches_duckdb(tmp_path) -> None:
    rng = random.Random(SEED)
    print(f"seed {SEED} (replay: DBSP_RUN_SEED={SEED})")
    root, data = _setup(tmp_path, rng)
    stopped = []
    for workers in (4,):  # then the final run at W=2 rescales on open (the slow test below stops more runs)
        out = _interrupted_run(root, workers, rng)
        stopped.append(int(out.rsplit("stopped at step ", 1)[1].split()[0]))
        data.add(rng.randrange(3, 8))  # more input arrives while it is stopped
    _final_run(root, data, stopped)


@pytest.mark.slow
def test_ctrl_c_twice_and_kill_9_at_random_moments_then_rerun_matches_duckdb(tmp_path) -> None:
    rng = random.Random(SEED + 1)
    print(f"seed {SEED} (replay: DBSP_RUN_SEED={SEED})")
    root, data = _setup(tmp_path, rng)
    for _ in range(6):
        _interrupted_run(root, rng.choice([1, 2, 4]), rng, rng.choice(["sigint", "sigint2", "kill"]))
        data.add(rng.randrange(0, 6))
    _final_run(root, data, [])


def _run_text(tmp_path, monkeypatch, capsys, text: str) -> tuple[int, str, str]:
    """``dbsp run p.sql --until-idle`` in this process (the CLI's main), in ``tmp_path``: (status, out, err)."""
    from dbsp_core.__main__ import main

    (tmp_path / "p.sql").write_text(text)
    monkeypatch.chdir(tmp_path)
    rc = main(["run", "p.sql", "--storage", "state", "--until-idle"])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("text, where, says", [
    ("CREATE TABLE t (a INT)\n  WITH ('connector' = 'files', 'path' = 'in',\n        'pth' = 'x');\n", "p.sql:3:9",
     "connector 'files' has no option 'pth'; its options are 'path'"),
    ("CREATE TABLE t (a INT, b INT);\nCREATE VIEW v AS\n  SELECT a, sum(b) FROM t;\n", "p.sql:3:10",
     "column a must appear in GROUP BY or be used in an aggregate function"),
    ("CREATE TABLE t (a INT)\nCREATE VIEW v AS SELECT a FROM t;\n", "p.sql:2:", "missing ';' before line 2"),
    ("CREATE TABLE t (a INT) WITH ('connector' = 'parquet', 'path' = 'x');\n", "p.sql:1:",
     "unknown connector 'parquet'; a table takes 'files', 'postgres'; 'parquet' is a connector of a view"),
])
def test_errors_name_the_file_line_and_touch_nothing(tmp_path, monkeypatch, capsys, text, where, says) -> None:
    rc, out, err = _run_text(tmp_path, monkeypatch, capsys, text)
    assert rc == 2, (out, err)
    assert err.startswith(where) and says in err, err
    assert not (tmp_path / "state").exists()  # checked before anything was opened


def test_credentials_are_never_printed(tmp_path, monkeypatch, capsys, caplog) -> None:
    secret = "hunter2-r35"
    rc, out, err = _run_text(tmp_path, monkeypatch, capsys,
                             f"CREATE TABLE t (a INT) WITH ('connector' = 'postgres', 'dsn' = "
                             f"'host=127.0.0.1 port=1 user=u password={secret} connect_timeout=3');\n"
                             "CREATE VIEW v AS SELECT a FROM t;\n")
    assert rc == 1, (out, err)
    assert "source t: postgres(dsn=***)" in out  # it got as far as naming the source
    assert "error:" in err
    assert secret not in out + err + caplog.text


README_MARK = "# tests/sql/test_run.py runs this block as written"


def _readme_block(tmp_path, names: str) -> tuple[str, str]:
    """The README's bash block marked as run here that writes ``names``, run as written in ``tmp_path``: (its
    stdout, what its last ``# prints`` comment says)."""
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = [b for b in re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
                  if b.startswith(README_MARK) and names in b]
    assert len(blocks) == 1
    env = _env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `python` is this interpreter
    r = subprocess.run(["bash", "-e", "-c", blocks[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr)
    said = re.findall(r"^# prints (.*)$", blocks[0], flags=re.M)[-1]
    assert r.stdout.strip().splitlines()[-1] == said
    return r.stdout, said


def test_readme_sql_only_pipeline_runs_as_written(tmp_path) -> None:
    """README "A pipeline in SQL only": its shop block prints what it says, and the SQLite view equals DuckDB over
    the block's input files."""
    from decimal import ROUND_HALF_UP, Decimal

    out, said = _readme_block(tmp_path, "shop.sql")
    assert "resumed at step 1" in out  # the second run went on from the first
    con = duckdb.connect()
    con.execute(f"CREATE VIEW orders AS SELECT id, customer, amount FROM (SELECT id, customer, amount, 1 AS weight "
                f"FROM read_parquet('{tmp_path}/data/orders/*.parquet') UNION ALL SELECT id, customer, "
                f"amount::DECIMAL(10, 2), weight FROM read_csv('{tmp_path}/data/orders/*.csv')) "
                f"GROUP BY ALL HAVING sum(weight) > 0")
    con.execute(f"CREATE VIEW customers AS SELECT * FROM read_csv('{tmp_path}/data/customers/*.csv')")
    want = [(region, n, str(total), str((total / n).quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)))
            for region, n, total in con.execute(
                "SELECT c.region, count(*), sum(o.amount) FROM orders AS o JOIN customers AS c ON o.customer = c.id "
                "GROUP BY c.region ORDER BY c.region").fetchall()]
    assert repr(want) == said


@pytest.mark.slow
def test_readme_nexmark_sql_runs_as_written(tmp_path) -> None:
    """README "A pipeline in SQL only": ``dbsp run`` on Nexmark's queries.sql over Parquet files prints what the
    README says, and its q4 sink equals DuckDB's q4 over the same files."""
    import ast

    from dbsp_core.nexmark.sql_queries import PATH

    out, said = _readme_block(tmp_path, "nexmark.sql")
    assert "idle: every source read" in out
    with open(PATH, encoding="utf-8") as f:
        q4 = f.read().split("CREATE VIEW q4 AS", 1)[1].split(";", 1)[0]
    con = duckdb.connect()
    for t in ("person", "auction", "bid"):
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{tmp_path}/nexmark/{t}/*.parquet')")
    want = dict(con.execute(q4).fetchall())
    rows = read_parquet_view(os.path.join(tmp_path, "out", "q4")).to_dict()
    assert set(rows.values()) == {1}
    got = {category: avg for category, avg in rows}
    assert sorted(got) == sorted(want)
    assert all(abs(got[k] - want[k]) <= 1e-9 * abs(want[k]) for k in want)
    assert ast.literal_eval(said) == sorted((c, round(a)) for c, a in want.items())


def test_a_rerun_reads_the_new_files_behind_more_old_ones_than_a_step_takes(tmp_path, monkeypatch, capsys) -> None:
    """A rerun's first polls find only files the last run pushed (skipped, but counted against --files-per-step):
    it must go on to the new files behind them, not stop as idle (a run stopped that way lost its last files)."""
    from dbsp_core.__main__ import main

    rng = random.Random(SEED)
    root, data = _setup(tmp_path, rng)
    monkeypatch.chdir(root)
    args = ["run", "pipeline.sql", "--storage", "state", "--until-idle", "--files-per-step", "2"]
    assert main(args) == 0
    data.add(3)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("idle: every source read") == 2
    assert _got(root) == data.expected(), f"seed {SEED} (replay: DBSP_RUN_SEED={SEED})"
