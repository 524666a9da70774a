"""The poison-input workload shared by the StepError tests and their kill -9 child: a circuit whose steps fail on some rows (an int64 sum overflow, a division by zero in a filter, a uint64 sum past uint64, a user function's exception), batches with a few poison ones among them, and a dict model of the views over the batches that were not discarded."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute as pc

import dbsp_core as dbsp

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("d", pa.int64()), ("u", pa.uint64())])
KINDS = ["int64-sum", "divide-by-zero", "uint64-sum", "user-function"]
BIG = 2**62


def _checked(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A user function that refuses a negative k (a stand-in for any exception of user code on bad data)."""
    if batch.num_rows and pc.min(batch.column("k")).as_py() < 0:
        raise ValueError("negative k")
    return batch.select(["k", "v"])


def build_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("sums", t.group_by("k").agg(total=dbsp.sum("v"), utotal=dbsp.sum("u"), n=dbsp.count()))
    c.output("ratios", t.filter(pc.divide(pc.field("v"), pc.field("d")) >= 0).select(k="k", v="v"))
    c.output("checked", t.flat_map(_checked, pa.schema([("k", pa.int64()), ("v", pa.int64())])))
    return c


def good(seed: int, producer: str, seq: int) -> pa.Table:
    """A batch that no step fails on: small values, d != 0, k >= 0."""
    rng = random.Random(f"{seed}/{producer}/{seq}")
    n = rng.randint(1, 6)
    return pa.table({"k": [rng.randint(0, 4) for _ in range(n)], "v": [rng.randint(-50, 50) for _ in range(n)],
                     "d": [rng.choice([1, 2, -3]) for _ in range(n)], "u": [rng.randint(0, 9) for _ in range(n)]},
                    schema=SCHEMA)


def poison(kind: str) -> pa.Table:
    """A batch every step that holds it fails on (with the good batches, whatever they are)."""
    if kind == "int64-sum":  # two rows of 2**62 in one group: the sum leaves int64
        return pa.table({"k": [9, 9], "v": [BIG, BIG], "d": [1, 1], "u": [0, 0]}, schema=SCHEMA)
    if kind == "divide-by-zero":
        return pa.table({"k": [1], "v": [1], "d": [0], "u": [0]}, schema=SCHEMA)
    if kind == "uint64-sum":  # two uint64 values past 2^63 in one group: their sum is past uint64
        return pa.table({"k": [2, 2], "v": [1, 1], "d": [1, 1], "u": [2**63 + 5, 2**63 + 5]}, schema=SCHEMA)
    if kind == "user-function":
        return pa.table({"k": [-1], "v": [1], "d": [1], "u": [0]}, schema=SCHEMA)
    raise ValueError(kind)


def model(batches: list[pa.Table]) -> dict[str, dict]:
    """The integral of every view over ``batches`` (each row weight +1), as ``{view: {row: weight}}``."""
    sums: dict = {}
    ratios: dict = {}
    for b in batches:
        for k, v, d, u in zip(*(b.column(n).to_pylist() for n in SCHEMA.names)):
            t, ut, n = sums.get(k, (0, 0, 0))
            sums[k] = (t + v, ut + u, n + 1)
            if int(v / d) >= 0:  # Arrow's divide of int64 truncates toward zero (small values: exact as floats)
                ratios[(k, v)] = ratios.get((k, v), 0) + 1
    checked = {}
    for b in batches:
        for k, v in zip(b.column("k").to_pylist(), b.column("v").to_pylist()):
            checked[(k, v)] = checked.get((k, v), 0) + 1
    return {"sums": {(k, t, ut, n): 1 for k, (t, ut, n) in sums.items()}, "ratios": ratios, "checked": checked}


def integral(outputs: list[dict]) -> dict[str, dict]:
    """The sum of a sequence of step outputs, per view, as ``{view: {row: weight}}`` without zero weights."""
    acc: dict[str, dict] = {}
    for out in outputs:
        for name, z in out.items():
            a = acc.setdefault(name, {})
            for row, w in z.to_dict().items():
                a[row] = a.get(row, 0) + w
                if a[row] == 0:
                    del a[row]
    return acc
