"""A simple reference model of Z-sets (a dict from canonical row to weight) and Hypothesis strategies for tables."""

from __future__ import annotations

import datetime
import math
from collections import defaultdict

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

# every supported column type, with a small pool of values so rows repeat
_INT_POOLS = {
    pa.int8(): [0, 1, -1, 127, -128],
    pa.int16(): [0, 2, -2, 32767, -32768],
    pa.int32(): [0, 3, -3, 2**31 - 1, -(2**31)],
    pa.int64(): [0, 5, -5, 2**63 - 1, -(2**63)],
    pa.uint8(): [0, 1, 255],
    pa.uint16(): [0, 7, 65535],
    pa.uint32(): [0, 9, 2**32 - 1],
    pa.uint64(): [0, 11, 2**64 - 1],
}
_FLOATS = [0.0, -0.0, 1.5, -2.25, math.nan, math.inf, -math.inf]
_STRS = ["", "a", "b", "ab", "é", "x" * 40]
POOLS: dict[pa.DataType, list] = {
    **_INT_POOLS,
    pa.bool_(): [True, False],
    pa.float32(): _FLOATS,
    pa.float64(): _FLOATS + [1e300],
    pa.date32(): [datetime.date(1970, 1, 1), datetime.date(2024, 2, 29), datetime.date(1900, 5, 5)],
    pa.timestamp("us"): [datetime.datetime(2020, 1, 1), datetime.datetime(1969, 12, 31, 23, 59, 59, 999999)],
    pa.string(): _STRS,
    pa.large_string(): _STRS,
    pa.binary(): [b"", b"\x00", b"\x00\x01", b"abc"],
    pa.large_binary(): [b"", b"\xff", b"abc"],
}
ALL_TYPES = list(POOLS)


def canon_value(v):
    """The identity of a value: null equals null, -0.0 equals 0.0, NaN equals NaN."""
    if v is None:
        return ("null",)
    if isinstance(v, float):
        if v != v:
            return ("nan",)
        return ("f", 0.0 if v == 0.0 else v)
    return ("v", v)


def canon_row(row) -> tuple:
    return tuple(canon_value(v) for v in row)


def model_of(table: pa.Table, weights) -> dict:
    """{canonical row: weight} with zero weights dropped: the reference consolidation."""
    acc: dict = defaultdict(int)
    cols = [c.to_pylist() for c in table.columns]
    for r, w in zip(zip(*cols) if cols else [() for _ in range(table.num_rows)], list(weights)):
        acc[canon_row(r)] += int(w)
    return {k: w for k, w in acc.items() if w != 0}


def canon_dict(d: dict) -> dict:
    """Canonicalize the keys of a ZSet.to_dict() result."""
    out: dict = defaultdict(int)
    for r, w in d.items():
        out[canon_row(r)] += w
    return dict(out)


def add_models(a: dict, b: dict, sign: int = 1) -> dict:
    out = dict(a)
    for k, w in b.items():
        out[k] = out.get(k, 0) + sign * w
    return {k: w for k, w in out.items() if w != 0}


@st.composite
def schemas(draw, min_cols=1, max_cols=3, types=None):
    types = types or ALL_TYPES
    n = draw(st.integers(min_cols, max_cols))
    return pa.schema([(f"c{i}", draw(st.sampled_from(types))) for i in range(n)])


@st.composite
def tables(draw, schema=None, max_rows=40, nulls=True):
    schema = schema if schema is not None else draw(schemas())
    n = draw(st.integers(0, max_rows))
    cols = []
    for f in schema:
        pool = POOLS[f.type] + ([None] if nulls else [])
        cols.append(pa.array(draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)), type=f.type))
    t = pa.Table.from_arrays(cols, schema=schema)
    # sometimes present the data sliced (non-zero Arrow offsets) or in several chunks
    shape = draw(st.sampled_from(["plain", "sliced", "chunked"]))
    if shape == "sliced" and n:
        pad = pa.Table.from_arrays([pa.array(POOLS[f.type][:1] * 3, type=f.type) for f in schema], schema=schema)
        t = pa.concat_tables([pad, t, pad]).combine_chunks().slice(3, n)
    elif shape == "chunked" and n > 1:
        k = draw(st.integers(1, n - 1))
        t = pa.concat_tables([t.slice(0, k), t.slice(k)])
    return t


def weights_for(draw, n, lo=-3, hi=3):
    return np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=np.int64)
