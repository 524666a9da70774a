"""Nexmark input with deletions: each step also deletes a random few of the rows earlier steps pushed (those the watermark still admits), and the integrated input, for DuckDB's recomputation, is every pushed row not deleted since.

The generator seed and the deletion draws come from one run seed: ``DBSP_NEXMARK_SEED`` replays a run; by default
a new seed per run, printed after the summary (conftest.py) and in every failure.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa

SEED = int(os.environ.get("DBSP_NEXMARK_SEED", str(random.SystemRandom().randrange(2**31))))
LATENESS_MS = 4_000  # nexmark.circuit's default lateness: a row below (earlier steps' max dateTime - this) is late
MARGIN_MS = 100


class Retractions:
    """The pushes of each step (the batch, then deletions of earlier rows with weight -1) and the integrated input.

    A row is deleted at most once and only while its ``dateTime`` is above the watermark the step runs under
    (the largest ``dateTime`` of the input in earlier steps minus the lateness), so no deletion is late.
    ``extra`` columns of a step (q12's ``p_time``) are kept with its rows for the reference only.
    """

    def __init__(self, seed: int, fraction: float = 0.05) -> None:
        self.rng = np.random.default_rng(seed)
        self.fraction = fraction
        self.parts: dict[str, list[pa.Table]] = {}  # the rows each step pushed (with their extra columns)
        self.alive: dict[str, list[np.ndarray]] = {}
        self.max_ms: dict[str, int] = {}
        self.deleted = 0

    def step(self, batch: dict[str, pa.Table], extra: dict[str, dict[str, pa.Array]] | None = None
             ) -> list[tuple[str, pa.Table, list[int] | None]]:
        """``(input, rows, weights)`` to push for this step's ``batch``; the batch is recorded as pushed."""
        pushes: list[tuple[str, pa.Table, list[int] | None]] = []
        for name, t in batch.items():
            pushes.append((name, t, None))
            gone = self._delete(name)
            if gone is not None:
                pushes.append((name, gone, [-1] * gone.num_rows))
        for name, t in batch.items():
            ref = t
            for col, arr in (extra or {}).get(name, {}).items():
                ref = ref.append_column(col, arr)
            self.parts.setdefault(name, []).append(ref)
            self.alive.setdefault(name, []).append(np.ones(t.num_rows, dtype=bool))
            if t.num_rows:
                ms = int(np.max(t.column("dateTime").cast(pa.int64()).to_numpy()))
                self.max_ms[name] = max(ms, self.max_ms.get(name, ms))
        return pushes

    def _delete(self, name: str) -> pa.Table | None:
        if name not in self.max_ms:
            return None
        floor = self.max_ms[name] - LATENESS_MS + MARGIN_MS
        taken = []
        for part, alive in zip(self.parts[name], self.alive[name]):
            ms = part.column("dateTime").cast(pa.int64()).to_numpy()
            pick = np.flatnonzero(alive & (ms >= floor) & (self.rng.random(len(alive)) < self.fraction))
            if len(pick):
                alive[pick] = False
                schema_cols = [c for c in part.column_names if c != "p_time"]
                taken.append(part.select(schema_cols).take(pa.array(pick, pa.int64())))
        if not taken:
            return None
        gone = pa.concat_tables(taken)
        self.deleted += gone.num_rows
        return gone

    def integrated(self) -> dict[str, pa.Table]:
        """Every input's rows pushed and not deleted (each row once per push: a multiset)."""
        return {name: pa.concat_tables([p.filter(pa.array(a)) for p, a in zip(parts, self.alive[name])])
                for name, parts in self.parts.items()}
