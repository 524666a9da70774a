"""kill -9 of an autoscaled durable pipeline: a child process steps while its autoscaler rescales it live (the policy's bounds switch between 1 and 2 workers every few steps), and is killed at named points of the live protocol and of checkpoints and at random moments; the next run finishes any interrupted move on open; in the end the layout is valid and the output log equals a never-rescaled run step by step and DuckDB over all input, with 0 rows lost or doubled.

``DBSP_AUTOSCALE_KILLS`` sets the kills that must land in the slow variant (default 10; the default run lands 1);
``DBSP_AUTOSCALE_KILL_SEED`` replays a seed (printed).
"""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dbsp_core.storage.directory import read_layout, read_rescale  # noqa: E402
from rescale_workload import Workload, kill_test, run_child  # noqa: E402

CHILD = os.path.join(HERE, "autoscale_kill_child.py")
BASE_SEED = int(os.environ.get("DBSP_AUTOSCALE_KILL_SEED", str(random.SystemRandom().randrange(2**31))))
STEPS = 30
POINTS = ["live-begin:1", "live-batch:1", "live-batch:3", "live-switch:1", "live-layout:1", "checkpoint-state:1",
          "checkpoint-commit:2", "step-written:4"]


def _child(d: str, seed: int, steps: int, flip: int, crash: str | None = None, kill_after: float | None = None
           ) -> tuple[str, dict | None]:
    return run_child([CHILD, d, str(seed), str(steps), str(flip)], crash, kill_after, 240, "an autoscale child")


def _run(tmp_path, kills: int, points: list[str], steps: int = STEPS,
         kill_after: tuple[float, float] | None = (0.3, 2.0)) -> None:
    seed = BASE_SEED
    print(f"\n[autoscale kill] seed {seed} (replay: DBSP_AUTOSCALE_KILL_SEED={seed})")
    rng = random.Random(seed)
    w = Workload(seed, steps)
    d = str(tmp_path / "d")
    stats = {"kills": 0, "named": 0, "timed": 0, "finished_on_open": 0, "rescales": 0, "killed_in_a_rescale": 0}
    goal = 3

    def one_round(kill) -> None:
        nonlocal goal
        goal = min(steps, goal + rng.randint(2, 4))
        flip = rng.randint(1, 3)
        def child(**k):
            how, info = _child(d, seed, goal, flip, **k)
            if how == "killed" and (k.get("crash") or "").startswith("live-"):
                stats["killed_in_a_rescale"] += 1  # only a rescale the autoscaler made reaches a live-* point
            return how, info

        kill(child)
        how, info = _child(d, seed, goal, 0)  # finishes an interrupted move on open, then steps to goal
        assert how == "done" and info["failed"] == 0
        stats["finished_on_open"] += info["recovery"] is not None
        stats["rescales"] += info["rescales"]
        assert read_rescale(d) is None  # a valid layout: no change left half done
        lay, _ = read_layout(d)
        assert info["workers"] == lay.workers and lay.workers in (1, 2)

    kill_test("autoscale kill", "embedded", seed, w, d, rng, stats, checkpoint=True, kills=kills, points=points,
              kill_after=kill_after, one_round=one_round, last_child=lambda: _child(d, seed, steps, 2))
    assert stats["rescales"] + stats["killed_in_a_rescale"] >= 1, f"the autoscaler never rescaled: {stats}"


def test_kill9_of_an_autoscaled_pipeline_short(tmp_path) -> None:
    """One kill at a named point of the live protocol (the slow variant below adds random moments and more). Named
    points only: a child here runs 2-4 steps, done before a timed kill could land (seed 858350864)."""
    _run(tmp_path, 1, ["live-begin:1", "live-batch:1", "live-switch:1", "live-layout:1"], steps=10, kill_after=None)


@pytest.mark.slow
def test_kill9_of_an_autoscaled_pipeline_at_random_moments(tmp_path) -> None:
    kills = int(os.environ.get("DBSP_AUTOSCALE_KILLS", "10"))
    # rounds add 2-4 steps each: enough steps that every round (at most 4 per kill) still has steps to run, or on a
    # fast machine the rounds after the goal reaches the last step finish at once and no kill lands (seed 783789242)
    _run(tmp_path, kills, POINTS, steps=max(STEPS, 12 * kills))
