"""Child process of the Structured Streaming tests: runs a file-source query into ``foreach_batch`` over a durable pipeline until the files are read, then closes.

Usage: stream_child.py DATA STORAGE CHECKPOINT STATS [RUNTIME]. Creates or recovers the pipeline in STORAGE
(``open`` when it exists; RUNTIME ``embedded``, the default, is the durable dbsp.Pipeline, ``spark`` is
spark_glue.SparkPipeline on this driver's session), starts the query from CHECKPOINT (Spark resumes it,
re-running its newest uncommitted batch) with one parquet file per trigger, and writes the sink's stats and
batch -> step map as JSON to STATS. The sink id is the query id. ``DBSP_CRASHPOINT`` kills this process (and
with it the Spark JVM it started) at a crash point of the durable pipeline, e.g. between a push and its step;
``DBSP_TEST_KILL_AFTER_BATCH=b`` kills it once batch b's step has returned, before Spark commits the batch.
"""

from __future__ import annotations

import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from stream_workload import build_circuit, spark_schema  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from spark_glue.streaming import foreach_batch, tidy_checkpoint  # noqa: E402


def main() -> int:
    data, storage, ckpt, stats = sys.argv[1:5]
    runtime = sys.argv[5] if len(sys.argv) > 5 else "embedded"
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("stream-child")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    c = build_circuit()
    exists = os.path.exists(os.path.join(storage, "META"))
    if runtime == "spark":
        from spark_glue import SparkPipeline

        p = SparkPipeline.open(spark, storage, c, checkpoint_interval=None) if exists else \
            SparkPipeline(spark, c, workers=2, storage=storage, checkpoint_interval=None)
    elif exists:
        p = dbsp.Pipeline.open(storage, c, checkpoint_interval=None)
    else:
        p = dbsp.Pipeline(c, workers=2, storage=storage, checkpoint_interval=None)
    kill_after = int(os.environ.get("DBSP_TEST_KILL_AFTER_BATCH", "-1"))

    def on_output(batch_id: int, step: int | None, out: dict) -> None:
        if batch_id == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    sink = foreach_batch(p, "s", on_output=on_output)
    print("READY", flush=True)
    tidy_checkpoint(ckpt)  # a kill during the first offset write leaves a temp file Spark 4.1 refuses to start on
    df = spark.readStream.schema(spark_schema()).option("maxFilesPerTrigger", 1).parquet(data)
    q = df.writeStream.foreachBatch(sink).option("checkpointLocation", ckpt).trigger(availableNow=True).start()
    q.awaitTermination()
    with open(stats, "w") as f:
        json.dump({"stats": sink.stats, "steps": {str(b): s for b, s in sink.batch_steps.items()},
                   "producer": sink.producer, "last": sink.last_batch}, f)
    p.close()
    spark.stop()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
