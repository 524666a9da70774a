"""What the profile's timing costs a small step: first the loop alone (the step loop's timed ``run_nodes``, dbsp_core.profile, against the same loop without clocks or row counts, over 26 operators that return their input: the added nanoseconds per operator, minimum of many repeats, which a loaded machine barely moves), then whole steps of the demo's auction circuit (26 live operators) on steps of about 30 rows, interleaved rounds, median microseconds per step.

    python bench/bench_profile_overhead.py [--steps 400] [--rounds 5] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import dbsp_core as dbsp
import dbsp_core.runtime.embedded as embedded
from dbsp_core import profile
from dbsp_core.demo import HANDLE, Generator, build_circuit


def untimed_run_nodes(calls: list, values: dict, ctx: object, timer: object) -> None:
    """The step loop as it was before the profile: no clock, no row counts."""
    for step, inputs, i in calls:
        values[i] = step([values[j] for j in inputs], ctx)


def per_step_us(workers: int, steps: int, timed: bool) -> float:
    embedded.run_nodes = profile.run_nodes if timed else untimed_run_nodes
    gen = Generator(11, int(time.time() * 1000), 10)  # 10 bids, 10 persons, 10 auctions per step
    batches = [gen.batch() for _ in range(steps + 20)]
    p = dbsp.Pipeline(build_circuit(), workers=workers)
    try:
        times = []
        for k, b in enumerate(batches):
            for stream, (rows, weights) in b.items():
                p.push(HANDLE[stream], dbsp.ZSet.from_arrow(rows, weights))
            t0 = time.perf_counter()
            p.step()
            if k >= 20:  # after warm-up
                times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)
    finally:
        p.close()
        embedded.run_nodes = profile.run_nodes


def loop_ns_per_operator(operators: int = 26, repeats: int = 20000) -> tuple[float, float]:
    """Nanoseconds per operator of the untimed and the timed loop over ``operators`` pass-through nodes (each
    reads its one input's value), minimum over ``repeats`` steps."""
    import pyarrow as pa

    z = dbsp.ZSet.from_arrow(pa.table({"x": list(range(30))}))
    calls = [(lambda args, ctx: args[0], (i,), i + 1) for i in range(operators)]
    timer = profile.NodeTimer([i + 1 for i in range(operators)])
    out = []
    for run in (untimed_run_nodes, profile.run_nodes):
        best = float("inf")
        for _ in range(repeats):
            values = {0: z}
            t0 = time.perf_counter_ns()
            run(calls, values, None, timer)
            best = min(best, time.perf_counter_ns() - t0)
        out.append(best / operators)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    nodes = len(build_circuit().live_nodes())
    a, b = loop_ns_per_operator()
    print(f"step loop alone: untimed {a:.0f} ns per operator, timed {b:.0f} ns: {b - a:+.0f} ns per operator "
          "per step per worker")
    print(f"auction circuit, {nodes} live operators, {args.steps} steps of ~30 rows per round, {args.rounds} rounds")
    for w in args.workers:
        on, off = [], []
        for _ in range(args.rounds):  # interleaved: the machine's load drifts alike for both
            off.append(per_step_us(w, args.steps, timed=False))
            on.append(per_step_us(w, args.steps, timed=True))
        a, b = statistics.median(off), statistics.median(on)
        print(f"W={w}: untimed {a:8.1f} us/step, timed {b:8.1f} us/step, overhead {b - a:+7.1f} us "
              f"({100 * (b - a) / a:+.1f}%; {1e3 * (b - a) / nodes / w:+.0f} ns per operator per worker); "
              f"rounds untimed {[round(x) for x in off]} timed {[round(x) for x in on]}")


if __name__ == "__main__":
    main()
