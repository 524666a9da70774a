"""The durable, exactly-once Pipeline: input log with producer/seq dedup, a logged division of input into steps with its determinants, an output log, coordinated checkpoints of per-worker Databases, and recovery.

Storage directory layout::

    META              circuit fingerprint, workers, shard bits (versioned, checksummed, replaced atomically)
    input/            StepLog: pushes (step, handle, producer, seq, Z-set) and one division record per step
    output/           OutputLog: every step's output and the input ranges that produced it
    worker-<w>.db     each worker's Database: operator state grouped by shard; worker 0 also the dedup table

Invariants (enforced here):
  1. ``push`` returns its acknowledgement only after the push's record is durable in the input log. The record
     carries the step that was open when the push was admitted; a step is closed only when no admitted push is
     still being appended, and pushes wait while a step closes, so the log's steps never decrease and every
     record of step s precedes s's division record.
  2. A ``(producer, seq)`` pair is counted once: it is marked seen only after its record is durable; a retry of
     a seen pair is acknowledged again (``duplicate=True``) and records nothing; a retry of a pair still being
     appended waits for it. The seen set is saved with each checkpoint (worker 0's ``dedup`` table) and
     completed on recovery from the log records after the checkpoint.
  3. A step's division record (step, number of pushes, wall-clock ``now``, random ``seed``) takes its place in
     the input log's order when the step closes (before any push of the next step), and is durable before any
     output of the step is written to the output log or returned by ``step``, so no output of a step exists
     whose input division could change. ``step`` overlaps the record's fsync with running the circuit (seed 000
     "Input/output synchronization": block until the division commits after running the circuit, before
     writing the output); everything else that makes a step's effects durable (``queue_step``, staged jobs
     that commit stage state) appends it durably before the step runs. Replay uses the logged ``now`` and
     ``seed``.
  4. Every step's output goes through ``OutputLog.write`` (discard / verify / append, seed 000); with replay
     checking on (the default) a replayed step whose output differs raises ReplayMismatchError.
  5. A checkpoint runs the coordinator protocol (coordinator.py): steps pause while every worker's state is
     captured, then the output log is flushed and every worker commits (on a background thread for timer
     checkpoints, while later steps run). Only after every worker opened the new version are the input log
     truncated below the checkpoint's step (the low watermark) and old output dropped (output at or after
     the checkpoint step is always kept, so replays can be verified).
  6. Recovery opens every worker at the newest common version, restores operator state, replays every
     divided step from the version's step (verifying output already in the log, appending the rest), then
     queues the acknowledged pushes never divided into a step for the next step. A directory written by a
     different circuit, worker count or shard count is refused with CircuitMismatchError.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, NamedTuple

import pyarrow as pa

from dbsp_core.circuit import Circuit
from dbsp_core.codec import decode_json, decode_zset, encode_json, encode_zset
from dbsp_core.operators.base import Operator
from dbsp_core.coordinator import Coordinator, WorkerStore, worker_db_path
from dbsp_core.errors import CircuitMismatchError, CorruptionError, DbspError, RecoveryError
from dbsp_core.storage.outputlog import OutputLog
from dbsp_core.time.watermark import advance  # watermark hook
from dbsp_core.runtime import Pipeline, PushData
from dbsp_core.shard import DEFAULT_SHARD_BITS
from dbsp_core.storage.snapshot import state_attrs
from dbsp_core.storage import DatabaseHandle, StepLog
from dbsp_core.zset import ZSet

FORMAT_VERSION = 1
DIVISION_HANDLE = "\x00division"
_DEDUP_TABLE = "dedup"

# ---- crash points for the kill -9 tests: DBSP_CRASHPOINT="name:n" kills this process at the n-th hit ----

_crash_name, _crash_left = "", 0
_crash_lock = threading.Lock()


def arm_crashpoint(spec: str) -> None:
    """Tests only: ``"name:n"`` makes the n-th hit of crash point ``name`` kill this process; ``""`` disarms."""
    global _crash_name, _crash_left
    name, _, n = spec.partition(":")
    _crash_name, _crash_left = name, (int(n) if n.isdigit() else 0)


arm_crashpoint(os.environ.get("DBSP_CRASHPOINT", ""))


def crashpoint(name: str) -> None:
    """Kill this process with SIGKILL at the configured hit of crash point ``name`` (tests only; else a no-op)."""
    global _crash_left
    if not _crash_left or name != _crash_name:
        return
    with _crash_lock:
        _crash_left -= 1
        if _crash_left == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class Ack(NamedTuple):
    """The acknowledgement of a durable push: the step it belongs to (None for a duplicate) and its identity."""

    step: int | None
    producer: str
    seq: int
    duplicate: bool


class _Seen:
    """The (producer, seq) pairs already recorded: a dense watermark per producer plus the seqs above it."""

    def __init__(self) -> None:
        self.wm: dict[str, int] = {}
        self.above: dict[str, set[int]] = {}

    def has(self, producer: str, seq: int) -> bool:
        return seq <= self.wm.get(producer, -1) or seq in self.above.get(producer, ())

    def add(self, producer: str, seq: int) -> None:
        wm = self.wm.get(producer, -1)
        if seq <= wm:
            return
        s = self.above.setdefault(producer, set())
        s.add(seq)
        while wm + 1 in s:
            wm += 1
            s.discard(wm)
        self.wm[producer] = wm
        if not s:
            del self.above[producer]

    def save(self, h: DatabaseHandle) -> None:
        old = {k for k, _ in h.scan(_DEDUP_TABLE)}
        for p, wm in self.wm.items():
            key = p.encode("utf-8")
            h.put(_DEDUP_TABLE, key, encode_json(b"DDUP", {"wm": wm, "above": sorted(self.above.get(p, ()))}))
            old.discard(key)
        for k in old:
            h.delete(_DEDUP_TABLE, k)

    def load(self, h: DatabaseHandle, where: str) -> None:
        for k, v in h.scan(_DEDUP_TABLE):
            d = decode_json(b"DDUP", v, f"{where} dedup {k!r}")
            p = k.decode("utf-8")
            self.wm[p] = int(d["wm"])
            if d["above"]:
                self.above[p] = set(int(x) for x in d["above"])


def circuit_fingerprint(circuit: Circuit) -> str:
    """A hash of the circuit's structure: every node's kind, inputs, schema and parameters, inputs and outputs.

    >>> import pyarrow as pa
    >>> c = Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> len(circuit_fingerprint(c))
    64
    """
    h = hashlib.sha256()
    for op in circuit.nodes:
        parts = [type(op).__name__, getattr(op, "kind", ""), repr(op.inputs), op.schema.to_string(),
                 repr(op.partitioning)]
        for k, v in sorted(vars(op).items()):
            if k in ("node_id", "inputs", "schema", "partitioning"):
                continue
            if isinstance(v, (str, int, float, bool, tuple, list, type(None))):
                parts.append(f"{k}={v!r}")
            elif isinstance(v, pa.Schema):
                parts.append(f"{k}={v.to_string()}")
            elif isinstance(v, Operator):
                parts.append(f"{k}=node#{v.node_id}")
            elif callable(v):
                code = getattr(v, "__code__", None)  # the function's body too, so two lambdas differ
                body = "" if code is None else hashlib.sha256(code.co_code + re.sub(
                    r" at 0x[0-9a-fA-F]+", "", repr(code.co_consts) + repr(code.co_names)).encode()).hexdigest()
                parts.append(f"{k}=<{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__name__)}"
                             f":{body}>")
            else:
                # e.g. pyarrow compute expressions print their full text; addresses vary between processes
                parts.append(f"{k}=" + re.sub(r" at 0x[0-9a-fA-F]+", "", str(v)))
        h.update("\x1f".join(parts).encode("utf-8") + b"\x1e")
    h.update(repr(sorted(circuit.inputs.items())).encode() + repr(sorted(circuit.outputs.items())).encode())
    return h.hexdigest()


def _lock_dir(root: str) -> int:
    """An exclusive lock on ``root/LOCK`` held while a pipeline (or an inspection) uses the directory."""
    fd = os.open(os.path.join(root, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DbspError(f"{root} is in use by another pipeline (LOCK is held)") from None
    return fd


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(root: str) -> dict:
    """The META record of a storage directory; FileNotFoundError if there is none, CorruptionError if bad."""
    path = os.path.join(root, "META")
    with open(path, "rb") as f:
        return decode_json(b"DMET", f.read(), path)


def _write_meta(root: str, meta: dict) -> None:
    path = os.path.join(root, "META")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(encode_json(b"DMET", meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)


def _ranges(entries: list[tuple[str, str, int]]) -> list[dict]:
    """Summarize a step's pushes as contiguous seq ranges per (handle, producer)."""
    by: dict[tuple[str, str], list[int]] = {}
    for handle, producer, seq in entries:
        by.setdefault((handle, producer), []).append(seq)
    out = []
    for (handle, producer), seqs in sorted(by.items()):
        if producer == "":
            out.append({"handle": handle, "producer": "", "first_seq": None, "last_seq": None, "pushes": len(seqs)})
            continue
        seqs.sort()
        lo = prev = seqs[0]
        for s in seqs[1:] + [None]:
            if s is not None and s == prev + 1:
                prev = s
                continue
            out.append({"handle": handle, "producer": producer, "first_seq": lo, "last_seq": prev,
                        "pushes": prev - lo + 1})
            if s is not None:
                lo = prev = s
    return out


class DurablePipeline(Pipeline):
    """A Pipeline whose input, step division, state and output survive ``kill -9``; see the module docstring.

    Built by ``Pipeline(circuit, workers=W, storage=dir, ...)`` or :meth:`Pipeline.open`.

    Parameters
    ----------
    circuit, workers, shard_bits
        As for :class:`~dbsp_core.runtime.Pipeline`; an existing directory must have the same ones.
    storage : str or os.PathLike
        The storage directory (created if missing; recovered if it holds a pipeline).
    checkpoint_interval : float or None
        Seconds between automatic checkpoints, checked after each step (None: only on demand and on close).
    replay_check : bool
        Verify replayed output against the output log (default True).
    output_retention : int or None
        Keep at least this many steps of output before the newest checkpoint (None: keep everything).
    output_sync : bool
        fsync each step's output record before ``step`` returns (default True).
    segment_bytes : int
        Segment size of the input and output logs; garbage collection drops whole segments.

    Examples
    --------
    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
    >>> c.output("totals", bids.group_by("auction").agg(total=dbsp.sum("price")))
    >>> d = tempfile.mkdtemp()
    >>> p = dbsp.Pipeline(c, workers=2, storage=d)
    >>> p.push("bids", pa.table({"auction": [1, 1], "price": [10, 5]}), producer="gen", seq=0).duplicate
    False
    >>> p.push("bids", pa.table({"auction": [1, 1], "price": [10, 5]}), producer="gen", seq=0).duplicate
    True
    >>> p.step()["totals"].to_dict()
    {(1, 15): 1}
    >>> p.close()
    >>> q = dbsp.Pipeline.open(d, c)
    >>> [(s, z.to_dict()) for s, z in q.read_output("totals")]
    [(0, {(1, 15): 1})]
    >>> q.close()
    """

    def __init__(self, circuit: Circuit, workers: int = 1, shard_bits: int = DEFAULT_SHARD_BITS,
                 storage: Any = None, *, checkpoint_interval: float | None = 10.0, replay_check: bool = True,
                 output_retention: int | None = None, output_sync: bool = True,
                 segment_bytes: int = 64 << 20) -> None:
        if storage is None:
            raise ValueError("DurablePipeline needs storage=<directory>")
        if checkpoint_interval is not None and not checkpoint_interval > 0:
            raise ValueError(f"checkpoint_interval must be a positive number of seconds or None, "
                             f"got {checkpoint_interval!r}")
        if output_retention is not None and (not isinstance(output_retention, int) or output_retention < 0):
            raise ValueError(f"output_retention must be a non-negative int or None, got {output_retention!r}")
        super().__init__(circuit, workers, shard_bits, None)
        self.storage = root = os.fspath(storage)
        self.checkpoint_interval = checkpoint_interval
        self.output_retention = output_retention
        self.fingerprint = circuit_fingerprint(circuit)
        if not isinstance(segment_bytes, int) or segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be an int >= 4096, got {segment_bytes!r}")
        self._cond = threading.Condition()
        self._step_lock = threading.RLock()
        self._closing = False
        self._inflight = 0
        self._inflight_keys: set[tuple[str, int]] = set()
        self._seen = _Seen()
        self._dpending: list[tuple[str, ZSet]] = []
        self._step_inputs: list[tuple[str, str, int]] = []
        self.now_ns: int | None = None
        self.seed: int | None = None
        self._now_floor = 0
        self._wm_divided = dict(self.watermarks)  # watermark hook: the watermarks after the last divided step
        self._division_watermarks: dict[int, dict[str, int]] = {}  # watermark hook: logged, by step, until run
        self._ckpt_thread: threading.Thread | None = None
        self._syncer: ThreadPoolExecutor | None = None  # fsyncs division records while the step runs
        self._division_sync: Future | None = None
        self.stats = {"pushes": 0, "duplicates": 0, "checkpoints": 0, "last_checkpoint_s": 0.0,
                      "recovery_s": 0.0, "replayed_steps": 0, "recovered_pushes": 0,
                      "late_rows": self.late_rows}  # watermark hook: late rows per event-time input, since open
        os.makedirs(root, exist_ok=True)
        self._lockfd = _lock_dir(root)
        self._input = self._output = self._coord = None  # type: ignore[assignment]
        try:
            meta = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "workers": workers,
                    "shard_bits": shard_bits, "inputs": sorted(self._inputs), "outputs": sorted(self._out_schemas),
                    "output_schemas": {n: sch.serialize().to_pybytes().hex() for n, sch in self._out_schemas.items()}}
            try:
                old = read_meta(root)
            except FileNotFoundError:
                old = None
            if old is None:
                if any(n.startswith("worker-") for n in os.listdir(root)):
                    raise RecoveryError(f"{root}: worker databases exist but META is missing")
                _write_meta(root, meta)
            else:
                for k in ("fingerprint", "workers", "shard_bits"):
                    if old.get(k) != meta[k]:
                        what = "circuit" if k == "fingerprint" else k
                        raise CircuitMismatchError(
                            f"{root} was written by a pipeline with a different {what} "
                            f"({old.get(k)!r} != {meta[k]!r}); open it with the same circuit and scale")
            self._input = StepLog(os.path.join(root, "input"), segment_bytes=segment_bytes)
            self._output = OutputLog(os.path.join(root, "output"), self._out_schemas, check=replay_check,
                                     sync=output_sync, segment_bytes=segment_bytes)
            self._open_state()
            self._recover()
        except BaseException:
            self._shutdown_storage()
            super().close()
            raise
        self._last_checkpoint = time.monotonic()

    # ---- recovery (hooks: _open_state, _restore_state, _replay_step, _replay_done; see dbsp_core.staged) ----

    def _open_state(self) -> None:
        """Open the operator state: one WorkerStore per worker under a Coordinator."""
        stores = []
        for w, wk in enumerate(self._workers):
            stateful = {i: inst for i, inst in wk.instances.items() if inst is not self.circuit.nodes[i]}
            for i, inst in stateful.items():
                state_attrs(i, inst)  # snapshot invariant 2: refuse state we could not checkpoint
            stores.append(WorkerStore(w, worker_db_path(self.storage, w), stateful, self.shard_map.shard_bits))
        self._coord = Coordinator(stores, crashpoint)

    def _restore_state(self) -> int:
        """Open every worker at the newest common version, load its state, the dedup set and the clock floor;
        returns the version's step (the first step to replay)."""
        x = self._coord.start(load=True)
        store0 = self._coord.stores[0]
        assert store0.handle is not None
        self._seen.load(store0.handle, f"{store0.db.path}")
        clock = store0.handle.get(_DEDUP_TABLE + ".clock", b"now")
        if clock is not None:
            clk = decode_json(b"DCLK", clock, f"{store0.db.path} clock")
            self._now_floor = int(clk["now_ns"])
            if "watermarks" in clk:  # watermark hook: the watermarks after the checkpoint's last step
                self.watermarks = {k: int(v) for k, v in clk["watermarks"].items()}
                self._wm_divided = dict(self.watermarks)
        return x

    def _replay_step(self, step: int, inputs: list[tuple[str, ZSet]], now_ns: int, seed: int,
                     ranges: list[dict]) -> None:
        """Re-run a logged step during recovery (its output is verified against the output log)."""
        self._run_step(step, inputs, now_ns, seed, ranges)
        self.stats["replayed_steps"] += 1
        crashpoint("recover-step")

    def _replay_done(self) -> None:
        """Every logged step was handed to :meth:`_replay_step` (a runner that batches steps runs them now)."""

    def _recover(self) -> None:
        t0 = time.perf_counter()
        x = self._restore_state()
        out = self._output
        if out.last < x:
            raise RecoveryError(f"{self.storage}: the output log ends at step {out.last} but the checkpoint is at "
                                f"step {x}; output of steps {out.last}..{x - 1} is lost")
        divisions: dict[int, dict] = {}
        records: dict[int, list] = {}
        for r in self._input.iter_from(x):
            if r.handle == DIVISION_HANDLE:
                divisions[r.step] = decode_json(b"DDIV", r.payload, f"{self.storage} division of step {r.step}")
            else:
                records.setdefault(r.step, []).append(r)
        step = x
        while step in divisions:
            d = divisions.pop(step)
            recs = records.pop(step, [])
            if d["step"] != step or d["pushes"] != len(recs):
                raise CorruptionError(f"{self.storage}: the division of step {step} names {d['pushes']} pushes, "
                                      f"the log holds {len(recs)}")
            self._now_floor = max(self._now_floor, d["now_ns"])
            if "watermarks" in d:  # watermark hook: replay with the logged watermarks
                self._wm_divided = self._division_watermarks[step] = {k: int(v) for k, v in d["watermarks"].items()}
            self._replay_step(step, self._decode(recs), d["now_ns"], d["seed"], _ranges(
                [(r.handle, r.producer, r.seq) for r in recs]))
            step += 1
        self._replay_done()
        if divisions:
            raise CorruptionError(f"{self.storage}: division records of steps {sorted(divisions)} follow a gap "
                                  f"at step {step}")
        if out.last > step:
            raise CorruptionError(f"{self.storage}: the output log holds steps up to {out.last - 1} but the input "
                                  f"log divides input only up to step {step - 1}")
        tail = records.pop(step, [])
        if records:
            raise CorruptionError(f"{self.storage}: input records of undivided steps {sorted(records)} after "
                                  f"step {step}")
        for (handle, z), r in zip(self._decode(tail), tail):
            self._dpending.append((handle, z))
            self._step_inputs.append((r.handle, r.producer, r.seq))
            if r.producer:
                self._seen.add(r.producer, r.seq)
        self.stats["recovered_pushes"] = len(tail)
        if self.now_ns is None and self._now_floor:
            self.now_ns = self._now_floor  # the now of the latest step, from the checkpoint
        self.steps = step
        self._open_step = step
        self.stats["recovery_s"] = time.perf_counter() - t0

    def _decode(self, recs: list) -> list[tuple[str, ZSet]]:
        out = []
        for r in recs:
            if r.handle not in self._inputs:
                raise CorruptionError(f"{self.storage}: logged push to unknown input {r.handle!r} at step {r.step}")
            z = decode_zset(r.payload, self._inputs[r.handle], f"{self.storage} input step {r.step}")
            if r.producer:
                self._seen.add(r.producer, r.seq)
            out.append((r.handle, z))
        return out

    # ---- input ----

    def push(self, handle: str, data: PushData, weights: Any = None, *, producer: str | None = None,
             seq: int | None = None) -> Ack:  # type: ignore[override]
        """Durably record ``data`` for the next step; returns an :class:`Ack` once it is in the input log.

        With ``producer`` and ``seq`` the push is idempotent across crashes: a pair already recorded is
        acknowledged again with ``duplicate=True`` and counted once. Keep each producer's seqs dense from 0
        (any order) to keep the dedup state small. Thread-safe; concurrent pushes share fsyncs.
        """
        self._check_usable()
        if (producer is None) != (seq is None):
            raise TypeError("push: give both producer= and seq=, or neither")
        if producer is not None:
            if not isinstance(producer, str) or not producer:
                raise TypeError(f"push: producer must be a non-empty str, got {producer!r}")
            if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**63:
                raise TypeError(f"push: seq must be an int in [0, 2**63), got {seq!r}")
        if handle not in self._inputs:
            raise KeyError(f"push: unknown input handle {handle!r}; inputs are {sorted(self._inputs)}")
        z = self._to_zset(handle, data, weights)
        if not z.weights.flags.writeable:  # Arrow-backed weights are read-only; the kernels need writable ones
            z = ZSet._make(z.data, z.weights.copy())
        payload = encode_zset(z)
        prod, sq = producer or "", seq or 0
        with self._cond:
            while True:
                if self._closing:
                    self._cond.wait()
                    continue
                if producer is not None:
                    if self._seen.has(prod, sq):
                        self.stats["duplicates"] += 1
                        return Ack(None, prod, sq, True)
                    if (prod, sq) in self._inflight_keys:
                        self._cond.wait()
                        continue
                    self._inflight_keys.add((prod, sq))
                break
            step = self._open_step
            self._inflight += 1
        try:
            crashpoint("push-append")
            self._input.append(step, handle, payload, producer=prod, seq=sq)
            crashpoint("push-acked")
        except BaseException as exc:
            # the record may or may not be durable: only recovery (which reads the log) can tell, so a retry in
            # this process could count it twice; stop accepting work (like a failed fsync in a database)
            with self._cond:
                self._broken = exc
                self._inflight -= 1
                self._inflight_keys.discard((prod, sq))
                self._cond.notify_all()
            raise
        with self._cond:
            self._dpending.append((handle, z))
            self._step_inputs.append((handle, prod, sq))
            if producer is not None:
                self._seen.add(prod, sq)
                self._inflight_keys.discard((prod, sq))
            self._inflight -= 1
            self.stats["pushes"] += 1
            self._cond.notify_all()
        return Ack(step, prod, sq, False)

    # ---- steps ----

    def _run_step(self, step: int, inputs: list[tuple[str, ZSet]], now_ns: int, seed: int,
                  ranges: list[dict]) -> dict[str, ZSet]:
        for handle, z in inputs:
            Pipeline.push(self, handle, z)
        self.now_ns, self.seed = now_ns, seed
        self._logged_watermarks = self._division_watermarks.pop(step, None)  # watermark hook
        for wk in self._workers:
            wk.ctx.now_ns = now_ns  # the step's determinants, identical on replay (invariant 3)
            wk.ctx.seed = seed
        out = Pipeline.step(self)
        crashpoint("step-computed")  # the division record may or may not be durable yet
        self._await_division()  # invariant 3: durable before any output is written or returned
        crashpoint("step-output")
        try:
            self._output.write(step, out, ranges)
        except BaseException as exc:
            self._broken = exc  # state has advanced past output that is not logged: recover from the checkpoint
            raise
        crashpoint("step-written")
        for s in self._coord.stores:
            s.advance()
        return out

    def step(self) -> dict[str, ZSet]:
        """Divide the acknowledged input into a step (durably, with ``now`` and ``seed``), run it, log its output."""
        self._check_usable()
        with self._step_lock:
            step, inputs, now_ns, seed, ranges = self._divide(wait=False)
            crashpoint("step-run")
            try:
                out = self._run_step(step, inputs, now_ns, seed, ranges)
            finally:
                if self._division_sync is not None:  # the step failed before waiting: settle the fsync
                    self._await_division(quiet=True)
            if self.checkpoint_interval is not None and \
                    time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
                self.checkpoint(wait=False)
            return out

    def _divide(self, wait: bool = True) -> tuple[int, list[tuple[str, ZSet]], int, int, list[dict]]:
        """Close the open step: log its division record (invariant 3); returns
        ``(step, pushes, now_ns, seed, input ranges)``. Call with ``_step_lock`` held.

        With ``wait`` the record is durable when this returns; without, it is placed in the log's order and
        fsync'd on a background thread, and :meth:`_await_division` must return before any output of the step
        is written or released."""
        with self._cond:
            self._closing = True
            try:
                while self._inflight:
                    self._cond.wait()
                step = self._open_step
                inputs, self._dpending = self._dpending, []
                entries, self._step_inputs = self._step_inputs, []
                now_ns, seed = max(time.time_ns(), self._now_floor), random.getrandbits(63)
                self._now_floor = now_ns  # now never goes back, even if the wall clock does
                crashpoint("step-divide")
                division = {"step": step, "pushes": len(inputs), "now_ns": now_ns, "seed": seed}
                if self._event_time:  # watermark hook: the step's watermarks, logged with its division
                    self._wm_divided, _ = advance(self._event_time, self._wm_divided, inputs)
                    division["watermarks"] = self._division_watermarks[step] = dict(self._wm_divided)
                record = encode_json(b"DDIV", division)
                try:
                    if wait:
                        self._input.append(step, DIVISION_HANDLE, record)
                    else:
                        ticket = self._input.enqueue(step, DIVISION_HANDLE, record)
                        if self._syncer is None:
                            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="dbsp-division-sync")
                        self._division_sync = self._syncer.submit(self._input.sync, ticket)
                except BaseException as exc:
                    self._broken = exc  # the division may or may not be durable: only recovery knows
                    raise
                self._open_step = step + 1
            finally:
                self._closing = False
                self._cond.notify_all()
        return step, inputs, now_ns, seed, _ranges(entries)

    def _await_division(self, quiet: bool = False) -> None:
        """Wait until the division record of the last :meth:`_divide` ``(wait=False)`` is durable (invariant 3)."""
        f, self._division_sync = self._division_sync, None
        if f is None:
            return
        try:
            f.result()
        except BaseException as exc:
            self._broken = exc  # the division may or may not be durable: only recovery knows
            if not quiet:
                raise

    # ---- checkpoints ----

    def checkpoint(self, wait: bool = True) -> int:
        """Take a checkpoint of every worker (seed-000 protocol); returns its step.

        Steps pause only while each worker's state is captured (cheap: immutable batches); the state is then
        written and committed, before this returns with ``wait=True`` (on demand) or on a background thread with
        ``wait=False`` (the timer), while later steps run. Pushes never wait. After the commit the input log is
        truncated below the checkpoint's step. One checkpoint runs at a time.
        """
        self._check_usable()
        with self._step_lock:
            self._join_checkpoint()
            t0 = time.perf_counter()
            crashpoint("checkpoint-start")
            with self._cond:
                seen = _Seen()
                seen.wm = dict(self._seen.wm)
                seen.above = {p: set(s) for p, s in self._seen.above.items()}
            floor = self._now_floor
            clock = {"now_ns": floor}
            if self._event_time:  # watermark hook: the watermarks after the checkpoint's last step
                clock["watermarks"] = dict(self.watermarks)

            def save0(h: DatabaseHandle) -> None:  # worker 0 also keeps the dedup set and the clock floor
                seen.save(h)
                h.put(_DEDUP_TABLE + ".clock", b"now", encode_json(b"DCLK", clock))

            try:
                step, plans = self._coord.begin_checkpoint()
            except BaseException as exc:
                self._broken = exc
                raise

            def finish() -> None:
                try:
                    self._output.flush()  # output of every step below the checkpoint is durable before it
                    self._coord.finish_checkpoint(step, plans, save0)
                    crashpoint("checkpoint-gc")
                    self._input.truncate_below(step)  # the low watermark: every worker now holds only this version
                    if self.output_retention is not None:
                        self._output.truncate_below(min(step, self._output.last - self.output_retention))
                    self.stats["checkpoints"] += 1
                    self.stats["last_checkpoint_s"] = time.perf_counter() - t0
                except BaseException as exc:
                    # workers may hold different versions and the incremental snapshot state is ahead of the
                    # database: only recovery (Pipeline.open) knows the consistent state again
                    self._broken = exc
                    raise

            self._last_checkpoint = time.monotonic()
            if wait:
                finish()
            else:
                self._ckpt_thread = threading.Thread(target=self._background, args=(finish,),
                                                     name="dbsp-checkpoint", daemon=True)
                self._ckpt_thread.start()
            return step

    def _background(self, finish: Any) -> None:
        try:
            finish()
        except BaseException:  # recorded in self._broken; raised by the next call
            pass

    def _join_checkpoint(self) -> None:
        """Wait for a background checkpoint; raise if it failed."""
        t = self._ckpt_thread
        if t is not None:
            t.join()
            self._ckpt_thread = None
        self._check_usable()

    # ---- output ----

    def read_output(self, name: str, from_step: int = 0) -> Iterator[tuple[int, ZSet]]:
        """Yields ``(step, change)`` of output ``name`` for every logged step from ``from_step``, once each, in order."""
        return self._output.read(name, from_step)

    def read_input(self, step: int) -> dict[str, ZSet]:
        """The input of a divided step as one Z-set per input handle (seed 000 ``read(step)``).

        Raises LookupError if the step is not divided yet or its records were truncated below the low watermark.
        """
        if not 0 <= step < self._open_step:
            raise LookupError(f"step {step} is not divided yet (the next step is {self._open_step})")
        first = self._input.first_step
        if first is None or step < first:
            raise LookupError(f"the input of step {step} was truncated below the low watermark")
        parts: dict[str, list[ZSet]] = {h: [] for h in self._inputs}
        divided = False
        for r in self._input.iter_from(step, step):
            if r.handle == DIVISION_HANDLE:
                divided = True
            else:
                parts[r.handle].append(decode_zset(r.payload, self._inputs[r.handle], f"{self.storage} step {step}"))
        if not divided:
            raise LookupError(f"the input of step {step} was truncated below the low watermark")
        return {h: (ZSet.concat(ps).consolidate() if len(ps) > 1 else ps[0].consolidate() if ps
                    else ZSet.empty(self._inputs[h])) for h, ps in parts.items()}

    def output_inputs(self, step: int) -> list[dict]:
        """The input (handle, producer, first_seq..last_seq ranges) that produced output step ``step``."""
        return self._output.inputs_of(step)

    @property
    def output_steps(self) -> range:
        """The output steps the log holds."""
        return range(self._output.first, self._output.last)

    def disk_usage(self) -> dict[str, int]:
        """Bytes on disk per part of the storage directory."""
        def du(p: str) -> int:
            if os.path.isfile(p):
                return os.path.getsize(p)
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
        parts = {"input": du(os.path.join(self.storage, "input")),
                 "output": du(os.path.join(self.storage, "output"))}
        parts["state"] = sum(du(worker_db_path(self.storage, w)) for w in range(self.workers))
        return parts

    # ---- shutdown ----

    def _shutdown_storage(self) -> None:
        if self._division_sync is not None:
            self._await_division(quiet=True)
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        for part in (self._coord, self._input, self._output):
            try:
                if part is not None:
                    part.close()
            except Exception:  # pragma: no cover - best effort on an error path
                pass
        if self._lockfd is not None:
            os.close(self._lockfd)  # releases the directory lock
            self._lockfd = None

    def close(self, checkpoint: bool = True) -> None:  # type: ignore[override]
        """Checkpoint (unless ``checkpoint=False`` or the pipeline is broken), then release files and threads."""
        if self._workers is None:
            return
        with self._step_lock:
            t = self._ckpt_thread
            if t is not None:
                t.join()
                self._ckpt_thread = None
            if checkpoint and self._broken is None:
                self.checkpoint()
            self._shutdown_storage()
            super().close()

    def __repr__(self) -> str:
        return f"DurablePipeline({self.storage!r}, workers={self.workers}, steps={self.steps})"


def open_pipeline(path: str | os.PathLike, circuit: Circuit, **kwargs: Any) -> DurablePipeline:
    """Recover the durable pipeline stored in ``path`` (its workers and shard bits come from the directory)."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"Pipeline.open: no storage directory {root!r}")
    try:
        meta = read_meta(root)
    except FileNotFoundError:
        raise RecoveryError(f"Pipeline.open: {root!r} holds no pipeline (META is missing)") from None
    if meta.get("format") != FORMAT_VERSION:
        raise DbspError(f"{root}: storage format {meta.get('format')}, this build reads {FORMAT_VERSION}")
    return DurablePipeline(circuit, meta["workers"], meta["shard_bits"], root, **kwargs)


def open_output(path: str | os.PathLike) -> OutputLog:
    """The output log of a storage directory, read-only, for consumers in other processes (no circuit needed).

    It may be read while the pipeline runs: :meth:`OutputLog.refresh` picks up new steps, a record being
    written is not shown until it is complete, and steps dropped by retention raise LookupError.

    >>> import tempfile, pyarrow as pa
    >>> c = Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> d = tempfile.mkdtemp(); p = Pipeline(c, storage=d); _ = p.push("x", pa.table({"a": [1]})); _ = p.step()
    >>> log = open_output(d)
    >>> [(step, z.to_dict()) for step, z in log.read("o", 0)]
    [(0, {(1,): 1})]
    >>> _ = p.push("x", pa.table({"a": [2]})); _ = p.step(); log.refresh()
    >>> range(log.first, log.last)
    range(0, 2)
    >>> p.close(); log.close()
    """
    root = os.fspath(path)
    meta = read_meta(root)
    if "output_schemas" not in meta:
        raise DbspError(f"{root} was written before output schemas were recorded; open it with Pipeline.open")
    schemas = {n: pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(h))) for n, h in meta["output_schemas"].items()}
    return OutputLog(os.path.join(root, "output"), {n: schemas[n] for n in meta["outputs"]}, readonly=True)


def inspect_storage(path: str | os.PathLike) -> dict:
    """A summary of a storage directory without recovering it: scale, checkpoints, logs and sizes.

    Opens the worker databases and logs read-mostly (a torn log tail from a crash may be cut off, as on
    recovery) and never runs the circuit.

    >>> import tempfile, pyarrow as pa
    >>> c = Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> d = tempfile.mkdtemp(); p = Pipeline(c, storage=d); _ = p.push("x", pa.table({"a": [1]})); _ = p.step()
    >>> p.close()
    >>> info = inspect_storage(d)
    >>> info["workers"], info["checkpoint_step"], info["output_steps"]
    (1, 1, [0, 1])
    >>> info["divided_steps"]
    [0, 0]
    """
    root = os.fspath(path)
    meta = read_meta(root)
    fd = _lock_dir(root)
    try:
        return _inspect(root, meta)
    finally:
        os.close(fd)


def _inspect(root: str, meta: dict) -> dict:
    info: dict[str, Any] = {"path": root, "workers": meta["workers"], "shard_bits": meta["shard_bits"],
                            "fingerprint": meta["fingerprint"][:16], "inputs": meta["inputs"],
                            "outputs": meta["outputs"], "versions": [], "steps_of_versions": []}
    from dbsp_core.storage import Database

    for w in range(meta["workers"]):
        with Database(worker_db_path(root, w)) as db:
            vs = db.versions()
            info["versions"].append([vs.start, vs.stop - 1])
            info["db_pages"] = info.get("db_pages", 0) + db.stats()["pages"]
    lo, hi = max(v[0] for v in info["versions"]), min(v[1] for v in info["versions"])
    info["checkpoint_version"] = hi if lo <= hi else None
    info["checkpoint_step"] = None
    if lo <= hi:  # opening the newest common version discards only what recovery would discard too
        with Database(worker_db_path(root, 0)) as db, db.open(hi) as h:
            info["checkpoint_step"] = h.get_step()
    with StepLog(os.path.join(root, "input")) as log:
        info["input_steps"] = [log.first_step, log.last_step]
        info["input_records"] = len(log)
        info["input_segments"] = log.segments
        divisions = [r.step for r in log.iter_from(0) if r.handle == DIVISION_HANDLE]
    info["divided_steps"] = [divisions[0], divisions[-1]] if divisions else None
    names = sorted(n for n in os.listdir(os.path.join(root, "output")) if n.endswith(".seg"))
    out = OutputLog(os.path.join(root, "output"), {n: pa.schema([]) for n in meta["outputs"]}, readonly=True)
    info["output_steps"] = [out.first, out.last]
    out.close()
    info["output_segments"] = len(names)
    sizes = {}
    for part in ("input", "output"):
        p = os.path.join(root, part)
        sizes[part] = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
    sizes["state"] = sum(os.path.getsize(worker_db_path(root, w)) for w in range(meta["workers"]))
    info["bytes"] = sizes
    return info
