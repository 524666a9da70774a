"""The SQL planner's building kit: one compile's state and the stream helpers the planner and its clause modules share.

The state is the source text, the circuit, the fresh names, the tables and views and the CTE scopes. The clause
modules (aggregate, subquery, recursive, joinplan) take a :class:`Builder` and plan nested queries through its
:meth:`Builder.query` and :meth:`Builder.from_clause`, which the planner (planner.py, a Builder) provides; so the
imports run one way: the planner above its clause modules, they above this one.
"""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat
from sqlglot import exp

from dbsp_core.circuit import Circuit, Stream
from dbsp_core.operators.join import _key_class
from dbsp_core.operators.temporal import filter_now
from dbsp_core.sql.errors import Source
from dbsp_core.sql.expr import Exprs, NowCondition, call, lit
from dbsp_core.sql.parse import DIALECT, ident, tname
from dbsp_core.sql.relation import Col, Names, Rel
from dbsp_core.sql.types import common_type

F = pc.field


class Builder(ABC):
    """One compile's state and the helpers that add streams to its circuit; the planner subclasses it with the
    planning of queries."""

    def __init__(self, src: Source, circuit: Circuit) -> None:
        self.src = src
        self.circuit = circuit  # where new sources (constants) go: the body's circuit inside a recursive CTE
        self.names = Names()
        self.relations: dict[str, Rel] = {}  # tables and views, by name
        self.scopes: list[dict[str, Any]] = []  # CTE frames, innermost last
        self.notes: list[str] | None = None  # the join plans of the view being compiled (joinplan.py), when kept
        self.recursive_body = False  # planning a recursive CTE's step: outer joins without anti joins (recursive.py)

    # ---- names ----

    def lookup(self, node: exp.Expression, name: str) -> Rel:
        for frame in reversed(self.scopes):
            if name in frame:
                got = frame[name]
                if callable(got):
                    got = frame[name] = got()
                return got
            if frame.get("__barrier__"):
                break
        if name in self.relations:
            rel = self.relations[name]
            if rel.stream.circuit is not self.circuit:
                raise self.src.error(node, f"{name!r} cannot be read here (inside a recursive term only the tables "
                                           f"it names directly can)")
            return rel
        known = sorted(set(self.relations) | {k for f in self.scopes for k in f if not k.startswith("__")})
        raise self.src.error(node, f"unknown table or view {name!r}; known: {', '.join(known) or '(none)'}")

    def fresh(self) -> str:
        return self.names.fresh()

    def exprs(self, rel: Rel, subst: dict | None = None, where: str = "expression") -> Exprs:
        return Exprs(self.src, rel, subst, where=where)

    # ---- small stream helpers ----

    def extend(self, rel: Rel, new: dict[str, pc.Expression]) -> Rel:
        """``rel`` with computed fields added (one select)."""
        if not new:
            return rel
        cols = {f: F(f) for f in rel.schema.names}
        cols.update(new)
        return Rel(rel.stream.select(**cols), rel.cols)

    def narrow(self, rel: Rel, fields: list[str], names: list[str] | None = None) -> Stream:
        """The stream of just ``fields`` (renamed to ``names``), with no operator if that is the stream itself."""
        names = names or fields
        if list(rel.schema.names) == list(names) and list(fields) == list(names):
            return rel.stream
        return rel.stream.select(**{n: F(f) for n, f in zip(names, fields)})

    def with_key(self, rel: Rel, name: str) -> Rel:
        """``rel`` plus a constant int64 field ``name`` (the key of a cross join)."""
        return self.extend(rel, {name: lit(0, pa.int64())})

    def constant(self, table: pa.Table) -> Stream:
        return self.circuit.constant(table)

    # ---- SELECT list ----

    def select_items(self, node: exp.Select, rel: Rel) -> list[tuple[str, exp.Expression]]:
        """The SELECT list as (output name, expression), stars expanded."""
        out: list[tuple[str, exp.Expression]] = []
        for item in node.expressions:
            if isinstance(item, exp.Star) or (isinstance(item, exp.Column) and isinstance(item.this, exp.Star)):
                table = tname(item.args["table"]) if isinstance(item, exp.Column) and item.args.get("table") else None
                if isinstance(item, exp.Star) and item.args.get("replace"):
                    raise self.src.error(item, "* REPLACE is not supported")
                cols = rel.star_cols(table)
                excluded = {ident(x) for x in (item.args.get("except") or [])} if isinstance(item, exp.Star) else set()
                for x in excluded:
                    if not any(c.name == x for c in cols):
                        raise self.src.error(item, f"* EXCLUDE names {x!r}, which is not a column here")
                cols = [c for c in cols if c.name not in excluded]
                if table is not None and not cols:
                    raise self.src.error(item, f"{table}.* names no table of this query")
                for c in cols:
                    out.append((c.name, exp.column(exp.to_identifier(c.name, quoted=True),
                                                   table=exp.to_identifier(c.table, quoted=True)
                                                   if c.table is not None and not c.merged else None)))
            elif isinstance(item, exp.Alias):
                out.append((ident(item.args["alias"]), item.this))
            elif isinstance(item, exp.Column):
                out.append((ident(item.this), item))
            else:
                out.append((item.sql(dialect=DIALECT).lower(), item))
        return out

    # ---- keys and joins ----

    def key_fields(self, left: Rel, right: Rel, keys: list[tuple[exp.Expression, exp.Expression]]
                   ) -> tuple[Rel, Rel, list[str], list[str]]:
        """Fields holding the key expressions on each side, cast to a common type where their kinds differ."""
        lx, rx = self.exprs(left, where="join key"), self.exprs(right, where="join key")
        lnew, rnew, lk, rk = {}, {}, [], []
        for a, b in keys:
            (ea, ta), (eb, tb) = lx.typed(a), rx.typed(b)
            la, lb = lx.literal_as(a, tb), rx.literal_as(b, ta)  # 'x' IN (SELECT int_col ...): DuckDB's cast
            if la is not None:
                ea, ta = la, tb
            elif lb is not None:
                eb, tb = lb, ta
            if _key_class(ta) != _key_class(tb):
                t = common_type(ta, tb)
                if t is None:
                    raise self.src.error(a.parent or a, f"cannot join {ta} with {tb}")
                ea, eb = ea.cast(t), eb.cast(t)
            for e, new, out, rel in ((ea, lnew, lk, left), (eb, rnew, rk, right)):
                names = [f for f in rel.schema.names if e.equals(F(f))]
                if names:
                    out.append(names[0])
                else:
                    f = self.fresh()
                    new[f] = e
                    out.append(f)
        return self.extend(left, lnew), self.extend(right, rnew), lk, rk

    def disjoint(self, left: Rel, right: Rel) -> Rel:
        """``right`` with its fields renamed where they clash with ``left``'s (so a join keeps every name)."""
        clash = set(left.schema.names) & set(right.schema.names)
        if not clash:
            return right
        ren = {f: (self.fresh() if f in clash else f) for f in right.schema.names}
        stream = right.stream.select(**{ren[f]: F(f) for f in right.schema.names})
        return Rel(stream, [Col(c.name, c.table, ren[c.field], c.star, c.merged) for c in right.cols])

    def null_safe(self, stream: Stream, fields: list[str]) -> tuple[Stream, list[str]]:
        """``stream`` plus, per field, a null flag and the value with nulls replaced: keys on which a join
        matches nulls to nulls."""
        new: dict[str, pc.Expression] = {f: F(f) for f in stream.schema.names}
        keys = []
        for f in fields:
            t = stream.schema.field(f).type
            k = _key_class(t)
            if pat.is_floating(t):
                default = lit(0.0, t)
            elif k in ("int", "string") or pat.is_boolean(t):
                default = lit({"int": 0, "string": ""}.get(k, False), t if k != "string" else pa.string())
            elif pat.is_date(t):
                default = lit(datetime.date(1970, 1, 1), t)
            elif pat.is_binary(t) or pat.is_large_binary(t):
                default = lit(b"", t)
            else:
                default = pc.scalar(pa.scalar(0, pa.int64()).cast(t))
            n, v = self.fresh(), self.fresh()
            new[n] = call("is_null", F(f))
            new[v] = call("coalesce", F(f), default)
            keys += [n, v]
        return stream.select(**new), keys

    # ---- WHERE ----

    def filter(self, rel: Rel, conds: list[exp.Expression], subst: dict | None = None) -> Rel:
        if not conds:
            return rel
        ex = self.exprs(rel, subst, "WHERE")
        ex.allow_now = True
        pred, timed = None, []
        for c in conds:
            ex.used_now = False
            p = ex.predicate(c)
            if ex.used_now:  # expr.py invariant 7: a temporal filter, at each step's logged now
                timed.append(c)
                continue
            pred = p if pred is None else call("and_kleene", pred, p)
        stream = rel.stream if pred is None else rel.stream.filter(pred)
        if timed:
            stream = filter_now(stream, NowCondition(self.src, rel, subst, timed))
        return Rel(stream, rel.cols)

    # ---- the planner's, for the clause modules ----

    @abstractmethod
    def query(self, node: exp.Expression, outer: Rel | None = None) -> Rel:
        """Any query expression, planned (a subquery's, a CTE's)."""

    @abstractmethod
    def from_clause(self, node: exp.Select, where: list[exp.Expression]) -> tuple[Rel, list[exp.Expression]]:
        """The FROM clause of ``node`` and its joins, and the WHERE conjuncts not used as join keys."""

    @abstractmethod
    def table_ref(self, node: exp.Expression) -> Rel:
        """One item of a FROM clause (a table, view, CTE, subquery, VALUES, parenthesised join), planned."""

    @abstractmethod
    def join(self, left: Rel, j: exp.Join, where: list[exp.Expression], right: Rel | None = None
             ) -> tuple[Rel, list[exp.Expression]]:
        """``left`` joined by ``j`` (with ``right``, its planned item, when given), and the WHERE conjuncts left."""

    @abstractmethod
    def inner(self, left: Rel, right: Rel, keys: list, residual: list[exp.Expression]) -> Rel:
        """The inner join of ``left`` and ``right`` on key pairs (a cross product without), filtered by ``residual``."""
