"""The SQL planner: queries (SELECT, set operations, VALUES, CTEs) turned into streams of the circuit, through the same Stream methods a hand-written circuit uses.

Invariants:
  1. Every query plans to a Rel whose stream's integral, after every step, is the query's result (a bag) over
     the integrated inputs: linear clauses map to linear operators (filter, select, ``+``), the others to the
     incremental operators (join, outer/semi/anti join, distinct, aggregate, top-k, fixpoint).
  2. A relation referenced twice (a view, a CTE, a table) is one stream read twice, never planned again.
  3. A FROM clause is planned by joinplan.py: conditions pushed to the inputs they read, equalities between
     inputs (in ON and WHERE) as keys, inner joins ordered along them; the remaining conditions filter the pairs. An outer join whose condition has more than equalities pads the
     rows with no pair passing the whole condition (found by an anti join, null-safe, on all their columns).
  4. The planner adds no operator a hand-written circuit would not need: a projection that only repeats the
     stream's columns is no operator, an aggregate over plain columns needs no projection before it.
  5. Constructs the planner does not handle raise SqlError at their position (errors.py).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat
from sqlglot import exp

from dbsp_core.circuit import Stream
from dbsp_core.sql.aggregate import aggregate_calls, plan_aggregate
from dbsp_core.sql.build import Builder
from dbsp_core.sql.expr import Exprs, call, null
from dbsp_core.sql.joinplan import plan_from
from dbsp_core.sql.parse import ident, interval_value, tname
from dbsp_core.sql.recursive import define_ctes
from dbsp_core.sql.relation import Col, Rel, SchemaRel
from dbsp_core.sql.subquery import apply_where, scalar_subqueries
from dbsp_core.sql.types import common_type, storable
from dbsp_core.sql.walk import columns_of, conjuncts, has_subquery, resolves

F = pc.field


class Planner(Builder):
    """Plans the views of one SQL program into one circuit (see the module docstring); the compile's state and
    the helpers it shares with the clause modules are the Builder's (build.py)."""

    # ---- queries ----

    def query(self, node: exp.Expression, outer: Rel | None = None) -> Rel:
        """Any query expression (invariant 1)."""
        with_ = node.args.get("with_") if isinstance(node, exp.Expression) else None
        if with_ is not None:
            self.scopes.append({})
            try:
                define_ctes(self, with_)
                inner = node.copy()
                inner.set("with_", None)
                return self.query(inner, outer)
            finally:
                self.scopes.pop()
        if isinstance(node, exp.Subquery):
            rel = self.query(node.this, outer)
            return self.order_limit(node, rel)
        if isinstance(node, exp.Select):
            return self.select(node, outer)
        if isinstance(node, (exp.Union, exp.Except, exp.Intersect)):
            return self.order_limit(node, self.setop(node))
        if isinstance(node, exp.Values):
            return self.values(node)
        raise self.src.error(node, f"{type(node).__name__} is not a query this compiler supports")

    # ---- SELECT ----

    def select(self, node: exp.Select, outer: Rel | None = None) -> Rel:
        distinct = node.args.get("distinct")
        if distinct is not None and distinct.args.get("on") is not None:
            raise self.src.error(distinct, "DISTINCT ON is not supported")
        for key in ("qualify", "windows", "prewhere", "sample", "laterals", "pivots"):
            if node.args.get(key):
                raise self.src.error(node.args[key] if isinstance(node.args[key], exp.Expression) else node,
                                     f"{key.upper()} is not supported")
        where = conjuncts(node.args["where"].this) if node.args.get("where") else []
        ranked = self.ranked_subquery(node, where)
        if ranked is not None:
            rel, where = ranked
        else:
            rel, where = self.from_clause(node, where)
        rel = apply_where(self, rel, where, outer)
        items = self.select_items(node, rel)
        having = node.args.get("having")
        if having is not None:
            having = self.output_aliases(having, items, rel)
        order = node.args.get("order")
        aggs = aggregate_calls(self, [e for _, e in items] + ([having.this] if having else []))
        subst: dict = {}
        if node.args.get("group") is not None or aggs:
            rel, subst = plan_aggregate(self, rel, node, items, aggs)
        if having is not None:
            if node.args.get("group") is None and not aggs:
                raise self.src.error(having, "HAVING needs GROUP BY or an aggregate")
            rel = apply_where(self, rel, conjuncts(having.this), outer, subst)
        rel, subst = scalar_subqueries(self, rel, [e for _, e in items], subst)
        out = self.project(rel, items, subst, order, node.args.get("limit") is not None)
        if distinct is not None:
            out = Rel(out.stream.distinct(), out.cols)
        return self.order_limit(node, out, rel, subst)

    def output_aliases(self, having: exp.Having, items: list[tuple[str, exp.Expression]], rel: Rel) -> exp.Having:
        """HAVING with each unqualified name that is no input column but an output alias replaced by the aliased
        expression (DuckDB: ``SELECT a AS k ... HAVING count(*) NOT IN (k)``)."""
        aliased = {n: e for n, e in items if not n.startswith("__")}

        def is_alias(n: exp.Expression) -> bool:
            return (isinstance(n, exp.Column) and not n.args.get("table") and isinstance(n.this, exp.Identifier)
                    and ident(n.this) in aliased and not rel.find(None, ident(n.this)))

        if not any(is_alias(n) for n in having.walk()):
            return having  # the same node: positions and memos stay those of the text
        return having.transform(lambda n: aliased[ident(n.this)].copy() if is_alias(n) else n)

    def project(self, rel: Rel, items: list[tuple[str, exp.Expression]], subst: dict,
                order: exp.Order | None = None, keep_order: bool = False) -> Rel:
        """The SELECT list over ``rel`` as a new Rel (output fields named after the columns, made unique); with
        ``keep_order`` the ORDER BY expressions that are not output columns become extra (hidden) fields."""
        ex = self.exprs(rel, subst, "SELECT")
        fields: dict[str, pc.Expression] = {}
        cols = []
        for name, node in items:
            e, t = ex.typed(node)
            if pat.is_null(t):
                e = e.cast(storable(t))
            same = next((f for f, x in fields.items() if x.equals(e)), None)
            if same is not None:  # the same expression twice is one field read by two columns (view_output
                cols.append(Col(name, None, same))  # names them apart)
                continue
            field = name if name and not name.startswith("__") and name not in fields else None
            if field is None:  # a hidden column: keep its source field's name when it is free
                src_field = next((f for f in rel.schema.names if e.equals(F(f))), None)
                taken = set(fields) | {n for n, _ in items}
                field = src_field if src_field is not None and src_field not in taken else self.fresh()
            fields[field] = e
            cols.append(Col(name, None, field))
        hidden = []
        if keep_order and order is not None:
            out_names = [n for n, _ in items]
            for o in order.expressions:
                key = o.this
                if self.order_target(key, items) is None:
                    f = self.fresh()
                    fields[f] = ex.compile(key)
                    hidden.append((o, f))
        if list(fields) == list(rel.schema.names) and all(e.equals(F(f)) for f, e in fields.items()):
            stream = rel.stream  # invariant 4
        else:
            stream = rel.stream.select(**fields)
        out = Rel(stream, cols)
        out.hidden_order = hidden  # type: ignore[attr-defined]
        return out

    @staticmethod
    def order_target(key: exp.Expression, items: list[tuple[str, exp.Expression]]) -> int | None:
        """The output column an ORDER BY key names: an ordinal, an output alias, or a listed expression."""
        if isinstance(key, exp.Literal) and not key.is_string and key.this.isdigit():
            return int(key.this) - 1
        if isinstance(key, exp.Column) and not key.args.get("table"):
            for i, (name, _) in enumerate(items):
                if name == ident(key.this):
                    return i
        for i, (_, e) in enumerate(items):
            if e == key:
                return i
        return None

    def order_limit(self, node: exp.Expression, out: Rel, rel: Rel | None = None, subst: dict | None = None) -> Rel:
        """ORDER BY ... LIMIT k as a top-k over the whole result; ORDER BY alone does nothing (a view has no order)."""
        limit = node.args.get("limit")
        if node.args.get("offset") is not None:
            raise self.src.error(node.args["offset"], "OFFSET is not supported (LIMIT is, with ORDER BY)")
        if limit is None:
            return out
        order = node.args.get("order")
        if order is None:
            raise self.src.error(limit, "LIMIT needs ORDER BY (which rows a LIMIT keeps must not depend on the "
                                        "order rows arrive in)")
        lim = limit.expression if isinstance(limit, exp.Limit) else limit
        if not (isinstance(lim, exp.Literal) and not lim.is_string and lim.this.isdigit()) or int(lim.this) < 1:
            raise self.src.error(limit, "LIMIT needs a positive integer literal")
        k = int(lim.this)
        items = [(c.name, exp.column(exp.to_identifier(c.name, quoted=True))) for c in out.cols]
        hidden = dict((id(o), f) for o, f in getattr(out, "hidden_order", []))
        spec = []
        for o in order.expressions:
            if o.args.get("nulls_first"):
                raise self.src.error(o, "NULLS FIRST is not supported (nulls sort last)")
            i = self.order_target(o.this, items)
            if i is not None:
                field = out.cols[i].field
            elif id(o) in hidden:
                field = hidden[id(o)]
            else:
                raise self.src.error(o, "ORDER BY with LIMIT must name output columns (or be part of a SELECT)")
            spec.append((field, "descending" if o.args.get("desc") else "ascending"))
        top = out.stream.group_by().top_k(k, spec)
        if hidden:
            top = top.select(**{c.field: F(c.field) for c in out.cols})
        return Rel(top, out.cols)

    # ---- ranking (top-k per partition) ----

    def ranked_subquery(self, node: exp.Select, where: list[exp.Expression]
                        ) -> tuple[Rel, list[exp.Expression]] | None:
        """``SELECT ... FROM (SELECT ..., ROW_NUMBER() OVER (PARTITION BY p ORDER BY o) AS rn FROM ...) WHERE rn <= k``
        (or RANK(), which keeps ties) as a top-k per partition; the rank itself cannot be selected."""
        from_ = node.args.get("from_")
        if from_ is None or node.args.get("joins") or not isinstance(from_.this, exp.Subquery):
            return None
        sub = from_.this
        inner = sub.this
        if not isinstance(inner, exp.Select):
            return None
        wins = [(i, it) for i, it in enumerate(inner.expressions)
                if isinstance(it, exp.Alias) and isinstance(it.this, exp.Window)]
        if not wins:
            return None
        if len(wins) > 1:
            raise self.src.error(wins[1][1], "one ranking window per subquery is supported")
        i, item = wins[0]
        alias, w = ident(item.args["alias"]), item.this
        if not isinstance(w.this, (exp.RowNumber, exp.Rank)):
            raise self.src.error(w, "window functions are supported only as ROW_NUMBER() or RANK() <= k (a top-k)")
        if w.args.get("spec") is not None:
            raise self.src.error(w, "window frames are not supported")
        k, used = None, None
        for c in where:
            lhs, rhs, op = c.this if isinstance(c, exp.Binary) else None, getattr(c, "expression", None), type(c)
            if isinstance(rhs, exp.Column) and isinstance(lhs, exp.Literal):  # k >= rn
                lhs, rhs = rhs, lhs
                op = {exp.GTE: exp.LTE, exp.GT: exp.LT, exp.EQ: exp.EQ}.get(op)
            if (isinstance(lhs, exp.Column) and ident(lhs.this) == alias and isinstance(rhs, exp.Literal)
                    and not rhs.is_string and rhs.this.isdigit()):
                n = int(rhs.this)
                k = {exp.LTE: n, exp.LT: n - 1, exp.EQ: 1 if n == 1 else None}.get(op)
                if k is not None and k >= 1:
                    used = c
                    break
        if used is None:
            raise self.src.error(w, f"{alias!r} needs a condition '{alias} <= k' (or '< k', '= 1') in the WHERE of the "
                                    f"enclosing query: a ranking is maintained as a top-k per partition")
        where = [c for c in where if c is not used]
        order = w.args.get("order")
        if order is None or not order.expressions:
            raise self.src.error(w, "a ranking needs ORDER BY")
        extra = [exp.alias_(p, f"__p{j}", quoted=True) for j, p in enumerate(w.args.get("partition_by") or [])]
        extra += [exp.alias_(o.this, f"__o{j}", quoted=True) for j, o in enumerate(order.expressions)]
        for o in order.expressions:
            if o.args.get("nulls_first"):
                raise self.src.error(o, "NULLS FIRST is not supported (nulls sort last)")
        mod = inner.copy()
        mod.set("expressions", [x for j, x in enumerate(inner.expressions) if j != i] + extra)
        rel = self.query(mod)
        field = {c.name: c.field for c in rel.cols}
        pf = [field[f"__p{j}"] for j in range(len(w.args.get("partition_by") or []))]
        spec = [(field[f"__o{j}"], "descending" if o.args.get("desc") else "ascending")
                for j, o in enumerate(order.expressions)]
        top = rel.stream.group_by(*pf).top_k(k, spec, with_ties=isinstance(w.this, exp.Rank))
        cols = [c for c in rel.cols if not c.name.startswith("__")]
        alias_node = sub.args.get("alias")
        return Rel(top, cols).qualified(tname(alias_node.this) if alias_node is not None else None), where

    # ---- FROM ----

    def from_clause(self, node: exp.Select, where: list[exp.Expression]) -> tuple[Rel, list[exp.Expression]]:
        """The FROM clause and its joins, planned by joinplan.py; returns the WHERE conjuncts it did not place."""
        from_ = node.args.get("from_")
        if from_ is None:
            if node.args.get("joins"):
                raise self.src.error(node, "JOIN without FROM")
            return self.one_row(), where
        self.natural_using(node)  # NATURAL joins become USING joins before the join planner prunes columns
        return plan_from(self, node, where)

    def one_row(self) -> Rel:
        """The relation of a SELECT without FROM: one row, no columns (a hidden constant)."""
        f = self.fresh()
        return Rel(self.constant(pa.table({f: pa.array([0], pa.int64())})), [])

    def table_ref(self, node: exp.Expression) -> Rel:
        alias_node = node.args.get("alias")
        alias = tname(alias_node.this) if alias_node is not None and alias_node.this is not None else None
        col_aliases = [ident(c) for c in alias_node.columns] if alias_node is not None and alias_node.columns else []
        if isinstance(node, exp.Table):
            if isinstance(node.this, exp.Anonymous) and node.this.name.upper() in ("TUMBLE", "HOP"):
                rel = self.window_tvf(node.this)
                name = alias or node.this.name.lower()
                rel = rel.qualified(name)
            else:
                if node.args.get("db") or node.args.get("catalog"):
                    raise self.src.error(node, "schema-qualified names are not supported")
                name = tname(node.this)
                rel = self.lookup(node, name).qualified(alias or name)
        elif isinstance(node, exp.Subquery) and isinstance(node.this, (exp.Table, exp.Subquery)):
            rel = self.table_ref(node.this)  # a parenthesised join, FROM (t) or FROM (a JOIN b ON ...)
            for j in node.this.args.get("joins") or []:
                rel, _ = self.join(rel, j, [])
            if alias is not None:
                rel = rel.qualified(alias)
        elif isinstance(node, exp.Subquery):
            rel = self.query(node.this)
            rel = self.order_limit(node, rel).qualified(alias)
        elif isinstance(node, exp.Values):
            rel = self.values(node).qualified(alias)
        else:
            raise self.src.error(node, f"{type(node).__name__} in FROM is not supported")
        if col_aliases:
            if len(col_aliases) != len(rel.cols):
                raise self.src.error(alias_node, f"{len(col_aliases)} column names for {len(rel.cols)} columns")
            rel = Rel(rel.stream, [Col(n, c.table, c.field) for n, c in zip(col_aliases, rel.cols)])
        return rel

    def values(self, node: exp.Values) -> Rel:
        """VALUES (...), (...): a constant relation (emitted at the first step)."""
        import numpy as np

        from dbsp_core.operators.expr import project_rows

        rows = [t.expressions if isinstance(t, exp.Tuple) else [t] for t in node.expressions]
        if not rows or len({len(r) for r in rows}) != 1:
            raise self.src.error(node, "VALUES needs rows of one length")
        probe = pa.table({"x": pa.array([0], pa.int64())})
        ex = Exprs(self.src, SchemaRel(probe.schema), where="VALUES")
        arrays = []
        for j in range(len(rows[0])):
            typed = [ex.typed(r[j]) for r in rows]
            target = pa.null()
            for _, t in typed:
                c = common_type(target, t)
                if c is None:
                    raise self.src.error(rows[0][j], f"VALUES column {j + 1} mixes {target} and {t}")
                target = c
            target = storable(target)
            got, _ = project_rows(probe, np.ones(1, dtype=np.int64), [e.cast(target) for e, _ in typed],
                                  [f"v{i}" for i in range(len(typed))])
            arrays.append(pa.array([got.column(i)[0].as_py() for i in range(len(typed))], target))
        fields = [self.fresh() for _ in arrays]
        stream = self.constant(pa.table(dict(zip(fields, arrays))))
        return Rel(stream, [Col(f"column{j + 1}", None, f) for j, f in enumerate(fields)])

    def window_tvf(self, fn: exp.Anonymous) -> Rel:
        """TUMBLE(t, DESCRIPTOR(col), size) and HOP(t, DESCRIPTOR(col), slide, size): the rows of t with their
        window's ``window_start`` and ``window_end`` (dbsp_core/operators/window.py)."""
        name = fn.name.upper()
        args = fn.expressions
        want = 3 if name == "TUMBLE" else 4
        if len(args) != want:
            raise self.src.error(fn, f"{name} takes {want} arguments: the table, DESCRIPTOR(time column), "
                                     + ("the size" if name == "TUMBLE" else "the slide, the size"))
        table, desc = args[0], args[1]
        if not isinstance(table, (exp.Column, exp.Table)):
            raise self.src.error(table, f"{name}'s first argument must name a table or view")
        rel = self.lookup(table, tname(table))
        if not (isinstance(desc, exp.Anonymous) and desc.name.upper() == "DESCRIPTOR" and len(desc.expressions) == 1):
            raise self.src.error(desc, f"{name}'s second argument must be DESCRIPTOR(<time column>)")
        hits = rel.find(None, ident(desc.expressions[0]))
        if len(hits) != 1:
            raise self.src.error(desc, f"DESCRIPTOR names no single column of {ident(table)}")
        field = hits[0].field
        typ = rel.type_of(field)
        sizes = [self.time_units(a, typ, f"the {what} of {name}")
                 for a, what in zip(args[2:], ("size",) if name == "TUMBLE" else ("slide", "size"))]
        for w in ("window_start", "window_end"):
            if w in rel.schema.names:
                raise self.src.error(fn, f"{name}: the input already has a column {w!r}")
        if name == "TUMBLE":
            s = rel.stream.tumble(field, sizes[0])
        else:
            slide, size = sizes
            if size % slide:
                raise self.src.error(fn, f"HOP: the size ({size}) must be a multiple of the slide ({slide})")
            s = rel.stream.hop(field, size, slide)
        cols = rel.cols + [Col("window_start", None, "window_start"), Col("window_end", None, "window_end")]
        return Rel(s, cols)

    def time_units(self, node: exp.Expression, typ: pa.DataType, what: str) -> int:
        """A duration in the units of a time column: an INTERVAL for a timestamp, an integer for an integer."""
        if pat.is_timestamp(typ):
            d = interval_value(self.src, node, what)
            per = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[typ.unit]
            v = round(d.total_seconds() * per)
        elif pat.is_integer(typ) and isinstance(node, exp.Literal) and not node.is_string:
            v = int(node.this)
        else:
            raise self.src.error(node, f"{what} must be an INTERVAL (timestamp column) or an integer (integer "
                                       f"column)")
        if v <= 0:
            raise self.src.error(node, f"{what} must be positive")
        return v

    # ---- joins ----

    def join(self, left: Rel, j: exp.Join, where: list[exp.Expression], right: Rel | None = None
             ) -> tuple[Rel, list[exp.Expression]]:
        right = self.table_ref(j.this) if right is None else right
        side = (j.args.get("side") or "").upper()
        kind = (j.args.get("kind") or "").upper()
        if kind in ("SEMI", "ANTI") and not j.args.get("method"):
            return self.semi_anti(left, right, j, kind == "ANTI"), where
        if j.args.get("method") or kind in ("NATURAL", "ASOF", "SEMI", "ANTI", "POSITIONAL"):
            raise self.src.error(j, f"{(j.args.get('method') or kind)} JOIN is not supported")
        clash = left.tables() & right.tables()
        if clash:
            raise self.src.error(j, f"table name {sorted(clash)[0]!r} appears twice in FROM; give one an alias")
        on = j.args.get("on")
        using = j.args.get("using")
        conds = conjuncts(on)
        if not side and on is None and not using:  # a comma or CROSS join: the WHERE equalities are its keys
            keys, rest = self.equi_keys(left, right, where)
            where = rest
            return self.inner(left, right, keys, []), where
        if using:
            return self.using(left, right, [ident(u) for u in using], side, j), where
        keys, residual = self.equi_keys(left, right, conds)
        if not side or side == "INNER":
            return self.inner(left, right, keys, residual), where
        return self.outer(left, right, keys, residual, side.lower()), where

    def side_of(self, rel: Rel, other: Rel, node: exp.Expression) -> bool:
        cols = columns_of(node)
        return bool(cols) and not has_subquery(node) and all(resolves(rel, c) and not resolves(other, c)
                                                             for c in cols)

    def equi_keys(self, left: Rel, right: Rel, conds: list[exp.Expression]
                  ) -> tuple[list[tuple[exp.Expression, exp.Expression]], list[exp.Expression]]:
        """Split conditions into key pairs ``left_expr = right_expr`` and the rest (invariant 3)."""
        keys, rest = [], []
        for c in conds:
            if isinstance(c, exp.EQ):
                a, b = c.this, c.expression
                if self.side_of(left, right, a) and self.side_of(right, left, b):
                    keys.append((a, b))
                    continue
                if self.side_of(right, left, a) and self.side_of(left, right, b):
                    keys.append((b, a))
                    continue
            rest.append(c)
        return keys, rest

    def inner(self, left: Rel, right: Rel, keys: list, residual: list[exp.Expression]) -> Rel:
        right = self._suffixable(left, right)
        if keys:
            left, right, lk, rk = self.key_fields(left, right, keys)
        else:  # a cross join: both sides on one constant key
            k = self.fresh()
            left, right = self.with_key(left, k), self.with_key(right, k + "_")
            lk, rk = [k], [k + "_"]
        stream = left.stream.join(right.stream, left_on=lk, right_on=rk)
        rel = Rel(stream, left.cols + self._suffixed(left, right))
        return self.filter(rel, residual)

    def _suffixable(self, left: Rel, right: Rel) -> Rel:
        """``right`` as a join's right side: a join suffixes its fields that clash with the left's with "_right"
        (operators/join.py); only fields whose suffixed name would clash again are renamed first."""
        names = set(left.schema.names)
        if not any(f + "_right" in names or (f in names and f + "_right" in right.schema.names)
                   for f in right.schema.names):
            return right
        return self.disjoint(left, right)

    @staticmethod
    def _suffixed(left: Rel, right: Rel) -> list[Col]:
        names = set(left.schema.names)
        return [Col(c.name, c.table, c.field + "_right" if c.field in names else c.field, c.star, c.merged)
                for c in right.cols]

    def outer(self, left: Rel, right: Rel, keys: list, residual: list[exp.Expression], side: str) -> Rel:
        """LEFT, RIGHT or FULL join (invariant 3)."""
        if keys and not residual and not self.recursive_body:
            right = self._suffixable(left, right)
            left, right, lk, rk = self.key_fields(left, right, keys)
            method = {"left": left.stream.left_join, "right": left.stream.right_join,
                      "full": left.stream.full_join}[side]
            return Rel(method(right.stream, left_on=lk, right_on=rk), left.cols + self._suffixed(left, right))
        right = self.disjoint(left, right)
        inner = self.inner(left, right, keys, residual)
        out_fields = list(inner.schema.names)
        parts = [inner.stream]
        for keep, other, wanted in ((left, right, side in ("left", "full")), (right, left, side in ("right", "full"))):
            if not wanted:
                continue
            fields = list(keep.schema.names)
            matched = self.narrow(inner, fields).distinct()
            alone = self.null_safe_anti(keep.stream, matched, fields)
            pad = {f: (F(f) if f in fields else null(inner.type_of(f))) for f in out_fields}
            parts.append(alone.select(**pad))
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return Rel(out, inner.cols)

    def null_safe_anti(self, stream: Stream, other: Stream, fields: list[str]) -> Stream:
        """The rows of ``stream`` whose ``fields`` equal no row of ``other`` (same fields), nulls equal to nulls."""
        a, ka = self.null_safe(stream, fields)
        b, kb = self.null_safe(other, fields)
        back = {f: F(f) for f in stream.schema.names}
        if self.recursive_body:  # a fixpoint's body has joins but no anti join: ``other`` is distinct, so the rows
            return stream - a.join(b, left_on=ka, right_on=kb).select(**back)  # with a match are the join's
        return a.anti_join(b, left_on=ka, right_on=kb).select(**back)

    def natural_using(self, node: exp.Select) -> None:
        """Each NATURAL join of ``node`` made the USING join it is (in place), before the FROM clause is planned:
        the USING list is the column names both sides show, in the left side's order."""
        joins = node.args.get("joins") or []
        if not any((j.args.get("method") or "").upper() == "NATURAL" for j in joins):
            return
        names = self.leaf_names(node.args["from_"].this)
        for j in joins:
            right = self.leaf_names(j.this)
            if (j.args.get("method") or "").upper() == "NATURAL":
                common = [n for n in names if n in right]
                if not common:
                    raise self.src.error(j, "NATURAL JOIN: the two sides have no column name in common; write "
                                            "CROSS JOIN for a cross product")
                j.set("method", None)
                j.set("using", [exp.to_identifier(n, quoted=True) for n in common])
            if (j.args.get("kind") or "").upper() not in ("SEMI", "ANTI"):
                names = list(dict.fromkeys(names + right))

    def leaf_names(self, leaf: exp.Expression) -> list[str]:
        """The column names a FROM item shows, for a NATURAL join (tables and views only)."""
        alias = leaf.args.get("alias")
        if alias is not None and alias.columns:
            return [ident(c) for c in alias.columns]
        if isinstance(leaf, exp.Table) and not isinstance(leaf.this, exp.Anonymous):
            return [c.name for c in self.lookup(leaf, tname(leaf.this)).star_cols()]
        raise self.src.error(leaf, "NATURAL JOIN over a subquery or a table function is not supported; write "
                                   "USING (...)")

    def semi_anti(self, left: Rel, right: Rel, j: exp.Join, anti: bool) -> Rel:
        """``left SEMI JOIN right ON c`` (``ANTI``): the rows of the left side for which a right row meets the
        condition (none does); only the left side's columns stay visible, as in DuckDB."""
        if j.args.get("side"):
            raise self.src.error(j, f"{j.args['side'].upper()} {'ANTI' if anti else 'SEMI'} JOIN is not DuckDB SQL; "
                                    f"write {'ANTI' if anti else 'SEMI'} JOIN")
        if j.args.get("using"):
            keys = [(exp.column(exp.to_identifier(ident(u), quoted=True)),) * 2 for u in j.args["using"]]
            for a, _ in keys:
                if len(left.find(None, a.name)) != 1 or len(right.find(None, a.name)) != 1:
                    raise self.src.error(j, f"USING column {a.name!r} must be a column of both sides")
            residual: list[exp.Expression] = []
        else:
            keys, residual = self.equi_keys(left, right, conjuncts(j.args.get("on")))
        if keys and not residual:
            lrel, rrel, lk, rk = self.key_fields(left, right, keys)
            keyed = self.narrow(rrel, rk)
            s = lrel.stream.anti_join(keyed, left_on=lk, right_on=rk) if anti else \
                lrel.stream.semi_join(keyed, left_on=lk, right_on=rk)
            return Rel(s, left.cols)
        fields = list(left.schema.names)  # the left rows (whole, nulls equal) that have a match
        matched = self.narrow(self.inner(left, self.disjoint(left, right), keys, residual), fields).distinct()
        a, ka = self.null_safe(left.stream, fields)
        b, kb = self.null_safe(matched, fields)
        s = a.anti_join(b, left_on=ka, right_on=kb) if anti else a.semi_join(b, left_on=ka, right_on=kb)
        return Rel(s.select(**{f: F(f) for f in fields}), left.cols)

    def using(self, left: Rel, right: Rel, names: list[str], side: str, j: exp.Join) -> Rel:
        keys = []
        for n in names:
            lh, rh = left.find(None, n), right.find(None, n)
            if len(lh) != 1 or len(rh) != 1:
                raise self.src.error(j, f"USING column {n!r} must be a column of both sides")
            keys.append((exp.column(exp.to_identifier(lh[0].name, quoted=True),
                                    table=exp.to_identifier(lh[0].table, quoted=True) if lh[0].table else None),
                         exp.column(exp.to_identifier(rh[0].name, quoted=True),
                                    table=exp.to_identifier(rh[0].table, quoted=True) if rh[0].table else None)))
        side = side.lower()
        rel = self.inner(left, right, keys, []) if side in ("", "inner") else self.outer(left, right, keys, [], side)
        merged, new = [], {}
        for n in names:
            lf = next(c.field for c in rel.cols[:len(left.cols)] if c.name == n)
            rf = next(c.field for c in rel.cols[len(left.cols):] if c.name == n)
            if side == "full":
                f = self.fresh()
                new[f] = call("coalesce", F(lf), F(rf))
            else:
                f = rf if side == "right" else lf
            merged.append(Col(n, None, f, True, True))
        rel = self.extend(rel, new)
        # DuckDB's order: a USING column stands where the left side shows it, the right side's copy is hidden
        by_name = {c.name: c for c in merged}
        cols: list[Col] = []
        for i, c in enumerate(rel.cols):
            if c.name not in by_name:
                cols.append(c)
                continue
            if i < len(left.cols) and c.star and by_name[c.name] not in cols:
                cols.append(by_name[c.name])
            if not c.merged:  # an earlier USING's column of the left side is replaced by the new one
                cols.append(Col(c.name, c.table, c.field, False, False))
        cols = [c for c in merged if c not in cols] + cols  # a USING column the left side shows under no star
        return Rel(rel.stream, cols)

    # ---- set operations ----

    def setop(self, node: exp.Expression) -> Rel:
        left, right = self.query(node.this), self.query(node.expression)
        what = type(node).__name__.upper()
        if len(left.cols) != len(right.cols):
            raise self.src.error(node, f"{what}: the left side has {len(left.cols)} columns, the right side "
                                       f"{len(right.cols)}")
        lnew, rnew = {}, {}
        fields = []
        for i, (a, b) in enumerate(zip(left.cols, right.cols)):
            ta, tb = left.type_of(a.field), right.type_of(b.field)
            t = common_type(ta, tb)
            if t is None:
                raise self.src.error(node, f"{what}: column {i + 1} is {ta} on the left and {tb} on the right")
            t = storable(t)
            f = f"c{i}"
            lnew[f] = F(a.field) if ta.equals(t) else F(a.field).cast(t)
            rnew[f] = F(b.field) if tb.equals(t) else F(b.field).cast(t)
            fields.append(f)
        cols = [Col(c.name, None, f) for c, f in zip(left.cols, fields)]
        ls = self._shaped(left, lnew)
        rs = self._shaped(right, rnew)
        distinct = node.args.get("distinct", True) is not False
        if isinstance(node, exp.Union):
            s = ls + rs
            return Rel(s.distinct() if distinct else s, cols)
        if not distinct:
            raise self.src.error(node, f"{what} ALL is not supported ({what} is)")
        x, y = ls.distinct(), rs.distinct()
        both = (x + y).distinct()
        if isinstance(node, exp.Intersect):
            return Rel(x + y - both, cols)  # 1 where both hold the row
        return Rel(both - y, cols)  # EXCEPT: 1 where only the left holds it

    def _shaped(self, rel: Rel, cols: dict[str, pc.Expression]) -> Stream:
        if list(rel.schema.names) == list(cols) and all(e.equals(F(f)) for f, e in cols.items()):
            return rel.stream
        return rel.stream.select(**cols)


def view_output(planner: Planner, rel: Rel) -> Stream:
    """The stream of a view: its columns under their SQL names (unique), nothing else."""
    names, used = [], set()
    for c in rel.cols:
        n, k = c.name, 1
        while n in used:
            n = f"{c.name}_{k}"
            k += 1
        used.add(n)
        names.append(n)
    return planner.narrow(rel, [c.field for c in rel.cols], names)
