"""FileSource's read-ahead (dbsp_core/connectors/files.py invariant 9): the same pushes, in the same order, with the
same ``(producer, seq)``, made on the caller's thread, whether files are read ahead or not; a bad file's error raised
at its turn, by each ``on_error``; nothing pushed twice or lost when a source closes (or its process's pipeline is
closed without a checkpoint) while files are read ahead; the thread joined by ``close()``. The rows are compared as
multisets with a plain-Python model of the files.

Seeds vary per run and are printed in every assertion message; ``DBSP_FILES_SEED`` replays one.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import threading
import time

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import FileSource
from dbsp_core.connectors import files as files_mod
from dbsp_core.errors import InputFileError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from file_source_child import circuit  # noqa: E402
from test_file_source import SEED, WHY, _integral, _rows, _write  # noqa: E402


def _inbox(d, rng: random.Random, n: int) -> tuple[list[str], collections.Counter]:
    """``n`` files of every format (Parquet in several row groups), in name order; their rows as a multiset."""
    d.mkdir(exist_ok=True)
    model: collections.Counter = collections.Counter()
    names = []
    for i in range(n):
        name = f"f{i:03d}" + rng.choice([".parquet", ".csv", ".jsonl"])
        rows = _rows(rng)
        _write(str(d / name), rows, rng)
        model.update(rows)
        names.append(name)
    return names, model


def _record(p: dbsp.Pipeline, log: list) -> None:
    """Record every push of ``p`` (producer, seq, rows, thread) in ``log``."""
    push, ref = p.push, p._push_reference

    def rec_push(handle, table, producer=None, seq=None, **kw):
        log.append((producer, seq, table.num_rows, threading.get_ident()))
        return push(handle, table, producer=producer, seq=seq, **kw) if producer is not None else push(handle, table)

    def rec_ref(handle, z, r, producer, seq):
        log.append((producer, seq, len(z), threading.get_ident()))
        return ref(handle, z, r, producer, seq)

    p.push, p._push_reference = rec_push, rec_ref


_OLDER: set = set()  # read-ahead threads of sources made before the running test (other tests' unclosed sources)


@pytest.fixture(autouse=True)
def _older_threads():
    _OLDER.clear()
    _OLDER.update(threading.enumerate())
    yield


def _threads() -> list[threading.Thread]:
    """The read-ahead threads alive that this test's sources started."""
    return [t for t in threading.enumerate() if t.name.startswith("dbsp-files-") and t not in _OLDER]


def _run(tmp_path, d, read_ahead: int, polls: list[int | None], immutable: bool) -> tuple[list, collections.Counter]:
    p = dbsp.Pipeline(circuit(), storage=str(tmp_path / f"pipe{read_ahead}"), checkpoint_interval=None)
    log: list = []
    _record(p, log)
    with FileSource(p, "t", d, name="src", read_ahead=read_ahead, immutable_files=immutable) as src:
        for n in polls:
            src.poll(max_files=n)
            p.step()
        src.poll()
        p.step()
        got = _integral(p)
    p.close()
    return log, got


@pytest.mark.parametrize("immutable", [False, True])
def test_read_ahead_makes_the_same_pushes_in_the_same_order(tmp_path, immutable) -> None:
    rng = random.Random(SEED)
    d = tmp_path / "in"
    _, model = _inbox(d, rng, 14)
    polls = [rng.choice([1, 1, 2, 3, None]) for _ in range(8)]
    before, got0 = _run(tmp_path, d, 0, polls, immutable)
    after, got3 = _run(tmp_path, d, 3, polls, immutable)
    assert got0 == model and got3 == model, f"{WHY} polls {polls}"
    assert [r[:3] for r in after] == [r[:3] for r in before], f"{WHY} polls {polls}"
    assert {r[3] for r in after} == {threading.get_ident()}, f"{WHY}: every push on the caller's thread"
    assert not _threads(), WHY


def test_files_are_read_ahead_while_the_pipeline_steps(tmp_path, monkeypatch) -> None:
    """The next files' reads happen on the source's thread, begun before their poll (not at their turn)."""
    rng = random.Random(SEED)
    d = tmp_path / "in"
    names, model = _inbox(d, rng, 6)
    where: dict = {}
    read = FileSource._read

    def spy(self, path, kind, seqs, f=None):
        where.setdefault(os.path.basename(path), threading.current_thread().name)
        return read(self, path, kind, seqs, f)

    monkeypatch.setattr(FileSource, "_read", spy)
    p = dbsp.Pipeline(circuit(), storage=str(tmp_path / "pipe"), checkpoint_interval=None)
    src = FileSource(p, "t", d, read_ahead=2)
    for _ in names:
        src.poll(max_files=1)
        p.step()
    assert _integral(p) == model, WHY
    assert where[names[0]] == threading.current_thread().name, where  # the first: nothing was ahead of it
    assert all(where[n].startswith("dbsp-files-") for n in names[1:]), where
    src.close()
    p.close()


def _bad(d, rng: random.Random) -> tuple[collections.Counter, collections.Counter]:
    """a.csv and b.parquet good, c.csv bad (a value its type cannot hold), d.jsonl and e.csv good: the rows of the
    files before the bad one and after it."""
    d.mkdir()
    before: collections.Counter = collections.Counter()
    after: collections.Counter = collections.Counter()
    for name, acc in (("a.csv", before), ("b.parquet", before), ("d.jsonl", after), ("e.csv", after)):
        rows = _rows(rng)
        _write(str(d / name), rows, rng)
        acc.update(rows)
    (d / "c.csv").write_text("k,v\n1,2\n3,three\n")
    return before, after


@pytest.mark.parametrize("on_error", ["raise", "skip", "quarantine"])
def test_a_bad_file_read_ahead_fails_at_its_turn(tmp_path, on_error) -> None:
    rng = random.Random(SEED)
    d = tmp_path / "in"
    before, after = _bad(d, rng)
    p = dbsp.Pipeline(circuit(), storage=str(tmp_path / "pipe"), checkpoint_interval=None)
    src = FileSource(p, "t", d, on_error=on_error, read_ahead=3)
    assert src.poll(max_files=1) == 1  # a.csv; c.csv's read has begun (and failed) on the thread meanwhile
    time.sleep(0.05)
    assert src.poll(max_files=1) >= 1 and src.stats["bad_files"] == 0, WHY  # b.parquet: c.csv not yet its turn
    if on_error == "raise":
        for _ in range(2):  # at its turn, on this thread, every poll; the files after it wait
            with pytest.raises(InputFileError) as e:
                src.poll()
            assert e.value.path == str(d / "c.csv") and "on_error" in str(e.value), WHY
        p.step()
        assert _integral(p) == before and src.stats["files"] == 2 and src.stats["bad_files"] == 2, WHY
    else:
        src.poll()
        p.step()
        assert _integral(p) == before + after, WHY
        assert [rel for rel, _ in src.errors] == ["c.csv"] and src.stats["bad_files"] == 1, WHY
        assert (d / "_quarantine" / "c.csv").exists() == (on_error == "quarantine"), WHY
        assert (d / "c.csv").exists() == (on_error == "skip"), WHY
    src.close()
    assert not _threads(), WHY
    p.close()


@pytest.mark.parametrize("immutable", [False, True])
def test_closing_with_files_read_ahead_pushes_nothing_twice_and_loses_nothing(tmp_path, immutable) -> None:
    rng = random.Random(SEED)
    d = tmp_path / "in"
    names, model = _inbox(d, rng, 10)
    storage = str(tmp_path / "pipe")
    p = dbsp.Pipeline(circuit(), storage=storage, checkpoint_interval=None)
    stop = rng.randrange(1, len(names) - 2)
    src = FileSource(p, "t", d, read_ahead=3, immutable_files=immutable)
    for _ in range(stop):
        src.poll(max_files=1)
        p.step()
    assert len(src._ahead) == 3, WHY  # files read ahead, not pushed
    ahead, pushed = {a.rel for a in src._ahead}, src.stats["pushes"]
    if rng.random() < 0.5:
        src.close()
        assert not _threads(), WHY
    p.close(checkpoint=False)  # with immutable files, recovery replays every step from the files
    p = dbsp.Pipeline.open(storage, circuit(), checkpoint_interval=None)
    src = FileSource(p, "t", d, read_ahead=3, immutable_files=immutable)
    while src.pending():
        src.poll(max_files=rng.choice([1, 2]))
        p.step()
    assert _integral(p) == model, f"{WHY}: stopped after {stop} files with {sorted(ahead)} read ahead"
    # the units pushed before are skipped unread (acknowledged), none found a duplicate
    assert src.stats["duplicates"] == 0 and src.stats["skipped"] == pushed, WHY
    src.close()
    p.close()
    assert not _threads(), WHY


def test_read_ahead_is_bounded_by_bytes_and_the_memory_limit(tmp_path) -> None:
    rng = random.Random(SEED)
    d = tmp_path / "in"
    names, model = _inbox(d, rng, 5)
    p = dbsp.Pipeline(circuit(), storage=str(tmp_path / "pipe"), checkpoint_interval=None, memory_limit="64MiB")
    assert FileSource(p, "t", d, name="a").read_ahead_bytes == int((64 << 20) * files_mod.READ_AHEAD_SHARE)
    src = FileSource(p, "t", d, name="b", read_ahead=3, read_ahead_bytes=1)  # no file fits: none read ahead
    src.poll(max_files=1)
    assert not src._ahead and not _threads(), WHY
    src.poll()
    p.step()
    assert _integral(p) == model, WHY
    with pytest.raises(ValueError, match="read_ahead"):
        FileSource(p, "t", d, name="c", read_ahead=-1)
    p.close()


def _refs_logged(storage: str) -> dict[str, int]:
    """``{file name: CRC-32C}`` of the reference records in a pipeline's input log (one per unit; the last wins)."""
    from dbsp_core.codec import decode_json
    from dbsp_core.storage.formats import FILE_REF_MAGIC
    from dbsp_core.storage.steplog import StepLog

    out = {}
    with StepLog(os.path.join(storage, "input"), readonly=True) as log:
        for r in log.iter_from(0):
            if bytes(r.payload[:4]) == FILE_REF_MAGIC:
                ref = decode_json(FILE_REF_MAGIC, r.payload, "test")
                out[f"{os.path.basename(ref['path'])}#{ref['unit']}"] = ref["crc32c"]
    return out


def test_references_are_taken_ahead_and_are_those_taken_at_the_turn(tmp_path, monkeypatch) -> None:
    """With immutable files, a file read ahead has its references (the checksum of its units' bytes) taken on a
    thread of the source too (beside the read), not at its turn on the caller's; the input log then holds the same references as with
    ``read_ahead=0``, and a reopen without a checkpoint replays the same rows from the files. (Before the change
    every reference was taken at the file's turn, on the caller's thread: the first assertion failed.)"""
    rng = random.Random(SEED)
    d = tmp_path / "in"
    names, model = _inbox(d, rng, 6)
    where: dict = {}
    real = files_mod.reference

    def spy(path, kind, unit):
        where.setdefault(os.path.basename(path), threading.current_thread().name)
        return real(path, kind, unit)

    monkeypatch.setattr(files_mod, "reference", spy)
    logged = {}
    for ahead in (2, 0):
        store = str(tmp_path / f"pipe{ahead}")
        p = dbsp.Pipeline(circuit(), storage=store, checkpoint_interval=None)
        with FileSource(p, "t", d, name="src", read_ahead=ahead, immutable_files=True) as src:
            for _ in names:
                src.poll(max_files=1)
                p.step()
        assert _integral(p) == model, WHY
        p.close(checkpoint=False)
        logged[ahead] = _refs_logged(store)
        q = dbsp.Pipeline.open(store, circuit(), checkpoint_interval=None)
        assert _integral(q) == model and q.stats["replayed_steps"] == len(names), WHY
        q.close()
        if ahead:
            assert all(where[n].startswith("dbsp-files-") for n in names[1:]), f"{WHY}: {where}"
            where.clear()
    assert logged[2] == logged[0] and len(logged[0]) >= len(names), f"{WHY}: {logged}"


def test_a_file_replaced_after_its_reference_was_taken_ahead_is_never_logged_by_the_old_checksum(
        tmp_path, monkeypatch) -> None:
    """A file that breaks its promise: replaced (other rows, a new inode) on the source's references thread right
    after its reference was taken there, while or before its rows are read ahead. The source must not log the new
    rows under the old
    checksum: the identity differs at the file's turn, so it reads the file again there (or, if the replacement
    came after the turn's identity was taken, refuses the push as changed while read, and the next poll pushes it),
    the pipeline holds the new rows, and a reopen without a checkpoint replays them from the file without a
    RecoveryError. (Watched fail with the poll's and the push's identity checks removed: RecoveryError at the
    reopen, the file's size differed from the reference's.)"""
    rng = random.Random(SEED + 1)
    d = tmp_path / "in"
    d.mkdir()
    files = {f"f{i}" + rng.choice([".parquet", ".csv", ".jsonl"]): _rows(rng) for i in range(5)}
    for name, rows in files.items():
        _write(str(d / name), rows, rng)
    names = sorted(files)
    victim = names[2]
    new_rows = _rows(rng, 30)
    real = files_mod.reference
    replaced: list = []

    def reference_then_replace(path, kind, unit):
        got = real(path, kind, unit)
        if (os.path.basename(path) == victim and not replaced
                and threading.current_thread().name.startswith("dbsp-files-")):
            time.sleep(0.01)  # a new modification time even on a coarse clock
            _write(str(d / victim), new_rows, rng)  # a new inode and size
            replaced.append(victim)
        return got

    monkeypatch.setattr(files_mod, "reference", reference_then_replace)
    store = str(tmp_path / "pipe")
    p = dbsp.Pipeline(circuit(), storage=store, checkpoint_interval=None)
    refused = []
    with FileSource(p, "t", d, name="src", read_ahead=2, immutable_files=True) as src:
        while src.pending():
            try:
                src.poll(max_files=1)
            except InputFileError as e:  # replaced while its rows were read ahead: refused at its turn, retried
                assert victim in str(e) and "changed" in str(e), f"{WHY}: {e}"
                refused.append(victim)
            p.step()
    assert replaced, f"{WHY}: the file was not replaced while read ahead"
    assert len(refused) <= 1 and _refs_logged(store).keys() >= {f"{victim}#0"}, f"{WHY}: {refused}"
    model = collections.Counter(r for name in names for r in (new_rows if name == victim else files[name]))
    assert _integral(p) == +model, f"{WHY}: the pipeline does not hold the replaced file's new rows"
    steps = p.steps
    p.close(checkpoint=False)
    q = dbsp.Pipeline.open(store, circuit(), checkpoint_interval=None)  # RecoveryError if logged by the old CRC
    assert _integral(q) == +model and q.stats["replayed_steps"] == steps, WHY
    q.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_two_sources_reading_ahead_beside_threads_that_push_step_and_checkpoint(tmp_path, monkeypatch, workers) -> None:
    """Two sources, each polled on its own thread while files keep appearing, each with its read-ahead thread, beside
    a thread pushing as another producer, one stepping and one checkpointing and reading metrics, on a durable
    pipeline: every file's rows and every push land exactly once (multisets), reads did happen ahead on the sources'
    threads and checkpoints between steps, and a reopen from the storage with the sources made again pushes nothing
    twice."""
    rng = random.Random(f"{SEED}/threads/{workers}")
    storage = str(tmp_path / "pipe")
    dirs = {"t": tmp_path / "in_t", "u": tmp_path / "in_u"}
    model: collections.Counter = collections.Counter()
    late: dict[str, list] = {}
    for h, d in dirs.items():
        _, rows = _inbox(d, rng, 3)
        model.update(rows)
        late[h] = []
        for i in range(3, 12):  # published while the sources poll
            name = f"f{i:03d}" + rng.choice([".parquet", ".csv", ".jsonl"])
            rows = _rows(rng)
            model.update(rows)
            late[h].append((name, rows, random.Random(rng.random())))
    immutable = rng.random() < 0.5
    ahead: list[str] = []
    read = FileSource._read

    def spy(self, path, kind, seqs, f=None):
        ahead.append(threading.current_thread().name)
        return read(self, path, kind, seqs, f)

    monkeypatch.setattr(FileSource, "_read", spy)
    p = dbsp.Pipeline(circuit(), workers=workers, storage=storage, checkpoint_interval=None)
    sources = {h: FileSource(p, h, d, name=f"src-{h}", read_ahead=2, immutable_files=immutable)
               for h, d in dirs.items()}
    published = {h: threading.Event() for h in dirs}
    done = threading.Event()
    errors: list = []
    counts = collections.Counter()
    pushes = []
    for i in range(30):
        rows = _rows(rng, rng.randrange(1, 6))
        model.update(rows)
        pushes.append(pa.table({"k": [r[0] for r in rows], "v": [r[1] for r in rows]},
                               schema=pa.schema([("k", pa.int64()), ("v", pa.int32())])))

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                done.set()
        return run

    def publish(h):
        for name, rows, r in late[h]:
            _write(str(dirs[h] / name), rows, r)
            time.sleep(r.uniform(0, 0.01))
        published[h].set()

    def overlapped() -> bool:
        """Two checkpoints and three steps ran while this thread worked (or a minute went by: asserted below)."""
        return (counts["checkpoints"] >= 2 and counts["steps"] >= 3) or time.monotonic() > give_up

    give_up = time.monotonic() + 60

    def poll(h):
        r = random.Random(f"{SEED}/poll/{h}")
        while not published[h].is_set() or sources[h].pending() or not overlapped():
            counts["polls"] += 1
            sources[h].poll(max_files=r.choice([1, 2, None]))
            time.sleep(0.002)

    def push():
        for i, t in enumerate(pushes):
            p.push("u", t, producer="other", seq=i)
            time.sleep(0.001)
        while not overlapped():
            time.sleep(0.002)

    def step():
        while not done.is_set():
            p.step()
            counts["steps"] += 1

    def checkpoint():
        while not done.is_set():
            p.checkpoint()
            counts["checkpoints"] += 1
            m = p.metrics()
            assert set(m["sources"]) >= {"src-t", "src-u"}, sorted(m["sources"])
            time.sleep(0.005)

    workers_ = [threading.Thread(target=guard(lambda h=h: publish(h))) for h in dirs]
    workers_ += [threading.Thread(target=guard(lambda h=h: poll(h))) for h in dirs]
    workers_ += [threading.Thread(target=guard(push))]
    background = [threading.Thread(target=guard(step)), threading.Thread(target=guard(checkpoint))]
    for t in workers_ + background:
        t.start()
    for t in workers_:
        t.join(120)
    done.set()
    for t in background:
        t.join(120)
    assert not errors, f"{WHY}: {errors!r}"
    for src in sources.values():
        src.poll()
    p.step()
    got = _integral(p)
    assert got == +model, f"{WHY} (W={workers}, immutable={immutable}): missing {model - got}, extra {got - model}"
    assert counts["steps"] >= 3 and counts["checkpoints"] >= 2, (WHY, counts)
    assert any(t.startswith("dbsp-files-") for t in ahead), (WHY, collections.Counter(ahead))
    for src in sources.values():
        src.close()
    assert not _threads(), WHY
    p.close()
    p = dbsp.Pipeline.open(storage, circuit(), checkpoint_interval=None)
    try:
        again = {h: FileSource(p, h, d, name=f"src-{h}", immutable_files=immutable) for h, d in dirs.items()}
        for src in again.values():
            src.poll()
        p.step()
        assert _integral(p) == +model, f"{WHY} (W={workers}, immutable={immutable}): after the reopen"
        assert sum(s.stats["pushes"] for s in again.values()) == 0, (WHY, [s.stats for s in again.values()])
        assert sum(s.stats["skipped"] for s in again.values()) > 0, (WHY, [s.stats for s in again.values()])
        for src in again.values():
            src.close()
    finally:
        p.close()
