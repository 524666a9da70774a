"""The executor protocol: what the driver (dbsp_core.runtime.driver.Pipeline) asks of whatever runs a circuit's steps, and the step record both sides share.

The driver owns everything common to every way of running a circuit (push and dedup, the division of input
into steps with its determinants, the output log, checkpoint cadence, open and recovery, format checks,
layout changes). An executor owns the operator state and runs steps over it:

- ``EmbeddedExecutor`` (embedded.py): W threads in this process, exchange by the shard map, state in memory,
  checkpointed into one Database per worker by the checkpoint coordinator (coordinator.py).
- ``StagedExecutor`` (staged.py): the circuit cut into stages at its exchanges, one task per (stage, worker)
  run by a job runner over blobs, state in a Database per (stage, worker) committed by every job; spark_glue
  supplies a runner that runs the tasks on Spark.

Invariants (every executor keeps them):
  1. ``run(steps)`` runs consecutive steps starting at the executor's current step and returns each step's
     ``{output: change}``, consolidated (distinct, zset.py invariant 2: no two equal rows, no zero weight, in
     any order); results do not depend on the number of workers, on the layout, nor on
     how the steps are grouped into calls.
  2. Durable state moves only through versions of its databases, all of them at the same version and step
     after every checkpoint (embedded) or job (staged); ``open_state`` puts every database back on the newest
     version they all hold (discarding a partial one) and returns it, without loading anything.
  3. The state of one layout's workers is one *group* of databases per stateful part of the executor (one group
     for the embedded executor, one per stateful stage for the staged one), each group one database per
     worker, every value grouped by shard (dbsp_core.storage.snapshot), so a layout change moves shards
     between the databases of a group and touches nothing else.
  4. A step that fails on its data (an operator raising anything but an I/O, memory or exchange failure:
     :func:`as_step_error`) makes ``run`` raise StepError with ``done`` holding the outputs of the steps of
     the call that completed before it; the state is then as after those steps (in memory and on disk), so
     the failed step can run again, e.g. after the driver discarded one of its pushes.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, NamedTuple, Protocol

from dbsp_core.circuit import Circuit
from dbsp_core.errors import RecoveryError, StepError, WorkerStateLostError
from dbsp_core.layout import Layout
from dbsp_core.profile import NodeTimer
from dbsp_core.storage.snapshot import TableSpec
from dbsp_core.trace import Trace
from dbsp_core.trace.spill import BatchStore
from dbsp_core.zset import ZSet


class StepInput(NamedTuple):
    """One divided step as the driver hands it to an executor: its pushes and its logged determinants."""

    step: int
    pushes: list[tuple[str, ZSet]]  # (input handle, change), in the order they were acknowledged
    now_ns: int | None
    prev_now_ns: int | None
    seed: int | None
    watermarks: dict[str, int]


class StateGroup(NamedTuple):
    """One group of state databases (invariant 3): a path per worker and what their state tables hold."""

    name: str
    path_of: Callable[[int], str]  # worker -> database path
    tables: dict[str, TableSpec]


class Executor(Protocol):
    """Runs the steps of one circuit over one layout; see the module docstring.

    A live rescale (dbsp_core.runtime.rescale, invariant 4) moves state the way the executor keeps it: one whose
    state is in memory (``state_in_memory``) moves each wave with :meth:`relayout`, between
    :meth:`prepare_relayout` and, if the change is undone, :meth:`abandon_relayout`; one whose state is on disk
    has each wave moved between its databases as a cold change and goes on with :meth:`resume`. Each executor
    refuses the member of the other way with DbspError.
    """

    kind: str  # "embedded" or "staged": recorded in META, a directory is reopened with the same kind
    division_first: bool  # the division of a step must be durable before it runs (state commits while it runs)
    state_in_memory: bool  # state lives in memory between checkpoints, not committed by every step (see above)
    range_values: bool  # its checkpoints may write range values (DRBR): its directories are of format 4 (formats.py)
    layout: Layout | None  # the layout of the workers built by the last start()
    stats: dict  # counters, shared with the driver's (the driver adds its own to the same dict)
    # the end of the driver's output log (the driver sets it when it opens the log): an executor whose state
    # commits while steps run does not resume past a step whose output is not logged (staged.py invariant 2)
    output_steps: Callable[[], int]
    # busy seconds per worker of the last run() (time in operators, not waiting at an exchange), or None when the
    # executor does not measure it (a staged executor's tasks run elsewhere): the autoscaling policy's work measure
    busy: list[float] | None
    batch_store: BatchStore | None  # the memory budget of the traces given by :meth:`spill` (None: none)

    @property
    def version(self) -> int:
        """The version every state database is at (-1 when the executor holds none open)."""

    def start(self, circuit: Circuit, layout: Layout, storage: str | None) -> None:
        """Build the workers of ``layout`` (no state is loaded); ``storage`` None runs in memory."""

    def groups(self, layout: Layout) -> list[StateGroup]:
        """The state groups of ``layout`` under the storage directory (invariant 3)."""

    def open_state(self) -> tuple[int, int | None]:
        """Normalize every state database to the newest version all hold; returns ``(version, step)``, the step
        None when the executor keeps no state (the driver's record says where to resume)."""

    def load_state(self, step: int) -> None:
        """Resume at ``step`` with the state of the version :meth:`open_state` chose (an executor that loads
        lazily only takes note of the step)."""

    def run(self, steps: list[StepInput]) -> list[dict[str, ZSet]]:
        """Run consecutive steps (invariant 1)."""

    def rename_state(self, renames: dict[int, int]) -> None:
        """A program change (dbsp_core.runtime.change): the next :meth:`load_state` reads node ``n``'s state from
        what node ``renames[n]`` of the circuit that wrote it stored, leaves the other nodes empty, and the next
        checkpoint stores the state under the current circuit's numbering only. An executor that cannot raises
        DbspError naming what to do instead."""

    def bootstrap(self, nodes: set[int], step: StepInput) -> dict[str, ZSet]:
        """A program change: build the state of ``nodes`` by running a fresh copy of the circuit, on the same
        layout, over ``step`` (the contents of the tables they read, as one step), put it in place of theirs,
        and return that step's ``{output: change}``; the other nodes' state is untouched."""

    def checkpoint(self, step: int) -> Callable[[], None]:
        """Capture the state at ``step`` (steps are paused); the returned function makes it durable (it may
        run on another thread while later steps run)."""

    def prepare_relayout(self, final: Layout) -> None:
        """Before the first wave of a live change to ``final``: build what the change adds, outside any pause."""

    def abandon_relayout(self) -> None:
        """A live change was undone: release what :meth:`prepare_relayout` built and no wave attached."""

    def relayout(self, layout: Layout) -> int:
        """State in memory: switch to ``layout`` between steps, moving the state of the shards whose owner
        changes; returns the bytes moved."""

    def pay_deferred(self, rows: int) -> bool:
        """Between steps, after the waves of a live change: do up to ``rows`` rows (of one trace, per level for merges)
        of the merge and index work the waves deferred (trace invariant 14); returns whether work is still owed
        (never, for state on disk)."""

    def resume(self, version: int, step: int) -> None:
        """State on disk: every state database now holds ``version`` at ``step`` (a layout change committed it,
        after :meth:`start` on the new layout): go on from there."""

    def rollback_lost(self) -> int:
        """After :meth:`run` or :meth:`checkpoint` raised WorkerStateLostError (only an executor whose workers keep
        state between checkpoints where they ran, e.g. the staged executor with ``worker_recovery="pipeline"``):
        put every worker back at the last state made durable, forgetting the rest; returns its step, from which the
        driver replays the input log (driver invariant 10). Others raise DbspError."""

    def traces(self, worker: int) -> dict[str, Trace]:
        """All keyed state of one worker as ``{"<operator label>.<trace name>": Trace}``."""

    def view(self, node: int) -> ZSet:
        """The current contents of readable node ``node`` (``Circuit.readable``: a materialize or upsert node, whose
        ``trace`` keeps them) summed over the workers, after the steps run so far (steps are not running)."""

    def state_bytes(self) -> int:
        """Bytes of every worker's state where the executor keeps it (in memory, or on disk)."""

    def node_timers(self) -> list[NodeTimer]:
        """The operator timings of the workers (dbsp_core.profile), as far as this process holds them."""

    def disk_bytes(self) -> int:
        """Bytes of state on disk."""

    def task_budget(self, memory_limit: int, spill_dir: str | None) -> bool:
        """Give the processes that run this executor's tasks a memory budget of ``memory_limit`` bytes per host,
        with batch files under ``spill_dir`` there (None: their local directory); False when the traces live in
        this process instead, and the driver gives the executor a store with :meth:`spill`."""

    def spill(self, store: BatchStore | None) -> None:
        """Keep the traces' batches under ``store``'s memory budget (trace invariant 12, dbsp_core/trace/spill.py):
        an executor that cannot raises DbspError naming what to do instead."""

    def referenced_files(self) -> set[str]:
        """The batch files (names in <storage>/spill) the last checkpoint's state names, after it committed."""

    def close(self) -> None:
        """Release threads and files (and the batch store it was given)."""


SPREAD_MIN_ROWS = 1024  # the fewest rows spread() hands a worker from one push (but for a push of fewer rows)


def spread(pushes: list[tuple[str, ZSet]], workers: int, cursor: int, keep: Any = None,
           min_rows: int = SPREAD_MIN_ROWS) -> list[dict[str, list[ZSet]]]:
    """Each push split in contiguous, even slices of at least ``min_rows`` rows over up to all the workers, starting
    at worker ``cursor``: ``[{handle: [parts]} per worker]``. A push of fewer than ``2 * min_rows`` rows goes whole
    to the cursor's worker, and the cursor moves on once that worker was handed ``min_rows`` rows so (so a step of
    small pushes keeps the other workers' stateless operators idle: a call costs ~0.1 ms whatever its rows, an
    empty input is skipped; and many small pushes still spread). A push cut in ``k < W`` slices moves the cursor
    on by ``k``; one cut over all ``W`` workers moves it by its rows (past the workers its uneven rows gave one
    more). Pushes to a handle not in ``keep`` (if given) are dropped. Results never depend on the split: it only
    balances the work.

    >>> import pyarrow as pa
    >>> z = ZSet.from_arrow(pa.table({"x": [1, 2, 3]}))
    >>> [{h: [p.num_rows for p in ps] for h, ps in w.items()} for w in spread([("t", z)], 2, 1, min_rows=1)]
    [{'t': [1]}, {'t': [2]}]
    >>> [{h: [p.num_rows for p in ps] for h, ps in w.items()} for w in spread([("t", z), ("u", z)], 2, 1)]
    [{}, {'t': [3], 'u': [3]}]
    """
    if workers == 1:  # every push whole to the one worker (what the general path below gives), without its sums
        one: dict[str, list[ZSet]] = {}
        for handle, z in pushes:
            if z.num_rows and (keep is None or handle in keep):
                one.setdefault(handle, []).append(z)
        return [one]
    out: list[dict[str, list[ZSet]]] = [{} for _ in range(workers)]
    min_rows = max(1, min_rows)
    fill = 0  # rows the cursor's worker was handed by whole small pushes
    for handle, z in pushes:
        if keep is not None and handle not in keep:
            continue
        n = z.num_rows
        if n == 0:
            continue
        k = min(workers, n // min_rows)
        if k <= 1:
            out[cursor % workers].setdefault(handle, []).append(z)
            fill += n
            if fill >= min_rows:
                cursor, fill = (cursor + 1) % workers, 0
            continue
        base, extra = divmod(n, k)
        start = 0
        for j in range(k):
            size = base + (1 if j < extra else 0)
            w = (cursor + j) % workers
            out[w].setdefault(handle, []).append(ZSet._make(z.data.slice(start, size), z.weights[start:start + size]))
            start += size
        cursor, fill = (cursor + (n if k == workers else k)) % workers, 0  # all: past the workers given one more
    return out


def live_nodes(circuit: Circuit) -> list[int]:
    """The nodes that feed an output, in id order (the nodes a pipeline runs)."""
    return circuit.live_nodes()


def groupings(circuit: Circuit) -> dict[int, tuple[str, ...] | None]:
    """Every node's partitioning: how its Z-set state is grouped by shard (dbsp_core.storage.snapshot inv. 5)."""
    return {i: op.partitioning for i, op in enumerate(circuit.nodes)}


def traces_by_label(circuit: Circuit, instances: dict[int, Any]) -> dict[str, Trace]:
    """The traces of operator instances (``{node: instance}``, of one worker) as ``Executor.traces`` returns
    them: by ``"<node label>.<trace name>"``; an instance without ``traces()`` holds none."""
    out: dict[str, Trace] = {}
    for i, inst in instances.items():
        get = getattr(inst, "traces", None)
        if get is not None:
            for name, trace in get().items():
                out[f"{circuit.nodes[i].label}.{name}"] = trace
    return out


_NOT_DATA = (OSError, MemoryError, threading.BrokenBarrierError, RecoveryError)


def as_step_error(exc: Exception, node: str, step: int | None) -> Exception:
    """``exc``, raised by operator ``node`` in ``step``, as a StepError when it is a failure on the step's data
    (invariant 4): anything but an I/O error, running out of memory, a broken exchange or a recovery error.

    >>> e = as_step_error(ZeroDivisionError("division by zero"), "filter#1", 4)
    >>> type(e).__name__, e.node, e.step, str(e)
    ('StepError', 'filter#1', 4, 'filter#1 failed on the data of step 4: ZeroDivisionError: division by zero')
    >>> type(as_step_error(OSError("disk"), "filter#1", 4)).__name__
    'OSError'
    """
    if isinstance(exc, StepError) or isinstance(exc, _NOT_DATA):
        return exc
    where = f"the data of step {step}" if step is not None else "its data"
    err = StepError(f"{node} failed on {where}: {type(exc).__name__}: {exc}", step, (), node)
    err.__cause__ = exc
    return err


_REMOTE = re.compile(r"StepError: (\S+) failed on (?:the data of step (\d+)|its data): ([^\n]*)")


_LOST = re.compile(r"WorkerStateLostError: ([^\n]*)")


def state_lost_of(exc: BaseException) -> WorkerStateLostError | None:
    """The WorkerStateLostError behind ``exc``: itself, or one raised in a task in another process whose traceback a
    job runner (Spark) reports as text; None otherwise.

    >>> state_lost_of(RuntimeError("...dbsp_core.errors.WorkerStateLostError: stage 1 worker 0: gone"))
    WorkerStateLostError('stage 1 worker 0: gone')
    """
    if isinstance(exc, WorkerStateLostError):
        return exc
    m = _LOST.search(str(exc))
    return None if m is None else WorkerStateLostError(m.group(1))


def step_error_of(exc: BaseException) -> StepError | None:
    """The StepError behind ``exc``: itself, or one raised in a task in another process whose traceback a job
    runner (Spark) reports as text; None if ``exc`` is not a failure on a step's data.

    >>> step_error_of(RuntimeError("...dbsp_core.errors.StepError: join#3 failed on the data of step 7: boom"))
    StepError('join#3 failed on the data of step 7: RuntimeError: boom')
    """
    if isinstance(exc, StepError):
        return exc
    m = _REMOTE.search(str(exc))
    if m is None:
        return None
    node, step = m.group(1), None if m.group(2) is None else int(m.group(2))
    return as_step_error(RuntimeError(m.group(3)), node, step)  # type: ignore[return-value]
