"""Durable storage: the two-version per-worker ``Database``, the write-ahead ``StepLog``, the output log, operator state saved by shard, the driver's set of recorded (producer, seq) pushes (dedup.py), and the fault-injecting I/O layer for tests (C core in csrc/)."""

from __future__ import annotations

from dbsp_core.errors import CorruptionError, FormatVersionError, StorageError
from dbsp_core.storage.database import SHARD_PREFIX_BYTES, Database, DatabaseHandle, shard_key, shard_of_key
from dbsp_core.storage.faults import FaultInjector, FaultVfs
from dbsp_core.storage.steplog import LogRecord, StepLog

__all__ = ["CorruptionError", "Database", "DatabaseHandle", "FaultInjector", "FaultVfs", "FormatVersionError", "LogRecord",
           "SHARD_PREFIX_BYTES", "StepLog", "StorageError", "shard_key", "shard_of_key"]
