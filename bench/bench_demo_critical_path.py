"""The CPU critical path of the demo's steps at W workers: per step, per segment of nodes between two exchange barriers, the largest worker's thread CPU in that segment, summed; a stand-in for the steps' wall time that a loaded host moves less (no waits for a core or the GIL counted).

What it runs: ``dbsp_core.demo``'s five views in memory over ``--batches`` of the generator's batches (25,000 bids,
seed 7), every merge on the worker threads, as bench_demo_workers.py does, with the profile's clock swapped for each
thread's CPU clock (a measurement hook of this script only). At W = 1 the critical path is the operators' CPU.
Alternate it over two checkouts with ``PYTHONPATH``.

Run:  PYTHONPATH=. python bench/bench_demo_critical_path.py 2 [--batches 40]
"""

import argparse
import os
import time

import dbsp_core as dbsp
import dbsp_core.profile as prof
from dbsp_core import demo
from dbsp_core.runtime import embedded as emb


class _ThreadClock:
    perf_counter = staticmethod(time.thread_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workers", type=int)
    ap.add_argument("--batches", type=int, default=40)
    args = ap.parse_args()
    prof.time = _ThreadClock  # each operator's time is its thread's CPU
    gen = demo.Generator(7, 1_700_000_000_000, 25000)
    data = [gen.batch() for _ in range(args.batches)]
    ex = emb.EmbeddedExecutor(background_merge=False)
    with dbsp.Pipeline(demo.build_circuit(), workers=args.workers, executor=ex) as p:
        for b in data:
            for stream, (t, w) in b.items():
                p.push(demo.HANDLE[stream], dbsp.ZSet.from_arrow(t, weights=w))
            p.step()
        timers = [wk.timer for wk in ex._workers]
        nodes = timers[0].nodes
        kinds = [type(ex.circuit.nodes[i]).__name__ for i in nodes]
    crit = work = 0.0
    for steps in zip(*[list(t.recent) for t in timers]):  # one step: each worker's (step, per-node seconds)
        seg = [0.0] * args.workers
        for k in range(len(nodes)):
            for w in range(args.workers):
                d = steps[w][1][k]
                seg[w] += d
                work += d
            if kinds[k] == "Exchange":  # a barrier: the segment ends at its slowest worker
                crit += max(seg)
                seg = [0.0] * args.workers
        crit += max(seg)
    print(f"W={args.workers} operators' CPU {work:.3f} s, critical path {crit:.3f} s "
          f"(load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
