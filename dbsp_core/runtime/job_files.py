"""Blob tables handed between the driver and a job's stage tasks through the storage directory: each worker's stage-0 input (written by the driver, read by the task) and each stateful stage task's result (written by the task before it commits, read by a retried attempt and by the driver).

A file is one :func:`dbsp_core.codec.frame` record (magic, format version, checksum of the body) whose body is a
4-byte little-endian header length, a JSON header (the job's tag) and one Arrow IPC stream of the table. The
CRC is computed over the Arrow buffers as written and checked over the file as read, without copying either.
With an object store (runtime/stage_store.py) the same bytes are one object per worker's input (encode_table,
decode_table), and no result file is written.

Invariants (enforced here):
  1. A reader gets the table written under the tag it asks for, or an error: a missing, torn, corrupt or
     foreign file (another job's tag) raises, it is never read as another job's blobs.
  2. Each worker has one input file, which every job replaces (atomically) before it starts and the driver
     removes when it ends; its header is the job's description, which the stage-0 task runs (and forwards to
     the later stages). So a stage-0 attempt of the running job reads that job's input; an attempt of an
     ended job (a zombie) may read a later job's input, but what it emits goes to a Spark job that no longer
     exists, and a stateful task refuses a job its database has moved past (stage_task.py invariant 3).
"""

from __future__ import annotations

import json
import os

import pyarrow as pa

from dbsp_core.codec import frame_head, unframe_view
from dbsp_core.errors import CorruptionError
from dbsp_core.storage.directory import fsync_dir
from dbsp_core.storage.formats import JOB_INPUT_MAGIC, TMP_SUFFIX, job_input_dir, job_input_path

__all__ = ["encode_table", "decode_table", "write_table_file", "read_table_file", "input_dir", "input_path", "write_job_inputs",
           "read_job_input", "remove_job_inputs"]


def encode_table(magic: bytes, tag: dict, table: pa.Table) -> list:
    """The buffers of one table file (or object) holding ``table`` under ``tag``, in order."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as wr:
        wr.write_table(table)
    ipc = sink.getvalue()
    head = json.dumps(tag, sort_keys=True).encode()
    prefix = len(head).to_bytes(4, "little") + head
    return [frame_head(magic, prefix, ipc), prefix, ipc]


def write_table_file(path: str, magic: bytes, tag: dict, table: pa.Table, sync: bool) -> None:
    """Write ``table`` under ``tag`` to ``path`` (atomically: a temporary file, then a rename).

    With ``sync`` the file and its directory are fsynced before this returns (the file survives a crash).
    """
    tmp = path + TMP_SUFFIX
    with open(tmp, "wb") as f:
        for b in encode_table(magic, tag, table):
            f.write(b)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(os.path.dirname(path) or ".")


def read_table_file(path: str, magic: bytes, where: str) -> tuple[dict, pa.Table]:
    """The ``(tag, table)`` of a :func:`write_table_file` file; FileNotFoundError if it is missing,
    CorruptionError / FormatVersionError (naming ``where``) if it is torn or damaged."""
    with open(path, "rb") as f:  # one read into memory: blobs decoded from it never pin the file
        return decode_table(f.read(), magic, where)


def decode_table(data: bytes, magic: bytes, where: str) -> tuple[dict, pa.Table]:
    """The ``(tag, table)`` of the bytes of one table file (or object), checked (invariant 1)."""
    body = unframe_view(magic, data, where)
    if body.nbytes < 4:
        raise CorruptionError(f"{where}: {body.nbytes}-byte body is shorter than its tag length")
    n = int.from_bytes(body[:4], "little")
    try:
        tag = json.loads(bytes(body[4:4 + n]))
        table = pa.ipc.open_stream(pa.py_buffer(body[4 + n:])).read_all()
    except (ValueError, pa.ArrowInvalid, OSError) as e:
        raise CorruptionError(f"{where}: unreadable body ({e})") from e
    return tag, table


# ---- stage-0 input ----


def input_dir(storage: str) -> str:
    return job_input_dir(storage)


def input_path(storage: str, worker: int) -> str:
    """The stage-0 input file of ``worker`` (one per worker: each job replaces it; invariant 2).

    >>> input_path("/p", 1)
    '/p/state/jobs/worker-1.input'
    """
    return job_input_path(storage, worker)


def write_job_inputs(storage: str, job: dict, blobs: pa.Table, workers: int) -> None:
    """Write each worker's stage-0 blobs (``part == w``) under the job description ``job`` (invariant 2).

    Not fsynced: a file is read only by the job that wrote it, and a job lost with its files is run again
    from the input log.
    """
    os.makedirs(input_dir(storage), exist_ok=True)
    parts = blobs.column("part").to_numpy()
    for w in range(workers):
        write_table_file(input_path(storage, w), JOB_INPUT_MAGIC, dict(job, worker=w),
                         blobs.filter(pa.array(parts == w)), sync=False)


def read_job_input(storage: str, worker: int) -> tuple[dict, pa.Table]:
    """The job description and the stage-0 blobs in ``worker``'s input file (invariant 1)."""
    path = input_path(storage, worker)
    tag, table = read_table_file(path, JOB_INPUT_MAGIC, path)
    if tag.pop("worker", None) != worker:
        raise CorruptionError(f"{path}: holds the input of another worker ({tag})")
    return tag, table


def remove_job_inputs(storage: str, workers: int) -> None:
    """Remove every worker's input file (when a job has ended)."""
    for w in range(workers):
        try:
            os.unlink(input_path(storage, w))
        except FileNotFoundError:
            pass
