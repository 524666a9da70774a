"""The checkpoint coordinator over per-worker Databases: choose a version, start, pause, stop at the maximum step, commit.

Invariants (enforced here):
  1. The coordinator opens every worker at ``v = max(intersection of the workers' versions())``; an empty
     intersection raises RecoveryError. After a completed checkpoint the next epoch's ``v`` is one more.
  2. A checkpoint pauses every worker (each returns its step), takes the maximum, stops every worker at that
     step (a worker behind it would have to run on; in the embedded runtime all workers step in lockstep,
     so a worker that is not exactly at it is a fatal error) and captures its state there (a snapshot plan of
     immutable batches). Then, possibly while later steps run, each worker writes the plan, the layout it
     belongs to, ``set_step`` and commits. Only after every worker committed does any worker open the new
     version; opening it discards the older one, so at every instant the newest version common to all workers
     is a complete checkpoint.
  3. The low watermark (the oldest step any worker can still be opened at) is the step of the oldest
     version that some worker still holds; logs may be truncated below it.
  4. A worker loads state only from a version written for its own index under the layout in force (the
     record of dbsp_core.storage.shardmove.write_worker_layout); anything else is refused.
"""

from __future__ import annotations

from typing import Any, Callable

from dbsp_core.errors import RecoveryError
from dbsp_core.layout import Layout
from dbsp_core.storage.database import Database, DatabaseHandle
from dbsp_core.storage.shardmove import read_worker_layout, write_worker_layout
from dbsp_core.storage.snapshot import WorkerSnapshot


class WorkerStore:
    """One worker's side of the protocol: its Database and the handle of the current epoch."""

    def __init__(self, index: int, path: str, instances: dict[int, Any], layout: Layout,
                 groupings: dict[int, tuple[str, ...] | None], vfs: str = "posix") -> None:
        self.index = index
        self.layout = layout
        self.db = Database(path, vfs=vfs)
        self.snapshot = WorkerSnapshot(instances, layout.shard_bits, group_pending=True, groupings=groupings,
                                       shard_ranges=True)
        self.handle: DatabaseHandle | None = None
        self.renames: dict[int, int] | None = None  # a program change: where the next load reads each node's state
        self.step = 0
        self._paused: int | None = None

    def versions(self) -> range:
        return self.db.versions()

    def start(self, version: int, load: bool = False) -> int:
        """Open ``version`` (discarding the other one); with ``load`` restore operator state. Returns its step."""
        self.handle = self.db.open(version)
        self.step = self.handle.get_step()
        if load:
            where = f"{self.db.path} v{version}"
            rec = read_worker_layout(self.handle, where)
            if rec is not None and (rec["epoch"], rec["worker"], rec["shard_bits"]) != \
                    (self.layout.epoch, self.index, self.layout.shard_bits):
                raise RecoveryError(f"{where}: holds the state of worker {rec['worker']} of layout epoch "
                                    f"{rec['epoch']} ({1 << rec['shard_bits']} shards); the layout in force is epoch "
                                    f"{self.layout.epoch} ({self.layout.shards} shards) and this is worker "
                                    f"{self.index}: LAYOUT or RESCALE does not belong with the state; restore the "
                                    f"directory from a backup (`dbsp repair DIR` lists the damage)")
            self.snapshot.load(self.handle, where, renames=self.renames, drop_unread=True)
            self.renames = None
        self._paused = None
        return self.step

    def close_epoch(self) -> None:
        """Close the open handle without committing (the database keeps the version it was opened at)."""
        if self.handle is not None and not self.handle.closed:
            self.handle.close()
        self.handle = None

    def reopen(self, version: int) -> None:
        """Open ``version`` after this worker committed it; the worker's step (maybe past it) is unchanged."""
        self.handle = self.db.open(version)

    def advance(self) -> None:
        """The worker finished one step."""
        if self._paused is not None:
            raise RecoveryError(f"worker {self.index} stepped while paused at {self._paused}")
        self.step += 1

    def pause(self) -> int:
        self._paused = self.step
        return self.step

    def stop(self, step: int) -> tuple[list[tuple], Layout]:
        """Stop at ``step``: capture the state to save (a snapshot plan) and the layout it belongs to, and resume
        stepping (invariant 2)."""
        if self.step != step:
            raise RecoveryError(f"worker {self.index} is at step {self.step}, the checkpoint is at {step}")
        plan = self.snapshot.prepare()
        self._paused = None
        return plan, self.layout

    def commit(self, step: int, captured: tuple[list[tuple], Layout]) -> None:
        """Write the captured state and the layout it belongs to, ``set_step(step)`` and commit (may run while
        later steps go on)."""
        h = self.handle
        assert h is not None
        plan, layout = captured
        self.snapshot.apply(h, plan)
        write_worker_layout(h, layout, self.index)
        h.set_step(step)
        h.commit()
        self.handle = None

    def close(self) -> None:
        self.close_epoch()
        self.db.close()


def choose_version(versions: list[range], where: str) -> int:
    """Invariant 1: the maximum of the intersection of the databases' ``versions()``."""
    lo, hi = max(r.start for r in versions), min(r.stop for r in versions)
    if lo >= hi:
        raise RecoveryError(f"{where}: the state databases share no version: "
                            f"{[(r.start, r.stop - 1) for r in versions]} (one was lost, replaced or copied from "
                            f"another time); restore the directory from a backup (`dbsp repair DIR` lists the damage)")
    return hi - 1


class Coordinator:
    """Runs the checkpoint protocol (the module's invariants 1-3) over the workers of one pipeline."""

    def __init__(self, stores: list[WorkerStore], crashpoint: Callable[[str], None] = lambda _: None) -> None:
        self.stores = stores
        self.version = -1
        self.checkpoints = 0
        self._crash = crashpoint

    def choose_version(self) -> int:
        """Invariant 1: the maximum of the intersection of every worker's versions()."""
        return choose_version([s.versions() for s in self.stores], "checkpoint")

    def start(self, load: bool) -> int:
        """Open every worker at the chosen version; returns the step all of them are at."""
        v = self.choose_version()
        steps = {s.start(v, load=load) for s in self.stores}
        if len(steps) != 1:
            raise RecoveryError(f"workers disagree on the step of version {v}: {sorted(steps)}")
        self.version = v
        return steps.pop()

    def begin_checkpoint(self) -> tuple[int, list[tuple[WorkerStore, tuple[list[tuple], Layout]]]]:
        """Pause every worker, take the maximum step and stop every worker there, capturing its state."""
        step = max(s.pause() for s in self.stores)
        return step, [(s, s.stop(step)) for s in self.stores]

    def finish_checkpoint(self, step: int, plans: list[tuple[WorkerStore, tuple[list[tuple], Layout]]]) -> int:
        """Commit every captured worker's state at ``step``, then open the new version everywhere (invariant 2)."""
        for s, captured in plans:
            s.commit(step, captured)
            self._crash("checkpoint-commit")
        self._crash("checkpoint-committed")
        v = self.version + 1
        for s, _ in plans:
            s.reopen(v)  # discards version v - 1 (invariant 2)
        self.version = v
        self.checkpoints += 1
        return step

    def checkpoint(self) -> int:
        """Pause, stop at the maximum step, commit every worker, then open the new version. Returns the step."""
        step, plans = self.begin_checkpoint()
        return self.finish_checkpoint(step, plans)

    def close(self) -> None:
        for s in self.stores:
            s.close()
