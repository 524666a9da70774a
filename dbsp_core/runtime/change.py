"""Program changes (Feldera calls it bootstrapping): opening a storage directory with a changed circuit keeps the state of what did not change, builds new and changed views from the current contents of the tables they read, and drops what was removed.

Design (the driver calls :func:`check`, :func:`prepare`, :func:`bootstrap`; invariants enforced here and by the
driver, whose invariant 6 includes them):

  1. Identity. Every node has a fingerprint (dbsp_core.circuit.part_fingerprints: its kind, schema and
     parameters and, recursively, those of every node it reads, by content rather than position). Two nodes of
     equal fingerprint compute the same stream from the same tables, so they hold the same state. META records
     the fingerprint of every node by id (``part_fingerprints["nodes"]``).
  2. What is refused, with CircuitMismatchError naming the views and tables that differ and why (nothing is
     changed): another executor than the embedded one; a META without node fingerprints (written before this
     module); a table removed or changed (its schema, key or event time: the input log holds its pushes); a
     worker count change or an interrupted layout change at the same open; a change while the previous one has
     not completed (invariant 6); a new or changed view that reads a table whose contents the stored state does
     not hold. A table's contents are held when it has a primary key or is declared materialized and that
     readable node is unchanged, or when the table is new (empty): the refusal names the tables to declare so.
  3. Kept and built. A stateful node whose fingerprint the old circuit has loads that node's stored state
     (``Executor.rename_state``, snapshot invariant 9); every other stateful node is built. The old nodes no new
     node keeps are dropped: the first checkpoint after the change deletes their tables.
  4. Views. A view is *rebuilt* when its name is new or its fingerprint changed, *kept* otherwise, *removed* when
     the new circuit lacks it. The change takes effect at step L, the end of the output log when it is made:
     META is rewritten (before any step runs) with the new circuit, ``change = {step: L, nodes: the old node
     fingerprints, rebuilt, removed}``, and ``since[view] = L`` for each rebuilt view, so the output log reads
     and verifies a rebuilt view from L on only (output log invariant 5).
  5. Bootstrap. The state loads at the checkpoint's step X <= L. Right after, the built nodes get the state of a
     fresh copy of the circuit run over the tables' contents at X as one step (``Executor.bootstrap``; contents
     from the kept readable nodes, new tables empty; no watermark, the ``now`` of step X-1, seed 0). Its outputs
     of the rebuilt views, plus their outputs of the replayed steps X..L-1, are *owed*: a rebuilt view's output
     of step L is owed + its change at L, so its first output in the log is its full contents after step L.
     Replayed steps X..L-1 verify the kept views only.
  6. Exactly once across the change and any crash. No checkpoint is taken until step L has run (its output
     logged), so state stored at a step <= L has the old circuit's numbering and state stored at a step > L the
     new one. Opening a directory whose META holds a change at L with the state at X <= L redoes 3 and 5 with
     the same stored contents, the same replayed steps and determinants: the step-L output is the same, and is
     verified as any replay if the log holds it already. With the state at X > L the change is complete.
  7. Results are those of a pipeline that ran the new circuit from the start with all input before X in one
     step (time-independent operators: the same contents; a view over ``now()`` or watermarks sees them as of
     the bootstrap step).
"""

from __future__ import annotations

from typing import NamedTuple

from dbsp_core.circuit import Circuit, part_fingerprints
from dbsp_core.errors import CircuitMismatchError
from dbsp_core.runtime.executor import Executor, StepInput
from dbsp_core.time.watermark import NO_WATERMARK, specs_of
from dbsp_core.zset import ZSet

__all__ = ["Change", "Owed", "bootstrap", "check", "prepare"]


class Change(NamedTuple):
    """A program change to carry out at this open (invariants 3-5)."""

    step: int  # L: the first step whose output holds the rebuilt views
    renames: dict[int, int]  # kept stateful node -> the old node whose state it loads
    built: set[int]  # stateful nodes built by the bootstrap
    rebuilt: list[str]  # views whose output starts again at L with their full contents
    tables: dict[str, int]  # table whose contents the bootstrap reads -> its readable node (kept)


def check(root: str, old: dict, new: dict, kind: str, differences: str) -> None:
    """Invariant 2, what can be told from META alone: refuse a change this module cannot carry out. ``old`` and
    ``new`` are the META records; ``differences`` says which views and tables differ."""
    base = f"{root} was written by a pipeline with a different circuit{differences}"
    was, now = old.get("part_fingerprints") or {}, new["part_fingerprints"]
    if kind != "embedded":
        raise CircuitMismatchError(f"{base}; a program change keeps state on the embedded executor only: open it "
                                   f"with the same circuit, or run the new one in a new directory")
    if "nodes" not in was:
        raise CircuitMismatchError(f"{base}; the directory was written before program changes were recorded (META "
                                   f"names no node fingerprints): open it with the same circuit, or run the new one "
                                   f"in a new directory")
    gone = sorted(set(was.get("inputs", {})) - set(now["inputs"]))
    changed = sorted(n for n in set(was.get("inputs", {})) & set(now["inputs"]) if was["inputs"][n] != now["inputs"][n])
    if gone or changed:
        said = ", ".join(gone + changed)
        raise CircuitMismatchError(f"{base}; a program change keeps every table as it was (the input log holds their "
                                   f"pushes): put table(s) {said} back as they were (add tables, and add, change or "
                                   f"drop views), or open it with the same circuit")


def _stateful(circuit: Circuit) -> set[int]:
    return {i for i in circuit.live_nodes() if circuit.nodes[i].instance() is not circuit.nodes[i]}


def _match(old_nodes: list[str], new_nodes: list[str], nodes: set[int]) -> dict[int, int]:
    """Each of ``nodes`` (new ids) whose fingerprint an old node has -> that old node (the k-th new node of a
    fingerprint takes the k-th old one: equal fingerprints hold equal state, invariant 1)."""
    free: dict[str, list[int]] = {}
    for i, fp in enumerate(old_nodes):
        if fp is not None:  # a node the old circuit did not run stored nothing
            free.setdefault(fp, []).append(i)
    out = {}
    for i in sorted(nodes):
        ids = free.get(new_nodes[i])
        if ids:
            out[i] = ids.pop(0)
    return out


def _upstream_tables(circuit: Circuit, starts: set[int]) -> set[str]:
    """The tables (inputs) some node of ``starts`` reads, through any path."""
    names = {i: n for n, i in circuit.inputs.items()}
    seen, todo = set(), list(starts)
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        todo.extend(circuit.nodes[i].inputs)
    return {names[i] for i in seen if i in names}


def prepare(root: str, old: dict, new: dict | None, circuit: Circuit, state_step: int, log_end: int,
            differences: str) -> tuple[Change | None, dict | None]:
    """The change to carry out at this open and the META to write first (None: leave META as it is).

    ``old`` is the stored META; ``new`` the META of ``circuit`` when its fingerprint differs (a change made now,
    at step ``log_end``), None when it is the stored one (a change recorded earlier is redone while the state, at
    ``state_step``, is not past it: invariant 6)."""
    recorded = old.get("change")
    pending = recorded is not None and state_step <= int(recorded["step"])
    if new is None:
        if not pending:
            return None, None
        assert recorded is not None
        return _plan(root, recorded["nodes"], circuit, int(recorded["step"]), differences,
                     rebuilt=list(recorded["rebuilt"])), None
    if pending:
        assert recorded is not None
        raise CircuitMismatchError(
            f"{root} was written by a pipeline with a different circuit{differences}; the program change made at step "
            f"{recorded['step']} has not completed (no checkpoint after its first step): open it with the circuit of "
            f"that change, step once and checkpoint, then change the program again")
    was = old["part_fingerprints"]
    change = _plan(root, was["nodes"], circuit, log_end, differences, was=was)
    since = {n: s for n, s in (old.get("since") or {}).items() if n in circuit.outputs}
    since.update({n: log_end for n in change.rebuilt})
    removed = sorted(set(old.get("outputs", [])) - set(circuit.outputs))
    meta = dict(old, **new, since=since,
                change={"step": log_end, "nodes": was["nodes"], "rebuilt": change.rebuilt, "removed": removed})
    return change, meta


def _plan(root: str, old_nodes: list[str], circuit: Circuit, step: int, differences: str, *,
          was: dict | None = None, rebuilt: list[str] | None = None) -> Change:
    """Invariants 2-4: what is kept, built and read, against the old circuit's node fingerprints ``old_nodes``
    and either its part fingerprints ``was`` (a change made now) or the views the recorded change ``rebuilt`` (a
    change redone: its tables were checked when it was made)."""
    now = part_fingerprints(circuit)
    stateful = _stateful(circuit)
    renames = _match(old_nodes, now["nodes"], stateful)
    built = stateful - set(renames)
    if rebuilt is None:
        assert was is not None
        rebuilt = sorted(n for n, fp in now["outputs"].items() if was.get("outputs", {}).get(n) != fp)
    need = _upstream_tables(circuit, built | {circuit.outputs[n] for n in rebuilt})
    tables, missing = {}, []
    for t in sorted(need):
        node = circuit.readable.get(t)
        if node is not None and node in renames:
            tables[t] = node
        elif was is not None and t in was.get("inputs", {}):
            missing.append(t)
        # a new table: empty, nothing to read
    if missing:
        what = ", ".join(rebuilt) or "the changed nodes"
        raise CircuitMismatchError(
            f"{root} was written by a pipeline with a different circuit{differences}; view(s) {what} must be built "
            f"from the current contents of table(s) {', '.join(missing)}, which the stored state does not hold: "
            f"declare them materialized (CREATE MATERIALIZED TABLE, or Circuit.input(..., materialized=True)) or "
            f"with a primary key (PRIMARY KEY) "
            f"from the start, or open it with the same circuit")
    return Change(step, renames, built, rebuilt, tables)


def bootstrap(executor: Executor, circuit: Circuit, change: Change, state_step: int, now_ns: int | None) -> "Owed":
    """Invariant 5: build the built nodes' state from the tables' contents (after the load at ``state_step``) and
    return what the rebuilt views owe to step L."""
    pushes = [(t, executor.view(node)) for t, node in sorted(change.tables.items())]
    pushes = [(t, z) for t, z in pushes if z.num_rows]
    marks = {name: NO_WATERMARK for name in specs_of(circuit)}
    outs = executor.bootstrap(change.built, StepInput(state_step, pushes, now_ns, None, 0, marks))
    return Owed(change.step, {n: outs[n] for n in change.rebuilt})


class Owed:
    """What the rebuilt views owe to step L (invariant 5): the bootstrap's output plus their outputs of the steps
    before L, added to their change at L."""

    def __init__(self, step: int, owed: dict[str, ZSet]) -> None:
        self.step = step
        self.owed = owed
        self.done = False

    def settle(self, step: int, out: dict[str, ZSet]) -> None:
        """Step ``step`` ran with output ``out``: before L its rebuilt views' changes are owed (the log holds none of
        them), at L they are added to ``out`` (in place), after which nothing is owed."""
        if self.done or step > self.step:
            self.done = True
            return
        for name in self.owed:
            self.owed[name] = self.owed[name] + out[name]
        if step == self.step:
            for name, z in self.owed.items():
                out[name] = z.consolidate()
            self.done = True
