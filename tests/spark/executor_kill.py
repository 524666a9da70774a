"""Losing a Spark executor of local-cluster on purpose (tests/spark/test_spark_lose.py, bench/bench_spark_lose.py): find the executor JVMs of an application and SIGKILL one with its Python processes, deleting its local directories."""

from __future__ import annotations

import os
import shutil
import signal

from spark_glue.placement import cmdline_of as _cmdline


def executors(app_id: str) -> dict[str, int]:
    """Executor id -> pid of the live executor JVMs of application ``app_id``."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            cmd = _cmdline(int(d))
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd and app_id in cmd:
                out[cmd[cmd.index("--executor-id") + 1]] = int(d)
    return out


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except OSError:
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def executor_dirs(pid: int) -> list[str]:
    """The local directories of executor JVM ``pid`` (its ``SPARK_EXECUTOR_DIRS``; the stage caches are under
    the first)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split("=", 1) for e in f.read().decode(errors="replace").split("\0") if "=" in e)
    except OSError:  # gone meanwhile
        return []
    return [d for d in env.get("SPARK_EXECUTOR_DIRS", "").split(os.pathsep) if d]


def kill_executor(pid: int) -> list[str]:
    """SIGKILL executor JVM ``pid`` and its Python daemon and workers, then delete its local directories (what a
    lost spot machine takes with it). Returns the directories deleted."""
    dirs = executor_dirs(pid)
    cwd = os.readlink(f"/proc/{pid}/cwd")  # work/<app>/<executor id>: its stdout, stderr and fetched files
    for p in _descendants(pid):  # the JVM first: the daemon must not see it go and restart workers
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for d in dirs + [cwd]:
        shutil.rmtree(d, ignore_errors=True)
    return dirs
