"""dbsp_core: incremental computation in the DBSP model over a native C core.

The public surface is listed in ``__all__``; everything else is internal.
"""

from __future__ import annotations

from dbsp_core.errors import (
    CorruptionError,
    DbspError,
    FormatVersionError,
    SchemaError,
    StorageError,
    WeightOverflowError,
)

from dbsp_core.zset import HASH_VERSION, IndexedZSet, ZSet

__version__ = "0.1.0"

__all__ = [
    "HASH_VERSION",
    "IndexedZSet",
    "ZSet",
    "CorruptionError",
    "DbspError",
    "FormatVersionError",
    "SchemaError",
    "StorageError",
    "WeightOverflowError",
]
