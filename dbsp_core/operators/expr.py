"""Vectorized evaluation of pyarrow.compute expressions over a Z-set's rows (Acero filter and project plans), shared by filter and select.

Invariants:
  1. The weight travels as a hidden column through the plan, so a row keeps its weight whatever order
     the plan emits rows in.
  2. Validation runs the same plan on an empty table of the input schema, so an expression that
     builds also runs; an unknown field is reported as a SchemaError naming the operator and the column.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.acero as ac
import pyarrow.compute as pc

from dbsp_core.errors import SchemaError

WEIGHT_COL = "__dbsp_weight__"
_FIELD_RE = re.compile(r"FieldRef\.Name\(([^)]*)\)")


def _run(table: pa.Table, node: ac.Declaration) -> pa.Table:
    source = ac.Declaration("table_source", ac.TableSourceNodeOptions(table))
    return ac.Declaration.from_sequence([source, node]).to_table(use_threads=False)


def schema_error(where: str, schema: pa.Schema, exc: Exception) -> SchemaError:
    """Turn an Arrow error from binding an expression into a SchemaError naming the column."""
    m = _FIELD_RE.search(str(exc))
    if m:
        return SchemaError(f"{where}: unknown column {m.group(1)!r}; input columns are {schema.names}")
    return SchemaError(f"{where}: invalid expression: {exc}")


def as_expression(value: object, where: str) -> pc.Expression:
    """A pc.Expression from an expression, a column name (str) or a literal."""
    if isinstance(value, pc.Expression):
        return value
    if isinstance(value, str):
        return pc.field(value)
    try:
        return pc.scalar(value)
    except (TypeError, pa.ArrowInvalid) as exc:
        raise TypeError(f"{where}: expected a pyarrow.compute expression, got {value!r}") from exc


def project_schema(schema: pa.Schema, exprs: list[pc.Expression], names: list[str], where: str) -> pa.Schema:
    """Output schema of projecting ``exprs`` over ``schema`` (SchemaError if an expression does not bind)."""
    try:
        out = _run(schema.empty_table(), ac.Declaration("project", ac.ProjectNodeOptions(exprs, names)))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError) as exc:
        raise schema_error(where, schema, exc) from None
    return pa.schema([pa.field(f.name, f.type) for f in out.schema])


def check_predicate(schema: pa.Schema, expr: pc.Expression, where: str) -> None:
    """SchemaError unless ``expr`` binds over ``schema`` to a boolean."""
    out = project_schema(schema, [expr], ["p"], where)
    t = out.field(0).type
    if not (pa.types.is_boolean(t) or pa.types.is_null(t)):
        raise SchemaError(f"{where}: the predicate must be boolean, got {t}")


def hidden_column(schema: pa.Schema, also: Sequence[str] = ()) -> str:
    """The name of the hidden weight column over ``schema``: ``WEIGHT_COL``, lengthened until no data column (nor
    a name in ``also``) has it, so any column name works."""
    names = set(schema.names) | set(also)
    name = WEIGHT_COL
    while name in names:
        name += "_"
    return name


def with_weights(data: pa.Table, weights: np.ndarray, hidden: str | None = None) -> pa.Table:
    """``data`` plus the hidden weight column (the last one)."""
    return data.append_column(hidden or hidden_column(data.schema), pa.array(weights, type=pa.int64()))


def split_weights(table: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """Inverse of :func:`with_weights`."""
    last = table.num_columns - 1
    w = np.array(table.column(last).to_numpy(), dtype=np.int64)  # a writable copy
    return table.remove_column(last), w


def filter_rows(data: pa.Table, weights: np.ndarray, expr: pc.Expression) -> tuple[pa.Table, np.ndarray]:
    """Rows where ``expr`` is true (null counts as false), with their weights."""
    out = _run(with_weights(data, weights), ac.Declaration("filter", ac.FilterNodeOptions(expr)))
    return split_weights(out)


def project_rows(data: pa.Table, weights: np.ndarray, exprs: list[pc.Expression], names: list[str]
                 ) -> tuple[pa.Table, np.ndarray]:
    """Evaluate ``exprs`` (named ``names``) on every row, with the rows' weights."""
    hidden = hidden_column(data.schema, names)
    exprs = list(exprs) + [pc.field(hidden)]
    names = list(names) + [hidden]
    out = _run(with_weights(data, weights, hidden), ac.Declaration("project", ac.ProjectNodeOptions(exprs, names)))
    return split_weights(out)
