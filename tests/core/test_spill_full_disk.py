"""A spill directory with no room left gives a clear StorageError (ENOSPC) naming the directory, not a SIGBUS: a merge's output built in a shared mapping of a scratch file (trace invariant 12) reserves the file's blocks before any page of it is written. On a real 8 MiB tmpfs when this process may mount one (root), else with ENOSPC injected into ``posix_fallocate`` of the child."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _tiny_tmpfs(path: str) -> bool:
    """Mount an 8 MiB tmpfs at ``path``; False when this process may not."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], capture_output=True)
    return r.returncode == 0


def test_full_spill_dir_is_a_clear_error() -> None:
    with tempfile.TemporaryDirectory() as d:
        mounted = _tiny_tmpfs(d)
        try:
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            r = subprocess.run([sys.executable, os.path.join(HERE, "full_disk_child.py"), d,
                                "real" if mounted else "inject"], capture_output=True, text=True, env=env,
                               timeout=300)
        finally:
            if mounted:
                subprocess.run(["umount", d], check=True)
    print(f"spill dir on {'an 8 MiB tmpfs' if mounted else 'a disk with ENOSPC injected'}: {r.stdout.strip()}")
    assert r.returncode == 0, f"the child died (signal {-r.returncode} if negative): {r.stdout}{r.stderr[-2000:]}"
    assert r.stdout.startswith("ERROR StorageError 28 "), r.stdout + r.stderr[-2000:]
    assert d in r.stdout and "no room" in r.stdout
