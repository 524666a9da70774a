"""The logs part of a pipeline in an object store (the :class:`~dbsp_core.storage.remote.LogPart` of
dbsp_core.storage.remote): the input and output logs as segment objects under ``<prefix>/log/`` (storage.logstore),
rebuilt from a manifest's log position when the pipeline opens and retained by the live manifests.

Invariants (enforced here; logstore's hold for the segments):
  1. A manifest's ``logs`` is ``{"mode": "segments", "input_from_step": X, "output_from_step": F}``: recovery from
     it reads the input records of the segments whose steps reach X (the manifest's step) and every output
     segment from F (the local output log's first step when the manifest was written, after consumer retention).
     Every acknowledged push is in an input segment already (group commit), so nothing else is needed.
  2. :meth:`RemoteLogs.covered` makes every output step appended so far durable in the store before the manifest
     is written.
  3. :meth:`RemoteLogs.retain` deletes only what neither live manifest needs: input segments whose steps are all
     below the smaller ``input_from_step`` of the two, output segments below the smaller ``output_from_step``; a
     store that refuses is logged, not raised (the next checkpoint deletes them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

from dbsp_core.errors import StoreUnavailableError
from dbsp_core.storage.formats import REMOTE_LOG_DIR
from dbsp_core.storage.logstore import LogShipper, LogStore

__all__ = ["RemoteLogs", "LOGS_MODE"]

LOGS_MODE = "segments"
log = logging.getLogger(__name__)


class RemoteLogs:
    """The log segments of the pipeline stored by ``remote`` (a :class:`dbsp_core.storage.remote.Remote`):
    what the driver gives :func:`dbsp_core.runtime.remote_state.restore`, ``RemoteCheckpoints`` and
    ``open_directory``. ``group_commit_s``: how long the first waiting record waits for others to share its PUT."""

    def __init__(self, remote: Any, *, group_commit_s: float = 0.002) -> None:
        loc = remote.location
        where = dataclasses.replace(loc.join(REMOTE_LOG_DIR), path=remote.path(REMOTE_LOG_DIR))
        self.store = LogStore(where, group_commit_s=group_commit_s, policy=remote.policy)
        self._from = {"input": 0, "output": 0}
        self._output: Any = None
        # the writer's lease check (storage.remote invariant 6), run after each segment PUT before its records are
        # acknowledged (storage.logstore invariant 2b); set by the writer once it holds its lease, None for a reader
        self.fence: Callable[[str], None] | None = None

    # ---- LogPart (dbsp_core.storage.remote) ----

    def covered(self, step: int) -> dict:
        """The manifest's ``logs`` of a checkpoint at ``step`` (invariants 1-2)."""
        first = 0
        if self._output is not None:
            self._output.flush()
            first = self._output.first
        return {"mode": LOGS_MODE, "input_from_step": step, "output_from_step": first}

    def restore(self, remote: Any, manifest: dict, root: str) -> None:
        """Takes the log position of ``manifest`` (invariant 1); the local logs are rebuilt from the segments when
        the driver opens them (:meth:`open_log`)."""
        logs = manifest.get("logs", {})
        self._from = {"input": int(logs.get("input_from_step", 0)), "output": int(logs.get("output_from_step", 0))}

    def retain(self, remote: Any, live: list[dict]) -> None:
        """Deletes the segments no live manifest needs (invariant 3)."""
        bounds = {}
        for kind in ("input", "output"):
            steps = [m.get("logs", {}).get(f"{kind}_from_step") for m in live]
            bounds[kind] = min(steps) if steps and None not in steps else 0
        try:
            for kind, below in bounds.items():
                self.store.retain(kind, below)
        except StoreUnavailableError as e:
            log.warning("log retention on %s postponed to the next checkpoint: %s", self.store.location.shown, e)

    # ---- the driver's side ----

    def open_log(self, kind: str, local_dir: str, local_segment_bytes: int) -> LogShipper:
        """Rebuilds the local ``kind`` log in ``local_dir`` from the segments (from the restored manifest's position)
        and returns the shipper the opened log appends through (logstore invariant 4)."""
        return self.store.restore(kind, local_dir, from_step=self._from[kind], local_segment_bytes=local_segment_bytes,
                                  fence=self.fence)

    def rebuild(self, root: str, local_segment_bytes: int = 64 << 20) -> None:
        """For a reader of the store (no writer will append): rebuilds ``root/input`` and ``root/output`` from the
        segments and stops there."""
        for kind in ("input", "output"):
            self.open_log(kind, os.path.join(root, kind), local_segment_bytes).close()

    def opened(self, output: Any) -> None:
        """The output log the driver opened: :meth:`covered` flushes it and records its first step."""
        self._output = output
