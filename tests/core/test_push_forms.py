"""Pipeline.push takes rows as Arrow, pandas, dicts of columns and lists of row dicts or tuples, cast safely like FileSource: each form gives the outputs the same rows give as a pyarrow table of the input's schema, and what does not fit is refused naming the column and the row, recording nothing."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.errors import SchemaError

SCHEMA = pa.schema([("k", pa.int32()), ("s", pa.utf8()), ("x", pa.float64())])
KEY = SCHEMA.field("k").type


def _pipeline() -> dbsp.Pipeline:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("all", t)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), sx=dbsp.sum("x")))
    return dbsp.Pipeline(c, workers=2)


def _forms(rows: list[tuple]) -> dict[str, object]:
    """The same rows in every form push takes, none of them already of the input's types."""
    cols = {n: [r[i] for r in rows] for i, n in enumerate(SCHEMA.names)}
    inferred = pa.table({n: pa.array(v, pa.int64() if n == "k" else SCHEMA.field(n).type)
                         for n, v in cols.items()})
    return {
        "arrow int64": inferred,
        "record batch": inferred.to_batches()[0] if rows else inferred,
        "arrow other order": inferred.select(["x", "k", "s"]),
        "pandas": pd.DataFrame(cols),
        "dict of lists": cols,
        "dict of numpy": {"k": np.array([r[0] for r in rows], dtype=object) if any(r[0] is None for r in rows)
                          else np.array([r[0] for r in rows], dtype=np.int64), "s": cols["s"], "x": cols["x"]},
        "row dicts": [dict(zip(SCHEMA.names, r)) for r in rows],
        "row tuples": list(rows),
    }


ROW = st.tuples(st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
                st.one_of(st.none(), st.sampled_from(["a", "b", "ü"])),
                st.one_of(st.none(), st.integers(-1000, 1000).map(lambda v: v / 4)))


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=12), weights=st.lists(st.integers(-3, 3), min_size=12, max_size=12))
def test_every_form_gives_the_outputs_of_the_same_rows_as_arrow(rows, weights) -> None:
    w = np.array(weights[:len(rows)], dtype=np.int64)
    ref = pa.table({n: [r[i] for r in rows] for i, n in enumerate(SCHEMA.names)}, schema=SCHEMA)
    with _pipeline() as p:
        p.push("t", ref, weights=w)
        want = {k: v.to_dict() for k, v in p.step().items()}  # dicts of row -> weight: multisets
    assert sum(want["all"].values()) == int(w.sum())  # the reference saw every row
    for name, data in _forms(rows).items():
        if name == "pandas" and all(r[0] is None for r in rows):
            continue  # pandas makes an all-None column object-typed; covered by the row forms
        with _pipeline() as p:
            p.push("t", data, weights=w)
            got = {k: v.to_dict() for k, v in p.step().items()}
        assert got == want, name


def test_the_issue_example_int64_into_an_int_column() -> None:
    c = sql.compile("CREATE TABLE t (k INT); CREATE VIEW v AS SELECT k, count(*) AS n FROM t GROUP BY k;")
    with dbsp.Pipeline(c, workers=1) as p:
        p.push("t", pa.table({"k": [1]}))  # int64; the column is INT (int32)
        p.push("t", {"k": [1, 2]})
        p.push("t", [{"k": 2}])
        assert p.step()["v"].to_dict() == {(1, 2): 1, (2, 2): 1}


def test_a_weight_column_gives_weights_in_every_columnar_form() -> None:
    rows = {"k": [1, 2], "s": ["a", "b"], "x": [0.5, None], "weight": [3, -1]}
    with _pipeline() as p:
        p.push("t", pa.table(rows))
        p.push("t", pd.DataFrame(rows))
        p.push("t", rows)
        assert p.step()["all"].to_dict() == {(1, "a", 0.5): 9, (2, "b", None): -3}


BIG = 2**31  # one past int32


@pytest.mark.parametrize("data", [
    pa.table({"k": [1, 2, BIG], "s": ["a"] * 3, "x": [0.0] * 3}),
    pd.DataFrame({"k": [1, 2, BIG], "s": ["a"] * 3, "x": [0.0] * 3}),
    {"k": [1, 2, BIG], "s": ["a"] * 3, "x": [0.0] * 3},
    [{"k": 1, "s": "a", "x": 0.0}, {"k": 2, "s": "a", "x": 0.0}, {"k": BIG, "s": "a", "x": 0.0}],
    [(1, "a", 0.0), (2, "a", 0.0), (BIG, "a", 0.0)],
], ids=["arrow", "pandas", "dict", "row dicts", "row tuples"])
def test_a_value_that_does_not_fit_names_the_column_and_row_and_records_nothing(data) -> None:
    with _pipeline() as p:
        with pytest.raises(SchemaError, match=rf"column 'k' \(int64\) do not cast to the input's int32: row 2 "
                                              rf"holds {BIG}"):
            p.push("t", data)
        assert p.step()["all"].to_dict() == {}


@pytest.mark.parametrize("data, message", [
    ({"k": [1], "x": [0.5]}, r"do not match the input's \['k', 's', 'x'\]: no column \['s'\]"),
    ({"k": [1], "s": ["a"], "x": [0.5], "y": [1]}, r"columns \['y'\] are not the input's"),
    (pd.DataFrame({"k": [1], "s": ["a"]}), r"no column \['x'\]"),
    ({"k": [1.5], "s": ["a"], "x": [0.5]}, r"column 'k' \(double\) do not cast .* row 0 holds 1.5"),
    ({"k": [1, 2], "s": ["a", "b"], "x": [0.5, "z"]}, r"column 'x' do not convert to one Arrow type: row 1 holds 'z'"),
    ([(1, "a", 0.5), (2, "b")], r"row 1 \(\(2, 'b'\)\) is not a tuple of 3 values"),
    ([{"k": 1, "s": "a", "x": 0.5}, {"k": "one", "s": "a", "x": 0.5}], r"row 1 .* does not convert"),
])
def test_a_missing_or_extra_column_or_a_bad_value_is_named(data, message) -> None:
    with _pipeline() as p:
        with pytest.raises(SchemaError, match=message):
            p.push("t", data)
        assert p.step()["all"].to_dict() == {}


def test_other_objects_are_a_type_error_listing_the_forms() -> None:
    with _pipeline() as p:
        with pytest.raises(TypeError, match="pandas or polars DataFrame, dict of columns, or list of row dicts"):
            p.push("t", 5)
        with pytest.raises(TypeError, match="a list of rows holds row dicts or row tuples"):
            p.push("t", [1, 2])
