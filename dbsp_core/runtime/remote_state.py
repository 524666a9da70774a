"""A durable pipeline whose storage is an object store: rebuilding its local cache directory from the newest manifest when it opens, and uploading each checkpoint (what changed, then the manifest, then retention) when the local one has committed.

The layout in the store and its invariants are dbsp_core.storage.remote's; this module is the driver's side.

Invariants (enforced here):
  1. The local directory is a cache: :func:`restore` empties it (only a directory that is empty or carries the
     ``.dbsp-cache`` marker is accepted) and rebuilds it from the newest complete manifest, so what a pipeline
     recovers never depends on what a crashed process left on local disk. The databases are rebuilt at the
     versions they had (a delta leading from version a to b is applied as one commit, then b - a - 1 empty
     commits), so the layout records and the state versions agree as they did.
  2. Journaling of the cache's databases (dbsp_core.storage.database.Journal) starts after the restore and before
     the driver opens or creates anything, so every commit after the restored manifest is in a journal.
  3. :meth:`RemoteCheckpoints.upload` runs after the local checkpoint committed (state, then driver.db, then the
     logs truncated below it: the previous manifest's log objects stay in the store until it is retired): it
     uploads every database's delta (or its page file when the journal
     cannot lead from the chain's version, or when the chain is past :data:`CHAIN_LIMIT` objects or its bytes
     past the page file's size: compaction), the batch files the state names that no earlier manifest names,
     what the logs part needs durable (its output segments), then the manifest (storage.remote invariant 2), then deletes what the two live
     manifests do not name (invariant 3 there). A failure before the manifest leaves the previous manifest in
     force and the pipeline broken (the driver's rule for a failed checkpoint).
  4. Restore's memory does not grow with an object's size: every object is streamed into a local file in bounded
     reads (Remote.get_file), a delta is checked (its CRC) from that file in bounded reads before any record is
     applied, then applied one record at a time; only one record's value is in memory at once.
  5. The upload runs off the step path: the driver calls :meth:`RemoteCheckpoints.capture` while the local
     checkpoint is committed (the records, the batch files its state names and the logs' position as they are at
     its step; a consumer record removed between the listing and the read, by a consumer unregistering in another
     thread or process, is left out, not an error), then steps go on while :meth:`RemoteCheckpoints.send` uploads
     on the checkpoint thread. At most one upload is in flight: the driver's next checkpoint starts only after it
     (an explicit one waits, the timer's is skipped and its change goes up with the next), so the databases, their
     journals and the batch files the upload reads do not change under it (the embedded executor writes its
     databases only when a checkpoint commits; a live rescale waits for the upload too; the batch store keeps the
     files a checkpoint names until the next one commits, trace/spill.py invariant 13). The local logs may be
     truncated at the local commit: recovery reads the store's log segments, which retention keeps for both live
     manifests (the last uploaded one and the one before), never the local logs. A failed upload breaks the
     pipeline (StoreUnavailableError).
  6. A manifest never lacks a state database its LAYOUT names: :meth:`RemoteCheckpoints.capture` takes the
     databases the upload sends (driver.db and every state database present) and checks them against those the
     LAYOUT it captures names (storage/statefiles.py invariant 1: META's state groups, LAYOUT's workers; LAYOUT is
     the layout in force at the checkpoint, as a live change's last checkpoint writes LAYOUT before driver.db and
     removes a leaving worker's database only after). One that is missing (deleted from the cache while the
     pipeline ran) raises CorruptionError naming it before anything is uploaded: the checkpoint fails, the pipeline
     is broken, and the store keeps its last manifest (the previous checkpoint), from which reopening rebuilds the
     cache and replays the input log. Before, the manifest named the databases present, silently dropping that
     worker's state from the store. A staged executor's state is its stage chains (runtime/stage_store.py), not
     databases in this cache: the check does not apply to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

from dbsp_core import _storage
from dbsp_core.codec import check_framed_file, frame_head
from dbsp_core.errors import CorruptionError, DbspError
from dbsp_core.storage.database import (JOURNAL_DELETE, JOURNAL_PUT, JOURNAL_STEP, Database, end_journals,
                                        journal_of, journal_under)
from dbsp_core.storage.directory import read_layout, read_meta
from dbsp_core.storage.formats import (CACHE_MARKER, CONSUMERS_DIR, DIRECTORY_FORMATS, DRIVER_DB, LAYOUT_FILE,
                                       LOCK_FILE, META_FILE, METRICS_FILE, PROFILE_FILE, REMOTE_DELTA_MAGIC,
                                       REMOTE_MANIFEST_DIR, REMOTE_SPILL_DIR, REMOTE_STATE_DIR, RESCALE_FILE,
                                       SPILL_DIR, state_db_paths)
from dbsp_core.storage.remote import (LogPart, Remote, blob_record, delta_name, manifest_name,
                                      record_blob, spill_name, version_of)
from dbsp_core.storage.remote_log import RemoteLogs
from dbsp_core.storage.statefiles import named_paths, state_groups

__all__ = ["RemoteCheckpoints", "restore", "prepare_cache", "restored", "CHAIN_LIMIT"]

CHAIN_LIMIT = 16  # objects in a database's chain before the next checkpoint uploads its page file instead
JOURNAL_DIR = ".dbsp-journal"  # in the cache: the databases' journals (storage.database.Journal)
RESTORE_DIR = ".dbsp-restore"  # in the cache, while restore runs: the delta objects downloaded, applied, removed
# objects downloaded at once by restore: the downloads wait on the store's latency (pyarrow's S3 client releases the
# GIL), not on the two cores; 4 keep a real store's per-request latency (tens of ms) off the small objects' path
# and cost 4 read buffers of 1 MiB (Remote.GET_CHUNK), while the local S3 server here (one process, one core) is
# saturated well before 4
DOWNLOAD_THREADS = 4
RECORDS = (META_FILE, LAYOUT_FILE, RESCALE_FILE, METRICS_FILE, PROFILE_FILE)

_REC = struct.Struct("<BH")
_KEY = struct.Struct("<H")
_VAL = struct.Struct("<Q")


def _present(path: str) -> bytes | None:
    """The bytes of the file ``path``, or None if it is not there (also when it vanishes between a listing or an
    existence check and this read: a record other threads and processes may remove)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def prepare_cache(cache_dir: str) -> None:
    """Claim ``cache_dir`` (invariant 1): it must be empty or a cache this module made; marks it as one."""
    if os.path.isdir(cache_dir):
        names = os.listdir(cache_dir)
        if names and CACHE_MARKER not in names:
            raise DbspError(f"cache_dir {cache_dir!r} is neither empty nor a dbsp cache directory (no {CACHE_MARKER} "
                            f"marker): give an empty directory; the pipeline's cache is rebuilt from the store there")
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, CACHE_MARKER), "w") as f:
        f.write("a dbsp-core cache of an object store: emptied and rebuilt whenever a pipeline opens it\n")


def _empty(cache_dir: str) -> None:
    """Remove everything in the (claimed and locked) cache but its marker and its lock."""
    for n in os.listdir(cache_dir):
        if n in (CACHE_MARKER, LOCK_FILE):
            continue
        p = os.path.join(cache_dir, n)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def _records(f: Any, end: int) -> Any:
    """The (op, table, key, value) records of a DRDL body (formats.py) read from the open file ``f`` up to offset
    ``end``, one record at a time (invariant 4: never the whole body in memory)."""
    def take(n: int) -> bytes:
        b = f.read(n)
        if len(b) != n:
            raise struct.error(f"{n} bytes wanted, {len(b)} left")
        return b

    while f.tell() < end:
        op, tl = _REC.unpack(take(_REC.size))
        table = take(tl)
        (kl,) = _KEY.unpack(take(_KEY.size))
        key = take(kl)
        value = None
        if op != JOURNAL_DELETE:
            (vl,) = _VAL.unpack(take(_VAL.size))
            value = take(vl)
        yield op, table, key, value
    if f.tell() != end:
        raise struct.error("a record runs past the body's end")


def _apply(db: Database, link: dict, path: str, where: str) -> None:
    """Apply one delta object, downloaded into local file ``path``, to ``db`` (at version ``link['from']``), leaving it
    at ``link['to']`` (invariant 1). The file is checked whole (its CRC) before anything is applied, then read a
    record at a time (invariant 4)."""
    frm, to = link["from"], link["to"]
    if db.versions().stop - 1 != frm:
        raise CorruptionError(f"{where}: a delta from version {frm}, but the database is at {db.versions().stop - 1}")
    with open(path, "rb", buffering=64 << 10) as f:
        n = check_framed_file(REMOTE_DELTA_MAGIC, f, where)
        end = f.tell() + n
        with db.open(frm) as h:
            try:
                for op, table, key, value in _records(f, end):
                    if op == JOURNAL_PUT:
                        h.put(table, key, value)
                    elif op == JOURNAL_DELETE:
                        h.delete(table, key)
                    elif op == JOURNAL_STEP:
                        h.set_step(int.from_bytes(value, "little"))
                    else:
                        raise CorruptionError(f"{where}: unknown record kind {op}")
            except struct.error as e:
                raise CorruptionError(f"{where}: truncated record ({e})") from None
            h.commit()
    for v in range(frm + 1, to):
        with db.open(v) as h:
            h.commit()


def restore(remote: Remote, root: str, log_part: LogPart | None = None) -> dict | None:
    """Rebuild the cache directory ``root`` from the newest complete manifest (invariant 1); returns it, or None
    when the store holds no pipeline (``root`` is left empty but for the marker). The caller claimed ``root``
    (:func:`prepare_cache`) and holds its lock.

    Every object is streamed into a local file (invariant 4) by :data:`DOWNLOAD_THREADS` threads, all objects
    asked for at once; each database's chain is applied in order as its objects arrive (deltas from their
    downloaded files, then removed), so applying overlaps downloading."""
    _empty(root)
    m = remote.newest_manifest()
    if m is None:
        return None
    for name, text in m.get("records", {}).items():
        p = os.path.join(root, *name.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        _storage.file_replace(p, blob_record(text), "posix")
    staging = os.path.join(root, RESTORE_DIR)
    os.makedirs(staging, exist_ok=True)
    spill = os.path.join(root, SPILL_DIR)
    pool = ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="dbsp-restore")
    try:
        chains: list[tuple[str, str, list[tuple[dict, str, Future]]]] = []
        k = 0
        for rel, ent in sorted(m.get("databases", {}).items()):
            path = os.path.join(root, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            links = []
            for i, link in enumerate(ent["chain"]):
                if link["kind"] == "file":
                    if i:
                        raise CorruptionError(f"{remote.shown}/{link['object']}: a page file in the middle of a chain")
                    dst = path
                else:
                    dst = os.path.join(staging, f"{k}.delta")
                    k += 1
                links.append((link, dst, pool.submit(remote.get_file, link["object"], dst, sync=False)))
            chains.append((rel, path, links))
        files = []
        for name, ent in m.get("files", {}).items():
            os.makedirs(spill, exist_ok=True)
            files.append(pool.submit(remote.get_file, ent["object"], os.path.join(spill, name)))
        for rel, path, links in chains:
            db: Database | None = None
            try:
                for i, (link, dst, fut) in enumerate(links):
                    fut.result()
                    where = f"{remote.shown}/{link['object']}"
                    if link["kind"] == "file":
                        db = Database(path)
                        if db.versions().stop - 1 != link["to"]:
                            raise CorruptionError(f"{where}: the page file is at version {db.versions().stop - 1}, "
                                                  f"the manifest says {link['to']}")
                        continue
                    if db is None:
                        if i or not link.get("fresh"):
                            raise CorruptionError(f"{where}: a chain that starts with a delta of a database not new")
                        db = Database.create(path, link["from"])
                    _apply(db, link, dst, where)
                    os.remove(dst)
            finally:
                if db is not None:
                    db.close()
        for fut in files:
            fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(staging, ignore_errors=True)
    if log_part is not None:
        log_part.restore(remote, m, root)
    else:  # a reader: the logs' segments rebuilt here (storage.remote_log)
        reader = RemoteLogs(remote)
        reader.restore(remote, m, root)
        reader.rebuild(root)
    return m


@contextlib.contextmanager
def restored(storage: Any) -> Iterator[tuple[str, dict, Remote]]:
    """For readers (``dbsp inspect/read/profile`` of a store): the newest checkpoint of ``storage`` restored into
    a temporary directory, removed afterwards; yields the directory, the manifest and the Remote.
    RecoveryError if the store holds no pipeline."""
    from dbsp_core.errors import RecoveryError

    tmp = tempfile.mkdtemp(prefix="dbsp-read-")
    try:
        remote = Remote.of(storage, tmp)
        m = restore(remote, tmp)
        if m is None:
            raise RecoveryError(f"{remote.shown} holds no pipeline (no manifest)")
        yield tmp, m, remote
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class RemoteCheckpoints:
    """The object-store side of a durable pipeline: made after :func:`restore` (with the manifest it restored and
    the logs part, storage.remote_log), it journals the cache's databases (invariant 2) and uploads each checkpoint (invariant 3)."""

    def __init__(self, remote: Remote, root: str, manifest: dict | None, log_part: LogPart,
                 lease: dict | None = None) -> None:
        """``lease``: the writer's lease (Remote.take_lease), taken before :func:`restore` read the manifest (taken
        here when None); with a restored ``manifest`` a claim manifest is committed at once (storage.remote
        invariant 6), so call this before the logs are opened."""
        self.remote, self.root, self.manifest = remote, root, manifest
        self.log_part = log_part
        self.lease = lease if lease is not None else remote.take_lease()
        # a staged executor's stage state in the store (runtime/stage_store.py invariant 5): ``covered(step)`` is the
        # manifest's ``stages``, ``retain(remote, live)`` deletes the stage objects no live manifest names
        self.state_part: Any = None
        listed = remote.manifest_versions()  # a damaged newer manifest restore skipped: never written over
        # one version skipped: an older writer's manifest landing late has at most the version after the newest
        # listed one (storage.remote invariant 6)
        self.version = max([0 if manifest is None else manifest["version"]] + listed) + 1
        self.chain_limit = CHAIN_LIMIT
        self.previous: dict | None = None  # the manifest before self.manifest, kept until the next commit
        self.last: dict[str, Any] = {}  # what the last upload did (bytes by kind, seconds): Pipeline.stats["remote"]
        self.totals = {"checkpoints": 0, "bytes": 0, "objects_deleted": 0}
        if manifest is not None:  # the claim: the restored checkpoint under this writer's first version
            claim = dict(manifest, version=self.version + 1, writer=self.lease["generation"])
            claim.pop("written_ns", None)
            claim.pop("format", None)
            self.remote.check_lease(self.lease, f"claim manifest {claim['version']}")
            remote.write_manifest(claim)
            self.previous, self.manifest, self.version = manifest, claim, claim["version"]
        journal_under(root, os.path.join(root, JOURNAL_DIR))

    def close(self) -> None:
        end_journals(self.root)

    def _databases(self) -> list[str]:
        rels = [DRIVER_DB] if os.path.exists(os.path.join(self.root, DRIVER_DB)) else []
        return rels + [os.path.relpath(p, self.root).replace(os.sep, "/") for p in state_db_paths(self.root)]

    def _check_named(self, step: int, databases: list[str]) -> None:
        """Invariant 6: CorruptionError, before anything is uploaded, if a state database the LAYOUT in force names
        is not among ``databases`` (what the upload sends; an embedded executor's: a staged one's state is its
        stage chains)."""
        if self.state_part is not None:
            return
        root = self.root
        layout, _ = read_layout(root)
        groups = state_groups(root, read_meta(root, (1, *DIRECTORY_FORMATS)))
        sent = set(databases)
        rel = [r for r in (os.path.relpath(p, root).replace(os.sep, "/")
                           for p in named_paths(root, groups, layout.workers)) if r not in sent]
        if not rel:
            return
        s = "s" if len(rel) > 1 else ""
        prev = self.manifest or {}
        kept = (f"its manifest {prev['version']} (the checkpoint at step {prev['step']})" if "step" in prev
                else "no manifest of this pipeline")
        raise CorruptionError(
            f"{root}: LAYOUT ({layout.workers} workers, layout epoch {layout.epoch}) names state database{s} "
            f"{', '.join(rel)}, missing from the cache at the checkpoint of step {step} (deleted while the pipeline "
            f"ran): its state is in no other local file. Nothing was uploaded: the store keeps {kept}. Close the "
            f"pipeline and reopen it from the store (Pipeline.open rebuilds the cache from that manifest and replays "
            f"the input log from its step): a cache is rebuilt at every open, so `dbsp repair` of it does not apply")

    def upload(self, step: int, referenced: set[str]) -> dict:
        """Upload the checkpoint at ``step`` that just committed locally; ``referenced`` names the batch files its
        state names. Returns what it uploaded (also :attr:`last`). :meth:`capture` then :meth:`send`."""
        return self.send(self.capture(step, referenced))

    def capture(self, step: int, referenced: set[str]) -> dict:
        """What the checkpoint at ``step`` (just committed locally) needs from the local directory at its commit,
        taken before steps go on (invariant 5): the small records, the batch files its state names, the logs
        part's position (its output steps below ``step`` made durable). Quick: no state object is read."""
        root = self.root
        databases = self._databases()
        self._check_named(step, databases)  # invariant 6: before anything is captured or uploaded
        records = {}
        for name in RECORDS:
            blob = _present(os.path.join(root, name))
            if blob is not None:
                records[name] = record_blob(blob)
        cdir = os.path.join(root, CONSUMERS_DIR)
        for name in sorted(os.listdir(cdir)) if os.path.isdir(cdir) else ():
            p = os.path.join(cdir, name)
            if os.path.isfile(p) and not name.startswith(".") and name != "LOCK" and not name.endswith(".tmp"):
                # a consumer (another thread, or a reader in another process) may unregister, removing its
                # record, between the listing and the read: it is then not in this checkpoint
                blob = _present(p)
                if blob is not None:
                    records[f"{CONSUMERS_DIR}/{name}"] = record_blob(blob)
        b0 = self.remote.stats["put_bytes"]
        logs = self.log_part.covered(step)
        # the stage chains as the executor captured them at the checkpoint's step, steps paused (stage_store inv. 5)
        stages = self.state_part.covered(step) if self.state_part is not None else None
        return {"step": step, "referenced": set(referenced), "records": records, "databases": databases,
                "logs": logs, "stages": stages,
                "log_bytes": self.remote.stats["put_bytes"] - b0, "t0": time.perf_counter()}

    def send(self, captured: dict, before_commit: Callable[[], None] | None = None) -> dict:
        """Upload a :meth:`capture`d checkpoint: what changed, then the manifest (the commit point), then retention
        (invariant 3). May run on its own thread while steps go on (invariant 5); ``before_commit`` runs just
        before the manifest is written (a crash point of the tests)."""
        r, root = self.remote, self.root
        step = captured["step"]
        put0 = r.stats["put_bytes"]
        v = self.version + 1
        prev = self.manifest or {}
        last = {"version": v, "step": step, "delta_bytes": 0, "base_bytes": 0, "spill_bytes": 0,
                "log_bytes": captured["log_bytes"], "changed_bytes": 0, "deltas": 0, "bases": 0, "spill_files": 0}
        dbs: dict[str, dict] = {}
        for rel in captured["databases"]:  # invariant 6: checked by capture
            dbs[rel] = self._upload_db(rel, prev.get("databases", {}).get(rel), v, last)
        files: dict[str, dict] = {}
        old_files = prev.get("files", {})
        for name in sorted(captured["referenced"]):
            if name in old_files:
                files[name] = old_files[name]
                continue
            n = r.put_file(spill_name(name), os.path.join(root, SPILL_DIR, name))
            files[name] = {"object": spill_name(name), "bytes": n}
            last["spill_bytes"] += n
            last["changed_bytes"] += n
            last["spill_files"] += 1
        m = {"version": v, "step": step, "records": captured["records"], "databases": dbs, "files": files,
             "logs": captured["logs"], "writer": self.lease["generation"]}
        if captured.get("stages") is not None:
            m["stages"] = captured["stages"]
        r.check_lease(self.lease, f"commit manifest {v}")  # a newer writer fences this one (storage.remote inv. 6)
        if before_commit is not None:
            before_commit()
        r.write_manifest(m)  # the commit point (storage.remote invariant 2)
        self.previous, self.manifest, self.version = self.manifest, m, v
        last["uploaded_bytes"] = r.stats["put_bytes"] - put0 + captured["log_bytes"]
        last["upload_s"] = time.perf_counter() - captured["t0"]
        last["deleted"] = self._retain()
        self.last = last
        self.totals["checkpoints"] += 1
        self.totals["bytes"] += last["uploaded_bytes"]
        self.totals["objects_deleted"] += last["deleted"]
        return last

    def _upload_db(self, rel: str, old: dict | None, v: int, last: dict) -> dict:
        """Upload database ``rel``'s change since manifest ``old`` names it: a delta, or its page file."""
        path = os.path.join(self.root, *rel.split("/"))
        j = journal_of(path)
        chain = list(old["chain"]) if old else []
        if j is None:
            raise DbspError(f"{path}: not journaled; the object store's checkpoint cannot tell what changed")
        sealed, start, to, valid, fresh = j.take()
        try:
            size = os.path.getsize(sealed)
            chain_bytes = sum(link["bytes"] for link in chain)
            follows = (old is not None and old["version"] == start) or (old is None and fresh)
            page_bytes = os.path.getsize(path)
            if valid and follows and len(chain) < self.chain_limit and chain_bytes + size <= max(page_bytes, 1 << 20):
                if start == to and old is not None:  # nothing committed since
                    return old
                with open(sealed, "rb") as f:
                    body = f.read()
                obj = delta_name(rel, v)
                head = frame_head(REMOTE_DELTA_MAGIC, body)
                self.remote.put(obj, head + body)
                link = {"object": obj, "kind": "delta", "from": start, "to": to, "bytes": len(head) + len(body)}
                if old is None:
                    link["fresh"] = True
                last["delta_bytes"] += link["bytes"]
                last["changed_bytes"] += size
                last["deltas"] += 1
                return {"version": to, "chain": chain + [link]}
            # compaction, or a journal that cannot lead from the chain's version: the page file as it is (quiet
            # until the next commit: the executor writes its databases only when a checkpoint commits)
            obj = delta_name(rel, v, base=True)
            n = self.remote.put_file(obj, path)
            j.restart(to)
            last["base_bytes"] += n
            last["changed_bytes"] += size
            last["bases"] += 1
            return {"version": to, "chain": [{"object": obj, "kind": "file", "to": to, "bytes": n}]}
        finally:
            os.remove(sealed)

    def _newer(self, name: str) -> bool:
        """Whether state object ``name`` carries a version above this writer's newest (a newer writer's upload)."""
        base = name.rsplit("/", 1)[-1].split(".", 1)[0]
        v = version_of(base)
        return v is not None and v > self.version

    def _retain(self) -> int:
        """Delete what neither live manifest names (storage.remote invariant 3); returns how many objects."""
        r = self.remote
        r.check_lease(self.lease, "delete objects no live manifest names")
        live = [m for m in (self.previous, self.manifest) if m is not None]
        keep = r.live_names(live)
        n = 0
        for prefix in (REMOTE_STATE_DIR, REMOTE_SPILL_DIR):
            for name in r.list(prefix):
                if name not in keep and not self._newer(name):
                    r.delete(name)
                    n += 1
        oldest = live[0]["version"]
        for name in r.list(REMOTE_MANIFEST_DIR):
            ver = version_of(name.rsplit("/", 1)[-1])
            if ver is not None and ver < oldest:
                r.delete(manifest_name(ver))
                n += 1
        self.log_part.retain(r, live)
        if self.state_part is not None:
            n += self.state_part.retain(r, live)
        return n
