"""The durable consumer registry of a storage directory: each consumer of the output log (a sink, a reader in another process) keeps a record of the steps it has durably applied, and the output log is truncated only below the lowest of them.

The rule (as in Falkirk Wheel's rollback recovery for dataflow): a processor that sends external output tells the
system which times the outside has acknowledged, and only then may the state that regenerates that output be discarded.
Here the output log is that state, and a consumer's acknowledgement is the first step it still needs.

Invariants (enforced here):
  1. A consumer is registered while its record file ``consumers/<name>`` exists (a framed ``DCSM`` record,
     dbsp_core.storage.formats, replaced atomically through the VFS; a ``<name>.tmp`` left by a writer killed
     mid-replace is no record and is ignored). The record holds ``next``: every output
     step below it is durably applied by the consumer. Each record has one writer, the consumer itself, so
     consumers in other processes never share a file with the pipeline or with each other.
  2. ``next`` never decreases: an acknowledgement below the recorded one changes nothing (a consumer that
     restarts may acknowledge again what it had already applied).
  3. Registration and truncation exclude each other (``flock`` on ``consumers/LOCK``). :meth:`register` writes
     its record and then, still under the lock, checks that the output log still holds its first step; the
     truncation reads every record and drops segments under the same lock. So a consumer is never registered
     at a step that a truncation is dropping, and a registered consumer's steps are never dropped.
  4. The output log is truncated below ``min(checkpoint step, last - retention, every consumer's next)``,
     leaving out the terms that do not apply (no retention setting, no consumer); with neither, nothing is
     dropped. Output at or after the checkpoint step is always kept (the driver verifies replays against it).

Examples
--------
>>> import tempfile
>>> reg = ConsumerRegistry(tempfile.mkdtemp())
>>> reg.register("sqlite", from_step=0, log_first=0)
0
>>> reg.ack("sqlite", 5), reg.ack("sqlite", 3), reg.list()
(5, 5, {'sqlite': 5})
>>> reg.truncation_bound(checkpoint_step=9, last=10, retention=None)
5
>>> reg.unregister("sqlite"); reg.truncation_bound(9, 10, None) is None
True
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from typing import Any, Callable, Iterator

from dbsp_core.errors import CorruptionError
from dbsp_core.storage.directory import fsync_dir, read_record, remove_record, write_record
from dbsp_core.storage.formats import CONSUMER_MAGIC, CONSUMERS_DIR, CONSUMERS_LOCK, TMP_SUFFIX

__all__ = ["ConsumerRegistry", "consumer_name_ok"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=-]{0,199}\Z")


def consumer_name_ok(name: Any) -> bool:
    """Whether ``name`` can name a consumer (a file name: letters, digits, ``_ . : = -``, not starting with a dot,
    not ending in ``.tmp``, the suffix of the temporary file an atomic replace leaves behind when it is killed)."""
    return (isinstance(name, str) and bool(_NAME.match(name)) and name != CONSUMERS_LOCK
            and not name.endswith(TMP_SUFFIX))


class ConsumerRegistry:
    """The consumers of one storage directory's output log (see the module docstring).

    Parameters
    ----------
    root
        The storage directory (the pipeline's ``storage``); records live in ``root/consumers/``.
    vfs
        ``"posix"`` or ``"fault"`` (crash tests).
    """

    def __init__(self, root: str | os.PathLike, vfs: str = "posix") -> None:
        self.root = os.fspath(root)
        self.dir = os.path.join(self.root, CONSUMERS_DIR)
        self.vfs = vfs

    def _path(self, name: str) -> str:
        if not consumer_name_ok(name):
            raise ValueError(f"consumer name {name!r}: use 1-200 letters, digits or _ . : = - (not a leading dot)")
        return os.path.join(self.dir, name)

    def _ensure_dir(self) -> None:
        if not os.path.isdir(self.dir):
            os.makedirs(self.dir, exist_ok=True)
            fsync_dir(self.root)  # the directory entry is durable before any record in it is relied on

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the registry lock (invariant 3): registration and truncation never overlap."""
        self._ensure_dir()
        fd = os.open(os.path.join(self.dir, CONSUMERS_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ---- a consumer's side ----

    def register(self, name: str, from_step: int = 0, log_first: int | Callable[[], int] = 0) -> int:
        """Register consumer ``name`` needing every output step from ``from_step`` on; returns its ``next``.

        ``log_first`` is the output log's first step (or a function returning it, read under the lock): a
        consumer cannot start below it (LookupError). Registering a name that is already registered changes
        nothing and returns its recorded ``next``, so a consumer restarting after a crash gets where it is.
        """
        if isinstance(from_step, bool) or not isinstance(from_step, int) or from_step < 0:
            raise ValueError(f"register({name!r}): from_step must be a non-negative int, got {from_step!r}")
        path = self._path(name)
        with self.locked():
            old = self._read(path)
            if old is not None:
                return old
            first = log_first() if callable(log_first) else log_first
            if from_step < first:
                raise LookupError(f"register({name!r}): output steps below {first} were already dropped; "
                                  f"asked from step {from_step}")
            write_record(path, CONSUMER_MAGIC, {"name": name, "next": from_step}, self.vfs)
            return from_step

    def ack(self, name: str, next_step: int) -> int:
        """Record that ``name`` has durably applied every output step below ``next_step`` (invariant 2); returns
        the recorded ``next``. KeyError if ``name`` is not registered."""
        if isinstance(next_step, bool) or not isinstance(next_step, int) or next_step < 0:
            raise ValueError(f"ack({name!r}): next_step must be a non-negative int, got {next_step!r}")
        path = self._path(name)
        old = self._read(path)
        if old is None:
            raise KeyError(f"ack: consumer {name!r} is not registered in {self.dir}")
        if next_step <= old:
            return old
        write_record(path, CONSUMER_MAGIC, {"name": name, "next": next_step}, self.vfs)
        return next_step

    def next_step(self, name: str) -> int | None:
        """The recorded ``next`` of ``name``, or None if it is not registered."""
        return self._read(self._path(name))

    def unregister(self, name: str) -> None:
        """Remove ``name``: it no longer holds back truncation (a missing consumer is fine)."""
        path = self._path(name)
        with self.locked():
            remove_record(path, self.vfs)

    # ---- the pipeline's side ----

    def list(self) -> dict[str, int]:
        """``{consumer name: next}`` of every registered consumer."""
        if not os.path.isdir(self.dir):
            return {}
        out = {}
        for name in sorted(os.listdir(self.dir)):
            if consumer_name_ok(name):
                n = self._read(os.path.join(self.dir, name))
                if n is not None:
                    out[name] = n
        return out

    def truncation_bound(self, checkpoint_step: int, last: int, retention: int | None) -> int | None:
        """The step the output log may be truncated below (invariant 4), or None to keep everything."""
        terms = list(self.list().values())
        if retention is not None:
            terms.append(last - retention)
        if not terms:
            return None
        return max(0, min([checkpoint_step] + terms))

    def truncate(self, output: Any, checkpoint_step: int, retention: int | None) -> int:
        """Drop the output log's segments below :meth:`truncation_bound` under the lock (invariant 3); returns
        how many segments went."""
        with self.locked():
            bound = self.truncation_bound(checkpoint_step, output.last, retention)
            return 0 if bound is None else output.truncate_below(bound)

    def _read(self, path: str) -> int | None:
        rec = read_record(path, CONSUMER_MAGIC, self.vfs)
        if rec is None:
            return None
        try:
            return int(rec["next"])
        except (KeyError, TypeError, ValueError):
            raise CorruptionError(f"{path}: consumer record without a step ({rec!r})") from None
