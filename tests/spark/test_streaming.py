"""Tests of spark_glue.foreach_batch with real Structured Streaming queries: results equal DuckDB over all input, each batch is one step, and a batch Spark delivers again after a crash and a restart from the same checkpointLocation counts once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pyspark = pytest.importorskip("pyspark")

import dbsp_core as dbsp  # noqa: E402
import spark_glue  # noqa: E402
from spark_glue.streaming import StaleBatchError  # noqa: E402
from stream_workload import build_circuit, duckdb_expected, integral, spark_schema, write_batches  # noqa: E402

pytestmark = [pytest.mark.spark,
              pytest.mark.skipif(shutil.which("java") is None, reason="Java is not installed (needed by pyspark)")]
CHILD = os.path.join(HERE, "stream_child.py")


def run_query(spark, data: str, ckpt: str, sink) -> None:
    df = spark.readStream.schema(spark_schema()).option("maxFilesPerTrigger", 1).parquet(data)
    q = df.writeStream.foreachBatch(sink).option("checkpointLocation", ckpt).trigger(availableNow=True).start()
    try:
        q.awaitTermination()
    finally:
        q.stop()


def check_views(p, data: str) -> None:
    want = duckdb_expected(data)
    for name in ("agg", "big"):
        assert integral(p, name) == want[name], name


def test_query_into_durable_pipeline_equals_duckdb(spark_local, tmp_path):
    data, ckpt = str(tmp_path / "data"), str(tmp_path / "ck")
    write_batches(data, 6, 400, seed=1)
    p = dbsp.Pipeline(build_circuit(), workers=2, storage=str(tmp_path / "p"), checkpoint_interval=None)
    seen = []
    sink = spark_glue.foreach_batch(p, on_output=lambda b, s, out: seen.append((b, s, sorted(out))))
    run_query(spark_local, data, ckpt, sink)
    assert sink.producer.startswith("spark-query:")
    assert sink.stats == {"batches": 6, "redelivered": 0, "pending": 0}
    assert sink.batch_steps == {b: b for b in range(6)}  # a fresh pipeline: batch id = step
    assert [(b, s) for b, s, _ in seen] == [(b, b) for b in range(6)]
    assert list(p.output_steps) == list(range(6))
    check_views(p, data)
    p.close()

    # new files, the same query restarted from its checkpoint by a new sink over the recovered pipeline:
    # the sink finds its last batch in the output log, Spark goes on with batches 6, 7, 8
    write_batches(data, 3, 400, seed=2, first=6)
    p = dbsp.Pipeline.open(str(tmp_path / "p"), build_circuit(), checkpoint_interval=None)
    sink2 = spark_glue.foreach_batch(p)
    run_query(spark_local, data, ckpt, sink2)
    assert sink2.producer == sink.producer  # the query id survives the restart
    assert sink2.stats == {"batches": 3, "redelivered": 0, "pending": 0}
    assert {b: s for b, s in sink2.batch_steps.items() if b >= 6} == {6: 6, 7: 7, 8: 8}
    check_views(p, data)

    # the same sink id on a query with a new checkpoint starts again at batch 0: refused, nothing applied
    sink3 = spark_glue.foreach_batch(p, producer=sink.producer)
    with pytest.raises(Exception, match="StaleBatchError|below the last applied batch 8"):
        run_query(spark_local, data, str(tmp_path / "ck-new"), sink3)
    assert list(p.output_steps) == list(range(9))
    check_views(p, data)
    p.close()


def test_stale_batch_is_refused_and_changes_nothing(tmp_path):
    """Without Spark: the sink's own rule for ids below the last applied one (design note 4)."""
    import pyarrow as pa

    class Batch:  # what the sink reads from a Spark DataFrame: toArrow()
        def __init__(self, ks):
            self.t = pa.table({"k": pa.array(ks, pa.int64()), "v": pa.array(ks, pa.int64())})

        def toArrow(self):
            return self.t

    p = dbsp.Pipeline(build_circuit(), workers=1, storage=str(tmp_path / "p"), checkpoint_interval=None)
    sink = spark_glue.foreach_batch(p, "s", producer="q")
    sink(Batch([1]), 5)
    sink(Batch([2]), 6)
    with pytest.raises(StaleBatchError, match="batch 5 is below the last applied batch 6"):
        sink(Batch([3]), 5)
    sink(Batch([2]), 6)  # the newest batch again: acknowledged, no step
    assert sink.stats == {"batches": 2, "redelivered": 1, "pending": 0}
    assert list(p.output_steps) == [0, 1] and sink.batch_steps == {5: 0, 6: 1}
    assert integral(p, "agg") == {(1, 1, 1): 1, (2, 1, 2): 1}
    p.close()


def _child(data: str, storage: str, ckpt: str, stats: str, runtime: str, crash: str | None) -> int:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYSPARK_PYTHON"] = sys.executable
    env.pop("DBSP_CRASHPOINT", None)
    env.pop("DBSP_TEST_KILL_AFTER_BATCH", None)
    if crash and crash.startswith("after-step:"):
        env["DBSP_TEST_KILL_AFTER_BATCH"] = crash.split(":")[1]
    elif crash:
        env["DBSP_CRASHPOINT"] = crash
    r = subprocess.run([sys.executable, CHILD, data, storage, ckpt, stats, runtime], env=env, capture_output=True,
                       text=True, timeout=900)
    if r.returncode not in (0, -9):
        raise AssertionError(f"child exited {r.returncode}:\n{r.stdout}\n{r.stderr[-4000:]}")
    return r.returncode


PUSHED = {"batches": 3, "redelivered": 0, "pending": 1}     # batch 2 pushed, never stepped
STEPPED = {"batches": 3, "redelivered": 1, "pending": 0}    # batch 2 stepped, Spark never told


@pytest.mark.parametrize("runtime, crash, expect", [
    ("embedded", "push-acked:3", PUSHED), ("embedded", "step-written:3", STEPPED),
    ("spark", "push-acked:3", PUSHED), ("spark", "after-step:2", STEPPED),
])
@pytest.mark.slow
def test_redelivered_batch_counts_once_after_a_driver_crash(tmp_path, runtime, crash, expect):
    """The driver dies (SIGKILL, taking its Spark JVM along) inside batch 2: after its push was acknowledged and
    before its step, or after its step and before Spark committed the batch. A new driver recovers the pipeline
    (the durable embedded one or SparkPipeline) and restarts the query from the same checkpointLocation; Spark
    runs batch 2 again, and it counts once."""
    data, storage, ckpt = str(tmp_path / "data"), str(tmp_path / "p"), str(tmp_path / "ck")
    write_batches(data, 6, 300, seed=3)
    assert _child(data, storage, ckpt, str(tmp_path / "s1.json"), runtime, crash) == -9
    assert not os.path.exists(tmp_path / "s1.json")
    assert _child(data, storage, ckpt, str(tmp_path / "s2.json"), runtime, None) == 0
    st = json.loads((tmp_path / "s2.json").read_text())
    assert st["stats"] == expect
    from dbsp_core.storage.inspect import open_output

    log = open_output(storage)  # the output log of either runtime, read-only
    try:
        assert (log.first, log.last) == (0, 6)  # one step per batch, none doubled, none extra
        owners = [[r for r in log.inputs_of(s) if r["producer"] == st["producer"]] for s in range(6)]
        assert [(o[0]["first_seq"], o[0]["last_seq"]) for o in owners] == [(b, b) for b in range(6)]
        want = duckdb_expected(data)
        for name in ("agg", "big"):
            acc: dict = {}
            for _, z in log.read(name, 0):
                for row, w in z.to_dict().items():
                    acc[row] = acc.get(row, 0) + w
            assert {r: w for r, w in acc.items() if w} == want[name], name
    finally:
        log.close()


def test_docstring_examples():
    import doctest

    import spark_glue.streaming

    result = doctest.testmod(spark_glue.streaming, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_tidy_checkpoint_removes_only_spark_temporaries(tmp_path):
    """What a driver killed during its first offset write leaves (seen in a CI run): only the temporaries go."""
    ck = tmp_path / "ck"
    (ck / "offsets").mkdir(parents=True)
    (ck / "commits").mkdir()
    tmp = ".0.5904b7bc-59bb-4cc8-9c71-8fe416ad20ec.tmp"
    for name in (tmp, "." + tmp + ".crc", "0", ".0.crc", "notes.tmp"):
        (ck / "offsets" / name).write_text("x")
    (ck / "commits" / ".3.5904b7bc-59bb-4cc8-9c71-8fe416ad20ec.tmp").write_text("x")
    (ck / "metadata").write_text("{}")
    removed = spark_glue.tidy_checkpoint("file:" + str(ck))
    assert sorted(os.path.basename(r) for r in removed) == sorted(
        [tmp, "." + tmp + ".crc", ".3.5904b7bc-59bb-4cc8-9c71-8fe416ad20ec.tmp"])
    assert sorted(os.listdir(ck / "offsets")) == [".0.crc", "0", "notes.tmp"]
    assert spark_glue.tidy_checkpoint(str(tmp_path / "missing")) == []
    with pytest.raises(dbsp.DbspError):
        spark_glue.tidy_checkpoint("")
