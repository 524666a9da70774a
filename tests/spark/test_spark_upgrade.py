"""Rolling upgrade of the engine's code under a running SparkPipeline on local-cluster[2,1,1024]: a new release is deployed into the executors' code directory, then each executor JVM is replaced in turn (killed; the cluster starts a new one, whose Python workers import the new release) while steps keep running; every step's output equals a never-upgraded run, exactly once, and the tasks after the replacement ran the new release."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

import dbsp_core as dbsp  # noqa: E402
from spark_glue import SparkPipeline  # noqa: E402
from test_spark_live import executor_jvms  # noqa: E402

pytestmark = pytest.mark.spark
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def record_release(b: pa.RecordBatch) -> pa.RecordBatch:
    """The identity; inside a Spark task it notes which release of the engine this Python worker imported."""
    import dbsp_core as engine

    markers = os.environ.get("DBSP_UPGRADE_MARKERS")
    if markers:
        with open(os.path.join(markers, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{engine.__version__}\n")
    return b


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("s", SCHEMA).flat_map(record_release, schema=SCHEMA)
    c.output("g", s.group_by("k").agg(n=dbsp.count(), t=dbsp.sum("v")))
    c.output("d", s.select(v="v").distinct())
    return c


def batch(i: int) -> pa.Table:
    import numpy as np

    rng = np.random.default_rng(i)
    return pa.table({"k": rng.integers(0, 40, 200), "v": rng.integers(0, 50, 200)}, schema=SCHEMA)


@pytest.fixture(scope="module")
def upgrade_cluster(tmp_path_factory, spark_session_factory):
    """A local-cluster session whose executors import the engine from a code directory of their own."""
    _session = spark_session_factory

    code = tmp_path_factory.mktemp("code")
    for pkg in ("dbsp_core", "spark_glue"):
        shutil.copytree(os.path.join(REPO, pkg), code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    markers = tmp_path_factory.mktemp("markers")  # set for the executors only: the reference run writes none
    s = _session("local-cluster[2,1,1024]", "dbsp-upgrade", **{
        "spark.executorEnv.PYTHONPATH": os.pathsep.join([str(code), HERE]),
        "spark.executorEnv.PYSPARK_PYTHON": sys.executable, "spark.executorEnv.DBSP_UPGRADE_MARKERS": str(markers),
        "spark.task.maxFailures": "4", "spark.executor.memory": "512m"})
    yield s, code, markers
    s.stop()


def _releases(markers) -> dict[int, str]:
    out = {}
    for f in os.listdir(markers):
        with open(os.path.join(markers, f)) as fh:
            lines = fh.read().split()
        if lines:
            out[int(f.split(".")[0])] = lines[-1]
    return out


@pytest.mark.slow
def test_rolling_upgrade_replaces_executors_exactly_once(upgrade_cluster, tmp_path) -> None:
    spark, code, markers = upgrade_cluster
    p = SparkPipeline(spark, circuit(), workers=2, storage=str(tmp_path / "d"), checkpoint_interval=None)
    ref = dbsp.Pipeline(circuit(), workers=1)
    got, want = [], []
    step = 0

    def run(n: int) -> None:
        nonlocal step
        for _ in range(n):
            p.push("s", batch(step), producer="gen", seq=step)
            ref.push("s", batch(step))
            got.append({k: v.to_dict() for k, v in p.step().items()})
            want.append({k: v.to_dict() for k, v in ref.step().items()})
            step += 1

    run(3)
    old = set(_releases(markers).values())
    assert old == {dbsp.__version__}, old
    new_version = dbsp.__version__ + "+rolling"
    init = code / "dbsp_core" / "__init__.py"  # deploy the new release (here: the same code, another version)
    init.write_text(init.read_text().replace(f'__version__ = "{dbsp.__version__}"', f'__version__ = "{new_version}"'))
    replaced = []
    originals = executor_jvms()
    assert len(originals) == 2, originals
    for victim in originals:  # replace the executors one at a time; steps run in between and while one is down
        os.kill(victim, signal.SIGKILL)
        replaced.append(victim)
        run(2)
        deadline = time.monotonic() + 120
        while (len(executor_jvms()) < 2 or set(executor_jvms()) & set(replaced)) and time.monotonic() < deadline:
            time.sleep(0.5)
        run(1)
    for f in os.listdir(markers):
        os.unlink(os.path.join(markers, f))
    run(3)
    after = set(_releases(markers).values())
    print(f"\n[spark upgrade] executors replaced: {replaced}; tasks before ran {sorted(old)}, after {sorted(after)}; "
          f"{step} steps")
    assert after == {new_version}, after
    assert got == want  # every step's output once, as a never-upgraded run computes it
    assert list(p.output_steps) == list(range(step))
    p.close()
    ref.close()
