"""The Arrow memory pool a pipeline's process allocates from: with ``DBSP_JEMALLOC=1``, jemalloc, chosen once, when the first Pipeline is built; by default Arrow's own (mimalloc in the pyarrow wheels).

Why a choice: mimalloc hands freed pages back to the system shortly after a free (its purge delay, 10 ms). A
streaming step frees the buffers of its input and of its intermediates, so the next step, and the read that feeds
it (pyarrow's CSV and Parquet readers allocate from the same pool), may fault the same memory in again, each fault
zeroing a page, or 2 MiB where the kernel backs the pool with transparent huge pages. Measured on Nexmark, W=2, 1M
events (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "Where the time goes, per query", 2026-11-29): under mimalloc the kernel's page zeroing
moved between runs of one query from nothing to half of its process CPU (system CPU q2 0.07-0.26 s of 0.30-0.45 s,
q16 0.26-1.73 s of 2.4-4.0 s); under jemalloc the spread was narrower (q2 0.05-0.08 s, q16 0.42-0.66 s) but the
medians of the stateless queries were not lower (q0 0.30 -> 0.34 s, q1 0.28 -> 0.32 s CPU; q15 0.93 -> 0.89, q16
3.02 -> 2.88): jemalloc as Arrow configures it faults about ten times the pages (21K against 2K minor faults on q0)
at a steadier cost. So it is a switch for runs that want the tighter spread, not the default.

Invariants (enforced here):
  1. Only the process's default pool changes, once per process, when a Pipeline is built (:func:`use_jemalloc`),
     and only when ``DBSP_JEMALLOC`` is on, ``ARROW_DEFAULT_MEMORY_POOL`` is unset (a choice made for Arrow wins)
     and this pyarrow has jemalloc; otherwise Arrow's default stays. Buffers allocated before keep their pool
     (Arrow frees a buffer to the pool that allocated it), so the switch is safe at any point.
  2. Nothing else in dbsp_core names a pool: everything allocates from ``pa.default_memory_pool()`` as before, and
     the memory release after a big step reaches the pool in force.
"""

from __future__ import annotations

import os
import threading

import pyarrow as pa

from dbsp_core.envvars import settings

__all__ = ["use_jemalloc"]

_lock = threading.Lock()
_done = False


def use_jemalloc() -> str:
    """With ``DBSP_JEMALLOC=1``, make jemalloc Arrow's default memory pool, once per process (invariant 1); returns
    the pool in force."""
    global _done
    with _lock:
        if not _done:
            _done = True
            if settings().jemalloc and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
                try:
                    pa.set_memory_pool(pa.jemalloc_memory_pool())
                except NotImplementedError:  # a pyarrow built without jemalloc: Arrow's default stays
                    pass
    return pa.default_memory_pool().backend_name
