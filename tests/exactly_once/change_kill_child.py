"""Child process of the program-change kill test: opens DIR with the changed program (change_workload.NEW), then runs the workload's steps up to STEPS (re-pushing each step's changes under its (producer, seq), so a step acknowledged before a kill counts once), checkpointing at random, and closes.

Usage: change_kill_child.py DIR SEED STEPS. Prints READY after open and one JSON line at the end (the step reached
and the program change this open carried out, if any). DBSP_CRASHPOINT kills the process at a chosen point.
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core import sql  # noqa: E402
from change_workload import NEW, program, push, step_data  # noqa: E402


def main() -> int:
    d, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    p = dbsp.Pipeline.open(d, sql.compile(program(NEW)), checkpoint_interval=None)
    print("READY", flush=True)
    change = p.stats.get("program_change")
    rng = random.Random(f"{seed}/{os.getpid()}")
    while p.steps < steps:
        s = p.steps
        push(p, step_data(seed, s), step=s)
        p.step()
        if rng.random() < 0.4:
            p.checkpoint()
    print(json.dumps({"steps": p.steps, "change": change}), flush=True)
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
