"""What a format-2 lookup costs read by pread against read in place from the file's mapping (groupedfile.py invariant
G5), the engine's own ``GroupedFile.lookup``: 1,000 random groups' first key hashes a lookup, process CPU (user, sys)
and minor faults a lookup, with the mapping kept between lookups or dropped (MADV_DONTNEED) after each (what the
batch store's mapped bound does when a step's units pass its cap), every slot already checked (``pre``) or none
(``new``: first reads, CRC and order checks); the file's FilePmdMapped at the end (its page cache in 2 MiB folios
or not). The file: bench/probe_grouped_phases.py's.

    PYTHONPATH=. python bench/probe_grouped_phases.py --rows 10000000 --steps 1 --dir /tmp/g10m
    PYTHONPATH=. python bench/probe_grouped_mapped.py /tmp/g10m/two.batch
"""

from __future__ import annotations

import argparse
import mmap
import resource

import numpy as np

from dbsp_core.trace.groupedfile import open_grouped


def _pmd() -> str:
    with open("/proc/self/smaps_rollup") as fh:
        return " ".join(line.split()[1] for line in fh if line.startswith(("Rss:", "FilePmdMapped:")))


def run(path: str, mode: str, pre: bool, lookups: int, keys: int, seed: int) -> None:
    f = open_grouped(path)
    f.read_mapped = mode != "pread"
    if pre:
        f.checked[:] = True
        f.verified[:] = 1
    rng = np.random.default_rng(seed)
    kh = f.first_hash
    a = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(lookups):
        f.lookup(kh[rng.integers(0, len(kh), keys)])
        if mode == "dropped":
            f.map.madvise(mmap.MADV_DONTNEED)
    b = resource.getrusage(resource.RUSAGE_SELF)
    pmd = _pmd()
    print(f"{mode:8s} {'pre' if pre else 'new'}: user {1e3 * (b.ru_utime - a.ru_utime) / lookups:.3f} ms, sys "
          f"{1e3 * (b.ru_stime - a.ru_stime) / lookups:.3f} ms, minor faults {(b.ru_minflt - a.ru_minflt) / lookups:.0f}"
          f" a lookup; Rss / FilePmdMapped kB {pmd}")
    f.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--keys", type=int, default=1000)
    a = ap.parse_args()
    for mode in ("pread", "kept", "dropped"):
        for pre in (True, False):
            run(a.path, mode, pre, a.lookups, a.keys, 1)


if __name__ == "__main__":
    main()
