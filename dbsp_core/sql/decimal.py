"""SQL ``DECIMAL(p, s)``: exact decimals stored as Arrow decimal64 (the C core sees their unscaled int64), with DuckDB's result types for arithmetic, and SUM, AVG, MIN and MAX computed exactly on the unscaled integers.

Invariants:
  1. ``DECIMAL(p, s)`` (also NUMERIC; 1 <= p <= 18, 0 <= s <= p; plain DECIMAL is DECIMAL(18, 3) as in DuckDB) is
     ``pa.decimal64(p, s)``: the value times 10^s as an int64, which hashing, equality, order and sums in the C
     core see (csrc/column.h invariant 4). Input columns of decimal128 are cast to it safely on push (a value
     that does not fit is an error naming the column and row, never rounded). Wider precisions are refused.
  2. Arithmetic follows DuckDB's types, capped at 18 digits: ``a + b`` and ``a - b`` are DECIMAL(max(p1 - s1,
     p2 - s2) + max(s1, s2) + 1, max(s1, s2)), ``a * b`` DECIMAL(p1 + p2, s1 + s2), ``-a`` keeps the type; a
     precision above 18 becomes 18, and a result that does not fit fails the step (a checked cast), never wraps.
     An integer operand counts as DECIMAL(digits of its type, 0); a float operand makes the result a DOUBLE, and
     ``/`` divides as doubles (both as DuckDB does).
  3. SUM(DECIMAL(p, s)) is DECIMAL(18, s): the exact sum of the unscaled values (an int64 sum that fails the
     step on overflow). AVG(DECIMAL(p, s)) is DECIMAL(18, S) with S = max(s, min(6, 18 - (p - s))) (SQL Server's
     max(s, 6), less when the p - s integer digits need the room): the exact quotient of that sum by the count,
     rounded half away from zero at S digits. (DuckDB's AVG of a DECIMAL is a DOUBLE; the tests check ours
     against DuckDB's exact SUM and COUNT.) MIN and MAX keep the argument's type.
"""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

MAX_PRECISION = 18
_INT_DIGITS = {8: 3, 16: 5, 32: 10, 64: 19}


def decimal_type(p: int, s: int) -> pa.DataType:
    """Invariant 1; ValueError naming the limit when ``(p, s)`` is outside it."""
    if not 1 <= p <= MAX_PRECISION:
        raise ValueError(f"DECIMAL({p}, {s}): the precision is 1 to {MAX_PRECISION} digits (a DECIMAL is stored as "
                         f"a 64-bit integer of units of 10^-scale); use DOUBLE for wider numbers")
    if not 0 <= s <= p:
        raise ValueError(f"DECIMAL({p}, {s}): the scale is 0 to the precision {p}")
    return pa.decimal64(p, s)


def is_decimal(t: pa.DataType) -> bool:
    return pat.is_decimal(t)


def as_decimal(t: pa.DataType) -> pa.DataType | None:
    """The decimal type an operand of type ``t`` counts as (integers: decimal128 of their digits, scale 0; Arrow
    casts an int64 only to 19 digits or more), None for others."""
    if pat.is_decimal(t):
        return t
    if pat.is_integer(t):
        return pa.decimal128(_INT_DIGITS[t.bit_width], 0)
    return None


def cast(e: pc.Expression, t: pa.DataType, out: pa.DataType) -> pc.Expression:
    """``e`` (a decimal or an integer of type ``t``) as decimal ``out``, checked: through its integer digits
    for an integer (invariant 2)."""
    if pat.is_integer(t):
        e = e.cast(as_decimal(t))
    return e.cast(out)


def literal_type(text: str) -> pa.DataType | None:
    """The decimal type of numeric literal text (``12.50`` is DECIMAL(4, 2)), None when it has an exponent or
    does not fit."""
    if "e" in text.lower():
        return None
    d = Decimal(text.lstrip("-+"))
    s = max(0, -d.as_tuple().exponent)
    p = max(len(d.as_tuple().digits), s, 1)
    return pa.decimal64(p, s) if p <= MAX_PRECISION else None


def result_type(op: str, a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """Invariant 2: the type of ``a op b`` (op ``add``, ``subtract`` or ``multiply``) of two decimals."""
    if op == "multiply":
        p, s = a.precision + b.precision, a.scale + b.scale
        if s > MAX_PRECISION:
            raise ValueError(f"the product of DECIMAL({a.precision}, {a.scale}) and DECIMAL({b.precision}, "
                             f"{b.scale}) has {s} decimal places, more than {MAX_PRECISION}; CAST an operand to a "
                             f"smaller scale first")
    else:
        s = max(a.scale, b.scale)
        p = max(a.precision - a.scale, b.precision - b.scale) + s + 1
    return pa.decimal64(min(p, MAX_PRECISION), s)


def common_decimal(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The decimal both ``a`` and ``b`` (decimals or integers) cast to without losing digits, capped at 18."""
    da, db = as_decimal(a), as_decimal(b)
    s = max(da.scale, db.scale)
    return pa.decimal64(min(max(da.precision - da.scale, db.precision - db.scale) + s, MAX_PRECISION), s)


def _wide(e: pc.Expression, t: pa.DataType) -> pc.Expression:
    return e.cast(pa.decimal128(t.precision, t.scale)) if pat.is_decimal(t) else e


def arith(op: str, a: pc.Expression, ta: pa.DataType, b: pc.Expression, tb: pa.DataType) -> pc.Expression:
    """``a op b`` of two decimal (or integer) operands, exact, in the type of invariant 2 (a checked cast)."""
    da, db = as_decimal(ta), as_decimal(tb)
    out = result_type(op, da, db)
    x = pc.Expression._call(op + "_checked", [_wide(a.cast(da) if not pat.is_decimal(ta) else a, da),
                                              _wide(b.cast(db) if not pat.is_decimal(tb) else b, db)])
    return x.cast(out)


def negate(a: pc.Expression, t: pa.DataType) -> pc.Expression:
    return pc.Expression._call("subtract_checked", [pc.scalar(pa.scalar(0, pa.decimal128(1, 0))), _wide(a, t)]
                               ).cast(t)


def unscaled(e: pc.Expression, t: pa.DataType) -> pc.Expression:
    """The decimal ``e`` (type ``t``) times 10^scale as an int64: what SUM, MIN and MAX aggregate (invariant 3)."""
    ten = pc.scalar(pa.scalar(Decimal(10) ** t.scale, pa.decimal128(t.scale + 1, 0)))
    return pc.Expression._call("multiply", [_wide(e, t), ten]).cast(pa.int64())


def from_unscaled(e: pc.Expression, scale: int, out: pa.DataType) -> pc.Expression:
    """The int64 ``e`` of units of 10^-scale as decimal type ``out`` (a checked cast: too large fails the step)."""
    unit = pc.scalar(pa.scalar(Decimal(1).scaleb(-scale), pa.decimal128(max(scale, 1), scale)))
    return pc.Expression._call("multiply", [e.cast(pa.decimal128(19, 0)), unit]).cast(out)


def sum_type(t: pa.DataType) -> pa.DataType:
    return pa.decimal64(MAX_PRECISION, t.scale)


def avg_type(t: pa.DataType) -> pa.DataType:
    """Invariant 3's DECIMAL(18, S)."""
    return pa.decimal64(MAX_PRECISION, max(t.scale, min(6, MAX_PRECISION - (t.precision - t.scale))))


def avg(total: pc.Expression, count: pc.Expression, t: pa.DataType) -> pc.Expression:
    """AVG of a decimal column of type ``t`` from the int64 sum of its unscaled values and its count (invariant 3):
    q = total / count truncated, then the remainder's next k = S - s digits, rounded half away from zero, all
    in checked int64 arithmetic (no double rounds anything)."""
    out = avg_type(t)
    k = out.scale - t.scale
    call = pc.Expression._call
    i64 = (lambda v: pc.scalar(pa.scalar(v, pa.int64())))
    q = call("divide_checked", [total, count])  # integers: truncated toward zero
    r = call("subtract_checked", [total, call("multiply_checked", [q, count])])  # |r| < count, sign of total
    frac_num = call("multiply_checked", [r, i64(10 ** k)])
    f = call("divide_checked", [frac_num, count])
    rem = call("subtract_checked", [frac_num, call("multiply_checked", [f, count])])
    up = call("greater_equal", [call("multiply_checked", [call("abs_checked", [rem]), i64(2)]), count])
    f = call("add_checked", [f, call("if_else", [up, call("sign", [total]).cast(pa.int64()), i64(0)])])
    units = call("add_checked", [call("multiply_checked", [q, i64(10 ** k)]), f])
    return from_unscaled(units, out.scale, out)
