"""Stages: a circuit cut at its exchanges into pieces that run one worker at a time, with their inputs and outputs as encoded blobs, so any engine that can move blobs between workers (Spark's shuffle) can run a circuit step by step.

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
empty Z-set.

Invariants (enforced here):
  1. For any W and any split of the input over workers, running every stage for every worker in stage order
     (each stage over the blobs the earlier stages addressed to it) gives, summed over workers, exactly the
     outputs of the embedded runtime: the same operator instances run in the same per-worker order, and an
     exchange partitions with the same kernel and ShardMap (``ZSet.partition``).
  2. A stage task for worker ``w`` accepts only blobs addressed to ``w`` and raises otherwise, so a
     misrouted shuffle can never produce a wrong result silently.
  3. State: a stage with stateful operators keeps one Database per worker under
     ``<storage>/stages/stage-<k>/worker-<w>.db`` (operator state grouped by shard, snapshot.py). A task runs
     a job of consecutive steps ``n..n+k-1`` against base version ``v`` whose step is ``n``: it opens ``v``,
     runs the steps, saves the changed state, ``set_step(n+k)`` and commits ``v+1``, once per job. Every task
     of a job commits, so all stage databases move through the same versions in lockstep.
  4. Retries never corrupt state nor change output: before committing, a task durably writes the blobs it
     produced to ``worker-<w>.result`` (tagged with the job: base version and steps). An attempt that finds
     ``v+1`` already committed (an earlier attempt got that far) returns that file's blobs and leaves the
     database alone, so a speculative duplicate cannot discard a version the job has already used (seed 000's
     "reopen v and redo" would, and if the duplicate then died, that database would hold no version the
     others share); an attempt that finds neither ``v`` as the newest version nor ``v+1`` is stale (a zombie
     of an earlier job) and raises without touching anything. Attempts of one (stage, worker) are serialized
     by a lock file (``flock``; on a shared mount it needs working POSIX locks, e.g. NFSv4).
  5. Executors cache live operator instances per (storage, stage, worker) with the run, version and step they
     are at; a cache entry is used only when all three match the job, else state is loaded from the
     Database, reusing the batches a stale entry of the same run still holds (Spark gives a task any of an
     executor's Python workers, so the previous job of a (stage, worker) often ran in another process); each
     commit logs the trace keys its save added and deleted (table ``stagelog``, the last 16 versions), so a
     stale entry reads only the batches saved since it, without scanning the state. A
     failed attempt in the same process rolls the cached instances back to the job's start (traces are
     spines of immutable batches, so the rollback keeps references, not copies).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.circuit import Circuit
from dbsp_core.codec import decode_json, decode_zset, encode_json, encode_zset, frame, unframe
from dbsp_core.errors import CorruptionError, DbspError, RecoveryError
from dbsp_core.operators.base import concat
from dbsp_core.operators.exchange import Exchange
from dbsp_core.operators.input import Input
from dbsp_core.runtime import _live_nodes
from dbsp_core.shard import ShardMap
from dbsp_core.snapshot import WorkerSnapshot, state_attrs
from dbsp_core.storage import Database
from dbsp_core.trace import Trace
from dbsp_core.zset import ZSet

__all__ = ["BLOB_SCHEMA", "ACK_NODE", "CONTROL_NODE", "control_blobs", "StagePlan", "StageWorker", "StageTask",
           "StepInfo", "StaleAttemptError", "InjectedFault", "run_stage_task", "encode_blobs", "stage_db_path",
           "live_nodes", "output_node"]

BLOB_SCHEMA = pa.schema([pa.field("part", pa.int32()), pa.field("src", pa.int32()), pa.field("node", pa.int32()),
                         pa.field("step", pa.int64()), pa.field("payload", pa.binary())])
ACK_NODE = -(1 << 30)
CONTROL_NODE = ACK_NODE + 1
_RESULT_MAGIC = b"DSTR"


class StaleAttemptError(DbspError):
    """A task attempt found its stage database past the job it belongs to (a zombie of an earlier job)."""


class InjectedFault(DbspError):
    """Raised by a test-only fault point of a stage task (see :class:`StageTask`)."""


def output_node(k: int) -> int:
    """The blob ``node`` tag of the ``k``-th output handle (in ``circuit.outputs`` order)."""
    return -1 - k


def live_nodes(circuit: Circuit) -> list[int]:
    """The nodes that feed an output, in id order (the nodes a pipeline runs, as in the embedded runtime)."""
    return _live_nodes(circuit)


def stage_db_path(storage: str, stage: int, worker: int) -> str:
    """The Database of ``worker`` in ``stage`` (invariant 3)."""
    return os.path.join(storage, "stages", f"stage-{stage}", f"worker-{worker}.db")


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


class _StageContext:
    """What an operator instance sees of its worker inside a stage (the embedded WorkerContext's fields)."""

    def __init__(self, worker: int, shard_map: ShardMap) -> None:
        self.worker = worker
        self.shard_map = shard_map
        self.inputs: dict[str, ZSet] = {}
        self.now_ns: int | None = None
        self.seed: int | None = None

    def exchange(self, node_id: int, z: ZSet, key: tuple[str, ...], schema: pa.Schema) -> ZSet:
        raise DbspError(f"exchange#{node_id} ran inside a stage: exchanges are stage boundaries")  # pragma: no cover


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
        self.ctx = _StageContext(worker, shard_map)
        nodes = circuit.nodes
        self.instances = {i: nodes[i].instance() for i in plan.compute[stage]}
        self.stateful = {i: inst for i, inst in self.instances.items() if inst is not nodes[i]}
        for i, inst in self.stateful.items():
            state_attrs(i, inst)  # refuse state that could not be checkpointed (snapshot invariant 2)

    def step(self, received: dict[int, ZSet], now_ns: int | None = None, seed: int | None = None) -> StageResult:
        """Run the stage's nodes for one step over the values ``received`` (``{node: Z-set}``; absent = empty)."""
        plan, nodes, k = self.plan, self.circuit.nodes, self.stage
        ctx = self.ctx
        ctx.now_ns, ctx.seed = now_ns, seed
        values: dict[int, ZSet] = {}
        for j in plan.receive[k]:
            z = received.get(j)
            values[j] = z if z is not None else ZSet.empty(nodes[j].schema)
        ctx.inputs = {nodes[i].name: values[i] for i in plan.receive[k] if isinstance(nodes[i], Input)}
        for i in plan.compute[k]:
            op = nodes[i]
            values[i] = self.instances[i].step([values[j] for j in op.inputs], ctx)
        w = self.shard_map.workers
        sends: dict[int, list[ZSet]] = {}
        for x in plan.sends[k]:
            z = values[nodes[x].inputs[0]]
            if w == 1:
                sends[x] = [z]
            elif z.num_rows:
                sends[x] = z.partition(list(nodes[x].key), self.shard_map.part_of_shard, w)
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


def _ack_blob(stage: int, worker: int, version: int, step: int, first: int, loaded: str) -> pa.Table:
    body = json.dumps({"stage": stage, "worker": worker, "version": version, "step": step,
                       "loaded": loaded}).encode()
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


# ---- tasks ----


class StepInfo(NamedTuple):
    """A step of a job and its logged determinants."""

    step: int
    now_ns: int | None
    seed: int | None


@dataclass
class StageTask:
    """Everything a task needs to run one stage of one job for any worker (picklable; sent to executors).

    ``storage`` is the pipeline's directory (state of stateful stages lives under it, invariant 3); ``run`` is
    a random id of the driver's incarnation (cache entries of an earlier incarnation are never used);
    ``version`` is the base version every stage database is at when the job starts. ``fault`` is for tests
    only: ``(point, worker)`` raises :class:`InjectedFault` at ``point`` (``"before-commit"`` or
    ``"after-commit"``; for a stateless stage both mean "after computing") when running ``worker``, if the
    caller asks for it (e.g. on a task's first attempt only).
    """

    plan: StagePlan
    stage: int
    workers: int
    shard_bits: int
    storage: str | None
    run: str
    version: int
    steps: list[StepInfo]
    fault: tuple[str, int] | None = None


class _Entry:
    """A cached stage worker: its live instances, their snapshot tracker, and where they are."""

    def __init__(self, run: str, version: int, step: int, worker: StageWorker, snapshot: WorkerSnapshot) -> None:
        self.run, self.version, self.step = run, version, step
        self.worker, self.snapshot = worker, snapshot


_CACHE: "OrderedDict[tuple[str, int, int], _Entry]" = OrderedDict()
_CACHE_MAX = 64
_CACHE_LOCK = threading.Lock()
cache_stats = {"hits": 0, "loads": 0, "partial_loads": 0, "listed_loads": 0, "listing_fallbacks": 0,
               "replayed_results": 0, "rollbacks": 0}


def _capture(entry: _Entry) -> list:
    """What :func:`_rollback` needs to put the cached state back where it is now (references, not copies)."""
    saved: list = []
    for i, inst in entry.worker.stateful.items():
        traces, zsets = state_attrs(i, inst)
        for name in traces:
            t: Trace = getattr(inst, name)
            saved.append((inst, name, t, {k: (list(v) if isinstance(v, list) else v) for k, v in vars(t).items()}))
        for name in zsets:
            saved.append((inst, name, None, getattr(inst, name)))
    snap = entry.snapshot
    saved.append(({t: dict(d) for t, d in snap._saved.items()}, snap._next))
    return saved


def _rollback(entry: _Entry, saved: list) -> None:
    snap_saved, snap_next = saved[-1]
    for inst, name, t, v in saved[:-1]:
        if t is None:
            setattr(inst, name, v)
        else:
            vars(t).clear()
            vars(t).update({k: (list(x) if isinstance(x, list) else x) for k, x in v.items()})
            setattr(inst, name, t)
    entry.snapshot._saved = snap_saved
    entry.snapshot._next = snap_next


def _run_steps(task: StageTask, sw: StageWorker, received: dict[tuple[int, int], ZSet]) -> pa.Table:
    """Run the job's steps in order on ``sw``; the blobs it produces."""
    w, k = sw.worker, task.stage
    rows: list[tuple[int, int, int, int, ZSet]] = []
    for st in task.steps:
        vals = {j: received[(j, st.step)] for j in task.plan.receive[k] if (j, st.step) in received}
        r = sw.step(vals, st.now_ns, st.seed)
        for x, parts in r.sends.items():
            rows.extend((p, w, x, st.step, z) for p, z in enumerate(parts))
        rows.extend((w, w, j, st.step, z) for j, z in r.carried.items())
        names = task.plan.output_names
        rows.extend((w, w, output_node(names.index(n)), st.step, z) for n, z in r.outputs.items())
    return encode_blobs(rows)


def _fault(task: StageTask, worker: int, point: str) -> None:
    if task.fault is not None and task.fault == (point, worker):
        raise InjectedFault(f"injected fault {point!r} in stage {task.stage} worker {worker}")


def _result_path(storage: str, stage: int, worker: int) -> str:
    return stage_db_path(storage, stage, worker)[:-3] + ".result"


def _write_result(path: str, tag: dict, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as wr:
        wr.write_table(table)
    head = json.dumps(tag, sort_keys=True).encode()
    blob = frame(_RESULT_MAGIC, len(head).to_bytes(4, "little") + head + sink.getvalue().to_pybytes())
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_result(path: str, tag: dict) -> pa.Table:
    try:
        with open(path, "rb") as f:
            body = unframe(_RESULT_MAGIC, f.read(), path)
    except FileNotFoundError:
        raise RecoveryError(f"{path}: missing, but the database holds the committed version of this job") from None
    n = int.from_bytes(body[:4], "little")
    got = json.loads(body[4:4 + n])
    # the same job (base version and steps) of any driver incarnation: its input division is logged, so its
    # result is the same (a zombie of a dead driver may have committed it)
    if {k: v for k, v in got.items() if k != "run"} != {k: v for k, v in tag.items() if k != "run"}:
        raise RecoveryError(f"{path}: holds the result of job {got}, expected {tag}")
    return pa.ipc.open_stream(pa.py_buffer(body[4 + n:])).read_all()


_SAVELOG = "stagelog"
_SAVELOG_KEEP = 16  # versions of save records kept: a cache entry at most this stale catches up without a scan


def _log_saves(h: Any, version: int, saves: list[tuple]) -> None:
    """Record which trace keys the save of ``version`` added and deleted (and drop records too old to use)."""
    added: dict[str, list[str]] = {}
    deleted: dict[str, list[str]] = {}
    for op in saves:
        if op[0] == "batch":
            added.setdefault(op[1], []).extend(k.hex() for k in op[5])
        elif op[0] == "delete":
            deleted.setdefault(op[1], []).extend(k.hex() for k in op[2])
    h.put(_SAVELOG, version.to_bytes(8, "big"), encode_json(b"DSVL", {"added": added, "deleted": deleted}))
    if version > _SAVELOG_KEEP:
        for k in [k for k, _ in h.scan(_SAVELOG, end=(version - _SAVELOG_KEEP).to_bytes(8, "big"))]:
            h.delete(_SAVELOG, k)


def _listing(h: Any, entry: _Entry, version: int, where: str) -> dict[str, list[bytes]] | None:
    """Every trace key of ``version``: the stale entry's saved keys plus the logged saves since; None if a
    record is gone (the entry is too stale)."""
    keys = {t: {k for _, ks in saved.values() for k in ks} for t, saved in entry.snapshot._saved.items()}
    for ver in range(entry.version + 1, version + 1):
        rec = h.get(_SAVELOG, ver.to_bytes(8, "big"))
        if rec is None:
            return None
        d = decode_json(b"DSVL", rec, f"{where} save log of version {ver}")
        for t, ks in d["deleted"].items():
            keys.setdefault(t, set()).difference_update(bytes.fromhex(x) for x in ks)
        for t, ks in d["added"].items():
            keys.setdefault(t, set()).update(bytes.fromhex(x) for x in ks)
    return {t: sorted(ks) for t, ks in keys.items()}


def run_stage_task(task: StageTask, worker: int, blobs: pa.Table) -> pa.Table:
    """Run stage ``task.stage`` of one job for ``worker`` over the blobs addressed to it; returns the blobs it emits.

    The result holds the blobs produced for later stages (exchange parts, carried values), this worker's output
    shares, the received blobs a later stage still needs (forwarded), and for a stateful stage one commit
    acknowledgement (:func:`read_acks`). Invariants 2-5.
    """
    plan, k = task.plan, task.stage
    if blobs.schema != BLOB_SCHEMA:
        blobs = blobs.select(BLOB_SCHEMA.names).cast(BLOB_SCHEMA)
    parts = blobs.column("part").to_numpy()
    if len(parts) and not bool((parts == worker).all()):
        bad = sorted(set(parts.tolist()) - {worker})
        raise DbspError(f"stage {k} worker {worker}: received blobs addressed to workers {bad} (misrouted shuffle)")
    nodes = blobs.column("node").to_numpy()
    uniq = [int(n) for n in np.unique(nodes)]
    fwd_nodes = [n for n in uniq if plan.forwards(n, k)]
    use_nodes = [n for n in uniq if n >= 0 and n in plan.receive[k]]
    forward = blobs.filter(pa.array(np.isin(nodes, np.array(fwd_nodes, dtype=np.int64))))
    received = gather(plan, blobs.filter(pa.array(np.isin(nodes, np.array(use_nodes, dtype=np.int64)))),
                      f"stage {k} worker {worker}")
    sm = ShardMap(task.workers, task.shard_bits)
    where = f"stage {k} worker {worker}"
    if not plan.stateful[k]:
        out = _run_steps(task, StageWorker(plan.circuit, plan, k, worker, sm), received)
        _fault(task, worker, "before-commit")
        _fault(task, worker, "after-commit")
        return pa.concat_tables([out, forward])
    if task.storage is None:
        raise DbspError(f"{where}: a stateful stage needs a storage directory")
    produced = _run_stateful(task, worker, sm, received)
    return pa.concat_tables([produced, forward])


def _run_stateful(task: StageTask, worker: int, sm: ShardMap, received: dict[tuple[int, int], ZSet]) -> pa.Table:
    plan, k, v = task.plan, task.stage, task.version
    assert task.storage is not None
    path = stage_db_path(task.storage, k, worker)
    first, end = task.steps[0].step, task.steps[-1].step + 1
    tag = {"run": task.run, "version": v, "first": first, "end": end}
    where = f"{path}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lockfd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lockfd, fcntl.LOCK_EX)  # invariant 4: one attempt of this (stage, worker) at a time
        db = Database(path)
        try:
            vs = db.versions()
            if vs == range(v, v + 2):  # an earlier attempt committed this job: return what it produced
                cache_stats["replayed_results"] += 1
                return _read_result(_result_path(task.storage, k, worker), tag)
            if vs.stop - 1 != v:
                raise StaleAttemptError(f"{where}: holds versions {vs.start}..{vs.stop - 1}, this attempt is for "
                                        f"base version {v} (a stale attempt of an earlier job)")
            h = db.open(v)
            try:
                if h.get_step() != first:
                    raise RecoveryError(f"{where}: version {v} is at step {h.get_step()}, the job starts at {first}")
                key = (task.storage, k, worker)
                with _CACHE_LOCK:
                    entry = _CACHE.pop(key, None)
                if entry is None or (entry.run, entry.version, entry.step) != (task.run, v, first):
                    # a stale entry of this run (another process ran the jobs since) still holds most batches,
                    # and the save log says which keys those jobs added and deleted
                    fresh = entry is not None and entry.run == task.run and entry.version < v
                    stale = entry.snapshot if fresh else None
                    listing = _listing(h, entry, v, where) if fresh else None
                    sw = StageWorker(plan.circuit, plan, k, worker, sm)
                    snap = WorkerSnapshot(sw.stateful, task.shard_bits)
                    try:
                        snap.load(h, f"{where} v{v}", reuse=stale, listing=listing)
                    except CorruptionError:
                        if listing is None:
                            raise
                        listing = None  # a listed key is gone (a save the log missed): read the tables instead
                        cache_stats["listing_fallbacks"] += 1
                        sw = StageWorker(plan.circuit, plan, k, worker, sm)
                        snap = WorkerSnapshot(sw.stateful, task.shard_bits)
                        snap.load(h, f"{where} v{v}", reuse=stale)
                    entry = _Entry(task.run, v, first, sw, snap)
                    loaded = "partial" if stale is not None else "full"
                    cache_stats["loads" if stale is None else "partial_loads"] += 1
                    cache_stats["listed_loads"] += listing is not None
                else:
                    loaded = "cache"
                    cache_stats["hits"] += 1
                saved = _capture(entry)
                try:
                    out = _run_steps(task, entry.worker, received)
                    saves = entry.snapshot.prepare()
                    WorkerSnapshot.apply(h, saves)
                    _log_saves(h, v + 1, saves)
                    h.set_step(end)
                    out = pa.concat_tables([out, _ack_blob(k, worker, v + 1, end, first, loaded)])
                    _write_result(_result_path(task.storage, k, worker), tag, out)
                    _fault(task, worker, "before-commit")
                    h.commit()
                except BaseException:
                    _rollback(entry, saved)
                    cache_stats["rollbacks"] += 1
                    with _CACHE_LOCK:
                        _CACHE[key] = entry
                    raise
                entry.version, entry.step = v + 1, end
                with _CACHE_LOCK:
                    _CACHE[key] = entry
                    while len(_CACHE) > _CACHE_MAX:
                        _CACHE.popitem(last=False)
            finally:
                if not h.closed:
                    h.close()
            _fault(task, worker, "after-commit")
            return out
        finally:
            db.close()
    finally:
        os.close(lockfd)  # releases the lock


def open_stage_databases(storage: str, plan: StagePlan, workers: int) -> list[tuple[int, int, str]]:
    """Create (if missing) the Database of every stateful (stage, worker); returns ``[(stage, worker, path)]``."""
    out = []
    for k in range(plan.num_stages):
        if not plan.stateful[k]:
            continue
        for w in range(workers):
            path = stage_db_path(storage, k, w)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Database(path).close()
            out.append((k, w, path))
    return out


def choose_version(paths: list[str], at_most: int | None = None) -> tuple[int, int]:
    """Seed 000 recovery over stage databases: open every one at ``max(intersection of versions())``.

    With ``at_most``, the newest common version not above it (the driver passes the base version of a job
    whose output it did not log). Opening discards any other version (e.g. a job that did not complete
    everywhere); returns ``(version, step)``. Takes each database's lock, so no task may run meanwhile.
    RecoveryError if no common version qualifies or the databases disagree on the step.
    """
    if not paths:
        return 0, 0
    locks = []
    try:
        dbs = []
        for p in paths:
            fd = os.open(p + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            locks.append(fd)
            dbs.append(Database(p))
        try:
            ranges = [db.versions() for db in dbs]
            lo, hi = max(r.start for r in ranges), min(r.stop for r in ranges)
            if lo >= hi:
                raise RecoveryError(f"the stage databases share no version: "
                                    f"{[(p, r.start, r.stop - 1) for p, r in zip(paths, ranges)]}")
            v = hi - 1 if at_most is None else min(hi - 1, at_most)
            if v < lo:
                raise RecoveryError(f"the stage databases share versions {lo}..{hi - 1}, none at or below {at_most}")
            steps = set()
            for db in dbs:
                h = db.open(v)  # discards the other version
                steps.add(h.get_step())
                h.close()  # keeps v only
            if len(steps) != 1:
                raise RecoveryError(f"the stage databases disagree on the step of version {v}: {sorted(steps)}")
            return v, steps.pop()
        finally:
            for db in dbs:
                db.close()
    finally:
        for fd in locks:
            os.close(fd)


def drop_cache() -> None:
    """Forget every cached stage worker of this process (tests; state is then loaded from the databases)."""
    with _CACHE_LOCK:
        _CACHE.clear()

