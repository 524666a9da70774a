"""Spark fixtures for tests/spark: a small local session (kept for the pytest process) and a local-cluster session (separate executor JVMs, one per test module), and the shared circuits of tests/core on the import path.

Both sessions run the Python workers with this interpreter and allow task retries: ``local[2,4]`` is two
threads with up to 4 attempts per task (plain ``local[2]`` never retries a task), and
``local-cluster[2,1,1024]`` (2 executors of 1 core and 1 GiB) keeps ``spark.task.maxFailures`` at 4.
local-cluster mode launches executors from a Spark distribution: it needs ``SPARK_HOME`` pointing at the
pyspark package directory (set here when missing) and gets ``PYTHONPATH`` (this checkout) and
``PYSPARK_PYTHON`` through ``spark.executorEnv``. Tests are skipped, with the reason, when Java is missing.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "core"))  # oracle.py, staged_circuits.py


def _java() -> bool:
    home = os.environ.get("JAVA_HOME")
    return bool(shutil.which("java") or (home and os.path.exists(os.path.join(home, "bin", "java"))))


def _missing() -> str | None:
    """Why the Spark tests cannot run here (None if they can)."""
    if not _java():
        return "Java is not installed (needed by pyspark)"
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (pip install -e .[spark])"
    return None


def pytest_collection_modifyitems(config, items):
    """DBSP_REQUIRE_SPARK=1 (CI): a missing Java or pyspark fails the run instead of skipping these tests."""
    why = _missing()
    if why and os.environ.get("DBSP_REQUIRE_SPARK") == "1":
        raise pytest.UsageError(f"DBSP_REQUIRE_SPARK=1 but the Spark tests cannot run: {why}")


def _session(master: str, app: str, **conf: str):
    if not _java():
        pytest.skip("Java is not installed (needed by pyspark)")
    pyspark = pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    active = SparkSession.getActiveSession()
    if active is not None and active.sparkContext.master != master:
        active.stop()  # one SparkContext per process: another module's session of another master goes first
    b = (SparkSession.builder.master(master).appName(app)
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2").config("spark.default.parallelism", "2"))
    for k, v in conf.items():
        b = b.config(k, v)
    s = b.getOrCreate()
    s.sparkContext.setLogLevel("ERROR")
    return s


@pytest.fixture(scope="session")
def _stop_spark_at_exit():
    """Stops the active session at the end of the pytest process (spark_local's, kept between modules)."""
    yield
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


@pytest.fixture(scope="module")
def spark_local(_stop_spark_at_exit):
    """A ``local[2,4]`` session (two task threads, task retries on). It stays up after the module: the next module
    of this process that asks for it gets the same session (``getOrCreate``), with Spark's Python workers already
    started (a new SparkContext starts its Python worker daemon and workers again, and each worker imports
    dbsp_core and Arrow: most of a small module's time). A module that needs another master (spark_cluster, the
    README's blocks) stops it first; the next spark_local then starts a new one."""
    s = _session("local[2,4]", "dbsp-tests-local")
    yield s


@pytest.fixture(scope="module")
def spark_cluster():
    """A ``local-cluster[2,1,1024]`` session: two executor JVMs, each with its own Python workers."""
    pythonpath = os.pathsep.join([REPO] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    s = _session("local-cluster[2,1,1024]", "dbsp-tests-cluster", **{
        "spark.executorEnv.PYTHONPATH": pythonpath, "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
        "spark.task.maxFailures": "4", "spark.executor.memory": "512m"})
    yield s
    s.stop()


@pytest.fixture(scope="session")
def spark_session_factory():
    """``_session(master, app, **conf)`` for tests that build a session of their own (a fixture, because a
    ``from conftest import`` names whichever tests/*/conftest.py was imported first)."""
    return _session
