"""The first small step after a bulk load (EmbeddedExecutor._compact_after_load, trace invariant 15): a distinct under
a 100 MiB budget loads N random rows in 1M-row steps, then runs 101 1k-row steps; prints the load's time, the first
small step's (which compacts the tiered spilled batches), and the mean and p99 of the next 100. Modes: ``auto`` (the
engine's own compaction), ``settle`` (settle_merges called after the load, as the benchmarks do), ``none`` (the hook
off: the tiered batches stay). ``python bench/probe_compaction.py 20000000 auto``."""
import sys, time, resource, numpy as np, pyarrow as pa, dbsp_core as dbsp
from dbsp_core.runtime.embedded import EmbeddedExecutor
N = int(sys.argv[1]); explicit = sys.argv[2] == "settle"
if sys.argv[2] == "none": EmbeddedExecutor._compact_after_load = lambda self, rows: None
S = pa.schema([("k", pa.int64()), ("v", pa.int64())])
c = dbsp.Circuit(); c.output("d", c.input("t", S).distinct())
p = dbsp.Pipeline(c, memory_limit="100MiB")
rng = np.random.default_rng(1)
t0 = time.perf_counter()
for _ in range(N // 1_000_000):
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 1_000_000), "v": rng.integers(0, 3, 1_000_000)}, schema=S)); p.step()
load = time.perf_counter() - t0
store = p.executor.batch_store
if explicit:
    t0 = time.perf_counter(); p.executor.settle_merges(); settle = time.perf_counter() - t0
else:
    settle = 0.0
ts = []
for _ in range(101):
    p.push("t", pa.table({"k": rng.integers(0, 1 << 40, 1000), "v": rng.integers(0, 3, 1000)}, schema=S))
    t0 = time.perf_counter(); p.step(); ts.append(time.perf_counter() - t0)
c0 = resource.getrusage(resource.RUSAGE_SELF)
rest = np.array(ts[1:]) * 1000
print(f"{sys.argv[2]}: load {load:.1f}s settle {settle:.2f}s first small step {ts[0]*1000:.0f} ms; next 100: mean {rest.mean():.2f} ms p99 {np.percentile(rest,99):.2f} ms; compactions {store.stats['compactions']}")
p.close()
