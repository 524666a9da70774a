"""Task placement by cache for a SparkPipeline whose state is in an object store: each stage of a job runs as a Spark job of W tasks whose task w prefers the Spark executor that holds worker w's stage state, the blobs between stages passing through the store (issue 33).

Design notes (each is a requirement this module keeps):
  1. Why a Spark job per stage: a reduce task of Spark's shuffle prefers only the hosts that hold most of its map
     output (the MapOutputTracker), never one Spark executor of a host, and the map output dies with its Spark
     executor (a ``FetchFailed`` then re-runs the earlier stage's lost tasks on the cores left). A partition of an
     RDD made by ``SparkContext.makeRDD`` with an ``executor_<host>_<id>`` location prefers that Spark executor
     (PROCESS_LOCAL; after ``spark.locality.wait`` Spark relaxes to the host, then any). So each stage is one
     Spark job over such an RDD of W one-worker partitions (:func:`placed_rdd`, through the JVM gateway: pyspark
     has no binding for location preferences), and its tasks run :func:`run_placed_task`.
  2. The exchange goes through the store (``stage_store.write_exchange`` / ``read_exchange``): a task of stage k
     writes one object of the blobs it sends into stage k + 1 (W PUTs a stage, not W^2), a part per receiving
     worker, each tagged with the job, the stage, the receiver and the sender, and returns where each part is;
     the driver hands those ranges to stage k + 1's tasks, each of which reads its part of every sender's object
     (one ranged GET each) and refuses any part of another job, stage, receiver or sender. Stage 0 reads the job inputs the driver wrote,
     the last stage returns its blobs (acknowledgements, control blobs, output shares) through ``collect``. A lost
     Spark executor costs only its running task's attempt: nothing of an earlier stage was on it.
  3. Every task reports the Spark executor it ran on (:func:`executor_here`: the executor process's command line,
     ``--executor-id`` and ``--hostname``, which every coarse-grained backend is started with, or
     ``SPARK_EXECUTOR_ID``); ``collect`` returns the attempt Spark took, whose acknowledgement the driver checks,
     so :class:`Placement` knows where each (stage, worker)'s committed state is cached.
  4. Policy (:meth:`Placement.assign`): a stateful (stage, worker) stays on the Spark executor that ran it last if
     that one is alive and warm and holds no more than its share (ceil(W / warm Spark executors)) of the stage's
     workers; the others go to the warm Spark executors with the fewest, lowest id first. A stateless stage's
     task w goes where worker w's first stateful stage goes. With no warm Spark executor (the first job) no task
     has a preference. Moving a worker costs its chain's fetch from the store on its next task (a cache miss),
     never a wrong result: the stage tasks check the chain whatever the placement (stage_task invariant 6).
  5. A Spark executor none of whose tasks ran here yet (a replacement after a loss, or one asked for by an
     autoscaler) gets a warm-up task (imports, store client) in a Spark job of its own, started in the background
     and preferring it; only once that task reported from it does the policy give it workers. So its cold start
     (JVM, Python worker, imports: seconds) is off the steps' critical path, and the workers it takes then cost
     one chain fetch each.
  6. One Spark job per preferred Spark executor: a stage's tasks are split by the Spark executor they prefer, and
     each group runs as a Spark job of its own over the same RDD (``SparkContext.runJob`` on that group's
     partitions; :func:`run_by_executor`), all at once, the results gathered. Why: Spark's delay scheduling (a
     TaskSetManager's ``getAllowedLocalityLevel``) stays at PROCESS_LOCAL while any pending task of the task set
     prefers any Spark executor, a lost one included, and a task attempt lost with its Spark executor is retried
     with the same preference; in one task set of every worker, the retry of a lost worker's task (and its
     workers' tasks not started yet) then waits out ``spark.locality.wait`` while the survivors sit idle (2.6-3.1
     s a loss on local-cluster, bench/RESULTS.md issue 33). In a task set of its own, every task prefers the lost
     Spark executor only, so when it is lost (``executorLost`` recomputes the valid levels) PROCESS_LOCAL is no
     longer a valid level and the tasks go to the cores left at once. Without a loss the scheduling is the same
     (each group's tasks wait ``spark.locality.wait`` for their Spark executor before another takes them); the
     cost is a Spark job per warm Spark executor per stage instead of one (measured in bench/RESULTS.md).
  7. ``worker_recovery="pipeline"`` (spark_glue/pipeline.py design note 9): a worker whose state since the last
     durable point is only in its Spark executor's cache (local links) is pinned there: :meth:`Placement.assign`
     never moves it for balance (moving it would lose that state), only once it is durable again. A task that finds
     its worker's state missing or behind returns ``{"lost": why}`` instead of raising (Spark would retry it up to
     ``spark.task.maxFailures`` times, each attempt as lost), and the driver raises WorkerStateLostError for it;
     a pinned worker whose Spark executor is gone is known lost before its job starts.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from typing import Any, Callable

import pyarrow as pa

__all__ = ["Placement", "cmdline_of", "executor_here", "placed_rdd", "run_by_executor", "run_placed_task",
           "stage_task_of", "job_of", "warm_up"]

_HERE: list[tuple[str, str] | None] = []  # this process's Spark executor, found once


def cmdline_of(pid: int) -> list[str]:
    """The command line of process ``pid`` (empty if it is gone or not readable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def executor_here() -> tuple[str, str] | None:
    """``(host, executor id)`` of the Spark executor whose Python worker this process is (design note 3), or None
    when it cannot tell (local mode: the driver's JVM runs the tasks; a system without ``/proc``)."""
    if _HERE:
        return _HERE[0]
    found = None
    pid = os.getpid()
    for _ in range(4):  # Python worker -> pyspark daemon -> executor JVM
        cmd = cmdline_of(pid)
        if "--executor-id" in cmd:
            i = cmd.index("--executor-id")
            host = cmd[cmd.index("--hostname") + 1] if "--hostname" in cmd else socket.gethostname()
            found = (host, cmd[i + 1])
            break
        pid = _parent(pid)
        if pid <= 1:
            break
    if found is None and os.environ.get("SPARK_EXECUTOR_ID"):
        found = (socket.gethostname(), os.environ["SPARK_EXECUTOR_ID"])
    _HERE.append(found)
    return found


def placed_rdd(sc: Any, prefs: list[str | None]) -> Any:
    """A pyspark RDD of ``len(prefs)`` partitions, partition ``w`` holding the one string ``str(w)`` and preferring the
    Spark executor ``prefs[w]`` (``"executor_<host>_<id>"``, or None: no preference); design note 1."""
    from pyspark.rdd import RDD
    from pyspark.serializers import UTF8Deserializer

    jvm = sc._jvm
    seq = jvm.PythonUtils.toSeq
    items = [jvm.scala.Tuple2(str(w), seq([p] if p else [])) for w, p in enumerate(prefs)]
    tag = jvm.scala.reflect.ClassTag.apply(jvm.java.lang.Class.forName("java.lang.String"))
    jrdd = sc._jsc.sc().makeRDD(seq(items), tag)
    return RDD(jrdd.toJavaRDD(), sc, UTF8Deserializer())


def run_by_executor(sc: Any, rdd: Any, prefs: list[str | None]) -> list[Any]:
    """What ``rdd.collect()`` returns, run as one Spark job per distinct preference in ``prefs`` (partition ``w``
    preferring ``prefs[w]``, as ``rdd``'s partitions do; design note 6), the jobs at once, each in a thread that
    keeps the caller's Spark local properties (job group, pool). Every job is waited for before an error of one is
    raised, so no task of this call runs after it returns."""
    from pyspark import InheritableThread
    from pyspark.util import _load_from_socket

    groups: dict[str | None, list[int]] = {}
    for w, p in enumerate(prefs):
        groups.setdefault(p, []).append(w)
    if len(groups) <= 1:
        return rdd.collect()
    parts = list(groups.values())
    got: list[list[Any] | None] = [None] * len(parts)
    errors: list[BaseException] = []
    jrdd = rdd._jrdd  # one JVM RDD (the task function pickled once) for every group's job

    def run(i: int) -> None:
        try:
            sock = sc._jvm.PythonRDD.runJob(sc._jsc.sc(), jrdd, parts[i])
            with _load_from_socket(sock, rdd._jrdd_deserializer) as stream:
                got[i] = list(stream)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread once every job ended
            errors.append(exc)

    threads = [InheritableThread(target=run, args=(i,), name="dbsp-spark-stage-job") for i in range(1, len(parts))]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for g in got for r in (g or [])]


def job_of(blobs: pa.Table, where: str) -> dict:
    """The job description in the control blob among ``blobs`` (pipeline.py design note 6)."""
    import json

    import pyarrow.compute as pc

    from dbsp_core.errors import DbspError
    from dbsp_core.runtime.stage_plan import CONTROL_NODE

    ctl = blobs.filter(pc.equal(blobs.column("node"), CONTROL_NODE)).column("payload")
    if len(ctl) != 1:
        raise DbspError(f"{where}: {len(ctl)} control blobs, expected one (it carries the job)")
    return json.loads(ctl[0].as_py())


def stage_task_of(plan: Any, stage: int, storage: str | None, outputs_in_result: bool, store: Any, job: dict,
                  worker: int, attempt: int) -> Any:
    """The StageTask of ``stage`` for ``worker`` in the job ``job`` describes (pipeline.py design note 6), with the
    job's test fault if it names this task and attempt."""
    import dataclasses

    from dbsp_core.layout import Layout
    from dbsp_core.runtime.stage_plan import StepInfo
    from dbsp_core.runtime.stage_task import StageTask

    where = f"stage {stage} worker {worker}"
    chains = None
    if store is not None and str(stage) in job.get("chains", {}):
        chains = {int(w): c for w, c in job["chains"][str(stage)].items()}
    task = StageTask(plan, stage, Layout.from_dict(job["layout"], where),
                     storage if store is None else store.root(), job["run"], job["version"],
                     [StepInfo(*s) for s in job["steps"]], outputs_in_result=outputs_in_result, store=store,
                     chains=chains, memory_limit=job["memory"][0], spill_dir=job["memory"][1],
                     worker_recovery=job.get("recovery", "alone"))
    f = job["fault"]
    if f is not None and f[0] == stage and f[2] == worker and attempt < f[3]:
        task = dataclasses.replace(task, fault=(f[1], worker))  # tests: fail the first attempt(s)
    return task


def run_placed_task(plan: Any, stage: int, store: Any, workers: int, job: dict,
                    sent: list[dict] | None = None) -> Callable[[int, Any], Any]:
    """The function of one stage's Spark job (design note 2): task ``index`` is worker ``index``; it reads the blobs
    sent to it (stage 0: its job input; else its part of each sender's object, ``sent[src]`` as the sender's
    committed attempt returned it), runs the stage task and writes what it sends into the next stage to the store,
    or, in the last stage, returns its blobs; either way with the Spark executor it ran on."""
    last = stage == plan.num_stages - 1

    def run(index: int, items: Any) -> Any:
        for _ in items:  # read to its end, else the Python worker is not reused (a fresh one imports all again)
            pass
        from pyspark import TaskContext

        from dbsp_core.errors import DbspError, WorkerStateLostError
        from dbsp_core.runtime import stage_store
        from dbsp_core.runtime.stage_task import run_stage_task

        remote = stage_store.remote_of(store)
        worker = index
        where = f"stage {stage} worker {worker}"
        attempt = TaskContext.get().attemptNumber()
        if stage == 0:
            head, table = stage_store.read_job_input(remote, worker)
            if head != job:
                raise DbspError(f"{where}: the input object of job {head} is read by the job {job}")
        else:
            if sent is None or len(sent) != workers:
                raise DbspError(f"{where}: the job names what {0 if sent is None else len(sent)} of {workers} workers "
                                "sent into this stage")
            table = stage_store.read_exchange(remote, job, stage, worker, sent)
        task = stage_task_of(plan, stage, None, False, store, job, worker, attempt)
        try:
            out = run_stage_task(task, worker, table)
        except WorkerStateLostError as exc:  # design note 7: reported, not raised (Spark would retry it in vain)
            yield worker, executor_here(), {"lost": str(exc)}
            return
        here = executor_here()
        if last:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, out.schema) as wr:
                wr.write_table(out)
            yield worker, here, sink.getvalue().to_pybytes()
        else:
            yield worker, here, stage_store.write_exchange(remote, job, stage + 1, worker, out, workers, attempt)

    return run


def warm_up(store: Any) -> Callable[[int, Any], Any]:
    """A warm-up task's function (design note 5): import the stage tasks' code, make the store client."""

    def run(_index: int, items: Any) -> Any:
        for _ in items:  # read to its end: the warmed Python worker is then reused
            pass
        from dbsp_core.runtime import stage_store, stage_task  # noqa: F401 - the import is the warm-up

        stage_store.remote_of(store)
        yield executor_here()

    return run


class Placement:
    """The driver's record of where each stateful (stage, worker)'s state is cached and which Spark executors are
    warm, and the policy choosing each task's preferred Spark executor (design notes 3-5).

    ``stats``: ``asked`` (tasks given a preference), ``ran_as_asked`` (of those, run on it), ``moved`` (stateful
    tasks that ran on another Spark executor than their worker's previous one), ``warmups`` (warm-up tasks run)."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, int], str] = {}  # (stage, worker) -> the Spark executor of its committed state
        self.hosts: dict[str, str] = {}  # Spark executor id -> host, as its tasks reported
        self.warm: set[str] = set()
        self.warming: set[str] = set()
        self.lock = threading.Lock()
        self.stats = {"asked": 0, "ran_as_asked": 0, "moved": 0, "warmups": 0}
        self.asked: dict[tuple[int, int], str | None] = {}  # the last job's preferences
        self.ran: dict[tuple[int, int], str | None] = {}  # ... and where each task ran

    def assign(self, stateful: list[bool], workers: int, alive: list[str],
               pinned: set[tuple[int, int]] = frozenset()) -> dict[int, list[str | None]]:  # type: ignore[assignment]
        """Per stage, each worker's preferred Spark executor id (None: no preference), design note 4; a ``pinned``
        (stage, worker) stays on its live Spark executor whatever its share (design note 7)."""
        with self.lock:
            warm = sorted((e for e in alive if e in self.warm), key=lambda x: (len(x), x))
            out: dict[int, list[str | None]] = {}
            if not warm:
                return {k: [None] * workers for k in range(len(stateful))}
            cap = math.ceil(workers / len(warm))
            first: list[str | None] = [None] * workers
            for k, st in enumerate(stateful):
                if not st:
                    continue
                count = dict.fromkeys(warm, 0)
                pick: list[str | None] = [None] * workers
                for w in range(workers):
                    e = self.last.get((k, w))
                    if e in count and (k, w) in pinned:
                        pick[w] = e
                        count[e] += 1
                for w in range(workers):
                    e = self.last.get((k, w))
                    if pick[w] is None and e in count and count[e] < cap:
                        pick[w] = e
                        count[e] += 1
                for w in range(workers):
                    if pick[w] is None:
                        e = min(warm, key=lambda x: count[x])
                        pick[w] = e
                        count[e] += 1
                out[k] = pick
                for w in range(workers):
                    first[w] = first[w] or pick[w]
            if not any(first):  # no stateful stage: spread the workers over the warm Spark executors
                first = [warm[w % len(warm)] for w in range(workers)]
            for k, st in enumerate(stateful):
                if not st:
                    out[k] = list(first)
            return out

    def location(self, executor: str | None) -> str | None:
        """The ``executor_<host>_<id>`` location string of a Spark executor (None if its host is not known)."""
        if executor is None or executor not in self.hosts:
            return None
        return f"executor_{self.hosts[executor]}_{executor}"

    def ran_on(self, stage: int, worker: int, here: tuple[str, str] | None, stateful: bool) -> None:
        """Record where ``(stage, worker)``'s committed attempt ran (design note 3)."""
        with self.lock:
            asked = self.asked.get((stage, worker))
            eid = None
            if here is not None:
                host, eid = here
                self.hosts[eid] = host
                self.warm.add(eid)
                self.warming.discard(eid)
            self.ran[(stage, worker)] = eid
            if asked is not None:
                self.stats["asked"] += 1
                self.stats["ran_as_asked"] += asked == eid
            if stateful and eid is not None:
                self.stats["moved"] += self.last.get((stage, worker), eid) != eid
                self.last[(stage, worker)] = eid
