"""Stage tasks (the code that runs inside a task, on a Spark executor or another job runner's process): one stage of one job for one worker, run against that (stage, worker)'s state in its Database, safe under task retries, speculative duplicates and zombie attempts, with a task-side cache of live operator instances; and recovery's choice of a common version (see stage_plan.py for stages and blobs).

Invariants (enforced here):
  1. A stage task for worker ``w`` accepts only blobs addressed to ``w`` and raises otherwise, so a
     misrouted shuffle can never produce a wrong result silently.
  2. State: a stage with stateful operators keeps one Database per worker under
     ``<storage>/state/stage-<k>/worker-<w>.db`` (operator state grouped by shard, dbsp_core.storage.snapshot),
     each version recording the layout (epoch) and worker it belongs to; a task refuses a database written for
     another layout or worker (a zombie of a job before a layout change). A task runs
     a job of consecutive steps ``n..n+k-1`` against base version ``v`` whose step is ``n``: it opens ``v``,
     runs the steps, saves the changed state, ``set_step(n+k)`` and commits ``v+1``, once per job. Every task
     of a job commits, so all stage databases move through the same versions in lockstep. A task never creates
     its database: the driver's open made it (open_stage_databases), so a missing one is damage and the task
     raises CorruptionError naming it (an empty one made in its place would hold no state of version ``v``).
  3. Retries never corrupt state nor change output: before committing, a task durably writes the blobs it
     produced to ``worker-<w>.result`` (tagged with the job: base version and steps). An attempt that finds
     ``v+1`` already committed (an earlier attempt got that far) returns that file's blobs and leaves the
     database alone, so a speculative duplicate cannot discard a version the job has already used (plain
     "reopen v and redo" would, and if the duplicate then died, that database would hold no version the
     others share); an attempt that finds neither ``v`` as the newest version nor ``v+1`` is stale (a zombie
     of an earlier job) and raises without touching anything. Attempts of one (stage, worker) are serialized
     by a lock file (``flock``; on a shared mount it needs working POSIX locks, e.g. NFSv4).
  4. Task processes (on Spark: the Python workers of Spark executors) cache live operator instances per
     (storage, stage, worker) with the run, version and step they are at; a cache entry is used only when all
     three match the job, else state is loaded from the Database, reusing the batches a stale entry of the same
     run still holds (Spark gives a task any of a Spark executor's Python workers, so the previous job of a
     (stage, worker) often ran in another process); each commit logs the trace keys its save added and deleted
     (table ``stagelog``, the last 16 versions), so a stale entry reads only the batches saved since it,
     without scanning the state. A failed attempt in the same process rolls the cached instances back to the
     job's start (traces are levels of immutable batches, so the rollback keeps references, not copies).
     When a pipeline closes its runner releases the entries of its run in the processes it reaches
     (:func:`release`; the reference runner's is this one): no later job can use them.
  5. With ``outputs_in_result`` (a runner sets it on a stateful last stage), a task returns its blobs without
     its output shares, and the driver reads those from the result files (:func:`read_result_outputs`) once
     the job has succeeded: the files hold exactly the committed attempt's blobs (invariant 3) under the job's
     tag, so the driver gets every output share once, whichever attempt committed, without moving them
     through the engine (the job's last shuffle output and the collect).
  6. With an object store (``task.store``), invariants 2, 3 and 5 change where the state is and how attempts are
     told apart (runtime/stage_store.py): the database is in the task process's own stage cache, never on a
     shared path; before opening it the attempt brings it to the job's chain (fetching from the store what its
     cache lacks), it uploads its commit's delta before committing and names it in its acknowledgement, and it
     writes no result file: an attempt that finds ``v + 1`` in its cache discards it and runs the job again
     (the driver takes whichever attempt's acknowledgement reached it, so no attempt needs another's result),
     and the output shares always travel with the blobs. With ``worker_recovery="pipeline"`` it uploads nothing: it
     writes its commit's records to a pending file in its cache and acknowledges a local link (stage_store
     invariant 8); a cached database behind the job's chain then raises WorkerStateLostError.
  7. A memory budget (``task.memory_limit``, bytes per task process; the driver divides the pipeline's
     ``memory_limit``, which is per Spark executor, by the tasks a Spark executor runs at once, since each runs in
     a Python worker of its own): each task process keeps one :class:`~dbsp_core.trace.spill.BatchStore` (trace
     invariant 12) over every trace it holds, those of the cached instances of invariant 4 and those a task
     loads from its stage database, with its batch files in ``<base>/dbsp-task-spill/<host>-<pid>`` where ``base`` is
     the pipeline's ``spill_dir`` or else the Spark executor's own local directory (the stage cache's,
     stage_store invariant 7); files a dead process of the host left there are removed by the next store created
     beside them. A task runs under the store (``spilling``): a loaded trace is placed and the budget enforced after
     each trace the load reads (a task that loads a whole (stage, worker) holds at most one trace beyond the
     budget, not the whole state), and again after each step of the job. Budgeted tasks of one process run
     one at a time (a process lock: the store's ``enforce`` needs every trace it holds idle; Spark runs one task
     per Python worker anyway). After each step and after the commit the allocators' free memory goes back to the
     system (runtime/embedded.py ``release_memory``: the C caches, glibc's free heap, the Arrow pool's free pages),
     so that a process does not keep what one step used beside the state. The acknowledgement carries the store's counters (``"spill"``: files and
     bytes written during the task, cache hits and misses, bytes in memory and in files after it), summed by
     the driver into ``stats["task_spill"]``.
     A commit copies the rows of spilled batches into the stage database (the page store) as it copies any
     batch; it never names the batch files as an embedded checkpoint does (snapshot.py invariant 8). The files
     are scratch of one task process, in a directory local to one Spark executor: another Spark executor (the
     next job's task for this worker may run anywhere, design note 7 of spark_glue/pipeline.py), the driver
     (``traces``, ``view``, layout changes) and a store pipeline's uploaded deltas must read the state without
     them, and they vanish with their Spark executor. Referencing them would need them written where the state
     lives (the shared path or the object store) and kept while a committed version names them: the next
     issue's durable files. The copy costs only what a job changed (a save writes new batches only), and a
     spilled batch it copies is read from the file's pages, not brought back into memory first. The commit holds
     about one shard's value at a time: a batch is encoded shard by shard as it is put, and a value of 16 pages or
     more goes to the database file as it is put (csrc/pagestore.c overflow_write_through), so the transaction
     keeps only tree pages and small values in memory until its commit (the acknowledgement's ``commit_held``: its
     dirty pages once the job's state is written).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.codec import decode_json, encode_json
from dbsp_core.errors import CorruptionError, DbspError, RecoveryError
from dbsp_core.layout import Layout
from dbsp_core.profile import task_timer
from dbsp_core.runtime.embedded import BIG_STEP_ROWS, release_memory
from dbsp_core.runtime.executor import groupings
from dbsp_core.runtime.job_files import read_table_file, write_table_file
from dbsp_core.runtime.rollback import capture, restore
from dbsp_core.runtime.stage_plan import (ACK_NODE, BLOB_SCHEMA, CONTROL_NODE, StagePlan, StageWorker, StepInfo,
                                          ack_blob, encode_blobs, gather, output_node)
from dbsp_core.runtime.stage_store import (LOCAL, Recorder, StageStore, check_pending, needs_compaction, object_name,
                                          remote_of, sync_stage_db, upload_base, upload_delta, write_pending,
                                          write_side)
from dbsp_core.storage.database import Database
from dbsp_core.storage.formats import (RESULT_MAGIC, SAVELOG_MAGIC, SAVELOG_TABLE, lock_path, result_path,
                                       state_db_path)
from dbsp_core.storage.shardmove import read_worker_layout, write_worker_layout
from dbsp_core.storage.snapshot import WorkerSnapshot
from dbsp_core.trace.spill import BatchStore, spilling
from dbsp_core.zset import ZSet

__all__ = ["StageTask", "StaleAttemptError", "InjectedFault", "run_stage_task", "stage_db_path",
           "open_stage_databases", "choose_stage_version", "drop_cache", "release", "cache_stats", "job_tag",
           "read_result_outputs"]


class StaleAttemptError(DbspError):
    """A task attempt found its stage database past the job it belongs to (a zombie of an earlier job)."""


class InjectedFault(DbspError):
    """Raised by a test-only fault point of a stage task (see :class:`StageTask`)."""


def stage_db_path(storage: str, stage: int, worker: int) -> str:
    """The Database of ``worker`` in ``stage`` (invariant 2).

    >>> stage_db_path("/data/pipe", 1, 0)
    '/data/pipe/state/stage-1/worker-0.db'
    """
    return state_db_path(storage, stage, worker)


@dataclass
class StageTask:
    """Everything a task needs to run one stage of one job for any worker (picklable; sent to the task processes).

    ``storage`` is the pipeline's directory (state of stateful stages lives under it, invariant 2); ``layout``
    routes exchanged rows and names the layout the stage databases must be at; ``run`` is a random id of the
    driver's incarnation (cache entries of an earlier incarnation are never used); ``version`` is the base
    version every stage database is at when the job starts. ``fault`` is for tests
    only: ``(point, worker)`` raises :class:`InjectedFault` at ``point`` (``"before-commit"`` or
    ``"after-commit"``; for a stateless stage both mean "after computing") when running ``worker``, if the
    caller asks for it (e.g. on a task's first attempt only). ``outputs_in_result`` (a stateful stage only):
    the output shares are left in the result file for the driver, not returned (invariant 5). ``store`` (a
    pipeline whose storage is an object store, invariant 6): the state lives in this process's stage cache
    (``store.root()``, ``storage`` is ignored) and in the store, and ``chains`` names, per worker of this stage,
    the chain leading to ``version`` (runtime/stage_store.py). ``memory_limit`` (bytes, or None: no budget) bounds
    the traces of this task's process and ``spill_dir`` is the base of its batch files (None: the Spark
    executor's own local directory), invariant 7.
    """

    plan: StagePlan
    stage: int
    layout: Layout
    storage: str | None
    run: str
    version: int
    steps: list[StepInfo]
    fault: tuple[str, int] | None = None
    outputs_in_result: bool = False
    store: StageStore | None = None
    chains: dict[int, list[dict]] | None = None
    memory_limit: int | None = None
    spill_dir: str | None = None
    worker_recovery: str = "alone"  # "pipeline": commit in this process's cache only (stage_store invariant 8)


class _Entry:
    """A cached stage worker: its live instances, their snapshot tracker, and where they are."""

    def __init__(self, run: str, version: int, step: int, worker: StageWorker, snapshot: WorkerSnapshot,
                 made: str | None = None) -> None:
        self.run, self.version, self.step = run, version, step
        self.worker, self.snapshot = worker, snapshot
        self.made = made  # with a store: the id of the version it is at (stage_store invariant 3)


_CACHE: "OrderedDict[tuple[str, int, int], _Entry]" = OrderedDict()
_CACHE_MAX = 64
_CACHE_LOCK = threading.Lock()
cache_stats = {"hits": 0, "loads": 0, "partial_loads": 0, "listed_loads": 0, "listing_fallbacks": 0,
               "replayed_results": 0, "rollbacks": 0}


_STORES: dict[str, BatchStore] = {}  # spill base directory -> this process's batch store there (invariant 7)
_BUDGET_LOCK = threading.Lock()  # budgeted tasks of this process run one at a time (invariant 7)
SPILL_SUBDIR = "dbsp-task-spill"
PAGE_BYTES = 4096  # a stage database's page (csrc/pagestore.c)
# the store's counters an acknowledgement reports (invariant 7)
SPILL_COUNTERS = ("files_written", "bytes_written", "files_deleted", "evictions", "cache_hits", "cache_misses",
                  "pages_checked", "merges_on_disk")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def task_store(memory_limit: int, spill_dir: str | None) -> BatchStore:
    """This process's batch store in ``<host>-<pid>`` under ``<spill_dir or the Spark executor's local
    directory>/dbsp-task-spill`` (invariant 7), created on first use (removing the directories of this host's dead
    processes beside it), its budget set to ``memory_limit``."""
    from dbsp_core.runtime.stage_store import default_cache_base

    base = os.path.join(spill_dir if spill_dir is not None else default_cache_base(), SPILL_SUBDIR)
    with _CACHE_LOCK:
        store = _STORES.get(base)
        if store is None:
            os.makedirs(base, exist_ok=True)
            host = socket.gethostname() + "-"
            for name in os.listdir(base):  # a crashed or killed process's files on this host: nobody reads them
                pid = name[len(host):]
                if name.startswith(host) and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                    shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            mine = os.path.join(base, host + str(os.getpid()))
            store = _STORES[base] = BatchStore(memory_limit, mine)  # scratch: sweeps what an earlier pid left
            atexit.register(shutil.rmtree, mine, True)
        store.memory_limit = int(memory_limit)  # the newest job's budget (a driver may change it on reopen)
        return store


def _spill_counts(store: BatchStore) -> dict[str, int]:
    return {k: store.stats[k] for k in SPILL_COUNTERS}


def _spill_report(store: BatchStore, before: dict[str, int], db: Database) -> dict[str, int]:
    """What the acknowledgement says of the store (invariant 7): counters during the task, bytes after it, and the
    bytes the commit holds in memory (the stage database's dirty pages once the job's state is written)."""
    out = {k: v - before[k] for k, v in _spill_counts(store).items()}
    out.update(limit=store.memory_limit, memory_bytes=store.memory()[0], disk_bytes=store.disk_bytes(),
               process=f"{socket.gethostname()}:{os.getpid()}", commit_held=db.stats()["dirty_pages"] * PAGE_BYTES)
    return out


def _capture(entry: _Entry) -> tuple:
    """What :func:`_rollback` needs to put the cached state back where it is now (references, not copies)."""
    snap = entry.snapshot
    return capture(entry.worker.stateful.values()), ({t: dict(d) for t, d in snap._saved.items()}, snap._next)


def _rollback(entry: _Entry, saved: tuple) -> None:
    restore(saved[0])
    entry.snapshot._saved, entry.snapshot._next = saved[1]


def _run_steps(task: StageTask, sw: StageWorker, received: dict[tuple[int, int], ZSet],
               store: BatchStore | None = None) -> pa.Table:
    """Run the job's steps in order on ``sw``; the blobs it produces. With ``store``, its budget is enforced after
    each step (invariant 7)."""
    w, k = sw.worker, task.stage
    rows: list[tuple[int, int, int, int, ZSet]] = []
    if task.storage is not None:  # dbsp_core.profile: the timings outlive this task in this process
        sw.timer = task_timer(task.storage, k, w, sw.timer.nodes)
    for st in task.steps:
        sw.timer.step = st.step
        vals = {j: received[(j, st.step)] for j in task.plan.receive[k] if (j, st.step) in received}
        r = sw.step(vals, st)
        for x, parts in r.sends.items():
            rows.extend((p, w, x, st.step, z) for p, z in enumerate(parts))
        rows.extend((w, w, j, st.step, z) for j, z in r.carried.items())
        names = task.plan.output_names
        rows.extend((w, w, output_node(names.index(n)), st.step, z) for n, z in r.outputs.items())
        if store is not None:
            store.enforce()
            release_memory(BIG_STEP_ROWS)  # invariant 7: what the step used and the state does not hold
    return encode_blobs(rows)


def _fault(task: StageTask, worker: int, point: str) -> None:
    if task.fault is not None and task.fault == (point, worker):
        raise InjectedFault(f"injected fault {point!r} in stage {task.stage} worker {worker}")


def _result_path(storage: str, stage: int, worker: int) -> str:
    return result_path(stage_db_path(storage, stage, worker))


def _write_result(path: str, tag: dict, table: pa.Table) -> None:
    write_table_file(path, RESULT_MAGIC, tag, table, sync=True)


def _read_result(path: str, tag: dict) -> pa.Table:
    try:
        got, table = read_table_file(path, RESULT_MAGIC, path)
    except FileNotFoundError:
        raise RecoveryError(f"{path}: missing, but the database holds the committed version of this job") from None
    # the same job (base version, steps and push counts) of any driver incarnation: its input division is logged,
    # so its result is the same (a zombie of a dead driver may have committed it); a job run again after one of
    # its pushes was discarded has fewer pushes, so a zombie of the failed attempt is never taken for it (a tag
    # of an older release has no push counts)
    mine, want = {k: v for k, v in got.items() if k != "run"}, {k: v for k, v in tag.items() if k != "run"}
    if "pushes" not in mine:
        want.pop("pushes", None)
    if mine != want:
        raise RecoveryError(f"{path}: holds the result of job {got}, expected {tag}")
    return table


def _is_output(blobs: pa.Table) -> Any:
    """A mask of the output shares among ``blobs`` (node < 0, neither an acknowledgement nor a control blob)."""
    nodes = blobs.column("node").to_numpy()
    return (nodes < 0) & (nodes != ACK_NODE) & (nodes != CONTROL_NODE)


def _returned(task: StageTask, produced: pa.Table) -> pa.Table:
    """What a stateful task returns of the blobs it produced: all of them, or without the output shares when
    the driver reads those from the result file (``task.outputs_in_result``, invariant 5)."""
    if not task.outputs_in_result:
        return produced
    return produced.filter(pa.array(~_is_output(produced)))


def job_tag(task: StageTask) -> dict:
    """The tag of the job ``task`` belongs to: driver incarnation, base version, steps and their push counts."""
    return {"run": task.run, "version": task.version, "first": task.steps[0].step, "end": task.steps[-1].step + 1,
            "pushes": [s.pushes for s in task.steps]}


def read_result_outputs(task: StageTask, workers: int) -> pa.Table:
    """The output shares that every worker's task of ``task.stage`` left in its result file (invariant 5);
    RecoveryError if a file is missing or holds another job's result. Call it after the job succeeded."""
    assert task.storage is not None
    tag = job_tag(task)
    outs = []
    for w in range(workers):
        t = _read_result(_result_path(task.storage, task.stage, w), tag)
        outs.append(t.filter(pa.array(_is_output(t))))
    return pa.concat_tables(outs) if outs else BLOB_SCHEMA.empty_table()


_SAVELOG = SAVELOG_TABLE
_SAVELOG_KEEP = 16  # versions of save records kept: a cache entry at most this stale catches up without a scan


def _log_saves(h: Any, version: int, saves: list[tuple]) -> None:
    """Record which trace keys the save of ``version`` added and deleted (and drop records too old to use)."""
    added: dict[str, list[str]] = {}
    deleted: dict[str, list[str]] = {}
    for op in saves:
        if op[0] == "batch":
            added.setdefault(op[1], []).extend(k.hex() for k in op[5])
        elif op[0] == "delete":
            deleted.setdefault(op[1], []).extend(k.hex() for k in op[2])
    h.put(_SAVELOG, version.to_bytes(8, "big"), encode_json(SAVELOG_MAGIC, {"added": added, "deleted": deleted}))
    if version > _SAVELOG_KEEP:
        for k in [k for k, _ in h.scan(_SAVELOG, end=(version - _SAVELOG_KEEP).to_bytes(8, "big"))]:
            h.delete(_SAVELOG, k)


def _listing(h: Any, entry: _Entry, version: int, where: str) -> dict[str, list[bytes]] | None:
    """Every trace key of ``version``: the stale entry's saved keys plus the logged saves since; None if a
    record is gone (the entry is too stale)."""
    keys = {t: {k for _, ks in saved.values() for k in ks} for t, saved in entry.snapshot._saved.items()}
    for ver in range(entry.version + 1, version + 1):
        rec = h.get(_SAVELOG, ver.to_bytes(8, "big"))
        if rec is None:
            return None
        d = decode_json(SAVELOG_MAGIC, rec, f"{where} save log of version {ver}")
        for t, ks in d["deleted"].items():
            keys.setdefault(t, set()).difference_update(bytes.fromhex(x) for x in ks)
        for t, ks in d["added"].items():
            keys.setdefault(t, set()).update(bytes.fromhex(x) for x in ks)
    return {t: sorted(ks) for t, ks in keys.items()}


def run_stage_task(task: StageTask, worker: int, blobs: pa.Table) -> pa.Table:
    """Run stage ``task.stage`` of one job for ``worker`` over the blobs addressed to it; returns the blobs it emits.

    The result holds the blobs produced for later stages (exchange parts, carried values), this worker's output
    shares, the received blobs a later stage still needs (forwarded), and for a stateful stage one commit
    acknowledgement (:func:`read_acks`). Invariants 2-5.
    """
    plan, k = task.plan, task.stage
    if blobs.schema != BLOB_SCHEMA:
        blobs = blobs.select(BLOB_SCHEMA.names).cast(BLOB_SCHEMA)
    parts = blobs.column("part").to_numpy()
    if len(parts) and not bool((parts == worker).all()):
        bad = sorted(set(parts.tolist()) - {worker})
        raise DbspError(f"stage {k} worker {worker}: received blobs addressed to workers {bad} (misrouted shuffle)")
    nodes = blobs.column("node").to_numpy()
    uniq = [int(n) for n in np.unique(nodes)]
    fwd_nodes = [n for n in uniq if plan.forwards(n, k)]
    use_nodes = [n for n in uniq if n >= 0 and n in plan.receive[k]]
    forward = blobs.filter(pa.array(np.isin(nodes, np.array(fwd_nodes, dtype=np.int64))))
    received = gather(plan, blobs.filter(pa.array(np.isin(nodes, np.array(use_nodes, dtype=np.int64)))),
                      f"stage {k} worker {worker}")
    sm = task.layout.shard_map
    where = f"stage {k} worker {worker}"
    if task.outputs_in_result and not plan.stateful[k]:
        raise DbspError(f"{where}: outputs_in_result needs a stateful stage (a stateless one writes no result)")
    if not plan.stateful[k]:
        out = _run_steps(task, StageWorker(plan.circuit, plan, k, worker, sm), received)
        _fault(task, worker, "before-commit")
        _fault(task, worker, "after-commit")
        return pa.concat_tables([out, forward])
    if task.storage is None and task.store is None:
        raise DbspError(f"{where}: a stateful stage needs a storage directory")
    if task.memory_limit is None:
        produced = _run_stateful(task, worker, sm, received, None)
    else:  # invariant 7: under this process's batch store, one budgeted task at a time
        with _BUDGET_LOCK:
            store = task_store(task.memory_limit, task.spill_dir)
            with spilling(store):
                produced = _run_stateful(task, worker, sm, received, store)
            release_memory(BIG_STEP_ROWS)  # the commit's encoded values are freed: the next task starts lean
    return pa.concat_tables([produced, forward])


def _check_layout(h: Any, task: StageTask, worker: int, where: str) -> None:
    """Invariant 2: the database holds the state of this worker under the task's layout (or none yet)."""
    rec = read_worker_layout(h, where)
    lay = task.layout
    if rec is not None and (rec["epoch"], rec["worker"], rec["shard_bits"]) != (lay.epoch, worker, lay.shard_bits):
        raise StaleAttemptError(f"{where}: holds the state of worker {rec['worker']} of layout epoch {rec['epoch']}, "
                                f"this attempt is for worker {worker} of epoch {lay.epoch} (a stale attempt)")


def _placed(store: BatchStore) -> Any:
    """What a load calls after each trace it restored (invariant 7): the trace's batches placed, so that the
    budget may spill them, and the budget enforced before the next trace is read."""

    def after(trace: Any) -> None:
        trace.settle()
        store.enforce()

    return after


def _run_stateful(task: StageTask, worker: int, sm: Any, received: dict[tuple[int, int], ZSet],
                  store: BatchStore | None) -> pa.Table:
    plan, k, v = task.plan, task.stage, task.version
    before = _spill_counts(store) if store is not None else None
    remote = None
    if task.store is not None:  # invariant 6: this process's stage cache of a store pipeline
        root = task.store.root()
        remote = remote_of(task.store)
        if task.chains is None or worker not in task.chains:
            raise DbspError(f"stage {k} worker {worker}: the job names no chain of this worker's state")
    else:
        assert task.storage is not None
        root = task.storage
    path = stage_db_path(root, k, worker)
    first, end = task.steps[0].step, task.steps[-1].step + 1
    tag = job_tag(task)
    where = f"{path}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lockfd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lockfd, fcntl.LOCK_EX)  # invariant 3: one attempt of this (stage, worker) at a time
        extra: dict[str, Any] = {}
        ids: dict[int, str] = {}
        chain: list[dict] = []
        page_bytes = 0
        if remote is not None:  # stage_store invariant 3: the chain's version v here
            assert task.chains is not None
            chain = task.chains[worker]
            t_sync = time.perf_counter()
            how, got, ids = sync_stage_db(remote, path, chain, v, where)
            if task.worker_recovery == "pipeline":
                check_pending(path, chain, where)  # stage_store invariant 8
            extra = {"fetch": how, "fetched_bytes": got, "cache_root": root,
                     "fetch_s": time.perf_counter() - t_sync}
            page_bytes = os.path.getsize(path)  # the page file before the job (stage_store invariant 4)
        if not os.path.exists(path):  # invariant 2: never made empty in place of the state of version v
            raise CorruptionError(f"{where}: missing; the job's base version {v} (step {first}) of stage {k} worker "
                                  f"{worker} was in it")
        db = Database(path)
        try:
            vs = db.versions()
            if remote is None and vs == range(v, v + 2):  # an earlier attempt committed this job: its result
                cache_stats["replayed_results"] += 1
                return _returned(task, _read_result(_result_path(root, k, worker), tag))
            if vs.stop - 1 != v:
                raise StaleAttemptError(f"{where}: holds versions {vs.start}..{vs.stop - 1}, this attempt is for "
                                        f"base version {v} (a stale attempt of an earlier job)")
            h = db.open(v)
            try:
                if h.get_step() != first:
                    raise RecoveryError(f"{where}: version {v} is at step {h.get_step()}, the job starts at {first}")
                _check_layout(h, task, worker, f"{where} v{v}")
                key = (root, k, worker)
                made = ids.get(v)
                with _CACHE_LOCK:
                    entry = _CACHE.pop(key, None)
                if entry is None or (entry.run, entry.version, entry.step, entry.made) != (task.run, v, first, made):
                    # a stale entry of this run (another process ran the jobs since) still holds most batches,
                    # and the save log says which keys those jobs added and deleted (with a store: only an entry
                    # at a version of the chain, stage_store invariant 3)
                    fresh = (entry is not None and entry.run == task.run and entry.version < v
                             and (remote is None or ids.get(entry.version) == entry.made))
                    stale = entry.snapshot if fresh else None
                    listing = _listing(h, entry, v, where) if fresh else None
                    t_load = time.perf_counter()
                    sw = StageWorker(plan.circuit, plan, k, worker, sm)
                    snap = WorkerSnapshot(sw.stateful, task.layout.shard_bits, groupings=groupings(plan.circuit))
                    snap.after_trace = _placed(store) if store is not None else None
                    try:
                        snap.load(h, f"{where} v{v}", reuse=stale, listing=listing)
                    except CorruptionError:
                        if listing is None:
                            raise
                        listing = None  # a listed key is gone (a save the log missed): read the tables instead
                        cache_stats["listing_fallbacks"] += 1
                        sw = StageWorker(plan.circuit, plan, k, worker, sm)
                        snap = WorkerSnapshot(sw.stateful, task.layout.shard_bits, groupings=groupings(plan.circuit))
                        snap.after_trace = _placed(store) if store is not None else None
                        snap.load(h, f"{where} v{v}", reuse=stale)
                    entry = _Entry(task.run, v, first, sw, snap, made)
                    loaded = "partial" if stale is not None else "full"
                    extra["load_s"] = time.perf_counter() - t_load
                    cache_stats["loads" if stale is None else "partial_loads"] += 1
                    cache_stats["listed_loads"] += listing is not None
                else:
                    loaded = "cache"
                    cache_stats["hits"] += 1
                saved = _capture(entry)
                try:
                    out = _run_steps(task, entry.worker, received, store)
                    saves = entry.snapshot.prepare()
                    w = Recorder(h) if remote is not None else h  # stage_store invariant 1: what the commit writes
                    WorkerSnapshot.apply(w, saves)
                    _log_saves(w, v + 1, saves)
                    write_worker_layout(w, task.layout, worker)
                    w.set_step(end)
                    compact, vid = False, None
                    if remote is not None:  # stage_store invariants 1 and 4: the delta before the commit, or the
                        vid = object_name(k, worker, v + 1)  # page file after it, named by the acknowledgement
                        body = w.body()
                        extra["delta_bytes"] = len(body)
                        if task.worker_recovery == "pipeline":  # stage_store invariant 8: nothing uploaded
                            extra["local"] = {"kind": LOCAL, "from": v, "to": v + 1, "made": vid, "bytes": len(body)}
                            write_pending(path, extra["local"], body)
                        else:
                            compact = needs_compaction(chain, len(body), page_bytes)
                        if not compact and "local" not in extra:
                            extra["delta"], n = upload_delta(remote, v + 1, body, chain, vid)
                            extra["replaces"] = [link["object"] for link in chain[len(chain) - n:]]
                        write_side(path, {v: ids[v], v + 1: vid})
                    if store is not None:
                        extra["spill"] = _spill_report(store, before, db)
                    if remote is None:
                        out = pa.concat_tables([out, ack_blob(k, worker, v + 1, end, first, loaded, extra)])
                        _write_result(_result_path(root, k, worker), tag, out)
                    _fault(task, worker, "before-commit")
                    h.commit()
                    if remote is not None:
                        if compact:
                            extra["base"] = upload_base(remote, path, k, worker, v + 1, vid, at=v + 1)
                        out = pa.concat_tables([out, ack_blob(k, worker, v + 1, end, first, loaded, extra)])
                except BaseException:
                    _rollback(entry, saved)
                    cache_stats["rollbacks"] += 1
                    with _CACHE_LOCK:
                        _CACHE[key] = entry
                    raise
                entry.version, entry.step = v + 1, end
                entry.made = vid if remote is not None else None
                with _CACHE_LOCK:
                    _CACHE[key] = entry
                    while len(_CACHE) > _CACHE_MAX:
                        _CACHE.popitem(last=False)
            finally:
                if not h.closed:
                    h.close()
            _fault(task, worker, "after-commit")
            return _returned(task, out)
        finally:
            db.close()
    finally:
        os.close(lockfd)  # releases the lock


def open_stage_databases(storage: str, plan: StagePlan, workers: int) -> list[tuple[int, int, str]]:
    """Create (if missing) the Database of every stateful (stage, worker); returns ``[(stage, worker, path)]``.
    The driver's open has checked that none is missing unless the state is at step 0 (storage/statefiles.py
    invariant 2), so a database made here never stands in for one that held state.

    Takes each database's lock file, as a task attempt does (invariant 3), so a task still running (a zombie)
    is waited for rather than met by the database's own lock (InUseError)."""
    out = []
    for k in range(plan.num_stages):
        if not plan.stateful[k]:
            continue
        for w in range(workers):
            path = stage_db_path(storage, k, w)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                Database(path).close()
            finally:
                os.close(fd)
            out.append((k, w, path))
    return out


def choose_stage_version(paths: list[str], at_most: int | None = None) -> tuple[int, int]:
    """The coordinator's recovery over stage databases: open every one at ``max(intersection of versions())``.

    With ``at_most``, the newest common version not above it (the driver passes the base version of a job
    whose output it did not log). Opening discards any other version (e.g. a job that did not complete
    everywhere); returns ``(version, step)``. Takes each database's lock, so no task may run meanwhile.
    RecoveryError if no common version qualifies or the databases disagree on the step.
    """
    if not paths:
        return 0, 0
    locks = []
    try:
        dbs = []
        for p in paths:
            fd = os.open(lock_path(p), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            locks.append(fd)
            dbs.append(Database(p))
        try:
            ranges = [db.versions() for db in dbs]
            lo, hi = max(r.start for r in ranges), min(r.stop for r in ranges)
            if lo >= hi:
                raise RecoveryError(f"the stage databases share no version: "
                                    f"{[(p, r.start, r.stop - 1) for p, r in zip(paths, ranges)]} (one was lost, "
                                    f"replaced or copied from another time); restore the directory from a backup "
                                    f"(`dbsp repair DIR` lists the damage)")
            v = hi - 1 if at_most is None else min(hi - 1, at_most)
            if v < lo:
                raise RecoveryError(f"the stage databases share versions {lo}..{hi - 1}, none at or below {at_most}")
            steps = set()
            for db in dbs:
                h = db.open(v)  # discards the other version
                steps.add(h.get_step())
                h.close()  # keeps v only
            if len(steps) != 1:
                raise RecoveryError(f"the stage databases disagree on the step of version {v}: {sorted(steps)}")
            return v, steps.pop()
        finally:
            for db in dbs:
                db.close()
    finally:
        for fd in locks:
            os.close(fd)


def drop_cache() -> None:
    """Forget every cached stage worker of this process (tests; state is then loaded from the databases)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def release(pipeline: str) -> int:
    """Forget this process's cached stage workers of a pipeline that closed (invariant 4: no later job can use
    them, its next incarnation has another run), so that their instances, traces and key indexes are freed now
    rather than when 64 newer entries push them out. ``pipeline`` is the storage directory its tasks ran on, or,
    with an object store, its ``StageStore.key`` (whatever stage cache base the tasks had). Returns how many."""
    def of(root: str) -> bool:
        return root == pipeline or (os.path.basename(root) == pipeline
                                    and os.path.basename(os.path.dirname(root)) == "dbsp-stage-cache")

    with _CACHE_LOCK:
        gone = [key for key in _CACHE if of(key[0])]
        for key in gone:
            del _CACHE[key]
    return len(gone)
