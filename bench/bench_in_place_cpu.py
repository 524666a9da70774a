"""CPU seconds in write_in_place (posix) for merges built on disk: 16 inserts of 400k rows into a trace under a 1-byte
budget (every merge on disk, its output made its batch file in place). Usage: python bench/bench_in_place_cpu.py
[durable]. Prints the CPU seconds inside write_in_place, the files it made and their bytes, and the process's CPU."""
import sys, time, tempfile
import numpy as np, pyarrow as pa
from dbsp_core import ZSet
from dbsp_core.trace import Trace
from dbsp_core.trace import spill
from dbsp_core.trace.spill import BatchStore, spilling
BatchStore.FILE_MERGE_MIN = 0
acc = [0.0, 0, 0]
real = spill.write_in_place
def timed(*a, **k):
    t = time.process_time(); r = real(*a, **k); acc[0] += time.process_time() - t
    if r is not None: acc[1] += 1; acc[2] += r
    return r
spill.write_in_place = timed
rng = np.random.default_rng(1)
schema = pa.schema([("k", pa.int64()), ("a", pa.int64()), ("b", pa.int64())])
t = Trace(schema, ("k",))
durable = len(sys.argv) > 1 and sys.argv[1] == "durable"
t0 = time.process_time()
with tempfile.TemporaryDirectory() as tmp, BatchStore(1, directory=tmp, durable=durable) as store, spilling(store):
    for i in range(16):
        n = 400_000
        z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 1 << 40, n), "a": rng.integers(0, 9, n), "b": rng.integers(0, 9, n)}))
        t.insert(z.index_by(["k"]))
        store.enforce(); store.settle()
    st = dict(store.stats)
print(f"in_place_cpu={acc[0]:.3f}s files={acc[1]} bytes={acc[2]>>20}MiB total_cpu={time.process_time()-t0:.2f}s written_in_place={st['written_in_place']}")
