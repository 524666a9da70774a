"""The embedded executor: W copies of a circuit on W threads of this process, exchanging rows by the layout's shard map before keyed operators, with state in memory and (for a durable pipeline) checkpointed into one Database per worker by the checkpoint coordinator (coordinator.py).

Invariants (enforced here):
  1. Every worker owns a private instance of every stateful operator; workers share nothing but the
     exchange mailboxes, which are written before and read after a barrier.
  2. A step runs every live node (one that feeds an output) in id order on every worker; each worker reaches
     each exchange exactly once, so the barrier at an exchange is met by all W workers or the step fails
     (a failing worker aborts the barrier, releasing the others).
  3. A step's output for a handle is the consolidated sum of the workers' outputs, distinct (zset.py invariant 2)
     but not sorted. When rows of two workers cannot be equal (the output is sharded by columns it keeps), each
     worker makes its own output distinct on its thread and the concatenation is handed over as it is. Else
     each worker hashes its rows on its thread and makes them distinct there only when that drops at least an
     eighth of them (ZSet._hashed_part: a gather that pays for itself); the concatenation is made distinct once
     across the workers from those row hashes (one probe per row: ZSet._distinct_unsorted), never sorted, so a
     push of a bag with a few equal rows handed through is copied once (the sum's gather), not once per worker
     and again to concatenate the workers' copies. A worker whose output is the step's whole (one worker, one
     piece) makes it distinct on its thread without row hashes (its probe hashes rows more cheaply, csrc/zset.c
     design note 5): no sum reads them.
     Because keyed operators see all rows of a key in one worker and linear operators commute with the sum,
     results do not depend on W, on the layout, nor on how input is split into steps.
  4. With storage, worker ``w``'s state lives in ``state/worker-<w>.db`` (dbsp_core.storage.formats), grouped by
     shard (dbsp_core.storage.snapshot), in the version the coordinator last committed; the workers' step
     counters advance with every step and must all equal the checkpoint's step.
  5. Under a memory budget (a batch store), a step whose pushes hold more than a piece's bytes runs as several
     sub-steps over pieces of them when every live node is split-safe (dbsp_core/runtime/substep.py: when, what,
     why the step's output is the same, what is not split): :meth:`EmbeddedExecutor._run_one` decides the pieces
     once per step on the calling thread (every worker runs each of them: exchanges are barriers), runs each on all
     workers with the step's context, enforces the budget between pieces and returns the sum of their outputs made
     distinct (invariant 3, without the disjoint shortcut: two pieces may hold equal rows). The step counts once:
     one ``advance`` of the worker stores, one rollback capture, one release of memory after it. A step of at least
     ``Trace.FAN_IN`` pieces holds the store's tiered merges while they run and, after the last, merges each trace's
     batches the pieces placed in one pass (trace invariant 15: each piece's rows written once alone, once merged).
  6. A step on one worker without a memory budget (no pool, no batch store) runs by :meth:`EmbeddedExecutor._run_alone`:
     the calls of invariants 3 and 5 for one worker and one piece, without their lists of parts and sums of one
     part; its outputs, state, counters and timings are those of the general path (tests/core/test_run_alone.py
     runs both over the same steps).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from dbsp_core import _zset
from dbsp_core.circuit import Circuit
from dbsp_core.envvars import settings
from dbsp_core.errors import CorruptionError, DbspError, StepError
from dbsp_core.layout import Layout
from dbsp_core.operators.base import concat
from dbsp_core.operators.context import StepContext
from dbsp_core.progress import progress
from dbsp_core.profile import NodeTimer, failed_node, run_nodes, zset_bytes
from dbsp_core.runtime.coordinator import Coordinator, WorkerStore, choose_version
from dbsp_core.runtime.crashpoints import crashpoint
from dbsp_core.runtime.executor import (StateGroup, StepInput, as_step_error, groupings, live_nodes, spread,
                                       traces_by_label)
from dbsp_core.runtime.migrate import hand_over, move_shards
from dbsp_core.runtime.plan import StepPlan
from dbsp_core.runtime.rollback import capture, restore
from dbsp_core.runtime.substep import piece_bytes, pieces, split_off
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import tree_bytes
from dbsp_core.storage.formats import SPILL_DIR, state_db_path
from dbsp_core.storage.snapshot import state_attrs, state_tables
from dbsp_core.trace import MergeThread, Trace, merging
from dbsp_core.trace.groupedbatch import is_grouped, spilled_bytes
from dbsp_core.trace.spill import BatchStore, spilling
from dbsp_core.trace.threadvalue import ThreadValuePair
from dbsp_core.zset import ZSet


log = logging.getLogger("dbsp_core.substep")


def compaction_slice(rows: int) -> int:
    """The compaction input rows a step that pushed ``rows`` rows pays without a merge thread (trace invariant 17)."""
    return max(Trace.COMPACT_SLICE, Trace.COMPACT_FUEL * rows)


BIG_STEP_ROWS = 1 << 18  # pushed rows from which a step also returns the allocators' free memory (release_memory)


def release_memory(step_rows: int) -> None:
    """Return the memory a step used but the state does not hold (csrc/scratch.c design note 6), on the thread that
    ran worker 0, once the step's rollback copy is gone: the C scratch cache of this thread and the region cache down to ``DBSP_CACHE_KEEP_MB`` each; after a
    step of at least BIG_STEP_ROWS pushed rows also glibc's free memory (``malloc_trim``) and the Arrow pool's free
    pages (``release_unused``), whose cost (a walk of the heap, a few ms) such a step amortizes."""
    big = step_rows >= BIG_STEP_ROWS
    _zset.trim_caches(settings().cache_keep_mb << 20, all_threads_memory=big)
    if big:
        pa.default_memory_pool().release_unused()


_CORES = os.cpu_count() or 1  # read once: the call reads /sys, ~12 us, a measurable share of a small step


def _start_pool(workers: int) -> ThreadPoolExecutor | None:
    """The threads of workers 1..W-1 (worker 0 runs on the caller's), started now, when the pipeline is built,
    not by its first step: one task per thread, each held until all have started (an idle thread would take the
    next one instead of a new thread starting)."""
    if workers <= 1:
        return None
    pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="dbsp-worker")
    started = threading.Barrier(workers - 1)
    for _ in range(workers - 1):
        pool.submit(started.wait, 10.0)
    return pool


class _Exchanger:
    """All-to-all mailboxes of one step: one W x W grid per exchange node, and one barrier."""

    def __init__(self, layout: Layout, timers: list[NodeTimer] | None = None) -> None:
        self.shard_map = layout.shard_map
        self.workers = layout.workers
        self.timers = timers  # each worker's: the bytes it sends to the others (dbsp_core.profile)
        self.barrier = threading.Barrier(self.workers)
        self.mailboxes: dict[int, list[list[ZSet] | None]] = {}
        self._lock = threading.Lock()
        self.waited = [0.0] * self.workers  # seconds each worker waited at the barrier this step (not busy)

    def _wait(self, worker: int) -> None:
        t0 = time.perf_counter()  # ~50 ns a call: two per exchange per worker, no per-row cost
        self.barrier.wait()
        self.waited[worker] += time.perf_counter() - t0

    def _grid(self, node_id: int) -> list[list[ZSet] | None]:
        box = self.mailboxes.get(node_id)
        if box is None:
            with self._lock:
                box = self.mailboxes.setdefault(node_id, [None] * self.workers)
        return box

    def __call__(self, worker: int, node_id: int, z: ZSet, key: tuple, schema: pa.Schema) -> ZSet:
        w = self.workers
        if w == 1:
            return z
        box = self._grid(node_id)
        # each sender posts its rows and their order by owner (zset.py partition's, without its gather); each
        # receiver gathers its rows from every sender at once, so a row is copied once (ZSet._gather_parts)
        sent_rows = None
        if z.num_rows:
            perm, offsets = _zset.partition(z.hash(list(key)), self.shard_map.part_of_shard, w)
            box[worker] = sent_rows = (z, perm, offsets.tolist())
        else:
            box[worker] = None
        if sent_rows is not None and self.timers is not None:
            sent = self.timers[worker].exchange_bytes
            node = node_id[0] if isinstance(node_id, tuple) else node_id  # a fixpoint's (node, iteration, inner)
            off = sent_rows[2]  # the bytes sent: the input's, in proportion to the rows sent
            out = z.num_rows - (off[worker + 1] - off[worker])
            sent[node] = sent.get(node, 0) + zset_bytes(z) * out // z.num_rows
        self._wait(worker)
        mine = []
        for row in box:
            if row is not None:
                src, perm, off = row
                if off[worker + 1] > off[worker]:
                    mine.append((src, perm[off[worker]:off[worker + 1]]))
        return ZSet._gather_parts(mine, schema)

    def exchange_runs(self, worker: int, node_id: int, runs: list[tuple[int, int, int]], cut: Callable[[int, int], Any]
                      ) -> list:
        """The exchange of rows a fused chain has already ordered by owner (dbsp_core/runtime/plan.py note 4): each
        run ``(worker, start, stop)`` of rows goes to that worker's mailbox as ``cut(start, stop)``, a part made
        without copying rows. Returns the parts sent to this worker by every worker, itself included, as they were
        cut (no concatenation)."""
        box = self._grid(node_id)
        out: list[list] = [[] for _ in range(self.workers)]
        for dest, s, e in runs:
            if e > s:
                out[dest].append(cut(s, e))
        box[worker] = out  # type: ignore[assignment]
        if self.timers is not None and runs:
            sent = self.timers[worker].exchange_bytes
            node = node_id[0] if isinstance(node_id, tuple) else node_id
            sent[node] = sent.get(node, 0) + sum(zset_bytes(getattr(p, "zset", p)) for k, ps in enumerate(out)
                                                 if k != worker for p in ps)
        self._wait(worker)
        return [p for row in box if row is not None for p in row[worker]]

    def anyone(self, worker: int, node_id: object, flag: bool) -> bool:
        """Whether any worker passes ``flag`` True under mailbox ``node_id`` (one barrier, like an exchange): how
        the workers of a fixpoint agree on its last iteration, also with workers that own no shard."""
        if self.workers == 1:
            return flag
        box = self._grid(node_id)  # type: ignore[arg-type]
        box[worker] = [flag]  # type: ignore[list-item]
        self._wait(worker)
        return any(row is not None and row[0] for row in box)


class _Worker:
    """One copy of the circuit: an operator instance per live node, and its step context."""

    def __init__(self, circuit: Circuit, live: list[int], ctx: StepContext, workers: int = 1,
                 step_plan: bool = True) -> None:
        self.ctx = ctx
        self.live = live
        self.nodes = circuit.nodes
        self.instances = {i: circuit.nodes[i].instance() for i in live}
        self.outputs = dict(circuit.outputs)
        # the instances with state, fixed for the worker's life (a restore changes their attributes, not them)
        self._stateful = {i: inst for i, inst in self.instances.items() if inst is not self.nodes[i]}
        self._circuit = circuit
        self.lower(workers, step_plan)
        self.timer = NodeTimer(live)  # dbsp_core.profile: what each operator costs this worker

    def lower(self, workers: int, step_plan: bool) -> None:
        """The calls of a step, lowered for a layout of ``workers`` workers (dbsp_core/runtime/plan.py invariant 2:
        again at every layout change)."""
        self.plan = StepPlan(self._circuit, self.live, self.instances, workers, fuse=step_plan)
        self._steps = self.plan.calls

    def stateful(self) -> dict[int, Any]:
        return self._stateful

    def step(self) -> dict[str, ZSet]:
        values: dict[int, ZSet] = {}
        try:
            run_nodes(self._steps, values, self.ctx, self.timer)
        except Exception as exc:
            err = as_step_error(exc, self.nodes[failed_node(self._steps, values)].label, None)  # executor.py invariant 4
            if err is exc:
                raise
            raise err from exc
        return {name: values[i] for name, i in self.outputs.items()}


class EmbeddedExecutor:
    """Runs a circuit's steps on W threads of this process (see the module docstring).

    ``vfs`` (tests): the I/O layer of the worker databases, ``"posix"`` or ``"fault"``.

    ``background_merge``: trace merges run on a merge thread of their own, beside the workers (trace invariant
    10), so a step does not wait for them: True, False, or None (the default: while the workers leave a core
    free, ``workers < os.cpu_count()``). Results, state and checkpoints are the same either way; it trades a
    second core for shorter steps.

    ``step_plan``: the workers run their steps through a step plan that fuses the chains it covers
    (dbsp_core/runtime/plan.py); False runs every node's own step (None: ``DBSP_STEP_PLAN``, default on). Results
    and state are the same either way.

    ``substep_bytes`` (tests, benchmarks): under a memory budget, the most pushed bytes a piece of a step holds
    (invariant 5; None: ``DBSP_SUBSTEP_BYTES``, else an eighth of the budget, at least 4 MiB). Results are the same
    whatever it is.
    """

    kind = "embedded"
    PREPARE_MERGE_WAIT = 10.0  # seconds prepare_relayout waits for the merge thread, outside any pause
    division_first = False  # state becomes durable only at checkpoints: a step may run while its division syncs
    state_in_memory = True  # a live rescale moves state here (relayout); the driver makes it durable
    range_values = True  # its checkpoints save a batch as one value per block of shards (snapshot.py invariant 11)

    def __init__(self, vfs: str = "posix", background_merge: bool | None = None, step_plan: bool | None = None,
                 substep_bytes: int | None = None) -> None:
        self.vfs = vfs
        self.substep_bytes = substep_bytes  # invariant 5: a piece's bytes (None: substep.py's, from the budget)
        self._split_off: str | None = None  # why this circuit's steps run whole (None: they may run in pieces)
        self._said_off = False  # whether the log said why already
        self.background_merge = background_merge
        self.step_plan = settings().step_plan if step_plan is None else step_plan
        self._merge_thread: MergeThread | None = None
        self.batch_store: BatchStore | None = None  # the memory budget of the traces (trace invariant 12)
        self.circuit: Circuit | None = None
        self.layout: Layout | None = None
        self.storage: str | None = None
        self._workers: list[_Worker] = []
        self._pool: ThreadPoolExecutor | None = None
        self._exchanger: _Exchanger | None = None
        self._coord: Coordinator | None = None
        self._out_schemas: dict[str, pa.Schema] = {}
        self._in_schemas: dict[str, pa.Schema] = {}
        self.stats: dict[str, Any] = {}
        # the driver's output log end: not needed here (state commits only at checkpoints, after its output)
        self.output_steps: Callable[[], int] = lambda: 2**62
        self._joining: dict[int, tuple[_Worker, WorkerStore | None]] = {}  # built by prepare_relayout
        self._renames: dict[int, int] | None = None  # a program change: see rename_state
        self._owing: list[Trace] | None = None  # traces owing work relayout deferred, oldest first (pay_deferred)
        # CPU time each worker's thread spent in steps, counted only while ``measure_cpu`` is set: reading a
        # thread's CPU clock is a system call (4-40 us on this VM), a measurable share of a 1k-row step
        self.measure_cpu = False
        self._after_load = False  # the last step pushed BIG_STEP_ROWS rows or more (_compact_after_load)
        self._written_at_compact = 0  # the batch store's bytes written, compactions' aside, at the last compaction
        self._compact_due = False  # a compaction is wanted, started once the merge thread is idle (_compact_after_load)
        self._compacting: list[Trace] = []  # traces whose background compaction is not installed yet
        self._reopened = False  # load_state ran and no small step has looked at the loose files it opened yet
        self.worker_cpu_seconds: list[float] = []
        # busy seconds per worker of the last run(): time in its operators, not waiting at an exchange's barrier
        # (the autoscaling policy's measure of work: dbsp_core.runtime.autoscale)
        self.busy: list[float] | None = None

    # ---- setup ----

    def start(self, circuit: Circuit, layout: Layout, storage: str | None) -> None:
        self.circuit, self.storage = circuit, storage
        self._out_schemas = {name: circuit.nodes[i].schema for name, i in circuit.outputs.items()}
        self._in_schemas = {h: circuit.nodes[i].schema for h, i in circuit.inputs.items()}
        # outputs whose rows in two workers always differ: sharded by columns they keep (equal rows, equal shard)
        self._disjoint = {name: circuit.nodes[i].partitioning is not None
                          and set(circuit.nodes[i].partitioning) <= set(circuit.nodes[i].schema.names)
                          for name, i in circuit.outputs.items()}
        self._live = live_nodes(circuit)
        self._split_off = split_off(circuit, self._live)
        if "substeps" in self.stats:  # a budget given before the circuit (the driver's order)
            self.stats["substeps"]["off"] = self._split_off
        self._groupings = groupings(circuit)
        self._build(layout)

    def _build(self, layout: Layout) -> None:
        assert self.circuit is not None
        self.layout = layout
        self._exchanger = _Exchanger(layout)
        self._workers = [_Worker(self.circuit, self._live, StepContext(w, layout.shard_map, self._exchanger),
                                 layout.workers, self.step_plan) for w in range(layout.workers)]
        self._exchanger.timers = [wk.timer for wk in self._workers]
        for wk in self._workers:
            for i, inst in wk.stateful().items():
                state_attrs(i, inst)  # snapshot invariant 2: refuse state we could not checkpoint
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = _start_pool(layout.workers)
        self.worker_cpu_seconds = [0.0] * layout.workers

    def groups(self, layout: Layout) -> list[StateGroup]:
        assert self.circuit is not None and self.storage is not None
        root = self.storage
        probe = _Worker(self.circuit, self._live, StepContext(0, layout.shard_map))
        return [StateGroup("state", lambda w: state_db_path(root, None, w),
                           state_tables(probe.stateful(), self._groupings))]

    def _paths(self) -> list[str]:
        assert self.storage is not None and self.layout is not None
        return [state_db_path(self.storage, None, w) for w in range(self.layout.workers)]

    def open_state(self) -> tuple[int, int]:
        assert self.storage is not None
        paths = self._paths()
        os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
        gone = [p for p in paths if not os.path.exists(p)]
        if gone and len(gone) < len(paths):  # a new pipeline creates them all; a lost one must not start empty
            for p in paths:
                if p not in gone:
                    with Database(p, readonly=True, vfs=self.vfs) as db:
                        if db.versions().stop > 1:
                            raise CorruptionError(f"{self.storage}: state database {gone[0]} is missing while {p} "
                                                  f"holds state: that worker's state is lost")
        dbs = [Database(p, vfs=self.vfs) for p in paths]
        try:
            v = choose_version([db.versions() for db in dbs], self.storage)
            for db in dbs:  # open(v) below discards v - 1: a damaged v must leave it for dbsp repair to go back to
                if v - 1 in db.versions():
                    try:
                        db.check(v)
                    except CorruptionError as exc:
                        raise CorruptionError(f"{db.path}: version {v} of the state is damaged ({exc.args[-1]}); "
                                              f"version {v - 1} is kept: `dbsp repair DIR` goes back to it if every "
                                              f"worker holds it intact") from None
            steps = set()
            for db in dbs:
                with db.open(v) as h:  # discards any other version (a checkpoint some worker did not commit)
                    steps.add(h.get_step())
            if len(steps) != 1:
                raise DbspError(f"{self.storage}: the workers' databases disagree on the step of version {v}: "
                                f"{sorted(steps)}")
            return v, steps.pop()
        finally:
            for db in dbs:
                db.close()

    def load_state(self, step: int) -> None:
        assert self.layout is not None
        stores = [WorkerStore(w, p, wk.stateful(), self.layout, self._groupings, self.vfs)
                  for w, (p, wk) in enumerate(zip(self._paths(), self._workers))]
        for st in stores:
            self._name_files(st)
            st.renames = self._renames
        self._coord = Coordinator(stores, crashpoint)
        try:
            at = self._coord.start(load=True)
            if at != step:
                raise DbspError(f"{self.storage}: the workers' state is at step {at}, the driver resumes at {step}")
        except BaseException:
            self._coord.close()
            self._coord = None
            raise
        if self.batch_store is not None:  # the restored batches: under the budget before the first step
            if self.batch_store.durable:  # keep the files the opened checkpoint names (trace invariant 13)
                self.batch_store.sweep(self._referenced())
            self.spill(self.batch_store)
            self._reopened = True  # (their loose spilled files count toward the write rule: _compact_after_load)

    def _name_files(self, st: WorkerStore) -> None:
        """Checkpoints of ``st`` name the durable store's batch files instead of copying their rows (trace
        invariant 13); they read named files from <storage>/spill even without a store."""
        assert self.storage is not None
        st.snapshot.batch_dir = os.path.join(self.storage, SPILL_DIR)
        if self.batch_store is not None and self.batch_store.durable:
            st.snapshot.batch_store = self.batch_store

    def referenced_files(self) -> set[str]:
        """The batch files (names in <storage>/spill) the last checkpoint's state names (an object store's
        checkpoint uploads those it has not yet: dbsp_core.runtime.remote_state)."""
        return set() if self._coord is None else self._referenced()

    def _referenced(self) -> set[str]:
        """The batch files the workers' checkpointed state names."""
        assert self._coord is not None
        return set().union(*(st.snapshot.referenced() for st in self._coord.stores))

    # ---- steps ----

    def _step_merge_thread(self) -> "MergeThread | None":
        """The merge thread for this step's traces, if background merging is on (started on first use)."""
        on = self.background_merge
        if on is None:  # (the workers: as many as the layout's, without its property's call)
            on = self.layout is not None and len(self._workers) < _CORES
        if not on:
            return None
        if self._merge_thread is None:
            self._merge_thread = MergeThread()
        return self._merge_thread

    def _run_worker(self, w: int, merge_thread: "MergeThread | None" = None, alone: bool = False) -> dict[str, ZSet]:
        """Worker ``w``'s step; ``alone``: its outputs are the step's whole (one worker, one piece), so each is made
        distinct here, without the row hashes a sum of parts would read (invariant 3)."""
        t0 = time.thread_time() if self.measure_cpu else 0.0
        b0 = time.perf_counter()
        try:
            with ThreadValuePair(merging, merge_thread, spilling, self.batch_store):
                out = self._workers[w].step()
            disjoint = self._disjoint
            for name, z in out.items():  # invariant 3: each worker's share of the summing, in parallel
                if alone or disjoint[name]:
                    if not z._distinct:
                        out[name] = z._distinct_unsorted()
                else:  # summed and made distinct across the workers on the driver: hashed here
                    out[name] = z._hashed_part()
            if w:  # a pool thread: its own scratch cache (worker 0 runs on the driver's thread: _run_one)
                _zset.trim_caches(settings().cache_keep_mb << 20)
            return out
        except BaseException:
            assert self._exchanger is not None
            self._exchanger.barrier.abort()  # release the others waiting at an exchange (invariant 2)
            raise
        finally:
            if self.measure_cpu:
                self.worker_cpu_seconds[w] += time.thread_time() - t0
            assert self.busy is not None and self._exchanger is not None
            self.busy[w] += time.perf_counter() - b0 - self._exchanger.waited[w]

    def run(self, steps: list[StepInput]) -> list[dict[str, ZSet]]:
        done: list[dict[str, ZSet]] = []
        assert self.layout is not None
        self.busy = [0.0] * len(self._workers)  # (the layout's workers)
        stateful = [inst for wk in self._workers for inst in wk.stateful().values()]
        for s in steps:
            saved = capture(stateful)
            try:
                done.append(self._run_one(s))
            except StepError as exc:  # executor.py invariant 4: as if the step never ran
                restore(saved)
                exc.step, exc.done = s.step, done
                raise
            saved = None  # the rollback copy held the batches the step replaced: freed before the trim
            rows = 0
            for _, z in s.pushes:
                rows += z.num_rows  # stored rows: len() would consolidate
            self._enforce(rows)
            if self.batch_store is not None:
                self._compact_after_load(rows)
        return done

    def _compact_after_load(self, rows: int) -> None:
        """After a step of ``rows`` pushed rows, between steps: the first small step (under BIG_STEP_ROWS) after a
        bulk load of big ones makes a compaction of each trace's spilled loose batches due (trace invariant 15: a
        load leaves tiered levels of several spilled files, which every small step after it would ask, 1.3-2.8x the
        CPU of a step over one file in bench/history/RESULTS-2026-11-28-to-2026-12-02.md "Fewer rewrites of spilled levels"), when the store wrote at
        least half of what its files now hold since the last compaction (compactions' own writes aside): a compaction
        rewrites the spilled state, so a workload alternating loads and small steps writes at most about twice more
        than without it. With a merge thread the compaction runs there (trace invariant 16): at the end of the first
        step after it is due that finds the merge thread idle (the load's merges finished and installed, the spill
        thread's writes switched; a load that resumes meanwhile does not cancel it), every trace starts
        one (:meth:`Trace.start_compaction`, cheap: no row is read) and the steps go on over the old batches until the end of a step installs it; the stats' ``compactions``
        count the rounds started. Without a merge thread (``background_merge`` off, as when the workers take every
        core) the same compaction is started with no thread and paid in slices (trace invariant 17): every step's end,
        from the one that starts it on, advances it by :func:`compaction_slice` input rows in all (the first trace
        still compacting first), the last slice installing it. A reopened state (:meth:`load_state`), whose writes since
        its last compaction are not known, makes it due at the end of its first small step (which has read its traces:
        a trace still fresh counts nothing) when the batches a compaction of its traces merges (loose spilled ones,
        loose ones of tiered levels) beyond each trace's largest hold at least a third of those largest ones' bytes
        (``Trace.loose_spilled_bytes``): a load's tiered files, not one compacted file and the small batches of the
        steps after it; so that compaction rewrites at most four times those bytes."""
        store = self.batch_store
        if store is None:
            return
        mt = self._merge_thread
        if self._compacting:  # installed between steps: the old files go now, not at a later step's first read
            if mt is None:  # (this step's slice: trace invariant 17)
                self._pay_compaction(rows)
            for t in self._compacting:
                t.install_finished()
            self._compacting = [t for t in self._compacting if t.compacting]
        if rows >= BIG_STEP_ROWS:
            self._after_load = True
            return
        if self._reopened:  # a reopened state: its loose spilled files count (what wrote them is not known)
            self._reopened = False
            beyond, largest = (sum(x) for x in zip((0, 0), *(t.loose_spilled_bytes() for t in self._all_traces())))
            if beyond and 3 * beyond >= largest:
                self._compact_due = True
        written = store.stats["bytes_written"] - store.stats["bytes_compacted"]
        if self._after_load:
            self._after_load = False
            if 2 * (written - self._written_at_compact) >= store.disk_bytes():
                self._compact_due = True
        if not self._compact_due:
            return
        if self._compacting or store.writing() or (mt is not None and not mt.wait_idle(0)):
            return  # the load's merges and writes first: a later step's end looks again
        self._install_merges()  # (hands nothing over: the merge thread stays idle)
        self._compact_due = False
        self._written_at_compact = written
        self._compacting = [t for t in self._all_traces() if t.start_compaction(mt)]
        if self._compacting:
            store.stats["compactions"] += 1
            if mt is None:  # the step that starts it pays its first slice
                self._pay_compaction(rows)
                self._compacting = [t for t in self._compacting if t.compacting]

    def _pay_compaction(self, rows: int) -> None:
        """A step's slice of the compactions started without a merge thread (trace invariant 17):
        :func:`compaction_slice` input rows in all, the first trace still compacting first."""
        left = compaction_slice(rows)
        for t in self._compacting:
            left -= t.advance_compaction(left)
            if left <= 0:
                break

    def rename_state(self, renames: dict[int, int]) -> None:
        """The next :meth:`load_state` reads node ``n``'s state from the tables of node ``renames[n]`` (snapshot
        invariant 9; a program change, dbsp_core.runtime.change)."""
        self._renames = dict(renames)

    def bootstrap(self, nodes: set[int], step: StepInput) -> dict[str, ZSet]:
        """Run a fresh in-memory copy of the circuit on this layout over ``step`` and give every worker that copy's
        state of ``nodes`` (each worker's shards, so placement is as if the copy had run here); returns its
        outputs (a program change, dbsp_core.runtime.change)."""
        assert self.circuit is not None and self.layout is not None
        fresh = EmbeddedExecutor(background_merge=False)
        try:
            fresh.start(self.circuit, self.layout, None)
            outs = fresh.run([step])[0]
            for wk, fw in zip(self._workers, fresh._workers):
                for i in sorted(nodes):
                    dst, src = wk.stateful().get(i), fw.stateful().get(i)
                    if dst is None or src is None:
                        continue
                    traces, zsets = state_attrs(i, src)
                    for name in traces:
                        t: Trace = getattr(dst, name)
                        t.clear()
                        for b in getattr(src, name).batches:
                            t.insert(b)
                        t.settle()
                    for name in zsets:
                        setattr(dst, name, getattr(src, name))
        finally:
            fresh.close()
        return outs

    def _enforce(self, rows: int) -> None:
        """Between steps or pieces (no worker runs: trace invariant 12): the batch store's budget enforced, and the
        memory the step (or piece) of ``rows`` pushed rows used and the state does not hold returned
        (:func:`release_memory`); after a big one also before the enforce, so that the enforce's own work (the
        cache's accounting, spills) grows from the state, not beside what the step freed (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "A
        one-push load under the budget")."""
        if self.batch_store is not None:
            if rows >= BIG_STEP_ROWS:
                release_memory(rows)
            self.batch_store.enforce()
        release_memory(rows)

    def _pieces(self, s: StepInput) -> list[list[tuple[str, ZSet]]]:
        """The pushes of step ``s`` as the pieces it runs in (invariant 5, dbsp_core/runtime/substep.py): one, unless
        a budget is set, the pushes hold more than a piece's bytes and the circuit is split-safe."""
        store = self.batch_store
        if store is None or not s.pushes:
            return [s.pushes]
        limit = self.substep_bytes if self.substep_bytes is not None else piece_bytes(store.memory_limit)
        cut = pieces(s.pushes, limit)
        if len(cut) == 1:
            return cut
        counts = self._substep_stats()
        if self._split_off is not None:  # substep.py invariant 5: said once, the step runs whole
            if not self._said_off:
                self._said_off = True
                log.debug("step %d runs whole (%d pieces of its input under the budget): %s", s.step, len(cut),
                          self._split_off)
            return [s.pushes]
        counts["split_steps"] += 1
        counts["pieces"] += len(cut)
        return cut

    def _substep_stats(self) -> dict[str, Any]:
        """The counters of split steps (``Pipeline.metrics()["spill"]["substeps"]``): steps run in pieces, their
        pieces, and why this circuit's steps run whole (None: they may run in pieces)."""
        return self.stats.setdefault("substeps", {"split_steps": 0, "pieces": 0, "off": self._split_off})

    def _run_one(self, s: StepInput) -> dict[str, ZSet]:
        if self._pool is None and self.batch_store is None:  # invariant 6
            return self._run_alone(s)
        return self._run_pieces(s)

    def _run_pieces(self, s: StepInput) -> dict[str, ZSet]:
        """A step on the workers in its pushes' pieces (invariant 5), the workers' outputs summed (invariant 3)."""
        assert self.circuit is not None and self.layout is not None
        cut = self._pieces(s)
        results: list[dict[str, ZSet]] = []
        store, marks = self.batch_store, None
        if len(cut) >= Trace.FAN_IN and store is not None:  # a load in pieces (invariant 5): their batches wait as
            marks = [(t, t._placed) for t in self._all_traces()]  # loose files of their tiered levels,
            store.holding = True  # merged once below (trace invariant 15), not FAN_IN at a time and then again
        try:
            for k, pushes in enumerate(cut):
                if k:  # between pieces no worker runs, as between steps (substep.py invariant 3)
                    self._enforce(sum(z.num_rows for _, z in cut[k - 1]))
                results += self._run_piece(s, pushes, alone=len(cut) == 1)
        finally:
            if marks is not None:
                store.holding = False
        if len(cut) > 1:  # what the last piece freed leaves before the pieces' outputs are summed
            release_memory(sum(z.num_rows for _, z in cut[-1]))
        if marks is not None:  # each trace's loose batches placed by the pieces, merged k at once (the tiered ones
            self._install_merges(settle=True)  # and the spilled), on disk: one more write of the step's rows
            store.settle()
            for t, placed in marks:
                t.compact_spilled(since=placed)
            release_memory(BIG_STEP_ROWS)  # (the merge's freed inputs)
        if self._coord is not None:
            for st in self._coord.stores:
                st.advance()
        whole = len(cut) == 1  # pieces' outputs may hold equal rows of two pieces (substep.py invariant 3)
        out = {}
        for name, schema in self._out_schemas.items():
            parts = [r.pop(name) for r in results]  # popped: the sum below holds the only reference to them
            z = concat(parts, schema)
            if z._distinct or (whole and self._disjoint[name] and all(p._distinct for p in parts)):  # invariant 3
                out[name] = z if z._distinct else ZSet._make(z.data, z.weights, distinct=True, chunked=True)  # parts
                # need no sort (z.data: one chunk per column, zset.py invariant 1)
            else:  # the workers' distinct parts, with their row hashes, summed across workers (invariant 3)
                del parts  # copied into z (or z itself): freed before the hashing, not beside it (a split step's
                # outputs of every piece: a 1M-row join step's ~48 MiB, its peak)
                out[name] = z._distinct_unsorted()
        return out

    def _run_alone(self, s: StepInput) -> dict[str, ZSet]:
        """:meth:`_run_one` on one worker without a memory budget (invariant 6): the step whole (no budget, no
        pieces: invariant 5) on this thread, each output the one worker's made distinct (invariant 3's sum of one
        part); what the general path does for it, without its pieces, lists of parts and sums of one part."""
        assert self._exchanger is not None
        wk = self._workers[0]
        wk.timer.step = s.step
        schemas = self._in_schemas
        one = spread(s.pushes, 1, 0)[0]  # (it hands over no part without rows)
        wk.ctx.begin({h: ps[0] if len(ps) == 1 else concat(ps, schemas[h]) for h, ps in one.items()}, s.now_ns,
                     s.prev_now_ns, s.seed, s.watermarks)
        ex = self._exchanger
        if ex.barrier.broken:
            ex.barrier.reset()
        ex.mailboxes.clear()
        ex.waited = [0.0]
        out = self._run_worker(0, self._step_merge_thread(), alone=True)  # (its outputs distinct: invariant 3)
        if self._coord is not None:
            for st in self._coord.stores:
                st.advance()
        return out

    def _run_piece(self, s: StepInput, pushes: list[tuple[str, ZSet]], alone: bool = False) -> list[dict[str, ZSet]]:
        """Run the circuit once on every worker over ``pushes`` (the step's, or a piece of them) with the context of
        step ``s``; returns each worker's outputs (``alone``: ``pushes`` are the step's whole, so one worker's outputs
        are the step's: :meth:`_run_worker`)."""
        assert self.circuit is not None and self.layout is not None and self._exchanger is not None
        W = self.layout.workers
        parts = spread(pushes, W, s.step % W)
        schemas = self._in_schemas
        for w, wk in enumerate(self._workers):
            wk.timer.step = s.step
            wk.ctx.begin({h: concat(ps, schemas[h]) for h, ps in parts[w].items()}, s.now_ns, s.prev_now_ns,
                         s.seed, s.watermarks)
        if self._exchanger.barrier.broken:
            self._exchanger.barrier.reset()
        self._exchanger.mailboxes.clear()
        self._exchanger.waited = [0.0] * W
        mt = self._step_merge_thread()
        if self._pool is None:  # (one worker)
            return [self._run_worker(0, mt, alone=alone)]
        futures = [self._pool.submit(self._run_worker, w, mt) for w in range(1, W)]
        errors: list[BaseException] = []
        results = []
        try:
            results.append(self._run_worker(0, mt))
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
        return results

    # ---- live layout changes ----

    def prepare_relayout(self, final: Layout) -> None:
        """Build the workers ``final`` adds (a fresh copy of the circuit and, with storage, a database created at
        the checkpoint version every worker holds, opened for the next checkpoint), so that :meth:`relayout` only
        attaches them. Call it with no checkpoint in flight and none starting until the change ends; it does
        file I/O and needs no step lock. It also waits (a while at most) for the merge thread to finish the merges
        it holds, so that the first wave's settling of them (:meth:`relayout`) installs them instead of waiting in
        its pause."""
        assert self.circuit is not None and self.layout is not None
        if self._merge_thread is not None:
            self._merge_thread.wait_idle(self.PREPARE_MERGE_WAIT)
        for w in range(len(self._workers), final.workers):
            if w in self._joining:
                continue
            wk = _Worker(self.circuit, self._live, StepContext(w, final.shard_map, None), final.workers,
                         self.step_plan)
            st = None
            if self._coord is not None:
                assert self.storage is not None
                path = state_db_path(self.storage, None, w)
                if os.path.exists(path):
                    os.unlink(path)  # a database of a worker an earlier change removed, or an undone one
                Database.create(path, self._coord.version, vfs=self.vfs).close()
                st = WorkerStore(w, path, wk.stateful(), final, self._groupings, self.vfs)
                self._name_files(st)
                st.start(self._coord.version)
            self._joining[w] = (wk, st)

    def abandon_relayout(self) -> None:
        """A live change ended without attaching the workers :meth:`prepare_relayout` built (it failed and was
        undone): close their databases (the driver deletes the files)."""
        for _, st in self._joining.values():
            if st is not None:
                st.close()
        self._joining = {}

    def relayout(self, layout: Layout) -> int:
        """Switch to ``layout`` between steps, moving in memory the state of the shards whose owner changes
        (dbsp_core.runtime.migrate); returns the bytes moved. Workers join (a fresh copy of the circuit and, with
        storage, a database created at the checkpoint version every worker holds) or leave (handing over what
        they hold) as the layout's worker count changes. The caller holds the step lock and no checkpoint is in
        flight."""
        assert self.circuit is not None and self.layout is not None
        self._owing = None  # this wave defers more work (migrate.py invariant 4): pay_deferred looks again
        self._install_merges(settle=True)  # cut merged batches, not a merge's two inputs
        old = self.layout
        nodes = self.circuit.nodes
        bits = layout.shard_bits
        if bits != old.shard_bits:  # shards split or merge: owners compared at the new count
            if self._coord is not None:
                for st in self._coord.stores:
                    st.snapshot.set_shard_bits(bits)
        W = layout.workers
        if len(self._workers) < W:
            self.prepare_relayout(layout)
        while len(self._workers) < W:  # joining workers: prepared (copy of the circuit, database) beforehand
            wk, st = self._joining.pop(len(self._workers))
            self._workers.append(wk)
            if st is not None:
                assert self._coord is not None
                st.step = self._coord.stores[0].step
                self._coord.stores.append(st)
        fine = max(bits, old.shard_bits)  # owners compare at the finer count (a merge moves odd children)
        src_owner = np.repeat(old.shard_map.part_of_shard, 1 << (fine - old.shard_bits))
        dst_owner = np.repeat(layout.shard_map.part_of_shard, 1 << (fine - bits))
        moved = 0
        stores = {st.index: st for st in self._coord.stores} if self._coord is not None else {}
        # only the (source, target) pairs some shard moves between: a wave costs its shards, not W^2 masks
        changing = np.flatnonzero(src_owner != dst_owner)
        for a, b in sorted({(int(src_owner[s]), int(dst_owner[s])) for s in changing.tolist()}):
            mask = (src_owner == a) & (dst_owner == b)
            snap = stores[a].snapshot if a in stores else None
            moved += move_shards(nodes, self._workers[a].stateful(), self._workers[b].stateful(), mask, fine, snap)
        for a in range(W, len(self._workers)):  # leaving workers hand over what they still hold
            moved += hand_over(nodes, self._workers[a].stateful(), [wk.stateful() for wk in self._workers[:W]],
                               dst_owner, fine)
            if self._coord is not None:
                st = stores[a]
                st.close()  # never committed again; the driver deletes its database once the layout is durable
                self._coord.stores.remove(st)
        del self._workers[W:]
        self.layout = layout
        self._exchanger = _Exchanger(layout, [wk.timer for wk in self._workers])
        for w, wk in enumerate(self._workers):
            wk.ctx.shard_map = layout.shard_map
            wk.ctx._exchanger = self._exchanger
            wk.lower(W, self.step_plan)  # plan.py invariant 2: an exchange the identity at W = 1 is not at W > 1
        for st in (self._coord.stores if self._coord is not None else []):
            st.layout = layout
        if old.workers != W:  # the pool's size follows the worker count
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = _start_pool(W)
        self.worker_cpu_seconds = (self.worker_cpu_seconds + [0.0] * W)[:W]
        return moved

    def pay_deferred(self, rows: int) -> bool:
        """Do up to ``rows`` rows of the work :meth:`relayout` deferred (merges and key-index folds of the moved rows,
        trace invariant 14, dbsp_core/runtime/migrate.py invariant 4) in the first trace that owes some, so that
        one call costs about the same whatever the worker and trace counts; returns whether work is still owed.
        The caller holds the step lock (no step runs)."""
        if self._owing is None:  # the traces that owe, found once after the waves (only relayout makes debts)
            self._owing = [t for t in self._all_traces() if t.deferred != (0, 0)]
        while self._owing and not self._owing[0].pay_deferred(rows):
            self._owing.pop(0)  # paid off
            rows = 0  # a trace that owed nothing more took no work: look at the next one only
        return bool(self._owing)

    def resume(self, version: int, step: int) -> None:
        raise DbspError("resume: the embedded executor's state is in memory; a live rescale moves it with "
                        "relayout, and a stored layout change is loaded by open_state and load_state")

    def rollback_lost(self) -> int:
        raise DbspError("rollback_lost: the embedded executor's workers are threads of this process; their state is "
                        "never lost alone")

    def task_budget(self, memory_limit: int, spill_dir: str | None) -> bool:
        """The traces live in this process: the driver gives a store through :meth:`spill` instead."""
        return False

    def spill(self, store: BatchStore | None) -> None:
        """Keep the traces' batches under ``store``'s memory budget from now on (trace invariant 12; None: in
        memory); the traces already built register now, and it is enforced at once and after every step."""
        self.batch_store = store
        if store is not None:
            self._substep_stats()
        if store is not None and self._workers:
            for t in self._all_traces():
                t._store = store
                store.register(t)
            store.enforce()

    def _all_traces(self) -> list[Trace]:
        """Every trace of every worker's operators (what checkpoints save)."""
        return [getattr(inst, name) for wk in self._workers for i, inst in wk.stateful().items()
                for name in state_attrs(i, inst)[0]]

    def settle_merges(self) -> int:
        """Wait until the merge thread has no merge left and every trace has installed what it merged (after a
        bulk load, say, so later steps do not share the machine with the load's merges), and the batch store's spill
        thread has written what it was handed (trace invariant 12), and each trace's spilled loose batches are one
        (``Trace.compact_spilled``, trace invariant 15: the load left tiered levels of several files, which every
        small step after it would ask; a compaction paid in slices, trace invariant 17, is finished first); then
        return the memory they freed, as after a big step (:func:`release_memory`). Call between steps. Returns the
        batches the compaction merged."""
        self._install_merges(settle=True)
        merged = 0
        if self.batch_store is not None:
            if self._merge_thread is None and self._compacting:  # a compaction paid in slices: the rest now
                for t in self._compacting:
                    t.advance_compaction(1 << 62)
                self._compacting = []
            self.batch_store.settle()
            for t in self._all_traces():  # the tiered levels' spilled batches, one batch each (trace invariant 15)
                merged += t.compact_spilled()
        release_memory(BIG_STEP_ROWS)  # a load's merges freed their inputs: the allocators' free memory too
        return merged

    def _install_merges(self, settle: bool = False) -> None:
        """Between steps (the caller holds the step lock): every trace installs the merges the merge thread
        finished (trace invariant 10), so what is saved, moved or measured next is merged. With ``settle``, waits
        for the merge thread until no merge it was handed is left (what a shard cut needs: merged batches move fewer
        bytes than their inputs; the wait is merge work the steps before would have done without the merge thread)."""
        if self._merge_thread is None:
            return
        traces = self._all_traces()
        freed = 0
        with progress("settling merges", unit=" merges installed") if settle else nullcontext() as shown:
            while True:
                installed = sum(t.install_finished(self._merge_thread if settle else None) for t in traces)
                freed += installed
                if shown is not None:
                    shown.update(freed)
                # nothing left to install and an idle merge thread (no merge handed over and unfinished): settled
                if not settle or (not installed and self._merge_thread.wait_idle(0)):
                    break
                self._merge_thread.wait_idle()
        if freed:  # the merges' inputs went back to the region cache: trim it as a step's end does
            _zset.trim_caches(settings().cache_keep_mb << 20)

    def state_bytes(self) -> int:
        """Bytes of every worker's state in memory (the Arrow buffers of its traces and Z-sets)."""
        assert self.circuit is not None
        self._install_merges()
        total = 0
        for wk in self._workers:
            for i, inst in wk.stateful().items():
                traces, zsets = state_attrs(i, inst)
                for name in traces:
                    placed, pending = getattr(inst, name).parts()
                    total += sum(spilled_bytes(b) if is_grouped(b) else  # (format 2: its rows not read)
                                 int(b.zset.data.nbytes) + int(b.zset.weights.nbytes) for b in placed + pending)
                for name in zsets:
                    z = getattr(inst, name)
                    total += int(z.data.nbytes) + int(z.weights.nbytes)
        return total

    # ---- durability ----

    def checkpoint(self, step: int) -> Callable[[], None]:
        if self._coord is None:
            raise DbspError("checkpoint: this executor keeps no state on disk")
        self._install_merges()
        if self.batch_store is not None:  # batches the spill thread is writing: referenced by their files, not
            self.batch_store.settle()  # copied row by row (trace invariant 12-13)
        at, plans = self._coord.begin_checkpoint()
        if at != step:
            raise DbspError(f"checkpoint at step {step}, but the workers are at step {at}")
        coord, store = self._coord, self.batch_store

        def finish() -> None:
            coord.finish_checkpoint(at, plans)
            if store is not None and store.durable:  # files no checkpoint names any more go (trace invariant 13)
                store.checkpointed(set().union(*(st.snapshot.referenced() for st in coord.stores)))
        return finish

    @property
    def version(self) -> int:
        """The state version the workers are open at (the last checkpoint's)."""
        return -1 if self._coord is None else self._coord.version

    # ---- inspection ----

    def traces(self, worker: int) -> dict[str, Trace]:
        assert self.circuit is not None
        if not 0 <= worker < len(self._workers):
            raise ValueError(f"traces: worker {worker} is outside 0..{len(self._workers) - 1}")
        return traces_by_label(self.circuit, self._workers[worker].instances)

    def view(self, node: int) -> ZSet:
        """The contents of readable node ``node``: its trace in every worker, in memory."""
        return ZSet.concat([w.instances[node].trace.consolidated().zset for w in self._workers])

    def node_timers(self) -> list[NodeTimer]:
        """Each worker's operator timings (dbsp_core.profile)."""
        return [wk.timer for wk in self._workers]

    def disk_bytes(self) -> int:
        if self.storage is None or self.layout is None:
            return 0
        return sum(tree_bytes(p) for p in self._paths())  # a file gone at its stat counts 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._merge_thread is not None:
            self._merge_thread.close()
            self._merge_thread = None
        if self.batch_store is not None:
            self.batch_store.close()
            self.batch_store = None
        if self._coord is not None:
            self._coord.close()
            self._coord = None
        self._workers = []
