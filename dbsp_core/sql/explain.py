"""The plan of a circuit's views as text (``python -m dbsp_core sql FILE.sql``): for each output, the tree of operators that maintain it, where rows cross workers, and what state each one keeps.

Invariants:
  1. Each output is printed as a tree from the view down to the inputs; a node already printed (shared by two
     views, or read twice) is printed once in full and then referred to by its label.
  2. Every stateful operator lists its state as its Trace and Z-set attributes (what a checkpoint saves,
     dbsp_core/storage/snapshot.py), with the key each trace is indexed and sharded by; an exchange says the
     key it shards by. A fixpoint prints its nested body under it the same way.
  3. The summary line of a view counts its operators, exchanges and traces (shared ones included).
  4. Under a compiled view's SQL text come the plans of its FROM clauses of two or more inputs (joinplan.py
     invariant 6): the join order, each join's keys, the filters pushed to each input and the columns it keeps.
  5. A join or window whose state keeps only the columns read after it (runtime/prune.py, as a pipeline built now
     would: :func:`explain` applies the pass) says which it keeps, and its traces show those columns.
"""

from __future__ import annotations

from typing import Any

from dbsp_core.circuit import Circuit
from dbsp_core.operators.base import Operator
from dbsp_core.runtime.prune import decide, describe
from dbsp_core.storage.snapshot import state_attrs

_WIDTH = 100


def _short(text: str, width: int = 70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _details(op: Operator) -> str:  # noqa: C901 - one line per operator kind
    k = op.kind
    if k == "input":
        et = f", event time {op.event_time} - {op.lateness}" if getattr(op, "event_time", None) else ""
        return f"table {op.name}{et}"
    if k == "filter":
        return _short(op.predicate)
    if k == "select":
        if op.picks is not None:
            return "columns " + ", ".join(n if n == p else f"{n}={p}" for n, p in zip(op.names, op.picks))
        return _short(", ".join(f"{n}={e}" for n, e in zip(op.names, op.exprs)))
    if k == "exchange":
        return f"shard by ({', '.join(op.key)})"
    if k in ("join", "left_join", "right_join", "full_join", "semi_join", "anti_join"):
        return " AND ".join(f"{a} = {b}" for a, b in zip(op.left_on, op.right_on))
    if k == "aggregate":
        keys = ", ".join(op.keys) if getattr(op, "output_keys", True) else "(all rows)"
        aggs = ", ".join(f"{n}={a[0]}" for n, a in zip(op.names, op.plan))
        return f"group by {keys}: {aggs}"
    if k == "top_k":
        order = ", ".join(f"{c} {'DESC' if d == 'descending' else 'ASC'}" for c, d in op.order)
        keys = ", ".join(c for c in op.keys if c != op.hidden_key) or "(all rows)"
        return f"first {op.k}{' with ties' if op.with_ties else ''} per {keys} by {order}"
    if k == "window":
        return f"{op.mode} {op.column} size {op.size}" + (f" slide {op.slide}" if op.mode == "hop" else "")
    if k == "constant":
        return _short(op.rows, 50)
    if k == "fixpoint":
        return f"iterate to a fixed point (at most {op.max_iterations} iterations per step)"
    return ""


def _state(op: Operator) -> list[str]:
    inst = op.instance()
    if inst is op:
        return []
    traces, zsets = state_attrs(op.node_id, inst)
    out = []
    for name in traces:
        t = getattr(inst, name)
        out.append(f"{name}: trace keyed by ({', '.join(t.key)}) of ({', '.join(t.schema.names)})")
    for name in zsets:
        out.append(f"{name}: z-set")
    kept = describe(op)
    if kept is not None:  # invariant 5
        out.append(f"kept columns {kept}: no operator after it reads the others")
    return out


class _Printer:
    def __init__(self, circuit: Circuit) -> None:
        self.circuit = circuit
        self.seen: dict[int, str] = {}
        self.lines: list[str] = []
        self.counts = {"operators": 0, "exchanges": 0, "traces": 0}

    def node(self, circuit: Circuit, i: int, depth: int, owner: str, body_inputs: dict[int, str]) -> None:
        op = circuit.nodes[i]
        pad = "  " * depth
        key = (id(circuit), i)
        label = op.label if circuit is self.circuit else f"{owner}.{op.label}"
        if i in body_inputs:
            self.lines.append(f"{pad}{body_inputs[i]}")
            return
        if key in self.seen:
            self.lines.append(f"{pad}{label} (see above)")
            return
        self.seen[key] = label
        self.counts["operators"] += 1
        self.counts["exchanges"] += op.kind == "exchange"
        head = f"{pad}{label}"
        det = _details(op)
        if det:
            head += f"  {det}"
        if op.partitioning:
            head += f"  [sharded by {', '.join(op.partitioning)}]"
        self.lines.append(head)
        for s in _state(op) if op.kind != "fixpoint" else _fixpoint_state(op):
            self.counts["traces"] += ": trace" in s
            self.lines.append(f"{pad}    state: {s}")
        if op.kind == "fixpoint":
            body = op.body
            names = {op.rec: "(the recursive view itself, one iteration behind)"}
            for j, imp in zip(op.imports, op.inputs):
                names[j] = f"(input {circuit.nodes[imp].label} below)"
            self.lines.append(f"{pad}  body:")
            self.node(body, op.out, depth + 2, label, names)
        for j in op.inputs:
            self.node(circuit, j, depth + 1, owner, {} if circuit is self.circuit else body_inputs)


def _fixpoint_state(op: Operator) -> list[str]:
    inst = op.instance()
    out = []
    for name, t in inst.traces().items():
        mode = "embedded: distributed" if name.startswith("n") else "staged: gathered"
        out.append(f"{name}: trace keyed by ({', '.join(t.key)}) [{mode}]")
    return out


def explain(circuit: Circuit, views: list[str] | None = None) -> str:
    """The plan of ``views`` (default: every output) as text (invariants 1-3 and 5).

    >>> from dbsp_core import sql
    >>> c = sql.compile("CREATE TABLE t (k INT, v BIGINT); "
    ...                 "CREATE VIEW s AS SELECT k, sum(v) AS total FROM t GROUP BY k")
    >>> print(explain(c))  # doctest: +NORMALIZE_WHITESPACE
    view s (k int32, total int64): 4 operators, 1 exchanges, 1 traces
      SELECT k, SUM(v) AS total FROM t GROUP BY k
      aggregate#3  group by k: total=sum  [sharded by k]
          state: trace: trace keyed by (k) of (k, p_0, p_1, p_2)
        exchange#2  shard by (k)  [sharded by k]
          pre_aggregate#1
            input#0  table t
    """
    program = getattr(circuit, "sql", None)
    decide(circuit)  # invariant 5: the columns each join and window keeps, as a pipeline built now would keep them
    out = []
    for name in views or list(circuit.outputs):
        if name not in circuit.outputs:
            raise KeyError(f"no view {name!r}; views are {list(circuit.outputs)}")
        p = _Printer(circuit)
        i = circuit.outputs[name]
        p.node(circuit, circuit.readable.get(name, i), 1, "", {})  # a materialized view: from the node keeping it
        schema = circuit.nodes[i].schema
        cols = ", ".join(f"{f.name} {f.type}" for f in schema)
        c = p.counts
        head = [f"view {name} ({cols}): {c['operators']} operators, {c['exchanges']} exchanges, {c['traces']} traces"]
        if program is not None and name in program.views:
            head += ["  " + line for line in program.views[name].splitlines()]
            head += ["  " + line for note in program.plans.get(name, []) for line in note.splitlines()]
        out.append("\n".join(head + p.lines))
    return "\n\n".join(out)
