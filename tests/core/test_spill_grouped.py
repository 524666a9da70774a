"""The spill store writing batch file format 2 (row groups, read by pread: spill.py invariant 18, groupedbatch.py): a
trace's reads of some keys and whole reads against a dict model, copies of whole reads emptied by the next enforce and
counted meanwhile, pipelines against the same steps in memory, a checkpoint naming format-2 files reopened without
reading their rows, a store holding both formats, and the C decoder's read buffer bounded by the budget."""

from __future__ import annotations

import gc
import os
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core import ZSet, _storage
from dbsp_core.storage.formats import BATCH_FILE_GROUPED_VERSION, SPILL_DIR
from dbsp_core.storage.inspect import inspect_storage
from dbsp_core.trace import Trace, groupedbatch, groupedfile
from dbsp_core.trace.groupedfile import file_version
from dbsp_core.trace.spill import MAP_UNIT, BatchStore, spilling

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])


def _rows(rng: random.Random, n: int, keys: int) -> list[tuple]:
    return [(rng.randrange(keys), rng.choice(["a", "bb", "", "c" * 40]), rng.randrange(5)) for _ in range(n)]


def _dict(z: ZSet) -> Counter:
    return Counter({r: w for r, w in z.to_dict().items() if w})


def test_a_trace_spilled_in_format_2_reads_as_the_model(monkeypatch) -> None:
    """Random inserts and deletions into a trace whose every batch spills to a format-2 file: lookups, key sums,
    weights of rows and whole reads equal the dict model's; a whole read's copy counts in memory until the next
    enforce empties it, and a read of some keys makes none."""
    monkeypatch.setattr(BatchStore, "GROUPED_FROM", 1)
    monkeypatch.setattr(BatchStore, "ASYNC_BYTES", 1 << 40)  # written on this thread: switched by this enforce
    rng = random.Random(SEED)
    t = Trace(SCHEMA, ("k",))
    model: Counter = Counter()
    with BatchStore(1) as store, spilling(store):
        for step in range(6):
            ins = _rows(rng, 300, 60)
            dels = rng.sample(sorted(model.elements()), min(40, sum(model.values()))) if model else []
            z = ZSet.from_rows(ins + dels, SCHEMA, weights=[1] * len(ins) + [-1] * len(dels))
            t.insert(z.index_by(["k"]))
            model.update(Counter(ins))
            model.subtract(Counter(dels))
            model = +model
            store.enforce()
            grouped = [b for b in t._levels() if store.grouped_of(b) is not None]
            assert grouped and all(type(b) is groupedbatch.GroupedBatch for b in grouped), f"step {step}"
            assert not any(groupedbatch.copied_bytes(b) for b in grouped)
            before = groupedbatch.COPIES["reads"]
            store.PREFETCH = "on" if step % 2 else "off"  # (odd steps: the groups' pages asked for first, WILLNEED)
            probe = ZSet.from_rows([(k, "", 0) for k in rng.sample(range(70), 12)], SCHEMA).index_by(["k"])
            hashes = np.sort(probe.key_hash)
            got: Counter = Counter()
            for b in t.lookup(hashes):
                got.update(b.zset.to_dict())
            want = Counter({r: w for r, w in model.items() if r[0] in {k for k, _, _ in probe.zset.to_dict()}})
            assert +got == want, f"step {step}: lookup"
            sums = t.key_sums(probe.zset.data, ["k"], probe.key_hash, np.arange(len(probe), dtype=np.int64), ["v"])
            keys = probe.zset.data.column("k").to_pylist()
            assert sums[:, 0].tolist() == [sum(r[2] * w for r, w in model.items() if r[0] == k) for k in keys]
            assert groupedbatch.COPIES["reads"] == before, "a read of some keys copied a grouped batch whole"
            assert store.stats["grouped_lookups"] > 0
            assert _dict(t.consolidated().zset) == model, f"step {step}: whole read"
            store.enforce()  # (empties the copy consolidated() made)
            assert not any(groupedbatch.copied_bytes(b) for b in t._levels())
            mem_before = store.memory()[0]
            for b in t._levels():
                b.key_hash  # noqa: B018 (a whole read: every grouped batch's rows copied)
            copied = sum(groupedbatch.copied_bytes(b) for b in grouped)
            assert copied > 0 and store.memory()[0] >= mem_before + copied
            store.enforce()
            assert not any(groupedbatch.copied_bytes(b) for b in t._levels())
    assert store.stats["grouped_files_written"] > 0 and store.stats["grouped_prefetched"] > 0


def test_match_weights_and_walks_over_format_2(monkeypatch) -> None:
    """A whole-row trace (distinct's shape) spilled to format 2: match_weights of a change is the model's weights."""
    monkeypatch.setattr(BatchStore, "GROUPED_FROM", 1)
    monkeypatch.setattr(BatchStore, "ASYNC_BYTES", 1 << 40)
    rng = random.Random(SEED + 1)
    key = tuple(SCHEMA.names)
    t = Trace(SCHEMA, key)
    model: Counter = Counter()
    with BatchStore(1) as store, spilling(store):
        for _ in range(4):
            ins = _rows(rng, 400, 50)
            t.insert(ZSet.from_rows(ins, SCHEMA).index_by(list(key)))
            model.update(Counter(ins))
            store.enforce()
            change = ZSet.from_rows(rng.sample(sorted(model), 15) + [(77, "zz", 9)], SCHEMA).index_by(list(key))
            before = groupedbatch.COPIES["reads"]
            got = t.match_weights(change)
            rows = [tuple(r.values()) for r in change.zset.data.to_pylist()]
            assert got.tolist() == [model.get(r, 0) for r in rows]
            assert groupedbatch.COPIES["reads"] == before
        assert any(store.grouped_of(b) is not None for b in t._levels())


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids = c.input("bids", pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()),
                                      ("note", pa.string())]))
    auctions = c.input("auctions", pa.schema([("id", pa.int64()), ("cat", pa.int64())]))
    c.output("d", bids.select(auction=pa.compute.field("auction"), bidder=pa.compute.field("bidder")).distinct())
    c.output("g", bids.group_by("auction").agg(n=dbsp.count(), s=dbsp.sum("price"), hi=dbsp.max("price")))
    c.output("j", bids.join(auctions, left_on="auction", right_on="id").group_by("cat").agg(n=dbsp.count()))
    return c


def _pushes(rng: np.random.Generator, steps: int) -> list[tuple[pa.Table, pa.Table]]:
    out = []
    for i in range(steps):
        n = 200
        out.append((pa.table({"auction": rng.integers(0, 80, n), "bidder": rng.integers(0, 30, n),
                              "price": rng.integers(0, 1000, n), "note": [f"n{x}" for x in rng.integers(0, 9, n)]}),
                    pa.table({"id": np.arange(i * 10, i * 10 + 10), "cat": np.arange(i * 10, i * 10 + 10) % 4})))
    return out


def _integral(acc: dict, out: dict) -> None:
    for name, z in out.items():
        acc.setdefault(name, Counter()).update(z.to_dict())


@pytest.mark.parametrize("grouped_from", [1, 16 << 10])
def test_a_pipeline_checkpoints_and_reopens_format_2_state(tmp_path, monkeypatch, grouped_from: int) -> None:
    """Join, distinct and group-by under a 1-byte budget with format-2 files (every file, or only the bigger ones
    beside format 1's): outputs equal the same steps in memory; a checkpoint names the files, a reopened pipeline
    reads them (their rows not read on opening) and continues; ``dbsp inspect`` checks them."""
    from dbsp_core import envvars

    monkeypatch.setattr(BatchStore, "GROUPED_FROM", grouped_from)
    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))  # (the reference's)
    rng = np.random.default_rng(SEED)
    pushes = _pushes(rng, 10)
    d = str(tmp_path / "p")
    ref = dbsp.Pipeline(_circuit())
    want: dict = {}
    got: dict = {}
    with dbsp.Pipeline(_circuit(), storage=d, memory_limit=1, checkpoint_interval=None) as p:
        for b, a in pushes[:6]:
            for q in (p, ref):
                q.push("bids", b)
                q.push("auctions", a)
            _integral(got, p.step())
            _integral(want, ref.step())
        store = p.executor.batch_store
        assert store.stats.get("grouped_files_written", 0) > 0, store.stats
        p.checkpoint()
    names = [n for n in os.listdir(os.path.join(d, SPILL_DIR)) if n.endswith(".batch")]
    versions = Counter(file_version(os.path.join(d, SPILL_DIR, n)) for n in names)
    assert versions[BATCH_FILE_GROUPED_VERSION] > 0, versions
    if grouped_from > 1:
        assert versions[1] > 0, versions  # the small ones stay format 1: a store holds both
    bf = inspect_storage(d)["batch_files"]
    assert bf["files"] and not bf["bad"] and all(f["check"] == "ok" for f in bf["files"]), bf
    copies = groupedbatch.COPIES["reads"]
    with dbsp.Pipeline.open(d, _circuit(), memory_limit=1, checkpoint_interval=None) as q:
        store = q.executor.batch_store
        assert store._grouped, "the reopened state reads no format-2 file"
        assert groupedbatch.COPIES["reads"] == copies, "opening read a format-2 file's rows"
        m = q.metrics()  # sizes every batch (metrics.state_bytes): a grouped one's without reading its rows
        assert sum(w["total"] for w in m["state_bytes"].values()) > 0, m["state_bytes"]
        assert groupedbatch.COPIES["reads"] == copies, "the metrics read a format-2 file's rows"
        for b, a in pushes[6:]:
            for x in (q, ref):
                x.push("bids", b)
                x.push("auctions", a)
            _integral(got, q.step())
            _integral(want, ref.step())
    ref.close()
    assert {k: +v for k, v in got.items()} == {k: +v for k, v in want.items()}


def test_a_store_with_format_1_files_reads_them_after_the_switch(tmp_path, monkeypatch) -> None:
    """A state written with format 1 only (the switch off) is reopened with the switch on: it reads its format-1 files,
    writes new ones in format 2, and both checkpoint and reopen again (old data readable)."""
    from dbsp_core import envvars

    monkeypatch.setattr(envvars, "_current", envvars.settings()._replace(memory_limit=None))
    rng = np.random.default_rng(SEED + 2)
    pushes = _pushes(rng, 9)
    d = str(tmp_path / "p")
    ref = dbsp.Pipeline(_circuit())
    want: dict = {}
    got: dict = {}
    for i, (grouped, part) in enumerate(((None, pushes[:3]), (1, pushes[3:6]), (None, pushes[6:]))):
        monkeypatch.setattr(BatchStore, "GROUPED_FROM", grouped)
        opener = (lambda: dbsp.Pipeline(_circuit(), storage=d, memory_limit=1, checkpoint_interval=None)) if i == 0 \
            else (lambda: dbsp.Pipeline.open(d, _circuit(), memory_limit=1, checkpoint_interval=None))
        with opener() as p:
            if i == 1:
                assert p.executor.batch_store._files, "the reopened state reads its format-1 files"
            for b, a in part:
                for x in (p, ref):
                    x.push("bids", b)
                    x.push("auctions", a)
                _integral(got, p.step())
                _integral(want, ref.step())
            if i == 1:
                assert p.executor.batch_store._grouped, "new files in format 2 beside them"
    ref.close()
    assert {k: +v for k, v in got.items()} == {k: +v for k, v in want.items()}


def _keep_limit() -> int:
    """The decoder's keep limit now (read by setting it and setting it back)."""
    now = _storage.grouped_keep_limit(0)
    _storage.grouped_keep_limit(now)
    return now


def test_the_decoders_read_buffer_is_bounded_by_the_budget() -> None:
    """csrc/groupdecode.c keeps a thread's read buffer up to a limit (32 MiB at most): while a store is open, at most
    the budget's SCRATCH_SHARE (spill.py invariant 18), and a bigger store does not raise it; closed, it goes up."""
    gc.collect()  # (stores other tests dropped give their shares back)
    share = int((64 << 20) * BatchStore.SCRATCH_SHARE)
    with BatchStore(64 << 20):
        inside = _keep_limit()
        assert inside <= share
        with BatchStore(1 << 40):
            assert _keep_limit() == inside
        assert _keep_limit() == inside
    assert share < _keep_limit() <= 32 << 20 or _keep_limit() == inside
    with pytest.raises(ValueError):
        _storage.grouped_keep_limit(-1)


def _vma_rss(path: str) -> int:
    """Bytes of ``path``'s pages mapped in this process (the Rss of its mappings in /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                inside = len(head) >= 6 and head[5] == path
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) << 10
    return total


def test_a_format_2_files_mapped_units_count_in_the_budget_and_the_enforce_drops_them(monkeypatch) -> None:
    """Mapped lookups of a format-2 file (groupedfile.py invariant G5) through the store: the 2 MiB units they read
    count in ``mapped_bytes`` at the next enforce (spill.py invariants 12 and 18), the file's pages the process maps
    stay within them, and an enforce whose cap they pass drops the mapping whole (``mapped_drops``): none of its pages
    mapped after it, and the file's lookups read by pread (nothing mapped) for ``MAP_BACKOFF`` enforces, then map
    again, but when its reads found ``MAP_GROUPS_PER_UNIT`` groups a unit or more. A cold lookup (prefetch on) reads by pread and maps nothing."""
    monkeypatch.setattr(BatchStore, "GROUPED_FROM", 1)
    monkeypatch.setattr(BatchStore, "ASYNC_BYTES", 1 << 40)
    monkeypatch.setattr(BatchStore, "PREFETCH", "off")
    monkeypatch.setattr(groupedfile, "READ_MAPPED", True)  # (whatever DBSP_SPILL_GROUPED_MAP says)
    rng = np.random.default_rng(SEED)
    n = 400_000
    t = Trace(SCHEMA, ("k",))
    z = ZSet.from_arrow(pa.table({"k": rng.integers(0, n, n), "s": pa.array(["x" * 20] * n, pa.string()),
                                  "v": rng.integers(0, 5, n)}, schema=SCHEMA))
    with BatchStore(1) as store, spilling(store):
        cap = [1 << 40]
        monkeypatch.setattr(store, "cache_cap", lambda: cap[0])
        t.insert(z.consolidate().index_by(["k"]))
        store.enforce()
        (b,) = [b for b in t._levels() if store.grouped_of(b) is not None]
        f = store.grouped_of(b)
        assert f.map is None and f.size > 8 << 20
        keys = np.unique(np.asarray(b.key_hash))
        for _ in range(3):
            probe = np.sort(rng.choice(keys, 40, replace=False))
            assert sum(len(x) for x in t.lookup(probe)) >= 40
        assert f.map is not None and f.units.any()
        flagged = int(np.count_nonzero(f.units))
        store.enforce()
        assert store.mapped_bytes(t) == flagged * MAP_UNIT and store.mapped_bytes() >= flagged * MAP_UNIT
        assert 0 < _vma_rss(f.path) <= store.mapped_bytes(t)  # (2 MiB folios: a unit's pages at most)
        drops = store.stats["mapped_drops"]
        cap[0] = MAP_UNIT  # fewer than the units mapped: the next enforce drops the mapping
        t.lookup(np.sort(rng.choice(keys, 10, replace=False)))
        store.enforce()
        assert store.stats["mapped_drops"] > drops and store.mapped_bytes(t) == 0
        assert _vma_rss(f.path) == 0
        # backed off (invariant 18): by pread for MAP_BACKOFF enforces, nothing mapped, then mapped again
        assert not f.read_mapped and store.stats["grouped_map_backoffs"] >= 1
        cap[0] = 1 << 40
        for _ in range(store.MAP_BACKOFF - 1):
            t.lookup(np.sort(rng.choice(keys, 40, replace=False)))
            assert not f.units.any() and _vma_rss(f.path) == 0
            store.enforce()
        assert not f.read_mapped
        store.enforce()
        assert f.read_mapped
        t.lookup(np.sort(rng.choice(keys, 40, replace=False)))
        assert f.units.any() and _vma_rss(f.path) > 0
        store.enforce()
        # reads that found MAP_GROUPS_PER_UNIT groups a unit or more: dropped, but no back-off
        monkeypatch.setattr(store, "MAP_GROUPS_PER_UNIT", 0)
        cap[0] = MAP_UNIT
        backoffs = store.stats["grouped_map_backoffs"]
        t.lookup(np.sort(rng.choice(keys, 40, replace=False)))
        store.enforce()
        assert _vma_rss(f.path) == 0 and f.read_mapped and store.stats["grouped_map_backoffs"] == backoffs
        monkeypatch.setattr(store, "prefetching", lambda: True)  # a cold file's lookups: by pread, nothing flagged
        f.take_units()
        t.lookup(np.sort(rng.choice(keys, 40, replace=False)))
        assert not f.units.any() and f.read_mapped


def test_a_warm_format_2_step_with_a_few_pages_from_the_disk_does_not_prefetch_the_next(monkeypatch) -> None:
    """The prefetch rule's share (spill.py invariants 12 and 18, ``BatchStore.prefetching``) applies to format-2
    lookups too: each counts the pages of the groups it read as pages its reads missed in the cache, so a warm step
    whose few pages the host took back (a tenth of the pages it read came from the disk) does not make the next step's
    lookups cold (fadvise and pread instead of the mapping), and a step whose pages all came from the disk does. It
    used to count none (zero misses: any 16 pages from the disk turned the next lookups cold, which every 100M-row
    step then was, bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-f2100). The step's measured reads are set by hand (``_from_disk``: what
    getrusage would have said); the pages are the step's own. Outputs as the dict model's."""
    from tests.core.test_spill import _join_over_a_spilled_side

    monkeypatch.setattr(BatchStore, "GROUPED_FROM", 1)
    monkeypatch.setattr(BatchStore, "PREFETCH", "auto")
    monkeypatch.setattr(BatchStore, "PREFETCH_FROM", 16)
    rng = np.random.default_rng(SEED)
    n = 300_000
    ys = rng.integers(0, 1000, n)
    p, store = _join_over_a_spilled_side(ys)
    try:
        assert store.stats.get("grouped_files_written", 0) > 0, "the right side is not in format 2"
        want = None
        for s, cold in enumerate([True, True, False, False, True]):  # cold: all of the step's pages from the disk
            keys = rng.choice(n, 300, replace=False)
            x = rng.integers(0, 100, len(keys))
            before = store.stats.get("grouped_prefetched", 0)
            lookups = store.stats.get("grouped_lookups", 0)
            p.push("l", pa.table({"a": keys, "x": x}))
            out = p.step()
            assert Counter(out["v"].to_dict()) == Counter({(int(a), int(b), int(a), int(ys[a])): 1
                                                           for a, b in zip(keys, x)}), (s, SEED)
            assert store.stats["grouped_lookups"] > lookups, (s, SEED)
            if want is not None:  # what the step before it measured decides
                assert (store.stats.get("grouped_prefetched", 0) > before) == want, (s, SEED)
            pages = store._step_misses
            assert pages >= 200, (pages, SEED)  # the groups of ~300 present keys (some share one)
            store._from_disk = pages if cold else pages // 10  # over PREFETCH_FROM, under 1/8 of the pages read
            want = cold
    finally:
        p.close()
