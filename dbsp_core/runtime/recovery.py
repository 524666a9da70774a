"""Recovery of a storage directory for the driver: open it (format checks, an interrupted repair or layout change settled, a cold rescale if asked), put the executor's state at its step, and read back from driver.db and the input log where the pipeline goes on and which divided steps run again.

The driver (dbsp_core.runtime.driver, invariant 6) calls, in order: :func:`open_directory`, :func:`settle_state`,
then a :class:`LogReplay` whose divided steps it runs again itself (through the same path as any step, so their
output is verified against the output log), and whose undivided tail it queues.

Invariants (enforced here; together they are driver invariant 6):
  1. Recovery resolves an interrupted layout change (rescale.py), lets the executor put its state on the newest
     version every database holds (step X), changes the layout if asked (cold rescale), loads the state, loads
     the seen set and clock from ``driver.db`` (step D <= X) and completes them from the log records of steps
     D..X-1, replays every divided step from X (verifying output already in the log, appending the rest), then
     queues the acknowledged pushes never divided into a step.
  2. A directory written by another kind of executor is refused with CircuitMismatchError. One written by a
     different circuit is a program change (dbsp_core.runtime.change), carried out by the driver, or refused
     with CircuitMismatchError naming the views (outputs) and tables (inputs) added, removed or changed, by the
     part fingerprints META records (the two circuit hashes if META predates them), and why.
  3. A state database LAYOUT names that is missing while the state is past step 0 raises CorruptionError naming
     it before anything is created or changed, also before an interrupted layout change is settled
     (storage/statefiles.py invariant 2). A damaged input log raises CorruptionError naming the file and offset
     and changes nothing (``dbsp repair`` is the way forward); a damaged output log is rebuilt when every step it
     lost is one the replay computes again, and refused otherwise (dbsp_core.storage.repair, invariants 1 and 4).
  4. An executor whose checkpoints may write range values (``range_values``: the embedded one) creates a directory
     of format 4 and raises one of format 2 or 3 to it (one atomic META rewrite, storage/directory.py invariant
     3) after the refusals above and before anything that writes state (the settling of a layout change, the
     first checkpoint): no range value is ever under a META an older build reads.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, NamedTuple

import pyarrow as pa

from dbsp_core.circuit import Circuit, part_fingerprints
from dbsp_core.codec import decode_json
from dbsp_core.errors import CircuitMismatchError, CorruptionError, RecoveryError
from dbsp_core.layout import DEFAULT_SHARD_BITS, HASH_VERSION, Layout
from dbsp_core.progress import progress
from dbsp_core.runtime.division import Divided, ranges
from dbsp_core.runtime.executor import Executor, StepInput
from dbsp_core.runtime.change import check as check_change
from dbsp_core.runtime.prune import apply as apply_stored, chosen as chosen_columns, stored_columns
from dbsp_core.runtime.rescale import cold_rescale, end_live, live_target, resolve
from dbsp_core.runtime.upgrade import is_format1, upgrade_format1
from dbsp_core.storage.consumers import ConsumerRegistry
from dbsp_core.storage.database import Database
from dbsp_core.storage.dedup import SeenSet
from dbsp_core.storage.fileref import decode_push
from dbsp_core.storage.directory import (raise_to_ranges, read_layout, read_meta, read_rescale, write_layout,
                                         write_meta)
from dbsp_core.storage.formats import (CLOCK_KEY, CLOCK_MAGIC, CLOCK_TABLE, DISCARD_HANDLE, DISCARD_MAGIC,
                                       DIVISION_HANDLE, DIVISION_MAGIC, DRIVER_DB, INPUT_DIR, OUTPUT_DIR, STATE_DIR)
from dbsp_core.storage.outputlog import OutputLog
from dbsp_core.storage.remote_log import RemoteLogs
from dbsp_core.storage.repair import finish_repair, rebuild_output
from dbsp_core.storage.statefiles import check_named
from dbsp_core.storage.steplog import StepLog
from dbsp_core.time.watermark import NO_WATERMARK, EventTime, advance
from dbsp_core.zset import ZSet

__all__ = ["LogReplay", "Opened", "open_directory", "settle_state"]

REPLAY_STEPS = 64  # divided steps handed to the executor at once during replay


class Opened(NamedTuple):
    """The files of a storage directory the driver holds open, and the layout ``LAYOUT`` names after an
    interrupted layout change was settled (the executor is started on it)."""

    input: StepLog
    output: OutputLog
    driver_db: Database
    consumers: ConsumerRegistry
    layout: Layout
    last_rescale: dict | None
    meta: dict  # META as stored (before any program change)
    changed: dict | None  # the META of the circuit opened when it differs from the stored one (a program change)
    differences: str  # what differs, said as CircuitMismatchError says it ("" when nothing does)


def open_directory(root: str, executor: Executor, circuit: Circuit, fingerprint: str, inputs: dict[str, pa.Schema],
                   outputs: dict[str, pa.Schema], *, workers: int, shard_bits: int, open_only: bool,
                   segment_bytes: int, replay_check: bool, output_sync: bool, stats: dict,
                   crashpoint: Callable[[str], None], vfs: str, rescale_to: int | None = None,
                   logs: RemoteLogs | None = None) -> Opened:
    """Open (or create) the pipeline stored in ``root``, whose lock the caller holds: finish an interrupted repair,
    upgrade a directory of the previous release, check META (invariant 2), settle an interrupted layout change,
    start the executor on the layout, and open the logs and ``driver.db`` (invariant 3). On failure, what it
    opened is closed again (the executor is the caller's). ``stats`` gets ``upgraded_from_format``,
    ``rescale_recovery`` and ``output_rebuilt`` when they happen. With ``logs`` the logs live in an object store as
    segment objects: their local copies are rebuilt from it (storage/logstore.py invariant 4)."""
    finish_repair(root)  # a repair a crash interrupted: swap in the repaired logs (storage/repair.py)
    meta = {"fingerprint": fingerprint, "executor": executor.kind, "inputs": sorted(inputs),
            "outputs": sorted(outputs), "hash_version": HASH_VERSION,
            "output_schemas": {n: sch.serialize().to_pybytes().hex() for n, sch in outputs.items()},
            "part_fingerprints": part_fingerprints(circuit)}
    legacy = is_format1(root)
    old = None
    if legacy is None:
        try:
            old = read_meta(root)
        except FileNotFoundError:
            pass
    # the columns joins and windows keep (operators/pruned.py invariant 3): a new directory records the pass's choice,
    # an existing one is opened with what it recorded (none when it predates the record, or for its nodes after a
    # program change that are not the same nodes as before)
    meta["stored_columns"] = stored = {} if legacy is not None else _stored_columns(old, meta, circuit)
    apply_stored(circuit, stored)
    if legacy is not None:  # the previous release's directory: converted, then opened as any other
        executor.start(circuit, Layout.local(int(legacy.get("workers", 1)),
                                             int(legacy.get("shard_bits", DEFAULT_SHARD_BITS))), root)
        upgrade_format1(root, legacy, executor, fingerprint, vfs)
        stats["upgraded_from_format"] = 1
        old = read_meta(root)
    changed, differences = None, ""
    if old is None:
        if open_only:
            raise RecoveryError(f"Pipeline.open: {root!r} holds no pipeline (META is missing)")
        if os.path.exists(os.path.join(root, STATE_DIR)) or os.path.exists(os.path.join(root, DRIVER_DB)):
            raise RecoveryError(f"{root}: state databases exist but META is missing")
        new = Layout.local(workers, shard_bits)
        write_layout(root, new, None, vfs)
        executor.start(circuit, new, root)  # its state groups: the databases LAYOUT names (statefiles invariant 1)
        write_meta(root, dict(meta, state_groups=[g.name for g in executor.groups(new)]), vfs,
                   ranges=executor.range_values)  # META last: the
        # directory holds a pipeline from here on
    else:
        if old.get("executor") != meta["executor"]:
            raise CircuitMismatchError(
                f"{root} was written by a pipeline with a different executor kind ({old.get('executor')!r} != "
                f"{meta['executor']!r}); open it with the same circuit and executor")
        if old.get("fingerprint") != meta["fingerprint"]:  # a program change: the driver carries it out (change.py)
            differences = _differences(old, meta)
            check_change(root, old, meta, executor.kind, differences)
            if read_rescale(root, vfs) is not None or live_target(root, vfs) is not None:
                raise CircuitMismatchError(f"{root} was written by a pipeline with a different circuit{differences}; "
                                           f"a layout change is in progress: open it with the same circuit first")
            changed = meta
    layout, _ = read_layout(root, vfs)
    if changed is not None and rescale_to is not None and rescale_to != layout.workers:
        raise CircuitMismatchError(f"{root} was written by a pipeline with a different circuit{differences}; change "
                                   f"the program and the worker count in two opens")
    if old is not None and not open_only and layout.workers != workers:
        raise CircuitMismatchError(f"{root} holds a pipeline of {layout.workers} workers, not {workers}; "
                                   f"Pipeline.open({root!r}, circuit, workers={workers}) rescales it")
    executor.start(circuit, layout, root)
    _check_state_files(root, executor, layout, logs)  # before anything is created or changed
    if old is not None and executor.range_values:  # format 2 or 3 raised to 4 before anything can write a range
        old = raise_to_ranges(root, old, vfs)  # value (invariant 4): no DRBR under a META of 2 or 3
    # an interrupted layout change: finish it or undo it
    stats["rescale_recovery"] = resolve(root, executor, crashpoint, vfs)
    layout, last_rescale = read_layout(root, vfs)
    executor.start(circuit, layout, root)
    if stats["rescale_recovery"] is not None:
        _check_state_files(root, executor, layout, logs)
    with contextlib.ExitStack() as opened:
        ship_in = ship_out = None
        if logs is not None:
            ship_in = logs.open_log("input", os.path.join(root, INPUT_DIR), segment_bytes)
            opened.callback(ship_in.close)
            ship_out = logs.open_log("output", os.path.join(root, OUTPUT_DIR), segment_bytes)
            opened.callback(ship_out.close)
        inp = StepLog(os.path.join(root, INPUT_DIR), segment_bytes=segment_bytes, ship=ship_in)
        opened.callback(inp.close)
        try:
            out = OutputLog(os.path.join(root, OUTPUT_DIR), outputs, check=replay_check, sync=output_sync,
                            segment_bytes=segment_bytes, since=(old or {}).get("since"), ship=ship_out, input_log=inp)
        except CorruptionError:  # output is a function of input: rebuild it if the lost steps are replayed
            rebuilt = rebuild_output(root)
            stats["output_rebuilt"] = {k: rebuilt[k] for k in ("kept", "missing", "backup")}
            out = OutputLog(os.path.join(root, OUTPUT_DIR), outputs, check=replay_check, sync=output_sync,
                            segment_bytes=segment_bytes, expect=rebuilt["expect"], since=(old or {}).get("since"),
                            ship=ship_out, input_log=inp)
        opened.callback(out.close)
        if logs is not None:
            logs.opened(out)
        if not os.path.exists(os.path.join(root, DRIVER_DB)) and out.last > 0:
            raise CorruptionError(f"{root}: {DRIVER_DB} is missing, but the output log holds steps up to "
                                  f"{out.last - 1}: the record of the pushes already counted is lost")
        db = Database(os.path.join(root, DRIVER_DB), vfs=vfs)
        opened.callback(db.close)
        consumers = ConsumerRegistry(root, vfs)
        executor.output_steps = lambda: out.last
        opened.pop_all()  # the caller holds them from here on
    return Opened(inp, out, db, consumers, layout, last_rescale, old if old is not None else meta, changed, differences)


def _stored_columns(old: dict | None, meta: dict, circuit: Circuit) -> dict:
    """The kept columns to open a directory with (operators/pruned.py invariant 3): the pass's for a new one; the
    recorded ones for a directory of the same circuit; after a program change, the recorded ones of each node that
    is the same node as before (same part fingerprint; change.py keeps its state), and the pass's for the new nodes
    (built from scratch). A kept node whose recorded columns lack one the changed program reads through it is
    refused (CircuitMismatchError): its state cannot give that column."""
    if old is None:
        return chosen_columns(circuit)
    was = old.get("stored_columns")
    if not isinstance(was, dict) or not was:
        return {}
    if old.get("fingerprint") == meta["fingerprint"]:
        return dict(was)
    before = (old.get("part_fingerprints") or {}).get("nodes") or []
    now = meta["part_fingerprints"]["nodes"]
    where = {fp: i for i, fp in enumerate(before) if fp is not None}
    fresh = chosen_columns(circuit)
    reads = stored_columns(circuit)  # what the changed program reads through each node, pruning on or off
    out = {}
    for i, fp in enumerate(now):
        j = where.get(fp)
        if j is None:
            if str(i) in fresh:
                out[str(i)] = fresh[str(i)]
        elif str(j) in was:
            out[str(i)] = kept = was[str(j)]
            op = circuit.nodes[i]
            need = reads.get(str(i)) or [s.names for s in ((op.lschema, op.rschema) if hasattr(op, "lschema")
                                                           else (op.schema,))]
            lacking = [sorted(set(n) - set(k)) for n, k in zip(need, kept)]
            if any(lacking):  # the kept state lacks columns the changed program reads: never serve nulls
                raise CircuitMismatchError(
                    f"{op.label} keeps only columns {kept} of its inputs in its stored state (operators/pruned.py), "
                    f"and the changed program reads {[c for cols in lacking for c in cols]} through it too; open the "
                    f"directory with the program that wrote it, or change the new view to read the columns kept")
    return out


def _check_state_files(root: str, executor: Executor, layout: Layout, logs: RemoteLogs | None) -> None:
    """Every state database LAYOUT names is present, or the state is at step 0 (storage/statefiles.py invariant 2):
    else CorruptionError naming the missing files and ``dbsp repair``. With an object store the manifest names
    the state instead (runtime/stage_check.py rule 2, runtime/remote_state.py); a manifest lists the databases the
    cache held (remote_state.py ``_databases``), which may lack one LAYOUT names, so the embedded executor's
    ``open_state`` keeps its own refusal of a worker database missing beside one with state
    (tests/exactly_once/test_state_files.py, the object store's case)."""
    if logs is not None:
        return
    named = [g.path_of(w) for g in executor.groups(layout) for w in range(layout.workers)]
    check_named(root, named, layout.workers, layout.epoch)


def _differences(old: dict, new: dict) -> str:
    """What differs between the circuit recorded in META ``old`` and that of ``new``: the views (outputs) and
    tables (inputs) added, removed or changed, by their fingerprints; the two circuit hashes when ``old`` has no
    part fingerprints (a directory written before META recorded them) or none of them differs."""
    hashes = f" ({old.get('fingerprint')!r} != {new['fingerprint']!r})"
    was, now = old.get("part_fingerprints"), new["part_fingerprints"]
    if not isinstance(was, dict) or was.get("version") != now["version"]:
        return hashes
    said = []
    for key, what in (("outputs", "views"), ("inputs", "tables")):
        a, b = was.get(key, {}), now[key]
        for how, names in (("added", sorted(b.keys() - a.keys())), ("removed", sorted(a.keys() - b.keys())),
                           ("changed", sorted(n for n in a.keys() & b.keys() if a[n] != b[n]))):
            if names:
                said.append(f"{what} {how}: {', '.join(names)}")
    if not said:
        return f"{hashes}: no view or table differs, but how the circuit's nodes are ordered or shared does"
    return ": " + "; ".join(said)


def settle_state(root: str, executor: Executor, circuit: Circuit, layout: Layout, last_rescale: dict | None,
                 rescale_to: int | None, stats: dict, crashpoint: Callable[[str], None], vfs: str
                 ) -> tuple[int | None, dict | None]:
    """Put the executor's state on the newest version every database holds, finish a live rescale a crash
    interrupted (a cold change to its target, rescale.py invariant 4) and make the cold change to ``rescale_to``
    workers if asked; returns the step the state is at (None: the executor keeps no state) and the report of
    the last layout change."""
    version, step = executor.open_state()
    target = live_target(root, vfs)  # a live rescale a crash interrupted: finish the move
    if target is not None:
        if target.epoch != layout.epoch:
            rep = cold_rescale(root, executor, layout, target, version, -1 if step is None else step, crashpoint, vfs)
            last_rescale = dict(rep, kind="live", finished_by_recovery=True)
            write_layout(root, target, last_rescale, vfs)
            layout = target
            executor.start(circuit, layout, root)
            version, step = executor.open_state()
        else:
            end_live(root, vfs)
        stats["rescale_recovery"] = "finished"
    if rescale_to is not None and rescale_to != layout.workers:
        new = layout.rebalance(rescale_to)
        with progress(f"rescale {layout.workers} -> {new.workers} workers"):
            last_rescale = cold_rescale(root, executor, layout, new, version, -1 if step is None else step,
                                        crashpoint, vfs)
        executor.start(circuit, new, root)
        version, step = executor.open_state()
    return step, last_rescale


class LogReplay:
    """What the driver's record (``driver.db``) and the input log say about where a pipeline goes on (invariant 1).

    Made, it has loaded the seen set and the clock of the newest driver record (at :attr:`record_step`). Then,
    with the executor's state at step X: :meth:`catch_up` completes them from the log records of the steps the
    state holds and the record does not; :meth:`divided` yields the divided steps from X on, in runs of
    :data:`REPLAY_STEPS`, for the driver to run again; :meth:`tail` returns the acknowledged pushes after the
    last division. Meanwhile :attr:`now_floor`, :attr:`prev_now` (the ``now`` of the step before the next one
    run), :attr:`watermarks` (after the last step divided), :attr:`anon_seq` and :attr:`next_step` follow.
    """

    def __init__(self, root: str, input: StepLog, output: OutputLog, driver_db: Database,
                 inputs: dict[str, pa.Schema], event_time: dict[str, EventTime], seen: SeenSet) -> None:
        self.root, self._input, self._output, self._inputs = root, input, output, inputs
        self._event_time, self._seen = event_time, seen
        self.now_floor = 0
        self.prev_now: int | None = None
        self.watermarks: dict[str, int] = {name: NO_WATERMARK for name in event_time}
        self.anon_seq = 0  # the seq of the next anonymous push
        self.next_step = 0
        self._divisions: dict[int, dict] = {}
        self._records: dict[int, list] = {}
        self._discards: set[tuple[str, int]] = set()
        self._discarded_at: dict[tuple[str, int], int] = {}
        db = driver_db
        with db.open(db.versions().stop - 1) as h:  # the newest committed driver record; discards an older one
            seen.load(h, db.path)
            clock = h.get(CLOCK_TABLE, CLOCK_KEY)
            if clock is not None:
                c = decode_json(CLOCK_MAGIC, clock, f"{db.path} clock")
                self.now_floor, self.prev_now = int(c["now_ns"]), c.get("prev_now_ns")
                for name, wm in (c.get("watermarks") or {}).items():  # after the checkpoint's last step
                    if name in self.watermarks:
                        self.watermarks[name] = int(wm)
            self.record_step: int = h.get_step()

    def catch_up(self, x: int) -> None:
        """Read the input log from the driver record's step D and complete the seen set and the clock with the
        steps D..``x``-1 the state holds."""
        root, d, out = self.root, self.record_step, self._output
        if out.last < x:
            raise RecoveryError(f"{root}: the output log ends at step {out.last} but the state is at step {x}; "
                                f"output of steps {out.last}..{x - 1} is lost and cannot be computed again: "
                                f"restore the directory from a backup (`dbsp repair DIR` lists the damage)")
        if d > x:
            raise RecoveryError(f"{root}: driver.db is at step {d} but the state only at step {x}")
        divisions, records = self._divisions, self._records
        discards = self._discards  # (producer, seq) of pushes dropped by discard (driver invariant 7)
        # the step open when each discard was logged: a discard of a push its step's division had not yet closed
        # (logged while that step was open) is not among the division's pushes; a later one is
        discarded_at = self._discarded_at
        for r in self._input.iter_from(d):
            if r.handle == DIVISION_HANDLE:
                divisions[r.step] = decode_json(DIVISION_MAGIC, r.payload, f"{root} division of step {r.step}")
            elif r.handle == DISCARD_HANDLE:
                decode_json(DISCARD_MAGIC, r.payload, f"{root} discard record of step {r.step}")
                discards.add((r.producer, r.seq))
                discarded_at.setdefault((r.producer, r.seq), r.step)
                if r.producer:  # a discarded push was acknowledged: it stays seen, whether or not its record is
                    self._seen.add(r.producer, r.seq)
            else:
                records.setdefault(r.step, []).append(r)
            if not r.producer and r.handle != DIVISION_HANDLE:
                self.anon_seq = max(self.anon_seq, r.seq + 1)
        for s in range(d, x):  # the steps the state holds but the driver record does not: seen pairs and clock
            dv = divisions.pop(s, None)
            if dv is None:
                raise CorruptionError(f"{root}: the input log has no division of step {s}, which the state holds")
            self.now_floor = max(self.now_floor, int(dv["now_ns"]))
            self.prev_now = int(dv["now_ns"])
            self._logged_watermarks(dv, s)
            for r in records.pop(s, []):
                if r.producer:
                    self._seen.add(r.producer, r.seq)
        self.next_step = x

    def divided(self, shown: Any) -> Iterator[list[Divided]]:
        """The divided steps from the state's step on, in runs of at most :data:`REPLAY_STEPS` (the last may be
        empty), each step's pushes less the discarded ones and its watermarks recomputed and checked against
        the logged ones; ``shown`` is the progress display. Raises CorruptionError at a gap or a mismatch."""
        root, divisions, records = self.root, self._divisions, self._records
        x = step = self.next_step
        run: list[Divided] = []
        shown.total = sum(1 for s in divisions if s >= x)
        rewritten = False  # a discard changed a replayed step: the watermarks logged after it are recomputed
        while step in divisions:
            dv = divisions.pop(step)
            recs = records.pop(step, [])
            before = sum(1 for r in recs if self._discarded_at.get((r.producer, r.seq)) == step)
            if dv["step"] != step or dv["pushes"] != len(recs) - before:
                raise CorruptionError(f"{root}: the division of step {step} names {dv['pushes']} pushes, the log "
                                      f"holds {len(recs)}" + (f" ({before} discarded before it)" if before else ""))
            self.now_floor = max(self.now_floor, int(dv["now_ns"]))
            live = self._live(recs)
            rewritten |= len(live) != len(recs)
            pushes = self._decode(live)
            in_force = dict(self.watermarks)
            after, late = advance(self._event_time, in_force, pushes) if self._event_time else ({}, {})
            logged = self._logged_watermarks(dv, step)
            if rewritten:
                self.watermarks = dict(after) if self._event_time else self.watermarks
            elif logged is not None and logged != after:
                raise CorruptionError(f"{root}: step {step} logged watermarks {logged}, its pushes give {after}")
            entries = [(r.handle, r.producer, r.seq) for r in live]
            run.append(Divided(StepInput(step, pushes, int(dv["now_ns"]), None, int(dv["seed"]), in_force),
                               ranges(entries), after, late, entries))
            step += 1
            self.next_step = step
            if len(run) >= REPLAY_STEPS:
                yield run
                run = []
                shown.update(step - x)
        yield run
        shown.update(step - x)
        if divisions:
            raise CorruptionError(f"{root}: division records of steps {sorted(divisions)} follow a gap at step "
                                  f"{step}")
        if self._output.last > step:
            raise CorruptionError(f"{root}: the output log holds steps up to {self._output.last - 1} but the input log "
                                  f"divides input only up to step {step - 1}")

    def tail(self) -> list[tuple[str, ZSet, tuple[str, str, int]]]:
        """The acknowledged pushes of the step after the last division, less the discarded ones, as
        ``(input, change, (input, producer, seq))``; raises CorruptionError if records of later steps follow."""
        records = self._records
        tail = self._live(records.pop(self.next_step, []))
        if records:
            raise CorruptionError(f"{self.root}: input records of undivided steps {sorted(records)} after step "
                                  f"{self.next_step}")
        return [(handle, z, (r.handle, r.producer, r.seq)) for (handle, z), r in zip(self._decode(tail), tail)]

    def _logged_watermarks(self, dv: dict, step: int) -> dict[str, int] | None:
        """The watermarks a division record logged (after its step), which become the ones in force next."""
        wms = dv.get("watermarks")
        if not self._event_time:
            return None
        if not wms:
            raise CorruptionError(f"{self.root}: the division of step {step} logs no watermarks, but the circuit "
                                  f"declares event time on {sorted(self._event_time)}")
        got = {name: int(wms.get(name, NO_WATERMARK)) for name in self._event_time}
        self.watermarks = dict(got)
        return got

    def _live(self, recs: list) -> list:
        """The records of ``recs`` no discard record names; a discarded push stays seen (a retry is a duplicate)."""
        if not self._discards:
            return recs
        live = []
        for r in recs:
            if (r.producer, r.seq) in self._discards:
                if r.producer:
                    self._seen.add(r.producer, r.seq)
            else:
                live.append(r)
        return live

    def _decode(self, recs: list) -> list[tuple[str, ZSet]]:
        out = []
        for r in recs:
            if r.handle not in self._inputs:
                raise CorruptionError(f"{self.root}: logged push to unknown input {r.handle!r} at step {r.step}")
            out.append((r.handle, decode_push(r.payload, self._inputs[r.handle], f"{self.root} input step "
                                                                                f"{r.step}")))
            if r.producer:
                self._seen.add(r.producer, r.seq)
        return out
