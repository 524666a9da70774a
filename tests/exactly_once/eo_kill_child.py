"""Child process of the kill -9 tests: recovers the durable pipeline in a directory, resumes two producer threads from their last acknowledged seq (retrying the unacknowledged one), steps and checkpoints until every batch is in, then closes.

Usage: eo_kill_child.py DIR SEED BATCHES WORKERS [keyed] (keyed: the workload's keyed circuit). Acknowledgements are appended to DIR/../acks-<producer>.txt
(written before the next push, so a line is never missing for an ack the producer saw). Prints READY after
recovery and DONE at the end. DBSP_CRASHPOINT in the environment kills the process at a chosen point.
"""

from __future__ import annotations

import os
import random
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from workload import PRODUCERS, build_circuit, push_batch, with_refs  # noqa: E402


def acked(path: str) -> int:
    """Number of batches of a producer acknowledged so far (acks are contiguous from seq 0)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        seqs = [int(x.split()[0]) for x in f.read().split("\n") if x.strip()]
    assert seqs == list(range(len(seqs))), f"{path}: acks not contiguous"
    return len(seqs)


def main() -> int:
    d, seed, batches, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    return run(d, seed, batches, workers, int(os.environ.get("DBSP_RUN", "0")), sys.argv[5:] == ["keyed"])


def forked(d: str, seed: int, batches: int, workers: int, run_no: int, crash: str) -> None:
    """Entry point in a process forked from a preloaded server (multiprocessing forkserver); same as main."""
    import traceback

    from dbsp_core.runtime.crashpoints import arm_crashpoint

    arm_crashpoint(crash)
    try:
        run(d, seed, batches, workers, run_no)
    except BaseException:
        with open(os.path.join(os.path.dirname(os.path.abspath(d)), "child-error.txt"), "a") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run(d: str, seed: int, batches: int, workers: int, run: int, keyed: bool = False) -> int:
    root = os.path.dirname(os.path.abspath(d))
    c = build_circuit(keyed, not keyed and with_refs(seed))
    # small log segments, so checkpoints truncate the input log (GC runs under the kills too)
    # odd seeds also checkpoint on a 20 ms timer: those checkpoints commit on a background thread while steps run
    interval = 0.02 if seed % 2 else None
    p = dbsp.Pipeline(c, workers=workers, storage=d, checkpoint_interval=interval, segment_bytes=4096)
    print("READY", flush=True)
    rng = random.Random(f"{seed}/{run}")
    done = threading.Event()
    errors: list[BaseException] = []

    def produce(producer: str) -> None:
        path = os.path.join(root, f"acks-{producer}.txt")
        start = acked(path)
        try:
            with open(path, "a") as f:
                for seq in range(start, batches):
                    acks = push_batch(p, seed, producer, seq, keyed)
                    f.write(f"{seq} {int(any(a.duplicate for a in acks))}\n")
                    f.flush()
        except BaseException as e:  # pragma: no cover - reported by the parent
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(pr,)) for pr in PRODUCERS]
    for t in threads:
        t.start()
    n = 0
    while any(t.is_alive() for t in threads):
        p.step()
        n += 1
        if rng.random() < 0.25:
            p.checkpoint()
        if keyed and rng.random() < 0.3:  # read the materialized state while the producers push
            p.view("by_cat")
            p.query("SELECT count(*) FROM auctions")
        for t in threads:
            t.join(timeout=rng.uniform(0, 0.01))
    if errors:
        raise errors[0]
    p.step()  # the tail pushed after the last step
    p.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
