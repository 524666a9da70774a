"""The demo's five views in memory at W = 1 and W = 2 on the same batches: each step's wall and CPU time, and where a second worker's extra CPU goes, operator by operator.

What it runs: ``dbsp_core.demo``'s circuit (five views over persons, auctions and bids) and its generator's batches
(``--batches`` of ``--bids`` bids, seed 7, the demo's defaults), pushed and stepped in memory, in a fresh child
process a run, every trace merge on the worker threads (``--merge-thread off``, the default here, as bench_circuits
(c): else at W = 1 on two cores the merges move to a merge thread and out of the operators' times); runs alternate W = 1 and W = 2 (the order flipped each round) so a load
change on a shared machine hits both.

What it reports per run: the steps' wall time (sum of ``step()``), their process CPU time (every thread: the
workers, the merge thread), the median step, and from ``Pipeline.profile()`` each operator's time summed over the
workers. A child measures that time twice: by the wall clock, the profile's own (an exchange's includes its wait at
the barrier for the other worker, an operator's its wait for the GIL), and, in a second child, by each worker
thread's CPU clock (``time.thread_time``: the work alone; the child swaps the clock of ``dbsp_core.profile`` for
it, a measurement hook of this script only). Operator kinds are summed last (exchanges, joins, aggregates, the
rest), with W = 2's CPU over W = 1's.

Run:  python bench/bench_demo_workers.py [--rounds 3] [--batches 40] [--bids 25000] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def child(workers: int, batches: int, bids: int, clock: str, merge_thread: str) -> dict:
    """One run in this process: push and step every batch; the steps' times and the profile's operators."""
    import dbsp_core as dbsp
    import dbsp_core.profile as prof
    from dbsp_core import demo
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    if clock == "cpu":  # the profile's per-operator clock becomes the worker thread's CPU clock (module docstring)
        class _ThreadClock:
            perf_counter = staticmethod(time.thread_time)
        prof.time = _ThreadClock  # type: ignore[assignment]
    gen = demo.Generator(7, 1_700_000_000_000, bids)
    data = [gen.batch() for _ in range(batches)]
    walls, cpu = [], 0.0
    ex = EmbeddedExecutor(background_merge={"default": None, "off": False}[merge_thread])
    with dbsp.Pipeline(demo.build_circuit(), workers=workers, executor=ex) as p:
        for b in data:
            for stream, (t, w) in b.items():
                p.push(demo.HANDLE[stream], dbsp.ZSet.from_arrow(t, weights=w))
            c0, t0 = time.process_time(), time.perf_counter()
            p.step()
            walls.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
        ops = {r["operator"]: r["seconds"] or 0.0 for r in p.profile(state=False)["operators"]}
    return {"wall": sum(walls), "cpu": cpu, "median_ms": statistics.median(walls) * 1e3,
            "p99_ms": float(np.percentile(walls, 99)) * 1e3, "ops": ops}


def run(workers: int, args: argparse.Namespace, clock: str) -> dict:
    arg = json.dumps([workers, args.batches, args.bids, clock, args.merge_thread])
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arg], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"W={workers} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def kind(op: str) -> str:
    name = op.split("#")[0]
    return {"exchange": "exchanges", "join": "joins", "aggregate": "aggregates"}.get(name, "the rest")


def main() -> int:
    if "--child" in sys.argv:
        w, batches, bids, clock, merge_thread = json.loads(sys.argv[sys.argv.index("--child") + 1])
        print(json.dumps(child(w, batches, bids, clock, merge_thread)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--bids", type=int, default=25_000)
    ap.add_argument("--top", type=int, default=12, help="operators shown, by W = 2's CPU")
    ap.add_argument("--merge-thread", choices=("off", "default"), default="off",
                    help="off (default): every trace merge on the worker threads, inside the operator that inserts, so "
                         "W = 1 and W = 2 count the same work in their operators; default: the executor's rule (a "
                         "merge thread while the workers leave a core free: at W = 1 on 2 cores, the merges leave "
                         "the operators' CPU)")
    args = ap.parse_args()
    res: dict = collections.defaultdict(list)
    for r in range(args.rounds):
        for w in ((1, 2) if r % 2 == 0 else (2, 1)):
            for clock in ("wall", "cpu"):
                x = run(w, args, clock)
                res[(w, clock)].append(x)
                if clock == "wall":
                    print(f"round {r + 1} W={w}: steps {x['wall']:.2f} s wall, {x['cpu']:.2f} s CPU, median step "
                          f"{x['median_ms']:.1f} ms, p99 {x['p99_ms']:.1f} ms (load {os.getloadavg()[0]:.2f})",
                          flush=True)
    for w in (1, 2):
        xs = res[(w, "wall")]
        print(f"W={w}: steps wall {min(x['wall'] for x in xs):.2f}-{max(x['wall'] for x in xs):.2f} s, CPU "
              f"{min(x['cpu'] for x in xs):.2f}-{max(x['cpu'] for x in xs):.2f} s")

    def mean_ops(w: int, clock: str) -> dict:
        runs = res[(w, clock)]
        return {op: statistics.mean(x["ops"].get(op, 0.0) for x in runs) for op in runs[0]["ops"]}

    c1, c2, w1, w2 = mean_ops(1, "cpu"), mean_ops(2, "cpu"), mean_ops(1, "wall"), mean_ops(2, "wall")
    print("\n| operator | W=1 CPU s | W=2 CPU s (both workers) | W=2 / W=1 | W=1 wall s | W=2 wall s (both) |")
    print("|---|---|---|---|---|---|")
    for op in sorted(c2, key=lambda o: -c2[o])[:args.top]:
        ratio = f"{c2[op] / c1[op]:.2f}x" if c1.get(op) else "-"
        print(f"| {op} | {c1.get(op, 0):.3f} | {c2[op]:.3f} | {ratio} | {w1.get(op, 0):.3f} | {w2.get(op, 0):.3f} |")
    sums = {k: [0.0] * 4 for k in ("exchanges", "joins", "aggregates", "the rest")}
    for i, d in enumerate((c1, c2, w1, w2)):
        for op, s in d.items():
            sums[kind(op)][i] += s
    print("\n| kind | W=1 CPU s | W=2 CPU s | W=2 / W=1 | W=1 wall s | W=2 wall s |")
    print("|---|---|---|---|---|---|")
    for k, (a, b, c, d) in sums.items():
        print(f"| {k} | {a:.3f} | {b:.3f} | {f'{b / a:.2f}x' if a else '-'} | {c:.3f} | {d:.3f} |")
    tot = [sum(v[i] for v in sums.values()) for i in range(4)]
    print(f"| all | {tot[0]:.3f} | {tot[1]:.3f} | {tot[1] / tot[0]:.2f}x | {tot[2]:.3f} | {tot[3]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
