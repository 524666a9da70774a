"""Scripted StreamTest-style scenarios of the durable pipeline in one process: add data, check, stop, restart, check; a restart in the middle of a checkpoint; dedup across restarts; refusing another circuit; the replay check; determinants; corruption; bounded disk."""

from __future__ import annotations

import os
import sys
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime.coordinator import WorkerStore  # noqa: E402
from dbsp_core.errors import (CircuitMismatchError, CorruptionError, RecoveryError,  # noqa: E402
                              ReplayMismatchError)
from workload import PRODUCERS, build_circuit, integral, oracle, push_batch  # noqa: E402


class Stream:
    """A tiny StreamTest: a durable pipeline plus the batches pushed so far and the expected views."""

    def __init__(self, d: str, seed: int = 3, workers: int = 2, **kw) -> None:
        self.d, self.seed, self.workers, self.kw = d, seed, workers, kw
        self.counts = {pr: 0 for pr in PRODUCERS}
        self.p = dbsp.Pipeline(build_circuit(), workers=workers, storage=d, checkpoint_interval=None, **kw)

    def add(self, n: int = 1) -> None:
        for _ in range(n):
            for pr in PRODUCERS:
                push_batch(self.p, self.seed, pr, self.counts[pr])
                self.counts[pr] += 1

    def step(self) -> None:
        self.p.step()

    def check(self) -> None:
        want = oracle(self.seed, self.counts)
        for name, expect in want.items():
            got, steps = integral(self.p, name)
            assert steps == list(range(self.p.steps)), f"{name}: steps {steps}"
            assert got == expect, f"{name} differs from DuckDB"

    def stop(self, checkpoint: bool = True) -> None:
        self.p.close(checkpoint=checkpoint)

    def restart(self) -> None:
        self.p = dbsp.Pipeline.open(self.d, build_circuit(), checkpoint_interval=None, **self.kw)


def test_add_check_stop_restart_check(tmp_path):
    s = Stream(str(tmp_path / "d"))
    s.add(3)
    s.step()
    s.check()
    s.stop()
    s.restart()
    assert s.p.stats["replayed_steps"] == 0  # a clean stop checkpoints: nothing to replay
    s.check()
    s.add(2)
    s.step()
    s.check()
    s.stop(checkpoint=False)  # like a crash after the step: the step is replayed and verified on restart
    s.restart()
    assert s.p.stats["replayed_steps"] == 1
    s.check()
    s.add(1)  # acknowledged but never stepped, then "crash": the push must survive
    s.stop(checkpoint=False)
    s.restart()
    assert s.p.stats["recovered_pushes"] == 3  # p0's bids, p1's bids and auctions
    s.step()
    s.check()
    s.stop()


def test_restart_in_the_middle_of_a_checkpoint(tmp_path, monkeypatch):
    s = Stream(str(tmp_path / "d"))
    s.add(2)
    s.step()
    s.p.checkpoint()
    s.add(2)
    s.step()
    s.add(1)
    s.step()
    real_commit = WorkerStore.commit

    def commit(self, step, captured):
        if self.index == 1:  # worker 0 has committed the new version, worker 1 "crashes" before its commit
            raise OSError("simulated crash during the checkpoint commit")
        return real_commit(self, step, captured)

    monkeypatch.setattr(WorkerStore, "commit", commit)
    with pytest.raises(OSError):
        s.p.checkpoint()
    monkeypatch.setattr(WorkerStore, "commit", real_commit)
    with pytest.raises(dbsp.DbspError, match="broken"):  # a failed checkpoint breaks the pipeline
        s.p.step()
    s.p._shutdown()  # abandon the process state, as a crash would
    versions = [dbsp.storage.Database(os.path.join(s.d, "state", f"worker-{w}.db")).versions() for w in range(2)]
    assert versions[0] != versions[1]  # worker 0 holds one version more than worker 1
    s.restart()
    assert s.p.stats["replayed_steps"] == 2  # recovery chose the older, common version
    s.check()
    s.add(1)
    s.step()
    s.check()
    s.stop()


def test_dedup_survives_restarts_and_truncation(tmp_path):
    s = Stream(str(tmp_path / "d"), segment_bytes=4096)
    s.add(3)
    s.step()
    s.stop(checkpoint=False)
    s.restart()
    for seq in range(3):  # retries of acknowledged pushes: acknowledged again, counted once
        assert all(a.duplicate for a in push_batch(s.p, s.seed, "p0", seq))
    for _ in range(20):
        s.add(1)
        s.step()
        s.p.checkpoint()
    s.stop()
    s.restart()
    for seq in (0, 5, 22):
        assert all(a.duplicate for a in push_batch(s.p, s.seed, "p1", seq))
    s.step()
    s.check()
    s.stop()


def test_concurrent_producers_and_concurrent_retries(tmp_path):
    s = Stream(str(tmp_path / "d"), workers=2)
    n = 30

    def produce(pr: str) -> None:
        for seq in range(n):
            push_batch(s.p, s.seed, pr, seq)

    def retry(pr: str) -> None:  # a second thread retrying the same (producer, seq) pairs concurrently
        for seq in range(n):
            push_batch(s.p, s.seed, pr, seq)

    threads = [threading.Thread(target=f, args=(pr,)) for pr in PRODUCERS for f in (produce, retry)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        s.step()
    for t in threads:
        t.join()
    s.step()
    s.counts = {pr: n for pr in PRODUCERS}
    s.check()
    assert s.p.stats["pushes"] == 3 * n and s.p.stats["duplicates"] == 3 * n
    s.stop()


def test_other_circuit_or_scale_is_refused(tmp_path):
    d = str(tmp_path / "d")
    s = Stream(d)
    s.add(1)
    s.step()
    s.stop()
    c = build_circuit()  # a new view over a table that is not materialized: it cannot be built (runtime/change.py)
    c.output("extra", dbsp.Stream(c, c.inputs["bids"]).distinct())
    with pytest.raises(CircuitMismatchError, match="different circuit: views added: extra; .* table\\(s\\) bids"):
        dbsp.Pipeline.open(d, c)
    with pytest.raises(CircuitMismatchError, match="workers"):
        dbsp.Pipeline(build_circuit(), workers=1, storage=d)
    other = dbsp.Circuit()
    b = other.input("bids", pa.schema([("auction", pa.int64())]))
    other.output("by_cat", b.filter(pc.field("auction") > 1))
    with pytest.raises(CircuitMismatchError):
        dbsp.Pipeline.open(d, other)
    p = dbsp.Pipeline.open(d, build_circuit())  # the right circuit still opens
    p.close()


_calls = {"n": 0}


def _nondeterministic(batch: pa.RecordBatch) -> pa.RecordBatch:
    _calls["n"] += 1
    return pa.record_batch({"a": pa.array([_calls["n"]] * batch.num_rows, pa.int64())})


def _nd_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    x = c.input("x", pa.schema([("a", pa.int64())]))
    c.output("y", x.flat_map(_nondeterministic, pa.schema([("a", pa.int64())])))
    return c


def test_replay_check_fires_on_nondeterministic_output(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(_nd_circuit(), storage=d, checkpoint_interval=None)
    p.push("x", pa.table({"a": [1, 2]}))
    p.step()
    p.close(checkpoint=False)
    with pytest.raises(ReplayMismatchError, match="replayed step 0"):
        dbsp.Pipeline.open(d, _nd_circuit())
    p = dbsp.Pipeline.open(d, _nd_circuit(), replay_check=False)  # checking off: the old output stands
    assert [s for s, _ in p.read_output("y")] == [0]
    p.close()


def test_determinants_are_logged_and_replayed(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(build_circuit(), workers=2, storage=d, checkpoint_interval=None)
    p.step()
    p.step()
    now, seed = p.now_ns, p.seed
    assert p.executor._workers[1].ctx.now_ns == now and p.executor._workers[0].ctx.seed == seed
    p.close(checkpoint=False)
    q = dbsp.Pipeline.open(d, build_circuit())
    assert q.stats["replayed_steps"] == 2 and (q.now_ns, q.seed) == (now, seed)
    q.close()


def test_corrupt_meta_and_lost_output_are_reported(tmp_path):
    d = str(tmp_path / "d")
    s = Stream(d)
    s.add(1)
    s.step()
    s.stop()
    meta = os.path.join(d, "META")
    good = open(meta, "rb").read()
    with open(meta, "r+b") as f:
        f.seek(len(good) - 3)
        f.write(b"\x00")
    with pytest.raises(CorruptionError, match="checksum"):
        dbsp.Pipeline.open(d, build_circuit())
    with open(meta, "wb") as f:
        f.write(good)
    out = os.path.join(d, "output")
    for name in os.listdir(out):  # the output of the checkpointed step vanishes
        os.truncate(os.path.join(out, name), 0)
    with pytest.raises(RecoveryError, match="output of steps 0..0 is lost"):
        dbsp.Pipeline.open(d, build_circuit())


def _segments(log) -> list[tuple[int, int]]:
    """(records, last step) of every segment of a step log, oldest first."""
    return [(records, hi) for _, _, _, records, _, _, hi in log.segments()]


@pytest.mark.parametrize("retention", [5, None])
def test_logs_are_truncated_below_the_checkpoint_and_bounded_with_retention(tmp_path, retention):
    """After every checkpoint at step X, no input-log segment but the newest holds only steps below X (it was
    dropped), and with retention R no output segment but the newest holds only steps below min(X, last - R).
    So the logs stay bounded with retention, and the output log grows without it (the bound is not vacuous)."""
    d = str(tmp_path / "d")
    s = Stream(d, segment_bytes=8192, output_retention=retention)
    sizes = []
    for i in range(60):
        s.add(1)
        s.step()
        if i % 3 == 2:
            x = s.p.checkpoint()
            segs = _segments(s.p._input._log)
            assert len(segs) >= 1 and all(hi >= x for n, hi in segs[:-1] if n), (x, segs)
            assert s.p._input.first_step >= x - 10  # a segment holds a few steps
            out = _segments(s.p._output._log)
            bound = min(x, s.p._output.last - retention) if retention is not None else 0
            assert all(hi >= bound for n, hi in out[:-1] if n), (bound, out)
        if i % 10 == 9:
            u = s.p.disk_usage()
            sizes.append((u["input"], u["output"]))
    assert s.p._input.first_step >= 50
    inputs, outputs = [a for a, _ in sizes], [b for _, b in sizes]
    assert max(inputs) <= 2 * min(inputs) + 8192, inputs  # truncated at every checkpoint
    if retention is not None:
        assert s.p.output_steps.start >= 60 - retention - 10
        assert max(outputs) <= 2 * min(outputs) + 8192, outputs
        with pytest.raises(LookupError):
            next(s.p.read_output("big", 0))
    else:
        assert s.p.output_steps.start == 0
        assert outputs[-1] >= 4 * outputs[0], outputs  # every step's output is kept
    s.stop()


def test_last_hour_view_replays_with_the_logged_now(tmp_path, monkeypatch):
    """Rows enter and leave a 2 ms window as the steps' now moves on; the replay after a crash uses the logged now,
    not the clock, so it reproduces every change (the replay check compares them). The wall clock is a fake that
    the test advances, so the outcome never depends on how fast the machine is."""
    import time

    from dbsp_core.operators.temporal import within_last

    def circ() -> dbsp.Circuit:
        c = dbsp.Circuit()
        b = c.input("bids", pa.schema([("id", pa.int64()), ("ts", pa.int64())]))
        c.output("recent", within_last(b, "ts", 0.002, unit="ms"))  # a 2 ms window: rows expire between steps
        return c

    clock = [time.time_ns()]
    monkeypatch.setattr(time, "time_ns", lambda: clock[0])
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circ(), workers=2, storage=d, checkpoint_interval=None)
    now_ms = clock[0] // 10**6
    p.push("bids", pa.table({"id": list(range(6)), "ts": [now_ms + 3 * k for k in range(6)]}))
    first = p.step()["recent"]  # now = now_ms: rows 0 (ts = now) in the window, the others in the future
    p.checkpoint()
    outs = []
    for _ in range(8):
        clock[0] += 3 * 10**6  # 3 ms per step: one row enters and the one before leaves
        outs.append(p.step()["recent"])
    assert first.to_dict() == {(0, now_ms): 1}
    assert [len(o) for o in outs] == [2, 2, 2, 2, 2, 1, 0, 0]
    p.close(checkpoint=False)
    clock[0] += 10**12  # the replay must not see the clock: a step run with this now would expire every row
    q = dbsp.Pipeline.open(d, circ())  # replays 8 steps; the replay check compares every change
    assert q.stats["replayed_steps"] == 8
    got, _ = integral(q, "recent")
    assert got == {}  # every row entered the window and left it again, identically on replay
    q.close()


def test_one_pipeline_per_directory(tmp_path):
    d = str(tmp_path / "d")
    p = dbsp.Pipeline(build_circuit(), workers=2, storage=d)
    with pytest.raises(dbsp.DbspError, match="in use"):
        dbsp.Pipeline.open(d, build_circuit())
    p.close()
    from dbsp_core.storage.inspect import inspect_storage

    info = inspect_storage(d)  # the lock is free again
    assert info["workers"] == 2 and info["checkpoint_step"] == 0
    dbsp.Pipeline.open(d, build_circuit()).close()


def _state(p) -> dict:
    """Every worker's stateful instances' traces and Z-sets, consolidated, as dicts."""
    out = {}
    for w, wk in enumerate(p.executor._workers):
        for i, inst in wk.instances.items():
            if inst is p.circuit.nodes[i]:
                continue
            for name, val in vars(inst).items():
                if isinstance(val, dbsp.ZSet):
                    out[(w, i, name)] = val.to_dict()
                elif hasattr(val, "consolidated") and hasattr(val, "pending"):
                    out[(w, i, name)] = val.consolidated().zset.to_dict()
    return out


def test_incremental_checkpoints_restore_exactly_the_state(tmp_path):
    """Saved spine batches plus deletions of merged-away ones add up to the in-memory state (snapshot inv. 4)."""
    d = str(tmp_path / "d")
    s = Stream(d, workers=2)
    for k in range(24):
        s.add(1)
        s.step()
        if k % 2:
            s.p.checkpoint()
        if k % 8 == 7:
            before = _state(s.p)
            s.stop()
            s.restart()
            assert s.p.stats["replayed_steps"] == 0
            assert _state(s.p) == before
    s.check()
    s.stop()


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_output_log_torn_tail_is_regenerated_and_sealed_damage_is_an_error(tmp_path):
    d = str(tmp_path / "d")
    s = Stream(d, segment_bytes=4096)
    for _ in range(12):
        s.add(1)
        s.step()
    s.stop(checkpoint=False)  # nothing checkpointed: every step can be replayed
    out = os.path.join(d, "output")
    segs = sorted(os.listdir(out))
    assert len(segs) >= 3
    newest = os.path.join(out, segs[-1])
    os.truncate(newest, os.path.getsize(newest) - 7)  # a torn write of the last record
    s.restart()
    assert s.p.stats["replayed_steps"] == 12
    s.check()  # the torn step was cut off and appended again by the replay
    s.stop()
    _flip(os.path.join(out, segs[0]), 40)  # damage inside a sealed segment
    with pytest.raises(CorruptionError):
        dbsp.Pipeline.open(d, build_circuit())


def test_damaged_input_log_or_state_is_an_error_not_wrong_data(tmp_path):
    d = str(tmp_path / "d")
    s = Stream(d)
    s.add(3)
    s.step()
    s.p.checkpoint()
    s.add(2)
    s.step()
    s.stop(checkpoint=False)
    seg = [n for n in sorted(os.listdir(os.path.join(d, "input"))) if n.endswith(".seg")][0]
    path = os.path.join(d, "input", seg)
    good = open(path, "rb").read()
    _flip(path, len(good) // 2)
    damaged = open(path, "rb").read()
    # records written after the damaged one carry marks proving it had been fsynced: the step log refuses to
    # open, names the file and the offset, and cuts nothing (it used to cut it off like a torn tail)
    with pytest.raises(CorruptionError, match=rf"{seg}: damaged record at offset \d+"):
        dbsp.Pipeline.open(d, build_circuit())
    assert open(path, "rb").read() == damaged


def test_read_input_returns_each_step_as_divided(tmp_path):
    s = Stream(str(tmp_path / "d"))
    s.add(2)
    s.step()
    s.add(1)
    s.step()
    s.stop(checkpoint=False)
    s.restart()
    whole = {}
    for step in range(2):
        for h, z in s.p.read_input(step).items():
            whole[h] = z if h not in whole else whole[h] + z
    s.counts = {pr: 3 for pr in PRODUCERS}
    from workload import batch as wbatch, to_table  # noqa: E402

    want = {}
    for pr in PRODUCERS:
        for seq in range(3):
            for h, rows, weights in wbatch(s.seed, pr, seq):
                z = dbsp.ZSet.from_arrow(to_table(h, rows, weights).drop_columns(["weight"]), weights=weights)
                want[h] = z if h not in want else want[h] + z
    assert all(whole[h] == want[h] for h in want)
    with pytest.raises(LookupError):
        s.p.read_input(2)
    s.stop()


def test_failed_append_breaks_the_pipeline_and_recovery_counts_the_push_once(tmp_path, monkeypatch):
    d = str(tmp_path / "d")
    s = Stream(d)
    log = s.p._input
    real = type(log).append

    def append_then_fail(self, *a, **kw):  # the record reaches the log, then the call reports an error
        real(self, *a, **kw)
        raise dbsp.StorageError("simulated EIO after the write")

    monkeypatch.setattr(type(log), "append", append_then_fail)
    with pytest.raises(dbsp.StorageError):
        push_batch(s.p, s.seed, "p0", 0)
    monkeypatch.setattr(type(log), "append", real)
    with pytest.raises(dbsp.DbspError, match="broken"):
        push_batch(s.p, s.seed, "p0", 0)  # the retry is refused in this process...
    s.p.close()
    s.restart()
    assert all(a.duplicate for a in push_batch(s.p, s.seed, "p0", 0))  # ...and after recovery counted once
    push_batch(s.p, s.seed, "p1", 0)
    s.step()
    s.counts = {"p0": 1, "p1": 1}
    s.check()
    s.stop()


def test_filter_now_replays_and_its_predicate_is_part_of_the_fingerprint(tmp_path):
    import time

    from dbsp_core.operators.temporal import filter_now

    def circ(delay_ns: int) -> dbsp.Circuit:
        c = dbsp.Circuit()
        ev = c.input("ev", pa.schema([("id", pa.int64()), ("due", pa.int64())]))
        if delay_ns:
            c.output("due", filter_now(ev, lambda now: pc.field("due") <= now - 1))
        else:
            c.output("due", filter_now(ev, lambda now: pc.field("due") <= now))
        return c

    d = str(tmp_path / "d")
    p = dbsp.Pipeline(circ(0), workers=2, storage=d, checkpoint_interval=None)
    t = time.time_ns()
    p.push("ev", pa.table({"id": list(range(8)), "due": [t + k * 1_000_000 for k in range(8)]}))
    for _ in range(4):
        p.step()
        time.sleep(0.003)
    p.close(checkpoint=False)
    with pytest.raises(CircuitMismatchError):  # same shape, other predicate: refused
        dbsp.Pipeline.open(d, circ(1))
    q = dbsp.Pipeline.open(d, circ(0))  # replays 4 steps with their logged now; the replay check passes
    assert q.stats["replayed_steps"] == 4
    got, _ = integral(q, "due")
    assert got == {(k, t + k * 1_000_000): 1 for k in range(8) if t + k * 1_000_000 <= q.now_ns}
    q.close()


def test_a_consumer_process_reads_the_output_log_while_the_pipeline_runs(tmp_path):
    from dbsp_core.storage.inspect import open_output

    d = str(tmp_path / "d")
    s = Stream(d, segment_bytes=4096, output_retention=2)
    log = open_output(d)  # read-only, no circuit; another process would do the same
    seen = []
    for _ in range(10):
        s.add(1)
        s.step()
        log.refresh()
        for step, z in log.read("by_cat", seen[-1][0] + 1 if seen else 0):
            seen.append((step, z))
        s.p.checkpoint()
    assert [st for st, _ in seen] == list(range(10))  # every step once, in order, while retention drops old ones
    acc = {}
    for _, z in seen:
        for row, w in z.to_dict().items():
            acc[row] = acc.get(row, 0) + w
    assert {r: w for r, w in acc.items() if w} == oracle(s.seed, s.counts)["by_cat"]
    log.refresh()
    assert log.first > 0
    with pytest.raises(ValueError, match="read-only"):
        log.write(log.last, {})
    log.close()
    s.stop()
