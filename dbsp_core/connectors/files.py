"""A source that turns new Parquet, CSV and JSON-lines files in a directory into pushes, with ``(file, row group)`` as ``(producer, seq)``, so a restart neither skips nor repeats a file.

Invariants (enforced here):
  1. Each file is producer ``<name>:<path relative to the directory>``; a Parquet file pushes one batch per row
     group with ``seq`` = the row group's index (0, 1, ...); a CSV or JSON-lines file pushes itself whole as
     ``seq`` 0. The pipeline's dedup (driver invariant 2) counts each ``(producer, seq)`` once, so a restart
     that pushes a file again (all of it, or the row groups after a crash mid-file) changes nothing it had
     recorded, and a row group is skipped without reading once the pipeline acknowledges it.
  2. The name is unique per source: by default ``<input>@<real path of the directory>``, the same whenever the
     source is made again with the same arguments (so a restart resumes its producers); two live sources on
     one pipeline with one name and different inputs or directories are refused. A file begun under the former
     default name ``files`` (a storage directory of an earlier release) finishes under that name.
  3. Files are taken in name order, and only complete ones: a file appears by an atomic rename into the
     directory; names starting with ``.`` or ``_`` (temporary files, markers, ``_quarantine``) are never read.
     A file must not change once it has appeared (its row groups are its identity): one rewritten under a name
     this source has read (another inode, size or modification time) is not read again, but logged as a
     warning and counted (``rewritten``). Only what this process has seen is compared: a file rewritten while
     no source ran goes unnoticed. In a local directory (invariant 10) a file replaced by a rename (another
     inode in the listing) is reported at the next poll; one rewritten in place (same inode) when its turn
     comes: each poll checks the identity of REWRITE_CHECKS of the files read, in turn, so with N files read
     such a rewrite is reported within ceil(N / REWRITE_CHECKS) polls (at the next one while N <=
     REWRITE_CHECKS).
  4. Rows are taken by the input's column names (extra columns are ignored) and cast safely to the input's types;
     an integer ``weight`` column, if present, gives the rows' weights (-1 deletes). A file is read and converted
     whole before any of it is pushed (a Parquet file with several row groups left to push is decoded twice, unless
     it was read ahead: invariant 9 keeps its tables), so a file that cannot be read or does not fit (corrupt, empty,
     a missing column, a value the input's type cannot hold) pushes nothing that was not already recorded. It is
     named in an InputFileError and, by ``on_error``, stops the poll (``"raise"``: the files after it wait), or is
     logged, counted (``bad_files``) and passed over: ``"skip"`` leaves it in place (tried again if it is replaced,
     or after a restart), ``"quarantine"`` moves it under ``quarantine_dir`` beside ``<file>.error``, the reason.
  5. The directory may be on an object store: a URI (``s3://bucket/prefix?endpoint_override=...``, ``gs://``,
     ``hdfs://``) or a path with ``filesystem=`` a ``pyarrow.fs.FileSystem`` (dbsp_core.storage.location). Files
     are listed and read through ``pyarrow.fs``; a file's identity there is its size and modification time (no
     inode); quarantine copies the object and deletes the original (object stores have no rename). The default
     name uses the URI without its query or credentials, so a restart with other credentials resumes.
  6. Immutable files (``immutable_files=True``, local directories only; the default is False): the source
     declares that a file, once it appears, is never changed, moved or deleted until a checkpoint covers every
     step its pushes are in (``Pipeline.checkpoint()`` returned after those steps; for a view that is an input
     logged by reference, outputlog.py invariant 7, until the output log no longer holds them). Each push is then
     logged in the input log as a reference to its unit (path, row group, identity, CRC-32C of the unit's bytes:
     dbsp_core.storage.fileref) instead of its rows, so a durable push costs a read of the unit's bytes instead
     of encoding, writing and fsyncing its rows; recovery reads the rows again from the file and refuses, with a
     RecoveryError naming the file, one that vanished or whose bytes differ. Such a push is acknowledged before
     its record's fsync (driver invariant 1): a crash may lose it, and then it is not acknowledged after the
     restart, so this source pushes it again from the file. A file that changes while it is read
     for such a push is an InputFileError (invariant 4), never logged by a checksum of other bytes. With the
     default, every push logs its rows and the file may go as soon as its pushes are acknowledged.
  7. On a pipeline in memory (no ``storage=``) the source pushes each unit once per process, without a producer
     or seq (there is no dedup, and nothing to resume after a restart): for runs measured against the same
     files read durably (bench/), and for tests.
  8. The source's counters (``stats``) are part of ``Pipeline.metrics()["sources"][name]`` and of the Prometheus
     text (dbsp_core.metrics) while the pipeline object lives; a source made again (same name, input and
     directory) counts on in the same counters.
  9. Read-ahead (``read_ahead=``, default READ_AHEAD = 2 files): while a file is pushed and, between polls, while
     the pipeline steps, the next pending files (in name order) are read and converted on one background thread
     of the source (pyarrow's readers release the GIL), at most ``read_ahead`` files and, as long as they are
     held, at most ``read_ahead_bytes`` (default READ_AHEAD_BYTES; with a pipeline ``memory_limit``, at most
     READ_AHEAD_SHARE of it) counted as each file's size until it is parsed and then as its tables' bytes: a file
     that would go beyond is read at its turn instead. Only the read moves ahead (with immutable files on a
     durable pipeline, invariant 6, the references too, on a second thread of the source beside the read, so
     the read's chain is not lengthened: each unit's identity is taken before its checksum, and the push checks
     the identity again at the file's turn, fileref invariant 2, so a file replaced meanwhile is read again at
     its turn or refused as changed): every push is still made on
     the caller's thread, in name order, at the file's turn, with its ``(producer, seq)`` unchanged, and a
     file's parsed tables are used only if its identity (invariant 3) and producer are still those taken when
     its read began (else it is read again at its turn). A read's error is kept and raised at the file's turn on
     the caller's thread, where invariant 4 handles it as before (``on_error``: earlier files pushed, the later
     ones wait or go on); a file parsed ahead but not pushed is simply read again after a restart or a
     ``close()``, so exactly once rests on invariant 1 as before. ``close()`` (or leaving a ``with`` block) drops
     what is parsed ahead and joins the thread; a later ``poll()`` starts it again. ``read_ahead=0`` reads every
     file at its turn on the caller's thread, as before.
 10. A poll costs O(new files), not O(files read) (a local directory): each directory's listing (names, and the
     inode each entry names: readdir's, no stat) is kept between polls with the directory's identity (inode,
     modification and change time) and reused while a stat of the directory shows the same identity, provided
     its last change was at least LISTING_MARGIN_NS older than the listing (a change within the same tick of a
     coarse or whole-second clock then cannot leave the identity unchanged). A directory changed, or changed too
     recently to trust, is listed again; a file read whose listed inode differs from the former listing's is
     stat'ed and compared (invariant 3), and the files not yet read are kept in name order between listings. So a
     poll makes one stat per directory, REWRITE_CHECKS stats of files read (invariant 3), one per file passed
     over (``on_error``: a replaced one is read again at the next poll) and those of its new files; listing
     again costs a readdir, no stat per file. What it rests on: a directory's change time moves whenever an
     entry is added, removed or renamed (POSIX), and the host's clock and the file system's agree within
     LISTING_MARGIN_NS (on NFS, within the client's attribute cache as before). An object store (invariant 5)
     is listed at every poll, its listing giving each file's identity.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dbsp_core import metrics
from dbsp_core.connectors.inputs import source_input
from dbsp_core.errors import InputFileError, SchemaError
from dbsp_core.storage.fileref import convert, read_checked, read_unit, reference, unit_zset
from dbsp_core.storage.location import Location, resolve

__all__ = ["FileSource"]

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl",
           ".ndjson": "jsonl"}
ON_ERROR = ("raise", "skip", "quarantine")
LEGACY_NAME = "files"  # the default name before names were unique per source (invariant 2)
QUARANTINE = "_quarantine"

# what reading or converting a bad file raises (a vanished file, FileNotFoundError, is not a bad file)
_BAD = (pa.ArrowException, SchemaError, OSError, UnicodeDecodeError)

READ_AHEAD = 2  # files read ahead by default (invariant 9)
READ_AHEAD_BYTES = 256 << 20  # bytes held ahead by default (invariant 9)
READ_AHEAD_SHARE = 0.125  # at most this share of a pipeline's memory_limit is held ahead (invariant 9)
REWRITE_CHECKS = 16  # files read whose identity each poll checks, in turn (invariant 3)
LISTING_MARGIN_NS = 2_000_000_000  # a listing is reused only if the directory changed this long before (invariant 10)


class _Listing(NamedTuple):
    """One directory's listing kept between polls (invariant 10)."""
    ident: tuple  # the directory's inode, modification and change time when it was listed
    trusted: bool  # its last change was at least LISTING_MARGIN_NS before the listing: reusable while ident holds
    files: dict[str, int]  # relative path -> the inode its entry named (readdir's d_ino) of the files it may read
    dirs: list[str]  # its subdirectories to list (recursive), relative


class _Ahead(NamedTuple):
    """A file being read ahead (invariant 9): what its read began with, and the read."""
    rel: str
    sig: tuple
    producer: str
    future: Future
    estimate: int  # its size on disk, the bytes it is counted as until parsed
    refs: Future | None = None  # with immutable files on a durable pipeline: its units' references (invariant 9)

    def held(self) -> int:
        if self.future.done() and not self.future.cancelled() and self.future.exception() is None:
            got = self.future.result()
            return got[2] if got is not None else 0
        return self.estimate


def _shutdown(pool: list, wait: bool = True) -> None:
    """Stop a source's read-ahead threads (``pool`` holds their executors: the read's, the references'); with
    ``wait``, join them. (A source collected without close() stops them without waiting: the collection may
    happen on one of those very threads.)"""
    for i, ex in enumerate(pool):
        if ex is not None:
            ex.shutdown(wait=wait, cancel_futures=True)
            pool[i] = None


def _signature(where: Location, path: str) -> tuple[int, int, int]:
    """A file's identity (invariant 3): inode, size and modification time; on an object store (invariant 5)
    size and modification time."""
    if where.local:
        st = os.stat(path)
        return st.st_ino, st.st_size, st.st_mtime_ns
    info = where.info(path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(path)
    return 0, info.size, info.mtime_ns or 0


class FileSource:
    """Pushes the files of ``directory`` into input ``handle`` of a durable pipeline (module docstring).

    Parameters
    ----------
    pipeline
        A durable ``dbsp_core.Pipeline`` (``storage=``): exactly once rests on its ``(producer, seq)`` dedup. In
        memory, each unit is pushed once per process (invariant 7).
    handle
        The input the rows go to.
    directory
        The directory to watch (files directly in it; subdirectories too with ``recursive``): a local path, a
        URI (``s3://bucket/prefix?endpoint_override=...``) or a path in ``filesystem`` (invariant 5).
    name
        The source's name, the prefix of every producer id; keep it stable across restarts. By default
        ``<handle>@<real path of directory>`` (invariant 2): pass a name if the directory may move.
    formats
        Extensions to read, from ``.parquet``/``.pq``, ``.csv``, ``.jsonl``/``.json``/``.ndjson``.
    on_error
        What a file that cannot be read or converted does (invariant 4): ``"raise"`` (InputFileError naming
        it; the poll stops there), ``"skip"`` (logged, counted, left in place) or ``"quarantine"`` (logged,
        counted, moved to ``quarantine_dir`` with a ``.error`` file saying why).
    quarantine_dir
        Where ``"quarantine"`` moves bad files; by default ``<directory>/_quarantine`` (never read: invariant 3).
        On the same file system as ``directory``.
    filesystem
        A ``pyarrow.fs.FileSystem`` that ``directory`` is a path in (e.g. an fsspec store through
        ``PyFileSystem(FSSpecHandler(...))``).
    immutable_files
        Declare that the files stay unchanged where they are until a checkpoint covers their steps (invariant
        6): pushes are logged by reference to the files instead of by their rows. A local directory only.
    read_ahead
        How many of the next files are read and converted on a background thread while the caller pushes and
        steps (invariant 9); 0 reads each file at its turn. Call :meth:`close` (or use ``with``) to join it.
    read_ahead_bytes
        At most this many bytes held ahead (default READ_AHEAD_BYTES, and at most READ_AHEAD_SHARE of the
        pipeline's ``memory_limit`` if it has one).

    Examples
    --------
    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq, dbsp_core as dbsp
    >>> from dbsp_core.connectors import FileSource
    >>> c = dbsp.Circuit(); t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    >>> c.output("s", t.group_by("k").agg(s=dbsp.sum("v")))
    >>> p = dbsp.Pipeline(c, storage=tempfile.mkdtemp()); d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"k": [1, 2, 1], "v": [1, 2, 3]}), os.path.join(d, "a.parquet"), row_group_size=2)
    >>> with open(os.path.join(d, "b.csv"), "w") as f: _ = f.write("k,v\\n2,5\\n")
    >>> with open(os.path.join(d, "c.csv"), "w") as f: _ = f.write("k,v\\n2,five\\n")
    >>> src = FileSource(p, "t", d, on_error="quarantine")
    >>> src.poll(), src.poll()     # two row groups of a.parquet and b.csv; then nothing new
    (3, 0)
    >>> src.errors[0][0], sorted(os.listdir(os.path.join(d, "_quarantine")))   # c.csv did not convert
    ('c.csv', ['c.csv', 'c.csv.error'])
    >>> sorted(p.step()["s"].to_dict().items())
    [((1, 4), 1), ((2, 7), 1)]
    >>> p.close()
    """

    def __init__(self, pipeline: Any, handle: str, directory: str | os.PathLike, *, name: str | None = None,
                 formats: tuple[str, ...] = tuple(FORMATS), recursive: bool = False, on_error: str = "raise",
                 quarantine_dir: str | os.PathLike | None = None,
                 filesystem: pafs.FileSystem | None = None, immutable_files: bool = False,
                 read_ahead: int = READ_AHEAD, read_ahead_bytes: int | None = None) -> None:
        handle, schema = source_input("FileSource", pipeline, handle, durable=False)
        where = resolve(directory, filesystem, "FileSource directory")
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"FileSource: unknown formats {unknown}; known: {sorted(FORMATS)}")
        if on_error not in ON_ERROR:
            raise ValueError(f"FileSource: on_error={on_error!r}; it is one of {list(ON_ERROR)}")
        if not isinstance(immutable_files, bool):
            raise TypeError(f"FileSource: immutable_files={immutable_files!r}; it is True or False")
        if immutable_files and not where.local:
            raise ValueError(f"FileSource: immutable_files=True needs a local directory ({where.name} is not): a push "
                             "logged by reference is read again from the file at recovery; pass immutable_files=False")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"FileSource: read_ahead={read_ahead!r}; it is a number of files >= 0")
        if read_ahead_bytes is not None and (isinstance(read_ahead_bytes, bool) or not isinstance(read_ahead_bytes, int)
                                             or read_ahead_bytes < 0):
            raise ValueError(f"FileSource: read_ahead_bytes={read_ahead_bytes!r}; it is a number of bytes >= 0")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"FileSource: name={name!r}; it is a non-empty string (or None for the default)")
        self.pipeline = pipeline
        self.handle = handle
        self.schema: pa.Schema = schema
        self.where = where
        self.directory = os.fspath(directory) if where.local else where.path
        self._real = where.name  # the real path of a local directory; the URI without query or credentials
        self._default_name = name is None
        self.name = f"{handle}@{self._real}" if name is None else name
        self.formats = tuple(formats)
        self.recursive = recursive
        self.on_error = on_error
        self.immutable_files = immutable_files
        if where.local:
            self.quarantine_dir = os.fspath(quarantine_dir or os.path.join(self.directory, QUARANTINE))
            inside = os.path.relpath(os.path.realpath(self.quarantine_dir), self._real)
        else:
            self.quarantine_dir = (resolve(quarantine_dir, where.fs, "FileSource quarantine_dir").path
                                   if quarantine_dir is not None else where.join(QUARANTINE).path)
            inside = (where.relative(self.quarantine_dir) if self.quarantine_dir.startswith(where.path + "/")
                      else "..") or "."
        if recursive and (inside == "." or not inside.startswith((".", "_"))):
            raise ValueError(f"FileSource: quarantine_dir {self.quarantine_dir} is a directory the source reads "
                             "(recursive=True): start its name with '_' or put it outside the directory")
        self.read_ahead = read_ahead
        budget = READ_AHEAD_BYTES if read_ahead_bytes is None else read_ahead_bytes
        limit = getattr(pipeline, "memory_limit", None)  # the pipeline's budget (Pipeline.memory_limit)
        self.read_ahead_bytes = min(budget, int(limit * READ_AHEAD_SHARE)) if limit else budget
        self._ahead: deque[_Ahead] = deque()  # files being read ahead, in name order (invariant 9)
        # the read-ahead thread's executor and the references' (made at the first read ahead; invariant 9)
        self._pool: list = [None, None]
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, False)
        self._done: dict[str, tuple] = {}  # files fully pushed (in this process) -> their signature
        self._bad: dict[str, tuple] = {}  # files skipped or quarantined -> their signature (a new one is read)
        self._turns: list[str] = []  # the files of _done in the order they were done, checked in turn (invariant 3)
        self._turn = 0  # the next of _turns to check
        self._dirs: dict[str, _Listing] = {}  # a local directory's listings, by relative path ("": it) (invariant 10)
        self._todo: list[str] = []  # the listed files not done, in name order (invariant 10)
        self.errors: list[tuple[str, str]] = []  # (file, why) of every file skipped or quarantined
        self.stats = {"files": 0, "pushes": 0, "duplicates": 0, "skipped": 0, "rows": 0, "bad_files": 0,
                      "quarantined": 0, "rewritten": 0}
        try:
            self.stats = metrics.attach_source(pipeline, self.name, handle, f"directory {self._real}", self.stats)
        except ValueError as e:
            raise ValueError(f"FileSource: {e}") from None

    def pending(self) -> list[str]:
        """Relative paths of the files not yet known to be fully pushed, in name order (invariant 3); warns about
        a file rewritten under a name already read (invariant 3: replaced by a rename at once, rewritten in place
        at its turn). In a local directory, O(new files) a call (invariant 10)."""
        if not self.where.local:
            return self._pending_listed()
        if self._relist():
            listed = set().union(*(d.files for d in self._dirs.values()))
            self._todo = sorted(listed.difference(self._done))
        self._check_turns()
        out, todo = [], []
        for rel in self._todo:
            if rel in self._done:
                continue
            todo.append(rel)
            seen = self._bad.get(rel)
            if seen is not None:
                try:
                    if _signature(self.where, self._path(rel)) == seen:
                        continue
                except FileNotFoundError:
                    continue
                del self._bad[rel]  # a bad file replaced: read the new one
            out.append(rel)
        self._todo = todo
        return out

    def _pending_listed(self) -> list[str]:
        """pending() on an object store: its listing gives every file's identity (invariant 5)."""
        out = []
        for info in self.where.files(self.recursive):
            rel = self.where.relative(info.path)
            if any(part.startswith((".", "_")) for part in rel.split("/")) or not self._readable(rel):
                continue
            sig = (0, info.size, info.mtime_ns or 0)
            seen = self._done.get(rel, self._bad.get(rel))
            if seen is not None:
                if sig == seen:
                    continue
                if rel in self._done:
                    self._rewritten(rel, sig)
                    continue
                del self._bad[rel]  # a bad file replaced: read the new one
            out.append(rel)
        return sorted(out)

    def _readable(self, name: str) -> bool:
        """Whether a name (not starting with ``.``) ends in one of the formats read (its extension, any case)."""
        return name.lower().endswith(self.formats)

    def _relist(self) -> bool:
        """Bring the kept listings of a local directory up to date (invariant 10): one stat per directory, a readdir
        of each whose identity changed or was too recent to trust. A file read whose entry names another inode
        than in the former listing is stat'ed and compared (invariant 3). Returns whether any was listed again."""
        again, seen, stack = False, set(), [""]
        while stack:
            sub = stack.pop()
            seen.add(sub)
            path = os.path.join(self.directory, sub) if sub else self.directory
            now = time.time_ns()  # before the stat: a change after it is stamped later than now - a tick
            try:
                st = os.stat(path)
            except OSError:  # gone or unreadable: no files (as os.walk)
                seen.discard(sub)
                continue
            ident = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            old = self._dirs.get(sub)
            if old is None or not old.trusted or old.ident != ident:
                listing = self._list(sub, path, ident, max(st.st_mtime_ns, st.st_ctime_ns) <= now - LISTING_MARGIN_NS)
                if listing is None:
                    seen.discard(sub)
                    continue
                was = old.files.items() if old is not None else ()
                for rel, _ in listing.files.items() - was:  # a new name, or another inode under a known one
                    if rel in self._done:  # under a name read: compare
                        self._check(rel)
                self._dirs[sub] = old = listing
                again = True
            stack.extend(reversed(old.dirs))
        for sub in [d for d in self._dirs if d not in seen]:
            del self._dirs[sub]
            again = True
        return again

    def _list(self, sub: str, path: str, ident: tuple, trusted: bool) -> _Listing | None:
        """One directory's listing (invariant 3's names, os.walk's choices: a symbolic link to a directory is not
        entered), None if it cannot be read."""
        files, dirs = {}, []
        prefix, ends, recursive = os.path.join(sub, "") if sub else "", self.formats, self.recursive
        try:
            with os.scandir(path) as it:
                for e in it:  # a few C calls an entry: a directory of 10k files is read again in a few ms
                    name = e.name
                    if name.startswith((".", "_")):
                        continue
                    readable = name.lower().endswith(ends)
                    if not readable and not recursive:
                        continue
                    try:
                        is_dir = e.is_dir()
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if recursive and not e.is_symlink():
                            dirs.append(prefix + name)
                    elif readable:
                        files[prefix + name] = e.inode()
        except OSError:
            return None
        return _Listing(ident, trusted, files, sorted(dirs))

    def _check(self, rel: str) -> None:
        """Compare a file read with its identity when it was read; report it rewritten if it differs (invariant 3)."""
        try:
            sig = _signature(self.where, self._path(rel))
        except FileNotFoundError:
            return
        if sig != self._done[rel]:
            self._rewritten(rel, sig)

    def _check_turns(self) -> None:
        """Check REWRITE_CHECKS of the files read, in turn (invariant 3)."""
        n = len(self._turns)
        for _ in range(min(REWRITE_CHECKS, n)):
            self._turn %= n
            self._check(self._turns[self._turn])
            self._turn += 1

    def _path(self, rel: str) -> str:
        return os.path.join(self.directory, rel) if self.where.local else f"{self.where.path}/{rel}"

    def poll(self, max_files: int | None = None) -> int:
        """Push every new file (at most ``max_files`` of them); returns the number of pushes newly recorded.

        A file that cannot be read or converted raises InputFileError or is passed over, by ``on_error``."""
        new = 0
        pending = self.pending()
        todo = pending[:max_files]
        for i, rel in enumerate(todo):
            path = self._path(rel)
            ahead = self._take(rel)
            try:
                sig = _signature(self.where, path)
                if ahead is not None and ahead.sig != sig:  # not the file whose read began (invariant 9)
                    ahead.future.cancel()
                    ahead = None
                self._read_ahead(pending, i + 1)  # the next files are read while this one is pushed
                new += self._push_file(rel, path, sig, ahead)
            except FileNotFoundError:
                log.warning("FileSource %s: %s vanished before it was read whole", self.name, path)
                continue
            except InputFileError as e:
                self._failed(rel, path, sig, e)
                continue
            if rel not in self._done:
                self._turns.append(rel)
            self._done[rel] = sig
            self.stats["files"] += 1
        self._read_ahead(pending, len(todo))  # and the files of the next poll while the pipeline steps
        return new

    def close(self) -> None:
        """Drop what is read ahead and join the read-ahead thread (invariant 9); the source stays usable (a later
        poll reads ahead again). Pushes nothing and acknowledges nothing: files read ahead are read again."""
        self._drop(len(self._ahead))
        _shutdown(self._pool)

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drop(self, n: int) -> None:
        for _ in range(n):
            a = self._ahead.popleft()
            a.future.cancel()  # a read already begun finishes on its own; its result is dropped
            if a.refs is not None:
                a.refs.cancel()

    def _take(self, rel: str) -> _Ahead | None:
        """The read ahead of ``rel`` if it is the next one; reads ahead of files before it (passed over, vanished,
        done) are dropped, those of files after it kept."""
        while self._ahead and self._ahead[0].rel < rel:
            self._drop(1)
        if self._ahead and self._ahead[0].rel == rel:
            return self._ahead.popleft()
        return None

    def _read_ahead(self, pending: list[str], start: int) -> None:
        """Begin reading ``pending[start:]`` ahead, within ``read_ahead`` files and ``read_ahead_bytes``."""
        if not self.read_ahead:
            return
        want = pending[start:start + self.read_ahead]
        have = [a.rel for a in self._ahead]
        if have != want[:len(have)]:  # other files came first (a new name, a file passed over): begin again
            self._drop(len(have))
            have = []
        held = sum(a.held() for a in self._ahead)
        for rel in want[len(have):]:
            path = self._path(rel)
            try:
                sig = _signature(self.where, path)
            except FileNotFoundError:
                return
            if held + sig[1] > self.read_ahead_bytes:
                return
            if self._pool[0] is None:
                self._pool[0] = ThreadPoolExecutor(1, thread_name_prefix=f"dbsp-files-{self.handle}")
            producer = self._producer(rel)
            kind = FORMATS[os.path.splitext(rel)[1].lower()]
            refs = None
            if self._by_reference():  # beside the read, not before it on its thread (invariant 9)
                if self._pool[1] is None:
                    self._pool[1] = ThreadPoolExecutor(1, thread_name_prefix=f"dbsp-files-ref-{self.handle}")
                refs = self._pool[1].submit(self._references, path, kind, producer)
            self._ahead.append(_Ahead(rel, sig, producer, self._pool[0].submit(self._parse, path, kind, producer),
                                      sig[1], refs))
            held += sig[1]

    def _parse(self, path: str, kind: str, producer: str) -> tuple[int, dict[int, pa.Table], int] | None:
        """On the read-ahead thread: ``(units, {seq: converted table} of the units not acknowledged, bytes)``;
        a read's error is raised to whoever takes the result (the caller's thread, at the file's turn); None if
        the pipeline cannot say what is acknowledged (the file is then read at its turn)."""
        f = self._parquet(path) if kind == "parquet" else None
        units = f.num_row_groups if f is not None else 1
        try:
            todo = [seq for seq in range(units) if not self.pipeline.acknowledged(producer, seq)]
        except Exception:  # e.g. a pipeline closed meanwhile: leave it to the file's turn
            return None
        tables = dict(self._read(path, kind, todo, f))
        return units, tables, sum(t.nbytes for t in tables.values())

    def _references(self, path: str, kind: str, producer: str) -> dict[int, tuple[bytes, tuple]]:
        """On the references' thread, beside the read of the same file: ``{seq: (reference record, identity)}`` of
        the units not acknowledged (invariant 6), each identity taken before its checksum; the push checks it
        again at the file's turn (fileref invariant 2). Empty if anything fails: the turn takes them then."""
        try:
            units = self._parquet(path).num_row_groups if kind == "parquet" else 1
            return {seq: reference(path, kind, seq) for seq in range(units)
                    if not self.pipeline.acknowledged(producer, seq)}
        except Exception:  # a vanished or bad file, a pipeline closed meanwhile: the file's turn decides
            return {}

    def _by_reference(self) -> bool:
        """Whether pushes are logged by reference to the files (invariant 6)."""
        return self.immutable_files and self.pipeline.storage is not None

    def _rewritten(self, rel: str, sig: tuple) -> None:
        self._done[rel] = sig  # warn once per rewrite
        self.stats["rewritten"] += 1
        log.warning("FileSource %s: %s was rewritten after it was read (a file must not change once it appears, "
                    "invariant 3); its new content is not read: publish it under a new name", self.name,
                    self._path(rel))

    def _failed(self, rel: str, path: str, sig: tuple, e: InputFileError) -> None:
        self.stats["bad_files"] += 1
        why = str(e)
        if self.on_error == "raise":
            raise InputFileError(f"{why}. Replace it under a new name, or pass on_error='skip' or 'quarantine' to "
                                 "go past it (the files after it wait until then)", path) from e.__cause__
        if self.on_error == "quarantine":
            dest = self._quarantine(rel, path, why)
            self.stats["quarantined"] += 1
            log.warning("%s; quarantined as %s", why, dest)
        else:
            log.warning("%s; skipped (on_error='skip'): it stays in place and is tried again if it is replaced or "
                        "the source restarts", why)
        self._bad[rel] = sig
        self.errors.append((rel, why))

    def _quarantine(self, rel: str, path: str, why: str) -> str:
        if not self.where.local:  # invariant 5: copy, then delete; never over an earlier one
            base, fs = f"{self.quarantine_dir}/{rel}", self.where.fs
            dest, n = base, 0
            while any(i.type != pafs.FileType.NotFound for i in fs.get_file_info([dest, dest + ".error"])):
                n += 1
                dest = f"{base}.{n}"
            fs.copy_file(path, dest)
            self.where.write_bytes((why + "\n").encode(), dest + ".error")
            fs.delete_file(path)
            return dest
        base = os.path.join(self.quarantine_dir, rel)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        dest, n = base, 0
        while os.path.exists(dest) or os.path.exists(dest + ".error"):  # never replace an earlier one
            n += 1
            dest = f"{base}.{n}"
        try:
            os.replace(path, dest)
        except OSError:  # another file system
            shutil.move(path, dest)
        with open(dest + ".error", "w") as f:
            f.write(why + "\n")
        return dest

    def _producer(self, rel: str) -> str:
        """``<name>:<rel>``, or the former default's producer for a file begun under it (invariant 2)."""
        own = f"{self.name}:{rel}"
        if self._default_name and LEGACY_NAME not in metrics.sources(self.pipeline):  # no source of it is named so
            old = f"{LEGACY_NAME}:{rel}"
            if self.pipeline.acknowledged(old, 0) and not self.pipeline.acknowledged(own, 0):
                return old
        return own

    def _push_file(self, rel: str, path: str, sig: tuple, ahead: _Ahead | None = None) -> int:
        producer = self._producer(rel)
        kind = FORMATS[os.path.splitext(rel)[1].lower()]
        p = self.pipeline
        try:
            # a read ahead's error is raised here, at the file's turn, on this thread (invariant 9)
            got = ahead.future.result() if ahead is not None and ahead.producer == producer else None
            units = got[0] if got is not None else self._parquet(path).num_row_groups if kind == "parquet" else 1
            todo = [seq for seq in range(units) if not p.acknowledged(producer, seq)]
            self.stats["skipped"] += units - len(todo)
            if not todo:
                return 0
            # references taken ahead (invariant 9), by seq; none if they failed or were not taken
            refs = (ahead.refs.result() if got is not None and ahead.refs is not None
                    and not ahead.refs.cancelled() else {})
            if got is not None and all(seq in got[1] for seq in todo):  # acknowledged ones only grow meanwhile
                kept = [(seq, got[1][seq]) for seq in todo]
            elif len(todo) == 1:
                kept = list(self._read(path, kind, todo))
            else:
                kept = None
                for _ in self._read(path, kind, todo):  # checked whole before any of it is pushed (invariant 4)
                    pass
        except FileNotFoundError:
            raise
        except _BAD as e:
            raise self._error(path, e) from e
        batches = iter(kept if kept is not None else self._read(path, kind, todo))  # decoded again
        new = 0
        while True:
            try:
                item = next(batches, None)
            except FileNotFoundError:
                raise
            except _BAD as e:  # the file changed under the source
                raise self._error(path, e, pushed=new) from e
            if item is None:
                return new
            new += self._push(producer, *item) if not self.immutable_files else self._push_unit(
                producer, path, kind, sig, *item, ahead=refs.get(item[0]))

    def _read(self, path: str, kind: str, seqs: list[int],
              f: pq.ParquetFile | None = None) -> Iterator[tuple[int, pa.Table]]:
        """``(seq, converted table)`` of each of ``seqs``, one row group at a time (of ``f`` if given)."""
        if kind != "parquet":
            src = path if self.where.local else self.where.fs.open_input_stream(path)
            yield 0, self._convert(read_unit(src, kind, 0, self.schema))
            return
        f = f if f is not None else self._parquet(path)
        for seq in seqs:
            yield seq, self._convert(read_unit(f, kind, seq, self.schema))

    def _parquet(self, path: str) -> pq.ParquetFile:
        return pq.ParquetFile(path if self.where.local else self.where.open_input(path))

    def _error(self, path: str, e: BaseException, pushed: int = 0) -> InputFileError:
        what = f"{type(e).__name__}: {e}" if not isinstance(e, SchemaError) else str(e)
        more = f" ({pushed} of its row groups were pushed before it changed)" if pushed else ""
        return InputFileError(f"FileSource {self.name!r}: cannot read {path}{more}: {what}", path)

    def _convert(self, table: pa.Table) -> pa.Table:
        return convert(table, self.schema, f"the input {self.handle!r}")

    def _push_unit(self, producer: str, path: str, kind: str, sig: tuple, seq: int, table: pa.Table,
                   ahead: tuple[bytes, tuple] | None = None) -> int:
        """Push one unit logged by reference to the file (invariant 6); ``sig`` is the file's identity before any
        of it was read, ``table`` its converted rows, ``ahead`` the reference and identity the read-ahead took
        before it read them (None: taken now, after them: the checksum reads the bytes again either way)."""
        what = f"FileSource {self.name!r}"
        if self.pipeline.acknowledged(producer, seq) or self.pipeline.storage is None:  # no reference needed
            return self._push(producer, seq, table)
        ref, ident = ahead if ahead is not None else reference(path, kind, seq)
        if ident != sig:
            raise self._error(path, InputFileError(f"{what}: {path} changed while it was read", path))
        z = unit_zset(table, self.schema, f"the input {self.handle!r}")
        read_checked(path, ident, what)  # fileref invariant 2: the rows and the checksum are of the same bytes
        ack = self.pipeline._push_reference(self.handle, z, ref, producer, seq)
        if ack.duplicate:
            self.stats["duplicates"] += 1
            return 0
        self.stats["pushes"] += 1
        self.stats["rows"] += table.num_rows
        return 1

    def _push(self, producer: str, seq: int, table: pa.Table) -> int:
        durable = self.pipeline.storage is not None
        ack = self.pipeline.push(self.handle, table, **({"producer": producer, "seq": seq} if durable else {}))
        if ack is not None and ack.duplicate:
            self.stats["duplicates"] += 1
            return 0
        self.stats["pushes"] += 1
        self.stats["rows"] += table.num_rows
        return 1
