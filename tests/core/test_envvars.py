"""Settings from the environment (dbsp_core/envvars.py): a value that does not parse is refused with the variable's
name when dbsp_core is imported, never read as 0 by the C core or met half way through a recovery."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dbsp_core.envvars import check_native, env_number, parse_number

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_numbers_parse_and_bad_ones_name_the_variable():
    assert parse_number("0", "X") == 0.0 and parse_number("2.5", "X", positive=True) == 2.5
    assert parse_number(" 12 ", "X", integer=True) == 12
    for text, kw in (("", {}), ("abc", {}), ("-1", {}), ("nan", {}), ("inf", {}), ("0", {"positive": True}),
                     ("1.5", {"integer": True}), ("1e3", {"integer": True})):
        with pytest.raises(ValueError, match="^DBSP_X must be"):
            parse_number(text, "DBSP_X", **kw)
    assert env_number("DBSP_X", environ={}) is None and env_number("DBSP_X", environ={"DBSP_X": "  "}) is None
    assert env_number("DBSP_X", environ={"DBSP_X": "3"}, integer=True) == 3


def test_the_native_settings_are_checked():
    check_native({"DBSP_SCRATCH_MB": "0", "DBSP_REGION_CACHE_MB": "256"})
    for name in ("DBSP_SCRATCH_MB", "DBSP_REGION_CACHE_MB"):
        with pytest.raises(ValueError, match=name):
            check_native({name: "-5"})  # strtoull would have read it as 2**64 - 5 MiB: no limit at all


@pytest.mark.parametrize("name,value", [("DBSP_SCRATCH_MB", "lots"), ("DBSP_PROGRESS_DELAY", "soon"),
                                        ("DBSP_KEY_INDEX_MB", "0"), ("DBSP_KEY_INDEX_TOTAL_MB", "-1"),
                                        ("DBSP_PAGE_CACHE_MB", "0")])
def test_importing_with_a_bad_setting_fails_at_once_with_its_name(name, value):
    env = dict(os.environ, PYTHONPATH=ROOT, **{name: value})
    r = subprocess.run([sys.executable, "-c", "import dbsp_core"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert f"ValueError: {name} must be" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
