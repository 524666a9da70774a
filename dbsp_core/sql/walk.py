"""Helpers that walk a parsed SQL expression (sqlglot): its ANDed parts, its column references, whether it holds a subquery, whether a column resolves in a relation. Shared by the planner and the subquery rewriter."""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from dbsp_core.sql.parse import ident, tname
from dbsp_core.sql.relation import Rel

__all__ = ["conjuncts", "columns_of", "has_subquery", "resolves"]


def conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    """The ANDed parts of a condition."""
    if node is None:
        return []
    if isinstance(node, exp.Paren) and isinstance(node.this, exp.And):
        return conjuncts(node.this)
    if isinstance(node, exp.And):
        return conjuncts(node.this) + conjuncts(node.expression)
    return [node]


def columns_of(node: exp.Expression) -> list[exp.Column]:
    """The column references of an expression, not looking into subqueries."""
    out = []

    def walk(n: Any) -> None:
        if isinstance(n, exp.Column):
            out.append(n)
            return
        if isinstance(n, (exp.Subquery, exp.Select, exp.Exists)) or (isinstance(n, exp.In) and n.args.get("query")):
            if isinstance(n, exp.In):
                walk(n.this)
            return
        for child in n.iter_expressions() if isinstance(n, exp.Expression) else []:
            walk(child)

    walk(node)
    return out


def has_subquery(node: exp.Expression) -> bool:
    return any(isinstance(n, (exp.Subquery, exp.Exists)) or (isinstance(n, exp.In) and n.args.get("query"))
               for n in node.walk())


def resolves(rel: Rel, col: exp.Column) -> bool:
    table = tname(col.args["table"]) if col.args.get("table") else None
    return len(rel.find(table, ident(col.this))) >= 1
