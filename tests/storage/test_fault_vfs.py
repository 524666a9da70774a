"""Fault VFS instances (csrc/vfs.c model 6): each counts, arms and crashes its own operations, so a session a test
enumerates through its own instance is numbered the same whatever other pipelines or threads of the process do
through the process-wide fault VFS or another instance."""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading

import pytest

from dbsp_core import _storage
from dbsp_core.storage import FaultInjector, FaultVfs

from storage_helpers import build_base, fault_op, run_session

OP = re.compile(r"(\w+(?: \w+)?) (\S+): (?:simulated crash|injected [^:;]+?) at operation (\d+)")


def _session(tmp_path, pristine: str, states: dict, fv: FaultVfs, arm: dict) -> tuple[int, tuple | None]:
    """A Database session (storage_helpers.run_session) on a copy of ``pristine`` through ``fv`` armed with ``arm``:
    the operations ``fv`` counted, and the operation (name, file name) an injected error landed on."""
    path = str(tmp_path / "db")
    shutil.copyfile(pristine, path)
    fv.arm(**arm)
    _new, _ok, err = run_session(path, 2, states[2], seed=11, vfs=fv.name)
    ops = fv.ops()
    fv.disarm()
    op = fault_op(err, arm.get("error_at", 0), OP)
    return ops, None if op is None else (op[0], os.path.basename(op[1]))


def _numbers_hold(tmp_path, fv: FaultVfs) -> None:
    """The session's operation count and where an error at each of a few operations lands, alone and then while
    another thread runs file writes through the process-wide fault VFS and through another instance."""
    pristine = str(tmp_path / "pristine")
    states, _ = build_base(pristine, seed=7, versions=2)
    nops, _ = _session(tmp_path, pristine, states, fv, {})
    points = sorted({1, 2, nops // 3, nops // 2, nops - 1, nops})
    alone = {n: _session(tmp_path, pristine, states, fv, dict(error_at=n))[1] for n in points}
    assert all(op is not None for op in alone.values()), alone
    other, stop = FaultVfs(), threading.Event()
    busy = {"writes": 0}

    def writes() -> None:  # another pipeline's operations: each file_replace is several VFS operations
        f = str(tmp_path / "other")
        while not stop.is_set():
            for vfs in ("fault", other.name):
                _storage.file_replace(f, b"x" * 100, vfs=vfs)
                _storage.file_remove(f, vfs=vfs)
            busy["writes"] += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave within a session
    t = threading.Thread(target=writes, daemon=True)
    t.start()
    try:
        for _ in range(3):
            assert _session(tmp_path, pristine, states, fv, {})[0] == nops
            for n in points:
                assert _session(tmp_path, pristine, states, fv, dict(error_at=n))[1] == alone[n], (n, alone)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(switch)
        FaultInjector.disarm()
    assert busy["writes"] > 0


def test_a_fault_vfs_numbers_its_own_operations_whatever_other_threads_do(tmp_path) -> None:
    """A Database session through a FaultVfs of its own: its operation count, and the operation an error armed at
    each of six numbers lands on, are the same alone and while another thread writes through the process-wide fault
    VFS and another instance. Watched fail with the session on the process-wide VFS (``FaultVfs("fault")``, as every
    crash test's was): the other thread's operations took its numbers."""
    _numbers_hold(tmp_path, FaultVfs())


def test_instances_are_apart() -> None:
    """Arming, counting and crashing one instance leave another and the process-wide one as they were; a name that
    is no fault VFS is refused."""
    a, b = FaultVfs(), FaultVfs()
    assert a.name != b.name
    a.arm(crash_at=1)
    b.arm()
    FaultInjector.arm()
    a.crash_now()
    assert a.crashed() and not b.crashed() and not FaultInjector.crashed()
    for fv in (a, b):
        fv.disarm()
    FaultInjector.disarm()
    with pytest.raises(ValueError, match="not a fault VFS"):
        _storage.fault_ops("posix")
    with pytest.raises(ValueError, match="unknown vfs"):
        _storage.file_read("/nonexistent", vfs="fault:999999")
