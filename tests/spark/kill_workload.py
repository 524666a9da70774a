"""The workload of the Spark kill tests: seeded batches of (k, v), a circuit whose first operator can kill the Spark task that holds a poison row, and the sessions the kill children run on."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import dbsp_core as dbsp
from stream_workload import SCHEMA

POISON = 1_000_000  # a key no generated row has; the target step's batch carries one row with it


def batch(seed: int, i: int, rows: int = 400, poison: bool = False) -> pa.Table:
    """Batch ``i`` of seed ``seed`` (the same on every call); with ``poison`` one extra row has key POISON."""
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(1, rows + 1))
    k = rng.integers(0, 50, n)
    v = rng.integers(0, 100, n)
    if poison:
        k, v = np.append(k, POISON), np.append(v, 1)
    return pa.table({"k": k, "v": v}, schema=SCHEMA)


def make_trap(marker_dir: str | None, mode: str):
    """The flat_map function of the kill circuit: the identity, except inside a Spark task that sees a POISON row
    while ``marker_dir`` holds no marker yet (so only the first attempt, whatever Spark calls it).

    ``mode="worker"``: write the marker and ``os._exit`` the Python worker. ``mode="executor"``: write the
    marker (with this worker's pid) and wait to be killed with the executor JVM that runs it; the test kills it.
    Outside Spark (the embedded reference) and with ``marker_dir=None`` it never fires.
    """

    def trap(b: pa.RecordBatch) -> pa.RecordBatch:
        if marker_dir is None or b.num_rows == 0 or not pc.any(pc.equal(b.column(0), POISON)).as_py():
            return b
        import time

        try:
            from pyspark import TaskContext
        except ImportError:
            return b
        tc = TaskContext.get()
        if tc is None:
            return b
        try:
            fd = os.open(os.path.join(marker_dir, f"{mode}.pid"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # a later attempt: let it run
            return b
        os.write(fd, f"{os.getpid()} {tc.stageId()} {tc.partitionId()} {tc.attemptNumber()}\n".encode())
        os.fsync(fd)
        os.close(fd)
        if mode == "worker":
            os._exit(1)
        time.sleep(300)  # "executor": the test kills our JVM now; if it never does, the test fails on its own
        return b

    return trap


def build_circuit(marker_dir: str | None = None, mode: str = "worker") -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("s", SCHEMA).flat_map(make_trap(marker_dir, mode), schema=SCHEMA)
    c.output("agg", s.group_by("k").agg(n=dbsp.count(), total=dbsp.sum("v")))
    c.output("big", s.filter(pc.field("v") >= 90).select(k=pc.field("k"), v=pc.field("v")))
    return c


def session(master: str):
    """A small Spark session for a kill child: UI off, 2 shuffle partitions, executors that find this checkout."""
    import pyspark
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))  # local-cluster launches executors from it
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(os.path.abspath(__file__))
    pp = os.pathsep.join([repo, here])
    b = (SparkSession.builder.master(master).appName("kill-child")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.executorEnv.PYTHONPATH", pp).config("spark.executorEnv.PYSPARK_PYTHON", sys.executable))
    if master.startswith("local-cluster"):
        b = b.config("spark.executor.memory", "768m")
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):  # an object store's, if any:
            if k in os.environ:  # executors get them from their environment, as on a real cluster
                b = b.config(f"spark.executorEnv.{k}", os.environ[k])
    s = b.getOrCreate()
    s.sparkContext.setLogLevel("ERROR")
    return s
