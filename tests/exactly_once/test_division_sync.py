"""The step's division record is fsync'd while the circuit runs (durable invariant 3): output is written and returned only after it is durable, and a crash before or after that point recovers exactly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.storage.formats import DIVISION_HANDLE  # noqa: E402
from dbsp_core.storage import StepLog  # noqa: E402
from workload import PRODUCERS, build_circuit, integral, oracle, push_batch  # noqa: E402

SEED = 5


def _divided(log: StepLog, step: int) -> bool:
    """Whether the durable part of the input log holds the division record of ``step``."""
    return any(r.handle == DIVISION_HANDLE and r.step == step for r in log.iter_from(step, step))


def test_output_is_written_and_returned_only_after_the_division_is_durable(tmp_path, monkeypatch):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(build_circuit(), workers=2, storage=d, checkpoint_interval=None)
    real_sync = StepLog.sync
    syncs: list[float] = []

    def slow_sync(self, ticket):  # a slow disk: the fsync ends long after the circuit ran
        time.sleep(0.15)
        real_sync(self, ticket)
        syncs.append(time.monotonic())

    monkeypatch.setattr(StepLog, "sync", slow_sync)
    log, out = p._input, p._output
    real_write = type(out).write
    seen: list[tuple[int, bool]] = []

    def checked_write(self, step, outputs, *rest, **kw):  # rest: the input ranges and the references
        seen.append((step, _divided(log, step)))
        return real_write(self, step, outputs, *rest, **kw)

    monkeypatch.setattr(type(out), "write", checked_write)
    counts = {pr: 0 for pr in PRODUCERS}
    for k in range(3):
        for pr in PRODUCERS:
            push_batch(p, SEED, pr, counts[pr])  # pushes append (not enqueue): unaffected by the slow sync
            counts[pr] += 1
        p.step()
        assert _divided(log, k), "step returned before its division record was durable"
    assert seen == [(0, True), (1, True), (2, True)]
    assert len(syncs) == 3  # the division records went through the background sync
    monkeypatch.undo()
    for name, want in oracle(SEED, counts).items():
        assert integral(p, name)[0] == want
    p.close()


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import dbsp_core as dbsp
    from dbsp_core.runtime.crashpoints import arm_crashpoint
    from dbsp_core.storage import StepLog
    from workload import PRODUCERS, build_circuit, push_batch
    p = dbsp.Pipeline(build_circuit(), workers=2, storage={d!r}, checkpoint_interval=None)
    for seq in range(2):
        for pr in PRODUCERS:
            push_batch(p, {seed}, pr, seq)
        p.step()
    p.checkpoint()
    for pr in PRODUCERS:
        push_batch(p, {seed}, pr, 2)
    p.step()  # step 1 after the checkpoint: replayed on recovery
    for pr in PRODUCERS:
        push_batch(p, {seed}, pr, 3)
    if {mode!r} == "before-sync":  # the division record is enqueued, never written: the process dies first
        StepLog.sync = lambda self, ticket: os.kill(os.getpid(), signal.SIGKILL)
    else:  # the division record is durable, the output of the step is not written yet
        arm_crashpoint("step-output:1")
    p.step()
    print("NOT KILLED", flush=True)
""")


@pytest.mark.parametrize("mode", ["before-sync", "after-sync"])
def test_a_crash_around_the_division_sync_recovers_exactly(tmp_path, mode):
    d = str(tmp_path / "d")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), HERE]))
    env.pop("DBSP_CRASHPOINT", None)
    r = subprocess.run([sys.executable, "-c", CHILD.format(here=HERE, d=d, seed=SEED, mode=mode)],
                       capture_output=True, env=env, timeout=120)
    assert r.returncode == -9, (r.returncode, r.stdout.decode(), r.stderr.decode())
    with StepLog(os.path.join(d, "input")) as log:
        assert _divided(log, 2)
        assert _divided(log, 3) == (mode == "after-sync")
    p = dbsp.Pipeline.open(d, build_circuit(), checkpoint_interval=None)
    try:
        assert p.stats["replayed_steps"] == (2 if mode == "after-sync" else 1)  # steps 2 (and 3) from the log
        if mode == "before-sync":
            assert p.steps == 3 and p.output_steps == range(0, 3)
            assert p.stats["recovered_pushes"] == 3  # seq 3's pushes, acknowledged but never divided: kept
            p.step()  # they form step 3 now
        assert p.steps == 4 and p.output_steps == range(0, 4)
        counts = {pr: 4 for pr in PRODUCERS}
        for name, want in oracle(SEED, counts).items():
            got, steps = integral(p, name)
            assert steps == [0, 1, 2, 3] and got == want, name
        assert len(p.output_inputs(3)) == 3  # step 3 holds the three pushes of seq 3, each once
    finally:
        p.close()
