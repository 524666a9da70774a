"""Peak RSS and time of writing one large durable batch file (write_batch, sync=True) through the posix or the fault VFS, each run in a fresh process.

    python bench/bench_batchfile_write.py --rows 1000000                 # posix, then fault: one JSON line each
    python bench/bench_batchfile_write.py --rows 1000000 --repeat 2 --vfs posix

``peak_growth_mib`` is the process's peak RSS during the write over its RSS before it (VmHWM reset through
/proc/self/clear_refs): what writing holds besides the batch. Through the fault VFS it includes the VFS's own copy of
every unsynced write (its model of a crash, kept until the fsync), which is not the writer's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(rows: int, vfs: str, directory: str) -> None:
    """Build a batch of ``rows`` rows (int64 key, 100-byte string, row hashes: about 130 B a row), reset the peak
    RSS (/proc/self/clear_refs), write it, print the peak's growth over the RSS before the write."""
    import numpy as np
    import pyarrow as pa

    from dbsp_core import ZSet
    from dbsp_core.storage import FaultInjector
    from dbsp_core.trace.batchfile import write_batch

    pad = pa.array(np.full(rows, "x" * 100, dtype=object), pa.string())
    b = ZSet.from_arrow(pa.table({"k": np.arange(rows, dtype=np.int64), "pad": pad})).index_by(["k"])
    b._row_hashes()
    path = os.path.join(directory, "big.batch")
    if vfs == "fault":
        FaultInjector.arm()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    size = write_batch(path, b, vfs, sync=True)
    dt = time.perf_counter() - t0
    peak = _kib("VmHWM")
    print(json.dumps({"rows": rows, "vfs": vfs, "file_mib": round(size / 2**20, 1), "seconds": round(dt, 2),
                      "rss_before_mib": round(before / 1024, 1), "peak_growth_mib": round((peak - before) / 1024, 1),
                      "ops": FaultInjector.ops() if vfs == "fault" else None}))
    os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--vfs", nargs="+", default=["posix", "fault"])
    ap.add_argument("--repeat", type=int, default=1, help="runs per VFS, alternated")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help="where the file is written (default: a temporary directory)")
    a = ap.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="dbsp-bench-batchfile-")
    if a.child:
        child(a.rows, a.vfs[0], d)
        return
    for _ in range(a.repeat):
        for vfs in a.vfs:
            subprocess.run([sys.executable, __file__, "--child", "--rows", str(a.rows), "--vfs", vfs, "--dir", d],
                           check=True)


if __name__ == "__main__":
    main()
