"""Running circuits: the driver (``Pipeline``) over pluggable executors (embedded threads, or staged jobs on a job runner), and layout changes.

How the pieces fit (each module states its own invariants):

- ``driver.py``: one ``Pipeline`` class. It validates and (durably) logs pushes with producer/seq dedup (its
  seen set is dbsp_core/storage/dedup.py), divides input into steps with their determinants (now, seed,
  watermarks), hands divided steps to the executor, logs their output, takes checkpoints, recovers, and changes
  layouts. Nothing here depends on how steps run.
- ``division.py``: a divided step as the driver keeps it until it runs (divided now, or read back on recovery).
- ``recovery.py``: opening a storage directory for the driver: format checks, an interrupted repair or layout
  change settled, the executor's state put at its step, and the driver record and input log read back into
  the divided steps to run again and the pushes to queue.
- ``executor.py``: the protocol between driver and executor (everything the driver asks of one, including how
  a live rescale moves its state), and the step record they share.
- ``plan.py``: the step plan: each worker's live nodes lowered, when its workers are built and at every layout
  change, to the calls of one step, with the chains it covers fused into one call (the design note there).
- ``embedded.py``: W threads in this process; state in memory, checkpointed by ``coordinator.py`` (all workers
  pause at one step, commit a version each; the newest version every worker holds is the checkpoint).
- ``substep.py``: under a memory budget, a step whose pushes are bigger than a share of it runs in the embedded
  executor as sub-steps over slices of its input (the user sees one step), when every live node is split-safe.
- ``staged.py`` (driver side), ``stage_plan.py`` (the circuit cut into stages; blobs), ``stage_task.py`` (runs
  inside a task, against its stage database), ``job_files.py`` (blob files between driver and tasks); a job
  runner moves blobs between tasks (``LocalJobRunner`` here, ``spark_glue.SparkJobRunner`` on Spark).
- Each executor gives every worker's operator instances a ``StepContext`` (dbsp_core/operators/context.py): the
  runtime sits above the operators and the circuit and imports them, never the other way (the layers of
  dbsp_core are listed in the README's Layout section and checked by tests/test_layers.py).
- ``rescale.py``: layout changes, cold and live. The layout (dbsp_core.layout: S shards, owner table) is
  saved in ``LAYOUT`` and in every state database; every stored value belongs to one shard
  (dbsp_core.storage.snapshot), so a cold change of worker count moves the values of the shards whose owner
  changes between databases (dbsp_core.storage.shardmove), commits one new version of every state database, and
  switches ``LAYOUT``; a ``RESCALE`` record lets recovery finish or undo an interrupted change. A live change
  (``Pipeline.rescale``: ``LiveRescale``) moves its shards in waves, one pause of the steps each (in memory the
  moved rows' merges wait for short pauses after the last wave), records its target in ``RESCALE`` first, and recovery after a crash midway finishes it (settling what an in-memory
  executor's last checkpoint left, then a cold change to the target).
- ``autoscale.py``: ``Autoscale`` (a user's bounds and targets) and ``decide``, a pure function from a pipeline's
  measurements (step samples with the workers' busy times, backlog, the bytes a move would take) to a decision;
  ``autoscaler.py`` runs it after steps and makes a decided live rescale on a thread of its own, one at a time.
- ``migrate.py``: the embedded executor's side of a live change: operator state moves between its workers in
  memory, a wave of shards at a time, at a step boundary (the staged executor makes each wave a cold change).
- ``change.py``: program changes (bootstrapping): opening a directory with a changed circuit keeps the state of
  the nodes whose fingerprint (by content) is unchanged, builds new and changed views from the contents of
  materialized or keyed tables (a fresh copy of the circuit run over them as one step), and makes a rebuilt
  view's first output its full contents; no checkpoint is taken until that step ran, so a crash redoes it.
- ``upgrade.py``: opening a directory of the previous release (directory format 1): its state databases are
  converted into format-2 copies and META switches last, so a crash leaves a directory either release opens.
- ``crashpoints.py``: named crash points for the kill -9 tests (a no-op unless armed).
- ``rollback.py``: puts operator instances back as they were before a step that failed on its data (StepError:
  the step waits, divided, until ``Pipeline.discard`` drops a bad push; a discard record in the input log makes
  recovery do the same).

The driver also updates a ``dbsp_core.metrics.Metrics`` (``Pipeline.metrics()``, Prometheus text) on push, step
and checkpoint, and truncates the output log through the consumer registry (dbsp_core.storage.consumers): below
the lowest step every registered consumer acknowledged, and the retention setting.

Step: push -> (input log) -> divide (division record) -> executor.run -> output log -> returned.
Checkpoint at X: executor captures state (steps paused) -> output log flushed -> state committed -> driver.db
at X -> input log truncated below X -> output log truncated below min(X, consumers, retention) -> METRICS.
Open: finish an interrupted repair -> upgrade a format-1 directory -> every state database LAYOUT names is there
(storage/statefiles.py) -> resolve RESCALE -> executor.open_state (version v, step X) -> finish an interrupted
live change (cold, to its target) -> optional cold rescale (v -> v+1) -> a program change recorded in META (change.py) -> load (nodes renamed by fingerprint) -> metrics
counters from METRICS -> complete dedup from the log -> bootstrap the built nodes -> replay divided steps >= X.
"""

from __future__ import annotations

from dbsp_core.runtime.driver import Ack, Pipeline
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.executor import Executor, StepInput
from dbsp_core.runtime.staged import Job, JobRunner, LocalJobRunner, StagedExecutor

__all__ = ["Ack", "EmbeddedExecutor", "Executor", "Job", "JobRunner", "LocalJobRunner", "Pipeline",
           "StagedExecutor", "StepInput"]
