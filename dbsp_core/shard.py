"""Fixed sharding: a ShardMap assigns S = 2**shard_bits key-hash shards to W workers in contiguous slices, and a Layout places workers on hosts.

Invariants (enforced here):
  1. ``S`` is a power of two and ``S >= W``; a row's shard is the top ``shard_bits`` bits of its 64-bit
     key hash, never ``hash % W``.
  2. Shards are assigned in contiguous slices: shard ``s`` belongs to worker ``s * W // S``, so every
     worker owns ``S / W`` shards (rounded) and owner(s) is non-decreasing in ``s``.
  3. A ShardMap is immutable; a layout change builds a new one and :meth:`ShardMap.moved_shards`
     says which shards change owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_SHARD_BITS = 8


class ShardMap:
    """Maps each of ``2**shard_bits`` shards to one of ``workers`` workers, in contiguous slices.

    Parameters
    ----------
    workers : int
        Number of workers W (>= 1).
    shard_bits : int, optional
        log2 of the number of shards S; S must be >= W. Default 8 (256 shards).

    Examples
    --------
    >>> m = ShardMap(workers=2, shard_bits=2)
    >>> m.part_of_shard.tolist()
    [0, 0, 1, 1]
    >>> list(m.shards_of(1))
    [2, 3]
    """

    __slots__ = ("_workers", "_shard_bits", "_part_of_shard")

    def __init__(self, workers: int, shard_bits: int = DEFAULT_SHARD_BITS) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"ShardMap: workers must be a positive int, got {workers!r}")
        if not isinstance(shard_bits, int) or not 0 <= shard_bits <= 16:
            raise ValueError(f"ShardMap: shard_bits must be an int in [0, 16], got {shard_bits!r}")
        if (1 << shard_bits) < workers:
            raise ValueError(f"ShardMap: {1 << shard_bits} shards (shard_bits={shard_bits}) "
                             f"cannot be spread over {workers} workers; raise shard_bits")
        self._workers = workers
        self._shard_bits = shard_bits
        nshards = 1 << shard_bits
        owner = (np.arange(nshards, dtype=np.int64) * workers) // nshards
        self._part_of_shard = owner.astype(np.int32)

    @property
    def workers(self) -> int:
        """Number of workers W."""
        return self._workers

    @property
    def shard_bits(self) -> int:
        """log2 of the number of shards."""
        return self._shard_bits

    @property
    def shards(self) -> int:
        """Number of shards S = 2**shard_bits."""
        return 1 << self._shard_bits

    @property
    def part_of_shard(self) -> np.ndarray:
        """int32 array of length S: the worker owning each shard (do not modify it)."""
        return self._part_of_shard

    def worker_of(self, shard: int) -> int:
        """The worker that owns ``shard``."""
        return int(self._part_of_shard[shard])

    def shards_of(self, worker: int) -> range:
        """The contiguous range of shards owned by ``worker``."""
        hits = np.flatnonzero(self._part_of_shard == worker)
        if len(hits) == 0:
            return range(0)
        return range(int(hits[0]), int(hits[-1]) + 1)

    def shard_of_hash(self, hashes: np.ndarray) -> np.ndarray:
        """Shard of each 64-bit key hash: its top ``shard_bits`` bits."""
        h = np.asarray(hashes, dtype=np.uint64)
        if self._shard_bits == 0:
            return np.zeros(len(h), dtype=np.int64)
        return (h >> np.uint64(64 - self._shard_bits)).astype(np.int64)

    def moved_shards(self, other: "ShardMap") -> list[int]:
        """Shards whose owner differs between ``self`` and ``other`` (same shard count required)."""
        if other.shard_bits != self._shard_bits:
            raise ValueError("ShardMap.moved_shards: both maps need the same shard_bits")
        return np.flatnonzero(self._part_of_shard != other.part_of_shard).tolist()

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ShardMap) and other._workers == self._workers
                and other._shard_bits == self._shard_bits)

    def __hash__(self) -> int:
        return hash((self._workers, self._shard_bits))

    def __repr__(self) -> str:
        return f"ShardMap(workers={self._workers}, shard_bits={self._shard_bits})"


@dataclass(frozen=True)
class Layout:
    """Where work runs: a ShardMap (shards -> workers) and the host of each worker.

    Examples
    --------
    >>> lay = Layout.local(workers=2)
    >>> lay.shard_map.workers, lay.hosts
    (2, ('local', 'local'))
    >>> lay.workers_on("local")
    [0, 1]
    """

    shard_map: ShardMap
    hosts: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        hosts = tuple(self.hosts) or ("local",) * self.shard_map.workers
        if len(hosts) != self.shard_map.workers:
            raise ValueError(f"Layout: {len(hosts)} hosts given for {self.shard_map.workers} workers")
        object.__setattr__(self, "hosts", hosts)

    @classmethod
    def local(cls, workers: int, shard_bits: int = DEFAULT_SHARD_BITS) -> "Layout":
        """All ``workers`` in this process."""
        return cls(ShardMap(workers, shard_bits))

    def workers_on(self, host: str) -> list[int]:
        """The workers placed on ``host``."""
        return [w for w, h in enumerate(self.hosts) if h == host]
