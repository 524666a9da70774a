"""dbsp_core/arrow_pool.py: with DBSP_JEMALLOC=1 the first Pipeline of a process makes jemalloc Arrow's default pool
(invariant 1), unless ARROW_DEFAULT_MEMORY_POOL chooses; unset, the pool stays Arrow's; each case in a fresh process
(the choice is once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import pyarrow as pa
before = pa.default_memory_pool().backend_name
import dbsp_core as dbsp
c = dbsp.Circuit()
c.output("a", c.input("a", pa.schema([("x", pa.int64())])))
p = dbsp.Pipeline(c, workers=2)
kept = pa.array(list(range(1000)))  # allocated from the pool in force before the step
p.push("a", pa.table({"x": kept}))
assert p.step()["a"].to_dict() == {(i,): 1 for i in range(1000)}
p.close()
print(before, pa.default_memory_pool().backend_name)
"""


def _pools(**env: str) -> list[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("DBSP_JEMALLOC", "ARROW_DEFAULT_MEMORY_POOL")}
    e.update(env, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def _has_jemalloc() -> bool:
    try:
        pa.jemalloc_memory_pool()
        return True
    except NotImplementedError:
        return False


@pytest.mark.skipif(not _has_jemalloc(), reason="this pyarrow has no jemalloc")
def test_a_pipeline_makes_jemalloc_the_default_pool():
    before, after = _pools(DBSP_JEMALLOC="1")
    assert after == "jemalloc", (before, after)


def test_the_setting_and_arrows_own_choice_keep_the_pool():
    for env in ({}, {"DBSP_JEMALLOC": "0"}):
        before, after = _pools(**env)
        assert after == before, env
    assert _pools(DBSP_JEMALLOC="1", ARROW_DEFAULT_MEMORY_POOL="system") == ["system", "system"]
