"""A process the Postgres kill tests SIGKILL at random points: a durable pipeline fed by a PostgresSource on table
``sales``, with two PostgresSinks (the table mirrored, and totals by region) in another database.

    pg_child.py STORAGE SOURCE_DSN SINK_DSN run      polls, steps and applies until killed
    pg_child.py STORAGE SOURCE_DSN SINK_DSN finish   the same until the source has nothing new and the sinks hold
                                                      every step; prints DONE <steps>

The DSNs come in the environment (PG_SOURCE_DSN, PG_SINK_DSN), never on the command line.
"""

from __future__ import annotations

import os
import sys

import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.connectors import PostgresSink, PostgresSource

SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("amount", pa.int64())])


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    s = c.input("sales", SCHEMA)
    c.output("mirror", s)
    c.output("by_region", s.group_by("region").agg(n=dbsp.count(), total=dbsp.sum("amount")))
    return c


def main(storage: str, mode: str) -> None:
    src_dsn, sink_dsn = os.environ["PG_SOURCE_DSN"], os.environ["PG_SINK_DSN"]
    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=0.2, segment_bytes=1 << 16)
    src = PostgresSource(p, "sales", src_dsn, "sales", max_changes=200)
    sinks = [PostgresSink(p, "mirror", sink_dsn), PostgresSink(p, "by_region", sink_dsn)]
    print("START", p.steps, flush=True)
    while True:
        new = src.poll()
        p.step()
        for s in sinks:
            s.poll()
        if mode == "finish" and not new and not src.pending() and all(s.next == p.steps for s in sinks):
            break
    p.close()
    print("DONE", p.steps, src.stats["duplicates"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
