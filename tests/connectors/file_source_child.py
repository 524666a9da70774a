"""A process the FileSource restart test kills with SIGKILL: ``file_source_child.py STORAGE INBOX EXPECTED [immutable]`` opens (or creates) the pipeline, pushes the files of INBOX one poll and one step at a time through a FileSource with the default name, printing ``PUSHED <n>`` after each, and prints ``DONE skipped=<row groups skipped> duplicates=<pushes found duplicate>`` once EXPECTED files are in.

With ``immutable`` the source declares its files immutable (pushes logged by reference to the files) and the
pipeline takes no checkpoint before its close, so every restart replays every step from the files; ``START``
then also says how many steps recovery replayed."""

from __future__ import annotations

import os
import sys

import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.connectors import FileSource


def circuit() -> dbsp.Circuit:
    """Two inputs of the same schema and a view of every row of both (their union, multiplicities kept)."""
    c = dbsp.Circuit()
    schema = pa.schema([("k", pa.int64()), ("v", pa.int32())])
    t, u = c.input("t", schema), c.input("u", schema)
    c.output("rows", t + u)
    return c


def main(storage: str, inbox: str, expected: int, immutable: bool = False) -> None:
    every = None if immutable else 0.05
    p = (dbsp.Pipeline.open(storage, circuit(), checkpoint_interval=every) if os.path.exists(storage)
         else dbsp.Pipeline(circuit(), storage=storage, checkpoint_interval=every))
    src = FileSource(p, "t", inbox, immutable_files=immutable)
    print("START", p.steps, f"replayed={p.stats['replayed_steps']}", flush=True)
    while src.pending() or src.stats["files"] < expected:
        new = src.poll(max_files=1)
        p.step()
        print("PUSHED", new, flush=True)
    p.close()
    print(f"DONE skipped={src.stats['skipped']} duplicates={src.stats['duplicates']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["immutable"])
