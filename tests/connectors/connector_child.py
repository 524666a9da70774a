"""A process the connector kill tests SIGKILL at random points.

    connector_child.py writer STORAGE INBOX SQLITE PARQUET_DIR EXPECTED_FILES [immutable]
        runs the pipeline with a FileSource on INBOX and both sinks attached to it, until every one of
        EXPECTED_FILES files is pushed, stepped and applied by both sinks; prints DONE. With ``immutable`` the
        source declares its files immutable (pushes logged by reference to them).
    connector_child.py sink STORAGE SQLITE PARQUET_DIR TARGET_STEP
        runs both sinks over the storage directory (the pipeline runs in another process) until both have
        applied every step below TARGET_STEP; prints DONE.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.connectors import FileSource, ParquetSink, SqliteSink  # noqa: E402
from connector_workload import circuit  # noqa: E402


def writer(storage: str, inbox: str, sqlite: str, pdir: str, expected: int, immutable: bool = False) -> None:
    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=0.05, segment_bytes=4096)
    src = FileSource(p, "sales", inbox, immutable_files=immutable)
    sinks = [SqliteSink(p, "by_region", sqlite), ParquetSink(p, "big", pdir)]
    print("START", p.steps, flush=True)
    while True:
        new = src.poll(max_files=1)
        p.step()
        for s in sinks:
            s.poll(limit=4)
        caught_up = all(s.next == p.steps for s in sinks)
        if not new and caught_up and not src.pending() and len(os.listdir(inbox)) == expected:
            break
    p.close()
    print("DONE", p.steps, flush=True)


def sink(storage: str, sqlite: str, pdir: str, target: int) -> None:
    sinks = [SqliteSink(storage, "by_region", sqlite), ParquetSink(storage, "big", pdir)]
    print("START", min(s.next for s in sinks), flush=True)
    while min(s.next for s in sinks) < target:
        for s in sinks:
            s.poll(limit=2)
    for s in sinks:
        s.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "writer":
        writer(*args[:4], int(args[4]), args[5:] == ["immutable"])
    else:
        sink(*args[:3], int(args[3]))
