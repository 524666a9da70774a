"""Job files: a blob table written under a tag reads back exactly, and a torn, damaged or foreign file raises instead of being read (dbsp_core.runtime.job_files invariants 1 and 2)."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import CorruptionError
from dbsp_core.runtime.job_files import (input_path, read_job_input, read_table_file, remove_job_inputs, write_job_inputs,
                                write_table_file)
from dbsp_core.runtime.stage_plan import BLOB_SCHEMA, control_blobs, encode_blobs

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.utf8())])


def blobs(workers: int) -> pa.Table:
    z = dbsp.ZSet.from_arrow(pa.table({"k": list(range(50)), "s": [f"v{i}" for i in range(50)]}, schema=SCHEMA))
    rows = [(w, -1, 3, 7, z) for w in range(workers)]
    return pa.concat_tables([encode_blobs(rows), control_blobs(workers, 7)])


@pytest.mark.parametrize("sync", [False, True])
def test_round_trip(tmp_path, sync: bool) -> None:
    t = blobs(2)
    path = str(tmp_path / "x.blobs")
    write_table_file(path, b"TEST", {"a": 1, "b": [2, 3]}, t, sync)
    tag, got = read_table_file(path, b"TEST", "x")
    assert tag == {"a": 1, "b": [2, 3]} and got.equals(t)
    assert os.listdir(tmp_path) == ["x.blobs"]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty"])
def test_damaged_file_raises(tmp_path, damage: str) -> None:
    path = str(tmp_path / "x.blobs")
    write_table_file(path, b"TEST", {"a": 1}, blobs(2), False)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "magic":
        data[0:4] = b"NOPE"
    else:
        data = data[:3]
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptionError):
        read_table_file(path, b"TEST", "x")


def test_job_inputs_per_worker(tmp_path) -> None:
    storage = str(tmp_path)
    t = blobs(3)
    job = {"run": "r", "version": 4, "steps": [[7, None, None]], "fault": None}
    write_job_inputs(storage, job, t, 3)
    for w in range(3):
        tag, got = read_job_input(storage, w)
        assert tag == job
        assert got.column("part").to_pylist() == [w, w] and got.schema == BLOB_SCHEMA
    os.replace(input_path(storage, 1), input_path(storage, 0))  # worker 1's file where worker 0's belongs
    with pytest.raises(CorruptionError, match="another worker"):
        read_job_input(storage, 0)
    remove_job_inputs(storage, 3)
    with pytest.raises(FileNotFoundError):
        read_job_input(storage, 2)
