"""Poison inputs: a step that fails on its data raises StepError naming its pushes, leaves the pipeline usable at the step before it with its state untouched, and runs again once the bad push is discarded; the same holds after a reopen and after ``kill -9`` at every crash point of the remedy.

Every outcome is compared with a dict model of the views over the batches that were not discarded
(tests/exactly_once/poison.py); any half-applied state would show as a difference.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pyarrow as pa
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.errors import StepError  # noqa: E402
from dbsp_core.runtime.staged import StagedExecutor  # noqa: E402
from poison import KINDS, build_circuit, good, integral, model, poison  # noqa: E402

SEED = int(os.environ.get("DBSP_POISON_SEED", random.randrange(10**6)))
print(f"\n[poison] DBSP_POISON_SEED={SEED}")


def _logged(p: dbsp.Pipeline) -> list[dict]:
    """Every step's output as the output log holds it: ``[{view: change}]`` in step order."""
    names = ("sums", "ratios", "checked")
    per = {n: dict(p.read_output(n, p.output_steps.start)) for n in names}
    return [{n: per[n][s] for n in names} for s in p.output_steps]


def _pipeline(kind: str, workers: int, d: str | None, **kw) -> dbsp.Pipeline:
    ex = StagedExecutor() if kind == "staged" else None
    return dbsp.Pipeline(build_circuit(), workers=workers, storage=d, executor=ex, checkpoint_interval=None, **kw)


RUNS = [("embedded", 1, False), ("embedded", 2, False), ("embedded", 1, True), ("embedded", 2, True),
        ("staged", 2, True)]


def test_stepError_is_exported():
    assert dbsp.StepError is StepError and "StepError" in dbsp.__all__


@pytest.mark.parametrize("executor, workers, durable", RUNS)
@pytest.mark.parametrize("bad", KINDS)
def test_a_poison_push_fails_its_step_and_discard_lets_it_run(tmp_path, executor, workers, durable, bad):
    """One poison push among good ones (named and anonymous): the step raises StepError listing every push of
    the step, nothing changes (a second try fails the same way), the pipeline takes pushes meanwhile, and
    after ``discard`` the step and the next ones give exactly the views of the good batches."""
    d = str(tmp_path / "d") if durable else None
    named = durable  # producers need a durable pipeline
    p = _pipeline(executor, workers, d)
    kept: list[pa.Table] = []
    outs = []

    def push(prod: str, seq: int, t: pa.Table, keep: bool = True) -> None:
        if named:
            p.push("t", t, producer=prod, seq=seq)
        else:
            p.push("t", t)
        if keep:
            kept.append(t)

    for seq in range(3):
        push("g", seq, good(SEED, "g", seq))
    outs.append(p.step())
    push("g", 3, good(SEED, "g", 3))
    push("bad", 0, poison(bad), keep=False)
    p.push("t", good(SEED, "anon", 0))
    kept.append(good(SEED, "anon", 0))
    for attempt in range(2):
        with pytest.raises(StepError) as info:
            p.step()
        err = info.value
        assert err.step == 1 and p.steps == 1 and p.step_error is err
        assert [e[0] for e in err.inputs] == ["t"] * 3
        ids = [e[1:] for e in err.inputs]
        assert ("g", 3) in ids or not named
        bad_id = ("bad", 0) if named else ids[1]
        assert bad_id in ids and "discard(producer, seq)" in str(err)
        assert err.__cause__ is not None
    push("g", 4, good(SEED, "g", 4))  # accepted while the failed step waits; it belongs to the next step
    assert p.discard(*bad_id) == ("t", 1)
    with pytest.raises(KeyError, match="waits for a step"):
        p.discard(*bad_id)
    outs.append(p.step())  # step 1 again, without the poison push
    assert p.steps == 2 and p.step_error is None
    outs.append(p.step())  # step 2: the push made while step 1 waited
    assert integral(outs) == model(kept)
    if not durable:
        p.close()
        return
    assert [s for s, _ in p.read_output("sums")] == [0, 1, 2]
    assert [r["producer"] for r in p.output_inputs(1)] == ["", "g"]
    p.close(checkpoint=False)  # reopen replays steps 1 and 2: the discard is replayed, the output verified
    q = dbsp.Pipeline.open(d, build_circuit(), executor=StagedExecutor() if executor == "staged" else None)
    assert q.steps == 3 and q.step_error is None
    assert integral(_logged(q)) == model(kept)
    assert q.push("t", poison(bad), producer="bad", seq=0).duplicate  # a discarded push stays acknowledged
    q.close()


@pytest.mark.parametrize("executor, workers", [("embedded", 2), ("staged", 2)])
def test_a_reopen_meets_the_same_failure_and_the_same_remedy(tmp_path, executor, workers):
    """A directory whose next step fails on its data opens (the replay of the failed step fails and waits), the
    next ``step`` raises the same StepError, and ``discard`` lets it run."""
    d = str(tmp_path / "d")
    p = _pipeline(executor, workers, d)
    p.push("t", good(SEED, "g", 0), producer="g", seq=0)
    p.step()
    p.checkpoint()
    p.push("t", good(SEED, "g", 1), producer="g", seq=1)
    p.push("t", poison("int64-sum"), producer="bad", seq=7)
    with pytest.raises(StepError):
        p.step()
    p.close()  # the checkpoint at step 1; step 1 stays divided in the log
    for _ in range(2):  # every open replays it, it fails again, and the pipeline opens at step 1
        q = _pipeline(executor, workers, d)
        assert q.steps == 1 and q.step_error is not None and ("t", "bad", 7) in q.step_error.inputs
        with pytest.raises(StepError, match="step 1 failed on its data"):
            q.step()
        q.close(checkpoint=False)
    q = _pipeline(executor, workers, d)
    q.discard("bad", 7)
    q.close(checkpoint=False)  # the discard is logged: the next open replays step 1 without the poison push
    r = _pipeline(executor, workers, d)
    assert r.steps == 2 and r.step_error is None
    assert integral(_logged(r)) == model([good(SEED, "g", 0), good(SEED, "g", 1)])
    r.close()


def test_queued_steps_after_a_failed_one_wait_with_it(tmp_path):
    """Of three queued steps the second fails: the first one's output is logged, the second and third wait,
    and run together once the poison push is gone."""
    d = str(tmp_path / "d")
    p = _pipeline("embedded", 2, d)
    batches = [good(SEED, "g", i) for i in range(3)]
    for i, b in enumerate(batches):
        p.push("t", b, producer="g", seq=i)
        if i == 1:
            p.push("t", poison("divide-by-zero"), producer="bad", seq=0)
        p.queue_step()
    with pytest.raises(StepError) as info:
        p.run_queued()
    assert info.value.step == 1 and p.steps == 1 and p.queued == 2
    assert [s for s, _ in p.read_output("ratios")] == [0]
    p.discard("bad", 0)
    outs = p.run_queued()
    assert len(outs) == 2 and p.steps == 3
    assert integral(_logged(p)) == model(batches)
    p.close()


def test_event_time_watermarks_follow_the_discard(tmp_path):
    """With event time, the watermark after a step depends on its pushes: a discarded push's time no longer
    counts, live and in the replay after a reopen (which must reproduce the same output)."""
    def circuit() -> dbsp.Circuit:
        c = dbsp.Circuit()
        t = c.input("t", pa.schema([("ts", pa.int64()), ("v", pa.int64())]), event_time="ts")
        c.output("w", t.tumble("ts", 10).group_by("window_start").agg(total=dbsp.sum("v")))
        return c

    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(), storage=d, checkpoint_interval=None)
    p.push("t", pa.table({"ts": [1, 2], "v": [1, 1]}), producer="a", seq=0)
    p.step()
    p.push("t", pa.table({"ts": [15], "v": [1]}), producer="a", seq=1)
    p.push("t", pa.table({"ts": [1000, 1000], "v": [2**62, 2**62]}), producer="bad", seq=0)  # overflows, ts 1000
    with pytest.raises(StepError):
        p.step()
    p.discard("bad", 0)
    p.step()
    assert p.watermarks["t"] == 15  # not 1000: the discarded push's time does not count
    p.push("t", pa.table({"ts": [16], "v": [3]}), producer="a", seq=2)  # not late
    out = p.step()
    assert out["w"].to_dict() == {(10, 1): -1, (10, 4): 1}
    assert p.late_rows["t"] == 0
    p.close(checkpoint=False)
    q = dbsp.Pipeline.open(d, circuit())  # replays steps 1 and 2 with the discard: the same output (verified)
    assert q.watermarks["t"] == 16 and q.stats["replayed_steps"] == 3
    q.close()


# ---- kill -9 at every crash point of the remedy ----

CHILD = os.path.join(HERE, "poison_child.py")
POINTS = [None, ("push-append", 3), ("push-acked", 4), ("step-divide", 2), ("step-run", 2), ("step-computed", 2),
          ("step-output", 2), ("step-failed", 1), ("discard-logged", 1), ("step-written", 2), ("step-failed", 2),
          ("checkpoint-start", 2), ("checkpoint-gc", 2), ("recover-step", 1)]


def _child(d: str, executor: str, crash: tuple[str, int] | None) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(HERE))] + [env.get("PYTHONPATH", "")])
    env.pop("DBSP_CRASHPOINT", None)
    if crash:
        env["DBSP_CRASHPOINT"] = f"{crash[0]}:{crash[1]}"
    r = subprocess.run([sys.executable, CHILD, d, executor, str(SEED)], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == -signal.SIGKILL:
        return "killed"
    assert r.returncode == 0 and "DONE" in r.stdout, f"crash={crash} rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return "done"


@pytest.mark.parametrize("executor", ["embedded", "staged"])
@pytest.mark.slow
def test_kill_at_every_point_of_the_remedy(tmp_path, executor):
    """The child pushes good and poison batches (named), steps, meets StepError, discards the poison pushes and
    steps on; it is killed at each crash point once, then run again to the end. Every open works, the views
    equal the model of the good batches, and every good push is in exactly one output step, the poison in none."""
    from poison_child import BATCHES, POISON

    landed = 0
    for i, crash in enumerate(POINTS):
        d = str(tmp_path / f"d{i}")
        if crash is not None:
            landed += _child(d, executor, crash) == "killed"
        assert _child(d, executor, None) == "done"
        p = dbsp.Pipeline.open(d, build_circuit(), executor=StagedExecutor() if executor == "staged" else None)
        assert integral(_logged(p)) == model([good(SEED, "g", s) for s in range(BATCHES)]), f"crash={crash}"
        seen = [(r["producer"], s) for st in range(p.steps) for r in p.output_inputs(st)
                for s in range(r["first_seq"], r["last_seq"] + 1)]
        assert sorted(seen) == [("g", s) for s in range(BATCHES)], f"crash={crash}"
        assert p.stats.get("failed_steps", 0) == 0 or p.step_error is None
        p.close()
        assert all(("bad", s) not in seen for s in POISON)
    print(f"\n[poison kill -9, {executor}] {len(POINTS) - 1} crash points, {landed} kills landed")
    assert landed >= len(POINTS) - 3  # nearly every point is on the remedy's path (a kill that lands is checked)
