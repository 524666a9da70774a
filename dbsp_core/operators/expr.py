"""Vectorized evaluation of pyarrow.compute expressions over a Z-set's rows (Acero filter and project plans), shared by filter and select.

Invariants:
  1. The weight travels as a hidden column through the plan, so a row keeps its weight whatever order
     the plan emits rows in.
  2. Validation runs the same plan on an empty table of the input schema, so an expression that
     builds also runs; an unknown field is reported as a SchemaError naming the operator and the column.
  3. :func:`strftime`'s C path is a call of the scalar function ``dbsp_time_format_<type>`` (csrc/timefmt.h),
     registered with Arrow once per process when this module is imported, for every type in ``_TIME_TYPES``: an
     expression naming one (a circuit built here, its fingerprint's text) runs wherever dbsp_core is imported, and
     it gives Arrow's strftime's strings (tests/core/test_expr_kernels.py). A circuit fingerprint reads such a call
     as the expression it replaced (:func:`fingerprint_text`, from the text alone), so every circuit keeps the
     fingerprints the code before it computed and its checkpoints reopen as the same program
     (tests/core/test_strftime_fingerprint.py, tests/exactly_once/test_strftime_upgrade.py).
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.acero as ac
import pyarrow.compute as pc

from dbsp_core import _zset
from dbsp_core.errors import SchemaError
from dbsp_core.zset import _take

WEIGHT_COL = "__dbsp_weight__"
_FIELD_RE = re.compile(r"FieldRef\.Name\(([^)]*)\)")
_STRFTIME_TOKENS = re.compile(r"%Y-%m-%d|%.?|[^%]+")


def _run(table: pa.Table, node: ac.Declaration) -> pa.Table:
    source = ac.Declaration("table_source", ac.TableSourceNodeOptions(table))
    return ac.Declaration.from_sequence([source, node]).to_table(use_threads=False)


def schema_error(where: str, schema: pa.Schema, exc: Exception) -> SchemaError:
    """Turn an Arrow error from binding an expression into a SchemaError naming the column."""
    m = _FIELD_RE.search(str(exc))
    if m:
        return SchemaError(f"{where}: unknown column {m.group(1)!r}; input columns are {schema.names}")
    return SchemaError(f"{where}: invalid expression: {exc}")


def as_expression(value: object, where: str) -> pc.Expression:
    """A pc.Expression from an expression, a column name (str) or a literal."""
    if isinstance(value, pc.Expression):
        return value
    if isinstance(value, str):
        return pc.field(value)
    try:
        return pc.scalar(value)
    except (TypeError, pa.ArrowInvalid) as exc:
        raise TypeError(f"{where}: expected a pyarrow.compute expression, got {value!r}") from exc


def strftime(value: pc.Expression, fmt: str, typ: pa.DataType) -> pc.Expression:
    """``pc.strftime(value, format=fmt)`` over a ``typ`` column, the same string for every value (nulls stay null),
    by one C pass (csrc/timefmt.h, as the scalar function ``dbsp_time_format_<type>``, :func:`_time_format`) when
    ``fmt`` has only ``%Y %m %d %H %M %%`` and literal text, and ``typ`` is a timestamp without a time zone (or
    UTC), or a date without ``%H``/``%M``: Arrow's strftime formats row by row through a stream (1-2 us a row), the
    C pass costs a hundredth of that and a tenth of Arrow's date cast and field kernels (:func:`_cast_format`, which
    it falls back to for a batch with a year outside [0, 9999]). Any other format or type: ``pc.strftime`` itself
    (``%S``: Arrow prints a timestamp's fractional seconds; ``%F``: Arrow prints a negative year unlike
    ``%Y-%m-%d``).

    >>> t = pa.array([86_399_999, None, -1], pa.timestamp("ms"))
    >>> _eval(strftime(pc.field("t"), "%d.%m.%Y %H:%M", t.type), t)
    ['01.01.1970 23:59', None, '31.12.1969 23:59']
    """
    tokens = _STRFTIME_TOKENS.findall(fmt)
    timestamp = pa.types.is_timestamp(typ) and typ.tz in (None, "UTC")
    fast = {"%Y-%m-%d", "%Y", "%m", "%d", "%%"} | ({"%H", "%M"} if timestamp else set())
    if not (timestamp or pa.types.is_date(typ)) or any(t[0] == "%" and t not in fast for t in tokens) \
            or all(t[0] != "%" or t == "%%" for t in tokens):
        return pc.strftime(value, format=fmt)
    return pc.Expression._call(_time_format_name(typ), [value, pc.scalar(fmt)])


def _cast_format(value: pc.Expression, fmt: str, typ: pa.DataType) -> pc.Expression:
    """What :func:`strftime` formats in C, built from Arrow's date cast and field kernels (the year as strftime
    prints it, sign and 5 digits past 9999): :func:`_time_format`'s way for years outside [0, 9999]."""
    day = value.cast(pa.date32()).cast(pa.string())  # "YYYY-MM-DD", the year as strftime prints it (sign, 5 digits)

    def two(e: pc.Expression) -> pc.Expression:
        return pc.utf8_lpad(e.cast(pa.string()), width=2, padding="0")

    fields = {"%Y-%m-%d": lambda: day, "%Y": lambda: pc.utf8_slice_codeunits(day, 0, -6),
              "%m": lambda: two(pc.month(value)), "%d": lambda: two(pc.day(value)),
              "%H": lambda: two(pc.hour(value)), "%M": lambda: two(pc.minute(value))}
    parts: list = []  # expressions and literal strings, adjacent literals joined
    for t in _STRFTIME_TOKENS.findall(fmt):
        if t in fields:
            parts.append(fields[t]())
        elif parts and isinstance(parts[-1], str):
            parts[-1] += "%" if t == "%%" else t
        else:
            parts.append("%" if t == "%%" else t)
    if len(parts) == 1:
        return parts[0]
    return pc.binary_join_element_wise(*[pc.scalar(p) if isinstance(p, str) else p for p in parts], "")


_FORMAT_ARG = "__dbsp_time_format_arg__"  # a placeholder field: _cast_format's text over it, then the argument's
_FORMAT_CALL = re.compile(r"(?<![\w.])dbsp_time_format_([a-z0-9_]+)\(")
_UNESCAPE = {'"': '"', "\\": "\\", "n": "\n", "r": "\r", "t": "\t"}


def _scan_call(text: str, start: int) -> tuple[int, int] | None:
    """From just past a call's ``(`` at ``start``: (the index of its last argument's comma, of its closing ``)``),
    skipping string literals (``"..."``, backslash escapes) and balanced parentheses; None if it does not close."""
    depth, comma, i = 0, -1, start
    while i < len(text):
        ch = text[i]
        if ch == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return (comma, i) if ch == ")" and comma >= 0 else None
            depth -= 1
        elif ch == "," and depth == 0:
            comma = i
        i += 1
    return None


def fingerprint_text(text: str) -> str:
    """``text`` (an expression's, as a circuit fingerprint hashes it, circuit.py ``_node_text``) with every call
    ``dbsp_time_format_<type>(<arg>, "<fmt>")`` of :func:`strftime`'s C path written as the expression that
    formatted the same strings before it (:func:`_cast_format` over ``<arg>``) prints: a circuit keeps the
    fingerprint it had, so its checkpoints reopen as the same program. A pure function of the text (no state kept
    when the expression was built), so it gives the same in every process (a Spark executor's unpickled circuit).
    Text that is not such a call (an unknown type, a format that does not print back the same) is left as is.

    >>> t = pa.timestamp("ms")
    >>> fingerprint_text(str(strftime(pc.field("t"), "%H", t))) == str(_cast_format(pc.field("t"), "%H", t))
    True
    """
    out, pos = [], 0
    for m in _FORMAT_CALL.finditer(text):
        if m.start() < pos or m.group(1) not in _TIME_TYPES:
            continue  # inside a call already rewritten (its argument's calls are rewritten with it), or not ours
        scan = _scan_call(text, m.end())
        if scan is None:
            continue
        comma, close = scan
        arg, lit = text[m.end():comma], text[comma + 1:close].strip()
        if not (len(lit) >= 2 and lit[0] == lit[-1] == '"'):
            continue
        fmt = re.sub(r"(?s)\\(.)", lambda e: _UNESCAPE.get(e.group(1), "\\" + e.group(1)), lit[1:-1])
        if str(pc.scalar(fmt)) != lit:  # not a literal this function reads back exactly: leave the text
            continue
        old = str(_cast_format(pc.field(_FORMAT_ARG), fmt, _TIME_TYPES[m.group(1)]))
        out += [text[pos:m.start()], old.replace(_FORMAT_ARG, fingerprint_text(arg))]
        pos = close + 1
    return "".join(out) + text[pos:]


# the column types strftime formats in C, by the suffix of their scalar function's name (registered when this module
# is imported, so an expression naming one runs in any process that imports dbsp_core, e.g. a Spark executor's)
_TIME_TYPES = {**{f"ts_{u}": pa.timestamp(u) for u in ("s", "ms", "us", "ns")},
               **{f"ts_{u}_utc": pa.timestamp(u, tz="UTC") for u in ("s", "ms", "us", "ns")},
               "date32": pa.date32(), "date64": pa.date64()}
_UNITS_PER_DAY = {"s": 86_400, "ms": 86_400_000, "us": 86_400_000_000, "ns": 86_400_000_000_000}


def _time_format_name(typ: pa.DataType) -> str:
    for suffix, t in _TIME_TYPES.items():
        if t == typ:
            return "dbsp_time_format_" + suffix
    raise TypeError(f"strftime: no C formatting for {typ}")  # strftime sends only _TIME_TYPES here


def _time_format(ctx: object, values: "pa.Array | pa.Scalar", fmt: pa.Scalar) -> pa.Array:
    """The scalar function behind :func:`strftime`'s C path: one batch of ``values`` formatted by ``fmt``, by
    csrc/timefmt.h, or by :func:`_cast_format` when a year is outside [0, 9999] (the kernel's invariant 3)."""
    fmt_s = fmt.as_py()
    if isinstance(values, pa.Scalar):  # a literal: the batch's length of it (Arrow's fill, no Python per row)
        values = pa.nulls(ctx.batch_length, values.type).fill_null(values)  # type: ignore[attr-defined]
    typ = values.type
    units = 1 if pa.types.is_date32(typ) else 86_400_000 if pa.types.is_date64(typ) else _UNITS_PER_DAY[typ.unit]
    out = _zset.time_format(values, fmt_s, units)
    if out is None:
        plan = ac.Declaration("project", ac.ProjectNodeOptions([_cast_format(pc.field("t"), fmt_s, typ)], ["x"]))
        out = _run(pa.table({"t": values}), plan).column(0).combine_chunks()
    return out


def _register_time_formats() -> None:
    for suffix, typ in _TIME_TYPES.items():
        name = "dbsp_time_format_" + suffix
        try:
            pc.get_function(name)
        except pa.ArrowKeyError:
            pc.register_scalar_function(
                _time_format, name, {"summary": "strftime by fixed-width fields (dbsp_core.operators.expr)",
                                     "description": "The values formatted by %Y %m %d %H %M %% and literal text."},
                {"values": typ, "format": pa.string()}, pa.string())


_register_time_formats()


def split_parts(strings: "pa.Array | pa.ChunkedArray", sep: str, indexes: Sequence[int]) -> list[pa.Array]:
    """Part ``i`` (0-based) of each string split at the literal ``sep``, for each ``i`` in ``indexes``: null where
    the string is null or has ``i`` parts or fewer. For utf8 and binary strings, one C pass locates the parts and
    copies only them (csrc/split.h); else one ``split_pattern`` for all the parts, then a gather per part at the
    list offsets (numpy): choosing a part with ``if_else`` over the lists instead copies the lists.

    >>> [a.to_pylist() for a in split_parts(pa.array(["a/b/c", "a", None, "/x/"]), "/", [1, 2])]
    [['b', None, None, 'x'], ['c', None, None, '']]
    """
    if sep and len(indexes) and min(indexes) >= 0 and (pa.types.is_string(strings.type)
                                                       or pa.types.is_binary(strings.type)):
        if isinstance(strings, pa.ChunkedArray):
            strings = strings.combine_chunks()
        return _zset.split_parts(strings, sep, list(indexes))
    lists = pc.split_pattern(strings, sep)
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    off = np.asarray(lists.offsets, dtype=np.int64)  # absolute positions into lists.values
    n = np.diff(off)
    valid = np.asarray(lists.is_valid(), dtype=bool)
    out = []
    for i in indexes:
        has = valid & (n > i)
        out.append(lists.values.take(pa.array(np.where(has, off[:-1] + i, 0), pa.int64(), mask=~has)))
    return out


def _eval(expr: pc.Expression, column: pa.Array) -> list:
    """``expr`` over a one-column table ``t`` (doctests)."""
    out = _run(pa.table({"t": column}), ac.Declaration("project", ac.ProjectNodeOptions([expr], ["x"])))
    return out.column(0).to_pylist()


def project_schema(schema: pa.Schema, exprs: list[pc.Expression], names: list[str], where: str) -> pa.Schema:
    """Output schema of projecting ``exprs`` over ``schema`` (SchemaError if an expression does not bind)."""
    try:
        out = _run(schema.empty_table(), ac.Declaration("project", ac.ProjectNodeOptions(exprs, names)))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError) as exc:
        raise schema_error(where, schema, exc) from None
    return pa.schema([pa.field(f.name, f.type) for f in out.schema])


def check_predicate(schema: pa.Schema, expr: pc.Expression, where: str) -> None:
    """SchemaError unless ``expr`` binds over ``schema`` to a boolean."""
    out = project_schema(schema, [expr], ["p"], where)
    t = out.field(0).type
    if not (pa.types.is_boolean(t) or pa.types.is_null(t)):
        raise SchemaError(f"{where}: the predicate must be boolean, got {t}")


def hidden_column(schema: pa.Schema, also: Sequence[str] = ()) -> str:
    """The name of the hidden weight column over ``schema``: ``WEIGHT_COL``, lengthened until no data column (nor
    a name in ``also``) has it, so any column name works."""
    names = set(schema.names) | set(also)
    name = WEIGHT_COL
    while name in names:
        name += "_"
    return name


def with_weights(data: pa.Table, weights: np.ndarray, hidden: str | None = None) -> pa.Table:
    """``data`` plus the hidden weight column (the last one)."""
    return data.append_column(hidden or hidden_column(data.schema), pa.array(weights, type=pa.int64()))


def split_weights(table: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """Inverse of :func:`with_weights`."""
    last = table.num_columns - 1
    w = np.array(table.column(last).to_numpy(), dtype=np.int64)  # a writable copy
    return table.remove_column(last), w


def filter_rows(data: pa.Table, weights: np.ndarray, expr: pc.Expression) -> tuple[pa.Table, np.ndarray]:
    """Rows where ``expr`` is true (null counts as false), with their weights: the predicate evaluated alone (an
    Acero projection of one boolean column, reading only the columns it names), then the rows kept gathered once
    into one chunk per column (zset.py ``_take``). Acero's filter node copied every column batch by batch, and
    its chunks were combined into one afterwards: two copies of each row kept, half as fast on q14's bids."""
    keep = _run(data, ac.Declaration("project", ac.ProjectNodeOptions([expr], ["keep"]))).column(0)
    if keep.null_count:
        keep = pc.fill_null(keep, False)
    rows = np.flatnonzero(np.asarray(keep.to_numpy(zero_copy_only=False), dtype=bool))
    try:
        return _take(data, rows), weights[rows]
    except SchemaError:  # a column type the C gathers do not read (a list, a struct, ...): Arrow's take
        return data.take(pa.array(rows, pa.int64())).combine_chunks(), weights[rows]


def project_rows(data: pa.Table, weights: np.ndarray, exprs: list[pc.Expression], names: list[str]
                 ) -> tuple[pa.Table, np.ndarray]:
    """Evaluate ``exprs`` (named ``names``) on every row, with the rows' weights."""
    hidden = hidden_column(data.schema, names)
    exprs = list(exprs) + [pc.field(hidden)]
    names = list(names) + [hidden]
    out = _run(with_weights(data, weights, hidden), ac.Declaration("project", ac.ProjectNodeOptions(exprs, names)))
    return split_weights(out)
