"""FileSource against real files: producer names unique per source and stable across a kill -9, bad files (corrupt Parquet, empty CSV, unconvertible values) named and raised, skipped or quarantined without losing the files after them, rewritten files warned about (in place at their turn, by a rename at the next poll), and a poll's stats and readdirs not growing with the files read; the pipeline's output is compared as a multiset with a plain-Python model of the files.

Seeds vary per run and are printed in every assertion message; ``DBSP_FILES_SEED`` replays one.
``DBSP_FILES_KILLS`` sets the kill -9s of the restart test (default 3).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import FileSource
from dbsp_core.connectors import files as files_module
from dbsp_core.errors import DbspError, InputFileError
from dbsp_core.metrics import prometheus_text
from dbsp_core.storage.formats import FILE_REF_MAGIC
from dbsp_core.storage.steplog import StepLog

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(HERE, "file_source_child.py")
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int32())])
SEED = int(os.environ.get("DBSP_FILES_SEED") or random.randrange(2**32))
KILLS = int(os.environ.get("DBSP_FILES_KILLS", "3"))
WHY = f"seed {SEED} (replay: DBSP_FILES_SEED={SEED})"

sys.path.insert(0, HERE)
from file_source_child import circuit  # noqa: E402


def _rows(rng: random.Random, n: int | None = None) -> list[tuple[int, int]]:
    """Rows with repeats (so a multiset differs from a set)."""
    n = rng.randrange(3, 25) if n is None else n
    return [(rng.randrange(6), rng.randrange(-5, 5)) for _ in range(n)]


def _write(path: str, rows: list[tuple[int, int]], rng: random.Random, row_groups=(2, 5, 100)) -> None:
    """``rows`` in ``path`` by its extension; Parquet in row groups of a size drawn from ``row_groups``."""
    kind = os.path.splitext(path)[1]
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path))  # published by an atomic rename
    if kind == ".parquet":
        pq.write_table(pa.table({"k": [r[0] for r in rows], "v": [r[1] for r in rows]}), tmp,
                       row_group_size=rng.choice(list(row_groups)))
    elif kind == ".csv":
        with open(tmp, "w") as f:
            f.write("k,v\n" + "".join(f"{k},{v}\n" for k, v in rows))
    else:
        with open(tmp, "w") as f:
            f.writelines(json.dumps({"k": k, "v": v}) + "\n" for k, v in rows)
    os.replace(tmp, path)


def _integral(p: dbsp.Pipeline, view: str = "rows") -> collections.Counter:
    acc: collections.Counter = collections.Counter()
    for _, z in p.read_output(view):
        for row, w in z.to_dict().items():
            acc[row] += w
    return +acc


def _input_records(storage: str) -> collections.Counter:
    """The input log's push records by payload magic (the division and discard records left out)."""
    with StepLog(os.path.join(storage, "input"), readonly=True) as log:
        return collections.Counter(bytes(r.payload[:4]) for r in log.iter_from(0) if not r.handle.startswith("\0"))


def _pipeline(path: str, **kw) -> dbsp.Pipeline:
    return dbsp.Pipeline(circuit(), storage=path, checkpoint_interval=None, **kw)


# ---- producer names ----

def test_two_default_sources_keep_files_of_the_same_name(tmp_path) -> None:
    """Two sources with the default name on two directories holding files of the same names: every file's rows
    arrive (before the fix the second source's a.csv and b.parquet were dropped as duplicates)."""
    rng = random.Random(SEED)
    model: collections.Counter = collections.Counter()
    dirs = [tmp_path / "d1", tmp_path / "d2"]
    for d in dirs:
        d.mkdir()
        for name in ("a.csv", "b.parquet", "c.jsonl"):
            rows = _rows(rng)
            _write(str(d / name), rows, rng)
            model.update(rows)
    p = _pipeline(str(tmp_path / "pipe"))
    srcs = [FileSource(p, "t", dirs[0]), FileSource(p, "u", dirs[1])]
    for s in srcs:
        s.poll()
    p.step()
    assert _integral(p) == model, WHY
    assert [s.stats["duplicates"] for s in srcs] == [0, 0] and srcs[0].name != srcs[1].name, WHY
    p.close()


def test_a_duplicate_name_is_refused(tmp_path) -> None:
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    p = _pipeline(str(tmp_path / "pipe"))
    FileSource(p, "t", tmp_path / "d1", name="in")
    with pytest.raises(ValueError, match="'in' is already the name of a source"):
        FileSource(p, "u", tmp_path / "d2", name="in")
    FileSource(p, "t", tmp_path / "d1", name="in")  # the same source again (same handle and directory) is fine
    p.close()


def test_a_directory_of_the_old_default_name_resumes_without_reading_a_file_twice(tmp_path) -> None:
    """A storage directory written by a FileSource under the former default name ``files`` keeps its files: a
    source with the default name reopened on it pushes none of them again, and new files still arrive."""
    rng = random.Random(SEED)
    d = tmp_path / "in"
    d.mkdir()
    model: collections.Counter = collections.Counter()
    for i in range(4):
        rows = _rows(rng)
        _write(str(d / f"f{i}.parquet"), rows, rng)
        model.update(rows)
    p = _pipeline(str(tmp_path / "pipe"))
    FileSource(p, "t", d, name="files").poll(max_files=3)  # what the former default wrote: producers "files:<file>"
    p.step()
    p.close()
    q = dbsp.Pipeline.open(str(tmp_path / "pipe"), circuit())
    src = FileSource(q, "t", d)
    rows = _rows(rng)
    _write(str(d / "g.csv"), rows, rng)
    model.update(rows)
    assert src.poll() == 1 + pq.ParquetFile(str(d / "f3.parquet")).num_row_groups, WHY
    q.step()
    assert src.stats["duplicates"] == 0 and src.stats["skipped"] > 0, WHY
    assert _integral(q) == model, WHY
    q.close()


def _launch(storage: str, inbox: str, expected: int, immutable: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, CHILD, storage, inbox, str(expected)] + ["immutable"] * immutable,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("immutable", [False, True], ids=["rows-logged", "immutable-files"])
def test_default_name_survives_kill_9(tmp_path, capsys, immutable) -> None:
    """kill -9 of a process running a default-named FileSource after it has pushed some files, restarted with
    the same arguments: the restarted source finds its files recorded under the same producer names (it skips
    them without reading), and the output is each file's rows exactly once. ``DBSP_FILES_KILLS`` kills. With
    immutable files the pushes are logged by reference and no checkpoint is taken before the close, so every
    restart replays the steps from the files themselves (asserted)."""
    rng = random.Random(SEED)
    inbox, storage = tmp_path / "in", str(tmp_path / "pipe")
    inbox.mkdir()
    model: collections.Counter = collections.Counter()
    n = 4 * KILLS + 4
    for i in range(n):
        rows = _rows(rng)
        _write(str(inbox / f"f{i:03d}{rng.choice(['.parquet', '.csv', '.jsonl'])}"), rows, rng)
        model.update(rows)
    kills = replayed = 0
    for _ in range(KILLS):
        proc = _launch(storage, str(inbox), n, immutable)
        wait_for = rng.randrange(1, 4)
        lines = []
        while len(lines) < wait_for:
            line = proc.stdout.readline()
            assert line.startswith(("START", "PUSHED")), f"{WHY}: {line!r} {proc.communicate()}"
            lines.append(line) if line.startswith("PUSHED") else None
            replayed += int(line.split("replayed=")[1]) if line.startswith("START") else 0
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        kills += proc.returncode == -signal.SIGKILL
    assert kills == KILLS, WHY
    proc = _launch(storage, str(inbox), n, immutable)
    out, err = proc.communicate(timeout=120)
    replayed += int(out.split("replayed=")[1].split()[0])
    assert proc.returncode == 0 and "DONE" in out, f"{WHY}: {out}{err}"
    done = dict(kv.split("=") for kv in out.split("DONE")[1].split())
    assert int(done["skipped"]) > 0 and int(done["duplicates"]) == 0, f"{WHY}: {out}"
    if immutable:  # every restart after a kill replayed the steps before it, reading their rows from the files
        assert replayed >= KILLS, f"{WHY}: {replayed} steps replayed"
        logged = _input_records(storage)
        assert logged and set(logged) == {FILE_REF_MAGIC}, f"{WHY}: {logged}"
    q = dbsp.Pipeline.open(storage, circuit())
    assert _integral(q) == model, f"{WHY}: {kills} kills"
    q.close()
    with capsys.disabled():
        print(f"\nFileSource restart{' (immutable files)' * immutable}: {kills} kill -9s, {replayed} steps replayed, {n} files, {done['skipped']} row groups skipped unread "
              f"after the last restart, 0 duplicates; output equals the files' rows once ({WHY})")


# ---- bad files ----

def _bad_inbox(d, rng: random.Random) -> tuple[collections.Counter, list[str]]:
    """Good files with bad ones between them (in name order); returns the good files' rows and the bad names."""
    d.mkdir()
    good: collections.Counter = collections.Counter()
    for name in ("a.csv", "c.parquet", "e.jsonl", "g.parquet", "i.csv"):
        rows = _rows(rng)
        _write(str(d / name), rows, rng)
        good.update(rows)
    (d / "b.parquet").write_bytes(b"PAR1 this is no parquet file PAR1")  # corrupt
    _write(str(d / "d.parquet"), _rows(rng, 30), rng)
    full = (d / "d.parquet").read_bytes()
    (d / "d.parquet").write_bytes(full[: len(full) // 2])  # truncated
    (d / "f.csv").write_bytes(b"")  # 0 bytes
    (d / "h.csv").write_text("k,v\n1,2\nthree,4\n")  # unconvertible value
    (d / "h2.jsonl").write_text('{"k": 1, "v": 2}\n{"k": "x", "v": 3}\n')
    # a Parquet file whose second row group holds a value the input's int32 column cannot take: none of it
    pq.write_table(pa.table({"k": [1, 2, 3, 4], "v": pa.array([1, 2, 3, 2**40], pa.int64())}),
                   str(d / "h3.parquet"), row_group_size=2)
    return good, ["b.parquet", "d.parquet", "f.csv", "h.csv", "h2.jsonl", "h3.parquet"]


def test_a_bad_file_raises_an_error_naming_it(tmp_path) -> None:
    rng = random.Random(SEED)
    _bad_inbox(tmp_path / "in", rng)
    p = _pipeline(str(tmp_path / "pipe"))
    src = FileSource(p, "t", tmp_path / "in")
    for _ in range(2):  # the files before it are pushed; it stops every poll until it is dealt with
        with pytest.raises(InputFileError) as e:
            src.poll()
        assert isinstance(e.value, DbspError) and e.value.path == str(tmp_path / "in" / "b.parquet"), WHY
        assert "b.parquet" in str(e.value) and "on_error" in str(e.value), WHY
    assert src.stats["files"] == 1 and src.stats["bad_files"] == 2, WHY
    p.close()


@pytest.mark.parametrize("on_error", ["skip", "quarantine"])
def test_bad_files_are_skipped_or_quarantined_and_the_rest_arrive(tmp_path, on_error, caplog) -> None:
    rng = random.Random(SEED)
    d = tmp_path / "in"
    good, bad = _bad_inbox(d, rng)
    p = _pipeline(str(tmp_path / "pipe"))
    src = FileSource(p, "t", d, on_error=on_error)
    with caplog.at_level(logging.WARNING, logger="dbsp_core.connectors.files"):
        src.poll()
        src.poll()  # nothing new, and no second warning
    p.step()
    assert _integral(p) == good, WHY
    for name in bad:
        assert sum(name in r.getMessage() for r in caplog.records) == 1, f"{WHY}: {name} {caplog.text}"
    assert sorted(rel for rel, _ in src.errors) == bad, WHY
    assert src.stats["bad_files"] == len(bad), WHY
    qdir = d / "_quarantine"
    if on_error == "quarantine":
        assert src.stats["quarantined"] == len(bad)
        assert sorted(os.listdir(qdir)) == sorted(bad + [b + ".error" for b in bad]), WHY
        assert "h.csv" in (qdir / "h.csv.error").read_text()
        assert not any((d / b).exists() for b in bad)
    else:
        assert src.stats["quarantined"] == 0 and not qdir.exists() and all((d / b).exists() for b in bad)
    m = p.metrics()["sources"][src.name]
    assert m["bad_files"] == len(bad) and m["files"] == 5, WHY
    text = prometheus_text(p)
    assert f'dbsp_source_bad_files_total{{source="{src.name}"}} {float(len(bad))}' in text, text
    # a new good file after them still arrives; a skipped file replaced by a good one is read
    rows = _rows(rng)
    _write(str(d / "z.csv"), rows, rng)
    good.update(rows)
    fixed = 0
    if on_error == "skip":
        rows = _rows(rng)
        _write(str(d / "h.csv"), rows, rng)
        good.update(rows)
        fixed = 1
    assert src.poll() == 1 + fixed, WHY
    p.step()
    assert _integral(p) == good, WHY
    p.close()


def test_a_rewritten_file_warns_and_is_counted(tmp_path, caplog) -> None:
    rng = random.Random(SEED)
    d = tmp_path / "in"
    d.mkdir()
    rows = _rows(rng)
    _write(str(d / "a.csv"), rows, rng)
    p = _pipeline(str(tmp_path / "pipe"))
    src = FileSource(p, "t", d)
    src.poll()
    _write(str(d / "a.csv"), _rows(rng) + [(99, 99)], rng)  # new content under a name already read
    with caplog.at_level(logging.WARNING, logger="dbsp_core.connectors.files"):
        assert src.poll() == 0
        assert src.poll() == 0
    p.step()
    assert [r.getMessage() for r in caplog.records if "a.csv" in r.getMessage()] and \
        sum("rewritten" in r.getMessage() for r in caplog.records) == 1, caplog.text
    assert src.stats["rewritten"] == 1
    assert p.metrics()["sources"][src.name]["rewritten"] == 1
    assert _integral(p) == collections.Counter(rows), WHY  # the content that was read, once
    p.close()


# ---- a poll's cost: O(new files), rewrites still reported (files.py invariants 3 and 10) ----

def _inbox_of(d, rng: random.Random, n: int, sub: str = "") -> collections.Counter:
    """``n`` CSV files f000.csv... in ``d`` (under ``sub``); returns their rows."""
    model: collections.Counter = collections.Counter()
    (d / sub).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rows = _rows(rng, 3)
        _write(str(d / sub / f"f{i:03d}.csv"), rows, rng)
        model.update(rows)
    return model


def _rewrite_warnings(caplog) -> int:
    return sum("rewritten" in r.getMessage() for r in caplog.records)


def test_a_file_rewritten_in_place_is_reported_at_its_turn(tmp_path, caplog) -> None:
    """Many files read (4 polls' turns of them), one rewritten in place (same inode, no change to the directory):
    reported once, within ceil(files / REWRITE_CHECKS) polls, and its new rows are not read."""
    rng = random.Random(f"{SEED}/in-place")
    d = tmp_path / "in"
    n = 4 * files_module.REWRITE_CHECKS
    model = _inbox_of(d, rng, n)
    p = dbsp.Pipeline(circuit())
    src = FileSource(p, "t", d, read_ahead=0)
    assert src.poll() == n, WHY
    victim = str(d / f"f{rng.randrange(n):03d}.csv")
    ino = os.stat(victim).st_ino
    with open(victim, "a") as f:  # in place: the same inode, a new size
        f.write("99,99\n")
    assert os.stat(victim).st_ino == ino
    with caplog.at_level(logging.WARNING, logger="dbsp_core.connectors.files"):
        for _ in range(-(-n // files_module.REWRITE_CHECKS)):
            assert src.poll() == 0, WHY
    assert _rewrite_warnings(caplog) == 1 and src.stats["rewritten"] == 1, (WHY, victim, caplog.text)
    assert _integral_of(p.step()) == model, WHY
    p.close()


def _integral_of(out: dict) -> collections.Counter:
    return +collections.Counter({row: w for row, w in out["rows"].to_dict().items()})


def test_a_kept_listing_sees_renames_and_new_files_without_turns(tmp_path, monkeypatch, caplog) -> None:
    """Listings kept between polls (the directories older than the margin): no readdir while nothing changes; a
    file read then replaced by a rename, in a subdirectory, is reported at the next poll by the listing alone
    (turns off), and a new file there is read, though the top directory did not change."""
    monkeypatch.setattr(files_module, "REWRITE_CHECKS", 0)
    monkeypatch.setattr(files_module, "LISTING_MARGIN_NS", 50_000_000)
    rng = random.Random(f"{SEED}/renamed")
    d = tmp_path / "in"
    model = _inbox_of(d, rng, 5) + _inbox_of(d, rng, 20, "sub")
    p = dbsp.Pipeline(circuit())
    src = FileSource(p, "t", d, recursive=True, read_ahead=0)
    assert src.poll() == 25, WHY
    time.sleep(0.1)  # the directories are now older than the margin: the next listing is kept
    assert src.poll() == 0, WHY
    listed = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(path) or scandir(path))
    assert src.poll() == 0 and listed == [], (WHY, listed)
    victim = str(d / "sub" / f"f{rng.randrange(20):03d}.csv")
    _write(victim, _rows(rng, 3) + [(99, 99)], rng)  # replaced by a rename
    rows = _rows(rng, 3)
    _write(str(d / "sub" / "g.csv"), rows, rng)  # a new file: only sub/ changes
    model.update(rows)
    with caplog.at_level(logging.WARNING, logger="dbsp_core.connectors.files"):
        assert src.poll() == 1, WHY
    assert listed == [os.path.join(str(d), "sub")], (WHY, listed)
    assert _rewrite_warnings(caplog) == 1 and src.stats["rewritten"] == 1, (WHY, victim, caplog.text)
    assert _integral_of(p.step()) == model, WHY
    p.close()


def test_a_poll_stats_no_more_files_as_more_are_read(tmp_path, monkeypatch) -> None:
    """pending()'s stats: one for the directory and REWRITE_CHECKS files read in turn, whether 2 or 8 turns of
    files have been read (before: one per file read, every poll)."""
    rng = random.Random(f"{SEED}/stats")
    k = files_module.REWRITE_CHECKS
    counts = []
    for n in (2 * k, 8 * k):
        d = tmp_path / f"in{n}"
        _inbox_of(d, rng, n)
        p = dbsp.Pipeline(circuit())
        src = FileSource(p, "t", d, read_ahead=0)
        assert src.poll() == n, WHY
        stats = []
        stat = os.stat
        monkeypatch.setattr(os, "stat", lambda path, *a, **kw: stats.append(path) or stat(path, *a, **kw))
        assert src.pending() == [], WHY
        monkeypatch.setattr(os, "stat", stat)
        counts.append(len(stats))
        p.close()
    assert counts == [1 + k, 1 + k], (WHY, counts)


def test_a_directory_changed_within_the_margin_is_listed_at_every_poll(tmp_path, monkeypatch) -> None:
    """A listing taken less than LISTING_MARGIN_NS after the directory's last change is not kept (a change in the
    same tick of a coarse clock would leave the directory's identity as it was): every poll lists it again."""
    monkeypatch.setattr(files_module, "LISTING_MARGIN_NS", 3600 * 10**9)
    d = tmp_path / "in"
    _inbox_of(d, random.Random(f"{SEED}/margin"), 3)
    p = dbsp.Pipeline(circuit())
    src = FileSource(p, "t", d, read_ahead=0)
    listed = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(path) or scandir(path))
    for _ in range(3):
        src.poll()
    assert listed == [str(d)] * 3, (WHY, listed)
    p.close()
