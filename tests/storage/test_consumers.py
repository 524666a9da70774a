"""The consumer registry: records per consumer, acknowledgements that never go back, and output-log truncation
below the lowest acknowledged step (and the retention setting) instead of by step count alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.storage.consumers import ConsumerRegistry
from dbsp_core.storage.directory import read_record
from dbsp_core.storage.formats import CONSUMER_MAGIC, CONSUMERS_DIR
from dbsp_core.storage.inspect import inspect_storage, open_output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("sums", t.group_by("k").agg(s=dbsp.sum("v")))
    return c


def _run(p: dbsp.Pipeline, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        p.push("t", pa.table({"k": list(range(i, i + 40)), "v": [1] * 40}))
        p.step()


def test_truncation_waits_for_the_slowest_consumer(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), workers=2, storage=tmp_path, segment_bytes=4096, checkpoint_interval=None)
    p.consumers.register("fast")
    p.consumers.register("slow")
    _run(p, 30)
    p.checkpoint()
    assert p.output_steps == range(0, 30)  # nobody acknowledged anything: nothing goes
    p.consumers.ack("fast", 30)
    p.consumers.ack("slow", 12)
    p.checkpoint()
    first = p.output_steps.start
    assert 0 < first <= 12  # whole segments below the slow consumer's step only
    assert [s for s, _ in p.read_output("sums", 12)][:1] == [12]
    p.consumers.unregister("slow")
    p.checkpoint()
    assert p.output_steps.start > first and p.output_steps.start <= 30
    p.close()


def test_retention_and_consumers_together(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), storage=tmp_path, segment_bytes=4096, checkpoint_interval=None,
                      output_retention=25)
    p.consumers.register("c")
    _run(p, 30)
    p.consumers.ack("c", 30)
    p.checkpoint()
    assert p.output_steps.start <= 30 - 25  # retention keeps its 25 steps though the consumer needs none
    p.close()


def test_registry_is_durable_and_never_goes_back(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), storage=tmp_path, checkpoint_interval=None)
    assert p.consumers.register("sink-1", from_step=0) == 0
    _run(p, 3)
    assert p.consumers.ack("sink-1", 2) == 2
    assert p.consumers.ack("sink-1", 1) == 2  # an older acknowledgement changes nothing
    p.close()
    rec = read_record(os.path.join(tmp_path, CONSUMERS_DIR, "sink-1"), CONSUMER_MAGIC)
    assert rec == {"name": "sink-1", "next": 2}
    q = dbsp.Pipeline.open(tmp_path, _circuit())
    assert q.consumers.list() == {"sink-1": 2}
    assert q.consumers.register("sink-1", from_step=0) == 2  # registering again: where it really is
    q.close()
    assert inspect_storage(tmp_path)["consumers"] == {"sink-1": 2}


def test_register_below_the_log_and_bad_names(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), storage=tmp_path, segment_bytes=4096, checkpoint_interval=None,
                      output_retention=0)
    _run(p, 30)
    p.checkpoint()
    first = p.output_steps.start
    assert first > 0
    with pytest.raises(LookupError, match="already dropped"):
        p.consumers.register("late", from_step=0, log_first=lambda: p.output_steps.start)
    assert p.consumers.register("late", from_step=first, log_first=lambda: p.output_steps.start) == first
    for bad in ("", ".hidden", "a/b", "LOCK", "x.tmp", 7):
        with pytest.raises(ValueError):
            p.consumers.register(bad)
    with pytest.raises(KeyError):
        p.consumers.ack("nobody", 3)
    p.close()


def test_a_reader_in_another_process_registers_and_acks(tmp_path) -> None:
    p = dbsp.Pipeline(_circuit(), storage=tmp_path, segment_bytes=4096, checkpoint_interval=None)
    _run(p, 20)
    code = (
        "import sys; from dbsp_core.storage.consumers import ConsumerRegistry\n"
        "from dbsp_core.storage.inspect import open_output\n"
        "log = open_output(sys.argv[1]); reg = ConsumerRegistry(sys.argv[1])\n"
        "nxt = reg.register('reader', 0, lambda: (log.refresh(), log.first)[1])\n"
        "n = sum(1 for _ in log.read('sums', nxt)); reg.ack('reader', nxt + n); print(n)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "20", r.stderr
    assert p.consumers.list() == {"reader": 20}
    p.checkpoint()
    first = p.output_steps.start
    assert first > 0
    p.close()
    log = open_output(tmp_path)
    assert log.first == first
    log.close()


def test_registry_alone(tmp_path) -> None:
    reg = ConsumerRegistry(tmp_path)
    os.makedirs(os.path.join(tmp_path, CONSUMERS_DIR))
    open(os.path.join(tmp_path, CONSUMERS_DIR, "a.tmp"), "wb").close()  # a replace killed midway: no record
    assert reg.list() == {} and reg.truncation_bound(5, 10, None) is None
    reg.register("a", 3)
    assert reg.truncation_bound(5, 10, None) == 3 and reg.truncation_bound(2, 10, None) == 2
    assert reg.truncation_bound(5, 10, 9) == 1
