"""kill -9 during cold rescales: a real child process opens a directory at another worker count and is killed at each named point of the layout-change protocol (rescale.py) and at random moments; the next open finishes or undoes the change, a following run rescales again, and in the end the output log equals a never-rescaled run step by step and DuckDB over all input, with 0 rows lost or doubled.

Seeds vary between runs (``DBSP_RESCALE_KILL_SEED`` replays one; printed); ``DBSP_RESCALE_KILLS`` sets the number of
kills per executor (default 12; rounds go on until that many landed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.storage.directory import read_layout, read_rescale  # noqa: E402
from rescale_workload import Workload, build_circuit, check_log_against_duckdb, reference  # noqa: E402

CHILD = os.path.join(HERE, "rescale_kill_child.py")
KILLS = int(os.environ.get("DBSP_RESCALE_KILLS", "12"))
BASE_SEED = int(os.environ.get("DBSP_RESCALE_KILL_SEED", str(random.SystemRandom().randrange(2**31))))
POINTS = ["rescale-intent:1", "rescale-group:1", "rescale-commit:1", "rescale-commit:2", "rescale-commit:3",
          "rescale-committed:1", "rescale-layout:1", "step-written:1", "checkpoint-state:1"]
STEPS = 12


def _env(crash: str | None) -> dict:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("DBSP_CRASHPOINT", None)
    if crash:
        env["DBSP_CRASHPOINT"] = crash
    return env


def _child(d: str, seed: int, steps: int, target: int, kind: str, crash: str | None = None,
           kill_after: float | None = None) -> tuple[str, dict | None]:
    p = subprocess.Popen([sys.executable, CHILD, d, str(seed), str(steps), str(target), kind],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(crash), text=True)
    try:
        out, err = p.communicate(timeout=kill_after if kill_after is not None else 180)
    except subprocess.TimeoutExpired:
        if kill_after is None:
            p.kill()
            raise AssertionError("a rescale child still ran after 180 s (a hang)")
        p.kill()
        out, err = p.communicate()
        return "killed", None
    if p.returncode == -9:
        return "killed", None
    assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{err[-3000:]}"
    return "done", json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_kill9_during_cold_rescales(tmp_path, kind: str) -> None:
    seed = BASE_SEED + (0 if kind == "embedded" else 1)
    print(f"\n[rescale kill] {kind} seed {seed} (replay: DBSP_RESCALE_KILL_SEED={seed - (kind == 'staged')})")
    rng = random.Random(seed)
    w = Workload(seed, STEPS)
    ref = reference(w)
    d = str(tmp_path / "d")
    cur = [0]
    p = dbsp.Pipeline(build_circuit(), 2, storage=d, executor=StagedExecutor() if kind == "staged" else None,
                      checkpoint_interval=None, clock=lambda: w.clock(cur[0]))
    for s in range(3):
        cur[0] = s
        for name, z in w.pushes[s]:
            p.push(name, z, producer=f"gen-{name}", seq=s)
        p.step()
    p.close(checkpoint=False)  # the first rescale starts from a state that needs replaying
    stats = {"kills": 0, "named": 0, "timed": 0, "forward": 0, "back": 0, "rescales": 0}
    steps_done = 3
    rounds = 0
    # A named point is not reached on every path and a timed kill can come after the child finished: go on until
    # KILLS kills landed (at most 4x as many rounds), so the count does not depend on the machine's speed.
    while stats["kills"] < KILLS and rounds < 4 * KILLS:
        rounds += 1
        target = rng.choice([t for t in (1, 2, 3, 4, 5) if t != read_layout(d)[0].workers])
        goal = min(STEPS, steps_done + rng.choice([0, 1, 2]))
        if rng.random() < 0.6:
            crash = rng.choice(POINTS)
            how, _ = _child(d, seed, goal, target, kind, crash=crash)
            stats["named"] += how == "killed"
        else:
            how, _ = _child(d, seed, goal, target, kind, kill_after=rng.uniform(0.4, 1.4))
            stats["timed"] += how == "killed"
        stats["kills"] += how == "killed"
        lay, _ = read_layout(d)
        assert lay.workers in range(1, 6)
        if rng.random() < 0.3 and read_rescale(d) is not None:  # a kill while undoing / finishing it, too
            _child(d, seed, goal, target, kind, crash="rescale-rollback:1")
        how, info = _child(d, seed, goal, target, kind)
        assert how == "done" and info["workers"] == target, info
        if info["recovery"]:
            stats[info["recovery"]] += 1
        stats["rescales"] += 1
        steps_done = goal
    how, info = _child(d, seed, STEPS, read_layout(d)[0].workers, kind)
    assert how == "done"
    q = dbsp.Pipeline.open(d, build_circuit(), executor=StagedExecutor() if kind == "staged" else None,
                           checkpoint_interval=None)
    assert q.steps == STEPS and list(q.output_steps) == list(range(STEPS))
    for s in range(STEPS):
        got = {name: z.to_dict() for name, z in q._output.get(s).items()}
        assert got == ref[s], f"output step {s} differs from the never-rescaled run (seed {seed})"
    check_log_against_duckdb(q, w, STEPS - 1)
    q.close()
    print(f"[rescale kill] {kind}: {rounds} rounds, {stats}; 0 rows lost, 0 doubled")
    assert stats["kills"] >= KILLS, f"only {stats['kills']} of {KILLS} kills landed in {rounds} rounds"
