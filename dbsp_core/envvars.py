"""Every ``DBSP_*`` setting the library reads at run time, read here and nowhere else: typed, checked and documented
with its default.

:func:`settings` reads them all from the environment once (``import dbsp_core`` makes the first call) and keeps the
result; a value that does not parse is refused then, with the variable's name, instead of being read as 0 by C's
``strtoull`` or failing with a bare ``float()`` error in the middle of a recovery. Reading the settings reads
nothing else: what is derived from them and from the machine (the key indexes' memory sizing,
dbsp_core/trace/sizing.py) is computed when first needed.

Runtime settings (:data:`SETTINGS`; blank counts as unset), with what reads them:

- ``DBSP_KEY_INDEX`` (trace/keyindex.py): ``0``: no trace keeps a key index; ``1``: traces may (default 1).
- ``DBSP_KEY_INDEX_MB`` (trace/sizing.py): MiB one key index may hold, a number > 0 (default: an eighth of the
  process's memory, at least 512).
- ``DBSP_KEY_INDEX_TOTAL_MB`` (trace/sizing.py): MiB all key indexes together may hold, a number > 0 (default: a
  quarter of the process's memory, at least 1024).
- ``DBSP_PAGE_CACHE_MB`` (storage/database.py): MiB of clean pages each state database caches, a whole number >= 1
  (default 32).
- ``DBSP_PROGRESS`` (progress.py): ``1``: show progress lines; ``0``: never (default: when stderr is a terminal).
- ``DBSP_PROGRESS_DELAY`` (progress.py): seconds an operation lasts before its progress shows, a number >= 0
  (default 1).
- ``DBSP_CRASHPOINT`` (runtime/crashpoints.py; kill tests): ``name:n``, the n-th hit (n >= 1) of crash point
  ``name`` kills the process (default: none).
- ``DBSP_SCRATCH_MB`` (csrc/scratch.c reads it itself; checked here): MiB of scratch buffers the C core caches per
  thread, a whole number >= 0 (0: none; default 512; a memory budget lowers it to ``BatchStore.SCRATCH_SHARE`` of
  the budget while it lives).
- ``DBSP_REGION_CACHE_MB`` (csrc/scratch.c reads it itself; checked here): MiB of freed mapped regions the C core
  keeps for reuse, a whole number >= 0 (default 256).
- ``DBSP_HUGEPAGES`` (csrc/scratch.c reads it itself; checked here): ``1``: the C core's buffers of 2 MiB and more
  (key indexes' included) are madvised for transparent huge pages, and so is the scratch mapping of a merge output built
  on disk (bindings/merge.pxi ``HUGE_SCRATCH``: its page cache in 2 MiB folios); ``0``: never (default 1; csrc/scratch.c design note 2 has the measured
  gain and the compaction stalls that ``0`` avoids on a host whose free memory is fragmented).
- ``DBSP_MEMORY_LIMIT`` (runtime/driver.py): the memory budget of a pipeline's traces when ``Pipeline(...,
  memory_limit=)`` is not given, bytes or a size such as ``4GiB`` (default: none; an embedded pipeline's only: a
  staged one, SparkPipeline's, takes a budget from its argument alone). ``.ci/run`` runs tests/core, tests/sql,
  tests/nexmark, tests/exactly_once and tests/storage once more with ``DBSP_MEMORY_LIMIT=1``, so that every trace
  spills its batches to files (dbsp_core/trace/spill.py).
- ``DBSP_CACHE_KEEP_MB`` (runtime/embedded.py): MiB of each of those two caches kept past the end of a step, a whole
  number >= 0 (default 16): the rest goes back to the system (csrc/scratch.c design note 6), so the buffers a large
  step used do not stay resident beside the state it built.
- ``DBSP_JEMALLOC`` (arrow_pool.py): ``1``: the first Pipeline of a process makes jemalloc Arrow's default memory
  pool, unless ``ARROW_DEFAULT_MEMORY_POOL`` chooses one; ``0``: Arrow's default stays (mimalloc in the pyarrow
  wheels; default 0: arrow_pool.py has what each costs, measured on Nexmark).
- ``DBSP_STEP_PLAN`` (runtime/embedded.py): ``1``: the embedded executor's workers run fused chains of operators
  as one call (runtime/plan.py); ``0``: every operator's own step (default 1). Results are the same either way.
- ``DBSP_PRUNE`` (runtime/prune.py): ``1``: a pipeline's joins and ``within_last`` windows keep in their state only the
  columns read after them (operators/pruned.py); ``0``: every column (default 1). A durable pipeline keeps what its
  directory recorded when it was created. Results are the same either way.
- ``DBSP_TOTALS_HOLD`` (operators/aggregate.py, distinct.py, count_distinct.py, join.py, presence.py, materialize.py):
  the fan-in up to which the low levels of a trace merge while its reads need no walk of its batches (trace/levels.py
  invariant 18): a trace read only through its key index (a linear or min/max aggregate's totals, a distinct's input, a
  count_distinct's pairs) or only by a few keys at a time (a min/max's value multisets), or a join side's (inner,
  outer, semi, anti) or a materialized view's trace while nothing reads it; a whole number >= 0 (0 or 1: two at a
  time, as every other trace; default 8). Results and state are the same either way; only the merge work differs.
- ``DBSP_TOTALS_PER_KEY`` (operators/aggregate.py): ``1`` (default): a linear or min/max aggregate's steps (invariant
  12 there) keep its totals in its key index only and bring the totals trace's batches up to date when something
  reads them (trace/levels.py invariant 19: no per-step batch, no merges between reads); ``0``: every step inserts
  its batch of old and new totals (the path until 2026-12-01, a min/max's until 2026-12-02;
  tests/core/test_totals_per_key*.py and test_values_hold.py compare the two). Results and state are the same either way. Not
  under a memory budget (the trace then keeps its totals in batches); a key index that cannot grow
  (``DBSP_KEY_INDEX_MB``, ``DBSP_KEY_INDEX_TOTAL_MB``, memory) has its step's store undone and the trace keeps its
  totals in batches from then on.
- ``DBSP_SUBSTEP_BYTES`` (runtime/substep.py): under a memory budget, the most pushed bytes (Arrow data and weights)
  one piece of a step holds: a bigger step runs as sub-steps over pieces of its input (default: an eighth of the
  budget, at least 4 MiB; bytes or a size such as ``64MiB``). Results are the same either way; with no budget it is
  not read.
- ``DBSP_SPILL_NATIVE`` (trace/spillread.py ``NATIVE``): ``1``: the spilled state's native paths (the C calls of
  trace/spillread.py that test the Bloom filters of a read's batches, locate its pages and stamp and evict them in
  one call each, ``Trace.narrowed``'s one take for every batch, and batchfile.py's Bloom build and CRC combine in
  C, and trace/groupedfile.py's decode of a format-2 lookup in C); ``0``: their reference paths (numpy and a
  Python call per batch; pyarrow's IPC reader for format 2), which the tests compare the native ones with
  (default 1). Results, files and the cache's counts are the same either way; only the CPU differs.
- ``DBSP_SPILL_GROUPED`` (trace/spill.py ``BatchStore.GROUPED_FROM``): bytes (or a size such as ``256MiB``) from which
  a spilled batch's file is written in batch file format 2 (row groups, trace/groupedfile.py) instead
  of format 1 (mapped); ``1``: every spilled batch's (default: none, format 1 only). A store reads either format
  whatever this says. Results are the same either way.
- ``DBSP_SPILL_GROUPED_MAP`` (trace/groupedfile.py ``READ_MAPPED``): ``1``: a format-2 file's lookups read its groups
  in place from a mapping of the file kept between steps, its 2 MiB units counted in the memory budget as format
  1's (trace/spill.py invariant 18), but for a step the store finds reading from the disk, which reads by pread;
  ``0``: by pread(2) always, the file never mapped (default 1). Results are the same either way.

Not runtime settings, read where they are used (listed so that this is the one list of every ``DBSP_*`` variable;
tests/core/test_envvars.py checks that the repository reads no other):

- build (setup.py): ``DBSP_DEBUG`` (``-O0 -g``, asserts and invariant checkers on), ``DBSP_SANITIZE``
  (AddressSanitizer); ``.ci/run`` and tests/spark/conftest.py: ``DBSP_REQUIRE_SPARK`` (a missing Spark fails);
  ``.ci/run`` and tests/connectors/conftest.py: ``DBSP_REQUIRE_POSTGRES`` (a missing PostgreSQL server fails),
  ``DBSP_PG_DSN`` (the DSN a kill-test child reaches the test server by, passed through the environment so that
  no password is on a command line); ``.ci/run`` and tests/conftest.py: ``DBSP_REQUIRE_S3`` (a missing S3 test
  server, moto's, fails); ``.ci/run`` and tests/core/test_status_page.py: ``DBSP_REQUIRE_CHROMIUM`` (a missing
  headless chromium fails), and that test's ``DBSP_STATUS_SCREENSHOT`` (a file to save the status page's
  screenshot to: how bench/status_page.png is made).
- the test run (tests/conftest.py, tests/hypothesis_profile.py): ``DBSP_LONG`` (also the tests marked slow),
  ``DBSP_HYPOTHESIS_SEED``, ``DBSP_HYPOTHESIS_EXAMPLES``.
- seeds that replay a test's random choices: ``DBSP_SQL_SEED``, ``DBSP_SQL_LIMITS_SEED``, ``DBSP_NAN_SEED``,
  ``DBSP_NEXMARK_SEED``, ``DBSP_CONNECTOR_SEED``, ``DBSP_FILES_SEED``, ``DBSP_DAMAGE_SEED``, ``DBSP_REPAIR_SEED``,
  ``DBSP_POISON_SEED``, ``DBSP_THREADS_SEED``, ``DBSP_CONCURRENCY_SEED``, ``DBSP_RACE_SEED``, ``DBSP_WIDE_SEED``,
  ``DBSP_RESCALE_SEED``, ``DBSP_RESCALE_KILL_SEED``, ``DBSP_LIVE_SEED``, ``DBSP_LIVE_KILL_SEED``,
  ``DBSP_SPARK_KILL_SEED``, ``DBSP_SPARK_LOSE_SEED`` (tests/spark/test_spark_lose.py), ``DBSP_SPARK_STORE_SEED``,
  ``DBSP_STAGE_STORE_SEED`` (tests/storage/test_remote_staged.py, test_stage_job_retry.py, test_stage_exchange.py),
  ``DBSP_WORKER_RECOVERY_SEED`` (tests/storage/test_worker_recovery.py), ``DBSP_STAGE_CHECK_SEED``
  (tests/storage/test_stage_check.py: which stage object is damaged), ``DBSP_FUZZ_SEED``,
  ``DBSP_TEST_SEED``, ``DBSP_PG_SEED``, ``DBSP_DELTA_SEED``, ``DBSP_LINRUN_SEED`` (tests/core/test_linear_run.py),
  ``DBSP_LINGROUP_SEED`` (tests/core/test_lingroup.py), ``DBSP_TRACE_READ_SEED`` (tests/exactly_once/test_traces_read_beside_steps.py),
  ``DBSP_HOLD_SEED`` (tests/core/test_totals_hold.py), ``DBSP_PERKEY_SEED`` (tests/core/test_totals_per_key*.py),
  ``DBSP_SLT_SEED``, ``DBSP_AUTOSCALE_SEED``, ``DBSP_AUTOSCALE_KILL_SEED``, ``DBSP_STORE_FAULT_SEED`` (the
  store-fault tests: which store calls fail, and how), ``DBSP_REMOTE_SEED``, ``DBSP_REMOTE_KILL_SEED``,
  ``DBSP_RUN_SEED`` (tests/sql/test_run.py), ``DBSP_DECIMAL_SEED`` (tests/sql/test_decimal.py), ``DBSP_NOW_SEED``
  (tests/sql/test_now.py), ``DBSP_CHANGE_SEED`` and ``DBSP_CHANGE_KILL_SEED`` (program changes,
  tests/exactly_once/test_program_change*.py), ``DBSP_PUSH_MANY_SEED`` (tests/exactly_once/test_push_many.py),
  ``DBSP_OUTPUT_REFS_SEED`` (tests/storage/test_output_refs.py), ``DBSP_MOVE_TARGET_SEED`` (tests/storage/test_move_target.py), ``DBSP_RANGES_SEED``
  (tests/exactly_once/test_shard_ranges.py),
  ``DBSP_STAGED_SPILL_SEED`` and ``DBSP_SPARK_SPILL_SEED`` (tests/core/test_staged_spill.py, tests/spark/test_spark_spill.py),
  ``DBSP_EXPR_KERNELS_SEED`` (tests/core/test_expr_kernels.py), ``DBSP_PRUNE_SEED``
  (tests/core/test_column_pruning.py), ``DBSP_APPEND_ONLY_SEED`` (tests/sql/test_compile.py:
  the rows pushed into append-only tables).
- sizes of the test loops and soaks: ``DBSP_SQL_CORPUS``, ``DBSP_EO_SEEDS``, ``DBSP_EO_KEYED_SEEDS``, ``DBSP_EO_JOBS``,
  ``DBSP_CRASH_SEEDS``, ``DBSP_RESCALE_SEEDS``, ``DBSP_RESCALE_KILLS``, ``DBSP_RESCALE_CRASH_FULL``, ``DBSP_LIVE_KILLS``,
  ``DBSP_RACE_ROUNDS``, ``DBSP_WIDE_WORKERS``, ``DBSP_CONCURRENCY_ROUNDS``, ``DBSP_CONCURRENCY_KILLS``,
  ``DBSP_CONCURRENCY_STORE_ROUNDS``, ``DBSP_CONCURRENCY_BUDGET_ROUNDS``, ``DBSP_SPARK_HARNESS_ROUNDS``
  (tests/spark/test_spark_store.py),
  ``DBSP_CONNECTOR_KILLS``, ``DBSP_FILES_KILLS``, ``DBSP_STORAGE_KILLS``, ``DBSP_STORAGE_SOAK``,
  ``DBSP_SPARK_KILLS``, ``DBSP_SPARK_CLUSTER_KILLS`` (driver kills on local-cluster), ``DBSP_SPARK_LOSE_KILLS``,
  ``DBSP_SPARK_KILL_RUNTIMES``, ``DBSP_FUZZ_CASES``,
  ``DBSP_PG_KILLS``, ``DBSP_DELTA_KILLS``,
  ``DBSP_AUTOSCALE_KILLS``, ``DBSP_CHANGE_KILLS``, ``DBSP_SLT_QUERIES``, ``DBSP_SLT_MEMORY_GB`` (tests/sql/slt.py: the resident memory at which a sqllogictest child is stopped),
  ``DBSP_SLT_TRACEBACK`` (tracebacks in the runner's error lines), ``DBSP_SPARK_PLACE`` (tests/spark/test_spark_store.py:
  ``0`` runs the placement test with Spark's own placement, the path before task placement by cache, to watch it fail),
  ``DBSP_OLD_BUILD`` (tests/exactly_once/test_range_format.py: the source tree, with its compiled modules, of an
  earlier build run in a subprocess to open and write directories; its tests are skipped without it).
- benchmarks: ``DBSP_FLINK_PYTHON`` (the interpreter of a venv with apache-flink, bench/nexmark.py --peers flink),
  ``DBSP_BREAKDOWN_CODE`` (bench/durable_breakdown.py --baseline: the tree whose dbsp_core a child imports).
- what a test parent tells its child process: ``DBSP_RUN``, ``DBSP_TEST_KILL_AFTER_BATCH``, ``DBSP_UPGRADE_MARKERS``,
  ``DBSP_KILL_STORE_URI`` (tests/spark/test_spark_kill.py: the store the child's pipeline uses),
  ``DBSP_KILL_LOCAL_DIRS`` (there: the directory under which each run keeps its Spark local directories, deleted by
  the next run).
"""

from __future__ import annotations

import math
import os
import re
import threading
from typing import Mapping, NamedTuple

__all__ = ["Settings", "SETTINGS", "settings", "load", "parse_number", "parse_memory_limit", "env_number", "check_native"]

NATIVE = ("DBSP_SCRATCH_MB", "DBSP_REGION_CACHE_MB")  # whole MiB >= 0, read by csrc/scratch.c


def parse_number(text: str, name: str, *, integer: bool = False, positive: bool = False) -> float:
    """``text`` as a finite number >= 0 (> 0 with ``positive``; a whole number with ``integer``), else ValueError
    naming ``name``.

    >>> parse_number(" 1.5 ", "X"), parse_number("7", "X", integer=True)
    (1.5, 7)
    >>> parse_number("-1", "DBSP_SCRATCH_MB", integer=True)
    Traceback (most recent call last):
    ...
    ValueError: DBSP_SCRATCH_MB must be a whole number >= 0, got '-1'
    """
    what = ("a whole number" if integer else "a number") + (" > 0" if positive else " >= 0")
    try:
        value = int(text.strip(), 10) if integer else float(text)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {what}, got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory_limit(value: Any, name: str = "memory_limit") -> int | None:
    """A memory limit in bytes: an int (bytes, >= 1), or text such as ``"4GiB"``, ``"512MB"``, ``"1.5 GiB"``,
    ``"100000"`` (SI units are powers of 10, IEC units and single letters powers of 2); None is no limit.
    Anything else raises TypeError or ValueError naming ``name`` and what it accepts.

    >>> parse_memory_limit("4GiB"), parse_memory_limit("512MB"), parse_memory_limit(1024), parse_memory_limit(None)
    (4294967296, 512000000, 1024, None)
    >>> parse_memory_limit("lots")
    Traceback (most recent call last):
    ...
    ValueError: memory_limit must be a number of bytes >= 1 with an optional unit (B, KB, MB, GB, KiB, MiB, GiB, ...), such as "4GiB" or "512MB", got 'lots'
    """
    if value is None:
        return None
    what = (f'{name} must be a number of bytes >= 1 with an optional unit (B, KB, MB, GB, KiB, MiB, GiB, ...), '
            f'such as "4GiB" or "512MB"')
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what}, or an int; got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{what}, got {value!r}")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}, got {value!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"{what}, got {value!r}")
    return n


def parse_flag(text: str, name: str) -> bool:
    """``"1"`` as True, ``"0"`` as False, else ValueError naming ``name``.

    >>> parse_flag(" 0 ", "DBSP_KEY_INDEX")
    False
    >>> parse_flag("yes", "DBSP_KEY_INDEX")
    Traceback (most recent call last):
    ...
    ValueError: DBSP_KEY_INDEX must be 0 or 1, got 'yes'
    """
    value = text.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return value == "1"


def parse_crashpoint(text: str, name: str) -> str:
    """``"name:n"`` (a crash point's name and a whole number n >= 1), stripped, else ValueError naming ``name``.

    >>> parse_crashpoint("commit:3", "DBSP_CRASHPOINT")
    'commit:3'
    >>> parse_crashpoint("commit", "DBSP_CRASHPOINT")
    Traceback (most recent call last):
    ...
    ValueError: DBSP_CRASHPOINT must be name:n (a crash point and a whole number n >= 1), got 'commit'
    """
    point, sep, n = text.strip().partition(":")
    if not point or not sep or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{name} must be name:n (a crash point and a whole number n >= 1), got {text!r}")
    return f"{point}:{int(n)}"


class Setting(NamedTuple):
    """One runtime setting: its variable, the :class:`Settings` field it fills, how its text parses and what unset
    means (the default: a value, or None where the reader derives one)."""

    name: str
    field: str
    kind: str  # "flag" | "number" | "whole" | "crashpoint" | "bytes"
    positive: bool = False  # numbers: > 0 rather than >= 0
    default: object = None

    def parse(self, text: str) -> object:
        """The value of ``text`` (not blank), else ValueError naming the variable."""
        if self.kind == "flag":
            return parse_flag(text, self.name)
        if self.kind == "crashpoint":
            return parse_crashpoint(text, self.name)
        if self.kind == "bytes":
            return parse_memory_limit(text, self.name)
        return parse_number(text, self.name, integer=self.kind == "whole", positive=self.positive)


SETTINGS: tuple[Setting, ...] = (  # the list of the module docstring, in its order
    Setting("DBSP_KEY_INDEX", "key_index", "flag", default=True),
    Setting("DBSP_KEY_INDEX_MB", "key_index_mb", "number", positive=True),  # None: trace/sizing.py derives it
    Setting("DBSP_KEY_INDEX_TOTAL_MB", "key_index_total_mb", "number", positive=True),  # likewise
    Setting("DBSP_PAGE_CACHE_MB", "page_cache_mb", "whole", positive=True, default=32),
    Setting("DBSP_PROGRESS", "progress", "flag"),  # None: when stderr is a terminal
    Setting("DBSP_PROGRESS_DELAY", "progress_delay", "number", default=1.0),
    Setting("DBSP_CRASHPOINT", "crashpoint", "crashpoint", default=""),
    Setting("DBSP_SCRATCH_MB", "scratch_mb", "whole"),  # None: the C core's default (csrc/scratch.c)
    Setting("DBSP_REGION_CACHE_MB", "region_cache_mb", "whole"),  # likewise
    Setting("DBSP_HUGEPAGES", "hugepages", "flag"),  # None: the C core's default (csrc/scratch.c: on)
    Setting("DBSP_MEMORY_LIMIT", "memory_limit", "bytes"),  # None: no budget unless a Pipeline sets one
    Setting("DBSP_CACHE_KEEP_MB", "cache_keep_mb", "whole", default=16),
    Setting("DBSP_STEP_PLAN", "step_plan", "flag", default=True),
    Setting("DBSP_PRUNE", "prune", "flag", default=True),
    Setting("DBSP_JEMALLOC", "jemalloc", "flag", default=False),
    Setting("DBSP_TOTALS_HOLD", "totals_hold", "whole", default=8),
    Setting("DBSP_TOTALS_PER_KEY", "totals_per_key", "flag", default=True),
    Setting("DBSP_SUBSTEP_BYTES", "substep_bytes", "bytes"),  # None: runtime/substep.py derives it from the budget
    Setting("DBSP_SPILL_NATIVE", "spill_native", "flag", default=True),
    Setting("DBSP_SPILL_GROUPED", "spill_grouped", "bytes"),  # None: format 1 only (trace/spill.py GROUPED_FROM)
    Setting("DBSP_SPILL_GROUPED_MAP", "spill_grouped_map", "flag", default=True),
)


class Settings(NamedTuple):
    """The runtime settings (:data:`SETTINGS`), typed; None where unset and the reader derives the default."""

    key_index: bool
    key_index_mb: float | None
    key_index_total_mb: float | None
    page_cache_mb: int
    progress: bool | None
    progress_delay: float
    crashpoint: str
    scratch_mb: int | None
    region_cache_mb: int | None
    hugepages: bool | None
    memory_limit: int | None
    cache_keep_mb: int
    step_plan: bool
    prune: bool
    jemalloc: bool
    totals_hold: int
    totals_per_key: bool
    substep_bytes: int | None
    spill_native: bool
    spill_grouped: int | None
    spill_grouped_map: bool


assert Settings._fields == tuple(s.field for s in SETTINGS)


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Every runtime setting parsed from ``environ`` (default ``os.environ``), defaults where unset or blank; the
    first value that does not parse raises ValueError naming its variable.

    >>> s = load({"DBSP_KEY_INDEX": "0", "DBSP_PAGE_CACHE_MB": "8"})
    >>> s.key_index, s.page_cache_mb, s.key_index_mb, s.progress_delay
    (False, 8, None, 1.0)
    >>> load({"DBSP_PAGE_CACHE_MB": "0"})
    Traceback (most recent call last):
    ...
    ValueError: DBSP_PAGE_CACHE_MB must be a whole number > 0, got '0'
    """
    env = os.environ if environ is None else environ
    values = []
    for s in SETTINGS:
        text = env.get(s.name)
        values.append(s.default if text is None or not text.strip() else s.parse(text))
    return Settings(*values)


_current: Settings | None = None
_lock = threading.Lock()


def settings() -> Settings:
    """The process's runtime settings: read from the environment at the first call (importing dbsp_core makes it),
    the same object after. Raises ValueError naming the first variable that does not parse."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = load()
    return _current


def env_number(name: str, *, integer: bool = False, positive: bool = False,
               environ: Mapping[str, str] | None = None) -> float | None:
    """The number in environment variable ``name`` (:func:`parse_number`'s rules), None when unset or blank."""
    text = (os.environ if environ is None else environ).get(name)
    if text is None or not text.strip():
        return None
    return parse_number(text, name, integer=integer, positive=positive)


def check_native(environ: Mapping[str, str] | None = None) -> None:
    """Validate the settings the C core reads from the environment itself (:data:`NATIVE`): whole MiB >= 0."""
    for name in NATIVE:
        env_number(name, integer=True, environ=environ)
