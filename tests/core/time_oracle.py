"""The DuckDB reference for event-time circuits: random event streams with disorder, late rows and deletions, a plain-Python model of watermarks and late rows, and the query recomputed by DuckDB over the accepted rows after every step."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from oracle import _diff, accumulate, duckdb_query, normalize, to_zset

EV = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("t", pa.int64())])
NEG_INF = -(2**63)


class EventGen:
    """Rows (k, v, t) around a clock that moves forward; some rows late, some deletions of accepted rows."""

    def __init__(self, rng: np.random.Generator, lateness: int, keys: int = 4) -> None:
        self.rng, self.lateness, self.keys = rng, lateness, keys
        self.clock = 0
        self.watermark = NEG_INF  # the model of dbsp_core/time/watermark.py invariant 1
        self.accepted: Counter = Counter()
        self.late = 0

    def step(self, max_rows: int = 8) -> dict[tuple, int]:
        rng, delta = self.rng, Counter()
        self.clock += int(rng.integers(0, 12))
        for _ in range(int(rng.integers(0, max_rows + 1))):
            present = [r for r, w in (self.accepted + delta).items() if w > 0]
            if present and rng.random() < 0.25:
                delta[present[int(rng.integers(len(present)))]] -= 1
            else:
                t = self.clock + int(rng.integers(-2 * self.lateness - 3, 4))
                delta[(int(rng.integers(0, self.keys)), int(rng.integers(0, 5)), t)] += 1
        delta = Counter({r: w for r, w in delta.items() if w})
        # the model: rows below the watermark in force are late; then the step's rows move the watermark
        for r, w in delta.items():
            if r[2] < self.watermark:
                self.late += 1
            else:
                self.accepted[r] += w
        if delta:
            self.watermark = max(self.watermark, max(r[2] for r in delta) - self.lateness)
        self.accepted = Counter({r: w for r, w in self.accepted.items() if w})
        return dict(delta)


def run_event_time(build: Callable[[dbsp.Circuit, dict[str, dbsp.Stream]], dict[str, dbsp.Stream]],
                   queries: dict[str, str], seed: int, workers: int, inputs: tuple[str, ...] = ("a",),
                   lateness: int = 6, steps: int = 8, pipeline: Callable | None = None) -> dbsp.Pipeline:
    """Feed random event streams step by step; after each step compare each output's integral with DuckDB over
    the accepted rows, the pipeline's watermarks and late counts with the model's. Returns the closed pipeline."""
    rng = np.random.default_rng(seed)
    c = dbsp.Circuit()
    streams = {name: c.input(name, EV, event_time="t", lateness=lateness) for name in inputs}
    for name, s in build(c, streams).items():
        c.output(name, s)
    gens = {name: EventGen(rng, lateness) for name in inputs}
    views: dict[str, dict] = {name: {} for name in queries}
    p = pipeline(c) if pipeline else dbsp.Pipeline(c, workers=workers)
    with p:
        for step in range(steps):
            for name, g in gens.items():
                change = g.step()
                if change:
                    p.push(name, to_zset(change, EV))
            out = p.step()
            where = f"after step {step} (W={workers}, seed={seed})"
            assert p.watermarks == {n: g.watermark for n, g in gens.items()}, where
            assert p.late_rows == {n: g.late for n, g in gens.items()}, where
            tables = {name: (EV, dict(g.accepted)) for name, g in gens.items()}
            for name, sql in queries.items():
                accumulate(views[name], out[name])
                want = duckdb_query(sql, tables)
                got = normalize(views[name])
                assert got == want, (f"output {name!r} differs from DuckDB {where}\nonly in circuit: "
                                     f"{_diff(got, want)}\nonly in DuckDB: {_diff(want, got)}")
    return p
