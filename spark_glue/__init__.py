from spark_glue.streaming import ForeachBatch, StaleBatchError, foreach_batch  # noqa: F401,E402  Structured Streaming sink
