"""Saving and restoring the operator state of one worker in its Database, grouped by shard.

Invariants (enforced here):
  1. Only stateful operator instances (``node.instance() is not node``) persist anything; stateless operators
     persist nothing (the Falkirk Wheel "ephemeral" policy).
  2. A stateful instance's state is exactly its attributes holding a ``Trace`` or a ``ZSet``; every other
     attribute is configuration rebuilt by ``instance()``. Each instance is checked once when the pipeline is
     built: an attribute of another mutable kind (list, dict, ndarray, IndexedZSet) raises, so state can never
     be silently left out.
  3. A trace is stored consolidated, one value per non-empty shard under :func:`shard_key` ``(shard, b"")``
     in table ``s<node>.<attr>``, so a shard's state is one contiguous key range and moves as a unit.
     A plain Z-set (integrate, delay, differentiate state, not keyed) is stored whole under key ``b"all"``
     in table ``z<node>.<attr>``. Every value is a checksummed, versioned Z-set encoding.
  4. Saving rewrites only values that changed and deletes keys of shards that became empty, so the stored
     state equals the in-memory state after every save.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.codec import decode_zset, encode_zset
from dbsp_core.errors import DbspError
from dbsp_core.storage import DatabaseHandle, shard_key, shard_of_key
from dbsp_core.trace import Trace
from dbsp_core.zset import IndexedZSet, ZSet

_CONFIG_TYPES = (str, int, float, bool, bytes, tuple, pa.Schema, type(None))


def state_attrs(node_id: int, inst: Any) -> tuple[list[str], list[str]]:
    """The names of the Trace and the ZSet attributes of a stateful instance (invariant 2)."""
    traces, zsets = [], []
    for name, val in vars(inst).items():
        if isinstance(val, Trace):
            traces.append(name)
        elif isinstance(val, ZSet):
            zsets.append(name)
        elif isinstance(val, (list, dict, set, np.ndarray, IndexedZSet)) and not _is_config_list(val):
            raise DbspError(f"node #{node_id} ({type(inst).__name__}): attribute {name!r} of type "
                            f"{type(val).__name__} may be state that cannot be checkpointed")
    return traces, zsets


def _is_config_list(val: Any) -> bool:
    # lists/tuples of names or (kind, column) pairs are configuration, e.g. key columns
    if isinstance(val, list):
        return all(isinstance(x, (str, tuple)) for x in val)
    return False


def _trace_shards(trace: Trace, shard_bits: int) -> dict[int, ZSet]:
    whole = trace.consolidated()
    if len(whole) == 0:
        return {}
    bounds = whole.shard_bounds(shard_bits)
    out = {}
    nz = np.flatnonzero(np.diff(bounds) > 0)
    for s in nz.tolist():
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        out[s] = whole.zset.data.slice(lo, hi - lo), whole.zset.weights[lo:hi]
    return {s: ZSet._make(t, np.array(w, dtype=np.int64, copy=True)) for s, (t, w) in out.items()}


def _sync_table(h: DatabaseHandle, table: str, values: dict[bytes, bytes]) -> int:
    """Make ``table`` hold exactly ``values``; returns how many keys were written or deleted (invariant 4)."""
    changed = 0
    old = dict(h.scan(table))
    for k in old.keys() - values.keys():
        h.delete(table, k)
        changed += 1
    for k, v in values.items():
        if old.get(k) != v:
            h.put(table, k, v)
            changed += 1
    return changed


def save_worker(h: DatabaseHandle, instances: dict[int, Any], shard_bits: int) -> int:
    """Write the state of one worker's stateful instances into ``h``; returns the number of keys changed."""
    changed = 0
    for node_id, inst in instances.items():
        traces, zsets = state_attrs(node_id, inst)
        for name in traces:
            shards = _trace_shards(getattr(inst, name), shard_bits)
            changed += _sync_table(h, f"s{node_id}.{name}",
                                   {shard_key(s, b""): encode_zset(z) for s, z in shards.items()})
        for name in zsets:
            z = getattr(inst, name)
            changed += _sync_table(h, f"z{node_id}.{name}", {b"all": encode_zset(z)} if z.num_rows else {})
    return changed


def load_worker(h: DatabaseHandle, instances: dict[int, Any], where: str) -> int:
    """Restore the state saved by :func:`save_worker` into fresh instances; returns the number of rows loaded."""
    rows = 0
    for node_id, inst in instances.items():
        traces, zsets = state_attrs(node_id, inst)
        for name in traces:
            trace: Trace = getattr(inst, name)
            table = f"s{node_id}.{name}"
            parts = []
            for k, v in h.scan(table):
                parts.append(decode_zset(v, trace.schema, f"{where} {table} shard {shard_of_key(k)}"))
            trace.clear()
            parts = [p for p in parts if p.num_rows]
            if parts:
                z = parts[0] if len(parts) == 1 else ZSet.concat(parts)
                trace.insert(z.index_by(list(trace.key)))
                rows += z.num_rows
        for name in zsets:
            cur: ZSet = getattr(inst, name)
            table = f"z{node_id}.{name}"
            v = h.get(table, b"all")
            z = ZSet.empty(cur.schema) if v is None else decode_zset(v, cur.schema, f"{where} {table}")
            setattr(inst, name, z)
            rows += z.num_rows
    return rows
