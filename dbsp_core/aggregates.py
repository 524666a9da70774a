"""Aggregate descriptors for ``group_by(...).agg(...)``: count, count_distinct, sum, min, max and avg with SQL-on-bags semantics.

Invariants (enforced here and in operators/aggregate.py):
  1. ``count()`` counts rows with multiplicity; ``count(col)`` counts rows whose ``col`` is not null.
  2. ``sum``, ``min``, ``max`` and ``avg`` ignore nulls and give null for a group with no non-null value.
  3. ``sum`` and ``avg`` accept only integer and floating-point columns; ``sum`` of integers is int64, of uint64
     uint64 (a group's sum outside that type fails the step with an error naming the column, never wraps), of
     floats float64; ``avg`` is float64: the exact sum divided by the count in long double, then rounded (as
     DuckDB does). Every integer value of every type is accepted (no cast loses or refuses one).
  4. ``min`` and ``max`` return the column's own type.
  5. ``count_distinct(col)`` counts the distinct non-null values of ``col`` in the group (int64, 0 when all
     are null); it combines with count and integer sum/avg only (operators/count_distinct.py).
"""

from __future__ import annotations


import pyarrow as pa
import pyarrow.types as pat

from dbsp_core.errors import SchemaError

KINDS = ("count", "count_distinct", "sum", "min", "max", "avg")


class Aggregate:
    """One aggregate of a group: ``kind`` over ``column`` (None for ``count()``).

    Build them with :func:`count`, :func:`sum`, :func:`min`, :func:`max`, :func:`avg`.

    Examples
    --------
    >>> sum("price")
    sum('price')
    >>> count()
    count()
    """

    __slots__ = ("kind", "column")

    def __init__(self, kind: str, column: str | None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown aggregate kind {kind!r}; expected one of {KINDS}")
        if column is not None and not isinstance(column, str):
            raise TypeError(f"{kind}(): the column must be a column name (str), got {column!r}")
        if column is None and kind != "count":
            raise TypeError(f"{kind}() needs a column name")
        self.kind = kind
        self.column = column

    def output_type(self, schema: pa.Schema, where: str) -> pa.DataType:
        """The result type over input ``schema``; SchemaError (naming ``where`` and the column) if invalid."""
        if self.column is None:
            return pa.int64()
        idx = schema.get_field_index(self.column)
        if idx < 0:
            raise SchemaError(f"{where}: {self!r} refers to unknown column {self.column!r}; "
                              f"input columns are {schema.names}")
        t = schema.field(idx).type
        if self.kind in ("count", "count_distinct"):
            return pa.int64()
        if self.kind in ("sum", "avg"):
            if pat.is_integer(t):
                if self.kind == "avg":
                    return pa.float64()
                return pa.uint64() if pat.is_uint64(t) else pa.int64()
            if pat.is_floating(t):
                return pa.float64()
            raise SchemaError(f"{where}: {self!r} needs a numeric column, but {self.column!r} is {t}")
        if not (pat.is_integer(t) or pat.is_floating(t) or pat.is_string(t) or pat.is_large_string(t)
                or pat.is_boolean(t) or pat.is_date32(t) or pat.is_timestamp(t)
                or pat.is_binary(t) or pat.is_large_binary(t)):
            raise SchemaError(f"{where}: {self!r} cannot order column {self.column!r} of type {t}")
        return t

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Aggregate) and (other.kind, other.column) == (self.kind, self.column)

    def __hash__(self) -> int:
        return hash((self.kind, self.column))

    def __repr__(self) -> str:
        return f"{self.kind}({'' if self.column is None else repr(self.column)})"


def count(column: str | None = None) -> Aggregate:
    """Rows of the group with multiplicity; with ``column``, only rows where it is not null.

    >>> count(), count("price")
    (count(), count('price'))
    """
    return Aggregate("count", column)


def count_distinct(column: str) -> Aggregate:
    """The number of distinct non-null values of ``column`` in the group (SQL ``COUNT(DISTINCT column)``).

    >>> count_distinct("bidder")
    count_distinct('bidder')
    """
    return Aggregate("count_distinct", column)


def sum(column: str) -> Aggregate:  # noqa: A001 - mirrors SQL
    """Sum of the non-null values of ``column`` (weighted by multiplicity); null if there are none.

    >>> sum("price").kind
    'sum'
    """
    return Aggregate("sum", column)


def min(column: str) -> Aggregate:  # noqa: A001
    """Smallest non-null value of ``column``; stays correct when the current minimum is deleted.

    >>> min("price").column
    'price'
    """
    return Aggregate("min", column)


def max(column: str) -> Aggregate:  # noqa: A001
    """Largest non-null value of ``column``; stays correct when the current maximum is deleted.

    >>> max("price").column
    'price'
    """
    return Aggregate("max", column)


def avg(column: str) -> Aggregate:
    """Mean of the non-null values of ``column`` (float64), i.e. ``sum / count(column)``.

    >>> avg("price")
    avg('price')
    """
    return Aggregate("avg", column)


__all__ = ["Aggregate", "count", "count_distinct", "sum", "min", "max", "avg"]
