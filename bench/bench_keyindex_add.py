"""The key index's add with the weights before (a distinct's step: Trace.match_and_insert) of 1k-row consolidated changes into a 1M-key index of (auction, bidder) pairs, as bench_circuits (a)'s distinct makes them: microseconds of thread CPU per call.

Run from the root of the checkout to measure (its dbsp_core is imported from the working directory):

    PYTHONPATH=. python bench/bench_keyindex_add.py [calls]   # default 300 calls (the index stays below its growth)
    cd ../other && PYTHONPATH=. python ../this/bench/bench_keyindex_add.py   # another checkout's code
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pyarrow as pa

from dbsp_core import _zset
from dbsp_core.zset import ZSet


def pairs(rng: np.random.Generator, n: int) -> ZSet:
    """n bids' (auction, bidder) as bench_circuits.bids_table draws them (100k auctions, 1k bidders; its price draw
    kept so the stream is the same)."""
    auction, bidder = rng.integers(0, 100_000, n), rng.integers(0, 1000, n)
    rng.integers(1, 10_000, n)
    return ZSet.from_arrow(pa.table({"auction": auction, "bidder": bidder}))


def main() -> int:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rng = np.random.default_rng(1)
    ix = _zset.KeyIndex([pa.int64(), pa.int64()], 1)
    base = pairs(rng, 1_000_000).index_by(["auction", "bidder"])
    ix.add(base._view(), None, [0, 1], base._row_hashes(), [-1])  # the load: a bulk add
    changes = [pairs(rng, 1000).index_by(["auction", "bidder"]) for _ in range(calls)]
    us = []
    for c in changes:
        before = np.zeros((len(c), 1), dtype=np.int64)
        v, rh = c._view(), c._row_hashes()
        t0 = time.thread_time_ns()
        ix.add(v, None, [0, 1], rh, [-1], before=before)
        us.append((time.thread_time_ns() - t0) / 1e3)
    a = np.array(us)
    print(f"{len(ix):,} keys after {calls} adds of 1k rows: us per add mean {a.mean():.1f}, p50 {np.median(a):.1f}, "
          f"min {a.min():.1f} (load {os.getloadavg()[0]:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
