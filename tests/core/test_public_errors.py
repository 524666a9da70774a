"""The public error classes: every class of dbsp_core/errors.py (and the SQL front end's SqlError) is exported from dbsp_core, and a second opener of a storage directory gets the documented InUseError, still a DbspError."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pyarrow as pa
import pytest

import dbsp_core as dbsp
import dbsp_core.errors as errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_error_class_is_exported() -> None:
    classes = {n: c for n, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__}
    assert len(classes) >= 12 and "InUseError" in classes and "DbspError" in classes
    for name, cls in classes.items():
        assert name in dbsp.__all__, name
        assert getattr(dbsp, name) is cls, name
    from dbsp_core.sql.errors import SqlError
    assert "SqlError" in dbsp.__all__ and dbsp.SqlError is SqlError


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64())]))
    c.output("d", t.distinct())
    return c


def test_a_second_opener_gets_in_use_error(tmp_path) -> None:
    """It got a bare DbspError("... LOCK is held"); InUseError is a DbspError, so code catching that still works."""
    p = dbsp.Pipeline(_circuit(), storage=tmp_path, checkpoint_interval=None)
    for attempt in (lambda: dbsp.Pipeline.open(tmp_path, _circuit()),
                    lambda: dbsp.Pipeline(_circuit(), storage=tmp_path)):
        with pytest.raises(errors.InUseError, match="is in use by another pipeline") as e:
            attempt()
        assert isinstance(e.value, errors.DbspError) and str(tmp_path) in str(e.value)
    code = ("import sys, dbsp_core as dbsp\nsys.path.insert(0, %r)\nfrom test_public_errors import _circuit\n"
            "try:\n    dbsp.Pipeline.open(%r, _circuit())\n"
            "except dbsp.errors.InUseError as e:\n    print('InUseError', e)\n"
            % (os.path.dirname(__file__), str(tmp_path)))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.startswith("InUseError"), out.stdout + out.stderr  # another process too
    p.push("t", pa.table({"k": [1]}))
    p.step()
    p.close()
    q = dbsp.Pipeline.open(tmp_path, _circuit())  # free again once the first is closed
    assert q.steps == 1
    q.close()
