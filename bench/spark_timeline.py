"""Reads a Spark event log (``spark.eventLog.enabled``) and times apart a window of it, e.g. the step in flight when a Spark executor was lost (bench/bench_spark_lose.py): executor loss and replacement, stage attempts, every task attempt with its Spark executor, locality, failure reason and run time, and the time no task ran anywhere.

Run on a log: python bench/spark_timeline.py <event log file> [<from epoch s> <to epoch s>]
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _files(path: str) -> list[str]:
    """The files of one application's event log: a file, a rolling log's directory (``eventlog_v2_*``, its
    ``events_<n>_*`` files in order), or a directory of logs (its newest application's)."""
    if not os.path.isdir(path):
        return [path]
    rolled = glob.glob(os.path.join(path, "events_*"))
    if rolled:
        return sorted(rolled, key=lambda f: int(os.path.basename(f).split("_")[1]))
    apps = sorted(glob.glob(os.path.join(path, "*")), key=os.path.getmtime)
    if not apps:
        raise FileNotFoundError(f"no event log in {path}")
    return _files(apps[-1])


def read_events(path: str) -> list[dict]:
    """The events of one application's event log (see :func:`_files`)."""
    out = []
    for name in _files(path):
        with open(name) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:  # the last line of a log still being written
                        pass
    return out


def _ms(x: float) -> int:
    return int(round(x * 1000))


def window(events: list[dict], t0: float, t1: float) -> dict:
    """What happened between epoch seconds ``t0`` and ``t1`` (task attempts that ran in it, stage attempts submitted
    in it, executors removed or added in it), times relative to ``t0`` in ms."""
    a, b = _ms(t0), _ms(t1)
    ex_removed, ex_added, stages, tasks = [], [], {}, []
    for e in events:
        ev = e.get("Event")
        if ev == "SparkListenerExecutorRemoved" and a <= e["Timestamp"] <= b:
            ex_removed.append({"executor": e["Executor ID"], "at": e["Timestamp"] - a,
                               "reason": e.get("Removed Reason")})
        elif ev == "SparkListenerExecutorAdded" and a <= e["Timestamp"] <= b:
            ex_added.append({"executor": e["Executor ID"], "at": e["Timestamp"] - a})
        elif ev in ("SparkListenerStageSubmitted", "SparkListenerStageCompleted"):
            si = e["Stage Info"]
            key = (si["Stage ID"], si["Stage Attempt ID"])
            st = stages.setdefault(key, {"stage": key[0], "attempt": key[1], "tasks": si.get("Number of Tasks")})
            if si.get("Submission Time") is not None:
                st["submitted"] = si["Submission Time"] - a
            if si.get("Completion Time") is not None:
                st["completed"] = si["Completion Time"] - a
            if si.get("Failure Reason"):
                st["failure"] = si["Failure Reason"].splitlines()[0][:120]
        elif ev == "SparkListenerTaskEnd":
            ti = e["Task Info"]
            if ti["Finish Time"] < a or ti["Launch Time"] > b:
                continue
            m = e.get("Task Metrics") or {}
            reason = e["Task End Reason"]["Reason"]
            tasks.append({"stage": e["Stage ID"], "stage_attempt": e["Stage Attempt ID"], "index": ti["Index"],
                          "attempt": ti["Attempt"], "executor": ti["Executor ID"], "locality": ti["Locality"],
                          "start": ti["Launch Time"] - a, "end": ti["Finish Time"] - a, "reason": reason,
                          "run_ms": m.get("Executor Run Time"), "deser_ms": m.get("Executor Deserialize Time")})
    stages = {k: v for k, v in stages.items()  # submitted in the window, or before it and still running at its start
              if "submitted" in v and v["submitted"] <= b - a and v.get("completed", 0) >= 0}
    tasks.sort(key=lambda t: t["start"])
    return {"removed": ex_removed, "added": ex_added, "stages": sorted(stages.values(), key=lambda s: s["submitted"]),
            "tasks": tasks, "idle_ms": _idle(tasks, 0, b - a), "span_ms": b - a}


def _idle(tasks: list[dict], lo: int, hi: int) -> int:
    """Milliseconds of [lo, hi] in which no task attempt ran on any Spark executor."""
    spans = sorted((max(lo, t["start"]), min(hi, t["end"])) for t in tasks if t["end"] > lo and t["start"] < hi)
    idle, at = 0, lo
    for s, e in spans:
        if s > at:
            idle += s - at
        at = max(at, e)
    return idle + max(0, hi - at)


def retry_waits(w: dict) -> list[dict]:
    """Per task attempt retried after its Spark executor was lost (the previous attempt of that stage attempt and
    index failed ``ExecutorLostFailure``): when the loss was seen, when the retry started, and how much of that no
    task ran on any Spark executor (``idle_s``: the cores left waited, e.g. out ``spark.locality.wait``; the rest
    they ran other tasks). Seconds from the window's start."""
    lost = {}
    out = []
    for t in sorted(w["tasks"], key=lambda t: (t["start"], t["attempt"])):
        key = (t["stage"], t["stage_attempt"], t["index"])
        if key in lost and t["attempt"] > lost[key]["attempt"]:
            prev = lost.pop(key)
            out.append({"task": f"{key[0]}.{key[1]}/{key[2]}", "lost_s": prev["end"] / 1000,
                        "retry_s": t["start"] / 1000, "on": t["executor"], "locality": t["locality"],
                        "idle_s": _idle(w["tasks"], prev["end"], t["start"]) / 1000})
        if t["reason"] == "ExecutorLostFailure":
            lost[key] = t
    return out


def summary(w: dict) -> dict:
    """Counts and sums of a window: failed attempts by reason, stage re-attempts, time in successful attempts and in
    lost ones, per locality level, and the idle time."""
    by_reason: dict[str, int] = {}
    lost_ms = ok_ms = 0
    for t in w["tasks"]:
        by_reason[t["reason"]] = by_reason.get(t["reason"], 0) + 1
        if t["reason"] == "Success":
            ok_ms += t["end"] - t["start"]
        else:
            lost_ms += t["end"] - t["start"]
    loc: dict[str, int] = {}
    for t in w["tasks"]:
        loc[t["locality"]] = loc.get(t["locality"], 0) + 1
    return {"span_s": w["span_ms"] / 1000, "idle_s": w["idle_ms"] / 1000, "attempts": by_reason,
            "stage_reattempts": sum(1 for s in w["stages"] if s["attempt"] > 0),
            "successful_task_s": ok_ms / 1000, "failed_task_s": lost_ms / 1000, "locality": loc,
            "executor_removed_s": [r["at"] / 1000 for r in w["removed"]],
            "executor_added_s": [r["at"] / 1000 for r in w["added"]], "retries": retry_waits(w)}


def render(w: dict) -> str:
    """The window as text lines, times in seconds from its start."""
    lines = []
    for r in w["removed"]:
        lines.append(f"{r['at'] / 1000:7.2f}  executor {r['executor']} removed: {(r['reason'] or '')[:90]}")
    for r in w["added"]:
        lines.append(f"{r['at'] / 1000:7.2f}  executor {r['executor']} added")
    for s in w["stages"]:
        end = f"{s['completed'] / 1000:.2f}" if "completed" in s else "-"
        lines.append(f"{s['submitted'] / 1000:7.2f}  stage {s['stage']}.{s['attempt']} submitted ({s['tasks']} tasks), "
                     f"completed {end}{'  FAILED: ' + s['failure'] if 'failure' in s else ''}")
    for t in w["tasks"]:
        lines.append(f"{t['start'] / 1000:7.2f}  task {t['stage']}.{t['stage_attempt']}/{t['index']} attempt "
                     f"{t['attempt']} on executor {t['executor']} ({t['locality']}) until {t['end'] / 1000:.2f}: "
                     f"{t['reason']}, run {t['run_ms']} ms, deserialize {t['deser_ms']} ms")
    lines.sort(key=lambda x: float(x.split()[0]))
    return "\n".join(lines)


if __name__ == "__main__":
    ev = read_events(sys.argv[1])
    lo = float(sys.argv[2]) if len(sys.argv) > 2 else min(e.get("Timestamp", 1e18) for e in ev) / 1000
    hi = float(sys.argv[3]) if len(sys.argv) > 3 else 1e12
    w = window(ev, lo, hi)
    print(render(w))
    print(json.dumps(summary(w), indent=1))
