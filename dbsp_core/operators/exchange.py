"""The exchange operator: re-shards a stream across workers by the hash of key columns, so equal keys meet in one worker.

Invariants:
  1. A row goes to the worker that owns its shard in the pipeline's ShardMap (top bits of the key hash),
     never ``hash % W``; with W = 1 the exchange is the identity.
  2. Exchange is linear and loses no row: the sum over workers of its outputs equals the sum of its inputs.
  3. Every worker reaches every exchange once per step (the runtime's barrier relies on it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from dbsp_core.operators.base import Operator

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Exchange(Operator):
    """Re-shard by ``key``; the output is partitioned by ``key``."""

    kind = "exchange"
    split_safe = True  # base.py invariant 6 (linear)

    def __init__(self, node: int, schema: pa.Schema, key: tuple[str, ...]) -> None:
        super().__init__((node,), schema, tuple(key))
        self.key = tuple(key)

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        return ctx.exchange(self.node_id, inputs[0], self.key, self.schema)
