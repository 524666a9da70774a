"""A script that ends without closing its pipeline leaves no engine thread running into Python's finalization (a
daemon merge or spill thread taking the GIL back inside C code there aborted a process once: SIGABRT,
"PyGILState_Release: thread state must be current"); the exit hook of dbsp_core/trace/at_exit.py stops them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("mode", ["memory", "durable"])
def test_engine_threads_are_stopped_before_finalization(mode: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, os.path.join(HERE, "unclosed_child.py"), mode, d], capture_output=True,
                           text=True, env=env, timeout=300)
    out = r.stdout + r.stderr[-2000:]
    assert r.returncode == 0, f"the child died (signal {-r.returncode} if negative): {out}"
    started = next(line for line in r.stdout.splitlines() if line.startswith("STARTED:"))
    # the thing under test happened: both background threads ran in the child
    assert "dbsp-merge-thread" in started and "dbsp-spill-thread" in started, out
    assert "ALIVE AT EXIT: none" in r.stdout, out
