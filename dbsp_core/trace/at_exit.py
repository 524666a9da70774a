"""The engine's background threads stopped at interpreter exit, before Python finalizes, for pipelines never closed.

The merge thread, the spill thread and a background checkpoint are daemon threads that run C code with the GIL
released. A script that ends without ``close()`` (after an error, say) leaves them running; Python then finalizes
under them, and a daemon thread that takes the GIL back inside a C call during finalization can abort the process
(seen: SIGABRT, "PyGILState_Release: thread state must be current", after the script had ended normally). An
``atexit`` hook runs while the interpreter is still whole and after Python has joined the user's non-daemon
threads: it stops each registered owner's threads there (the merge thread after its current chunk, the spill thread
after the batches handed to it, a background checkpoint at its end), so no engine thread is left at finalization.
What they leave unfinished is what any crash leaves (merges are finished by the next insert; unswitched spill files
and an unfinished checkpoint are swept by the next open).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

__all__ = ["stop_at_exit", "stop_all"]


class _Stoppable(Protocol):
    def _stop_for_exit(self) -> None: ...


_live: "weakref.WeakSet[_Stoppable]" = weakref.WeakSet()


def stop_at_exit(owner: _Stoppable) -> None:
    """Have ``owner._stop_for_exit()`` called at interpreter exit if ``owner`` is still alive then (held weakly)."""
    _live.add(owner)


def stop_all() -> int:
    """Stop every registered owner's background threads (the ``atexit`` hook); returns how many owners it stopped.
    One owner's failure does not keep the others running."""
    n = 0
    for owner in list(_live):
        try:
            owner._stop_for_exit()
            n += 1
        except BaseException:  # the process is ending: stop the rest
            pass
    return n


atexit.register(stop_all)
