"""The DBSP_MEMORY_LIMIT setting as CI runs the suites with it (.ci/run): a kill-test child started the way the kill tests start theirs inherits it and spills an embedded pipeline's traces, and a staged pipeline's tasks take no budget from it (the README: embedded only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# in the child: an embedded and a staged pipeline made without memory_limit, what budget each holds, and whether
# the embedded one wrote batch files
CHILD = """
import json, sys, tempfile
import pyarrow as pa
import dbsp_core as dbsp
from dbsp_core.runtime import StagedExecutor
c = dbsp.Circuit()
c.output("o", c.input("t", pa.schema([("k", pa.int64())])).distinct())
p = dbsp.Pipeline(c, storage=tempfile.mkdtemp())
p.push("t", pa.table({"k": list(range(100))}))
p.step()
store = p.executor.batch_store
out = {"embedded": None if store is None else store.memory_limit,
       "files": 0 if store is None else store.stats["files_written"]}
p.close()
with dbsp.Pipeline(c, storage=tempfile.mkdtemp(), executor=StagedExecutor()) as q:
    out["staged"] = q.executor.memory_limit
print(json.dumps(out))
"""


@pytest.mark.parametrize("how", ["run_child", "test_kill9._env"])
@pytest.mark.parametrize("setting", ["1", None])
def test_kill_children_inherit_the_budget_setting_embedded_only(monkeypatch, how, setting) -> None:
    from rescale_workload import run_child
    from test_kill9 import _env

    if setting is None:
        monkeypatch.delenv("DBSP_MEMORY_LIMIT", raising=False)
    else:
        monkeypatch.setenv("DBSP_MEMORY_LIMIT", setting)
    if how == "run_child":
        _, got = run_child(["-c", CHILD], None, None, 120, "a budget-setting child")
    else:
        r = subprocess.run([sys.executable, "-c", CHILD], env=_env({}), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
    if setting is None:
        assert got == {"embedded": None, "files": 0, "staged": None}
    else:
        assert got["embedded"] == 1 and got["files"] > 0, got  # every trace spilled
        assert got["staged"] is None, got  # the setting is the embedded executor's only
