"""The main job: ``python -m dbsp_core demo`` runs, verifies its views against DuckDB, and survives its own
``kill -9`` (``--kill-after``) with the recovered views equal to a from-scratch recomputation."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dbsp_core", "demo", "--batches", "8", "--bids", "3000",
                           "--checkpoint-interval", "0.05", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_kill_and_recover(tmp_path) -> None:
    r = _demo("--kill-after", "4", "--dir", str(tmp_path / "d"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child killed by SIGKILL" in r.stdout
    assert "Pipeline.open recovered at step 5" in r.stdout
    assert "verified against DuckDB" in r.stdout


def test_demo_kill_and_recover_on_an_object_store(s3_server, tmp_path) -> None:
    uri = s3_server.uri(s3_server.bucket(), "demo")
    r = _demo("--kill-after", "4", "--storage", uri)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child killed by SIGKILL" in r.stdout and "Pipeline.open recovered at step 5" in r.stdout
    assert "verified against DuckDB" in r.stdout


def test_demo_rerun_over_the_same_directory(tmp_path) -> None:
    d = str(tmp_path / "d")
    first = _demo("--dir", d)
    assert first.returncode == 0, first.stdout + first.stderr
    again = _demo("--dir", d)  # every batch is recognized as a duplicate; the views stay right
    assert again.returncode == 0, again.stdout + again.stderr
    assert "verified against DuckDB" in again.stdout
    assert "0 new rows" in again.stdout
    other = _demo("--dir", d, "--seed", "8")
    assert other.returncode != 0 and "holds a demo run with seed 7" in other.stderr


def test_cli_inspect_and_read(tmp_path) -> None:
    d = str(tmp_path / "d")
    assert _demo("--dir", d, "--no-verify").returncode == 0
    env = dict(os.environ, PYTHONPATH=ROOT)
    ins = subprocess.run([sys.executable, "-m", "dbsp_core", "inspect", d], env=env, capture_output=True, text=True)
    assert ins.returncode == 0 and "output log   steps 0.." in ins.stdout, ins.stdout + ins.stderr
    rd = subprocess.run([sys.executable, "-m", "dbsp_core", "read", d, "category_stats", "--limit", "1"], env=env,
                        capture_output=True, text=True)
    assert rd.returncode == 0 and rd.stdout.startswith("step 0:"), rd.stdout + rd.stderr
    bad = subprocess.run([sys.executable, "-m", "dbsp_core", "inspect", str(tmp_path / "none")], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a dbsp storage directory" in bad.stderr


def test_demo_over_a_directory_of_another_circuit(tmp_path) -> None:
    """A directory the demo's earlier circuit wrote (last_hour windowing the bids, then joining the auctions again)
    stops the demo with a message naming the directory and what to do, not a traceback."""
    import pyarrow as pa

    import dbsp_core as dbsp
    from dbsp_core.demo import AUCTIONS, BIDS, PERSONS

    d = str(tmp_path / "d")
    c = dbsp.Circuit()
    c.input("persons", PERSONS)
    auctions, bids = c.input("auctions", AUCTIONS), c.input("bids", BIDS)
    recent = dbsp.within_last(bids, "ts", 3600).join(auctions, left_on="auction", right_on="id")
    c.output("last_hour", recent.group_by("category").agg(n=dbsp.count(), hi=dbsp.max("price")))
    c.output("top_bid", bids.group_by("auction").agg(hi=dbsp.max("price"), n=dbsp.count()))
    p = dbsp.Pipeline(c, workers=2, storage=d, checkpoint_interval=None)
    p.push("auctions", pa.table({"id": [1], "seller": [1], "category": ["cat-00"], "reserve": [10]}, schema=AUCTIONS))
    p.step()
    p.close()
    r = _demo("--dir", d)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{d} holds a run of another version of the demo's circuit" in r.stderr and "use another --dir" in r.stderr
    assert "Traceback" not in r.stderr
