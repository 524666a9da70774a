"""CPU per 1k-row step of a linear group-by over 1M rows, through the one-call C step (``LinearRun``) or through
``linear_step`` (``C_STEP`` off), and the bytes its trace's fresh batches pin beyond their own (issue 31: a fresh
batch's weights, key hashes and slots were slices of one buffer of 2 x groups x (4 + ns) words).

    python bench/probe_linear_pin.py --path cstep|linear_step [--rows 1000000] [--groups 100000] [--steps 400]

Prints one line: path, CPU ms per step (mean over the steps, getrusage of the process), and the most bytes the trace's
batches' weights and key hashes pinned beyond their own (their numpy bases) after each of 20 more steps."""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.runtime.plan import _LinearGroupBy


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pinned(p: dbsp.Pipeline) -> tuple[int, int]:
    """(bytes of the trace batches' weights and key hashes, bytes of the numpy buffers they are views of)."""
    own = base = 0
    seen: set[int] = set()
    for t in p.executor.traces(0).values():
        for b in t.batches:
            for a in (b.zset.weights, b.key_hash):
                own += a.nbytes
                root = a
                while isinstance(getattr(root, "base", None), np.ndarray):
                    root = root.base
                if id(root) not in seen:
                    seen.add(id(root))
                    base += root.nbytes
    return own, base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=("cstep", "linear_step"), default="cstep")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--groups", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-rows", type=int, default=1000)
    a = ap.parse_args()
    _LinearGroupBy.C_STEP = a.path == "cstep"
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    c = dbsp.Circuit()
    t = c.input("t", schema)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    rng = np.random.default_rng(1)
    with dbsp.Pipeline(c, workers=1) as p:
        for lo in range(0, a.rows, 1_000_000):
            n = min(1_000_000, a.rows - lo)
            p.push("t", pa.table({"k": rng.integers(0, a.groups, n), "v": rng.integers(0, 100, n)}, schema=schema))
            p.step()
        steps = [pa.table({"k": rng.integers(0, a.groups, a.step_rows), "v": rng.integers(0, 100, a.step_rows)},
                          schema=schema) for _ in range(a.steps)]
        for s in steps[:20]:  # warm
            p.push("t", s)
            p.step()
        c0, w0 = _cpu(), time.perf_counter()
        for s in steps[20:]:
            p.push("t", s)
            p.step()
        c1, w1 = _cpu(), time.perf_counter()
        k = len(steps) - 20
        peak = (0, 0)
        for s in steps[:20]:  # the bytes pinned after each of 20 more steps (outside the timed ones)
            p.push("t", s)
            p.step()
            own, base = _pinned(p)
            peak = max(peak, (base - own, own))
        print(f"{a.path} cpu_ms_per_step={1000 * (c1 - c0) / k:.3f} wall_ms_per_step={1000 * (w1 - w0) / k:.3f} "
              f"max_pinned_beyond_own={peak[0]} (own {peak[1]})")


if __name__ == "__main__":
    main()
