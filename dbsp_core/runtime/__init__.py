"""Running circuits: the driver (``Pipeline``) over pluggable executors (embedded threads, or staged jobs on a job runner), the step context operators see, and layout changes."""

from __future__ import annotations

from dbsp_core.runtime.context import StepContext
from dbsp_core.runtime.driver import Ack, Pipeline
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.runtime.executor import Executor, StepInput
from dbsp_core.runtime.staged import Job, JobRunner, LocalJobRunner, StagedExecutor

__all__ = ["Ack", "EmbeddedExecutor", "Executor", "Job", "JobRunner", "LocalJobRunner", "Pipeline",
           "StagedExecutor", "StepContext", "StepInput"]
