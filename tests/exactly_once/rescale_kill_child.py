"""Child process of the rescale kill test: opens the pipeline in DIR at TARGET workers (a cold rescale, or finishing / undoing an interrupted one), then runs the workload's steps up to STEPS (re-pushing each step's changes under its (producer, seq), so a step acknowledged before a kill counts once), checkpointing at random, and closes.

Usage: rescale_kill_child.py DIR SEED STEPS TARGET KIND [TOTAL KEYS]: the workload is ``Workload(SEED, TOTAL,
keys=KEYS)`` (TOTAL defaults to STEPS, KEYS to 0). Prints READY after open and one JSON line with the layout and
the recovery outcome at the end. DBSP_CRASHPOINT kills the process at a chosen point.
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from rescale_workload import Workload, build_circuit  # noqa: E402


def main() -> int:
    d, seed, steps, target, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    total, keys = (int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 7 else (steps, 0)
    w = Workload(seed, total, keys=keys)
    cur = [0]
    p = dbsp.Pipeline.open(d, build_circuit(), target, executor=StagedExecutor() if kind == "staged" else None,
                           checkpoint_interval=None, clock=lambda: w.clock(cur[0]))
    print("READY", flush=True)
    rng = random.Random(f"{seed}/{os.getpid()}")
    recovery = p.stats.get("rescale_recovery")

    def after(_: int) -> None:
        if rng.random() < 0.3:
            p.checkpoint()

    w.step_to(p, cur, steps, after)
    print(json.dumps({"workers": p.layout.workers, "shards": p.layout.shards, "recovery": recovery,
                      "rescale": p.last_rescale}), flush=True)
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
