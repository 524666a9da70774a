"""The fault-injecting VFS of crash tests: ``FaultInjector`` drives the process-wide one (``vfs="fault"``), a
``FaultVfs`` one of its own (``vfs=fv.name``) whose operations no other pipeline or thread of the process numbers."""

from __future__ import annotations

from dbsp_core import _storage

__all__ = ["FaultInjector", "FaultVfs"]


class FaultVfs:
    """A fault-injecting VFS with an operation counter, arming and remembered writes of its own (csrc/vfs.c model 6),
    modelled on SQLite's test6.c: a test passes ``fv.name`` as the ``vfs`` of the pipeline or store it enumerates, so
    the operations of another pipeline of the process (one an earlier test left to the collector) or another thread
    through another VFS never take one of its numbers; within it, numbers follow the order its operations run in.

    ``arm(crash_at=N, mode=...)`` makes the N-th I/O operation simulate a crash: unsynced writes are kept,
    dropped, torn, reordered or mixed (``mode`` in ``keep, drop, tear, reorder, chaos``) and every later
    operation fails. ``arm(error_at=N, error="EIO"|"ENOSPC"|"EOPNOTSUPP")`` fails the N-th operation once
    (EOPNOTSUPP: as a file system without the operation answers; a hole punch then goes without the hole).
    Instances are never freed (a file may still point at one); ``disarm`` forgets what one remembers.

    Examples
    --------
    >>> fv = FaultVfs()
    >>> fv.name.startswith("fault:")
    True
    >>> fv.arm()          # count operations, inject nothing
    >>> fv.ops()
    0
    """

    MODES = tuple(_storage.CRASH_MODES)

    def __init__(self, name: str | None = None) -> None:
        self.name = _storage.fault_new() if name is None else name  # (name "fault": the process-wide one)

    def arm(self, crash_at: int = 0, mode: str = "drop", seed: int = 0, error_at: int = 0, error: str = "EIO") -> None:
        _storage.fault_arm(crash_at, mode, seed, error_at, error, vfs=self.name)

    def disarm(self) -> None:
        _storage.fault_arm(vfs=self.name)

    def ops(self) -> int:
        """I/O operations counted since the last :meth:`arm`."""
        return _storage.fault_ops(self.name)

    def crashed(self) -> bool:
        return _storage.fault_crashed(self.name)

    def crash_now(self, mode: str = "drop", seed: int = 0) -> None:
        _storage.fault_crash_now(mode, seed, vfs=self.name)


_PROCESS = FaultVfs("fault")


class FaultInjector:
    """Process-wide control of the fault-injecting VFS (``vfs="fault"``): :class:`FaultVfs`'s calls on the one every
    pipeline and thread of the process that passes ``vfs="fault"`` shares (one counter for all of them).

    Examples
    --------
    >>> FaultInjector.arm()          # count operations, inject nothing
    >>> FaultInjector.ops()
    0
    """

    MODES = FaultVfs.MODES

    @staticmethod
    def arm(crash_at: int = 0, mode: str = "drop", seed: int = 0, error_at: int = 0, error: str = "EIO") -> None:
        _PROCESS.arm(crash_at, mode, seed, error_at, error)

    @staticmethod
    def disarm() -> None:
        _PROCESS.disarm()

    @staticmethod
    def ops() -> int:
        """I/O operations counted since the last :meth:`arm`."""
        return _PROCESS.ops()

    @staticmethod
    def crashed() -> bool:
        return _PROCESS.crashed()

    @staticmethod
    def crash_now(mode: str = "drop", seed: int = 0) -> None:
        _PROCESS.crash_now(mode, seed)
