"""within_last against a model: integral(output) == rows of integral(input) inside [now - window, now], for
random changes (inserts, deletions, nulls, future and already-expired rows), random steps of now (including
jumps longer than the window and steps that do not move), W in {1, 2}."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis_profile import examples
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core.operators.temporal import within_last

SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
WINDOW = 100  # seconds


def _run(seed: int, workers: int, steps: int, unit: str) -> None:
    rng = np.random.default_rng(seed)
    scale = {"s": 1, "ms": 1000}[unit]
    c = dbsp.Circuit()
    src = c.input("ev", SCHEMA)
    c.output("w", within_last(src, "ts", WINDOW, unit=unit))
    now_s = 1_000_000
    clock = [now_s * 10**9]
    p = dbsp.Pipeline(c, workers=workers, clock=lambda: clock[0])
    bag: Counter = Counter()
    view: Counter = Counter()
    for _ in range(steps):
        now_s += int(rng.choice([0, 1, 7, 30, 99, 100, 101, 250, 100_000], p=[.1, .2, .2, .15, .1, .05, .05, .1, .05]))
        rows: Counter = Counter()
        for _ in range(int(rng.integers(0, 12))):
            present = [r for r, w in (bag + rows).items() if w > 0]
            if present and rng.random() < 0.3:
                rows[present[int(rng.integers(len(present)))]] -= 1
            else:
                ts = None if rng.random() < 0.05 else int((now_s + int(rng.integers(-2 * WINDOW, WINDOW))) * scale)
                rows[(int(rng.integers(0, 5)), ts)] += 1
        rows = Counter({r: w for r, w in rows.items() if w})
        bag.update(rows)
        bag = Counter({r: w for r, w in bag.items() if w})
        if rows:
            p.push("ev", dbsp.ZSet.from_rows(list(rows), SCHEMA, weights=list(rows.values())))
        clock[0] = now_s * 10**9
        for r, w in p.step()["w"].to_dict().items():
            view[r] += w
        view = Counter({r: w for r, w in view.items() if w})
        lo, hi = (now_s - WINDOW) * scale, now_s * scale
        expected = {r: w for r, w in bag.items() if r[1] is not None and lo <= r[1] <= hi}
        assert dict(view) == expected, f"now={now_s}"
    p.close()


@pytest.mark.parametrize("workers", [1, 2])
@settings(max_examples=examples(25))
@given(seed=st.integers(0, 2**32 - 1))
def test_within_last_matches_model(workers: int, seed: int) -> None:
    _run(seed, workers, steps=30, unit="s")


def test_within_last_milliseconds_many_steps() -> None:
    _run(12345, 2, steps=300, unit="ms")


def test_a_long_jump_of_now_reads_the_state_once_without_allocating_per_bucket() -> None:
    """A pause of ten years with a 1 ms window is ~2e13 time buckets: the step used to build an array of
    every bucket id before noticing it would rather read the whole state (MemoryError, on every replay)."""
    import pyarrow as pa

    import dbsp_core as dbsp
    from dbsp_core.operators.temporal import within_last

    clock = [10**18]
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("id", pa.int64()), ("ts", pa.int64())]))
    c.output("recent", within_last(t, "ts", 0.001, unit="ms"))
    p = dbsp.Pipeline(c, clock=lambda: clock[0])
    now_ms = clock[0] // 10**6
    p.push("t", pa.table({"id": [1, 2], "ts": [now_ms, now_ms + 10 * 365 * 86_400_000]}))
    assert p.step()["recent"].to_dict() == {(1, now_ms): 1}
    clock[0] += 10 * 365 * 86_400 * 10**9  # ten years later
    assert p.step()["recent"].to_dict() == {(1, now_ms): -1, (2, now_ms + 10 * 365 * 86_400_000): 1}
