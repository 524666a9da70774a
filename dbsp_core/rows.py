"""Rows in the forms users hold them (Arrow, pandas, polars, dicts of columns, lists of row dicts or tuples) made into Arrow tables of an input's schema with safe casts, for ``Pipeline.push`` and ``FileSource``.

Invariants (enforced here):
  1. Conversion is columnar: Arrow and pandas data go to Arrow through pyarrow, without Python per row; a list of
     rows is converted by pyarrow (row dicts) or transposed by ``zip`` (row tuples), then typed column by column.
  2. :func:`conform` takes columns by the input's names and casts them safely (Arrow ``safe=True``: an int64 value
     that fits an int32 column is taken, one that does not is refused, and so is a float with a fraction for an
     integer column); what fails is a SchemaError naming the column, the first row that does not fit, and its
     value. Nothing is ever truncated or dropped silently.
  3. Finding the row is done only after a failure (by halving the prefix that fails), so it costs nothing on the
     path of good data.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pyarrow as pa

from dbsp_core.errors import SchemaError

__all__ = ["as_table", "conform", "key_rows"]

_CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError)


def _first_bad(n: int, fails: Callable[[int], bool]) -> int:
    """The index of the first row that makes a prefix fail, given that the prefix of length ``n`` fails."""
    lo, hi = 0, n  # the prefix of length lo converts, that of length hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid
    return hi - 1


def _fails(convert: Callable[[int], Any]) -> Callable[[int], bool]:
    def fails(m: int) -> bool:
        try:
            convert(m)
        except _CAST_ERRORS:
            return True
        return False
    return fails


def _column(name: str, values: Any, where: str) -> pa.Array | pa.ChunkedArray:
    """One column of a dict of columns as Arrow (types inferred; :func:`conform` casts them)."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    try:
        return pa.array(values)
    except _CAST_ERRORS as e:
        if isinstance(values, (list, tuple)) and values:
            i = _first_bad(len(values), _fails(lambda m: pa.array(values[:m])))
            raise SchemaError(f"{where}: the values of column {name!r} do not convert to one Arrow type: row {i} "
                              f"holds {values[i]!r} ({e})") from None
        raise SchemaError(f"{where}: the values of column {name!r} do not convert to Arrow: {e}") from None


def _from_rows(rows: list | tuple, schema: pa.Schema, where: str) -> pa.Table:
    if not rows:
        return schema.empty_table()
    if isinstance(rows[0], Mapping):
        try:
            return pa.Table.from_struct_array(pa.array(rows))  # the columns are every key any row has
        except _CAST_ERRORS as e:
            i = _first_bad(len(rows), _fails(lambda m: pa.array(rows[:m])))
            raise SchemaError(f"{where}: row {i} ({rows[i]!r}) does not convert like the rows before it: {e}; give "
                              f"a list of row dicts (a key missing from a row is null) or of row tuples") from None
    if not isinstance(rows[0], (tuple, list)):
        raise TypeError(f"{where}: a list of rows holds row dicts or row tuples, got {type(rows[0]).__name__}")
    n = len(schema)
    try:
        sizes = set(map(len, rows))
    except TypeError:  # a row that is not a sequence
        sizes = set()
    if sizes != {n} or not all(isinstance(r, (tuple, list)) for r in rows):
        i = next(i for i, r in enumerate(rows) if not isinstance(r, (tuple, list)) or len(r) != n)
        raise SchemaError(f"{where}: row {i} ({rows[i]!r}) is not a tuple of {n} values, one per column of the "
                          f"input {schema.names}")
    return pa.table({name: _column(name, list(col), where) for name, col in zip(schema.names, zip(*rows))})


def as_table(data: Any, schema: pa.Schema, where: str) -> pa.Table | None:
    """``data`` as an Arrow table (not yet cast, see :func:`conform`), or None if it is none of the forms: a pa.Table
    or RecordBatch, a pandas or polars DataFrame, a dict of columns (lists, numpy or Arrow arrays), or a list of
    row dicts or of row tuples (in the order of ``schema``'s columns)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    module = type(data).__module__ or ""
    if module.startswith("pandas") and type(data).__name__ == "DataFrame":
        try:
            return pa.Table.from_pandas(data, preserve_index=False)
        except _CAST_ERRORS as e:
            raise SchemaError(f"{where}: the DataFrame does not convert to Arrow: {e}") from None
    if module.startswith("polars") and type(data).__name__ == "DataFrame":  # polars is never imported here
        return data.to_arrow()
    if isinstance(data, Mapping):
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise SchemaError(f"{where}: a dict of columns needs str column names, got {bad[0]!r}")
        return pa.table({k: _column(k, v, where) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return _from_rows(data, schema, where)
    return None


def conform(table: pa.Table, schema: pa.Schema, where: str, *, weight: str | None = None,
            extra: bool = False) -> pa.Table:
    """``table``'s columns named by ``schema``, cast safely to its types (invariant 2), then the integer
    ``weight`` column (cast to int64) if one of that name is there; other columns are ignored if ``extra`` and
    a SchemaError otherwise, as is a missing column."""
    have = table.column_names
    names = list(schema.names)
    fields = list(schema)
    if weight is not None and weight in have and weight not in names:
        names.append(weight)
        fields.append(pa.field(weight, pa.int64()))
    missing = [n for n in schema.names if n not in have]
    unknown = [n for n in have if n not in names]
    if missing or (unknown and not extra):
        what = "; ".join(([f"no column {missing}"] if missing else [])
                         + ([f"columns {unknown} are not the input's"] if unknown and not extra else []))
        raise SchemaError(f"{where}: columns {have} do not match the input's {list(schema.names)}: {what}")
    table = table.select(names)
    target = pa.schema(fields)
    try:
        return table.cast(target, safe=True)
    except _CAST_ERRORS as e:
        err = e
    for f in fields:  # which column and row: only after a failure (invariant 3)
        col = table.column(f.name)
        try:
            col.cast(f.type, safe=True)
        except _CAST_ERRORS as e:
            i = _first_bad(len(col), _fails(lambda m, c=col, t=f.type: c.slice(0, m).cast(t, safe=True)))
            raise SchemaError(f"{where}: the values of column {f.name!r} ({col.type}) do not cast to the input's "
                              f"{f.type}: row {i} holds {col[i].as_py()!r} ({e})") from None
    raise SchemaError(f"{where}: columns ({', '.join(f'{f.name} {f.type}' for f in table.schema)}) do not cast to "
                      f"the input's ({', '.join(f'{f.name} {f.type}' for f in fields)}): {err}") from None


def key_rows(data: Any, schema: pa.Schema, key: tuple[str, ...], where: str) -> pa.Table:
    """Rows of ``schema`` holding the keys ``data`` names (columns ``key``, in any form :func:`as_table` takes, or
    for a one-column key a list, numpy or Arrow array or pandas Series of its values), cast by :func:`conform`,
    every other column null: the rows a delete by key pushes.

    >>> s = pa.schema([("k", pa.int32()), ("v", pa.utf8())])
    >>> key_rows([1, 2], s, ("k",), "delete").to_pylist()
    [{'k': 1, 'v': None}, {'k': 2, 'v': None}]
    """
    kschema = pa.schema([schema.field(k) for k in key])
    if len(key) == 1:
        if type(data).__name__ == "Series" and (type(data).__module__ or "").startswith("pandas"):
            data = data.to_numpy()
        if isinstance(data, (pa.Array, pa.ChunkedArray)) or type(data).__name__ == "ndarray" or (
                isinstance(data, (list, tuple)) and data and not isinstance(data[0], (Mapping, list, tuple))):
            data = {key[0]: data}  # a one-column key's values
    table = as_table(data, kschema, where)
    if table is None:
        raise TypeError(f"{where}: expected the key columns {list(key)} as a pyarrow Table or RecordBatch, pandas or "
                        f"polars DataFrame, dict of columns, list of row dicts or tuples, or (for a one-column key) a "
                        f"list of values; got {type(data).__name__}")
    table = conform(table, kschema, where)
    n = table.num_rows
    return pa.Table.from_arrays([table.column(f.name) if f.name in key else pa.nulls(n, f.type) for f in schema],
                                schema=schema)
