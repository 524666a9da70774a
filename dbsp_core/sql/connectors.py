"""The connectors a SQL program declares in ``WITH (...)``: a source on a CREATE TABLE, a sink on a CREATE VIEW, their options checked against the catalog below at compile time.

Invariants:
  1. The form is Flink's and RisingWave's flat options, placed as Feldera places them: ``CREATE TABLE t (...)
     WITH ('connector' = 'files', 'path' = 'in/', ...)`` and ``CREATE [MATERIALIZED] VIEW v WITH ('connector' =
     'parquet', 'path' = 'out/') AS SELECT ...``. Keys are case-insensitive strings or names; values are
     literals (strings, numbers, TRUE/FALSE), kept as text. One connector per table or view.
  2. A key the connector does not take, a missing required key, a value outside an option's choices or a
     connector the catalog does not have is a SqlError at that option's line and column naming it and the keys
     or values allowed; nothing is started before the whole program passed.
  3. An option that holds credentials (``secret``: a DSN, a password, a storage option of an object store) is
     never shown: :meth:`Connector.describe` and every message of this module print ``***`` for its value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlglot import exp

from dbsp_core.sql.errors import Source, SqlError


@dataclass(frozen=True)
class Option:
    """One option a connector takes."""

    required: bool = False
    choices: tuple[str, ...] = ()
    secret: bool = False
    help: str = ""


_BOOL = ("true", "false")
# kind ("table" or "view") -> connector name -> option -> Option; a key ending in ".*" takes any suffix
CATALOG: dict[str, dict[str, dict[str, Option]]] = {
    "table": {
        "files": {
            "path": Option(True, help="the directory whose files are read (a local path or a URI: s3://...)"),
            "format": Option(choices=("parquet", "csv", "jsonl"), help="read only files of this format"),
            "on_error": Option(choices=("raise", "skip", "quarantine"), help="what a bad file does"),
            "recursive": Option(choices=_BOOL, help="read the subdirectories too"),
            "name": Option(help="the source's name (keep it stable across runs)"),
        },
        "postgres": {
            "dsn": Option(True, secret=True, help="the server's connection string"),
            "table": Option(help="the Postgres table (default: the table's own name)"),
            "where": Option(help="a condition on the Postgres rows"),
            "name": Option(help="the source's name (keep it stable across runs)"),
        },
    },
    "view": {
        "parquet": {
            "path": Option(True, help="the directory of step-<N>.parquet change files"),
            "skip_empty": Option(choices=_BOOL, help="write no file for a step without changes"),
        },
        "sqlite": {
            "path": Option(True, help="the SQLite database file"),
            "table": Option(help="the SQLite table (default: the view's name)"),
        },
        "postgres": {
            "dsn": Option(True, secret=True, help="the server's connection string"),
            "table": Option(help="the Postgres table (default: the view's name)"),
        },
        "delta": {
            "path": Option(True, help="the Delta table's location (a local path or a URI)"),
            "mode": Option(choices=("append", "merge"), help="append changes with their weight, or merge by key"),
            "key": Option(help="the key columns of merge mode, comma-separated"),
            "storage.*": Option(secret=True, help="an object store option (storage.aws_access_key_id = ...)"),
        },
    },
}


@dataclass
class Connector:
    """A connector declared on table or view ``name`` (``kind`` "table" or "view"): its ``connector`` and
    ``options`` (keys lower case, values as text), and where each was written (line, column)."""

    kind: str
    name: str
    connector: str
    options: dict[str, str] = field(default_factory=dict)
    where: dict[str, tuple[int, int]] = field(default_factory=dict)

    def secret(self, key: str) -> bool:
        """Whether option ``key`` holds credentials (invariant 3)."""
        spec = _spec(CATALOG[self.kind][self.connector], key)
        return spec is None or spec.secret

    def describe(self) -> str:
        """The connector and its options, credentials shown as ``***`` (invariant 3)."""
        opts = ", ".join(f"{k}={'***' if self.secret(k) else v}" for k, v in self.options.items())
        return f"{self.connector}({opts})"

    def flag(self, key: str) -> bool:
        return self.options.get(key, "false") == "true"

    def error(self, key: str, message: str) -> SqlError:
        """A SqlError at option ``key`` (at the statement's WITH when it was not written)."""
        line, col = self.where.get(key, self.where.get("connector", (0, 0)))
        return SqlError(message, line, col)


def _spec(options: dict[str, Option], key: str) -> Option | None:
    if key in options:
        return options[key]
    return next((o for k, o in options.items() if k.endswith(".*") and key.startswith(k[:-1])), None)


def _text(src: Source, node: exp.Expression, what: str) -> str:
    if isinstance(node, exp.Literal):
        return str(node.this)
    if isinstance(node, exp.Boolean):
        return "true" if node.this else "false"
    if isinstance(node, (exp.Var, exp.Identifier, exp.Column)):
        return node.name
    raise src.error(node, f"{what} must be a literal (a string, number, TRUE or FALSE), got {node.sql()}")


def declared(src: Source, kind: str, name: str, node: exp.Create) -> Connector | None:
    """The connector ``node`` declares in its WITH (...), checked (invariants 1-2); None when it declares none."""
    props = node.args.get("properties")
    items = [p for p in (props.expressions if props is not None else []) if type(p) is exp.Property]  # not MATERIALIZED
    if not items:
        return None
    options: dict[str, str] = {}
    where: dict[str, tuple[int, int]] = {}
    for p in items:
        key = _text(src, p.this, "an option's name").lower()
        if key in options:
            raise src.error(p, f"option {key!r} is given twice")
        options[key] = _text(src, p.args.get("value"), f"the value of option {key!r}")
        where[key] = src.line_col(src.offset(p))
    catalog = CATALOG[kind]
    what = "table" if kind == "table" else "view"
    if "connector" not in options:
        line, col = where[next(iter(where))]
        raise SqlError(f"the WITH options of {what} {name!r} need 'connector' (one of {', '.join(catalog)})",
                       line, col)
    conn = options.pop("connector")
    c = Connector(kind, name, conn, options, where)
    if conn not in catalog:
        other = "view" if kind == "table" else "table"
        hint = (f"; {conn!r} is a connector of a {other} ({'a source' if other == 'table' else 'a sink'})"
                if conn in CATALOG[other] else "")
        raise c.error("connector", f"{what} {name!r}: unknown connector {conn!r}; a {what} takes "
                                   f"{', '.join(repr(k) for k in catalog)}{hint}")
    spec = catalog[conn]
    for key, value in options.items():
        opt = _spec(spec, key)
        if opt is None:
            raise c.error(key, f"{what} {name!r}: connector {conn!r} has no option {key!r}; its options are "
                               f"{', '.join(repr(k) for k in spec)}")
        if opt.choices and value.lower() not in opt.choices:
            shown = "***" if opt.secret else repr(value)
            raise c.error(key, f"{what} {name!r}: option {key!r} is {shown}; it is one of "
                               f"{', '.join(repr(v) for v in opt.choices)}")
        if opt.choices:
            options[key] = value.lower()
    missing = [k for k, o in spec.items() if o.required and k not in options]
    if missing:
        raise c.error("connector", f"{what} {name!r}: connector {conn!r} needs option "
                                   f"{', '.join(repr(k) for k in missing)} ({spec[missing[0]].help})")
    return c
