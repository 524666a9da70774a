"""``dbsp run`` with a Postgres source and a Postgres sink declared in SQL, against a real server: the sink's table (a DECIMAL view as numeric) equals Postgres' own query over the source table, after a first run, changes (insert, update, delete) and a second run that resumes; the DSN's password is never printed."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal

from dbsp_core.__main__ import main


def _exec(dsn: str, *sql: str) -> list:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        out = []
        for s in sql:
            cur = c.execute(s)
            out = cur.fetchall() if cur.description else out
        return out


def _sink_view(dsn: str) -> Counter:
    got: Counter = Counter()
    for cust, n, amount, weight in _exec(dsn, "SELECT cust, n, amount, weight FROM totals"):
        assert weight > 0
        got[(cust, n, amount)] += weight
    return got


def _run(monkeypatch, capsys, tmp_path, text: str) -> tuple[int, str, str]:
    (tmp_path / "p.sql").write_text(text)
    monkeypatch.chdir(tmp_path)
    rc = main(["run", "p.sql", "--storage", "state", "--until-idle", "--workers", "2"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_postgres_in_postgres_out_resumes_and_matches_postgres(pg_dsn, tmp_path, monkeypatch, capsys) -> None:
    _exec(pg_dsn, "CREATE TABLE orders (id bigint PRIMARY KEY, cust int, cents bigint)",
          "INSERT INTO orders SELECT g, g % 5, g * 37 % 1000 FROM generate_series(1, 200) AS g")
    dsn = pg_dsn.replace("'", "''")
    text = (f"CREATE TABLE orders (id BIGINT, cust INT, cents BIGINT)\n"
            f"  WITH ('connector' = 'postgres', 'dsn' = '{dsn}');\n"
            f"CREATE VIEW totals WITH ('connector' = 'postgres', 'dsn' = '{dsn}') AS\n"
            f"  SELECT cust, count(*) AS n, sum(CAST(cents AS DECIMAL(12, 0)) * 0.01) AS amount\n"
            f"  FROM orders GROUP BY cust;\n")
    want_sql = "SELECT cust, count(*), sum(cents * 0.01)::numeric(18, 2) FROM orders GROUP BY cust"
    rc, out, err = _run(monkeypatch, capsys, tmp_path, text)
    assert rc == 0, (out, err)
    assert "source orders: postgres(dsn=***)" in out
    assert _sink_view(pg_dsn) == Counter(tuple(r) for r in _exec(pg_dsn, want_sql))
    assert _exec(pg_dsn, "SELECT data_type, numeric_precision, numeric_scale FROM information_schema.columns "
                         "WHERE table_name = 'totals' AND column_name = 'amount'") == [("numeric", 18, 2)]
    _exec(pg_dsn, "INSERT INTO orders SELECT g, g % 7, g FROM generate_series(201, 260) AS g",
          "UPDATE orders SET cents = cents + 1 WHERE id % 3 = 0", "DELETE FROM orders WHERE id % 11 = 0")
    rc, out, err = _run(monkeypatch, capsys, tmp_path, text)
    assert rc == 0, (out, err)
    assert "resumed at step" in out
    want = Counter(tuple(r) for r in _exec(pg_dsn, want_sql))
    assert _sink_view(pg_dsn) == want
    assert sum(want.values()) == 7 and all(isinstance(a, Decimal) for _, _, a in want)


def test_postgres_password_is_never_printed(pg_server, tmp_path, monkeypatch, capsys, caplog) -> None:
    # trust authentication: a role that does not exist is refused, whatever the password
    bad = f"host=127.0.0.1 port={pg_server.port} user=nobody_r35 password=Sw0rdfish-r35 dbname=postgres"
    rc, out, err = _run(monkeypatch, capsys, tmp_path,
                        f"CREATE TABLE t (a INT) WITH ('connector' = 'postgres', 'dsn' = '{bad}');\n"
                        "CREATE VIEW v AS SELECT a FROM t;\n")
    assert rc == 1, (out, err)
    assert "error:" in err
    assert "Sw0rdfish-r35" not in out + err + caplog.text


