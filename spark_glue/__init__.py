"""spark_glue: run dbsp_core circuits on Apache Spark (SparkPipeline) and feed them from Structured Streaming (foreach_batch).

Only dbsp_core's public API is used; pyspark is imported when a Spark object is needed, so importing this
package does not start a JVM.
"""

from spark_glue.pipeline import SparkJobRunner, SparkPipeline  # noqa: F401,E402  steps as Spark jobs
from spark_glue.streaming import ForeachBatch, StaleBatchError, foreach_batch, tidy_checkpoint  # noqa: F401,E402  Structured Streaming sink

__all__ = ["SparkPipeline", "SparkJobRunner", "foreach_batch", "ForeachBatch", "StaleBatchError", "tidy_checkpoint"]
