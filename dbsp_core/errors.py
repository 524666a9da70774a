"""The typed exceptions of dbsp_core; every native status code maps to one of them."""

from __future__ import annotations


class DbspError(Exception):
    """Base class of every error raised by dbsp_core."""


class WeightOverflowError(DbspError, OverflowError):
    """A Z-set weight left the int64 range; weights never wrap around."""


class SchemaError(DbspError, ValueError):
    """Two schemas that must agree do not, or a column is unknown or of an unsupported type."""


class StorageError(DbspError, OSError):
    """An I/O operation of the storage layer failed (EIO, ENOSPC, ...)."""


class CorruptionError(StorageError):
    """An on-disk structure failed its checksum or validity rule.

    Its message always names ``dbsp repair`` (the command that reports what is damaged, repairs what can be, and
    says what the user can do about the rest): a message that does not already say how to use it gets a hint.
    """

    HINT = "run `dbsp repair DIR`: it says what is damaged, repairs what it can and what to do about the rest"

    def __str__(self) -> str:
        text = super().__str__()
        return text if "dbsp repair" in text else f"{text}; {self.HINT}"


class FormatVersionError(StorageError):
    """An on-disk structure has a format version this build cannot read."""


class ReplayMismatchError(DbspError):
    """A step replayed during recovery produced output that differs from what the output log already holds."""


class CircuitMismatchError(DbspError, ValueError):
    """A storage directory was opened with a circuit (or worker count) other than the one that wrote it."""


class RecoveryError(DbspError):
    """Durable state cannot be recovered consistently (e.g. the workers share no database version)."""


class WorkerStateLostError(RecoveryError):
    """A worker's state since the last durable point was lost with the process that held it (a Spark executor of a
    pipeline run with ``worker_recovery="pipeline"``, whose tasks commit to their Spark executor's cache only): the
    driver recovers the whole pipeline from the last checkpoint, replaying the input log (driver invariant 10).
    ``where`` names the (stage, worker) whose task found its state missing or behind."""


class StepError(DbspError):
    """A step failed on its data (an integer overflow, a division by zero, a user function's exception, ...).

    The pipeline stays usable at the step before it: no state was changed, nothing of the step was output, and
    the step waits, divided, until it can run. ``inputs`` lists the step's pushes as ``(input, producer, seq)``
    (an anonymous push has producer ``""`` and a seq of its own); ``Pipeline.discard(producer, seq)`` drops
    one durably, and the next ``step()`` runs the step again. ``step`` is the failed step's number, ``node`` the
    operator that failed (e.g. ``"aggregate#3"``) when known; the original exception is ``__cause__``.
    """

    def __init__(self, message: str, step: int | None = None, inputs: list | tuple = (), node: str | None = None,
                 done: list | tuple = ()) -> None:
        super().__init__(message)
        self.step = step
        self.inputs = list(inputs)
        self.node = node
        self.done = list(done)  # executor -> driver: the outputs of the steps that ran before the failing one

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.args[0] if self.args else "", self.step, self.inputs, self.node))


class InputFileError(DbspError, ValueError):
    """A file a source reads cannot be read or converted (corrupt, empty, a value that does not fit the input's
    type); the message names the file and what to do, ``path`` is the file."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.args[0] if self.args else "", self.path))


class StoreUnavailableError(StorageError):
    """An object store (``storage="s3://..."``, ...) kept failing a call through every retry: what needed it did not
    happen (a push is not acknowledged, a log segment is not durable); the message names the call, the store (without
    credentials), the attempts and the last error. Check the store's endpoint, credentials and health, then reopen
    the pipeline with ``Pipeline.open``: nothing acknowledged is lost."""


class StoreFencedError(StorageError):
    """Another pipeline opened this pipeline's object-store prefix after this one (a newer writer generation,
    dbsp_core.storage.remote invariant 6): this one stops without committing, so it cannot write over the newer
    writer's checkpoints. The message names both generations and the newer writer's host and process. Run one
    pipeline per prefix; the newer one continues from the store."""


class InUseError(StorageError):
    """A file or directory is held by another open object (an OS lock): a second writer would lose data."""


class IndexDroppedWarning(RuntimeWarning):
    """A trace dropped its key index (past its size limit, the process-wide budget, or out of memory): steps on it
    keep their results but walk its batches from then on, which is slower on a large state."""


class PrimaryKeyError(DbspError, ValueError):
    """A push or delete into a table with a primary key that the key refuses (a null key value, a weight other than
    +1 or -1), or a delete by key on a table without one; nothing was recorded."""


class AppendOnlyError(DbspError, ValueError):
    """A push of a row with a weight other than positive (a retraction) into an input declared append-only
    (``Circuit.input(..., append_only=True)``, SQL ``WITH ('append_only' = 'true')``); nothing was recorded."""


class QueryError(DbspError, ValueError):
    """An ad-hoc query (``Pipeline.query``) that is refused (not one read-only SELECT) or that DuckDB cannot run
    (bad SQL, a table or view that is not readable); the message says which and what the query can read."""
