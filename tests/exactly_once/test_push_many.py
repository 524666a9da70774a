"""``Pipeline.push_many``: several pushes recorded with one fsync of the input log, validated all before any is recorded, deduplicated and recovered like single pushes, and exactly once across a kill -9 between its records' placement in the log and their fsync."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.errors import SchemaError  # noqa: E402
from workload import BIDS, batch, build_circuit, integral, oracle, to_table  # noqa: E402

SEED = int(os.environ.get("DBSP_PUSH_MANY_SEED", random.randrange(1 << 30)))


def items(seed: int, producer: str, seq: int) -> list[dict]:
    return [{"handle": h, "data": to_table(h, rows, w), "producer": f"{producer}.{k}", "seq": seq}
            for k, (h, rows, w) in enumerate(batch(seed, producer, seq))]


def test_push_many_shares_one_fsync_and_counts_each_push_once(tmp_path):
    print(f"DBSP_PUSH_MANY_SEED={SEED}")
    p = dbsp.Pipeline(build_circuit(), workers=2, storage=str(tmp_path / "d"), checkpoint_interval=None)
    try:
        log = p._input
        f0, n0 = log.fsyncs, len(log)
        acks = p.push_many(items(SEED, "p0", 0) + items(SEED, "p1", 0))
        assert log.fsyncs - f0 == 1, "the pushes of one push_many share one fsync"
        assert len(log) - n0 == len(acks) == 3 and not any(a.duplicate for a in acks)
        assert [(a.producer, a.seq, a.step) for a in acks] == [("p0.0", 0, 0), ("p1.0", 0, 0), ("p1.1", 0, 0)]
        # the control: the same shape pushed one by one costs one fsync each
        f1 = log.fsyncs
        for it in items(SEED, "p0", 1) + items(SEED, "p1", 1):
            p.push(**it)
        assert log.fsyncs - f1 == 3
        # a retry of recorded pairs beside a new one: the old ones are duplicates, only the new one is recorded
        n1 = len(log)
        again = p.push_many(items(SEED, "p0", 1) + items(SEED, "p0", 2))
        assert [a.duplicate for a in again] == [True, False] and len(log) - n1 == 1
        p.step()
        counts = {"p0": 3, "p1": 2}
        for name, want in oracle(SEED, counts).items():
            assert integral(p, name)[0] == want, name
    finally:
        p.close()


def test_push_many_records_nothing_if_any_item_is_bad(tmp_path):
    p = dbsp.Pipeline(build_circuit(), workers=1, storage=str(tmp_path / "d"), checkpoint_interval=None)
    try:
        good = items(SEED, "p1", 0)
        bad = dict(good[0], data={"auction": [1], "nope": [2]}, producer="x", seq=0)
        n0 = len(p._input)
        with pytest.raises(SchemaError):
            p.push_many(good + [bad])
        with pytest.raises(ValueError, match="more than once"):
            p.push_many(good + [dict(good[0])])
        with pytest.raises(TypeError, match="item 1"):
            p.push_many([good[0], ("bids",)])
        with pytest.raises(TypeError):
            p.push_many(good[0])  # one dict, not a list of them
        assert len(p._input) == n0 and not any(p.step().values())
        assert not p.acknowledged("p1.0", 0)  # the refused calls recorded nothing: the pairs are still new
        assert [a.duplicate for a in p.push_many(good)] == [False, False]
        assert p.push_many([]) == []
    finally:
        p.close()


def test_push_many_in_memory_is_the_pushes_in_order():
    c = dbsp.Circuit()
    bids = c.input("bids", BIDS, primary_key=["auction"])
    c.output("latest", bids)
    p = dbsp.Pipeline(c)
    rows = [(1, 10, 5), (1, 11, 6), (2, 12, 7)]
    assert p.push_many([("bids", [r]) for r in rows]) == [None] * 3
    # a keyed table keeps the last row of a key in push order: push_many's order is the pushes' order
    assert p.step()["latest"].to_dict() == {(1, 11, 6): 1, (2, 12, 7): 1}


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import dbsp_core as dbsp
    from dbsp_core.runtime.crashpoints import arm_crashpoint
    from test_push_many import items
    from workload import build_circuit
    p = dbsp.Pipeline(build_circuit(), workers=2, storage={d!r}, checkpoint_interval=None)
    p.push_many(items({seed}, "p0", 0) + items({seed}, "p1", 0))
    p.step()
    arm_crashpoint({crash!r})
    p.push_many(items({seed}, "p0", 1) + items({seed}, "p1", 1))
    print("NOT KILLED", flush=True)
""")


@pytest.mark.parametrize("crash", ["push-enqueued:1", "push-acked:1"])
def test_a_kill_inside_push_many_loses_nothing_and_counts_nothing_twice(tmp_path, crash):
    """Killed with the batch's records placed in the log but not fsynced (push-enqueued), or fsynced but not
    acknowledged (push-acked): the producer retries the batch after recovery, and every push counts once."""
    d = str(tmp_path / "d")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), HERE]))
    env.pop("DBSP_CRASHPOINT", None)
    r = subprocess.run([sys.executable, "-c", CHILD.format(here=HERE, d=d, seed=SEED, crash=crash)],
                       capture_output=True, env=env, timeout=120)
    assert r.returncode == -9, (r.returncode, r.stdout.decode(), r.stderr.decode())  # the kill happened
    p = dbsp.Pipeline.open(d, build_circuit(), checkpoint_interval=None)
    try:
        kept = [p.acknowledged(it["producer"], it["seq"]) for it in items(SEED, "p0", 1) + items(SEED, "p1", 1)]
        if crash.startswith("push-acked"):
            assert kept == [True] * 3  # fsynced before the kill
        assert kept == sorted(kept, reverse=True), f"not a prefix of the batch: {kept}"
        acks = p.push_many(items(SEED, "p0", 1) + items(SEED, "p1", 1))
        assert [a.duplicate for a in acks] == kept
        p.step()
        for name, want in oracle(SEED, {"p0": 2, "p1": 2}).items():
            assert integral(p, name)[0] == want, name
        counted = collections.Counter((r["producer"], s) for step in p.output_steps for r in p.output_inputs(step)
                                      for s in range(r["first_seq"], r["last_seq"] + 1))
        assert set(counted.values()) == {1} and len(counted) == 6
    finally:
        p.close()
