"""Checks, once per SparkContext, that Spark's Python workers import the engine, and the same version as the driver, so a missing ``PYSPARK_PYTHON`` fails at once with what to set instead of deep inside the first step.

The probe is one tiny ``mapInArrow`` job. Its function is compiled from source into a module Spark's workers do
not need to import (cloudpickle then ships it by value), so it can report a worker that cannot import
``dbsp_core`` or ``spark_glue`` instead of failing to unpickle.
"""

from __future__ import annotations

import sys
from typing import Any

import dbsp_core
from dbsp_core.errors import DbspError

__all__ = ["check_executors", "ExecutorSetupError"]

_CHECKED: set[str] = set()  # applicationIds whose Spark executors passed

_PROBE = '''
def probe(batches):
    import sys
    import pyarrow as pa
    for _ in batches:
        pass
    version, error = None, ""
    try:
        import dbsp_core
        version = getattr(dbsp_core, "__version__", "unknown")
        import spark_glue  # noqa: F401
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    yield pa.RecordBatch.from_pydict({"python": [sys.executable], "version": [version], "error": [error]})
'''


class ExecutorSetupError(DbspError):
    """Spark's Python workers cannot run the engine (not importable there, or another version)."""


def _probe_fn() -> Any:
    ns: dict[str, Any] = {"__name__": "dbsp_executor_probe"}  # not importable: pickled by value
    exec(compile(_PROBE, "<dbsp executor probe>", "exec"), ns)
    return ns["probe"]


def _advice() -> str:
    return (f"Set PYSPARK_PYTHON to a Python that has dbsp-core {dbsp_core.__version__} installed before the "
            f"SparkSession starts (this driver runs {sys.executable}: export PYSPARK_PYTHON={sys.executable}), "
            f"or install the same dbsp-core wheel on every Spark executor, or point spark.executorEnv.PYTHONPATH at "
            f"this checkout")


def check_executors(spark: Any, tasks: int | None = None) -> dict:
    """Run the probe on ``tasks`` tasks (default: the default parallelism) and return ``{"python": [...],
    "version": ...}``; raise :class:`ExecutorSetupError` saying what to set if a worker cannot import the
    engine or has another version. Passing once per SparkContext is remembered."""
    sc = spark.sparkContext
    app = sc.applicationId
    if app in _CHECKED:
        return {"checked": True}
    n = max(1, tasks or sc.defaultParallelism)
    try:
        rows = (spark.range(0, n, 1, n).mapInArrow(_probe_fn(), "python string, version string, error string")
                .toArrow().to_pylist())
    except Exception as e:  # the worker Python failed before the probe ran (no pyarrow there, ...)
        last = str(e).strip().splitlines()
        raise ExecutorSetupError(f"Spark's Python workers could not run a dbsp probe ({last[-1] if last else e}). "
                                 f"{_advice()}") from None
    other = sorted({r["version"] for r in rows if r["version"] is not None} - {dbsp_core.__version__})
    bad = [r for r in rows if r["error"]]
    if bad and not other:
        raise ExecutorSetupError(f"Spark's Python workers ({bad[0]['python']}) cannot import the engine: "
                                 f"{bad[0]['error']}. {_advice()}")
    if other:
        raise ExecutorSetupError(f"Spark's Python workers run dbsp-core {other[0]}, this driver "
                                 f"{dbsp_core.__version__}: results and storage formats must come from one "
                                 f"version. {_advice()}")
    _CHECKED.add(app)
    return {"python": sorted({r["python"] for r in rows}), "version": dbsp_core.__version__}
