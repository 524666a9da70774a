"""Where one Nexmark query's time goes in one process: CSV parsing, push and step (wall and the process's CPU seconds, which other load on the machine barely moves), the per-operator profile, and with --cprofile the hottest functions by CPU time.

Run:  python bench/nexmark_profile.py q17 --workers 2 [--events 1000000] [--cprofile]

The events come from the project's generator (seed 0, steps of --batch events), written to CSV in memory once
and parsed inside the timed loop as bench/nexmark.py does beside Flink; only the streams the query reads are
parsed (flink_nexmark.READS). The executor merges on the workers' threads, as in bench/nexmark.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import pyarrow as pa
import pyarrow.csv as pa_csv

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dbsp_core as dbsp  # noqa: E402
import flink_nexmark  # noqa: E402  (bench/, beside this file)
from dbsp_core import nexmark  # noqa: E402
from dbsp_core.profile import format_table  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("query")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--cprofile", action="store_true", help="also the 15 hottest functions by CPU time")
    args = ap.parse_args()
    if args.query not in nexmark.QUERIES:
        sys.exit(f"unknown query {args.query!r}: the queries are q0..q22")
    reads = flink_nexmark.READS.get(args.query, tuple(nexmark.SCHEMAS))
    steps = []
    for b in nexmark.generate(args.events, seed=0, batch=args.batch):
        step = {}
        for name, t in b.items():
            buf = io.BytesIO()
            pa_csv.write_csv(t, buf, pa_csv.WriteOptions(include_header=False))
            step[name] = (buf.getvalue(), t.num_rows)
        steps.append(step)

    def parse(data: bytes, name: str) -> pa.Table:
        schema = nexmark.SCHEMAS[name]
        return pa_csv.read_csv(pa.BufferReader(data), read_options=pa_csv.ReadOptions(column_names=schema.names),
                               convert_options=pa_csv.ConvertOptions(column_types=schema, strings_can_be_null=False))

    p = dbsp.Pipeline(nexmark.circuit(args.query), workers=args.workers,
                      executor=EmbeddedExecutor(background_merge=False))
    if args.query == "q13":
        p.push("side_input", nexmark.side_input())
    read = push = step_s = engine = 0.0  # engine: the process's CPU seconds in push_many and step (no parsing)
    events = 0
    prof = cProfile.Profile(time.process_time) if args.cprofile else None
    cpu0 = time.process_time()
    if prof:
        prof.enable()
    for st in steps:
        t0 = time.perf_counter()
        tables = [(name, parse(st[name][0], name)) for name in reads]
        t1, c1 = time.perf_counter(), time.process_time()
        p.push_many(tables)
        t2 = time.perf_counter()
        p.step()
        t3 = time.perf_counter()
        engine += time.process_time() - c1
        read, push, step_s = read + t1 - t0, push + t2 - t1, step_s + t3 - t2
        events += sum(n for _, n in st.values())
    if prof:
        prof.disable()
    cpu = time.process_time() - cpu0
    total = read + push + step_s
    print(f"{args.query} W={args.workers}: {events / total:,.0f} events/s; wall: parse {read:.2f} s, push {push:.2f} s, "
          f"step {step_s:.2f} s; CPU {cpu:.2f} s (engine {engine:.3f} s); load average {os.getloadavg()[0]:.1f}")
    print(format_table(p.profile()))
    p.close()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
