"""Child of test_unclosed_at_exit.py: runs a pipeline (argv[1]: "memory" or "durable" under argv[2], a directory)
whose budget makes the spill thread and the merge thread run, and ends without close(); an exit hook registered
before dbsp_core is imported (so it runs after the engine's own) prints the engine threads still alive then."""

from __future__ import annotations

import atexit
import sys
import threading


def _report() -> None:
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("dbsp-") and t.is_alive())
    print("ALIVE AT EXIT:", ",".join(left) or "none", flush=True)


atexit.register(_report)  # atexit runs last-in first-out: this one after dbsp_core's

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

import dbsp_core as dbsp  # noqa: E402

c = dbsp.Circuit()
s = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
c.output("d", s.distinct())
storage = sys.argv[2] if sys.argv[1] == "durable" else None
p = dbsp.Pipeline(c, workers=1, storage=storage, memory_limit="8MiB", checkpoint_interval=0.001 if storage else None)
p.executor.background_merge = True  # the merge thread even on a machine with one core
rng = np.random.default_rng(7)
for _ in range(12):
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 150_000), "v": rng.integers(0, 100, 150_000)}))
    p.step()
started = sorted({t.name for t in threading.enumerate() if t.name.startswith("dbsp-")})
print("STARTED:", ",".join(started), flush=True)
# no p.close(): the script just ends
