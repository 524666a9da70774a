"""Arrow decimal64 columns in Z-sets: the C core sees their unscaled int64 (csrc/column.h invariant 4), so equal decimals consolidate, group and join as equal and keep their type; decimal128 stays refused, by name."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pytest

import dbsp_core as dbsp

D = pa.decimal64(10, 2)


def test_decimal64_rows_consolidate_group_and_join_by_value() -> None:
    t = pa.table({"k": [1, 2, 3, 4], "d": pa.array([Decimal("1.10"), Decimal("1.10"), Decimal("-2.25"), None], D)})
    z = dbsp.ZSet.from_arrow(t.select(["d"]), weights=[1, 2, 1, 1])
    assert z.schema.field("d").type == D
    assert z.to_dict() == {(Decimal("1.10"),): 3, (Decimal("-2.25"),): 1, (None,): 1}
    c = dbsp.Circuit()
    s = c.input("t", t.schema)
    c.output("g", s.group_by("d").agg(n=dbsp.count()))
    c.output("j", s.join(s.select(d=pa.compute.field("d"), k2=pa.compute.field("k")), on="d"))
    p = dbsp.Pipeline(c, workers=2)
    p.push("t", t)
    out = p.step()
    assert out["g"].to_dict() == {(Decimal("1.10"), 2): 1, (Decimal("-2.25"), 1): 1, (None, 1): 1}
    assert sorted(r for r in out["j"].to_dict()) == [(1, Decimal("1.10"), 1), (1, Decimal("1.10"), 2),
                                                     (2, Decimal("1.10"), 1), (2, Decimal("1.10"), 2),
                                                     (3, Decimal("-2.25"), 3)]
    p.close()


def test_decimal128_is_refused_naming_the_column() -> None:
    with pytest.raises(dbsp.SchemaError, match="column 'd' has unsupported type decimal128"):
        dbsp.ZSet.from_arrow(pa.table({"d": pa.array([Decimal("1.10")], pa.decimal128(10, 2))}))
