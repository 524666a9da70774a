"""Warm lookups in the steady state (issue 31): format 1 mapped ("v1": seek + take, as probe_grouped_rw.py), format 2
by the one-call C lookup ("v2c": ``GroupedFile.lookup``, ``_storage.grouped_lookup``) and by the previous two-step
path ("v2g": ``np.unique`` + ``groups_of`` in numpy, then ``_gather``), on one file of N rows: the same ``--sets``
sets of 1,000 random present keys looked up ``--rounds`` times, the readers alternated in every order in turn, the
first round not counted (after it every page is resident and touched by this process and every slot's CRC checked).
Thread CPU and wall a lookup, mean and p99. Run from the tree's root with the tree on PYTHONPATH:

    PYTHONPATH=. python bench/probe_grouped_steady.py --rows 1000000
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import numpy as np
import pyarrow as pa

import dbsp_core
from dbsp_core import ZSet
from dbsp_core.trace.batchfile import open_batch, write_batch
from dbsp_core.trace.groupedfile import open_grouped, write_grouped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--sets", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    rng = np.random.default_rng(7)
    n = a.rows
    k = rng.integers(0, n // 2, n)  # ~2 rows a key, as probe_grouped_rw.py
    b = ZSet.from_arrow(pa.table({"k": k, "v": rng.integers(0, 1 << 40, n), "s": rng.integers(0, 1000, n)})
                        ).consolidate().index_by(["k"])
    d = tempfile.mkdtemp(prefix="grouped-")
    p1, p2 = os.path.join(d, "one.batch"), os.path.join(d, "two.batch")
    write_batch(p1, b)
    write_grouped(p2, b)
    f1, f2 = open_batch(p1), open_grouped(p2)
    ix = f1.batch
    kh = np.asarray(b.key_hash)
    del b
    sets = [np.unique(kh[rng.integers(0, n, 1000)]) for _ in range(a.sets)]

    def v1(h: np.ndarray) -> int:
        rows = ix.lookup(h)
        got = ix.zset.data.take(pa.array(rows))
        return len(got) + 0 * int(ix.zset.weights[rows].sum())

    def v2c(h: np.ndarray) -> int:
        return len(f2.lookup(h))

    def v2g(h: np.ndarray) -> int:
        u = np.unique(h)
        rb = f2._gather(f2.groups_of(u), u)
        return len(f2._batch(pa.Table.from_batches([rb])))

    readers = {"v1": v1, "v2c": v2c, "v2g": v2g}
    orders = list(itertools.permutations(readers))
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
    step = 0
    for rnd in range(a.rounds):
        for h in sets:
            want = None
            for name in orders[step % len(orders)]:
                t, c = time.perf_counter(), time.thread_time()
                got = readers[name](h)
                if rnd:
                    res[name].append((time.perf_counter() - t, time.thread_time() - c))
                if want is not None and got != want:
                    raise SystemExit(f"{name} found {got} rows, {want} expected")
                want = got
            step += 1
    for name, xs in res.items():
        wall = np.array([x[0] for x in xs]) * 1e3
        cpu = np.array([x[1] for x in xs]) * 1e3
        print(f"steady {n} {name}: wall mean {wall.mean():.2f} ms, p99 {np.percentile(wall, 99):.2f} ms, CPU mean "
              f"{cpu.mean():.2f} ms, p99 {np.percentile(cpu, 99):.2f} ms ({len(xs)} lookups)")
    print("load:", os.getloadavg(), "dbsp_core from", os.path.dirname(dbsp_core.__file__))


if __name__ == "__main__":
    main()
