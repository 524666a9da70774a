"""Child process of the kill -9 test: 3 threads append to a StepLog, the main thread commits a Database, forever.

Protocol (one line per event, written only after the operation returned):
  "A <producer> <seq>"   the append of producer p<producer> with sequence number <seq> is durable
  "C <version> <nseq>"   version <version> is committed and records the log length <nseq>
"""

from __future__ import annotations

import os
import random
import sys
import threading
import types

# Start fast: load dbsp_core.storage without running the package __init__ (which imports pyarrow).
_pkg = types.ModuleType("dbsp_core")
_pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "dbsp_core")]
sys.modules.setdefault("dbsp_core", _pkg)

from dbsp_core.storage import Database, StepLog  # noqa: E402


def payload(seq: int) -> bytes:
    return (b"%d;" % seq) * (1 + seq % 97)


PRODUCERS = 3


def resume(log: StepLog) -> tuple[list[int], int]:
    """Each producer's next sequence number and the next step, from the log's last steps: every step holds appends
    of every producer unless a kill cut it short, so a few steps back usually find all three; the window widens
    (to the whole log at worst) until it does. Reading the whole log at every start made a 10k-kill soak
    quadratic (the log reaches hundreds of MiB)."""
    last, first = log.last_step, log.first_step
    if last is None:
        return [0] * PRODUCERS, 0
    back = 8
    while True:
        lo = max(first, last - back)
        found: dict[int, int] = {}
        for r in log.iter_from(lo):
            found[int(r.producer[1:])] = r.seq + 1
        if len(found) == PRODUCERS or lo == first:
            return [found.get(p, 0) for p in range(PRODUCERS)], last + 1
        back *= 8


def main(d: str, seed: int) -> None:
    rng = random.Random(seed)
    log = StepLog(os.path.join(d, "log"), segment_bytes=32 << 10)
    db = Database(os.path.join(d, "db"))
    next_seq, step = resume(log)
    v = max(db.versions())
    fd = sys.stdout.fileno()
    os.write(fd, b"READY\n")

    def produce(p: int, n: int) -> None:  # concurrent appends of one step share fsyncs (group commit)
        for _ in range(n):
            s = next_seq[p]
            log.append(step, "in", payload(s), producer=f"p{p}", seq=s)
            os.write(fd, b"A %d %d\n" % (p, s))  # one write() per line: atomic on a pipe
            next_seq[p] = s + 1

    while True:
        ths = [threading.Thread(target=produce, args=(p, rng.randint(1, 6))) for p in range(PRODUCERS)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        step += 1
        with db.open(v) as h:
            h.put("commits", b"%08d" % (v + 1), b"%d" % sum(next_seq))
            if rng.random() < 0.3:
                h.put("state", b"blob", os.urandom(rng.choice([100, 5000, 40000])))
            for _ in range(rng.randint(0, 20)):
                h.put("state", b"k%03d" % rng.randrange(300), os.urandom(rng.randint(1, 200)))
            h.set_step(step)
            h.commit()
        v += 1
        os.write(fd, b"C %d %d\n" % (v, sum(next_seq)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
