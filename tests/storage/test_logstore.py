"""The input and output logs as segment objects in an object store (dbsp_core.storage.logstore) on moto's S3 server:
logs rebuilt on an empty disk equal the originals, pushes share PUTs, retention keeps what is needed, a store that
stays down stops acknowledging, and a pipeline under random store faults of every kind loses no acknowledged push
and counts none twice (against a dict model), never reading a partial segment."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
from collections import Counter

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import CorruptionError, DbspError, StoreUnavailableError
from dbsp_core.storage import retry
from dbsp_core.storage.location import resolve
from dbsp_core.storage.logstore import LogStore, decode_segment, parse_segment_name
from dbsp_core.storage.outputlog import OutputLog
from dbsp_core.storage.steplog import StepLog
from dbsp_core.storage.store_faults import KINDS, StoreFaults
from dbsp_core.zset import ZSet

SEED = int(os.environ.get("DBSP_STORE_FAULT_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
FAST = retry.RetryPolicy(attempts=4, first_delay_s=0.001, max_delay_s=0.005)


@pytest.fixture()
def where(s3_server):
    return resolve(s3_server.uri(s3_server.bucket(), "pipe/log"))


def _all_records(log: StepLog) -> list:
    return list(log.iter_from(0))


def _segments(store: LogStore, kind: str) -> list:
    """Every segment object of ``kind`` decoded (CorruptionError for a partial or damaged one)."""
    d = store.dir(kind)
    out = []
    for info in d.files(recursive=False):
        seg = parse_segment_name(info.path)
        assert seg is not None, f"an object that is no segment: {info.path}"
        with d.fs.open_input_stream(info.path) as f:
            out.append((seg, decode_segment(f.read(), seg, kind, info.path)))
    return out


def test_logs_rebuilt_on_an_empty_disk_equal_the_originals(where, tmp_path):
    rng = random.Random(SEED)
    print(f"log store: seed {SEED} (replay: DBSP_STORE_FAULT_SEED={SEED})")
    store = LogStore(where, group_commit_s=0.001)
    inp = StepLog(tmp_path / "a" / "input", ship=store.restore("input", tmp_path / "a" / "input"))
    step = 0

    def pusher(t: int) -> None:
        for i in range(8):
            inp.append(step, f"h{t}", rng.randbytes(rng.randrange(0, 200)), producer=f"p{t}", seq=i)

    for step in range(4):
        threads = [threading.Thread(target=pusher, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        inp.append(step, "\x00division", b"div")
    shipped = inp._log.shipper.stats
    original = _all_records(inp)
    inp.close()
    assert len(original) == 4 * 25 and shipped.records == len(original)
    assert shipped.segments < shipped.records  # concurrent appends shared PUTs (group commit)

    out = OutputLog(str(tmp_path / "a" / "output"), {"o": SCHEMA},
                    ship=store.restore("output", tmp_path / "a" / "output"))
    changes = [ZSet.from_rows([(rng.randrange(9), s)], SCHEMA, weights=[rng.choice([1, -1, 2])]) for s in range(6)]
    for s, z in enumerate(changes):
        out.write(s, {"o": z}, [{"handle": "t", "producer": "p", "first_seq": s, "last_seq": s, "pushes": 1}])
    out.close()

    # an empty disk: nothing of tmp_path/a is read from here on
    shutil.rmtree(tmp_path / "a")
    inp2 = StepLog(tmp_path / "b" / "input", ship=store.restore("input", tmp_path / "b" / "input"))
    assert _all_records(inp2) == original  # every record, in the same order
    inp2.append(4, "h0", b"after", producer="p0", seq=99)  # the rebuilt log goes on where the store's ended
    inp2.close()
    out2 = OutputLog(str(tmp_path / "b" / "output"), {"o": SCHEMA},
                     ship=store.restore("output", tmp_path / "b" / "output"))
    assert (out2.first, out2.last) == (0, 6)
    assert [out2.get(s)["o"].to_dict() for s in range(6)] == [z.to_dict() for z in changes]
    assert out2.inputs_of(3) == [{"handle": "t", "producer": "p", "first_seq": 3, "last_seq": 3, "pushes": 1}]
    out2.close()

    inp3 = StepLog(tmp_path / "c", ship=store.restore("input", tmp_path / "c", from_step=3))
    got = _all_records(inp3)
    inp3.close()
    assert got[-1].payload == b"after" and {r.step for r in got} <= {0, 1, 2, 3, 4} and 3 in {r.step for r in got}
    assert [r for r in original if r.step >= 3] == [r for r in got if 3 <= r.step < 4]


def test_retention_deletes_covered_segments_and_keeps_the_chain(where, tmp_path):
    store = LogStore(where, group_commit_s=0)
    inp = StepLog(tmp_path / "input", ship=store.restore("input", tmp_path / "input"))
    for step in range(6):
        inp.append(step, "t", f"r{step}".encode())  # one PUT each: 6 segments
    inp.close()
    chain, _ = store.listing("input")
    assert [(s.lo_step, s.hi_step) for s in chain] == [(s, s) for s in range(6)]
    assert store.retain("input", 4) == 4
    assert [s.lo_step for s in store.listing("input")[0]] == [4, 5]
    assert store.retain("input", 100) == 1  # the newest segment stays: the next writer continues after it
    inp = StepLog(tmp_path / "input", ship=store.restore("input", tmp_path / "input"))
    assert [r.payload for r in _all_records(inp)] == [b"r5"]
    inp.append(6, "t", b"r6")
    inp.close()
    assert [(s.first, s.last) for s in store.listing("input")[0]] == [(6, 6), (7, 7)]


def test_a_superseded_put_that_landed_late_is_not_read(where, tmp_path):
    """A PUT of a dead writer that lands after a new writer listed the store: the new writer's segment at that LSN
    wins (invariant 4), and retention removes the loser before the chain's start passes it."""
    store = LogStore(where, group_commit_s=0)
    inp = StepLog(tmp_path / "1", ship=store.restore("input", tmp_path / "1"))
    inp.append(0, "t", b"a")
    inp.close()
    new = StepLog(tmp_path / "2", ship=store.restore("input", tmp_path / "2"))  # generation 2, LSN 2 next
    from dbsp_core.storage.logstore import encode_segment
    name, parts = encode_segment("input", 2, 1, [(0, b"t", b"", 0, b"zombie")])  # generation 1's late PUT
    where.join("input").write_bytes(b"".join(parts), where.join("input", name).path)
    new.append(1, "t", b"b")
    new.close()
    chain, off = store.listing("input")
    assert [s.gen for s in chain] == [1, 2] and [s.gen for s in off] == [1]
    log = StepLog(tmp_path / "3", ship=store.restore("input", tmp_path / "3"))
    assert [r.payload for r in _all_records(log)] == [b"a", b"b"]
    log.close()
    assert store.retain("input", 1) == 1  # the first segment; the superseded one starts where the chain now does
    assert store.listing("input") == (chain[1:], off)
    log = StepLog(tmp_path / "4", ship=store.restore("input", tmp_path / "4"))
    log.append(2, "t", b"c")
    log.close()
    assert [r.payload for r in _all_records(StepLog(tmp_path / "4", readonly=True))] == [b"b", b"c"]
    assert store.retain("input", 2) == 2  # the segment of step 1, and the superseded one below the chain's start
    assert [s.lo_step for s in store.listing("input")[0]] == [2] and store.listing("input")[1] == []


def test_a_damaged_segment_is_refused(where, tmp_path):
    store = LogStore(where, group_commit_s=0)
    inp = StepLog(tmp_path / "1", ship=store.restore("input", tmp_path / "1"))
    inp.append(0, "t", b"payload")
    inp.close()
    (seg, _), = _segments(store, "input")
    with where.fs.open_input_stream(seg.path) as f:
        blob = bytearray(f.read())
    blob[-3] ^= 0xFF
    where.write_bytes(bytes(blob), seg.path)
    with pytest.raises(CorruptionError, match="checksum"):
        store.restore("input", tmp_path / "2")
    where.write_bytes(bytes(blob[:len(blob) // 2]), seg.path)  # a partial object: refused, never read
    with pytest.raises(CorruptionError):
        store.restore("input", tmp_path / "2")


def test_a_store_that_stays_down_stops_acknowledging(s3_server, tmp_path):
    bucket = s3_server.bucket()
    faults = StoreFaults(s3_server.filesystem())
    store = pafs.SubTreeFileSystem(f"{bucket}/pipe", faults.fs)
    # store calls retried 4 times within milliseconds (the default waits up to seconds)
    fast = dbsp.StoreOptions(attempts=4, first_delay_s=0.001, max_delay_s=0.005)
    p = dbsp.Pipeline(_circuit(), storage=store, cache_dir=str(tmp_path / "c1"), checkpoint_interval=None,
                      store_options=fast)
    assert p.push("t", {"k": [1], "v": [10]}, producer="p", seq=0).duplicate is False
    faults.down()
    with pytest.raises(StoreUnavailableError, match=r"failed 4 times"):
        p.push("t", {"k": [2], "v": [20]}, producer="p", seq=1)
    with pytest.raises(DbspError, match="broken"):  # nothing more is acknowledged
        p.push("t", {"k": [3], "v": [30]}, producer="p", seq=2)
    assert faults.injected[("put", "error")] == 4
    try:
        p.close()
    except StoreUnavailableError:
        pass
    faults.down(False)
    p = dbsp.Pipeline.open(store, _circuit(), cache_dir=str(tmp_path / "c2"), checkpoint_interval=None)
    assert p.acknowledged("p", 0) and not p.acknowledged("p", 1)
    p.push("t", {"k": [2], "v": [20]}, producer="p", seq=1)
    p.step()
    assert sorted(p.view("s").to_pylist(), key=lambda r: r["k"]) == [{"k": 1, "n": 1, "s": 10}, {"k": 2, "n": 1, "s": 20}]
    p.close()


def test_records_are_acknowledged_only_after_a_check_that_saw_them_landed(where, tmp_path):
    """logstore invariant 2b: threads submit records; every record a ``wait`` returned for was in a segment object
    listed in the store when a check that acknowledged it started; once the check refuses (a newer writer), no wait
    returns and no PUT starts after the refusal."""
    from dbsp_core.errors import StoreFencedError

    store = LogStore(where, group_commit_s=0.001, policy=FAST)
    d = store.dir("input")
    checks: list[int] = []  # per check: the highest LSN landed in the store when it started
    refuse_after = random.Random(SEED + 7).randrange(3, 12)

    def fence(what: str) -> None:
        segs = [parse_segment_name(i.path) for i in d.files(recursive=False)]
        checks.append(max((s.last for s in segs if s is not None), default=0))
        if len(checks) > refuse_after:
            raise StoreFencedError(f"a newer writer ({what})")

    shipper = store.restore("input", str(tmp_path / "input"), fence=fence)
    acked: list[int] = []
    lock = threading.Lock()

    def pusher(t: int) -> None:
        for i in range(40):
            lsn = shipper.submit(0, b"t", b"p%d" % t, i, b"x" * 10)
            try:
                shipper.wait(lsn)
            except StoreFencedError:
                return
            with lock:
                acked.append(lsn)

    ths = [threading.Thread(target=pusher, args=(t,)) for t in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    with pytest.raises(StoreFencedError):
        shipper.close()
    print(f"DBSP_STORE_FAULT_SEED={SEED}: {len(checks)} checks, {len(acked)} records acknowledged before the refusal")
    assert acked and len(checks) == refuse_after + 1
    assert max(acked) <= checks[refuse_after - 1], "a record acknowledged without a check that saw it landed"
    assert shipper.durable_lsn == max(acked)
    landed = max(s.last for s in (parse_segment_name(i.path) for i in d.files(recursive=False)) if s)
    assert landed <= checks[-1] + 4, "PUTs went on after the refusal"  # the one in flight: a record per thread


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("s", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")), materialized=True)
    return c


def _fault_run(s3_server, tmp_path, pushes: int) -> None:
    """Pushes, steps and checkpoints of a pipeline whose logs go to a store failing at random (every kind, and each
    kind at least once by plan); every failure ends in a reopen from the store with the local logs deleted; every
    push is retried until acknowledged. The result must count each push exactly once."""
    rng = random.Random(SEED)
    print(f"store faults: seed {SEED} (replay: DBSP_STORE_FAULT_SEED={SEED})")
    bucket = s3_server.bucket()
    plan = {("put", 3): "landed", ("put", 5): "timeout", ("put", 7): "error", ("put", 9): "delay",
            ("get", 1): "error", ("get", 2): "timeout", ("get", 3): "delay",
            ("list", 2): "error", ("list", 4): "timeout", ("list", 6): "delay",
            ("delete", 1): "error", ("delete", 2): "timeout", ("delete", 3): "delay"}
    faults = StoreFaults(s3_server.filesystem(), seed=SEED, rate=0.08, plan=plan, delay_s=0.002, timeout_s=0.003)
    store = pafs.SubTreeFileSystem(f"{bucket}/pipe", faults.fs)
    caches = iter(range(10**6))
    model: Counter = Counter()  # key -> (count, sum) of every push acknowledged
    sums: Counter = Counter()
    acked = reopened = 0

    def open_pipeline() -> dbsp.Pipeline:
        nonlocal reopened
        while True:
            cache = str(tmp_path / f"cache-{next(caches)}")  # each process starts with an empty local disk
            try:
                return dbsp.Pipeline(_circuit(), storage=store, cache_dir=cache, checkpoint_interval=None)
            except (StoreUnavailableError, OSError):
                reopened += 1  # the store failed the reopen too: try again

    p = open_pipeline()
    seq = duplicates = 0
    rows = {}
    # the store goes down for a while: first every PUT lands and fails (the push is in the store but not
    # acknowledged), then plain failures, then at random
    outages = {pushes // 4: "landed", pushes // 2: "error"}
    while seq < pushes:
        if seq not in rows:
            rows[seq] = (rng.randrange(8), rng.randrange(-50, 50))
            outage = outages.pop(seq, "timeout" if rng.random() < 0.03 else None)
            if outage is not None:
                faults.down(kind=outage)
        k, v = rows[seq]
        try:
            ack = p.push("t", {"k": [k], "v": [v]}, producer="gen", seq=seq)
            model[k] += 1
            sums[k] += v
            acked += 1
            duplicates += ack.duplicate
            assert ack.seq == seq
            seq += 1
            if rng.random() < 0.2:
                p.step()
            if seq % 6 == 0:
                p.checkpoint()  # uploads the state and a manifest; retention deletes the segments it covers
        except (StoreUnavailableError, DbspError) as e:
            assert isinstance(e, StoreUnavailableError) or "broken" in str(e), e
            try:
                p.close(checkpoint=False)
            except BaseException:
                pass
            reopened += 1
            faults.down(False)
            p = open_pipeline()  # seq stays: the push is retried (a duplicate if its segment had landed)
    faults.set_rate(0)
    faults.plan.clear()
    p.step()
    got = {r["k"]: (r["n"], r["s"]) for r in p.view("s").to_pylist()}
    integrated: Counter = Counter()
    for _, z in p.read_output("s"):  # the output log, rebuilt from the store at each reopen, holds every step once
        for row, w in z.to_dict().items():
            integrated[row] += w
    p.close()
    expected = {k: (model[k], sums[k]) for k in model}
    print(f"store faults: {acked} acknowledged pushes ({duplicates} of them retries of a push whose segment had "
          f"landed), {reopened} reopens; injected by kind "
          f"{faults.injected_by_kind()}, by operation and kind {dict(faults.injected)}")
    assert got == expected  # 0 lost, 0 doubled
    assert {(k, n, s): 1 for k, (n, s) in expected.items()} == +integrated
    for kind in KINDS:
        assert faults.injected_by_kind().get(kind, 0) > 0, f"no {kind} fault was injected: the run tests less"
    assert faults.ops["delete"] > 0  # retention ran (under faults too)
    assert reopened >= 2 and duplicates >= 1  # the outages happened, and a landed push was recovered, not redone
    for kind in ("input", "output"):  # every object in the store is a whole, valid segment
        assert _segments(LogStore(resolve(f"{bucket}/pipe/log", s3_server.filesystem())), kind)


def test_pipeline_logs_restored_on_an_empty_disk(s3_server, tmp_path):
    """A pipeline on the store, killed without a checkpoint after its last pushes (the process's disk is gone): a
    new one on an empty cache recovers every acknowledged push from the input log's segments, and its output log
    equals the first one's."""
    uri = s3_server.uri(s3_server.bucket(), "pipe")
    p = dbsp.Pipeline(_circuit(), storage=uri, cache_dir=str(tmp_path / "c1"), checkpoint_interval=None)
    for i in range(6):
        p.push("t", {"k": [i % 3], "v": [i]}, producer="g", seq=i)
        if i == 2:
            p.step()
            p.checkpoint()
    p.step()
    p.push("t", {"k": [7], "v": [70]}, producer="g", seq=6)  # acknowledged, not in any step yet
    before = [(s, z.to_dict()) for s, z in p.read_output("s")]
    p._shutdown()  # as a kill: no checkpoint, no close of the logs
    shutil.rmtree(tmp_path / "c1")
    q = dbsp.Pipeline.open(uri, _circuit(), cache_dir=str(tmp_path / "c2"), checkpoint_interval=None)
    assert [(s, z.to_dict()) for s, z in q.read_output("s")] == before
    assert q.acknowledged("g", 6) and q.stats["replayed_steps"] == 1 and q.stats["recovered_pushes"] == 1
    q.step()
    assert {r["k"]: (r["n"], r["s"]) for r in q.view("s").to_pylist()} == {0: (2, 3), 1: (2, 5), 2: (2, 7),
                                                                            7: (1, 70)}
    q.close()


def test_store_faults_lose_no_acknowledged_push(s3_server, tmp_path):
    _fault_run(s3_server, tmp_path, pushes=30)


@pytest.mark.slow
def test_store_faults_lose_no_acknowledged_push_long(s3_server, tmp_path):
    _fault_run(s3_server, tmp_path, pushes=600)


_RESTORE_PEAK = """
import os, sys
from dbsp_core.storage.location import resolve
from dbsp_core.storage.logstore import LogStore

def status(field):
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(field + ":"))

store, local = sys.argv[1], sys.argv[2]
s = LogStore(resolve("file://" + store))
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
s.restore("input", local).close()
print(status("VmHWM") - base)
"""


def test_restore_memory_does_not_grow_with_the_log(tmp_path):
    """Rebuilding a local log from its segment objects writes it out segment by segment: the process's peak RSS
    during the rebuild of a 64 MiB log stays under half of it (it held the whole log before the last record)."""
    store = LogStore(resolve("file://" + str(tmp_path / "store")), group_commit_s=0)
    log = StepLog(str(tmp_path / "input"), ship=store.restore("input", str(tmp_path / "input")))
    payload = os.urandom(1 << 20)
    for i in range(64):
        log.append(i, "t", payload)
    log.close()
    r = subprocess.run([sys.executable, "-c", _RESTORE_PEAK, str(tmp_path / "store"), str(tmp_path / "again")],
                       capture_output=True, text=True, check=True)
    peak = int(r.stdout.strip())
    print(f"peak RSS rebuilding a 64 MiB log: +{peak >> 20} MiB")
    assert peak < 32 << 20
    again = StepLog(str(tmp_path / "again"))
    try:
        assert [(r.step, r.payload) for r in again.iter_from(0)] == [(i, payload) for i in range(64)]
    finally:
        again.close()
