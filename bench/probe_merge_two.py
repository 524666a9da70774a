"""CPU of one two-input merge (``merge_cursor`` + ``step`` + ``merged``) of two indexed batches of ``n`` rows each,
int64 or string keys: the k = 2 route of the MergeCursor (bindings/merge.pxi: the two-way kernel
``dbsp_merge_cursor_step``, or the k-way one ``dbsp_merge_k_step`` in a tree built with that route) compared.

    python bench/probe_merge_two.py int|str N REPS      (prints CPU ms per merge, process time)
"""
import os, sys, time, numpy as np, pyarrow as pa
from dbsp_core.zset import ZSet, merge_cursor, merged
kind, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(5)
def batch(seed):
    r = np.random.default_rng(seed)
    k = r.integers(0, 4 * n, n)
    kc = pa.array(k) if kind == "int" else pa.array([f"key{x:09d}" for x in k.tolist()])
    t = pa.table({"k": kc, "v": r.integers(0, 1000, n)})
    return ZSet.from_arrow(t).index_by(["k"])
a, b = batch(1), batch(2)
m = merge_cursor(a, b); m.step(1 << 62); merged(a, m)  # warm (views, fences)
t0 = time.process_time()
for _ in range(reps):
    m = merge_cursor(a, b)
    m.step(1 << 62)
    merged(a, m)
dt = time.process_time() - t0
print(f"{kind} n={n} reps={reps} cpu_ms_per_merge={1000 * dt / max(reps, 1):.3f}")
