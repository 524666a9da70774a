"""Stage state in an object store (the staged executor over ``storage="s3://..."``, e.g. SparkPipeline on a cluster without a shared mount): each (stage, worker)'s database lives in a local cache directory of whichever process runs its task, and moves between processes (Spark executors) only through immutable objects in the store, while the driver keeps which objects are canonical.

Layout under the pipeline's prefix (beside dbsp_core.storage.remote's ``manifest/``, ``db/``, ``log/``)::

    stage/<k>/<w>/<20-digit v>-<token>.delta   what one attempt of a job committed to (stage k, worker w): v-1 -> v
    stage/<k>/<w>/<20-digit v>-<token>.base    a page file (a compacted chain, or a layout change's new state)
    jobs/worker-<w>.input                      the running job's stage-0 blobs of worker w (transient)
    jobs/stage-<k>/from-<s>.a<attempt>         what worker s sent into stage k, a part per receiver (transient)

A **chain** is the list of links whose replay gives a (stage, worker)'s database at a version: a base (a page file)
or a delta from a new, empty database, then deltas. Each link carries ``made``: the id of the version it leads to
(a delta's own object name; a task's compaction base keeps the id of the version it copied; a layout change's
base is its own name).

Invariants (enforced here, with stage_task.py's remote branch and staged.py):
  1. Upload before the commit, acknowledgement after: a stateful task attempt for base version ``v`` records
     every put, delete and step it writes (:class:`Recorder`, the DRDL records of storage.database.Journal),
     uploads them as an object under a token of its own before it commits ``v + 1`` in its local cache, and its
     acknowledgement names the object. So every version the driver hears of is durable in the store, and
     attempts (retries, speculative duplicates, zombies) on any Spark executor never write the same object: no
     lock across Spark executors is needed (the local lock file still serializes attempts within one).
  2. The driver's chains are the truth (:class:`StageChains`): once every acknowledgement of a job checks out
     (staged.py invariant 1) the driver appends each (stage, worker)'s acknowledged delta to its chain (or starts
     the chain again from the base the attempt uploaded); objects of attempts it did not take are garbage. A
     job's description names, per worker, the chain leading to its base version.
  3. A cached database is trusted only for versions on the chain: a sidecar file beside it (``.chain``, rewritten
     before every commit to it) names the id of each version it holds. A task opens the newest local version
     whose id is the chain's (discarding a newer one: another attempt's lineage, or a job the driver lost) and
     applies only the deltas after it: moving a (stage, worker) to a Spark executor whose cache is stale costs
     the change since that version. A database with no version on the chain is rebuilt from the chain's start.
     The task processes' cache of live instances (stage_task.py invariant 4) is used only at an id on the chain.
  4. Upload follows the change: once a chain has :data:`MERGE_AT` links, a job's delta absorbs the deltas at its
     tail when :data:`MERGE_FANOUT` - 1 of them span as many jobs as it, and so on up (:func:`merge_run`; the task
     GETs them and uploads one object, their records then its own, as the link from the first one's ``from`` to
     ``v + 1``; the acknowledgement names the links it ``replaces``): a counter over jobs, so a chain of n jobs
     has O(log n) links and each job's records are uploaded O(log n) times. Compaction: when the job's upload (its
     delta and those it absorbs) would pass the page file's size before the job (at least 1 MiB; the page file
     costs no more and empties the chain), or the chain with it would hold more delta bytes than that page file,
     or more than :data:`CHAIN_LIMIT` links, the task commits ``v + 1`` and then uploads its page file (quiet: its
     lock held, no handle open) as a base at ``v + 1`` instead of the delta, under the id it named in the sidecar
     before the commit; the chain becomes that base. So a whole page file is uploaded only after about its size in
     deltas, never every N jobs (a small state, whose page file is less than MERGE_AT jobs' deltas, compacts
     before any merge; a big one merges and seldom compacts), and by the job that crosses the line (a big job,
     e.g. a load, pays for its own compaction, not the small jobs after it). A base uploaded after the commit
     keeps invariant 1's order where it matters: the acknowledgement follows the upload, and a cached ``v + 1``
     whose upload never happened is on no chain (invariant 3).
  5. Checkpoints: the manifest (storage.remote invariant 2) carries the chains at the checkpoint's step under
     ``stages`` (captured when the checkpoint is taken, with the steps paused); recovery takes the chains from
     the manifest it restored and replays the logs from its step. Retention deletes ``stage/`` objects named by
     a version at or below the newest manifest's that neither live manifest nor the driver's current chains
     name; a newer object may belong to a job in flight and waits for a later pass.
  6. Layout changes (cold, or each wave of a live one) run as a job of tasks (:class:`MoveTask`, one per stateful
     (stage, worker) of the new layout, wherever the job runner puts it), never through the driver: a task brings
     the old databases it reads to their chains in its own stage cache (invariant 3: a cached copy at a version
     of the chain is used as it is), the old workers whose shards move to its worker (every leaving worker) and
     its own worker's, builds its worker's database of the new layout (dbsp_core.storage.shardmove invariant 5:
     the rows of the shards it will own, the same bytes runtime/rescale.py's protocol writes there), uploads it
     as a base under a token of its own (as invariant 1: attempts never write the same object) and acknowledges
     it; it leaves the new database in its cache at the new version. The driver only decides the assignment,
     checks one acknowledgement per (stage, worker) and restarts every chain from the base it names
     (:meth:`StageChains.record_move`); attempts it did not take are garbage, and a job that fails is run again
     from the same chains (staged.py invariant 5). Until the chains are recorded nothing durable changed: a
     driver that dies mid-change recovers from the manifest's chains and layout (invariant 5), so the change
     and the steps after the checkpoint replay exactly once.
  7. No path is shared: a task's cache is ``<base>/dbsp-stage-cache/<pipeline key>``, where ``base`` is the
     ``task_cache_dir`` setting or else the Spark executor's own directory (``SPARK_EXECUTOR_DIRS``, YARN's
     ``LOCAL_DIRS``, ``SPARK_LOCAL_DIRS``, the temporary directory); two Spark executors sharing one (one machine)
     is fine: attempts there are serialized by the lock file, and every version is checked by invariant 3.
  8. ``worker_recovery="pipeline"`` (spark_glue/pipeline.py design note 9): a stateful task uploads nothing; it
     writes its commit's records (the delta invariant 1 would upload, in its format: REMOTE_DELTA_MAGIC, checksummed)
     to a pending file beside its cached database (``<db>.pending/<20-digit v>-<token>.delta``) before it commits
     ``v + 1`` there, and acknowledges a **local** link (``kind "local"``, no object) naming the version's id. The
     driver keeps local links apart from the durable chains (:attr:`StageChains.pending`): they never reach a
     manifest (:meth:`StageChains.capture` refuses them) and retention never sees them. A task is given the
     durable chain followed by its local links; a cached database at the chain's version (the tail's id) is used
     as it is, but one that is missing or behind a local link cannot be rebuilt from the store: the task raises
     WorkerStateLostError, and the driver recovers the whole pipeline (:meth:`StageChains.rollback`, driver
     invariant 10). A task also checks that the pending file of every local link is there (else the same error)
     and removes the pending files of no local link (another attempt's, or already durable). A flush
     (:class:`FlushTask`, at a checkpoint, before a layout change and before the driver reads the state) runs
     one task per (stage, worker) on the process holding it: it checks the cached database is at the chain's
     version, uploads the pending records since the durable chain as ONE delta from its first ``from`` to the
     version (or the page file as a base, by invariant 4's rule), under a token of its own, and acknowledges it;
     the driver then appends it to the chain (:meth:`StageChains.record_flush`). So a checkpoint uploads what
     changed since the last durable point, and nothing is uploaded between them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from dbsp_core.codec import frame_head, unframe
from dbsp_core.errors import CorruptionError, DbspError, RecoveryError, WorkerStateLostError
from dbsp_core.layout import Layout
from dbsp_core.runtime.job_files import decode_table, encode_table
from dbsp_core.runtime.remote_state import DOWNLOAD_THREADS
from dbsp_core.runtime.remote_state import _apply as apply_delta
from dbsp_core.storage.database import JOURNAL_DELETE, JOURNAL_PUT, JOURNAL_STEP, Database
from dbsp_core.storage.formats import JOB_INPUT_MAGIC, REMOTE_DELTA_MAGIC, TMP_SUFFIX, lock_path, state_db_path
from dbsp_core.storage.remote import Remote, version_of
from dbsp_core.storage.shardmove import (build_target, change_handles, check_source, moving_to, relayout_group,
                                         state_bytes)
from dbsp_core.storage.snapshot import TableSpec

__all__ = ["StageStore", "StageChains", "Recorder", "MoveTask", "CHAIN_LIMIT", "sync_stage_db", "upload_delta",
           "upload_base", "merge_run", "needs_compaction", "remote_of", "run_move_task", "write_job_inputs",
           "read_job_input", "write_exchange", "read_exchange", "by_receiver", "job_digest", "default_cache_base",
           "FlushTask", "run_flush_task", "write_pending", "check_pending", "local_links", "LOCAL", "RECOVERY_MODES"]

CHAIN_LIMIT = 40  # links of a chain past which a task compacts it (invariant 4; merges keep it shorter)
MERGE_FANOUT = 8  # deltas of one span that merge into one of the next (invariant 4)
MERGE_AT = 16  # links of a chain before its deltas merge (invariant 4): a small state compacts before it
STAGE_DIR = "stage"
JOBS_DIR = "jobs"
SIDE_SUFFIX = ".chain"
FRESH = "fresh"  # the id of an empty database's first version
LOCAL = "local"  # the kind of a link committed in one process's cache only (invariant 8)
PENDING_SUFFIX = ".pending"
# how a lost worker's state is brought back (spark_glue/pipeline.py design note 9): "alone" uploads every job's delta
# (invariant 1) so the worker is rebuilt from its chain; "pipeline" uploads at flushes only (invariant 8) and a loss
# recovers the whole pipeline from the last durable point
RECOVERY_MODES = ("alone", "pipeline")


def default_cache_base() -> str:
    """Where a process keeps its stage cache when no ``task_cache_dir`` is set (invariant 7)."""
    for var, sep in (("SPARK_EXECUTOR_DIRS", os.pathsep), ("LOCAL_DIRS", ","), ("SPARK_LOCAL_DIRS", ",")):
        v = os.environ.get(var)
        if v:
            return v.split(sep)[0]
    return tempfile.gettempdir()


@dataclass(frozen=True)
class StageStore:
    """Where the stage state of one pipeline lives (picklable: it travels to the task processes).

    ``storage`` is the pipeline's store as given (a URI, credentials from the environment, or a
    ``pyarrow.fs.FileSystem``); ``key`` names the pipeline in task caches; ``cache_dir`` is the task cache base
    on every process (None: the Spark executor's own directory, invariant 7)."""

    storage: Any = field(repr=False)  # a URI may carry secrets: never shown (storage.remote invariant 5)
    key: str = ""
    cache_dir: str | None = None

    @classmethod
    def of(cls, storage: Any, shown: str, cache_dir: str | None = None) -> "StageStore":
        key = hashlib.sha256(shown.encode()).hexdigest()[:16]
        return cls(storage, key, None if cache_dir is None else os.fspath(cache_dir))

    def root(self) -> str:
        """This process's stage cache of the pipeline (invariant 7)."""
        base = self.cache_dir or default_cache_base()
        return os.path.join(base, "dbsp-stage-cache", self.key)


_REMOTES: dict[str, Remote] = {}


def remote_of(store: StageStore) -> Remote:
    """The :class:`Remote` of ``store`` in this process (made once per pipeline)."""
    r = _REMOTES.get(store.key)
    if r is None:
        r = _REMOTES[store.key] = Remote.of(store.storage, store.root())
    return r


def object_name(stage: int, worker: int, version: int, base: bool = False) -> str:
    """A new object name of (stage, worker) for the job committing ``version`` (invariant 1: a token per attempt).

    >>> object_name(1, 2, 7).startswith("stage/1/2/00000000000000000007-")
    True
    """
    return f"{STAGE_DIR}/{stage}/{worker}/{version:020d}-{uuid.uuid4().hex[:16]}{'.base' if base else '.delta'}"


def object_version(name: str) -> int | None:
    """The job version in a stage object's name (None for a name of another shape).

    >>> object_version("stage/0/1/00000000000000000007-ab.delta"), object_version("stage/x")
    (7, None)
    """
    return version_of(name.rsplit("/", 1)[-1].split("-", 1)[0])


# ---- task side ----


class Recorder:
    """A write handle that records what it writes as DRDL records (storage.database.Journal's format)
    (invariant 1); every other call goes to the handle."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.parts: list[bytes] = []

    def _rec(self, op: int, table: Any, key: Any, value: Any = None) -> None:
        t = table.encode() if isinstance(table, str) else bytes(table)
        k = bytes(key)
        self.parts.append(bytes([op]) + len(t).to_bytes(2, "little") + t + len(k).to_bytes(2, "little") + k)
        if value is not None:
            self.parts.append(len(value).to_bytes(8, "little") + bytes(value))

    def put(self, table: Any, key: Any, value: Any) -> None:
        self.h.put(table, key, value)
        self._rec(JOURNAL_PUT, table, key, value)

    def delete(self, table: Any, key: Any) -> bool:
        found = self.h.delete(table, key)
        if found:
            self._rec(JOURNAL_DELETE, table, key)
        return found

    def set_step(self, step: int) -> None:
        self.h.set_step(step)
        self._rec(JOURNAL_STEP, b"", b"", step.to_bytes(8, "little"))

    def body(self) -> bytes:
        return b"".join(self.parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.h, name)


def _side(path: str) -> str:
    return path[:-len(".db")] + SIDE_SUFFIX if path.endswith(".db") else path + SIDE_SUFFIX


def read_side(path: str) -> dict[int, str]:
    """The sidecar of a cached database: the id of each version it holds (invariant 3); {} if missing or torn."""
    try:
        with open(_side(path)) as f:
            return {int(k): v for k, v in json.load(f).items()}
    except (FileNotFoundError, ValueError, AttributeError):
        return {}


def write_side(path: str, ids: dict[int, str]) -> None:
    """Rewrite the sidecar (before the commit it describes: invariant 3); atomic, not fsynced (a torn or lost one
    only makes the next task rebuild from the store)."""
    tmp = _side(path) + TMP_SUFFIX
    with open(tmp, "w") as f:
        json.dump({str(k): v for k, v in ids.items()}, f)
    os.replace(tmp, _side(path))


def made_ids(chain: list[dict], v: int) -> dict[int, str]:
    """The id of each version ``chain`` passes through (an empty chain: a new database at ``v``)."""
    if not chain:
        return {v: FRESH}
    out = {} if chain[0]["kind"] == "base" else {chain[0]["from"]: FRESH}
    for link in chain:
        out[link["to"]] = link["made"]
    return out


def _remove_db(path: str) -> None:
    for p in (path, _side(path)):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def sync_stage_db(remote: Remote, path: str, chain: list[dict], v: int, where: str) -> tuple[str, int, dict]:
    """Bring the cached database at ``path`` to the chain's version ``v`` (invariant 3); the caller holds its
    lock. Returns how (``"cache"``: it was there; ``"fetched"``: deltas since a cached version applied;
    ``"rebuilt"``: from the chain's start; ``"fresh"``: a new empty database), the bytes downloaded, and the ids
    of the chain's versions."""
    ids = made_ids(chain, v)
    if chain and chain[-1]["to"] != v:
        raise RecoveryError(f"{where}: the job's chain leads to version {chain[-1]['to']}, its base version is {v}")
    local = next((i for i, link in enumerate(chain) if link["kind"] == LOCAL), len(chain))  # invariant 8
    start = -1  # index of the chain link the cached version is at (-1: before the first link)
    if os.path.exists(path):
        side = read_side(path)
        db = Database(path)
        try:
            vs = db.versions()
            x = next((u for u in reversed(vs) if u <= v and u in ids and side.get(u) == ids[u]), None)
            if x is not None and vs.stop - 1 != x:
                db.open(x).close()  # another lineage's newer version: discarded
        finally:
            db.close()
        if x is not None:
            if x == v:
                return "cache", 0, ids
            start = {link["to"]: i for i, link in enumerate(chain)}.get(x, -1)  # -1: a new database's first version
            if start + 1 < len(chain) and any(link["kind"] == LOCAL for link in chain[start + 1:]):
                raise WorkerStateLostError(f"{where}: the cached database is at version {x}, behind the version "
                                           f"{chain[local]['to']} committed in another process's cache only "
                                           f"(worker_recovery='pipeline')")
            write_side(path, {x: ids[x]})
            with _Prefetch(remote, path, chain[start + 1:]) as pre:
                return "fetched", _apply_links(remote, path, chain[start + 1:], ids, pre), ids
        _remove_db(path)
    if local < len(chain):
        raise WorkerStateLostError(f"{where}: no cached database at version {v}, and versions "
                                   f"{chain[local]['from'] + 1}..{v} were committed in a process's cache only "
                                   f"(worker_recovery='pipeline')")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not chain:
        write_side(path, {v: FRESH})
        Database.create(path, v).close()
        return "fresh", 0, ids
    got = 0
    first = chain[0]
    rest = chain[1:] if first["kind"] == "base" else chain
    with _Prefetch(remote, path, rest) as pre:  # the deltas download while the base does
        if first["kind"] == "base":
            got += remote.get_file(first["object"], path)
            with Database(path) as db:
                if db.versions().stop - 1 != first["to"]:
                    raise CorruptionError(f"{remote.shown}/{first['object']}: the page file is at version "
                                          f"{db.versions().stop - 1}, the chain says {first['to']}")
            write_side(path, {first["to"]: first["made"]})
        else:
            write_side(path, {first["from"]: FRESH})
            Database.create(path, first["from"]).close()
        return "rebuilt", got + _apply_links(remote, path, rest, ids, pre), ids


class _Prefetch:
    """The objects of a chain's deltas, all asked for at once from :data:`DOWNLOAD_THREADS` threads (as
    remote_state.restore does), each streamed into a file beside the database (never whole in memory,
    remote_state invariant 4): a task whose state moved to another Spark executor waits about for the slowest
    object instead of the sum of all (issue 33). The files left are removed on exit."""

    def __init__(self, remote: Remote, path: str, links: list[dict]) -> None:
        self.dsts = [f"{path}.delta{i}" for i in range(len(links))]
        self.pool = (ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(links)), thread_name_prefix="dbsp-stage-fetch")
                     if links else None)
        self.futs = [] if self.pool is None else [
            self.pool.submit(remote.get_file, link["object"], dst, sync=False)
            for link, dst in zip(links, self.dsts)]

    def __enter__(self) -> "_Prefetch":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for dst in self.dsts:
            for p in (dst, dst + TMP_SUFFIX):
                if os.path.exists(p):
                    os.remove(p)


def _apply_links(remote: Remote, path: str, links: list[dict], ids: dict[int, str], pre: _Prefetch) -> int:
    got = 0
    with Database(path) as db:
        for i, link in enumerate(links):
            if link["kind"] != "delta":
                raise CorruptionError(f"{remote.shown}/{link['object']}: a base in the middle of a chain")
            got += pre.futs[i].result()
            write_side(path, {link["from"]: ids[link["from"]], link["to"]: link["made"]})
            apply_delta(db, link, pre.dsts[i], f"{remote.shown}/{link['object']}")
            os.remove(pre.dsts[i])
    return got


def merge_run(chain: list[dict], new_bytes: int) -> int:
    """How many deltas at the tail of ``chain`` a job's delta absorbs (invariant 4). None while the chain with it has
    at most :data:`MERGE_AT` links (a state whose page file is less than that many jobs' deltas compacts first, and
    pays no merge); past it, a counter in base :data:`MERGE_FANOUT` over jobs: when the tail holds
    ``MERGE_FANOUT - 1`` links of the run's span, they join it and the run spans ``MERGE_FANOUT`` times as many
    jobs, then again at that span. So a chain of n small jobs has at most MERGE_AT + (MERGE_FANOUT - 1) log(n)
    links past its base, and each job's records are uploaded at most 1 + log(n) times (logarithms to base
    MERGE_FANOUT). ``new_bytes`` does not matter (a job's delta spans one job) but documents the call.

    >>> d = lambda span: {"kind": "delta", "bytes": 1, "from": 0, "to": span}
    >>> merge_run([d(1)] * 15, 9), merge_run([d(1)] * 16, 9), merge_run([d(1)] * 9 + [d(8)] * 7 + [d(1)] * 7, 9)
    (0, 7, 14)
    >>> merge_run([d(1)] * 14 + [d(8)] + [d(1)] * 2, 9), merge_run([{"kind": "base", "bytes": 1, "to": 3}] + [d(1)] * 16, 9)
    (0, 7)
    """
    if len(chain) + 1 <= MERGE_AT:
        return 0
    span, n, i = 1, 0, len(chain)
    while i >= MERGE_FANOUT - 1:
        tail = chain[i - MERGE_FANOUT + 1:i]
        if any(link["kind"] != "delta" or link["to"] - link["from"] != span for link in tail):
            break
        span, n, i = span * MERGE_FANOUT, n + len(tail), i - len(tail)
    return n


def delta_bodies(remote: Remote, links: list[dict]) -> list[bytes]:
    """The checked record bodies of delta objects ``links``, asked for at once (invariant 4's merge)."""
    def one(link: dict) -> bytes:
        return unframe(REMOTE_DELTA_MAGIC, remote.get(link["object"]), f"{remote.shown}/{link['object']}")

    if len(links) <= 1:
        return [one(x) for x in links]
    with ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(links)), thread_name_prefix="dbsp-stage-merge") as pool:
        return list(pool.map(one, links))


def needs_compaction(chain: list[dict], new_bytes: int, page_bytes: int) -> bool:
    """Invariant 4: the job's delta of ``new_bytes`` with the deltas it would absorb (:func:`merge_run`) holds more
    than the page file's size before the job (``page_bytes``, at least 1 MiB: uploading the page file then costs no
    more and empties the chain), or the chain with it has more delta bytes than the page file, or more than
    :data:`CHAIN_LIMIT` links. A base is not counted: it is about the page file's size, so counting it compacted at
    every job once a chain started with one.

    >>> d = {"kind": "delta", "bytes": 10 << 20, "from": 0, "to": 1}
    >>> needs_compaction([d], 20 << 20, 15 << 20), needs_compaction([d], 70_000, 15 << 20)  # a load; a small job
    (True, False)
    >>> needs_compaction([dict(d, bytes=2 << 20)] * 7, 2 << 20, 15 << 20)  # a merge of 16 MB: the page file instead
    True
    """
    n = merge_run(chain, new_bytes)
    page = max(page_bytes, 1 << 20)
    merged = new_bytes + sum(link["bytes"] for link in chain[len(chain) - n:])
    deltas = new_bytes + sum(link["bytes"] for link in chain if link["kind"] == "delta")
    return len(chain) - n + 1 > CHAIN_LIMIT or deltas > page or merged > page


def upload_delta(remote: Remote, version: int, body: bytes | list[bytes], chain: list[dict], name: str,
                 frm: int | None = None, made: str | None = None) -> tuple[dict, int]:
    """Upload a job's delta records ``body`` (:meth:`Recorder.body`), behind the deltas at ``chain``'s tail it absorbs
    (invariant 4), as object ``name`` (:func:`object_name`) leading to ``version`` (invariant 1); returns its link
    and how many links of ``chain`` it replaces. A flush (invariant 8) gives the records of several jobs as a list,
    the version they start from (``frm``) and the id of the version they lead to (``made``)."""
    bodies = body if isinstance(body, list) else [body]
    n = merge_run(chain, sum(len(b) for b in bodies))
    parts = delta_bodies(remote, chain[len(chain) - n:]) + bodies
    head = frame_head(REMOTE_DELTA_MAGIC, *parts)
    remote.put(name, b"".join([head, *parts]))
    start = chain[len(chain) - n]["from"] if n else (version - 1 if frm is None else frm)
    return ({"object": name, "kind": "delta", "from": start, "to": version, "made": made or name,
             "bytes": len(head) + sum(len(x) for x in parts)}, n)


def upload_base(remote: Remote, path: str, stage: int, worker: int, version: int, made: str,
                at: int | None = None) -> dict:
    """Upload the (quiet) page file at ``path``, at version ``at`` (default ``version - 1``), as a base named by
    the job committing ``version`` (invariant 4); its id stays ``made``. Returns its link."""
    name = object_name(stage, worker, version, base=True)
    n = remote.put_file(name, path)
    to = version - 1 if at is None else at
    return {"object": name, "kind": "base", "to": to, "made": made or name, "bytes": n}


# ---- layout changes through the store (invariant 6) ----


@dataclass(frozen=True)
class MoveTask:
    """One task of a layout change (invariant 6): build (``stage``, ``worker``)'s database of layout ``new`` (a
    dict: ``Layout.to_dict``) from the old databases at ``version``, whose chains ``chains`` names by old worker
    (only those it reads), and record ``step`` in it. ``specs``: the stage's state tables (picklable: it travels
    to the task processes, as :class:`StageStore` does)."""

    store: StageStore
    stage: int
    worker: int
    old: dict
    new: dict
    version: int
    step: int
    chains: dict[int, list[dict]]
    specs: dict[str, TableSpec]
    measure: bool = False  # also report the bytes of every state value of the new database (``total_bytes``)

    @staticmethod
    def sources(old: Layout, new: Layout, worker: int) -> list[int]:
        """The old workers whose databases ``worker``'s task reads: its own (if it is an old worker), every other
        one whose shards move to it when the shard count stays (all of them, and every leaving one, else).

        >>> a = Layout.local(2, 8)
        >>> b = a.rebalance(3)                        # 256 shards still: worker 2 takes shards of 0 and 1
        >>> [MoveTask.sources(a, b, w) for w in range(3)], [MoveTask.sources(b, a, w) for w in range(2)]
        ([[0], [1], [0, 1]], [[0, 2], [1, 2]])
        >>> MoveTask.sources(Layout.local(2, 4), Layout.local(2, 4).rebalance(3), 0)  # 16 -> 32 shards: all
        [0, 1]
        """
        if old.shard_bits != new.shard_bits:
            return list(range(old.workers))
        src, dst = old.shard_map.part_of_shard, new.shard_map.part_of_shard
        return [w for w in range(old.workers)
                if w == worker or w >= new.workers or bool(((src == w) & (dst == worker)).any())]


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """The lock file stage tasks take beside a cached database (stage_task.py invariant 3)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _db_path(root: str, stage: int, worker: int) -> str:
    return state_db_path(root, stage, worker)


def run_move_task(task: MoveTask) -> dict:
    """Run one task of a layout change where this process is (invariant 6); returns its acknowledgement
    ``{stage, worker, version, step, base, moved_bytes, fetched_bytes, fetch, cache_root}`` (``base``: the link
    of the object it uploaded; ``moved_bytes``: bytes moved into its worker's database, or, when the shard count
    changes, every database's, ``group_moved``; with ``measure``, ``total_bytes``)."""
    old, new = Layout.from_dict(task.old, "MoveTask old"), Layout.from_dict(task.new, "MoveTask new")
    k, w, v = task.stage, task.worker, task.version
    remote, root = remote_of(task.store), task.store.root()
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="move-", dir=root)  # beside the cache: the new database moves into it
    fetched, how, copies = 0, {}, {}
    try:
        same_bits = old.shard_bits == new.shard_bits
        incoming: list = []
        counts: dict = {}
        for s in sorted(task.chains):  # one lock at a time: tasks sharing this cache never wait on each other
            path = _db_path(root, k, s)
            where = f"stage {k} worker {s} of layout epoch {old.epoch}"
            with _locked(path):
                how[s], got, _ = sync_stage_db(remote, path, task.chains[s], v, where)
                fetched += got
                with Database(path) as db, db.read(v) as h:
                    check_source(h, old, s, f"{where} (version {v}, from {remote.shown})", remote.shown)
                    if same_bits and s != w:
                        got_in, cnt = moving_to(h, s, w, old, new, task.specs, f"stage {k}")
                        incoming.extend(got_in)
                        counts.update(cnt)
                if not same_bits or s == w:  # a copy to change (the cached one stays at v for other tasks)
                    copies[s] = _db_path(scratch, k, s)
                    os.makedirs(os.path.dirname(copies[s]), exist_ok=True)
                    shutil.copyfile(path, copies[s])
        target = copies.get(w) or _db_path(scratch, k, w)
        if same_bits:
            if w not in copies:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                Database.create(target, v).close()
            with Database(target) as db:
                h = db.open(v)
                try:
                    moved = build_target(h, w, old, new, task.specs, incoming, counts, f"stage {k}")
                    h.set_step(task.step)
                    h.commit()
                finally:
                    if not h.closed:
                        h.close()
            done = {"moved_bytes": moved}
        else:
            done = {"group_moved": _move_all(copies, scratch, k, w, old, new, v, task)}
        if task.measure:
            with Database(target) as db, db.read(v + 1) as h:
                done["total_bytes"] = state_bytes(h)
        link = upload_base(remote, target, k, w, v + 1, "", at=v + 1)
        own = _db_path(root, k, w)
        with _locked(own):  # the new state stays in this cache at v + 1 (the next job's tasks may find it here)
            _remove_db(own)
            write_side(own, {v + 1: link["made"]})
            os.replace(target, own)
        return {"stage": k, "worker": w, "version": v + 1, "step": task.step, "base": link,
                "fetched_bytes": fetched, "fetch": how, "cache_root": root, **done}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _move_all(copies: dict[int, str], scratch: str, k: int, w: int, old: Layout, new: Layout, v: int,
              task: MoveTask) -> int:
    """A change of the shard count: every old database's copy (``copies``) and an empty one per joining worker,
    changed together by runtime/rescale.py's protocol; only worker ``w``'s is committed. Returns the moved bytes of
    the whole stage."""
    paths = {x: copies.get(x) or _db_path(scratch, k, x) for x in range(max(old.workers, new.workers))}
    with change_handles(paths, v, set(paths) - set(copies)) as handles:
        rep = relayout_group(handles, old, new, task.specs, f"stage {k}", False)
        handles[w].set_step(task.step)
        handles[w].commit()
        return int(rep["moved_bytes"])


# ---- worker_recovery="pipeline": local commits and flushes (invariant 8) ----


def local_links(chain: list[dict]) -> list[dict]:
    """The local links at ``chain``'s tail (invariant 8)."""
    n = len(chain)
    while n and chain[n - 1]["kind"] == LOCAL:
        n -= 1
    return chain[n:]


def _pending_dir(path: str) -> str:
    return (path[:-len(".db")] if path.endswith(".db") else path) + PENDING_SUFFIX


def _pending_file(path: str, link: dict) -> str:
    return os.path.join(_pending_dir(path), f"{link['to']:020d}-{link['made'].rsplit('/', 1)[-1]}")


def write_pending(path: str, link: dict, body: bytes) -> None:
    """The pending file of ``link`` (a local commit of the database at ``path``): its records framed as a delta
    object (REMOTE_DELTA_MAGIC, checksummed); written whole (a temporary file renamed) before the commit. Not
    fsynced: a machine that loses it loses the cache with it, and a torn one fails its checksum at the flush."""
    dst = _pending_file(path, link)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = dst + TMP_SUFFIX
    with open(tmp, "wb") as f:
        f.write(frame_head(REMOTE_DELTA_MAGIC, body))
        f.write(body)
    os.replace(tmp, dst)


def check_pending(path: str, chain: list[dict], where: str) -> None:
    """Invariant 8: every local link of ``chain`` has its pending file beside ``path`` (else WorkerStateLostError);
    the pending files of no local link are removed (an attempt the driver did not take, or already flushed). Call
    with the database's lock held."""
    keep = {os.path.basename(_pending_file(path, link)) for link in local_links(chain)}
    d = _pending_dir(path)
    have = set(os.listdir(d)) if os.path.isdir(d) else set()
    if keep - have:
        raise WorkerStateLostError(f"{where}: the pending records of versions "
                                   f"{sorted(int(n.split('-', 1)[0]) for n in keep - have)} are missing "
                                   f"(worker_recovery='pipeline')")
    for name in have - keep:
        os.remove(os.path.join(d, name))


def _pending_bodies(path: str, links: list[dict], where: str) -> list[bytes]:
    out = []
    for link in links:
        f = _pending_file(path, link)
        try:
            with open(f, "rb") as fh:
                out.append(unframe(REMOTE_DELTA_MAGIC, fh.read(), f))
        except (FileNotFoundError, CorruptionError) as e:
            raise WorkerStateLostError(f"{where}: the pending records of version {link['to']}: {e}") from None
    return out


@dataclass(frozen=True)
class FlushTask:
    """One task of a flush (invariant 8): upload what (``stage``, ``worker``) committed in its process's cache since
    its durable chain; ``chain`` is the durable chain followed by the local links. Runs where the worker's state is
    cached (``where_cached``: a job runner prefers the process its last task ran on)."""

    store: StageStore
    stage: int
    worker: int
    chain: list[dict]
    where_cached = True


def run_flush_task(task: FlushTask) -> dict:
    """Run one flush task where this process is (invariant 8); returns ``{stage, worker, version, delta | base,
    replaces, bytes, cache_root}``. WorkerStateLostError if the cached database is not at the chain's version
    (another process, or a lost cache) or a pending file is missing or torn."""
    k, w = task.stage, task.worker
    remote, root = remote_of(task.store), task.store.root()
    path = _db_path(root, k, w)
    where = f"stage {k} worker {w} (flush, {root})"
    locs = local_links(task.chain)
    durable = task.chain[:len(task.chain) - len(locs)]
    if not locs:
        raise DbspError(f"{where}: nothing to flush")
    v, made = locs[-1]["to"], locs[-1]["made"]
    with _locked(path):
        if not os.path.exists(path):
            raise WorkerStateLostError(f"{where}: no cached database (worker_recovery='pipeline')")
        with Database(path) as db:
            top = db.versions().stop - 1
        if top != v or read_side(path).get(v) != made:
            raise WorkerStateLostError(f"{where}: the cached database is at version {top}, not at the chain's {v} "
                                       f"(worker_recovery='pipeline')")
        bodies = _pending_bodies(path, locs, where)
        total = sum(len(b) for b in bodies)
        out = {"stage": k, "worker": w, "version": v, "cache_root": root, "delta_bytes": total}
        if needs_compaction(durable, total, os.path.getsize(path)):
            out["base"] = upload_base(remote, path, k, w, v, made, at=v)
        else:
            out["delta"], n = upload_delta(remote, v, bodies, durable, object_name(k, w, v), frm=locs[0]["from"],
                                           made=made)
            out["replaces"] = [link["object"] for link in durable[len(durable) - n:]]
        return out


# ---- job inputs and exchanges through the store ----


def _input_name(worker: int) -> str:
    return f"{JOBS_DIR}/worker-{worker}.input"


def by_receiver(blobs: pa.Table, workers: int, where: str) -> list[pa.Table]:
    """``blobs`` split by their ``part`` (the receiving worker), in one stable sort (not a filter per worker);
    DbspError if a blob is addressed to no worker of ``workers`` (it would be lost)."""
    parts = blobs.column("part").to_numpy(zero_copy_only=False)
    bad = (parts < 0) | (parts >= workers)
    if bad.any():
        raise DbspError(f"{where}: blobs addressed to workers {sorted(set(parts[bad].tolist()))}, there are {workers}")
    order = np.argsort(parts, kind="stable")
    counts = np.bincount(parts, minlength=workers)
    ends = np.cumsum(counts)
    t = blobs.take(pa.array(order))
    return [t.slice(int(ends[w] - counts[w]), int(counts[w])) for w in range(workers)]


def write_job_inputs(remote: Remote, job: dict, blobs: pa.Table, workers: int) -> None:
    """Each worker's stage-0 blobs as one object under the job's description (job_files.py invariant 2: each job
    replaces them; a reader checks the description, and the driver checks every acknowledgement's version). One
    object a worker: a stage-0 task of the one-Spark-job path (design note 6 of spark_glue/pipeline.py) finds its
    input by name alone."""
    for w, t in enumerate(by_receiver(blobs, workers, "job input")):
        bufs = encode_table(JOB_INPUT_MAGIC, dict(job, worker=w), t)
        remote.put(_input_name(w), b"".join(bytes(b) for b in bufs))


def read_job_input(remote: Remote, worker: int) -> tuple[dict, pa.Table]:
    name = _input_name(worker)
    tag, table = decode_table(remote.get(name), JOB_INPUT_MAGIC, f"{remote.shown}/{name}")
    if tag.pop("worker", None) != worker:
        raise CorruptionError(f"{remote.shown}/{name}: holds the input of another worker ({tag})")
    return tag, table


def job_digest(job: dict) -> str:
    """A job description's digest (SHA-256 of its canonical JSON): what an exchange's parts are tagged with."""
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


def _exchange_tag(job: dict, stage: int, worker: int, src: int) -> dict:
    return {"job": job_digest(job), "stage": stage, "worker": worker, "src": src}


def write_exchange(remote: Remote, job: dict, stage: int, src: int, blobs: pa.Table, workers: int,
                   attempt: int = 0) -> dict:
    """What worker ``src`` sends into stage ``stage``, as ONE object (one PUT, not one per receiver): the part of
    each receiving worker one after another, each a checksummed table tagged with the job's digest, the stage, the
    receiver and the sender, so a receiver reads its part alone with a ranged GET and checks it whole. Named by
    the sender and the task attempt (``attempt``, Spark's attempt number: duplicates of one task never write one
    object; each job replaces the objects of the last). Returns ``{"object", "ranges"}``: ``ranges[w]`` is
    ``[offset, length]`` of worker ``w``'s part, which the driver hands to the next stage's tasks
    (:func:`read_exchange`)."""
    name = f"{JOBS_DIR}/stage-{stage}/from-{src}.a{attempt}"
    bufs, ranges, off = [], [], 0
    for w, t in enumerate(by_receiver(blobs, workers, f"stage {stage - 1} worker {src}")):
        enc = [bytes(b) for b in encode_table(JOB_INPUT_MAGIC, _exchange_tag(job, stage, w, src), t)]
        n = sum(len(b) for b in enc)
        ranges.append([off, n])
        bufs += enc
        off += n
    remote.put(name, b"".join(bufs))
    return {"object": name, "ranges": ranges}


def read_exchange(remote: Remote, job: dict, stage: int, worker: int, sent: list[dict]) -> pa.Table:
    """The blobs every worker sent ``worker`` into ``stage``: ``sent[src]`` is what :func:`write_exchange` returned
    to sender ``src``'s committed attempt; one ranged GET a sender, all at once. CorruptionError if a part is
    torn or tagged for another job, stage, receiver or sender (a zombie of an earlier job overwrote the object:
    the job then runs again)."""
    def one(src: int) -> pa.Table:
        name, (off, n) = sent[src]["object"], sent[src]["ranges"][worker]
        where = f"{remote.shown}/{name} [{off}, {off + n})"
        tag, table = decode_table(remote.get_range(name, off, n), JOB_INPUT_MAGIC, where)
        if tag != _exchange_tag(job, stage, worker, src):
            raise CorruptionError(f"{where}: holds the blobs of another job or worker ({tag}), not those of stage "
                                  f"{stage} worker {worker} from {src} in this job")
        return table

    with ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(sent)), thread_name_prefix="dbsp-exchange") as pool:
        return pa.concat_tables(list(pool.map(one, range(len(sent)))))


# ---- driver side ----


class StageChains:
    """The driver's record of every stateful (stage, worker)'s chain (invariant 2), the version and step they
    lead to, and the store side of checkpoints (invariant 5: ``covered`` and ``retain``, as storage.remote's
    LogPart)."""

    def __init__(self, remote: Remote, entry: dict | None) -> None:
        self.remote = remote
        entry = entry or {"version": 0, "step": 0, "chains": {}}
        self.version, self.step = int(entry["version"]), int(entry["step"])
        self.chains: dict[str, list[dict]] = {k: list(v) for k, v in entry["chains"].items()}
        # invariant 8: the local links after each durable chain, and the version and step the durable chains are at
        self.pending: dict[str, list[dict]] = {}
        self.durable = (self.version, self.step)
        self._captured: dict | None = None
        self.scratch: str | None = None  # the driver's own copies of stage databases (views and traces)

    @staticmethod
    def key(stage: int, worker: int) -> str:
        return f"{stage}/{worker}"

    def chain(self, stage: int, worker: int) -> list[dict]:
        """The durable chain of (stage, worker) (its links are objects in the store)."""
        return self.chains.get(self.key(stage, worker), [])

    def task_chain(self, stage: int, worker: int) -> list[dict]:
        """What a task is given: the durable chain and the local links after it (invariant 8)."""
        return self.chain(stage, worker) + self.pending.get(self.key(stage, worker), [])

    def entry(self) -> dict:
        return {"version": self.version, "step": self.step, "chains": {k: list(v) for k, v in self.chains.items()}}

    def record(self, acks: list[dict], version: int, step: int) -> None:
        """After a job whose acknowledgements all checked out (invariant 2): each chain ends in its task's delta (in
        place of the links it ``replaces``, invariant 4) or restarts from its task's base. RecoveryError, changing
        nothing, if a delta replaces other links than the chain's tail."""
        chains = dict(self.chains)  # replaced whole: a checkpoint's retention may be reading the old one
        pending = dict(self.pending)
        for a in acks:
            k = self.key(a["stage"], a["worker"])
            if a.get("local") is not None:  # invariant 8: committed in its process's cache only
                pending[k] = pending.get(k, []) + [a["local"]]
                continue
            if pending.get(k):
                raise RecoveryError(f"stage {a['stage']} worker {a['worker']}: an uploaded link after local ones "
                                    f"(flush first)")
            if a.get("delta") is None:
                chains[k] = [a["base"]]
                continue
            ch, gone = chains.get(k, []), list(a.get("replaces", []))
            keep = len(ch) - len(gone)
            if keep < 0 or [link["object"] for link in ch[keep:]] != gone:
                raise RecoveryError(f"stage {a['stage']} worker {a['worker']}: the delta {a['delta']['object']} "
                                    f"replaces {gone}, the chain ends in {[link['object'] for link in ch[-3:]]}")
            chains[k] = ch[:keep] + [a["delta"]]
        self.chains, self.pending, self.version, self.step = chains, pending, version, step
        if not any(pending.values()):
            self.durable = (version, step)

    def record_flush(self, acks: list[dict]) -> None:
        """After a flush whose acknowledgements all checked out (invariant 8): each chain ends in the delta its task
        uploaded (or restarts from its base), its local links gone; the durable chains are then at the current
        version and step."""
        for a in acks:
            if a["version"] != self.version:
                raise RecoveryError(f"stage {a['stage']} worker {a['worker']}: a flush to version {a['version']}, the "
                                    f"chains are at {self.version}")
        self.pending = {}
        self.record([{k: v for k, v in a.items() if k != "local"} for a in acks], self.version, self.step)

    def rollback(self) -> int:
        """Forget the local links (their state was lost, invariant 8): the chains are at the durable version and
        step again; returns that step."""
        self.pending = {}
        self.version, self.step = self.durable
        return self.step

    def bytes(self) -> int:
        return sum(link["bytes"] for c in self.chains.values() for link in c)

    # ---- checkpoints (invariant 5) ----

    def capture(self) -> None:
        """The chains at the checkpoint being taken (the steps are paused); RecoveryError if local links are left
        (invariant 8: a flush comes first)."""
        if any(self.pending.values()):
            raise RecoveryError(f"a checkpoint of stage chains with local links {sorted(self.pending)}: flush first")
        self._captured = self.entry()

    def covered(self, step: int) -> dict:
        got = self._captured if self._captured is not None else self.entry()
        if got["step"] != step:
            raise RecoveryError(f"the stage chains captured are at step {got['step']}, the checkpoint at {step}")
        return got

    def retain(self, remote: Remote, live: list[dict]) -> int:
        keep = {link["object"] for c in list(self.chains.values()) for link in c}
        newest = 0
        for m in live:
            st = m.get("stages") or {}
            newest = max(newest, int(st.get("version", 0)))
            keep.update(link["object"] for c in st.get("chains", {}).values() for link in c)
        n = 0
        for name in remote.list(STAGE_DIR):
            ver = object_version(name)
            if name not in keep and ver is not None and ver <= newest:
                remote.delete(name)
                n += 1
        return n

    # ---- the driver's own copies (views and traces: what the driver reads itself) ----

    def scratch_dir(self) -> str:
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix="dbsp-stages-")
        return self.scratch

    def materialize(self, path: str, stage: int, worker: int) -> str:
        """Rebuild (stage, worker)'s database at the current version at ``path`` (the driver's scratch)."""
        return sync_stage_db(self.remote, path, self.chain(stage, worker), self.version,
                             f"stage {stage} worker {worker}")[0]

    def record_move(self, acks: list[dict], version: int, step: int) -> None:
        """After a layout change's job whose acknowledgements all checked out: every chain restarts from the base
        its task uploaded, at ``version`` (invariant 6); the chains of workers that left are dropped."""
        self.chains = {self.key(a["stage"], a["worker"]): [a["base"]] for a in acks}
        self.pending = {}
        self.version, self.step = version, step
        self.durable = (version, step)

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
