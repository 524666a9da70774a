"""Subqueries of the SQL planner: EXISTS, IN, NOT EXISTS, NOT IN and scalar subqueries, uncorrelated or correlated by any condition, turned into semi, anti and outer joins and aggregates (decorrelated).

Invariants:
  1. A subquery is correlated when conditions of its WHERE (or its SELECT list) name columns of the enclosing
     query. When each such condition is an equality between an expression of the subquery and one of the
     enclosing query (and the SELECT list names none), these pairs become join keys; otherwise see invariant 5.
  2. A WHERE (or HAVING) conjunct ``EXISTS (q)``, ``x IN (q)`` is a semi join and ``NOT EXISTS (q)`` an anti join
     on the correlation keys (and x = the subquery's column): exactly SQL's rows, since a NULL there means the
     row is dropped, as false does.
  3. Anywhere else (under NOT, OR, CASE, in the SELECT list) ``x IN (q)`` and ``EXISTS (q)`` are values of SQL's
     three-valued logic: EXISTS is whether a correlated row exists; ``x IN (q)`` is TRUE when x equals a value of
     q, else FALSE when q (for this row's correlation) is empty, else NULL when x is NULL or q holds a NULL,
     else FALSE. They are computed by left joins with the distinct key values and with per-key counts, so
     ``NOT IN`` has SQL's NULL rules.
  4. A scalar subquery is left-joined on its correlation keys (a constant key when uncorrelated), so a row with
     no value gets NULL; an aggregate over no rows gets its SQL value (COUNT is 0). An uncorrelated scalar
     subquery must return at most one row; if it returns several, the row is repeated per value (SQL raises an
     error instead).
  5. Any other correlation goes through a domain (Neumann and Kemper, "Unnesting Arbitrary Queries"): D, the
     distinct values of the enclosing columns the subquery names, is joined with the subquery's FROM (on its
     correlated equalities, a cross join if none) and the correlated conditions filter the pairs, with those
     columns read from D; the subquery is then correlated by equality with D's columns, nulls matching nulls
     (a condition such as ``t1.b IS NULL`` can hold for a null). So every subquery is evaluated once per
     distinct correlation value, by incremental joins and aggregates, and invariants 2-4 apply unchanged.
     An aggregate over only enclosing columns (which SQL evaluates in the enclosing query) is refused.
  6. ``x op ANY (q)`` is TRUE when ``x op y`` is TRUE for a row y of q, else NULL when it is NULL for one, else
     FALSE (so FALSE when q is empty); ``x op ALL (q)`` is TRUE when no row makes it anything but TRUE, else
     FALSE when a row makes it FALSE, else NULL. Each part is an EXISTS over q with the comparison added to
     q's WHERE (or over q as a derived table when q groups, aggregates or limits), correlated by x's columns.
  7. A subquery that aggregates without GROUP BY or HAVING has exactly one row for every enclosing row, even
     when its WHERE (correlated or not) keeps none: ``EXISTS (q)`` is TRUE and ``x IN (q)`` is ``x = (q)``
     (with its NULL rules), q a scalar subquery (invariant 4: COUNT over no rows is 0).
  8. A correlated subquery's GROUP BY groups by the correlation key first, then its own keys; HAVING filters the
     groups, DISTINCT the (key, row) pairs and ORDER BY ... LIMIT k keeps a top-k per key, so each enclosing
     row sees its own groups and rows. OFFSET is refused; ORDER BY without LIMIT changes no answer, and
     EXISTS ignores a LIMIT of one or more rows.
  9. A subquery nested in a condition of a subquery may name the outermost query's columns (qualified by a table
     alias that no FROM in between defines): those columns join the middle subquery's domain, and the
     condition is applied after the domain join, where they are D's columns; the nested subquery is then
     correlated with the middle one as usual.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from sqlglot import exp

from dbsp_core import aggregates as dbsp  # dbsp.count(), dbsp.sum(), ...: the public aggregate functions
from dbsp_core.sql.aggregate import aggregate_calls, plan_aggregate
from dbsp_core.sql.build import Builder
from dbsp_core.sql.expr import call, lit, null
from dbsp_core.sql.parse import DIALECT, ident, tname
from dbsp_core.sql.relation import Col, Rel
from dbsp_core.sql.walk import columns_of, conjuncts, has_subquery, resolves

F = pc.field


class Sub:
    """A planned subquery: its (filtered) relation, the correlation pairs (inner field, outer expression), its
    SELECT list (for a plain SELECT), and the enclosing relation to join it with (``outer`` plus the null-safe
    key fields of a domain, invariant 5)."""

    def __init__(self, rel: Rel, pairs: list[tuple[str, exp.Expression]], node: exp.Expression,
                 items: list[tuple[str, exp.Expression]] | None, outer: Rel, dcols: list[Col] | None = None) -> None:
        self.rel, self.pairs, self.node, self.items, self.outer = rel, pairs, node, items, outer
        self.dcols = dcols or []  # D's columns naming the enclosing fields they copy (for the SELECT list)


def plan_sub(builder: Builder, node: exp.Expression, outer: Rel) -> Sub:
    """Invariant 1: split the subquery's WHERE into its own conditions and correlation pairs; any other
    correlation goes through a domain (invariant 5)."""
    if isinstance(node, exp.Subquery):
        node = node.this
    if not isinstance(node, exp.Select) or node.args.get("with_"):
        return Sub(builder.query(node), [], node, None, outer)
    where = conjuncts(node.args["where"].this) if node.args.get("where") else []
    inner, rest = builder.from_clause(node, where)
    own, corr = [], []
    for c in rest:
        outer_cols = [x for x in columns_of(c) if not resolves(inner, x)]
        if not outer_cols:
            own.append(c)
            continue
        if has_subquery(c):
            raise builder.src.error(c, "a correlated condition may not hold a subquery")
        for x in outer_cols:
            if not resolves(outer, x):
                raise builder.src.error(x, f"unknown column {x.sql(dialect=DIALECT)}")
        corr.append(c)
    listed = [e for e in node.expressions if not isinstance(e, exp.Star)]
    item_outer = [x for e in listed for x in columns_of(e) if not resolves(inner, x) and resolves(outer, x)]
    late = [c for c in own if _deep_refs(node, c, outer)]  # invariant 9
    if late:
        own = [c for c in own if not any(c is d for d in late)]
        return domain(builder, node, inner, own, corr, outer, late)
    if not corr and not item_outer:
        return Sub(builder.query(node), [], node, None, outer)
    if node.args.get("offset") is not None:
        raise builder.src.error(node.args["offset"], "OFFSET in a correlated subquery is not supported")
    if node.args.get("having") is not None and node.args.get("group") is None:
        raise builder.src.error(node.args["having"], "HAVING without GROUP BY in a correlated subquery is not "
                                                     "supported")
    split = [_key_pair(inner, c) for c in corr]
    if item_outer or any(p is None for p in split):
        return domain(builder, node, inner, own, corr, outer)
    pairs = [p for p in split if p is not None]
    rel = apply_where(builder, inner, own, None)
    ex = builder.exprs(rel, where="subquery")
    new, fields = {}, []
    for a, _ in pairs:
        e = ex.compile(a)
        f = next((g for g in rel.schema.names if e.equals(F(g))), None)
        if f is None:
            f = builder.fresh()
            new[f] = e
        fields.append(f)
    rel = builder.extend(rel, new)
    rel, items = _grouped(builder, node, rel, fields, builder.select_items(node, rel))
    return Sub(rel, list(zip(fields, [b for _, b in pairs])), node, items, outer)


def _grouped(builder: Builder, node: exp.Select, rel: Rel, keys: list[str], items: list[tuple[str, exp.Expression]]
             ) -> tuple[Rel, list[tuple[str, exp.Expression]]]:
    """Invariant 8: a correlated subquery's GROUP BY, HAVING, DISTINCT and ORDER BY ... LIMIT, per correlation
    key (``keys``)."""
    group, having, distinct = node.args.get("group"), node.args.get("having"), node.args.get("distinct")
    limit = node.args.get("limit")
    if group is None and distinct is None and limit is None:
        return rel, items
    if distinct is not None and distinct.args.get("on") is not None:
        raise builder.src.error(distinct, "DISTINCT ON is not supported")
    subst: dict = {}
    if group is not None:
        aggs = aggregate_calls(builder, [e for _, e in items] + ([having.this] if having is not None else []))
        rel, subst = plan_aggregate(builder, rel, node, items, aggs, extra_keys=keys)
        if having is not None:
            rel = apply_where(builder, rel, conjuncts(having.this), None, subst)
    ex = builder.exprs(rel, subst, "subquery")
    new = {builder.fresh(): ex.compile(e) for _, e in items}
    spec, order_new = [], {}
    if limit is not None:
        k = _positive_limit(builder, limit)
        if node.args.get("order") is None:
            raise builder.src.error(limit, "LIMIT needs ORDER BY (which rows a LIMIT keeps must not depend on the "
                                           "order rows arrive in)")
        aliased = {n: f for (n, _), f in zip(items, new)}
        for o in node.args["order"].expressions:
            if o.args.get("nulls_first"):
                raise builder.src.error(o, "NULLS FIRST is not supported (nulls sort last)")
            t = o.this
            if isinstance(t, exp.Column) and not t.args.get("table") and ident(t.this) in aliased and \
                    not rel.find(None, ident(t.this)):
                f = aliased[ident(t.this)]
            else:
                f = builder.fresh()
                order_new[f] = ex.compile(t)
            spec.append((f, "descending" if o.args.get("desc") else "ascending"))
    out = builder.extend(Rel(rel.stream, []), {**new, **order_new})
    stream = builder.narrow(out, list(dict.fromkeys(keys + list(new) + list(order_new))))
    if distinct is not None:
        stream = stream.distinct()
    if limit is not None:
        stream = stream.group_by(*keys).top_k(k, spec)
        if order_new:
            stream = stream.select(**{f: F(f) for f in dict.fromkeys(keys + list(new))})
    cols = [Col(f, None, f, False) for f in new]
    return Rel(stream, cols), [(n, exp.column(exp.to_identifier(f, quoted=True))) for (n, _), f in zip(items, new)]


def _key_pair(inner: Rel, c: exp.Expression) -> tuple[exp.Expression, exp.Expression] | None:
    """(inner expression, outer expression) when ``c`` equates an expression of each, else None."""
    if not isinstance(c, exp.EQ):
        return None
    for a, b in ((c.this, c.expression), (c.expression, c.this)):
        if columns_of(a) and all(resolves(inner, x) for x in columns_of(a)) and \
                all(not resolves(inner, x) for x in columns_of(b)):
            return a, b
    return None


def _deep_refs(node: exp.Select, c: exp.Expression, outer: Rel) -> list[exp.Column]:
    """Invariant 9: the columns of the enclosing query that subqueries nested in the condition ``c`` of the
    subquery ``node`` name (qualified by a table alias that no FROM inside ``node`` defines)."""
    if not has_subquery(c):
        return []
    inside = {tname(t.args["alias"].this) if t.args.get("alias") is not None and t.args["alias"].this is not None
              else tname(t.this) for t in node.find_all(exp.Table)}
    inside |= {tname(q.args["alias"].this) for q in node.find_all(exp.Subquery)
               if q.args.get("alias") is not None and q.args["alias"].this is not None}
    shallow = {id(x) for x in columns_of(c)}
    return [x for x in c.find_all(exp.Column) if id(x) not in shallow and x.args.get("table") is not None
            and tname(x.args["table"]) not in inside and resolves(outer, x)]


def domain(builder: Builder, node: exp.Select, inner: Rel, own: list[exp.Expression], corr: list[exp.Expression],
           outer: Rel, late: list[exp.Expression] | None = None) -> Sub:
    """Invariant 5: the subquery over its FROM joined with the domain D (the distinct values of the enclosing
    columns it names), its correlated conditions ordinary conditions on the join; correlated to the enclosing
    query by equality with D's columns, nulls matching nulls."""
    dname: dict[str, str] = {}  # outer field -> D field

    def outer_refs(e: exp.Expression) -> list[exp.Column]:
        return [x for x in columns_of(e) if not resolves(inner, x) and resolves(outer, x)]

    def field_of(x: exp.Column) -> str:
        hits = outer.find(tname(x.args["table"]) if x.args.get("table") else None, ident(x.this))
        if len({c.field for c in hits}) != 1:
            raise builder.src.error(x, f"column {x.sql(dialect=DIALECT)} is ambiguous")
        f = hits[0].field
        if f not in dname:
            dname[f] = builder.fresh()
        return dname[f]

    def rewrite(e: exp.Expression) -> exp.Expression:
        """``e`` with its enclosing-query columns naming D's columns (not inside nested subqueries)."""
        e = e.copy()
        refs = {id(x): field_of(x) for x in outer_refs(e)}
        if not refs:
            return e
        return e.transform(lambda n: exp.column(exp.to_identifier(refs[id(n)], quoted=True))
                           if id(n) in refs else n, copy=False)

    def rewrite_deep(c: exp.Expression) -> exp.Expression:
        """``c`` with the enclosing columns its nested subqueries name (invariant 9) naming D's columns."""
        c = c.copy()
        refs = {id(x): field_of(x) for x in _deep_refs(node, c, outer)}
        return c.transform(lambda n: exp.column(exp.to_identifier(refs[id(n)], quoted=True))
                           if id(n) in refs else n, copy=False)

    late = [rewrite_deep(c) for c in late or []]
    keys, residual = [], []
    for c in corr:
        p = _key_pair(inner, c)
        if p is not None:
            keys.append((p[0], rewrite(p[1])))
        else:
            residual.append(rewrite(c))
    listed = [e for e in node.expressions if not isinstance(e, exp.Star)]
    for agg in aggregate_calls(builder, listed):
        cols = columns_of(agg)
        if cols and all(not resolves(inner, x) for x in cols):
            raise builder.src.error(agg, "an aggregate of only enclosing-query columns inside a subquery is not "
                                         "supported")
    for e in listed:
        for x in outer_refs(e):
            field_of(x)
    ofields = list(dname)
    d = outer.stream.select(**{dname[f]: F(f) for f in ofields}).distinct()
    drel = Rel(d, [Col(dname[f], None, dname[f], False) for f in ofields])
    rel = apply_where(builder, inner, own, None)
    if keys:
        left, right, lk, rk = builder.key_fields(rel, drel, keys)
    else:  # no equality: every domain value with every row (the residual conditions filter the pairs)
        k = builder.fresh()
        left, right, lk, rk = builder.with_key(rel, k), builder.with_key(drel, k + "_"), [k], [k + "_"]
    joined = Rel(left.stream.join(right.stream, left_on=lk, right_on=rk), rel.cols + drel.cols)
    joined = apply_where(builder, builder.filter(joined, residual), late, None)
    s, ikeys = builder.null_safe(joined.stream, [dname[f] for f in ofields])
    rel = Rel(s, joined.cols)
    o, okeys = builder.null_safe(outer.stream, ofields)
    outer2 = Rel(o, outer.cols + [Col(k, None, k, False) for k in okeys])
    items = [(n, rewrite(e)) for n, e in builder.select_items(node, rel)]
    rel, items = _grouped(builder, node, rel, ikeys, items)
    pairs = [(i, exp.column(exp.to_identifier(k, quoted=True))) for i, k in zip(ikeys, okeys)]
    return Sub(rel, pairs, node, items, outer2, [Col(dname[f], None, f, False) for f in ofields])


def _one_column(builder: Builder, sub: Sub, what: str) -> tuple[Rel, str]:
    """The subquery's single output column as a field of its relation."""
    if sub.items is None:
        if len(sub.rel.cols) != 1:
            raise builder.src.error(sub.node, f"{what} needs a subquery of one column, not {len(sub.rel.cols)}")
        return sub.rel, sub.rel.cols[0].field
    if len(sub.items) != 1:
        raise builder.src.error(sub.node, f"{what} needs a subquery of one column, not {len(sub.items)}")
    e = builder.exprs(sub.rel, where="subquery").compile(sub.items[0][1])
    f = next((g for g in sub.rel.schema.names if e.equals(F(g))), None)
    if f is None:
        f = builder.fresh()
        return builder.extend(sub.rel, {f: e}), f
    return sub.rel, f


def _keys(builder: Builder, rel: Rel, inner: Rel, outer_nodes: list[exp.Expression], inner_fields: list[str]
          ) -> tuple[Rel, Rel, list[str], list[str]]:
    """Key fields on both sides for outer expressions = inner fields (a constant key when there are none)."""
    if not outer_nodes:
        k = builder.fresh()
        return builder.with_key(rel, k), builder.with_key(inner, k + "_"), [k], [k + "_"]
    fields, copies = [], {}  # a field keying twice (x IN (SELECT v ... WHERE v = o.v)) keys as a copy: join
    for f in inner_fields:   # keys are distinct fields
        if f in fields:
            g = builder.fresh()
            copies[g] = F(f)
            fields.append(g)
        else:
            fields.append(f)
    if copies:
        inner = builder.extend(inner, copies)
    pairs = [(o, exp.column(exp.to_identifier(f, quoted=True))) for o, f in zip(outer_nodes, fields)]
    named = Rel(inner.stream, inner.cols + [Col(f, None, f, False) for f in fields])
    return builder.key_fields(rel, named, pairs)


def semi(builder: Builder, rel: Rel, node: exp.Expression, anti: bool) -> Rel:
    """Invariant 2."""
    if isinstance(node, exp.Exists):
        sub = plan_sub(builder, _exists_query(builder, node.this), rel)
        inner, extra_o, extra_i = sub.rel, [], []
    else:
        sub = plan_sub(builder, node.args["query"], rel)
        inner, y = _one_column(builder, sub, "IN")
        extra_o, extra_i = [node.this], [y]
    rel2, inner2, lk, rk = _keys(builder, sub.outer, inner, [o for _, o in sub.pairs] + extra_o,
                                 [f for f, _ in sub.pairs] + extra_i)
    keys = builder.narrow(inner2, rk)
    s = rel2.stream.anti_join(keys, left_on=lk, right_on=rk) if anti else \
        rel2.stream.semi_join(keys, left_on=lk, right_on=rk)
    return Rel(s, rel.cols)


def mark(builder: Builder, rel: Rel, node: exp.Expression) -> tuple[Rel, str]:
    """Invariant 3: ``rel`` plus a boolean field holding the value of ``EXISTS (q)`` or ``x IN (q)``."""
    is_in = isinstance(node, exp.In)
    sub = plan_sub(builder, node.args["query"] if is_in else _exists_query(builder, node.this), rel)
    inner, y = _one_column(builder, sub, "IN") if is_in else (sub.rel, None)
    corr_i = [f for f, _ in sub.pairs]
    corr_o = [o for _, o in sub.pairs]
    # M: the distinct (correlation, value) pairs of q, each with a marker
    m_fields = list(dict.fromkeys(corr_i + ([y] if y is not None else [])))
    values = inner if y is None else Rel(inner.stream.filter(call("is_valid", F(y))), inner.cols)
    marker = builder.fresh()
    if m_fields:
        m = builder.narrow(values, m_fields).distinct().select(**{f: F(f) for f in m_fields}, **{marker: lit(True)})
    else:  # uncorrelated EXISTS: whether q has a row at all
        m = values.stream.group_by().agg(**{builder.fresh(): dbsp.count()}).select(**{marker: lit(True)})
    base = sub.outer
    m_rel = builder.disjoint(base, Rel(m, [Col(f, None, f, False) for f in m_fields + [marker]]))
    fm = {c.name: c.field for c in m_rel.cols}
    rel2, m2, lk, rk = _keys(builder, base, m_rel, corr_o + ([node.this] if is_in else []), [fm[f] for f in corr_i]
                             + ([fm[y]] if is_in else []))
    out = Rel(rel2.stream.left_join(m2.stream, left_on=lk, right_on=rk), base.cols)
    matched = call("coalesce", F(fm[marker]), lit(False))
    f = builder.fresh()
    if not is_in:
        return builder.extend(Rel(out.stream, rel.cols), {f: matched}), f
    # per correlation key: how many rows q has, how many non-null values
    cnt, nn = builder.fresh(), builder.fresh()
    aggs = {cnt: dbsp.count(), nn: dbsp.count(y)}
    stats = inner.stream.group_by(*corr_i).agg(**aggs) if corr_i else inner.stream.group_by().agg(**aggs)
    s_rel = builder.disjoint(out, Rel(stats, [Col(g, None, g, False) for g in stats.schema.names]))
    fs = {c.name: c.field for c in s_rel.cols}
    out2, s2, lk2, rk2 = _keys(builder, out, s_rel, corr_o, [fs[g] for g in corr_i])
    joined = Rel(out2.stream.left_join(s2.stream, left_on=lk2, right_on=rk2), rel.cols)
    n_all = call("coalesce", F(fs[cnt]), lit(0, pa.int64()))
    n_val = call("coalesce", F(fs[nn]), lit(0, pa.int64()))
    x = builder.exprs(out2, where="IN").compile(node.this)
    value = call("if_else", matched, lit(True),
                 call("if_else", call("equal", n_all, lit(0, pa.int64())), lit(False),
                      call("if_else", call("or_kleene", call("is_null", x), call("less", n_val, n_all)),
                           null(pa.bool_()), lit(False))))
    return builder.extend(joined, {f: value}), f


def scalar(builder: Builder, rel: Rel, node: exp.Subquery) -> tuple[Rel, str]:
    """Invariant 4: ``rel`` plus the field holding the scalar subquery's value."""
    sub = plan_sub(builder, node, rel)
    corr_i = [f for f, _ in sub.pairs]
    corr_o = [o for _, o in sub.pairs]
    if sub.items is not None and len(sub.items) != 1:
        raise builder.src.error(sub.node, f"a scalar subquery has one column, not {len(sub.items)}")
    aggs = aggregate_calls(builder, [sub.items[0][1]]) if sub.items is not None else []
    if not aggs:  # a plain value (per correlation key)
        inner, y = _one_column(builder, sub, "a scalar subquery")
        fields = list(dict.fromkeys(corr_i + [y]))
        vals = builder.disjoint(sub.outer, Rel(builder.narrow(inner, fields),
                                               [Col(g, None, g, False) for g in fields]))
        fv = {c.name: c.field for c in vals.cols}
        rel2, v2, lk, rk = _keys(builder, sub.outer, vals, corr_o, [fv[g] for g in corr_i])
        return Rel(rel2.stream.left_join(v2.stream, left_on=lk, right_on=rk), rel.cols), fv[y]
    item = sub.items[0][1]
    grouped, subst = plan_aggregate(builder, sub.rel, None, sub.items, aggs, extra_keys=corr_i, keyless_row=False)
    counts = getattr(grouped, "count_fields", set())
    g = builder.disjoint(sub.outer, Rel(grouped.stream, [Col(f, None, f, False) for f in grouped.schema.names]))
    fg = {c.name: c.field for c in g.cols}
    rel2, g2, lk, rk = _keys(builder, sub.outer, g, corr_o, [fg[f] for f in corr_i])
    j = Rel(rel2.stream.left_join(g2.stream, left_on=lk, right_on=rk), rel.cols)
    fixes, subst2 = {}, {}
    for a in aggs:
        f = fg[subst[a]]
        if subst[a] in counts:  # COUNT over no rows is 0 (invariant 4)
            c = builder.fresh()
            fixes[c] = call("coalesce", F(f), lit(0, pa.int64()))
            f = c
        subst2[a] = f
    j = builder.extend(j, fixes)
    e = builder.exprs(Rel(j.stream, j.cols + sub.dcols), subst2, "scalar subquery").compile(item)
    f = builder.fresh()
    return builder.extend(j, {f: e}), f


def _subqueries(node: exp.Expression) -> list[exp.Expression]:
    """The outermost subquery nodes of an expression: EXISTS, IN (query) and scalar subqueries."""
    out = []

    def walk(n: Any) -> None:
        if not isinstance(n, exp.Expression):
            return
        if isinstance(n, exp.Exists) or (isinstance(n, exp.In) and n.args.get("query") is not None) or \
                quantifier(n) is not None:
            out.append(n)
            return
        if isinstance(n, exp.Subquery):
            out.append(n)
            return
        if isinstance(n, exp.Select):
            return
        for c in n.iter_expressions():
            walk(c)

    walk(node)
    return out


def with_subqueries(builder: Builder, rel: Rel, nodes: list[exp.Expression], subst: dict | None
                    ) -> tuple[Rel, dict]:
    """``rel`` plus a field per subquery in ``nodes`` (marks and scalar values), and the map to them."""
    subst = dict(subst or {})
    for node in nodes:
        for s in _subqueries(node):
            if s in subst:
                continue
            one = _one_row(builder, s)
            if one is not None:  # invariant 7
                rel, subst = with_subqueries(builder, rel, [one], subst)
                f = builder.fresh()
                rel = builder.extend(rel, {f: builder.exprs(rel, subst, "IN").compile(one)})
            elif isinstance(s, exp.Subquery):
                rel, f = scalar(builder, rel, s)
            elif quantifier(s) is not None:
                rel, value = quantified(builder, rel, s)
                rel, subst = with_subqueries(builder, rel, [value], subst)
                f = builder.fresh()
                rel = builder.extend(rel, {f: builder.exprs(rel, subst, "ANY / ALL").compile(value)})
            else:
                rel, f = mark(builder, rel, s)
            subst[s] = f
    return rel, subst


def apply_where(builder: Builder, rel: Rel, conds: list[exp.Expression], outer: Rel | None,
                subst: dict | None = None) -> Rel:
    """The WHERE (or HAVING) conjuncts over ``rel``: subquery conjuncts as semi and anti joins (invariant 2),
    the others, with any subqueries they hold, as one filter."""
    plain = []
    for c in conds:
        one = _one_row(builder, c.this if isinstance(c, exp.Not) else c)
        if subst and c in subst:
            plain.append(c)
        elif one is not None:  # invariant 7
            plain.append(exp.false() if isinstance(c, exp.Not) and isinstance(c.this, exp.Exists) else
                         exp.Not(this=one) if isinstance(c, exp.Not) else one)
        elif isinstance(c, exp.Exists):
            rel = semi(builder, rel, c, anti=False)
        elif isinstance(c, exp.Not) and isinstance(c.this, exp.Exists):
            rel = semi(builder, rel, c.this, anti=True)
        elif isinstance(c, exp.In) and c.args.get("query") is not None:
            rel = semi(builder, rel, c, anti=False)
        elif quantifier(c) is not None:  # true for some row (ANY) / for no row not true (ALL)
            rel, exists = quantified(builder, rel, c, where=True)
            anti = isinstance(exists, exp.Not)
            rel = semi(builder, rel, exists.this if anti else exists, anti=anti)
        else:
            plain.append(c)
    if any(has_subquery(c) for c in plain):
        rel, subst = with_subqueries(builder, rel, plain, subst)
    return builder.filter(rel, plain, subst)


def scalar_subqueries(builder: Builder, rel: Rel, nodes: list[exp.Expression], subst: dict) -> tuple[Rel, dict]:
    """The subqueries of the SELECT list (invariants 3 and 4)."""
    if not any(has_subquery(n) for n in nodes):
        return rel, subst
    return with_subqueries(builder, rel, nodes, subst)


COMPARISONS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)


def quantifier(node: Any) -> exp.Expression | None:
    """The ANY or ALL of a comparison ``x op ANY (q)`` / ``x op ALL (q)``, else None."""
    if isinstance(node, COMPARISONS) and isinstance(node.expression, (exp.Any, exp.All)):
        return node.expression
    return None


def quantified(builder: Builder, rel: Rel, node: exp.Expression, where: bool = False
               ) -> tuple[Rel, exp.Expression]:
    """Invariant 6: ``x op ANY|ALL (q)`` as an expression of EXISTS subqueries over q with ``x op y`` added to
    q's WHERE (``rel`` gains hidden names for x's columns, so q's own columns cannot capture them). With
    ``where`` (a WHERE conjunct, where NULL drops the row as FALSE does) the one EXISTS or NOT EXISTS that
    decides it."""
    q = quantifier(node)
    is_all = isinstance(q, exp.All)
    query = q.this.this if isinstance(q.this, exp.Subquery) else q.this
    if not isinstance(query, exp.Query):
        raise builder.src.error(q, f"{'ALL' if is_all else 'ANY'} needs a subquery")
    x = node.this.copy()
    if has_subquery(x):
        raise builder.src.error(node.this, "the left side of ANY / ALL may not hold a subquery")
    hidden, names = [], {}
    for c in columns_of(x):
        hits = rel.find(tname(c.args["table"]) if c.args.get("table") else None, ident(c.this))
        if len({h.field for h in hits}) != 1:
            builder.exprs(rel, where="ANY / ALL").compile(c)  # raises the unknown or ambiguous column error
        names[id(c)] = builder.fresh()
        hidden.append(Col(names[id(c)], None, hits[0].field, False))
    x = x.transform(lambda n: exp.column(exp.to_identifier(names[id(n)], quoted=True)) if id(n) in names else n,
                    copy=False)
    rel = Rel(rel.stream, rel.cols + hidden)
    simple = isinstance(query, exp.Select) and query.args.get("from_") is not None and \
        len(query.expressions) == 1 and not isinstance(query.expressions[0], exp.Star) and \
        not any(query.args.get(k) for k in ("group", "having", "limit", "offset", "with_", "qualify")) \
        and not aggregate_calls(builder, list(query.expressions))  # DISTINCT, ORDER BY: no change to ANY / ALL

    def exists(cond: Any) -> exp.Exists:
        """EXISTS (q's rows where ``cond(y)`` holds), y the value of q's row."""
        if simple:
            y = query.expressions[0]
            y = y.this if isinstance(y, exp.Alias) else y
            sel = query.copy()
            old = sel.args.get("where")
            c = cond(y.copy())
            sel.set("where", exp.Where(this=exp.and_(old.this, c) if old is not None else c))
            sel.set("expressions", [exp.Literal.number(1)])
            sel.set("distinct", None)
            sel.set("order", None)
        else:  # SELECT 1 FROM (q) AS _q(_y) WHERE cond(_q._y)
            t, v = builder.fresh(), builder.fresh()
            alias = exp.TableAlias(this=exp.to_identifier(t, quoted=True),
                                   columns=[exp.to_identifier(v, quoted=True)])
            sel = exp.select(exp.Literal.number(1)).from_(exp.Subquery(this=query.copy(), alias=alias)).where(
                cond(exp.column(exp.to_identifier(v, quoted=True), table=exp.to_identifier(t, quoted=True))))
        return exp.Exists(this=sel)

    def cmp(y: exp.Expression) -> exp.Expression:
        return type(node)(this=x.copy(), expression=y)

    def not_true(y: exp.Expression) -> exp.Expression:
        return exp.Not(this=exp.Paren(this=exp.Coalesce(this=cmp(y), expressions=[exp.false()])))

    if where:
        return rel, (exp.Not(this=exists(not_true)) if is_all else exists(cmp))
    if is_all:  # TRUE when no row is not TRUE, else FALSE when a row is FALSE, else NULL
        value = exp.Case(ifs=[exp.If(this=exp.Not(this=exists(not_true)), true=exp.true()),
                              exp.If(this=exists(lambda y: exp.Not(this=exp.Paren(this=cmp(y)))), true=exp.false())],
                         default=exp.Null())
    else:  # TRUE when a row is TRUE, else NULL when a row is NULL, else FALSE
        value = exp.Case(ifs=[exp.If(this=exists(cmp), true=exp.true()),
                              exp.If(this=exists(lambda y: exp.Is(this=cmp(y), expression=exp.Null())),
                                     true=exp.Null())],
                         default=exp.false())
    return rel, value


def _one_row(builder: Builder, node: exp.Expression) -> exp.Expression | None:
    """Invariant 7: for ``EXISTS (q)`` or ``x IN (q)`` where q aggregates without GROUP BY or HAVING (one row
    for every enclosing row), the equivalent TRUE or ``x = (q)``; else None."""
    if isinstance(node, exp.Exists):
        q = node.this
    elif isinstance(node, exp.In) and node.args.get("query") is not None:
        q = node.args["query"]
    else:
        return None
    q = q.this if isinstance(q, exp.Subquery) else q
    if not isinstance(q, exp.Select) or any(q.args.get(k) for k in ("group", "having", "limit", "offset", "with_")) \
            or not aggregate_calls(builder, list(q.expressions)):
        return None
    if isinstance(node, exp.Exists):
        return exp.true()
    return exp.EQ(this=node.this, expression=exp.Subquery(this=q))


def _positive_limit(builder: Builder, limit: exp.Expression) -> int:
    lim = limit.expression if isinstance(limit, exp.Limit) else limit
    if not (isinstance(lim, exp.Literal) and not lim.is_string and lim.this.isdigit()) or int(lim.this) < 1:
        raise builder.src.error(limit, "LIMIT needs a positive integer literal")
    return int(lim.this)


def _exists_query(builder: Builder, q: exp.Expression) -> exp.Expression:
    """The query of ``EXISTS (q)`` without a LIMIT of one or more rows (and its ORDER BY): whether q has a row
    does not depend on them."""
    sel = q.this if isinstance(q, exp.Subquery) else q
    if not isinstance(sel, exp.Select) or sel.args.get("limit") is None or sel.args.get("offset") is not None:
        return q
    _positive_limit(builder, sel.args["limit"])
    sel = sel.copy()
    sel.set("limit", None)
    sel.set("order", None)
    return sel
