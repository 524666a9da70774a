"""Measures three things people want to see as pictures and draws them as PNGs beside RESULTS.md: throughput against each peer (small changes against large state, and a join-aggregate view kept current over a stream: bench_circuits.py's (a) and (b) workloads), step latency over the steps of a durable pipeline (with its checkpoints), and memory over time (that run, and a windowed view over an endless stream).

Run from the repository root (``pip install -e ".[bench]"`` first; about a minute and a half on two cores):

    python bench/plots.py                 # measure, write bench/plots.json, draw bench/*.png
    python bench/plots.py --replot        # draw again from bench/plots.json
    python bench/plots.py --quick         # small sizes, for a smoke run

Every number of one figure comes from the same data in the same run. The small-change panel shows every query of
bench_circuits.py's (a), ours and DuckDB's, as steps per second by the mean of 200 consecutive steps (merges
included), the ratio of the means and our p99 under each pair; the stream panel's DuckDB and pandas recompute the
view after every step, all measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import dbsp_core as dbsp  # noqa: E402
from bench_circuits import (auctions_table, bench_a, join_agg_circuit, make_stream, run_ours,  # noqa: E402
                            sampled_recompute)

JSON = os.path.join(HERE, "plots.json")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssSampler:
    """Samples this process's resident memory every ``interval`` seconds on a thread."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, _rss_mib()))
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure_small_changes(state_rows: int, change_rows: int, steps: int) -> dict:
    """Steps per second of ``change_rows``-row changes against ``state_rows`` rows of state, ours against DuckDB
    recomputing the view (bench_circuits.py's (a), per query), by the mean of ``steps`` consecutive steps (merges
    included), with our p99 beside it."""
    res = bench_a(state_rows, change_rows, steps)  # every query of (a), the slow ones too
    return {"state_rows": state_rows, "change_rows": change_rows, "steps": steps, "by": "mean",
            "steps_per_s": {r["query"]: {"dbsp": 1e3 / r["ours_mean_ms"], "DuckDB recompute": 1e3 / r["duckdb_mean_ms"]}
                            for r in res},
            "dbsp_p99_ms": {r["query"]: r["ours_p99_ms"] for r in res}}


def measure_throughput(total_rows: int, step_rows: int) -> dict:
    """M rows/s with the view current after every step: ours at W=1 and W=2, DuckDB and pandas recomputing."""
    auctions = auctions_table(100_000, 1000)
    batches = make_stream(total_rows, step_rows, 100_000)
    run_ours(batches[:len(batches) // 3], auctions, 1)  # untimed warm-up, as bench_circuits' (b): the first run
    # in a process pays for growing the heap, which would flatter W=2 against W=1
    ours = {w: run_ours(batches, auctions, w)[0] for w in (1, 2)}
    duck, pand, _ = sampled_recompute(batches, auctions, samples=None)  # measured at every step, not estimated
    rate = lambda s: total_rows / s / 1e6  # noqa: E731
    return {"rows": total_rows, "step_rows": step_rows, "peers": "measured at every step",
            "mrows_per_s": {"dbsp W=1": rate(ours[1]), "dbsp W=2": rate(ours[2]),
                            "DuckDB recompute": rate(duck), "pandas recompute": rate(pand)}}


def measure_durable(steps: int, step_rows: int) -> dict:
    """Per-step latency (from Pipeline.metrics) and memory of a durable join-aggregate pipeline with a
    checkpoint every second."""
    rng = np.random.default_rng(5)
    auctions = auctions_table(100_000, 1000)
    with tempfile.TemporaryDirectory() as d, RssSampler() as mem:
        p = dbsp.Pipeline(join_agg_circuit(), workers=2, storage=d, checkpoint_interval=1.0)
        p.push("auctions", auctions)
        p.step()
        checkpoints = []
        for _ in range(steps):
            p.push("bids", pa.table({"auction": rng.integers(0, 100_000, step_rows),
                                     "bidder": rng.integers(0, 1000, step_rows),
                                     "price": rng.integers(1, 10_000, step_rows)}))
            before = p._last_checkpoint  # set when the driver starts a checkpoint after a step
            p.step()
            if p._last_checkpoint != before:
                checkpoints.append(p.steps - 1)
        lat = p._metrics.recent_latencies()
        m = p.metrics(state=False)
        p.close()
    return {"latency": [[s, sec] for s, sec in lat], "checkpoints": sorted(set(checkpoints)),
            "mean_ms": m["step_seconds"]["mean"] * 1e3, "p99_ms": m["step_seconds"]["p99"] * 1e3,
            "rss": mem.samples, "step_rows": step_rows}


def measure_windowed(steps: int, step_rows: int) -> dict:
    """Memory of a tumbling-window count over an endless stream: closed windows' state is dropped."""
    c = dbsp.Circuit()
    bid = c.input("bid", pa.schema([("auction", pa.int64()), ("price", pa.int64()), ("t", pa.int64())]),
                  event_time="t", lateness=10)
    c.output("w", bid.tumble("t", 100).group_by("window_start", "auction").agg(n=dbsp.count(),
                                                                                 top=dbsp.max("price")))
    rng = np.random.default_rng(6)
    with RssSampler() as mem:
        p = dbsp.Pipeline(c, workers=2)
        for s in range(steps):
            p.push("bid", pa.table({"auction": rng.integers(0, 50_000, step_rows),
                                    "price": rng.integers(1, 10_000, step_rows),
                                    "t": np.full(step_rows, s * 10, dtype=np.int64)}))
            p.step()
        p.close()
    return {"rss": mem.samples, "steps": steps, "step_rows": step_rows}


def _phase(name: str, quick: bool) -> dict:
    """Run a memory-measuring phase in a fresh process, so its memory curve starts from a clean baseline."""
    import subprocess

    r = subprocess.run([sys.executable, __file__, "--phase", name] + (["--quick"] if quick else []),
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def draw(data: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    meta = f"{data['machine']}, {data['when']}"

    tp, sc = data["throughput"], data["small_changes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.4), gridspec_kw={"width_ratios": [2.2, 1]})
    queries = list(sc["steps_per_s"])
    x = np.arange(len(queries))
    for k, (peer, color) in enumerate((("dbsp", "#2a7"), ("DuckDB recompute", "#888"))):
        vals = [sc["steps_per_s"][q][peer] for q in queries]
        bars = left.bar(x + (k - 0.5) * 0.38, vals, 0.38, color=color, label=peer)
        for b, v in zip(bars, vals):
            left.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    labels = []
    for q in queries:  # the ratio by means and our p99 under each pair
        ratio = sc["steps_per_s"][q]["dbsp"] / sc["steps_per_s"][q]["DuckDB recompute"]
        p99 = sc.get("dbsp_p99_ms", {}).get(q)
        labels.append(f"{q}\n{ratio:.0f}x" + (f", p99 {p99:.2f} ms" if p99 is not None else ""))
    left.set_xticks(x, labels, fontsize=7, rotation=25, ha="right")
    left.set_yscale("log")
    top = max(max(d.values()) for d in sc["steps_per_s"].values())
    left.set_ylim(top=top * 8)  # room for the legend above the bars
    by = f"by the mean of {sc['steps']} steps" if sc.get("by") == "mean" else "by the median step"
    left.set_ylabel(f"steps/s {by} (log)", fontsize=8)
    left.set_title(f"{sc['change_rows']:,}-row changes, {sc['state_rows']:,} rows of state; "
                   f"under each pair: ours / DuckDB, and our p99", fontsize=9)
    left.legend(fontsize=8, loc="upper right", ncol=2)
    names, vals = list(tp["mrows_per_s"]), list(tp["mrows_per_s"].values())
    bars = right.barh(names[::-1], vals[::-1], color=["#2a7", "#2a7", "#888", "#888"][::-1])
    for b, v in zip(bars, vals[::-1]):
        right.text(v, b.get_y() + b.get_height() / 2, f" {v:.2f}", va="center", fontsize=8)
    right.set_xlabel("M input rows/s, view current after every step")
    right.set_title(f"Join + group-by: {tp['rows']:,} rows in steps of {tp['step_rows']:,}\n"
                    + ("peers measured at every step" if tp.get("peers") else "peers estimated from sampled steps"),
                    fontsize=9)
    right.set_xlim(0, max(vals) * 1.2)
    fig.text(0.01, 0.01, meta, fontsize=7, color="#666")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.append(os.path.join(HERE, "throughput.png"))
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    du = data["durable"]
    lat = np.array(du["latency"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(lat[:, 0], lat[:, 1] * 1e3, lw=0.8, color="#2a7", label="step latency")
    for i, s in enumerate(du["checkpoints"]):
        ax.axvline(s, color="#c44", lw=0.6, alpha=0.6, label="checkpoint started" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title(f"Durable pipeline, 2 workers, {du['step_rows']:,}-row steps: mean {du['mean_ms']:.1f} ms, "
                 f"p99 {du['p99_ms']:.1f} ms", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, meta, fontsize=7, color="#666")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.append(os.path.join(HERE, "step_latency.png"))
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key, label, color in (("durable", f"durable join + group-by, {data['durable']['step_rows']:,}-row steps (state grows)",
                               "#27a"),
                              ("windowed", f"tumbling-window count, {data['windowed']['step_rows']:,}-row steps "
                               "(closed windows dropped)", "#a72")):
        r = np.array(data[key]["rss"])
        ax.plot(r[:, 0], r[:, 1], lw=1, color=color, label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("resident memory, MiB")
    ax.set_title("Memory over time (RSS of a fresh process per run, sampled every 50 ms)", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, meta, fontsize=7, color="#666")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.append(os.path.join(HERE, "memory.png"))
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replot", action="store_true", help="draw from bench/plots.json without measuring")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--json", default=JSON, help="where the measurements go (default bench/plots.json)")
    ap.add_argument("--phase", choices=["durable", "windowed"], help=argparse.SUPPRESS)  # one phase, as JSON
    args = ap.parse_args(argv)
    if args.phase:
        fn = measure_durable if args.phase == "durable" else measure_windowed
        # 1500 steps of 10k rows: several seconds, so the durable run takes several checkpoints (one a second)
        print(json.dumps(fn(30 if args.quick else 1500, 2_000 if args.quick else 10_000)))
        return 0
    if args.replot:
        with open(args.json) as f:
            data = json.load(f)
    else:
        q = args.quick
        data = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start, dbsp_core "
                           f"{dbsp.__version__}"}
        data["small_changes"] = measure_small_changes(100_000 if q else 1_000_000, 1_000, 20 if q else 200)
        data["throughput"] = measure_throughput(200_000 if q else 10_000_000, 20_000 if q else 100_000)
        print("small changes (steps/s by mean):", {name: {k: round(v) for k, v in d.items()}
                                                    for name, d in data["small_changes"]["steps_per_s"].items()})
        print("throughput (M rows/s):", {k: round(v, 3) for k, v in data["throughput"]["mrows_per_s"].items()})
        data["durable"] = _phase("durable", q)
        print(f"durable: mean {data['durable']['mean_ms']:.1f} ms, p99 {data['durable']['p99_ms']:.1f} ms, "
              f"{len(data['durable']['checkpoints'])} checkpoints")
        data["windowed"] = _phase("windowed", q)
        data["machine"] += f", load {os.getloadavg()[0]:.1f} at end"
        with open(args.json, "w") as f:
            json.dump(data, f)
    for path in draw(data):
        print("wrote", os.path.relpath(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
