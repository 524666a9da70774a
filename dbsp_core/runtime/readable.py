"""Reading the current contents of a pipeline's materialized views and readable tables (``Pipeline.view``) and running read-only SQL over them (``Pipeline.query``, DuckDB over Arrow).

Invariants (enforced here and by the driver, driver.py invariant 9):
  1. The contents come from the executor's state (``Executor.view``: the trace of the circuit's readable node,
     summed over the workers), never from a copy kept beside it, read while no step runs: the contents as of
     the last completed step, the same for every table and view one query reads.
  2. A view's rows are a bag: each row repeated by its weight (``weights=True``: each row once, with its weight
     in a ``weight`` column, the form of :meth:`ZSet.to_arrow`). A row of negative weight (a view that is a
     difference, not a bag) cannot be a bag's row: reading it as rows refuses, naming the view.
  3. A query is one read-only statement (SELECT, or a WITH ... SELECT); anything else is refused before it runs.
     It runs on a cursor of an empty in-memory DuckDB database, which sees only the readable tables and views the
     query names (registered as Arrow tables: DuckDB scans their buffers, no copy when every weight is 1) and has no
     access to files; its result is an Arrow table.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.circuit import Circuit
from dbsp_core.errors import DbspError, QueryError
from dbsp_core.zset import ZSet

__all__ = ["ReadableState", "as_rows", "check_read_only", "run_query"]


def as_rows(z: ZSet, name: str, weights: bool) -> pa.Table:
    """The contents ``z`` of readable ``name`` as an Arrow table (invariant 2).

    >>> z = ZSet.from_arrow(pa.table({"x": [1, 2]}), weights=[2, 1])
    >>> as_rows(z, "v", False).column("x").to_pylist(), as_rows(z, "v", True).column("weight").to_pylist()
    ([1, 1, 2], [2, 1])
    """
    if weights:
        return z.to_arrow()
    w = z.weights
    if len(w) == 0 or bool((w == 1).all()):
        return z.data
    if bool((w < 0).any()):
        n = int((w < 0).sum())
        raise DbspError(f"{name!r} holds {n} rows of negative weight, which a bag of rows cannot show (it is a "
                        f"difference of streams, not a table); read it with view({name!r}, weights=True)")
    return z.data.take(pa.array(np.repeat(np.arange(len(w), dtype=np.int64), w)))


class ReadableState:
    """The readable tables and views of one circuit (``Circuit.readable``): which node holds each one's contents, and
    what to say of a name that is not readable (the driver reads the nodes under the step lock, invariant 1)."""

    def __init__(self, circuit: Circuit) -> None:
        self.nodes = dict(circuit.readable)
        self.outputs = set(circuit.outputs)
        self.inputs = set(circuit.inputs)

    def node(self, name: Any, what: str) -> int:
        """The readable node of ``name``; KeyError saying how to make it readable if it is not."""
        if not isinstance(name, str):
            raise TypeError(f"{what}: a table or view name must be a str, got {name!r}")
        if name in self.nodes:
            return self.nodes[name]
        known = ", ".join(sorted(self.nodes)) or "none"
        if name in self.outputs:
            how = (f"view {name!r} is not materialized: declare it with CREATE MATERIALIZED VIEW, or "
                   f"Circuit.output({name!r}, stream, materialized=True)")
        elif name in self.inputs:
            how = (f"table {name!r} keeps no contents: give it a PRIMARY KEY, or declare it with CREATE "
                   f"MATERIALIZED TABLE, or Circuit.input({name!r}, schema, materialized=True)")
        else:
            how = f"there is no table or view {name!r}"
        raise KeyError(f"{what}: {how} (the readable ones are: {known})")

    def names_in(self, sql: str) -> list[str]:
        """The readable names ``sql`` mentions as words (a superset of those it reads: registering one more is
        harmless, reading one that is not registered is DuckDB's catalog error)."""
        return [n for n in self.nodes if re.search(r"(?<![\w$])" + re.escape(n) + r"(?![\w$])", sql, re.IGNORECASE)]


def check_read_only(sql: Any) -> str:
    """``sql`` if it is one read-only statement (invariant 3), else QueryError (TypeError if not a str).

    >>> check_read_only("SELECT 1")
    'SELECT 1'
    >>> check_read_only("DELETE FROM v")
    Traceback (most recent call last):
    ...
    dbsp_core.errors.QueryError: query: only a read-only SELECT is run; this is a DELETE statement (views and tables change only through push and step)
    """
    import duckdb

    if not isinstance(sql, str):
        raise TypeError(f"query: expected SQL text (str), got {type(sql).__name__}")
    try:
        stmts = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(f"query: the SQL does not parse: {exc}") from None
    if len(stmts) != 1:
        raise QueryError(f"query: expected one statement, got {len(stmts)}")
    kind = stmts[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryError(f"query: only a read-only SELECT is run; this is a {kind.name} statement (views and tables "
                         f"change only through push and step)")
    return sql


_BASE: tuple[int, Any] | None = None  # (pid, the empty DuckDB database every query opens a cursor on)
_BASE_LOCK = threading.Lock()


def _database() -> Any:
    """The process's empty in-memory DuckDB database without file access (a connection costs 15-50 ms, a cursor on
    it 0.1 ms); made again in a forked child."""
    global _BASE
    import duckdb

    with _BASE_LOCK:
        if _BASE is None or _BASE[0] != os.getpid():
            _BASE = (os.getpid(), duckdb.connect(":memory:", config={"enable_external_access": False}))
        return _BASE[1]


def run_query(sql: str, tables: dict[str, pa.Table], readable: list[str]) -> pa.Table:
    """Run the read-only ``sql`` over ``tables`` (name -> Arrow table) on a private DuckDB database (invariant 3);
    ``readable`` (every name a query could read) is named in the error of a query that fails."""
    import duckdb

    con = _database().cursor()  # registrations are the cursor's own: no query sees another's tables
    try:
        for name, table in tables.items():
            con.register(name, table)
        try:
            rel = con.sql(sql)
            if rel is None:  # pragma: no cover - check_read_only let only a SELECT through
                raise QueryError("query: the statement returned no result")
            return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
        except duckdb.Error as exc:
            known = ", ".join(sorted(readable)) or "none"
            text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise QueryError(f"query: {type(exc).__name__}: {text} (the tables and views it can read: {known}; a "
                             f"view is readable once materialized, a table once it has a primary key or is "
                             f"materialized)") from None
    finally:
        con.close()

