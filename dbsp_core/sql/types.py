"""SQL types as Arrow types: the column types of CREATE TABLE and CAST, literal types, and the common type of two columns (UNION, CASE, join keys).

Invariants:
  1. Only the column types the engine stores are accepted (bool, integers, floats, DECIMAL(p, s) up to 18 digits
     (decimal.py), date, timestamp, strings, binary); nested types and wider decimals raise SqlError naming the
     type (the caller adds the position).
  2. Integer literals are int32 when they fit, else int64, and decimal literals float64 (DuckDB types the former
     the same; it keeps decimals exact, so compare floating results with a tolerance).
  3. ``common_type`` widens integers to the wider integer, integer and float to float64, decimals and integers
     to the decimal holding both (decimal.py), and gives the other type when one side is null; otherwise both
     types must be equal.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.types as pat
from sqlglot import exp

from dbsp_core.sql.decimal import common_decimal, decimal_type

_TYPES = {
    "BOOLEAN": pa.bool_(), "TINYINT": pa.int8(), "SMALLINT": pa.int16(), "INT": pa.int32(), "MEDIUMINT": pa.int32(),
    "BIGINT": pa.int64(), "UTINYINT": pa.uint8(), "USMALLINT": pa.uint16(), "UINT": pa.uint32(),
    "UBIGINT": pa.uint64(), "FLOAT": pa.float32(), "DOUBLE": pa.float64(), "VARCHAR": pa.string(),
    "NVARCHAR": pa.string(), "CHAR": pa.string(), "NCHAR": pa.string(), "TEXT": pa.string(), "STRING": pa.string(),
    "VARBINARY": pa.binary(), "BINARY": pa.binary(), "BLOB": pa.binary(), "DATE": pa.date32(),
}
_TIMESTAMPS = ("TIMESTAMP", "TIMESTAMPNTZ", "DATETIME", "TIMESTAMP_S", "TIMESTAMP_MS", "TIMESTAMP_NS")


class TypeProblem(ValueError):
    """A type the engine cannot store (invariant 1)."""


def arrow_type(dt: exp.DataType) -> pa.DataType:
    """The Arrow type of a SQL type (TIMESTAMP is microseconds, TIMESTAMP(3) milliseconds, and so on)."""
    name = dt.this.name if hasattr(dt.this, "name") else str(dt.this)
    if name in _TYPES:
        return _TYPES[name]
    if name == "DECIMAL":  # sqlglot fills in DuckDB's (18, 3) for a bare DECIMAL
        ps = [int(x.this.this if isinstance(x, exp.DataTypeParam) else x.this) for x in dt.expressions]
        try:
            return decimal_type(ps[0] if ps else 18, ps[1] if len(ps) > 1 else (0 if ps else 3))
        except ValueError as e:
            raise TypeProblem(str(e)) from None
    if name in _TIMESTAMPS:
        unit = {"TIMESTAMP_S": "s", "TIMESTAMP_MS": "ms", "TIMESTAMP_NS": "ns"}.get(name, "us")
        params = dt.expressions
        if params:
            p = int(params[0].this.this if isinstance(params[0], exp.DataTypeParam) else params[0].this)
            unit = "s" if p == 0 else "ms" if p <= 3 else "us" if p <= 6 else "ns"
        return pa.timestamp(unit)
    raise TypeProblem(f"type {dt.sql()} is not supported (column types are BOOLEAN, TINYINT..BIGINT, REAL, DOUBLE, "
                      f"DECIMAL(p, s), VARCHAR, VARBINARY, DATE and TIMESTAMP[(p)])")


def int_literal_type(v: int) -> pa.DataType:
    """Invariant 2."""
    return pa.int32() if -(2**31) <= v < 2**31 else pa.int64()


def is_numeric(t: pa.DataType) -> bool:
    return pat.is_integer(t) or pat.is_floating(t) or pat.is_decimal(t)


def is_string(t: pa.DataType) -> bool:
    return pat.is_string(t) or pat.is_large_string(t)


def common_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """Invariant 3: the type both ``a`` and ``b`` cast to, or None when there is none."""
    if a.equals(b):
        return a
    if pat.is_null(a):
        return b
    if pat.is_null(b):
        return a
    if pat.is_integer(a) and pat.is_integer(b):
        if pat.is_signed_integer(a) == pat.is_signed_integer(b):
            return a if a.bit_width >= b.bit_width else b
        return pa.int64()
    if (pat.is_decimal(a) or pat.is_decimal(b)) and not (pat.is_floating(a) or pat.is_floating(b)) \
            and is_numeric(a) and is_numeric(b):
        return common_decimal(a, b)
    if is_numeric(a) and is_numeric(b):
        return pa.float64()
    if is_string(a) and is_string(b):
        return pa.string()
    if pat.is_timestamp(a) and pat.is_timestamp(b):
        order = ["s", "ms", "us", "ns"]
        return a if order.index(a.unit) >= order.index(b.unit) else b
    if pat.is_timestamp(a) and pat.is_date(b):
        return a
    if pat.is_date(a) and pat.is_timestamp(b):
        return b
    return None


def storable(t: pa.DataType) -> pa.DataType:
    """The type a view column of type ``t`` is stored as: a null-typed column (``SELECT NULL``) becomes int32."""
    return pa.int32() if pat.is_null(t) else t
