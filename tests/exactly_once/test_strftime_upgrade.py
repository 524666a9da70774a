"""A Nexmark q10 directory written by the code before strftime's C path (tests/fixtures/strftime-q10-*, see
make_strftime_q10.py) opens as the same program (operators/expr.py invariant 3, fingerprint_text): no program
change, nothing rebuilt, its output log goes on from step 0, and the next steps' outputs equal those the old code
computed (tests/fixtures/strftime-q10-*-expected.arrow)."""

from __future__ import annotations

import os
import shutil
import sys

import pyarrow as pa
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "fixtures")
sys.path.insert(0, FIXTURES)

import dbsp_core as dbsp  # noqa: E402
import make_strftime_q10 as w  # noqa: E402
from dbsp_core.circuit import circuit_fingerprint, part_fingerprints  # noqa: E402
from dbsp_core.storage.directory import read_meta  # noqa: E402


def _bag(t: pa.Table) -> list:
    rows = t.drop_columns(["__step"]).to_pylist() if "__step" in t.column_names else t.to_pylist()
    return sorted((tuple(sorted(r.items())) for r in rows), key=repr)


@pytest.mark.parametrize("kind", ["hand", "sql"])
def test_q10_directory_of_the_old_code_opens_as_the_same_program(tmp_path, kind) -> None:
    d = str(tmp_path / kind)
    shutil.copytree(os.path.join(FIXTURES, f"strftime-q10-{kind}"), d)
    c = w.build(kind)
    meta = read_meta(d)
    assert meta["fingerprint"] == circuit_fingerprint(c)
    assert meta["part_fingerprints"] == part_fingerprints(c)
    expected = pa.ipc.open_file(os.path.join(FIXTURES, f"strftime-q10-{kind}-expected.arrow")).read_all()
    p = dbsp.Pipeline.open(d, c, checkpoint_interval=None)
    try:
        assert "program_change" not in p.stats, p.stats["program_change"]
        assert p.output_steps == range(0, w.WRITTEN)
        for step in range(w.WRITTEN, w.LAST):
            w.push(p, step)
            got = w.as_table([(step, p.step()["q10"])])
            want = expected.filter(pa.compute.equal(expected.column("__step"), step))
            assert want.num_rows > 0 and _bag(got) == _bag(want), step
        assert [s for s, _ in p.read_output("q10")] == list(range(w.LAST))  # the log went on, not restarted
    finally:
        p.close()
    assert "change" not in read_meta(d)
