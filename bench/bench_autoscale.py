"""Benchmark of autoscaling under a load swing: the input rate steps up 8x and back down twice, with a step-latency target; an autoscaled embedded pipeline against a fixed minimum and a fixed maximum size on the same input (same rows, same schedule): the fraction of steps meeting the target, worker-seconds, the number of rescales, and the step latency during each rescale; a timeline of rate, workers and latency.

Run: python bench/bench_autoscale.py [--low S] [--high S] [--target-ms T] [--tick S] [--max-workers W]
[--merge-thread] [--quick]. A stepping loop pushes every ``tick`` what the rate schedule says arrived since the last
step (rows pre-generated, sliced zero-copy) and steps; a step that overruns is followed at once by the next (the rows
wait: backlog). The rates are calibrated first (``--rate`` sets the low one instead): the step cost against its rows
is measured at 1 worker and at the most, and the high rate is chosen so that the target sits at the geometric mean
of the two predicted high-step latencies (1 worker misses it, the most workers meet it, by the printed margin). The
schedule is low, high, low, high, low (``--low`` and ``--high`` seconds); the worker-seconds floor an autoscaled run
could reach, (low time * 1 + high time * W) / (total * W), is printed. Every pipeline merges its traces on its
workers' threads (``--merge-thread``: on a merge thread while a core is free, a Pipeline's default, with which one
worker already uses a second core for a third of this workload's step: see bench/RESULTS.md, Autoscaling), so that
worker-seconds are core-seconds. Worker-seconds integrate the worker count over the run. "During a rescale" are the
steps that overlapped one (from its decision to its end). Writes bench/autoscale.json (every step: time, rate,
workers, latency) and, if matplotlib is installed, bench/autoscale.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime.embedded import EmbeddedExecutor  # noqa: E402

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
KEYS = 200_000


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v"), hi=dbsp.max("v")))
    c.output("u", t.select(k="k").distinct())
    return c


def pool(rows: int, seed: int = 7) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"k": rng.integers(0, KEYS, rows), "v": rng.integers(0, 1000, rows)}, schema=SCHEMA)


class Calibration(NamedTuple):
    """The per-step cost measured at 1 worker and at the most (``cost[w] = (fixed s, s per row)``), the high
    phase's rows per step chosen from it, and the latency it predicts at each size."""

    cost: dict[int, tuple[float, float]]
    high_rows: int
    predicted_s: dict[int, float]

    def low_rate(self, tick: float) -> float:
        return self.high_rows / (8 * tick)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``seconds = a + b * rows`` (a >= 0) over (rows, seconds) medians."""
    n = np.array([x for x, _ in points], dtype=float)
    t = np.array([y for _, y in points])
    b, a = np.polyfit(n, t, 1)
    if a < 0:
        a, b = 0.0, float(np.sum(n * t) / np.sum(n * n))
    return float(a), float(b)


def calibrate(data: pa.Table, target_s: float, workers: int, merge_thread: bool = False,
              sizes: tuple[int, ...] = (25_000, 100_000), reps: int = 5) -> Calibration:
    """Measure the step cost against the step's rows at 1 worker and at ``workers`` (a pipeline each, steps
    alternated between them so both see the same load of the host), then choose the high phase's rows per
    step so that the target sits at the geometric mean of the two predicted latencies: 1 worker misses it and
    ``workers`` meet it by the same factor (the margin printed)."""
    sizes_w = sorted({1, workers})
    ps = {w: dbsp.Pipeline(circuit(), workers=w, executor=EmbeddedExecutor(background_merge=merge_thread))
          for w in sizes_w}
    off = 0

    def step(p: dbsp.Pipeline, n: int) -> float:
        nonlocal off
        if off + n > data.num_rows:
            off = 0
        p.push("t", data.slice(off, n))
        off += n
        t0 = time.perf_counter()
        p.step()
        return time.perf_counter() - t0

    try:
        for _ in range(4):  # the state first: every key seen (KEYS of them), levels built
            for p in ps.values():
                step(p, 100_000)
        seen: dict[tuple[int, int], list[float]] = {}
        for _ in range(reps):
            for n in sizes:
                for w, p in ps.items():
                    seen.setdefault((w, n), []).append(step(p, n))
    finally:
        for p in ps.values():
            p.close()
    cost = {w: _fit([(n, float(np.median(seen[(w, n)]))) for n in sizes]) for w in sizes_w}

    def lat(w: int, n: float) -> float:
        return cost[w][0] + cost[w][1] * n

    lo, hi = 1_000.0, float(data.num_rows)  # lat(1)*lat(W) grows with n: bisect for target_s**2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if lat(1, mid) * lat(workers, mid) < target_s ** 2 else (lo, mid)
    n = int(lo)
    return Calibration(cost, n, {w: lat(w, n) for w in sizes_w})


def run(label: str, data: pa.Table, schedule: list[tuple[float, float]], tick: float, workers: int,
        policy: dbsp.Autoscale | None, merge_thread: bool = False) -> dict:
    """Run the schedule ([(seconds, rows/s)]) on a pipeline; returns every step and the rescales."""
    p = dbsp.Pipeline(circuit(), workers=workers, autoscale=policy,
                      executor=EmbeddedExecutor(background_merge=merge_thread))
    total = sum(d for d, _ in schedule)
    bounds = np.cumsum([0.0] + [d for d, _ in schedule])

    def rate(t: float) -> float:
        i = min(int(np.searchsorted(bounds, t, side="right")) - 1, len(schedule) - 1)
        return schedule[i][1]

    steps = []
    t0 = time.monotonic()
    last = 0.0
    carry = 0.0
    off = 0
    sizes = [(0.0, workers)]
    while True:
        now = time.monotonic() - t0
        if now >= total:
            break
        arrived = carry + rate(last) * (now - last)  # what arrived since the last step (rate at its start)
        n = int(arrived)
        carry, last = arrived - n, now
        if n:
            if off + n > data.num_rows:
                off = 0
            p.push("t", data.slice(off, n))
            off += n
        s0 = time.monotonic()
        p.step()
        s1 = time.monotonic()
        w = p.workers
        if w != sizes[-1][1]:
            sizes.append((s1 - t0, w))
        steps.append({"t": round(s0 - t0, 4), "seconds": round(s1 - s0, 5), "rows": n, "rate": rate(s0 - t0),
                      "workers": w})
        wait = tick - (time.monotonic() - s0)
        if wait > 0:
            time.sleep(wait)
    end = time.monotonic() - t0
    changes = []
    m = p.metrics(state=False)
    while policy is not None and m["autoscale"]["in_flight"]:  # a rescale in flight ends
        time.sleep(0.05)
        m = p.metrics(state=False)
    p.close()
    auto = m.get("autoscale") or {}
    for c in auto.get("changes", []):
        changes.append({"t": round(c["t"] - t0, 3), "from": c["workers"], "to": c["target"], "reason": c["reason"],
                        "result": c["result"], "seconds": c.get("seconds"), "max_pause_ms": c.get("max_pause_ms"),
                        "moved_bytes": c.get("moved_bytes"), "why": c["why"]})
    ws = 0.0
    for (ta, w), tb in zip(sizes, [s[0] for s in sizes[1:]] + [end]):
        ws += w * (tb - ta)
    return {"label": label, "steps": steps, "changes": changes, "worker_seconds": ws, "seconds": end,
            "decisions": auto.get("decisions", {})}


def summarize(r: dict, target_s: float) -> dict:
    lat = np.array([s["seconds"] for s in r["steps"]])
    during = []
    for c in r["changes"]:
        if c["result"] != "done":
            continue
        a, b = c["t"], c["t"] + (c["seconds"] or 0.0)
        inside = [s["seconds"] for s in r["steps"] if s["t"] <= b and s["t"] + s["seconds"] >= a]
        during.append({"change": f"{c['from']}->{c['to']} ({c['reason']})", "steps": len(inside),
                       "max_ms": round(max(inside) * 1000, 1) if inside else None,
                       "mean_ms": round(float(np.mean(inside)) * 1000, 1) if inside else None,
                       "max_pause_ms": c["max_pause_ms"], "moved_bytes": c["moved_bytes"]})
    high = np.array([s["seconds"] for s in r["steps"] if s["rate"] > min(x["rate"] for x in r["steps"])])
    return {"label": r["label"], "steps": len(lat), "met": round(float(np.mean(lat <= target_s)), 4),
            "met_high": round(float(np.mean(high <= target_s)), 4) if len(high) else None,
            "p50_ms": round(float(np.percentile(lat, 50)) * 1000, 1),
            "p99_ms": round(float(np.percentile(lat, 99)) * 1000, 1), "worker_seconds": round(r["worker_seconds"], 1),
            "rescales": sum(c["result"] == "done" for c in r["changes"]), "during_rescales": during}


def draw(runs: list[dict], target_s: float, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (the timeline is in the JSON)"
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for r in runs:
        t = [s["t"] for s in r["steps"]]
        axes[1].step(t, [s["workers"] for s in r["steps"]], where="post", label=r["label"])
        axes[2].plot(t, [s["seconds"] * 1000 for s in r["steps"]], ".", ms=2, label=r["label"])
    s0 = runs[0]["steps"]
    axes[0].step([s["t"] for s in s0], [s["rate"] for s in s0], where="post")
    axes[0].set_ylabel("input rows/s")
    axes[1].set_ylabel("workers")
    axes[2].axhline(target_s * 1000, color="k", lw=0.8, ls="--")
    axes[2].set_ylabel("step ms")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def worker_seconds_floor(low_s: float, high_s: float, workers: int) -> float:
    """The least share of the fixed maximum's worker-seconds an autoscaled run can use: 1 worker in the low
    phases, ``workers`` in the high ones, rescaling instantly: (low * 1 + high * W) / ((low + high) * W)."""
    return (low_s + high_s * workers) / ((low_s + high_s) * workers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--low", type=float, default=40.0, help="seconds per low phase (three of them)")
    ap.add_argument("--high", type=float, default=8.0, help="seconds per high phase (two of them)")
    ap.add_argument("--target-ms", type=float, default=150.0, help="the step-latency target")
    ap.add_argument("--tick", type=float, default=0.25, help="seconds between steps when they keep up")
    ap.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rate", type=float, default=None, help="the low rate in rows/s (default: calibrated)")
    ap.add_argument("--merge-thread", action="store_true",
                    help="merge traces on a merge thread while a core is free (the default of a Pipeline; "
                         "here off, so that one worker uses one core and worker-seconds are core-seconds)")
    ap.add_argument("--quick", action="store_true", help="8 s low and 2 s high phases (a smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "autoscale.json"))
    a = ap.parse_args(argv)
    low, high = (8.0, 2.0) if a.quick else (a.low, a.high)
    target = a.target_ms / 1000
    W = a.max_workers
    load0 = os.getloadavg()
    data = pool(2_000_000)
    cal = None
    if a.rate is None:
        cal = calibrate(data, target, W, a.merge_thread)
        rate = cal.low_rate(a.tick)
        margin = cal.predicted_s[1] / target - 1
        print("step cost (fixed + per row), steps alternated between the sizes: " + "; ".join(
            f"W={w}: {c[0] * 1000:.1f} ms + {c[1] * 1e9:.0f} ns/row" for w, c in cal.cost.items()))
        print(f"high steps of {cal.high_rows:,} rows: predicted {cal.predicted_s[1] * 1000:.0f} ms at 1 worker, "
              f"{cal.predicted_s[W] * 1000:.0f} ms at {W} (target {a.target_ms:g} ms: margin {margin:.0%} each "
              f"side)")
        if margin < 0.1:
            print(f"warning: {W} workers are predicted at most {1 + margin:.2f}x as fast as 1 here, inside the noise "
                  f"of a step: the swing cannot show the policy's gains on this host now")
    else:
        rate = a.rate
    schedule = [(low, rate), (high, 8 * rate), (low, rate), (high, 8 * rate), (low, rate)]
    floor = worker_seconds_floor(3 * low, 2 * high, W)
    policy = dbsp.Autoscale(1, W, max_step_ms=a.target_ms, window_s=3.0, interval_s=0.5, min_steps=4,
                            scale_down_window_s=high / 2)
    print(f"low rate {rate:,.0f} rows/s, high {8 * rate:,.0f} rows/s, low phases {low:g} s, high {high:g} s, tick "
          f"{a.tick} s, target {a.target_ms:g} ms; worker-s floor {floor:.0%} of the fixed maximum (1 worker low, "
          f"{W} high, no lag); merge thread {'on' if a.merge_thread else 'off'}; policy {policy}")
    runs = [run("fixed 1", data, schedule, a.tick, 1, None, a.merge_thread),
            run(f"fixed {W}", data, schedule, a.tick, W, None, a.merge_thread),
            run("autoscaled", data, schedule, a.tick, 1, policy, a.merge_thread)]
    out = {"rate": rate, "low": low, "high": high, "tick": a.tick, "target_ms": a.target_ms,
           "merge_thread": a.merge_thread, "worker_seconds_floor": round(floor, 4),
           "calibration": None if cal is None else {"cost": {str(w): c for w, c in cal.cost.items()},
                                                    "high_rows": cal.high_rows,
                                                    "predicted_s": {str(w): x for w, x in cal.predicted_s.items()}},
           "policy": policy.to_dict(),
           "cores": os.cpu_count(), "load_start": load0, "load": os.getloadavg(),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=HERE).stdout.strip(),
           "summary": [summarize(r, target) for r in runs], "runs": runs}
    with open(a.out, "w") as f:
        json.dump(out, f)
    fixed_max = out["summary"][1]["worker_seconds"]
    for s in out["summary"]:
        print(f"{s['label']:>11}: {s['steps']} steps, {s['met']:.1%} met the target ({s['met_high']:.1%} in high "
              f"phases), p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms; {s['worker_seconds']} worker-s "
              f"({s['worker_seconds'] / fixed_max:.0%} of fixed max); {s['rescales']} rescales")
        for d in s["during_rescales"]:
            print(f"             during {d['change']}: {d['steps']} steps, mean {d['mean_ms']} ms, max {d['max_ms']} "
                  f"ms; longest pause {d['max_pause_ms']} ms, {d['moved_bytes']:,} B moved")
    for c in runs[2]["changes"]:
        print(f"  t={c['t']:7.2f} s {c['from']} -> {c['to']} {c['reason']} ({c['result']}): {c['why']}")
    print(draw(runs, target, os.path.splitext(a.out)[0] + ".png"))
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
