"""spark_glue.udf on local-cluster[2,1,1024]: a user's own mapInArrow keeps per-partition state in durable
pipelines across two jobs, rows routed by the engine's shard map, with a task that fails after applying its
input and is retried; the integrated output equals DuckDB over all input. Also the executor check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

import dbsp_core as dbsp  # noqa: E402
from spark_glue import udf  # noqa: E402

pytestmark = pytest.mark.spark

SCHEMA = pa.schema([("auction", pa.int64()), ("price", pa.int64())])


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids = c.input("bids", SCHEMA)
    c.output("totals", bids.group_by("auction").agg(n=dbsp.count(), total=dbsp.sum("price")))
    return c


def _job(spark, table: pa.Table, state: str, run: int, workers: int) -> pa.Table:
    c = _circuit()
    from dbsp_core.layout import ShardMap

    def fn(batches):
        from pyspark import TaskContext

        tc = TaskContext.get()
        data = udf.as_table(batches, SCHEMA)
        owners = udf.worker_of(data, ["auction"], ShardMap(workers))
        if len(owners) and not (owners == tc.partitionId()).all():
            raise AssertionError("a row reached a partition that does not own its shard")
        with udf.partition_pipeline(c, state) as p:
            out = udf.apply_once(p, {"bids": data}, producer="bids", seq=run)
            if run == 0 and tc.partitionId() == 1 and tc.attemptNumber() == 0:
                raise RuntimeError("injected failure after the input was applied")
        yield from out["totals"].to_arrow().to_batches()

    df = spark.createDataFrame(table.to_pandas())
    routed = udf.shard_partition(df, ["auction"], workers=workers)
    return routed.mapInArrow(fn, "auction long, n long, total long, weight long").toArrow()


@pytest.mark.slow
def test_partition_state_across_jobs_and_a_retry(spark_cluster, tmp_path) -> None:
    import duckdb

    runs = [pa.table({"auction": [i % 17 for i in range(r * 300, r * 300 + 300)],
                      "price": [(i * 7) % 101 for i in range(r * 300, r * 300 + 300)]}) for r in range(2)]
    view: dict = {}
    for run, t in enumerate(runs):
        out = _job(spark_cluster, t, str(tmp_path / "state"), run, workers=3)
        for r in out.to_pylist():
            k = (r["auction"], r["n"], r["total"])
            view[k] = view.get(k, 0) + r["weight"]
    got = {k for k, w in view.items() if w}
    assert all(w in (0, 1) for w in view.values())
    allbids = pa.concat_tables(runs)  # noqa: F841  (read by DuckDB by name)
    ref = set(duckdb.sql("SELECT auction, count(*), sum(price) FROM allbids GROUP BY auction").fetchall())
    assert got == ref
    assert sorted(os.listdir(tmp_path / "state")) == ["part-00000", "part-00001", "part-00002"]


@pytest.mark.slow
def test_executors_that_cannot_import_the_engine_are_named(tmp_path) -> None:
    """A session whose Python workers lack dbsp_core (or have another version) fails at SparkPipeline(...) with
    what to set, not deep inside the first step."""
    hide, stub = tmp_path / "hide", tmp_path / "stub"
    hide.mkdir()
    stub.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['dbsp_core'] = None\n")
    (stub / "sitecustomize.py").write_text("import sys, types\nm = types.ModuleType('dbsp_core')\n"
                                           "m.__version__ = '0.0.1'\nsys.modules['dbsp_core'] = m\n")
    for d in (hide, stub):
        wrapper = d / "python"
        wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={d}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
        wrapper.chmod(0o755)
    script = textwrap.dedent(f"""
        import os, pyarrow as pa, pyspark, dbsp_core as dbsp, spark_glue
        from pyspark.sql import SparkSession
        os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
        c = dbsp.Circuit(); c.output("o", c.input("t", pa.schema([("k", pa.int64())])).distinct())
        for wrapper in ({str(hide / "python")!r}, {str(stub / "python")!r}):
            os.environ["PYSPARK_PYTHON"] = wrapper
            spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
                     .config("spark.ui.showConsoleProgress", "false").getOrCreate())
            try:
                spark_glue.SparkPipeline(spark, c, storage={str(tmp_path / "pipe")!r})
                print("NO ERROR")
            except spark_glue.ExecutorSetupError as e:
                print("ERROR", e)
            spark.stop()
        """)
    env = dict(os.environ)
    env.pop("PYSPARK_PYTHON", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 2, r.stdout + r.stderr
    assert "cannot import the engine" in lines[0] and "PYSPARK_PYTHON" in lines[0] and sys.executable in lines[0]
    assert "run dbsp-core 0.0.1, this driver 0.1.0" in lines[1] and "PYSPARK_PYTHON" in lines[1]
