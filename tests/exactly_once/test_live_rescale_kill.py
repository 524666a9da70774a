"""kill -9 during live rescales: a child process steps on one thread while its main thread rescales live, and is killed at named points of the live protocol (and of the batches' and checkpoints' commits) and at random moments; the next run finishes the move on open and goes on rescaling; in the end the output log equals a never-rescaled run step by step and DuckDB over all input, with 0 rows lost or doubled.

``DBSP_LIVE_KILLS`` sets the rounds per executor (default 10); ``DBSP_LIVE_KILL_SEED`` replays a seed (printed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.storage.directory import read_layout, read_rescale  # noqa: E402
from rescale_workload import Workload, build_circuit, check_log_against_duckdb, reference  # noqa: E402

CHILD = os.path.join(HERE, "live_kill_child.py")
KILLS = int(os.environ.get("DBSP_LIVE_KILLS", "10"))
BASE_SEED = int(os.environ.get("DBSP_LIVE_KILL_SEED", str(random.SystemRandom().randrange(2**31))))
STEPS = 30
POINTS = {
    "embedded": ["live-begin:1", "live-batch:1", "live-batch:5", "live-switch:1", "live-layout:1",
                 "checkpoint-state:1", "checkpoint-commit:2", "step-written:3"],
    "staged": ["live-begin:1", "live-batch:2", "rescale-intent:3", "rescale-commit:4", "rescale-committed:2",
               "rescale-layout:5", "step-written:3"],
}


def _child(d: str, seed: int, steps: int, kind: str, targets: list[int], crash: str | None = None,
           kill_after: float | None = None) -> tuple[str, dict | None]:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("DBSP_CRASHPOINT", None)
    if crash:
        env["DBSP_CRASHPOINT"] = crash
    p = subprocess.Popen([sys.executable, CHILD, d, str(seed), str(steps), kind, ",".join(map(str, targets))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        out, err = p.communicate(timeout=kill_after if kill_after is not None else 240)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        if kill_after is None:
            raise AssertionError("a live-rescale child still ran after 240 s (a hang)")
        return "killed", None
    if p.returncode == -9:
        return "killed", None
    assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{err[-3000:]}"
    return "done", json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["embedded", "staged"])
def test_kill9_during_live_rescales(tmp_path, kind: str) -> None:
    seed = BASE_SEED + (kind == "staged")
    print(f"\n[live kill] {kind} seed {seed} (replay: DBSP_LIVE_KILL_SEED={BASE_SEED})")
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
    p.close()
    stats = {"kills": 0, "named": 0, "timed": 0, "finished_on_open": 0, "completed": 0}
    goal = 3
    rounds = 0
    # Rounds go on until KILLS kills landed (at most 4x as many rounds): a timed kill can come after the child
    # finished, and the count must not depend on the machine's speed.
    while stats["kills"] < KILLS and rounds < 4 * KILLS:
        rounds += 1
        goal = min(STEPS, goal + rng.randint(1, 3))
        cur_w = read_layout(d)[0].workers
        targets = [rng.choice([t for t in (1, 2, 3, 4) if t != cur_w])]
        targets.append(rng.choice([t for t in (1, 2, 3, 4) if t != targets[0]]))
        if rng.random() < 0.6:
            how, _ = _child(d, seed, goal, kind, targets, crash=rng.choice(POINTS[kind]))
            stats["named"] += how == "killed"
        else:
            how, _ = _child(d, seed, goal, kind, targets, kill_after=rng.uniform(0.5, 3.0))
            stats["timed"] += how == "killed"
        stats["kills"] += how == "killed"
        how, info = _child(d, seed, goal, kind, [])  # finishes an interrupted move on open, then steps to goal
        assert how == "done"
        stats["finished_on_open"] += info["recovery"] is not None
        stats["completed"] += 1
        assert read_rescale(d) is None
        lay, _ = read_layout(d)
        assert info["workers"] == lay.workers
    how, info = _child(d, seed, STEPS, kind, [])
    assert how == "done"
    q = dbsp.Pipeline.open(d, build_circuit(), executor=StagedExecutor() if kind == "staged" else None,
                           checkpoint_interval=None)
    assert q.steps == STEPS and list(q.output_steps) == list(range(STEPS))
    for s in range(STEPS):
        got = {name: z.to_dict() for name, z in q._output.get(s).items()}
        assert got == ref[s], f"output step {s} differs from the never-rescaled run (seed {seed})"
    check_log_against_duckdb(q, w, STEPS - 1)
    q.close()
    print(f"[live kill] {kind}: {rounds} rounds, {stats}; 0 rows lost, 0 doubled")
    assert stats["kills"] >= KILLS, f"only {stats['kills']} of {KILLS} kills landed in {rounds} rounds"
