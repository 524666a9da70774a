"""The fast expression kernels of dbsp_core/operators/expr.py against their references: strftime against Arrow's own, on random timestamps and dates of every unit, negative ones, years past 9999 and nulls; split_parts against str.split (seed: DBSP_EXPR_KERNELS_SEED, printed after the summary)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dbsp_core.operators.expr import filter_rows, project_rows, split_parts, strftime

SEED = int(os.environ.get("DBSP_EXPR_KERNELS_SEED", "0"))
MS_PER_DAY = 86_400_000
FAST = ["%Y-%m-%d", "%H:%M", "%Y/%m/%d %H:%M", "day %d of %m, %Y%%", "%Y", "%m%d", "x%Hy", "%Y-%m-%d %H"]
DATE_FAST = ["%Y-%m-%d", "%Y", "%d.%m.%Y", "%%%m"]
SLOW = ["%S", "%F", "%Y-%m-%d %H:%M:%S", "%j", "%a %d", "plain text", "%"]


def _millis(rng: np.random.Generator, n: int, lo_year: int, hi_year: int) -> np.ndarray:
    lo, hi = (lo_year - 1970) * 365 * MS_PER_DAY, (hi_year - 1970) * 365 * MS_PER_DAY
    edges = np.array([0, -1, 1, MS_PER_DAY - 1, MS_PER_DAY, -MS_PER_DAY, -MS_PER_DAY - 1], dtype=np.int64)
    return np.concatenate([edges, rng.integers(lo, hi, n, dtype=np.int64)])


def _eval(expr: pc.Expression, column: pa.Array) -> pa.Array:
    data, _ = project_rows(pa.table({"t": column}), np.ones(len(column), np.int64), [expr], ["x"])
    return data.column("x").combine_chunks()


def _check(column: pa.Array, fmt: str) -> None:
    expr = strftime(pc.field("t"), fmt, column.type)
    assert "strftime" not in str(expr), f"{fmt!r} over {column.type} took Arrow's strftime: {expr}"
    got, want = _eval(expr, column), pc.strftime(column, format=fmt)
    bad = np.flatnonzero(~np.asarray(pc.fill_null(pc.equal(got, want), False)) & np.asarray(column.is_valid()))
    if len(bad):
        i = int(bad[0])  # the raw value: a negative year has no Python datetime
        raise AssertionError(f"DBSP_EXPR_KERNELS_SEED={SEED} {fmt!r} over {column.type}: value "
                             f"{column.cast(pa.int64())[i]} gave {got[i]}, strftime {want[i]}")
    assert got.null_count == column.null_count and got.is_null().equals(column.is_null())


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_timestamps_match_arrow_strftime(unit: str) -> None:
    rng = np.random.default_rng(SEED)
    years = (1678, 2261) if unit == "ns" else (-300, 12_000)  # ns: what int64 nanoseconds reach
    ms = _millis(rng, 20_000, *years)
    scale = {"s": 1 / 1000, "ms": 1, "us": 1000, "ns": 1_000_000}[unit]
    values = (ms // 1000) if unit == "s" else ms * int(scale)
    mask = rng.random(len(values)) < 0.05
    for tz in (None, "UTC"):
        column = pa.array(values, pa.timestamp(unit, tz=tz), mask=mask)
        for fmt in FAST:
            _check(column, fmt)


def test_dates_match_arrow_strftime() -> None:
    rng = np.random.default_rng(SEED + 1)
    days = _millis(rng, 20_000, -300, 12_000) // MS_PER_DAY
    mask = rng.random(len(days)) < 0.05
    for column in (pa.array(days.astype(np.int32), pa.date32(), mask=mask),
                   pa.array(days * MS_PER_DAY, pa.date64(), mask=mask)):
        for fmt in DATE_FAST:
            _check(column, fmt)


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns", "date32"])
def test_c_formatting_matches_arrow_strftime(unit: str) -> None:
    """Years 0-9999, where csrc/timefmt.h formats every value itself (none falls back to the cast kernels): each
    unit, nulls, a sliced column, against Arrow's strftime; a year past 9999 in the batch falls back whole."""
    from dbsp_core import _zset
    from dbsp_core.operators.expr import _UNITS_PER_DAY

    rng = np.random.default_rng(SEED + 3)
    years = (1678, 2261) if unit == "ns" else (0, 9999)
    ms = np.clip(_millis(rng, 20_000, *years), (years[0] - 1970) * 365 * MS_PER_DAY, None)
    mask = rng.random(len(ms)) < 0.05
    if unit == "date32":
        column, upd, fmts = pa.array(ms // MS_PER_DAY, pa.int32(), mask=mask).cast(pa.date32()), 1, DATE_FAST
    else:
        values = (ms // 1000) if unit == "s" else ms * {"ms": 1, "us": 1000, "ns": 1_000_000}[unit]
        column, upd, fmts = pa.array(values, pa.timestamp(unit), mask=mask), _UNITS_PER_DAY[unit], FAST
    for col in (column, column.slice(13, 15_000)):
        for fmt in fmts:
            assert _zset.time_format(col, fmt, upd) is not None, f"{fmt!r} over {col.type}: the kernel refused"
            _check(col, fmt)
    if unit != "ns":
        past = pa.concat_arrays([column, pa.array([(11_000 - 1970) * 365 * upd], column.type)])
        assert _zset.time_format(past, fmts[0], upd) is None  # year 10999: the cast kernels' way
        _check(past, fmts[0])


def test_other_formats_and_types_keep_arrow_strftime() -> None:
    """Seconds (Arrow prints fractions), %F (its negative years), other directives, literal-only formats, time zones other than UTC and
    a date's hours go to Arrow's strftime, which gives the same strings as before by definition."""
    ts = pa.timestamp("ms")
    for fmt in SLOW:
        assert "strftime" in str(strftime(pc.field("t"), fmt, ts)), fmt
    assert "strftime" in str(strftime(pc.field("t"), "%Y-%m-%d", pa.timestamp("ms", tz="Asia/Tokyo")))
    assert "strftime" in str(strftime(pc.field("t"), "%Y %H", pa.date32()))
    column = pa.array([0, 1_234_567, None], ts)
    for fmt in SLOW:
        assert _eval(strftime(pc.field("t"), fmt, ts), column).equals(pc.strftime(column, format=fmt))


@pytest.mark.parametrize("sep", ["/", "ab", "é", "aa"])
def test_split_parts_match_python_split(sep: str) -> None:
    """split_parts (q22's SPLIT_INDEX; utf8 and binary by csrc/split.h, large_string by Arrow) against str.split:
    empty parts, separators at both ends, overlapping matches ("aa" in "aaa"), nulls, non-ASCII text, a sliced
    array and a chunked one, part indexes out of order and repeated."""
    rng = np.random.default_rng(SEED + 2)
    alphabet = ["a", "b", "é", "/", "x", "", sep, sep]
    strings = ["".join(rng.choice(alphabet, rng.integers(0, 12))) for _ in range(3000)]
    values = [None if rng.random() < 0.05 else s for s in strings]
    for column in (pa.array(values), pa.array(values).slice(17, 2000),
                   pa.chunked_array([pa.array(values[:1000]), pa.array(values[1000:])]),
                   pa.array(values, pa.large_string())):
        py = column.to_pylist()
        indexes = (3, 0, 1, 5, 0)
        got = split_parts(column, sep, indexes)
        for i, arr in zip(indexes, got):
            want = [None if s is None or len(s.split(sep)) <= i else s.split(sep)[i] for s in py]
            bad = [k for k, (g, w) in enumerate(zip(arr.to_pylist(), want)) if g != w]
            assert not bad, (f"DBSP_EXPR_KERNELS_SEED={SEED} sep {sep!r} part {i} of {py[bad[0]]!r}: "
                             f"{arr[bad[0]]}, str.split {want[bad[0]]!r}")
            assert sum(w is not None for w in want) > 0, "no string had the part: the check proved nothing"


def test_split_parts_of_binary_and_empty_columns() -> None:
    """The C kernel over binary (bytes in, bytes out), an empty column and an all-null one; a bad call raises."""
    from dbsp_core import _zset

    got = split_parts(pa.array([b"a\x00b", None, b"\x00"], pa.binary()), "\x00", [1])
    assert got[0].type == pa.binary() and got[0].to_pylist() == [b"b", None, b""]
    assert [a.to_pylist() for a in split_parts(pa.array([], pa.string()), "/", [0, 2])] == [[], []]
    assert split_parts(pa.array([None, None], pa.string()), "/", [0])[0].to_pylist() == [None, None]
    with pytest.raises(ValueError):
        _zset.split_parts(pa.array(["a"]), "", [0])


@pytest.mark.parametrize("n", [7, 5000])  # under and over the gather's threshold (zset._GATHER_MIN)
def test_filter_rows_against_arrows_filter(n: int) -> None:
    """filter_rows (the predicate as a mask, then one gather) equals Arrow's filter with null as false, weights
    kept, each column one chunk; a column the C gathers do not read (a list) takes Arrow's take."""
    rng = np.random.default_rng(SEED + n)
    t = pa.table({"a": pa.array(rng.integers(0, 10, n), mask=rng.random(n) < 0.2),
                  "s": pa.array([None if i % 5 == 0 else "v" * int(i % 11) for i in range(n)]),
                  "b": pa.array(rng.random(n) < 0.5), "f": rng.random(n)})
    w = rng.integers(1, 5, n)
    for pred in (pc.field("a") > 4, (pc.field("s") != "vv") & pc.field("b"), pc.scalar(True), pc.field("a") > 99):
        got, gw = filter_rows(t, w, pred)
        want = t.filter(pred, null_selection_behavior="drop")
        assert got.equals(want) and all(c.num_chunks == 1 for c in got.columns)
        # the weights: the same rows' weights, by Arrow's filter of the weight column beside the others
        ww = pa.table({"w": w, **{c: t.column(c) for c in t.column_names}}).filter(pred).column("w").to_numpy()
        assert gw.tolist() == ww.tolist()
    lt = t.append_column("l", pa.array([[i] for i in range(n)]))
    got, gw = filter_rows(lt, w, pc.field("a") > 4)
    assert got.equals(lt.filter(pc.field("a") > 4)) and gw.tolist() == w[np.asarray(
        pc.fill_null(pc.greater(t.column("a"), 4), False))].tolist()
