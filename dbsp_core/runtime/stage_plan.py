"""Stage plans: a circuit cut at its exchanges into pieces that run one worker at a time, with their inputs and outputs as encoded blobs, so any engine that can move blobs between workers (Spark's shuffle) can run a circuit step by step.

A **stage** is a set of live nodes. Stage 0 holds the input-side nodes; an exchange ends a stage on its sending
side (the sender partitions its input by the ShardMap) and its output belongs to a later stage (the receiver
concatenates the parts sent to it). ``stage(input) = 0``, ``stage(exchange) = stage(its input) + 1``, and
every other node sits in the latest stage of its inputs. A node value needed by a later stage than its own
(e.g. a stream joined after another exchange) is *carried*: sent to the same worker and forwarded by every
stage in between.

Data between stages travels as a table of **blobs** (:data:`BLOB_SCHEMA`): ``part`` (destination worker),
``src`` (sending worker), ``node`` (the node whose value this is; ``-1 - k`` for output handle ``k``;
:data:`ACK_NODE` for a commit acknowledgement; :data:`CONTROL_NODE` for the one empty blob per worker that
every stage forwards, so no stage of a job ever sees an empty input, which an engine could optimize away),
``step`` and ``payload`` (a checksummed codec.py Z-set encoding). The value of node ``i`` at worker ``w`` in
step ``s`` is the concatenation of the blobs ``(part=w, node=i, step=s)`` in ``src`` order (a shuffle delivers
blobs in any order; ``src`` makes a retried or replayed task see the same input), and an absent blob is the
empty Z-set. Running a stage task against its state, with retries: stage_task.py.

Invariants (enforced here):
  1. For any W and any split of the input over workers, running every stage for every worker in stage order
     (each stage over the blobs the earlier stages addressed to it) gives, summed over workers, exactly the
     outputs of the embedded runtime: the same operator instances run in the same per-worker order, and an
     exchange partitions with the same kernel and ShardMap (``ZSet.partition``).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.circuit import Circuit
from dbsp_core.codec import decode_zset, encode_zset
from dbsp_core.layout import ShardMap
from dbsp_core.operators.base import concat
from dbsp_core.operators.exchange import Exchange
from dbsp_core.operators.input import Input
from dbsp_core.operators.context import StepContext
from dbsp_core.profile import NodeTimer, failed_node, run_nodes, zset_bytes
from dbsp_core.runtime.executor import as_step_error, live_nodes
from dbsp_core.storage.snapshot import state_attrs
from dbsp_core.zset import ZSet

__all__ = ["BLOB_SCHEMA", "ACK_NODE", "CONTROL_NODE", "StagePlan", "StageWorker", "StageResult", "StepInfo",
           "encode_blobs", "ack_blob", "control_blobs", "read_acks", "gather", "output_node"]

BLOB_SCHEMA = pa.schema([pa.field("part", pa.int32()), pa.field("src", pa.int32()), pa.field("node", pa.int32()),
                         pa.field("step", pa.int64()), pa.field("payload", pa.binary())])
ACK_NODE = -(1 << 30)
CONTROL_NODE = ACK_NODE + 1


def output_node(k: int) -> int:
    """The blob ``node`` tag of the ``k``-th output handle (in ``circuit.outputs`` order)."""
    return -1 - k


class StepInfo(NamedTuple):
    """A step of a job and its logged determinants (dbsp_core.operators.context)."""

    step: int
    now_ns: int | None
    prev_now_ns: int | None
    seed: int | None
    watermarks: dict[str, Any]
    pushes: int = 0  # the step's number of pushes: a step run again after a push was discarded is another job


class StagePlan:
    """The stages of a circuit's live nodes and what each one receives, computes, sends and forwards.

    Examples
    --------
    >>> import pyarrow as pa
    >>> import dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    >>> c.output("n", t.group_by("k").agg(n=dbsp.count()))
    >>> plan = StagePlan(c)
    >>> plan.num_stages, plan.stateful
    (2, [False, True])
    >>> [n.kind for n in (c.nodes[i] for i in plan.compute[1])]
    ['aggregate']
    """

    def __init__(self, circuit: Circuit) -> None:
        if not isinstance(circuit, Circuit):
            raise TypeError(f"StagePlan needs a Circuit, got {type(circuit).__name__}")
        self.circuit = circuit
        nodes = circuit.nodes
        self.live = live_nodes(circuit)
        stage: dict[int, int] = {}
        for i in self.live:
            op = nodes[i]
            if isinstance(op, Input) or not op.inputs:
                stage[i] = 0
            elif isinstance(op, Exchange):
                stage[i] = stage[op.inputs[0]] + 1
            else:
                stage[i] = max(stage[j] for j in op.inputs)
        self.stage_of = stage
        self.num_stages = max(stage.values(), default=0) + 1
        n = self.num_stages
        self.inputs = {name: i for name, i in circuit.inputs.items() if i in stage}
        # per stage: nodes computed (non-exchange, id order), exchanges sent, nodes received from blobs
        self.compute: list[list[int]] = [[] for _ in range(n)]
        self.sends: list[list[int]] = [[] for _ in range(n)]
        self.receive: list[set[int]] = [set() for _ in range(n)]
        self.emit: list[list[int]] = [[] for _ in range(n)]  # values carried to a later stage
        self.outputs: list[list[tuple[int, str, int]]] = [[] for _ in range(n)]  # (k, name, node)
        self.last_needed: dict[int, int] = {}  # blob node -> the last stage that reads it
        for i in self.live:
            op, k = nodes[i], stage[i]
            if isinstance(op, Exchange):
                self.sends[stage[op.inputs[0]]].append(i)
                self._need(i, k)
            elif isinstance(op, Input):
                self.receive[0].add(i)
                self.compute[0].append(i)
            else:
                self.compute[k].append(i)
                for j in op.inputs:
                    if stage[j] < k or isinstance(nodes[j], Exchange):
                        self._need(j, k)
        for k_out, (name, i) in enumerate(circuit.outputs.items()):
            if isinstance(nodes[i], Exchange):
                self._need(i, stage[i])
            self.outputs[stage[i]].append((k_out, name, i))
        for j, last in self.last_needed.items():
            if not isinstance(nodes[j], Exchange) and last > stage[j]:
                self.emit[stage[j]].append(j)
        for k in range(n):
            self.emit[k].sort()
        self.stateful = [any(nodes[i].instance() is not nodes[i] for i in self.compute[k]) for k in range(n)]
        self.output_schemas = {name: nodes[i].schema for name, i in circuit.outputs.items()}
        self.output_names = list(circuit.outputs)

    def _need(self, j: int, k: int) -> None:
        """Blob node ``j`` is read in stage ``k``."""
        self.receive[k].add(j)
        self.last_needed[j] = max(self.last_needed.get(j, k), k)

    def forwards(self, node: int, stage: int) -> bool:
        """Whether a blob of ``node`` received by ``stage`` goes on to a later stage (outputs and acks always do)."""
        return node < 0 or self.last_needed.get(node, -1) > stage

    def schema_of(self, node: int) -> pa.Schema:
        """The schema of the Z-set in a blob of ``node``."""
        if node >= 0:
            return self.circuit.nodes[node].schema
        return self.output_schemas[self.output_names[-1 - node]]

    def __repr__(self) -> str:
        return f"StagePlan({self.num_stages} stages, stateful={self.stateful})"


class StageResult(NamedTuple):
    """What one stage produced for one worker in one step."""

    sends: dict[int, list[ZSet]]  # exchange node -> W parts (part p goes to worker p)
    carried: dict[int, ZSet]      # node -> its value, for a later stage on this worker
    outputs: dict[str, ZSet]      # output name -> this worker's share


class StageWorker:
    """Runs one stage of a circuit for one worker, one step at a time (invariant 1).

    Parameters
    ----------
    circuit, plan
        The circuit and its :class:`StagePlan`.
    stage, worker
        Which stage, and which of the ``shard_map.workers`` workers.
    shard_map
        Routes exchanged rows: a row goes to the owner of its key's shard.

    Examples
    --------
    >>> import pyarrow as pa
    >>> import dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> t = c.input("t", pa.schema([("x", pa.int64())]))
    >>> c.output("d", t.distinct())
    >>> plan, sm = StagePlan(c), dbsp.ShardMap(1)
    >>> s0, s1 = StageWorker(c, plan, 0, 0, sm), StageWorker(c, plan, 1, 0, sm)
    >>> r0 = s0.step({0: dbsp.ZSet.from_arrow(pa.table({"x": [5, 5]}))})
    >>> x = plan.sends[0][0]
    >>> s1.step({x: r0.sends[x][0]}).outputs["d"].to_dict()
    {(5,): 1}
    """

    def __init__(self, circuit: Circuit, plan: StagePlan, stage: int, worker: int, shard_map: ShardMap) -> None:
        if not 0 <= stage < plan.num_stages:
            raise ValueError(f"StageWorker: stage {stage} is outside 0..{plan.num_stages - 1}")
        if not 0 <= worker < shard_map.workers:
            raise ValueError(f"StageWorker: worker {worker} is outside 0..{shard_map.workers - 1}")
        self.circuit, self.plan, self.stage, self.worker, self.shard_map = circuit, plan, stage, worker, shard_map
        self.ctx = StepContext(worker, shard_map)  # no exchanger: exchanges are stage boundaries
        nodes = circuit.nodes
        self.instances = {i: nodes[i].instance() for i in plan.compute[stage]}
        self.stateful = {i: inst for i, inst in self.instances.items() if inst is not nodes[i]}
        self.calls = [(self.instances[i].step, nodes[i].inputs, i) for i in plan.compute[stage]]
        self.timer = NodeTimer(plan.compute[stage])  # dbsp_core.profile; a task may hand it a longer-lived one
        for i, inst in self.stateful.items():
            state_attrs(i, inst)  # refuse state that could not be checkpointed (snapshot invariant 2)

    def step(self, received: dict[int, ZSet], info: StepInfo | None = None) -> StageResult:
        """Run the stage's nodes for one step over the values ``received`` (``{node: Z-set}``; absent = empty)
        with the step's determinants ``info``."""
        plan, nodes, k = self.plan, self.circuit.nodes, self.stage
        ctx = self.ctx
        values: dict[int, ZSet] = {}
        for j in plan.receive[k]:
            z = received.get(j)
            values[j] = z if z is not None else ZSet.empty(nodes[j].schema)
        inputs = {nodes[i].name: values[i] for i in plan.receive[k] if isinstance(nodes[i], Input)}
        if info is None:
            ctx.begin(inputs, None, None, None)
        else:
            ctx.begin(inputs, info.now_ns, info.prev_now_ns, info.seed, info.watermarks)
        try:
            run_nodes(self.calls, values, ctx, self.timer)
        except Exception as exc:
            err = as_step_error(exc, nodes[failed_node(self.calls, values)].label,
                                info.step if info is not None else None)  # executor.py inv. 4
            if err is exc:
                raise
            raise err from exc
        w = self.shard_map.workers
        sends: dict[int, list[ZSet]] = {}
        for x in plan.sends[k]:
            z = values[nodes[x].inputs[0]]
            if w == 1:
                sends[x] = [z]
            elif z.num_rows:
                sends[x] = parts = z.partition(list(nodes[x].key), self.shard_map.part_of_shard, w)
                sent = self.timer.exchange_bytes
                sent[x] = sent.get(x, 0) + sum(zset_bytes(p) for q, p in enumerate(parts) if q != self.worker)
            else:
                sends[x] = [z] * w
        carried = {j: values[j] for j in plan.emit[k]}
        outputs = {name: values[i] for _, name, i in plan.outputs[k]}
        return StageResult(sends, carried, outputs)


# ---- blobs ----


def encode_blobs(rows: list[tuple[int, int, int, int, ZSet]]) -> pa.Table:
    """A blob table of ``(part, src, node, step, Z-set)``; empty Z-sets are left out (absent = empty)."""
    rows = [r for r in rows if r[4].num_rows]
    return pa.table([pa.array([r[0] for r in rows], pa.int32()), pa.array([r[1] for r in rows], pa.int32()),
                     pa.array([r[2] for r in rows], pa.int32()), pa.array([r[3] for r in rows], pa.int64()),
                     pa.array([encode_zset(r[4]) for r in rows], pa.binary())], schema=BLOB_SCHEMA)


def ack_blob(stage: int, worker: int, version: int, step: int, first: int, loaded: str,
             extra: dict | None = None) -> pa.Table:
    """A commit acknowledgement; ``extra`` (a store pipeline's: the objects the attempt uploaded and how it found its
    state, runtime/stage_store.py) rides along."""
    body = json.dumps({"stage": stage, "worker": worker, "version": version, "step": step,
                       "loaded": loaded, **(extra or {})}).encode()
    return pa.table([pa.array([worker], pa.int32()), pa.array([worker], pa.int32()), pa.array([ACK_NODE], pa.int32()),
                     pa.array([first], pa.int64()), pa.array([body], pa.binary())], schema=BLOB_SCHEMA)


def control_blobs(workers: int, step: int) -> pa.Table:
    """One control blob per worker (see the module docstring); a job's input carries them to every stage."""
    return pa.table([pa.array(range(workers), pa.int32()), pa.array([-1] * workers, pa.int32()),
                     pa.array([CONTROL_NODE] * workers, pa.int32()), pa.array([step] * workers, pa.int64()),
                     pa.array([b""] * workers, pa.binary())], schema=BLOB_SCHEMA)


def read_acks(blobs: pa.Table) -> list[dict]:
    """The commit acknowledgements in a blob table: ``[{stage, worker, version, step, loaded}]`` (``loaded``:
    where the committing attempt found its state: ``"cache"`` (this process ran the previous job),
    ``"partial"`` (a stale cache entry: only batches saved since were read) or ``"full"`` (the database))."""
    acks = blobs.filter(pc.equal(blobs.column("node"), ACK_NODE))
    return [json.loads(b) for b in acks.column("payload").to_pylist()]


def gather(plan: StagePlan, blobs: pa.Table, where: str) -> dict[tuple[int, int], ZSet]:
    """``{(node, step): value}`` of a blob table: each group's blobs concatenated in ``src`` order."""
    if blobs.num_rows == 0:
        return {}
    blobs = blobs.sort_by([("node", "ascending"), ("step", "ascending"), ("src", "ascending")])
    nodes = blobs.column("node").to_numpy()
    steps = blobs.column("step").to_numpy()
    payloads = blobs.column("payload")
    out: dict[tuple[int, int], list[ZSet]] = {}
    for r in range(blobs.num_rows):  # one iteration per blob (a whole Z-set), never per row
        node, step = int(nodes[r]), int(steps[r])
        z = decode_zset(payloads[r].as_buffer(), plan.schema_of(node), f"{where} node {node} step {step}")
        out.setdefault((node, step), []).append(z)
    return {key: concat(zs, zs[0].schema) for key, zs in out.items()}
