"""Child process of the object-store kill test: recovers the durable pipeline from an S3 prefix into an empty local cache, resumes two producers from their last confirmed seq (pushing the unconfirmed ones again), steps (and checkpoints on another thread) until every batch is in, then closes.

Usage: remote_kill_child.py URI CACHE_DIR SEED BATCHES WORKERS. The parent deletes CACHE_DIR before every run.
Files beside CACHE_DIR: ``pushed-<producer>.txt`` (a line per push as it returns: seq and whether it was a
duplicate) and ``confirmed-<producer>.txt`` (after each checkpoint returns, how many seqs were pushed before it
began: those are in the store whatever the logs do). A producer resumes at its confirmed count and pushes the later
seqs again: each of those acknowledged before the kill must come back as a duplicate (the parent counts). Prints READY after recovery, DONE at the end.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from workload import PRODUCERS, build_circuit, push_batch  # noqa: E402


def confirmed(path: str) -> int:
    """The producer's seqs below this are in the store (the last line of its confirmed file)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [x for x in f.read().split("\n") if x.strip()]
    return int(lines[-1]) if lines else 0


def main() -> int:
    uri, cache, seed, batches, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    root = os.path.dirname(os.path.abspath(cache))
    rng = random.Random(f"{seed}/{os.environ.get('DBSP_RUN', '0')}")
    # odd seeds also checkpoint on a 50 ms timer: those uploads run on a background thread while steps go on
    interval = 0.05 if seed % 2 else None
    p = dbsp.Pipeline(build_circuit(), workers=workers, storage=uri, cache_dir=cache, checkpoint_interval=interval,
                      segment_bytes=4096)
    print("READY", p.steps, flush=True)
    pushed = {pr: confirmed(os.path.join(root, f"confirmed-{pr}.txt")) for pr in PRODUCERS}
    errors: list[BaseException] = []

    def produce(producer: str) -> None:
        prng = random.Random(f"{seed}/{producer}/{os.environ.get('DBSP_RUN', '0')}")
        try:
            with open(os.path.join(root, f"pushed-{producer}.txt"), "a") as f:
                for seq in range(pushed[producer], batches):
                    acks = push_batch(p, seed, producer, seq)
                    f.write(f"{seq} {int(any(a.duplicate for a in acks))}\n")
                    f.flush()
                    pushed[producer] = seq + 1
                    time.sleep(prng.uniform(0, 0.02))  # producers spread over the run, so kills land between pushes
        except BaseException as e:  # pragma: no cover - reported by the parent
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(pr,)) for pr in PRODUCERS]
    for t in threads:
        t.start()

    def checkpoint() -> None:
        before = dict(pushed)  # pushes that returned before the checkpoint began: in the store once it returns
        p.checkpoint()
        for pr, n in before.items():
            with open(os.path.join(root, f"confirmed-{pr}.txt"), "a") as f:
                f.write(f"{n}\n")
                f.flush()

    # checkpoints run on their own thread while this one steps: the upload of one (remote_state invariant 5) is in
    # flight while later steps run, the window the "checkpoint-manifest" crash point kills in
    ckpt: threading.Thread | None = None

    def checkpointer() -> None:
        try:
            checkpoint()
        except BaseException as e:  # pragma: no cover - reported by the parent
            errors.append(e)

    while any(t.is_alive() for t in threads):
        p.step()
        if rng.random() < 0.3 and (ckpt is None or not ckpt.is_alive()):
            ckpt = threading.Thread(target=checkpointer)
            ckpt.start()
        for t in threads:
            t.join(timeout=rng.uniform(0, 0.02))
    if ckpt is not None:
        ckpt.join()
    if errors:
        raise errors[0]
    p.step()  # the tail pushed after the last step
    checkpoint()
    p.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
