"""Aggregate descriptors for ``group_by(...).agg(...)``: count, count_distinct, sum, min, max, avg, the variance family, string_agg, first and last, with SQL-on-bags semantics.

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
  6. The whole-group kinds (``GROUP_KINDS``: the variance family, ``string_agg``, ``first``, ``last``) are computed
     over each changed group's integrated rows (operators/aggregate.py, recompute strategy), so they do not depend
     on the split into steps or workers:
     - ``var_pop``/``var_samp``/``stddev_pop``/``stddev_samp`` of a numeric column and ``covar_pop``/``covar_samp``/
       ``corr`` of two are float64 over the rows where every argument is non-null, by the two-pass method (the
       group's mean, then the centred sums); null without such rows, and for the ``_samp`` kinds with one; ``corr``
       is NaN when a variance is 0 (DuckDB's answers).
     - ``string_agg(col, sep, order_by)`` joins the non-null strings of the group, each as often as its
       multiplicity, in ``order_by`` order (then by value); null without any.
     - ``first``/``last(col, order_by)`` is ``col`` of the first/last row in ``order_by`` order (ties broken by the
       value, nulls last), null included; ``order_by`` is required (a Z-set's rows have no order).
     ``order_by`` is a sequence of ``(column, descending, nulls_first)``.
"""

from __future__ import annotations


import pyarrow as pa
import pyarrow.types as pat

from dbsp_core.errors import SchemaError

STAT_KINDS = ("var_pop", "var_samp", "stddev_pop", "stddev_samp", "covar_pop", "covar_samp", "corr")
PAIR_KINDS = ("covar_pop", "covar_samp", "corr")  # of two columns: ``column`` and ``args[0]``
GROUP_KINDS = STAT_KINDS + ("string_agg", "first", "last")  # invariant 6
KINDS = ("count", "count_distinct", "sum", "min", "max", "avg") + GROUP_KINDS


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

    __slots__ = ("kind", "column", "args")

    def __init__(self, kind: str, column: str | None, args: tuple = ()) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown aggregate kind {kind!r}; expected one of {KINDS}")
        if column is not None and not isinstance(column, str):
            raise TypeError(f"{kind}(): the column must be a column name (str), got {column!r}")
        if column is None and kind != "count":
            raise TypeError(f"{kind}() needs a column name")
        self.kind = kind
        self.column = column
        self.args = args  # the second column of PAIR_KINDS; (separator, order_by) / (order_by,) of the others

    def columns(self) -> list[str]:
        """Every column the aggregate reads (its argument first)."""
        out = [] if self.column is None else [self.column]
        if self.kind in PAIR_KINDS:
            out.append(self.args[0])
        elif self.kind in ("string_agg", "first", "last"):
            out += [c for c, _, _ in self.args[-1]]
        return list(dict.fromkeys(out))

    def output_type(self, schema: pa.Schema, where: str) -> pa.DataType:
        """The result type over input ``schema``; SchemaError (naming ``where`` and the column) if invalid."""
        if self.column is None:
            return pa.int64()
        idx = schema.get_field_index(self.column)
        if idx < 0:
            raise SchemaError(f"{where}: {self!r} refers to unknown column {self.column!r}; "
                              f"input columns are {schema.names}")
        t = schema.field(idx).type
        for c in self.columns():
            if schema.get_field_index(c) < 0:
                raise SchemaError(f"{where}: {self!r} refers to unknown column {c!r}; input columns are {schema.names}")
        if self.kind in STAT_KINDS:
            for c in self.columns():
                ct = schema.field(c).type
                if not (pat.is_integer(ct) or pat.is_floating(ct)):
                    raise SchemaError(f"{where}: {self!r} needs numeric columns, but {c!r} is {ct}")
            return pa.float64()
        if self.kind == "string_agg":
            if not (pat.is_string(t) or pat.is_large_string(t)):
                raise SchemaError(f"{where}: {self!r} needs a string column, but {self.column!r} is {t}")
            return pa.string()
        if self.kind in ("first", "last"):
            return t
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
        return (isinstance(other, Aggregate)
                and (other.kind, other.column, other.args) == (self.kind, self.column, self.args))

    def __hash__(self) -> int:
        return hash((self.kind, self.column, self.args))

    def __repr__(self) -> str:
        if self.kind in PAIR_KINDS:
            return f"{self.kind}({self.column!r}, {self.args[0]!r})"
        if self.kind == "string_agg":
            return f"string_agg({self.column!r}, {self.args[0]!r}, order_by={list(self.args[1])!r})"
        if self.kind in ("first", "last"):
            return f"{self.kind}({self.column!r}, order_by={list(self.args[0])!r})"
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


def _order(order_by: "list | tuple", what: str) -> tuple:
    out = []
    for o in order_by:
        if isinstance(o, str):
            o = (o, False, False)
        col, desc, nulls_first = o
        if not isinstance(col, str):
            raise TypeError(f"{what}: order_by takes column names or (column, descending, nulls_first), got {o!r}")
        out.append((col, bool(desc), bool(nulls_first)))
    return tuple(out)


def stat(kind: str, column: str, other: str | None = None) -> Aggregate:
    """A statistical aggregate (invariant 6): ``var_pop``, ``var_samp``, ``stddev_pop``, ``stddev_samp`` of
    ``column``, or ``covar_pop``, ``covar_samp``, ``corr`` of ``column`` and ``other``.

    >>> stat("var_samp", "price"), stat("corr", "x", "y")
    (var_samp('price'), corr('x', 'y'))
    """
    if kind not in STAT_KINDS:
        raise ValueError(f"unknown statistical aggregate {kind!r}; expected one of {STAT_KINDS}")
    if (kind in PAIR_KINDS) != (other is not None):
        raise TypeError(f"{kind}() takes {'two columns' if kind in PAIR_KINDS else 'one column'}")
    return Aggregate(kind, column, (other,) if other is not None else ())


def string_agg(column: str, separator: str = ",", order_by: "list | tuple" = ()) -> Aggregate:
    """The group's non-null strings joined by ``separator``, in ``order_by`` order, then by value (invariant 6).

    >>> string_agg("name", "; ", order_by=[("t", True, False)])
    string_agg('name', '; ', order_by=[('t', True, False)])
    """
    if not isinstance(separator, str):
        raise TypeError(f"string_agg(): the separator must be a str, got {separator!r}")
    return Aggregate("string_agg", column, (separator, _order(order_by, "string_agg()")))


def first(column: str, order_by: "list | tuple") -> Aggregate:
    """``column`` of the group's first row in ``order_by`` order (invariant 6).

    >>> first("bidder", order_by=["price"])
    first('bidder', order_by=[('price', False, False)])
    """
    if not order_by:
        raise ValueError("first() needs order_by: a Z-set's rows have no order of their own")
    return Aggregate("first", column, (_order(order_by, "first()"),))


def last(column: str, order_by: "list | tuple") -> Aggregate:
    """``column`` of the group's last row in ``order_by`` order (invariant 6).

    >>> last("bidder", order_by=["price"]).kind
    'last'
    """
    if not order_by:
        raise ValueError("last() needs order_by: a Z-set's rows have no order of their own")
    return Aggregate("last", column, (_order(order_by, "last()"),))


__all__ = ["Aggregate", "count", "count_distinct", "sum", "min", "max", "avg", "stat", "string_agg", "first",
           "last"]
