"""``dbsp inspect`` and ``dbsp repair`` of a store pipeline's stage chains (runtime/stage_check.py) on moto's S3 server: one stage object deleted or corrupted, inspect names it, open refuses with a typed error naming ``dbsp repair``, and repair falls back to the older whole checkpoint (only when asked) and recovers exactly once against DuckDB, or refuses when no checkpoint is whole."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pyarrow.fs as pafs
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

from staged_circuits import build, changes, check_duckdb, embedded, same_outputs  # noqa: E402

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.__main__ import main  # noqa: E402
from dbsp_core.errors import CorruptionError  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.runtime.staged import LocalJobRunner  # noqa: E402
from dbsp_core.storage.remote import Remote  # noqa: E402

SEED = int(os.environ.get("DBSP_STAGE_CHECK_SEED", np.random.SeedSequence().entropy % 10**6))
STEPS = 8


def _executor(caches, seed):
    return StagedExecutor(LocalJobRunner(cache_dirs=caches, seed=seed))


def _feed(p, steps):
    for pushes in steps:
        for h, z in pushes:
            p.push(h, z)
        p.step()


def _history(s3_server, tmp_path, steps):
    """A pipeline with two checkpoints (steps 3 and 5) and one step after them, then a crash: returns its URI,
    circuit, SQL and the manifests older and newer."""
    c, sql = build("join_agg")
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = dbsp.Pipeline(c, 2, 8, uri, executor=_executor([str(tmp_path / f"run0-{i}") for i in range(2)], SEED),
                      cache_dir=str(tmp_path / "driver0"), checkpoint_interval=None)
    _feed(p, steps[:3])
    p.checkpoint()
    _feed(p, steps[3:5])
    p.checkpoint()
    _feed(p, steps[5:6])
    p._shutdown()  # a crash: step 5 is only in the logs
    r = Remote.of(uri, str(tmp_path))
    older, newer = (r.read_manifest(v) for v in r.manifest_versions()[-2:])
    return uri, c, sql, r, older, newer


def _links(m):
    return {link["object"] for ch in m["stages"]["chains"].values() for link in ch}


def _damage(s3_server, r, name, how):
    fs = s3_server.filesystem()
    path = r.path(name)
    if how == "delete":
        fs.delete_file(path)
        return
    with fs.open_input_stream(path) as f:
        data = bytearray(f.readall())
    data[-1] ^= 0x5A  # the same size: only the checksum can tell
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))


def _cli(capsys, *argv):
    capsys.readouterr()  # what came before (the seed line) stays out of the command's output
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _open(c, uri, tmp_path, tag):
    """Pipeline.open by a new process: an empty driver directory and empty task caches."""
    caches = [str(tmp_path / f"{tag}-{i}") for i in range(2)]
    return dbsp.Pipeline.open(uri, c, executor=_executor(caches, SEED + 1), cache_dir=str(tmp_path / tag),
                              checkpoint_interval=None)


@pytest.mark.parametrize("how", ["delete", "corrupt"])
def test_repair_falls_back_to_the_whole_checkpoint(s3_server, tmp_path, capsys, how) -> None:
    print(f"DBSP_STAGE_CHECK_SEED={SEED}")
    steps, bags = changes(SEED, STEPS)
    uri, c, sql, r, older, newer = _history(s3_server, tmp_path, steps)
    only_newer = sorted(_links(newer) - _links(older))
    assert only_newer, "the newer checkpoint's chains add links"
    victim = only_newer[np.random.default_rng(SEED).integers(len(only_newer))]
    _damage(s3_server, r, victim, how)

    rc, out, _ = _cli(capsys, "inspect", uri, "--json")
    assert rc == 0
    sc = json.loads(out)["stage_chains"]
    assert [d["object"] for d in sc["damaged"]] == [victim]
    assert sc["damaged"][0]["problem"] == ("missing" if how == "delete" else "checksum mismatch")
    assert sc["damaged"][0]["manifests"] == [newer["version"]]
    assert sc["unnamed"], "step 5's objects are named by no manifest"
    rc, out, _ = _cli(capsys, "inspect", uri)
    assert rc == 0 and "1 links DAMAGED (dbsp repair" in out and victim in out

    # open refuses, typed and naming the repair; a same-size damage is found by the task reading it in the replay
    with pytest.raises(CorruptionError, match="dbsp repair") as e:
        _open(c, uri, tmp_path, "refused")
    assert victim in str(e.value)

    versions = r.manifest_versions()
    rc, out, _ = _cli(capsys, "repair", uri, "--json")
    report = json.loads(out)
    assert rc == 1 and not report["done"] and "--fall-back" in report["action"]
    assert report["fallback"]["manifest"] == older["version"] and report["fallback"]["step"] == 3
    assert r.manifest_versions()[-1] == versions[-1], "without --fall-back nothing is written"

    rc, out, _ = _cli(capsys, "repair", uri, "--fall-back")
    assert rc == 0 and "fell back" in out
    # the damaged newest: the crashed run's, or the claim (a copy of it) of the open that found the damage in its replay
    assert r.newest_manifest()["repaired"]["from"] == older["version"]

    q = _open(c, uri, tmp_path, "repaired")  # replays steps 3..5 from the logs, checked against the output log
    _feed(q, steps[6:])
    logs = {n: dict(q.read_output(n, from_step=0)) for n in sql}  # every step once, in the output log
    q.close()
    outs = [{n: logs[n][i] for n in sql} for i in range(STEPS)]
    same_outputs(outs, embedded(c, steps))
    check_duckdb(sql, outs, bags)


def test_repair_refuses_when_no_checkpoint_is_whole(s3_server, tmp_path, capsys) -> None:
    print(f"DBSP_STAGE_CHECK_SEED={SEED}")
    steps, _ = changes(SEED, 6)
    uri, c, sql, r, older, newer = _history(s3_server, tmp_path, steps)
    shared = sorted(_links(newer) & _links(older))
    victim = shared[np.random.default_rng(SEED).integers(len(shared))]
    _damage(s3_server, r, victim, "delete")
    versions = r.manifest_versions()
    rc, out, _ = _cli(capsys, "repair", uri, "--fall-back", "--json")
    report = json.loads(out)
    assert rc == 1 and not report["done"] and report["fallback"] is None
    assert [d["object"] for d in report["lost"]] == [victim]
    assert report["result"].startswith("refused")
    assert r.manifest_versions() == versions, "a refusal writes nothing"
    rc, out, _ = _cli(capsys, "repair", uri)
    assert rc == 1 and f"lost         {victim}" in out
    with pytest.raises(CorruptionError, match="dbsp repair"):
        _open(c, uri, tmp_path, "refused")
