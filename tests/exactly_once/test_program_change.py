"""Program changes on a durable directory (dbsp_core/runtime/change.py): a view kept, one changed, one dropped and one added between two opens, after random steps of upserts and deletes, at 1, 2 and 4 workers; every view equals DuckDB over the tables after every step, a rebuilt view's first output is its full contents, and the refusals name what differs and what to do.

The seed varies per run, is printed, and ``DBSP_CHANGE_SEED`` replays it.
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.errors import CircuitMismatchError
from dbsp_core.runtime import StagedExecutor
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import read_meta
from dbsp_core.storage.formats import is_state_table, state_db_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from change_workload import (DROPPED, KEPT, NEW, OLD, REBUILT, apply, as_bag, integrate, oracle,  # noqa: E402
                             program, push, step_data)

SEED = int(os.environ.get("DBSP_CHANGE_SEED", str(random.SystemRandom().randrange(2**31))))


def _check(p, views: dict, model: dict, acc: dict, when: str) -> None:
    for name, (query, materialized) in views.items():
        want = oracle(model, query)
        assert as_bag(acc[name]) == want, f"{when}: view {name} differs from DuckDB"
        if materialized:
            got = p.view(name)
            assert sorted(zip(*[got.column(c).to_pylist() for c in got.column_names])) == sorted(want.elements()), \
                f"{when}: p.view({name!r}) differs from DuckDB"


def _stored_tables(d: str, workers: int) -> set[str]:
    out = set()
    for w in range(workers):
        with Database(state_db_path(d, None, w), readonly=True) as db, db.read(db.versions().stop - 1) as h:
            out |= {t for t in h.tables() if is_state_table(t) and next(iter(h.scan(t)), None)}
            out |= {k[len(b"order."):].decode() for k, _ in h.scan("snapshot", prefix=b"order.")}
    return out


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_add_change_and_drop_views_equal_duckdb(tmp_path, workers) -> None:
    seed = SEED + workers
    print(f"\n[program change] workers {workers} seed {seed} (replay: DBSP_CHANGE_SEED={SEED})")
    rng = random.Random(seed)
    d = str(tmp_path / "d")
    model: dict = {}
    acc: dict = {n: {} for n in OLD}
    first = rng.randint(3, 6)
    ckpt = 0
    p = dbsp.Pipeline(sql.compile(program(OLD)), workers=workers, storage=d, checkpoint_interval=None)
    for s in range(first):
        data = step_data(seed, s)
        push(p, data)
        out = p.step()
        apply(model, data)
        for n in OLD:
            integrate(acc[n], out[n])
        if rng.random() < 0.3:
            ckpt = p.checkpoint()
        _check(p, OLD, model, acc, f"step {s}")
    replay = rng.random() < 0.5  # without a checkpoint at the close, the new circuit replays steps first
    p.close(checkpoint=not replay)

    p = dbsp.Pipeline.open(d, sql.compile(program(NEW)))
    change = p.stats["program_change"]
    assert change["step"] == first and change["rebuilt"] == REBUILT and change["kept_nodes"] > 0, change
    assert p.stats["replayed_steps"] == (first - ckpt if replay else 0)
    meta = read_meta(d)
    assert meta["change"]["removed"] == DROPPED and meta["since"] == {n: first for n in REBUILT}
    for n in REBUILT:  # rebuilt views start over; the kept one goes on
        acc[n] = {}
    for n in DROPPED:
        del acc[n]
    for s in range(first, first + rng.randint(3, 6)):
        data = step_data(seed, s)
        push(p, data)
        out = p.step()
        apply(model, data)
        if s == first:  # exactly once across the change: the first output of a rebuilt view is its contents
            for n in REBUILT:
                assert as_bag(dict(out[n].to_dict())) == oracle(model, NEW[n][0]), n
        for n in NEW:
            integrate(acc[n], out[n])
        _check(p, NEW, model, acc, f"step {s} (after the change at {first})")
        if rng.random() < 0.3:
            p.checkpoint()
    last = p.steps
    p.close()
    assert _stored_tables(d, workers) == set(p.executor.groups(p.layout)[0].tables)  # the dropped state is gone

    with dbsp.Pipeline.open(d, sql.compile(program(NEW))) as p:  # the change completed: nothing is redone
        assert "program_change" not in p.stats and p.steps == last
        for n in NEW:
            steps = [s for s, _ in p.read_output(n)]
            assert steps == list(range(first if n in REBUILT else 0, last)), (n, steps)
            whole: dict = {}
            for _, z in p.read_output(n, 0):
                integrate(whole, z)
            assert as_bag(whole) == oracle(model, NEW[n][0]), n
        with pytest.raises(KeyError):
            list(p.read_output(DROPPED[0]))
    assert KEPT == ["by_cust"]


def _python_circuit(extra: str | None) -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]), materialized=True)
    u = c.input("u", pa.schema([("k", pa.int64())]))
    c.output("n", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    c.output("uu", u.distinct())
    if extra == "distinct":
        c.output("d", t.select(v=pa.compute.field("v")).distinct(), materialized=True)
    elif extra == "join_u":
        c.output("j", t.join(u, on="k"))
    return c


def test_a_python_circuit_builds_a_new_view_from_a_materialized_table(tmp_path) -> None:
    """Without a key: the table's integral (materialized=True) is the contents the new view starts from, bag
    semantics and deletions (weight -1) included; a view over a table that is not materialized is refused, naming
    the table."""
    rng = random.Random(SEED)
    print(f"\n[program change, python] seed {SEED} (replay: DBSP_CHANGE_SEED={SEED})")
    d = str(tmp_path / "d")
    bag: dict = {}
    with dbsp.Pipeline(_python_circuit(None), workers=2, storage=d) as p:
        for _ in range(4):
            rows = [(rng.randrange(5), rng.randrange(4)) for _ in range(8)]
            gone = [r for r in bag if rng.random() < 0.3]
            z = dbsp.ZSet.from_rows(rows + gone, p.circuit.nodes[p.circuit.inputs["t"]].schema,
                                    [1] * len(rows) + [-1] * len(gone))
            p.push("t", z)
            p.push("u", {"k": [rng.randrange(5)]})
            p.step()
            integrate(bag, z)
    with pytest.raises(CircuitMismatchError, match=r"views added: j; view\(s\) j must be built from the current "
                                                    r"contents of table\(s\) u, .*declare them materialized"):
        dbsp.Pipeline.open(d, _python_circuit("join_u"))
    with dbsp.Pipeline.open(d, _python_circuit("distinct")) as p:
        want = sorted({(v,) for (_, v), w in bag.items() if w > 0})
        assert sorted(p.step()["d"].to_dict()) == want  # its first output: the distinct v of the whole table
        assert sorted(p.view("d").column("v").to_pylist()) == [v for (v,) in want]


def test_a_change_not_yet_completed_is_redone_and_another_refused(tmp_path) -> None:
    d = str(tmp_path / "d")
    model: dict = {}
    with dbsp.Pipeline(sql.compile(program(OLD)), workers=2, storage=d) as p:
        for s in range(3):
            push(p, step_data(SEED, s))
            p.step()
            apply(model, step_data(SEED, s))
    dbsp.Pipeline.open(d, sql.compile(program(NEW))).close()  # no step ran: the checkpoint waits (invariant 6)
    assert read_meta(d)["change"]["step"] == 3
    third = dict(NEW, extra=("SELECT id FROM cust", False))
    with pytest.raises(CircuitMismatchError, match="the program change made at step 3 has not completed"):
        dbsp.Pipeline.open(d, sql.compile(program(third)))
    with dbsp.Pipeline.open(d, sql.compile(program(NEW))) as p:
        assert p.stats["program_change"]["step"] == 3
        push(p, step_data(SEED, 3))
        apply(model, step_data(SEED, 3))
        out = p.step()
        for n in REBUILT:
            assert as_bag(dict(out[n].to_dict())) == oracle(model, NEW[n][0]), n
        for n in NEW:  # the kept view goes on from the state stored before the change
            acc: dict = {}
            for _, z in p.read_output(n):
                integrate(acc, z)
            assert as_bag(acc) == oracle(model, NEW[n][0]), n
    with dbsp.Pipeline.open(d, sql.compile(program(third))) as p:  # completed: the next change is taken
        assert p.stats["program_change"]["rebuilt"] == ["extra"]


def test_the_staged_executor_refuses_a_program_change(tmp_path) -> None:
    d = str(tmp_path / "d")
    with dbsp.Pipeline(sql.compile(program(OLD)), workers=1, storage=d, executor=StagedExecutor()) as p:
        push(p, step_data(SEED, 0))
        p.step()
    with pytest.raises(CircuitMismatchError, match="views added: by_region; views removed: regions; views changed: "
                                                   "big; a program change keeps state on the embedded executor"):
        dbsp.Pipeline.open(d, sql.compile(program(NEW)), executor=StagedExecutor())
    dbsp.Pipeline.open(d, sql.compile(program(OLD)), executor=StagedExecutor()).close()


def test_a_sink_of_a_rebuilt_view_starts_with_its_contents_or_is_refused(tmp_path) -> None:
    """A sink of a new view starts at the change with the view's full contents; one holding steps of a changed
    view's earlier definition is refused instead of adding the new contents to the old ones."""
    from dbsp_core.connectors import SqliteSink, read_sqlite_view

    d = str(tmp_path / "d")
    model: dict = {}
    with dbsp.Pipeline(sql.compile(program(OLD)), workers=1, storage=d) as p:
        old_big = SqliteSink(p, "big", str(tmp_path / "big.db"))
        for s in range(2):
            push(p, step_data(SEED, s))
            apply(model, step_data(SEED, s))
            p.step()
        assert old_big.poll() == 2
        old_big.close()
    with dbsp.Pipeline.open(d, sql.compile(program(NEW))) as p:
        assert p.output_since == {"big": 2, "by_region": 2}
        p.step()
        fresh = SqliteSink(p, "by_region", str(tmp_path / "region.db"))
        assert fresh.poll() == 1  # step 2 only: the view's full contents
        step, rows = read_sqlite_view(str(tmp_path / "region.db"), "by_region")
        got = Counter((r["region"], r["s"], r["n"]) for r in rows.to_pylist() for _ in range(r["weight"]))
        assert step == 2 and got == oracle(model, NEW["by_region"][0])
        fresh.close()
        stale = SqliteSink(p, "big", str(tmp_path / "big.db"))
        with pytest.raises(dbsp.DbspError, match="'big' was rebuilt by a program change at step 2"):
            stale.poll()
        stale.close()
    stale = SqliteSink(d, "big", str(tmp_path / "big.db"))  # from the directory, in another process's way
    with pytest.raises(dbsp.DbspError, match="'big' was rebuilt by a program change at step 2"):
        stale.poll()
    stale.close()


SQL_TABLES = ("CREATE MATERIALIZED TABLE t (k BIGINT, v BIGINT);\n"
              "CREATE TABLE u (k BIGINT, v BIGINT) WITH ('materialized' = 'true');\n"
              "CREATE TABLE x (k BIGINT);\n")
SQL_OLD = SQL_TABLES + "CREATE VIEW n AS SELECT k, count(*) AS c FROM t GROUP BY k;\n"
SQL_NEW = SQL_OLD + ("CREATE MATERIALIZED VIEW j AS SELECT t.k, t.v, u.v AS w FROM t JOIN u ON t.k = u.k "
                     "WHERE t.v <> u.v;\n")


@pytest.mark.parametrize("workers", [1, 2])
def test_sql_tables_declared_materialized_let_a_new_view_be_built(tmp_path, workers) -> None:
    """In SQL, ``CREATE MATERIALIZED TABLE`` and ``WITH ('materialized' = 'true')`` keep a table without a key
    (bags, deletions included), so a view added later is built from the tables' contents: its first output and
    ``p.view`` equal DuckDB over them; a view over the table declared neither way is refused, naming it."""
    import duckdb

    rng = random.Random(SEED + 10 + workers)
    print(f"\n[program change, sql tables] seed {SEED} (replay: DBSP_CHANGE_SEED={SEED})")
    d = str(tmp_path / "d")
    bags: dict = {"t": {}, "u": {}}
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    with dbsp.Pipeline(sql.compile(SQL_OLD), workers=workers, storage=d) as p:
        for _ in range(5):
            for name, bag in bags.items():
                rows = [(rng.randrange(6), rng.randrange(3)) for _ in range(10)]
                gone = [r for r, w in bag.items() if w > 0 and rng.random() < 0.3]
                z = dbsp.ZSet.from_rows(rows + gone, schema, [1] * len(rows) + [-1] * len(gone))
                p.push(name, z)
                integrate(bag, z)
            p.push("x", {"k": [1]})
            p.step()
        assert sorted(p.view("u").to_pylist(), key=str) == sorted(
            ({"k": k, "v": v} for (k, v), w in bags["u"].items() for _ in range(w)), key=str)
    with pytest.raises(CircuitMismatchError, match=r"table\(s\) x, .*CREATE MATERIALIZED TABLE"):
        dbsp.Pipeline.open(d, sql.compile(SQL_OLD + "CREATE VIEW y AS SELECT DISTINCT k FROM x;\n"))
    con = duckdb.connect()
    for name, bag in bags.items():
        rows = [r for r, w in bag.items() for _ in range(w)]
        con.execute(f"CREATE TABLE {name} (k BIGINT, v BIGINT)")
        if rows:
            con.executemany(f"INSERT INTO {name} VALUES (?, ?)", rows)
    want = Counter(con.execute("SELECT t.k, t.v, u.v AS w FROM t JOIN u ON t.k = u.k WHERE t.v <> u.v").fetchall())
    assert want, "the new view is empty over these tables: the test would show nothing"
    with dbsp.Pipeline.open(d, sql.compile(SQL_NEW)) as p:
        first = p.step()["j"].to_dict()
        assert Counter({r: w for r, w in first.items() if w}) == want  # its first output: the whole view
        got = p.view("j")
        assert Counter(zip(*[got.column(c).to_pylist() for c in got.column_names])) == want
