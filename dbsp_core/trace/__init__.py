"""Traces: the integrated, indexed state of stateful operators, as consolidated batches in levels.

One room per concern (numbered invariants at the top of each, counted across the package as "trace invariant N"):

- ``levels.py``: :class:`Trace`, its batches in levels by work, merged a little on every insert, and the reads,
  shard cuts and cleanup over them (invariants 1-9).
- ``merge_thread.py``: :class:`MergeThread`, the background thread that advances merges while steps run, and
  :func:`merging`, which puts one in force on an inserting thread (invariant 10).
- ``keyindex.py``: the key-index cache, per-key sums kept beside the batches (invariant 11), and :func:`summable`.
- ``sizing.py``: the key indexes' memory sizing (machine and cgroup memory, ``DBSP_KEY_INDEX*_MB``), computed when
  the first index is built, never at import.
- ``batchfile.py``: the batch file, one batch written once to an immutable, checksummed file (an Arrow IPC file, a
  fence and a Bloom filter of its key hashes, page CRCs), read in place through a memory mapping.
- ``spill.py``: :class:`BatchStore`, a pipeline's memory budget over its traces: the biggest, oldest batches move
  to batch files between steps and are read in place through a byte-budgeted cache (invariant 12); checkpoints
  name the files instead of copying their rows (invariant 13).

Batches are :class:`~dbsp_core.zset.IndexedZSet` objects; the levels reach them only through the entries of
``Trace._by_level`` and ``Trace.pending`` and read them through ``Trace._read()``, the seam where the batch store
registers a trace and marks its files used. A spilled batch is the same object with its buffers switched to the
file's mapping, so nothing else in the trace changes.
"""

from dbsp_core.trace.keyindex import summable
from dbsp_core.trace.levels import Trace, level_of, unique_sorted
from dbsp_core.trace.merge_thread import MergeThread, current_merge_thread, merging

__all__ = ["Trace", "MergeThread", "merging", "current_merge_thread", "level_of", "unique_sorted", "summable"]
