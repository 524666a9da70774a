"""A process the Delta kill tests SIGKILL at random points: two DeltaSinks (the ``big`` view appended, the
``by_region`` view merged by key) over a pipeline's storage directory, one commit per step, up to four
steps per acknowledgement to the output log.

    delta_child.py STORAGE APPEND_URI MERGE_URI TARGET_STEP
        runs both sinks until each holds every step below TARGET_STEP; prints START, then DONE.
"""

from __future__ import annotations

import sys

from dbsp_core.connectors import DeltaSink


def main(storage: str, append_uri: str, merge_uri: str, target: int) -> None:
    sinks = [DeltaSink(storage, "big", append_uri), DeltaSink(storage, "by_region", merge_uri, mode="merge",
                                                               key=["region"])]
    print("START", min(s.next for s in sinks), flush=True)
    while min(s.next for s in sinks) < target:
        for s in sinks:
            s.poll(limit=4)  # several commits per acknowledgement: a kill between them tests invariant 2
    for s in sinks:
        s.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
