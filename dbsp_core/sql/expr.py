"""SQL scalar expressions compiled to pyarrow.compute expressions over a relation's fields, with SQL's three-valued NULL logic and DuckDB's arithmetic.

Invariants:
  1. AND, OR and NOT are Kleene (three-valued) as in SQL; comparisons, arithmetic and string functions give
     NULL when an argument is NULL; CASE and WHERE treat NULL as false; IN (list) is the OR of equalities (so
     ``x IN (1, NULL)`` is NULL, not false, when x is not 1); IS [NOT] DISTINCT FROM compares nulls as values.
  2. Arithmetic follows DuckDB: ``/`` divides as doubles; ``//`` and ``%`` of integers truncate toward zero (the
     remainder has the dividend's sign; of doubles, ``//`` is the quotient and ``%`` the truncated remainder); integer +, -, * and unary - raise on overflow; CAST of a float to an integer
     rounds half to even, ROUND rounds half away from zero. An integer becomes a double (``/``, SQRT, LN, LOG, EXP,
     POWER, CAST) rounded to the nearest double, as in DuckDB: every int64 and uint64 value is accepted.
     DECIMAL arithmetic is exact with DuckDB's result types (decimal.py): a numeric literal beside a DECIMAL is a
     DECIMAL of its own digits; a DECIMAL beside a float is a double; CAST to DECIMAL or to an integer rounds
     half away from zero.
  3. A node found in the substitution map (group keys, aggregate calls, subquery results the planner already
     computed) compiles to a reference to its field, before anything else is looked at.
  4. Anything not covered raises SqlError at the node, saying what is not supported. A literal pattern (regular
     expression, LIKE) is run once at compile time by the kernel that will run it, so a bad one is a SqlError at
     the literal, never a failure of every step.
  5. A chain of binary operators (``a + b + ...``, sqlglot's left-deep tree) compiles without recursing per
     term, in the written order (exactly associative AND, OR and ``||`` as a balanced tree); a chain or IN list
     longer than MAX_CHAIN terms is a SqlError, since Arrow evaluates it recursively and would overflow its stack.
  7. ``now()`` and ``CURRENT_TIMESTAMP`` are the step's logged time (``ctx.now_ns``, the same when a step is
     replayed after a crash) as a TIMESTAMP in microseconds (UTC). They may appear in WHERE and HAVING conditions
     only: such a condition is a temporal filter (NowCondition, operators/temporal.py ``filter_now``) that
     re-evaluates the integral of its input at every step; elsewhere they are a SqlError.
  6. Floats compare as in DuckDB, not IEEE: NaN equals NaN and is greater than every other number (+inf included),
     -0.0 equals 0.0; a NULL operand still gives NULL. Every comparison (=, <>, <, <=, >, >=, IS [NOT] DISTINCT
     FROM, NULLIF, and IN, BETWEEN and CASE through them) goes through ``_compare``; GREATEST of a NaN is NaN.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat
from sqlglot import exp

from dbsp_core.errors import SchemaError
from dbsp_core.operators.expr import project_schema, strftime
from dbsp_core.sql import decimal as dec
from dbsp_core.sql.errors import Source, SqlError
from dbsp_core.sql.parse import DIALECT, ident, interval_value, tname
from dbsp_core.sql.relation import Rel
from dbsp_core.sql.types import TypeProblem, arrow_type, common_type, int_literal_type, is_numeric, is_string

F = pc.field
ROUND = "half_towards_infinity"  # Arrow's name for half away from zero
AGGREGATES = (exp.Count, exp.Sum, exp.Min, exp.Max, exp.Avg, exp.Variance, exp.VariancePop, exp.Stddev, exp.StddevSamp,
              exp.StddevPop, exp.CovarPop, exp.CovarSamp, exp.Corr, exp.GroupConcat, exp.First, exp.Last)
MAX_CHAIN = 4096  # terms of a chain (a + b + ..., x OR y OR ...): Arrow recurses per term (~1 KB of stack each)
_REGROUPABLE = (exp.And, exp.Or, exp.DPipe)  # exactly associative: compiled as a balanced tree (shallow to bind)
_TEMPORAL_PARTS = {"YEAR": "year", "MONTH": "month", "DAY": "day", "HOUR": "hour", "MINUTE": "minute",
                   "SECOND": "second", "MILLISECOND": "millisecond", "QUARTER": "quarter", "DOY": "day_of_year",
                   "DAYOFYEAR": "day_of_year", "WEEK": "iso_week", "DOW": "day_of_week", "DAYOFWEEK": "day_of_week",
                   "ISODOW": "day_of_week"}
_TRUNC_UNITS = {"YEAR": "year", "QUARTER": "quarter", "MONTH": "month", "WEEK": "week", "DAY": "day",
                "HOUR": "hour", "MINUTE": "minute", "SECOND": "second", "MILLISECOND": "millisecond"}
_JAVA_FORMAT = [("yyyy", "%Y"), ("MM", "%m"), ("dd", "%d"), ("HH", "%H"), ("mm", "%M"), ("ss", "%S")]


def lit(value: Any, typ: pa.DataType | None = None) -> pc.Expression:
    """A literal expression of ``value`` (typed)."""
    return pc.scalar(pa.scalar(value, typ) if typ is not None else pa.scalar(value))


def null(typ: pa.DataType = pa.null()) -> pc.Expression:
    return pc.scalar(pa.scalar(None, typ))


def call(name: str, *args: pc.Expression, options: Any = None) -> pc.Expression:
    return pc.Expression._call(name, list(args), options)


class Exprs:
    """Compiles the expressions of one relation (invariants 1-4).

    ``subst`` maps sqlglot nodes (compared structurally) to fields of ``rel`` already computed; ``columns`` (if
    given) resolves a column node to a field when the relation's names are not enough (outer references).
    """

    def __init__(self, src: Source, rel: Rel, subst: dict | None = None,
                 columns: Callable[[exp.Column], str | None] | None = None, where: str = "expression") -> None:
        self.src, self.rel = src, rel
        self.subst = subst or {}
        self.columns = columns
        self.where = where
        self._types: dict[str, pa.DataType] = {}
        self._memo: dict[int, tuple[exp.Expression, pc.Expression]] = {}  # the nodes of a chain being compiled
        self._typed: dict[int, tuple[pc.Expression, pa.DataType]] = {}  # its levels' types, by expression object
        self.allow_now = False  # invariant 7: a WHERE or HAVING condition
        self.now_ns: int | None = None  # the step's now that now() compiles to (None: the wall clock, to bind)
        self.used_now = False  # set when now() was compiled

    # ---- entry points ----

    def compile(self, node: exp.Expression) -> pc.Expression:
        return self.typed(node)[0]  # bound now, so an error points at this node

    def typed(self, node: exp.Expression) -> tuple[pc.Expression, pa.DataType]:
        e = self._c(node)
        t = self.type_of(e, node)
        if pat.is_decimal(t) and not pat.is_decimal64(t):  # an Arrow kernel's decimal128 (coalesce): stored as 64
            e = e.cast(pa.decimal64(min(t.precision, dec.MAX_PRECISION), t.scale))
            t = self.type_of(e, node)
        return e, t

    def predicate(self, node: exp.Expression) -> pc.Expression:
        e, t = self.typed(node)
        if pat.is_null(t):
            return null(pa.bool_())
        if is_numeric(t):  # WHERE 0, WHERE x: DuckDB casts a number to a boolean (nonzero is true)
            return call("not_equal", e, lit(0, t))
        if not (pat.is_boolean(t) or pat.is_null(t)):
            raise self.src.error(node, f"{node.sql(dialect=DIALECT)} is {t}, not a boolean condition")
        return e

    def type_of(self, e: pc.Expression, node: Any = None) -> pa.DataType:
        known = self._typed.get(id(e))
        if known is not None and known[0] is e:
            return known[1]
        key = str(e)
        t = self._types.get(key)
        if t is None:
            try:
                t = project_schema(self.rel.schema, [e], ["x"], self.where).field(0).type
            except (SchemaError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                msg = str(exc).split("\n")[0]
                raise self.src.error(node, f"cannot evaluate {node.sql(dialect=DIALECT) if node is not None else e}: "
                                           f"{msg}") from None
            self._types[key] = t
        return t

    # ---- the cases ----

    def _t(self, node: exp.Expression) -> tuple[pc.Expression, pa.DataType]:
        e = self._c(node)
        return e, self.type_of(e, node)

    def _field(self, node: exp.Column) -> pc.Expression:
        table = tname(node.args["table"]) if node.args.get("table") else None
        name = ident(node.this)
        hits = self.rel.find(table, name)
        if len(hits) == 1:
            return F(hits[0].field)
        if len(hits) > 1:
            raise self.src.error(node, f"column {name!r} is ambiguous: it may be "
                                       f"{', '.join(sorted({f'{c.table}.{c.name}' for c in hits}))}")
        ungrouped = getattr(self.rel, "ungrouped", None)
        if ungrouped is not None and ungrouped.find(table, name):
            raise self.src.error(node, f"column {(table + '.') if table else ''}{name} must appear in GROUP BY or be "
                                       f"used in an aggregate function (e.g. MIN({name}))")
        if self.columns is not None:
            field = self.columns(node)
            if field is not None:
                return F(field)
        known = sorted({(f"{c.table}." if c.table else "") + c.name for c in self.rel.cols})
        raise self.src.error(node, f"unknown column {(table + '.') if table else ''}{name}; the columns here are "
                                   f"{', '.join(known) or '(none)'}")

    def _c(self, node: exp.Expression) -> pc.Expression:  # noqa: C901 - one case per SQL construct
        done = self._memo.get(id(node))
        if done is not None and done[0] is node:
            return done[1]
        hit = self.subst.get(node)
        if hit is not None:
            return F(hit)
        if isinstance(node, exp.Binary) and isinstance(node.this, exp.Binary) and id(node.this) not in self._memo:
            return self._chain(node)
        src = self.src
        if isinstance(node, exp.Paren):
            return self._c(node.this)
        if isinstance(node, exp.Column):
            if isinstance(node.this, exp.Star):
                raise src.error(node, "* is not allowed here")
            return self._field(node)
        if isinstance(node, exp.Literal):
            if node.is_string:
                return lit(node.this, pa.string())
            text = node.this
            if re.fullmatch(r"-?\d+", text):
                v = int(text)
                return lit(v, int_literal_type(v))
            return lit(float(text), pa.float64())
        if isinstance(node, exp.CurrentTimestamp) or (
                isinstance(node, exp.Anonymous) and node.name.lower() in ("now", "get_current_timestamp")
                and not node.expressions):
            return self._now(node)
        if isinstance(node, exp.HexString):  # x'303132': a BLOB (parse.py reads it from the tokens)
            return lit(bytes.fromhex(node.this), pa.binary())
        if isinstance(node, exp.Null):
            return null()
        if isinstance(node, exp.Boolean):
            return lit(bool(node.this), pa.bool_())
        if isinstance(node, (exp.And, exp.Or)):
            a, b = self._bool(node.this), self._bool(node.expression)
            return call("and_kleene" if isinstance(node, exp.And) else "or_kleene", a, b)
        if isinstance(node, exp.Not):
            return call("invert", self._bool(node.this))
        if isinstance(node, (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)):
            name = {exp.EQ: "equal", exp.NEQ: "not_equal", exp.GT: "greater", exp.GTE: "greater_equal",
                    exp.LT: "less", exp.LTE: "less_equal"}[type(node)]
            a, b = self._comparable(node.this, node.expression, node)
            return self._compare(name, a, b, node.this, node.expression)
        if isinstance(node, (exp.NullSafeEQ, exp.NullSafeNEQ)):
            a, b = self._comparable(node.this, node.expression, node)
            eq = call("if_else", call("and_kleene", call("is_null", a), call("is_null", b)), lit(True),
                      call("if_else", call("or_kleene", call("is_null", a), call("is_null", b)), lit(False),
                           self._compare("equal", a, b, node.this, node.expression)))
            return eq if isinstance(node, exp.NullSafeEQ) else call("invert", eq)
        if isinstance(node, exp.Is):
            a = self._c(node.this)
            other = node.expression
            if isinstance(other, exp.Null):
                return call("is_null", a)
            if isinstance(other, exp.Boolean):
                return call("coalesce", call("equal", a, lit(bool(other.this))), lit(False))
            raise src.error(node, f"IS {other.sql(dialect=DIALECT)} is not supported")
        if isinstance(node, exp.Between):
            x = node.this
            lo = exp.GTE(this=x, expression=node.args["low"])
            hi = exp.LTE(this=x, expression=node.args["high"])
            return call("and_kleene", self._c(lo), self._c(hi))
        if isinstance(node, exp.In):
            if node.args.get("query") is not None or node.args.get("unnest") is not None:
                raise src.error(node, "IN (subquery) is supported in WHERE and HAVING conditions and the SELECT list "
                                      "of a query with a FROM clause")
            if len(node.expressions) > MAX_CHAIN:  # an OR of equalities: as deep when Acero flattens it
                raise src.error(node, f"IN with {len(node.expressions)} values is longer than the {MAX_CHAIN} an "
                                      f"expression may have (Arrow evaluates it recursively and would overflow its "
                                      f"stack); put the values in a table and join, or IN (SELECT ...)")
            eqs = [self._c(exp.EQ(this=node.this, expression=v)) for v in node.expressions]
            if not eqs:  # DuckDB: false, NULL for a NULL operand
                x = self._c(node.this)
                return call("if_else", call("is_null", x), null(pa.bool_()), lit(False))
            out = eqs[0]
            for e in eqs[1:]:
                out = call("or_kleene", out, e)
            return out
        if isinstance(node, (exp.Add, exp.Sub, exp.Mul)):
            return self._arith(node)
        if isinstance(node, exp.Div):
            return call("divide", self._f64(node.this), self._f64(node.expression))
        if isinstance(node, (exp.IntDiv, exp.Mod)):
            (a, ta), (b, tb) = self._pair(node.this, node.expression)
            self._numeric(node, ta, tb)
            if pat.is_integer(ta) and pat.is_integer(tb):
                q = call("divide_checked", a, b)
                return q if isinstance(node, exp.IntDiv) else call("subtract", a, call("multiply", q, b))
            fa, fb = a.cast(pa.float64(), safe=False), b.cast(pa.float64(), safe=False)
            if isinstance(node, exp.IntDiv):  # DuckDB: // of doubles is their plain quotient
                return call("divide", fa, fb)
            return call("subtract", fa, call("multiply", call("trunc", call("divide", fa, fb)), fb))
        if isinstance(node, exp.Neg):
            a, t = self._t(node.this)
            if pat.is_unsigned_integer(t):  # DuckDB: the same unsigned type, so only -0 has a value
                return call("subtract_checked", lit(0, t), a)
            if pat.is_decimal(t):
                return dec.negate(a, t)
            return call("negate_checked", a)
        if isinstance(node, exp.DPipe):
            a, b = self._as_string(node.this), self._as_string(node.expression)
            return call("binary_join_element_wise", a, b, lit(""),
                        options=pc.JoinOptions(null_handling="emit_null"))
        if isinstance(node, exp.Concat):
            parts = [self._as_string(x) for x in node.expressions]
            return call("binary_join_element_wise", *parts, lit(""), options=pc.JoinOptions(null_handling="skip"))
        if isinstance(node, exp.Case):
            return self._case(node)
        if isinstance(node, exp.If):
            cond = call("coalesce", self._bool(node.this), lit(False))
            f = node.args.get("false")
            return call("if_else", cond, self._c(node.args["true"]), self._c(f) if f is not None else null())
        if isinstance(node, exp.Coalesce):
            args = [node.this] + list(node.expressions)
            return call("coalesce", *self._unified(args, node))
        if isinstance(node, exp.Nullif):
            a, b = self._comparable(node.this, node.expression, node)
            eq = self._compare("equal", a, b, node.this, node.expression)
            value = self._c(node.this)  # NULLIF has its first argument's type (a literal's as README says)
            return call("if_else", call("coalesce", eq, lit(False)), null(self.type_of(value, node.this)), value)
        if isinstance(node, (exp.Greatest, exp.Least)):
            args = self._unified([node.this] + list(node.expressions), node)
            if all(pat.is_null(self.type_of(x)) for x in args):
                return null()
            name = "max_element_wise" if isinstance(node, exp.Greatest) else "min_element_wise"
            out = call(name, *args, options=pc.ElementWiseAggregateOptions(skip_nulls=True))
            t = self.type_of(out)
            if isinstance(node, exp.Greatest) and pat.is_floating(t):  # Arrow skips NaN; NaN is the greatest
                nan = [call("coalesce", call("is_nan", x), lit(False)) for x in args
                       if pat.is_floating(self.type_of(x))]
                out = call("if_else", _any(nan), lit(float("nan"), t), out)
            return out
        if isinstance(node, (exp.Cast, exp.TryCast)):
            return self._cast(node)
        if isinstance(node, (exp.Like, exp.ILike)):
            pat_node = node.expression
            if node.args.get("escape") is not None or not (isinstance(pat_node, exp.Literal) and pat_node.is_string):
                raise src.error(node, "LIKE needs a string literal pattern (without ESCAPE)")
            ci = isinstance(node, exp.ILike)
            opts = self._pattern(pat_node, "match_like", lambda t: pc.MatchSubstringOptions(t, ignore_case=ci),
                                 "the LIKE pattern")
            e = call("match_like", self._as_string(node.this), options=opts)
            return call("invert", e) if node.args.get("negate") else e
        if isinstance(node, exp.Interval):
            raise src.error(node, "an INTERVAL can only be added to or subtracted from a date or timestamp")
        if isinstance(node, exp.Window):
            raise src.error(node, "window functions (OVER) are supported only as ROW_NUMBER() or RANK() <= k in the "
                                  "WHERE of an enclosing query (a top-k per group)")
        if isinstance(node, AGGREGATES) or (isinstance(node, exp.Filter) and isinstance(node.this, AGGREGATES)):
            raise src.error(node, f"aggregate {node.sql(dialect=DIALECT)} is not allowed here")
        if isinstance(node, (exp.Subquery, exp.Exists, exp.Select)):
            raise src.error(node, "a subquery is not allowed here")
        if isinstance(node, exp.Func):
            return self._function(node)
        raise src.error(node, f"{type(node).__name__} ({node.sql(dialect=DIALECT)}) is not supported")

    def _now(self, node: exp.Expression) -> pc.Expression:
        """Invariant 7."""
        if not self.allow_now:
            raise self.src.error(node, f"{node.sql(dialect=DIALECT)} is supported in WHERE and HAVING conditions "
                                       f"(a temporal filter, evaluated at each step's logged time), "
                                       f"not in {self.where}")
        self.used_now = True
        now = self.now_ns if self.now_ns is not None else time.time_ns()
        return lit(now // 1000, pa.timestamp("us"))

    def _chain(self, node: exp.Binary) -> pc.Expression:
        """A binary operator whose left operand is one too: sqlglot nests ``a + b + c`` as ``(a + b) + c``, so a
        flat chain of thousands of terms is a tree as deep. Its left operands compile bottom-up, each level finding
        the one below it already compiled, so Python's stack does not grow with the chain (left to right, as
        SQL evaluates it: overflow and rounding are those of the written order)."""
        lefts: list[exp.Expression] = []
        n = node.this
        while isinstance(n, exp.Binary) and id(n) not in self._memo and self.subst.get(n) is None:
            lefts.append(n)
            n = n.this
        same = lefts[:next((i for i, x in enumerate(lefts) if type(x) is not type(node)), len(lefts))]
        terms = len(same) + 2 if isinstance(node, _REGROUPABLE) and same else len(lefts) + 2
        if terms > MAX_CHAIN:  # Arrow's filter re-flattens AND/OR chains: the limit holds for them too
            raise self.src.error(node, f"a chain of {terms} terms of {type(node).__name__} is longer than the "
                                       f"{MAX_CHAIN} an expression may have (Arrow evaluates it recursively and would "
                                       f"overflow its stack); split it, e.g. into partial results in a subquery or "
                                       f"IN (list)")
        if isinstance(node, _REGROUPABLE) and same:
            return self._regrouped(node, same)
        try:
            for n in lefts[::-1] + [node]:  # bottom-up
                below = self._memo.get(id(n.this))
                if below is None:
                    self._memo[id(n)] = (n, self._c(n))
                    continue
                # the level's type, bound with its operands as typed NULLs (the same few shapes at every level,
                # so the type cache answers): binding each level whole would cost the chain's length again
                right = n.expression
                r = None
                if not isinstance(right, (exp.Interval, exp.Literal)) and id(right) not in self._memo:
                    r = self._t(right)
                    self._memo[id(right)] = (right, null(r[1]))
                self._memo[id(n.this)] = (n.this, null(self.type_of(below[1], n.this)))
                t = self.type_of(self._c(n), n)
                self._memo[id(n.this)] = below
                if r is not None:
                    self._memo[id(right)] = (right, r[0])
                try:
                    e = self._c(n)
                finally:
                    if r is not None:
                        del self._memo[id(right)]
                self._typed[id(e)] = (e, t)
                self._memo[id(n)] = (n, e)
            return self._memo[id(node)][1]
        finally:  # nothing of the chain stays memoized, also after an error (a caller may compile on)
            for n in lefts + [node]:
                self._memo.pop(id(n), None)
                self._memo.pop(id(n.expression), None)

    def _regrouped(self, node: exp.Expression, lefts: list[exp.Expression]) -> pc.Expression:
        """A chain of one operator that is exactly associative (Kleene AND, Kleene OR, ``||`` with NULL in, NULL
        out) as a balanced tree: the same result at depth log2(n), bound without a pass per level (Acero's filter
        still flattens AND/OR chains when it runs them, hence MAX_CHAIN for these too)."""
        operand = self._as_string if isinstance(node, exp.DPipe) else self._bool
        xs = [operand(x) for x in [lefts[-1].this if lefts else node.this]
              + [x.expression for x in lefts[::-1]] + [node.expression]]
        while len(xs) > 1:
            pairs = [xs[i:i + 2] for i in range(0, len(xs), 2)]
            xs = [p[0] if len(p) == 1 else
                  call("binary_join_element_wise", p[0], p[1], lit(""),
                       options=pc.JoinOptions(null_handling="emit_null")) if isinstance(node, exp.DPipe) else
                  call("and_kleene" if isinstance(node, exp.And) else "or_kleene", p[0], p[1]) for p in pairs]
        return xs[0]

    # ---- helpers ----

    def _numeric(self, node: exp.Expression, *types: pa.DataType) -> None:
        for t in types:
            if not (is_numeric(t) or pat.is_null(t)):
                raise self.src.error(node, f"{node.sql(dialect=DIALECT)}: arithmetic needs numbers, got {t}")

    def _pair(self, x: exp.Expression, y: exp.Expression
              ) -> tuple[tuple[pc.Expression, pa.DataType], tuple[pc.Expression, pa.DataType]]:
        """Both operands typed; a numeric literal takes the other operand's numeric type when its value fits
        (as SQL engines cast a constant to the column's type), so no cast runs per row."""
        (a, ta), (b, tb) = self._t(x), self._t(y)
        if pat.is_decimal(ta) or pat.is_decimal(tb):  # a literal beside a DECIMAL: a DECIMAL of its own digits
            return self._decimal_literal(x, ta, a, tb), self._decimal_literal(y, tb, b, ta)
        b2 = self._retyped(y, ta)
        if b2 is not None:
            return (a, ta), (b2, ta)
        a2 = self._retyped(x, tb)
        if a2 is not None:
            return (a2, tb), (b, tb)
        return (a, ta), (b, tb)

    def _decimal_literal(self, node: exp.Expression, t: pa.DataType, e: pc.Expression, other: pa.DataType
                         ) -> tuple[pc.Expression, pa.DataType]:
        """A numeric literal next to a DECIMAL operand (``other``) typed as a DECIMAL of its digits, as DuckDB types
        it; anything else as it is."""
        neg = isinstance(node, exp.Neg)
        n = node.this if neg else node
        if not (pat.is_decimal(other) and isinstance(n, exp.Literal) and not n.is_string) or self.subst.get(node):
            return e, t
        lt = dec.literal_type(n.this)
        if lt is None:
            return e, t
        from decimal import Decimal

        v = Decimal(n.this)
        return lit(-v if neg else v, lt), lt

    def literal_as(self, node: exp.Expression, t: pa.DataType) -> pc.Expression | None:
        """A string literal compared with (or joined to) a number, as DuckDB casts it: to the number's type,
        refused when its text is not such a number (DuckDB's conversion error); None for anything else."""
        if not (isinstance(node, exp.Literal) and node.is_string and is_numeric(t)) or self.subst.get(node):
            return None
        text = node.this.strip()
        try:
            if pat.is_integer(t):
                if not re.fullmatch(r"[+-]?\d+", text):
                    raise ValueError(text)
                return lit(pa.scalar(int(text), t).as_py(), t)
            return lit(float(text), t)
        except (ValueError, pa.ArrowInvalid, OverflowError):
            raise self.src.error(node, f"cannot compare {t} with {node.sql(dialect=DIALECT)}: the string is cast "
                                       f"to {t} (as DuckDB does) and is not such a value") from None

    def _retyped(self, node: exp.Expression, t: pa.DataType) -> pc.Expression | None:
        neg = isinstance(node, exp.Neg)
        n = node.this if neg else node
        if not (isinstance(n, exp.Literal) and not n.is_string and is_numeric(t)) or self.subst.get(node):
            return None
        try:
            v = int(n.this) if re.fullmatch(r"\d+", n.this) else float(n.this)
        except ValueError:
            return None
        v = -v if neg else v
        if pat.is_integer(t):
            if isinstance(v, float):
                return None
            try:
                return lit(pa.scalar(v, t).as_py(), t)
            except (pa.ArrowInvalid, OverflowError):
                return None
        return lit(float(v), t)

    def _comparable(self, x: exp.Expression, y: exp.Expression, node: exp.Expression
                    ) -> tuple[pc.Expression, pc.Expression]:
        (a, ta), (b, tb) = self._pair(x, y)
        b2, a2 = self.literal_as(y, ta), self.literal_as(x, tb)  # '1' = a (not a + '1': DuckDB refuses that)
        if b2 is not None:
            b, tb = b2, ta
        elif a2 is not None:
            a, ta = a2, tb
        if common_type(ta, tb) is None:
            raise self.src.error(node, f"cannot compare {ta} with {tb} in {node.sql(dialect=DIALECT)}")
        if pat.is_null(ta) and pat.is_null(tb):  # NULL = NULL: a boolean NULL, whatever the (untyped) sides
            return null(pa.bool_()), null(pa.bool_())
        if pat.is_null(ta):
            a = null(tb)
        elif pat.is_null(tb):
            b = null(ta)
        if pat.is_decimal(ta) or pat.is_decimal(tb):
            c = common_type(ta, tb)
            if pat.is_floating(c):
                return a.cast(c), b.cast(c)
            return (a if ta.equals(c) else dec.cast(a, ta, c)), (b if tb.equals(c) else dec.cast(b, tb, c))
        if pat.is_timestamp(ta) and pat.is_date(tb):
            b = b.cast(ta)
        elif pat.is_date(ta) and pat.is_timestamp(tb):
            a = a.cast(tb)
        return a, b

    def _compare(self, name: str, a: pc.Expression, b: pc.Expression, x: exp.Expression, y: exp.Expression
                 ) -> pc.Expression:
        """``name`` (equal, not_equal, less, less_equal, greater, greater_equal) of ``a`` and ``b`` (nodes ``x`` and
        ``y``, made comparable by ``_comparable``) in DuckDB's order of floats (invariant 6): IEEE's where neither
        side is NaN, so only a side that may be NaN (a float that is not a numeric literal) costs more."""
        na, nb = self._may_nan(a, x), self._may_nan(b, y)
        if not (na or nb):
            return call(name, a, b)
        if name in ("less", "less_equal"):  # a < b is b > a
            a, b, na, nb = b, a, nb, na
            name = name.replace("less", "greater")
        # "and" / "or" are not Kleene: a NULL side (is_nan NULL) keeps the result NULL
        if name in ("equal", "not_equal"):
            if not (na and nb):  # IEEE already: NaN = x is false, NaN <> x true, for x not NaN
                return call(name, a, b)
            eq = call("or", call("equal", a, b), call("and", call("is_nan", a), call("is_nan", b)))
            return eq if name == "equal" else call("invert", eq)
        # a > b is NOT (a <= b) (true for a NaN a, as IEEE makes a <= b false), unless b is NaN
        out = call("invert", call("less_equal" if name == "greater" else "less", a, b))
        if nb:  # a > NaN is false; a >= NaN only for a NaN a
            not_nan_b = call("invert", call("is_nan", b))
            ok = call("or", call("is_nan", a), not_nan_b) if name == "greater_equal" and na else not_nan_b
            out = call("and", out, ok)
        return out

    def _may_nan(self, e: pc.Expression, node: exp.Expression) -> bool:
        n = node.this if isinstance(node, exp.Neg) else node
        if isinstance(n, exp.Literal) and not n.is_string and not self.subst.get(node):
            return False
        return pat.is_floating(self.type_of(e))

    def _unified(self, nodes: list[exp.Expression], node: exp.Expression) -> list[pc.Expression]:
        typed = [self._t(n) for n in nodes]
        target = pa.null()
        for _, t in typed:
            c = common_type(target, t)
            if c is None:
                raise self.src.error(node, f"{node.sql(dialect=DIALECT)}: no common type for {target} and {t}")
            target = c
        return [e if t.equals(target) else dec.cast(e, t, target) if pat.is_decimal(target) and pat.is_integer(t)
                else e.cast(target) for e, t in typed]  # only NULLs: they stay untyped

    def _f64(self, node: exp.Expression) -> pc.Expression:
        """A numeric operand as a double, integers rounded to the nearest (invariant 2)."""
        return self._c(node).cast(pa.float64(), safe=False)

    def _bool(self, node: exp.Expression) -> pc.Expression:
        """A boolean operand (a bare NULL is a boolean NULL, a number is true when nonzero, as DuckDB casts it)."""
        e, t = self._t(node)
        if is_numeric(t):
            return call("not_equal", e, lit(0, t))
        return null(pa.bool_()) if pat.is_null(t) else e

    def _as_string(self, node: exp.Expression) -> pc.Expression:
        e, t = self._t(node)
        if is_string(t):
            return e
        if pat.is_null(t):
            return null(pa.string())
        return e.cast(pa.string())

    def _arith(self, node: exp.Expression) -> pc.Expression:
        x, y = node.this, node.expression
        if isinstance(y, exp.Interval) or isinstance(x, exp.Interval):
            if isinstance(node, exp.Mul) or isinstance(x, exp.Interval) and isinstance(node, exp.Sub):
                raise self.src.error(node, "an INTERVAL can only be added to or subtracted from a date or timestamp")
            base, iv = (x, y) if isinstance(y, exp.Interval) else (y, x)
            a, ta = self._t(base)
            if not (pat.is_timestamp(ta) or pat.is_date(ta)):
                raise self.src.error(node, f"an INTERVAL is added to a date or timestamp, not {ta}")
            delta = interval_value(self.src, iv, "the interval")
            unit = ta.unit if pat.is_timestamp(ta) else "s"
            if pat.is_date(ta):
                a, ta = a.cast(pa.timestamp("s")), pa.timestamp("s")
            d = lit(delta, pa.duration(unit))
            return call("add" if isinstance(node, exp.Add) else "subtract", a, d)
        (a, ta), (b, tb) = self._pair(x, y)
        if isinstance(node, exp.Sub) and (pat.is_timestamp(ta) or pat.is_date(ta)):
            return call("subtract", a, b)
        self._numeric(node, ta, tb)
        name = {exp.Add: "add_checked", exp.Sub: "subtract_checked", exp.Mul: "multiply_checked"}[type(node)]
        if pat.is_decimal(ta) or pat.is_decimal(tb):
            if pat.is_floating(ta) or pat.is_floating(tb):  # DuckDB: a DECIMAL beside a float is a double
                return call(name, a.cast(pa.float64()), b.cast(pa.float64()))
            try:
                return dec.arith(name[:-len("_checked")], a, ta, b, tb)
            except ValueError as e:
                raise self.src.error(node, str(e)) from None
        return call(name, a, b)

    def _case(self, node: exp.Case) -> pc.Expression:
        operand = node.this
        branches = []
        for i in node.args.get("ifs") or []:
            cond = i.this if operand is None else exp.EQ(this=operand, expression=i.this)
            branches.append((cond, i.args["true"]))
        default = node.args.get("default")
        values = self._unified([v for _, v in branches] + ([default] if default is not None else []), node)
        out = values[-1] if default is not None else null()
        if default is None and values:
            t = self.type_of(values[0])
            out = null(t) if not pat.is_null(t) else out
        for (cond, _), v in reversed(list(zip(branches, values[:len(branches)]))):
            out = call("if_else", call("coalesce", self._bool(cond), lit(False)), v, out)
        return out

    def _cast(self, node: exp.Expression) -> pc.Expression:
        if isinstance(node, exp.TryCast):
            raise self.src.error(node, "TRY_CAST is not supported (CAST raises on a value it cannot convert)")
        try:
            target = arrow_type(node.args["to"])
        except TypeProblem as e:
            raise self.src.error(node, str(e)) from None
        inner = node.this
        if isinstance(inner, exp.Literal) and inner.is_string and (pat.is_temporal(target) or pat.is_date(target)):
            try:
                return lit(pa.scalar(inner.this).cast(target).as_py(), target)
            except (pa.ArrowInvalid, ValueError) as e:
                raise self.src.error(node, f"{inner.this!r} is not a {target}: {e}") from None
        e, t = self._t(inner)
        if pat.is_integer(t) and pat.is_decimal(target):  # through the integer's digits (Arrow's rule), checked
            return dec.cast(e, t, target)
        if pat.is_decimal(t) and (pat.is_integer(target) or pat.is_decimal(target) and target.scale < t.scale):
            digits = target.scale if pat.is_decimal(target) else 0  # DuckDB rounds half away from zero
            e = call("round", e.cast(pa.decimal128(t.precision, t.scale)), options=pc.RoundOptions(digits, ROUND))
            return e.cast(target)
        if pat.is_floating(t) and pat.is_decimal(target):
            e = call("round", e, options=pc.RoundOptions(target.scale, ROUND))
            return e.cast(target, safe=False)  # rounded already: the cast only drops a float's binary tail
        if pat.is_floating(t) and pat.is_integer(target):
            e = call("round", e, options=pc.RoundOptions(0, "half_to_even"))
        if pat.is_integer(t) and pat.is_floating(target):  # invariant 2: rounded to the nearest, never refused
            return e.cast(target, safe=False)
        if pat.is_boolean(target) and is_string(t):
            e = call("utf8_lower", e)
        return e.cast(target)

    # ---- functions ----

    def _int_arg(self, node: exp.Expression, what: str) -> int:
        if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal):
            return -self._int_arg(node.this, what)
        if not (isinstance(node, exp.Literal) and not node.is_string and re.fullmatch(r"\d+", node.this)):
            raise self.src.error(node, f"{what} must be an integer literal")
        return int(node.this)

    def _str_arg(self, node: exp.Expression, what: str) -> str:
        if not (isinstance(node, exp.Literal) and node.is_string):
            raise self.src.error(node, f"{what} must be a string literal")
        return node.this

    def _pattern(self, node: exp.Expression, kernel: str, options: Callable[[str], Any], what: str) -> Any:
        """The options of ``kernel`` for the string literal pattern ``node``, the pattern checked now by the engine
        that runs it (Arrow's RE2 or LIKE translation, on a one-row probe): a bad one is a SqlError at the
        literal, not a failure of every step (invariant 4)."""
        text = self._str_arg(node, what)
        opts = options(text)
        try:
            pc.call_function(kernel, [pa.array([""], pa.string())], opts)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            msg = str(e).split("\n")[0]
            raise self.src.error(node, f"{what} {text!r} is not valid: {msg}") from None
        return opts

    def _regex(self, node: exp.Expression) -> Any:
        """MatchSubstringOptions of a checked regular expression literal (RE2 syntax, as Arrow runs it)."""
        return self._pattern(node, "match_substring_regex", pc.MatchSubstringOptions, "the regular expression")

    def _temporal(self, node: exp.Expression, arg: exp.Expression) -> tuple[pc.Expression, pa.DataType]:
        e, t = self._t(arg)
        if not (pat.is_timestamp(t) or pat.is_date(t)):
            raise self.src.error(node, f"{node.sql(dialect=DIALECT)} needs a date or timestamp, got {t}")
        return e, t

    def _part(self, node: exp.Expression, part: str, arg: exp.Expression) -> pc.Expression:
        e, _ = self._temporal(node, arg)
        p = part.upper()
        if p not in _TEMPORAL_PARTS:
            raise self.src.error(node, f"date part {part} is not supported ({', '.join(_TEMPORAL_PARTS)})")
        fn = _TEMPORAL_PARTS[p]
        if fn == "day_of_week":
            opts = pc.DayOfWeekOptions(count_from_zero=p != "ISODOW", week_start=7 if p != "ISODOW" else 1)
            return call(fn, e, options=opts).cast(pa.int64())
        return call(fn, e).cast(pa.int64())

    def _function(self, node: exp.Func) -> pc.Expression:  # noqa: C901 - one case per function
        src = self.src
        a = node.this if isinstance(node.this, exp.Expression) else None
        if isinstance(node, exp.Upper):
            return call("utf8_upper", self._as_string(a))
        if isinstance(node, exp.Lower):
            return call("utf8_lower", self._as_string(a))
        if isinstance(node, exp.Length):
            return call("utf8_length", self._as_string(a)).cast(pa.int64())
        if isinstance(node, exp.Substring):
            start = self._int_arg(node.args["start"], "the SUBSTRING start")
            length = node.args.get("length")
            stop = None if length is None else start - 1 + self._int_arg(length, "the SUBSTRING length")
            begin = max(start - 1, 0)
            if stop is not None and stop <= begin:
                return call("if_else", call("is_null", self._c(a)), null(pa.string()), lit(""))
            return call("utf8_slice_codeunits", self._as_string(a),
                        options=pc.SliceOptions(begin, stop if stop is not None else 2**31 - 1))
        if isinstance(node, exp.Left):
            n = self._int_arg(node.expression, "the LEFT length")
            return call("utf8_slice_codeunits", self._c(a), options=pc.SliceOptions(0, n))
        if isinstance(node, exp.Right):
            n = self._int_arg(node.expression, "the RIGHT length")
            return call("utf8_slice_codeunits", self._c(a), options=pc.SliceOptions(-n, 2**31 - 1)) if n \
                else call("if_else", call("is_null", self._c(a)), null(pa.string()), lit(""))
        if isinstance(node, exp.Trim):
            chars = node.expression
            pos = (node.args.get("position") or "BOTH").upper()
            fn = {"BOTH": "utf8_trim", "LEADING": "utf8_ltrim", "TRAILING": "utf8_rtrim"}[pos]
            if chars is None:
                return call(fn + "_whitespace", self._as_string(a))
            return call(fn, self._as_string(a), options=pc.TrimOptions(self._str_arg(chars, "the TRIM characters")))
        if isinstance(node, exp.Replace):
            old = self._str_arg(node.expression, "the REPLACE pattern")
            new = self._str_arg(node.args["replacement"], "the REPLACE replacement")
            return call("replace_substring", self._as_string(a), options=pc.ReplaceSubstringOptions(old, new))
        if isinstance(node, exp.StrPosition):
            sub = self._str_arg(node.args["substr"], "the searched string")
            return call("add", call("find_substring", self._as_string(a), options=pc.MatchSubstringOptions(sub)),
                        lit(1, pa.int32())).cast(pa.int64())
        if isinstance(node, exp.StartsWith):
            return call("starts_with", self._as_string(a),
                        options=pc.MatchSubstringOptions(self._str_arg(node.expression, "the prefix")))
        if isinstance(node, exp.Pad):
            width = self._int_arg(node.expression, "the pad width")
            fill = node.args.get("fill_pattern")
            ch = " " if fill is None else self._str_arg(fill, "the pad character")
            return call("utf8_lpad" if node.args.get("is_left") else "utf8_rpad", self._as_string(a),
                        options=pc.PadOptions(width, ch))
        if isinstance(node, exp.SplitPart):
            sep = self._str_arg(node.args["delimiter"], "the SPLIT_PART delimiter")
            k = self._int_arg(node.args["part_index"], "the SPLIT_PART index")
            parts = call("split_pattern", self._as_string(a), options=pc.SplitPatternOptions(sep))
            n = call("list_value_length", parts)
            safe = call("if_else", call("greater_equal", n, lit(k, pa.int32())), parts,
                        lit([""] * k, pa.list_(pa.string())))
            return call("if_else", call("greater_equal", n, lit(k, pa.int32())),
                        call("list_element", safe, lit(k - 1, pa.int32())), lit(""))
        if isinstance(node, exp.RegexpExtract):
            self._regex(node.expression)
            pattern = self._str_arg(node.expression, "the regular expression")
            group = node.args.get("group")
            g = 0 if group is None else self._int_arg(group, "the group number")
            named, count = _named_groups(pattern)
            if g > count:
                raise src.error(node, f"the regular expression has {count} groups, not {g}")
            m = call("extract_regex", self._c(a), options=pc.ExtractRegexOptions(f"(?P<g0>{named})"))
            got = call("struct_field", m, options=pc.StructFieldOptions([f"g{g}"]))
            return call("if_else", call("is_null", m), call("if_else", call("is_null", self._c(a)), null(pa.string()),
                                                            lit("")), got)
        if isinstance(node, exp.RegexpLike):
            return call("match_substring_regex", self._c(a), options=self._regex(node.expression))
        if isinstance(node, exp.Abs):
            return call("abs_checked", self._c(a))
        if isinstance(node, exp.Sign):
            return call("sign", self._c(a))
        if isinstance(node, exp.Round):
            d = node.args.get("decimals")
            e, t = self._t(a)
            if pat.is_integer(t):
                return e
            return call("round", e, options=pc.RoundOptions(0 if d is None else self._int_arg(d, "ROUND digits"),
                                                            ROUND))
        if isinstance(node, (exp.Floor, exp.Ceil)):
            e, t = self._t(a)
            if pat.is_integer(t):
                return e
            return call("floor" if isinstance(node, exp.Floor) else "ceil", e)
        if isinstance(node, exp.Sqrt):
            return call("sqrt", self._f64(a))
        if isinstance(node, exp.Pow):
            return call("power", self._f64(a), self._f64(node.expression))
        if isinstance(node, exp.Ln):
            return call("ln", self._f64(a))
        if isinstance(node, exp.Exp):
            return call("exp", self._f64(a))
        if isinstance(node, exp.Log):
            if node.expression is None:  # LOG(x): base 10, as in DuckDB
                return call("log10", self._f64(a))
            base = node.this
            if isinstance(base, exp.Literal) and not base.is_string and base.this == "10":  # LOG10(x), LOG(10, x)
                return call("log10", self._f64(node.expression))
            return call("divide", call("log10", self._f64(node.expression)), call("log10", self._f64(base)))  # DuckDB's
        if isinstance(node, exp.Extract):
            return self._part(node, node.this.name, node.expression)
        for cls, part in ((exp.Year, "YEAR"), (exp.Month, "MONTH"), (exp.Day, "DAY"), (exp.DayOfWeek, "DOW"),
                          (exp.DayOfYear, "DOY"), (exp.Quarter, "QUARTER"), (exp.Hour, "HOUR"),
                          (exp.Minute, "MINUTE"), (exp.Second, "SECOND")):
            if isinstance(node, cls):
                return self._part(node, part, a)
        if isinstance(node, (exp.TimestampTrunc, exp.DateTrunc)):
            unit = node.args.get("unit")
            u = (unit.name if unit is not None else "").upper().strip("'")
            if u not in _TRUNC_UNITS:
                raise src.error(node, f"DATE_TRUNC unit {u or '?'} is not supported ({', '.join(_TRUNC_UNITS)})")
            e, t = self._temporal(node, a)
            out = call("floor_temporal", e, options=pc.RoundTemporalOptions(1, _TRUNC_UNITS[u]))
            return out
        if isinstance(node, exp.TimeToStr):
            fmt = self._str_arg(node.args["format"], "the format")
            e, t = self._temporal(node, a)
            return strftime(e, fmt, t)
        if isinstance(node, exp.Anonymous):
            return self._anonymous(node)
        raise src.error(node, f"function {node.sql(dialect=DIALECT).split('(')[0]} is not supported")

    def _anonymous(self, node: exp.Anonymous) -> pc.Expression:
        name = node.name.lower()
        args = node.expressions
        if name == "date_format" and len(args) == 2:
            fmt = self._str_arg(args[1], "the DATE_FORMAT pattern")
            for java, c in _JAVA_FORMAT:
                fmt = fmt.replace(java, c)
            e, t = self._temporal(node, args[0])
            return strftime(e, fmt, t)
        if name in ("regexp_matches", "regexp_like") and len(args) == 2:
            return call("match_substring_regex", self._c(args[0]), options=self._regex(args[1]))
        if name == "count_substring" and len(args) == 2:
            return call("count_substring", self._c(args[0]),
                        options=pc.MatchSubstringOptions(self._str_arg(args[1], "the substring"))).cast(pa.int64())
        if name in ("log10",) and len(args) == 1:
            return call("log10", self._f64(args[0]))
        if name in ("epoch_ms",) and len(args) == 1:
            e, t = self._t(args[0])
            if pat.is_timestamp(t):
                return e.cast(pa.timestamp("ms")).cast(pa.int64())
        raise self.src.error(node, f"function {node.name}() is not supported")


class NowCondition:
    """The conjunction of WHERE/HAVING conditions that read now() over ``rel``, as ``filter_now`` calls it: the
    pyarrow predicate at a step's now (invariant 7). Its ``__qualname__`` holds the conditions' SQL, which the
    circuit's fingerprint hashes."""

    def __init__(self, src: Source, rel: Rel, subst: dict | None, conds: list[exp.Expression]) -> None:
        self.src, self.rel, self.subst, self.conds = src, rel, subst, conds
        self.__qualname__ = "NowCondition[" + " AND ".join(c.sql(dialect=DIALECT) for c in conds) + "]"

    def __call__(self, now_ns: int) -> pc.Expression:
        ex = Exprs(self.src, self.rel, self.subst, where="WHERE")
        ex.allow_now, ex.now_ns = True, now_ns
        out = None
        for c in self.conds:
            p = ex.predicate(c)
            out = p if out is None else call("and_kleene", out, p)
        return out


def _any(conds: list[pc.Expression]) -> pc.Expression:
    out = conds[0]
    for c in conds[1:]:
        out = call("or", out, c)
    return out


def _named_groups(pattern: str) -> tuple[str, int]:
    """``pattern`` with its capturing groups named g1, g2, ... (Arrow's extract_regex needs names)."""
    out, count, i = [], 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "(" and not pattern.startswith("(?", i):
            count += 1
            out.append(f"(?P<g{count}>")
        else:
            out.append(ch)
        i += 1
    return "".join(out), count
