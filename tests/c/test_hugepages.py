"""DBSP_HUGEPAGES (csrc/scratch.c design note 2) takes effect: a merge's result region of 2 MiB and more, and the
key index's large anonymous regions (its slot table and entries after a bulk add, csrc/keyindex.c), carry the kernel's
huge-page advice (the ``hg`` flag of their mappings in /proc/self/smaps) by default and with ``1``, never with ``0``;
the merge's rows and the index's sums are the same either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import json
import numpy as np, pyarrow as pa
from dbsp_core import _zset
from dbsp_core.zset import ZSet
n = 300_000  # 2.4 MB per int64 column: a mapped region past 2 MiB
a = ZSet.from_arrow(pa.table({"k": np.arange(0, 2 * n, 2), "v": np.arange(n)})).index_by(["k"])
b = ZSet.from_arrow(pa.table({"k": np.arange(1, 2 * n, 2), "v": np.arange(n, 2 * n)})).index_by(["k"])
m = a.merge(b)
buf = m.zset.data.column("v").chunk(0).buffers()[1]
t = pa.table({"k": np.arange(n, dtype=np.int64)})
kh = _zset.hash_columns(t, [0])
ix = _zset.KeyIndex([pa.int64()], 1)
ix.add(t, None, [0], kh, [-1])  # a bulk add: a slot table of 4 MiB and entries of 4.8 MB, advised at once
acc = np.zeros((n, 1), dtype=np.int64)
ix.get(t, [0], kh, acc)


def flags_at(address):
    flags = None
    for line in open("/proc/self/smaps"):
        f = line.split()
        if not f[0].endswith(":"):
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            inside = lo <= address < hi
        elif inside and f[0] == "VmFlags:":
            flags = f[1:]
    return flags


k = m.zset.data.column("k").to_numpy()
order = np.argsort(k, kind="stable")
want = np.arange(2 * n)
ok = (np.array_equal(k[order], want) and np.array_equal(m.zset.data.column("v").to_numpy()[order],
                                                          want // 2 + np.where(want % 2 == 1, n, 0))
      and bool((np.asarray(m.zset.weights) == 1).all()) and bool((acc == 1).all()))
print(json.dumps({"on": _zset.hugepages(), "flags": flags_at(buf.address), "rows_ok": ok,
                  "index": [flags_at(at) for at, size in ix.regions if size >= 2 << 20]}))
"""


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages")
@pytest.mark.parametrize("value, advised", [(None, True), ("1", True), ("0", False), (" 0 ", False), ("", True)])
def test_the_setting_decides_the_advice(value: str | None, advised: bool) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DBSP_HUGEPAGES", None)
    if value is not None:
        env["DBSP_HUGEPAGES"] = value
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rows_ok"]
    assert got["flags"] is not None, "the result buffer is in no mapping of smaps"
    assert got["on"] is advised
    assert ("hg" in got["flags"]) is advised, got["flags"]
    assert len(got["index"]) == 2 and None not in got["index"], got["index"]  # the slot table and the entries
    assert all(("hg" in f) is advised for f in got["index"]), got["index"]
