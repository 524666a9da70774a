"""Memory sizing of the traces' key indexes: the memory this process may use (the machine's, or a cgroup's limit)
and the size limits derived from it and from the settings, computed once, when the first key index is built.

Nothing here runs at import: :func:`key_index_sizing` reads the settings (dbsp_core/envvars.py) and the cgroup
files, and sets the C core's process-wide budget (csrc/keyindex.h invariant 6), at its first call, which the first
key index a trace builds makes (dbsp_core/trace/keyindex.py); later calls return the same limits.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

from dbsp_core.envvars import parse_number, settings

__all__ = ["KeyIndexSizing", "key_index_sizing", "memory_bytes", "key_index_mb", "key_index_total_mb"]


def memory_bytes() -> int | None:
    """The memory this process may use: the machine's physical memory, or a cgroup's limit (a container) when lower;
    None when neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:  # "max" (v2) or a huge number (v1) when unlimited
            limits.append(int(text))
    limits = [x for x in limits if x > 0]
    return min(limits) if limits else None


def _value(setting: float | str | None, name: str) -> float | None:
    """A size setting's value: a number as it is (dbsp_core/envvars.py parsed it), text parsed as a number > 0
    (ValueError naming ``name``), None when unset or blank."""
    if isinstance(setting, str):
        return parse_number(setting, name, positive=True) if setting.strip() else None
    return setting


def key_index_mb(setting: float | str | None, memory: int | None, name: str = "DBSP_KEY_INDEX_MB") -> float:
    """The size limit of one key index in MiB (trace invariant 11): ``DBSP_KEY_INDEX_MB`` when set (``setting``, its
    value or its text: a positive number), else an eighth of the process's memory (:func:`memory_bytes`), at least
    512 MiB (512 MiB when unknown). An index holds about its trace's bytes per key (an entry of the key and sums,
    and a slot word in a table 3/8 to 3/4 full), so a limit that does not grow with the machine would turn the
    indexes off exactly where the state is large (at 10M groups a two-sum index needs about 360 MiB).

    >>> key_index_mb(None, 24 * 2**30), key_index_mb(None, 2 * 2**30), key_index_mb(None, None), key_index_mb("64", None)
    (3072.0, 512.0, 512.0, 64.0)
    """
    value = _value(setting, name)
    if value is not None:
        return value
    return max(512.0, memory / 8 / 2**20) if memory else 512.0


def key_index_total_mb(setting: float | str | None, memory: int | None) -> float:
    """The budget on every key index of the process together, in MiB (csrc/keyindex.h invariant 6):
    ``DBSP_KEY_INDEX_TOTAL_MB`` when set (``setting``, its value or its text: a positive number), else a quarter of
    the process's memory (:func:`memory_bytes`), at least 1024 MiB (1024 MiB when unknown). It keeps many large
    indexes (one per stateful operator and worker) from taking the memory the state needs: the index that would
    pass it is dropped instead.

    >>> key_index_total_mb(None, 24 * 2**30), key_index_total_mb(None, None), key_index_total_mb("2048", None)
    (6144.0, 1024.0, 2048.0)
    """
    value = _value(setting, "DBSP_KEY_INDEX_TOTAL_MB")
    if value is not None:
        return value
    return max(1024.0, memory / 4 / 2**20) if memory else 1024.0


class KeyIndexSizing(NamedTuple):
    """The key indexes' size limits in MiB: one index's (:func:`key_index_mb`: above it, a trace drops its index)
    and every index's of the process together (:func:`key_index_total_mb`: the C core's budget)."""

    index_mb: float
    total_mb: float


_sizing: KeyIndexSizing | None = None
_lock = threading.Lock()


def key_index_sizing() -> KeyIndexSizing:
    """The key indexes' size limits, computed at the first call from ``DBSP_KEY_INDEX_MB``,
    ``DBSP_KEY_INDEX_TOTAL_MB`` and :func:`memory_bytes`; the first call also sets the C core's budget on every
    index together to ``total_mb`` (process-wide, set once). Later calls return the same limits."""
    global _sizing
    if _sizing is None:
        with _lock:
            if _sizing is None:
                from dbsp_core import _zset

                s, memory = settings(), memory_bytes()
                sizing = KeyIndexSizing(key_index_mb(s.key_index_mb, memory),
                                        key_index_total_mb(s.key_index_total_mb, memory))
                _zset.keyindex_budget(int(sizing.total_mb * 2**20))
                _sizing = sizing
    return _sizing
