"""Tables with a primary key (``Circuit.input(primary_key=...)``, SQL ``PRIMARY KEY``, ``Pipeline.delete``): random
pushes with repeated keys and deletes by key, several per step, give after every step the table DuckDB holds after
the same rows as ``INSERT OR REPLACE`` / ``DELETE ... WHERE key`` in push order, and views over it match DuckDB's,
at W in {1, 2, 4}, durable across a reopen at another worker count, and on the staged executor; the refusals."""

from __future__ import annotations

import os
from collections import Counter

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.runtime import StagedExecutor

SEED = int(os.environ.get("DBSP_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
CUSTOMER = pa.schema([("id", pa.int32()), ("region", pa.utf8()), ("name", pa.utf8())])
ORDERS = pa.schema([("oid", pa.int64()), ("cid", pa.int32()), ("amount", pa.int64())])
DDL = """CREATE TABLE customer (id INT, region VARCHAR, name VARCHAR, PRIMARY KEY (id, region));
         CREATE TABLE orders (oid BIGINT PRIMARY KEY, cid INT, amount BIGINT);"""
SPEND = ("SELECT c.region, count(*) AS n, sum(o.amount) AS total FROM orders o JOIN customer c ON o.cid = c.id "
         "GROUP BY c.region")


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    cust = c.input("customer", CUSTOMER, primary_key=["id", "region"])  # a key of two columns, one a string
    orders = c.input("orders", ORDERS, primary_key="oid")
    c.output("customer_changes", cust)
    spend = orders.join(cust, left_on="cid", right_on="id").group_by("region").agg(n=dbsp.count(),
                                                                                  total=dbsp.sum("amount"))
    c.output("spend", spend, materialized=True)
    return c


def rows(t: pa.Table) -> Counter:
    return Counter(zip(*[t.column(i).to_pylist() for i in range(t.num_columns)]))


class Oracle:
    """DuckDB tables with the same primary keys, changed row by row in push order."""

    def __init__(self) -> None:
        self.con = duckdb.connect()
        self.con.execute(DDL)

    def apply(self, table: str, key: list[str], data: list[tuple], weights: list[int]) -> None:
        for r, w in zip(data, weights):
            cols = [f.name for f in (CUSTOMER if table == "customer" else ORDERS)]
            if w > 0:
                self.con.execute(f"INSERT OR REPLACE INTO {table} VALUES ({', '.join('?' * len(r))})", list(r))
            else:
                cond = " AND ".join(f"{k} = ?" for k in key)
                self.con.execute(f"DELETE FROM {table} WHERE {cond}", [r[cols.index(k)] for k in key])

    def bag(self, q: str) -> Counter:
        return rows(self.con.sql(q).to_arrow_table())


def random_push(rng: np.random.Generator, table: str) -> tuple[list[tuple], list[int]]:
    """A few rows over a small key space (so keys repeat within a push, a step and across steps), some -1."""
    n = int(rng.integers(1, 7))
    if table == "customer":
        data = [(int(rng.integers(0, 6)), ["eu", "us"][int(rng.integers(0, 2))], f"n{int(rng.integers(0, 5))}")
                for _ in range(n)]
    else:
        data = [(int(rng.integers(0, 15)), int(rng.integers(0, 6)), int(rng.integers(1, 50))) for _ in range(n)]
    return data, [1 if rng.random() < 0.75 else -1 for _ in range(n)]


def push(p: dbsp.Pipeline, o: Oracle, rng: np.random.Generator, table: str) -> None:
    data, weights = random_push(rng, table)
    schema = CUSTOMER if table == "customer" else ORDERS
    key = ["id", "region"] if table == "customer" else ["oid"]
    o.apply(table, key, data, weights)
    if all(w < 0 for w in weights) and rng.random() < 0.5:  # Pipeline.delete, keys in one of its forms
        keys = [tuple(r[schema.names.index(k)] for k in key) for r in data]
        form = int(rng.integers(0, 3))
        if form == 0:
            p.delete(table, pd.DataFrame(keys, columns=key))
        elif form == 1:
            p.delete(table, [dict(zip(key, k)) for k in keys])
        else:
            p.delete(table, [k[0] for k in keys] if len(key) == 1 else keys)
    else:
        p.push(table, dbsp.ZSet.from_rows(data, schema, weights=weights))


def check(p: dbsp.Pipeline, o: Oracle, integral: Counter, where: str) -> None:
    for table in ("customer", "orders"):
        got, want = rows(p.view(table)), o.bag(f"SELECT * FROM {table}")
        assert got == want, f"{where}: table {table} differs: only ours {got - want}, only DuckDB's {want - got}"
    got, want = rows(p.view("spend")), o.bag(SPEND)
    assert got == want, f"{where}: view spend differs: only ours {got - want}, only DuckDB's {want - got}"
    assert +integral == integral and integral == o.bag("SELECT * FROM customer"), \
        f"{where}: the table's changes (retractions of replaced rows) do not sum to the table"
    got, want = rows(p.query("SELECT region, count(*) AS k FROM customer GROUP BY region")), \
        o.bag("SELECT region, count(*) AS k FROM customer GROUP BY region")
    assert got == want, f"{where}: a query over the keyed table differs"


def run(p: dbsp.Pipeline, o: Oracle, rng: np.random.Generator, steps: int, integral: Counter, where: str) -> None:
    for s in range(steps):
        for _ in range(int(rng.integers(1, 5))):  # several pushes per step: the last row of a key wins
            push(p, o, rng, "customer" if rng.random() < 0.5 else "orders")
        out = p.step()
        integral.update(out["customer_changes"].to_dict())
        for r in [r for r, w in integral.items() if w == 0]:
            del integral[r]
        check(p, o, integral, f"{where} step {s}")


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_upserts_and_deletes_match_duckdb_insert_or_replace(workers) -> None:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    rng = np.random.default_rng([SEED, workers])
    p, o, integral = dbsp.Pipeline(circuit(), workers=workers, shard_bits=4), Oracle(), Counter()
    run(p, o, rng, 15, integral, f"W={workers}")
    p.rescale(3, batch_shards=4)  # the keyed state moves by shard: the key decides the shard
    run(p, o, rng, 5, integral, f"W={workers} -> 3")
    p.close()


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_keyed_tables_survive_a_reopen_at_another_worker_count(tmp_path, kind) -> None:
    print(f"seed {SEED} (replay: DBSP_TEST_SEED={SEED})")
    rng = np.random.default_rng([SEED, 99])
    ex = (lambda: StagedExecutor()) if kind == "staged" else (lambda: None)
    d = str(tmp_path / "d")
    p, o, integral = dbsp.Pipeline(circuit(), workers=2, shard_bits=4, storage=d, executor=ex(),
                                   checkpoint_interval=None), Oracle(), Counter()
    run(p, o, rng, 6, integral, f"{kind} W=2")
    p.close()
    q = dbsp.Pipeline.open(d, circuit(), workers=1, executor=ex(), checkpoint_interval=None)
    check(q, o, integral, f"{kind} reopened at W=1")
    run(q, o, rng, 4, integral, f"{kind} W=1")
    q.close()


def test_the_last_row_of_a_key_wins_within_a_step() -> None:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.utf8())]), primary_key=["k"])
    c.output("changes", t)
    p = dbsp.Pipeline(c, workers=2)
    p.push("t", [(1, "a"), (2, "b"), (1, "c")])  # within a push: row order
    p.push("t", [(3, "x")])
    p.delete("t", [3])  # across pushes: the order they were acknowledged
    p.push("t", [(4, "y")], weights=[-1])  # delete of a key never held: nothing
    assert p.step()["changes"].to_dict() == {(1, "c"): 1, (2, "b"): 1}
    p.delete("t", {"k": [1]})
    p.push("t", {"k": [1], "v": ["d"]})  # a delete then an insert of one key in a step: the insert stands
    p.push("t", [(2, "b")])  # the row already held: no change
    assert p.step()["changes"].to_dict() == {(1, "c"): -1, (1, "d"): 1}
    assert rows(p.view("t")) == Counter({(1, "d"): 1, (2, "b"): 1})
    p.close()


def test_sql_primary_key_replaces_instead_of_counting_twice() -> None:
    """The issue's case: pushing an existing customer id added a second row, and the join counted that customer's
    orders twice (PRIMARY KEY was accepted and ignored)."""
    c = sql.compile("""CREATE TABLE customers (customer_id INT PRIMARY KEY, name TEXT);
                       CREATE TABLE orders (order_id BIGINT, customer_id INT, amount BIGINT);
                       CREATE MATERIALIZED VIEW per_customer AS SELECT c.name, count(*) AS n, sum(o.amount) AS total
                           FROM orders o JOIN customers c ON o.customer_id = c.customer_id GROUP BY c.name;""")
    p = dbsp.Pipeline(c, workers=2)
    p.push("customers", {"customer_id": [1, 2], "name": ["ann", "bob"]})
    p.push("orders", {"order_id": [10, 11, 12], "customer_id": [1, 1, 2], "amount": [5, 6, 7]})
    p.step()
    p.push("customers", {"customer_id": [1], "name": ["anne"]})  # an update of customer 1
    out = p.step()["per_customer"].to_dict()
    assert out == {("ann", 2, 11): -1, ("anne", 2, 11): 1}
    assert rows(p.view("per_customer")) == Counter({("anne", 2, 11): 1, ("bob", 1, 7): 1})
    p.close()


def test_keyed_pushes_and_deletes_are_refused_with_what_is_wrong(tmp_path) -> None:
    c = dbsp.Circuit()
    s = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c.input("t", s, primary_key=["k"])
    c.output("u", c.input("u", s))
    p = dbsp.Pipeline(c, storage=str(tmp_path / "d"), checkpoint_interval=None)
    with pytest.raises(dbsp.PrimaryKeyError, match="row 1 has weight 2.*\\+1 .*-1"):
        p.push("t", [(1, 1), (2, 2)], weights=[1, 2])
    with pytest.raises(dbsp.PrimaryKeyError, match="'k' is null at row 0"):
        p.push("t", {"k": [None], "v": [1]})
    with pytest.raises(dbsp.PrimaryKeyError, match="'k' is null"):
        p.delete("t", [None])
    with pytest.raises(dbsp.PrimaryKeyError, match="has no primary key"):
        p.delete("u", [1])
    with pytest.raises(KeyError, match="unknown input"):
        p.delete("nope", [1])
    with pytest.raises(dbsp.SchemaError, match="'k'"):
        p.delete("t", {"k": ["x"]})
    with pytest.raises(TypeError, match="key columns"):
        p.delete("t", 5)
    with pytest.raises(dbsp.SchemaError):
        dbsp.Circuit().input("t", s, primary_key=["nope"])
    c2 = dbsp.Circuit()
    c2.output("e", c2.input("e", s, primary_key=["k"], event_time="v", lateness=3))
    q = dbsp.Pipeline(c2)
    with pytest.raises(dbsp.PrimaryKeyError, match="event time.*weight -1"):
        q.delete("e", [1])  # its null event time would make it a late row, dropped
    q.push("e", [(1, 10)])
    q.step()
    q.push("e", [(1, 10)], weights=[-1])  # the whole row: its event time decides whether it is late
    assert q.step()["e"].to_dict() == {(1, 10): -1}
    q.close()
    p.step()
    assert p.read_input(0) == {"t": dbsp.ZSet.empty(p.circuit.nodes[0].schema),
                               "u": dbsp.ZSet.empty(p.circuit.nodes[2].schema)}  # nothing was recorded
    p.close()


def test_concurrent_pushes_of_one_key_win_in_the_log_order_that_recovery_replays(tmp_path, monkeypatch) -> None:
    """Push A is durable in the input log before push B, but B's thread queues B for the step first (A's thread is
    held between its fsync and its queueing). The step must keep the row recovery keeps: B's, the later one in the
    log; queueing order made the live step keep A's and the replay after a reopen disagree (ReplayMismatchError)."""
    import threading

    from dbsp_core.runtime import driver

    c = dbsp.Circuit()
    c.output("t_changes", c.input("t", pa.schema([("k", pa.int64()), ("v", pa.utf8())]), primary_key=["k"]))
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(c, storage=d, checkpoint_interval=None)
    held, b_done = threading.Event(), threading.Event()
    real = driver.crashpoint

    def hold(name: str) -> None:
        if name == "push-acked" and threading.current_thread().name == "A":
            held.set()
            assert b_done.wait(30)
        real(name)

    monkeypatch.setattr(driver, "crashpoint", hold)
    a = threading.Thread(target=p.push, args=("t", [(1, "a")]), name="A")
    a.start()
    assert held.wait(30)
    p.push("t", [(1, "b")])
    b_done.set()
    a.join()
    assert p.step()["t_changes"].to_dict() == {(1, "b"): 1}
    p.close(checkpoint=False)  # the reopen replays step 0 and checks its output against the log
    monkeypatch.setattr(driver, "crashpoint", real)
    q = dbsp.Pipeline.open(d, c, checkpoint_interval=None)
    assert q.stats["replayed_steps"] == 1 and rows(q.view("t")) == Counter({(1, "b"): 1})
    q.close()
