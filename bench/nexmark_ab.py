"""Alternate two source trees (e.g. main's and a branch's) on the same Nexmark events: each run is one
``bench/nexmark.py --child`` of that tree in a fresh process, so both read the same files and are timed the same
way; prints events/s (the child's timed loop, wall) and the child's whole CPU seconds (user + system, from
``wait4``; imports and setup included, the same on both sides), per run and as a median with the spread.

A tree may be given as ``path@N``: its FileSources then read ahead N files (``run_dbsp``'s ``read_ahead``; a
tree whose bench/nexmark.py does not know it ignores it). The table also gives the seconds of the timed loop
spent in the read and push (``read_s``: the FileSources' polls, or pyarrow and push_many), where the child says.

Run:  python bench/nexmark_ab.py --trees /tmp/main,/work/wt/branch@0,/work/wt/branch --queries q0,q1,q2 \
          --modes memory,durable --source csv --reader files --pairs 3 [--events 1000000 --batch 100000 --workers 2]

The events are written once by this tree's ``nexmark.write_events`` (with ``--source csv`` the CSV twins too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nexmark as bench  # noqa: E402  (bench/nexmark.py)


def child(spec: str, arg: dict) -> tuple[dict, float]:
    """One run of ``spec``'s (``tree`` or ``tree@read_ahead``) bench/nexmark.py child: its result and its CPU
    seconds."""
    tree, _, ahead = spec.partition("@")
    if ahead:
        arg = dict(arg, read_ahead=int(ahead))
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.Popen([sys.executable, os.path.join(tree, "bench", "nexmark.py"), "--child", json.dumps(arg)],
                            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{tree}: {arg} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="comma-separated source trees, run in this order each pair")
    ap.add_argument("--queries", default="q0,q1,q2")
    ap.add_argument("--modes", default="memory,durable")
    ap.add_argument("--source", choices=["csv", "parquet"], default="csv")
    ap.add_argument("--reader", choices=["files", "push"], default="files")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    trees = args.trees.split(",")
    root = tempfile.mkdtemp(prefix="nexmark-ab-")
    try:
        files, _ = bench.write_events(root, args.events, args.batch, 0, bench.nexmark.generator.DEFAULT_RATE,
                                      csv=args.source == "csv")
        json.dump(files, open(os.path.join(root, "files.json"), "w"))
        runs: dict = {}
        for i in range(args.pairs):
            for q in args.queries.split(","):
                for mode in args.modes.split(","):
                    for tree in trees:
                        r, cpu = child(tree, {"query": q, "mode": mode, "workers": args.workers, "root": root,
                                              "source": args.source, "reader": args.reader})
                        rate = r["events"] / r["seconds"]
                        runs.setdefault((q, mode, tree), []).append((rate, cpu, r.get("read_s")))
                        print(f"pair {i + 1} {q} {mode:>7} {tree}: {rate:>12,.0f} events/s  CPU {cpu:.2f} s  "
                              f"read {r.get('read_s') or float('nan'):.3f} s  "
                              f"load {os.getloadavg()[0]:.1f}", flush=True)
        print("\n| query | mode | tree | events/s median (min-max) | CPU s median (min-max) | read+push s median |"
              "\n|---|---|---|---|---|---|")
        for (q, mode, tree), v in runs.items():
            rates, cpus, reads = [x[0] for x in v], [x[1] for x in v], [x[2] for x in v if x[2] is not None]
            print(f"| {q} | {mode} | {tree} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
                  f"| {statistics.median(cpus):.2f} ({min(cpus):.2f}-{max(cpus):.2f}) "
                  f"| {f'{statistics.median(reads):.3f}' if reads else '-'} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
