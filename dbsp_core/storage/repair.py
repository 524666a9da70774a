"""Ways forward from a damaged storage directory: ``dbsp repair DIR`` (it keeps a copy of what it replaces, reports exactly which pushes and which output steps are lost, and leaves a directory that opens, or says which file is damaged and what the user can do), and the rebuild of a damaged output log at ``Pipeline.open`` (its damaged steps are computed again from the input).

Invariants (enforced here):
  1. Nothing is destroyed: a log part (``input/`` or ``output/``) is replaced only by renaming the old one into
     the repair's backup directory ``repair-<n>/`` (every byte of it, damaged segments included), after the
     new one is complete and durable. A ``REPAIR`` record at the root says which parts are being swapped;
     :func:`finish_repair` (run by ``dbsp repair`` and by ``Pipeline.open`` before anything else) completes an
     interrupted swap, so a crash leaves the old directory or the repaired one, never a log part missing.
  2. The input log keeps every valid record of the steps before ``s``, the first step at or after the
     checkpoint that damage may have touched (``resume_step``: the step recovery resumes at); the valid pushes
     and discard records of steps ``s`` and later are logged again, undivided, at step ``s``, so the next
     ``step()`` divides them anew (their old division is gone with the lost pushes). Output of steps ``s``
     and later is withdrawn (it could not be computed again without the lost pushes). Of the steps the state
     holds past driver.db's step, recovery only reads the clock and the pushes (to keep them seen): a lost
     division of one is made up, and a lost push an output step names gets a discard record (it stays seen).
  3. A push is reported lost by name when a record of the pipeline names it but no valid record holds it:
     the list of the pushes the input log held that a clean close writes to driver.db, the output log's input
     ranges of a step, or a gap in a producer's seqs after what the checkpoint's dedup set had seen; the
     number of lost pushes of a step whose division survived is exact. A lost push is not marked seen, so its
     producer can push it again. After a crash nothing names the pushes of the newest write, and a cut of it
     passes for a torn tail (csrc/steplog.c invariant 10 marks the end only at a clean close).
  4. A damaged output log is rebuilt (at open) only when every step it lacks is one recovery computes again
     (at or after the resume step): the new log holds the intact records below the first missing step, and
     the intact records after it are kept to verify the steps computed again. Otherwise CorruptionError names
     the damaged file, the steps that cannot be recomputed and the ``--drop-output FIRST..LAST`` of invariant
     5, and nothing changes. A segment missing between two others is damage (salvage invariant 4), and so is
     an input log that starts after driver.db's step (its oldest segment is gone: truncation never removes a
     record of a step at or after it), or whose divisions end before the output log's steps do (a cut at a
     record boundary: the lost records are repaired as damage at the end of the segment that held them).
  5. Output history is dropped only with consent naming exactly the steps that go (``drop_output``, CLI
     ``--drop-output FIRST..LAST``): the output of every step below the last damaged step under the checkpoint
     goes with it (the log is contiguous), and the new log starts after it, as if retention had dropped them.
     State and input are kept, so every push still counts once; only their output can no longer be read.
  5b. An intact output record whose references (outputlog.py invariant 7) name a push the repaired input log
     no longer holds at that step is as good as damaged: its view's rows were only in the lost record. It is
     treated as a missing output step by invariants 4 and 5 (below the checkpoint: dropped only with consent).
  6. The other files: META cannot be rebuilt (it names the circuit); a state database's damaged newest version
     is given up (``Database.open`` of the one before, closed without commit) only when every state database
     holds that one intact and the input log and driver.db still go back to its step; LAYOUT is rebuilt from
     the layout every state database records with its state, when they agree; driver.db from the output log's
     input ranges of every step below the state's (its seen set) and the input log (its clock floor); the
     staged JOB record is removed or made again from the versions and the output log's end.
  6b. Batch files (trace/spill.py invariant 13): every file the checkpoint recovery opens names must be present and
     pass every checksum. One that is missing or damaged is listed unrepaired (a copy of the same name from a
     backup is the same bytes) and nothing changes: the state it holds is in no other file (a clean close keeps
     one version of each state database, so no older checkpoint can stand in for it), and opening the pipeline
     would fail on it (when it opens or when a step reads the damaged pages), never read it as data.
  6c. State databases (storage/statefiles.py): every one LAYOUT names must be present once a record says the state
     got past step 0. A missing one is repaired only when another file holds what it held: driver.db is at step 0
     (so no checkpoint truncated the input log) and the input log holds every record from step 0, undamaged; then
     every state file present (databases, the files beside them, the batch files they name, JOB) moves to the
     backup directory and the next open computes the state again from step 0, each step's output checked against
     the output log. Otherwise each missing one is listed unrepaired (restore that file from a backup: the state it
     held is in no other file, since a clean close keeps one version of each database and the other workers'
     databases hold other shards) and nothing changes. No database is ever created in place of a missing one. A
     database LAYOUT does not name, beside a complete set that holds LAYOUT's state, moves to the backup directory
     (recovery never reads it; statefiles invariant 3).
  7. Repair finishes or says exactly why not: damage it leaves is listed in the report's ``unrepaired`` (file,
     problem, what the user can do) and nothing is changed for it; the CLI then exits with status 1. A
     directory repair reports as repaired opens (the file fuzz test checks it for every kind of file).
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from typing import Any

from dbsp_core import _storage
from dbsp_core.codec import decode_json, encode_json
from dbsp_core.errors import CorruptionError, FormatVersionError, RecoveryError, StorageError
from dbsp_core.storage.database import Database
from dbsp_core.storage.directory import (fsync_dir, lock_dir, read_layout, read_meta, read_record, read_rescale,
                                        remove_record, unlock_dir, write_layout, write_record)
from dbsp_core.storage.formats import (ACKED_KEY, ACKED_MAGIC, ACKED_TABLE, CLOCK_KEY, CLOCK_MAGIC, CLOCK_TABLE,
                                       DEDUP_MAGIC, DEDUP_TABLE, DIRECTORY_FORMATS, DISCARD_HANDLE, DISCARD_MAGIC,
                                       DIVISION_HANDLE, DIVISION_MAGIC, DRIVER_DB, INPUT_DIR, JOB_FILE, JOB_MAGIC,
                                       LAYOUT_FILE, META_FILE, NEW_SUFFIX, OUTPUT_DIR, REPAIR_BACKUP_PREFIX,
                                       REPAIR_FILE, REPAIR_MAGIC, RESCALE_FILE, SPILL_DIR, STAGE_DIR_PREFIX, STATE_DIR,
                                       job_path, segment_name, state_db_paths, worker_files, worker_of_db)
from dbsp_core.storage.salvage import Record, Salvaged, salvage
from dbsp_core.storage.statefiles import StateFiles, state_groups, state_step, survey

__all__ = ["finish_repair", "rebuild_output", "repair", "resume_step"]


# ---- the swap (invariant 1) ----

def finish_repair(root: str) -> bool:
    """Complete a repair a crash interrupted (invariant 1); returns whether there was one."""
    path = os.path.join(root, REPAIR_FILE)
    rec = read_record(path, REPAIR_MAGIC)
    if rec is None:
        return False
    backup = os.path.join(root, rec["backup"])
    for part in rec["parts"]:
        new = os.path.join(root, part + NEW_SUFFIX)
        if not os.path.isdir(new):
            continue  # swapped already
        cur = os.path.join(root, part)
        if os.path.exists(cur):
            os.rename(cur, os.path.join(backup, part))
            fsync_dir(root)
        os.rename(new, cur)
        fsync_dir(root)
    remove_record(path)
    return True


def _backup_dir(root: str) -> str:
    n = 1
    while os.path.exists(os.path.join(root, f"{REPAIR_BACKUP_PREFIX}{n}")):
        n += 1
    path = os.path.join(root, f"{REPAIR_BACKUP_PREFIX}{n}")
    os.mkdir(path)
    fsync_dir(root)
    return path


def _swap(root: str, backup: str, parts: list[str]) -> None:
    for part in parts:
        fsync_dir(os.path.join(root, part + NEW_SUFFIX))
    write_record(os.path.join(root, REPAIR_FILE), REPAIR_MAGIC, {"backup": os.path.basename(backup), "parts": parts})
    finish_repair(root)


def _write_log(path: str, records: list[tuple[int, str, str, int, bytes]], log_file: bool) -> None:
    """A new step log at ``path`` holding ``records`` (step, handle, producer, seq, payload), durable."""
    if os.path.exists(path):
        shutil.rmtree(path)
    log = _storage.Log(path, "posix", 64 << 20, False, log_file)
    try:
        ticket = 0
        for step, handle, producer, seq, payload in records:
            ticket = log.enqueue(step, handle.encode("utf-8", "surrogateescape"),
                                 producer.encode("utf-8", "surrogateescape"), seq, payload)
        if ticket:
            log.sync(ticket)
    finally:
        log.close()


# ---- where recovery resumes ----

def _state_paths(root: str) -> list[str]:
    """The state databases recovery reads: those LAYOUT names that are present (statefiles invariant 3: no other is
    ever read), or every one present when LAYOUT cannot be read (it is rebuilt from their records)."""
    try:
        layout = read_layout(root)[0]
    except (CorruptionError, FormatVersionError):
        return state_db_paths(root)
    files = survey(root, state_groups(root, _meta(root)), layout.workers)
    return [p for p in files.named if p not in files.missing]


def resume_step(root: str, out_last: int) -> int:
    """The step recovery resumes at (the state's checkpoint), read without changing anything: the step of the
    newest version every state database holds (not above the base version of a staged job whose output ends
    past ``out_last``), or driver.db's step when there is no state database."""
    paths = _state_paths(root)
    if not paths:
        dpath = os.path.join(root, DRIVER_DB)
        if not os.path.exists(dpath):
            return 0
        with Database(dpath, readonly=True) as db, db.read(db.versions().stop - 1) as h:
            return h.get_step()
    ranges = []
    for p in paths:
        with Database(p, readonly=True) as db:
            ranges.append(db.versions())
    lo, hi = max(r.start for r in ranges), min(r.stop for r in ranges) - 1
    if lo > hi:
        raise RecoveryError(f"{root}: the state databases share no version: {[(r.start, r.stop - 1) for r in ranges]}")
    job = read_record(job_path(root), JOB_MAGIC)
    v = hi if job is None or job["end"] <= out_last else min(hi, job["version"])
    with Database(paths[0], readonly=True) as db, db.read(v) as h:
        return h.get_step()


# ---- the output log ----

def _output_steps(got: Salvaged, where: str) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for r in got.records:
        if r.step in out:
            raise CorruptionError(f"{where}: two valid records of output step {r.step}")
        out[r.step] = r.payload
    return out


def _unnamed_refs(root: str, held: set[tuple[int, str, str, int]]) -> list[int]:
    """The intact output steps whose references name a push that ``held`` ((step, input, producer, seq) of the
    records the repaired input log keeps at their step) lacks (invariant 5b)."""
    from dbsp_core.storage.outputlog import named_pushes

    odir = os.path.join(root, OUTPUT_DIR)
    if not os.path.isdir(odir):
        return []
    return sorted(s for s, payload in _output_steps(salvage(odir), odir).items()
                  if any((s, h, p, q) not in held for h, p, q in named_pushes(payload, f"{odir} step {s}")))


def _plan_output(root: str, below: int | None, drop: tuple[int, int] | None,
                 held: set[tuple[int, str, str, int]] | None = None) -> dict[str, Any]:
    """What a rebuilt output log keeps (invariants 4, 5 and 5b: with ``held``, the records whose references name
    a push it lacks count as missing): ``{"intact", "first", "keep": (k, cut), "x", "missing", "damaged",
    "dropped", "unnamed"}``. CorruptionError (nothing changed) when output history the replay cannot compute
    again would go and ``drop`` does not consent to exactly that, naming the option that does."""
    odir = os.path.join(root, OUTPUT_DIR)
    got = salvage(odir) if os.path.isdir(odir) else Salvaged([], [], None, [], [])
    intact = _output_steps(got, odir)
    # the log's span before invariant 5b takes out the records naming lost pushes: an unnamed step after the last
    # record kept is missing all the same (below the checkpoint it cannot be computed again)
    logged = sorted(intact)
    unnamed = _unnamed_refs(root, held) if held is not None else []
    for s in unnamed:
        del intact[s]
    steps = sorted(intact)
    first = logged[0] if logged else 0
    end = logged[-1] + 1 if logged else 0
    head = bool(got.damaged) and (not got.records or (got.damaged[0][0], got.damaged[0][1]) <
                                  (got.records[0].segment, got.records[0].offset))
    missing = [s for s in range(first, end) if s not in intact]
    x = resume_step(root, min(missing + ([below] if below is not None else []) + [end]))
    bad = [m for m in missing if m < x]
    k = max(bad) + 1 if bad else first  # the new log starts here: every damaged step below x goes
    cut = min([m for m in missing if m >= k] + ([below] if below is not None else []) + [end])
    where = ", ".join([f"{n} bytes {a}..{b}" for n, a, b in got.damaged] + [f"{n} missing" for n in got.missing])
    where = f"damaged ({where})" if where else "intact, but its references name input records the damage took"
    # what a backup must replace: the output log when it is damaged itself, else the directory (5b: the input took it)
    target = odir if got.damaged or got.missing else f"the directory {root}"
    dropped = why = None
    if bad or head:
        # the steps before the first intact record are unknown when the head is damaged: if the oldest segment
        # is the log's first, they start at step 0, else retention may have dropped some of them
        lo = 0 if head else first
        dropped = (lo, k - 1) if k - 1 >= lo else None
        lost_refs = f" ({sorted(set(bad) & set(unnamed))[:20]} name input records the damage took)" \
            if set(bad) & set(unnamed) else ""
        why = (f"output steps {bad[:20]} are missing{lost_refs} and the state's checkpoint is at step {x}: they "
               f"cannot be computed again (their input is gone)" if bad else
               f"it is damaged before its first intact record, which is of step {first}")
    if cut <= k and x > 0:  # before any --drop-output advice: dropping would leave no record to start the log at
        raise CorruptionError(f"{odir}: {where}; {why + '; ' if why else ''}no intact output record is left at or "
                              f"after step {k} and the state is at step {x}: restore {target} from a backup. Nothing "
                              f"was changed (dbsp repair cannot rebuild it: an output log starts at its oldest "
                              f"record, and none would be left)")
    if dropped is not None and (drop is None or tuple(drop) != dropped):
        given = "" if drop is None else f" (--drop-output {drop[0]}..{drop[1]} was given)"
        raise CorruptionError(
            f"{odir}: {where}; {why}. Nothing was changed{given}. `dbsp repair {root} --drop-output "
            f"{dropped[0]}..{dropped[1]}` drops the output of steps {dropped[0]}..{dropped[1]} (consumers can no "
            f"longer read them) and keeps the state and the input; or restore {target} from a backup")
    return {"intact": intact, "keep": (k, cut), "x": x, "missing": missing, "damaged": got.damaged + [
        (n, 0, 0) for n in got.missing], "dropped": dropped, "first": first, "unnamed": unnamed}


def rebuild_output(root: str, below: int | None = None, backup: str | None = None,
                   drop: tuple[int, int] | None = None) -> dict[str, Any]:
    """Rebuild the output log from its intact records (invariants 4 and 5): the new log ends before the first
    step it lacks (and before ``below``); returns ``{"kept": (first, end), "expect": {step: payload}, "missing":
    [...], "dropped": (first, last) or None, "backup": dir}``, the intact records after the cut in ``expect``.
    CorruptionError (nothing changed) if a step it lacks is below the step recovery resumes at and ``drop``
    does not name exactly the steps that must go for that (see :func:`_plan_output`)."""
    plan = _plan_output(root, below, drop)
    intact, (k, cut) = plan["intact"], plan["keep"]
    odir = os.path.join(root, OUTPUT_DIR)
    backup = backup or _backup_dir(root)
    _write_log(odir + NEW_SUFFIX, [(s, "", "", 0, intact[s]) for s in range(k, cut)], False)
    _swap(root, backup, [OUTPUT_DIR])
    return {"kept": (k, cut), "expect": {s: intact[s] for s in sorted(intact) if s >= cut},
            "missing": plan["missing"], "backup": backup, "damaged": plan["damaged"], "dropped": plan["dropped"]}


# ---- the input log (dbsp repair) ----

def _dedup(root: str) -> dict[str, tuple[int, set[int]]]:
    """The checkpoint's dedup set: producer -> (every seq <= wm seen, seen seqs above wm)."""
    dpath = os.path.join(root, DRIVER_DB)
    out: dict[str, tuple[int, set[int]]] = {}
    if not os.path.exists(dpath):
        return out
    with Database(dpath, readonly=True) as db, db.read(db.versions().stop - 1) as h:
        for k, v in h.scan(DEDUP_TABLE):
            rec = decode_json(DEDUP_MAGIC, v, f"{dpath} dedup {k!r}")
            out[k.decode("utf-8", "surrogateescape")] = (int(rec["wm"]), {int(x) for x in rec["above"]})
    return out


def _acked(root: str) -> list[tuple[str, int]]:
    """The named pushes a clean close recorded in driver.db as held by the input log (empty if none)."""
    dpath = os.path.join(root, DRIVER_DB)
    if not os.path.exists(dpath):
        return []
    try:
        with Database(dpath, readonly=True) as db, db.read(db.versions().stop - 1) as h:
            rec = h.get(ACKED_TABLE, ACKED_KEY)
            if rec is None:
                return []
            got = decode_json(ACKED_MAGIC, rec, f"{dpath} acked")
            return [(p, q) for p, q in got["pushes"]] if got.get("step") == h.get_step() else []
    except (CorruptionError, KeyError, TypeError, ValueError):
        return []


def _named_outputs(root: str, steps: range) -> dict[int, list[dict]]:
    """The input ranges the output log records for ``steps`` (those it holds intact)."""
    odir = os.path.join(root, OUTPUT_DIR)
    if not os.path.isdir(odir):
        return {}
    out = {}
    for r in salvage(odir).records:
        if r.step in steps:
            try:  # the record's JSON part (dbsp_core/storage/outputlog.py byte layout)
                n = int.from_bytes(r.payload[4:8], "little")
                out[r.step] = json.loads(r.payload[8:8 + n].decode("utf-8"))["inputs"]
            except (ValueError, UnicodeDecodeError, KeyError):
                continue
    return out


def repair(root: str, drop_output: tuple[int, int] | None = None) -> dict[str, Any]:
    """Repair a storage directory (invariants 1-7); returns the report.

    ``drop_output=(first, last)`` consents to dropping the output of steps ``first..last`` when that output is
    damaged and cannot be computed again (invariant 5); it must name exactly the steps the refusal names.
    Raises CorruptionError (nothing changed) when the output log needs that consent, RecoveryError if the
    directory is not a directory or a layout change is in progress (open the pipeline first), DbspError if a
    pipeline has it open. Damage it cannot repair is listed in the report's ``unrepaired``,
    each entry naming the file, what is wrong and what the user can do.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise RecoveryError(f"dbsp repair: {root!r} is not a directory")
    fd = lock_dir(root)
    try:
        finish_repair(root)
        try:
            rescale = read_rescale(root)
        except (CorruptionError, FormatVersionError) as exc:
            report = _empty_report(root)
            _unrepaired(report, root, os.path.join(root, RESCALE_FILE), _why(exc),
                        "it describes a layout change in progress, which no other file does: restore the directory "
                        "from a backup (nothing else was looked at or changed)")
            report["result"] = f"NOT REPAIRED: RESCALE: {_why(exc)}"
            return report
        if rescale is not None:
            report = _empty_report(root)
            if _missing_in_change(root, report):  # open refuses before it settles the change: say what to do
                report["result"] = "NOT REPAIRED: " + "; ".join(f"{u['file']}: {u['problem']} -> {u['action']}"
                                                                for u in report["unrepaired"])
                return report
            raise RecoveryError(f"dbsp repair: {root}: a layout change is in progress (RESCALE); Pipeline.open "
                                f"finishes or undoes it before it reads anything else: open the pipeline first, and "
                                f"if open fails on the change itself, restore the directory from a backup")
        report = _empty_report(root)
        _repair_files(root, report)
        logs = _repair_logs(root, report, drop_output)
        done = "; ".join(report["repaired"])
        bad = "; ".join(f"{u['file']}: {u['problem']} -> {u['action']}" for u in report["unrepaired"])
        report["result"] = "; ".join(x for x in (done, logs, f"NOT REPAIRED: {bad}" if bad else "") if x) \
            or "nothing to repair: every file of the directory is intact"
        return report
    finally:
        unlock_dir(fd)


def _empty_report(root: str) -> dict[str, Any]:
    return {"path": root, "input_damaged": [], "input_missing": [], "lost": [], "lost_unnamed": 0,
            "withdrawn_output": None, "output_dropped": None, "output_unnamed": [], "backup": None,
            "requeued_pushes": 0, "repaired": [], "unrepaired": []}


def _why(exc: BaseException) -> str:
    """An error's message without the hint CorruptionError adds (a report names repair already)."""
    return str(exc).replace("; " + CorruptionError.HINT, "")


def _unrepaired(report: dict[str, Any], root: str, path: str, problem: str, action: str) -> None:
    """List damage repair leaves as it is, with what the user can do."""
    report["unrepaired"].append({"file": os.path.relpath(path, root), "problem": problem, "action": action})


def _version_error(db: Database, v: int) -> str | None:
    """Why version ``v`` of ``db`` fails its check (csrc/pagestore.c invariants 1-4: every page it reaches,
    its free list), or None if it passes."""
    try:
        db.check(v)
    except (CorruptionError, StorageError, KeyError) as exc:
        return _why(exc)
    return None


def _repair_files(root: str, report: dict[str, Any]) -> None:
    """META, the state databases, LAYOUT and driver.db (invariants 6 and 7): repaired when another file holds
    what they held, else listed in ``report["unrepaired"]`` with what the user can do."""
    meta_problem = None
    try:
        if read_meta(root, (1, *DIRECTORY_FORMATS)).get("format") == 1:
            return  # the previous directory format: Pipeline.open upgrades it; nothing here reads it
    except FileNotFoundError:
        meta_problem = "missing"
    except (CorruptionError, FormatVersionError) as exc:  # a format version no build of ours wrote: a flipped byte
        meta_problem = _why(exc)                          # (the record's checksum does not cover it) or a newer one
    if meta_problem is not None:
        _unrepaired(report, root, os.path.join(root, META_FILE), meta_problem,
                    "META names the circuit (its fingerprint), the executor kind and the schemas, which no other file "
                    "holds: restore META from a backup of the directory (or open it with the build that wrote it, if "
                    "a newer one did); nothing else was changed for it")
    if not _repair_job(root, report) or not _repair_state(root, report) or not _repair_batch_files(root, report):
        return
    try:
        read_layout(root)
    except (CorruptionError, FormatVersionError) as exc:
        _repair_layout(root, report, _why(exc))
    if _state_paths(root):
        _repair_driver(root, report, resume_step(root, _output_last(root)))


def _repair_job(root: str, report: dict[str, Any]) -> bool:
    """The staged executor's JOB record damaged: it only matters when the job's output is not all logged (then
    recovery opens the job's base version). Removed when the output log holds every step the state does; made
    again from the version before the newest when every stage database holds it at a step the output log
    covers; else listed unrepaired. Returns whether the state can be looked at further."""
    path = job_path(root)
    try:
        read_record(path, JOB_MAGIC)
        return True
    except (CorruptionError, FormatVersionError) as exc:
        problem = _why(exc)
    out_last = _output_last(root)
    paths = _state_paths(root)
    try:
        dbs = [Database(p, readonly=True) for p in paths]
    except (CorruptionError, StorageError, OSError):
        dbs = []
    try:
        if not dbs:
            return _unrepaired(report, root, path, problem, "the stage databases cannot be read either: restore "
                               "the directory from a backup") or False
        lo, hi = max(db.versions().start for db in dbs), min(db.versions().stop for db in dbs) - 1
        steps = {}
        for v in (hi - 1, hi):
            if v >= lo:
                with dbs[0].read(v) as h:
                    steps[v] = h.get_step()
    finally:
        for db in dbs:
            db.close()
    keep = os.path.join(_backup_dir(root), JOB_FILE)
    if hi in steps and steps[hi] <= out_last:
        os.rename(path, keep)
        fsync_dir(os.path.dirname(path))
        report["repaired"].append(f"state/JOB was damaged ({problem}); the output log holds every step of the state "
                                  f"(step {steps[hi]}), so the record is not needed: moved to {keep}")
        return True
    if hi - 1 in steps and steps[hi - 1] <= out_last:
        shutil.copy2(path, keep)
        write_record(path, JOB_MAGIC, {"version": hi - 1, "first": steps[hi - 1], "end": steps[hi]})
        report["repaired"].append(f"state/JOB was damaged ({problem}); made again: the job from version {hi - 1} "
                                  f"(step {steps[hi - 1]}) to step {steps[hi]}, whose output is not all logged, runs "
                                  f"again at open; the damaged record is in {keep}")
        return True
    if not os.listdir(os.path.dirname(keep)):
        os.rmdir(os.path.dirname(keep))
    _unrepaired(report, root, path, problem, f"the state is at step {steps.get(hi)} and the output log ends at step "
                f"{out_last}, with no older version to run the job again from: restore the directory from a backup")
    return False


def _repair_state(root: str, report: dict[str, Any]) -> bool:
    """The state databases LAYOUT names (invariant 6c), then their versions (:func:`_repair_versions`); a
    database LAYOUT does not name is set aside once those hold LAYOUT's state. Returns whether the state is
    usable (True when there is none)."""
    try:
        layout = read_layout(root)[0]
    except (CorruptionError, FormatVersionError):
        layout = None
    if layout is None:  # LAYOUT itself is damaged: rebuilt (or not) from the databases' own records afterwards
        return _repair_versions(root, report, _state_paths(root), None)
    files = survey(root, state_groups(root, _meta(root)), layout.workers)
    if files.missing:
        done = _missing_state(root, report, files, layout)
        if done is not True:
            return done is None  # None: the state is at step 0, and the executor creates the missing ones
        return True  # every database set aside: the state starts again at step 0 (see _missing_state)
    if not _repair_versions(root, report, files.named, layout):
        return False
    if files.unnamed:
        _set_aside_unnamed(root, report, files.unnamed, layout)
    return True


def _meta(root: str) -> dict:
    try:
        return read_meta(root, (1, *DIRECTORY_FORMATS))
    except (FileNotFoundError, CorruptionError, FormatVersionError):  # listed by the META check
        kind = "staged" if os.path.isdir(os.path.join(root, STATE_DIR)) and any(
            n.startswith(STAGE_DIR_PREFIX) for n in os.listdir(os.path.join(root, STATE_DIR))) else "embedded"
        return {"executor": kind}


def _restart_refused(root: str) -> str | None:
    """Why the state cannot start again at step 0 and be computed again from the input log (None: it can): that
    needs driver.db at step 0 (then no checkpoint truncated the input log) and an input log that holds every
    record from step 0, undamaged."""
    dpath = os.path.join(root, DRIVER_DB)
    d = _driver_step(root, {})
    if d is None:
        return f"{os.path.relpath(dpath, root)} is missing or unreadable"
    if d > 0:
        return f"driver.db's checkpoint is at step {d}, and each checkpoint truncates the input log below its step"
    idir = os.path.join(root, INPUT_DIR)
    got = salvage(idir) if os.path.isdir(idir) else Salvaged([], [], None, [], [])
    if got.damaged or got.missing:
        return "the input log is damaged (run `dbsp repair` again once the state is restored)"
    if got.records and got.records[0].step != 0:
        return f"the input log starts at step {got.records[0].step}"
    return None


def _missing_in_change(root: str, report: dict[str, Any]) -> bool:
    """A layout change is in progress (RESCALE) and a database LAYOUT names is missing while the state is past
    step 0 (``Pipeline.open`` refuses before it settles the change): listed unrepaired, nothing changed (the
    state is not started again during a change). Returns whether it listed any."""
    try:
        layout = read_layout(root)[0]
    except (CorruptionError, FormatVersionError):
        return False
    files = survey(root, state_groups(root, _meta(root)), layout.workers)
    return bool(files.missing) and _missing_state(root, report, files, layout, restart=False) is False


def _missing_state(root: str, report: dict[str, Any], files: StateFiles, layout: Any,
                   restart: bool = True) -> bool | None:
    """Databases LAYOUT names are missing (invariant 6c). None: nothing says the state got past step 0 (not
    damage). True: it did, but driver.db is at step 0 and the input log holds every step from 0, so the state is
    computed again: every state file present is set aside and the next open starts the state at step 0. False:
    listed unrepaired, nothing changed."""
    present = [p for p in files.named if p not in files.missing]
    said = state_step(root, present)
    if said is None:
        return None
    step, where = said
    at = f"at step {step}" if step is not None else "unreadable (it may hold state)"
    why = _restart_refused(root) if restart else "a layout change is in progress (RESCALE)"
    if why is None:
        backup = _backup_dir(root)
        moved = _set_aside(root, backup, present + files.unnamed)
        job = job_path(root)
        if os.path.exists(job):
            os.rename(job, os.path.join(backup, JOB_FILE))
            fsync_dir(os.path.dirname(job))
            moved.append(os.path.relpath(job, root))
        report["repaired"].append(
            f"state database{'s' if len(files.missing) > 1 else ''} "
            f"{', '.join(os.path.relpath(p, root) for p in files.missing)} missing while "
            f"{os.path.relpath(where, root)} is {at}; driver.db is at step 0 and the input log holds every step from "
            f"0, so the state is computed again from it: {', '.join(moved) or 'nothing else'} moved to {backup}, and "
            f"the next open starts every state database at step 0 and replays the input log (each step's output "
            f"checked against the output log)")
        return True
    versions = {}
    for p in present:
        try:
            with Database(p, readonly=True) as db:
                versions[p] = db.versions()
        except (CorruptionError, StorageError):
            continue
    lo = max((r.start for r in versions.values()), default=None)
    hi = min((r.stop - 1 for r in versions.values()), default=None)
    need = (f" holding version {hi} (the other databases' version{'' if lo == hi else f's {lo}..{hi}'})"
            if lo is not None and hi is not None and lo <= hi else "")
    for p in files.missing:
        g = os.path.basename(os.path.dirname(p))
        whose = f"worker {worker_of_db(p)}" + (f" of stage {g[len(STAGE_DIR_PREFIX):]}" if g.startswith(
            STAGE_DIR_PREFIX) else "")
        _unrepaired(report, root, p, f"missing: LAYOUT ({layout.workers} workers, epoch {layout.epoch}) names it, and "
                    f"{os.path.relpath(where, root)} is {at}",
                    f"the state of {whose} was in this file only ({why}, so it cannot be computed again): restore "
                    f"{os.path.relpath(p, root)} from a backup of the directory{need}, or restore the whole "
                    f"directory from a backup; nothing was changed")
    return False


def _set_aside(root: str, backup: str, paths: list[str], batch_files: bool = True) -> list[str]:
    """Move the state databases ``paths``, the files a stage task keeps beside each and (with ``batch_files``) the
    batch files they name into ``backup`` (invariant 1: nothing is destroyed); returns what moved (relative to
    ``root``)."""
    from dbsp_core.storage.batchrefs import referenced_files

    moved: list[str] = []
    batch: set[str] = set()
    for p in paths if batch_files else []:
        try:
            with Database(p, readonly=True) as db:
                for v in db.versions():
                    batch |= set(referenced_files(db, v))
        except (CorruptionError, StorageError, KeyError):
            pass
    for f in [q for p in paths for q in worker_files(p)] + [os.path.join(root, SPILL_DIR, n) for n in sorted(batch)]:
        if os.path.exists(f):
            rel = os.path.relpath(f, root)
            os.rename(f, os.path.join(backup, rel.replace(os.sep, "-")))
            fsync_dir(os.path.dirname(f))
            moved.append(rel)
    return moved


def _set_aside_unnamed(root: str, report: dict[str, Any], unnamed: list[str], layout: Any) -> None:
    """Invariant 6c: databases LAYOUT does not name (no layout change is in progress: repair refuses while RESCALE
    exists) are no part of the state; they go to the backup directory, as they are."""
    from dbsp_core.storage.shardmove import read_worker_layout

    held = []
    for p in unnamed:
        try:
            with Database(p, readonly=True) as db, db.read(db.versions().stop - 1) as h:
                rec = read_worker_layout(h, p)
            what = "no state" if rec is None else f"worker {rec['worker']} of layout epoch {rec['epoch']}"
            held.append(f"{os.path.relpath(p, root)} ({what})")
        except (CorruptionError, StorageError, KeyError):
            held.append(f"{os.path.relpath(p, root)} (unreadable)")
    backup = _backup_dir(root)
    _set_aside(root, backup, unnamed, False)  # no batch file it names is moved: a database LAYOUT names may name it too
    report["repaired"].append(
        f"state database{'s' if len(unnamed) > 1 else ''} {', '.join(held)} not named by LAYOUT ({layout.workers} "
        f"workers, epoch {layout.epoch}), whose databases are all present and hold its state: recovery never reads "
        f"{'them' if len(unnamed) > 1 else 'it'} (a leftover of a layout change, or a copy); moved to {backup}")


def _repair_versions(root: str, report: dict[str, Any], paths: list[str], layout: Any) -> bool:
    """Every state database's version recovery opens must be readable in full; if one is not and every database
    holds the version before it intact, and the input log still holds the steps from there, every database goes
    back to it (the damaged version is discarded: ``Database.open(v - 1)`` closed without commit). A database
    holding the state of another layout than LAYOUT's is listed unrepaired. Returns whether the state is usable
    (True when there is none)."""
    if not paths:
        return True
    vers: dict[str, range] = {}
    dbs: dict[str, Database] = {}
    try:
        for p in paths:
            try:
                dbs[p] = Database(p, readonly=True)
                vers[p] = dbs[p].versions()
            except (CorruptionError, StorageError) as exc:
                _unrepaired(report, root, p, f"no version is readable ({_why(exc)})",
                            "this worker's state is gone: restore the directory from a backup")
        if len(vers) < len(paths):
            return False
        v = min(r.stop for r in vers.values()) - 1
        if v < max(r.start for r in vers.values()):
            _unrepaired(report, root, os.path.join(root, STATE_DIR), "the state databases share no version: "
                        + ", ".join(f"{os.path.relpath(p, root)} {r.start}..{r.stop - 1}" for p, r in vers.items()),
                        "a database was lost or replaced: restore the directory from a backup")
            return False
        bad = {p: e for p in paths if (e := _version_error(dbs[p], v)) is not None}
        if not bad:
            return _layout_matches(root, report, layout, dbs, v)
        staged = any(os.path.basename(os.path.dirname(p)).startswith(STAGE_DIR_PREFIX) for p in paths)
        older = v - 1
        ok = not staged and all(older in vers[p] and _version_error(dbs[p], older) is None for p in paths)
        step = None
        if ok:
            with dbs[paths[0]].read(older) as h:
                step = h.get_step()
            first = _first_division(root)
            ok = first is not None and first <= step and _driver_step(root, report) in (None, *range(step + 1))
        if not ok:
            why = ("the version before it is not intact in every database" if not staged and step is None else
                   f"the version before it (step {step}) is intact, but the input log or driver.db no longer goes "
                   f"back to that step" if step is not None else "the staged executor's versions go with its jobs")
            for p, e in bad.items():
                _unrepaired(report, root, p, f"version {v} is damaged ({e})",
                            f"{why}: restore the directory from a backup (the state cannot be computed again)")
            return False
    finally:
        for db in dbs.values():
            db.close()
    backup = _backup_dir(root)  # invariant 1: the databases as they were
    for p in paths:
        shutil.copy2(p, os.path.join(backup, os.path.relpath(p, root).replace(os.sep, "-")))
    for p in paths:
        with Database(p) as db:
            if v in db.versions():
                db.open(older).close()  # discards version v: older is the only one (a close keeps the base)
    report["repaired"].append(
        "state version " + str(v) + " was damaged in " + ", ".join(os.path.relpath(p, root) for p in bad)
        + f" ({'; '.join(bad.values())}); every state database is back at version {older} (step {step}), and "
          f"opening the pipeline computes the later steps again from the input; the databases as they were are "
          f"in {backup}")
    return True


def _repair_batch_files(root: str, report: dict[str, Any]) -> bool:
    """The batch files the checkpoint recovery opens names (invariant 6b) must be present and intact; one that is not
    is listed unrepaired with what to do, and nothing changes. Returns whether the state is usable."""
    from dbsp_core.storage.batchrefs import check_batch_files, referenced_files

    paths = _state_paths(root)
    if not paths:
        return True
    named: dict[str, dict[str, int]] = {}
    dbs = {p: Database(p, readonly=True) for p in paths}
    try:
        v = min(db.versions().stop for db in dbs.values()) - 1
        for db in dbs.values():
            for n, per in referenced_files(db, v).items():
                named.setdefault(n, {}).update(per)
    finally:
        for db in dbs.values():
            db.close()
    found = check_batch_files(root, named)
    for f in found["files"]:
        if f["file"] in found["bad"]:
            _unrepaired(report, root, os.path.join(root, SPILL_DIR, f["file"]), f["check"],
                        f"the checkpoint (state version {v}) reads rows of {', '.join(sorted(f['tables']))} from this "
                        "spilled batch file, which no other file holds: copy the file of the same name from a backup "
                        f"into {os.path.join(root, SPILL_DIR)} (a batch file never changes once written, so any "
                        "backup's copy is the same bytes) or restore the directory from a backup; nothing was changed")
    return not found["bad"]


def _layout_matches(root: str, report: dict[str, Any], layout: Any, dbs: dict[str, Database], v: int) -> bool:
    """Every database's version ``v`` holds the state of LAYOUT's epoch (no layout change is in progress here:
    repair refuses while RESCALE exists); else the mismatch is listed unrepaired."""
    from dbsp_core.storage.shardmove import read_worker_layout

    if layout is None:
        return True  # LAYOUT itself is damaged: rebuilt from these records next
    odd = []
    for p, db in dbs.items():
        with db.read(v) as h:
            rec = read_worker_layout(h, p)
        if rec is not None and rec["epoch"] != layout.epoch:
            odd.append(f"{os.path.relpath(p, root)} (epoch {rec['epoch']})")
    if odd:
        _unrepaired(report, root, os.path.join(root, LAYOUT_FILE), f"LAYOUT is of layout epoch {layout.epoch} but "
                    f"the state of {', '.join(odd)} is not (a layout change whose RESCALE record is gone, or files "
                    f"from another time)", "restore the directory from a backup")
        return False
    return True


def _first_division(root: str) -> int | None:
    steps = [r.step for r in salvage(os.path.join(root, INPUT_DIR)).records if r.handle == DIVISION_HANDLE] \
        if os.path.isdir(os.path.join(root, INPUT_DIR)) else []
    return min(steps) if steps else None


def _driver_step(root: str, report: dict[str, Any]) -> int | None:
    dpath = os.path.join(root, DRIVER_DB)
    try:
        with Database(dpath, readonly=True) as db, db.read(db.versions().stop - 1) as h:
            return h.get_step()
    except (OSError, CorruptionError, KeyError):
        return None


def _repair_layout(root: str, report: dict[str, Any], problem: str) -> None:
    """LAYOUT again from the layout every state database records with its state (shardmove.write_worker_layout)."""
    from dbsp_core.layout import Layout
    from dbsp_core.storage.shardmove import read_worker_layout

    path = os.path.join(root, LAYOUT_FILE)
    found = []
    for p in _state_paths(root):
        try:
            with Database(p, readonly=True) as db, db.read(db.versions().stop - 1) as h:
                rec = read_worker_layout(h, p, whole=True)
        except (OSError, CorruptionError, KeyError):
            continue
        if rec is not None:
            found.append((rec["epoch"], json.dumps(rec["layout"], sort_keys=True)))
    if not found or len(set(found)) != 1 or found[0][0] != max(e for e, _ in found):
        _unrepaired(report, root, path, problem,
                    "the state databases record no layout they agree on (" + (
                        f"epochs {sorted({e for e, _ in found})}" if found else "none holds state") + "): restore "
                    "LAYOUT from a backup of the directory")
        return
    layout = Layout.from_dict(json.loads(found[0][1]), path)
    if os.path.exists(path):
        shutil.copy2(path, os.path.join(_backup_dir(root), LAYOUT_FILE))
    write_layout(root, layout, None)
    report["repaired"].append(f"LAYOUT was damaged ({problem}); rebuilt from the layout the state databases record "
                              f"({layout.workers} workers, {layout.shards} shards, epoch {layout.epoch}); the "
                              f"report of the last layout change is gone")


def _repair_driver(root: str, report: dict[str, Any], x: int) -> None:
    """driver.db missing, or its newest version unreadable: a new one at the state's step ``x``, its seen set
    from the output log's input ranges of every step below ``x`` (so it needs them all, from step 0) and the
    pushes the input log still holds, its clock floor the ``now`` of the first division at or after ``x``."""
    from dbsp_core.storage.dedup import SeenSet

    dpath = os.path.join(root, DRIVER_DB)
    if os.path.exists(dpath):
        try:
            with Database(dpath, readonly=True) as db:
                err = _version_error(db, db.versions().stop - 1)
        except (CorruptionError, StorageError) as exc:
            err = _why(exc)
        if err is None:
            return
        problem = f"its newest version is damaged ({err})"
    else:
        problem = "missing"
    odir, idir = os.path.join(root, OUTPUT_DIR), os.path.join(root, INPUT_DIR)
    named = _named_outputs(root, range(0, x))
    irecs = salvage(idir).records if os.path.isdir(idir) else []
    divs = [decode_json(DIVISION_MAGIC, r.payload, f"{idir} division of step {r.step}") for r in irecs
            if r.handle == DIVISION_HANDLE]
    why = None
    if any(t not in named for t in range(x)):
        why = (f"the output log ({odir}) does not name the pushes of every step below the state's step {x} (steps "
               f"{[t for t in range(x) if t not in named][:10]} are gone), so the set of pushes already counted "
               f"cannot be rebuilt")
    elif any("watermarks" in dv for dv in divs):
        why = "the circuit has event time, and the watermarks in force at the checkpoint are recorded nowhere else"
    if why is not None:
        _unrepaired(report, root, dpath, problem, f"{why}: restore driver.db from a backup of the directory")
        return
    seen = SeenSet()
    for t in range(x):
        for rg in named[t]:
            if rg["producer"] and rg["first_seq"] is not None:
                for q in range(rg["first_seq"], rg["last_seq"] + 1):
                    seen.add(rg["producer"], q)
    for r in irecs:
        if r.step < x and r.producer and r.handle != DIVISION_HANDLE:
            seen.add(r.producer, r.seq)
    after = [int(dv["now_ns"]) for dv in divs if int(dv["step"]) >= x]
    floor = min(after) if after else max([int(dv["now_ns"]) for dv in divs] + [0])
    if os.path.exists(dpath):
        keep = os.path.join(_backup_dir(root), DRIVER_DB)
        os.rename(dpath, keep)
        fsync_dir(root)
    with Database.create(dpath, 0) as db, db.open(0) as h:
        seen.save(h)
        h.put(CLOCK_TABLE, CLOCK_KEY, encode_json(CLOCK_MAGIC, {"now_ns": floor, "prev_now_ns": None}))
        h.set_step(x)
        h.commit()
    report["repaired"].append(f"driver.db was {problem}; rebuilt at the state's step {x} from the output log (the "
                              f"pushes of steps 0..{x - 1}) and the input log" + (
                                  f"; the damaged one is in {os.path.dirname(keep)}" if problem != "missing" else ""))


def _repair_logs(root: str, report: dict[str, Any], drop: tuple[int, int] | None) -> str:
    """The input and output logs (invariants 2-5); returns what was done ("" for nothing)."""
    idir = os.path.join(root, INPUT_DIR)
    try:
        _storage.Log(idir, "posix", 64 << 20, False, True).close()  # opens (cutting a torn tail as open would)
        damaged = False
    except CorruptionError as exc:
        damaged = True
        report["error"] = str(exc)
    try:
        from dbsp_core.storage.outputlog import OutputLog

        OutputLog(os.path.join(root, OUTPUT_DIR), {}, readonly=True).close()
        out_damaged = False
    except CorruptionError:
        out_damaged = True
    front = None if damaged else _front_gap(root)
    tail = None
    if front is not None:
        damaged = True
        report["error"] = front[1]
    if not damaged and not out_damaged:
        tail = _tail_gap(root)
        if tail is not None:  # a cut at a record boundary: the damage is at the end of the segment it names
            damaged = True
            report["error"] = tail[1]
    if not damaged and not out_damaged:
        try:
            x, out_last = resume_step(root, _output_last(root)), _output_last(root)
        except (CorruptionError, RecoveryError, OSError, KeyError):
            return ""  # listed by the checks of the files
        if out_last < x and not report["unrepaired"]:
            _unrepaired(report, root, os.path.join(root, OUTPUT_DIR), f"it ends at step {out_last} but the state is "
                        f"at step {x}: the output of steps {out_last}..{x - 1} is lost and cannot be computed again",
                        "restore the directory from a backup")
        return ""
    if not damaged:  # only the output log: the rebuild Pipeline.open would do, dropping history if consented
        r = rebuild_output(root, drop=drop)
        report["backup"] = r["backup"]
        report["withdrawn_output"] = [r["kept"][1], None]
        report["output_dropped"] = list(r["dropped"]) if r["dropped"] else None
        return ((f"the output of steps {r['dropped'][0]}..{r['dropped'][1]} is dropped (consumers can no longer "
                 f"read it; the state and the input are kept); " if r["dropped"] else "")
                + f"the output log was damaged; it holds steps {r['kept'][0]}..{r['kept'][1] - 1} now, and opening "
                  f"the pipeline computes the rest again from the input; the old log is in {r['backup']}")
    got = salvage(idir)
    # the log refused to open: an invalid tail is damage too (a log closed cleanly was cut), and a cut at a
    # record boundary leaves no invalid byte at all: then the damage is after the last valid record
    damaged_ranges = got.damaged + ([got.torn] if got.torn else [])
    # a missing segment (salvage invariant 4) lost all it held: the records between its neighbours' (it sorts
    # between them by name, so the spans below find the steps it may have held)
    missing = list(got.missing) + ([front[0]] if front is not None else [])
    damaged_ranges = sorted(damaged_ranges + [(n, 0, 0) for n in missing])
    if not damaged_ranges and got.segments:
        last = tail[0] if tail is not None else got.segments[-1]
        end = os.path.getsize(os.path.join(idir, last))
        damaged_ranges = [(last, end, end)]
    report["input_damaged"] = [{"segment": n, "from": a, "to": b} for n, a, b in damaged_ranges
                               if n not in missing]
    report["input_missing"] = missing
    # the steps each damaged range may have held: from the valid record before it to the one after it
    recs = got.records
    where = [(r.segment, r.offset) for r in recs]
    spans = []
    for n, a, b in damaged_ranges:
        i, j = bisect.bisect_left(where, (n, a)), bisect.bisect_left(where, (n, b))
        lo = recs[i - 1].step if i else None
        if i and recs[i - 1].handle == DIVISION_HANDLE:
            lo = recs[i - 1].step + 1  # every push of a step precedes its division: the damage is of later steps
        spans.append((lo, recs[j].step if j < len(recs) else None))
    out_last = _output_last(root)
    x = resume_step(root, out_last)
    lows = [lo if lo is not None else -1 for lo, _ in spans]
    highs = [hi if hi is not None else 2**62 for _, hi in spans]
    if all(h < x for h in highs):
        s = None  # every damaged record was of a step the checkpoint holds: nothing is lost
    else:
        s = max(x, min(lo for lo, h in zip(lows, highs) if h >= x))
    report["resume_step"] = x
    plan = None
    # invariant 5b: the input records the repaired log keeps at their step (those of steps >= s move to s)
    held = {(r.step, r.handle, r.producer, r.seq) for r in recs if s is None or r.step < s}
    if out_damaged or (s is not None and out_last > s) or _unnamed_refs(root, held):
        plan = _plan_output(root, s, drop, held)  # CorruptionError here changes nothing
        report["output_unnamed"] = plan["unnamed"]
    backup = _backup_dir(root)
    report["backup"] = backup
    for n in sorted({n for n, _, _ in damaged_ranges} - set(missing)):  # invariant 1: a copy of each
        shutil.copy2(os.path.join(idir, n), os.path.join(backup, n))       # damaged segment, as it is
    if s is None:
        _write_log(idir + NEW_SUFFIX, _held(root, recs, x, report), True)
        parts = [INPUT_DIR] + _write_output(root, plan, report)
        _swap(root, backup, parts)
        return (f"the damaged input records were of steps below the checkpoint (step {x}), which holds their "
                f"effect: no push is lost" + _dropped_text(report) + f"; the old logs are in {backup}")
    # invariant 2: steps < s as they are; the valid pushes (and discards) of steps >= s again, undivided, at s
    head = [r for r in recs if r.step < s]
    tail = [r for r in recs if r.step >= s and r.handle != DIVISION_HANDLE]
    divisions = {r.step: decode_json(DIVISION_MAGIC, r.payload, f"{idir} division of step {r.step}")
                 for r in recs if r.step >= s and r.handle == DIVISION_HANDLE}
    last_step = max([r.step for r in recs] + [out_last - 1, s])
    lost, unnamed = _lost(root, s, last_step, [r for r in tail if r.handle != DISCARD_HANDLE], divisions,
                          {(r.producer, r.seq) for r in recs if r.producer and r.handle not in (DIVISION_HANDLE,
                                                                                                DISCARD_HANDLE)})
    report["lost"] = [{"producer": p, "seq": q, "step": st} for p, q, st in lost]
    report["lost_unnamed"] = unnamed
    report["requeued_pushes"] = sum(1 for r in tail if r.handle != DISCARD_HANDLE)
    new = _held(root, head, x, report) + [(s, r.handle, r.producer, r.seq, r.payload) for r in tail]
    _write_log(idir + NEW_SUFFIX, new, True)
    parts = [INPUT_DIR] + _write_output(root, plan, report)
    if plan is not None:
        r_out = plan["keep"][1]
        report["withdrawn_output"] = [r_out, out_last - 1] if out_last > r_out else None
    _swap(root, backup, parts)
    named = ", ".join(f"({p!r}, {q})" for p, q, _ in lost[:50]) + (" ..." if len(lost) > 50 else "")
    return (f"input of steps {s} and later was damaged: {len(lost)} pushes are lost by name"
            + (f" [{named}]" if lost else "") + (f" and {unnamed} more without a name (anonymous, or "
                                                  f"counted by a division only)" if unnamed else "")
            + f"; {report['requeued_pushes']} valid pushes of those steps wait for the next step"
            + (f"; output steps {report['withdrawn_output'][0]}..{report['withdrawn_output'][1]} are "
               f"withdrawn (read them again after the next steps)" if report["withdrawn_output"] else "")
            + _dropped_text(report) + f"; the old logs are in {backup}")


def _front_gap(root: str) -> tuple[str, str] | None:
    """The input log opens, but its oldest records are gone: it starts after driver.db's step, or the division of
    that step counts more pushes than the log holds (a deleted oldest segment; truncation never removes a
    record of a step at or after driver.db's). Returns (the name of the missing segment before the oldest one,
    why), or None."""
    idir = os.path.join(root, INPUT_DIR)
    d = _driver_step(root, {})
    if d is None or not os.path.isdir(idir):
        return None
    got = salvage(idir)
    nums = [int(n[:20]) for n in got.segments]
    name = segment_name(max(nums[0] - 1, 0) if nums else 0)
    recs = [r for r in got.records if r.step >= d]
    if not recs:
        out_last = _output_last(root)
        return (name, f"{idir}: holds no record of step {d} or later, but the output log holds steps up to "
                      f"{out_last - 1}") if out_last > d else None
    if recs[0].step > d:
        return name, f"{idir}: starts at step {recs[0].step}, but driver.db's checkpoint is at step {d}"
    div = next((r for r in recs if r.step == d and r.handle == DIVISION_HANDLE), None)
    held = sum(1 for r in recs if r.step == d and r.handle not in (DIVISION_HANDLE, DISCARD_HANDLE))
    if div is not None and int(decode_json(DIVISION_MAGIC, div.payload, f"{idir} division of step {d}")["pushes"]) \
            > held:
        return name, f"{idir}: the division of step {d} counts more pushes than the log holds"
    return None


def _tail_gap(root: str) -> tuple[str, str] | None:
    """The input log opens, but records of its newest steps are gone: its divisions from the step recovery resumes
    at end before the output log does (a cut at a record boundary leaves no invalid byte, and a log not closed
    cleanly has no end mark to miss; recovery refuses such a log). The lost division of the first step without
    one came after that step's pushes and before any push of a later step: at the end of the segment holding the
    last record of a step up to it (a later segment can hold the next steps' pushes). Returns (that segment,
    why), or None."""
    idir = os.path.join(root, INPUT_DIR)
    if not os.path.isdir(idir):
        return None
    out_last = _output_last(root)
    try:
        x = resume_step(root, out_last)
    except (CorruptionError, RecoveryError, OSError, KeyError):
        return None  # listed by the checks of the files
    got = salvage(idir)
    divided = {r.step for r in got.records if r.handle == DIVISION_HANDLE}
    step = x
    while step in divided:
        step += 1
    if out_last <= step or not got.segments:
        return None
    before = [r.segment for r in got.records if r.step <= step]
    return (before[-1] if before else got.segments[0],
            f"{idir}: divides input only up to step {step - 1}, but the output log holds steps up to "
            f"{out_last - 1} (the input log lost records of step {step} or later)")


def _write_output(root: str, plan: dict[str, Any] | None, report: dict[str, Any]) -> list[str]:
    """``output.new`` from ``plan`` (of :func:`_plan_output`); the parts to swap in."""
    if plan is None:
        return []
    k, cut = plan["keep"]
    _write_log(os.path.join(root, OUTPUT_DIR) + NEW_SUFFIX, [(t, "", "", 0, plan["intact"][t]) for t in range(k, cut)],
               False)
    report["output_dropped"] = list(plan["dropped"]) if plan["dropped"] else None
    return [OUTPUT_DIR]


def _dropped_text(report: dict[str, Any]) -> str:
    d = report.get("output_dropped")
    return (f"; the output of steps {d[0]}..{d[1]} is dropped (consumers can no longer read it; the state and "
            f"the input are kept)") if d else ""


def _held(root: str, recs: list[Record], x: int, report: dict) -> list[tuple[int, str, str, int, bytes]]:
    """``recs`` as records to log again, with what recovery needs of the steps ``d..x-1`` that the state holds
    but driver.db (at step ``d``) does not (invariant 2): a division per step, made up when damage took it
    (its ``now`` the latest one logged before it: recovery only keeps the clock from it), and a discard record
    per push an intact output step names but no record holds, so that push stays seen (its effect is in the
    state: it is not lost, and a retry must stay a duplicate)."""
    out = [(r.step, r.handle, r.producer, r.seq, r.payload) for r in recs]
    dpath = os.path.join(root, DRIVER_DB)
    try:
        with Database(dpath, readonly=True) as db, db.read(db.versions().stop - 1) as h:
            d = h.get_step()
            clock = h.get(CLOCK_TABLE, CLOCK_KEY)
            floor = int(decode_json(CLOCK_MAGIC, clock, f"{dpath} clock")["now_ns"]) if clock is not None else 0
    except (OSError, CorruptionError, KeyError, ValueError):
        return out
    divs = {r.step: decode_json(DIVISION_MAGIC, r.payload, f"division of step {r.step}") for r in recs
            if r.handle == DIVISION_HANDLE}
    missing = [t for t in range(d, x) if t not in divs]
    if not missing:
        return out
    present = {(r.producer, r.seq) for r in recs if r.producer and r.handle not in (DIVISION_HANDLE, DISCARD_HANDLE)}
    named = _named_outputs(root, range(d, x))
    extra: dict[int, list[tuple[int, str, str, int, bytes]]] = {}
    held = []
    for t in range(d, x):
        for rg in named.get(t, []):
            if rg["producer"] and rg["first_seq"] is not None:
                for q in range(rg["first_seq"], rg["last_seq"] + 1):
                    if (rg["producer"], q) not in present:
                        held.append((rg["producer"], q, t))
                        extra.setdefault(t, []).append((t, DISCARD_HANDLE, rg["producer"], q, encode_json(
                            DISCARD_MAGIC, {"input": rg["handle"], "producer": rg["producer"], "seq": q, "step": t})))
        if t in missing:
            before = [dv for st, dv in divs.items() if st < t]
            last = max(before, key=lambda dv: dv["step"]) if before else None
            dv = {"step": t, "pushes": sum(1 for r in recs if r.step == t and r.handle not in (DIVISION_HANDLE,
                                                                                            DISCARD_HANDLE)),
                  "now_ns": max(floor, int(last["now_ns"])) if last else floor, "seed": 0}
            if last is not None and "watermarks" in last:
                dv["watermarks"] = last["watermarks"]
            divs[t] = dv
            extra.setdefault(t, []).append((t, DIVISION_HANDLE, "", 0, encode_json(DIVISION_MAGIC, dv)))
    report["held_by_the_state"] = [{"producer": p, "seq": q, "step": t} for p, q, t in held]
    report["made_up_divisions"] = missing
    merged: list[tuple[int, str, str, int, bytes]] = []
    for rec in out:
        for t in sorted(k for k in extra if k < rec[0]):
            merged.extend(extra.pop(t))
        merged.append(rec)
    for t in sorted(extra):
        merged.extend(extra[t])
    return merged


def _output_last(root: str) -> int:
    odir = os.path.join(root, OUTPUT_DIR)
    if not os.path.isdir(odir):
        return 0
    steps = [r.step for r in salvage(odir).records]
    return max(steps) + 1 if steps else 0


def _lost(root: str, s: int, last: int, tail: list[Record], divisions: dict[int, dict], logged: set
          ) -> tuple[list[tuple[str, int, int]], int]:
    """Invariant 3: ``[(producer, seq, step)]`` lost by name, and how many more are lost without a name;
    ``tail`` the valid pushes of steps ``s`` and later, ``logged`` every (producer, seq) a valid record holds."""
    have = {(r.producer, r.seq) for r in tail} | logged
    lost: dict[tuple[str, int], int] = {}
    named_outputs = _named_outputs(root, range(s, last + 1))
    by_step: dict[int, int] = {}
    for step, ranges in named_outputs.items():  # the output log names the pushes of the steps it holds
        for rg in ranges:
            if rg["producer"] and rg["first_seq"] is not None:
                for q in range(rg["first_seq"], rg["last_seq"] + 1):
                    if (rg["producer"], q) not in have:
                        lost.setdefault((rg["producer"], q), step)
            elif not rg["producer"]:
                by_step[step] = by_step.get(step, 0) + rg["pushes"]
    stepped = {(rg["producer"], q) for st, ranges in _named_outputs(root, range(0, s)).items() for rg in ranges
               if rg["producer"] and rg["first_seq"] is not None for q in range(rg["first_seq"], rg["last_seq"] + 1)}
    for key in _acked(root):  # a clean close recorded every push the log held: those gone are lost by name
        if key not in have and key not in stepped:
            lost.setdefault(key, -1)
    seen = _dedup(root)
    producers = {r.producer for r in tail if r.producer}
    for p in producers:  # gaps in a producer's seqs after what the checkpoint had seen
        wm, above = seen.get(p, (-1, set()))
        qs = sorted(q for pp, q in have if pp == p and q > wm)
        if not qs:
            continue
        for q in range(wm + 1, qs[-1]):
            if q not in above and (p, q) not in have and (p, q) not in stepped:
                lost.setdefault((p, q), -1)
    unnamed = 0
    for step, dv in divisions.items():  # a division counts its pushes: those not named are lost without a name
        held = sum(1 for r in tail if r.step == step)
        named_here = sum(1 for st in lost.values() if st == step)
        unnamed += max(0, int(dv.get("pushes", 0)) - held - named_here)
    unnamed = max(0, unnamed - sum(1 for st in lost.values() if st == -1))  # gaps name some of them
    anon_held = {}
    for r in tail:
        if not r.producer:
            anon_held[r.step] = anon_held.get(r.step, 0) + 1
    for step, n in by_step.items():
        if step not in divisions:
            unnamed += max(0, n - anon_held.get(step, 0))
    return sorted((p, q, st) for (p, q), st in lost.items()), unnamed
