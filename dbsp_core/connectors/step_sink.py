"""What every sink that applies a view's changes step by step to a store with its own step record shares (the SQLite, Postgres and Delta sinks): registration as an output-log consumer checked against the store's step, the poll loop that applies each logged step once, and the acknowledgement after the commits.

Invariants (enforced here; each sink's invariants 2 and 3):
  1. ``next`` is the first step the store lacks, read from the store itself at start; the consumer registry is
     asked to keep the log from there. A registry step above the store's means the store was replaced by an
     older copy: refused with DbspError naming both steps.
  2. :meth:`StepSink.poll` applies the logged steps from ``next`` on in order, each by the subclass's
     ``_apply(step, change)`` (which commits it durably together with its step record), and acknowledges
     ``next`` to the registry only after those commits, so the registry's step never exceeds the store's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dbsp_core.connectors.output import OutputReader
from dbsp_core.errors import DbspError
from dbsp_core.zset import ZSet

__all__ = ["StepSink"]


class StepSink(ABC):
    """Base of the sinks whose store records the step it holds (module docstring). A subclass sets
    ``self.reader`` (an OutputReader) and ``self.what`` (how errors name it), then calls :meth:`_start` with the
    store's first missing step, and implements ``_apply``."""

    reader: OutputReader
    what: str
    next: int

    def _start(self, table_next: int, store: str) -> None:
        """Invariant 1."""
        self.next = table_next
        acked = self.reader.register(table_next)
        if acked > table_next:
            raise DbspError(f"{self.what}: {store} holds steps below {table_next}, but the sink had acknowledged "
                            f"steps below {acked}: it was replaced by an older copy; restore it, or unregister "
                            f"the consumer and start a new one")

    @abstractmethod
    def _apply(self, step: int, z: ZSet) -> None:
        """Applies step ``step``'s change ``z`` to the store together with the step the store then holds."""

    def poll(self, limit: int | None = None) -> int:
        """Apply the logged steps the store lacks (at most ``limit``), one commit each; returns how many."""
        start, applied = self.next, 0
        for step, z in self.reader.changes(start, limit):
            self._apply(step, z)
            self.next = step + 1
            applied += 1
        if self.next > start:
            self.reader.ack(self.next)  # invariant 2: after the commits
        return applied

    def close(self) -> None:
        self.reader.close()
