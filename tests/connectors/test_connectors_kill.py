"""Exactly once through the connectors under kill -9: the file source, the SQLite sink and the Parquet sink, with
the writer (pipeline, source and sinks in one process) or the reader (the sinks, in a process of their own
over the storage directory) killed at random points. At the end the SQLite table and the Parquet directory
equal DuckDB's recomputation over every input file, and no step was applied twice.

``DBSP_CONNECTOR_KILLS`` sets the kills per scenario (default 12). The files and the kill moments come from a seed
new per run, printed (with ``-rA`` and in every failure); ``DBSP_CONNECTOR_SEED`` replays one. Views compare as
multisets: a row the SQLite sink wrote twice is a failure."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter

import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import FileSource, read_parquet_view, read_sqlite_view

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from connector_workload import circuit, make_files, publish, reference  # noqa: E402

KILLS = int(os.environ.get("DBSP_CONNECTOR_KILLS", "12"))
SEED = int(os.environ.get("DBSP_CONNECTOR_SEED", str(random.SystemRandom().randrange(2**31))))
CHILD = os.path.join(HERE, "connector_child.py")


def _launch(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _run_to_end(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "DONE" in out, out + err
    return out


def _kill_at_random(proc: subprocess.Popen, rng: random.Random) -> tuple[int, int]:
    """SIGKILL ``proc`` at a random point: three times in four while it works (a random delay after it has
    recovered and printed START), otherwise while it starts or recovers. Returns (killed, killed while working)."""
    seen = ""
    if rng.random() < 0.75:
        seen = proc.stdout.readline()  # START once recovered ("" if it died or finished first)
        time.sleep(rng.uniform(0.0, 0.6))
    else:
        time.sleep(rng.uniform(0.1, 1.0))
    if proc.poll() is not None:
        out, err = proc.communicate()
        assert proc.returncode == 0, seen + out + err
        return 0, 0
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    return 1, int("START" in seen + out)


def _check(inbox: str, sqlite_path: str, pdir: str, steps: int, seed: int) -> None:
    ref = reference(inbox)
    step, table = read_sqlite_view(sqlite_path, "by_region")
    assert step == steps - 1  # the last step, as the output log numbers it
    got = Counter((r["region"], r["n"], r["total"], r["weight"]) for r in table.to_pylist())
    assert got == ref["by_region"], f"SQLite differs from DuckDB (replay: DBSP_CONNECTOR_SEED={seed})"
    con = sqlite3.connect(sqlite_path)
    applied = [s for (s,) in con.execute("SELECT step FROM _dbsp_steps ORDER BY step")]
    con.close()
    assert applied == list(range(steps))  # each step once (the primary key refuses a second application)
    files = sorted(f for f in os.listdir(pdir) if f.startswith("step-"))
    assert files == [f"step-{s:020d}.parquet" for s in range(steps)]
    big = read_parquet_view(pdir)
    assert Counter(k + (w,) for k, w in big.to_dict().items()) == ref["big"], \
        f"Parquet differs from DuckDB (replay: DBSP_CONNECTOR_SEED={seed})"


def _report(capsys, what: str, kills: int, working: int, rounds: int, steps: int) -> None:
    with capsys.disabled():
        print(f"\n{what}: {kills} kill -9s ({working} while working, the rest while starting or recovering) in "
              f"{rounds} runs, {steps} steps; views equal DuckDB over all input, no step applied twice")


@pytest.mark.slow
@pytest.mark.parametrize("immutable", [False, True], ids=["rows-logged", "immutable-files"])
def test_kill_the_writer(tmp_path, capsys, immutable) -> None:
    print(f"[connectors] writer kills: seed {SEED} (replay: DBSP_CONNECTOR_SEED={SEED})")
    rng = random.Random(SEED)
    staging, inbox = str(tmp_path / "staging"), str(tmp_path / "in")
    names = make_files(staging, 3 * KILLS + 6, seed=SEED + 1)
    storage, sqlite_path, pdir = str(tmp_path / "pipe"), str(tmp_path / "views.db"), str(tmp_path / "big")
    kills = working = rounds = 0
    todo = list(names)
    while kills < KILLS:
        for _ in range(rng.randrange(1, 4)):
            if todo:
                publish(staging, inbox, todo.pop(0))
        rounds += 1
        k, w = _kill_at_random(_launch("writer", storage, inbox, sqlite_path, pdir, str(len(names)),
                                       *["immutable"] * immutable), rng)
        kills, working = kills + k, working + w
    for name in todo:
        publish(staging, inbox, name)
    rounds += 1
    out = _run_to_end(_launch("writer", storage, inbox, sqlite_path, pdir, str(len(names)), *["immutable"] * immutable))
    steps = int(out.split("DONE")[1].split()[0])
    _check(inbox, sqlite_path, pdir, steps, SEED)
    assert kills >= KILLS
    _report(capsys, "writer (pipeline + file source" + " with immutable files" * immutable + " + sinks)", kills, working,
            rounds, steps)


@pytest.mark.slow
def test_kill_the_reader(tmp_path, capsys) -> None:
    print(f"[connectors] reader kills: seed {SEED} (replay: DBSP_CONNECTOR_SEED={SEED})")
    rng = random.Random(SEED + 10)
    staging, inbox = str(tmp_path / "staging"), str(tmp_path / "in")
    names = make_files(staging, 2 * KILLS + 4, seed=SEED + 2)
    storage, sqlite_path, pdir = str(tmp_path / "pipe"), str(tmp_path / "views.db"), str(tmp_path / "big")
    p = dbsp.Pipeline(circuit(), workers=2, storage=storage, checkpoint_interval=None, segment_bytes=4096)
    src = FileSource(p, "sales", inbox)
    kills = working = rounds = 0
    todo = list(names)
    while kills < KILLS:
        for _ in range(2):  # new files and steps while the sinks run (and die) in their own process
            if todo:
                publish(staging, inbox, todo.pop(0))
            src.poll()
            p.step()
        for _ in range(rng.randrange(2, 8)):
            p.step()  # empty steps: more records for the sinks to write
        p.checkpoint()  # truncates the output log below what both sinks acknowledged
        rounds += 1
        k, w = _kill_at_random(_launch("sink", storage, sqlite_path, pdir, str(p.steps)), rng)
        kills, working = kills + k, working + w
    for name in todo:
        publish(staging, inbox, name)
    src.poll()
    p.step()
    p.checkpoint()
    assert p.output_steps.start > 0  # the log was truncated below the consumers' steps, never past them
    rounds += 1
    _run_to_end(_launch("sink", storage, sqlite_path, pdir, str(p.steps)))
    assert p.consumers.list() == {"sqlite-by_region": p.steps, "parquet-big": p.steps}
    steps = p.steps
    p.close()
    _check(inbox, sqlite_path, pdir, steps, SEED)
    assert kills >= KILLS
    _report(capsys, "reader (SQLite and Parquet sinks over the storage directory)", kills, working, rounds, steps)


def test_file_source_restart_neither_skips_nor_repeats(tmp_path) -> None:
    staging, inbox = str(tmp_path / "staging"), str(tmp_path / "in")
    names = make_files(staging, 8, seed=SEED + 3)
    for n in names:
        publish(staging, inbox, n)
    p = dbsp.Pipeline(circuit(), storage=tmp_path / "pipe", checkpoint_interval=None)
    src = FileSource(p, "sales", inbox)
    src.poll(max_files=3)
    p.step()
    p.close()
    q = dbsp.Pipeline.open(tmp_path / "pipe", circuit())
    again = FileSource(q, "sales", inbox)
    again.poll()
    assert again.stats["skipped"] > 0 and again.stats["duplicates"] == 0  # known row groups are not even read
    q.step()
    view: dict = {}
    for _, z in q.read_output("by_region"):
        for row, w in z.to_dict().items():
            view[row] = view.get(row, 0) + w
    assert Counter(k + (w,) for k, w in view.items() if w) == reference(inbox)["by_region"], \
        f"the view differs from DuckDB (replay: DBSP_CONNECTOR_SEED={SEED})"
    q.close()
