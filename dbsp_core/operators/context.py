"""The step context: everything an operator instance may see of the step it runs in (its worker, the layout's routing table, the step's logged determinants, the step's input on this worker, and the exchange).

Invariants:
  1. An operator reads nothing about the world but its inputs and this context; every field that is not
     data (``now_ns``, ``prev_now_ns``, ``seed``, ``watermarks``) is logged with the step's input division by
     a durable pipeline, so a replayed step sees the same values (they are the step's determinants).
  2. ``now_ns`` never decreases from one step to the next, also across restarts; ``prev_now_ns`` is the
     previous step's ``now_ns`` (None before a pipeline's first step).
  3. ``exchange`` is the only way rows cross workers: it sends each row to the owner of its key's shard in
     ``shard_map`` and returns the rows sent to this worker. A context without an exchanger (a stage of the
     staged executor, where exchanges are stage boundaries) refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pyarrow as pa

from dbsp_core.errors import DbspError
from dbsp_core.layout import ShardMap

if TYPE_CHECKING:
    from dbsp_core.zset import ZSet

Exchanger = Callable[[int, int, "ZSet", tuple, pa.Schema], "ZSet"]


class StepContext:
    """What one worker's operator instances see during a step (see the module docstring).

    Examples
    --------
    >>> ctx = StepContext(worker=0, shard_map=ShardMap(1))
    >>> ctx.worker, ctx.now_ns, ctx.watermarks
    (0, None, {})
    """

    __slots__ = ("worker", "shard_map", "inputs", "now_ns", "prev_now_ns", "seed", "watermarks", "_exchanger")

    def __init__(self, worker: int, shard_map: ShardMap, exchanger: Exchanger | None = None) -> None:
        self.worker = worker
        self.shard_map = shard_map
        self.inputs: dict[str, "ZSet"] = {}
        self.now_ns: int | None = None
        self.prev_now_ns: int | None = None
        self.seed: int | None = None
        self.watermarks: dict[str, int] = {}
        self._exchanger = exchanger

    def begin(self, inputs: dict[str, "ZSet"], now_ns: int | None, prev_now_ns: int | None, seed: int | None,
              watermarks: dict[str, int] | None = None) -> None:
        """Set the step's input on this worker and its determinants."""
        self.inputs = inputs
        self.now_ns, self.prev_now_ns, self.seed = now_ns, prev_now_ns, seed
        self.watermarks = watermarks or {}

    @property
    def can_exchange(self) -> bool:
        """Whether :meth:`exchange` works here (False in a stage task, where exchanges are stage boundaries)."""
        return self._exchanger is not None

    def anyone(self, node_id: object, flag: bool) -> bool:
        """Whether any worker passes ``flag`` True at this point (every worker calls it once per ``node_id`` and
        step, like :meth:`exchange`); a runtime whose exchanger cannot agree across workers refuses it."""
        agree = getattr(self._exchanger, "anyone", None)
        if agree is None:
            raise DbspError("this runtime cannot agree across workers within a step (a fixpoint needs it)")
        return bool(agree(self.worker, node_id, flag))

    def exchange(self, node_id: int, z: "ZSet", key: tuple[str, ...], schema: pa.Schema) -> "ZSet":
        """Send each row of ``z`` to the worker owning its key's shard; return the rows sent to this worker."""
        if self._exchanger is None:
            raise DbspError(f"exchange#{node_id} ran where exchanges are stage boundaries (a staged executor bug)")
        return self._exchanger(self.worker, node_id, z, key, schema)

    def exchange_runs(self, node_id: int, runs: list[tuple[int, int, int]], cut: Callable[[int, int], object]
                      ) -> list:
        """:meth:`exchange` of rows already ordered by owner: runs ``(worker, start, stop)`` of them, each sent as
        ``cut(start, stop)``; returns the parts sent to this worker, uncombined (the fused chains of
        dbsp_core/runtime/plan.py). A runtime whose exchanger cannot do it refuses it."""
        send = getattr(self._exchanger, "exchange_runs", None)
        if send is None:
            raise DbspError(f"exchange#{node_id}: this runtime cannot exchange runs of rows (a step plan bug)")
        return send(self.worker, node_id, runs, cut)
