"""Stage state in an object store (the staged executor over ``storage="s3://..."``, e.g. SparkPipeline on a cluster without a shared mount): each (stage, worker)'s database lives in a local cache directory of whichever process runs its task, and moves between processes (Spark executors) only through immutable objects in the store, while the driver keeps which objects are canonical.

Layout under the pipeline's prefix (beside dbsp_core.storage.remote's ``manifest/``, ``db/``, ``log/``)::

    stage/<k>/<w>/<20-digit v>-<token>.delta   what one attempt of a job committed to (stage k, worker w): v-1 -> v
    stage/<k>/<w>/<20-digit v>-<token>.base    a page file (a compacted chain, or a layout change's new state)
    jobs/worker-<w>.input                      the running job's stage-0 blobs of worker w (transient)

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
  4. Compaction: when a chain has :data:`CHAIN_LIMIT` links, or its bytes pass the page file's size, the task
     uploads its page file at ``v`` (quiet: its lock held, no handle open) as a base before running the job,
     under the job's version; the chain becomes that base and the job's delta.
  5. Checkpoints: the manifest (storage.remote invariant 2) carries the chains at the checkpoint's step under
     ``stages`` (captured when the checkpoint is taken, with the steps paused); recovery takes the chains from
     the manifest it restored and replays the logs from its step. Retention deletes ``stage/`` objects named by
     a version at or below the newest manifest's that neither live manifest nor the driver's current chains
     name; a newer object may belong to a job in flight and waits for a later pass.
  6. Layout changes (cold, or the waves of a live one) run on the driver: it rebuilds the old workers'
     databases from their chains in a scratch directory of its own, runs runtime/rescale.py's protocol there,
     and uploads every database of the new layout as a base (the chains restart). That state passes through the
     driver: a known limit of this version.
  7. No path is shared: a task's cache is ``<base>/dbsp-stage-cache/<pipeline key>``, where ``base`` is the
     ``task_cache_dir`` setting or else the Spark executor's own directory (``SPARK_EXECUTOR_DIRS``, YARN's
     ``LOCAL_DIRS``, ``SPARK_LOCAL_DIRS``, the temporary directory); two Spark executors sharing one (one machine)
     is fine: attempts there are serialized by the lock file, and every version is checked by invariant 3.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dbsp_core.codec import frame_head
from dbsp_core.errors import CorruptionError, RecoveryError
from dbsp_core.runtime.job_files import decode_table, encode_table
from dbsp_core.runtime.remote_state import _apply as apply_delta
from dbsp_core.storage.database import JOURNAL_DELETE, JOURNAL_PUT, JOURNAL_STEP, Database
from dbsp_core.storage.formats import JOB_INPUT_MAGIC, REMOTE_DELTA_MAGIC, TMP_SUFFIX
from dbsp_core.storage.remote import Remote, version_of

__all__ = ["StageStore", "StageChains", "Recorder", "CHAIN_LIMIT", "sync_stage_db", "upload_delta", "upload_base",
           "remote_of", "write_job_inputs", "read_job_input", "default_cache_base"]

CHAIN_LIMIT = 16  # links of a chain before a task compacts it (invariant 4)
STAGE_DIR = "stage"
JOBS_DIR = "jobs"
SIDE_SUFFIX = ".chain"
FRESH = "fresh"  # the id of an empty database's first version


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
            write_side(path, {x: ids[x]})
            return "fetched", _apply_links(remote, path, chain[start + 1:], ids), ids
        _remove_db(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not chain:
        write_side(path, {v: FRESH})
        Database.create(path, v).close()
        return "fresh", 0, ids
    got = 0
    first = chain[0]
    if first["kind"] == "base":
        got += remote.get_file(first["object"], path)
        with Database(path) as db:
            if db.versions().stop - 1 != first["to"]:
                raise CorruptionError(f"{remote.shown}/{first['object']}: the page file is at version "
                                      f"{db.versions().stop - 1}, the chain says {first['to']}")
        write_side(path, {first["to"]: first["made"]})
        rest = chain[1:]
    else:
        write_side(path, {first["from"]: FRESH})
        Database.create(path, first["from"]).close()
        rest = chain
    return "rebuilt", got + _apply_links(remote, path, rest, ids), ids


def _apply_links(remote: Remote, path: str, links: list[dict], ids: dict[int, str]) -> int:
    got = 0
    with Database(path) as db:
        for link in links:
            if link["kind"] != "delta":
                raise CorruptionError(f"{remote.shown}/{link['object']}: a base in the middle of a chain")
            data = remote.get(link["object"])
            got += len(data)
            write_side(path, {link["from"]: ids[link["from"]], link["to"]: link["made"]})
            apply_delta(db, link, data, f"{remote.shown}/{link['object']}")
    return got


def upload_delta(remote: Remote, stage: int, worker: int, version: int, rec: Recorder) -> dict:
    """Upload what ``rec`` recorded as the delta leading to ``version`` (invariant 1); returns its link."""
    body = rec.body()
    head = frame_head(REMOTE_DELTA_MAGIC, body)
    name = object_name(stage, worker, version)
    remote.put(name, head + body)
    return {"object": name, "kind": "delta", "from": version - 1, "to": version, "made": name,
            "bytes": len(head) + len(body)}


def needs_compaction(chain: list[dict], path: str) -> bool:
    """Invariant 4: the chain is long (:data:`CHAIN_LIMIT` links), or holds more bytes than the page file."""
    if len(chain) < 2:
        return False
    return len(chain) >= CHAIN_LIMIT or sum(link["bytes"] for link in chain) > max(os.path.getsize(path), 1 << 20)


def upload_base(remote: Remote, path: str, stage: int, worker: int, version: int, made: str,
                at: int | None = None) -> dict:
    """Upload the (quiet) page file at ``path``, at version ``at`` (default ``version - 1``), as a base named by
    the job committing ``version`` (invariant 4); its id stays ``made``. Returns its link."""
    name = object_name(stage, worker, version, base=True)
    n = remote.put_file(name, path)
    to = version - 1 if at is None else at
    return {"object": name, "kind": "base", "to": to, "made": made or name, "bytes": n}


# ---- job inputs through the store ----


def _input_name(worker: int) -> str:
    return f"{JOBS_DIR}/worker-{worker}.input"


def write_job_inputs(remote: Remote, job: dict, blobs: pa.Table, workers: int) -> None:
    """Each worker's stage-0 blobs as one object under the job's description (job_files.py invariant 2: each job
    replaces them; a reader checks the description, and the driver checks every acknowledgement's version)."""
    parts = blobs.column("part").to_numpy()
    for w in range(workers):
        bufs = encode_table(JOB_INPUT_MAGIC, dict(job, worker=w), blobs.filter(pa.array(parts == w)))
        remote.put(_input_name(w), b"".join(bytes(b) for b in bufs))


def read_job_input(remote: Remote, worker: int) -> tuple[dict, pa.Table]:
    name = _input_name(worker)
    tag, table = decode_table(remote.get(name), JOB_INPUT_MAGIC, f"{remote.shown}/{name}")
    if tag.pop("worker", None) != worker:
        raise CorruptionError(f"{remote.shown}/{name}: holds the input of another worker ({tag})")
    return tag, table


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
        self._captured: dict | None = None
        self.scratch: str | None = None  # the driver's own copies of stage databases (invariant 6)

    @staticmethod
    def key(stage: int, worker: int) -> str:
        return f"{stage}/{worker}"

    def chain(self, stage: int, worker: int) -> list[dict]:
        return self.chains.get(self.key(stage, worker), [])

    def entry(self) -> dict:
        return {"version": self.version, "step": self.step, "chains": {k: list(v) for k, v in self.chains.items()}}

    def record(self, acks: list[dict], version: int, step: int) -> None:
        """After a job whose acknowledgements all checked out (invariant 2)."""
        chains = dict(self.chains)  # replaced whole: a checkpoint's retention may be reading the old one
        for a in acks:
            k = self.key(a["stage"], a["worker"])
            chains[k] = ([a["base"]] if a.get("base") else chains.get(k, [])) + [a["delta"]]
        self.chains, self.version, self.step = chains, version, step

    def bytes(self) -> int:
        return sum(link["bytes"] for c in self.chains.values() for link in c)

    # ---- checkpoints (invariant 5) ----

    def capture(self) -> None:
        """The chains at the checkpoint being taken (the steps are paused)."""
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

    # ---- the driver's own copies (invariant 6; also views and traces) ----

    def scratch_dir(self) -> str:
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix="dbsp-stages-")
        return self.scratch

    def materialize(self, path: str, stage: int, worker: int) -> str:
        """Rebuild (stage, worker)'s database at the current version at ``path`` (the driver's scratch)."""
        return sync_stage_db(self.remote, path, self.chain(stage, worker), self.version,
                             f"stage {stage} worker {worker}")[0]

    def upload_all(self, paths: dict[tuple[int, int], str], version: int, step: int) -> None:
        """After a layout change in the scratch directory: every database of the new layout becomes a base at
        ``version`` (invariant 6)."""
        chains = {}
        for (k, w), path in sorted(paths.items()):
            link = upload_base(self.remote, path, k, w, version, "", at=version)
            chains[self.key(k, w)] = [link]
            write_side(path, {version: link["made"]})
        self.chains, self.version, self.step = chains, version, step

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
