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
     of a job commits, so all stage databases move through the same versions in lockstep.
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
     and the output shares always travel with the blobs.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.codec import decode_json, encode_json
from dbsp_core.errors import CorruptionError, DbspError, RecoveryError
from dbsp_core.layout import Layout
from dbsp_core.profile import task_timer
from dbsp_core.runtime.executor import groupings
from dbsp_core.runtime.job_files import read_table_file, write_table_file
from dbsp_core.runtime.rollback import capture, restore
from dbsp_core.runtime.stage_plan import (ACK_NODE, BLOB_SCHEMA, CONTROL_NODE, StagePlan, StageWorker, StepInfo,
                                          ack_blob, encode_blobs, gather, output_node)
from dbsp_core.runtime.stage_store import (Recorder, StageStore, needs_compaction, remote_of, sync_stage_db,
                                          upload_base, upload_delta, write_side)
from dbsp_core.storage.database import Database
from dbsp_core.storage.formats import (RESULT_MAGIC, SAVELOG_MAGIC, SAVELOG_TABLE, lock_path, result_path,
                                       state_db_path)
from dbsp_core.storage.shardmove import read_worker_layout, write_worker_layout
from dbsp_core.storage.snapshot import WorkerSnapshot
from dbsp_core.zset import ZSet

__all__ = ["StageTask", "StaleAttemptError", "InjectedFault", "run_stage_task", "stage_db_path",
           "open_stage_databases", "choose_stage_version", "drop_cache", "cache_stats", "job_tag", "read_result_outputs"]


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
    the chain leading to ``version`` (runtime/stage_store.py).
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


def _capture(entry: _Entry) -> tuple:
    """What :func:`_rollback` needs to put the cached state back where it is now (references, not copies)."""
    snap = entry.snapshot
    return capture(entry.worker.stateful.values()), ({t: dict(d) for t, d in snap._saved.items()}, snap._next)


def _rollback(entry: _Entry, saved: tuple) -> None:
    restore(saved[0])
    entry.snapshot._saved, entry.snapshot._next = saved[1]


def _run_steps(task: StageTask, sw: StageWorker, received: dict[tuple[int, int], ZSet]) -> pa.Table:
    """Run the job's steps in order on ``sw``; the blobs it produces."""
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
    produced = _run_stateful(task, worker, sm, received)
    return pa.concat_tables([produced, forward])


def _check_layout(h: Any, task: StageTask, worker: int, where: str) -> None:
    """Invariant 2: the database holds the state of this worker under the task's layout (or none yet)."""
    rec = read_worker_layout(h, where)
    lay = task.layout
    if rec is not None and (rec["epoch"], rec["worker"], rec["shard_bits"]) != (lay.epoch, worker, lay.shard_bits):
        raise StaleAttemptError(f"{where}: holds the state of worker {rec['worker']} of layout epoch {rec['epoch']}, "
                                f"this attempt is for worker {worker} of epoch {lay.epoch} (a stale attempt)")


def _run_stateful(task: StageTask, worker: int, sm: Any, received: dict[tuple[int, int], ZSet]) -> pa.Table:
    plan, k, v = task.plan, task.stage, task.version
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
        if remote is not None:  # stage_store invariants 3-4: the chain's version v here, then maybe a base
            assert task.chains is not None
            chain = task.chains[worker]
            how, got, ids = sync_stage_db(remote, path, chain, v, where)
            extra = {"fetch": how, "fetched_bytes": got, "cache_root": root}
            if needs_compaction(chain, path):
                extra["base"] = upload_base(remote, path, k, worker, v + 1, ids[v])
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
                    sw = StageWorker(plan.circuit, plan, k, worker, sm)
                    snap = WorkerSnapshot(sw.stateful, task.layout.shard_bits, groupings=groupings(plan.circuit))
                    try:
                        snap.load(h, f"{where} v{v}", reuse=stale, listing=listing)
                    except CorruptionError:
                        if listing is None:
                            raise
                        listing = None  # a listed key is gone (a save the log missed): read the tables instead
                        cache_stats["listing_fallbacks"] += 1
                        sw = StageWorker(plan.circuit, plan, k, worker, sm)
                        snap = WorkerSnapshot(sw.stateful, task.layout.shard_bits, groupings=groupings(plan.circuit))
                        snap.load(h, f"{where} v{v}", reuse=stale)
                    entry = _Entry(task.run, v, first, sw, snap, made)
                    loaded = "partial" if stale is not None else "full"
                    cache_stats["loads" if stale is None else "partial_loads"] += 1
                    cache_stats["listed_loads"] += listing is not None
                else:
                    loaded = "cache"
                    cache_stats["hits"] += 1
                saved = _capture(entry)
                try:
                    out = _run_steps(task, entry.worker, received)
                    saves = entry.snapshot.prepare()
                    w = Recorder(h) if remote is not None else h  # stage_store invariant 1: what the commit writes
                    WorkerSnapshot.apply(w, saves)
                    _log_saves(w, v + 1, saves)
                    write_worker_layout(w, task.layout, worker)
                    w.set_step(end)
                    if remote is not None:  # uploaded before the commit, named by the acknowledgement
                        link = upload_delta(remote, k, worker, v + 1, w)
                        extra["delta"] = link
                        write_side(path, {v: ids[v], v + 1: link["made"]})
                    out = pa.concat_tables([out, ack_blob(k, worker, v + 1, end, first, loaded, extra)])
                    if remote is None:
                        _write_result(_result_path(root, k, worker), tag, out)
                    _fault(task, worker, "before-commit")
                    h.commit()
                except BaseException:
                    _rollback(entry, saved)
                    cache_stats["rollbacks"] += 1
                    with _CACHE_LOCK:
                        _CACHE[key] = entry
                    raise
                entry.version, entry.step = v + 1, end
                entry.made = extra["delta"]["made"] if remote is not None else None
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
