"""Child process of the kill -9 test: appends to a StepLog and commits a Database forever, reporting acks on stdout.

Protocol (one line per event, written only after the operation returned):
  "A <seq>"              the append with sequence number <seq> is durable
  "C <version> <nseq>"   version <version> is committed and records the log length <nseq>
"""

from __future__ import annotations

import os
import random
import sys
import types

# Start fast: load dbsp_core.storage without running the package __init__ (which imports pyarrow).
_pkg = types.ModuleType("dbsp_core")
_pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "dbsp_core")]
sys.modules.setdefault("dbsp_core", _pkg)

from dbsp_core.storage import Database, StepLog  # noqa: E402


def payload(seq: int) -> bytes:
    return (b"%d;" % seq) * (1 + seq % 97)


def main(d: str, seed: int) -> None:
    rng = random.Random(seed)
    log = StepLog(os.path.join(d, "log"), segment_bytes=32 << 10)
    db = Database(os.path.join(d, "db"))
    last = None
    for r in log.iter_from(log.first_step or 0):
        last = r
    next_seq = last.seq + 1 if last else 0
    step = last.step + 1 if last else 0
    v = max(db.versions())
    out = os.fdopen(sys.stdout.fileno(), "wb", buffering=0)
    out.write(b"READY\n")
    while True:
        for _ in range(rng.randint(1, 8)):
            log.append(step, "in", payload(next_seq), producer="child", seq=next_seq)
            out.write(b"A %d\n" % next_seq)
            next_seq += 1
        step += 1
        with db.open(v) as h:
            h.put("commits", b"%08d" % (v + 1), b"%d" % next_seq)
            if rng.random() < 0.3:
                h.put("state", b"blob", os.urandom(rng.choice([100, 5000, 40000])))
            for _ in range(rng.randint(0, 20)):
                h.put("state", b"k%03d" % rng.randrange(300), os.urandom(rng.randint(1, 200)))
            h.set_step(step)
            h.commit()
        v += 1
        out.write(b"C %d %d\n" % (v, next_seq))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
