"""The input operator: a circuit's source, yielding each step the Z-set pushed to its handle on this worker, less its late rows when the input declares event time.

Invariants:
  1. Without event time, the output is exactly the pushed Z-set.
  2. With ``event_time`` (dbsp_core/time/watermark.py), the output is the pushed rows whose event time is not null
     and at or above the watermark in force in the step, ``ctx.watermarks[name]`` (computed by the runtime from
     the pushes of the steps before; it counts the rows dropped here with the same rule). A runtime that gives no watermarks
     cannot run such an input: the step raises DbspError naming it.
  3. With ``append_only``, every row pushed has a positive weight (the driver refuses any other push with
     AppendOnlyError before recording it, runtime/driver.py), so every change of the stream is inserts only and
     operators downstream may keep a smaller state (``Circuit.inserts_only``, operators/top_k.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dbsp_core.errors import DbspError
from dbsp_core.operators.base import Operator, empty

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import ZSet


class Input(Operator):
    """Source node of input handle ``name``; its rows may sit in any worker (no partitioning)."""

    kind = "input"
    event_time: str | None = None  # the event-time column; set (with ``lateness``) only when declared
    lateness = 0
    append_only = False  # invariant 3; set only when declared

    @property
    def split_safe(self) -> bool:  # type: ignore[override]
        """base.py invariant 6: without event time the output is the pushed change (invariant 1); with it, late rows
        and what the watermark lets operators drop are judged per step: not proven safe in pieces."""
        return self.event_time is None

    def __init__(self, name: str, schema: pa.Schema, event_time: str | None = None, lateness: int = 0,
                 append_only: bool = False) -> None:
        super().__init__((), schema, None)
        self.name = name
        if event_time is not None:  # set only when declared: circuits without event time keep their fingerprint
            self.event_time = event_time
            self.lateness = int(lateness)
        if append_only:  # likewise
            self.append_only = True

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":
        z = ctx.inputs.get(self.name)
        if z is None:
            z = empty(self.schema)
        if self.event_time is None:
            return z
        wms = getattr(ctx, "watermarks", None)
        if wms is None or self.name not in wms:
            raise DbspError(f"input {self.name!r} declares event time, but this runtime passes no watermarks to its "
                            f"operators (the embedded Pipeline and its durable form do)")
        if z.num_rows == 0:
            return z
        from dbsp_core.time.watermark import late_mask
        from dbsp_core.zset import ZSet

        keep = late_mask(z.data, self.event_time, wms[self.name])
        mask = np.asarray(keep.to_numpy(zero_copy_only=False), dtype=bool)
        if mask.all():
            return z
        return ZSet._make(z.data.filter(pa.array(mask)), np.ascontiguousarray(z.weights[mask]))
