"""What the Postgres source and sink share: connections (through psycopg 3) whose errors show the DSN with its password masked, the mapping between Postgres column types and the engine's Arrow types, and the conversion of Postgres' text values to Arrow columns.

Invariants (enforced here):
  1. A DSN's password never appears in a message, log line or file written by the connectors: every error names
     the DSN as :func:`mask_dsn` prints it (``password=***``), and a driver error's text is scrubbed of the
     password before it is shown.
  2. Every connection runs with ``TimeZone=UTC``, ``DateStyle=ISO`` and ``extra_float_digits=3``, so the text
     form of a value (a snapshot's CSV, a change's pgoutput tuple) is exact and parses to one Arrow value.
  3. Text values convert to Arrow by one path, :func:`text_columns`: Arrow's CSV parser with the Arrow type of
     each column, the empty unquoted field as NULL and nothing else (``NaN`` is a float, ``""`` an empty
     string). A column whose Postgres type has no Arrow type here raises SchemaError naming the column.
"""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from dbsp_core.errors import DbspError, SchemaError

__all__ = ["mask_dsn", "scrub", "connect", "execute", "table_sql", "arrow_type", "postgres_type", "table_columns",
           "text_columns", "parse_csv", "quote_ident", "csv_bytes"]

SESSION = "-c TimeZone=UTC -c DateStyle=ISO -c extra_float_digits=3"

# Postgres type name (pg_type.typname) -> Arrow type (invariant 3)
_FROM_PG = {
    "int2": pa.int16(), "int4": pa.int32(), "int8": pa.int64(),
    "float4": pa.float32(), "float8": pa.float64(), "bool": pa.bool_(),
    "text": pa.string(), "varchar": pa.string(), "bpchar": pa.string(), "name": pa.string(),
    "uuid": pa.string(), "json": pa.string(), "jsonb": pa.string(),
    "date": pa.date32(), "timestamp": pa.timestamp("us"), "timestamptz": pa.timestamp("us", tz="UTC"),
}


def _password(dsn: str) -> str | None:
    try:
        from psycopg.conninfo import conninfo_to_dict

        return conninfo_to_dict(dsn).get("password") or None  # type: ignore[return-value]
    except Exception:
        return None


def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``***`` (key/value or URI form).

    >>> mask_dsn("host=db user=app password=s3cret dbname=x")
    'host=db user=app password=*** dbname=x'
    >>> mask_dsn("postgresql://app:s3cret@db:5432/x")
    'postgresql://app:***@db:5432/x'
    """
    out = re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)
    out = re.sub(r"^(postgres(?:ql)?://[^:/@]*:)[^@]*@", r"\1***@", out)
    out = re.sub(r"([?&]password=)[^&]*", r"\1***", out)
    pw = _password(dsn)
    return out.replace(pw, "***") if pw else out


def scrub(text: str, dsn: str) -> str:
    """``text`` without the password of ``dsn`` (invariant 1)."""
    pw = _password(dsn)
    return text.replace(pw, "***") if pw else text


def connect(dsn: str, what: str, *, replication: bool = False, autocommit: bool = True) -> Any:
    """A psycopg connection to ``dsn`` with the session settings of invariant 2; a failure raises DbspError naming
    ``what`` and the masked DSN."""
    try:
        import psycopg
    except ImportError:  # pragma: no cover - the dependency is declared; this names it if it is missing
        raise ImportError(f"{what} needs psycopg 3: pip install 'dbsp-core[postgres]'") from None
    kwargs: dict[str, Any] = {"options": SESSION, "autocommit": autocommit}
    if replication:
        kwargs["replication"] = "database"
    try:
        return psycopg.connect(dsn, **kwargs)
    except psycopg.Error as e:
        raise DbspError(f"{what}: cannot connect to {mask_dsn(dsn)}: {scrub(str(e), dsn)}") from None


def execute(conn: Any, query: str, params: Any, what: str, dsn: str) -> list:
    """The rows of ``query`` (none for a statement); a driver error raises DbspError naming ``what``, its text
    scrubbed of the password (invariant 1). A failed statement's exception is the DbspError's context."""
    import psycopg

    try:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []
    except psycopg.Error as e:
        raise DbspError(f"{what}: {scrub(str(e), dsn)}") from None


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def table_sql(table: str) -> str:
    """A table given as ``name`` or ``schema.name`` (exact spelling, any case) as quoted SQL.

    >>> table_sql("Sales"), table_sql("app.orders")
    ('"Sales"', '"app"."orders"')
    """
    return ".".join(quote_ident(p) for p in table.split(".", 1))


def arrow_type(column: str, typname: str, where: str) -> pa.DataType:
    """The Arrow type of a Postgres column (invariant 3)."""
    t = _FROM_PG.get(typname)
    if t is None:
        raise SchemaError(f"{where}: column {column!r} has Postgres type {typname}, which has no Arrow type here "
                          f"(supported: {', '.join(sorted(_FROM_PG))}); cast it in a view or change its type")
    return t


def postgres_type(column: str, t: pa.DataType, where: str) -> str:
    """The Postgres column type that holds Arrow type ``t`` exactly."""
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t):
        bits = t.bit_width + (0 if pa.types.is_signed_integer(t) else 1)
        if bits <= 64:
            return "smallint" if bits <= 16 else "integer" if bits <= 32 else "bigint"
    if pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision}, {t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_date32(t):
        return "date"
    if pa.types.is_timestamp(t) and t.unit in ("s", "ms", "us"):
        return "timestamptz" if t.tz else "timestamp"
    raise SchemaError(f"{where}: column {column!r} has Arrow type {t}, which no Postgres column holds exactly here "
                      f"(supported: bool, integers but uint64, float32/64, decimals, strings, date32, timestamps in "
                      f"s/ms/us)")


def table_columns(conn: Any, table: str, where: str) -> list[tuple[str, str]]:
    """``[(column, type name)]`` of ``table`` (a name, optionally schema-qualified) in column order."""
    import psycopg

    try:
        rows = conn.execute(
            "SELECT a.attname, t.typname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (table_sql(table),)).fetchall()
    except psycopg.errors.UndefinedTable:
        raise SchemaError(f"{where}: no table {table!r}") from None
    return [(r[0], r[1]) for r in rows]


def _parse(data: bytes, names: list[str], types: list[pa.DataType]) -> pa.Table:
    opts = pacsv.ConvertOptions(column_types=dict(zip(names, types)), null_values=[""], strings_can_be_null=True,
                                quoted_strings_can_be_null=False, true_values=["t"], false_values=["f"])
    read = pacsv.ReadOptions(column_names=names, use_threads=False)
    return pacsv.read_csv(pa.py_buffer(data), read_options=read, convert_options=opts,
                          parse_options=pacsv.ParseOptions(newlines_in_values=True))


def parse_csv(data: bytes, schema: pa.Schema, where: str) -> pa.Table:
    """Postgres ``COPY ... (FORMAT csv)`` output as a table of ``schema`` (invariant 3)."""
    if not data:
        return schema.empty_table()
    try:
        return _parse(data, schema.names, schema.types)
    except pa.ArrowInvalid as e:
        raise SchemaError(f"{where}: a value does not convert to the input's Arrow type: {e}") from None


def text_columns(columns: list[list[str | None]], schema: pa.Schema, where: str) -> pa.Table:
    """Columns of Postgres text values (None = NULL) as a table of ``schema`` (invariant 3): string columns as
    they are, the others through the CSV parser (one call for all of them)."""
    arrays: dict[str, pa.Array] = {}
    other = []
    for name, t, values in zip(schema.names, schema.types, columns):
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            arrays[name] = pa.array(values, t)
        else:
            other.append((name, t, pa.array(values, pa.string())))
    if other and columns and len(columns[0]):
        data = csv_bytes(pa.table({n: a for n, _, a in other}))
        try:
            parsed = _parse(data, [n for n, _, _ in other], [t for _, t, _ in other])
        except pa.ArrowInvalid as e:
            raise SchemaError(f"{where}: a value does not convert to the input's Arrow type: {e}") from None
        for n, _, _ in other:
            arrays[n] = parsed.column(n)
    elif other:
        for n, t, _ in other:
            arrays[n] = pa.array([], t)
    return pa.table([arrays[n] for n in schema.names], schema=schema)


def csv_bytes(table: pa.Table) -> bytes:
    """``table`` as headerless CSV in the form Postgres' ``COPY ... (FORMAT csv)`` reads: NULL unquoted empty,
    strings quoted."""
    sink = pa.BufferOutputStream()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False))
    return sink.getvalue().to_pybytes()
