"""dbsp_core: incremental computation in the DBSP model over a native C core.

The public surface is listed in ``__all__``; everything else is internal.
"""

from __future__ import annotations

from dbsp_core.errors import (
    AppendOnlyError,
    CircuitMismatchError,
    CorruptionError,
    DbspError,
    FormatVersionError,
    IndexDroppedWarning,
    InputFileError,
    InUseError,
    PrimaryKeyError,
    QueryError,
    RecoveryError,
    ReplayMismatchError,
    SchemaError,
    StepError,
    StorageError,
    StoreFencedError,
    StoreUnavailableError,
    WeightOverflowError,
    WorkerStateLostError,
)

from dbsp_core.envvars import settings

settings()  # every DBSP_* setting read and checked now (DBSP_SCRATCH_MB too, before a kernel reads it); no sizing

from dbsp_core.storage import Database, StepLog  # noqa: E402
from dbsp_core.zset import HASH_VERSION, IndexedZSet, ZSet  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Database",
    "StepLog",
    "HASH_VERSION",
    "IndexedZSet",
    "ZSet",
    "AppendOnlyError",
    "CircuitMismatchError",
    "CorruptionError",
    "DbspError",
    "FormatVersionError",
    "IndexDroppedWarning",
    "InputFileError",
    "InUseError",
    "PrimaryKeyError",
    "QueryError",
    "RecoveryError",
    "ReplayMismatchError",
    "SchemaError",
    "SqlError",  # dbsp_core.sql.errors, imported on first use (below)
    "StepError",
    "StorageError",
    "StoreFencedError",
    "StoreUnavailableError",
    "WeightOverflowError",
    "WorkerStateLostError",
]

# circuits, operators and the embedded runtime
from dbsp_core.aggregates import avg, count, count_distinct, max, min, sum  # noqa: E402,A004
from dbsp_core.circuit import Circuit, Stream  # noqa: E402
from dbsp_core.layout import Layout, ShardMap  # noqa: E402
from dbsp_core.runtime import Pipeline  # noqa: E402
from dbsp_core.runtime.autoscale import Autoscale  # noqa: E402
from dbsp_core.storage.remote import StoreOptions  # noqa: E402

__all__ += ["Circuit", "Stream", "Pipeline", "Autoscale", "StoreOptions", "count", "count_distinct", "sum", "min", "max", "avg", "ShardMap", "Layout"]

# views over the step's logged wall-clock now
from dbsp_core.operators.temporal import filter_now, within_last  # noqa: E402

__all__ += ["within_last", "filter_now"]


def __getattr__(name: str) -> object:
    """``dbsp.sql`` (the SQL front end), ``dbsp.nexmark`` and ``dbsp.SqlError``, imported on first use (sqlglot
    loads only then)."""
    if name in ("sql", "nexmark"):
        import importlib

        return importlib.import_module(f"dbsp_core.{name}")
    if name == "SqlError":
        from dbsp_core.sql.errors import SqlError

        return SqlError
    raise AttributeError(f"module 'dbsp_core' has no attribute {name!r}")
