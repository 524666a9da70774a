"""Crash tests of the steps one call runs together (``run_queued``), whose output records share one fsync (driver.py invariant 4, outputlog.py invariant 2): a simulated crash (every damage mode) at every I/O operation of the call and right after it returns, through a fault VFS of the test's own.

After each crash the output log on disk (read-only, through POSIX) holds a prefix of the steps, each one the step the
in-memory reference computed, and all of them once ``run_queued`` returned; reopening the pipeline computes the rest
again, and every step's output is then the reference's, each step exactly once.
"""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dbsp_core as dbsp
from dbsp_core import _storage
from dbsp_core.envvars import settings
from dbsp_core.errors import DbspError, StorageError
from dbsp_core.storage import FaultVfs
from dbsp_core.storage.formats import OUTPUT_DIR
from dbsp_core.storage.outputlog import OutputLog

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
BATCHES = [pa.table({"k": [i % 3, (i * 5) % 4, i], "v": [i, i + 2, 7 - i]}, schema=SCHEMA) for i in range(5)]
QUEUED = 4  # steps 1..4 run by one run_queued (step 0 by step())
DAMAGE = [(m, 0) for m in ("keep", "drop")] + [(m, s) for m in ("tear", "reorder", "chaos") for s in range(2)]


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("sums", t.group_by("k").agg(s=dbsp.sum("v")))
    c.output("big", t.filter(pc.field("v") > 2))
    return c


def reference() -> list[dict[str, dict]]:
    p = dbsp.Pipeline(circuit())
    out = []
    for b in BATCHES:
        p.push("t", b)
        out.append({n: z.to_dict() for n, z in p.step().items()})
    p.close()
    return out


def session(d: str, fv: FaultVfs, arm: dict | None, after: tuple[str, int] | None) -> tuple[bool, int]:
    """Step 0, then queue steps 1..4 and run them with one run_queued, ``fv`` armed with ``arm`` for the call (and
    with ``after``: a crash in that mode right after it returns); whether run_queued returned, and the operations
    ``fv`` counted in it."""
    p = dbsp.Pipeline(circuit(), storage=d, vfs=fv.name, checkpoint_interval=None)
    p.push("t", BATCHES[0])
    p.step()
    out = p._output  # the pipeline's vfs reaches its state and driver files, not its logs: the output log's here
    out._log.close()
    out._log, out._ticket = _storage.Log(out.path, fv.name, out.segment_bytes, False, False), 0
    for b in BATCHES[1:]:
        p.push("t", b)
        p.queue_step()
    if arm is not None:
        fv.arm(**arm)
    try:
        p.run_queued()
        returned = True
    except (StorageError, DbspError):
        returned = False
    ops = fv.ops()
    if after is not None:
        fv.crash_now(*after)
    try:
        p.close()
    except (StorageError, DbspError):
        pass  # a crashed VFS fails every later operation
    return returned, ops


def check(d: str, returned: bool, ref: list[dict[str, dict]], where: str) -> None:
    c = circuit()
    schemas = {name: c.nodes[i].schema for name, i in c.outputs.items()}
    log = OutputLog(os.path.join(d, OUTPUT_DIR), schemas, readonly=True)
    try:
        assert log.first == 0 and 1 <= log.last <= 1 + QUEUED, f"{where}: log holds {log.first}..{log.last - 1}"
        assert not returned or log.last == 1 + QUEUED, \
            f"{where}: run_queued returned but the log on disk holds steps 0..{log.last - 1} only"
        for s in range(log.last):
            got = {n: z.to_dict() for n, z in log.get(s).items()}
            assert got == ref[s], f"{where}: step {s} on disk is not the reference's"
    finally:
        log.close()
    p = dbsp.Pipeline.open(d, circuit())
    try:
        assert p.output_steps == range(0, 1 + QUEUED), f"{where}: after recovery {p.output_steps}"
        for n in ("sums", "big"):
            got = [(s, z.to_dict()) for s, z in p.read_output(n)]
            assert got == [(s, ref[s][n]) for s in range(1 + QUEUED)], f"{where}: {n} after recovery"
    finally:
        p.close()


def test_a_crash_in_or_after_run_queued_keeps_a_prefix_and_every_returned_step(tmp_path):
    ref = reference()
    fv = FaultVfs()
    dry = str(tmp_path / "dry")
    returned, nops = session(dry, fv, {}, None)  # count the call's operations
    fv.disarm()
    assert returned
    check(dry, True, ref, "no crash")
    tried = 0
    for n in range(1, nops + 2):  # n = nops + 1: no crash inside the call, one right after it returns
        for mode, seed in DAMAGE:
            d = str(tmp_path / f"c{n}-{mode}-{seed}")
            inside = n <= nops
            returned, _ = session(d, fv, dict(crash_at=n, mode=mode, seed=n * 100 + seed) if inside else {},
                               None if inside else (mode, seed))
            assert fv.crashed(), f"op {n} {mode}: no crash"
            fv.disarm()
            assert returned != inside, f"op {n} {mode}: run_queued {'returned' if returned else 'raised'}"
            check(d, returned, ref, f"crash at op {n} of {nops} ({mode}, seed {seed})")
            shutil.rmtree(d)
            tried += 1
    # without a budget the call's I/O is the output log's: one write and one fsync for the four steps (deferral off
    # makes it 8); under DBSP_MEMORY_LIMIT (.ci/run's second pass) every step also writes its traces' batch files
    # through the same VFS, so the count only bounds from below, and the crashes above cover those operations too
    if settings().memory_limit is None:
        assert 2 <= nops <= 4, f"run_queued of {QUEUED} steps took {nops} I/O operations (one write and one fsync)"
    else:
        assert nops >= 2, f"run_queued of {QUEUED} steps took {nops} I/O operations"
    print(f"\n[run_queued crash] {nops} operations + after the return x {len(DAMAGE)} damage modes = {tried} crashes")
