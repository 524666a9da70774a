"""The Nexmark queries written in SQL (queries.sql) compiled by dbsp_core.sql: ``sql_circuit("q4")`` has the same inputs and output as ``circuit("q4")``."""

from __future__ import annotations

import os
import re

from dbsp_core.circuit import Circuit

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "queries.sql")


def sql_text() -> str:
    """The whole SQL program: the four tables and one view per query."""
    with open(PATH, encoding="utf-8") as f:
        return f.read()


def _statements(text: str) -> list[str]:
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in body.split(";") if s.strip()]


def view_sql(query: str) -> str:
    """The CREATE VIEW statement of ``query``."""
    for st in _statements(sql_text()):
        if re.match(rf"CREATE\s+VIEW\s+{re.escape(query)}\s+AS", st, re.I):
            return st + ";"
    raise KeyError(f"no SQL view {query!r} in {PATH}")


def sql_queries() -> list[str]:
    """The queries written in SQL, in order."""
    return [m.group(1) for st in _statements(sql_text()) if (m := re.match(r"CREATE\s+VIEW\s+(\w+)", st, re.I))]


def sql_circuit(query: str) -> Circuit:
    """The circuit of Nexmark ``query`` compiled from its SQL view (inputs person, auction, bid, side_input).

    >>> c = sql_circuit("q4")
    >>> sorted(c.inputs), list(c.outputs), c.nodes[c.outputs["q4"]].schema.names
    (['auction', 'bid', 'person', 'side_input'], ['q4'], ['category', 'avg'])
    """
    from dbsp_core import sql

    tables = [st + ";" for st in _statements(sql_text()) if re.match(r"CREATE\s+TABLE", st, re.I)]
    return sql.compile("\n".join(tables + [view_sql(query)]))
