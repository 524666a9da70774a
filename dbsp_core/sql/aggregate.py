"""GROUP BY and aggregates of the SQL planner: COUNT, SUM, AVG, MIN, MAX, the variance family, STRING_AGG, FIRST and LAST (with DISTINCT, FILTER and ORDER BY inside the call) over any group keys.

A query without GROUP BY gives SQL's one row, also over an empty input.

Invariants:
  1. After every step, the plan's integral holds one row per group of the integrated input (keys, then one
     field per distinct aggregate call); a query without GROUP BY holds exactly one row, also over an empty
     input (COUNT 0, the others NULL), as SQL requires: the keyless aggregate's row, plus a constant default
     row minus the default row once per aggregate row (so the default shows exactly while the input is empty).
  2. Aggregates run in as few aggregate operators as their kinds allow (operators/aggregate.py): one for the
     plain ones, one for COUNT(DISTINCT) when the plain ones are not all linear, one per column of
     SUM/AVG(DISTINCT) over the distinct (keys, value) pairs; several are joined on the keys, nulls matching.
  3. ``agg(x) FILTER (WHERE c)`` is ``agg(CASE WHEN c THEN x END)`` (``COUNT(*) FILTER`` counts the rows where c
     holds); MIN/MAX(DISTINCT x) are MIN/MAX(x).
  4. SUM, AVG, MIN and MAX of a DECIMAL aggregate its unscaled int64 (AVG as SUM and COUNT), converted back to
     the types of decimal.py invariant 3 after the aggregate.
  5. STDDEV[_SAMP|_POP], VARIANCE, VAR_SAMP, VAR_POP, COVAR_POP, COVAR_SAMP, CORR, STRING_AGG / LISTAGG /
     GROUP_CONCAT (separator a string literal, default ','; ORDER BY inside) and FIRST / LAST (ORDER BY inside
     required: a view's rows have no order, and DuckDB's answer without it depends on its scan) are the whole-group
     aggregates of dbsp_core/aggregates.py (invariant 6 there). ``FIRST(x ORDER BY o) FILTER (WHERE c)`` orders the
     rows where c holds first and reads ``CASE WHEN c THEN x END`` (null when no row passes); STRING_AGG of
     an integer reads its VARCHAR cast; DISTINCT is taken for the one-column kinds (over the distinct
     (keys, value) pairs, as SUM(DISTINCT)), refused with an ORDER BY on another expression or two columns.
  6. The result Rel names the plain-column group keys (so ``SELECT t.a ... GROUP BY a`` works); the
     substitution map sends every group-key expression and aggregate call to its field.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat
from sqlglot import exp

from dbsp_core import aggregates as dbsp  # dbsp.count(), dbsp.sum(), ...: the public aggregate functions
from dbsp_core.sql import decimal as dec
from dbsp_core.sql.build import Builder
from dbsp_core.sql.expr import AGGREGATES, call, lit, null
from dbsp_core.sql.parse import DIALECT, ident, tname
from dbsp_core.sql.relation import Col, Rel
from dbsp_core.sql.types import is_numeric

F = pc.field
_KINDS = {exp.Count: "count", exp.Sum: "sum", exp.Min: "min", exp.Max: "max", exp.Avg: "avg",
          exp.Variance: "var_samp", exp.VariancePop: "var_pop", exp.Stddev: "stddev_samp", exp.StddevSamp: "stddev_samp",
          exp.StddevPop: "stddev_pop", exp.CovarPop: "covar_pop", exp.CovarSamp: "covar_samp", exp.Corr: "corr",
          exp.GroupConcat: "string_agg", exp.First: "first", exp.Last: "last"}
_ORDERED = ("string_agg", "first", "last")  # ORDER BY inside the call (invariant 5)


def _is_agg(n: Any) -> bool:
    return isinstance(n, AGGREGATES) or (isinstance(n, exp.Filter) and isinstance(n.this, AGGREGATES))


def aggregate_calls(builder: Builder, nodes: list[exp.Expression]) -> list[exp.Expression]:
    """The distinct aggregate calls (FILTER included) in ``nodes``, not looking into subqueries."""
    out: list[exp.Expression] = []
    # depth-first, children in order, with an explicit stack: a flat chain of thousands of terms is as deep
    stack: list[tuple[Any, exp.Expression | None]] = [(node, None) for node in reversed(nodes)]
    while stack:
        n, inside = stack.pop()
        if not isinstance(n, exp.Expression):
            continue
        if isinstance(n, (exp.Subquery, exp.Select, exp.Exists)):
            continue
        if isinstance(n, exp.AggFunc) and not isinstance(n, AGGREGATES):
            raise builder.src.error(n, f"aggregate {n.sql(dialect=DIALECT).split('(')[0]} is not supported "
                                       f"(COUNT, SUM, AVG, MIN, MAX, STDDEV[_SAMP|_POP], VARIANCE, VAR_SAMP, "
                                       f"VAR_POP, COVAR_POP, COVAR_SAMP, CORR, STRING_AGG / LISTAGG / GROUP_CONCAT, "
                                       f"FIRST and LAST are)")
        if _is_agg(n) and not (isinstance(n, AGGREGATES) and isinstance(n.parent, exp.Filter)):
            if inside is not None:
                raise builder.src.error(n, "an aggregate cannot contain another aggregate")
            if n not in out:
                out.append(n)
            stack.extend((child, n) for child in reversed(list(n.iter_expressions())))
            continue
        if isinstance(n, exp.Window):
            continue
        stack.extend((child, inside) for child in reversed(list(n.iter_expressions())))
    return out


class _Extra:
    """What a whole-group aggregate call carries besides its argument (invariant 5)."""

    def __init__(self, second: exp.Expression | None = None, separator: str = ",",
                 order: list[exp.Ordered] | None = None) -> None:
        self.second, self.separator, self.order = second, separator, order or []


def _parts(builder: Builder, node: exp.Expression
           ) -> tuple[str, exp.Expression | None, bool, exp.Expression | None, _Extra | None]:
    """(kind, argument, distinct, filter condition, the whole-group aggregate's extras) of an aggregate call."""
    cond = None
    if isinstance(node, exp.Filter):
        cond = node.expression.this if isinstance(node.expression, exp.Where) else node.expression
        node = node.this
    kind = _KINDS[type(node)]
    arg = node.this
    extra = None
    if kind in _ORDERED or kind.startswith(("var", "stddev", "covar", "corr")):
        extra = _Extra()
        if isinstance(arg, exp.Order):  # f(x ORDER BY ...)
            if kind not in _ORDERED:
                raise builder.src.error(node, f"{kind.upper()} takes no ORDER BY (its value does not depend on an "
                                              f"order)")
            extra.order, arg = list(arg.expressions), arg.this
        if kind in ("covar_pop", "covar_samp", "corr"):
            extra.second = node.args.get("expression")
            if extra.second is None or arg is None:
                raise builder.src.error(node, f"{kind.upper()} takes two arguments, e.g. {kind.upper()}(y, x)")
        if kind == "string_agg":
            sep = node.args.get("separator")
            if sep is not None:
                if not (isinstance(sep, exp.Literal) and sep.is_string):
                    raise builder.src.error(sep, "the separator of STRING_AGG must be a string literal")
                extra.separator = sep.this
        if kind in ("first", "last") and not extra.order:
            raise builder.src.error(node, f"{kind.upper()}(x) needs an ORDER BY inside the call, e.g. "
                                          f"{kind.upper()}(x ORDER BY t): a view's rows have no order, so the "
                                          f"first row is not defined (DuckDB answers with its scan order)")
    distinct = False
    if isinstance(arg, exp.Distinct):
        if len(arg.expressions) != 1:
            raise builder.src.error(node, f"{kind.upper()}(DISTINCT ...) takes one expression")
        distinct, arg = True, arg.expressions[0]
    if isinstance(arg, exp.Star):
        if kind != "count" or distinct:
            raise builder.src.error(node, f"{kind.upper()}(*) is not valid SQL")
        arg = None
    elif node.expressions:
        raise builder.src.error(node, f"{kind.upper()} takes one argument")
    elif arg is None and kind != "count":  # COUNT() is COUNT(*) in DuckDB; MAX() etc. are not functions there
        raise builder.src.error(node, f"{kind.upper()}() needs an argument, e.g. {kind.upper()}(x)")
    if distinct and extra is not None:
        if kind in ("first", "last"):
            distinct = False  # the same value either way
        elif extra.second is not None or any(o.this != arg for o in extra.order):
            raise builder.src.error(node, f"{kind.upper()}(DISTINCT ...) is supported with one argument and an "
                                          f"ORDER BY only on that argument")
    return kind, arg, distinct, cond, extra


def group_nodes(builder: Builder, node: exp.Select, items: list[tuple[str, exp.Expression]], rel: Rel
                ) -> list[exp.Expression]:
    """The GROUP BY expressions, ordinals and output aliases resolved to the expressions they stand for."""
    group = node.args.get("group")
    if group is None:
        return []
    if group.args.get("all"):
        return [e for _, e in items if not aggregate_calls(builder, [e])]
    out = []
    for g in group.expressions:
        if isinstance(g, exp.Literal) and not g.is_string and g.this.isdigit():
            k = int(g.this)
            if not 1 <= k <= len(items):
                raise builder.src.error(g, f"GROUP BY {k}: the SELECT list has {len(items)} columns")
            out.append(items[k - 1][1])
        elif (isinstance(g, exp.Column) and not g.args.get("table") and not rel.find(None, ident(g.this))
              and any(n == ident(g.this) for n, _ in items)):
            out.append(next(e for n, e in items if n == ident(g.this)))
        else:
            if isinstance(g, (exp.Cube, exp.Rollup, exp.GroupingSets)):
                raise builder.src.error(g, "GROUPING SETS, CUBE and ROLLUP are not supported")
            out.append(g)
    return out


def plan_aggregate(builder: Builder, rel: Rel, node: exp.Select | None, items: list[tuple[str, exp.Expression]],
                   aggs: list[exp.Expression], extra_keys: list[str] | None = None,
                   keyless_row: bool = True) -> tuple[Rel, dict]:
    """Invariants 1-4. ``extra_keys`` (fields of ``rel``) lead the group keys (a correlated subquery's
    correlation columns); ``keyless_row=False`` leaves out the default row of a keyless aggregate."""
    src = builder.src
    rel = _through_picks(rel)
    groups = group_nodes(builder, node, items, rel) if node is not None else []
    for g in groups:
        if aggregate_calls(builder, [g]):
            raise src.error(g, "GROUP BY cannot contain an aggregate")
    ex = builder.exprs(rel, where="GROUP BY")
    new: dict[str, pc.Expression] = {}
    keys = list(extra_keys or [])
    key_of: dict = {}

    def field_for(e: pc.Expression) -> str:
        for f in rel.schema.names:
            if e.equals(F(f)):
                return f
        for f, x in new.items():
            if e.equals(x):
                return f
        f = builder.fresh()
        new[f] = e
        return f

    for g in groups:
        f = field_for(ex.compile(g))
        key_of[g] = f
        if f not in keys:
            keys.append(f)
    # aggregate arguments (invariant 3)
    alias_of = {e: n for n, e in items if not n.startswith("__")}
    specs: list[tuple[exp.Expression, str, str | None, bool]] = []  # (call, kind, arg field, distinct)
    decimals: dict = {}  # call -> the DECIMAL type of its argument (invariant 4)
    whole: dict[exp.Expression, Any] = {}  # call -> its dbsp aggregate (the whole-group kinds, invariant 5)
    for a in aggs:
        kind, arg, distinct, cond, extra = _parts(builder, a)
        if extra is not None:
            if cond is not None and kind in ("first", "last"):  # the passing rows first (last), read as CASE
                flag = exp.Case(ifs=[exp.If(this=cond, true=exp.Literal.number(0 if kind == "first" else 1))],
                                default=exp.Literal.number(1 if kind == "first" else 0))
                extra.order = [exp.Ordered(this=flag, desc=False, nulls_first=False)] + extra.order
            if cond is not None and extra.second is not None:
                extra.second = exp.Case(ifs=[exp.If(this=cond, true=extra.second)])
        if cond is not None:
            ex.predicate(cond)
            arg = exp.Case(ifs=[exp.If(this=cond, true=arg if arg is not None else exp.Literal.number(1))])
        if arg is None:
            specs.append((a, "count", None, False))
            continue
        if extra is not None:
            f = _whole_group_fields(builder, ex, a, kind, arg, extra, field_for)
            whole[a] = _whole_group_spec(kind, f, extra, field_for, ex)
            specs.append((a, kind, f[0], distinct))
            continue
        e, t = ex.typed(arg)
        if kind in ("sum", "avg") and not (is_numeric(t) or pat.is_null(t)):
            raise src.error(a, f"{kind.upper()} needs a numeric argument, got {t}")
        if pat.is_null(t):
            e = e.cast(pa.int32())
        if pat.is_decimal(t) and kind != "count":
            decimals[a] = t
            e = dec.unscaled(e, t)
        if kind in ("min", "max"):
            distinct = False
        f = field_for(e)
        if kind in ("min", "max") and f in keys:  # the extremes strategy keeps (keys, value): a copy, not the key
            f = builder.fresh()
            new[f] = e
        specs.append((a, kind, f, distinct))
    pre = rel
    if new:  # only the fields the aggregates read cross the exchange
        needed = list(dict.fromkeys(keys + [f for _, _, f, _ in specs if f is not None]
                                    + [c for spec in whole.values() for c in spec.columns()]))
        cols = {f: (new[f] if f in new else F(f)) for f in needed}
        pre = Rel(rel.stream.select(**cols), rel.cols)
    # the aggregate operators (invariant 2)
    names: dict = {}
    used = set(keys)

    def out_name(call_node: exp.Expression) -> str:
        n = alias_of.get(call_node)
        if n is None or n in used or n.startswith("__") or n in pre.schema.names:
            n = builder.fresh()
        used.add(n)
        return n

    count_of: dict = {}  # a DECIMAL AVG's call -> the field of its count (invariant 4)
    plain: dict[str, Any] = {}
    counted: dict[str, Any] = {}
    by_distinct: dict[str, dict[str, Any]] = {}
    counts: set[str] = set()
    for call_node, kind, f, distinct in specs:
        if call_node in names:
            continue
        name = names[call_node] = out_name(call_node)
        if kind == "count":
            counts.add(name)
            if distinct:
                counted[name] = dbsp.count_distinct(f)
            else:
                plain[name] = dbsp.count(f) if f is not None else dbsp.count()
        elif call_node in whole and distinct:  # one column (checked by _parts): over distinct (keys, value)
            by_distinct.setdefault(f, {})[name] = whole[call_node]
        elif call_node in whole:
            plain[name] = whole[call_node]
        else:  # SUM / AVG (DISTINCT x) over the distinct pairs
            into = by_distinct.setdefault(f, {}) if distinct else plain
            if kind == "avg" and call_node in decimals:  # invariant 4: the exact sum and the count
                into[name] = dbsp.sum(f)
                count_of[call_node] = builder.fresh()
                into[count_of[call_node]] = dbsp.count(f)
            else:
                into[name] = getattr(dbsp, kind)(f)
    linear = all(a.kind == "count" or (a.kind in ("sum", "avg") and pat.is_integer(pre.type_of(a.column)))
                 for a in plain.values())
    if counted and (linear or not plain):
        plain.update(counted)
        counted = {}
    parts: list[tuple[Any, dict]] = []
    if plain:
        parts.append((pre.stream, plain))
    if counted:
        parts.append((pre.stream, counted))
    for f, aggs_f in by_distinct.items():
        parts.append((builder.narrow(pre, list(dict.fromkeys(keys + [f]))).distinct(), aggs_f))
    if not parts:  # GROUP BY without aggregates: the distinct keys
        out = builder.narrow(pre, keys).distinct()
        results = [out]
    else:
        results = [s.group_by(*keys).agg(**a) for s, a in parts]
    if not keys and keyless_row:
        results = [_with_default_row(builder, r, counts) for r in results]
    stream = results[0]
    for other in results[1:]:
        stream = _join_on_keys(builder, stream, other, keys)
    if decimals:
        stream = _decimal_results(stream, {names[c]: (c, t) for c, t in decimals.items()}, count_of)
    cols = [Col(ident(g.this), tname(g.args["table"]) if g.args.get("table") else None, key_of[g])
            for g in groups if isinstance(g, exp.Column)]
    for g in groups:
        if isinstance(g, exp.Column):  # also under the input's qualifiers of that column
            for c in rel.find(tname(g.args["table"]) if g.args.get("table") else None, ident(g.this)):
                cols.append(Col(c.name, c.table, key_of[g]))
    subst: dict = dict(key_of)
    subst.update(names)
    out_rel = Rel(stream, cols)
    out_rel.grouped = True  # type: ignore[attr-defined]
    out_rel.ungrouped = rel  # type: ignore[attr-defined]  # the input, to name a column that is not grouped
    out_rel.count_fields = counts  # type: ignore[attr-defined]
    return out_rel, subst


def _decimal_results(stream: Any, fields: dict, count_of: dict) -> Any:
    """Invariant 4: the aggregates of unscaled DECIMALs (``fields``: output name -> (call, type)) as decimals;
    the counts of the AVGs (``count_of``: call -> its count's field) dropped."""
    hidden = set(count_of.values())
    cols: dict[str, pc.Expression] = {}
    for n in stream.schema.names:
        if n in hidden:
            continue
        if n not in fields:
            cols[n] = F(n)
            continue
        c, t = fields[n]
        kind = _KINDS[type(c.this if isinstance(c, exp.Filter) else c)]
        if kind == "avg":
            cols[n] = dec.avg(F(n), F(count_of[c]), t)
        else:
            cols[n] = dec.from_unscaled(F(n), t.scale, dec.sum_type(t) if kind == "sum" else t)
    return stream.select(**cols)


def _whole_group_fields(builder: Builder, ex: Any, call_node: exp.Expression, kind: str, arg: exp.Expression,
                        extra: _Extra, field_for: Any) -> list[str]:
    """The fields a whole-group aggregate reads (invariant 5): its argument (a VARCHAR cast of an integer for
    STRING_AGG), then its second argument."""
    src = builder.src
    e, t = ex.typed(arg)
    if pat.is_null(t):
        e = e.cast(pa.string() if kind == "string_agg" else pa.int32())
    elif kind == "string_agg" and not (pat.is_string(t) or pat.is_large_string(t)):
        if not pat.is_integer(t):
            raise src.error(call_node, f"STRING_AGG of {t}: cast the argument to VARCHAR (only strings and "
                                       f"integers are joined as they are)")
        e = e.cast(pa.string())
    elif kind not in _ORDERED and not is_numeric(t):
        raise src.error(call_node, f"{kind.upper()} needs a numeric argument, got {t}")
    out = [field_for(e)]
    if extra.second is not None:
        e2, t2 = ex.typed(extra.second)
        if not (is_numeric(t2) or pat.is_null(t2)):
            raise src.error(call_node, f"{kind.upper()} needs numeric arguments, got {t2}")
        out.append(field_for(e2.cast(pa.int32()) if pat.is_null(t2) else e2))
    return out


def _whole_group_spec(kind: str, fields: list[str], extra: _Extra, field_for: Any, ex: Any) -> Any:
    """The dbsp aggregate of a whole-group call, its ORDER BY expressions made fields."""
    if kind in _ORDERED:
        order = []
        for o in extra.order:
            e, t = ex.typed(o.this)
            e = e.cast(pa.int32()) if pat.is_null(t) else e  # ORDER BY NULL: every row ties
            order.append((field_for(e), bool(o.args.get("desc")), bool(o.args.get("nulls_first"))))
        if kind == "string_agg":
            return dbsp.string_agg(fields[0], extra.separator, order)
        return getattr(dbsp, kind)(fields[0], order_by=order)
    return dbsp.stat(kind, fields[0], fields[1] if len(fields) > 1 else None)


def _through_picks(rel: Rel) -> Rel:
    """``rel`` read from before a select that only picks and renames columns (a subquery's SELECT list): the
    aggregate reads just the fields it names, so the select would only cost a step of its own."""
    from dbsp_core.operators.select import Select

    op = rel.stream.op
    if not isinstance(op, Select) or op.picks is None:
        return rel
    source = dict(zip(op.names, op.picks))
    from dbsp_core.circuit import Stream

    upstream = Stream(rel.stream.circuit, op.inputs[0])
    return Rel(upstream, [Col(c.name, c.table, source[c.field], c.star, c.merged) for c in rel.cols])


def _with_default_row(builder: Builder, x: Any, counts: set[str]) -> Any:
    """Invariant 1: the keyless aggregate ``x`` plus its default row while the input is empty."""
    schema = x.schema
    defaults = {f.name: (0 if f.name in counts else None) for f in schema}
    table = pa.table({f.name: pa.array([defaults[f.name]], f.type) for f in schema})
    d = builder.constant(table)
    as_default = x.select(**{f.name: (lit(defaults[f.name], f.type) if defaults[f.name] is not None else null(f.type))
                             for f in schema})
    return x + d - as_default


def _join_on_keys(builder: Builder, a: Any, b: Any, keys: list[str]) -> Any:
    """Two aggregate results side by side: joined on their keys (nulls matching), or both one row (no keys)."""
    if not keys:
        k = builder.fresh()
        a2 = a.select(**{f: F(f) for f in a.schema.names}, **{k: lit(0, pa.int64())})
        b2 = b.select(**{f: F(f) for f in b.schema.names}, **{k + "_": lit(0, pa.int64())})
        j = a2.join(b2, left_on=[k], right_on=[k + "_"])
        return j.select(**{f: F(f) for f in a.schema.names + b.schema.names})
    ren = {f: (builder.fresh() if f in keys else f) for f in b.schema.names}
    b = b.select(**{ren[f]: F(f) for f in b.schema.names})
    sa, ka = builder.null_safe(a, keys)
    sb, kb = builder.null_safe(b, [ren[k] for k in keys])
    j = sa.join(sb, left_on=ka, right_on=kb)
    return j.select(**{f: F(f) for f in a.schema.names + [ren[f] for f in ren if f not in keys]})
