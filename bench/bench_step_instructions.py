"""Instructions per incremental step under callgrind: a load-independent measure of the (a) circuits of bench_circuits.py.

Run from the repository root (needs valgrind; about a minute per query):

    python bench/bench_step_instructions.py                       # every (a) query, 1k-row changes, 100k-row state
    python bench/bench_step_instructions.py join --state 1000000

For each query it runs this script's ``--child`` mode twice under ``valgrind --tool=callgrind`` (20 and 60
steps after the same initial load) and prints the difference of the two instruction totals divided by 40:
the instructions of one step, without the setup. Wall-clock numbers on a shared machine swing with the load;
these do not, so they compare two versions of the code exactly (run it in each tree).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def child(query: str, change: int, state: int, steps: int) -> None:
    import numpy as np

    import dbsp_core as dbsp
    from bench_circuits import AUCTIONS, BIDS, QUERIES_A, auctions_table, bids_table

    build, _ = QUERIES_A[query]
    rng = np.random.default_rng(1)
    n_auctions = state // 10
    base = bids_table(rng, state, n_auctions)
    c = dbsp.Circuit()
    b, a = c.input("bids", BIDS), c.input("auctions", AUCTIONS)
    c.output("v", build(b, a))
    p = dbsp.Pipeline(c, workers=1)
    p.push("bids", base)
    p.push("auctions", auctions_table(n_auctions, 1000))
    p.step()
    dels = change // 10
    changes = [(bids_table(rng, change - dels, n_auctions), base.slice(i * dels, dels)) for i in range(60)]
    w = np.full(dels, -1)
    for ins, old in changes[:steps]:
        p.push("bids", ins)
        p.push("bids", old, weights=w)
        p.step()


def instructions(query: str, change: int, state: int, steps: int) -> int:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
        r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                            os.path.abspath(__file__), "--child", query, "--change", str(change), "--state",
                            str(state), "--steps", str(steps)], env=env, capture_output=True, text=True)
        m = re.search(r"Collected : (\d+)", r.stderr)
        if r.returncode or not m:
            raise SystemExit(f"callgrind run failed ({r.returncode}):\n{r.stderr[-2000:]}")
        return int(m.group(1))


def main() -> int:
    from bench_circuits import QUERIES_A

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("queries", nargs="*", default=list(QUERIES_A), help=f"of {list(QUERIES_A)}")
    ap.add_argument("--change", type=int, default=1000)
    ap.add_argument("--state", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.queries[0], args.change, args.state, args.steps)
        return 0
    for q in args.queries:
        if q not in QUERIES_A:
            ap.error(f"unknown query {q!r}; choose from {list(QUERIES_A)}")
        a, b = instructions(q, args.change, args.state, 20), instructions(q, args.change, args.state, 60)
        print(f"{q}: {(b - a) // 40:,} instructions per {args.change}-row step against {args.state:,} rows of state",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
