"""Stored columns: a stateful operator that keeps only the input columns read after it, projecting its input before its trace and padding its output with nulls where the dropped columns were.

Invariants (enforced here and by the operators that use it):
  1. A pruned operator's output has its full schema (so nothing after it changes, the circuit's fingerprint
     neither); a dropped column holds nulls. The pass drops only columns that no consumer reads, transitively,
     and only before operators whose output, projected on the columns read after them, is a function of their
     input projected the same way (inner join, ``within_last``): so every view is the same Z-set, weights
     included (projection of a Z-set sums the weights of rows it makes equal; a trace is consolidated when a
     change is indexed, ``ZSet.index_by``).
  2. Keys, and every column the operator itself reads (a join's keys, a window's time column), are kept.
  3. What a pruned trace holds is a different state schema: the durable pipeline records the kept columns in
     META (``stored_columns``) when it creates a directory, and opens a directory with exactly the recorded
     ones (none for a directory written before they were recorded: its traces hold every column).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pyarrow as pa

if TYPE_CHECKING:
    from dbsp_core.zset import ZSet


def project(z: "ZSet", names: Sequence[str]) -> "ZSet":
    """``z`` with only columns ``names`` (no row copied); not consolidated (rows may now be equal: the caller indexes
    it, which consolidates)."""
    from dbsp_core.zset import ZSet

    return ZSet._make(z.data.select(list(names)), z.weights)


def sub_schema(schema: pa.Schema, names: Sequence[str]) -> pa.Schema:
    """The fields ``names`` of ``schema``, in ``schema``'s order."""
    keep = set(names)
    return pa.schema([f for f in schema if f.name in keep])


def pad(z: "ZSet", schema: pa.Schema) -> "ZSet":
    """``z`` (a subset of ``schema``'s columns, by name) with every other column of ``schema`` as nulls, in
    ``schema``'s order; weights, order and the distinct/consolidated flags kept (null columns distinguish nothing)."""
    from dbsp_core.zset import ZSet

    n = z.num_rows
    data = z.data
    have = set(data.schema.names)
    cols = [data.column(f.name) if f.name in have else pa.nulls(n, f.type) for f in schema]
    return ZSet._make(pa.Table.from_arrays(cols, schema=schema), z.weights, distinct=z._distinct)


class JoinStored:
    """What an inner join keeps of each side (``left``, ``right``: column names, keys included) and how its output
    rows map to the full output schema (positions of the join's output, left side first)."""

    def __init__(self, op: object, left: Sequence[str], right: Sequence[str]) -> None:
        lschema, rschema, schema = op.lschema, op.rschema, op.schema  # type: ignore[attr-defined]
        self.left, self.right = tuple(left), tuple(right)
        self.lschema, self.rschema = sub_schema(lschema, left), sub_schema(rschema, right)
        self.lmap = {i: self.lschema.get_field_index(f.name) for i, f in enumerate(lschema) if f.name in self.left}
        self.rmap = {i: self.rschema.get_field_index(f.name) for i, f in enumerate(rschema) if f.name in self.right}
        nl = len(lschema)
        out_pos = [i for i in range(nl) if i in self.lmap]
        rcols = []
        for j, p in enumerate(op.right_kept_pos):  # type: ignore[attr-defined]
            if p in self.rmap:
                out_pos.append(nl + j)
                rcols.append(self.rmap[p])
        self.rcols = rcols  # positions in the kept right rows of the right columns the output holds
        self.schema = pa.schema([schema.field(i) for i in out_pos])  # the kept output columns

    def describe(self) -> str:
        return f"left [{', '.join(self.left)}], right [{', '.join(self.right)}]"


class RowsStored:
    """What a one-input operator keeps of its input rows (``names``, in schema order)."""

    def __init__(self, schema: pa.Schema, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.schema = sub_schema(schema, names)

    def describe(self) -> str:
        return f"[{', '.join(self.names)}]"
