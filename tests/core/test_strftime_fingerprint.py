"""strftime's C path (operators/expr.py invariant 3) leaves every circuit's fingerprints what they were before it:
``circuit_fingerprint`` and ``part_fingerprints`` of a circuit using it equal those of the same circuit built
with ``_cast_format`` (the code before it), so a checkpoint of it reopens as the same program."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core.nexmark.queries as nq
import dbsp_core.sql.expr as sql_expr
from dbsp_core import sql
from dbsp_core.circuit import circuit_fingerprint, part_fingerprints
from dbsp_core.nexmark.sql_queries import sql_circuit
from dbsp_core.operators import expr as E

VIEWS = """CREATE TABLE t (id BIGINT, ts TIMESTAMP, d DATE, s VARCHAR);
CREATE VIEW v AS SELECT id, DATE_FORMAT(ts, 'yyyy-MM-dd HH:mm') AS a, DATE_FORMAT(d, 'yyyy/MM/dd') AS b,
  UPPER(CONCAT(s, DATE_FORMAT(ts, 'dd.MM.yyyy'))) AS c, DATE_FORMAT(ts, 'HH:mm') AS e FROM t
  WHERE DATE_FORMAT(d, 'yyyy') > '1999';
CREATE VIEW w AS SELECT DATE_FORMAT(ts, 'yyyy-MM') AS m, COUNT(*) AS n FROM t GROUP BY DATE_FORMAT(ts, 'yyyy-MM');
"""


def _old_strftime(value: pc.Expression, fmt: str, typ: pa.DataType) -> pc.Expression:
    """strftime before its C path: the C call's expression built by _cast_format, anything else as it is."""
    e = E.strftime(value, fmt, typ)
    return E._cast_format(value, fmt, typ) if str(e).startswith("dbsp_time_format_") else e


def _build(what: str):
    if what == "view":
        return sql.compile(VIEWS)
    form, q = what.split("-")
    return nq.circuit(q) if form == "hand" else sql_circuit(q)


def _without_c_path(monkeypatch) -> None:
    monkeypatch.setattr(sql_expr, "strftime", _old_strftime)
    for name, col, typ in (("DAY", "dateTime", None), ("MINUTE", "dateTime", None), ("DAY_OF_DATE", "day", pa.date32())):
        fmt = "%H:%M" if name == "MINUTE" else "%Y-%m-%d"
        monkeypatch.setattr(nq, name, _old_strftime(pc.field(col), fmt, typ or nq.BID.field(col).type))


@pytest.mark.parametrize("what", [f"{form}-{q}" for form in ("hand", "sql") for q in ("q10", "q15", "q16", "q17")]
                         + ["view"])
def test_fingerprints_are_those_without_the_c_path(what, monkeypatch) -> None:
    c = _build(what)
    assert "dbsp_time_format_" in repr([vars(op) for op in c.nodes]), "no C path in the circuit: nothing tested"
    new = circuit_fingerprint(c), part_fingerprints(c)
    with monkeypatch.context() as m:
        _without_c_path(m)
        old_c = _build(what)
        assert "dbsp_time_format_" not in repr([vars(op) for op in old_c.nodes])
        old = circuit_fingerprint(old_c), part_fingerprints(old_c)
    assert new == old


FORMATS = ["%Y-%m-%d", "%H:%M", "%d.%m.%Y %H:%M", "(%Y)", '"%Y", \\%m', "%Y\n%m\t%d\r", "%%%Y%%", "a(b%Y)c,d)"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("typ", [pa.timestamp("ms"), pa.timestamp("us", tz="UTC"), pa.timestamp("s"), pa.date32(),
                                 pa.date64()])
def test_fingerprint_text_is_the_cast_formats_text(fmt, typ) -> None:
    if pa.types.is_date(typ) and "%H" in fmt:
        fmt = fmt.replace("%H:%M", "%m")
    # an argument that is itself an expression with literals, parentheses and commas; and a nested call
    for arg in (pc.field("t"), pc.field("t").cast(typ), pc.if_else(pc.field("b"), pc.field("t"), pc.field("u"))):
        e = E.strftime(arg, fmt, typ)
        assert str(e).startswith("dbsp_time_format_"), str(e)
        assert E.fingerprint_text(str(e)) == str(E._cast_format(arg, fmt, typ))
        outer = pc.binary_join_element_wise(e, pc.scalar(") ,\"("), E.strftime(pc.field("t"), "%Y", typ), "")
        want = pc.binary_join_element_wise(E._cast_format(arg, fmt, typ), pc.scalar(") ,\"("),
                                           E._cast_format(pc.field("t"), "%Y", typ), "")
        assert E.fingerprint_text(str(outer)) == str(want)
        assert E.fingerprint_text(repr([outer, "x"])) == repr([want, "x"])


def test_fingerprint_text_leaves_other_text() -> None:
    for text in ['dbsp_time_format_ts_ms(t, "%Y"', 'dbsp_time_format_nope(t, "%Y")', "strftime(t, {format=%Y})",
                 'dbsp_time_format_ts_ms(t)', 'xdbsp_time_format_ts_ms(t, "%Y")', "a=1"]:
        assert E.fingerprint_text(text) == text
