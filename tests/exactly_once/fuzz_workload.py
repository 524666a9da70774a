"""The workload of the file-damage fuzz test: a small circuit, named pushes, the storage directories it damages (embedded, staged, and one stopped in the middle of a layout change), and a dict model of the views."""

from __future__ import annotations

import os
import random

import pyarrow as pa

import dbsp_core as dbsp

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
STEPS, PENDING = 10, 2
ACKED = [(pr, s) for s in range(STEPS + PENDING) for pr in ("a", "b")]


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("sums", t.group_by("k").agg(total=dbsp.sum("v"), n=dbsp.count()))
    c.output("big", t.filter(pa.compute.field("v") > 50))
    return c


def batch(producer: str, seq: int) -> pa.Table:
    rng = random.Random(f"fuzz/{producer}/{seq}")
    n = rng.randint(1, 4)
    return pa.table({"k": [rng.randint(0, 5) for _ in range(n)], "v": [rng.randint(0, 99) for _ in range(n)]},
                    schema=SCHEMA)


def model(pushes: list[tuple[str, int]]) -> dict[str, dict]:
    sums: dict = {}
    big: dict = {}
    for pr, seq in pushes:
        t = batch(pr, seq)
        for k, v in zip(t.column("k").to_pylist(), t.column("v").to_pylist()):
            tot, n = sums.get(k, (0, 0))
            sums[k] = (tot + v, n + 1)
            if v > 50:
                big[(k, v)] = big.get((k, v), 0) + 1
    return {"sums": {(k, tot, n): 1 for k, (tot, n) in sums.items()}, "big": big}


def build(d: str, kind: str) -> None:
    """STEPS steps (a checkpoint after the second and the sixth), then PENDING steps' pushes never stepped;
    closed without a checkpoint, so open replays steps and takes the pending pushes."""
    from dbsp_core.runtime.staged import StagedExecutor

    p = dbsp.Pipeline(circuit(), workers=2, storage=d, checkpoint_interval=None, segment_bytes=4096,
                      executor=StagedExecutor() if kind == "staged" else None)
    for s in range(STEPS + PENDING):
        for pr in ("a", "b"):
            p.push("t", batch(pr, s), producer=pr, seq=s)
        if s < STEPS:
            p.step()
        if s in (1, 5):
            p.checkpoint()
    p.close(checkpoint=False)


def build_mid_rescale(d: str) -> None:
    """An embedded directory whose change to 3 workers stopped after the first state database was committed:
    it holds RESCALE (the next open finishes or undoes the change)."""
    import dbsp_core.runtime.driver as driver_module

    build(d, "embedded")
    hits = [0]
    real = driver_module.crashpoint

    def crash(name: str) -> None:
        if name == "rescale-commit":
            hits[0] += 1
            if hits[0] == 2:
                raise KeyboardInterrupt("stop in the middle of the layout change")

    driver_module.crashpoint = crash
    try:
        dbsp.Pipeline.open(d, circuit(), 3, checkpoint_interval=None)
    except KeyboardInterrupt:
        pass
    finally:
        driver_module.crashpoint = real
    assert os.path.exists(os.path.join(d, "RESCALE")), "the layout change did not stop in the middle"


def minus(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    """Z-set difference per view: the integral of the changes from a step is Q(all) - Q(before it)."""
    out = {}
    for name in a:
        d = dict(a[name])
        for row, w in b[name].items():
            d[row] = d.get(row, 0) - w
            if not d[row]:
                del d[row]
        out[name] = d
    return out
