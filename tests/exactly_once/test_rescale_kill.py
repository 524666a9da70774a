"""kill -9 during cold rescales: a real child process opens a directory at another worker count and is killed at each named point of the layout-change protocol (rescale.py) and at random moments; the next open finishes or undoes the change, a following run rescales again, and in the end the output log equals a never-rescaled run step by step and DuckDB over all input, with 0 rows lost or doubled.

Seeds vary between runs (``DBSP_RESCALE_KILL_SEED`` replays one; printed); ``DBSP_RESCALE_KILLS`` sets the number of
kills per executor (default 12; rounds go on until that many landed). The workload has enough keys that every one of
the 256 shards holds stored state, asserted before each round's move; the last step deletes them all (the rounds
stop one step short of it), so a row any move lost or left behind shows in the final check.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dbsp_core.storage.directory import read_layout, read_rescale  # noqa: E402
from rescale_workload import Workload, assert_every_shard_holds_state, kill_test, run_child  # noqa: E402

CHILD = os.path.join(HERE, "rescale_kill_child.py")
KILLS = int(os.environ.get("DBSP_RESCALE_KILLS", "12"))
BASE_SEED = int(os.environ.get("DBSP_RESCALE_KILL_SEED", str(random.SystemRandom().randrange(2**31))))
POINTS = ["rescale-intent:1", "rescale-group:1", "rescale-commit:1", "rescale-commit:2", "rescale-commit:3",
          "rescale-committed:1", "rescale-layout:1", "step-written:1", "checkpoint-state:1"]
STEPS = 12
KEYS = 1024


def _child(d: str, seed: int, steps: int, target: int, kind: str, crash: str | None = None,
           kill_after: float | None = None) -> tuple[str, dict | None]:
    return run_child([CHILD, d, str(seed), str(steps), str(target), kind, str(STEPS), str(KEYS)], crash,
                     kill_after, 180, "a rescale child")


@pytest.mark.parametrize("kind", ["embedded", "staged"])
@pytest.mark.slow
def test_kill9_during_cold_rescales(tmp_path, kind: str) -> None:
    seed = BASE_SEED + (0 if kind == "embedded" else 1)
    print(f"\n[rescale kill] {kind} seed {seed} (replay: DBSP_RESCALE_KILL_SEED={seed - (kind == 'staged')})")
    rng = random.Random(seed)
    w = Workload(seed, STEPS, keys=KEYS)
    d = str(tmp_path / "d")
    stats = {"kills": 0, "named": 0, "timed": 0, "forward": 0, "back": 0, "rescales": 0, "shards_checked": 0}
    steps_done = 3  # by start_storage (in kill_test)

    def one_round(kill) -> None:
        nonlocal steps_done
        assert read_rescale(d) is None  # the last round ended with a finished move
        stats["shards_checked"] += assert_every_shard_holds_state(d, f"round {stats['rescales'] + 1}")
        target = rng.choice([t for t in (1, 2, 3, 4, 5) if t != read_layout(d)[0].workers])
        goal = min(STEPS - 1, steps_done + rng.choice([0, 1, 2]))  # the last step (every bulk row deleted) at the end
        kill(lambda **k: _child(d, seed, goal, target, kind, **k))
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

    kill_test("rescale kill", kind, seed, w, d, rng, stats,
              checkpoint=False,  # the first rescale starts from a state that needs replaying
              kills=KILLS, points=POINTS, kill_after=(0.4, 1.4), one_round=one_round,
              last_child=lambda: _child(d, seed, STEPS, read_layout(d)[0].workers, kind))
    assert stats["forward"] + stats["back"] >= 1, f"no kill left a move for recovery to finish or undo: {stats}"
