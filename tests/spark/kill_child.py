"""Child driver of the Spark kill tests: runs a pipeline over seeded batches and either gets killed (driver kills) or has one of its Spark tasks killed (worker and executor kills).

Usage:
  kill_child.py driver RUNTIME STORAGE SEED BATCHES WORKERS [MASTER]
      Create or recover (``open``) the pipeline in STORAGE and push batch i with ``producer="gen", seq=i``
      from the first batch not acknowledged yet (the unacknowledged one is pushed again, the same seq), step
      after each push (SparkPipeline: queue even batches' steps, so each job runs two) and checkpoint every
      third batch. Each acknowledgement is appended to STORAGE/../acks.txt
      (fsync'd) before the step. Prints READY after recovery and DONE at the end. MASTER: Spark's (default
      local[2]); with DBSP_KILL_LOCAL_DIRS set, every run deletes that directory and keeps its Spark local
      directories (the executors' too, so their stage caches) in a new ``run-<n>`` under it, and the last run
      writes its state fetch counters to STORAGE/../stats.json.
  kill_child.py task MODE STORAGE SEED BATCHES WORKERS MARKER MASTER TARGET OUT
      A new pipeline on MASTER whose circuit kills the task holding the poison row of batch TARGET (MODE
      "worker": os._exit of the Python worker; "executor": it waits and the test kills the executor JVM);
      every step's output is pickled to OUT as ``[{output: sorted rows}]``. Prints READY and DONE. With
      DBSP_KILL_STORE_URI set, the pipeline's storage is that object store (STORAGE its driver's local cache).
RUNTIME is ``spark`` (spark_glue.SparkPipeline on local[2]), ``spark-store`` (the same with its storage on the object
store named by DBSP_KILL_STORE_URI and STORAGE its driver's local cache, deleted first: every restart starts on an
empty disk) or ``embedded`` (dbsp.Pipeline, to test the harness).
"""

from __future__ import annotations

import json
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from kill_workload import batch, build_circuit, session  # noqa: E402


def acked(path: str) -> int:
    """How many batches were acknowledged (acks are appended in seq order from 0)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        seqs = [int(x) for x in f.read().split()]
    assert seqs == list(range(len(seqs))), f"{path}: acks not contiguous: {seqs}"
    return len(seqs)


def make(runtime: str, storage: str, workers: int, circuit: dbsp.Circuit, master: str = "local[2]"):
    """Create or recover the pipeline in ``storage`` with the chosen runtime."""
    if runtime == "spark-store":
        import shutil

        from dbsp_core.storage.remote import Remote
        from spark_glue import SparkPipeline

        uri = os.environ["DBSP_KILL_STORE_URI"]
        shutil.rmtree(storage, ignore_errors=True)  # the old driver's local disk is gone
        disks = os.environ.get("DBSP_KILL_LOCAL_DIRS")
        if disks:  # and the old executors' (their stage caches): the Spark local directories of this run only
            shutil.rmtree(disks, ignore_errors=True)
            os.environ["SPARK_LOCAL_DIRS"] = os.path.join(disks, f"run-{_next_run(storage)}")
            os.makedirs(os.environ["SPARK_LOCAL_DIRS"])
        spark = session(master)
        if Remote.of(uri, storage).manifest_versions():
            return SparkPipeline.open(spark, uri, circuit, cache_dir=storage, checkpoint_interval=None)
        return SparkPipeline(spark, circuit, workers=workers, storage=uri, cache_dir=storage, checkpoint_interval=None)
    exists = os.path.exists(os.path.join(storage, "META"))
    if runtime == "embedded":
        if exists:
            return dbsp.Pipeline.open(storage, circuit, checkpoint_interval=None)
        return dbsp.Pipeline(circuit, workers=workers, storage=storage, checkpoint_interval=None)
    from spark_glue import SparkPipeline

    spark = session(master)
    if exists:
        return SparkPipeline.open(spark, storage, circuit)
    return SparkPipeline(spark, circuit, workers=workers, storage=storage)


def _next_run(storage: str) -> int:
    """The number of this run (1 for the first), counted in STORAGE/../runs.txt."""
    path = os.path.join(os.path.dirname(os.path.abspath(storage)), "runs.txt")
    n = int(open(path).read()) + 1 if os.path.exists(path) else 1
    with open(path, "w") as f:
        f.write(str(n))
    return n


def driver(runtime: str, storage: str, seed: int, batches: int, workers: int, master: str = "local[2]") -> None:
    base = os.path.dirname(os.path.abspath(storage))
    acks = os.path.join(base, "acks.txt")
    p = make(runtime, storage, workers, build_circuit(), master)
    opened_at = p.steps - p.stats.get("replayed_steps", 0)  # the checkpoint's step this run recovered from
    print("READY", flush=True)
    for i in range(acked(acks), batches):
        ack = p.push("s", batch(seed, i), producer="gen", seq=i)
        with open(acks, "a") as f:
            f.write(f"{i}\n")
            f.flush()
            os.fsync(f.fileno())
        assert ack.seq == i
        if hasattr(p, "queue_step") and i % 2 == 0:
            p.queue_step()  # SparkPipeline: this step runs in one job with the next one
        else:
            p.step()
        if i % 3 == 2:
            p.checkpoint()
    if os.environ.get("DBSP_KILL_LOCAL_DIRS"):
        st = p.stats
        with open(os.path.join(base, "stats.json"), "w") as f:
            json.dump({"run": int(open(os.path.join(base, "runs.txt")).read()), "fetches": st.get("state_fetches", 0), "opened_at": opened_at,
                       "fetch_bytes": st.get("state_fetch_bytes", 0), "roots": st.get("state_cache_roots", [])}, f)
    p.close()


def task(mode: str, storage: str, seed: int, batches: int, workers: int, marker: str, master: str, target: int,
         out: str) -> None:
    runtime = "spark-store" if os.environ.get("DBSP_KILL_STORE_URI") else "spark"
    p = make(runtime, storage, workers, build_circuit(marker, mode), master)
    print("READY", flush=True)
    steps = []
    for i in range(batches):
        p.push("s", batch(seed, i, poison=i == target))
        steps.append({name: sorted(z.to_dict().items()) for name, z in p.step().items()})
    p.close()
    with open(out, "wb") as f:
        pickle.dump(steps, f)


def main() -> int:
    a = sys.argv[1:]
    if a[0] == "driver":
        driver(a[1], a[2], int(a[3]), int(a[4]), int(a[5]), *a[6:7])
    elif a[0] == "task":
        task(a[1], a[2], int(a[3]), int(a[4]), int(a[5]), a[6], a[7], int(a[8]), a[9])
    else:
        raise SystemExit(f"unknown command {a[0]!r}")
    print("DONE", flush=True)
    sys.stdout.flush()
    os._exit(0)  # do not wait for Spark's shutdown hooks: the work is durable and reported


if __name__ == "__main__":
    sys.exit(main())
