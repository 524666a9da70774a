"""The reclaim of deleted batch files in pieces (trace/spill.py invariant 12, ``BatchStore._reclaim_files``) truncates a
file only once no mapping of it is alive (batchfile.py ``mapped``): a truncated file under a live mapping is a bus
error when the mapping is read. Each case runs in a subprocess, so that a SIGBUS fails the test instead of killing
pytest: the child keeps an array of a mapping the store's batch does not read (a second ``open_batch`` of the file, as
a checkpoint's restore or a shard move opens one; the scratch mapping a merge built its output in, which becomes the
batch file in place), deletes the file through its batch's death, runs enough enforces to reclaim it whole, and reads
the array."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dbsp_core.trace.spill import BatchStore

# a test of format 1's mapped files and pages, skipped when spilled files are format 2 (trace/spill.py invariant 18)
FORMAT_1 = pytest.mark.skipif(BatchStore.GROUPED_FROM is not None, reason="format 1's mapped files")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PRELUDE = """
import gc, os, sys
import numpy as np
import pyarrow as pa
from dbsp_core import ZSet
from dbsp_core.trace import Trace
from dbsp_core.trace.batchfile import open_batch
from dbsp_core.trace.spill import BatchStore, spilling

BatchStore.RECLAIM_FILES = 256
BatchStore.RECLAIM_CHECK = sys.argv[1]
rng = np.random.default_rng(7)
KV = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def batch(n):
    z = ZSet.from_arrow(pa.table({"k": rng.integers(0, 1 << 40, n), "v": rng.integers(0, 3, n)}))
    return z.consolidate().index_by(["k"])


def reclaim(store, box, want):
    # enforces while box's array (over a mapping of the deleted file) lives: it reads the file's rows, and the file
    # is whole; then, the array gone, enforces until the file is given back
    assert len(store._reclaim) == 1, "the file was not deleted"
    fd = store._reclaim[0].fd
    size = os.fstat(fd).st_size
    for _ in range(50):
        store.enforce()
    assert box[0].to_pylist() == want  # a SIGBUS here if the file was truncated under the mapping
    assert os.fstat(fd).st_size == size, "truncated under a live mapping"
    box.clear()
    gc.collect()
    for _ in range(1000):
        store.enforce()
        if not store._reclaim:
            break
    assert not store._reclaim and store.stats.get("bytes_reclaimed", 0) >= size, store.stats
    print("ok", store.stats.get("reclaim_untracked", 0))
"""

_SECOND_OPEN = """
t = Trace(KV, ("k",))
with BatchStore(1) as store, spilling(store):
    t.insert(batch(200_000))
    store.enforce()
    store.settle()
    (b,) = [e[1] for level in t._by_level for e in level.loose]
    f = store.file_of(b)
    assert f is not None
    other = open_batch(f.path)  # a second mapping of the file, as a restore or a shard move opens one
    kept = other.batch.zset.data.column("v")  # an Arrow array over it
    want = kept.to_pylist()
    del other, f, b, t
    gc.collect()
    box = [kept]
    del kept
    reclaim(store, box, want)
"""

_SCRATCH = """
from dbsp_core.zset import merge_cursor, merged
with BatchStore(1) as store, spilling(store):
    a, b = batch(100_000), batch(100_000)
    c = merge_cursor(a, b, row_hashes=True, spill_dir=store.directory, prefix=store.merge_room(a))
    while not c.done:
        c.step(1 << 20)
    out = merged(a, c)
    kept = out.zset.data.column("v")  # over the merge's scratch mapping (a view taken before the output's spill)
    want = kept.to_pylist()
    store.spill_output(out, c)  # the scratch file becomes the batch file in place; ``out`` reads a new mapping of it
    assert store.stats["written_in_place"] == 1, store.stats
    del out, c, a, b
    gc.collect()
    box = [kept]
    del kept
    reclaim(store, box, want)
"""


def _run(body: str, check: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DBSP_MEMORY_LIMIT", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_PRELUDE) + textwrap.dedent(body), check],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@FORMAT_1
@pytest.mark.parametrize("case", ["second_open", "scratch"])
def test_a_mapping_the_batch_does_not_read_keeps_its_file_from_truncation(case: str) -> None:
    """A mapping of a deleted batch file other than its batch's (a second ``open_batch``; the merge's scratch mapping
    of a file made in place) is alive: the reclaim gives the file back only once it is gone, and the array over it
    reads its rows. ``RECLAIM_CHECK`` "off": the registry of mappings alone decides (the kernel's list of mappings is
    not asked). Watched fail with the reclaim keeping a weak reference to the batch's current mapping only (as
    r31-slicewrite did): the child died of SIGBUS (returncode -7) in both cases."""
    r = _run(_SECOND_OPEN if case == "second_open" else _SCRATCH, "off")
    assert r.returncode == 0 and r.stdout.split() == ["ok", "0"], (r.returncode, r.stdout, r.stderr[-3000:])


@FORMAT_1
def test_the_kernel_check_finds_a_mapping_the_registry_missed(monkeypatch) -> None:
    """With the registry blind (``batchfile.mapped`` always False), ``RECLAIM_CHECK`` "kernel" (the default) still keeps
    the file whole while /proc/self/maps lists a mapping of it, counting it in ``reclaim_untracked``; "strict" raises."""
    blind = """
import dbsp_core.trace.batchfile as bf
bf.mapped = lambda key: False
""" + textwrap.dedent(_SECOND_OPEN)
    r = _run(blind, "kernel")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    ok, untracked = r.stdout.split()
    assert ok == "ok" and int(untracked) >= 1, r.stdout
    r = _run(blind, "strict")
    assert r.returncode == 1 and "reclaim" in r.stderr and "mapped" in r.stderr, (r.returncode, r.stderr[-3000:])


def test_a_file_linked_under_another_name_is_not_truncated(tmp_path) -> None:
    """A deleted batch file whose inode another name still links (a saved copy made with ``cp -al`` or os.link, as
    bench/spill_state.py's copies of a saved state are) is not truncated by the reclaim: it is not given back when
    its name goes, and the other name keeps its bytes. Watched fail with ``_delete`` not asking for the inode's
    links: the linked file was truncated to 0 bytes."""
    import zlib

    import numpy as np
    import pyarrow as pa

    from dbsp_core import ZSet
    from dbsp_core.trace import Trace
    from dbsp_core.trace.spill import spilling

    rng = np.random.default_rng(7)
    kv = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    t = Trace(kv, ("k",))
    with BatchStore(1) as store, spilling(store):
        t.insert(ZSet.from_arrow(pa.table({"k": rng.integers(0, 1 << 40, 200_000), "v": rng.integers(0, 3, 200_000)},
                                          schema=kv)).consolidate().index_by(["k"]))
        store.enforce()
        store.settle()
        files = [f.path for f in list(store._files.values()) + list(store._grouped.values())]
        assert files, "nothing spilled"
        saved = []
        for i, path in enumerate(files):
            link = str(tmp_path / f"saved-{i}.batch")
            os.link(path, link)
            with open(link, "rb") as f:
                saved.append((link, zlib.crc32(f.read()), os.path.getsize(link)))
        t.clear()
        for _ in range(1000):
            store.enforce()
            if not store._reclaim:
                break
        assert not any(os.path.exists(p) for p in files), "the store's names were not deleted"
    for link, crc, size in saved:
        with open(link, "rb") as f:
            assert (zlib.crc32(f.read()), os.path.getsize(link)) == (crc, size), f"{link} changed"
