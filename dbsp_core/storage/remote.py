"""A durable pipeline's home in an object store (``storage="s3://..."``): the layout of its objects, the manifest that commits each checkpoint, and the :class:`Remote` that reads and writes them beside the local cache directory.

The store is the durable home; the local directory (``cache_dir``) is a cache the pipeline runs on exactly as
on a local storage directory (dbsp_core.storage.formats), rebuilt from the store whenever a pipeline opens.

Layout of one pipeline under its prefix (``REMOTE_*`` in dbsp_core.storage.formats)::

    <prefix>/
      manifest/<20-digit version>          one per committed checkpoint (DRMF, JSON): the commit point
      db/<db>/<20-digit version>.delta  a database's change committed between two checkpoints (DRDL)
      db/<db>/<20-digit version>.base   a database's page file as it is at a checkpoint (a compacted chain)
      spill/<name>.batch                   a batch file a checkpoint names (trace/batchfile.py), uploaded as is
      log/input/...                        the input log's segment objects (the logs part: see below)
      log/output/...                       the output log's segment objects (the logs part)
      writer/<20-digit generation>         one lease per writer that opened the prefix (DRWL, JSON; invariant 6)

``<db>`` is a database's path in the local directory with ``/`` kept (``driver.db``, ``state/worker-0.db``).

Invariants (enforced here and by the checkpoint upload in dbsp_core.runtime.remote_state):
  1. Objects are immutable: every object is written once, whole, by one PUT under a name never used before
     (versions only grow; batch file names carry a random token), and never rewritten. Object stores have no
     append and no rename, so nothing relies on either.
  2. A checkpoint commits when its manifest object lands: it is written last, under version N+1 when N is the
     newest manifest (a new writer's claim skips one, invariant 6), after every object it names is durable. A manifest names everything recovery needs: the
     small records of the directory (META, LAYOUT, consumers, METRICS, PROFILE) inline, for each database the
     chain of delta objects (a base, then deltas) whose replay gives its content at the checkpoint, the batch
     files its state names, what the logs part records (``logs``) and the writer generation that committed it
     (``writer``, invariant 6). A checkpoint that crashes before its
     manifest leaves objects no manifest names (deleted by the next retention pass) and the previous manifest
     in force.
  3. Readers take the newest complete manifest: the highest version whose object reads back with a valid
     checksum. The previous manifest is kept until the next one commits (so a reader that listed just before a
     commit still finds the one it chose); retention then deletes manifests older than the previous one and
     every object under ``db/`` and ``spill/`` that neither of the two live manifests names.
  4. A checkpoint uploads only what no earlier checkpoint uploaded: for a database, one delta object holding the
     values put and the keys deleted by the commits since the previous checkpoint (recorded as they are written,
     :class:`dbsp_core.storage.database.Journal`), so the bytes uploaded follow the change, not the state; a batch
     file once (it is immutable and named by its content's token). The page file itself is never uploaded: it is
     updated in place, except to compact a chain: when it has 16 objects (remote_state.CHAIN_LIMIT) or its bytes
     pass the page file's size, or the journal cannot lead from the chain's version, the checkpoint uploads the
     page file as the chain's new base (``.base``; quiet then: the embedded executor writes its databases only
     when a checkpoint commits), and retention drops the old chain.
  5. Credentials never appear in what is logged, raised or written: messages name the store by
     :attr:`Location.shown`, and manifests hold object names relative to the prefix only.
  6. One writer per prefix, the newest: a pipeline that opens a prefix to write takes the next writer generation
     G (one above the highest lease object under ``writer/``) by writing the lease ``writer/<20-digit G>`` (its
     host, process, a random token) before it reads the newest manifest, and before each manifest commit (and
     each retention pass) checks that no higher generation exists and that ``writer/G`` still holds its token;
     otherwise it stops with StoreFencedError and writes nothing more. A store has no lock and a dead writer
     looks like a live one, so the newer writer wins (a restarted process must not wait out a lease) and the
     older one is refused at its next commit. The older one may have passed its check just before the newer
     lease landed: at most that one manifest lands late, under a version at most one above what the newer writer
     listed, so the newer writer skips that version and commits a claim manifest (a copy of the one it restored,
     naming the same objects) at once, before its logs are opened: a late manifest of the older writer is never
     the newest. The log shippers run the same check after each segment PUT, before its records are acknowledged
     (storage.logstore invariant 2b): a push the older writer acknowledges is in the newer writer's history, and
     a push it can no longer make durable there raises StoreFencedError instead. Two writers opening in the same
     instant may take the same generation: the token check fences the one whose lease was overwritten at its
     first acknowledgement or commit.

What the logs part provides (dbsp_core.storage.remote_log, plugged in as a :class:`LogPart`): the
input and output logs as segment objects under ``log/`` with group commit, and
  - ``covered(step) -> dict``: called during a checkpoint at ``step`` after the local output log is flushed and
    before the manifest is written; makes durable in the store every output step below ``step`` and returns
    JSON for the manifest's ``logs`` (the segment objects recovery reads: input records from ``step`` on, output
    steps up to the newest). The input log in the store must hold every acknowledged push (group commit), so a
    recovery from this manifest replays every step after it.
  - ``restore(remote, manifest, root)``: before recovery opens ``root`` (an empty cache with the manifest's
    records and databases in place), brings the input and output logs of ``manifest["logs"]`` into
    ``root/input`` and ``root/output`` as the local StepLog and OutputLog read them.
  - ``retain(remote, live)``: after a manifest commits, deletes the log objects that no manifest in ``live``
    (the two newest) and no unacknowledged consumer needs.
dbsp_core.storage.remote_log.RemoteLogs is that part (over storage.logstore).
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from dbsp_core.codec import decode_json, encode_json
from dbsp_core.errors import (CorruptionError, DbspError, FormatVersionError, StorageError, StoreFencedError,
                              StoreUnavailableError)
from dbsp_core.storage import retry
from dbsp_core.storage.formats import (REMOTE_BASE_SUFFIX, REMOTE_DELTA_SUFFIX, REMOTE_LOG_DIR,
                                       REMOTE_MANIFEST_DIR, REMOTE_MANIFEST_FORMAT, REMOTE_MANIFEST_MAGIC,
                                       REMOTE_SPILL_DIR, REMOTE_STATE_DIR, REMOTE_WRITER_DIR, REMOTE_WRITER_MAGIC)
from dbsp_core.storage.location import Location, resolve
from dbsp_core.storage.retry import DEFAULT_POLICY

__all__ = ["Remote", "LogPart", "StoreOptions", "manifest_name", "delta_name", "is_remote", "version_of"]

log = logging.getLogger(__name__)

T = TypeVar("T")

GET_CHUNK = 1 << 20  # the largest read of one downloaded object (Remote.get_file): what a download holds in memory


@dataclass(frozen=True)
class StoreOptions:
    """How a pipeline talks to its object store (``Pipeline(..., store_options=StoreOptions(...))``).

    Parameters
    ----------
    attempts : int
        Calls one store operation (a PUT, GET, LIST or DELETE) may take before the pipeline stops with
        ``StoreUnavailableError`` (default 6; >= 1). Only transient failures are retried (storage/retry.py).
    first_delay_s, max_delay_s : float
        The wait before the first retry, doubling up to ``max_delay_s`` (defaults 0.05 and 2.0 s), each with up to
        50% random jitter: with the defaults a store that stays down stops the pipeline after about 2 to 3 s.
    group_commit_s : float
        How long the first push waiting for the input log's next segment object waits for others to share its PUT
        (default 0.002 s; 0 to 1). Pushes arriving while a PUT is in flight share the next one anyway; a longer
        window means fewer, larger PUTs and a longer acknowledgement (storage/logstore.py invariant 3).

    >>> StoreOptions(attempts=3, group_commit_s=0.01).policy().attempts
    3
    >>> StoreOptions(attempts=0)
    Traceback (most recent call last):
    ...
    ValueError: StoreOptions: attempts must be an int >= 1, got 0
    """

    attempts: int = DEFAULT_POLICY.attempts
    first_delay_s: float = DEFAULT_POLICY.first_delay_s
    max_delay_s: float = DEFAULT_POLICY.max_delay_s
    group_commit_s: float = 0.002

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"StoreOptions: attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("first_delay_s", "max_delay_s", "group_commit_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"StoreOptions: {name} must be a number of seconds >= 0, got {v!r}")
        if self.first_delay_s > self.max_delay_s:
            raise ValueError(f"StoreOptions: first_delay_s ({self.first_delay_s!r}) must not exceed max_delay_s "
                             f"({self.max_delay_s!r})")
        if self.group_commit_s > 1:
            raise ValueError(f"StoreOptions: group_commit_s is a window in seconds up to 1 (every push waits for "
                             f"it), got {self.group_commit_s!r}")

    def policy(self) -> retry.RetryPolicy:
        """The retry policy of every store call."""
        return retry.RetryPolicy(self.attempts, float(self.first_delay_s), float(self.max_delay_s))


def is_remote(where: Any) -> bool:
    """Whether ``storage=`` names an object store (a URI other than ``file://``) rather than a local directory."""
    if isinstance(where, pafs.FileSystem):
        return not isinstance(where, pafs.LocalFileSystem)
    if isinstance(where, (str, os.PathLike)):
        s = os.fspath(where)
        return isinstance(s, str) and "://" in s and not s.startswith("file://")
    return False


def manifest_name(version: int) -> str:
    """The object name of manifest ``version`` (invariant 2).

    >>> manifest_name(7)
    'manifest/00000000000000000007'
    """
    return f"{REMOTE_MANIFEST_DIR}/{version:020d}"


def version_of(name: str) -> int | None:
    """The version of a manifest object's base name, None if it is not one (a stray object is ignored).

    >>> version_of("00000000000000000007"), version_of("x.tmp")
    (7, None)
    """
    return int(name) if len(name) == 20 and name.isdigit() else None


def delta_name(db: str, version: int, base: bool = False) -> str:
    """The object name of database ``db``'s delta (or base) uploaded by the checkpoint of manifest ``version``.

    >>> delta_name("state/worker-0.db", 3), delta_name("driver.db", 4, base=True)
    ('db/state/worker-0.db/00000000000000000003.delta', 'db/driver.db/00000000000000000004.base')
    """
    return f"{REMOTE_STATE_DIR}/{db}/{version:020d}{REMOTE_BASE_SUFFIX if base else REMOTE_DELTA_SUFFIX}"


def spill_name(file: str) -> str:
    """The object name of batch file ``file`` (a name in the local spill directory)."""
    return f"{REMOTE_SPILL_DIR}/{file}"


class Remote:
    """A pipeline's prefix in an object store (a :class:`Location`) and its local cache directory.

    Every store call goes through :meth:`call`: retried while it fails transiently (dbsp_core.storage.retry,
    ``policy``), then StoreUnavailableError; any other error of the store becomes StorageError.
    """

    def __init__(self, location: Location, cache_dir: str) -> None:
        if location.local:
            raise ValueError(f"Remote: {location.shown} is a local directory, not an object store")
        self.location = location
        self.cache_dir = cache_dir
        self.stats = {"puts": 0, "put_bytes": 0, "gets": 0, "get_bytes": 0, "deletes": 0, "lists": 0}
        self._stats_lock = threading.Lock()  # restore downloads on several threads, the upload runs on its own
        self._pool: ThreadPoolExecutor | None = None  # check_lease's second request
        self.policy = DEFAULT_POLICY

    def _count(self, op: str, n: int = 0) -> None:
        """Count one call of ``op`` (``puts``, ``gets``, ``deletes``, ``lists``) moving ``n`` bytes."""
        with self._stats_lock:
            self.stats[op] += 1
            if op in ("puts", "gets"):
                self.stats[op[:-1] + "_bytes"] += n

    @classmethod
    def of(cls, storage: Any, cache_dir: str) -> "Remote":
        """The Remote of ``storage=``: a URI, or a ``pyarrow.fs.FileSystem`` whose root is the prefix (e.g. a
        ``SubTreeFileSystem``, or ``PyFileSystem(FSSpecHandler(...))``)."""
        if isinstance(storage, pafs.FileSystem):
            name = f"{storage.type_name}://"
            return cls(Location(storage, "", False, name, name), cache_dir)
        return cls(resolve(storage, what="storage"), cache_dir)

    @property
    def shown(self) -> str:
        return self.location.shown

    def path(self, name: str) -> str:
        base = self.location.path.rstrip("/")
        return f"{base}/{name}" if base else name

    def call(self, op: str, name: str, fn: Callable[[], T]) -> T:
        """Run one store operation ``op`` (PUT, GET, LIST, DELETE) on object ``name``; errors of the store become
        StorageError naming the object by its secret-free name (invariant 5)."""
        try:
            return retry.call(fn, f"{op} {name}", self.location, self.policy)
        except (FileNotFoundError, StoreUnavailableError):
            raise
        except (OSError, pa.ArrowException) as e:
            raise StorageError(f"{op} {self.shown}/{name}: {_masked(str(e), self)}") from None

    def put(self, name: str, data: bytes | memoryview | pa.Buffer) -> None:
        """Write object ``name`` whole with one PUT (invariant 1)."""
        def go() -> None:
            with self.location.fs.open_output_stream(self.path(name)) as f:
                f.write(data)
        self.call("PUT", name, go)
        self._count("puts", len(memoryview(data)) if not isinstance(data, pa.Buffer) else data.size)

    def put_file(self, name: str, path: str, chunk: int = 8 << 20) -> int:
        """Upload local file ``path`` as object ``name`` (streamed); returns its size."""
        def go() -> int:
            n = 0
            with open(path, "rb") as src, self.location.fs.open_output_stream(self.path(name)) as f:
                while True:
                    b = src.read(chunk)
                    if not b:
                        return n
                    f.write(b)
                    n += len(b)
        n = self.call("PUT", name, go)
        self._count("puts", n)
        return n

    def get(self, name: str) -> bytes:
        """The whole content of object ``name``; FileNotFoundError if there is none."""
        def go() -> bytes:
            with self.location.fs.open_input_stream(self.path(name)) as f:
                return f.readall()
        data = self.call("GET", name, go)
        self._count("gets", len(data))
        return data

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of object ``name`` from ``offset`` (one ranged GET); CorruptionError if the object is
        shorter, FileNotFoundError if there is none."""
        def go() -> bytes:
            with self.location.fs.open_input_file(self.path(name)) as f:
                return f.read_at(length, offset)
        data = self.call("GET", name, go)
        self._count("gets", len(data))
        if len(data) != length:
            raise CorruptionError(f"{self.shown}/{name}: {len(data)} bytes at {offset}, expected {length} (a shorter "
                                  "object: another writer replaced it)")
        return data

    def get_file(self, name: str, path: str, chunk: int | None = None, sync: bool = True) -> int:
        """Download object ``name`` into local file ``path`` in ``chunk``-byte reads, never whole in memory (written
        to ``path.tmp``, fsynced unless ``sync`` is false, renamed). Safe to call from several threads."""
        tmp = path + ".tmp"
        chunk = chunk or GET_CHUNK

        def go() -> int:
            n = 0
            with self.location.fs.open_input_stream(self.path(name)) as f, open(tmp, "wb") as dst:
                while True:
                    b = f.read(chunk)
                    if not b:
                        break
                    dst.write(b)
                    n += len(b)
                if sync:
                    dst.flush()
                    os.fsync(dst.fileno())
            return n
        n = self.call("GET", name, go)
        os.replace(tmp, path)
        self._count("gets", n)
        return n

    def list(self, prefix: str) -> dict[str, int]:
        """``{object name: size}`` of every object under ``prefix`` (a directory of the layout)."""
        def go() -> list[pafs.FileInfo]:
            sel = pafs.FileSelector(self.path(prefix), allow_not_found=True, recursive=True)
            return self.location.fs.get_file_info(sel)
        infos = self.call("LIST", prefix, go)
        self._count("lists")
        base = self.location.path.rstrip("/")
        base = base + "/" if base else ""
        return {i.path[len(base):]: i.size for i in infos if i.type == pafs.FileType.File and i.path.startswith(base)}

    def delete(self, name: str) -> None:
        """Delete object ``name`` (a missing one is fine)."""
        def go() -> None:
            try:
                self.location.fs.delete_file(self.path(name))
            except FileNotFoundError:
                pass
        self.call("DELETE", name, go)
        self._count("deletes")

    # ---- manifests (invariants 2 and 3) ----

    def manifest_versions(self) -> list[int]:
        """The versions of the manifest objects in the store, ascending."""
        names = self.list(REMOTE_MANIFEST_DIR)
        return sorted(v for v in (version_of(n.rsplit("/", 1)[-1]) for n in names) if v is not None)

    def read_manifest(self, version: int) -> dict:
        """Manifest ``version``; CorruptionError if it does not read back whole (checksum, magic, fields)."""
        name = manifest_name(version)
        where = f"{self.shown}/{name}"
        m = decode_json(REMOTE_MANIFEST_MAGIC, self.get(name), where)
        if not isinstance(m, dict) or m.get("version") != version:
            raise CorruptionError(f"{where}: not the manifest of version {version}")
        if m.get("format") != REMOTE_MANIFEST_FORMAT:
            raise FormatVersionError(f"{where}: manifest format {m.get('format')!r}, this build reads "
                                     f"{REMOTE_MANIFEST_FORMAT}")
        return m

    def newest_manifest(self) -> dict | None:
        """The newest complete manifest (invariant 3), None if the store holds no pipeline. A damaged newest one
        is logged and skipped (the previous one is kept until the next commit for this)."""
        for v in reversed(self.manifest_versions()):
            try:
                return self.read_manifest(v)
            except (CorruptionError, FileNotFoundError) as e:
                log.warning("%s: skipping manifest %d: %s", self.shown, v, e)
        return None

    def write_manifest(self, manifest: dict) -> int:
        """Write ``manifest`` under its ``version`` (the commit point of a checkpoint, invariant 2)."""
        v = manifest["version"]
        body = dict(manifest, format=REMOTE_MANIFEST_FORMAT, written_ns=time.time_ns())
        self.put(manifest_name(v), encode_json(REMOTE_MANIFEST_MAGIC, body))
        return v

    # ---- the writer's lease (invariant 6) ----

    def writer_generations(self) -> list[int]:
        """The generations of the lease objects under ``writer/``, ascending."""
        names = self.list(REMOTE_WRITER_DIR)
        return sorted(v for v in (version_of(n.rsplit("/", 1)[-1]) for n in names) if v is not None)

    def take_lease(self) -> dict:
        """Write the lease of the next writer generation (invariant 6); returns it (``generation``, ``token``,
        ``host``, ``pid``, ``started_ns``)."""
        gens = self.writer_generations()
        lease = {"generation": (gens[-1] if gens else 0) + 1, "token": uuid.uuid4().hex,
                 "host": socket.gethostname(), "pid": os.getpid(), "started_ns": time.time_ns()}
        self.put(_lease_name(lease["generation"]), encode_json(REMOTE_WRITER_MAGIC, lease))
        return lease

    def check_lease(self, lease: dict, what: str) -> None:
        """Raise StoreFencedError unless ``lease`` is still the newest writer's (invariant 6); ``what`` says what
        was about to happen (e.g. "commit manifest 7"). The LIST of the leases and the GET of this writer's run at
        once (a check follows every log segment PUT: storage.logstore invariant 2b)."""
        g = lease["generation"]
        with self._stats_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dbsp-lease")
        got = self._pool.submit(self._lease_or_none, g)
        gens = self.writer_generations()
        mine = got.result()
        newer = [v for v in gens if v > g]
        other = None
        if newer:
            other = self._lease_or_none(newer[-1])
        elif mine is None or mine.get("token") != lease["token"]:
            other = mine or {"generation": g}
        if other is None:
            return
        who = (f"generation {other.get('generation')} (host {other.get('host', '?')}, pid {other.get('pid', '?')})"
               if other else "another writer")
        raise StoreFencedError(
            f"{self.shown}: {who} opened this prefix after this pipeline (writer generation {g}): this pipeline "
            f"stops before it would {what}, so it cannot write over the newer writer's checkpoints. Run one "
            f"pipeline per prefix; the newer one continues from the store")

    def _lease_or_none(self, generation: int) -> dict | None:
        name = _lease_name(generation)
        try:
            got = decode_json(REMOTE_WRITER_MAGIC, self.get(name), f"{self.shown}/{name}")
        except (FileNotFoundError, CorruptionError):
            return None
        return got if isinstance(got, dict) else None

    def live_names(self, manifests: list[dict]) -> set[str]:
        """Every object under ``db/`` and ``spill/`` that one of ``manifests`` names."""
        out: set[str] = set()
        for m in manifests:
            for d in m.get("databases", {}).values():
                out.update(link["object"] for link in d["chain"])
            out.update(f["object"] for f in m.get("files", {}).values())
        return out


def _lease_name(generation: int) -> str:
    return f"{REMOTE_WRITER_DIR}/{generation:020d}"


def record_blob(data: bytes) -> str:
    """A small record file's bytes as the manifest holds them inline."""
    return base64.b64encode(data).decode("ascii")


def blob_record(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _masked(msg: str, remote: Remote) -> str:
    """An error text of the store without the URI's secrets (invariant 5): pyarrow names paths, not URIs, but an
    error may quote the query string."""
    return msg if "?" not in msg else msg.split("?", 1)[0] + "?..."


class LogPart(Protocol):
    """What the logs part plugs in (see the module docstring)."""

    def covered(self, step: int) -> dict: ...

    def restore(self, remote: Remote, manifest: dict, root: str) -> None: ...

    def retain(self, remote: Remote, live: list[dict]) -> None: ...
