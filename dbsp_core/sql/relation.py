"""Relations of the SQL planner: a stream plus the SQL names of its columns (qualified by table alias), with the name resolution rules of SQL.

Invariants:
  1. A Rel's columns each name one field of its stream; several columns may name one field (a USING column is
     visible as ``a.k``, ``b.k`` and ``k``). Fields the SQL cannot name (helpers) have no column.
  2. An unqualified name resolves to the one column of that name, a USING (merged) column first; a qualified
     one to the column of that table alias. No match or several are errors naming the candidates.
  3. Fresh field names (``__s<n>``) never clash with a table's columns (a name starting with two underscores is
     refused in CREATE TABLE) nor with each other within a compile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pyarrow as pa

from dbsp_core.circuit import Stream


@dataclass(frozen=True)
class Col:
    """One SQL-visible column: its name, its table alias (None for a computed column), its stream field."""

    name: str
    table: str | None
    field: str
    star: bool = True  # listed by SELECT *
    merged: bool = False  # a USING column (invariant 2)


class Rel:
    """A stream and the SQL columns over its fields (invariant 1)."""

    def __init__(self, stream: Stream, cols: list[Col]) -> None:
        self.stream = stream
        self.cols = list(cols)

    @property
    def schema(self) -> pa.Schema:
        return self.stream.schema

    def type_of(self, field: str) -> pa.DataType:
        return self.stream.schema.field(field).type

    def find(self, table: str | None, name: str) -> list[Col]:
        """The columns an identifier may mean (invariant 2), best first."""
        if table is not None:
            hits = [c for c in self.cols if c.table == table and c.name == name]
            return hits[:1] if len({c.field for c in hits}) == 1 else hits
        hits = [c for c in self.cols if c.name == name]
        merged = [c for c in hits if c.merged]
        if merged:
            return merged[:1]
        fields = {c.field for c in hits}
        return hits[:1] if len(fields) == 1 else hits

    def star_cols(self, table: str | None = None) -> list[Col]:
        """The columns of ``*`` (or ``table.*``), in order."""
        if table is None:
            return [c for c in self.cols if c.star]
        return [c for c in self.cols if c.table == table and (c.star or not c.merged)]

    def qualified(self, table: str | None) -> "Rel":
        """The same columns under one table alias (a subquery's, a view's or a CTE's name)."""
        return Rel(self.stream, [replace(c, table=table, merged=False) for c in self.cols if c.star])

    def tables(self) -> set[str]:
        return {c.table for c in self.cols if c.table is not None}

    def __repr__(self) -> str:
        return f"Rel({[(c.table, c.name, c.field) for c in self.cols]})"


class SchemaRel(Rel):
    """A relation known only by its schema (for typing constant expressions; it has no stream)."""

    def __init__(self, schema: pa.Schema) -> None:
        self._schema = schema
        self.cols = []

    @property
    def schema(self) -> pa.Schema:
        return self._schema


class Names:
    """Fresh field names for one compile (invariant 3)."""

    def __init__(self) -> None:
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"__s{self.n}"
