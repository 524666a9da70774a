"""Crash test (b): random kill -9 of a real process appending to a StepLog and committing a Database.

After each kill every acknowledged append is in the log exactly once and in order, and every acknowledged
commit is openable. DBSP_STORAGE_KILLS sets the number of kills (default 200; up to 10k for soak runs).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from dbsp_core.storage import Database, StepLog

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_child.py")
KILLS = int(os.environ.get("DBSP_STORAGE_KILLS", "200"))


def payload(seq: int) -> bytes:
    return (b"%d;" % seq) * (1 + seq % 97)


def run_and_kill(d: str, seed: int, rng: random.Random) -> tuple[list[int], list[tuple[int, int]]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(CHILD)))] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    p = subprocess.Popen([sys.executable, CHILD, d, str(seed)], stdout=subprocess.PIPE, env=env)
    first = p.stdout.readline()
    assert first == b"READY\n", f"child failed to start: {first!r}"
    time.sleep(rng.uniform(0.002, 0.06))
    os.kill(p.pid, signal.SIGKILL)
    rest = p.stdout.read()
    p.wait()
    p.stdout.close()
    acks, commits = [], []
    for line in rest.split(b"\n"):
        parts = line.split()
        if len(parts) == 2 and parts[0] == b"A":
            acks.append(int(parts[1]))
        elif len(parts) == 3 and parts[0] == b"C":
            commits.append((int(parts[1]), int(parts[2])))
    return acks, commits


def test_kill9_loop(tmp_path):
    d = str(tmp_path)
    rng = random.Random(2024)
    acked_max, committed_max = -1, 0
    total_acks = total_commits = 0
    for i in range(KILLS):
        acks, commits = run_and_kill(d, i, rng)
        assert acks == list(range(acked_max + 1, acked_max + 1 + len(acks))), f"kill {i}: acks out of order"
        total_acks += len(acks)
        total_commits += len(commits)
        if acks:
            acked_max = max(acked_max, acks[-1])
        if commits:
            committed_max = max(committed_max, commits[-1][0])
        with StepLog(os.path.join(d, "log"), segment_bytes=32 << 10) as log:
            recs = list(log.iter_from(0))
        seqs = [r.seq for r in recs]
        assert seqs == list(range(len(seqs))), f"kill {i}: log sequence has gaps or duplicates"
        assert len(seqs) > acked_max, f"kill {i}: acknowledged append {acked_max} lost (log has {len(seqs)})"
        assert all(r.payload == payload(r.seq) for r in recs), f"kill {i}: wrong payload"
        assert [r.step for r in recs] == sorted(r.step for r in recs)
        acked_max = len(seqs) - 1  # unacknowledged-but-durable records count from now on
        with Database(os.path.join(d, "db")) as db:
            vs = db.versions()
            assert vs[-1] >= committed_max, f"kill {i}: acknowledged commit {committed_max} lost ({vs})"
            db.check()
            with db.open(vs[-1]) as h:
                keys = [int(k) for k, _ in h.scan("commits")]
                assert keys == list(range(1, vs[-1] + 1)), f"kill {i}: commits table is not 1..{vs[-1]}"
                assert all(int(v) <= len(seqs) for _, v in h.scan("commits"))
        committed_max = vs[-1]
    print(f"\n[storage kill -9 (b)] {KILLS} kills, {total_acks} acknowledged appends, {total_commits} acknowledged "
          f"commits, log holds {acked_max + 1} records, database at version {committed_max}, 0 violations")
