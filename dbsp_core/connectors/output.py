"""A view's changes by step for a sink: read from a running pipeline or from a storage directory (possibly while another process writes it), as a registered consumer of its output log.

Invariants (enforced here):
  1. A reader is a consumer (dbsp_core.storage.consumers) named ``consumer``: while it is registered the output
     log keeps every step from the reader's acknowledged ``next`` on, so a sink that restarts from any step
     at or after its acknowledgement finds it.
  2. :meth:`OutputReader.ack` is called by the sink only once every step below the acknowledged one is
     durably applied at its end; steps are handed out in order, each once per :meth:`OutputReader.changes`
     call.
  3. The log of a view starts over at the step a program change rebuilt it (its full contents there,
     dbsp_core.runtime.change): a sink that holds steps of the view's earlier definition (``from_step > 0``)
     and would be handed that step next is refused with DbspError instead of adding the contents to what it
     holds; a sink that holds nothing of the view starts there.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pyarrow as pa

from dbsp_core.errors import DbspError
from dbsp_core.storage.consumers import ConsumerRegistry, consumer_name_ok
from dbsp_core.storage.inspect import open_output
from dbsp_core.zset import ZSet

__all__ = ["OutputReader"]


class OutputReader:
    """Changes of view ``view`` by step, for consumer ``consumer``.

    Parameters
    ----------
    source
        A durable ``dbsp_core.Pipeline`` (or ``spark_glue.SparkPipeline``) in this process, or the path of its
        storage directory (read-only; the pipeline may run in another process).
    view
        The output name.
    consumer
        The consumer's name in the registry (stable across restarts: it is how the sink finds its progress).
    """

    def __init__(self, source: Any, view: str, consumer: str) -> None:
        self.view = view
        self.consumer = consumer
        if isinstance(source, (str, os.PathLike)):
            self._log = open_output(source)
            self._pipeline = None
            self.registry = ConsumerRegistry(source)
            self.schema: pa.Schema = self._log.schemas.get(view)  # type: ignore[assignment]
        else:
            if getattr(source, "consumers", None) is None:
                raise ValueError("OutputReader: the pipeline keeps no output log; give it storage=<dir>")
            self._log = None
            self._pipeline = source
            self.registry = source.consumers
            c = source.circuit
            self.schema = {name: c.nodes[i].schema for name, i in c.outputs.items()}.get(view)
        if self.schema is None:
            raise KeyError(f"OutputReader: no output {view!r}")
        # the first step of the view's current definition (invariant 3; dbsp_core.runtime.change); a pipeline that
        # takes no program change (spark_glue's) has none
        since = self._log.since if self._log is not None else getattr(source, "output_since", {})
        self.since = int(since.get(view, 0))
        if not consumer_name_ok(consumer):
            raise ValueError(f"consumer name {consumer!r}: use 1-200 letters, digits or _ . : = - (not a leading dot)")

    def first(self) -> int:
        """The output log's first step (after picking up the writer's changes)."""
        if self._log is not None:
            self._log.refresh()
            return self._log.first
        return self._pipeline.output_steps.start

    def register(self, from_step: int = 0) -> int:
        """Register (or find) the consumer; returns the first step it still needs (invariant 1)."""
        return self.registry.register(self.consumer, from_step, self.first)

    def changes(self, from_step: int, limit: int | None = None) -> Iterator[tuple[int, ZSet]]:
        """``(step, change)`` for the logged steps from ``from_step`` on, in order (at most ``limit`` of them)."""
        if 0 < from_step <= self.since:  # invariant 3
            raise DbspError(f"consumer {self.consumer!r}: view {self.view!r} was rebuilt by a program change at step "
                            f"{self.since} (its output starts over there with its full contents), but this sink holds "
                            f"its steps below {from_step}, of its earlier definition: give the sink a new table (or "
                            f"directory) and consumer name")
        if self._log is not None:
            self._log.refresh()
            it = self._log.read(self.view, from_step)
        else:
            it = self._pipeline.read_output(self.view, from_step)
        for n, item in enumerate(it):
            if limit is not None and n >= limit:
                return
            yield item

    def ack(self, next_step: int) -> None:
        """Every step below ``next_step`` is durably applied by the sink (invariant 2)."""
        self.registry.ack(self.consumer, next_step)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
