"""Child process of the live-rescale kill test: opens the pipeline in DIR (finishing any interrupted change), then steps the workload up to STEPS on a thread (re-pushing each step's changes under its (producer, seq)) while the main thread rescales live to each worker count of TARGETS in turn, then closes.

Usage: live_kill_child.py DIR SEED STEPS KIND TARGETS (comma-separated). Prints READY after open and a JSON line
at the end. DBSP_CRASHPOINT kills the process at a chosen point.
"""

from __future__ import annotations

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from rescale_workload import Workload, build_circuit  # noqa: E402


def main() -> int:
    d, seed, steps, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    targets = [int(x) for x in sys.argv[5].split(",") if x]
    w = Workload(seed, steps)
    cur = [0]
    p = dbsp.Pipeline.open(d, build_circuit(), executor=StagedExecutor() if kind == "staged" else None,
                           checkpoint_interval=0.05, clock=lambda: w.clock(cur[0]))
    print("READY", flush=True)
    recovery = p.stats.get("rescale_recovery")
    errors: list[BaseException] = []

    def stepping() -> None:
        try:
            w.step_to(p, cur, steps)
        except BaseException as e:  # pragma: no cover - reported by the parent
            errors.append(e)

    t = threading.Thread(target=stepping)
    t.start()
    reports = [p.rescale(n, batch_shards=8) for n in targets]
    t.join()
    if errors:
        raise errors[0]
    print(json.dumps({"workers": p.layout.workers, "recovery": recovery,
                      "batches": [r["batches"] for r in reports]}), flush=True)
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
