"""``FaultInjector``: process-wide control of the fault-injecting VFS that tests pass as ``vfs="fault"``."""

from __future__ import annotations

from dbsp_core import _storage

__all__ = ["FaultInjector"]


class FaultInjector:
    """Process-wide control of the fault-injecting VFS (``vfs="fault"``), modelled on SQLite's test6.c.

    ``arm(crash_at=N, mode=...)`` makes the N-th I/O operation simulate a crash: unsynced writes are kept,
    dropped, torn, reordered or mixed (``mode`` in ``keep, drop, tear, reorder, chaos``) and every later
    operation fails. ``arm(error_at=N, error="EIO"|"ENOSPC"|"EOPNOTSUPP")`` fails the N-th operation once
    (EOPNOTSUPP: as a file system without the operation answers; a hole punch then goes without the hole).

    Examples
    --------
    >>> FaultInjector.arm()          # count operations, inject nothing
    >>> FaultInjector.ops()
    0
    """

    MODES = tuple(_storage.CRASH_MODES)

    @staticmethod
    def arm(crash_at: int = 0, mode: str = "drop", seed: int = 0, error_at: int = 0, error: str = "EIO") -> None:
        _storage.fault_arm(crash_at, mode, seed, error_at, error)

    @staticmethod
    def disarm() -> None:
        _storage.fault_arm()

    @staticmethod
    def ops() -> int:
        """I/O operations counted since the last :meth:`arm`."""
        return _storage.fault_ops()

    @staticmethod
    def crashed() -> bool:
        return _storage.fault_crashed()

    @staticmethod
    def crash_now(mode: str = "drop", seed: int = 0) -> None:
        _storage.fault_crash_now(mode, seed)
