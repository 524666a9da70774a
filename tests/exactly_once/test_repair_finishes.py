"""``dbsp repair`` finishes or says exactly why not (issue 29, defect 3): a missing input segment, damaged output history below the checkpoint (``--drop-output``), damaged state databases, LAYOUT and META; every CorruptionError names ``dbsp repair``."""

from __future__ import annotations

import os
import random
import shutil
import sys

import pytest

import dbsp_core as dbsp
from dbsp_core.__main__ import main as cli
from dbsp_core.errors import CorruptionError, DbspError
from dbsp_core.storage.repair import repair
from dbsp_core.storage.salvage import salvage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_workload import minus  # noqa: E402
from test_damage import batch, build, circuit, flip, model, views  # noqa: E402

SEED = int(os.environ.get("DBSP_REPAIR_SEED", random.randrange(10**6)))
print(f"\n[repair] DBSP_REPAIR_SEED={SEED}")


def _segments(d: str, part: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(d, part)) if n.endswith(".seg"))


def _pushes_in(d: str, part: str, segment: str) -> set[tuple[str, int]]:
    return {(r.producer, r.seq) for r in salvage(os.path.join(d, part)).records
            if r.segment == segment and r.producer and not r.handle.startswith("\x00")}


def test_a_missing_middle_input_segment_names_every_lost_push_and_opens(tmp_path, capsys):
    """Before the fix repair reported a 0-byte damaged range in another segment and "0 pushes are lost", and
    the directory did not open; now every push the missing segment held is named and the directory opens with
    the views of every other acknowledged push. Where the segment boundaries fall varies between runs: a draw
    whose missing segment also held a push of a step the checkpoint covers goes to :func:`_named_push_taken`."""
    d = str(tmp_path / "d")
    where = build(d, steps=14, checkpoint_at=3, segment_bytes=4096)
    segs = _segments(d, "input")
    assert len(segs) >= 4, segs
    rng = random.Random(SEED)
    gone = segs[rng.randrange(1, len(segs) - 1)]  # a middle one: neither the oldest nor the newest
    held = _pushes_in(d, "input", gone)
    assert held, f"segment {gone} holds no push (seed {SEED})"
    if any(where[x] < 3 for x in held):
        _named_push_taken(d, where, gone, held, capsys)
        return
    _lost_after_the_checkpoint(d, where, gone, held, capsys)


def _lost_after_the_checkpoint(d: str, where: dict[tuple[str, int], int], gone: str, held: set[tuple[str, int]],
                               capsys) -> None:
    """``gone`` held pushes of steps after the checkpoint only: repair names each as lost, withdraws the output
    from the checkpoint on, and the directory opens; each lost push can be pushed again, once."""
    os.unlink(os.path.join(d, "input", gone))
    with pytest.raises(CorruptionError, match="dbsp repair"):
        dbsp.Pipeline.open(d, circuit())
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert f"missing      input/{gone}" in out, out
    lost = {(ln.split("'")[1], int(ln.split("seq ")[1].split()[0])) for ln in out.splitlines()
            if ln.startswith("lost         producer")}
    assert lost == held, (f"seed {SEED}: lost {sorted(lost)} != held by {gone} {sorted(held)}", out)
    p = dbsp.Pipeline.open(d, circuit())
    p.step()  # the valid pushes of the withdrawn steps, logged again
    assert views(p) == model(sorted(set(where) - lost)), f"seed {SEED}"
    for pr, q in sorted(lost):  # a lost push can be pushed again, once
        assert not p.push("t", batch(pr, q), producer=pr, seq=q).duplicate
    p.step()
    assert views(p) == model(sorted(where)), f"seed {SEED}"
    p.close()
    assert repair(d)["result"].startswith("nothing to repair")


def _named_push_taken(d: str, where: dict[tuple[str, int], int], gone: str, held: set[tuple[str, int]],
                      capsys, cp: int = 3) -> None:
    """``gone`` held a push of a step the checkpoint covers: the push is in the state (not lost), but the output
    of its step named it (``raw`` is logged by reference), so that output is gone and cannot be computed again.
    Repair changes nothing and names the way out: ``--drop-output`` when an intact output record would be left
    to start the log at (then the directory opens with every push counted once), else a backup. Before the
    fix repair exited 0 saying only later output was withdrawn, and the directory did not open
    (DBSP_REPAIR_SEED=589308532 DBSP_DAMAGE_SEED=2115617419)."""
    named = sorted({where[x] for x in held if where[x] < cp})  # cp: the checkpoint's step
    early = named[-1]
    os.unlink(os.path.join(d, "input", gone))
    before = _files(d)
    assert cli(["repair", d]) == 1
    err = capsys.readouterr().err
    assert f"output steps {named} are missing" in err and "Nothing was changed" in err, (SEED, err)
    assert _files(d) == before
    if any(where[x] >= cp for x in held):  # every output record from the checkpoint on is withdrawn: none is left
        assert f"restore the directory {d} from a backup" in err and "--drop-output" not in err, err
        with pytest.raises(CorruptionError, match="dbsp repair"):
            dbsp.Pipeline.open(d, circuit())
        return
    assert f"dbsp repair {d} --drop-output 0..{early}" in err, err
    assert cli(["repair", d, "--drop-output", f"0..{early}"]) == 0
    out = capsys.readouterr().out
    assert "lost         producer" not in out, out  # its effect is in the state
    p = dbsp.Pipeline.open(d, circuit())
    start, acc = _from(p)
    assert start == early + 1
    assert acc["raw"] == model([x for x in where if where[x] >= start])["raw"], f"seed {SEED}"
    for pr, q in sorted(held):  # still seen: a retry is a duplicate
        assert p.push("t", batch(pr, q), producer=pr, seq=q).duplicate
    # the state counts every push once: the next change of "sums" retracts the totals of all of them
    old = dict(model(sorted(where))["sums"])
    p.push("t", batch("c", 0), producer="c", seq=0)
    z = p.step()["sums"]
    new = model(sorted(where) + [("c", 0)])["sums"]
    assert z.to_dict() == {**{r: -1 for r in old if r not in new}, **{r: 1 for r in new if r not in old}}, SEED
    p.close()


def _layout_with(tmp_path, cp: int, want) -> tuple[str, dict[tuple[str, int], int], str, set[tuple[str, int]]]:
    """The first of the damage seeds 0.. whose build has a middle input segment ``want(held)`` accepts (segment
    boundaries follow the drawn row counts); returns (directory, where, segment, the pushes it holds)."""
    import test_damage

    for seed in range(200):
        test_damage.SEED = seed  # batch() draws its rows from it
        d = str(tmp_path / f"d{seed}")
        where = build(d, steps=14, checkpoint_at=cp, segment_bytes=4096)
        for gone in _segments(d, "input")[1:-1]:
            held = _pushes_in(d, "input", gone)
            if held and want({where[x] for x in held}):
                return d, where, gone, held
        shutil.rmtree(d)
    raise AssertionError("no damage seed below 200 lays out the input log as the test needs")


@pytest.mark.parametrize("also_after", [False, True], ids=["only-under-the-checkpoint", "and-after-it"])
def test_a_missing_segment_that_held_a_push_an_output_step_names(tmp_path, capsys, monkeypatch, also_after):
    import test_damage

    monkeypatch.setattr(test_damage, "SEED", test_damage.SEED)  # restored after the search below changes it
    cp = 7  # a middle segment can hold steps below it only (segments of 4 KiB hold 2-3 steps)
    if also_after:
        found = _layout_with(tmp_path, cp, lambda steps: min(steps) < cp <= max(steps))
    else:
        found = _layout_with(tmp_path, cp, lambda steps: max(steps) < cp)
    _named_push_taken(*found, capsys, cp)


def _from(p: dbsp.Pipeline) -> tuple[int, dict[str, dict]]:
    """The first output step the log holds and the sum of every view's changes from it."""
    start = p.output_steps.start
    acc: dict[str, dict] = {}
    for name in ("sums", "raw"):
        a = acc.setdefault(name, {})
        for _, z in p.read_output(name, start):
            for row, w in z.to_dict().items():
                a[row] = a.get(row, 0) + w
                if not a[row]:
                    del a[row]
    return start, acc


def _refused_unchanged(d: str, capsys, open_error: str, *says: str) -> None:
    """Open fails with a CorruptionError matching ``open_error``; repair exits 1 saying each of ``says`` and
    changes no file."""
    with pytest.raises(CorruptionError, match=open_error):
        dbsp.Pipeline.open(d, circuit())
    before = _files(d)
    assert cli(["repair", d]) == 1
    out = capsys.readouterr().out
    assert all(x in out for x in says), out
    assert _files(d) == before


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for r, _, fs in os.walk(d):
        for f in fs:
            if f != "LOCK":
                with open(os.path.join(r, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(r, f), d)] = fh.read()
    return out


@pytest.mark.parametrize("damage", ["flip the first record", "delete a middle segment"])
def test_damaged_output_history_below_the_checkpoint_is_dropped_on_consent(tmp_path, capsys, damage):
    """Before the fix the directory never opened again and repair changed nothing. Now repair refuses, naming
    the exact ``--drop-output`` that helps and changing nothing; with it, the output of exactly those steps is
    gone, the state and the input are kept (every push still counts once), and the directory opens."""
    d = str(tmp_path / "d")
    # steps 0..6 are below the checkpoint; "raw" holds its rows (references, outputlog.py invariant 7, would make
    # the output records so small that no middle segment ends below step 6)
    c = circuit(by_reference=False)
    where = build(d, steps=10, checkpoint_at=7, segment_bytes=4096, c=c)
    if damage == "flip the first record":
        flip(d, "output", lambda r: r.step == 0)
        last_dropped = 0
    else:
        by_seg: dict[str, list[int]] = {}
        for r in salvage(os.path.join(d, "output")).records:
            by_seg.setdefault(r.segment, []).append(r.step)
        segs = sorted(by_seg)
        middle = [n for n in segs[1:-1] if max(by_seg[n]) < 6]
        assert middle, by_seg
        gone = middle[random.Random(SEED).randrange(len(middle))]
        os.unlink(os.path.join(d, "output", gone))
        last_dropped = max(by_seg[gone])
    with pytest.raises(CorruptionError, match=rf"--drop-output 0\.\.{last_dropped}\b"):
        dbsp.Pipeline.open(d, c)
    before = _files(d)
    assert cli(["repair", d]) == 1
    err = capsys.readouterr().err
    assert f"dbsp repair {d} --drop-output 0..{last_dropped}" in err and "Nothing was changed" in err, err
    assert _files(d) == before
    assert cli(["repair", d, "--drop-output", f"0..{last_dropped + 1}"]) == 1  # only the exact steps
    assert _files(d) == before
    capsys.readouterr()
    assert cli(["repair", d, "--drop-output", f"0..{last_dropped}"]) == 0
    out = capsys.readouterr().out
    assert f"dropped      the output of steps 0..{last_dropped}" in out, out
    p = dbsp.Pipeline.open(d, c)
    start, got = _from(p)
    assert start == last_dropped + 1, (start, out)
    before_start = [k for k, s in where.items() if s < start]
    assert got == minus(model(sorted(where)), model(sorted(before_start))), f"seed {SEED}"
    assert p.push("t", batch("a", 0), producer="a", seq=0).duplicate  # the state keeps every push
    p.close()
    assert repair(d)["result"].startswith("nothing to repair")


def _flip_page(path: str, page: int) -> None:
    with open(path, "r+b") as f:
        f.seek(page * 4096 + 100)
        b = f.read(1)
        f.seek(page * 4096 + 100)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_damaged_newest_state_version_goes_back_to_the_intact_one(tmp_path, capsys):
    """Every worker database holds versions v and v+1 (a checkpoint committed them all and the process died
    before the next one began: made here by committing v+1 with one extra entry outside the operator state);
    a page only v+1 reaches is damaged in worker 0. Before the fix repair said "nothing to repair" while open
    failed; now every database goes back to v (intact everywhere) and the directory opens with every view."""
    from dbsp_core.storage.database import Database

    d = str(tmp_path / "d")
    where = build(d, steps=8, checkpoint_at=3)
    dbs = sorted(os.path.join(d, "state", n) for n in os.listdir(os.path.join(d, "state")) if n.endswith(".db"))
    for path in dbs:
        with Database(path) as db:
            v = db.versions().stop - 1
            with db.open(v) as h:
                h.put("repair-test", b"k", b"v")
                h.commit()
            assert db.versions() == range(v, v + 2)
    with open(dbs[0], "rb") as f:  # the catalog root of v+1 (meta slot (v+1) % 2, bytes 24..31): new in v+1
        f.seek(((v + 1) % 2) * 4096 + 24)
        root_page = int.from_bytes(f.read(8), "little")
    _flip_page(dbs[0], root_page)
    with pytest.raises(CorruptionError, match="dbsp repair"):
        dbsp.Pipeline.open(d, circuit())
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert f"every state database is back at version {v}" in out, out
    p = dbsp.Pipeline.open(d, circuit())
    assert views(p) == model(sorted(where)), f"seed {SEED}"
    p.close()


def test_a_damaged_page_of_the_only_state_version_says_what_to_do(tmp_path, capsys):
    """No intact version to go back to: repair changes nothing and says which file is damaged and what to do
    (exit status 1), where it said "nothing to repair" before the fix."""
    d = str(tmp_path / "d")
    build(d, steps=8, checkpoint_at=3)
    _flip_page(os.path.join(d, "state", "worker-1.db"), 2)
    _refused_unchanged(d, capsys, "dbsp repair", "NOT REPAIRED state/worker-1.db: version",
                       "restore the directory from a backup")


def test_a_deleted_layout_is_rebuilt_from_the_state_databases(tmp_path, capsys):
    d = str(tmp_path / "d")
    where = build(d, steps=8, checkpoint_at=3)
    p = dbsp.Pipeline.open(d, circuit(), workers=3)  # a layout of epoch > 0 and 3 workers
    want = (p.layout.workers, p.layout.shards, p.layout.epoch, [p.layout.owner(s) for s in range(p.layout.shards)])
    p.checkpoint()
    p.close()
    os.unlink(os.path.join(d, "LAYOUT"))
    with pytest.raises(CorruptionError, match="dbsp repair"):
        dbsp.Pipeline.open(d, circuit())
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert "LAYOUT was damaged" in out and "rebuilt from the layout the state databases record" in out, out
    p = dbsp.Pipeline.open(d, circuit())
    assert (p.layout.workers, p.layout.shards, p.layout.epoch,
            [p.layout.owner(s) for s in range(p.layout.shards)]) == want
    assert views(p) == model(sorted(where)), f"seed {SEED}"
    p.close()


def test_a_damaged_meta_says_what_is_damaged_and_what_to_do(tmp_path, capsys):
    d = str(tmp_path / "d")
    build(d, steps=4, checkpoint_at=2)
    with open(os.path.join(d, "META"), "r+b") as f:
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 0x10]))
    _refused_unchanged(d, capsys, r"META.*dbsp repair", "NOT REPAIRED META: ", "restore META from a backup")


def test_a_deleted_driver_db_is_rebuilt_from_the_output_log(tmp_path, capsys):
    """driver.db (the pushes already counted, the clock) deleted: open created an empty one and failed ever
    after; now open refuses without creating it, and repair rebuilds it from the output log's input ranges."""
    d = str(tmp_path / "d")
    where = build(d, steps=8, checkpoint_at=5)
    os.unlink(os.path.join(d, "driver.db"))
    with pytest.raises(CorruptionError, match=r"driver\.db is missing.*dbsp repair"):
        dbsp.Pipeline.open(d, circuit())
    assert not os.path.exists(os.path.join(d, "driver.db"))
    assert cli(["repair", d]) == 0
    out = capsys.readouterr().out
    assert "driver.db was missing; rebuilt at the state's step 5" in out, out
    p = dbsp.Pipeline.open(d, circuit())
    assert views(p) == model(sorted(where)), f"seed {SEED}"
    for pr, q in sorted(where):  # every push stays counted once
        assert p.push("t", batch(pr, q), producer=pr, seq=q).duplicate, (pr, q)
    p.close()


def test_every_corruption_error_names_dbsp_repair(tmp_path):
    """A CorruptionError from the C stores (checksum), from a record file and from the driver all name it."""
    for exc in (CorruptionError(5, "pagestore x: page 2: checksum mismatch"), CorruptionError("META: bad")):
        assert "dbsp repair" in str(exc), str(exc)
    d = str(tmp_path / "d")
    build(d, steps=3, checkpoint_at=2)
    os.unlink(os.path.join(d, "LAYOUT"))
    with pytest.raises(DbspError) as e:
        dbsp.Pipeline.open(d, circuit())
    assert isinstance(e.value, CorruptionError) and "dbsp repair" in str(e.value), str(e.value)
    shutil.rmtree(d)
