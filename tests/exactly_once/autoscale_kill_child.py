"""Child process of the autoscale kill test: opens the pipeline in DIR (finishing any interrupted change) with an autoscaling policy, then steps the workload up to STEPS (re-pushing each step's changes under its (producer, seq)), switching the policy's bounds between 1 and 2 workers every few steps so that the autoscaler decides live rescales while the steps go on; then closes.

Usage: autoscale_kill_child.py DIR SEED STEPS FLIP (steps between two policy switches; 0: never switch). Prints
READY after open and a JSON line at the end. DBSP_CRASHPOINT kills the process at a chosen point.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from rescale_workload import Workload, build_circuit  # noqa: E402


def policy(workers: int) -> dbsp.Autoscale:
    """A policy that holds the pipeline at ``workers`` (its bounds), deciding after every step."""
    return dbsp.Autoscale(workers, workers, max_step_ms=10_000, interval_s=0, min_steps=1)


def main() -> int:
    d, seed, steps, flip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    w = Workload(seed, steps)
    cur = [0]
    p = dbsp.Pipeline.open(d, build_circuit(), checkpoint_interval=0.05, clock=lambda: w.clock(cur[0]))
    print("READY", flush=True)
    recovery = p.stats.get("rescale_recovery")
    size = 1 if p.layout.workers != 1 else 2
    p.autoscale(policy(size))

    def after(s: int) -> None:
        nonlocal size
        if flip and s % flip == flip - 1:
            size = 3 - size
            p.autoscale(policy(size))

    w.step_to(p, cur, steps, after)
    auto = p._autoscaler
    p.close()  # waits for a rescale in flight
    info = auto.snapshot()
    print(json.dumps({"workers": p.executor.layout.workers, "recovery": recovery,
                      "rescales": info["rescales"], "failed": info["failed_rescales"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
