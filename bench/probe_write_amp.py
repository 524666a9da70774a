"""Where a Nexmark query's batch-file bytes are written under a budget: per trace, per cause and level.

Causes: ``enforce`` (a batch spilled whole between steps, by the level it sat at), ``mergeout`` (a merge output built
on disk, by the level it lands at), ``compact`` (``Trace.compact_spilled``). Then each trace's final files and levels
(level, loose batches, merge in progress) and the merges built on disk by (trace, fan-in, output level). W=1, no merge
thread, 100k-event steps, as bench_spill_nexmark.py's limited child. The bytes are deterministic for a tree.

Run:  python bench/probe_write_amp.py q4 20e6 96.2     # query, events, memory_limit in MiB
      FAN_IN=4 python bench/probe_write_amp.py q7 5e6 33.4
"""
import collections, json, os, sys, time, resource
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dbsp_core as dbsp
from dbsp_core import nexmark
from dbsp_core.runtime.embedded import EmbeddedExecutor
from dbsp_core.trace import spill as sp
from dbsp_core.trace import levels as lv

q, events, limit = sys.argv[1], int(float(sys.argv[2])), float(sys.argv[3])
fan = os.environ.get("FAN_IN")
if fan: lv.Trace.FAN_IN = int(fan)
ex = EmbeddedExecutor(background_merge=False)
p = dbsp.Pipeline(nexmark.circuit(q), executor=ex, memory_limit=int(limit * 2**20))
rec = collections.defaultdict(lambda: collections.Counter())
ctx = {"cause": "enforce"}
orig_switch = sp.BatchStore._switch
names = {}
def tname(t):
    if id(t) not in names:
        names[id(t)] = f"T{len(names)}[{','.join(t.key)}|{','.join(f.name for f in t.schema)}]"
    return names[id(t)]
def where(b):
    for t in ex._all_traces():
        for lvl, level in enumerate(t._by_level):
            for e in level.loose:
                if e[1] is b: return tname(t), lvl, e[2]
            if level.merge is not None:
                for e in level.merge.inputs:
                    if e[1] is b: return tname(t), lvl, e[2]
        for x in t.pending:
            if x is b: return tname(t), -1, 0
    return "?", -2, 0
def sw(self, b, name, path, size, f=None):
    t, lvl, w = where(b)
    rec[t][(ctx["cause"], lvl)] += size
    return orig_switch(self, b, name, path, size, f)
sp.BatchStore._switch = sw
orig_so = sp.BatchStore.spill_output
def so(self, out, cursor):
    ctx["cause"] = "mergeout"
    try: return orig_so(self, out, cursor)
    finally: ctx["cause"] = "enforce"
sp.BatchStore.spill_output = so
orig_cs = lv.Trace.compact_spilled
def cs(self):
    ctx["cause"] = "compact"
    try: return orig_cs(self)
    finally: ctx["cause"] = "enforce"
lv.Trace.compact_spilled = cs
# merges: record fan-in and whether on disk
merges = collections.Counter()
orig_init = lv._Merge.__init__
def mi(self, inputs, store=None, row_hashes=True):
    orig_init(self, inputs, store, row_hashes)
    if self.cursor.mapping is not None:
        tr = [t for t in ex._all_traces() if any(e[1] is inputs[0][1] for lvl in t._by_level for e in lvl.loose + (lvl.merge.inputs if lvl.merge else ()))]
        merges[(tname(tr[0]) if tr else "?", len(inputs), lv.level_of(self.work))] += 1
lv._Merge.__init__ = mi
next(nexmark.generate(1, seed=0))
c0 = time.process_time()
for b in nexmark.generate(events, seed=0, batch=100_000):
    for n, t in b.items(): p.push(n, t)
    p.step()
cpu = time.process_time() - c0
store = ex.batch_store
final = collections.Counter()
for t in ex._all_traces():
    for b in t._levels() + t.pending:
        f = store.file_of(b)
        if f is not None: final[tname(t)] += f.size
print("cpu", round(cpu, 1), "written MiB", store.stats["bytes_written"] >> 20, "disk", store.disk_bytes() >> 20, "compactions", store.stats["compactions"])
for t in sorted(rec):
    tot = sum(rec[t].values())
    print(f"{t}: written {tot/2**20:.0f} MiB")
    for k, v in sorted(rec[t].items()):
        print("    ", k, f"{v/2**20:.1f}")
for t in ex._all_traces():
    print(tname(t), "final MiB", final[tname(t)]>>20, "levels", [(l, len(lo), m) for l, lo, m in t.levels()], "spilled rows", sum(len(b) for b in t._levels() if store.is_spilled(b)))
for k, v in sorted(merges.items()): print("merge on disk", k, v)
p.close()
