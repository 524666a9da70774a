"""Child of test_spill_full_disk.py: a pipeline under a 4 MiB budget whose spill_dir (argv[1]) has no room for a merge's scratch file; prints the error it got (``ERROR <type> <errno> <message>``) or ``NO ERROR``. With argv[2] == "inject", ``os.posix_fallocate`` fails with ENOSPC (the file system of argv[1] has room: a mount was not possible)."""

from __future__ import annotations

import errno
import os
import sys

import numpy as np
import pyarrow as pa

import dbsp_core as dbsp

if sys.argv[2] == "inject":
    def _full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.posix_fallocate = _full

from dbsp_core.trace import Trace  # noqa: E402

Trace.FAN_IN = 2  # spilled levels merge two at a time (levels.py invariant 15): a merge's scratch file, not a batch
# file, is the write that finds the disk full (with FAN_IN 4 the unmerged batches' files fill it first: a clear
# error too, from the batch file's write)

c = dbsp.Circuit()
s = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
c.output("d", s.distinct())
p = dbsp.Pipeline(c, workers=1, memory_limit="4MiB", spill_dir=sys.argv[1])
rng = np.random.default_rng(1)
try:
    for _ in range(40):
        p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 200_000), "v": rng.integers(0, 100, 200_000)}))
        p.step()
    print("NO ERROR", flush=True)
except dbsp.DbspError as e:
    print("ERROR", type(e).__name__, getattr(e, "errno", None), e, flush=True)
