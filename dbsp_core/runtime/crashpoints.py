"""Named crash points for the kill -9 tests: ``DBSP_CRASHPOINT="name:n"`` (or :func:`arm_crashpoint`) makes the n-th hit of crash point ``name`` kill this process with SIGKILL; unarmed, a hit costs one comparison."""

from __future__ import annotations

import os
import signal
import threading

from dbsp_core.envvars import settings

_crash_name, _crash_left = "", 0
_crash_lock = threading.Lock()


def arm_crashpoint(spec: str) -> None:
    """Tests only: ``"name:n"`` makes the n-th hit of crash point ``name`` kill this process; ``""`` disarms."""
    global _crash_name, _crash_left
    name, _, n = spec.partition(":")
    _crash_name, _crash_left = name, (int(n) if n.isdigit() else 0)


arm_crashpoint(settings().crashpoint)  # DBSP_CRASHPOINT


def crashpoint(name: str) -> None:
    """Kill this process with SIGKILL at the configured hit of crash point ``name`` (tests only; else a no-op)."""
    global _crash_left
    if not _crash_left or name != _crash_name:
        return
    with _crash_lock:
        _crash_left -= 1
        if _crash_left == 0:
            os.kill(os.getpid(), signal.SIGKILL)
