"""Helpers that walk a parsed SQL expression (sqlglot): its ANDed parts, its column references, whether it holds a subquery, whether a column resolves in a relation. Shared by the planner and the subquery rewriter."""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from dbsp_core.sql.parse import ident, tname
from dbsp_core.sql.relation import Rel

__all__ = ["conjuncts", "columns_of", "has_subquery", "resolves"]


def conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    """The ANDed parts of a condition, in order (iteratively: a chain of thousands of ANDs is as deep)."""
    out: list[exp.Expression] = []
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if isinstance(n, exp.Paren) and isinstance(n.this, exp.And):
            stack.append(n.this)
        elif isinstance(n, exp.And):
            stack += [n.expression, n.this]
        else:
            out.append(n)
    return out


def columns_of(node: exp.Expression) -> list[exp.Column]:
    """The column references of an expression, in order, not looking into subqueries (iteratively)."""
    out = []
    stack: list[Any] = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, exp.Column):
            out.append(n)
            continue
        if isinstance(n, (exp.Subquery, exp.Select, exp.Exists)) or (isinstance(n, exp.In) and n.args.get("query")):
            if isinstance(n, exp.In):
                stack.append(n.this)
            continue
        stack.extend(reversed(list(n.iter_expressions())) if isinstance(n, exp.Expression) else [])
    return out


def has_subquery(node: exp.Expression) -> bool:
    return any(isinstance(n, (exp.Subquery, exp.Exists, exp.Any, exp.All)) or
               (isinstance(n, exp.In) and n.args.get("query")) for n in node.walk())


def resolves(rel: Rel, col: exp.Column) -> bool:
    table = tname(col.args["table"]) if col.args.get("table") else None
    return len(rel.find(table, ident(col.this))) >= 1
