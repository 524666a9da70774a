"""Layouts as data: S key-hash shards and an owner table shard -> worker (a ShardMap), rebalanced to a new worker count by moving the fewest shards, with S doubling or halving as the worker count grows or shrinks (dynamic sharding: at least W / IMBALANCE shards, so no worker holds much more than its fair share).

Invariants (enforced here):
  1. ``S = 2**shard_bits`` and ``S >= W``; a row's shard is the top ``shard_bits`` bits of its 64-bit key
     hash, never ``hash % W``. Every worker ``0..W-1`` owns at least one shard.
  2. A ShardMap and a Layout are immutable; a layout change builds a new Layout with a larger ``epoch``.
  3. :meth:`Layout.rebalance` to ``W'`` workers gives every worker ``floor(S/W')`` or ``ceil(S/W')`` shards and
     changes the owner of as few shards as that allows: a staying worker keeps every shard within its quota,
     the ``S mod W'`` larger quotas go to the workers that hold the most shards, and leaving workers
     (``w >= W'``) give up all of theirs. Going from W to W+1 takes about ``S/(W+1)`` shards, evenly from every
     worker; going to W-1 spreads the leaving worker's shards evenly over the others.
  4. Dynamic sharding: ``S`` is the smallest power of two ``>= W / IMBALANCE`` (so no worker holds more than
     about 10% above its fair share) and at least ``2**min_shard_bits``. Doubling S splits shard ``s`` into
     ``2s`` and ``2s + 1`` with the same owner (nothing moves); halving S gives shard ``s`` the owner of
     ``2s`` (only odd children with another owner move), then rebalances.
  5. Owner tables compare at the finer of two shard counts: shard ``s`` at ``b`` bits covers the shards
     ``s << d .. (s + 1) << d`` at ``b + d`` bits, so :meth:`Layout.moved_shards` is exact across a split or
     a merge.
  6. :meth:`Layout.steps_to` cuts a change into waves: layouts that each move at most ``batch`` shards, in shard
     order (neighbouring shards move together, so each wave is few contiguous key-hash ranges). The layouts in
     between keep ``max(W, W')`` workers, some of which may own no shard yet (growing) or any more
     (shrinking); the last one is the target itself. A change of the shard count comes first, as a layout
     of its own that moves nothing (a split) or that first gathers every pair of children with the owner
     of the even child (a merge).
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

import numpy as np

DEFAULT_SHARD_BITS = 8
"""256 shards by default: at most 10% imbalance up to 25 workers with no split, and small enough that a
trace batch of a few thousand rows still has several rows per shard when it is saved shard by shard."""

MAX_SHARD_BITS = 16
IMBALANCE = 0.1  # k of dynamic sharding: S >= W / k keeps every worker within about k of its fair share
HASH_VERSION = 1  # the key hash of csrc/hash.h that shards are defined over (dbsp_core.zset.HASH_VERSION)


def shard_bits_for(workers: int, min_shard_bits: int = DEFAULT_SHARD_BITS) -> int:
    """The shard bits of dynamic sharding for ``workers`` workers (invariant 4).

    >>> shard_bits_for(3), shard_bits_for(25), shard_bits_for(26), shard_bits_for(2, min_shard_bits=4)
    (8, 8, 9, 5)
    """
    need = max(1, math.ceil(workers / IMBALANCE))
    return min(MAX_SHARD_BITS, max(min_shard_bits, (need - 1).bit_length()))


def resample_owners(owners: np.ndarray, bits: int, to_bits: int) -> np.ndarray:
    """The owner table ``owners`` (at ``bits`` shard bits) at ``to_bits``: split shards keep their owner, merged
    ones take their even child's (invariant 4)."""
    if to_bits > bits:
        return np.repeat(owners, 1 << (to_bits - bits))
    if to_bits < bits:
        return owners[:: 1 << (bits - to_bits)].copy()
    return owners


class ShardMap:
    """Maps each of ``2**shard_bits`` shards to one of ``workers`` workers (the routing table of exchanges).

    ``ShardMap(W, shard_bits)`` assigns contiguous slices (shard ``s`` to worker ``s * W // S``), the layout of
    a new pipeline; :meth:`from_owners` takes any owner table (a rebalanced layout).

    Examples
    --------
    >>> m = ShardMap(workers=2, shard_bits=2)
    >>> m.part_of_shard.tolist()
    [0, 0, 1, 1]
    >>> m.shards_of(1)
    [2, 3]
    >>> ShardMap.from_owners([1, 0, 1, 0]).shards_of(0)
    [1, 3]
    """

    __slots__ = ("_workers", "_shard_bits", "_part_of_shard")

    def __init__(self, workers: int, shard_bits: int = DEFAULT_SHARD_BITS) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"ShardMap: workers must be a positive int, got {workers!r}")
        _check_bits(shard_bits, "ShardMap")
        if (1 << shard_bits) < workers:
            raise ValueError(f"ShardMap: {1 << shard_bits} shards (shard_bits={shard_bits}) "
                             f"cannot be spread over {workers} workers; raise shard_bits")
        nshards = 1 << shard_bits
        owners = ((np.arange(nshards, dtype=np.int64) * workers) // nshards).astype(np.int32)
        self._set(workers, shard_bits, owners)

    def _set(self, workers: int, shard_bits: int, owners: np.ndarray) -> None:
        owners.flags.writeable = False
        self._workers, self._shard_bits, self._part_of_shard = workers, shard_bits, owners

    @classmethod
    def from_owners(cls, owners: Iterable[int], workers: int | None = None, allow_empty: bool = False
                    ) -> "ShardMap":
        """A map with the given owner of every shard (length a power of two; invariant 1). ``allow_empty``: a
        worker may own no shard (the layouts a live rescale passes through, invariant 6)."""
        arr = np.array(list(owners) if not isinstance(owners, np.ndarray) else owners, dtype=np.int64)
        n = len(arr)
        if n == 0 or n & (n - 1):
            raise ValueError(f"ShardMap.from_owners: the owner table needs a power-of-two length, got {n}")
        bits = n.bit_length() - 1
        _check_bits(bits, "ShardMap.from_owners")
        w = int(arr.max()) + 1 if workers is None else workers
        if not isinstance(w, int) or w < 1 or arr.min() < 0 or arr.max() >= w:
            raise ValueError(f"ShardMap.from_owners: owners must lie in 0..{w - 1}")
        if len(np.unique(arr)) != w and not allow_empty:
            missing = sorted(set(range(w)) - set(np.unique(arr).tolist()))
            raise ValueError(f"ShardMap.from_owners: workers {missing[:8]} own no shard")
        m = cls.__new__(cls)
        m._set(w, bits, arr.astype(np.int32))
        return m

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
        """Read-only int32 array of length S: the worker owning each shard."""
        return self._part_of_shard

    def worker_of(self, shard: int) -> int:
        """The worker that owns ``shard``."""
        return int(self._part_of_shard[shard])

    def shards_of(self, worker: int) -> list[int]:
        """The shards owned by ``worker``, ascending."""
        return np.flatnonzero(self._part_of_shard == worker).tolist()

    def shard_of_hash(self, hashes: np.ndarray) -> np.ndarray:
        """Shard of each 64-bit key hash: its top ``shard_bits`` bits."""
        h = np.asarray(hashes, dtype=np.uint64)
        if self._shard_bits == 0:
            return np.zeros(len(h), dtype=np.int64)
        return (h >> np.uint64(64 - self._shard_bits)).astype(np.int64)

    def runs(self, khash: np.ndarray) -> list[tuple[int, int, int]]:
        """The rows of key hashes ``khash`` (ascending) as runs ``(worker, start, stop)`` of consecutive shards of one
        owner, in row order: how an exchange cuts rows sorted by key hash into the workers' parts without a
        permutation (one run per worker for the contiguous map of a new pipeline). Empty runs are left out.

        Examples
        --------
        >>> m = ShardMap(workers=2, shard_bits=2)
        >>> m.runs(np.array([1, 2, 1 << 63, 3 << 62], dtype=np.uint64))
        [(0, 0, 2), (1, 2, 4)]
        """
        owners = self._part_of_shard
        first = np.flatnonzero(np.diff(owners)) + 1  # the first shard of each run after the first
        if self._shard_bits == 0 or len(first) == 0:
            return [(int(owners[0]), 0, len(khash))] if len(khash) else []
        lows = first.astype(np.uint64) << np.uint64(64 - self._shard_bits)  # the lowest key hash of each run
        cuts = [0] + np.searchsorted(khash, lows).tolist() + [len(khash)]
        whose = [int(owners[0])] + owners[first].tolist()
        return [(w, s, e) for w, s, e in zip(whose, cuts, cuts[1:]) if e > s]

    def moved_shards(self, other: "ShardMap") -> list[int]:
        """Shards (at the finer of the two shard counts) whose owner differs between ``self`` and ``other``."""
        bits = max(self._shard_bits, other.shard_bits)
        a = resample_owners(self._part_of_shard, self._shard_bits, bits)
        b = resample_owners(other.part_of_shard, other.shard_bits, bits)
        return np.flatnonzero(a != b).tolist()

    def __reduce__(self) -> tuple:
        return (ShardMap.from_owners, (self._part_of_shard.copy(), self._workers, True))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ShardMap) and other._workers == self._workers
                and other._shard_bits == self._shard_bits
                and bool(np.array_equal(other._part_of_shard, self._part_of_shard)))

    def __hash__(self) -> int:
        return hash((self._workers, self._shard_bits, self._part_of_shard.tobytes()))

    def __repr__(self) -> str:
        return f"ShardMap(workers={self._workers}, shard_bits={self._shard_bits})"


def shard_runs(shards: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of consecutive shard numbers in an ascending array of distinct ones (each run one
    key-hash range).

    >>> shard_runs(np.array([0, 1, 2, 5, 7, 8]))
    [(0, 3), (5, 6), (7, 9)]
    """
    s = np.asarray(shards, dtype=np.int64)
    if len(s) == 0:
        return []
    cut = np.flatnonzero(np.diff(s) != 1) + 1
    starts, ends = s[np.r_[0, cut]], s[np.r_[cut - 1, len(s) - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist()))


def _check_bits(bits: Any, where: str) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 0 <= bits <= MAX_SHARD_BITS:
        raise ValueError(f"{where}: shard_bits must be an int in [0, {MAX_SHARD_BITS}], got {bits!r}")


class Layout:
    """Where work runs: S shards, the owner of each (a :class:`ShardMap`), and the host of each worker.

    A layout is data: it is saved with every checkpoint and changed only by a rescale, which builds the
    next one with :meth:`rebalance` (invariants 3 and 4).

    Parameters
    ----------
    shard_map : ShardMap
        The owner table.
    hosts : tuple of str
        The host of each worker (default ``"local"`` for all).
    epoch : int
        Increases with every layout change of a pipeline.
    min_shard_bits : int
        The floor of dynamic sharding (default: the map's shard bits).

    Examples
    --------
    >>> lay = Layout.local(workers=3)
    >>> lay.workers, lay.shards, lay.owner(0), lay.owner(255)
    (3, 256, 0, 2)
    >>> grown = lay.rebalance(4)
    >>> len(lay.moved_shards(grown)), [len(grown.shard_map.shards_of(w)) for w in range(4)]
    (64, [64, 64, 64, 64])
    >>> len(grown.moved_shards(grown.rebalance(3)))
    64
    """

    __slots__ = ("shard_map", "hosts", "epoch", "min_shard_bits", "_json")

    def __init__(self, shard_map: ShardMap, hosts: tuple[str, ...] = (), epoch: int = 0,
                 min_shard_bits: int | None = None) -> None:
        if not isinstance(shard_map, ShardMap):
            raise TypeError(f"Layout needs a ShardMap, got {type(shard_map).__name__}")
        hosts = tuple(hosts) or ("local",) * shard_map.workers
        if len(hosts) != shard_map.workers or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(f"Layout: {len(hosts)} hosts given for {shard_map.workers} workers")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Layout: epoch must be a non-negative int, got {epoch!r}")
        mb = shard_map.shard_bits if min_shard_bits is None else min_shard_bits
        _check_bits(mb, "Layout")
        object.__setattr__(self, "shard_map", shard_map)
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "epoch", epoch)
        object.__setattr__(self, "min_shard_bits", min(mb, shard_map.shard_bits))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Layout is immutable; build a new one (e.g. with rebalance)")

    @classmethod
    def local(cls, workers: int, shard_bits: int = DEFAULT_SHARD_BITS) -> "Layout":
        """``workers`` workers in this process, shards in contiguous slices."""
        return cls(ShardMap(workers, shard_bits))

    @property
    def workers(self) -> int:
        """Number of workers W."""
        return self.shard_map.workers

    @property
    def shards(self) -> int:
        """Number of shards S."""
        return self.shard_map.shards

    @property
    def shard_bits(self) -> int:
        """log2 of the number of shards."""
        return self.shard_map.shard_bits

    def owner(self, shard: int) -> int:
        """The worker that owns ``shard``."""
        if not isinstance(shard, (int, np.integer)) or not 0 <= shard < self.shards:
            raise IndexError(f"Layout.owner: shard {shard!r} is outside 0..{self.shards - 1}")
        return self.shard_map.worker_of(int(shard))

    def workers_on(self, host: str) -> list[int]:
        """The workers placed on ``host``."""
        return [w for w, h in enumerate(self.hosts) if h == host]

    def moved_shards(self, other: "Layout") -> list[int]:
        """Shards, at the finer of the two shard counts, whose owner differs (invariant 5)."""
        return self.shard_map.moved_shards(other.shard_map)

    def rebalance(self, workers: int, shard_bits: int | None = None) -> "Layout":
        """The next layout for ``workers`` workers, moving as few shards as an even split allows (invariant 3).

        ``shard_bits`` forces the shard count; by default dynamic sharding chooses it (invariant 4).
        """
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"rebalance: workers must be a positive int, got {workers!r}")
        bits = shard_bits_for(workers, self.min_shard_bits) if shard_bits is None else shard_bits
        _check_bits(bits, "rebalance")
        S = 1 << bits
        if S < workers:
            raise ValueError(f"rebalance: {S} shards cannot be spread over {workers} workers; raise shard_bits")
        owners = resample_owners(self.shard_map.part_of_shard, self.shard_bits, bits).astype(np.int64)
        counts = np.bincount(owners, minlength=max(self.workers, workers))
        base, extra = divmod(S, workers)
        quota = np.full(workers, base, dtype=np.int64)
        order = sorted(range(workers), key=lambda w: (-int(counts[w]), w))
        quota[order[:extra]] += 1
        released: list[list[int]] = []
        for w in range(len(counts)):
            mine = np.flatnonzero(owners == w)
            keep = int(quota[w]) if w < workers else 0
            if len(mine) > keep:
                released.append(mine[keep:].tolist())  # a worker gives up its highest shards
        pool = [s for group in _interleave(released) for s in group]  # evenly from every giving worker
        need = [(w, int(quota[w] - counts[w])) for w in range(workers) if quota[w] > counts[w]]
        k = 0
        while pool:
            w, n = need[k % len(need)]
            if n:
                owners[pool.pop(0)] = w
                need[k % len(need)] = (w, n - 1)
            k += 1
            if k > 4 * S * max(1, len(need)):  # pragma: no cover - the quotas add up to S
                raise AssertionError("rebalance: quotas do not cover the released shards")
        hosts = self.hosts[:workers] + ("local",) * max(0, workers - self.workers)
        return Layout(ShardMap.from_owners(owners, workers), hosts, self.epoch + 1, self.min_shard_bits)

    def steps_to(self, target: "Layout", batch: int) -> list["Layout"]:
        """The layouts a live change to ``target`` passes through, one per wave of at most ``batch`` moved shards,
        ending with ``target`` (invariant 6)."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"steps_to: batch must be a positive int, got {batch!r}")
        out: list[Layout] = []
        cur, epoch = self, self.epoch
        W = max(self.workers, target.workers)
        if target.shard_bits != self.shard_bits:
            owners = resample_owners(cur.shard_map.part_of_shard, cur.shard_bits, target.shard_bits)
            epoch += 1
            cur = Layout(ShardMap.from_owners(owners, cur.workers, True), cur.hosts, epoch, self.min_shard_bits)
            out.append(cur)
        owners = cur.shard_map.part_of_shard.astype(np.int64).copy()
        goal = target.shard_map.part_of_shard
        moving = np.flatnonzero(owners != goal)
        hosts = (self.hosts + target.hosts[len(self.hosts):])[:W] if W > self.workers else self.hosts
        for lo in range(0, len(moving), batch):
            sel = moving[lo:lo + batch]
            owners[sel] = goal[sel]
            epoch += 1
            last = lo + batch >= len(moving)
            if last:
                break
            out.append(Layout(ShardMap.from_owners(owners, W, True), hosts, epoch, self.min_shard_bits))
        out.append(Layout(target.shard_map, target.hosts, epoch + (0 if len(moving) else 1), target.min_shard_bits))
        return out

    # ---- persistence ----

    def to_dict(self) -> dict:
        """A JSON-able record (owners run-length encoded); :meth:`from_dict` reads it back."""
        owners = np.asarray(self.shard_map.part_of_shard)
        starts = np.flatnonzero(np.concatenate(([True], owners[1:] != owners[:-1])))
        lengths = np.diff(np.append(starts, len(owners)))
        runs = np.stack([owners[starts], lengths], axis=1).tolist()  # vectorized: O(S) at C speed
        return {"epoch": self.epoch, "workers": self.workers, "shard_bits": self.shard_bits,
                "min_shard_bits": self.min_shard_bits, "hash_version": HASH_VERSION, "owners": runs,
                "hosts": list(self.hosts)}

    def to_json(self) -> str:
        """:meth:`to_dict` as compact JSON with sorted keys, computed once per layout (a checkpoint writes it into
        every worker's database: W copies of an O(S) record must not cost W encodings)."""
        try:
            return object.__getattribute__(self, "_json")
        except AttributeError:
            text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_json", text)
            return text

    @classmethod
    def from_dict(cls, d: dict, where: str = "layout") -> "Layout":
        """The layout of a :meth:`to_dict` record; ValueError naming ``where`` if it is inconsistent."""
        try:
            if d.get("hash_version") != HASH_VERSION:
                raise ValueError(f"hash version {d.get('hash_version')!r}, this build shards by hash version "
                                 f"{HASH_VERSION}")
            owners = np.concatenate([np.full(int(n), int(o), dtype=np.int64) for o, n in d["owners"]])
            if len(owners) != 1 << int(d["shard_bits"]):
                raise ValueError(f"{len(owners)} owners for {1 << int(d['shard_bits'])} shards")
            sm = ShardMap.from_owners(owners, int(d["workers"]), True)
            return cls(sm, tuple(d.get("hosts") or ()), int(d["epoch"]), int(d["min_shard_bits"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a valid layout record: {e}") from None

    def __reduce__(self) -> tuple:
        return (Layout, (self.shard_map, self.hosts, self.epoch, self.min_shard_bits))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Layout) and self.shard_map == other.shard_map and self.hosts == other.hosts
                and self.epoch == other.epoch)

    def __hash__(self) -> int:
        return hash((self.shard_map, self.hosts, self.epoch))

    def __repr__(self) -> str:
        return f"Layout(workers={self.workers}, shards={self.shards}, epoch={self.epoch})"


def _interleave(groups: list[list[int]]) -> list[list[int]]:
    """Round-robin over the groups: one shard of each in turn (as one-element lists)."""
    out: list[list[int]] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend([g[i]] for g in groups if i < len(g))
    return out
