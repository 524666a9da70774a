"""Build-time validation: schemas are inferred through every operator, and bad columns or types raise SchemaError naming the operator and the column."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from oracle import AUCTIONS, BIDS

import dbsp_core as dbsp
from dbsp_core.errors import SchemaError


@pytest.fixture
def streams() -> tuple[dbsp.Circuit, dbsp.Stream, dbsp.Stream]:
    c = dbsp.Circuit()
    return c, c.input("bids", BIDS), c.input("auctions", AUCTIONS)


def test_schemas_are_inferred(streams) -> None:
    c, b, a = streams
    assert b.filter(pc.field("price") > 1).schema.names == BIDS.names
    s = b.select(a="auction", eur=pc.field("price") * 0.9, up=pc.utf8_upper(pc.field("bidder")))
    assert s.schema.types == [pa.int64(), pa.float64(), pa.utf8()]
    j = b.join(a, left_on="auction", right_on="id")
    assert j.schema.names == BIDS.names + AUCTIONS.names
    g = b.group_by("auction").agg(n=dbsp.count(), t=dbsp.sum("price"), lo=dbsp.min("bidder"),
                                  m=dbsp.avg("price"), ft=dbsp.sum("f"))
    assert g.schema.types == [pa.int64(), pa.int64(), pa.int64(), pa.utf8(), pa.float64(), pa.float64()]
    lj = b.left_join(a, left_on="auction", right_on="id")
    assert lj.schema.names == j.schema.names
    assert (b + b).schema.names == (b - b).schema.names == (-b).schema.names == BIDS.names
    assert b.distinct().schema.names == b.integrate().differentiate().delay().schema.names


def test_on_keeps_one_key_and_suffixes_clashes(streams) -> None:
    c, b, _ = streams
    other = b.select(auction="auction", price="price", extra="f")
    assert b.join(other, on="auction").schema.names == ["auction", "bidder", "price", "f", "price_right", "extra"]
    assert b.join(other, on=["auction", "price"]).schema.names == ["auction", "bidder", "price", "f", "extra"]


@pytest.mark.parametrize("build, words", [
    (lambda b, a: b.filter(pc.field("nope") > 1), ["filter#", "nope"]),
    (lambda b, a: b.filter(pc.field("price") + 1), ["filter#", "boolean"]),
    (lambda b, a: b.select(x=pc.field("nope")), ["select#", "nope"]),
    (lambda b, a: b.join(a, left_on="nope", right_on="id"), ["join#", "nope"]),
    (lambda b, a: b.join(a, left_on="auction", right_on="nope"), ["join#", "nope"]),
    (lambda b, a: b.join(a, left_on="bidder", right_on="id"), ["join#", "bidder", "id"]),
    (lambda b, a: b.left_join(a, left_on="f", right_on="id"), ["left_join#", "'f'", "id"]),
    (lambda b, a: b.group_by("nope").agg(n=dbsp.count()), ["aggregate#", "nope"]),
    (lambda b, a: b.group_by("auction").agg(s=dbsp.sum("bidder")), ["aggregate#", "bidder", "numeric"]),
    (lambda b, a: b.group_by("auction").agg(s=dbsp.avg("bidder")), ["aggregate#", "bidder"]),
    (lambda b, a: b.group_by("auction").agg(s=dbsp.max("nope")), ["aggregate#", "nope"]),
    (lambda b, a: b.group_by("auction").agg(auction=dbsp.count()), ["aggregate#", "auction"]),
    (lambda b, a: b + a, ["plus#"]),
    (lambda b, a: b - a, ["minus#"]),
])
def test_bad_circuits_raise_schema_error(streams, build, words) -> None:
    c, b, a = streams
    n = len(c.nodes)
    with pytest.raises(SchemaError) as info:
        build(b, a)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert len(c.nodes) == n  # a rejected operator adds no node


def test_other_builder_errors(streams) -> None:
    c, b, a = streams
    with pytest.raises(ValueError):
        c.input("bids", BIDS)
    with pytest.raises(TypeError):
        b.join(a, on="auction", left_on="auction")
    with pytest.raises(TypeError):
        b.join(a, left_on="auction")
    with pytest.raises(TypeError):
        b.filter("price > 3")
    other = dbsp.Circuit().input("x", BIDS)
    with pytest.raises(ValueError):
        b + other
    with pytest.raises(SchemaError):
        c.input("bad", pa.schema([("l", pa.list_(pa.int64()))]))
    c.output("v", b)
    with pytest.raises(ValueError):
        c.output("v", b)


def test_fingerprint_follows_source_text_not_bytecode(tmp_path) -> None:
    """The same function compiled differently (another optimization level: other bytecode, as after a Python
    upgrade) gives the same fingerprint; another function body gives another one."""
    import importlib.util
    import sys

    from dbsp_core.circuit import circuit_fingerprint

    def load(name: str, body: str, optimize: int, file: str = "a"):
        path = tmp_path / file / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"def f(b):\n    assert b is not None, 'a batch'\n    return {body}\n")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        code = compile(path.read_text(), str(path), "exec", optimize=optimize)
        exec(code, mod.__dict__)
        sys.modules[name] = mod
        return mod.f

    def fp(fn) -> str:
        c = dbsp.Circuit()
        s = c.input("t", pa.schema([("x", pa.int64())]))
        c.output("o", s.flat_map(fn, schema=s.schema))
        return circuit_fingerprint(c)

    a0, a2 = load("fp_mod_a", "b", 0), load("fp_mod_a", "b", 2)
    assert a0.__code__.co_code != a2.__code__.co_code  # the assert is compiled out at -OO
    assert fp(a0) == fp(a2)
    before = fp(a0)
    b0 = load("fp_mod_a", "b.slice(0, 0)", 0, file="b")  # same module and name, another body
    assert fp(b0) != before


def test_types_no_step_can_hold_are_refused_when_built() -> None:
    """decimal and float16 in select, a uint64 within_last column and huge intervals passed circuit building and
    failed at the first step; they are refused when the circuit is built, naming the operator and the column."""
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("a", pa.int64()), ("u", pa.uint64()), ("ts", pa.int64())]))
    with pytest.raises(SchemaError, match=r"select#\d+: its output column 'd' has unsupported type decimal"):
        t.select(d=pc.field("a").cast(pa.decimal128(10, 2)))
    with pytest.raises(SchemaError, match=r"select#\d+: its output column 'h' has unsupported type halffloat"):
        t.select(h=pc.field("a").cast(pa.float16()))
    with pytest.raises(SchemaError, match="'u' must be a timestamp or a signed integer time, got uint64"):
        dbsp.within_last(t, "u", 10)
    with pytest.raises(ValueError, match="longer than the limit"):
        dbsp.within_last(t, "ts", 1e12)
    with pytest.raises(ValueError, match="size 18446744073709551616 is larger than the limit"):
        t.tumble("ts", 2**64)
    with pytest.raises(ValueError, match="windows per row is more than the limit"):
        t.hop("ts", 2**40, 1)
    with pytest.raises(ValueError, match="lower .* is outside the limit"):
        t.interval_join(t, "ts", "ts", -(2**63), 0, on="a")
    with pytest.raises(ValueError, match="lateness .* is larger than the limit"):
        c.input("late", pa.schema([("ts", pa.int64())]), event_time="ts", lateness=2**63)
    assert len(c.nodes) == 1  # nothing was added by the refused calls


def test_input_and_output_names_have_limits() -> None:
    """Names are logged with every push: a name the log could not hold is refused when the circuit is built."""
    c = dbsp.Circuit()
    with pytest.raises(ValueError, match="input name of 1025 bytes is longer than the limit of 1024"):
        c.input("x" * 1025, pa.schema([("a", pa.int64())]))
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        c.input("a\udc80", pa.schema([("a", pa.int64())]))
    t = c.input("t", pa.schema([("a", pa.int64())]))
    with pytest.raises(ValueError, match="output name of 2048 bytes"):
        c.output("é" * 1024, t)
