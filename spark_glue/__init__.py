"""spark_glue: run dbsp_core circuits on Apache Spark (SparkPipeline), feed them from Structured Streaming (foreach_batch), and use the engine inside a user's own UDFs (udf).

Only dbsp_core's public API is used; pyspark is imported when a Spark object is needed, so importing this
package does not start a JVM.
"""

from spark_glue.check import ExecutorSetupError, check_executors  # noqa: F401,E402  workers import the engine
from spark_glue.pipeline import SparkJobRunner, SparkPipeline  # noqa: F401,E402  steps as Spark jobs
from spark_glue.streaming import ForeachBatch, StaleBatchError, foreach_batch, tidy_checkpoint  # noqa: F401,E402  Structured Streaming sink

from spark_glue import udf  # noqa: F401,E402  the engine inside a user's own mapInArrow / pandas UDFs

__all__ = ["SparkPipeline", "SparkJobRunner", "foreach_batch", "ForeachBatch", "StaleBatchError", "tidy_checkpoint",
           "udf", "check_executors", "ExecutorSetupError"]
