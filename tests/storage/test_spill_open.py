"""Opening a spilled state reads metadata, not rows: the batch files a checkpoint names are opened lazily and their pages checked as steps read them (trace/spill.py invariant 14, batchfile.py invariant 5), results checked against a dict model; a damaged byte fails the step that reads it, never returns wrong rows."""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.errors import CorruptionError
from dbsp_core.storage.formats import SPILL_DIR
from dbsp_core.trace.batchfile import PAGE, open_batch
from dbsp_core.trace.spill import BatchStore
from storage_helpers import view_integral as _view

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")


SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
KEYS = 40000


def test_seed_is_printed() -> None:
    print(f"DBSP_TEST_SEED={SEED}")


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k").agg(n=dbsp.count(), lo=dbsp.min("v")))  # min: reads its trace by Trace.lookup
    return c


def _model(rows: list[tuple[int, int, int]]) -> dict:
    """{(k, n, lo): 1} of the multiset ``rows`` of (k, v, weight)."""
    acc: dict[tuple[int, int], int] = {}
    for k, v, w in rows:
        acc[(k, v)] = acc.get((k, v), 0) + w
    groups: dict[int, list[int]] = {}
    for (k, v), w in acc.items():
        assert w >= 0
        groups.setdefault(k, []).extend([v] * w)
    return {(k, len(vs), min(vs)): 1 for k, vs in groups.items() if vs}


def _build(root: str, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """A durable pipeline whose group-by state (80k rows, ~34k groups) lives in batch files a checkpoint names
    (settle_merges compacts each trace's into one: trace invariant 15; so many rows and groups that a file's pages
    are many more than opening and a small step check)."""
    rows: list[tuple[int, int, int]] = []
    p = dbsp.Pipeline(_circuit(), storage=root, memory_limit="64KiB")
    for _ in range(4):
        t = pa.table({"k": rng.integers(0, KEYS, 20000), "v": rng.integers(0, 10**6, 20000)}, schema=SCHEMA)
        p.push("t", t)
        p.step()
        rows += [(k, v, 1) for k, v in zip(t.column("k").to_pylist(), t.column("v").to_pylist())]
    p.executor.settle_merges()
    p.push("t", pa.table({"k": [0], "v": [5]}, schema=SCHEMA))
    p.step()
    rows.append((0, 5, 1))
    assert p.executor.batch_store.stats["files_written"] > 0
    p.close()
    return rows


@FORMAT_1
def test_open_is_lazy_and_a_small_step_checks_few_pages() -> None:
    rng = np.random.default_rng(SEED)
    root = tempfile.mkdtemp()
    try:
        rows = _build(root, rng)
        p = dbsp.Pipeline.open(root, _circuit(), memory_limit="64KiB")
        store = p.executor.batch_store
        files = {id(f): f for f in store._unchecked.values()}
        assert files, "the opened checkpoint's batch files were checked whole at open"
        total = sum(len(f.checked) - 1 for f in files.values())
        assert total >= 4, total  # several pages: a lookup can read fewer than all
        assert store.stats["pages_checked"] == 0
        assert all(not f.checked[-1] for f in files.values())  # fence and filter not read at open
        keys = rng.choice(KEYS, 3, replace=False)
        t = pa.table({"k": keys, "v": rng.integers(0, 10**6, 3)}, schema=SCHEMA)
        p.push("t", t)
        p.step()
        rows += [(k, v, 1) for k, v in zip(t.column("k").to_pylist(), t.column("v").to_pylist())]
        checked = store.stats["pages_checked"]
        assert 0 < checked < total, (checked, total)  # the pages the lookup read, not the files
        assert _view(p) == _model(rows)
        p.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _semi() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t, u = c.input("t", SCHEMA), c.input("u", SCHEMA)
    c.output("s", t.semi_join(u, on="k"))  # a change of t reads u's trace by Trace.lookup
    return c


@FORMAT_1
@pytest.mark.parametrize("where", ["row", "filter"])
def test_a_damaged_byte_fails_the_step_that_reads_it(where: str) -> None:
    """One key of t changes; the byte damaged is the weight of that key's row in u's spilled trace ("row") or a
    word of the batch's Bloom filter ("filter"): the step fails naming the file, where unchecked reads would use
    the damaged byte."""
    rng = np.random.default_rng(SEED)
    root = tempfile.mkdtemp()
    try:
        p = dbsp.Pipeline(_semi(), storage=root, memory_limit="64KiB")
        for _ in range(4):  # (files of 40k rows, whose middle rows sit on pages opening does not check, even when
            # the four stay unmerged: a tiered level, trace invariant 15)
            p.push("u", pa.table({"k": rng.integers(0, 10**6, 40000), "v": rng.integers(0, 10**6, 40000)},
                                 schema=SCHEMA))
            p.step()
        p.executor.settle_merges()
        p.push("t", pa.table({"k": [-1], "v": [0]}, schema=SCHEMA))
        p.step()
        p.close()
        d = os.path.join(root, SPILL_DIR)
        files = [open_batch(os.path.join(d, n)) for n in sorted(os.listdir(d))]
        f = max(files, key=lambda f: f.rows)
        path = f.path
        del files
        r = len(f.batch) // 2
        key = int(f.batch.zset.data.column("k")[r].as_py())
        off = (f.batch.zset.weights.ctypes.data - f.base + 8 * r) if where == "row" else (f.sections[0] + 8 * 64)
        del f
        with open(path, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0x10]))
        p = dbsp.Pipeline.open(root, _semi(), memory_limit="64KiB")  # metadata only: opens
        p.push("t", pa.table({"k": [key], "v": [7]}, schema=SCHEMA))
        with pytest.raises(CorruptionError, match="dbsp repair") as err:
            p.step()
        assert os.path.basename(path) in str(err.value)
        p.close(checkpoint=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_page_of_rows_is_located() -> None:
    """check_rows locates the page of each asked row of each column: damage one row's page, and only a read of
    that row's page fails."""
    from dbsp_core import ZSet
    from dbsp_core.trace.batchfile import write_batch

    n = 40000
    rng = np.random.default_rng(SEED)
    z = ZSet.from_arrow(pa.table({"k": np.arange(n), "s": [f"x{i}" for i in rng.integers(0, 10**6, n)]}))
    b = z.index_by(["k"])
    b._row_hashes()
    path = os.path.join(tempfile.mkdtemp(), "a.batch")
    write_batch(path, b, sync=False)
    f = open_batch(path, lazy=True)
    assert f.unchecked()
    # damage the string bytes of the middle row: a read of rows 0..2 touches no page of them
    s = f.batch.zset.data.column("s").chunk(0)
    mid = n // 2
    at = s.buffers()[2].address - f.base + int(np.frombuffer(s.buffers()[1], dtype=np.int32)[mid])
    del s, f
    with open(path, "r+b") as fh:
        fh.seek(at)
        c = fh.read(1)
        fh.seek(at)
        fh.write(bytes([c[0] ^ 1]))
    f = open_batch(path, lazy=True)
    f.check_sections()
    f.check_rows(f.batch, np.array([0, 1, 2]))
    assert 0 < int(f.checked[:-1].sum()) < len(f.checked) - 1
    with pytest.raises(CorruptionError, match=f"page {(at - f.arrow_off) // PAGE} "):
        f.check_rows(f.batch, np.array([mid]))


def test_a_lookup_reads_only_pages_it_checked() -> None:
    """Check what seeking some keys and taking their rows reads, then overwrite every other Arrow page of the file with
    garbage: the same lookup on the garbled file still returns exactly the intact file's rows, so it read no page it
    had not checked (random keys, some absent)."""
    from dbsp_core import ZSet
    from dbsp_core.trace.batchfile import write_batch

    rng = np.random.default_rng(SEED)
    n = 200_000
    z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 50000, n), "v": rng.integers(0, 10**9, n),
                                  "s": [f"s{i}" for i in rng.integers(0, 10**6, n)]}))
    b = z.index_by(["k"])
    b._row_hashes()
    path = os.path.join(tempfile.mkdtemp(), "a.batch")
    write_batch(path, b, sync=False)
    probe = ZSet.from_arrow(pa.table({"k": rng.integers(0, 60000, 6), "v": np.zeros(6, dtype=np.int64),
                                      "s": ["x"] * 6})).index_by(["k"])
    hashes = np.unique(probe.key_hash)

    def lookup(f):
        f.check_seek(f.batch, hashes)
        asked = hashes[f.may_contain(hashes)]
        idx = f.batch.lookup(asked)
        f.check_rows(f.batch, idx)
        return f.batch.take(idx).zset.to_dict(), f.checked.copy()

    want, checked = lookup(open_batch(path, lazy=True))
    pages = np.flatnonzero(~checked[:-1])
    assert len(pages) > 0, "every page was checked: nothing to garble"
    f = open_batch(path)
    aoff, alen = f.arrow_off, f.arrow_len
    del f
    with open(path, "r+b") as fh:
        for i in pages:
            lo = aoff + int(i) * PAGE
            fh.seek(lo)
            fh.write(rng.integers(0, 256, min(PAGE, aoff + alen - lo), dtype=np.uint8).tobytes())
    g = open_batch(path, lazy=True)
    g.checked[:] = checked  # what the first lookup checked: the same lookup must read nothing else
    got, after = lookup(g)
    assert np.array_equal(after, checked)
    assert got == want and sum(want.values()) > 0
