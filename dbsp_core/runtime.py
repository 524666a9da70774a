"""The embedded multi-worker runtime: a Pipeline runs W copies of a circuit in parallel threads, spreading input over them and exchanging data by ShardMap before keyed operators.

Invariants (enforced here):
  1. Every worker owns a private instance of every stateful operator; workers share nothing but the
     exchange mailboxes, which are written before and read after a barrier.
  2. A push is validated completely (handle, type, schema, weights) before anything is recorded; a bad push
     raises and changes nothing. Accepted rows are spread evenly over the workers in contiguous slices.
  3. A step runs every live node (one that feeds an output) in id order on every worker; each worker reaches
     each exchange exactly once, so the barrier at an exchange is met by all W workers or the step fails.
  4. A step's output for a handle is the consolidated sum of the workers' outputs. Because keyed operators
     see all rows of a key in one worker and linear operators commute with the sum, results do not depend
     on W nor on how input is split into steps.
  5. If a step fails (e.g. a weight overflows), the pipeline is marked broken: state may be half-updated,
     so every later push or step raises DbspError.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from dbsp_core.circuit import Circuit
from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.operators.base import concat, same_columns
from dbsp_core.shard import DEFAULT_SHARD_BITS, Layout, ShardMap
from dbsp_core.time.watermark import NO_WATERMARK, advance, specs_of  # watermark hook
from dbsp_core.trace import Trace
from dbsp_core.zset import ZSet

PushData = ZSet | pa.Table | pa.RecordBatch


class _Exchanger:
    """All-to-all mailboxes of one pipeline: one W x W grid per exchange node, one barrier."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.barrier = threading.Barrier(workers)
        self.mailboxes: dict[int, list[list[ZSet] | None]] = {}

    def grid(self, node_id: int) -> list[list[ZSet] | None]:
        box = self.mailboxes.get(node_id)
        if box is None:
            box = self.mailboxes.setdefault(node_id, [None] * self.workers)
        return box


class WorkerContext:
    """What an operator instance sees of its worker: the step's inputs and the exchange."""

    def __init__(self, worker: int, shard_map: ShardMap, exchanger: _Exchanger) -> None:
        self.worker = worker
        self.shard_map = shard_map
        self.exchanger = exchanger
        self.inputs: dict[str, ZSet] = {}
        self.watermarks: dict[str, int] = {}  # watermark hook: those in force in the step, input -> int (time/watermark.py)

    def exchange(self, node_id: int, z: ZSet, key: tuple[str, ...], schema: pa.Schema) -> ZSet:
        """Send each row of ``z`` to the worker owning its key's shard; return the rows sent here."""
        w = self.shard_map.workers
        if w == 1:
            return z
        box = self.exchanger.grid(node_id)
        if z.num_rows:
            box[self.worker] = z.partition(list(key), self.shard_map.part_of_shard, w)
        else:
            box[self.worker] = None
        self.exchanger.barrier.wait()
        mine = [row[self.worker] for row in box if row is not None]
        return concat(mine, schema)


class _Worker:
    """One copy of the circuit: an operator instance per live node."""

    def __init__(self, circuit: Circuit, live: list[int], ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.live = live
        self.nodes = circuit.nodes
        self.instances = {i: circuit.nodes[i].instance() for i in live}
        self.outputs = dict(circuit.outputs)

    def step(self, inputs: dict[str, ZSet]) -> dict[str, ZSet]:
        self.ctx.inputs = inputs
        values: dict[int, ZSet] = {}
        for i in self.live:
            op = self.nodes[i]
            values[i] = self.instances[i].step([values[j] for j in op.inputs], self.ctx)
        return {name: values[i] for name, i in self.outputs.items()}


def _live_nodes(circuit: Circuit) -> list[int]:
    live = set(circuit.outputs.values())
    for i in range(len(circuit.nodes) - 1, -1, -1):
        if i in live:
            live.update(circuit.nodes[i].inputs)
    return sorted(live)


class Pipeline:
    """Runs a circuit embedded in this process on ``workers`` threads.

    Parameters
    ----------
    circuit : Circuit
        The circuit; nodes added after the pipeline is created are not run.
    workers : int
        Number of circuit copies W (threads). Results do not depend on it.
    shard_bits : int
        log2 of the number of shards S (default 8); S must be >= W.
    storage : str or os.PathLike or None
        A directory makes the pipeline durable (input log, checkpoints, output log; keyword arguments
        ``checkpoint_interval``, ``replay_check``, ``output_retention``, ``output_sync``): the call returns a
        ``dbsp_core.durable.DurablePipeline``. None (default) runs in memory.

    Examples
    --------
    >>> import pyarrow as pa
    >>> import dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
    >>> c.output("totals", bids.group_by("auction").agg(total=dbsp.sum("price")))
    >>> p = dbsp.Pipeline(c, workers=2)
    >>> p.push("bids", pa.table({"auction": [1, 1, 2], "price": [10, 5, 7]}))
    >>> sorted(p.step()["totals"].to_dict().items())
    [((1, 15), 1), ((2, 7), 1)]
    >>> p.push("bids", dbsp.ZSet.from_rows([(1, 5)], bids.schema, weights=[-1]))
    >>> sorted(p.step()["totals"].to_dict().items())
    [((1, 10), 1), ((1, 15), -1)]
    >>> p.close()
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Pipeline":
        # Pipeline(..., storage=dir) builds the durable pipeline (dbsp_core.durable) instead
        storage = args[3] if len(args) > 3 else kwargs.get("storage")
        if cls is Pipeline and storage is not None:
            from dbsp_core.durable import DurablePipeline

            return super().__new__(DurablePipeline)
        return super().__new__(cls)

    @staticmethod
    def open(path: Any, circuit: Circuit, **kwargs: Any) -> "Pipeline":
        """Recover the durable pipeline stored in directory ``path`` after a stop or a crash (see dbsp_core.durable)."""
        from dbsp_core.durable import open_pipeline

        return open_pipeline(path, circuit, **kwargs)

    def __init__(self, circuit: Circuit, workers: int = 1, shard_bits: int = DEFAULT_SHARD_BITS,
                 storage: Any = None) -> None:
        if not isinstance(circuit, Circuit):
            raise TypeError(f"Pipeline needs a Circuit, got {type(circuit).__name__}")
        if storage is not None:  # only reached by subclasses other than DurablePipeline
            raise TypeError(f"{type(self).__name__} keeps no storage; use dbsp.Pipeline(circuit, storage=dir) "
                            f"for a durable pipeline")
        self.circuit = circuit
        self.layout = Layout(ShardMap(workers, shard_bits))
        self.shard_map = self.layout.shard_map
        self.workers = workers
        self._inputs = {name: circuit.nodes[i].schema for name, i in circuit.inputs.items()}
        self._out_schemas = {name: circuit.nodes[i].schema for name, i in circuit.outputs.items()}
        live = _live_nodes(circuit)
        self._exchanger = _Exchanger(workers)
        self._workers = [_Worker(circuit, live, WorkerContext(w, self.shard_map, self._exchanger))
                         for w in range(workers)]
        self._pending: list[dict[str, list[ZSet]]] = [{} for _ in range(workers)]
        self._next = 0  # worker receiving the next pushed row (keeps small pushes spread)
        self._pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="dbsp-worker") \
            if workers > 1 else None
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self.steps = 0
        # watermark hook: the event-time inputs, their watermarks after the last step (in force in the next one), the
        # late rows dropped so far (time/watermark.py), and the watermarks a durable runtime logged with the
        # division of the step about to run (those after it)
        self._event_time = specs_of(circuit)
        self.watermarks: dict[str, int] = {name: NO_WATERMARK for name in self._event_time}
        self.late_rows: dict[str, int] = {name: 0 for name in self._event_time}
        self._logged_watermarks: dict[str, int] | None = None
        # CPU time each worker's thread spent in steps, counted only while ``measure_cpu`` is set: reading a
        # thread's CPU clock is a system call (4-40 us on this VM), a measurable share of a 1k-row step
        self.measure_cpu = False
        self.worker_cpu_seconds = [0.0] * workers

    # ---- input ----

    def _to_zset(self, handle: str, data: Any, weights: Any) -> ZSet:
        schema = self._inputs[handle]
        if isinstance(data, ZSet):
            if weights is not None:
                raise TypeError(f"push({handle!r}): weights= is only for Arrow data; a ZSet carries its own")
            z = data
        elif isinstance(data, (pa.Table, pa.RecordBatch)):
            table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
            if weights is None and "weight" in table.schema.names and "weight" not in schema.names:
                col = table.column("weight")  # the to_arrow() form: data columns + "weight"
                if not pa.types.is_integer(col.type):
                    raise TypeError(f"push({handle!r}): the 'weight' column must be an integer type, got {col.type}")
                weights = col
                table = table.drop_columns(["weight"])
            if not same_columns(table.schema, schema):
                raise SchemaError(f"push({handle!r}): data columns {_fmt(table.schema)} do not match the input "
                                  f"schema {_fmt(schema)}")
            if weights is not None and isinstance(weights, np.ndarray) and weights.dtype.kind not in "iu":
                raise TypeError(f"push({handle!r}): weights must be integers, got dtype {weights.dtype}")
            z = ZSet.from_arrow(table, weights=weights)
        else:
            raise TypeError(f"push({handle!r}): expected a ZSet, pyarrow Table or RecordBatch, "
                            f"got {type(data).__name__}")
        if not same_columns(z.schema, schema):
            raise SchemaError(f"push({handle!r}): Z-set columns {_fmt(z.schema)} do not match the input schema "
                              f"{_fmt(schema)}")
        if not z.schema.equals(schema):
            z = ZSet._make(z.data.cast(schema), z.weights)
        return z

    def push(self, handle: str, data: PushData, weights: Any = None) -> None:
        """Queue ``data`` (a change: ZSet, or Arrow rows with optional int ``weights``) for the next step.

        A pa.Table with an extra integer ``weight`` column (the form :meth:`ZSet.to_arrow` returns) is taken as
        rows with weights. Raises (KeyError, TypeError, SchemaError) and records nothing if the handle is unknown,
        the data is not a Z-set or Arrow batch, its columns differ from the input schema, or weights are not ints.
        """
        self._check_usable()
        if handle not in self._inputs:
            raise KeyError(f"push: unknown input handle {handle!r}; inputs are {sorted(self._inputs)}")
        z = self._to_zset(handle, data, weights)
        n = z.num_rows
        if n == 0:
            return
        with self._lock:
            wk = self.workers
            if wk == 1:  # one worker takes the whole push, no slicing
                self._pending[0].setdefault(handle, []).append(z)
                return
            base, extra = divmod(n, wk)
            start = 0
            for k in range(wk):  # contiguous, even slices, starting at the round-robin cursor
                size = base + (1 if k < extra else 0)
                if size == 0:
                    continue
                w = (self._next + k) % wk
                part = ZSet._make(z.data.slice(start, size), z.weights[start:start + size])
                self._pending[w].setdefault(handle, []).append(part)
                start += size
            self._next = (self._next + n) % wk

    # ---- steps ----

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise DbspError(f"the pipeline is broken by a failed step ({self._broken!r}); create a new one")
        if self._workers is None:
            raise DbspError("the pipeline is closed")

    def _run_worker(self, w: int, inputs: dict[str, ZSet]) -> dict[str, ZSet]:
        t0 = time.thread_time() if self.measure_cpu else 0.0
        try:
            return self._workers[w].step(inputs)
        except BaseException:
            self._exchanger.barrier.abort()  # release the others waiting at an exchange (invariant 3)
            raise
        finally:
            if self.measure_cpu:
                self.worker_cpu_seconds[w] += time.thread_time() - t0

    def step(self) -> dict[str, ZSet]:
        """Run one step over everything pushed since the last one; returns ``{output: change of the view}``."""
        self._check_usable()
        with self._lock:
            pending, self._pending = self._pending, [{} for _ in range(self.workers)]
        inputs = [{h: concat(parts, self._inputs[h]) for h, parts in p.items()} for p in pending]
        watermarks, late = self._step_watermarks(inputs)  # watermark hook: operators see those in force
        for wk in self._workers:
            wk.ctx.watermarks = self.watermarks
        try:
            if self._pool is None:
                results = [self._run_worker(0, inputs[0])]
            else:
                futures = [self._pool.submit(self._run_worker, w, inputs[w]) for w in range(1, self.workers)]
                errors: list[BaseException] = []
                results = []
                try:
                    results.append(self._run_worker(0, inputs[0]))
                except BaseException as exc:  # wait for the others before reporting
                    errors.append(exc)
                for f in futures:
                    try:
                        results.append(f.result())
                    except BaseException as exc:
                        errors.append(exc)
                if errors:  # report the root cause, not a worker released from the barrier by it
                    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
                    raise (real or errors)[0]
        except BaseException as exc:
            self._broken = exc  # invariant 5
            raise
        self.steps += 1
        self.watermarks = watermarks  # watermark hook
        for name, n in late.items():
            self.late_rows[name] += n
        out = {}
        for name, schema in self._out_schemas.items():
            out[name] = concat([r[name] for r in results], schema).consolidate()
        return out

    def _step_watermarks(self, inputs: list[dict[str, ZSet]]) -> tuple[dict[str, int], dict[str, int]]:
        """The watermarks after the step and its late rows per event-time input, from the step's pushes (watermark
        hook)."""
        if not self._event_time:
            return {}, {}
        pushes = [(h, z) for per_worker in inputs for h, z in per_worker.items()]
        watermarks, late = advance(self._event_time, self.watermarks, pushes)
        logged, self._logged_watermarks = self._logged_watermarks, None
        if logged is not None and logged != watermarks:
            raise DbspError(f"the step's watermarks {watermarks} differ from those logged with its division {logged}")
        return watermarks, late

    def traces(self, worker: int) -> dict[str, "Trace"]:
        """All keyed state of one worker, as ``{"<operator label>.<trace name>": Trace}``.

        Every trace is sorted by key hash, so ``trace.shard(shard_bits, s)`` reads one shard's state; the shards
        with rows are those :attr:`shard_map` assigns to ``worker``.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("d", t.distinct())
        >>> sorted(dbsp.Pipeline(c).traces(0))
        ['distinct#2.input']
        """
        self._check_usable()
        out: dict[str, Trace] = {}
        for i, inst in self._workers[worker].instances.items():
            get = getattr(inst, "traces", None)
            if get is not None:
                for name, trace in get().items():
                    out[f"{self.circuit.nodes[i].label}.{name}"] = trace
        return out

    def close(self) -> None:
        """Stop the worker threads; the pipeline cannot be used afterwards."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._workers = None  # type: ignore[assignment]

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pipeline(workers={self.workers}, steps={self.steps}, {self.circuit!r})"


def _fmt(s: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in s) + ")"
