"""Child process of the poison kill -9 test: opens (or creates) the pipeline, pushes BATCHES good batches of producer "g" and the poison batches of producer "bad" (retried pushes are duplicates), steps, discards every poison push a StepError names, and steps until every push is stepped; prints DONE. DBSP_CRASHPOINT kills it at a chosen point.

Usage: poison_child.py DIR EXECUTOR SEED.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.errors import StepError  # noqa: E402
from dbsp_core.runtime.staged import StagedExecutor  # noqa: E402
from poison import KINDS, build_circuit, good, poison  # noqa: E402

BATCHES = 6
POISON = {1: KINDS[0], 3: KINDS[1]}  # poison seq -> kind, pushed after good batch seq


def main() -> int:
    d, executor, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    p = dbsp.Pipeline(build_circuit(), workers=2, storage=d, checkpoint_interval=None, segment_bytes=4096,
                      executor=StagedExecutor() if executor == "staged" else None)

    def step() -> None:
        while True:
            try:
                p.step()
                return
            except StepError as e:
                bad = [x for x in e.inputs if x[1] == "bad"]
                assert bad, f"a step failed without a poison push: {e}"
                for _, prod, seq in bad:
                    p.discard(prod, seq)

    for seq in range(BATCHES):
        p.push("t", good(seed, "g", seq), producer="g", seq=seq)
        if seq in POISON:
            p.push("t", poison(POISON[seq]), producer="bad", seq=seq)
        step()
        if seq % 2:
            p.checkpoint()
    step()
    p.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
