"""Crash tests (a) and (d): a crash or an EIO/ENOSPC at every I/O operation of a Database session.

The session is open(v) -> puts/deletes -> set_step -> commit through the fault VFS. After each simulated
crash (with every damage mode) the file is reopened through POSIX and compared with the model: the
openable versions and their contents must be exactly an allowed outcome, never a mix.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from dbsp_core.errors import StorageError
from dbsp_core.storage import FaultInjector

from storage_helpers import build_base, dry_run_ops, observed, run_session

MODES = FaultInjector.MODES
# (mode, seed) pairs tried at every operation: the random modes get several seeds (DBSP_CRASH_SEEDS, default 3).
SEEDS = int(os.environ.get("DBSP_CRASH_SEEDS", "3"))
DAMAGE = [(m, 0) for m in ("keep", "drop")] + [(m, s) for m in ("tear", "reorder", "chaos") for s in range(SEEDS)]
COUNTS = {"crash_points": 0, "error_points": 0, "violations": 0}


@pytest.mark.parametrize("base_kind", ["newest", "older"])
def test_crash_at_every_operation(tmp_path, base_kind):
    """(a) exhaustive: crash at every operation x every damage mode; compare to the model."""
    path = str(tmp_path / "db")
    states, _ = build_base(path, seed=7, versions=2)  # versions() == range(1, 3)
    pristine = str(tmp_path / "pristine")
    shutil.copyfile(path, pristine)
    base = 2 if base_kind == "newest" else 1
    before = {v: states[v] for v in (1, 2)}
    nops = dry_run_ops(path, base, states[base], seed=11, tmpdir=str(tmp_path))
    tried = 0
    for n in range(1, nops + 1):
        for mode, seed in DAMAGE:
            shutil.copyfile(pristine, path)
            FaultInjector.arm(crash_at=n, mode=mode, seed=n * 1000 + seed)
            new, committed, err = run_session(path, base, states[base], seed=11)
            crashed = FaultInjector.crashed()
            FaultInjector.disarm()
            assert crashed and not committed and err is not None, f"op {n} {mode}: crash not surfaced"
            got = observed(path, str(tmp_path))
            allowed = [before, {base: states[base]}, {base: states[base], base + 1: new}]
            tried += 1
            if got not in allowed:
                COUNTS["violations"] += 1
                pytest.fail(f"crash at op {n} mode {mode}: versions {sorted(got)} match no allowed outcome")
    COUNTS["crash_points"] += tried
    print(f"\n[storage crash (a)] base={base_kind}: {nops} operations x {len(DAMAGE)} (mode, seed) = {tried} crashes, "
          f"0 violations")


@pytest.mark.parametrize("error", ["EIO", "ENOSPC"])
def test_error_at_every_operation(tmp_path, error):
    """(d) EIO/ENOSPC at every operation: the error surfaces, no false success, and a reopen is consistent."""
    path = str(tmp_path / "db")
    states, _ = build_base(path, seed=5, versions=2)
    pristine = str(tmp_path / "pristine")
    shutil.copyfile(path, pristine)
    base = 2
    before = {v: states[v] for v in (1, 2)}
    nops = dry_run_ops(path, base, states[base], seed=3, tmpdir=str(tmp_path))
    want_errno = errno.EIO if error == "EIO" else errno.ENOSPC
    for n in range(1, nops + 1):
        shutil.copyfile(pristine, path)
        FaultInjector.arm(error_at=n, error=error)
        new, committed, err = run_session(path, base, states[base], seed=3)
        FaultInjector.disarm()
        assert not committed, f"{error} at op {n}: commit reported success"
        assert isinstance(err, StorageError) and err.errno == want_errno, f"{error} at op {n}: got {err!r}"
        got = observed(path, str(tmp_path))
        assert got in [before, {base: states[base]}, {base: states[base], base + 1: new}], \
            f"{error} at op {n}: inconsistent reopen {sorted(got)}"
        # the store recovers: a clean session on the reopened file succeeds
        v = max(got)
        new2, ok, e2 = run_session(path, v, got[v], seed=99, vfs="posix")
        assert ok and e2 is None
        assert observed(path, str(tmp_path)) == {v: got[v], v + 1: new2}
    COUNTS["error_points"] += nops
    print(f"\n[storage errors (d)] {error} injected at each of {nops} operations, 0 violations")


def test_crash_during_create_and_first_commit(tmp_path):
    """A crash at every operation of creating a Database and committing version 1: on reopen the store is
    either version 0 (empty) or versions 0 and 1 with the committed data; never an unreadable file."""
    from dbsp_core.storage import Database

    tried = 0
    FaultInjector.arm()
    p0 = str(tmp_path / "dry")
    with Database(p0, vfs="fault") as db, db.open(0) as h:
        h.put("t", b"k", b"v" * 5000)
        h.commit()
    nops = FaultInjector.ops()
    for n in range(1, nops + 1):
        for mode in MODES:
            d = tmp_path / f"c{n}{mode}"
            d.mkdir()
            path = str(d / "db")
            FaultInjector.arm(crash_at=n, mode=mode, seed=n)
            try:
                with Database(path, vfs="fault") as db, db.open(0) as h:
                    h.put("t", b"k", b"v" * 5000)
                    h.commit()
            except StorageError:
                pass
            FaultInjector.disarm()
            got = observed(path, str(d))
            assert got in ({0: {("__step__", b""): 0}},
                           {0: {("__step__", b""): 0}, 1: {("__step__", b""): 0, ("t", b"k"): b"v" * 5000}}), \
                f"crash at op {n} mode {mode}: {got}"
            tried += 1
            shutil.rmtree(d)
    COUNTS["crash_points"] += tried
    print(f"\n[storage crash (a)] create + first commit: {nops} operations x {len(MODES)} modes = {tried} crashes, "
          f"0 violations")
