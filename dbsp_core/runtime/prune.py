"""Column pruning of stored state: a pass, when a pipeline is built, that has every inner join and ``within_last`` window keep only the columns read after it (operators/pruned.py).

Invariants (enforced here):
  1. ``reads[n]`` is the set of node ``n``'s output columns that some consumer reads, computed from the outputs
     backwards (consumers are later nodes, circuit invariant 1). An output, a readable view and every operator this
     pass does not know read every column of their inputs; so do distinct, top-k, count-distinct, outer and semi
     joins, windows, flat_map (a user function) and anything nested, whose results depend on columns that make rows
     distinct. Known readers: filter (its predicate's columns and what its consumers read), select (the columns of
     its expressions, or of its plain column picks read after it), exchange (its key and what its consumers read),
     plus/minus, negate, integrate, delay, differentiate (what their consumers read), the keyless group-by's hidden
     key, pre-aggregate and aggregate (keys and aggregated columns; every column when it has whole-group
     aggregates), inner join and ``within_last`` (their keys or time column and what their consumers read).
  2. A join or window is pruned only where its kept columns are fewer than its input's, so a circuit whose every
     column is read runs as before.
  3. The decision is data: ``{node: [[kept columns] per stored input]}``, JSON as META records it (operators/pruned.py
     invariant 3); :func:`apply` sets it on the circuit's nodes before instances are built, and clears the nodes
     it does not name; each instance keeps the choice in force when it was built, so one circuit object opened
     twice (a directory from before pruning, a new one) runs as each directory needs.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.circuit import Circuit
from dbsp_core.envvars import settings
from dbsp_core.operators import (Aggregate, Delay, Differentiate, Exchange, Filter, Integrate, Join, Negate, Plus,
                                 Select)
from dbsp_core.operators.aggregate import PreAggregate
from dbsp_core.operators.expr import project_schema
from dbsp_core.operators.keyless_aggregate import GLOBAL_KEY, AddGlobalKey
from dbsp_core.operators.temporal import WithinLast

__all__ = ["stored_columns", "apply", "chosen", "decide", "describe"]

_PASS = (Plus, Negate, Integrate, Delay, Differentiate)


def enabled() -> bool:
    """Whether new pipelines prune (``DBSP_PRUNE``, default on); tests switch it off to build old state."""
    return settings().prune


def expression_columns(expr: pc.Expression, schema: pa.Schema) -> set[str]:
    """The columns of ``schema`` that ``expr`` reads: those without which it no longer binds (an expression that names
    a column by position reads every column)."""
    if "FieldPath(" in str(expr):
        return set(schema.names)
    out = set()
    for name in schema.names:
        try:
            project_schema(pa.schema([f for f in schema if f.name != name]), [expr], ["x"], "prune")
        except Exception:  # noqa: BLE001 - any failure to bind means the column is read
            out.add(name)
    return out


def _input_reads(circuit: Circuit, op: Any, need: set[str]) -> list[set[str]]:
    """The columns of each input of ``op`` it reads, given the columns ``need`` of its output read after it
    (invariant 1)."""
    ins = [set(circuit.nodes[i].schema.names) for i in op.inputs]
    t = type(op)
    if t is Exchange:  # its key decides where each row goes (and where a keyed consumer's state sits)
        return [(need | set(op.key)) & ins[0]]
    if t in _PASS:
        return [need & s for s in ins]
    if t is Filter:
        return [(need | expression_columns(op.predicate, circuit.nodes[op.inputs[0]].schema)) & ins[0]]
    if t is Select:
        src = circuit.nodes[op.inputs[0]].schema
        cols: set[str] = set()
        if op.picks is not None:  # plain column picks: only those read after it (a pick cannot fail)
            cols = {c for n, c in zip(op.names, op.picks) if n in need}
        else:  # every expression is evaluated, read after it or not
            for e in op.exprs:
                cols |= expression_columns(e, src)
        return [cols]
    if t is AddGlobalKey:
        return [need - {GLOBAL_KEY}]
    if t is Aggregate or t is PreAggregate:
        agg = op if t is Aggregate else op.agg
        if (t is Aggregate and len(op.inputs) != 1) or agg.extras:  # whole-group aggregates (variance, first
            return ins  # ORDER BY, ...) read what their specs name: every column, to be sure
        cols = set(agg.keys) | {c for _, c in agg.kernel if c is not None} | set(agg.distinct_columns)
        return [cols & ins[0]]
    if t is Join:
        nl = len(op.lschema)
        out = op.schema.names
        right = {r for j, r in enumerate(op.right_kept) if out[nl + j] in need}
        return [(need & ins[0]) | set(op.left_on), right | set(op.right_on)]
    if t is WithinLast:
        return [need | {op.column}]
    return ins


def stored_columns(circuit: Circuit) -> dict[str, list[list[str]]]:
    """The pass (invariants 1-2): ``{str(node): [kept columns of each stored input, in schema order]}`` for every live
    inner join and ``within_last`` that needs fewer columns than its inputs have.

    >>> import pyarrow as pa
    >>> import dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64()), ("ts", pa.int64())]))
    >>> auctions = c.input("auctions", pa.schema([("id", pa.int64()), ("category", pa.utf8()), ("seller", pa.int64())]))
    >>> j = bids.join(auctions, left_on="auction", right_on="id")
    >>> c.output("stats", j.group_by("category").agg(hi=dbsp.max("price")))
    >>> stored_columns(c)
    {'4': [['auction', 'price'], ['id', 'category']]}
    """
    live = circuit.live_nodes()
    reads: dict[int, set[str]] = {i: set() for i in live}
    for i in set(circuit.outputs.values()) | set(circuit.readable.values()):
        reads[i] = set(circuit.nodes[i].schema.names)
    out: dict[str, list[list[str]]] = {}
    for i in reversed(live):
        op = circuit.nodes[i]
        need = reads[i]
        per_input = _input_reads(circuit, op, need)
        for j, cols in zip(op.inputs, per_input):
            reads[j] |= cols
        if type(op) in (Join, WithinLast):
            schemas = [op.lschema, op.rschema] if type(op) is Join else [op.schema]
            kept = [[n for n in s.names if n in cols] for s, cols in zip(schemas, per_input)]
            if any(len(k) < len(s) for k, s in zip(kept, schemas)):
                out[str(i)] = kept
    return out


def apply(circuit: Circuit, columns: dict[str, list[list[str]]]) -> None:
    """Set the kept columns on the circuit's joins and windows (invariant 3): those ``columns`` names, every column for
    the others."""
    for i, op in enumerate(circuit.nodes):
        kept = columns.get(str(i))
        if type(op) is Join:
            op.keep(*kept) if kept is not None else op.keep(None)
        elif type(op) is WithinLast:
            op.keep(kept[0] if kept is not None else None)


def chosen(circuit: Circuit) -> dict[str, list[list[str]]]:
    """The pass's result when pruning is on (``DBSP_PRUNE``), else none."""
    return stored_columns(circuit) if enabled() else {}


def decide(circuit: Circuit) -> dict[str, list[list[str]]]:
    """:func:`chosen`, applied to ``circuit`` (an in-memory pipeline's choice)."""
    columns = chosen(circuit)
    apply(circuit, columns)
    return columns


def describe(op: Any) -> str | None:
    """What ``op``'s state keeps when it is pruned, for plan displays (``dbsp sql``); None when it keeps every
    column."""
    st = getattr(op, "stored", None)
    return None if st is None else st.describe()
