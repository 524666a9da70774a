"""The fixpoint operator: a nested circuit (a recursive view's body) iterated within each step until its output stops changing.

It is incremental over steps and iterations as in DBSP (``Circuit.recursive``, SQL ``WITH RECURSIVE``).

The view R is the least fixed point of ``R = body(R, inputs)`` (the body ends with a distinct for SQL's UNION).
Each step runs iterations i = 0, 1, ...: iteration i feeds the body the body's output change of iteration i-1
(nothing at i = 0) and the step's input changes (at i = 0 only), and the body's nested operators
(operators/nested.py) emit 2-D changes, so the step's output change is the sum of the body's output over the
iterations, and a step costs what the changed keys cost at each iteration, not a recomputation.

Invariants (enforced here):
  1. After every step, integral(output) == the fixed point of the body over the integrated inputs (when it
     is reached in at most ``max_iterations`` iterations; else the step raises DbspError naming the node).
  2. A step stops after iteration i when the body's output change at i is empty on every worker and i has
     passed every nested operator's ``bound`` (nested.py invariant 4): no later iteration could emit anything.
  3. The inputs reach the fixpoint exchanged by a constant key (the gather exchange). Two modes, chosen by
     the runtime and fixed for a storage directory, since it is bound to one executor kind:
     - distributed (a runtime that exchanges within a step: the embedded executor): every worker runs every
       iteration; the body's exchanges go through ``ctx.exchange`` under a mailbox id of their own per
       iteration, and the workers agree on the last iteration through ``ctx.anyone`` (one barrier per
       iteration; workers that own no shard, as during a live rescale, take part too). State: the nested traces ``n<node>_<input>``, keyed by the
       body operators' exchange keys, so rows sit with their shard's owner.
     - gathered (a stage task of the staged executor, where an exchange is a stage boundary): the whole body
       runs on the worker owning the constant key's shard, its exchanges are the identity. State: the mirrors
       ``g<node>_<input>``, the same rows plus the constant key, keyed by it, so all of it is one shard that
       moves as a unit; the traces the body reads live in a cache (``_cache``: not state, rebuilt from the
       mirrors whenever they are not the batches the cache was last synced with, e.g. after a load).
     The other mode's traces stay empty (an empty trace stores nothing).
  4. Body operators are filter, select, plus/minus, negate, flat_map, window, add_global_key, exchange, (inner)
     join and distinct; anything else is refused when the fixpoint is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.operators.base import Operator, concat, empty, make, nullable_schema
from dbsp_core.operators.distinct import Distinct
from dbsp_core.operators.exchange import Exchange
from dbsp_core.operators.filter import Filter
from dbsp_core.operators.flat_map import FlatMap
from dbsp_core.operators.input import Input
from dbsp_core.operators.join import Join
from dbsp_core.operators.keyless_aggregate import GLOBAL_KEY, AddGlobalKey
from dbsp_core.operators.negate import Negate
from dbsp_core.operators.nested import NestedDistinct, NestedJoin, nested_state
from dbsp_core.operators.plus import Plus
from dbsp_core.operators.select import Select
from dbsp_core.operators.window import Window
from dbsp_core.trace import Trace
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.circuit import Circuit
    from dbsp_core.operators.context import StepContext

LINEAR = (Filter, Select, Plus, Negate, FlatMap, AddGlobalKey, Window)


def _linear(op: Operator) -> bool:
    return isinstance(op, LINEAR) and op.instance() is op


class Fixpoint(Operator):
    """The fixed point of a body circuit (see the module docstring); build it with ``Circuit.recursive``."""

    kind = "fixpoint"
    split_safe = True  # base.py invariant 6 (invariant 1: each piece iterates to its fixed point; body: invariant 4)


    @property
    def state_placed(self) -> bool:
        """The nested traces are keyed by the body's exchange keys (invariant 3), though the output is not
        partitioned: a live rescale must move them with their shards."""
        return True

    def __init__(self, inputs: Sequence[int], body: "Circuit", rec: int, imports: Sequence[int], out: int,
                 max_iterations: int, where: str, *, fingerprint: str, live: Sequence[int]) -> None:
        """``fingerprint`` and ``live`` are the body's fingerprint and live nodes, computed by the builder
        (``Circuit.recursive``), which owns those notions."""
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise ValueError(f"{where}: max_iterations must be a positive int, got {max_iterations!r}")
        super().__init__(inputs, nullable_schema(body.nodes[out].schema), None)
        self.body = body
        self.body_fingerprint = fingerprint
        self.rec, self.imports, self.out = rec, tuple(imports), out
        self.max_iterations = max_iterations
        live = sorted(live)
        for j in live:  # invariant 4
            node = body.nodes[j]
            if isinstance(node, (Input, Exchange)) or _linear(node) or type(node) in (Join, Distinct):
                continue
            raise SchemaError(f"{where}: {node.kind} cannot run inside a recursive body (only filter, select, "
                              f"plus/minus, negate, flat_map, window, join and distinct can)")
        self.live = tuple(live)
        self.nested_nodes = tuple(j for j in live if type(body.nodes[j]) in (Join, Distinct))

    def instance(self) -> "_FixpointState":
        return _FixpointState(self)


def _mirror_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema(list(schema) + [pa.field(GLOBAL_KEY, pa.int64())])


class _FixpointState:
    def __init__(self, op: Fixpoint) -> None:
        self.op = op
        nested = []
        for j in op.nested_nodes:
            n = nested_state(op.body.nodes[j])
            assert n is not None
            nested.append((j, n))
            for name, trace in zip(n.names, n.new_traces()):
                setattr(self, f"n{j}_{name}", trace)  # distributed mode's state (invariant 3)
            for name, schema in zip(n.names, n.schemas):
                setattr(self, f"g{j}_{name}", Trace(_mirror_schema(schema), (GLOBAL_KEY,)))  # gathered mode's
        self.nested: tuple[tuple[int, NestedJoin | NestedDistinct], ...] = tuple(nested)
        self._cache: tuple = ()  # gathered mode: (mirror batches when synced, working traces per nested node)

    def traces(self) -> dict[str, Trace]:
        """The operator's state, by name: the nested traces of distributed mode, then the gathered mirrors."""
        return {k: v for k, v in vars(self).items() if isinstance(v, Trace)}

    # ---- gathered mode: the working traces, cached from the mirrors ----

    def _mirrors(self) -> list[Trace]:
        return [getattr(self, f"g{j}_{name}") for j, n in self.nested for name in n.names]

    def _mirror_batches(self) -> tuple:
        return tuple(b for m in self._mirrors() for part in m.parts() for b in part)

    def _working(self) -> tuple[tuple[Trace, ...], ...]:
        token = self._mirror_batches()
        if self._cache and len(self._cache[0]) == len(token) and all(a is b for a, b in zip(self._cache[0], token)):
            return self._cache[1]
        working = []
        for j, n in self.nested:  # rebuild: the mirrors' rows, indexed by the body operator's keys
            traces = n.new_traces()
            for name, t, key, schema in zip(n.names, traces, n.keys, n.schemas):
                m = getattr(self, f"g{j}_{name}")
                whole = m.consolidated()
                if len(whole):
                    z = make(whole.zset.data.drop_columns([GLOBAL_KEY]), whole.zset.weights, schema)
                    t.insert(z.index_by(list(key)))
            working.append(traces)
        self._cache = (token, tuple(working))
        return self._cache[1]

    # ---- a step ----

    def step(self, inputs: list[ZSet], ctx: "StepContext") -> ZSet:
        op = self.op
        body = op.body
        distributed = bool(getattr(ctx, "can_exchange", False))
        if distributed:
            olds = tuple(tuple(getattr(self, f"n{j}_{name}") for name in n.names) for j, n in self.nested)
        else:
            olds = self._working()
        imports = {}
        for node, z in zip(op.imports, inputs):
            schema = body.nodes[node].schema
            imports[node] = make(z.data.drop_columns([GLOBAL_KEY]), z.weights, schema) if z.num_rows \
                else empty(schema)
        if not distributed and not any(z.num_rows for z in imports.values()):
            return empty(op.schema)  # gathered: nothing changed on this worker, nothing can
        states = {j: n for j, n in self.nested}
        for (j, n), old in zip(self.nested, olds):
            n.begin(old)
        rec_schema = body.nodes[op.rec].schema
        rec = empty(rec_schema)
        total: list[ZSet] = []
        i = 0
        while True:
            values: dict[int, ZSet] = {}
            for j in op.live:
                node = body.nodes[j]
                if j == op.rec:
                    v = rec
                elif j in imports:
                    v = imports[j] if i == 0 else empty(node.schema)
                elif isinstance(node, Exchange):
                    z = values[node.inputs[0]]
                    v = ctx.exchange((op.node_id, j, i), z, node.key, node.schema) if distributed else z
                elif j in states:
                    v = states[j].iterate(i, [values[x] for x in node.inputs])
                else:
                    v = node.step([values[x] for x in node.inputs], ctx)
                values[j] = v
            out = values[op.out].consolidate()
            if out.num_rows:
                total.append(out)
            more = out.num_rows > 0 or any(n.bound > i for _, n in self.nested)
            if distributed:
                more = self._anyone(ctx, more, i)
            if not more:
                break
            i += 1
            if i >= op.max_iterations:
                raise DbspError(f"{op.label}: no fixed point after {op.max_iterations} iterations (a recursive "
                                f"UNION ALL over a cycle never converges; use UNION)")
            rec = make(out.data, out.weights, rec_schema)
        self._finish(distributed, olds)
        return concat(total, op.schema) if total else empty(op.schema)

    def _anyone(self, ctx: "StepContext", more: bool, i: int) -> bool:
        """Whether any worker has more to do (invariant 2), agreed through the runtime (StepContext.anyone)."""
        return ctx.anyone((self.op.node_id, -1, i), more)

    def _finish(self, distributed: bool, olds: Any) -> None:
        """Add the step's tagged changes to the state (nested.py invariant 1) and, gathered, to the mirrors."""
        for (j, n), old in zip(self.nested, olds):
            for name, trace, batches in zip(n.names, old, n.current()):
                mirror = None if distributed else getattr(self, f"g{j}_{name}")
                for b in batches:
                    if not len(b):
                        continue
                    trace.insert(b)
                    if mirror is not None:
                        z = b.zset
                        data = z.data.append_column(GLOBAL_KEY, pa.array(np.zeros(z.num_rows, dtype=np.int64)))
                        mirror.insert(make(data, z.weights, mirror.schema).index_by([GLOBAL_KEY]))
        if not distributed:
            self._cache = (self._mirror_batches(), self._cache[1])
