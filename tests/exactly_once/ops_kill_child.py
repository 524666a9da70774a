"""Child process of the concurrency kill test: runs rounds of the random-operations harness (ops_harness.Round) on the durable pipeline in DIR, recording each push (and operation on the keyed table) before it is made, once acknowledged and when refused, and each discard, in DIR/../ops-log.txt (appended and fsync'd line by line), until killed or done.

Usage: ops_kill_child.py DIR SEED RUN MODE ROUNDS. Prints a JSON line of counts at the end.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ops_harness import Round  # noqa: E402


def main() -> int:
    d, seed, run, mode, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    fd = os.open(os.path.join(os.path.dirname(os.path.abspath(d)), "ops-log.txt"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    lock = threading.Lock()

    def record(line: str) -> None:
        with lock:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)

    totals: Counter = Counter()
    for r in range(rounds):
        rnd = Round(mode, seed, d, threads=3, ops=10, run=run * 1000 + r,
                    on_try=lambda pr, sq: record(f"try {pr} {sq}"), on_ack=lambda pr, sq: record(f"ack {pr} {sq}"),
                    on_discard=lambda what, pr, sq: record(f"discard-{what} {pr} {sq}"),
                    on_refused=lambda pr, sq: record(f"refused {pr} {sq}"))
        p = rnd.open()
        rnd.go(p)
        if rnd.failures:
            print(json.dumps({"failures": rnd.failures}), flush=True)
            return 1
        if not rnd.closed_by_op:
            p.close()
        totals.update(rnd.counts)
        totals["rounds"] += 1
        record(f"round {json.dumps(dict(rnd.counts))}")
    print(json.dumps(dict(totals)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
