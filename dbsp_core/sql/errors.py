"""The SQL front end's one error type, SqlError, and how it finds the line and column of a syntax node.

Invariants:
  1. Every error the compiler raises for the user's SQL is a SqlError (a SchemaError) whose message starts
     with ``line L, column C:`` of the offending construct in the compiled text (1-based), then says what is
     wrong or what is missing.
  2. A node's position is the smallest start offset among the tokens of the node and its descendants (sqlglot
     records positions on identifiers, literals and function names); a node without one reports the position
     of the statement it belongs to.
"""

from __future__ import annotations

from typing import Any

from dbsp_core.errors import SchemaError


class SqlError(SchemaError):
    """A construct of the compiled SQL text that is wrong or not supported; ``line`` and ``column`` locate it."""

    def __init__(self, message: str, line: int = 0, column: int = 0) -> None:
        self.line, self.column = line, column
        super().__init__(f"line {line}, column {column}: {message}" if line else message)


class Source:
    """The compiled text, to turn character offsets into lines and columns."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.fallback = 0  # the start of the statement being compiled

    def line_col(self, offset: int) -> tuple[int, int]:
        line = self.text.count("\n", 0, offset) + 1
        return line, offset - (self.text.rfind("\n", 0, offset) + 1) + 1

    def offset(self, node: Any) -> int:
        """Invariant 2."""
        best = None
        if node is not None and hasattr(node, "walk"):
            for n in node.walk():
                start = (getattr(n, "meta", None) or {}).get("start")
                if start is not None and (best is None or start < best):
                    best = start
        return self.fallback if best is None else best

    def error(self, node: Any, message: str) -> SqlError:
        """A SqlError located at ``node``."""
        line, col = self.line_col(self.offset(node))
        return SqlError(message, line, col)
