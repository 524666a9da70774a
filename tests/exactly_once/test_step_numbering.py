"""One step numbering across the surfaces that show steps: ``read_output``, ``dbsp read``, the SQLite, Parquet and Delta sinks, ``dbsp inspect`` and the metrics counters agree on the number of every step, also after the pipeline was closed and opened again (the counters go on instead of restarting)."""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.__main__ import main as cli
from dbsp_core.connectors import ParquetSink, SqliteSink, read_sqlite_view

deltalake = pytest.importorskip("deltalake")

from dbsp_core.connectors import DeltaSink, delta_steps  # noqa: E402


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64())]))
    c.output("n", t.group_by("k").agg(n=dbsp.count()))
    return c


def _run(p: dbsp.Pipeline, sinks: list, first: int, steps: int) -> None:
    for s in range(first, first + steps):
        p.push("t", {"k": [s, s % 2]})  # every step changes the view
        p.step()
    for sink in sinks:
        sink.poll()


def _surfaces(d: str, p: dbsp.Pipeline, work: str, capsys) -> dict:
    """The last step each surface shows."""
    capsys.readouterr()
    assert cli(["read", d, "n", "--limit", "0"]) == 0
    read = [int(m) for m in re.findall(r"^step (\d+):", capsys.readouterr().out, re.M)]
    files = sorted(int(f[len("step-"):-len(".parquet")]) for f in os.listdir(os.path.join(work, "pq"))
                   if f.startswith("step-"))
    return {"read_output": [s for s, _ in p.read_output("n")][-1], "dbsp read": read[-1],
            "sqlite": read_sqlite_view(os.path.join(work, "v.db"), "n")[0], "parquet": files[-1],
            "delta": delta_steps(os.path.join(work, "delta"), "delta-n")[-1],
            "metrics": p.metrics()["steps"] - 1, "pipeline": p.steps - 1}


def test_every_surface_numbers_steps_as_the_output_log_does_across_a_reopen(tmp_path, capsys) -> None:
    d, work = str(tmp_path / "d"), str(tmp_path)

    def sinks(p: dbsp.Pipeline) -> list:
        return [SqliteSink(p, "n", os.path.join(work, "v.db")), ParquetSink(p, "n", os.path.join(work, "pq")),
                DeltaSink(p, "n", os.path.join(work, "delta"))]

    p = dbsp.Pipeline(_circuit(), workers=2, storage=d, checkpoint_interval=None)
    opened = sinks(p)
    _run(p, opened, 0, 2)
    assert set(_surfaces(d, p, work, capsys).values()) == {1}
    for sink in opened:
        sink.close()
    p.close()

    p = dbsp.Pipeline.open(d, _circuit(), checkpoint_interval=None)
    assert p.metrics()["steps"] == 2  # the counters go on from the last checkpoint, they do not restart
    opened = sinks(p)
    _run(p, opened, 2, 3)
    shown = _surfaces(d, p, work, capsys)
    assert set(shown.values()) == {4}, shown
    for sink in opened:
        sink.close()
    p.close()

    capsys.readouterr()
    assert cli(["inspect", d]) == 0
    text = capsys.readouterr().out
    for line in ("checkpoint   through step 4", "output log   steps 0..4", "counters     through step 4"):
        assert line in text, text
    assert re.search(r"consumers .*sqlite-n through step 4", text) and "parquet-n through step 4" in text, text
