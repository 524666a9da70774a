"""Child process of the reader test: a read-only OutputLog that refreshes while another process appends, checking every step once, in order, complete.

Usage: outputlog_reader_child.py <output dir> <steps> <progress file>. Writes the next step it needs to the
progress file (so the writer's retention stays behind it); prints "OK <steps> <refreshes> <first step left> <refreshes that met a record being written>",
or the problem on stderr with exit status 1.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dbsp_core.storage.outputlog import OutputLog  # noqa: E402

from outputlog_helpers import SCHEMAS, big_rows, inputs, outputs  # noqa: E402


def main() -> int:
    path, n, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    deadline = time.monotonic() + 240
    while not os.path.isdir(path):
        time.sleep(0.005)
    log = OutputLog(path, SCHEMAS, readonly=True)
    nxt, refreshes, partial = 0, 0, 0
    with open(progress, "w") as f:
        f.write("0")
    while nxt < n:
        if time.monotonic() > deadline:
            print(f"timed out at step {nxt} (log holds {log.first}..{log.last - 1})", file=sys.stderr)
            return 1
        log.refresh()
        refreshes += 1
        segs = log._log.segments()
        try:  # the newest segment's file is longer than its valid records: a record was being written
            partial += segs and os.path.getsize(os.path.join(path, f"{segs[-1][0]:020d}.seg")) > segs[-1][2]
        except FileNotFoundError:
            pass
        if log.first > nxt:
            print(f"step {nxt} was dropped before it was read (log holds {log.first}..)", file=sys.stderr)
            return 1
        for step, z in log.read("counts", nxt):
            if step != nxt:
                print(f"read step {step}, expected {nxt}", file=sys.stderr)
                return 1
            want = outputs(step, big_rows(step))
            got = log.get(step)
            if any(got[k].to_dict() != want[k].to_dict() for k in SCHEMAS) or z.to_dict() != want["counts"].to_dict() \
                    or log.inputs_of(step) != inputs(step):
                print(f"step {step} differs from what was written", file=sys.stderr)
                return 1
            nxt += 1
        tmp = progress + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(nxt))
        os.replace(tmp, progress)
    log.refresh()
    dropped = log.first
    log.close()
    print(f"OK {nxt} {refreshes} {dropped} {partial}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
