"""State databases LAYOUT names but that are missing, and ones it does not name (storage/statefiles.py, repair invariant 6c): ``Pipeline.open`` refuses a missing one naming the file and ``dbsp repair`` before anything changes, ``dbsp inspect`` shows it, ``dbsp repair`` lists it with what to do (or computes the state again when the input log holds every step), for both executors; a stale extra database is set aside; a pipeline whose databases are all there opens with the same views (dict model, test_damage.model)."""

from __future__ import annotations

import glob
import os
import shutil
import sys

import pytest

import dbsp_core as dbsp
from dbsp_core.__main__ import main as cli
from dbsp_core.errors import CorruptionError
from dbsp_core.runtime.remote_state import RemoteCheckpoints
from dbsp_core.runtime.staged import StagedExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_damage import SEED, batch, circuit, model, views  # noqa: E402
from test_repair_finishes import _files  # noqa: E402

KINDS = ["embedded", "staged"]


def _executor(kind: str) -> StagedExecutor | None:
    return StagedExecutor() if kind == "staged" else None


def _open(d: str, kind: str, **kw) -> dbsp.Pipeline:
    return dbsp.Pipeline.open(d, circuit(by_reference=False), executor=_executor(kind), checkpoint_interval=None, **kw)


def _build(d: str, kind: str, checkpoint: bool = True, steps: int = 6) -> list[tuple[str, int]]:
    """``steps`` steps of pushes by producers a and b (a checkpoint after step 2 and at the close, unless not
    ``checkpoint``: then the state is where the executor left it and driver.db at step 0); returns the pushes."""
    p = dbsp.Pipeline(circuit(by_reference=False), workers=2, storage=d, checkpoint_interval=None,
                      executor=_executor(kind))
    pushes = []
    for s in range(steps):
        for pr in ("a", "b"):
            p.push("t", batch(pr, s), producer=pr, seq=s)
            pushes.append((pr, s))
        p.step()
        if s == 2 and checkpoint:
            p.checkpoint()
    p.close(checkpoint=checkpoint)
    return pushes


def _dbs(d: str) -> list[str]:
    return sorted(glob.glob(os.path.join(d, "state", "**", "worker-*.db"), recursive=True))


def _goes_on(d: str, kind: str, pushes: list[tuple[str, int]], new: tuple[str, int] = ("c", 0), **kw) -> None:
    """The directory opens with every view right, and the next step counts the push ``new`` once against the state
    (``sums`` retracts the totals the state holds)."""
    p = _open(d, kind, **kw)
    assert views(p) == model(pushes), f"DBSP_DAMAGE_SEED={SEED}"
    assert not p.push("t", batch(*new), producer=new[0], seq=new[1]).duplicate
    p.step()
    assert views(p) == model(pushes + [new]), f"DBSP_DAMAGE_SEED={SEED}"
    p.close()


def _refused(d: str, kind: str, gone: list[str], capsys) -> None:
    """Open refuses naming each of ``gone`` and ``dbsp repair``, inspect shows them missing, repair lists them with
    the action; no file changes."""
    before = _files(d)
    rel = [os.path.relpath(p, d) for p in gone]
    with pytest.raises(CorruptionError) as e:
        _open(d, kind)
    assert all(r in str(e.value) for r in rel) and f"dbsp repair {d}" in str(e.value), str(e.value)
    assert _files(d) == before  # before the fix the staged executor made an empty database in place of it, and
    # an interrupted layout change was settled (RESCALE gone, databases rolled back) before the refusal
    assert cli(["inspect", d]) == 0
    out = capsys.readouterr().out
    assert all(f"state        {r} MISSING" in out for r in rel), out
    assert cli(["repair", d]) == 1
    out = capsys.readouterr().out
    for r in rel:
        assert f"NOT REPAIRED {r}: missing" in out and f"restore {r} from a backup" in out, out
    assert _files(d) == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_state_database_is_refused_listed_and_restored(tmp_path, capsys, kind):
    d, keep = str(tmp_path / "d"), str(tmp_path / "keep")
    pushes = _build(d, kind)
    gone = _dbs(d)[-1]
    shutil.copy2(gone, keep)
    os.unlink(gone)
    _refused(d, kind, [gone], capsys)
    shutil.copy2(keep, gone)  # the action repair names: restore that file from a backup
    _goes_on(d, kind, pushes)


@pytest.mark.parametrize("kind", KINDS)
def test_every_state_database_missing_is_refused(tmp_path, capsys, kind):
    """Before the fix open made every database empty and failed deep in recovery ("driver.db is at step 6 but the
    state only at step 0"), and repair then said "nothing to repair"."""
    d = str(tmp_path / "d")
    _build(d, kind)
    gone = _dbs(d)
    for p in gone:
        os.unlink(p)
    _refused(d, kind, gone, capsys)


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_database_of_a_worker_a_rescale_added(tmp_path, capsys, kind):
    """LAYOUT names three workers (a cold rescale at open); the third one's databases are gone."""
    d = str(tmp_path / "d")
    pushes = _build(d, kind)
    _open(d, kind, workers=3).close()
    gone = [p for p in _dbs(d) if p.endswith("worker-2.db")]
    assert gone
    os.unlink(gone[0])
    _refused(d, kind, gone[:1], capsys)
    assert len(pushes) == 12


@pytest.mark.parametrize("kind", KINDS)
def test_a_database_layout_does_not_name_is_set_aside(tmp_path, capsys, kind):
    """A stale worker-2.db beside a two-worker LAYOUT: never read (the directory opens with the same views); inspect
    names it, repair moves it to its backup directory (before the fix repair of the embedded executor said "the
    state databases share no version: restore the directory from a backup")."""
    d = str(tmp_path / "d")
    pushes = _build(d, kind)
    src = _dbs(d)[0]
    stale = os.path.join(os.path.dirname(src), "worker-2.db")
    shutil.copy2(src, stale)
    _goes_on(d, kind, pushes)  # a checkpoint at the close: the stale copy is now older than every named database
    assert cli(["inspect", d]) == 0
    assert f"{os.path.relpath(stale, d)} not named by LAYOUT" in capsys.readouterr().out
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert f"state database {os.path.relpath(stale, d)} (worker 0 of layout epoch 0) not named by LAYOUT" in out, out
    assert not os.path.exists(stale) and glob.glob(os.path.join(d, "repair-1", "*worker-2.db"))
    _goes_on(d, kind, pushes + [("c", 0)], new=("c", 1))


def test_a_database_missing_at_step_0_is_made_at_open(tmp_path):
    """Nothing says the state got past step 0 (no checkpoint of the embedded executor): the missing database held
    nothing, and open makes it (a pipeline whose creation a crash cut between two databases)."""
    d = str(tmp_path / "d")
    pushes = _build(d, "embedded", checkpoint=False)
    os.unlink(_dbs(d)[-1])
    _goes_on(d, "embedded", pushes)


def test_the_state_is_computed_again_when_the_input_log_holds_every_step(tmp_path, capsys):
    """The staged executor commits its state with every job, driver.db only at checkpoints: with none taken, the
    input log holds every step from 0, so repair sets every state file aside and the next open computes the state
    again (its output checked against the output log)."""
    d = str(tmp_path / "d")
    pushes = _build(d, "staged", checkpoint=False)
    gone = _dbs(d)[0]
    os.unlink(gone)
    with pytest.raises(CorruptionError, match="dbsp repair"):
        _open(d, "staged")
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert f"{os.path.relpath(gone, d)} missing" in out and "the state is computed again" in out, out
    assert _dbs(d) == [] and not os.path.exists(os.path.join(d, "state", "JOB"))
    _goes_on(d, "staged", pushes)


def test_a_missing_database_during_a_layout_change(tmp_path, capsys, monkeypatch):
    """A crash in the middle of a cold rescale (RESCALE present) and an old worker's database lost: open refuses
    before it settles the change, repair lists the file (instead of "open the pipeline first"), nothing changes;
    with the file back, open settles the change and goes on."""
    import dbsp_core.runtime.driver as driver

    class Crash(Exception):
        pass

    def crash(name: str) -> None:
        if name == "rescale-commit":
            raise Crash(name)

    d, keep = str(tmp_path / "d"), str(tmp_path / "keep")
    pushes = _build(d, "embedded")
    monkeypatch.setattr(driver, "crashpoint", crash)
    with pytest.raises(Crash):
        _open(d, "embedded", workers=3)
    monkeypatch.undo()
    assert os.path.exists(os.path.join(d, "RESCALE"))
    gone = os.path.join(d, "state", "worker-1.db")
    shutil.copy2(gone, keep)
    os.unlink(gone)
    _refused(d, "embedded", [gone], capsys)
    shutil.copy2(keep, gone)
    _goes_on(d, "embedded", pushes)


def test_a_stage_database_lost_while_the_pipeline_runs(tmp_path, capsys):
    """A stage task never makes its database: one lost between two jobs fails the next job naming the file (before
    the fix the task made an empty one at version 0 and failed as a stale attempt, and the next open failed with
    "the stage databases share no version"); with no checkpoint taken, repair computes the state again and every
    acknowledged push counts once."""
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circuit(by_reference=False), workers=2, storage=d, checkpoint_interval=None,
                      executor=StagedExecutor())
    pushes = []
    for s in range(4):
        p.push("t", batch("a", s), producer="a", seq=s)
        pushes.append(("a", s))
        if s == 3:
            gone = _dbs(d)[-1]
            os.unlink(gone)
            with pytest.raises(CorruptionError, match=f"{gone}: missing"):
                p.step()
        else:
            p.step()
    assert not os.path.exists(gone)
    p.close()
    with pytest.raises(CorruptionError, match=f"state database {os.path.relpath(gone, d)}, missing"):
        _open(d, "staged")
    assert not os.path.exists(gone)
    assert cli(["repair", d]) == 0
    assert "the state is computed again" in capsys.readouterr().out
    _goes_on(d, "staged", pushes)


@pytest.mark.parametrize("kind", KINDS)
def test_a_layout_change_refuses_a_missing_old_database_called_directly(tmp_path, kind):
    """runtime/rescale.py invariant 5, for callers other than ``Pipeline.open`` (whose check comes first): step 2
    (``_relayout``) took an old worker's missing database for a new worker's, made it empty and moved its shards'
    state as empty groups; it now refuses naming the file and ``dbsp repair`` and makes nothing, and
    ``cold_rescale`` refuses before RESCALE is written."""
    from dbsp_core.runtime.embedded import EmbeddedExecutor
    from dbsp_core.runtime.rescale import _relayout, cold_rescale
    from dbsp_core.storage.database import Database
    from dbsp_core.storage.directory import read_layout

    d = str(tmp_path / "d")
    _build(d, kind)
    old, _ = read_layout(d)
    new = old.rebalance(3)
    ex = _executor(kind) or EmbeddedExecutor()
    ex.start(circuit(by_reference=False), new, d)
    gone = [p for p in _dbs(d) if p.endswith("worker-1.db")]
    with Database(_dbs(d)[0], readonly=True) as db:
        version = db.versions().stop - 1
    for p in gone:
        os.unlink(p)
    before = _files(d)

    def nothing(_name: str) -> None:
        pass

    for g in ex.groups(new):
        with pytest.raises(CorruptionError) as e:
            _relayout(g, old, new, version, 6, nothing, "posix")
        assert os.path.relpath(g.path_of(1), d) in str(e.value) and f"dbsp repair {d}" in str(e.value), str(e.value)
    with pytest.raises(CorruptionError, match="dbsp repair"):
        cold_rescale(d, ex, old, new, version, 6, nothing)
    assert _files(d) == before and not os.path.exists(os.path.join(d, "RESCALE"))
    ex.close()


def test_an_object_stores_manifest_without_a_database_is_refused_by_the_executor(s3_server, tmp_path, monkeypatch):
    """Why EmbeddedExecutor.open_state keeps its own check of a missing worker database beside storage/statefiles.py's:
    with an object store ``Pipeline.open`` skips that one (the manifest names the state, runtime/recovery.py
    ``_check_state_files``), and a manifest lists the databases the cache held (runtime/remote_state.py
    ``_databases``): one deleted from the cache while the pipeline ran was missing from the next manifest. A checkpoint
    now refuses that (remote_state.py invariant 6), so such a manifest comes from a store written before it: made here
    by switching invariant 6's check off. The open from the store then meets worker-1.db missing beside a worker-0.db
    with state: open_state refuses naming it and ``dbsp repair`` (without its check: RecoveryError "the state
    databases share no version", after making it)."""
    monkeypatch.setattr(RemoteCheckpoints, "_check_named", lambda self, step, databases: None)
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    cache = str(tmp_path / "cache")
    p = dbsp.Pipeline(circuit(by_reference=False), 2, storage=uri, cache_dir=cache, checkpoint_interval=None)
    for s in range(4):
        for pr in ("a", "b"):
            p.push("t", batch(pr, s), producer=pr, seq=s)
        p.step()
        if s == 1:
            p.checkpoint()
            os.unlink(os.path.join(cache, "state", "worker-1.db"))
    p.close()
    with pytest.raises(CorruptionError, match=r"worker-1\.db is missing.*dbsp repair"):
        dbsp.Pipeline.open(uri, circuit(by_reference=False), cache_dir=str(tmp_path / "again"),
                           checkpoint_interval=None)
