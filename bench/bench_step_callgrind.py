"""Instructions of each step under callgrind for bench_scaling's workloads: mean, p50, p99 and max over consecutive steps, a load-independent stand-in for step latency.

Run from the repository root (needs valgrind; loading runs uninstrumented, so a 20M-row state loads in a few
minutes, then each measured step costs about a second):

    python bench/bench_step_callgrind.py group_by --state 1M --groups 100k --steps 200
    python bench/bench_step_callgrind.py join distinct --state 10M --groups 1M
    python bench/bench_step_callgrind.py group_by --tree ../other-checkout     # the same run on other code
    python bench/bench_step_callgrind.py group_by_min_max --step-thread        # the stepping thread only

The child loads the state as bench_scaling.py does (``--load-step``-row steps), runs 20 unmeasured steps, and
then waits before each measured step until this script has dumped callgrind's counters (``callgrind_control
--dump``), so each dump holds exactly one step: its push, step and trace merges. Instrumentation is switched
on only for the measured steps (``--instr-atstart=no``). Wall-clock numbers on a shared machine swing with
the load; these do not (cache misses are not counted: a big state's cold batches cost more than this shows).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(tree: str, query: str, state: int, groups: int, steps: int, load_step: int, d: str) -> None:
    sys.path.insert(0, tree)
    sys.path.insert(0, os.path.join(tree, "bench"))
    sys.path.insert(0, HERE)
    import numpy as np

    import dbsp_core as dbsp
    from bench_scaling import JOINED, auctions, bids, circuit

    rng = np.random.default_rng(7)
    p = dbsp.Pipeline(circuit(query), workers=1)
    if query in JOINED:
        p.push("auctions", auctions(query, groups))
    loaded, pool = 0, None
    while loaded < state:
        n = min(load_step, state - loaded)
        t = bids(rng, n, query, groups)
        if pool is None:
            pool = t.slice(0, 100 * (steps + 21))
        p.push("bids", t)
        p.step()
        loaded += n
    neg = np.full(100, -1, dtype=np.int64)
    changes = [(bids(rng, 900, query, groups), pool.slice(i * 100, 100)) for i in range(steps + 21)]
    for i, (ins, dels) in enumerate(changes):
        if i == 20:
            print("READY", flush=True)
        if i >= 20:  # the measured steps (the first of them is dropped: it holds the switch-on)
            sys.stdin.readline()  # blocked in read(2) until the parent has dumped the last step: no polling (a
            # failed os.stat raising inside os.path.exists cost ~110k instructions a step in the dumps)
        p.push("bids", ins)
        p.push("bids", dels, weights=neg[:dels.num_rows])
        p.step()
        if i >= 20:
            print(f"DONE {i}", flush=True)
    while not os.path.exists(os.path.join(d, "quit")):
        time.sleep(0.01)
    os._exit(0)  # no teardown of a big state in the last dump


def measure(tree: str, query: str, state: int, groups: int, steps: int, load_step: int,
            keep: str | None = None, cache_sim: bool = False, step_thread: bool = False) -> list[list[int]]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
        sim = (["--cache-sim=yes"] if cache_sim else []) + (["--separate-threads=yes"] if step_thread else [])
        pr = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", *sim, f"--callgrind-out-file={out}",
                               sys.executable, os.path.abspath(__file__), "--child", tree, query, str(state),
                               str(groups), str(steps), str(load_step), d],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
        try:
            line = pr.stdout.readline()
            if not line.startswith("READY"):
                raise SystemExit(f"the child exited ({pr.wait()}) before measuring: {line!r}")
            subprocess.run(["callgrind_control", "--instr=on", str(pr.pid)], capture_output=True, check=True)
            for i in range(20, steps + 21):
                pr.stdin.write("go\n")
                pr.stdin.flush()
                line = pr.stdout.readline()
                if not line.startswith("DONE"):
                    raise SystemExit(f"the child stopped before step {i}: {line!r}")
                subprocess.run(["callgrind_control", "--dump", str(pr.pid)], capture_output=True)
            open(os.path.join(d, "quit"), "w").close()
            pr.wait()
        finally:
            if pr.poll() is None:
                pr.kill()
        counts = []
        # (with step_thread, callgrind dumps each thread apart, "<out>.<n>-<thread>": thread 01 is the stepping one)
        for f in sorted(glob.glob(out + (".*-01" if step_thread else ".*")),
                        key=lambda f: int(f.rsplit(".", 1)[1].split("-")[0])):
            m = re.search(r"^(?:summary|totals):((?: \d+)+)", open(f).read(), re.M)
            counts.append([int(x) for x in m.group(1).split()])  # Ir, then (cache_sim) Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
            if keep:  # each step's dump, for callgrind_annotate
                os.makedirs(keep, exist_ok=True)
                shutil.copy(f, os.path.join(keep, f"{query}.{os.path.basename(f)}"))
        return counts[1:]  # the first dump holds the switch-on as well as its step


def _count(s: str) -> int:
    mult = {"k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def main() -> int:
    if "--child" in sys.argv:
        a = sys.argv[sys.argv.index("--child") + 1:]
        child(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), a[6])
        return 0
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("queries", nargs="+", help="of bench_scaling.QUERIES")
    ap.add_argument("--state", type=_count, default=1_000_000)
    ap.add_argument("--groups", type=_count, default=100_000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--load-step", type=_count, default=1_000_000)
    ap.add_argument("--tree", default=os.path.dirname(HERE), help="the checkout whose dbsp_core to measure")
    ap.add_argument("--keep", help="a directory to copy each step's callgrind dump into (for callgrind_annotate)")
    ap.add_argument("--cache-sim", action="store_true", help="also simulate the caches (valgrind's model of a "
                    "two-level cache, not this host's): data-cache and last-level misses a step, several times slower")
    ap.add_argument("--step-thread", action="store_true", help="count the stepping thread's instructions only "
                    "(callgrind --separate-threads=yes): not the merge thread's, which runs beside the step")
    args = ap.parse_args()
    for q in args.queries:
        m = np.array(measure(os.path.abspath(args.tree), q, args.state, args.groups, args.steps, args.load_step,
                             args.keep, args.cache_sim, args.step_thread), dtype=np.float64)
        c = m[:, 0] / 1e6
        print(f"{q} {args.state:,} rows / {args.groups:,} groups ({os.path.basename(os.path.abspath(args.tree))}): "
              f"{len(c)} steps, M instructions per step: mean {c.mean():.2f}, p50 {np.percentile(c, 50):.2f}, "
              f"p99 {np.percentile(c, 99):.2f}, max {c.max():.2f}", flush=True)
        if args.cache_sim:  # the events' order: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
            d1, ll = (m[:, 4] + m[:, 5]) / 1e3, (m[:, 7] + m[:, 8]) / 1e3
            print(f"    k data misses per step: D1 mean {d1.mean():.1f} p50 {np.percentile(d1, 50):.1f}; last level "
                  f"mean {ll.mean():.1f} p50 {np.percentile(ll, 50):.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
