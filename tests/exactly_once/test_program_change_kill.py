"""kill -9 during the first steps after a program change (dbsp_core/runtime/change.py invariant 6): a directory written by one SQL program is opened by a child process with the changed program (a view kept, one changed, one dropped, one added) and killed at named points of the change, the steps and the checkpoints and at random moments; the next child redoes or goes on, and in the end every view's output log, step by step, equals DuckDB over the tables: exactly once across the change, each rebuilt view's log starting with its full contents.

Seeds vary between runs (``DBSP_CHANGE_KILL_SEED`` replays one; printed); ``DBSP_CHANGE_KILLS`` sets the number of
kills that must land (default 2 in the default run, 12 in the long one). A kill that lands while the change has not
completed (META still names the old program, or the state is not checkpointed past the change's first step) is
counted as ``before_completed``; at least one must.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core import sql  # noqa: E402
from dbsp_core.circuit import circuit_fingerprint  # noqa: E402
from dbsp_core.storage.directory import read_meta  # noqa: E402
from dbsp_core.storage.inspect import inspect_storage  # noqa: E402
from change_workload import NEW, OLD, REBUILT, apply, as_bag, integrate, oracle, program, push, step_data  # noqa: E402
from rescale_workload import kill_rounds, run_child  # noqa: E402

CHILD = os.path.join(HERE, "change_kill_child.py")
BASE_SEED = int(os.environ.get("DBSP_CHANGE_KILL_SEED", str(random.SystemRandom().randrange(2**31))))
# reached by the first child before its first checkpoint after the change's first step: the change is not complete
FIRST_POINTS = ["change-meta:1", "step-output:1", "step-written:1"]
POINTS = ["change-meta:1", "step-output:1", "step-written:1", "step-written:2", "recover-step:1",
          "checkpoint-start:1", "checkpoint-state:1", "checkpoint-commit:1", "checkpoint-gc:1"]


def _run(tmp_path, kills: int, after: int, offset: int) -> None:
    seed = BASE_SEED + offset
    print(f"\n[change kill] seed {seed} (replay: DBSP_CHANGE_KILL_SEED={BASE_SEED}), {kills} kills")
    rng = random.Random(seed)
    d = str(tmp_path / "d")
    first = rng.randint(2, 5)
    with dbsp.Pipeline(sql.compile(program(OLD)), workers=rng.choice([1, 2, 4]), storage=d,
                       checkpoint_interval=None) as p:
        for s in range(first):
            push(p, step_data(seed, s), step=s)
            p.step()
            if rng.random() < 0.3:
                p.checkpoint()
        if rng.random() < 0.5:
            p.close(checkpoint=False)  # the new program replays steps first
    total = first + after  # at least; the last child runs one step past the last one reached
    stats = {"kills": 0, "named": 0, "timed": 0, "children": 0, "before_completed": 0, "opens_that_changed": 0}
    reached = [first]
    log: list = []  # (goal, how the child was run), shown when the final check fails

    def child(**kw):
        log.append((goal[0], kw))
        how, info = run_child([CHILD, d, str(seed), str(goal[0])], kw.get("crash"), kw.get("kill_after"), 120,
                              "a program-change child")
        stats["children"] += 1
        if info is not None:
            reached[0] = info["steps"]
            stats["opens_that_changed"] += info["change"] is not None
        elif not _completed(d):
            stats["before_completed"] += 1
        return how, info

    goal = [first]

    def one_round(kill) -> None:
        # the first steps after the change; always at least one step past the last one reached, so a child has a step
        # to run and its named points (step-output, step-written) are reached: a child with nothing to do cannot be
        # killed, and rounds spent on such children made the kill count depend on the seed (CI, seed 737558989)
        goal[0] = max(reached[0], first) + rng.choice([1, 2, 3])
        if stats["before_completed"] == 0:  # one kill that surely lands before the change completes
            goal[0] = max(goal[0], first + 1)
            how, _ = child(crash=rng.choice(FIRST_POINTS))
            stats["named"] += how == "killed"
            stats["kills"] += how == "killed"
            return
        kill(child)

    rounds = kill_rounds(rng, kills, stats, POINTS, (0.3, 1.5), one_round)
    total = max(total, reached[0] + 1, *(g for g, _ in log))  # a killed child may have gone up to its goal
    goal[0] = total
    how, info = child()
    assert how == "done" and info["steps"] == total, info
    assert stats["kills"] >= kills, f"only {stats['kills']} of {kills} kills landed: {stats}"
    assert stats["before_completed"] >= 1, f"no kill landed before the change completed: {stats}"

    model: dict = {}
    want = []
    for s in range(total):
        apply(model, step_data(seed, s))
        want.append({n: oracle(model, q) for n, (q, _) in NEW.items()})
    with dbsp.Pipeline.open(d, sql.compile(program(NEW))) as p:
        assert "program_change" not in p.stats  # the last child's close completed the change
        for n in NEW:
            acc: dict = {}
            steps = []
            for s, z in p.read_output(n):
                integrate(acc, z)
                steps.append(s)
                assert as_bag(acc) == want[s][n], f"view {n} at step {s} differs from DuckDB (seed {seed}; change at " \
                                                  f"step {first}; children {log})"
            assert steps == list(range(first if n in REBUILT else 0, total)), (n, steps)
    print(f"[change kill] {rounds} rounds, change at step {first}, {total} steps, {stats}; "
          f"every view equals DuckDB at every step: 0 rows lost, 0 doubled")


def _completed(d: str) -> bool:
    """Whether the program change is complete on disk: META names the new program and the state is checkpointed
    past the change's first step."""
    meta = read_meta(d)
    if meta["fingerprint"] != circuit_fingerprint(sql.compile(program(NEW))):
        return False
    step = inspect_storage(d)["checkpoint_step"]
    return step is not None and step > meta["change"]["step"]


def test_kill9_in_the_first_steps_after_a_program_change(tmp_path) -> None:
    _run(tmp_path, int(os.environ.get("DBSP_CHANGE_KILLS", "2")), 3, 0)


@pytest.mark.slow
def test_kill9_after_a_program_change_long(tmp_path) -> None:
    _run(tmp_path, int(os.environ.get("DBSP_CHANGE_KILLS", "12")), 8, 1)
