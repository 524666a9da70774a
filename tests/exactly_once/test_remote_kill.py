"""kill -9 of an embedded durable pipeline whose storage is an S3 prefix (moto's server, tests/s3_server.py): every restart deletes the local cache directory first and recovers from the store alone; at the end the outputs equal DuckDB's over every batch, each push counted in exactly one step (0 lost, 0 doubled).

The producers resume from the last seq a checkpoint confirmed (one that began after the push returned) and push
the later ones again after a restart: the dedup set and the input log restored from the store must drop every one
of them that was acknowledged, since the input log's segment objects are group-committed (storage.logstore), so
the test also counts acknowledged pushes missing from the store after a kill (``acked_then_not_in_store``: 0).
Seeds: ``DBSP_REMOTE_KILL_SEED`` replays one.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
CHILD = os.path.join(HERE, "remote_kill_child.py")

import dbsp_core as dbsp  # noqa: E402
from test_kill9 import _env  # noqa: E402
from workload import PRODUCERS, batch, build_circuit, integral, oracle  # noqa: E402

SEED = int(os.environ.get("DBSP_REMOTE_KILL_SEED", random.randrange(2**31)))


# crash points a run may be killed at instead of a timer: after the local checkpoint committed and the local logs
# were truncated, before the upload (the store's previous manifest must still hold what recovery needs), with the
# upload's objects in the store but not its manifest while later steps ran (remote_state invariant 5), and in the
# middle of a step or of the pushes
POINTS = [("checkpoint-upload", 2), ("checkpoint-manifest", 2), ("checkpoint-gc", 2), ("checkpoint-state", 2),
          ("push-acked", 10), ("step-run", 3)]


def _run(uri: str, cache: str, seed: int, batches: int, workers: int, run: int, kill_after: float | None,
         crash: str | None = None) -> str:
    """One child run on an emptied cache; kill -9 ``kill_after`` seconds after it is READY, or at crash point
    ``crash`` (neither: let it finish). Returns 'killed' or 'done'."""
    shutil.rmtree(cache, ignore_errors=True)  # a new machine: nothing of the old local disk
    p = subprocess.Popen([sys.executable, CHILD, uri, cache, str(seed), str(batches), str(workers)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env({"DBSP_RUN": str(run), **({"DBSP_CRASHPOINT": crash} if crash else {})}))
    ready = threading.Event()
    out: list[bytes] = []

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            out.append(line)
            if line.startswith(b"READY"):
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = crash is not None
    if kill_after is not None:
        ready.wait(120)
        time.sleep(kill_after)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            killed = True
    err = p.stderr.read() if p.stderr else b""
    p.wait(300)
    reader.join(10)
    if killed and p.returncode == -signal.SIGKILL:
        return "killed"
    assert p.returncode == 0 and any(x.startswith(b"DONE") for x in out), \
        f"seed {seed} run {run} failed rc={p.returncode}:\n{err.decode(errors='replace')[-3000:]}"
    return "done"


def _lines(path: str) -> list[list[str]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [x.split() for x in f.read().split("\n") if x.strip()]


def _confirmed(root: str, pr: str) -> int:
    lines = _lines(os.path.join(root, f"confirmed-{pr}.txt"))
    return int(lines[-1][0]) if lines else 0


def check(root: str, uri: str, seed: int, batches: int, kills: int) -> dict:
    rng = random.Random(seed)
    workers = 1 + seed % 3
    cache = os.path.join(root, "cache")
    landed = lost_from_store = 0
    how = []
    for run in range(kills):
        if run % 2:  # every other kill at a crash point
            name, hi = rng.choice(POINTS)
            crash, after = f"{name}:{rng.randint(1, hi)}", None
        else:
            crash, after = None, rng.uniform(0.05, 0.8)
        how.append(crash or f"{after:.2f}s")
        status = _run(uri, cache, seed, batches, workers, run, after, crash)
        assert status == "killed", f"seed {seed}: run {run} ({how[-1]}) finished before its kill (more batches?)"
        landed += 1
        for pr in PRODUCERS:  # acknowledged but not confirmed by a checkpoint: maybe not in the store
            lines = _lines(os.path.join(root, f"pushed-{pr}.txt"))
            top = max((int(x[0]) + 1 for x in lines), default=0)
            lost_from_store += max(0, top - _confirmed(root, pr))
    assert _run(uri, cache, seed, batches, workers, kills, None) == "done"
    # the re-pushes after each restart: a duplicate=0 one for a seq pushed before was not in the store any more
    repushed_new = 0
    for pr in PRODUCERS:
        seen: set[int] = set()
        for seq, dup in ((int(a), int(b)) for a, b in _lines(os.path.join(root, f"pushed-{pr}.txt"))):
            if seq in seen and not dup:
                repushed_new += 1
            seen.add(seq)
        assert seen == set(range(batches)), f"seed {seed}: {pr} pushed {sorted(seen)[:5]}..."
    shutil.rmtree(cache)
    p = dbsp.Pipeline.open(uri, build_circuit(), cache_dir=cache, checkpoint_interval=None)
    try:
        want = oracle(seed, {pr: batches for pr in PRODUCERS})
        last = p.output_steps.stop
        for name, expect in want.items():
            got, steps = integral(p, name)
            assert steps == list(range(last)), f"seed {seed}: output {name} steps {steps}"
            assert got == expect, f"seed {seed}: output {name} differs from DuckDB"
        where: dict[tuple[str, int], int] = {}
        doubled = 0
        for step in range(last):
            for r in p.output_inputs(step):
                for s in range(r["first_seq"], r["last_seq"] + 1):
                    doubled += (r["producer"], s) in where
                    where[(r["producer"], s)] = step
        expect_keys = {(f"{pr}.{k}", s) for pr in PRODUCERS for s in range(batches)
                       for k in range(len(batch(seed, pr, s)))}
        lost = len(expect_keys - set(where))
        manifest = p._remote_state.manifest
    finally:
        p.close(checkpoint=False)
    res = {"kills": landed, "how": how, "lost": lost, "doubled": doubled, "steps": last, "manifest": manifest["version"],
           "acked_after_last_checkpoint": lost_from_store, "acked_then_not_in_store": repushed_new}
    print(f"remote kill seed {seed} (replay: DBSP_REMOTE_KILL_SEED={seed}): {res}")
    assert lost == 0 and doubled == 0, res
    # the input log is in the store (segment objects, group commit): no acknowledged push is missing after a restart
    assert repushed_new == 0, res
    return res


def test_kill9_recovers_from_the_store_with_an_empty_disk(s3_server, tmp_path):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    res = check(str(tmp_path), uri, SEED, batches=30, kills=2)
    assert res["kills"] == 2 and res["manifest"] > 2


@pytest.mark.slow
def test_kill9_recovers_from_the_store_many_kills(s3_server, tmp_path):
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    res = check(str(tmp_path), uri, SEED, batches=150, kills=6)
    assert res["kills"] == 6
