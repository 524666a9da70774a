"""Z-sets: collections of rows with non-zero int64 weights, and indexed Z-sets grouped by key, over native kernels.

Invariants:
 1. ``ZSet._data`` is a pyarrow Table whose columns each hold exactly one chunk; ``ZSet._w`` is a contiguous
    int64 numpy array with one weight per row of ``_data``.
 2. When ``_consolidated`` is true, no two rows are equal (null == null, -0.0 == 0.0, NaN == NaN), no weight is
    zero, and rows are in canonical order (csrc/rows.h): by row hash, then by value; ``_rhash`` then holds the
    row hashes in that order. When ``_distinct`` is true (always when ``_consolidated`` is), no two rows are equal
    and no weight is zero, in any order: the Z-set's consolidated content, as an operator that produces its rows
    distinct hands it over (a step's output needs no sort to be read). Whatever the flags, ``_rhash`` when not None
    holds the stored rows' row hashes in stored order (always set when consolidated).
 3. An IndexedZSet's ZSet is consolidated and in canonical order for its key: by key hash, then row hash, then
    value; ``key_hash`` holds the key hashes, ascending.
 4. ``ZSet.num_rows`` (a slot) equals ``_data.num_rows``: set with ``_data`` by the two constructors (``_make``,
    ``empty``), the only places that assign either.
Every operation validates its inputs before touching any state and never mutates a ZSet: Z-sets are values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core import _zset
from dbsp_core.errors import SchemaError

__all__ = ["ZSet", "IndexedZSet", "HASH_VERSION", "FENCE_STEP", "ones", "weight_column"]

FENCE_STEP = 64  # csrc/lookup.h: a fence holds every 64th key hash (IndexedZSet._fence, trace/batchfile.py)

HASH_VERSION: int = _zset.HASH_VERSION
"""Version of the row/key hash (csrc/hash.h); shard placement depends on it."""


def _check_schema(schema: pa.Schema) -> None:
    if len(schema) == 0:
        raise SchemaError("a Z-set needs at least one column; the schema has none")
    for field in schema:
        if _zset.type_code(field.type) is None:
            raise SchemaError(
                f"column {field.name!r} has unsupported type {field.type}; supported: bool, int8..int64, "
                "uint8..uint64, float32/64, date32, timestamp, utf8, large_utf8, binary, large_binary"
            )


def _as_table(data: Any, what: str = "data") -> pa.Table:
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return data
    raise TypeError(f"{what} must be a pyarrow Table or RecordBatch, got {type(data).__name__}")


def _concat_batches(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of the rows of ``batches`` (one schema), each column one contiguous array: one Arrow call
    (a third of concatenating tables and combining their chunks)."""
    if len(batches) == 1:
        return batches[0]
    if _CONCAT_BATCHES is not None:
        return _CONCAT_BATCHES(batches)
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


_CONCAT_BATCHES = getattr(pa, "concat_batches", None)  # pyarrow >= 19

# rows from which ZSet.concat looks whether its parts are slices of one table (_rejoin, ~4.5 us for two parts: a
# column and its buffers wrapped per part) before copying them: below it the copy (~24 KiB at 1,000 rows of three
# int64 columns, ~2 us) costs less than the look, and a step's small pushes are seldom such slices
_REJOIN_MIN_ROWS = 1 << 14


def _rejoin(batches: list[pa.RecordBatch]) -> tuple[pa.RecordBatch, list[int]] | None:
    """The record batch that ``batches`` were sliced from, when together they cover one contiguous range of it
    in some order (every column's buffers shared, offsets adjacent), with that order; else None. No row is
    copied: the result views the same buffers."""
    firsts = [b.column(0) for b in batches]
    key = [(x.buffers(), x.offset) for x in firsts]
    if any(not _same_buffers(k[0], key[0][0]) for k in key[1:]):  # the common case: fails here, ~1 us a part
        return None
    order = sorted(range(len(batches)), key=lambda i: key[i][1])
    cols = []
    for j in range(batches[0].num_columns):
        arrs = [batches[i].column(j) for i in order]
        bufs, end = arrs[0].buffers(), arrs[0].offset
        for a in arrs:
            if a.offset != end or not _same_buffers(a.buffers(), bufs):
                return None
            end += len(a)
        cols.append(pa.Array.from_buffers(arrs[0].type, end - arrs[0].offset, bufs, offset=arrs[0].offset))
    return pa.RecordBatch.from_arrays(cols, schema=batches[0].schema), order


def _same_buffers(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y or (x is not None and y is not None and x.address == y.address
                                               and x.size == y.size) for x, y in zip(a, b))


def _single_chunk(table: pa.Table) -> pa.Table:
    if table.num_columns == 0:
        return table
    batches = table.to_batches()  # skips empty chunks: one batch means one non-empty chunk per column
    if len(batches) == 1:
        # the common case: rebuilt from its one batch (~1 us, vs ~3 us to inspect every column), which also
        # drops empty chunks
        return pa.Table.from_batches(batches, schema=table.schema)
    return table.combine_chunks() if table.num_rows else pa.table(
        {f.name: pa.array([], type=f.type) for f in table.schema}, schema=table.schema)


_ONES = np.ones(1 << 16, dtype=np.int64)
_ONES.flags.writeable = False


def ones(n: int) -> np.ndarray:
    """A new writable int64 array of ``n`` ones (a push's weights): a copy of a slice of one array of ones, which
    costs a fifth of ``np.ones`` (a Python function of numpy's, through its dispatcher) for a push's rows."""
    return _ONES[:n].copy() if n <= 65536 else np.ones(n, dtype=np.int64)


def _as_weights(weights: Any, n: int) -> np.ndarray:
    if weights is None:
        return ones(n)
    if isinstance(weights, (pa.Array, pa.ChunkedArray)):
        if not pa.types.is_integer(weights.type):
            raise TypeError(f"weights must be integers, got Arrow type {weights.type}")
        if weights.null_count:
            raise ValueError(f"weights must not be null ({weights.null_count} nulls)")
        weights = weights.to_numpy(zero_copy_only=False)
    w = np.asarray(weights)
    if w.ndim != 1:
        raise ValueError(f"weights must be one-dimensional, got shape {w.shape}")
    if w.dtype.kind not in "iu":
        if w.size == 0 and w.dtype.kind == "f":
            w = w.astype(np.int64)
        else:
            raise TypeError(f"weights must be integers, got dtype {w.dtype}")
    if w.dtype.kind == "u" and w.size and w.max() > np.iinfo(np.int64).max:
        raise ValueError("weights must fit in int64")
    if w.shape[0] != n:
        raise ValueError(f"got {w.shape[0]} weights for {n} rows")
    out = np.ascontiguousarray(w, dtype=np.int64)
    if np.shares_memory(out, w) and w.flags.writeable:  # a Z-set is a value: the caller's array may change later
        out = out.copy()
    return out


def weight_column(schema: pa.Schema) -> str:
    """The name of the weight column :meth:`ZSet.to_arrow` adds to rows of ``schema``: ``"weight"``, or when a
    data column has that name, the first of ``"_weight"``, ``"__weight"``, ... that none has.

    >>> weight_column(pa.schema([("x", pa.int64())])), weight_column(pa.schema([("weight", pa.int64())]))
    ('weight', '_weight')
    """
    names = set(schema.names)
    name = "weight"
    while name in names:
        name = "_" + name
    return name


def _same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    if a is b or a.equals(b):  # the common case, decided in C
        return True
    return a.names == b.names and all(x.type == y.type for x, y in zip(a, b))


def _require_same_schema(a: pa.Schema, b: pa.Schema, op: str) -> None:
    if not _same_columns(a, b):
        raise SchemaError(f"{op}: schemas differ: {_fmt_schema(a)} vs {_fmt_schema(b)}")


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema` (same names and types; nullability or metadata may differ): cast if needed."""
    return table if table.schema.equals(schema) else table.cast(schema)


def _fmt_schema(s: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in s) + ")"


_GATHER_MIN = 1 << 12  # rows from which _take uses the gather whose buffers come from Arrow's pool (large takes)


def _take(table: pa.Table, idx: np.ndarray, view: Any = None) -> pa.Table:
    """Rows of `table` at `idx`, each column one chunk (no Python per row), by a C gather: large takes into Arrow's
    memory pool (csrc/gather.h; a consolidated batch's rows come in hash order, i.e. randomly, so it prefetches),
    small ones in one call over every column handed over through the C data interface (csrc/cdata.h), which
    costs a fraction of Arrow's take per call. `view` is a BatchView of `table` the caller already holds."""
    n = idx.shape[0]
    if n == table.num_rows and (n == 0 or (idx[0] == 0 and idx[n - 1] == n - 1
                                          and np.array_equal(idx, np.arange(n)))):
        return table
    if table.num_columns == 0:
        return _single_chunk(table.take(pa.array(idx, type=pa.int64())))
    if n >= _GATHER_MIN:
        return _zset.gather(table, idx)
    return _zset.take(table if view is None else view, idx)


def _column_positions(schema: pa.Schema, columns: Sequence[str], op: str) -> list[int]:
    if isinstance(columns, str):
        columns = [columns]
    pos = []
    for c in columns:
        if not isinstance(c, str):
            raise TypeError(f"{op}: column names must be strings, got {c!r}")
        i = schema.get_field_index(c)
        if i < 0:
            raise SchemaError(f"{op}: unknown column {c!r}; columns are {schema.names}")
        pos.append(i)
    return pos


_NO_WEIGHTS = np.zeros(0, dtype=np.int64)
_NO_HASHES = np.zeros(0, dtype=np.uint64)
_EMPTY: dict[int, tuple[pa.Schema, "ZSet"]] = {}  # ZSet.empty's cache, by id of the schema object


class ZSet:
    """A Z-set: rows (an Arrow table) with non-zero int64 weights; a table's change or a table itself.

    Z-sets form a group under ``+``, ``-`` and unary ``-``. Equal rows (null equals null, -0.0 equals 0.0,
    NaN equals NaN) are one row whose weight is the sum of theirs; rows whose weights sum to 0 disappear.
    ``num_rows`` is the number of stored rows (before consolidation; ``len`` counts distinct rows).

    Examples
    --------
    >>> import pyarrow as pa
    >>> z = ZSet.from_arrow(pa.table({"k": [1, 1, 2], "v": ["a", "a", "b"]}))
    >>> sorted(z.to_dict().items())
    [((1, 'a'), 2), ((2, 'b'), 1)]
    >>> (z - z).to_dict()
    {}
    """

    __slots__ = ("_data", "_w", "_consolidated", "_rhash", "_distinct", "num_rows")
    # num_rows: the number of stored rows (before consolidation), ``_data.num_rows`` read once when the Z-set is made
    # (a slot, not a property: read by every operator call and the driver, ~20 times a small step, each a call of
    # Python as a property; invariant 4)
    num_rows: int
    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        raise TypeError("use ZSet.from_arrow, ZSet.from_rows or ZSet.empty to build a ZSet")

    # ---- construction ----

    @classmethod
    def _make(cls, data: pa.Table, weights: np.ndarray, consolidated: bool = False,
              rhash: np.ndarray | None = None, distinct: bool = False, chunked: bool = False) -> ZSet:
        """Internal constructor without validation (invariants 1 and 2 are the caller's duty, except that a claim of
        canonical order without row hashes is checked). ``chunked``: ``data`` holds one chunk per column already (a
        Z-set's own ``_data``, or a table of one non-empty record batch), so it is not rebuilt (~1.2 us)."""
        z = object.__new__(cls)
        z._data = data = data if chunked else _single_chunk(data)
        z.num_rows = data.num_rows
        z._w = weights
        z._consolidated = consolidated
        if consolidated and rhash is None:
            # invariant 2 is checked, not trusted, when the caller cannot hand over the row hashes
            rhash = _zset.hash_columns(z._data, list(range(z._data.num_columns)))
            consolidated = _zset.check_order(z._data, weights, rhash, [])
            z._consolidated = consolidated
        z._distinct = distinct or consolidated
        z._rhash = rhash
        return z

    @classmethod
    def from_arrow(cls, table: pa.Table | pa.RecordBatch, weights: Any = None) -> ZSet:
        """A Z-set from an Arrow table or record batch and int64-convertible weights (None: every row +1).

        Examples
        --------
        >>> import pyarrow as pa
        >>> ZSet.from_arrow(pa.table({"x": [5, 5]}), weights=[2, -3]).to_dict()
        {(5,): -1}
        """
        t = _as_table(table)
        _check_schema(t.schema)
        w = _as_weights(weights, t.num_rows)
        return cls._make(t, w)

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[Any]], schema: pa.Schema, weights: Any = None) -> ZSet:
        """A Z-set from row tuples of the given schema (for small data: the conversion runs in Python).

        Examples
        --------
        >>> import pyarrow as pa
        >>> s = pa.schema([("k", pa.int64()), ("name", pa.string())])
        >>> ZSet.from_rows([(1, "x"), (2, None)], s, weights=[1, -1]).to_dict()
        {(1, 'x'): 1, (2, None): -1}
        """
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"schema must be a pyarrow Schema, got {type(schema).__name__}")
        _check_schema(schema)
        rows = list(rows)
        ncols = len(schema)
        for i, r in enumerate(rows):
            if not isinstance(r, (tuple, list)):
                raise TypeError(f"row {i} must be a tuple or list, got {type(r).__name__}")
            if len(r) != ncols:
                raise ValueError(f"row {i} has {len(r)} values but the schema has {ncols} columns {schema.names}")
        arrays = []
        for j, field in enumerate(schema):
            try:
                arrays.append(pa.array([r[j] for r in rows], type=field.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise TypeError(f"column {field.name!r} ({field.type}): {e}") from e
        return cls.from_arrow(pa.Table.from_arrays(arrays, schema=schema), weights)

    @classmethod
    def empty(cls, schema: pa.Schema) -> ZSet:
        """The zero Z-set of a schema (one shared value per schema object: Z-sets are immutable)."""
        hit = _EMPTY.get(id(schema))
        if hit is not None and hit[0] is schema:
            return hit[1]
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"schema must be a pyarrow Schema, got {type(schema).__name__}")
        _check_schema(schema)
        t = schema.empty_table()
        z = object.__new__(cls)
        z._data, z._w, z._consolidated, z._rhash, z._distinct, z.num_rows = t, _NO_WEIGHTS, True, _NO_HASHES, True, 0
        if len(_EMPTY) >= 4096:  # schemas are few (one per operator); this only bounds a pathological caller
            _EMPTY.clear()
        _EMPTY[id(schema)] = (schema, z)  # the entry keeps the schema alive, so its id is not reused
        return z

    @classmethod
    def concat(cls, zsets: Sequence[ZSet]) -> ZSet:
        """The sum of Z-sets of one schema, without consolidating (cheap; consolidation happens on demand). Parts
        that are slices of one table covering a contiguous range (a push spread over the workers and handed
        through, as by a projection-free view) are joined again without copying, in their order in that table;
        the row hashes of parts that all hold theirs are kept."""
        zsets = list(zsets)
        if not zsets:
            raise ValueError("concat needs at least one ZSet (the schema comes from it)")
        first = zsets[0]
        if not isinstance(first, ZSet):
            raise TypeError(f"concat expects ZSets, got {type(first).__name__}")
        schema = first._data.schema
        base = None  # the schema of the first part with rows: the others are conformed to it
        parts, tables, weights, rows, rhashed = [], [], [], 0, True
        for z in zsets:
            if not isinstance(z, ZSet):
                raise TypeError(f"concat expects ZSets, got {type(z).__name__}")
            t = z._data
            ts = schema if z is first else t.schema
            if ts is not schema and not schema.equals(ts):  # (the common case decided in C, without a call)
                _require_same_schema(schema, ts, "concat")
            n = z.num_rows
            if n:
                if base is None:
                    base = ts
                elif ts is not base:
                    t = _conform(t, base)
                parts.append(z)
                tables.append(t)
                weights.append(z._w)
                rows += n
                if z._rhash is None:
                    rhashed = False
        if len(parts) <= 1:
            return parts[0] if parts else first
        batches = []
        for t in tables:  # one each (invariant 1: one chunk per column); (a loop: no comprehension's function call)
            batches += t.to_batches()
        joined = _rejoin(batches) if rows >= _REJOIN_MIN_ROWS and len(batches) == len(parts) else None
        if joined is not None:
            batch, order = joined
            parts = [parts[i] for i in order]
        elif len(batches) > 1 and _CONCAT_BATCHES is not None:
            batch = _CONCAT_BATCHES(batches)  # (_concat_batches' common case without its call)
        else:
            batch = _concat_batches(batches) if batches else None
        if batch is not None:  # one non-empty record batch: one chunk per column (invariant 1) as it is
            data, chunked = pa.Table.from_batches([batch]), batch.num_columns > 0
        else:
            data, chunked = pa.concat_tables(tables), False
        rh = np.concatenate([p._rhash for p in parts]) if rhashed else None
        return cls._make(data, np.concatenate(weights if joined is None else [p._w for p in parts]), rhash=rh,
                         chunked=chunked)  # (a rejoin reorders parts to their table's order)

    @classmethod
    def _gather_parts(cls, parts: Sequence[tuple[ZSet, np.ndarray]], schema: pa.Schema) -> ZSet:
        """The rows of each ``(zset, indices)`` of ``parts`` in turn, with their weights (and row hashes when every
        part holds them), as one Z-set, not consolidated: ``concat`` of the parts' takes, with each row copied once
        (one gather from every part into one output, csrc/gather.h dbsp_gather_column_at) where the takes and
        their concatenation copy it twice. An exchange's receiver builds its input so from the senders' rows."""
        parts = [(z, i) for z, i in parts if len(i)]
        if not parts:
            return ZSet.empty(schema)
        n = sum(len(i) for _, i in parts)
        if len(parts) == 1 or n < _GATHER_MIN:
            return cls.concat([cls._make(_take(z._data, i), z._w[i], rhash=z._rhash[i] if z._rhash is not None
                                         else None) for z, i in parts])
        first = parts[0][0]
        for z, _ in parts[1:]:
            _require_same_schema(first.schema, z.schema, "concat")
        tables = [first._data] + [_conform(z._data, first._data.schema) for z, _ in parts[1:]]
        try:
            data = _zset.gather_parts(tables, [i for _, i in parts])
        except OverflowError:  # over 2**31 - 1 bytes in one utf8 column: the parts stay apart until concat
            return cls.concat([cls._make(_take(z._data, i), z._w[i]) for z, i in parts])
        w = np.concatenate([z._w[i] for z, i in parts])
        rh = (np.concatenate([z._rhash[i] for z, i in parts]) if all(z._rhash is not None for z, _ in parts)
              else None)
        return cls._make(pa.Table.from_batches(data.to_batches(), schema=data.schema), w, rhash=rh)

    # ---- accessors ----

    @property
    def schema(self) -> pa.Schema:
        """The schema of the data columns (without the weight)."""
        return self._data.schema

    @property
    def data(self) -> pa.Table:
        """The stored rows (possibly unconsolidated), one chunk per column."""
        return self._data

    @property
    def weights(self) -> np.ndarray:
        """The int64 weight of each stored row."""
        return self._w

    @property
    def is_consolidated(self) -> bool:
        return self._consolidated

    def __len__(self) -> int:
        """The number of distinct rows with non-zero weight."""
        return self.num_rows if self._distinct else self.consolidate().num_rows

    def _distinct_rows(self) -> ZSet:
        """This Z-set with no two equal rows and no zero weight (invariant 2): itself when it is so already, in
        whatever order its rows are, else consolidated (canonical order)."""
        return self if self._distinct else self.consolidate()

    def _distinct_unsorted(self) -> ZSet:
        """The same Z-set with equal rows summed and zero weights dropped, in no particular order (invariant 2,
        distinct): each set of equal rows stays where its first row is, and with no two rows equal and no zero
        weight (a step's usual output) the data is kept as it is. It hashes and probes, but neither sorts nor (then)
        gathers, which consolidation does (csrc/zset.c, distinct-rows design notes). Row hashes the Z-set holds
        already are used (a concatenation of parts that had them) and kept; without them the probe hashes rows its
        own, cheaper way (design note 5) and the result holds none (a sum's part that needs them:
        :meth:`_hashed_part`).

        >>> z = ZSet.from_arrow(pa.table({"x": [3, 1, 3, 2]}), weights=[1, 1, -1, 1])._distinct_unsorted()
        >>> z.data.column("x").to_pylist(), z.weights.tolist()
        ([1, 2], [1, 1])
        """
        if self._distinct or self._rhash is not None:
            return self._hashed_part(0.0)
        v = _zset.BatchView(self._data, self._w)  # one view for the probe and the take
        kept = _zset.distinct_rows(v, self._w)
        if kept is None:
            return ZSet._make(self._data, self._w, distinct=True, chunked=True)
        idx, w = kept
        return ZSet._make(_take(self._data, idx, v), w, distinct=True)

    def _hashed_part(self, keep_below: float = 0.125) -> ZSet:
        """This Z-set as one part of a sum that is made distinct afterwards (:meth:`_distinct_unsorted` of the
        concatenation): with its row hashes, and made distinct here only when that drops at least ``keep_below``
        of its rows (0: always, which is :meth:`_distinct_unsorted`), so a part that shrinks much is gathered where it is (a worker's thread) while one with a few
        equal rows (a push of a bag handed through) is left as it is: the sum's one gather removes them, where a
        gather here would copy every row once more, and the concatenation of parts that are slices of one push
        stays a view (:meth:`concat`).

        >>> z = ZSet.from_arrow(pa.table({"x": [1, 2, 3, 4, 5, 6, 7, 8, 8]}))._hashed_part()
        >>> z.num_rows, z._rhash is not None, z._distinct
        (9, True, False)
        >>> ZSet.from_arrow(pa.table({"x": [7, 7]}))._hashed_part().to_dict()
        {(7,): 2}
        """
        if self._distinct and self._rhash is not None:
            return self
        rh = self._rhash
        if self._distinct:  # (rh is None)
            rh = _zset.hash_columns(self._data, list(range(self._data.num_columns)))
            return ZSet._make(self._data, self._w, distinct=True, rhash=rh, chunked=True)
        # one view of the rows for the hash, the probe and the take (each export costs ~25-45k instructions)
        v = _zset.BatchView(self._data, self._w)
        if rh is None:  # hashed and probed in one C pass (csrc/zset.c design note 4)
            rh, kept = _zset.hash_distinct(v, self._w)
        else:
            kept = _zset.distinct(v, self._w, rh)
        if kept is None:
            return ZSet._make(self._data, self._w, distinct=True, rhash=rh, chunked=True)
        idx, w = kept
        n = self._data.num_rows
        if n - len(idx) < keep_below * n:
            return ZSet._make(self._data, self._w, rhash=rh, chunked=True)
        return ZSet._make(_take(self._data, idx, v), w, distinct=True, rhash=rh[idx])

    # ---- kernels ----

    def consolidate(self) -> ZSet:
        """The same Z-set with equal rows merged, zero weights dropped, in canonical order."""
        if self._consolidated:
            return self
        v = _zset.BatchView(self._data, self._w)  # one view for the kernel and the take
        idx, w, rh = _zset.consolidate(v, None, [])
        return ZSet._make(_take(self._data, idx, v), w, consolidated=True, rhash=rh)

    def hash(self, columns: Sequence[str]) -> np.ndarray:
        """The DBSP key hash (version ``HASH_VERSION``) of each stored row over `columns`, as uint64.

        Examples
        --------
        >>> import pyarrow as pa
        >>> z = ZSet.from_arrow(pa.table({"a": pa.array([5], pa.int32())}))
        >>> y = ZSet.from_arrow(pa.table({"a": pa.array([5], pa.int64())}))
        >>> bool(z.hash(["a"])[0] == y.hash(["a"])[0])
        True
        """
        return _zset.hash_columns(self._data, _column_positions(self.schema, columns, "hash"))

    def _row_hashes(self) -> np.ndarray:
        z = self.consolidate()
        return z._rhash

    def partition(self, key_columns: Sequence[str], part_of_shard: np.ndarray, nparts: int) -> list[ZSet]:
        """Split rows into `nparts` Z-sets: row -> ``part_of_shard[shard]``, shard = top bits of the key hash.

        `part_of_shard` has a power-of-two length (2**shard_bits). Row order is kept inside each part.
        """
        if not isinstance(nparts, (int, np.integer)) or nparts < 1:
            raise ValueError(f"nparts must be a positive int, got {nparts!r}")
        kh = self.hash(key_columns)
        perm, offsets = _zset.partition(kh, part_of_shard, int(nparts))
        data = _take(self._data, perm)
        w = self._w[perm]
        rh = self._rhash[perm] if self._consolidated else None
        out = []
        for p in range(nparts):
            s, e = int(offsets[p]), int(offsets[p + 1])
            out.append(ZSet._make(data.slice(s, e - s), w[s:e], consolidated=self._consolidated,
                                  rhash=rh[s:e] if rh is not None else None))
        return out

    def index_by(self, key_columns: Sequence[str]) -> IndexedZSet:
        """This Z-set consolidated and ordered by the key hash of `key_columns`: the form joins and aggregates use.

        Examples
        --------
        >>> import pyarrow as pa
        >>> ix = ZSet.from_arrow(pa.table({"k": [2, 1, 2], "v": [1, 2, 3]})).index_by(["k"])
        >>> ix.key, len(ix)
        (('k',), 3)
        """
        pos = _column_positions(self.schema, key_columns, "index_by")
        if not pos:
            raise ValueError("index_by needs at least one key column")
        v = _zset.BatchView(self._data, self._w)  # one view for the kernel and the take
        idx, w, kh, rh = _zset.consolidate(v, None, pos, True)
        out = IndexedZSet._make(ZSet._make(_take(self._data, idx, v), w, consolidated=False), tuple(key_columns), kh)
        out._rh = rh  # the row hashes, when the kernel had them (csrc/zset.h consolidate_rh): trace merges use them
        return out

    def aggregate(self, key_columns: Sequence[str], aggs: Sequence[tuple[str, str | None]],
                  consolidate: bool = True, keep_zero: bool = False) -> pa.Table:
        """Grouped aggregates straight from the stored rows, by hash grouping (no index is built).

        Same kinds and result layout as :meth:`IndexedZSet.reduce`. Groups whose weights sum to 0 have no row
        (for a relation, where every weight is positive, that is SQL's GROUP BY) unless ``keep_zero``.
        ``min``/``max`` look at rows by their consolidated weight, so an unconsolidated Z-set is consolidated
        first when they are asked for, unless ``consolidate`` is False: then they look at each stored row with
        a positive weight (the same result when equal rows of opposite weights carry no min/max value).

        Examples
        --------
        >>> import pyarrow as pa
        >>> z = ZSet.from_arrow(pa.table({"k": ["a", "b", "a"], "v": [1.5, 2.0, 4.0]}))
        >>> z.aggregate(["k"], [("sum", "v"), ("count", None)]).sort_by("k").to_pylist()
        [{'k': 'a', 'agg_0': 5.5, 'agg_1': 2}, {'k': 'b', 'agg_0': 2.0, 'agg_1': 1}]
        """
        pos = _column_positions(self.schema, key_columns, "aggregate")
        if not pos:
            raise ValueError("aggregate needs at least one key column")
        specs = _agg_specs(self.schema, aggs)
        z = self.consolidate() if consolidate and any(k in ("min", "max") for k, _ in specs) else self
        group_row, _, ivals, fvals, valid = _zset.group_reduce(z._data, z._w, pos, specs, bool(keep_zero))
        return _agg_table(z._data, list(key_columns), specs, group_row, ivals, fvals, valid)

    def join_rows(self, other: ZSet, left_on: Sequence[str], right_on: Sequence[str],
                  left_outer: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pairs of stored rows with equal keys, by hashing: (left rows, right rows, weight products).

        The one-shot form of :meth:`IndexedZSet.join` for batches that have no index: neither side needs to be
        consolidated (a join is bilinear, so the pairs sum to the same Z-set). Nulls never match; with
        `left_outer`, each left row matching nothing appears once with right row -1 and its own weight; whether
        a key matches depends on the right side's consolidated content, so the right side is consolidated first
        (the returned right rows then index ``other.consolidate().data``).

        Examples
        --------
        >>> import pyarrow as pa
        >>> a = ZSet.from_arrow(pa.table({"k": [1, 2, None]}))
        >>> b = ZSet.from_arrow(pa.table({"id": [2, 2, None], "x": [7, 8, 9]}))
        >>> li, ri, w = a.join_rows(b, ["k"], ["id"])
        >>> sorted(b.data.column("x").take(ri).to_pylist())
        [7, 8]
        """
        if not isinstance(other, ZSet):
            raise TypeError(f"join_rows expects a ZSet, got {type(other).__name__}")
        lpos = _column_positions(self.schema, left_on, "join_rows (left)")
        rpos = _column_positions(other.schema, right_on, "join_rows (right)")
        if len(lpos) != len(rpos) or not lpos:
            raise SchemaError(f"join_rows: {len(lpos)} left key columns but {len(rpos)} right key columns")
        for lk, rk in zip(lpos, rpos):
            lt, rt = self.schema.field(lk).type, other.schema.field(rk).type
            if not _join_compatible(lt, rt):
                raise SchemaError(f"join_rows: key {self.schema.names[lk]!r} ({lt}) cannot match key "
                                  f"{other.schema.names[rk]!r} ({rt})")
        right = other.consolidate() if left_outer else other
        return _zset.hash_join(self._data, self._w, lpos, right._data, right._w, rpos, bool(left_outer))

    # ---- group operations ----

    def __add__(self, other: ZSet) -> ZSet:
        if not isinstance(other, ZSet):
            return NotImplemented
        _require_same_schema(self.schema, other.schema, "ZSet +")
        a, b = self.consolidate(), other.consolidate()
        if b.num_rows == 0:
            return a
        if a.num_rows == 0:
            return b
        bd = _conform(b._data, a._data.schema)
        idx, w, rh = _zset.merge(a._data, a._w, a._rhash, bd, b._w, b._rhash, [])
        both = _single_chunk(pa.concat_tables([a._data, bd]))
        return ZSet._make(_take(both, idx), w, consolidated=True, rhash=rh)

    def __neg__(self) -> ZSet:
        return ZSet._make(self._data, _zset.negate(self._w), self._consolidated, self._rhash, self._distinct)

    def __sub__(self, other: ZSet) -> ZSet:
        if not isinstance(other, ZSet):
            return NotImplemented
        _require_same_schema(self.schema, other.schema, "ZSet -")
        return self + (-other)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ZSet):
            return NotImplemented
        if not _same_columns(self.schema, other.schema):
            return False
        return (self - other).num_rows == 0

    # ---- export ----

    def to_arrow(self) -> pa.Table:
        """The consolidated rows (no two equal, no zero weights) plus an int64 weight column, named ``weight``
        unless a data column has that name (then see :func:`weight_column`). Rows are in canonical order, except
        for a step's output that its operator produced distinct (an aggregate's change, in key order): reading it
        sorts nothing.

        >>> import pyarrow as pa
        >>> ZSet.from_arrow(pa.table({"weight": [7]}), weights=[2]).to_arrow().column_names
        ['weight', '_weight']
        """
        z = self._distinct_rows()
        return z._data.append_column(pa.field(weight_column(z._data.schema), pa.int64(), nullable=False),
                                     pa.array(z._w, pa.int64()))

    def to_dict(self) -> dict[tuple, int]:
        """``{row tuple: weight}`` of the consolidated Z-set (Python objects; for small data and tests)."""
        z = self._distinct_rows()
        cols = [c.to_pylist() for c in z._data.columns]
        rows = zip(*cols) if cols else [() for _ in range(z.num_rows)]
        return {tuple(r): int(w) for r, w in zip(rows, z._w.tolist())}

    def to_pandas(self):
        """The consolidated rows and their ``weight`` as a pandas DataFrame."""
        return self.to_arrow().to_pandas()

    def __repr__(self) -> str:
        state = "consolidated" if self._consolidated else "distinct" if self._distinct else "unconsolidated"
        return f"ZSet({_fmt_schema(self.schema)}, {self.num_rows} rows, {state})"


class IndexedZSet:
    """A consolidated Z-set ordered by the hash of its key columns: the state form of joins and aggregates.

    Rows with equal keys are adjacent, and the rows of one shard (the top bits of the key hash) form one
    contiguous range, so state can be kept, looked up and moved by shard.
    """

    __slots__ = ("_z", "_key", "_kh", "_keypos", "_cv", "_fx", "_rh", "__weakref__")  # a checkpoint's record
    # of saved batches holds them weakly (dbsp_core.storage.snapshot)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        raise TypeError("build an IndexedZSet with ZSet.index_by or IndexedZSet.empty")

    FENCE_MIN = 4096  # rows from which kernels seek through a fence of the key hashes (csrc/lookup.h)

    def _view(self) -> Any:
        """The C view of (rows, weights, key hashes), built on first use and kept: trace batches are read by
        every step, and building a view costs a few microseconds per column. A large batch's view carries a
        fence of its key hashes, so seeks into it touch few cache lines."""
        v = self._cv
        if v is None:
            v = self._cv = _zset.BatchView(self._z._data, self._z._w, self._kh)
            f = self._fence()
            if f is not None:
                v.set_fence(f)
        return v

    def _fence(self) -> np.ndarray | None:
        """Every 64th key hash (built once; None for small batches, where galloping is as cheap)."""
        if len(self._kh) < self.FENCE_MIN:
            return None
        f = self._fx
        if f is None:
            f = self._fx = _zset.fence(self._kh)
        return f

    def _row_hashes(self) -> np.ndarray:
        """The row hash of each row, in index order: kept once computed (or handed over by the merge that made
        the batch), so merging batches whose key hashes meet needs no hashing (csrc/merge.h)."""
        rh = self._rh
        if rh is None:
            if self._keypos == list(range(self._z._data.num_columns)):
                rh = self._kh  # a whole-row key: the key hash is the row hash
            else:
                rh = _zset.hash_columns(self._z._data, list(range(self._z._data.num_columns)))
            self._rh = rh
        return rh

    def _view_as(self, schema: pa.Schema) -> Any:
        """:meth:`_view`, or a fresh view of the rows cast to ``schema`` when their types differ only there."""
        data = _conform(self._z._data, schema)
        return self._view() if data is self._z._data else _zset.BatchView(data, self._z._w, self._kh)

    @classmethod
    def _make(cls, z: ZSet, key: tuple[str, ...], kh: np.ndarray) -> IndexedZSet:
        ix = object.__new__(cls)
        ix._z = z
        ix._key = tuple(key)
        ix._kh = kh
        ix._cv = None
        ix._fx = None
        ix._rh = None
        ix._keypos = _column_positions(z.schema, key, "index")
        return ix

    @classmethod
    def _from_key_order(cls, z: ZSet, key: Sequence[str], kh: np.ndarray, rows: np.ndarray | None = None
                        ) -> IndexedZSet:
        """``z`` (or its rows ``rows``, ascending) indexed by ``key``, given the key hash ``kh`` of each of its rows,
        which are already in key-hash order (an indexed Z-set's rows projected onto its key and other columns, or
        rows built group by group in index order): consolidated by sorting only within runs of equal key hashes
        (csrc/zset.h dbsp_zset_consolidate_runs), the same batch as ``z.index_by(key)`` without hashing the key and
        sorting every row. The batch keeps the row hashes the kernel computed (trace merges use them)."""
        data = z._data
        v = _zset.BatchView(data, z._w)  # one view for the kernel and the take
        idx, w, kho, rh = _zset.consolidate_runs(v, None, kh, rows)
        out = cls._make(ZSet._make(_take(data, idx, v), w, consolidated=False), tuple(key), kho)
        out._rh = rh
        return out

    def _slice(self, start: int, stop: int) -> IndexedZSet:
        """Rows ``start..stop`` of the index order as an indexed Z-set, without copying (the rows of a run of
        shards, which an exchange of indexed rows sends as they are)."""
        n = max(0, stop - start)
        out = IndexedZSet._make(ZSet._make(self._z._data.slice(start, n), self._z._w[start:stop]), self._key,
                                self._kh[start:stop])
        if self._rh is not None:
            out._rh = self._rh[start:stop]
        return out

    @classmethod
    def empty(cls, schema: pa.Schema, key: Sequence[str]) -> IndexedZSet:
        """The empty indexed Z-set of a schema and key."""
        return ZSet.empty(schema).index_by(key)

    @property
    def key(self) -> tuple[str, ...]:
        return self._key

    @property
    def zset(self) -> ZSet:
        """The rows as a ZSet, in index order (consolidated)."""
        return self._z

    @property
    def key_hash(self) -> np.ndarray:
        """The key hash of each row, ascending."""
        return self._kh

    @property
    def schema(self) -> pa.Schema:
        return self._z.schema

    def __len__(self) -> int:
        return self._z.num_rows

    def __repr__(self) -> str:
        return f"IndexedZSet(key={self._key}, {_fmt_schema(self.schema)}, {len(self)} rows)"

    def _check_compatible(self, other: IndexedZSet, op: str) -> None:
        if not isinstance(other, IndexedZSet):
            raise TypeError(f"{op} expects an IndexedZSet, got {type(other).__name__}")
        _require_same_schema(self.schema, other.schema, op)
        if self._key != other._key:
            raise SchemaError(f"{op}: keys differ: {self._key} vs {other._key}")

    def merge(self, other: IndexedZSet) -> IndexedZSet:
        """The consolidated sum of two indexed Z-sets with the same schema and key, in linear time (one pass of
        the resumable C merge run to the end, :func:`merge_cursor`)."""
        self._check_compatible(other, "merge")
        if len(other) == 0:
            return self
        if len(self) == 0:
            return other
        m = merge_cursor(self, other)
        m.step(len(self) + len(other))
        return merged(self, m)

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """Row numbers (ascending, int64) of the rows whose key hash is in `hashes` (ascending uint64; duplicates
        allowed), by galloping over the key hashes in C: the cost grows with ``len(hashes)``, not with the batch.

        Examples
        --------
        >>> import pyarrow as pa
        >>> ix = ZSet.from_arrow(pa.table({"k": [1, 2, 2, 3]})).index_by(["k"])
        >>> want = np.sort(ZSet.from_arrow(pa.table({"k": [2]})).hash(["k"]))
        >>> ix.zset.data.column("k").take(ix.lookup(want)).to_pylist()
        [2]
        """
        return _zset.lookup(self._kh, hashes, self._fence())

    def match_weights(self, other: IndexedZSet, acc: np.ndarray | None = None) -> np.ndarray:
        """For each row of this batch, the weight of the equal row (whole-row identity) in `other`, 0 if none.

        Both batches have one schema and key. With `acc` (int64, one per row), the weights are added to it in
        place and it is returned. A galloping walk in C: the cost grows with this batch, not with `other`, for
        keys that are (nearly) whole rows, such as distinct's; rows of a key hash are compared pairwise.

        Examples
        --------
        >>> import pyarrow as pa
        >>> a = ZSet.from_arrow(pa.table({"k": [1, 2]})).index_by(["k"])
        >>> b = ZSet.from_arrow(pa.table({"k": [2, 2, 3]})).index_by(["k"])
        >>> dict(zip(a.zset.data.column("k").to_pylist(), a.match_weights(b).tolist()))
        {1: 0, 2: 2}
        """
        self._check_compatible(other, "match_weights")
        if acc is None:
            acc = np.zeros(len(self), dtype=np.int64)
        elif not (isinstance(acc, np.ndarray) and acc.dtype == np.int64 and acc.shape == (len(self),)
                  and acc.flags.c_contiguous and acc.flags.writeable):
            raise ValueError(f"match_weights: acc must be a writable contiguous int64 array of {len(self)} values")
        if len(self) and len(other):
            _zset.match_weights(self._view(), None, None, other._view_as(self._z._data.schema), None, None, acc)
        return acc

    def key_sums(self, probe: pa.Table, probe_keys: Sequence[str], khash: np.ndarray, rows: np.ndarray,
                 columns: Sequence[str], acc: np.ndarray | None = None) -> np.ndarray:
        """Weighted sums of this batch's int64 `columns` per probed key, without copying rows out of the batch.

        For i-th probe row ``rows[i]`` of `probe` (their keys over `probe_keys`, matched positionally with this
        batch's key, are distinct; ``khash[i]`` is the key hash of that row, ascending in i), ``acc[i, c]`` is
        the sum over this batch's rows with an equal key (null equals null) of weight times ``columns[c]``
        (a null counts as 0). With `acc` (int64, shape ``(len(rows), len(columns))``) the sums are added to it
        in place. A galloping walk in C: the cost grows with the probe, not with the batch.

        Examples
        --------
        >>> import pyarrow as pa
        >>> ix = ZSet.from_arrow(pa.table({"k": [1, 1, 2], "v": [10, 20, 5]}), weights=[1, 2, -1]).index_by(["k"])
        >>> probe = pa.table({"k": [2, 3, 1]})
        >>> kh = ZSet.from_arrow(probe).hash(["k"])
        >>> order = np.argsort(kh)
        >>> sums = ix.key_sums(probe, ["k"], kh[order], order, ["v"])
        >>> dict(zip(probe.column("k").take(order).to_pylist(), sums[:, 0].tolist()))[1]
        50
        """
        ppos, cpos = _key_sums_positions(self, probe, probe_keys, columns)
        if acc is None:
            acc = np.zeros((len(rows), len(cpos)), dtype=np.int64)
        if len(self):
            self._key_sums(probe, ppos, khash, rows, cpos, acc)
        return acc

    def _key_sums(self, probe: Any, ppos: Sequence[int], khash: np.ndarray, rows: np.ndarray, cpos: Sequence[int],
                  acc: np.ndarray) -> None:
        """:meth:`key_sums` with resolved positions; `probe` may be a prebuilt view (one per step, many batches)."""
        _zset.match_sums(probe, khash, rows, ppos, self._view(), None, None, self._keypos, cpos, acc)

    def slice(self, lo: int, hi: int) -> IndexedZSet:
        """Rows ``lo .. hi - 1`` as a view of the same buffers (no copy); the index order and the row hashes the
        batch keeps are kept.

        >>> import pyarrow as pa
        >>> ix = ZSet.from_arrow(pa.table({"k": [3, 1, 2]})).index_by(["k"])
        >>> len(ix.slice(1, 3)), sorted(ix.slice(0, 3).zset.to_dict()) == sorted(ix.zset.to_dict())
        (2, True)
        """
        z = self._z
        rh = z._rhash[lo:hi] if z._rhash is not None else None
        part = ZSet._make(z._data.slice(lo, hi - lo), z._w[lo:hi], consolidated=z._consolidated, rhash=rh)
        out = IndexedZSet._make(part, self._key, self._kh[lo:hi])
        # the row hashes the batch keeps (index order) slice with it: a trace that takes the slice (a shard cut,
        # dbsp_core/runtime/migrate.py) must not hash its rows again
        out._rh = self._rh[lo:hi] if self._rh is not None else None
        return out

    def take(self, indices: np.ndarray) -> IndexedZSet:
        """The rows at `indices` (ascending indices keep the index order)."""
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        out = IndexedZSet._make(ZSet._make(_take(self._z._data, idx), self._z._w[idx]), self._key, self._kh[idx])
        out._rh = self._rh[idx] if self._rh is not None else None
        return out

    def size_bytes(self) -> int:
        """Bytes of its rows, weights and key hashes: a size estimate for metrics and profiles, which a batch whose
        rows live in a file (trace/groupedbatch.py) gives without reading them."""
        return int(self.zset.data.nbytes) + int(self.zset.weights.nbytes) + int(self.key_hash.nbytes)

    def shard_bounds(self, shard_bits: int, near: bool = False) -> np.ndarray:
        """Row range of every shard: shard s holds rows ``bounds[s]:bounds[s+1]`` (length 2**shard_bits + 1).

        With ``near`` and a fence kept (every ``FENCE_STEP``-th key hash, in memory), each bound comes from the
        fence, within ``FENCE_STEP`` rows of the exact one: the exact ones binary-search the key hashes, which for
        a spilled batch maps pages of its file that no read of the store counts (trace/spill.py invariant 12)."""
        if not 0 <= shard_bits <= 30:
            raise ValueError(f"shard_bits must be in 0..30, got {shard_bits}")
        n = len(self)
        if shard_bits == 0:
            return np.array([0, n], dtype=np.int64)
        starts = np.arange(1 << shard_bits, dtype=np.uint64) << np.uint64(64 - shard_bits)
        if near and self._fx is not None:
            b = np.minimum(np.searchsorted(self._fx, starts, side="left").astype(np.int64) * FENCE_STEP, n)
        else:
            b = np.searchsorted(self._kh, starts, side="left").astype(np.int64)
        return np.append(b, np.int64(n))

    def join(self, other: IndexedZSet, left_outer: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row pairs with equal keys, as (left rows, right rows, weight products); nulls never match.

        Keys match positionally (``self.key[i]`` with ``other.key[i]``); with `left_outer`, every left row that
        matches nothing appears once with right row -1 and its own weight.

        Examples
        --------
        >>> import pyarrow as pa
        >>> a = ZSet.from_arrow(pa.table({"k": [1, 2]})).index_by(["k"])
        >>> b = ZSet.from_arrow(pa.table({"id": [2, 2, 3], "x": [7, 8, 9]})).index_by(["id"])
        >>> li, ri, w = a.join(b)
        >>> sorted(zip(a.zset.data.column("k").take(li).to_pylist(), b.zset.data.column("x").take(ri).to_pylist()))
        [(2, 7), (2, 8)]
        """
        if not isinstance(other, IndexedZSet):
            raise TypeError(f"join expects an IndexedZSet, got {type(other).__name__}")
        if len(self._key) != len(other._key):
            raise SchemaError(f"join: {len(self._key)} left key columns {self._key} but {len(other._key)} right "
                              f"{other._key}")
        for lk, rk in zip(self._key, other._key):
            lt, rt = self.schema.field(lk).type, other.schema.field(rk).type
            if not _join_compatible(lt, rt):
                raise SchemaError(f"join: key {lk!r} ({lt}) cannot match key {rk!r} ({rt})")
        return _zset.join(self._view(), None, None, self._keypos, other._view(), None, None, other._keypos,
                          bool(left_outer))

    def reduce(self, aggs: Sequence[tuple[str, str | None]]) -> pa.Table:
        """Grouped aggregates, one row per distinct key: the key columns, then ``agg_0``, ``agg_1``, ...

        Kinds: ``count`` (sum of weights), ``count_col`` (weighted count of non-null values), ``sum``
        (weight-aware; int64 for integer and bool columns, float64 for floats; null without non-null values),
        ``min`` and ``max`` (the input's type, over rows with positive weight; null when there are none).

        Examples
        --------
        >>> import pyarrow as pa
        >>> ix = ZSet.from_arrow(pa.table({"k": [1, 1, 2], "v": [3, 4, 5]}), weights=[1, 2, 1]).index_by(["k"])
        >>> sorted(ix.reduce([("count", None), ("sum", "v"), ("max", "v")]).to_pylist(), key=lambda r: r["k"])
        [{'k': 1, 'agg_0': 3, 'agg_1': 11, 'agg_2': 4}, {'k': 2, 'agg_0': 1, 'agg_1': 5, 'agg_2': 5}]
        """
        specs = _agg_specs(self.schema, aggs)
        data = self._z._data
        group_row, _, ivals, fvals, valid = _zset.reduce(self._view(), None, None, self._keypos, specs)
        return _agg_table(data, self._key, specs, group_row, ivals, fvals, valid)


def sum_adjacent(z: ZSet, h: np.ndarray) -> ZSet:
    """``z`` with its runs of adjacent equal rows summed, flagged distinct (invariant 2), when equal rows of ``z``
    can only sit side by side with equal hashes ``h[i]`` (a linear aggregate's step emits a group's new and old
    row next to each other, in key-hash order; rows of other groups differ in their keys): a consolidation that
    sorts nothing (csrc/zset.h)."""
    if z.num_rows == 0 or z._distinct:
        return z
    found = _zset.sum_adjacent(z._data, z._w, h)
    if found is None:
        return ZSet._make(z._data, z._w, distinct=True)
    idx, w = found
    return ZSet._make(_take(z._data, idx), np.ascontiguousarray(w), distinct=True)


def merge_cursor(a: IndexedZSet, *others: IndexedZSet, row_hashes: bool = False, spill_dir: str | None = None,
                 prefix: int = 0) -> Any:
    """A resumable merge of two or more non-empty indexed Z-sets of one schema (types) and key (csrc/merge.h; more
    than two in one pass, merge.h invariant 4): ``step(n)`` merges at least n more input rows, ``done`` tells when
    every row is in; :func:`merged` then gives the sum. Rows of meeting keys are ordered by the row hashes the inputs
    keep (else computed where needed); with ``row_hashes`` the sum keeps its own. With ``spill_dir`` the output is
    built in a scratch file's shared mapping there, whose written pages ``drop()`` returns to the page cache
    (bindings/merge.pxi); with ``prefix`` too, the file is named and its rows start ``prefix`` bytes in, so that it
    can become a batch file in place (dbsp_core/trace/batchfile.py ``write_in_place``)."""
    # a key of every column in order hashes like the whole row: the kernel then reuses the key hashes as row
    # hashes ([] = whole-row key) instead of hashing rows whose key hashes meet
    keys = [] if a._keypos == list(range(a._z._data.num_columns)) else a._keypos
    schema = a._z._data.schema
    return _zset.MergeCursor([a._view()] + [b._view_as(schema) for b in others], keys, [a._rh] + [b._rh for b in others],
                             row_hashes and bool(keys), spill_dir, prefix)


def merged(a: IndexedZSet, m: Any) -> IndexedZSet:
    """The result of a finished :func:`merge_cursor` whose first input is ``a``, as an indexed Z-set."""
    table, w, kh, rh = m.result()
    out = IndexedZSet._make(ZSet._make(table, w, chunked=True), a._key, kh)  # (one record batch: invariant 1)
    out._rh = rh
    return out


def _key_sums_positions(ix: IndexedZSet, probe: pa.Table, probe_keys: Sequence[str], columns: Sequence[str]
                        ) -> tuple[list[int], list[int]]:
    """Validated probe key positions and int64 sum column positions for :meth:`IndexedZSet.key_sums`."""
    ppos = _column_positions(probe.schema, probe_keys, "key_sums (probe)")
    if len(ppos) != len(ix._keypos):
        raise SchemaError(f"key_sums: {len(ppos)} probe key columns but the index has {len(ix._keypos)}")
    cpos = _column_positions(ix.schema, columns, "key_sums")
    for c in cpos:
        if not pa.types.is_int64(ix.schema.field(c).type):
            raise SchemaError(f"key_sums: column {ix.schema.names[c]!r} is {ix.schema.field(c).type}, not int64")
    return ppos, cpos


def _agg_specs(schema: pa.Schema, aggs: Sequence[tuple[str, str | None]]) -> list[tuple[str, int | None]]:
    """Validate (kind, column name) aggregates and resolve column positions."""
    specs = []
    for kind, col in aggs:
        if kind == "count":
            specs.append((kind, None))
            continue
        if col is None:
            raise ValueError(f"aggregate {kind!r} needs a column")
        pos = _column_positions(schema, [col], f"reduce {kind}")[0]
        t = schema.field(pos).type
        if kind == "sum" and not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise SchemaError(f"reduce: sum over non-numeric column {col!r} ({t})")
        specs.append((kind, pos))
    return specs


def _agg_table(data: pa.Table, key: Sequence[str], specs, group_row, ivals, fvals, valid) -> pa.Table:
    """The result table of a grouped reduce: key columns from each group's first row, then agg_0, agg_1, ..."""
    gr = pa.array(group_row, pa.int64())
    cols = {k: data.column(k).take(gr) for k in key}
    for j, (kind, pos) in enumerate(specs):
        ok = valid[:, j].astype(bool)
        mask = ~ok if not ok.all() else None
        if kind in ("count", "count_col"):
            cols[f"agg_{j}"] = pa.array(ivals[:, j], pa.int64())
        elif kind == "sum":
            if pa.types.is_floating(data.schema.field(pos).type):
                cols[f"agg_{j}"] = pa.array(fvals[:, j].copy(), pa.float64(), mask=mask)
            else:
                cols[f"agg_{j}"] = pa.array(ivals[:, j].copy(), pa.int64(), mask=mask)
        else:
            src = data.column(pos)
            taken = src.take(pa.array(np.where(ok, ivals[:, j], 0), pa.int64())) if len(src) else pa.array([], src.type)
            cols[f"agg_{j}"] = taken if mask is None else pc.if_else(pa.array(ok), taken, pa.scalar(None, src.type))
    return _single_chunk(pa.table(cols)) if len(cols) else pa.table({})


def _join_compatible(a: pa.DataType, b: pa.DataType) -> bool:
    if a == b:
        return True
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return True
    strs = (pa.types.is_string, pa.types.is_large_string)
    bins = (pa.types.is_binary, pa.types.is_large_binary)
    for group in (strs, bins):
        if any(f(a) for f in group) and any(f(b) for f in group):
            return True
    return False
