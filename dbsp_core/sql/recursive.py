"""WITH clauses of the SQL planner: common table expressions, and recursive ones (``WITH RECURSIVE r AS (base UNION [ALL] step)``) compiled to a fixpoint (operators/fixpoint.py).

Invariants:
  1. A CTE is planned once, where it is defined, and every reference reads its stream (planner invariant 2).
  2. A recursive CTE is ``base UNION [ALL] step`` where only ``step`` names the CTE, exactly once (linear
     recursion, as the SQL standard requires and DuckDB evaluates: a non-linear step is refused, since DuckDB's
     and the fixed point's answers differ for it). Its value is the least fixed point of
     ``R = base + step(R)``, distinct for UNION (the body ends with a distinct) and a bag for UNION ALL.
  3. The step is planned inside the fixpoint's nested circuit: the CTE itself and every table, view or CTE the
     step names are the nested circuit's inputs; the base is one more input. The step's columns are cast to
     the base's types (the CTE's types, as SQL has them).
  4. Constructs a fixpoint cannot maintain in its step (aggregates, outer joins padding the CTE's side, semi and
     anti joins, top-k, constant rows) are refused with the position of the step and the reason. A LEFT JOIN
     that keeps the CTE's rows (the CTE not on its right) is a function of each row, so DuckDB's iterations and
     the fixed point agree: it is planned with a join and a distinct only (the unmatched rows are the rows minus
     their join with the distinct matched rows), which the fixpoint's body can run. DuckDB evaluates the recursive part over
     the rows the previous iteration added (its working table); for an aggregate or outer join over the CTE, or
     a subquery condition, that answer is not the fixed point the engine maintains, so none is accepted there.
  5. A derived table in the step's FROM that does not name the CTE is the same relation at every iteration: it
     is planned outside the fixpoint, before it, and read by the step as one more imported relation (so it may
     aggregate, join outer, filter by subqueries or take a top-k like any query).
"""

from __future__ import annotations

import pyarrow.compute as pc
from sqlglot import exp

from dbsp_core.errors import SchemaError
from dbsp_core.sql.build import Builder
from dbsp_core.sql.errors import SqlError
from dbsp_core.sql.parse import ident, tname
from dbsp_core.sql.relation import Col, Rel
from dbsp_core.sql.types import storable

F = pc.field


def _references(node: exp.Expression, name: str) -> list[exp.Table]:
    return [t for t in node.find_all(exp.Table) if isinstance(t.this, exp.Identifier) and tname(t.this) == name
            and not t.args.get("db")]


def _names(node: exp.Expression) -> list[str]:
    out = []
    for t in node.find_all(exp.Table):
        if isinstance(t.this, exp.Identifier) and not t.args.get("db"):
            out.append(tname(t.this))
        elif isinstance(t.this, exp.Anonymous):  # TUMBLE(t, ...) / HOP(t, ...)
            first = t.this.expressions[0] if t.this.expressions else None
            if isinstance(first, (exp.Column, exp.Table)):
                out.append(tname(first))
    return list(dict.fromkeys(out))


def define_ctes(builder: Builder, with_: exp.With) -> None:
    """Plan the CTEs of a WITH clause into the innermost scope (invariant 1)."""
    recursive = bool(with_.args.get("recursive"))
    frame = builder.scopes[-1]
    for cte in with_.expressions:
        alias = cte.args.get("alias")
        name = tname(alias.this)
        cols = [ident(c) for c in alias.columns] if alias is not None and alias.columns else []
        if name in frame:
            raise builder.src.error(cte, f"CTE {name!r} is defined twice")
        if recursive and _references(cte.this, name):
            rel = plan_recursive(builder, name, cols, cte.this)
        else:
            rel = builder.query(cte.this).qualified(name)
            if cols:
                if len(cols) != len(rel.cols):
                    raise builder.src.error(cte, f"CTE {name!r} names {len(cols)} columns, its query has "
                                                 f"{len(rel.cols)}")
                rel = Rel(rel.stream, [Col(n, name, c.field) for n, c in zip(cols, rel.cols)])
        frame[name] = rel


def plan_recursive(builder: Builder, name: str, cols: list[str], q: exp.Expression) -> Rel:
    """Invariants 2-4."""
    src = builder.src
    if not isinstance(q, exp.Union):
        raise src.error(q, f"recursive CTE {name!r} must be <base query> UNION [ALL] <recursive query>")
    base_node, step_node = q.this, q.expression
    for key in ("order", "limit", "offset"):  # on the UNION: DuckDB refuses them in a recursive query
        if q.args.get(key) is not None:
            raise src.error(q.args[key], f"{key.upper().replace('ORDER', 'ORDER BY')} is not allowed on the UNION of recursive CTE {name!r} "
                                         f"(apply it to the CTE's result outside it)")
    if _references(base_node, name):
        raise src.error(base_node, f"the base query of recursive CTE {name!r} (before UNION) must not name it")
    step_node = _hoist_derived_tables(builder, name, step_node)
    refs = _references(step_node, name)
    if len(refs) > 1:
        raise src.error(refs[1], f"recursive CTE {name!r} is named {len(refs)} times in its recursive query; only "
                                 f"linear recursion (one reference) is supported")
    for n in step_node.walk():
        if isinstance(n, (exp.Order, exp.Limit, exp.Offset, exp.Fetch)):
            raise src.error(n, f"ORDER BY, LIMIT and OFFSET cannot be maintained inside the recursive query of "
                               f"{name!r} (apply them to the CTE's result outside it)")
    for n in step_node.walk():
        if isinstance(n, exp.AggFunc) or isinstance(n, exp.Group):
            raise src.error(n, f"aggregates and GROUP BY over recursive CTE {name!r} cannot be maintained: DuckDB "
                               f"aggregates the rows each iteration adds, the engine maintains a fixed point, and "
                               f"the two differ (aggregate the CTE's result outside it, or aggregate a table in a "
                               f"derived table of the recursive query that does not name {name!r})")
        if isinstance(n, (exp.Exists, exp.Subquery)) or (isinstance(n, exp.In) and n.args.get("query")):
            if not (isinstance(n, exp.Subquery) and isinstance(n.parent, (exp.From, exp.Join))):
                raise src.error(n, f"subquery conditions cannot be maintained inside the recursive query of {name!r} "
                                   f"(its fixed point has no semi or anti join; a derived table in FROM that does not "
                                   f"name {name!r} can hold the subquery, joined on its key)")
        side = (n.args.get("side") or "").upper() if isinstance(n, exp.Join) else ""
        if side in ("RIGHT", "FULL") or (side == "LEFT" and _references(n.this, name)):
            raise src.error(n, f"{side} JOIN with {name!r} on its null-padded side cannot be maintained inside the "
                               f"recursive query of {name!r}: DuckDB pads against the rows each iteration adds, which "
                               f"is not the fixed point the engine maintains (a LEFT JOIN keeping {name!r}'s rows can, "
                               f"and so can a derived table in FROM that does not name {name!r})")
    base = builder.query(base_node)
    names = cols or [c.name for c in base.cols]
    if len(names) != len(base.cols):
        raise src.error(q, f"recursive CTE {name!r} names {len(names)} columns, its base query has {len(base.cols)}")
    plain = len(set(names)) == len(names) and not any(n.startswith("__") for n in names)
    fields = list(names) if plain else [f"c{i}" for i in range(len(names))]
    types = [storable(base.type_of(c.field)) for c in base.cols]
    base_stream = base.stream.select(**{f: (F(c.field) if base.type_of(c.field).equals(t) else F(c.field).cast(t))
                                        for f, c, t in zip(fields, base.cols, types)})
    if _shaped(base, fields, types):
        base_stream = base.stream
    imported = [n for n in _names(step_node) if n != name]
    outer_rels = [builder.lookup(step_node, n) for n in imported]
    distinct = q.args.get("distinct", True) is not False

    # the nested circuit's inputs: the base and the named relations, each stream once (a base that is a table the
    # step also reads is gathered once)
    streams = [base_stream] + [r.stream for r in outer_rels]
    uniq: list = []
    for st in streams:
        if not any(st.node_id == u.node_id for u in uniq):
            uniq.append(st)
    slot = [next(k for k, u in enumerate(uniq) if u.node_id == st.node_id) for st in streams]

    def body(rec, *ins):
        base_in, imps = ins[slot[0]], [ins[k] for k in slot[1:]]
        saved = builder.circuit
        builder.circuit = rec.circuit
        frame = {"__barrier__": True, name: Rel(rec, [Col(n, name, f) for n, f in zip(names, fields)])}
        for n, outer, imp in zip(imported, outer_rels, imps):
            frame[n] = Rel(imp, outer.cols)
        builder.scopes.append(frame)
        was, builder.recursive_body = builder.recursive_body, True
        try:
            step = builder.query(step_node)
        finally:
            builder.recursive_body = was
            builder.scopes.pop()
            builder.circuit = saved
        if len(step.cols) != len(fields):
            raise src.error(step_node, f"the recursive query of {name!r} has {len(step.cols)} columns, the base "
                                       f"query {len(fields)}")
        shaped = step.stream if _shaped(step, fields, types) else step.stream.select(
            **{f: (F(c.field) if step.type_of(c.field).equals(t) else F(c.field).cast(t))
               for f, c, t in zip(fields, step.cols, types)})
        return base_in + shaped

    try:
        stream = builder.circuit.recursive(body, uniq, schema=base_stream.schema, distinct=distinct)
    except SqlError:
        raise
    except SchemaError as e:
        raise src.error(step_node, f"the recursive query of {name!r} cannot be maintained: "
                                   f"{str(e).split(': ', 1)[-1]}") from None
    return Rel(stream, [Col(n, name, f) for n, f in zip(names, fields)])


def _hoist_derived_tables(builder: Builder, name: str, step: exp.Expression) -> exp.Expression:
    """Invariant 5: ``step`` (a copy) with each derived table in a FROM or JOIN that does not name ``name`` planned
    now, outside the fixpoint, and read as a table of the innermost scope under a hidden name."""
    found = [n for n in step.find_all(exp.Subquery) if isinstance(n.parent, (exp.From, exp.Join))
             and not _references(n, name) and isinstance(n.this, (exp.Select, exp.Union, exp.Except, exp.Intersect))]
    if not found:
        return step
    step = step.copy()
    found = [n for n in step.find_all(exp.Subquery) if isinstance(n.parent, (exp.From, exp.Join))
             and not _references(n, name) and isinstance(n.this, (exp.Select, exp.Union, exp.Except, exp.Intersect))]
    frame = builder.scopes[-1]
    for sub in found:
        if any(other is not sub and any(x is sub for x in other.find_all(exp.Subquery)) for other in found):
            continue  # inside another one, hoisted with it
        hidden = f"__{name}_derived_{builder.fresh()}"
        rel = builder.order_limit(sub, builder.query(sub.this)).qualified(hidden)
        frame[hidden] = rel
        table = exp.Table(this=exp.to_identifier(hidden))
        if sub.args.get("alias") is not None:
            table.set("alias", sub.args["alias"].copy())
        sub.replace(table)
    return step


def _shaped(rel: Rel, fields: list[str], types: list) -> bool:
    return (list(rel.schema.names) == fields and [c.field for c in rel.cols] == fields
            and all(rel.type_of(f).equals(t) for f, t in zip(fields, types)))
