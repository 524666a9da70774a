"""The driver: one Pipeline class that owns everything common to every way of running a circuit (push validation and dedup, the division of input into steps with its determinants, the output log, checkpoint cadence, open and recovery, layout changes) and drives an executor (executor.py) that runs the steps.

Opening and recovering a storage directory (with its format checks) is recovery.py's and a live rescale's waves
are rescale.py's; the driver calls them, and holds the locks and the state they report back.

In memory (no ``storage``) the driver keeps pushes until the next step and hands them to the executor. With a
storage directory (dbsp_core.storage.formats lists every file) it is exactly once across ``kill -9``:

Invariants (enforced here):
  1. A push is validated completely (handle, type, schema, weights, producer and seq, and the limits: a
     producer id of at most 1024 bytes of UTF-8, a push of at most 1 GiB encoded) before anything is
     recorded; a bad push raises and changes nothing. With storage, ``push`` returns its acknowledgement only
     after the push's record is durable in the input log. The record carries the step that was open when the
     push was admitted; a step is closed only when no admitted push is still being appended, and pushes wait
     while a step closes, so the log's steps never decrease and every record of step s precedes s's division.
     A step's pushes reach the executor in the log's order (the order recovery reads them in), which decides
     which row of a key wins in a table with a primary key. A push from a source whose files are immutable
     (FileSource ``immutable_files=True``) is recorded as a reference to its file's unit (storage/fileref.py)
     and read again from the file by recovery; it is acknowledged (and marked seen) once its record has its
     place in the log's order, before its fsync: the step's division record, which follows it, makes it
     durable before any output of the step (invariant 3), a checkpoint syncs the log up to it before saving a
     seen set that holds it (invariant 5), and a crash before either loses the record and the seen mark
     together, so the source, which replays from its file, pushes it again. ``push_many`` validates all its pushes before it
     records any, admits them together into one step and acknowledges them once one fsync covers them all.
  2. A ``(producer, seq)`` pair is counted once: it is marked seen only after its record is durable; a retry of
     a seen pair is acknowledged again (``duplicate=True``) and records nothing; a retry of a pair still being
     appended waits for it. The seen set is saved in ``driver.db`` at each checkpoint and completed on
     recovery from the log records after it.
  3. A step's division record (step, number of pushes, wall-clock ``now``, random ``seed``, and for a circuit
     with event time the ``watermarks`` after the step, dbsp_core.time.watermark) takes its place in the input
     log when the step closes, and is durable before any output of the step is
     written to the output log or returned. An executor whose state commits while steps run
     (``division_first``) gets the step only once its division is durable; otherwise the record's fsync
     overlaps with running the step (a step may run before its input is durable, as long as no output of it
     leaves before that). ``now`` never decreases, also
     across restarts (the floor is saved with the checkpoint). Replay uses the logged determinants.
  4. Every step's output goes through ``OutputLog.write`` (discard / verify / append by step); with replay
     checking on (the default) a replayed step whose output differs raises ReplayMismatchError. With
     ``output_sync`` the steps one call runs together (``run_queued``, a step after a failed one, a recovery's
     replay) are appended unread and made durable and readable by one fsync before the call returns or raises
     (outputlog.py invariant 2); a crash before it loses those records only, whose divisions are durable, so
     recovery computes and appends them again: no reader saw them and no caller got them.
  5. A checkpoint at step X captures the executor's state at X while steps pause, then (possibly on a
     background thread, while later steps run) flushes the output log, makes the state durable, commits the
     driver's own record (seen set, clock) at X in ``driver.db``, and only then truncates the input log below
     X (the low watermark; with a view logged by reference, outputlog.py invariant 7, below the output log's
     first step if that is lower) and drops old output (output at or after X is always kept, so replays can be
     verified). ``driver.db``'s step never exceeds the executor's.
  6. Recovery (:meth:`Pipeline.open`, or a constructor given an existing directory) settles an interrupted layout
     change, puts the state at the newest checkpoint (step X), completes the seen set and clock from
     ``driver.db`` and the log, replays every divided step from X (verifying output already in the log,
     appending the rest) and queues the acknowledged pushes never divided into a step; it refuses a directory
     of another circuit or executor kind and never runs over a damaged log. recovery.py invariants 1-3 say
     exactly how and what it refuses.
  7. A step that fails on its data (an operator raising anything but an I/O, memory or exchange failure)
     raises StepError naming its pushes: the executor is back where it was before the step (executor.py
     invariant 4), nothing of the step is output, the step stays divided (its division record and
     determinants stand) at the head of the queue, and the pipeline stays usable. ``discard(producer, seq)``
     logs a record dropping one unstepped push before it changes anything in memory (recovery drops the
     same push; the pair stays seen), and the next ``step`` runs the waiting step again. A replay that fails
     the same way during recovery leaves the step waiting the same way, so ``open`` works after a crash at
     any point. Any other failure of a step marks the pipeline broken: state may be half-updated, so every
     later push or step raises DbspError until the directory is reopened with :meth:`Pipeline.open`.
  8. Every public operation may be called from any thread. Pushes run concurrently; steps, ``queue_step``,
     ``run_queued``, ``discard``, checkpoints and each wave of a live rescale hold the step lock. A live rescale
     starts (under the step lock) only with no checkpoint in flight; while it runs (until its report, which
     LAYOUT keeps on disk, is written: a later one is never overwritten by it), ``checkpoint`` and ``close``
     wait for its end on one condition of the step lock (deciding and acting under the lock, never between),
     and another ``rescale`` is refused with DbspError. ``close`` waits for the pushes being appended and
     refuses later ones. A rescale that fails before or between its waves is undone (rescale.py invariant 6):
     the pipeline goes on at the old layout. An autoscaling policy (autoscaler.py) decides after a step, under the step lock,
     and rescales through ``rescale`` on a thread of its own (so steps go on); ``close`` stops it and waits for
     the rescale it started before taking the step lock.
  9. ``view`` and ``query`` read the executor's state (the trace of each readable node, Circuit invariant 6) under
     the step lock, so what they see is the state after the last completed step, the same for every table and
     view of one query; DuckDB runs a query after the lock is released, over Arrow tables it cannot change.
 10. A worker's lost state (WorkerStateLostError from the executor's ``run`` or ``checkpoint``: a staged executor
     with ``worker_recovery="pipeline"`` whose task found its worker's state missing or behind, staged.py
     invariant 7) is recovered in place, under the step lock, as ``open`` recovers (invariant 6) but without a
     new driver: the background checkpoint is waited for, the executor rolls back to its last durable state
     (``rollback_lost``, step X), the steps from X to the failing ones are read again from the input log
     (recovery.LogReplay, with their logged determinants) and run, their output verified against the output log
     and never returned (OutputLog.write), then the failing steps (or checkpoint) run again. At most
     :data:`LOST_RECOVERIES` times in a row; a loss during a recovery starts it again. Counted in
     ``stats["lost_recoveries"]``, ``stats["lost_replayed_steps"]`` and ``stats["lost_recovery_s"]``.
 11. ``traces`` hands out the executor's live traces, each behind the step lock (runtime/guarded.py): every read of
     one runs under the lock, never beside a step, a rescale or a checkpoint. A read can write (a trace keeping
     totals per key syncs its batches first, trace invariant 19), so an unguarded read from another thread than
     the one stepping corrupted the state (test_traces_read_beside_steps.py).
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa

from dbsp_core import _storage
from dbsp_core.arrow_pool import use_jemalloc
from dbsp_core.circuit import Circuit, circuit_fingerprint
from dbsp_core.codec import encode_json, encode_zset_parts
from dbsp_core.envvars import parse_memory_limit, settings
from dbsp_core.errors import (AppendOnlyError, CorruptionError, DbspError, PrimaryKeyError, RecoveryError,
                              SchemaError, StepError, StorageError, WorkerStateLostError)
from dbsp_core.layout import DEFAULT_SHARD_BITS, Layout, ShardMap
from dbsp_core.metrics import Metrics, gather, serve, stop_serving
from dbsp_core.profile import Profile, pipeline_profile
from dbsp_core.operators.base import same_columns
from dbsp_core.operators.upsert import check_keyed, keep_last
from dbsp_core.progress import progress
from dbsp_core.rows import as_table, conform, key_rows
from dbsp_core.runtime.autoscale import Autoscale
from dbsp_core.runtime.autoscaler import Autoscaler, Capacity
from dbsp_core.runtime.change import Owed, bootstrap
from dbsp_core.runtime.change import prepare as prepare_change
from dbsp_core.runtime.crashpoints import crashpoint
from dbsp_core.runtime.division import Divided, ranges
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.executor import Executor, StepInput
from dbsp_core.runtime.guarded import GuardedTrace
from dbsp_core.runtime.prune import decide as decide_stored
from dbsp_core.runtime.recovery import LogReplay, open_directory, settle_state
from dbsp_core.runtime.readable import ReadableState, as_rows, check_read_only, run_query
from dbsp_core.runtime.remote_state import RemoteCheckpoints, prepare_cache, restore
from dbsp_core.runtime.rescale import LiveRescale
from dbsp_core.runtime.stage_check import check_present
from dbsp_core.runtime.stage_store import StageChains, StageStore
from dbsp_core.storage.consumers import ConsumerRegistry
from dbsp_core.storage.database import Database
from dbsp_core.storage.dedup import SeenSet
from dbsp_core.storage.fileref import decode_push
from dbsp_core.storage.directory import lock_dir, read_record, tree_bytes, unlock_dir, write_meta, write_record
from dbsp_core.storage.formats import (ACKED_KEY, ACKED_MAGIC, ACKED_TABLE, CLOCK_KEY, CLOCK_MAGIC, CLOCK_TABLE,
                                       DISCARD_HANDLE, DISCARD_MAGIC, DIVISION_HANDLE, DIVISION_MAGIC, INPUT_DIR,
                                       META_FILE, METRICS_FILE, METRICS_MAGIC, OUTPUT_DIR, PROFILE_FILE,
                                       PROFILE_MAGIC, SPILL_DIR, STATE_DIR)
from dbsp_core.storage.outputlog import OutputLog
from dbsp_core.storage.remote import Remote, StoreOptions, is_remote
from dbsp_core.storage.remote_log import RemoteLogs
from dbsp_core.storage.steplog import StepLog
from dbsp_core.time.watermark import NO_WATERMARK, advance, specs_of
from dbsp_core.trace import Trace
from dbsp_core.trace.at_exit import stop_at_exit
from dbsp_core.trace.spill import BatchStore
from dbsp_core.zset import ZSet, ones, weight_column

# what push takes: these, pandas and polars DataFrames (neither imported here), a dict of columns, a list of rows
PushData = ZSet | pa.Table | pa.RecordBatch | dict | list
MAX_PRODUCER_BYTES = 1024  # a producer id is a key of driver.db's dedup table (the page store's key limit)
MAX_PUSH_BYTES = _storage.MAX_PAYLOAD  # one push is one input-log record
LOST_RECOVERIES = 3  # in-place recoveries of a lost worker's state in a row before the pipeline breaks (inv. 10)

__all__ = ["Ack", "Pipeline", "PushData"]


class Ack(NamedTuple):
    """The acknowledgement of a durable push: the step it belongs to (None for a duplicate) and its identity."""

    step: int | None
    producer: str
    seq: int
    duplicate: bool


def row_width(schema: pa.Schema) -> int | None:
    """Bytes of one row's values when every column of ``schema`` is fixed-width and byte-aligned (integers, floats,
    temporal types, decimals, fixed-size binary): what ``Table.nbytes`` gives per row of such a table without null
    bitmaps; None with any other column (strings, booleans, dictionaries, nested types).

    >>> row_width(pa.schema([("a", pa.int64()), ("b", pa.int32()), ("t", pa.timestamp("us"))]))
    20
    >>> row_width(pa.schema([("a", pa.int64()), ("s", pa.string())])) is None
    True
    """
    width = 0
    for f in schema:
        t = f.type
        if not (pa.types.is_primitive(t) or pa.types.is_decimal(t) or pa.types.is_fixed_size_binary(t)):
            return None
        bits = t.bit_width
        if bits % 8:  # booleans are bit-packed
            return None
        width += bits // 8
    return width


class _Prepared(NamedTuple):
    """A validated push (and with storage its encoded record) not yet recorded."""

    handle: str
    z: ZSet
    payload: list | None  # the input-log record's parts (None in memory)
    nbytes: int
    producer: str | None
    seq: int | None


def _fmt(s: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in s) + ")"


class Pipeline:
    """Runs a circuit: embedded in this process by default, or on any executor; in memory, or durable and
    exactly once with a storage directory (see the module docstring).

    Parameters
    ----------
    circuit : Circuit
        The circuit; nodes added after the pipeline is created are not run.
    workers : int
        Number of circuit copies W. Results do not depend on it.
    shard_bits : int
        log2 of the number of shards S of a new pipeline's layout (default 8); S must be >= W. Rescaling may
        double or halve S later (dbsp_core.layout).
    storage : str or os.PathLike or pyarrow.fs.FileSystem or None
        A directory makes the pipeline durable (input log, checkpoints, output log). None runs in memory. An
        existing directory is recovered (its worker count must be ``workers``; use :meth:`open` to rescale).
        A URI of an object store (``s3://bucket/prefix?endpoint_override=...``, ``gs://``, ``hdfs://``: what
        ``pyarrow.fs.FileSystem.from_uri`` takes; credentials from the environment, never logged) or a
        ``pyarrow.fs.FileSystem`` object (its root; e.g. a ``SubTreeFileSystem``) makes the store the durable
        home: the pipeline runs on a local cache directory (``cache_dir``) rebuilt from the store's newest
        checkpoint when it opens, and each checkpoint uploads what changed (dbsp_core.storage.remote). The
        embedded executor only, for now.
    cache_dir : str or os.PathLike or None
        With an object store: the local cache directory, empty or a cache an earlier pipeline left (it is
        emptied and rebuilt from the store on open, never trusted). None: a temporary directory, removed on
        :meth:`close`. ``p.storage`` is the cache directory; ``p.storage_uri`` names the store (no secrets).
        A checkpoint commits locally, then uploads on its own thread while steps go on (one upload at a time:
        :meth:`checkpoint` returns once its manifest is in the store; the timer skips a checkpoint while the
        previous upload runs). One pipeline writes a prefix at a time: a newer writer fences an older one.
    store_options : StoreOptions or None
        With an object store: the retry policy of its calls (``attempts``, ``first_delay_s``, ``max_delay_s``)
        and the input log's group-commit window (``group_commit_s``); see :class:`dbsp_core.StoreOptions`. None:
        the defaults (6 attempts from 0.05 s doubling up to 2 s; a 2 ms window).
    executor : Executor or None
        What runs the steps: ``EmbeddedExecutor()`` (default: threads in this process) or a
        ``StagedExecutor(runner=...)`` (stage tasks on a job runner, e.g. Spark through spark_glue).
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
    clock : callable or None
        Returns the wall-clock time in nanoseconds since the epoch that a step logs as its ``now`` (default
        ``time.time_ns``; a simulation or a test passes its own). ``now`` never decreases whatever it returns.
    autoscale : Autoscale or None
        A policy that sizes the pipeline from what it measures: after a step it may rescale live (see
        :class:`dbsp_core.Autoscale` and :meth:`autoscale`). None: the worker count changes only when asked.
    memory_limit : int or str or None
        A memory budget for the operators' traces: bytes, or a size such as ``"4GiB"`` or ``"512MB"``. Beyond it
        the biggest, oldest batches of the traces move to immutable batch files on local disk and are read in
        place through a cache (dbsp_core/trace/spill.py); results do not change. None: the ``DBSP_MEMORY_LIMIT``
        setting (embedded executor only), else no budget (every batch in memory). On the staged executor the
        budget is per host of its task processes (a Spark executor), divided among the tasks it runs at once
        (dbsp_core/runtime/stage_task.py invariant 7).
    spill_dir : str or os.PathLike or None
        Where batch files go (default: ``<storage>/spill``, or a temporary directory without storage; on the
        staged executor a directory on each host running tasks, default its Spark local directory).

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

    Durable, exactly once:

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> p = dbsp.Pipeline(c, workers=2, storage=d)
    >>> p.push("bids", pa.table({"auction": [1, 1], "price": [10, 5]}), producer="gen", seq=0).duplicate
    False
    >>> p.push("bids", pa.table({"auction": [1, 1], "price": [10, 5]}), producer="gen", seq=0).duplicate
    True
    >>> p.step()["totals"].to_dict()
    {(1, 15): 1}
    >>> p.close()
    >>> q = dbsp.Pipeline.open(d, c, workers=3)       # continue at another worker count (cold rescale)
    >>> q.layout.workers, q.last_rescale["from_workers"], [(s, z.to_dict()) for s, z in q.read_output("totals")]
    (3, 2, [(0, {(1, 15): 1})])
    >>> q.close()
    """

    _capacity: Capacity | None = None  # what follows the worker count outside the process (SparkPipeline's executors)

    def __init__(self, circuit: Circuit, workers: int = 1, shard_bits: int = DEFAULT_SHARD_BITS,
                 storage: Any = None, *, executor: Executor | None = None,
                 checkpoint_interval: float | None = 10.0, replay_check: bool = True,
                 output_retention: int | None = None, output_sync: bool = True, segment_bytes: int = 64 << 20,
                 clock: Callable[[], int] | None = None, autoscale: Autoscale | None = None, vfs: str = "posix",
                 memory_limit: int | str | None = None, spill_dir: Any = None, cache_dir: Any = None,
                 store_options: StoreOptions | None = None,
                 _rescale_to: int | None = None, _open_only: bool = False) -> None:
        if not isinstance(circuit, Circuit):
            raise TypeError(f"Pipeline needs a Circuit, got {type(circuit).__name__}")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"Pipeline: workers must be a positive int, got {workers!r}")
        if checkpoint_interval is not None and not (isinstance(checkpoint_interval, (int, float))
                                                    and checkpoint_interval > 0):
            raise ValueError(f"checkpoint_interval must be a positive number of seconds or None, "
                             f"got {checkpoint_interval!r}")
        if output_retention is not None and (not isinstance(output_retention, int) or output_retention < 0):
            raise ValueError(f"output_retention must be a non-negative int or None, got {output_retention!r}")
        if not isinstance(segment_bytes, int) or segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be an int >= 4096, got {segment_bytes!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning nanoseconds since the epoch, got {clock!r}")
        if autoscale is not None and not isinstance(autoscale, Autoscale):
            raise TypeError(f"autoscale must be a dbsp_core.Autoscale or None, got {type(autoscale).__name__}")
        use_jemalloc()  # dbsp_core/arrow_pool.py: with DBSP_JEMALLOC=1, Arrow's pool becomes jemalloc
        ShardMap(workers, shard_bits)  # validates shard_bits against workers before anything is created
        limit = parse_memory_limit(memory_limit)
        if limit is None and (executor is None or executor.kind == "embedded"):
            limit = settings().memory_limit  # the setting is the embedded executor's only (a staged one's tasks
            # take a budget from the argument alone), also for the check of spill_dir below
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise TypeError(f"spill_dir must be a directory path or None, got {type(spill_dir).__name__}")
        if spill_dir is not None and limit is None:
            raise ValueError("spill_dir is where batches beyond memory_limit go: give memory_limit too")
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a directory path or None, got {type(cache_dir).__name__}")
        remote = is_remote(storage)
        if cache_dir is not None and not remote:
            raise ValueError("cache_dir is the local cache of an object store: give storage='s3://...' (or another "
                             "store's URI) too")
        if store_options is not None and not isinstance(store_options, StoreOptions):
            raise TypeError(f"store_options must be a dbsp_core.StoreOptions or None, got "
                            f"{type(store_options).__name__}")
        if store_options is not None and not remote:
            raise ValueError("store_options says how to talk to an object store: give storage='s3://...' (or another "
                             "store's URI, or a pyarrow.fs.FileSystem) too")
        if storage is not None and not remote and not isinstance(storage, (str, os.PathLike)):
            raise TypeError(f"storage must be a directory, an object store's URI or a pyarrow.fs.FileSystem, got "
                            f"{type(storage).__name__}")
        self.circuit = circuit
        self.executor: Executor = executor if executor is not None else EmbeddedExecutor(vfs=vfs)
        # an object store (dbsp_core.runtime.remote_state): the pipeline runs on a local cache directory
        self._remote: Remote | None = None
        self._remote_state: RemoteCheckpoints | None = None
        self._own_cache: str | None = None
        self._store_options = store_options if store_options is not None else StoreOptions()
        self.storage_uri: str | None = None
        self._stage_store: StageStore | None = None
        if remote:
            if self.executor.kind != "embedded" and not getattr(self.executor, "takes_store", False):
                raise DbspError(f"storage={storage!r}: the {self.executor.kind} executor cannot keep its state in an "
                                f"object store; use the embedded or the staged executor")
            if cache_dir is None:
                cache_dir = self._own_cache = tempfile.mkdtemp(prefix="dbsp-cache-")
            self._remote = Remote.of(storage, os.fspath(cache_dir))
            self._remote.policy = self._store_options.policy()
            if getattr(self.executor, "takes_store", False):  # runtime/stage_store.py: the tasks reach the store
                self._stage_store = StageStore.of(storage, self._remote.location.name,
                                                  getattr(self.executor, "task_cache_dir", None))
            self.storage_uri = self._remote.shown
            storage = cache_dir
        self.storage: str | None = None if storage is None else os.fspath(storage)
        self.checkpoint_interval = checkpoint_interval
        self.output_retention = output_retention
        self._vfs = vfs
        self._clock = clock if clock is not None else time.time_ns
        self._inputs = {name: circuit.nodes[i].schema for name, i in circuit.inputs.items()}
        self._out_schemas = {name: circuit.nodes[i].schema for name, i in circuit.outputs.items()}
        self._keys = dict(circuit.primary_keys)  # inputs with a primary key (operators/upsert.py)
        # inputs declared append-only: pushes with a weight other than positive are refused (operators/input.py)
        self._append_only = {name for name, i in circuit.inputs.items() if circuit.nodes[i].append_only}
        self._readable = ReadableState(circuit)  # what view() and query() read (invariant 9)
        # the lock of _cond, entered directly where nothing waits or notifies (a Condition's own __enter__ is a call of
        # Python: ~1.5k instructions, five a 1k-row step of two pushes)
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._step_lock = threading.RLock()
        # invariant 8: checkpoint, close and rescale wait on it (holding the step lock) while a rescale runs
        self._layout_idle = threading.Condition(self._step_lock)
        self._closing = False
        self._closed = False
        self._inflight = 0
        self._inflight_keys: set[tuple[str, int]] = set()
        self._seen = SeenSet()
        self._pending: list[tuple[str, ZSet]] = []
        # the backlog: rows and bytes pushed and not yet divided into a step, and when the oldest came (monotonic)
        self._backlog_rows = self._backlog_bytes = 0
        self._backlog_since: float | None = None
        self._row_widths: dict[str, tuple[pa.Schema, int | None]] = {}  # per input: (its schema, row_width of it)
        self._autoscaler: Autoscaler | None = None
        # with storage: each pending push's place in the input log (its entry -> the log's ticket), by which a step's
        # pushes are ordered when it is divided, as recovery reads them (the last row of a key wins, upsert.py)
        self._tickets: dict[tuple[str, str, int], int] = {}
        self._unsynced = 0  # the last ticket of a reference push acknowledged before its fsync (invariant 1)
        self._step_inputs: list[tuple[str, str, int]] = []
        self._anon_seq = 0  # the seq of the next anonymous push: its identity for StepError and discard
        self.step_error: StepError | None = None  # the failure of the step waiting at the head of the queue
        self._queue: list[Divided] = []
        self._broken: BaseException | None = None
        self.steps = 0  # steps run
        self._open_step = 0  # the step the next push belongs to
        self._now_floor = 0
        self._last_now: int | None = None  # now of the last step run (the next step's prev_now)
        self.now_ns: int | None = None
        self.seed: int | None = None
        # event time (dbsp_core.time.watermark): the watermarks after the last step run (in force in the next),
        # after the last step divided, and the late rows dropped since the pipeline was opened
        self._event_time = specs_of(circuit)
        self.watermarks: dict[str, int] = {name: NO_WATERMARK for name in self._event_time}
        self._wm_divided = dict(self.watermarks)
        self.late_rows: dict[str, int] = {name: 0 for name in self._event_time}
        self.last_rescale: dict | None = None
        self._stopping = False  # close() began: pushes are refused (invariant 8)
        self._waiting = 0  # steps waiting for the step lock (a live rescale lets them run between its waves)
        # a live rescale in progress (invariant 8; rescale.py invariant 4): {from_workers, to_workers, batches (its
        # waves), done, moved_shards, last_pause_ms}; None when none runs
        self.rescale_progress: dict | None = None
        self.fingerprint = circuit_fingerprint(circuit)
        self._owed: Owed | None = None  # a program change's first step not yet run (change.py invariant 5)
        self._ckpt_thread: threading.Thread | None = None
        stop_at_exit(self)  # never closed: a background checkpoint ends before Python finalizes (trace/at_exit.py)
        self._syncer: ThreadPoolExecutor | None = None
        self._division_sync: Future | None = None
        self._input: StepLog | None = None
        self._output: OutputLog | None = None
        # with storage: {view: input} for views that are an input itself, logged as references to the pushes'
        # records instead of a second copy of their rows (outputlog.py invariant 7)
        self._ref_outputs: dict[str, str] = {}
        self._driver_db: Database | None = None
        # with an object store: the input and output logs as segment objects in it (storage/remote_log.py); a
        # push is acknowledged once the object holding it is there
        self._remote_logs: RemoteLogs | None = None
        self._lockfd: int | None = None
        self.stats = self.executor.stats  # one dict: the executor's counters beside the driver's
        self.stats.update({"pushes": 0, "duplicates": 0, "checkpoints": 0, "last_checkpoint_s": 0.0,
                           "recovery_s": 0.0, "replayed_steps": 0, "recovered_pushes": 0,
                           "late_rows": self.late_rows,
                           # seconds of step() in the executor (the circuit) and in logging its output
                           "step_engine_s": 0.0, "step_log_s": 0.0})
        self._metrics = Metrics(list(self._inputs), list(self._out_schemas))  # dbsp_core.metrics
        self.consumers: ConsumerRegistry | None = None  # with storage: who still needs which output steps
        self._last_checkpoint = time.monotonic()
        # an explicit memory_limit on an executor that cannot spill is refused by it (Executor.spill)
        self._memory_limit = limit
        self._spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        if self.storage is None:
            self._start_spilling()
            decide_stored(circuit)  # the columns joins and windows keep (runtime/prune.py); with storage: META's
            self.executor.start(circuit, Layout.local(workers, shard_bits), None)
        else:
            try:
                self._open_storage(workers, shard_bits, segment_bytes, replay_check, output_sync, _rescale_to,
                                   _open_only)
            except BaseException:
                self._shutdown()
                raise
            self._last_checkpoint = time.monotonic()
        if autoscale is not None:
            self._autoscaler = Autoscaler(self, autoscale, self._capacity)

    @classmethod
    def open(cls, path: Any, circuit: Circuit, workers: int | None = None, **kwargs: Any) -> "Pipeline":
        """Recover the pipeline stored in directory ``path`` after a stop or a crash.

        ``workers`` continues it at another worker count (a cold rescale: only the shards whose owner changes
        are copied, committed atomically as a new checkpoint version; see dbsp_core.runtime.rescale); None keeps
        the stored count. ``p.last_rescale`` reports what moved. Other keyword arguments are as for the
        constructor (``executor`` must be of the kind that wrote the directory).
        """
        if is_remote(path):  # an object store: its newest manifest says whether it holds a pipeline
            root = path
        else:
            root = os.fspath(path)
            if not os.path.isdir(root):
                raise FileNotFoundError(f"Pipeline.open: no storage directory {root!r}")
            if not os.path.exists(os.path.join(root, META_FILE)):
                raise RecoveryError(f"Pipeline.open: {root!r} holds no pipeline (META is missing)")
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
            raise ValueError(f"Pipeline.open: workers must be a positive int or None, got {workers!r}")
        return cls(circuit, 1, DEFAULT_SHARD_BITS, root, _rescale_to=workers, _open_only=True, **kwargs)

    def _start_spilling(self) -> None:
        """Give the executor its batch store when a memory budget is set (trace invariant 12)."""
        if self._memory_limit is None:
            return
        if self.executor.task_budget(self._memory_limit, self._spill_dir):
            return  # the traces live in task processes, which keep the budget (staged.py invariant 6)
        directory = self._spill_dir
        if directory is None and self.storage is not None:
            directory = os.path.join(self.storage, SPILL_DIR)
        # durable: under the storage directory, where checkpoints name the files (trace invariant 13)
        self.executor.spill(BatchStore(self._memory_limit, directory,
                                       durable=self.storage is not None and self._spill_dir is None, vfs=self._vfs))

    # ---- storage: create or recover ----

    def _open_storage(self, workers: int, shard_bits: int, segment_bytes: int, replay_check: bool,
                      output_sync: bool, rescale_to: int | None, open_only: bool) -> None:
        """Create or recover the storage directory (invariant 6: the order and the checks are recovery.py's)."""
        root = self.storage
        assert root is not None
        os.makedirs(root, exist_ok=True)
        new_remote = False
        if self._remote is not None:
            prepare_cache(root)  # an empty directory or a cache: refused before anything is written in it
        self._lockfd = lock_dir(root)
        if self._remote is not None:  # rebuild the cache from the newest manifest, then journal (remote_state inv. 1-2)
            t_restore = time.perf_counter()
            with progress(f"restore from {self.storage_uri}"):
                self._remote_logs = RemoteLogs(self._remote, group_commit_s=self._store_options.group_commit_s)
                if open_only and not self._remote.manifest_versions():
                    raise RecoveryError(f"Pipeline.open: {self.storage_uri} holds no pipeline (no manifest)")
                lease = self._remote.take_lease()  # before the manifest is read (storage.remote invariant 6)
                self._remote_logs.fence = functools.partial(self._remote.check_lease, lease)  # logstore inv. 2b
                manifest = restore(self._remote, root, self._remote_logs)
            self.stats["restore_s"] = time.perf_counter() - t_restore  # the download into the empty cache
            if manifest is None and open_only:
                raise RecoveryError(f"Pipeline.open: {self.storage_uri} holds no pipeline (no manifest)")
            if self._stage_store is not None and manifest is not None:  # before the claim (stage_check rule 2)
                check_present(self._remote, manifest)
            # with a restored manifest, commits this writer's claim before the logs are opened
            self._remote_state = RemoteCheckpoints(self._remote, root, manifest, self._remote_logs, lease)
            new_remote = manifest is None
            if self._stage_store is not None:  # the stage chains the manifest names (stage_store invariant 5)
                chains = StageChains(self._remote, None if manifest is None else manifest.get("stages"))
                self.executor.use_store(self._stage_store, chains)  # type: ignore[attr-defined]
                self._remote_state.state_part = chains
        self._start_spilling()  # after the lock: the store clears the spill directory of an earlier process
        opened = open_directory(root, self.executor, self.circuit, self.fingerprint, self._inputs, self._out_schemas,
                                workers=workers, shard_bits=shard_bits, open_only=open_only,
                                segment_bytes=segment_bytes, replay_check=replay_check, output_sync=output_sync,
                                stats=self.stats, crashpoint=crashpoint, vfs=self._vfs, rescale_to=rescale_to,
                                logs=self._remote_logs)
        self._input, self._output, self._driver_db = opened.input, opened.output, opened.driver_db
        self.consumers = opened.consumers
        if self._remote_logs is None:  # an object store keeps its log copies apart: its output holds the rows
            plain = {i: n for n, i in self.circuit.inputs.items() if n not in self._keys}
            self._ref_outputs = {o: plain[i] for o, i in self.circuit.outputs.items() if i in plain}
        t0 = time.perf_counter()
        step, self.last_rescale = settle_state(root, self.executor, self.circuit, opened.layout, opened.last_rescale,
                                               rescale_to, self.stats, crashpoint, self._vfs)
        log = LogReplay(root, self._input, self._output, self._driver_db, self._inputs, self._event_time, self._seen)
        x = log.record_step if step is None else step  # an executor without state resumes at the driver's record
        # a program change (change.py): META names the new circuit before any step runs
        change, meta = prepare_change(root, opened.meta, opened.changed, self.circuit, x, self._output.last,
                                      opened.differences)
        if meta is not None:
            crashpoint("change-meta")
            write_meta(root, meta, self._vfs)
            self._output.since = dict(meta["since"])
        if change is not None:
            self.executor.rename_state(change.renames)
        self.executor.load_state(x)
        self._resume_counters(root, x)
        with progress("recovery replay", unit=" steps") as shown:
            log.catch_up(x)
            self.steps = self._open_step = x
            self._last_now = self.now_ns = log.prev_now
            self.watermarks = dict(log.watermarks)
            if change is not None:  # change.py invariant 5: the built nodes from the tables' contents at x
                self._owed = bootstrap(self.executor, self.circuit, change, x,
                                       log.prev_now if log.prev_now is not None else log.now_floor)
                self.stats["program_change"] = {"step": change.step, "rebuilt": change.rebuilt,
                                                "kept_nodes": len(change.renames), "built_nodes": len(change.built)}
            for run in log.divided(shown):
                self._replay(run)
        tail = log.tail()
        for handle, z, entry in tail:
            self._pending.append((handle, z))
            self._step_inputs.append(entry)
            self._queued(z.num_rows, self._push_bytes(handle, z))
        self.stats["recovered_pushes"] = len(tail)
        self._open_step = log.next_step
        self._now_floor, self._wm_divided, self._anon_seq = log.now_floor, log.watermarks, log.anon_seq
        self.stats["recovery_s"] = time.perf_counter() - t0
        if new_remote:  # the store holds the pipeline from its first manifest on (META, the layout, step 0)
            self._checkpoint(True)
            self._join_checkpoint()

    def _resume_counters(self, root: str, step: int) -> None:
        """The metrics counters go on from the last checkpoint's METRICS record (metrics.Metrics.resume). METRICS
        only informs: a damaged or missing one (``dbsp repair`` leaves it) starts them over, ``steps`` at ``step``."""
        try:
            counters = read_record(os.path.join(root, METRICS_FILE), METRICS_MAGIC, self._vfs) or {}
            dups = int(counters.get("duplicates", 0))
            late = {n: int(v) for n, v in (counters.get("late_rows") or {}).items() if n in self.late_rows}
            self._metrics.resume(counters, step)
        except (CorruptionError, TypeError, ValueError, AttributeError):
            self._metrics.resume(None, step)
            return
        self.stats["duplicates"] = dups
        self.late_rows.update(late)

    def _replay(self, run: list[Divided]) -> None:
        """Run divided steps again; once one fails on its data (invariant 7), it and every later one wait."""
        if not run:
            return
        if self.step_error is not None:
            self._queue.extend(run)
            return
        try:
            self._run(run, replay=True)
        except StepError:  # _run queued the failed step and the rest of the step run
            pass
        self.stats["replayed_steps"] += len(run) - len(self._queue)

    # ---- input ----

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise DbspError(f"the pipeline is broken by a failed step ({self._broken!r}); "
                            + ("reopen it with Pipeline.open" if self.storage else "create a new one"))
        if self._closed:
            raise DbspError("the pipeline is closed")

    def _to_zset(self, handle: str, data: Any, weights: Any) -> ZSet:
        schema = self._inputs[handle]
        if isinstance(data, ZSet):
            if weights is not None:
                raise TypeError(f"push({handle!r}): weights= is only for Arrow data; a ZSet carries its own")
            z = data
        elif (table := data if type(data) is pa.Table else as_table(data, schema, f"push({handle!r})")) is not None:
            if table.schema.equals(schema):  # the input's own schema (its types were checked when declared)
                if weights is None:
                    return ZSet._make(table, ones(table.num_rows))
                if (isinstance(weights, np.ndarray) and weights.dtype == np.int64 and weights.ndim == 1
                        and weights.shape[0] == table.num_rows):
                    return ZSet._make(table, weights.copy())  # a copy: a Z-set is a value
            wname = weight_column(schema)  # the to_arrow() form: data columns + the weight column
            if weights is None and wname in table.column_names:
                col = table.column(wname)
                if not pa.types.is_integer(col.type):
                    raise TypeError(f"push({handle!r}): the {wname!r} column must be an integer type, got {col.type}")
            table = conform(table, schema, f"push({handle!r})", weight=None if weights is not None else wname)
            if table.num_columns > len(schema):
                weights = table.column(len(schema))
                table = table.remove_column(len(schema))
            if weights is not None and isinstance(weights, np.ndarray) and weights.dtype.kind not in "iu":
                raise TypeError(f"push({handle!r}): weights must be integers, got dtype {weights.dtype}")
            z = ZSet.from_arrow(table, weights=weights)
        else:
            raise TypeError(f"push({handle!r}): expected a ZSet, pyarrow Table or RecordBatch, pandas or polars "
                            f"DataFrame, dict of columns, or list of row dicts or row tuples; got "
                            f"{type(data).__name__}")
        if not same_columns(z.schema, schema):
            raise SchemaError(f"push({handle!r}): Z-set columns {_fmt(z.schema)} do not match the input schema "
                              f"{_fmt(schema)}")
        if not z.schema.equals(schema):
            z = ZSet._make(z.data.cast(schema), z.weights)
        return z

    def push(self, handle: str, data: PushData, weights: Any = None, *, producer: str | None = None,
             seq: int | None = None) -> Ack | None:
        """Queue ``data`` (a change: a ZSet, or rows with optional int ``weights``, one per row) for the next step.

        Rows come as a pyarrow Table or RecordBatch, a pandas or polars DataFrame (polars is not a dependency), a
        dict of columns (lists, numpy or Arrow arrays) or a list of row dicts (a key missing from a row is null) or
        of row tuples (in the input's column order). Columns are taken by name and cast safely to the input's types,
        as ``FileSource`` does: an int64 value that fits an INT column is taken, one that does not (or a float with a
        fraction) is a SchemaError naming the column and the row. An extra integer column named like the one
        :meth:`ZSet.to_arrow` adds (``weight``) gives the rows' weights. Raises (KeyError, TypeError, SchemaError)
        and records nothing if the handle is unknown, the data is none of these forms, a column is missing or is
        not the input's, a value does not cast, or weights are not ints.

        Into a table with a primary key (``PRIMARY KEY``, ``Circuit.input(..., primary_key=[...])``) a row with
        weight +1 inserts or replaces the row of its key (the view sees the old row retracted) and a row with
        weight -1 deletes the row of its key whatever its other columns hold (:meth:`delete` pushes such rows);
        when a step holds several rows of one key, the last one wins: pushes in the order they are recorded (from one
        thread, the order of the calls; concurrent ones in the input log's order, the order recovery replays),
        rows in their order within a push. Any other weight, or a null key value, raises PrimaryKeyError and
        records nothing.

        With storage, returns an :class:`Ack` once the push is durable in the input log; with ``producer`` and
        ``seq`` the push is idempotent across crashes: a pair already recorded is acknowledged again with
        ``duplicate=True`` and counted once. Keep each producer's seqs dense from 0 (any order) to keep the
        dedup state small. Thread-safe: concurrent pushes share fsyncs (so do the pushes of one :meth:`push_many`).
        In memory, returns None.
        """
        if self.storage is None and producer is None and seq is None:
            return self._push_memory(handle, data, weights)
        return self._push_all([self._prepare(handle, data, weights, producer, seq)])[0]

    def _push_memory(self, handle: str, data: Any, weights: Any) -> None:
        """:meth:`push` into an in-memory pipeline without a producer: what :meth:`_prepare` and :meth:`_push_all`
        do for it (the same validation, whole before anything is queued: invariant 1), without their record and
        acknowledgement, which it has none of (~20k instructions of a 1k-row step's two pushes)."""
        if self._broken is not None or self._closed:  # (_check_usable's test, without its call on the usual path)
            self._check_usable()
        z = self._checked(handle, data, weights)
        nbytes = self._push_bytes(handle, z)
        self._metrics.pushed(handle, z.num_rows)
        with self._mutex:
            self._queue_anonymous(handle, z, nbytes)

    def _queue_anonymous(self, handle: str, z: ZSet, nbytes: int) -> None:
        """An in-memory push joins the open step, with its own seq (call with ``_cond``)."""
        self._queued(z.num_rows, nbytes)
        self._pending.append((handle, z))
        self._step_inputs.append((handle, "", self._anon_seq))
        self._anon_seq += 1

    def push_many(self, pushes: Any) -> list[Ack | None]:
        """Several pushes, each as :meth:`push` takes it, recorded together: one fsync of the input log for all of
        them instead of one each; returns their acknowledgements in order (with storage, once all are durable).

        Each item is a tuple ``(handle, data)`` or ``(handle, data, weights)``, or a dict of :meth:`push`'s
        arguments (``handle``, ``data`` and optionally ``weights``, ``producer``, ``seq``). Every item is validated
        before any is recorded: one bad item raises and records none (invariant 1). The pushes belong to one
        step, in this order (the input log's); a ``(producer, seq)`` already recorded is acknowledged as a
        duplicate, and one named twice in the list raises ValueError. A crash before this returns may keep any
        prefix of the new pushes (none acknowledged): retry them with the same producer and seq.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> s = pa.schema([("x", pa.int64())])
        >>> c.output("a", c.input("a", s)); c.output("b", c.input("b", s))
        >>> p = dbsp.Pipeline(c)
        >>> p.push_many([("a", [(1,)]), {"handle": "b", "data": [(2,)], "weights": [3]}])
        [None, None]
        >>> out = p.step(); out["a"].to_dict(), out["b"].to_dict()
        ({(1,): 1}, {(2,): 3})
        """
        self._check_usable()
        if isinstance(pushes, (str, bytes, dict)) or not hasattr(pushes, "__iter__"):
            raise TypeError(f"push_many: give a list of pushes ((handle, data[, weights]) tuples or dicts of push's "
                            f"arguments), got {type(pushes).__name__}")
        prepared = []
        for i, item in enumerate(pushes):
            if isinstance(item, dict):
                unknown = set(item) - {"handle", "data", "weights", "producer", "seq"}
                if unknown or "handle" not in item or "data" not in item:
                    raise TypeError(f"push_many: item {i} must name handle and data (and optionally weights, "
                                    f"producer, seq); got keys {sorted(item)}")
                args = (item["handle"], item["data"], item.get("weights"), item.get("producer"), item.get("seq"))
            elif isinstance(item, tuple) and len(item) in (2, 3):
                args = (item[0], item[1], item[2] if len(item) == 3 else None, None, None)
            else:
                raise TypeError(f"push_many: item {i} must be a (handle, data[, weights]) tuple or a dict of push's "
                                f"arguments, got {type(item).__name__}")
            prepared.append(self._prepare(*args))
        named = [(x.producer, x.seq) for x in prepared if x.producer is not None]
        if len(set(named)) != len(named):
            twice = sorted({k for k in named if named.count(k) > 1})
            raise ValueError(f"push_many: (producer, seq) {twice[0]} is named more than once in one call; each push "
                             f"needs its own seq")
        return self._push_all(prepared) if prepared else []

    def _push_reference(self, handle: str, z: ZSet, reference: bytes, producer: str, seq: int) -> Ack | None:
        """:meth:`push` of ``z``, the rows of a unit of an immutable file, whose input-log record is ``reference``
        (dbsp_core.storage.fileref) instead of the rows: recovery reads them again from the file. Acknowledged
        once the record has its place in the log, before its fsync (invariant 1). For FileSource with
        ``immutable_files=True``; a pipeline whose storage is an object store logs the rows (its log must not
        depend on this machine's files) and acknowledges them once durable."""
        x = self._prepare(handle, z, None, producer, seq, reference)
        return self._push_all([x], sync=x.payload is not None and x.payload[0] is not reference)[0]

    def _prepare(self, handle: str, data: Any, weights: Any, producer: str | None, seq: int | None,
                 reference: bytes | None = None) -> "_Prepared":
        """Validate one push completely and, with storage, encode its record (invariant 1); records nothing."""
        self._check_usable()
        if (producer is None) != (seq is None):
            raise TypeError("push: give both producer= and seq=, or neither")
        if producer is not None:
            if self.storage is None:
                raise TypeError("push: producer= and seq= need a durable pipeline (storage=<dir>)")
            if not isinstance(producer, str) or not producer:
                raise TypeError(f"push: producer must be a non-empty str, got {producer!r}")
            try:
                size = len(producer.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise ValueError(f"push: the producer id must be valid UTF-8 (it is stored and logged as UTF-8): "
                                 f"{e.reason} at index {e.start} of {producer[:40]!r}") from None
            if size > MAX_PRODUCER_BYTES:
                raise ValueError(f"push: a producer id of {size} bytes is longer than the limit of "
                                 f"{MAX_PRODUCER_BYTES} bytes (UTF-8)")
            if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**63:
                raise TypeError(f"push: seq must be an int in [0, 2**63), got {seq!r}")
        z = self._checked(handle, data, weights)
        if self.storage is None:
            return _Prepared(handle, z, None, self._push_bytes(handle, z), producer, seq)
        if not z.weights.flags.writeable:  # Arrow-backed weights are read-only; the kernels need writable ones
            z = ZSet._make(z.data, z.weights.copy())
        if reference is not None and self._remote is None:
            return _Prepared(handle, z, [reference], self._push_bytes(handle, z), producer, seq)
        head, body = encode_zset_parts(z)  # gathered by the log, never joined into one more copy of the push
        nbytes = len(head) + body.size
        if nbytes > MAX_PUSH_BYTES:  # invariant 1: refused before anything is recorded
            raise ValueError(f"push({handle!r}): the batch is {nbytes} bytes encoded, more than the limit of "
                             f"{MAX_PUSH_BYTES} bytes of one input-log record; push it in smaller parts")
        return _Prepared(handle, z, [head, body], nbytes, producer, seq)

    def _checked(self, handle: str, data: Any, weights: Any) -> ZSet:
        """The change a push of ``data`` (and ``weights``) to ``handle`` makes, validated (invariant 1): raises
        and records nothing if the handle is unknown, the data does not conform, or a keyed or append-only input
        refuses it."""
        if handle not in self._inputs:
            raise KeyError(f"push: unknown input handle {handle!r}; inputs are {sorted(self._inputs)}")
        z = self._to_zset(handle, data, weights)
        if handle in self._keys:  # operators/upsert.py invariant 2: refused before anything is recorded
            check_keyed(z, self._keys[handle], f"push({handle!r})")
        if handle in self._append_only and len(z.weights) and int(z.weights.min()) <= 0:
            bad = int(np.flatnonzero(z.weights <= 0)[0])
            raise AppendOnlyError(f"push({handle!r}): input {handle!r} is append-only, but row {bad} has weight "
                                  f"{int(z.weights[bad])}; push only inserts (positive weights) into it, or declare "
                                  f"it without append_only to push deletions")
        return z

    def _push_all(self, batch: list["_Prepared"], sync: bool = True) -> list[Ack | None]:
        """Record validated pushes (invariants 1 and 2): admit them together into the open step, append their
        records to the input log and fsync once (not ``sync``: only place them in the log's order, for pushes
        logged by reference), then queue them; returns their acknowledgements in order."""
        if self.storage is None:
            for x in batch:
                self._metrics.pushed(x.handle, x.z.num_rows)
            with self._cond:
                for x in batch:
                    self._queue_anonymous(x.handle, x.z, x.nbytes)
            return [None] * len(batch)
        acks: list[Ack | None] = [None] * len(batch)
        with self._cond:
            while True:  # admitted all at once: a batch never holds some pairs while it waits for others
                if self._stopping:
                    raise DbspError(f"push({batch[0].handle!r}): the pipeline is closing; nothing was recorded")
                if self._closing or any((x.producer, x.seq) in self._inflight_keys for x in batch
                                        if x.producer is not None):
                    self._cond.wait()
                    continue
                break
            new = []
            for i, x in enumerate(batch):
                if x.producer is None:
                    new.append((i, x, "", self._anon_seq))  # an anonymous push's own seq
                    self._anon_seq += 1
                elif self._seen.has(x.producer, x.seq):
                    self.stats["duplicates"] += 1
                    acks[i] = Ack(None, x.producer, x.seq, True)
                else:
                    new.append((i, x, x.producer, x.seq))
                    self._inflight_keys.add((x.producer, x.seq))
            if not new:
                return acks
            step = self._open_step
            self._inflight += len(new)
        tickets: list[int] = []
        try:
            crashpoint("push-append")
            assert self._input is not None
            for _, x, prod, sq in new[:-1]:  # placed in the log's order one after the other, fsynced together
                tickets.append(self._input.enqueue(step, x.handle, x.payload, producer=prod, seq=sq))
            if tickets:
                crashpoint("push-enqueued")  # in the log's order, not yet durable: a crash may keep any prefix
            _, x, prod, sq = new[-1]
            if sync:
                tickets.append(self._input.append(step, x.handle, x.payload, producer=prod, seq=sq))  # the one fsync
            else:
                tickets.append(self._input.enqueue(step, x.handle, x.payload, producer=prod, seq=sq))
            crashpoint("push-acked")
        except BaseException as exc:
            # the records may or may not be durable: only recovery (which reads the log) can tell, so a retry in
            # this process could count one twice; stop accepting work (like a failed fsync in a database). A
            # ValueError of the first record is the log refusing it before it entered the log: nothing was written.
            with self._cond:
                if tickets or not isinstance(exc, ValueError):
                    self._broken = exc
                self._inflight -= len(new)
                for _, _, prod, sq in new:
                    self._inflight_keys.discard((prod, sq))
                self._cond.notify_all()
            raise
        with self._cond:
            if not sync:
                self._unsynced = max(self._unsynced, tickets[-1])
            for (i, x, prod, sq), ticket in zip(new, tickets):
                self._queued(x.z.num_rows, x.nbytes)
                self._pending.append((x.handle, x.z))
                self._step_inputs.append((x.handle, prod, sq))
                self._tickets[(x.handle, prod, sq)] = ticket
                if x.producer is not None:
                    self._seen.add(prod, sq)
                    self._inflight_keys.discard((prod, sq))
                self.stats["pushes"] += 1
                self._metrics.pushed(x.handle, x.z.num_rows)
                acks[i] = Ack(step, prod, sq, False)
            self._inflight -= len(new)
            self._cond.notify_all()
        return acks

    def _push_bytes(self, handle: str, z: ZSet) -> int:
        """A push's bytes in the backlog (``backlog_bytes``): its weights and its rows' values; for an input whose
        columns are all fixed-width, rows times :func:`row_width` of its schema (``Table.nbytes`` walks every
        buffer's byte ranges: ~84k instructions a push, 3-4% of a 1k-row step), else ``Table.nbytes``. The width
        is computed once per input schema (``z`` has the input's schema: :meth:`_to_zset` conforms it)."""
        schema = self._inputs.get(handle)
        if schema is None:  # not an input of this circuit (never from push, which checks the handle)
            return z.data.nbytes + z.weights.nbytes
        got = self._row_widths.get(handle)
        if got is None or got[0] is not schema:
            got = self._row_widths[handle] = (schema, row_width(schema))
        width = got[1]
        return (z._data.nbytes if width is None else z.num_rows * width) + z._w.nbytes

    def _queued(self, rows: int, nbytes: int) -> None:
        """A push joins the backlog (call with ``_cond``)."""
        self._backlog_rows += rows
        self._backlog_bytes += nbytes
        if self._backlog_since is None:
            self._backlog_since = time.monotonic()

    def _backlog(self, now: float) -> tuple[int, int, float]:
        """Rows and bytes pushed and not yet divided into a step, and the age in seconds of the oldest."""
        with self._cond:
            since = self._backlog_since
            return self._backlog_rows, self._backlog_bytes, 0.0 if since is None else max(0.0, now - since)
    def delete(self, handle: str, keys: Any, *, producer: str | None = None, seq: int | None = None) -> Ack | None:
        """Delete, in the next step, the rows of table ``handle`` (which has a primary key) whose keys are ``keys``.

        ``keys`` holds the key columns in any form :meth:`push` takes (an Arrow table, a pandas DataFrame, a dict of
        columns, a list of row dicts or tuples), or, for a one-column key, a list or array of key values. A key the
        table does not hold deletes nothing. It is a push of the keys with weight -1 (other columns null): durable,
        idempotent with ``producer`` and ``seq``, and ordered with the other pushes of its step (the last row of a
        key wins). PrimaryKeyError if the table has no primary key, declares an event time (push the whole rows with
        weight -1 instead) or a key value is null.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.utf8())]), primary_key=["k"])
        >>> c.output("t_changes", t)
        >>> p = dbsp.Pipeline(c)
        >>> p.push("t", [(1, "a"), (2, "b")]); _ = p.step()
        >>> p.delete("t", [1]); p.step()["t_changes"].to_dict()
        {(1, 'a'): -1}
        """
        self._check_usable()
        if handle not in self._inputs:
            raise KeyError(f"delete: unknown input handle {handle!r}; inputs are {sorted(self._inputs)}")
        key = self._keys.get(handle)
        where = f"delete({handle!r})"
        if key is None:
            raise PrimaryKeyError(f"{where}: table {handle!r} has no primary key, so there is nothing to delete by; "
                                  f"declare one (PRIMARY KEY, or Circuit.input(..., primary_key=[...])), or push the "
                                  f"rows to delete with weight -1")
        if handle in self._event_time:  # its other columns are null: a null event time is a late row, dropped
            raise PrimaryKeyError(f"{where}: table {handle!r} declares an event time, which a delete by key does not "
                                  f"carry; push the whole rows to delete with weight -1 (their event time decides "
                                  f"whether they are late)")
        rows = key_rows(keys, self._inputs[handle], key, where)
        z = ZSet._make(rows, np.full(rows.num_rows, -1, dtype=np.int64))
        return self.push(handle, z, producer=producer, seq=seq)

    def acknowledged(self, producer: str, seq: int) -> bool:
        """Whether the push ``(producer, seq)`` is durably recorded, so pushing it again would be a duplicate
        (a source that restarts skips reading what it had pushed)."""
        with self._cond:
            return self._seen.has(producer, seq)

    # ---- steps ----

    def _divide(self, wait: bool) -> Divided:
        """Close the open step (invariant 3); with storage, log its division record. Call with ``_step_lock``.

        With ``wait`` the record is durable when this returns; without, it is placed in the log's order and
        fsync'd on a background thread, and :meth:`_await_division` must return before any output of the step
        is written or released."""
        with self._mutex:
            self._closing = True
            try:
                while self._inflight:
                    self._cond.wait()
                step = self._open_step
                pushes, self._pending = self._pending, []
                self._backlog_rows = self._backlog_bytes = 0
                self._backlog_since = None
                entries, self._step_inputs = self._step_inputs, []
                if self._tickets:  # in the input log's order, as recovery reads them (invariant 1)
                    order = sorted(range(len(entries)), key=lambda i: self._tickets.get(entries[i], 0))
                    pushes, entries = [pushes[i] for i in order], [entries[i] for i in order]
                    self._tickets = {}
                now_ns, seed = max(int(self._clock()), self._now_floor), random.getrandbits(63)
                self._now_floor = now_ns  # now never goes back, even if the wall clock does
                in_force = dict(self._wm_divided)  # operators see the watermarks after the previous step
                after, late = advance(self._event_time, in_force, pushes) if self._event_time else ({}, {})
                if self._input is not None:
                    crashpoint("step-divide")
                    division = {"step": step, "pushes": len(pushes), "now_ns": now_ns, "seed": seed}
                    if self._event_time:
                        division["watermarks"] = after
                    record = encode_json(DIVISION_MAGIC, division)
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
                self._wm_divided = after if self._event_time else self._wm_divided
            finally:
                self._closing = False
                if self.storage is not None:  # in memory no thread waits on _cond: no push is ever in flight
                    self._cond.notify_all()  # (nor waits for _closing); ~3k instructions a step
        # the pushes' seq ranges go to the output log only: none without one (in memory), where they cost ~2 us a step
        return Divided(StepInput(step, pushes, now_ns, None, seed, in_force),
                       ranges(entries) if self._output is not None else [], after, late, entries)

    def _await_division(self, quiet: bool = False) -> None:
        """Wait until the division record of the last ``_divide(wait=False)`` is durable (invariant 3)."""
        f, self._division_sync = self._division_sync, None
        if f is None:
            return
        try:
            f.result()
        except BaseException as exc:
            self._broken = exc  # the division may or may not be durable: only recovery knows
            if not quiet:
                raise

    def _run(self, run: list[Divided], replay: bool = False) -> list[dict[str, ZSet]]:
        """Run divided steps on the executor and log their output (invariants 3 and 4). Call with ``_step_lock``."""
        steps = []
        prev = self._last_now
        for d in run:  # a keyed table's pushes of a step as one change, the last row of each key kept
            i = d.input  # (built, not _replace'd: ~3k instructions less a step)
            steps.append(StepInput(i.step, keep_last(i.pushes, self._keys) if self._keys else i.pushes, i.now_ns,
                                   prev, i.seed, i.watermarks))
            prev = i.now_ns
        t0 = time.perf_counter()
        failed: StepError | None = None
        try:
            try:
                outs = (self.executor.run(steps) if self.storage is None  # (in memory no state is lost: invariant 10)
                        else self._lost_recovered(self.executor.run, run[0].input.step, steps))
            except StepError as exc:  # invariant 7: the executor is as after the steps before the failed one
                failed, outs = exc, list(exc.done)
            t1 = time.perf_counter()
            self.stats["step_engine_s"] += t1 - t0
            crashpoint("step-computed")  # the division record may or may not be durable yet
            if self._division_sync is not None:
                self._await_division()  # invariant 3: durable before any output is written or returned
            crashpoint("step-output")
            by_ref = self._owed is None  # a program change's first step: its views are their contents
            if self._owed is not None:  # change.py invariant 5: a rebuilt view's first output is its contents
                for d, out in zip(run, outs):
                    self._owed.settle(d.input.step, out)
                if self._owed.done:
                    self._owed = None
            if self._output is not None:
                # invariant 4: several steps of one call share one fsync (outputlog.py invariant 2: each record is
                # unread until it, and it comes before the call returns or raises any of them)
                defer = len(outs) > 1 and self._output.sync
                for d, out in zip(run, outs):
                    self._output.write(d.input.step, out, d.ranges, self._refs(d) if by_ref else None, defer=defer)
                    crashpoint("step-written" if not replay else "recover-step")
                if defer:
                    self._output.flush()
                    crashpoint("steps-synced")
            self.stats["step_log_s"] += time.perf_counter() - t1
        except BaseException as exc:
            self._broken = exc  # state has advanced past output that is not logged: recover from the checkpoint
            raise
        finally:
            if self._division_sync is not None:  # the step failed before waiting: settle the fsync
                self._await_division(quiet=True)
        seconds = time.perf_counter() - t0
        self._metrics.stepped([d.input.step for d in run[:len(outs)]], outs, seconds)
        if self._autoscaler is not None and not replay:
            rows = sum(z.num_rows for d in run for _, z in d.input.pushes)
            self._autoscaler.stepped(seconds, rows, self.layout.workers, self.executor.busy)
        if failed is not None:
            self._queue[:0] = run[len(outs):]  # the failed step and those after it wait, divided
            self._advance(run[:len(outs)])
            self.step_error = self._step_failed(failed, run[len(outs)])
            crashpoint("step-failed")
            raise self.step_error from failed.__cause__ or failed
        self.step_error = None
        self._advance(run)
        return outs

    def _lost_recovered(self, call: Callable[..., Any], upto: int, *args: Any) -> Any:
        """``call(*args)`` (the executor's run or checkpoint), after a WorkerStateLostError recovering the state of the
        steps before ``upto`` in place and calling it again (invariant 10)."""
        tries, lost = 0, None
        while True:
            try:
                if lost is not None:
                    self._recover_lost(upto, lost)
                return call(*args)
            except WorkerStateLostError as exc:
                tries += 1
                self.stats["last_state_lost"] = str(exc)[:500]
                if tries > LOST_RECOVERIES:
                    raise
                lost = exc

    def _recover_lost(self, upto: int, exc: BaseException) -> None:
        """Invariant 10: the executor back at its last durable state, the steps from there to ``upto`` run again
        from the input log, their output verified against the output log."""
        assert self.storage is not None and self._input is not None and self._output is not None
        assert self._driver_db is not None
        t = self._ckpt_thread
        if t is not None and t is not threading.current_thread():
            t.join()  # its driver record and truncation are done before the log is read
        try:
            self._recover_lost_steps(upto, exc)
        except WorkerStateLostError:
            raise  # lost again meanwhile: recovered again by the caller (_lost_recovered)
        except BaseException as failed:
            self._broken = failed  # the executor is behind the driver: only open() recovers now
            raise

    def _recover_lost_steps(self, upto: int, exc: BaseException) -> None:
        assert self.storage is not None and self._input is not None and self._output is not None
        assert self._driver_db is not None
        t0 = time.perf_counter()
        x = self.executor.rollback_lost()
        log = LogReplay(self.storage, self._input, self._output, self._driver_db, self._inputs, self._event_time,
                        SeenSet())  # the live seen set is complete; the log's pairs are read into a copy
        log.catch_up(x)
        prev = log.prev_now
        n = 0
        with progress(f"recovery of lost worker state (steps {x}..{upto - 1})", unit=" steps") as shown:
            for run in log.divided(shown):
                run = [d for d in run if d.input.step < upto]
                if run:
                    steps = []
                    for d in run:
                        steps.append(d.input._replace(prev_now_ns=prev, pushes=keep_last(d.input.pushes, self._keys)))
                        prev = d.input.now_ns
                    outs = self.executor.run(steps)
                    for d, out in zip(run, outs):  # steps < the log's end: verified and discarded (invariant 4)
                        self._output.write(d.input.step, out, d.ranges, self._refs(d))
                    n += len(run)
                if not run or run[-1].input.step + 1 >= upto:
                    break
        if x + n != upto:
            raise RecoveryError(f"recovery of lost worker state: replayed steps {x}..{x + n - 1} of the input log, the "
                                f"pipeline was at step {upto} ({exc})")
        st = self.stats
        st["lost_recoveries"] = st.get("lost_recoveries", 0) + 1
        st["lost_replayed_steps"] = st.get("lost_replayed_steps", 0) + n
        st["lost_recovery_s"] = st.get("lost_recovery_s", 0.0) + time.perf_counter() - t0

    def _refs(self, d: Divided) -> dict[str, tuple[str, list[tuple[str, int]]]] | None:
        """The views of step ``d`` whose change is exactly the sum of one input's pushes (the view is the input, no
        row of it was late), as OutputLog.write takes them: written as references to the pushes' records."""
        refs = {}
        for view, handle in self._ref_outputs.items():
            if d.late.get(handle, 0):
                continue  # the input operator dropped rows: the view is not the pushes' sum
            pairs = [(p, q) for h, p, q in d.entries if h == handle]
            if pairs and len(set(pairs)) == len(pairs):  # pushes an older release logged may share seq 0
                refs[view] = (handle, pairs)
        return refs or None

    def _advance(self, run: list[Divided]) -> None:
        """The steps of the step run ``run`` ran and their output is logged: the pipeline moves past them."""
        if not run:
            return
        last = run[-1].input
        self.steps = last.step + 1
        self._last_now = self.now_ns = last.now_ns
        self.seed = last.seed
        if self._event_time:
            self.watermarks = dict(run[-1].watermarks_after)
            for d in run:
                for name, n in d.late.items():
                    self.late_rows[name] += n

    def _step_failed(self, exc: StepError, d: Divided) -> StepError:
        """The StepError a caller sees for the failed step ``d`` (invariant 7): what failed and the remedy."""
        self.stats["failed_steps"] = self.stats.get("failed_steps", 0) + 1
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        shown = ", ".join(f"({h!r}, {p!r}, {q})" for h, p, q in d.entries[:20])
        more = f" and {len(d.entries) - 20} more" if len(d.entries) > 20 else ""
        where = f" in {exc.node}" if exc.node else ""
        return StepError(f"step {d.input.step} failed on its data{where}: {type(cause).__name__}: {cause}. The "
                         f"pipeline stays at step {self.steps}; the step waits with its {len(d.entries)} pushes "
                         f"(input, producer, seq): [{shown}{more}]. Drop the bad one with "
                         f"discard(producer, seq), then step() again",
                         d.input.step, d.entries, exc.node)

    def step(self) -> dict[str, ZSet]:
        """Divide the acknowledged input into a step (with storage: durably, with ``now`` and ``seed``), run it
        with any queued steps, log its output; returns ``{output: change of the view}`` of this step."""
        if self._broken is not None or self._closed:  # (_check_usable's test, without its call on the usual path)
            self._check_usable()
        if not self._step_lock.acquire(False):  # held: this step waits for it, counted (a live rescale lets waiting
            with self._mutex:  # steps run between its waves); a free lock is taken without the count's two locks
                self._waiting += 1
            try:
                self._step_lock.acquire()
            finally:
                with self._mutex:
                    self._waiting -= 1
        try:
            if self._broken is not None or self._closed:
                self._check_usable()
            if self.step_error is not None and self._queue:  # invariant 7: the failed step runs again first
                return self._run_queue()[-1]
            self._queue.append(self._divide(wait=self.storage is None or self.executor.division_first
                                            or bool(self._queue)))
            crashpoint("step-run")
            return self._run_queue()[-1]
        finally:
            self._step_lock.release()

    def queue_step(self) -> int:
        """Divide the acknowledged input into a step (durably) without running it; returns the step number.

        Queued steps run together (an executor may run them in one job) at the next :meth:`run_queued` or
        :meth:`step` (or on recovery, if the pipeline stops first).
        """
        self._check_usable()
        with self._step_lock:
            self._check_usable()
            self._queue.append(self._divide(wait=True))
            return self._queue[-1].input.step

    def run_queued(self) -> list[dict[str, ZSet]]:
        """Run every queued step; returns each one's ``{output: change}``, in step order."""
        self._check_usable()
        with self._step_lock:
            self._check_usable()
            return self._run_queue() if self._queue else []

    @property
    def queued(self) -> int:
        """How many divided steps wait to run."""
        return len(self._queue)

    def discard(self, producer: str, seq: int) -> tuple[str, int]:
        """Drop the push ``(producer, seq)`` that no step has run yet, durably; returns ``(input, step)``.

        For a step that failed on its data (:class:`~dbsp_core.errors.StepError` lists its pushes): drop the bad
        push, then ``step()`` runs the step again without it. An anonymous push has producer ``""`` and the seq
        the StepError names. With storage the discard is logged before this returns, so recovery drops the
        same push; the pair stays acknowledged (a retry of it is a duplicate). Raises KeyError if no unstepped
        push has that identity.
        """
        self._check_usable()
        if not isinstance(producer, str):
            raise TypeError(f"discard: producer must be a str ('' for an anonymous push), got {producer!r}")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"discard: seq must be an int, got {seq!r}")
        with self._step_lock:
            self._check_usable()
            with self._cond:
                while self._inflight:  # a push being appended may be the one named: let it land
                    self._cond.wait()
                key = (producer, seq)
                hits = [(k, i) for k, d in enumerate(self._queue) for i, e in enumerate(d.entries) if e[1:] == key]
                hits += [(None, i) for i, e in enumerate(self._step_inputs) if e[1:] == key]
                if not hits:
                    waiting = [e[1:] for d in self._queue for e in d.entries] + [e[1:] for e in self._step_inputs]
                    raise KeyError(f"discard: no push ({producer!r}, {seq}) waits for a step; the {len(waiting)} "
                                   f"waiting are {waiting[:20]}{' ...' if len(waiting) > 20 else ''}")
                if len(hits) > 1:
                    raise ValueError(f"discard: {len(hits)} unstepped pushes are ({producer!r}, {seq}) (anonymous "
                                     f"pushes logged by an older release all have seq 0); it names none of them")
                k, i = hits[0]
                handle = (self._queue[k].entries if k is not None else self._step_inputs)[i][0]
                step = self._queue[k].input.step if k is not None else self._open_step
                if self._input is not None:  # invariant 7: logged before anything changes in memory
                    rec = encode_json(DISCARD_MAGIC, {"input": handle, "producer": producer, "seq": seq, "step": step})
                    try:
                        self._input.append(self._open_step, DISCARD_HANDLE, rec, producer=producer, seq=seq)
                        crashpoint("discard-logged")
                    except BaseException as exc:
                        if not isinstance(exc, ValueError):
                            self._broken = exc  # the record may or may not be durable: only recovery knows
                        raise
                if k is None:
                    del self._pending[i], self._step_inputs[i]
                else:
                    d = self._queue[k]
                    self._queue[k] = self._without(d, [x for x in range(len(d.entries)) if x != i])
                    self._rewatermark()
                self.stats["discarded"] = self.stats.get("discarded", 0) + 1
                return handle, step

    def _without(self, d: Divided, keep: list[int]) -> Divided:
        """The divided step ``d`` with only its pushes at positions ``keep``."""
        entries = [d.entries[i] for i in keep]
        return d._replace(input=d.input._replace(pushes=[d.input.pushes[i] for i in keep]), ranges=ranges(entries),
                          entries=entries)

    def _rewatermark(self) -> None:
        """Recompute the watermarks of the queued steps from those after the last step run (after a discard)."""
        if not self._event_time:
            return
        wm = dict(self.watermarks)
        for k, d in enumerate(self._queue):
            after, late = advance(self._event_time, wm, d.input.pushes)
            self._queue[k] = d._replace(input=d.input._replace(watermarks=dict(wm)), watermarks_after=after, late=late)
            wm = after
        self._wm_divided = dict(wm)

    def _run_queue(self) -> list[dict[str, ZSet]]:
        run, self._queue = self._queue, []
        outs = self._run(run)
        if self.storage is not None and self.checkpoint_interval is not None and self.rescale_progress is None and \
                time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
            t = self._ckpt_thread
            if self._remote_state is not None and t is not None and t.is_alive():
                # remote_state invariant 5: the previous upload is still in flight; rather than make this step wait
                # for the store, skip: the next step tries again, and what changed goes up with that checkpoint
                self.stats["skipped_checkpoints"] = self.stats.get("skipped_checkpoints", 0) + 1
            else:
                self.checkpoint(wait=False)
        return outs

    # ---- checkpoints ----

    def checkpoint(self, wait: bool = True) -> int:
        """Take a checkpoint at the step the pipeline has run to (invariant 5); returns its step.

        Steps pause only while the executor captures its state (cheap: immutable batches); the state is then
        written and committed before this returns with ``wait=True`` (on demand) or on a background thread with
        ``wait=False`` (the timer), while later steps run. Pushes never wait. Queued steps are not run; they
        stay in the log. One checkpoint runs at a time; during a live rescale a checkpoint waits for its end
        (the rescale ends with one).
        """
        self._check_usable()
        if self.storage is None:
            raise DbspError("checkpoint: an in-memory pipeline keeps nothing on disk; give storage=<dir>")
        if wait and self._remote_state is not None:
            self._await_upload(self._ckpt_thread)  # one upload in flight at most: wait without holding up steps
            self._check_usable()
        with self._step_lock:
            self._wait_layout_idle()  # invariant 8: decided and taken under the step lock, never between
            self._check_usable()
            step = self._checkpoint(wait)
            t = self._ckpt_thread
        if wait and t is not None:  # an object store: the upload runs while steps go on; durable when we return
            self._await_upload(t)
            if self._broken is not None:
                raise self._broken  # the upload's own error (StoreUnavailableError, StoreFencedError), as raised
        return step

    @staticmethod
    def _await_upload(t: threading.Thread | None) -> None:
        """Wait, without the step lock, for the checkpoint thread ``t`` (remote_state invariant 5)."""
        if t is not None:
            t.join()

    def _wait_layout_idle(self) -> None:
        """Invariant 8: with the step lock held, wait (releasing it meanwhile) until no live rescale runs."""
        while self.rescale_progress is not None:
            self._layout_idle.wait()

    def _checkpoint(self, wait: bool, after_state: Callable[[], None] | None = None) -> int:
        """:meth:`checkpoint`; ``after_state`` runs between the state's commit and the driver's record (a live
        rescale switches LAYOUT there: rescale.py invariant 4)."""
        with self._step_lock:
            self._join_checkpoint()
            if self._owed is not None:  # change.py invariant 6: the state stays the old circuit's until step L ran
                if after_state is not None:
                    raise DbspError(f"a layout change waits for the first step after the program change (step "
                                    f"{self._owed.step}): step once, then change the layout")
                self.stats["deferred_checkpoints"] = self.stats.get("deferred_checkpoints", 0) + 1
                return self.steps
            t0 = time.perf_counter()
            crashpoint("checkpoint-start")
            step = self.steps
            with self._cond:
                seen = self._seen.copy()
                unsynced = self._unsynced  # reference pushes in ``seen`` whose records may not be durable yet
            floor, prev_now, wms = self._now_floor, self._last_now, dict(self.watermarks)
            # what `dbsp profile DIR` prints: taken with the steps paused, written with METRICS (traces in memory only)
            prof = dict(pipeline_profile(self, state=self.executor.state_in_memory), step=step)
            # the counters at the checkpoint's step: what the next open goes on from (metrics.Metrics.resume)
            counters = dict(self._metrics.snapshot(), duplicates=self.stats["duplicates"],
                            late_rows=dict(self.late_rows))
            try:
                make_durable = self._lost_recovered(lambda: self.executor.checkpoint(step), step)
            except BaseException as exc:
                self._broken = exc
                raise
            output, inp, db, consumers, root = self._output, self._input, self._driver_db, self.consumers, self.storage
            assert output is not None and inp is not None and db is not None and consumers is not None
            captured: dict = {}  # with an object store: what finish() takes for upload()

            def finish() -> None:
                try:
                    if unsynced:
                        inp.sync(unsynced)  # invariant 1: every push the saved seen set holds is durable
                    output.flush()  # output of every step below the checkpoint is durable before it
                    with progress(f"checkpoint at step {step}"):
                        make_durable()
                    crashpoint("checkpoint-state")
                    if after_state is not None:
                        after_state()
                    with db.open(db.versions().stop - 1) as h:  # invariant 5: the driver's record at the step
                        seen.save(h)
                        clock = {"now_ns": floor, "prev_now_ns": prev_now}
                        if wms:
                            clock["watermarks"] = wms  # after the checkpoint's last step: in force at its step
                        h.put(CLOCK_TABLE, CLOCK_KEY, encode_json(CLOCK_MAGIC, clock))
                        h.set_step(step)
                        h.commit()
                    crashpoint("checkpoint-gc")
                    # the low watermark: the state and driver.db are both at step; and the output log's steps that
                    # name pushes (outputlog.py invariant 7) keep their records
                    inp.truncate_below(min(step, output.first) if self._ref_outputs else step)
                    # below every consumer's acknowledged step and the retention setting (storage.consumers)
                    consumers.truncate(output, step, self.output_retention)
                    self.stats["checkpoints"] += 1
                    self.stats["last_checkpoint_s"] = time.perf_counter() - t0
                    secs = self.stats["last_checkpoint_s"]
                    self._metrics.checkpointed(secs)
                    saved = dict(counters, step=step, checkpoints=counters["checkpoints"] + 1, checkpoint_seconds=secs,
                                 checkpoint_seconds_sum=counters["checkpoint_seconds_sum"] + secs)
                    write_record(os.path.join(root, METRICS_FILE), METRICS_MAGIC, saved, self._vfs)
                    write_record(os.path.join(root, PROFILE_FILE), PROFILE_MAGIC, prof, self._vfs)
                    if self._remote_state is not None:
                        # an object store: what the upload needs as it is at the step (remote_state invariant 5)
                        captured.update(self._remote_state.capture(step, self.executor.referenced_files()))
                except BaseException as exc:
                    # databases may hold different versions and the incremental snapshot state is ahead of them:
                    # only recovery (Pipeline.open) knows the consistent state again
                    self._broken = exc
                    raise

            def upload() -> None:
                # upload what changed, commit the manifest, delete what no live manifest names (remote_state
                # invariants 3 and 5): on the checkpoint thread, steps going on
                state = self._remote_state
                if state is None:
                    return
                try:
                    crashpoint("checkpoint-upload")
                    self.stats["remote"] = state.send(captured, lambda: crashpoint("checkpoint-manifest"))
                except BaseException as exc:
                    self._broken = exc  # nothing after this checkpoint is taken; the next call raises
                    raise

            self._last_checkpoint = time.monotonic()
            if wait:
                finish()
                if self._remote_state is not None:  # the caller waits for it outside the step lock (checkpoint())
                    t = threading.Thread(target=self._background, args=(upload,),
                                         name="dbsp-checkpoint-upload", daemon=True)
                    t.start()  # started before it is published: checkpoint() joins it without the step lock
                    self._ckpt_thread = t
            else:
                def both() -> None:
                    finish()
                    upload()
                t = threading.Thread(target=self._background, args=(both,), name="dbsp-checkpoint", daemon=True)
                t.start()  # as above: a thread another caller can see has been started
                self._ckpt_thread = t
            return step

    def _stop_for_exit(self) -> None:
        """Interpreter exit with the pipeline open (trace/at_exit.py): let a background checkpoint end."""
        t = self._ckpt_thread
        if t is not None and t is not threading.current_thread():
            t.join()

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

    # ---- layout ----

    def rescale(self, workers: int, *, batch_shards: int = 16) -> dict:
        """Change the number of workers while the pipeline runs (other threads may push and step meanwhile);
        returns once the new layout is in force (and, with storage, durable).

        The shards that change owner move in waves of ``batch_shards``: each wave is one short pause between two
        steps (steps wait; pushes never do). The embedded executor cuts the moving shards' rows out of the
        traces in memory (zero-copy slices) and hands them to their new owners; the staged executor moves their
        stored values between the stage databases, each wave committed atomically. With storage, the target is
        recorded first, so a crash at any point ends, on the next open, with the move finished (rescale.py
        invariant 4). Returns (and keeps in :attr:`last_rescale`) ``{from_workers, to_workers, moved_shards,
        moved_bytes, total_bytes, batches, max_pause_ms, seconds}`` (``batches``: the number of waves).

        >>> import pyarrow as pa, dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("k", pa.int64())]))
        >>> c.output("n", t.group_by("k").agg(n=dbsp.count()))
        >>> p = dbsp.Pipeline(c, workers=2)
        >>> p.push("t", pa.table({"k": list(range(100))})); _ = p.step()
        >>> r = p.rescale(3)
        >>> (r["from_workers"], r["to_workers"], r["moved_shards"], p.layout.workers)
        (2, 3, 85, 3)
        >>> p.push("t", pa.table({"k": [5]})); sorted(p.step()["n"].to_dict().items())  # (a Z-set's rows: no order)
        [((5, 1), -1), ((5, 2), 1)]
        >>> p.close()
        """
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"rescale: workers must be a positive int, got {workers!r}")
        if not isinstance(batch_shards, int) or isinstance(batch_shards, bool) or batch_shards < 1:
            raise ValueError(f"rescale: batch_shards must be a positive int, got {batch_shards!r}")
        self._check_usable()
        t0 = time.perf_counter()
        with self._step_lock:
            self._check_usable()
            if self.rescale_progress is not None:
                raise DbspError("rescale: another rescale of this pipeline is in progress; call rescale again "
                                "once it returned")
            if self._owed is not None:  # change.py invariant 6
                raise DbspError(f"rescale: the first step after the program change (step {self._owed.step}) has not "
                                f"run; step once, then rescale")
            self._join_checkpoint()  # invariant 8: no checkpoint in flight, none starts until the end
            change = LiveRescale(self.executor, self.circuit, self.storage, self.layout, workers, batch_shards,
                                 crashpoint, self._vfs, t0)
            if not change.waves:
                return change.report(self.steps)
            change.begin()
            self.rescale_progress = change.progress  # the change is in progress (invariant 8)
        ran, rep = False, None
        try:
            change.run(self)
            ran = True
        except BaseException as exc:
            # a failure is undone (rescale.py invariant 6); a BaseException that is not an Exception
            # (KeyboardInterrupt, SystemExit: the process is going down, as a kill would) leaves the change to
            # Pipeline.open like a crash does
            if change.undoable and isinstance(exc, Exception) and self._broken is None and not self._closed:
                self._undo_rescale(change, exc)
            else:
                self._broken = self._broken or exc  # state may be between layouts: Pipeline.open finishes the move
            raise
        finally:
            # the change's report (LAYOUT's, on disk) is written while the change is still in progress: once
            # rescale_progress is None another rescale may start and run in full, and a report of this change
            # written after it would name a layout the stage databases are no longer in (invariant 8)
            with self._step_lock:
                try:
                    if ran:
                        rep = self.last_rescale = change.finish(self)
                finally:
                    self.rescale_progress = None
                    self._layout_idle.notify_all()
        assert rep is not None
        return rep

    def autoscale(self, policy: Autoscale | None) -> None:
        """Size the pipeline by ``policy`` from now on (replacing any policy it had), or stop autoscaling (None;
        a rescale the old policy started still ends). See :class:`dbsp_core.Autoscale`; the decisions are in
        ``metrics()["autoscale"]``.

        >>> import pyarrow as pa, dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("k", pa.int64())]))
        >>> c.output("n", t.group_by("k").agg(n=dbsp.count()))
        >>> p = dbsp.Pipeline(c, workers=2)
        >>> p.autoscale(dbsp.Autoscale(1, 1, max_step_ms=100))   # a bound below the size: brought inside at once
        >>> p.push("t", pa.table({"k": [1, 2]})); _ = p.step()
        >>> p.autoscale(None)                                      # waits for the rescale it decided
        >>> p.workers, p.last_rescale["to_workers"]
        (1, 1)
        >>> p.close()
        """
        if policy is not None and not isinstance(policy, Autoscale):
            raise TypeError(f"autoscale: expected a dbsp_core.Autoscale or None, got {type(policy).__name__}")
        self._check_usable()
        if policy is None:
            a, self._autoscaler = self._autoscaler, None
            if a is not None:
                a.stop()
                self._metrics.autoscaled(None)
            return
        if self._autoscaler is None:
            self._autoscaler = Autoscaler(self, policy, self._capacity)
        else:
            self._autoscaler.set_policy(policy)

    @property
    def autoscale_decisions(self) -> list[dict]:
        """The newest decisions of the autoscaling policy (every kind, oldest first; empty without a policy)."""
        a = self._autoscaler
        return [] if a is None else list(a.decisions)

    def _undo_rescale(self, change: LiveRescale, exc: BaseException) -> None:
        """A live rescale failed before or between waves (rescale.py invariant 6): undo it under the step lock.
        If that fails too, the pipeline is broken (Pipeline.open finishes or undoes the change from the
        directory)."""
        try:
            with self._step_lock:
                change.undo(self.steps)
                self.stats["rescales_undone"] = self.stats.get("rescales_undone", 0) + 1
        except BaseException as undo:
            self._broken = exc
            raise undo from exc

    @property
    def memory_limit(self) -> int | None:
        """The memory budget of the pipeline's state in bytes (``memory_limit=`` or ``DBSP_MEMORY_LIMIT``), None
        without one; connectors size what they hold ahead by it (connectors/files.py invariant 9)."""
        return self._memory_limit

    @property
    def layout(self) -> Layout:
        """The layout in force: ``.workers``, ``.shards`` and ``.owner(shard) -> worker``."""
        lay = self.executor.layout
        assert lay is not None
        return lay

    @property
    def workers(self) -> int:
        """Number of workers W of the layout in force."""
        return self.layout.workers

    @property
    def shard_map(self) -> ShardMap:
        """The routing table of the layout in force (shard -> worker)."""
        return self.layout.shard_map

    # ---- output ----

    def _need_storage(self, what: str) -> None:
        if self.storage is None:
            raise DbspError(f"{what}: an in-memory pipeline keeps no logs; give storage=<dir>")

    def read_output(self, name: str, from_step: int = 0) -> Iterator[tuple[int, ZSet]]:
        """Yields ``(step, change)`` of output ``name`` for every logged step from ``from_step``, once each, in order."""
        self._need_storage("read_output")
        assert self._output is not None
        if self._closed:
            raise DbspError(f"read_output({name!r}): the pipeline is closed; Pipeline.open(dir, circuit) reads its "
                            f"output again")
        return self._reading(self._output.read(name, from_step), name)

    def _reading(self, it: Iterator[tuple[int, ZSet]], name: str) -> Iterator[tuple[int, ZSet]]:
        """``it``, with the error of a read the pipeline's close cut short saying so (invariant 8)."""
        try:
            yield from it
        except StorageError as exc:
            if not (self._closed or self._stopping):  # _stopping: close() began, its logs may be closed already
                raise
            raise DbspError(f"read_output({name!r}): the pipeline was closed while its output was read; "
                            f"Pipeline.open(dir, circuit) reads it again") from exc

    def read_input(self, step: int) -> dict[str, ZSet]:
        """The input of a divided step as one Z-set per input handle (the input log read back by step).

        Raises LookupError if the step is not divided yet or its records were truncated below the low watermark.
        """
        self._need_storage("read_input")
        assert self._input is not None
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
                parts[r.handle].append(decode_push(r.payload, self._inputs[r.handle], f"{self.storage} step {step}"))
        if not divided:
            raise LookupError(f"the input of step {step} was truncated below the low watermark")
        return {h: (ZSet.concat(ps).consolidate() if len(ps) > 1 else ps[0].consolidate() if ps
                    else ZSet.empty(self._inputs[h])) for h, ps in parts.items()}

    def output_inputs(self, step: int) -> list[dict]:
        """The input (handle, producer, first_seq..last_seq ranges) that produced output step ``step``."""
        self._need_storage("output_inputs")
        assert self._output is not None
        return self._output.inputs_of(step)

    @property
    def output_steps(self) -> range:
        """The output steps the log holds."""
        self._need_storage("output_steps")
        assert self._output is not None
        return range(self._output.first, self._output.readable)

    @property
    def output_since(self) -> dict[str, int]:
        """``{view: step}`` for the views a program change rebuilt (dbsp_core.runtime.change): the log of such a view
        starts at that step, with its full contents; ``read_output`` of it starts there."""
        self._need_storage("output_since")
        assert self._output is not None
        return dict(self._output.since)

    def traces(self, worker: int) -> dict[str, Trace]:
        """All keyed state of one worker, as ``{"<operator label>.<trace name>": Trace}``.

        Every trace is sorted by key hash, so ``trace.shard(shard_bits, s)`` reads one shard's state; the shards
        with rows are those the layout assigns to ``worker``. Each comes behind the step lock (invariant 11): it may
        be read from any thread, each read waiting for a step, rescale or checkpoint in progress.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("d", t.distinct())
        >>> sorted(dbsp.Pipeline(c).traces(0))
        ['distinct#2.input']
        """
        return {name: GuardedTrace(t, self._step_lock) for name, t in self._live_traces(worker).items()}  # inv. 11

    def _live_traces(self, worker: int) -> dict[str, Trace]:
        """:meth:`traces` unguarded, for the engine's own readers (metrics: estimates that never write a trace,
        trace invariant 19's ``sync=False``, and that key their counters by the trace objects themselves)."""
        self._check_usable()
        with self._step_lock:
            return self._lost_recovered(lambda: self.executor.traces(worker), self.steps)  # invariant 10

    # ---- current contents: materialized views and readable tables (invariant 9; runtime/readable.py) ----

    def view(self, name: str, weights: bool = False) -> pa.Table:
        """The current contents of materialized view or readable table ``name`` as of the last completed step, as
        an Arrow table (``.to_pandas()`` gives a DataFrame).

        A view is a bag: each row comes as many times as its weight (SQL's ``SELECT * FROM name``), in no
        particular order; with ``weights=True`` each row comes once with its weight in a ``weight`` column (the
        form of ``ZSet.to_arrow()``), which also shows a view of negative weights (a difference of streams), whose
        rows alone are refused (DbspError). Readable are the views declared materialized (``CREATE MATERIALIZED
        VIEW``, ``Circuit.output(..., materialized=True)``), the tables with a primary key and the tables declared
        ``materialized=True``; another name raises KeyError saying how to make it readable. The contents are
        the state the engine keeps (a trace per worker, checkpointed, recovered and rescaled like all state), read
        while no step runs, so it is safe to call from any thread.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("k", pa.int64())]))
        >>> c.output("n", t.group_by("k").agg(n=dbsp.count()), materialized=True)
        >>> p = dbsp.Pipeline(c, workers=2)
        >>> p.push("t", {"k": [1, 1, 2]}); _ = p.step()
        >>> p.view("n").sort_by("k").to_pydict()
        {'k': [1, 2], 'n': [2, 1]}
        """
        self._check_usable()
        node = self._readable.node(name, f"view({name!r})")
        with self._step_lock:
            self._check_usable()
            z = self._lost_recovered(lambda: self.executor.view(node), self.steps)  # invariant 10
        return as_rows(z, name, weights)

    def query(self, sql: str) -> pa.Table:
        """Run one read-only SQL query (a SELECT) over the materialized views and readable tables (see
        :meth:`view`) as of the last completed step; returns an Arrow table.

        DuckDB runs it on a private in-memory database that sees the views and tables as Arrow tables (no copy
        when every weight is 1; each row repeated by its weight otherwise) and no files. Anything but a single
        SELECT (INSERT, UPDATE, DELETE, CREATE, COPY, ...) is refused with QueryError, and so is a query DuckDB
        cannot run (the message names the tables and views it can read). Every view the query names is read at
        the same step.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]), primary_key=["k"])
        >>> p = dbsp.Pipeline(c)
        >>> p.push("t", {"k": [1, 2], "v": [10, 20]}); _ = p.step()
        >>> p.push("t", {"k": [1], "v": [11]}); _ = p.step()
        >>> p.query("SELECT k, v FROM t ORDER BY k").to_pydict()
        {'k': [1, 2], 'v': [11, 20]}
        """
        sql = check_read_only(sql)
        self._check_usable()
        names = self._readable.names_in(sql)
        with self._step_lock:
            self._check_usable()
            zs = self._lost_recovered(lambda: {n: self.executor.view(self._readable.nodes[n]) for n in names},
                                      self.steps)  # invariant 10
        return run_query(sql, {n: as_rows(z, n, False) for n, z in zs.items()}, list(self._readable.nodes))

    def metrics(self, state: bool = True) -> dict:
        """What the pipeline is doing (dbsp_core.metrics): ``steps``, ``pushes``, ``rows_in`` / ``rows_out`` per
        input / output, ``step_seconds`` (histogram, mean, p50, p99 of the newest steps), ``checkpoints``,
        ``checkpoint_seconds``, ``replayed_steps``, ``late_rows``, ``workers``, ``shards``; with storage
        ``log_bytes``, ``output_steps`` and ``consumers``; with ``state`` ``state_bytes`` per worker (total,
        per shard, and ``key_index``: the bytes of the traces' key indexes, memory kept beside the state; a
        staged executor's tasks keep theirs in their own processes, not counted here); ``net_rows`` per output
        (the net weight of its changes since the pipeline was opened), ``rss_bytes`` (this process's resident
        memory), with storage ``sink_lag_steps`` (each consumer's logged steps not yet applied), and ``profile``
        (:meth:`profile`, with state as ``state`` says)."""
        self._check_usable()
        with self._step_lock:  # invariant 8: one layout, not one a rescale or close changes meanwhile
            self._check_usable()
            return gather(self, state)

    def profile(self, state: bool = True) -> Profile:
        """Where the time goes (dbsp_core.profile): one record per operator (node, label, kind, steps, seconds
        summed over workers, mean and p99 ms per step of the slowest worker over the newest steps, rows in and
        out, with ``state`` the rows and bytes of its traces and their key indexes, bytes exchanged between
        workers) and one per view (rows of its changes, their net weight, the seconds and state of the operators
        it depends on). ``print(p.profile())`` shows both as tables; ``.table()`` gives a pyarrow Table.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("d", t.distinct())
        >>> p = dbsp.Pipeline(c)
        >>> _ = p.push("t", pa.table({"x": [1, 1, 2]})); _ = p.step()
        >>> [(r["operator"], r["rows_in"], r["rows_out"], r["state_rows"]) for r in p.profile()["operators"]]
        [('input#0', None, 3, 0), ('exchange#1', 3, 3, 0), ('distinct#2', 3, 2, 2)]
        >>> p.profile()["views"][0]["rows_out"]
        2
        """
        self._check_usable()
        with self._step_lock:
            self._check_usable()
            return pipeline_profile(self, state)

    def serve_metrics(self, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, int]:
        """Serve :meth:`metrics` as Prometheus text at ``http://addr:port/metrics`` (port 0: any free one) until
        :meth:`close`; returns the server (``.shutdown()`` stops it sooner) and its port."""
        return serve(self, port, addr)

    def disk_usage(self) -> dict[str, int]:
        """Bytes on disk per part of the storage directory."""
        self._need_storage("disk_usage")
        root = self.storage
        assert root is not None
        return {"input": tree_bytes(os.path.join(root, INPUT_DIR)),
                "output": tree_bytes(os.path.join(root, OUTPUT_DIR)), "state": tree_bytes(os.path.join(root, STATE_DIR))}

    # ---- shutdown ----

    def _shutdown(self) -> None:
        stop_serving(self)  # metrics invariant 4
        if self._division_sync is not None:
            self._await_division(quiet=True)
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        for part in (self.executor, self._input, self._output, self._driver_db):
            try:
                if part is not None:
                    part.close()
            except Exception:  # pragma: no cover - best effort on an error path
                pass
        if self._remote_state is not None:
            self._remote_state.close()
        if self._lockfd is not None:
            unlock_dir(self._lockfd)
            self._lockfd = None
        if self._own_cache is not None:  # a temporary cache of an object store
            shutil.rmtree(self._own_cache, ignore_errors=True)
        self._closed = True

    def close(self, checkpoint: bool = True) -> None:
        """Checkpoint (with storage, unless ``checkpoint=False`` or the pipeline is broken), then release files
        and threads; the pipeline cannot be used afterwards."""
        if self._closed:
            return
        if self._autoscaler is not None:
            self._autoscaler.stop()  # no more rescales; one in flight ends first (outside the step lock)
        with self._step_lock:
            self._wait_layout_idle()  # invariant 8: a live rescale ends first
            if self._closed:
                return
            with self._cond:  # pushes being appended land; later ones are refused
                self._stopping = True
                while self._inflight:
                    self._cond.wait()
            t = self._ckpt_thread
            if t is not None:
                t.join()
                self._ckpt_thread = None
            try:
                if checkpoint and self.storage is not None and self._broken is None:
                    self.checkpoint()
                if self.storage is not None and self._broken is None:
                    self._record_acked()
            finally:
                self._shutdown()

    def _record_acked(self) -> None:
        """At a clean close: record in driver.db (same step) the named pushes the input log holds from driver.db's
        step on, so ``dbsp repair`` can name every one a damaged log lost (dbsp_core.storage.repair)."""
        db, inp = self._driver_db, self._input
        assert db is not None and inp is not None
        with db.open(db.versions().stop - 1) as h:
            d = h.get_step()
            pushes = sorted({(r.producer, r.seq) for r in inp.iter_from(d)
                             if r.producer and r.handle not in (DIVISION_HANDLE, DISCARD_HANDLE)})
            h.put(ACKED_TABLE, ACKED_KEY, encode_json(ACKED_MAGIC, {"step": d, "pushes": pushes}))
            h.commit()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{self.storage_uri or self.storage!r}, " if self.storage else ""
        lay = self.executor.layout
        return (f"Pipeline({where}workers={lay.workers if lay else '?'}, steps={self.steps}, "
                f"executor={self.executor.kind})")
