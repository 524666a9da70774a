"""Spark executors that follow an autoscaled SparkPipeline's worker count: before a scale-up and after a scale-down the autoscaler asks here for as many Spark executors as the new count of tasks per stage needs, through the JVM gateway's SparkContext.requestExecutors / killExecutors where the cluster manager supports them, and says what happened (or why nothing was asked) in its decisions.

What Spark allows (SparkContext, a DeveloperApi reached through ``sc._jsc.sc()``: pyspark has no Python
binding for it):
  1. Local mode (``local[N]``) runs every task in the driver's JVM: there are no Spark executors to ask for, and
     the scheduler backend refuses both calls. Nothing is asked; the decision says so.
  2. With ``spark.dynamicAllocation.enabled`` Spark's own allocation manager sizes the executors to the pending
     tasks (W per stage, so it follows the worker count by itself) and ``killExecutors`` is refused
     ("unsupported with Dynamic Allocation turned on"): a scale-up asks for the missing executors at once
     (``requestExecutors``, so they start before the next job needs them), a scale-down releases none
     (Spark's idle timeout does).
  3. Without dynamic allocation, on a cluster manager with a coarse-grained backend (standalone, YARN,
     Kubernetes, ``local-cluster``), a scale-up asks for the missing executors and a scale-down kills the extra
     ones (the newest first); the return value says whether the cluster manager took the request.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from dbsp_core.runtime.autoscaler import Capacity

__all__ = ["SparkExecutors"]


class SparkExecutors(Capacity):
    """Asks ``spark``'s cluster manager for the Spark executors ``workers`` tasks per stage need (module notes)."""

    def __init__(self, spark: Any) -> None:
        self.sc = spark.sparkContext
        self._released: set[str] = set()  # executors asked to go that may still be listed (a kill is asynchronous)

    def _conf(self, key: str, default: str) -> str:
        return str(self.sc.getConf().get(key, default))

    def tasks_per_executor(self) -> int:
        cores = int(self._conf("spark.executor.cores", "1"))
        cpus = int(self._conf("spark.task.cpus", "1"))
        return max(1, cores // max(1, cpus))

    def task_slots(self) -> int:
        """Tasks one Spark executor runs at once: ``N`` of ``local[N]`` / ``local[N,F]`` (the cores of ``local[*]``),
        the cores per executor of ``local-cluster[n,c,m]``, else :meth:`tasks_per_executor`."""
        master = self.sc.master
        m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master)
        if m is not None:
            n = m.group(1)
            return (os.cpu_count() or 1) if n == "*" else int(n or 1)
        m = re.fullmatch(r"local-cluster\[\s*\d+\s*,\s*(\d+)\s*,.*\]", master)
        if m is not None:
            return max(1, int(m.group(1)) // max(1, int(self._conf("spark.task.cpus", "1"))))
        return self.tasks_per_executor()

    def executor_ids(self) -> list[str]:
        """The Spark executors alive now (not the driver), without those already asked to go."""
        seq = self.sc._jsc.sc().getExecutorIds()
        ids = [str(x) for x in self.sc._jvm.scala.collection.JavaConverters.seqAsJavaList(seq)]
        self._released &= set(ids)  # gone: forget them
        return [i for i in ids if i not in self._released]

    def follow(self, workers: int) -> str:
        master = self.sc.master
        if master.startswith("local") and not master.startswith("local-cluster"):
            return (f"no Spark executors asked for: {master} runs every task in the driver's JVM (local mode); the "
                    f"worker count ({workers}) changed, the threads stay")
        dynamic = self._conf("spark.dynamicAllocation.enabled", "false").lower() == "true"
        per = self.tasks_per_executor()
        want = math.ceil(workers / per)
        try:
            ids = self.executor_ids()
            jsc = self.sc._jsc.sc()
            if want > len(ids):
                ok = jsc.requestExecutors(want - len(ids))
                return (f"asked for {want - len(ids)} more Spark executors ({len(ids)} -> {want} for {workers} "
                        f"workers, {per} tasks each): {'accepted' if ok else 'not taken by the cluster manager'}")
            if want < len(ids):
                if dynamic:
                    return (f"{len(ids) - want} Spark executors are no longer needed; with dynamic allocation on "
                            f"Spark releases idle ones itself (killExecutors is refused while it is on)")
                extra = sorted(ids, key=lambda x: (len(x), x))[want:]
                ok = jsc.killExecutors(self.sc._jvm.PythonUtils.toSeq(extra))
                if ok:
                    self._released |= set(extra)
                return (f"released Spark executors {extra} ({len(ids)} -> {want} for {workers} workers): "
                        f"{'accepted' if ok else 'not taken by the cluster manager'}")
            return f"{len(ids)} Spark executors run {workers} workers ({per} tasks each): none asked for"
        except Exception as exc:  # noqa: BLE001 - the cluster manager's answer, reported in the decision
            return (f"cannot ask the cluster manager for Spark executors ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}); the worker count changed, the Spark executors did not")
