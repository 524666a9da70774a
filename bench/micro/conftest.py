"""Shared data of the microbenchmarks: seeded bids like bench_scaling's, and the import paths they need.

Run from the repository root: ``pytest bench/micro --benchmark-only`` (bench/README.md). ``python -m pytest
tests`` never collects this folder (pyproject's ``testpaths`` is ``tests``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: bench_scaling's data and circuits
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root: dbsp_core built in place

SEED = 7
ROWS = 1_000_000  # a kernel's input, and the state of the per-step benchmarks
GROUPS = 100_000  # keys over those rows (bench_scaling's 1M:100k)
CATEGORIES = [f"cat-{i:02d}" for i in range(20)]


@pytest.fixture(scope="session")
def bids() -> pa.Table:
    """1M bids (auction, bidder, price) over 100k auctions, 1000 bidders, with a string column ``category`` (a
    key of the kind the demo's views group by): about 10% of (auction, bidder) pairs repeat."""
    rng = np.random.default_rng(SEED)
    auction = rng.integers(0, GROUPS, ROWS)
    return pa.table({"auction": auction, "bidder": rng.integers(0, 1000, ROWS),
                     "price": rng.integers(1, 10_000, ROWS),
                     "category": pa.array(np.array(CATEGORIES)[auction % len(CATEGORIES)])})
