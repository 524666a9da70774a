"""Running circuits: the driver (``Pipeline``) over pluggable executors (embedded threads, or staged jobs on a job runner), the step context operators see, and layout changes.

How the pieces fit (each module states its own invariants):

- ``driver.py``: one ``Pipeline`` class. It validates and (durably) logs pushes with producer/seq dedup, divides
  input into steps with their determinants (now, seed, watermarks), hands divided steps to the executor, logs
  their output, takes checkpoints, recovers, and changes layouts. Nothing here depends on how steps run.
- ``executor.py``: the protocol between driver and executor, and the step record they share.
- ``embedded.py``: W threads in this process; state in memory, checkpointed by ``coordinator.py`` (all workers
  pause at one step, commit a version each; the newest version every worker holds is the checkpoint).
- ``staged.py`` (driver side), ``stage_plan.py`` (the circuit cut into stages; blobs), ``stage_task.py`` (runs
  inside a task, against its stage database), ``job_files.py`` (blob files between driver and tasks); a job
  runner moves blobs between tasks (``LocalJobRunner`` here, ``spark_glue.SparkJobRunner`` on Spark).
- ``context.py``: the ``StepContext`` every operator instance gets.
- ``rescale.py``: layout changes of a storage directory. The layout (dbsp_core.layout: S shards, owner table) is
  saved in ``LAYOUT`` and in every state database; every stored value belongs to one shard
  (dbsp_core.storage.snapshot), so a cold change of worker count moves the values of the shards whose owner
  changes between databases (dbsp_core.storage.shardmove), commits one new version of every state database, and
  switches ``LAYOUT``; a ``RESCALE`` record lets recovery finish or undo an interrupted change. A live change
  (``Pipeline.rescale``) records its target in ``RESCALE`` first, and recovery after a crash midway finishes it
  (settling what an in-memory executor's last checkpoint left, then a cold change to the target).
- ``migrate.py``: the embedded executor's side of a live change: operator state moves between its workers in
  memory, a wave of shards at a time, at a step boundary (the staged executor makes each wave a cold change).
- ``upgrade.py``: opening a directory of the previous release (directory format 1): its state databases are
  converted into format-2 copies and META switches last, so a crash leaves a directory either release opens.
- ``dedup.py``: the (producer, seq) set of recorded pushes, saved with the driver's checkpoint.
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
Open: finish an interrupted repair -> upgrade a format-1 directory -> resolve RESCALE -> executor.open_state
(version v, step X) -> finish an interrupted live change (cold, to its target) -> optional cold rescale
(v -> v+1) -> load -> complete dedup from the log -> replay divided steps >= X.
"""

from __future__ import annotations

from dbsp_core.runtime.context import StepContext
from dbsp_core.runtime.driver import Ack, Pipeline
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.executor import Executor, StepInput
from dbsp_core.runtime.staged import Job, JobRunner, LocalJobRunner, StagedExecutor

__all__ = ["Ack", "EmbeddedExecutor", "Executor", "Job", "JobRunner", "LocalJobRunner", "Pipeline",
           "StagedExecutor", "StepContext", "StepInput"]
