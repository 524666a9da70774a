"""The Arrow memory pool a pipeline's process allocates from: jemalloc, chosen once, when the first Pipeline is built.

Why: the pyarrow wheels' default pool is mimalloc, which hands freed pages back to the system shortly after a free
(its purge delay, 10 ms). A streaming step frees the buffers of its input and of its intermediates, so the next
step, and the read that feeds it (pyarrow's CSV and Parquet readers allocate from the same pool), fault the same
memory in again, each fault zeroing a page, or 2 MiB where the kernel backs the pool with transparent huge pages.
Measured on Nexmark (bench/RESULTS.md, "Where the time goes, per query"): with mimalloc the kernel's page zeroing
(``clear_page_erms``) was up to half of a query's process CPU and moved between runs of the same query (system CPU
0.00-0.27 s of q1/q3/q15's 0.1-0.9 s); with jemalloc, which Arrow configures to return pages over a second and
which ``release_unused`` purges at once (runtime/embedded.py ``release_memory``, after a big step), the pages stay
between steps and the peak RSS was lower.

Invariants (enforced here):
  1. Only the process's default pool changes, once per process, when a Pipeline is built (:func:`use_jemalloc`),
     and only when ``DBSP_JEMALLOC`` is on (the default), ``ARROW_DEFAULT_MEMORY_POOL`` is unset (a choice made
     for Arrow wins) and this pyarrow has jemalloc; otherwise Arrow's default stays. Buffers allocated before keep
     their pool (Arrow frees a buffer to the pool that allocated it), so the switch is safe at any point.
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
    """Make jemalloc Arrow's default memory pool, once per process (invariant 1); returns the pool in force."""
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
