"""Parsing a SQL program: the statements of the text through sqlglot (DuckDB dialect), with the streaming clauses sqlglot does not know taken out first, and CREATE TABLE statements read into table definitions.

Invariants:
  1. The text is tokenized once; token positions stay offsets into the original text, so every error names
     the line and column the user wrote. Statements are split at top-level semicolons and parsed one by one.
  2. Clauses removed from the token stream before parsing, and kept: in CREATE TABLE, a column's
     ``LATENESS <lateness>`` (Feldera) and ``WATERMARK FOR <column> AS <column> - <lateness>`` (Flink); in FROM,
     the ``TABLE(...)`` wrapper of a window table function and the ``TABLE`` before its table
     (``TABLE(TUMBLE(TABLE bid, DESCRIPTOR(t), INTERVAL '10' SECOND))`` parses as ``TUMBLE(bid, ...)``).
  3. An expression nests at most ``MAX_NESTING`` levels (parentheses, function calls, CASE, subqueries): the
     parser and the compiler recurse once per level, so deeper nesting is refused from the tokens, at the first
     token beyond the limit, before anything recurses; a statement that still exhausts Python's stack (a chain
     of unary operators, a caller deep in its own stack) is a SqlError at its first token, never a
     RecursionError. Long flat chains (``a + b + ...``, ``x OR y OR ...``) are not nesting: they compile
     iteratively (expr.py).
  4. A lateness is an integer literal (an integer event-time column) or an INTERVAL (a timestamp column); a
     table has at most one event-time column.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.types as pat
import sqlglot
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import Token, TokenType

from dbsp_core.sql.errors import Source, SqlError
from dbsp_core.sql.types import TypeProblem, arrow_type

DIALECT = "duckdb"
WINDOW_FUNCTIONS = ("TUMBLE", "HOP")
MAX_NESTING = 32  # levels of parentheses, calls, CASE and subqueries (invariant 3): sqlglot parses ~40 at most
_OPEN = {TokenType.L_PAREN, TokenType.CASE}
_CLOSE = {TokenType.R_PAREN, TokenType.END}
_UNITS = {"MICROSECOND": "microseconds", "MILLISECOND": "milliseconds", "SECOND": "seconds", "MINUTE": "minutes",
          "HOUR": "hours", "DAY": "days", "WEEK": "weeks"}


@dataclass
class Statement:
    """One parsed statement, with the streaming clauses taken out of it (invariant 2)."""

    node: exp.Expression
    start: int  # offset of its first token
    latenesses: dict[str, tuple[int, exp.Expression]] = field(default_factory=dict)  # column -> (offset, lateness)


@dataclass
class TableDef:
    """A CREATE TABLE: the input's name, schema, primary key and event time."""

    name: str
    schema: pa.Schema
    primary_key: tuple[str, ...]
    not_null: tuple[str, ...]
    event_time: str | None
    lateness: object  # int, datetime.timedelta, or 0
    sql: str


def ident(node: Any) -> str:
    """The name of an identifier as SQL folds it: lower case unless quoted."""
    if isinstance(node, str):
        return node.lower()
    if isinstance(node, exp.Identifier):
        return node.this if node.quoted else node.this.lower()
    if isinstance(node, (exp.Column, exp.Table, exp.TableAlias)):
        return ident(node.this)
    return node.name.lower()


def tname(node: Any) -> str:
    """The name of a table, view, CTE or alias: lower case (tables are case-insensitive, quoted or not)."""
    return ident(node).lower()


def _matching(tokens: list[Token], i: int) -> int:
    """The index of the parenthesis closing the one at ``i``."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].token_type == TokenType.L_PAREN:
            depth += 1
        elif tokens[j].token_type == TokenType.R_PAREN:
            depth -= 1
            if depth == 0:
                return j
    return len(tokens) - 1


def _word(t: Token, *words: str) -> bool:
    return t.text.upper() in words


def _clause_end(tokens: list[Token], i: int) -> int:
    """The index after a column clause starting at ``i``: the next comma or closing parenthesis at its depth."""
    depth = 0
    for j in range(i, len(tokens)):
        tt = tokens[j].token_type
        if tt == TokenType.L_PAREN:
            depth += 1
        elif tt == TokenType.R_PAREN:
            if depth == 0:
                return j
            depth -= 1
        elif tt == TokenType.COMMA and depth == 0:
            return j
    return len(tokens)


def _expression(src: Source, tokens: list[Token]) -> exp.Expression:
    """The expression spelled by ``tokens``, its node positions offsets into the original text."""
    start, end = tokens[0].start, tokens[-1].end + 1
    try:
        node = sqlglot.parse_one("SELECT " + src.text[start:end], read=DIALECT).selects[0]
    except (ParseError, TokenError) as e:
        raise SqlError(f"cannot parse {src.text[start:end]!r}: {e}", *src.line_col(start)) from None
    for n in node.walk():
        meta = getattr(n, "meta", None)
        if meta and "start" in meta:
            meta["start"] += start - 7
            meta["end"] = meta.get("end", meta["start"]) + start - 7
    return node


def _rewrite(src: Source, tokens: list[Token]) -> tuple[list[Token], dict[str, tuple[int, exp.Expression]]]:
    """Invariant 2 for one statement's tokens."""
    drop: set[int] = set()
    lateness: dict[str, tuple[int, exp.Expression]] = {}
    is_create_table = (len(tokens) > 1 and tokens[0].token_type == TokenType.CREATE
                       and any(t.token_type == TokenType.TABLE for t in tokens[1:3]))
    for i, t in enumerate(tokens):
        if i in drop:
            continue
        if (t.token_type == TokenType.TABLE and i + 3 < len(tokens) and tokens[i + 1].token_type == TokenType.L_PAREN
                and _word(tokens[i + 2], *WINDOW_FUNCTIONS)):
            drop.update((i, i + 1, _matching(tokens, i + 1)))
        elif (_word(t, *WINDOW_FUNCTIONS) and i + 2 < len(tokens) and tokens[i + 1].token_type == TokenType.L_PAREN
              and tokens[i + 2].token_type == TokenType.TABLE):
            drop.add(i + 2)
        elif is_create_table and _word(t, "WATERMARK") and i + 4 < len(tokens) \
                and tokens[i + 1].token_type == TokenType.FOR:
            end = _clause_end(tokens, i)
            body = tokens[i + 4:end]  # WATERMARK FOR col AS <body>
            col = tokens[i + 2].text.lower() if tokens[i + 2].token_type != TokenType.IDENTIFIER else tokens[i + 2].text
            if not body:
                raise SqlError("WATERMARK FOR <column> AS <column> - <lateness> needs an expression",
                               *src.line_col(t.start))
            e = _expression(src, body)
            if not (isinstance(e, exp.Sub) and isinstance(e.this, exp.Column) and ident(e.this) == col):
                raise SqlError(f"the watermark of {col!r} must read '{col} - <lateness>' (an integer or an INTERVAL)",
                               *src.line_col(body[0].start))
            lateness[col] = (t.start, e.expression)
            comma = i - 1
            drop.update(range(comma if tokens[comma].token_type == TokenType.COMMA else i, end))
        elif is_create_table and _word(t, "LATENESS"):
            end = _clause_end(tokens, i)
            j = i - 1  # the column: the first token after the clause's start
            while j > 0 and tokens[j - 1].token_type not in (TokenType.COMMA, TokenType.L_PAREN):
                j -= 1
            col = tokens[j].text if tokens[j].token_type == TokenType.IDENTIFIER else tokens[j].text.lower()
            if end == i + 1:
                raise SqlError("LATENESS needs a value", *src.line_col(t.start))
            lateness[col] = (t.start, _expression(src, tokens[i + 1:end]))
            drop.update(range(i, end))
    return [t for i, t in enumerate(tokens) if i not in drop], lateness


def parse_program(src: Source) -> list[Statement]:
    """The statements of the text (invariant 1)."""
    dialect = Dialect.get_or_raise(DIALECT)
    try:
        tokens = dialect.tokenize(src.text)
    except TokenError as e:
        raise SqlError(f"cannot read the SQL text: {e}") from None
    chunks: list[list[Token]] = [[]]
    for t in tokens:
        if t.token_type == TokenType.SEMICOLON:
            chunks.append([])
        else:
            chunks[-1].append(t)
    out = []
    for chunk in chunks:
        if not chunk:
            continue
        _check_nesting(src, chunk)
        chunk = _check_tokens(src, chunk)
        toks, lateness = _rewrite(src, chunk)
        try:
            nodes = dialect.parser().parse(toks, src.text)
        except RecursionError:
            raise too_deep(src, chunk[0].start) from None
        except ParseError as e:
            err = e.errors[0] if getattr(e, "errors", None) else {}
            line, col = err.get("line", 0), err.get("col", 0)
            desc = err.get("description", str(e)).split("\n")[0]
            raise SqlError(f"syntax error: {desc}", line, col) from None
        for n in nodes:
            if n is not None:
                out.append(Statement(n, chunk[0].start, lateness))
    return out


def _check_tokens(src: Source, tokens: list[Token]) -> list[Token]:
    """Refusals and literals read from one statement's tokens, before sqlglot (which would accept and drop them,
    or fall back to an opaque command): a second CREATE (a missing ';'), COLLATE, a qualified name in USING (...);
    ``x'..'`` becomes a hex string token (a BLOB literal)."""
    out: list[Token] = []
    depth = 0
    i = 0
    while i < len(tokens):
        t = tokens[i]
        tt = t.token_type
        if tt == TokenType.L_PAREN:
            depth += 1
        elif tt == TokenType.R_PAREN:
            depth -= 1
        elif tt == TokenType.CREATE and i > 0 and depth == 0:
            line, col = src.line_col(t.start)
            raise SqlError(f"missing ';' before line {line}, column {col}: a statement ends before the next CREATE",
                           line, col)
        elif tt == TokenType.COLLATE:
            raise SqlError("COLLATE is not supported: strings compare, group and join byte by byte here; compare "
                           "lower(x) (or another normalized form) instead", *src.line_col(t.start))
        elif tt == TokenType.USING and i + 1 < len(tokens) and tokens[i + 1].token_type == TokenType.L_PAREN:
            for u in tokens[i + 2:_matching(tokens, i + 1)]:
                if u.token_type == TokenType.DOT:
                    raise SqlError("USING (...) takes column names, not qualified ones: write USING (col) or "
                                   "ON a.col = b.col", *src.line_col(u.start))
        elif (t.text in ("x", "X") and tt in (TokenType.VAR, TokenType.IDENTIFIER) and i + 1 < len(tokens)
              and tokens[i + 1].token_type == TokenType.STRING and tokens[i + 1].start == t.end + 1):
            digits = tokens[i + 1].text
            if len(digits) % 2 or any(ch not in "0123456789abcdefABCDEF" for ch in digits):
                raise SqlError(f"x'{digits}' is not a BLOB literal: it needs an even number of hex digits",
                               *src.line_col(t.start))
            out.append(Token(TokenType.HEX_STRING, digits, t.line, t.col, t.start, tokens[i + 1].end))
            i += 2
            continue
        out.append(t)
        i += 1
    return out


def _check_nesting(src: Source, tokens: list[Token]) -> None:
    """Invariant 3: refuse a statement nested deeper than MAX_NESTING, at the first token beyond it."""
    depth = 0
    for t in tokens:
        if t.token_type in _OPEN:
            depth += 1
            if depth > MAX_NESTING:
                raise SqlError(f"the expression is nested more than {MAX_NESTING} levels deep (parentheses, function "
                               f"calls, CASE and subqueries count); at most {MAX_NESTING} levels are supported: "
                               f"flatten it (a chain such as a + b + c or x OR y OR z needs no parentheses) or split "
                               f"it into views", *src.line_col(t.start))
        elif t.token_type in _CLOSE:
            depth = max(0, depth - 1)


def too_deep(src: Source, offset: int) -> SqlError:
    """Invariant 3: the SqlError for a statement that exhausted Python's recursion limit anyway."""
    return SqlError(f"the statement is nested too deeply to compile (more levels of nested operators than Python's "
                    f"recursion limit of {sys.getrecursionlimit()} frames allows); flatten it or split it into views",
                    *src.line_col(offset))


def interval_value(src: Source, node: exp.Expression, what: str) -> datetime.timedelta:
    """The duration of an INTERVAL literal (``INTERVAL '10' SECOND``, ``INTERVAL 10 SECONDS``, ``'10 seconds'``)."""
    if not isinstance(node, exp.Interval):
        raise src.error(node, f"{what} must be an INTERVAL literal")
    text = node.this.name if node.this is not None else ""
    unit = node.unit.name.upper() if node.unit is not None else ""
    if not unit and " " in text.strip():
        text, unit = text.strip().split(None, 1)
    unit = unit.upper().rstrip("S") if unit.upper() not in ("MS",) else "MILLISECOND"
    if unit not in _UNITS:
        raise src.error(node, f"{what}: interval unit {unit or '(none)'} is not supported "
                              f"(use {', '.join(_UNITS)})")
    try:
        n = float(text)
    except ValueError:
        raise src.error(node, f"{what}: {text!r} is not a number") from None
    return datetime.timedelta(**{_UNITS[unit]: n})


def table_def(src: Source, st: Statement) -> TableDef:
    """The table of a CREATE TABLE statement (invariants 2 and 3)."""
    node = st.node
    schema_node = node.this
    if not isinstance(schema_node, exp.Schema):
        raise src.error(node, "CREATE TABLE needs a column list (CREATE TABLE ... AS SELECT is not supported)")
    name = tname(schema_node.this)
    fields, pk, not_null = [], [], []
    for item in schema_node.expressions:
        if isinstance(item, exp.ColumnDef):
            col = ident(item.this)
            if item.args.get("kind") is None:
                raise src.error(item, f"column {col!r} needs a type")
            try:
                typ = arrow_type(item.args["kind"])
            except TypeProblem as e:
                raise src.error(item, f"column {col!r}: {e}") from None
            fields.append(pa.field(col, typ))
            for c in item.args.get("constraints") or []:
                kind = c.args.get("kind")
                if isinstance(kind, exp.PrimaryKeyColumnConstraint):
                    pk.append(col)
                elif isinstance(kind, exp.NotNullColumnConstraint):
                    not_null.append(col)
        elif isinstance(item, exp.PrimaryKey):
            pk.extend(ident(e) for e in item.expressions)
        else:
            raise src.error(item, f"table element {item.sql(dialect=DIALECT)!r} is not supported (columns, "
                                  f"PRIMARY KEY, WATERMARK FOR and LATENESS are)")
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise src.error(node, f"table {name!r} declares a column twice: {names}")
    for c in pk:
        if c not in names:
            raise src.error(node, f"PRIMARY KEY column {c!r} is not a column of {name!r}")
    event_time, lateness = None, 0
    for col, (offset, lat) in st.latenesses.items():
        if event_time is not None:
            raise SqlError(f"table {name!r} declares event time on {event_time!r} and {col!r}; one is allowed",
                           *src.line_col(offset))
        if col not in names:
            raise SqlError(f"lateness given for {col!r}, which is not a column of {name!r}", *src.line_col(offset))
        typ = fields[names.index(col)].type
        if pat.is_timestamp(typ):
            lateness = interval_value(src, lat, f"the lateness of {col!r}")
        elif pat.is_integer(typ):
            if not (isinstance(lat, exp.Literal) and not lat.is_string and lat.this.lstrip("-").isdigit()):
                raise src.error(lat, f"the lateness of integer column {col!r} must be an integer literal")
            lateness = int(lat.this)
        else:
            raise SqlError(f"event-time column {col!r} must be an integer or a TIMESTAMP, not {typ}",
                           *src.line_col(offset))
        event_time = col
    return TableDef(name, pa.schema(fields), tuple(pk), tuple(not_null), event_time, lateness,
                    src.text[st.start:].split(";")[0])
