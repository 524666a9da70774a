"""Opening a storage directory with a circuit it cannot change to (dbsp_core/runtime/change.py) is refused with a CircuitMismatchError that names the views and tables added, removed or changed (from the part fingerprints META records) and what to do, and with the two circuit hashes for a directory whose META predates them."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import sql
from dbsp_core.errors import CircuitMismatchError
from dbsp_core.storage.directory import read_meta, write_meta

TABLES = "CREATE TABLE t (k INT, v INT); CREATE TABLE u (k INT);"
A = "CREATE VIEW a AS SELECT k, sum(v) AS s FROM t GROUP BY k;"
B = "CREATE VIEW b AS SELECT k, v FROM t WHERE v > 1;"
C = "CREATE VIEW c AS SELECT t.k, t.v FROM t JOIN u ON t.k = u.k;"


def _written(tmp_path) -> str:
    d = str(tmp_path / "p")
    with dbsp.Pipeline(sql.compile(TABLES + A + B + C), workers=1, storage=d) as p:
        p.push("t", {"k": [1, 2], "v": [1, 5]})
        p.push("u", {"k": [2]})
        p.step()
    return d


def _refusal(d: str, text: str) -> str:
    with pytest.raises(CircuitMismatchError, match="different circuit") as e:
        dbsp.Pipeline.open(d, sql.compile(text))
    return str(e.value)


@pytest.mark.parametrize("text, said", [
    # a view added before the others: they keep their fingerprints (by content, not position)
    (TABLES + "CREATE VIEW x AS SELECT k FROM u WHERE k > 0;" + A + B + C,
     r"views added: x; view\(s\) x must be built from the current contents of table\(s\) u, "),
    (TABLES + A + B.replace("v > 1", "v > 2") + C,
     r"views changed: b; view\(s\) b must be built from the current contents of table\(s\) t, "),
    (TABLES.replace("u (k INT)", "u (k BIGINT)") + A + B + C,
     r"views changed: c; tables changed: u; a program change keeps every table as it was"),
    (TABLES + "CREATE VIEW x AS SELECT k FROM u;" + B.replace("v > 1", "v >= 1") + C,
     r"views added: x; views removed: a; views changed: b; view\(s\) b, x must be built from the current "
     r"contents of table\(s\) t, u, "),
])
def test_the_refusal_names_the_views_and_tables_that_differ(tmp_path, text, said) -> None:
    d = _written(tmp_path)
    msg = _refusal(d, text)
    assert re.search(rf"different circuit: {said}", msg), msg
    assert "open it with the same circuit" in msg, msg
    assert not re.search(r"[0-9a-f]{64}", msg), msg  # names, not hashes
    with dbsp.Pipeline.open(d, sql.compile(TABLES + A + B + C)) as p:  # the refusal changed nothing
        assert p.output_steps == range(0, 1)
        assert dict(p.read_output("b", 0))[0].to_dict() == {(2, 5): 1}


def test_a_directory_without_part_fingerprints_names_the_hashes(tmp_path) -> None:
    d = _written(tmp_path)
    meta = read_meta(d)
    del meta["part_fingerprints"]  # as a directory written before META recorded them
    write_meta(d, meta)
    msg = _refusal(d, TABLES + A + C)
    assert re.search(r"different circuit \('[0-9a-f]{64}' != '[0-9a-f]{64}'\); the directory was written before "
                     r"program changes were recorded", msg), msg
    dbsp.Pipeline.open(d, sql.compile(TABLES + A + B + C)).close()


def test_a_python_circuit_names_its_outputs_and_inputs(tmp_path) -> None:
    d = str(tmp_path / "p")

    def circuit(extra: bool) -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("bids", pa.schema([("auction", pa.int64())]))
        c.output("all", t)
        if extra:
            c.output("distinct", t.distinct())
        return c

    dbsp.Pipeline(circuit(False), workers=1, storage=d).close()
    with pytest.raises(CircuitMismatchError, match=r"different circuit: views added: distinct; view\(s\) distinct must "
                                                   r"be built from the current contents of table\(s\) bids"):
        dbsp.Pipeline.open(d, circuit(True))


def test_dropping_a_view_needs_no_table_contents(tmp_path) -> None:
    """A view removed: nothing is built, so the tables need not be materialized; the kept views go on."""
    d = _written(tmp_path)
    with dbsp.Pipeline.open(d, sql.compile(TABLES + A + C)) as p:
        assert p.stats["program_change"]["rebuilt"] == []
        p.push("t", {"k": [2], "v": [7]})
        out = p.step()
        assert out["c"].to_dict() == {(2, 7): 1} and out["a"].to_dict() == {(2, 5): -1, (2, 12): 1}
        with pytest.raises(KeyError):
            list(p.read_output("b"))
