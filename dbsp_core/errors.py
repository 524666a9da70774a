"""The typed exceptions of dbsp_core; every native status code maps to one of them."""

from __future__ import annotations


class DbspError(Exception):
    """Base class of every error raised by dbsp_core."""


class WeightOverflowError(DbspError, OverflowError):
    """A Z-set weight left the int64 range; weights never wrap around."""


class SchemaError(DbspError, ValueError):
    """Two schemas that must agree do not, or a column is unknown or of an unsupported type."""


class StorageError(DbspError, OSError):
    """An I/O operation of the storage layer failed (EIO, ENOSPC, ...)."""


class CorruptionError(StorageError):
    """An on-disk structure failed its checksum or validity rule."""


class FormatVersionError(StorageError):
    """An on-disk structure has a format version this build cannot read."""


class ReplayMismatchError(DbspError):
    """A step replayed during recovery produced output that differs from what the output log already holds."""


class CircuitMismatchError(DbspError, ValueError):
    """A storage directory was opened with a circuit (or worker count) other than the one that wrote it."""


class RecoveryError(DbspError):
    """Durable state cannot be recovered consistently (e.g. the workers share no database version)."""
