"""Where a format-2 lookup's CPU goes (dbsp_core/trace/groupedfile.py, ``GroupedFile.lookup`` taken apart phase by
phase, thread CPU time a phase): 1k-key lookups into one batch file of N rows (bench/probe_grouped_rw.py's data: an
int64 key, ~2 rows a key, two int64 columns), the file written once into ``--dir`` and reused. ``--prechecked``: every
CRC page marked checked first (the steady state of a long run: no first reads). Read the file whole first (``cat
FILE > /dev/null``) for a warm page cache.

    python bench/probe_grouped_phases.py --rows 10000000 --steps 60 --dir /tmp/grouped10m
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pyarrow as pa

from dbsp_core import ZSet, _storage
from dbsp_core.trace import batchfile as bf
from dbsp_core.trace.groupedfile import open_grouped, write_grouped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--prechecked", action="store_true")
    a = ap.parse_args()
    n = a.rows
    rng = np.random.default_rng(7)
    k = rng.integers(0, n // 2, n)
    b = ZSet.from_arrow(pa.table({"k": k, "v": rng.integers(0, 1 << 40, n), "s": rng.integers(0, 1000, n)})
                        ).consolidate().index_by(["k"])
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "two.batch")
    if not os.path.exists(path):
        write_grouped(path, b)
    kh = np.asarray(b.key_hash)
    del b
    f = open_grouped(path)
    if a.prechecked:
        f.checked[:] = True
    spent: dict[str, float] = {}

    def tick(name: str, t0: float) -> float:
        t1 = time.thread_time()
        spent[name] = spent.get(name, 0.0) + t1 - t0
        return t1

    groups = np.zeros(0, dtype=np.int64)
    for _ in range(a.steps):
        h = np.unique(kh[rng.integers(0, n, a.keys)])
        t = time.thread_time()
        groups = f.groups_of(h)
        t = tick("groups_of (filter, search)", t)
        length = f.msg_len[groups]
        at = f.index["slot"][groups].astype(np.int64) * f.slot
        f._check_pages(at, at + length)
        t = tick("first reads (pread + CRC of new slots)", t)
        head = len(f.schema_msg)
        dst = head + np.concatenate(([0], np.cumsum(length)))
        out = bytearray(int(dst[-1]) + 8)
        out[:head] = f.schema_msg
        out[-8:] = b"\xff\xff\xff\xff\0\0\0\0"
        _storage.pread_ranges(f.fd, np.ascontiguousarray(at), np.ascontiguousarray(length),
                              np.ascontiguousarray(dst[:-1]), out)
        t = tick("pread of the messages", t)
        tb = pa.ipc.open_stream(pa.py_buffer(out)).read_all()
        t = tick("Arrow IPC decode", t)
        np.asarray(tb.column(f.ndata + 1).combine_chunks().to_numpy(zero_copy_only=False), dtype=np.uint64)
        t = tick("key hash column combined (G1 check)", t)
        tb = tb.combine_chunks()
        t = tick("table combine_chunks", t)
        khc = bf._one_chunk(tb.column(f.ndata + 1)).to_numpy(zero_copy_only=False)
        f._batch(tb, np.flatnonzero(np.isin(khc, h)))
        tick("isin, take, IndexedZSet", t)
    for name, v in spent.items():
        print(f"{name:42s} {v / a.steps * 1e3:7.2f} ms")
    print(f"{'total':42s} {sum(spent.values()) / a.steps * 1e3:7.2f} ms; {len(groups)} groups a step; "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
